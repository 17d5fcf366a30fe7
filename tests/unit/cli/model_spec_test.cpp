// SPDX-License-Identifier: Apache-2.0
// Model presets, Hugging Face config.json parsing and flag overrides.
#include "kvport/cli/model_spec.hpp"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <algorithm>

#include "kvport/platform/error.hpp"
#include "kvport/sim/model_presets.hpp"
#include "kvport/testing/support.hpp"

namespace kvport::cli {
namespace {

using kvport::testing::message_of;
using ::testing::HasSubstr;

TEST(cli_model_spec, PresetsAreSortedAndComplete) {
  const auto presets = sim::model_presets();
  EXPECT_TRUE(std::is_sorted(presets.begin(), presets.end(),
                             [](const auto& a, const auto& b) { return a.name < b.name; }));
  for (const char* name : {"llama-3-8b", "llama-3-70b", "qwen2.5-7b", "mistral-7b"}) {
    EXPECT_EQ(find_model_preset(name).name, name);
  }
  const ModelSpec llama70 = find_model_preset("llama-3-70b");
  EXPECT_EQ(llama70.num_layers, 80u);
  EXPECT_EQ(llama70.num_kv_heads, 8u);
  EXPECT_EQ(llama70.head_dim_k, 128u);
  EXPECT_EQ(llama70.head_dim_v, 128u);
  const ModelSpec qwen = find_model_preset("qwen2.5-7b");
  EXPECT_EQ(qwen.num_layers, 28u);
  EXPECT_EQ(qwen.num_kv_heads, 4u);
  EXPECT_THAT(message_of<InvalidArgument>([] { find_model_preset("llama-4"); }),
              HasSubstr("unknown model preset 'llama-4' (known: deepseek-v3, gemma-3-27b"));
}

TEST(cli_model_spec, HfConfigFields) {
  const HfConfigFields f = parse_hf_config(
      R"({"_name_or_path": "meta-llama/Meta-Llama-3-8B", "model_type": "llama",
          "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
          "hidden_size": 4096})",
      "x");
  EXPECT_EQ(f.name, "meta-llama/Meta-Llama-3-8B");
  EXPECT_EQ(f.num_layers, 32u);
  EXPECT_EQ(f.num_kv_heads, 8u);
  EXPECT_EQ(f.head_dim, 128u);
}

TEST(cli_model_spec, HfConfigExplicitHeadDimWins) {
  // Gemma-style: head_dim is not hidden_size / num_attention_heads.
  const HfConfigFields f = parse_hf_config(
      R"({"num_hidden_layers": 42, "num_attention_heads": 16, "num_key_value_heads": 8,
          "hidden_size": 3584, "head_dim": 256})",
      "x");
  EXPECT_EQ(f.head_dim, 256u);
}

TEST(cli_model_spec, HfConfigNullFieldsAreAbsent) {
  const HfConfigFields f = parse_hf_config(
      R"({"num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": null,
          "hidden_size": 4096, "head_dim": null})",
      "x");
  EXPECT_EQ(f.num_kv_heads, 32u);
  EXPECT_EQ(f.head_dim, 128u);
  EXPECT_EQ(f.name, "hf-config");
}

TEST(cli_model_spec, HfConfigTextConfigOfMultimodalModels) {
  const HfConfigFields f = parse_hf_config(
      R"({"model_type": "llava", "vision_config": {"num_hidden_layers": 24},
          "text_config": {"num_hidden_layers": 32, "num_attention_heads": 32,
                          "num_key_value_heads": 8, "hidden_size": 4096}})",
      "x");
  EXPECT_EQ(f.name, "llava");
  EXPECT_EQ(f.num_layers, 32u);
  EXPECT_EQ(f.num_kv_heads, 8u);
  EXPECT_EQ(f.head_dim, 128u);
}

// text_config shapes the cache whenever it holds a shaping field, even when
// the top level repeats one; a field only the top level holds is read too,
// and one both hold with different values is refused.
TEST(cli_model_spec, HfConfigTextConfigBesideTopLevelFields) {
  const HfConfigFields agree = parse_hf_config(
      R"({"model_type": "llava", "num_hidden_layers": 32, "head_dim": 64,
          "text_config": {"num_hidden_layers": 32, "num_attention_heads": 32,
                          "num_key_value_heads": 8, "hidden_size": 4096}})",
      "x");
  EXPECT_EQ(agree.num_layers, 32u);
  EXPECT_EQ(agree.num_kv_heads, 8u);  // text_config's, not the top level's (none)
  EXPECT_EQ(agree.head_dim, 64u);     // only at the top level: read from there
  EXPECT_EQ(agree.name, "llava");
  const HfConfigFields top = parse_hf_config(
      R"({"num_hidden_layers": 4, "num_attention_heads": 8, "hidden_size": 512,
          "text_config": {"model_type": "llama", "vocab_size": 100}})",
      "x");
  EXPECT_EQ(top.num_layers, 4u);  // text_config holds no shaping field: the top level
  EXPECT_EQ(top.head_dim, 64u);
  const HfConfigFields nulls = parse_hf_config(
      R"({"num_hidden_layers": null, "num_key_value_heads": 2,
          "text_config": {"num_hidden_layers": 6, "num_key_value_heads": null,
                          "num_attention_heads": 4, "hidden_size": 256}})",
      "x");
  EXPECT_EQ(nulls.num_layers, 6u);    // a null is absent: no disagreement
  EXPECT_EQ(nulls.num_kv_heads, 2u);  // text_config's null filled from the top level
  EXPECT_THAT(message_of<InvalidArgument>([] {
                parse_hf_config(
                    R"({"num_hidden_layers": 32, "num_key_value_heads": 4,
                        "text_config": {"num_hidden_layers": 32, "num_key_value_heads": 8,
                                        "num_attention_heads": 32, "hidden_size": 4096}})",
                    "cfg.json");
              }),
              HasSubstr("HF config 'cfg.json': 'num_key_value_heads' is 4 at the top level but 8 "
                        "in text_config"));
}

TEST(cli_model_spec, HfConfigErrorsNameTheSource) {
  EXPECT_THAT(message_of<InvalidArgument>([] { parse_hf_config("{", "cfg.json"); }),
              HasSubstr("HF config 'cfg.json': not valid JSON"));
  EXPECT_THAT(message_of<InvalidArgument>([] { parse_hf_config("42", "cfg.json"); }),
              HasSubstr("expected a JSON object, got number"));
  EXPECT_THAT(message_of<InvalidArgument>(
                  [] { parse_hf_config(R"({"num_hidden_layers": 1e3})", "cfg.json"); }),
              HasSubstr("'num_hidden_layers' must be a positive integer, got 1000.0"));
  const std::string long_value(200, 'x');
  const std::string message = message_of<InvalidArgument>(
      [&] { parse_hf_config(R"({"head_dim": ")" + long_value + R"("})", "cfg.json"); });
  EXPECT_LT(message.size(), 120u) << "the offending value is shortened";
}

TEST(cli_model_spec, ResolveAppliesOverridesInOrder) {
  ModelOverrides o;
  o.preset = "llama-3-8b";
  o.num_kv_heads = 2;
  o.head_dim_v = 64;
  const ModelSpec spec = resolve_model_spec(o);
  EXPECT_EQ(spec.source, "preset+flags");
  EXPECT_EQ(spec.num_layers, 32u);
  EXPECT_EQ(spec.num_kv_heads, 2u);
  EXPECT_EQ(spec.head_dim_k, 128u);
  EXPECT_EQ(spec.head_dim_v, 64u);
}

TEST(cli_model_spec, ResolveUsesTheDefaultPresetOnlyWithoutAModel) {
  ModelOverrides o;
  EXPECT_EQ(resolve_model_spec(o, "qwen2.5-7b").name, "qwen2.5-7b");
  o.num_layers = 3;
  const ModelSpec spec = resolve_model_spec(o, "qwen2.5-7b");
  EXPECT_EQ(spec.num_layers, 3u);
  EXPECT_EQ(spec.num_kv_heads, 4u);
  EXPECT_THAT(message_of<InvalidArgument>([] { resolve_model_spec(ModelOverrides{}); }),
              HasSubstr("no model given"));
}

}  // namespace
}  // namespace kvport::cli
