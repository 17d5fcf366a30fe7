// SPDX-License-Identifier: Apache-2.0
// Capacity planning: how many blocks and tokens of a KV-cache config fit in a
// memory budget, and what every layer's block costs.
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>
#include <vector>

#include "kvport/core/block_id.hpp"
#include "kvport/core/dtype.hpp"
#include "kvport/core/kv_cache_config.hpp"

namespace kvport::cli {

/// One layer's share of a block.
struct LayerBlockBytes {
  std::size_t layer = 0;
  KvCacheDtype dtype = KvCacheDtype::bf16;
  BlockRegionLayout k;
  BlockRegionLayout v;

  std::size_t total_bytes() const noexcept { return k.total_bytes + v.total_bytes; }
};

/// Consecutive layers [first, last] with identical dtype and byte layouts.
struct LayerRange {
  std::size_t first = 0;
  std::size_t last = 0;
  LayerBlockBytes bytes;  ///< of layer `first` (the same for every layer in the range)

  std::size_t count() const noexcept { return last - first + 1; }
};

struct CapacityPlan {
  std::size_t memory_bytes = 0;
  std::size_t bytes_per_block = 0;  ///< all layers, K + V
  /// PagedKvCache::compute_num_blocks: what fits including the rounding of
  /// each pool allocation, at most kMaxCacheBlocks.
  std::size_t num_blocks = 0;
  /// More blocks fit in the budget than kMaxCacheBlocks; num_blocks is capped.
  bool capped_by_block_ids = false;
  std::size_t token_capacity = 0;       ///< num_blocks * block_size
  std::size_t cache_bytes = 0;          ///< num_blocks * bytes_per_block
  std::vector<LayerBlockBytes> layers;  ///< one per layer
};

/// Plans `config` (validated) into `memory_bytes`. Throws InvalidArgument for
/// an invalid config, and when the budget does not hold a single block (the
/// message gives both sizes).
CapacityPlan make_capacity_plan(const KvCacheConfig& config, std::size_t memory_bytes);

/// Groups consecutive layers with the same dtype and layouts, for tables.
std::vector<LayerRange> collapse_layers(std::span<const LayerBlockBytes> layers);

}  // namespace kvport::cli
