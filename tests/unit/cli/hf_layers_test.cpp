// SPDX-License-Identifier: Apache-2.0
// The per-layer KV specs of Hugging Face configs (hf_layers.hpp): the
// fixtures of tests/data/hf_configs and the presets that must agree with them,
// the other architectures and defaults, and the configs that must be refused
// with one error line naming the field.
#include <cstddef>
#include <fstream>
#include <string>
#include <utility>
#include <vector>

#include "cli_test_util.hpp"
#include "kvport/cli/model_spec.hpp"

namespace kvport::cli::testing {
namespace {

using ::testing::HasSubstr;

constexpr std::size_t kBlock = 16;  // tokens per block (the default)

std::string fixture(std::string_view model) {
  return std::string(KVPORT_TEST_DATA_DIR) + "/hf_configs/" + std::string(model) + ".json";
}

ModelSpec preset_spec(std::string_view name) {
  ModelOverrides o;
  o.preset = std::string(name);
  return resolve_model_spec(o);
}

ModelSpec config_spec(const std::string& path) {
  ModelOverrides o;
  o.hf_config = path;
  return resolve_model_spec(o);
}

// --- The fixtures -----------------------------------------------------------

// DeepSeek-V3: 61 layers of one latent of 512 + 64 bf16 values: 1152 B per
// token and layer, 70272 B per token. fp8_ds_mla: 512 + 512 / 128 x 4 + 64 x 2
// = 656 B per token and layer.
TEST(cli_hybrid_config, DeepSeekV3) {
  const ModelSpec spec = config_spec(fixture("deepseek-v3"));
  ASSERT_EQ(spec.layers.size(), 61u);
  for (const LayerSpec& layer : spec.layers)
    EXPECT_EQ(layer, LayerSpec::mla(512, 64));
  EXPECT_EQ(spec.layers[0].token_bytes(kBlock), 1152u);
  EXPECT_EQ(spec.num_kv_heads, 1u);  // not num_key_value_heads (128)
  EXPECT_EQ(spec.head_dim_k, 576u);
  EXPECT_EQ(spec.head_dim_v, 0u);
  EXPECT_EQ(LayerSpec::mla(512, 64, KvCacheDtype::bf16, MlaFormat::fp8_ds_mla).token_bytes(kBlock),
            656u);
}

TEST(cli_hybrid_config, PresetsGiveTheFixturesLayers) {
  for (const char* name :
       {"deepseek-v3", "kimi-k2", "gpt-oss-120b", "gpt-oss-20b", "gemma-3-27b", "llama-4-scout",
        "qwen3-next-80b-a3b", "nemotron-h-8b", "jamba-1.5-mini"}) {
    SCOPED_TRACE(name);
    const ModelSpec preset = preset_spec(name);
    const ModelSpec config = config_spec(fixture(name));
    EXPECT_TRUE(preset.is_hybrid());
    EXPECT_EQ(preset.layers, config.layers);
    EXPECT_EQ(preset.max_position_embeddings, config.max_position_embeddings);
    EXPECT_EQ(preset.num_kv_heads, config.num_kv_heads);
    EXPECT_EQ(preset.head_dim_k, config.head_dim_k);
    EXPECT_EQ(preset.head_dim_v, config.head_dim_v);
  }
}

// --- Other architectures and defaults ---------------------------------------

ModelSpec spec_of(std::string_view text) {
  const TempFile config("config.json", text);
  return config_spec(config.path());
}

TEST(cli_hybrid_config, Gemma2AlternatesFromLayer0) {
  const ModelSpec spec = spec_of(R"({"model_type": "gemma2", "num_hidden_layers": 4,
      "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 256, "sliding_window": 4096})");
  ASSERT_EQ(spec.layers.size(), 4u);
  EXPECT_EQ(spec.layers[0], LayerSpec::sliding_window(4096, 4, 256, 256));
  EXPECT_EQ(spec.layers[1], LayerSpec::full_attention(4, 256, 256));
  EXPECT_EQ(spec.layers[2].kind, LayerKind::sliding_window);
  EXPECT_EQ(spec.layers[3].kind, LayerKind::full_attention);
}

TEST(cli_hybrid_config, WindowsOfWholeModels) {
  // Mistral 7B v0.1: every layer slides.
  const ModelSpec mistral = spec_of(R"({"model_type": "mistral", "num_hidden_layers": 3,
      "num_attention_heads": 32, "num_key_value_heads": 8, "hidden_size": 4096,
      "sliding_window": 4096})");
  EXPECT_EQ(mistral.layers,
            std::vector<LayerSpec>(3, LayerSpec::sliding_window(4096, 8, 128, 128)));
  // Qwen2 with use_sliding_window: the layers from max_window_layers on.
  const ModelSpec qwen = spec_of(R"({"model_type": "qwen2", "num_hidden_layers": 4,
      "num_attention_heads": 4, "num_key_value_heads": 2, "hidden_size": 256,
      "sliding_window": 1024, "use_sliding_window": true, "max_window_layers": 2})");
  ASSERT_EQ(qwen.layers.size(), 4u);
  EXPECT_EQ(qwen.layers[1].kind, LayerKind::full_attention);
  EXPECT_EQ(qwen.layers[2], LayerSpec::sliding_window(1024, 2, 64, 64));
}

TEST(cli_hybrid_config, LayerTypesAndPatternsAgree) {
  // Gemma 3 as layer_types gives the pattern's layers; Llama 4 without
  // no_rope_layers uses transformers' default interval of 4; Qwen3-Next as
  // layer_types gives full_attention_interval's.
  std::string gemma_types, qwen_types;
  for (int i = 0; i < 62; ++i)
    gemma_types += std::string(i ? "," : "") +
                   ((i + 1) % 6 == 0 ? "\"full_attention\"" : "\"sliding_attention\"");
  for (int i = 0; i < 48; ++i)
    qwen_types += std::string(i ? "," : "") +
                  ((i + 1) % 4 == 0 ? "\"full_attention\"" : "\"linear_attention\"");
  const ModelSpec gemma = spec_of(R"({"model_type": "gemma3_text", "num_hidden_layers": 62,
      "num_key_value_heads": 16, "head_dim": 128, "sliding_window": 1024, "layer_types": [)" +
                                  gemma_types + "]}");
  EXPECT_EQ(gemma.layers, preset_spec("gemma-3-27b").layers);
  const ModelSpec scout = spec_of(R"({"model_type": "llama4_text", "num_hidden_layers": 48,
      "num_key_value_heads": 8, "head_dim": 128, "attention_chunk_size": 8192})");
  EXPECT_EQ(scout.layers, preset_spec("llama-4-scout").layers);
  const ModelSpec qwen = spec_of(R"({"model_type": "qwen3_next", "num_hidden_layers": 48,
      "num_key_value_heads": 2, "head_dim": 256, "linear_num_key_heads": 16,
      "linear_num_value_heads": 32, "linear_key_head_dim": 128, "linear_value_head_dim": 128,
      "linear_conv_kernel_dim": 4, "full_attention_interval": 4, "layer_types": [)" +
                                 qwen_types + "]}");
  EXPECT_EQ(qwen.layers, preset_spec("qwen3-next-80b-a3b").layers);
}

// Granite 4 (granitemoehybrid): layer_types mamba / attention and Mamba2
// fields; mamba_d_head "auto" is mamba_expand x hidden_size / mamba_n_heads.
TEST(cli_hybrid_config, Granite4) {
  const ModelSpec spec = spec_of(R"({"model_type": "granitemoehybrid", "num_hidden_layers": 4,
      "num_attention_heads": 32, "num_key_value_heads": 8, "hidden_size": 4096,
      "layer_types": ["mamba", "mamba", "mamba", "attention"], "mamba_n_heads": 128,
      "mamba_d_head": "auto", "mamba_d_state": 128, "mamba_n_groups": 1, "mamba_d_conv": 4,
      "mamba_expand": 2, "mamba_chunk_size": 256, "torch_dtype": "bfloat16"})");
  ASSERT_EQ(spec.layers.size(), 4u);
  EXPECT_EQ(spec.layers[3], LayerSpec::full_attention(8, 128, 128));
  const LayerSpec& mamba = spec.layers[0];
  ASSERT_EQ(mamba.kind, LayerKind::state);
  EXPECT_EQ(mamba.state[0].shape, (std::vector<std::size_t>{128 * 64 + 2 * 1 * 128, 3}));
  EXPECT_EQ(mamba.state[1].shape, (std::vector<std::size_t>{128, 64, 128}));
  EXPECT_EQ(mamba.state[1].dtype, StateDtype::bf16);  // the model dtype
  EXPECT_EQ(mamba.state_bytes(), (128u * 64 + 256) * 3 * 2 + 128u * 64 * 128 * 2);
}

// --- Refusals: one error line naming the field ---------------------------------

TEST(cli_hybrid_config, ContradictoryAndUnknownFieldsAreOneErrorLine) {
  const std::string gpt_types = R"(["sliding_attention", "full_attention", "sliding_attention"])";
  const std::vector<std::pair<std::string, std::string>> cases = {
      // Lengths and values.
      {R"({"model_type": "gpt_oss", "num_hidden_layers": 4, "num_key_value_heads": 8,
           "head_dim": 64, "sliding_window": 128, "layer_types": )" +
           gpt_types + "}",
       "'layer_types' has 3 entries but num_hidden_layers is 4"},
      {R"({"model_type": "gpt_oss", "num_hidden_layers": 3, "num_key_value_heads": 8,
           "head_dim": 64, "sliding_window": 0, "layer_types": )" +
           gpt_types + "}",
       "'sliding_window' must be a positive integer, got 0"},
      {R"({"model_type": "gpt_oss", "num_hidden_layers": 3, "num_key_value_heads": 8,
           "head_dim": 64, "layer_types": )" +
           gpt_types + "}",
       "has sliding-window layers but no 'sliding_window'"},
      {R"({"model_type": "gpt_oss", "num_hidden_layers": 2, "num_key_value_heads": 8,
           "head_dim": 64, "sliding_window": 128, "layer_types": ["full_attention", "sparse"]})",
       "'layer_types'[1] is 'sparse', a kind of layer kvport does not know for model_type "
       "'gpt_oss' (known: full_attention, sliding_attention, chunked_attention)"},
      {R"({"model_type": "llama", "num_hidden_layers": 1, "num_key_value_heads": 8,
           "head_dim": 64, "layer_types": "full_attention"})",
       "'layer_types' must be an array of strings, got \"full_attention\""},
      {R"({"model_type": "qwen3_next", "num_hidden_layers": 48, "num_key_value_heads": 2,
           "head_dim": 256, "full_attention_interval": 5})",
       "'full_attention_interval' 5 does not divide num_hidden_layers 48"},
      {R"({"model_type": "qwen3_next", "num_hidden_layers": 4, "num_key_value_heads": 2,
           "head_dim": 256, "full_attention_interval": 2, "linear_num_key_heads": 1,
           "linear_num_value_heads": 1, "linear_key_head_dim": 8, "linear_value_head_dim": 8,
           "linear_conv_kernel_dim": 4, "layer_types": ["linear_attention", "full_attention",
           "full_attention", "full_attention"]})",
       "'layer_types' and 'full_attention_interval' disagree about layer 2"},
      {R"({"model_type": "qwen3_next", "num_hidden_layers": 4, "num_key_value_heads": 2,
           "head_dim": 256, "full_attention_interval": 4})",
       "model_type 'qwen3_next' needs 'linear_num_key_heads' for its KV cache"},
      {R"({"model_type": "nemotron_h", "num_hidden_layers": 3, "num_key_value_heads": 8,
           "head_dim": 128, "hybrid_override_pattern": "M*"})",
       "'hybrid_override_pattern' has 2 characters but num_hidden_layers is 3"},
      {R"({"model_type": "nemotron_h", "num_hidden_layers": 3, "num_key_value_heads": 8,
           "head_dim": 128, "hybrid_override_pattern": "M*X"})",
       "'hybrid_override_pattern'[2] is 'X', a kind of layer kvport does not know"},
      {R"({"model_type": "nemotron_h", "num_hidden_layers": 2, "num_key_value_heads": 8,
           "hybrid_override_pattern": "M*", "mamba_num_heads": 4, "mamba_n_heads": 8})",
       "'mamba_num_heads' is 4 but 'mamba_n_heads' is 8: the two name the same size"},
      {R"({"model_type": "jamba", "num_hidden_layers": 8, "num_key_value_heads": 8,
           "head_dim": 128, "attn_layer_period": 4, "attn_layer_offset": 4})",
       "'attn_layer_offset' 4 is not below 'attn_layer_period' 4"},
      {R"({"model_type": "llama4_text", "num_hidden_layers": 2, "num_key_value_heads": 8,
           "head_dim": 128, "attention_chunk_size": 8192, "no_rope_layers": [1, 2]})",
       "'no_rope_layers'[1] must be 0 (NoPE) or 1 (RoPE), got 2"},
      {R"({"model_type": "gemma3_text", "num_hidden_layers": 2, "num_key_value_heads": 8,
           "head_dim": 128, "sliding_window": 512})",
       "model_type 'gemma3_text' needs 'layer_types' or 'sliding_window_pattern'"},
      {R"({"model_type": "nemotron_h", "num_hidden_layers": 1, "num_key_value_heads": 8,
           "head_dim": 128, "hybrid_override_pattern": "M", "mamba_num_heads": 2,
           "mamba_head_dim": 8, "ssm_state_size": 8, "n_groups": 1, "conv_kernel": 4,
           "mamba_ssm_cache_dtype": "int8"})",
       "'mamba_ssm_cache_dtype' is 'int8'"},
      // Fields that change the cache's shape on an architecture that does not
      // own them: never planned as full attention.
      {R"({"model_type": "llama", "num_hidden_layers": 2, "num_attention_heads": 4,
           "hidden_size": 256, "kv_lora_rank": 512})",
       "'kv_lora_rank' changes the KV cache's shape, and kvport does not read it for model_type "
       "'llama' (it does for deepseek_v2, deepseek_v3, kimi_k2): refusing"},
      {R"({"model_type": "deepseek_v32", "num_hidden_layers": 2, "kv_lora_rank": 512,
           "qk_rope_head_dim": 64, "index_topk": 2048})",
       "'kv_lora_rank' changes the KV cache's shape, and kvport does not read it for model_type "
       "'deepseek_v32'"},
      {R"({"num_hidden_layers": 2, "num_attention_heads": 4, "hidden_size": 256,
           "ssm_state_size": 16})",
       "'ssm_state_size' changes the KV cache's shape, and kvport does not read it for a config "
       "without model_type"},
      {R"({"model_type": "mamba2", "num_hidden_layers": 2, "num_attention_heads": 4,
           "hidden_size": 256, "mamba_d_whatever": 16})",
       "'mamba_d_whatever' changes the KV cache's shape"},
      {R"({"model_type": "qwen3_5_moe", "num_hidden_layers": 2, "num_attention_heads": 4,
           "hidden_size": 256, "linear_num_value_heads": 32})",
       "'linear_num_value_heads' changes the KV cache's shape"},
      {R"({"model_type": "llava", "text_config": {"model_type": "llama", "num_hidden_layers": 2,
           "num_attention_heads": 4, "hidden_size": 256, "linear_key_head_dim": 64}})",
       "'linear_key_head_dim' changes the KV cache's shape"},
      {R"({"model_type": "llama", "num_hidden_layers": 2, "num_attention_heads": 4,
           "hidden_size": 256, "attention_chunk_size": 8192})",
       "'attention_chunk_size' changes the KV cache's shape"},
      {R"({"model_type": "cohere2", "num_hidden_layers": 2, "num_attention_heads": 4,
           "hidden_size": 256, "sliding_window": 4096, "sliding_window_pattern": 4})",
       "'sliding_window_pattern' changes the KV cache's shape"},
      {R"({"model_type": "falcon", "num_hidden_layers": 2, "num_attention_heads": 4,
           "hidden_size": 256, "sliding_window": 4096})",
       "'sliding_window' is 4096, and kvport does not know which layers of model_type 'falcon' "
       "attend within it"},
      {R"({"model_type": "deepseek_v3", "num_hidden_layers": 2, "kv_lora_rank": 512,
           "qk_rope_head_dim": 64, "sliding_window": 4096})",
       "'sliding_window' is given, and kvport does not read it for model_type 'deepseek_v3'"},
      {R"({"model_type": "deepseek_v3", "num_hidden_layers": 2, "qk_rope_head_dim": 64})",
       "model_type 'deepseek_v3' needs 'kv_lora_rank' for its KV cache"},
  };
  const TempFile file("config.json", "");
  for (const auto& [text, needle] : cases) {
    SCOPED_TRACE(text);
    std::ofstream(file.path(), std::ios::binary | std::ios::trunc) << text;
    expect_bad_input(run_cli({"plan", "--hf-config", file.path(), "--memory", "1GiB"}), needle);
  }
}

TEST(cli_hybrid_config, ConfigStringsInMessagesAreEscapedAndCut) {
  // An unknown layer_types value with terminal escapes, 1 MB long.
  const std::string value = "\\u001b[2J" + std::string(1 << 20, 'y');
  const TempFile config("config.json", R"({"model_type": "gpt_oss", "num_hidden_layers": 1,
      "num_key_value_heads": 8, "head_dim": 64, "layer_types": [")" +
                                           value + R"("]})");
  const CliResult r = run_cli({"plan", "--hf-config", config.path(), "--memory", "1GiB"});
  expect_bad_input(r, "'layer_types'[0] is '\\x1b[2Jyyyy");
  EXPECT_EQ(r.err.find('\x1b'), std::string::npos);
  EXPECT_LT(r.err.size(), 400u);
  // A model_type with escapes, in a refusal.
  const TempFile odd("config.json", R"({"model_type": "x\u009b31m", "num_hidden_layers": 1,
      "num_attention_heads": 1, "head_dim": 8, "kv_lora_rank": 512})");
  const CliResult o = run_cli({"plan", "--hf-config", odd.path(), "--memory", "1GiB"});
  expect_bad_input(o, "model_type 'x\\xc2\\x9b31m'");
}

// --- Names from the config ---------------------------------------------------

TEST(cli_hybrid_config, ModelNamesAreEscapedAndCut) {
  const std::string huge(5 << 20, 'x');
  const TempFile config("config.json", R"({"_name_or_path": "\u001b[2J\u0007evil)" + huge +
                                           R"(", "num_hidden_layers": 2,
      "num_attention_heads": 2, "head_dim": 64})");
  const CliResult r = run_cli({"plan", "--hf-config", config.path(), "--memory", "1GiB"});
  ASSERT_EQ(r.code, 0) << r.err;
  const std::string line = r.out.substr(0, r.out.find('\n'));
  EXPECT_THAT(line, HasSubstr("Model           \\x1b[2J\\x07evilxxx"));
  EXPECT_EQ(line.find('\x1b'), std::string::npos);
  EXPECT_LT(line.size(), kMaxModelNameBytes + 100);
  const CliResult j = run_cli({"plan", "--hf-config", config.path(), "--memory", "1GiB", "--json"});
  ASSERT_EQ(j.code, 0) << j.err;
  EXPECT_LE(j.json()["model"]["name"].get<std::string>().size(), kMaxModelNameBytes);
}

}  // namespace
}  // namespace kvport::cli::testing
