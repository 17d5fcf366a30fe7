// SPDX-License-Identifier: Apache-2.0
// The built-in model shapes: ONE table for `kvport plan`/`demo` (--model),
// `kvport bench` and the benchmarks.
#pragma once

#include <cstddef>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "kvport/core/kv_cache_config.hpp"
#include "kvport/core/layer_spec.hpp"

namespace kvport::sim {

/// One built-in model: the attention shape a KV cache sees.
///
/// A hybrid model (sliding-window, chunked, MLA or state layers) also has
/// `layer_specs`: one LayerSpec per layer, as `kvport plan --hf-config` reads
/// the model's config.json (attention K/V and MLA latents in bf16; state in
/// the dtypes vLLM keeps it in: the model dtype, bf16, except where the
/// config's mamba_ssm_cache_dtype says otherwise). num_kv_heads and head_dim
/// then describe its first attention layer (an MLA model: one "head" of the
/// latent, kv_lora_rank + rope_dim values).
struct ModelPreset {
  std::string_view name;
  std::size_t num_layers;
  std::size_t num_kv_heads;
  std::size_t head_dim;  ///< of K and of V
  /// The config's max_position_embeddings: the longest context it was
  /// trained for.
  std::size_t max_position_embeddings;
  /// The per-layer specs of a hybrid model; null when every layer is full
  /// attention of num_kv_heads x head_dim.
  std::vector<LayerSpec> (*layer_specs)();

  bool is_hybrid() const noexcept { return layer_specs != nullptr; }
};

/// The built-in presets, sorted by name (deepseek-v3, ..., llama-3-8b,
/// llama-3-70b, qwen2.5-7b, ...). Never throws.
std::span<const ModelPreset> model_presets() noexcept;

/// The preset called `name` (ASCII case-insensitive), or nullopt.
std::optional<ModelPreset> find_model_preset(std::string_view name) noexcept;

/// The presets' names joined with ", " (for "unknown model" messages).
std::string model_preset_names();

/// Every layer of `preset`: its layer_specs() for a hybrid model, else
/// num_layers full-attention specs (bf16).
std::vector<LayerSpec> preset_layer_specs(const ModelPreset& preset);

/// A cache config of `preset`'s shape with `dtype` and `block_size` (tokens
/// per block), layer-major; not validated (a preset always is valid). A
/// hybrid preset has no single config: InvalidArgument naming it.
KvCacheConfig preset_config(const ModelPreset& preset, KvCacheDtype dtype = KvCacheDtype::bf16,
                            std::size_t block_size = 16);

}  // namespace kvport::sim
