// SPDX-License-Identifier: Apache-2.0
#include "kvport/cli/capacity_plan.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <limits>

#include "kvport/core/paged_kv_cache.hpp"
#include "kvport/platform/byte_size.hpp"
#include "kvport/platform/error.hpp"

namespace kvport::cli {

CapacityPlan make_capacity_plan(const KvCacheConfig& config, std::size_t memory_bytes) {
  config.validate();
  CapacityPlan plan;
  plan.memory_bytes = memory_bytes;
  plan.bytes_per_block = config.bytes_per_block();
  const std::size_t fits = PagedKvCache::compute_num_blocks(config, memory_bytes);
  if (fits == 0) {
    throw InvalidArgument(
        fmt::format("memory budget {} ({} bytes) is smaller than one block ({} bytes, {})",
                    format_bytes(memory_bytes), memory_bytes, plan.bytes_per_block,
                    format_bytes(plan.bytes_per_block)));
  }
  // compute_num_blocks also counts each pool's rounding to kAllocAlignment, so
  // a cache of that many blocks fits the budget; it caps at the block id range
  // (older cores did not: cap here too).
  plan.num_blocks = std::min(fits, kMaxCacheBlocks);
  plan.capped_by_block_ids = memory_bytes / plan.bytes_per_block > kMaxCacheBlocks;
  // num_blocks <= 2^32 - 1 and num_blocks * bytes_per_block <= memory_bytes, so
  // only the token product can overflow (a huge block size).
  plan.cache_bytes = plan.num_blocks * plan.bytes_per_block;
  if (config.block_size > std::numeric_limits<std::size_t>::max() / plan.num_blocks) {
    throw InvalidArgument(fmt::format("token capacity overflows: {} blocks x {} tokens",
                                      plan.num_blocks, config.block_size));
  }
  plan.token_capacity = plan.num_blocks * config.block_size;

  plan.layers.reserve(config.num_layers);
  for (std::size_t layer = 0; layer < config.num_layers; ++layer) {
    plan.layers.push_back(LayerBlockBytes{layer, config.dtype_for_layer(layer),
                                          config.k_layout(layer), config.v_layout(layer)});
  }
  return plan;
}

std::vector<LayerRange> collapse_layers(std::span<const LayerBlockBytes> layers) {
  std::vector<LayerRange> ranges;
  for (const LayerBlockBytes& layer : layers) {
    if (!ranges.empty()) {
      LayerRange& back = ranges.back();
      if (back.last + 1 == layer.layer && back.bytes.dtype == layer.dtype &&
          back.bytes.k == layer.k && back.bytes.v == layer.v) {
        back.last = layer.layer;
        continue;
      }
    }
    ranges.push_back(LayerRange{layer.layer, layer.layer, layer});
  }
  return ranges;
}

}  // namespace kvport::cli
