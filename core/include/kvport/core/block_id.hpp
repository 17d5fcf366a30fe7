// SPDX-License-Identifier: Apache-2.0
// Block ids: what names one block of a PagedKvCache, their range, and the
// null entry of a block table.
#pragma once

#include <cstddef>
#include <cstdint>
#include <limits>

namespace kvport {

/// The index of one block in a PagedKvCache: [0, num_blocks).
using BlockId = std::uint32_t;

/// The most blocks a PagedKvCache accepts (2^32 - 1): the PagedKvCache
/// constructor throws InvalidArgument for more, and compute_num_blocks caps
/// its answer here. Capacity planners cap with this constant, not a copy.
inline constexpr std::size_t kMaxCacheBlocks = std::numeric_limits<BlockId>::max();

/// The null entry of a block table (a released block, a block a group does
/// not need): never a valid id, since a cache has at most kMaxCacheBlocks =
/// 2^32 - 1 blocks, whose ids end at 2^32 - 2.
inline constexpr BlockId kNullBlock = 0xFFFFFFFFu;
static_assert(kNullBlock >= kMaxCacheBlocks, "kNullBlock must lie outside every cache's ids");

}  // namespace kvport
