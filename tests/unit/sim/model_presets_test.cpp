// SPDX-License-Identifier: Apache-2.0
// The hybrid model presets and the recurrent state shapes, against arithmetic
// written out from the models' public config.json values.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cstddef>
#include <limits>
#include <map>
#include <string>

#include "kvport/core/layer_spec.hpp"
#include "kvport/platform/error.hpp"
#include "kvport/sim/model_presets.hpp"
#include "kvport/sim/state_layers.hpp"
#include "kvport/testing/support.hpp"

namespace kvport::sim {
namespace {

using kvport::testing::message_of;
using ::testing::HasSubstr;

constexpr std::size_t kMiB = std::size_t{1} << 20;

// How many layers of each kind (LayerSpec::describe(), which includes the
// shape) a preset has.
std::map<std::string, std::size_t> kinds_of(std::string_view name) {
  const std::optional<ModelPreset> preset = find_model_preset(name);
  EXPECT_TRUE(preset) << name;
  if (!preset) return {};
  std::map<std::string, std::size_t> counts;
  for (const LayerSpec& spec : preset_layer_specs(*preset))
    ++counts[spec.describe()];
  return counts;
}

TEST(sim_model_presets, EveryHybridPresetIsConsistentWithItsShapeFields) {
  std::size_t hybrids = 0;
  for (const ModelPreset& preset : model_presets()) {
    SCOPED_TRACE(std::string(preset.name));
    const std::vector<LayerSpec> layers = preset_layer_specs(preset);
    ASSERT_EQ(layers.size(), preset.num_layers);
    EXPECT_GE(preset.max_position_embeddings, 8192u);
    for (const LayerSpec& spec : layers)
      EXPECT_NO_THROW(spec.validate(16));
    if (!preset.is_hybrid()) {
      EXPECT_EQ(layers.front(),
                LayerSpec::full_attention(preset.num_kv_heads, preset.head_dim, preset.head_dim));
      continue;
    }
    ++hybrids;
    EXPECT_THAT(message_of<InvalidArgument>([&] { (void)preset_config(preset); }),
                HasSubstr("is a hybrid model"));
    // num_kv_heads x head_dim: the first attention layer, or the MLA latent.
    bool found = false;
    for (const LayerSpec& spec : layers) {
      if (spec.kind == LayerKind::mla) {
        EXPECT_EQ(preset.num_kv_heads, 1u);
        EXPECT_EQ(preset.head_dim, spec.kv_lora_rank + spec.rope_dim);
        found = true;
        break;
      }
      if (spec.has_blocks()) {
        EXPECT_EQ(preset.num_kv_heads, spec.num_kv_heads);
        EXPECT_EQ(preset.head_dim, spec.head_dim_k);
        found = true;
        break;
      }
    }
    EXPECT_TRUE(found) << "a hybrid preset without an attention layer";
  }
  EXPECT_EQ(hybrids, 9u);
}

TEST(sim_model_presets, LayerKindsOfTheHybridModels) {
  using Counts = std::map<std::string, std::size_t>;
  EXPECT_EQ(kinds_of("deepseek-v3"), (Counts{{"mla(512+64) bf16", 61}}));
  EXPECT_EQ(kinds_of("kimi-k2"), (Counts{{"mla(512+64) bf16", 61}}));
  EXPECT_EQ(kinds_of("gpt-oss-120b"),
            (Counts{{"full_attention 8x64 bf16", 18}, {"sliding_window(128) 8x64 bf16", 18}}));
  EXPECT_EQ(kinds_of("gpt-oss-20b"),
            (Counts{{"full_attention 8x64 bf16", 12}, {"sliding_window(128) 8x64 bf16", 12}}));
  EXPECT_EQ(kinds_of("gemma-3-27b"),
            (Counts{{"full_attention 16x128 bf16", 10}, {"sliding_window(1024) 16x128 bf16", 52}}));
  EXPECT_EQ(kinds_of("llama-4-scout"),
            (Counts{{"full_attention 8x128 bf16", 12}, {"chunked_local(8192) 8x128 bf16", 36}}));
  EXPECT_EQ(kinds_of("qwen3-next-80b-a3b"),
            (Counts{{"full_attention 2x256 bf16", 12},
                    {"state(conv 8192x3 bf16, recurrent 32x128x128 bf16)", 36}}));
  EXPECT_EQ(kinds_of("nemotron-h-8b"), (Counts{{"full_attention 8x128 bf16", 4},
                                               {"state(conv 10240x3 bf16, ssm 128x64x128 f32)", 24},
                                               {"none", 24}}));
  EXPECT_EQ(kinds_of("jamba-1.5-mini"),
            (Counts{{"full_attention 8x128 bf16", 4},
                    {"state(conv 8192x3 bf16, ssm 8192x16 bf16)", 28}}));
}

TEST(sim_model_presets, WhichLayersAreGlobal) {
  const auto layers = [](std::string_view name) {
    return preset_layer_specs(*find_model_preset(name));
  };
  const auto gpt = layers("gpt-oss-120b");
  EXPECT_EQ(gpt[0].kind, LayerKind::sliding_window);  // layer 0 slides
  EXPECT_EQ(gpt[1].kind, LayerKind::full_attention);
  const auto gemma = layers("gemma-3-27b");
  for (std::size_t i : {5u, 11u, 59u})
    EXPECT_EQ(gemma[i].kind, LayerKind::full_attention) << i;
  for (std::size_t i : {0u, 4u, 6u, 60u, 61u})
    EXPECT_EQ(gemma[i].kind, LayerKind::sliding_window) << i;
  const auto scout = layers("llama-4-scout");
  EXPECT_EQ(scout[3].kind, LayerKind::full_attention);
  EXPECT_EQ(scout[47].kind, LayerKind::full_attention);
  EXPECT_EQ(scout[0].kind, LayerKind::chunked_local);
  const auto qwen = layers("qwen3-next-80b-a3b");
  EXPECT_EQ(qwen[3].kind, LayerKind::full_attention);
  EXPECT_EQ(qwen[0].kind, LayerKind::state);
  const auto nemotron = layers("nemotron-h-8b");
  for (std::size_t i : {7u, 18u, 29u, 40u})
    EXPECT_EQ(nemotron[i].kind, LayerKind::full_attention) << i;
  EXPECT_EQ(nemotron[0].kind, LayerKind::state);
  EXPECT_EQ(nemotron[1].kind, LayerKind::none);
  const auto jamba = layers("jamba-1.5-mini");
  for (std::size_t i : {4u, 12u, 20u, 28u})
    EXPECT_EQ(jamba[i].kind, LayerKind::full_attention) << i;
}

TEST(sim_model_presets, BytesOfTheHybridLayers) {
  const auto first = [](std::string_view name, LayerKind kind) {
    for (const LayerSpec& spec : preset_layer_specs(*find_model_preset(name)))
      if (spec.kind == kind) return spec;
    ADD_FAILURE() << name << " has no such layer";
    return LayerSpec::no_kv();
  };
  // DeepSeek-V3: (512 + 64) bf16 values per token = 1152 B; 61 layers 70272 B.
  EXPECT_EQ(first("deepseek-v3", LayerKind::mla).token_bytes(16), 1152u);
  EXPECT_EQ(61u * first("deepseek-v3", LayerKind::mla).token_bytes(16), 70272u);
  // gpt-oss: K + V = 2 x 8 heads x 64 x 2 B = 2048 B per token and layer.
  EXPECT_EQ(first("gpt-oss-120b", LayerKind::sliding_window).token_bytes(16), 2048u);
  EXPECT_EQ(first("gpt-oss-120b", LayerKind::full_attention).token_bytes(16), 2048u);
  // Nemotron-H: SSM 128 x 64 x 128 fp32 = 4 MiB; conv (128 x 64 + 2 x 8 x 128)
  // x 3 bf16 = 61440 B (a multiple of 16: no padding).
  EXPECT_EQ(first("nemotron-h-8b", LayerKind::state).state_bytes(), 4 * kMiB + 61440u);
  // Qwen3-Next: recurrent 32 x 128 x 128 bf16 = 1 MiB; conv (2 x 16 x 128 +
  // 32 x 128) x 3 bf16 = 49152 B.
  EXPECT_EQ(first("qwen3-next-80b-a3b", LayerKind::state).state_bytes(), kMiB + 49152u);
  // Jamba: conv 8192 x 3 bf16 = 49152 B; SSM 8192 x 16 bf16 = 262144 B.
  EXPECT_EQ(first("jamba-1.5-mini", LayerKind::state).state_bytes(), 49152u + 262144u);
}

TEST(sim_state_layers, ShapesAndErrors) {
  const LayerSpec m2 = mamba2_state_layer({4, 8, 16, 2, 4}, StateDtype::bf16, StateDtype::f32);
  ASSERT_EQ(m2.state.size(), 2u);
  EXPECT_EQ(m2.state[0].name, "conv");
  EXPECT_EQ(m2.state[0].shape, (std::vector<std::size_t>{4 * 8 + 2 * 2 * 16, 3}));
  EXPECT_EQ(m2.state[0].dtype, StateDtype::bf16);
  EXPECT_EQ(m2.state[1].name, "ssm");
  EXPECT_EQ(m2.state[1].shape, (std::vector<std::size_t>{4, 8, 16}));
  EXPECT_EQ(m2.state[1].dtype, StateDtype::f32);

  const LayerSpec gdn =
      gated_delta_net_state_layer({2, 4, 8, 16, 3}, StateDtype::f32, StateDtype::f32);
  EXPECT_EQ(gdn.state[0].shape, (std::vector<std::size_t>{2 * 2 * 8 + 4 * 16, 2}));
  EXPECT_EQ(gdn.state[1].name, "recurrent");
  EXPECT_EQ(gdn.state[1].shape, (std::vector<std::size_t>{4, 8, 16}));

  const LayerSpec m1 = mamba1_state_layer({64, 16, 4}, StateDtype::f16, StateDtype::f16);
  EXPECT_EQ(m1.state[0].shape, (std::vector<std::size_t>{64, 3}));
  EXPECT_EQ(m1.state[1].shape, (std::vector<std::size_t>{64, 16}));

  EXPECT_THAT(message_of<InvalidArgument>([] {
                mamba2_state_layer({4, 8, 16, 2, 1}, StateDtype::f32, StateDtype::f32);
              }),
              HasSubstr("the convolution kernel must be >= 2, got 1"));
  EXPECT_THAT(message_of<InvalidArgument>([] {
                mamba2_state_layer({0, 8, 16, 2, 4}, StateDtype::f32, StateDtype::f32);
              }),
              HasSubstr("Mamba2 state: num_heads must be > 0"));
  constexpr std::size_t kHuge = std::numeric_limits<std::size_t>::max() / 2;
  EXPECT_THAT(message_of<InvalidArgument>([&] {
                gated_delta_net_state_layer({kHuge, 1, 4, 1, 4}, StateDtype::f32, StateDtype::f32);
              }),
              HasSubstr("overflows"));
  EXPECT_THAT(message_of<InvalidArgument>([&] {
                mamba1_state_layer({kHuge, kHuge, 4}, StateDtype::f32, StateDtype::f32);
              }),
              HasSubstr("overflows"));
}

}  // namespace
}  // namespace kvport::sim
