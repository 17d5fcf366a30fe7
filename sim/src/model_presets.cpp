// SPDX-License-Identifier: Apache-2.0
#include "kvport/sim/model_presets.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <array>
#include <cctype>

#include "kvport/platform/error.hpp"
#include "kvport/sim/state_layers.hpp"

namespace kvport::sim {
namespace {

// The hybrid models, from their public config.json values (the same values
// as the fixtures in tests/data/hf_configs/, which the CLI tests read back
// into the same specs).

// DeepSeek-V3 / R1, Kimi K2: 61 MLA layers of a 512 + 64 latent.
std::vector<LayerSpec> mla_61_layers() {
  return std::vector<LayerSpec>(61, LayerSpec::mla(512, 64));
}

// gpt-oss: layer_types alternate sliding_attention (even layers, window 128)
// and full_attention; 8 KV heads x 64.
std::vector<LayerSpec> gpt_oss(std::size_t num_layers) {
  std::vector<LayerSpec> layers;
  for (std::size_t i = 0; i < num_layers; ++i) {
    layers.push_back(i % 2 == 0 ? LayerSpec::sliding_window(128, 8, 64, 64)
                                : LayerSpec::full_attention(8, 64, 64));
  }
  return layers;
}
std::vector<LayerSpec> gpt_oss_120b() {
  return gpt_oss(36);
}
std::vector<LayerSpec> gpt_oss_20b() {
  return gpt_oss(24);
}

// Gemma 3 27B: 62 layers, sliding_window 1024, sliding_window_pattern 6
// (layer i global when (i + 1) % 6 == 0); 16 KV heads x 128.
std::vector<LayerSpec> gemma_3_27b() {
  std::vector<LayerSpec> layers;
  for (std::size_t i = 0; i < 62; ++i) {
    layers.push_back((i + 1) % 6 == 0 ? LayerSpec::full_attention(16, 128, 128)
                                      : LayerSpec::sliding_window(1024, 16, 128, 128));
  }
  return layers;
}

// Llama 4 Scout: 48 layers; no_rope_layers marks every 4th layer NoPE, which
// attends globally; the RoPE layers attend within chunks of 8192 tokens.
std::vector<LayerSpec> llama_4_scout() {
  std::vector<LayerSpec> layers;
  for (std::size_t i = 0; i < 48; ++i) {
    layers.push_back((i + 1) % 4 == 0 ? LayerSpec::full_attention(8, 128, 128)
                                      : LayerSpec::chunked_local(8192, 8, 128, 128));
  }
  return layers;
}

// Qwen3-Next-80B-A3B: 48 layers, full_attention_interval 4 (2 KV heads x 256),
// the others Gated DeltaNet (16 key heads, 32 value heads, 128 x 128, conv 4).
std::vector<LayerSpec> qwen3_next_80b_a3b() {
  const LayerSpec linear = gated_delta_net_state_layer(GatedDeltaNetShape{16, 32, 128, 128, 4},
                                                       StateDtype::bf16, StateDtype::bf16);
  std::vector<LayerSpec> layers;
  for (std::size_t i = 0; i < 48; ++i) {
    layers.push_back((i + 1) % 4 == 0 ? LayerSpec::full_attention(2, 256, 256) : linear);
  }
  return layers;
}

// Nemotron-H 8B: hybrid_override_pattern of 52 layers (M Mamba2, * attention,
// - MLP); Mamba2 128 heads x 64, state 128, 8 groups, conv 4, the SSM state
// in float32 (mamba_ssm_cache_dtype); attention 8 KV heads x 128.
std::vector<LayerSpec> nemotron_h_8b() {
  constexpr std::string_view kPattern = "M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M-";
  const LayerSpec mamba =
      mamba2_state_layer(Mamba2Shape{128, 64, 128, 8, 4}, StateDtype::bf16, StateDtype::f32);
  std::vector<LayerSpec> layers;
  for (char c : kPattern) {
    layers.push_back(c == 'M'   ? mamba
                     : c == '*' ? LayerSpec::full_attention(8, 128, 128)
                                : LayerSpec::no_kv());
  }
  return layers;
}

// Jamba 1.5 Mini: 32 layers, attention where i % 8 == 4 (8 KV heads x 128),
// Mamba1 elsewhere (expand 2 x hidden 4096, state 16, conv 4).
std::vector<LayerSpec> jamba_1_5_mini() {
  const LayerSpec mamba =
      mamba1_state_layer(Mamba1Shape{8192, 16, 4}, StateDtype::bf16, StateDtype::bf16);
  std::vector<LayerSpec> layers;
  for (std::size_t i = 0; i < 32; ++i) {
    layers.push_back(i % 8 == 4 ? LayerSpec::full_attention(8, 128, 128) : mamba);
  }
  return layers;
}

// Sorted by name; `kvport plan --model x` lists them in this order.
constexpr std::array kPresets{
    ModelPreset{"deepseek-v3", 61, 1, 576, 163840, mla_61_layers},
    ModelPreset{"gemma-3-27b", 62, 16, 128, 131072, gemma_3_27b},
    ModelPreset{"gpt-oss-120b", 36, 8, 64, 131072, gpt_oss_120b},
    ModelPreset{"gpt-oss-20b", 24, 8, 64, 131072, gpt_oss_20b},
    ModelPreset{"jamba-1.5-mini", 32, 8, 128, 262144, jamba_1_5_mini},
    ModelPreset{"kimi-k2", 61, 1, 576, 131072, mla_61_layers},
    ModelPreset{"llama-3-70b", 80, 8, 128, 8192, nullptr},
    ModelPreset{"llama-3-8b", 32, 8, 128, 8192, nullptr},
    ModelPreset{"llama-3.1-405b", 126, 8, 128, 131072, nullptr},
    ModelPreset{"llama-4-scout", 48, 8, 128, 10485760, llama_4_scout},
    ModelPreset{"mistral-7b", 32, 8, 128, 32768, nullptr},
    ModelPreset{"mixtral-8x7b", 32, 8, 128, 32768, nullptr},
    ModelPreset{"nemotron-h-8b", 52, 8, 128, 8192, nemotron_h_8b},
    ModelPreset{"qwen2.5-0.5b", 24, 2, 64, 32768, nullptr},
    ModelPreset{"qwen2.5-72b", 80, 8, 128, 32768, nullptr},
    ModelPreset{"qwen2.5-7b", 28, 4, 128, 32768, nullptr},
    ModelPreset{"qwen3-next-80b-a3b", 48, 2, 256, 262144, qwen3_next_80b_a3b},
};

bool iequals(std::string_view a, std::string_view b) noexcept {
  return std::equal(a.begin(), a.end(), b.begin(), b.end(), [](char x, char y) {
    return std::tolower(static_cast<unsigned char>(x)) ==
           std::tolower(static_cast<unsigned char>(y));
  });
}

}  // namespace

std::span<const ModelPreset> model_presets() noexcept {
  return kPresets;
}

std::optional<ModelPreset> find_model_preset(std::string_view name) noexcept {
  for (const ModelPreset& preset : kPresets) {
    if (iequals(preset.name, name)) return preset;
  }
  return std::nullopt;
}

std::string model_preset_names() {
  std::string names;
  for (const ModelPreset& preset : kPresets) {
    if (!names.empty()) names += ", ";
    names += preset.name;
  }
  return names;
}

std::vector<LayerSpec> preset_layer_specs(const ModelPreset& preset) {
  if (preset.is_hybrid()) return preset.layer_specs();
  return std::vector<LayerSpec>(
      preset.num_layers,
      LayerSpec::full_attention(preset.num_kv_heads, preset.head_dim, preset.head_dim));
}

KvCacheConfig preset_config(const ModelPreset& preset, KvCacheDtype dtype, std::size_t block_size) {
  if (preset.is_hybrid()) {
    throw InvalidArgument(fmt::format(
        "model preset '{}' is a hybrid model (its layers keep different kinds of KV or state): it "
        "has no single cache config (kvport plan --model {} plans its KV cache groups)",
        preset.name, preset.name));
  }
  KvCacheConfig config;
  config.num_layers = preset.num_layers;
  config.num_kv_heads = preset.num_kv_heads;
  config.head_dim_k = config.head_dim_v = preset.head_dim;
  config.dtype = dtype;
  config.block_size = block_size;
  return config;
}

}  // namespace kvport::sim
