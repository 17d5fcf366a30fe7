#include "kvport/sim/model_presets.hpp"

#include <algorithm>
#include <array>
#include <cctype>

namespace kvport::sim {
namespace {

// Sorted by name; `kvport plan --model x` lists them in this order.
constexpr std::array kPresets{
    ModelPreset{"llama-3-70b", 80, 8, 128},     ModelPreset{"llama-3-8b", 32, 8, 128},
    ModelPreset{"llama-3.1-405b", 126, 8, 128}, ModelPreset{"mistral-7b", 32, 8, 128},
    ModelPreset{"mixtral-8x7b", 32, 8, 128},    ModelPreset{"qwen2.5-0.5b", 24, 2, 64},
    ModelPreset{"qwen2.5-72b", 80, 8, 128},     ModelPreset{"qwen2.5-7b", 28, 4, 128},
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

KvCacheConfig preset_config(const ModelPreset& preset, KvCacheDtype dtype, std::size_t block_size) {
  KvCacheConfig config;
  config.num_layers = preset.num_layers;
  config.num_kv_heads = preset.num_kv_heads;
  config.head_dim_k = config.head_dim_v = preset.head_dim;
  config.dtype = dtype;
  config.block_size = block_size;
  return config;
}

}  // namespace kvport::sim
