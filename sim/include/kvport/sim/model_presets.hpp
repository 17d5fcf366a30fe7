// The built-in model shapes: ONE table for `kvport plan`/`demo` (--model),
// `kvport bench` and the benchmarks.
#pragma once

#include <cstddef>
#include <optional>
#include <span>
#include <string>
#include <string_view>

#include "kvport/core/kv_cache_config.hpp"

namespace kvport::sim {

/// One built-in model: the attention shape a KV cache sees.
struct ModelPreset {
  std::string_view name;
  std::size_t num_layers;
  std::size_t num_kv_heads;
  std::size_t head_dim;  ///< of K and of V
};

/// The built-in presets, sorted by name (llama-3-8b, llama-3-70b, qwen2.5-7b,
/// ...). Never throws.
std::span<const ModelPreset> model_presets() noexcept;

/// The preset called `name` (ASCII case-insensitive), or nullopt.
std::optional<ModelPreset> find_model_preset(std::string_view name) noexcept;

/// The presets' names joined with ", " (for "unknown model" messages).
std::string model_preset_names();

/// A cache config of `preset`'s shape with `dtype` and `block_size` (tokens
/// per block), layer-major; not validated (a preset always is valid).
KvCacheConfig preset_config(const ModelPreset& preset, KvCacheDtype dtype = KvCacheDtype::bf16,
                            std::size_t block_size = 16);

}  // namespace kvport::sim
