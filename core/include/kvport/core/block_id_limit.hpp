// The largest number of blocks one PagedKvCache can have: block ids are
// 32-bit (BlockId, paged_kv_cache.hpp).
#pragma once

#include <cstddef>
#include <limits>

#include "kvport/core/paged_kv_cache.hpp"

namespace kvport {

/// The most blocks a PagedKvCache accepts (2^32 - 1): the PagedKvCache
/// constructor throws InvalidArgument for more, and compute_num_blocks caps
/// its answer here. Capacity planners cap with this constant, not a copy.
inline constexpr std::size_t kMaxCacheBlocks = std::numeric_limits<BlockId>::max();

}  // namespace kvport
