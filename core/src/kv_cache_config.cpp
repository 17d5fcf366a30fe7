// SPDX-License-Identifier: Apache-2.0
#include "kvport/core/kv_cache_config.hpp"

#include <fmt/format.h>

#include <limits>

#include "kvport/platform/error.hpp"

namespace kvport {

std::string_view to_string(KvCacheLayout layout) noexcept {
  switch (layout) {
    case KvCacheLayout::layer_major:
      return "layer_major";
    case KvCacheLayout::block_major:
      return "block_major";
  }
  return "unknown";
}

void KvCacheConfig::validate() const {
  if (num_layers == 0) throw InvalidArgument("KvCacheConfig: num_layers must be > 0");
  if (block_size == 0) throw InvalidArgument("KvCacheConfig: block_size must be > 0");
  if (num_kv_heads == 0) throw InvalidArgument("KvCacheConfig: num_kv_heads must be > 0");
  if (head_dim_k == 0) throw InvalidArgument("KvCacheConfig: head_dim_k must be > 0");
  if (!layer_dtypes.empty() && layer_dtypes.size() != num_layers) {
    throw InvalidArgument(fmt::format(
        "KvCacheConfig: layer_dtypes has {} entries but num_layers is {} (use an empty list for "
        "a uniform dtype)",
        layer_dtypes.size(), num_layers));
  }
  (void)bytes_per_block();  // checks groups and overflow for every layer
}

KvCacheDtype KvCacheConfig::dtype_for_layer(std::size_t layer) const {
  if (layer >= num_layers) {
    throw OutOfRange(
        fmt::format("KvCacheConfig: layer {} out of range (num_layers = {})", layer, num_layers));
  }
  if (layer_dtypes.empty()) return dtype;
  if (layer >= layer_dtypes.size()) {  // a config edited after validate(): never read past the end
    throw InvalidArgument(fmt::format(
        "KvCacheConfig: layer_dtypes has {} entries but num_layers is {} (one per layer, or none)",
        layer_dtypes.size(), num_layers));
  }
  return layer_dtypes[layer];
}

std::size_t KvCacheConfig::num_override_layers() const noexcept {
  std::size_t n = 0;
  for (KvCacheDtype d : layer_dtypes)
    n += d != dtype ? 1 : 0;
  return n;
}

BlockRegionLayout KvCacheConfig::k_layout(std::size_t layer) const {
  return block_region_layout(dtype_for_layer(layer), block_size, num_kv_heads, head_dim_k,
                             "head_dim_k");
}

BlockRegionLayout KvCacheConfig::v_layout(std::size_t layer) const {
  if (!has_v()) {
    (void)dtype_for_layer(layer);  // the same range check as with V
    return BlockRegionLayout{};
  }
  return block_region_layout(dtype_for_layer(layer), block_size, num_kv_heads, head_dim_v,
                             "head_dim_v");
}

std::size_t KvCacheConfig::bytes_per_block() const {
  if (num_layers == 0) throw InvalidArgument("KvCacheConfig: num_layers must be > 0");
  if (!layer_dtypes.empty() && layer_dtypes.size() != num_layers) {
    throw InvalidArgument(
        fmt::format("KvCacheConfig: layer_dtypes has {} entries but num_layers is {}",
                    layer_dtypes.size(), num_layers));
  }
  constexpr std::size_t kMax = std::numeric_limits<std::size_t>::max();
  std::size_t total = 0;
  // Uniform configs have one layer shape; compute it once.
  const std::size_t distinct = layer_dtypes.empty() ? 1 : num_layers;
  for (std::size_t layer = 0; layer < distinct; ++layer) {
    const std::size_t per_layer = k_block_bytes(layer) + v_block_bytes(layer);
    if (per_layer < k_block_bytes(layer)) {
      throw InvalidArgument("KvCacheConfig: bytes per block overflows size_t");
    }
    const std::size_t count = layer_dtypes.empty() ? num_layers : 1;
    if (count != 0 && per_layer > kMax / count) {
      throw InvalidArgument("KvCacheConfig: bytes per block overflows size_t (num_layers)");
    }
    if (per_layer * count > kMax - total) {
      throw InvalidArgument("KvCacheConfig: bytes per block overflows size_t");
    }
    total += per_layer * count;
  }
  return total;
}

}  // namespace kvport
