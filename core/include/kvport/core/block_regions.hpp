// SPDX-License-Identifier: Apache-2.0
// Block regions: the byte regions that hold a list of blocks in a cache's
// pools, the copy regions between them and host images of the blocks, and
// the pools' extents. Everything that asks "where are block b's bytes" for a
// batch asks here (single blocks: BlockPool::region).
#pragma once

#include <cstddef>
#include <span>
#include <vector>

#include "kvport/core/block_id.hpp"
#include "kvport/core/block_pool.hpp"
#include "kvport/core/paged_kv_cache.hpp"
#include "kvport/platform/backend.hpp"
#include "kvport/platform/device_region.hpp"

namespace kvport {

/// The device regions holding `blocks` in `pools`, appended to `out` pool by
/// pool (in `pools` order) and, inside a pool, in the order of `blocks`. In a
/// dense pool (stride == region bytes) each run of consecutive ids
/// (b, b + 1, ...) is one region; otherwise each id is one. Over a cache's
/// memory_pools() that is runs x 2 x layers regions in layer-major layout
/// (runs x layers for K-only layers) and one region per run in block-major
/// layout, whose one pool is the whole block. Ids are taken as given (not
/// sorted or deduplicated: sort them to coalesce more). O(pools x blocks).
/// Throws, before appending anything, OutOfRange for an id out of range
/// of a pool and InvalidArgument for a run whose bytes overflow size_t.
void append_block_regions(std::span<const BlockPool> pools, std::span<const BlockId> blocks,
                          std::vector<DeviceRegion>& out);

/// append_block_regions over cache.memory_pools() (every layer, K and V), in
/// a new vector.
std::vector<DeviceRegion> block_regions(const PagedKvCache& cache, std::span<const BlockId> blocks);

/// Bytes of one block's image: its region of every pool, pool after pool, no
/// gaps. For a cache's memory_pools(), config().bytes_per_block(). Throws
/// InvalidArgument when the sum overflows size_t.
std::size_t block_image_bytes(std::span<const BlockPool> pools);

/// The copy regions between `blocks` and host images of them: blocks[i]'s
/// image (block_image_bytes(pools) bytes: its region of each pool in `pools`
/// order) at `host + i * host_stride`, for a batched host copy in either
/// direction (Backend::copy_batch_h2d_async / copy_batch_d2h_async). One
/// region per (block, pool), appended in that order: over a cache's
/// memory_pools(), one per block in block-major layout and 2 x layers in
/// layer-major (whose pools are separate allocations even when adjacent: a
/// backend checks each region against one allocation). HostTier slots and
/// the transfer tests' staging are such images. `host` must hold
/// blocks.size() images. Throws InvalidArgument, before appending anything,
/// for an id out of range, or host_stride < the image bytes with more than
/// one block (the images would overlap).
void append_host_copy_regions(std::span<const BlockPool> pools, std::span<const BlockId> blocks,
                              std::byte* host, std::size_t host_stride,
                              std::vector<HostCopyRegion>& out);

/// Every pool's extent [base, base + extent()), sorted by address, with
/// ranges that overlap or touch merged: the memory a transport registers to
/// reach every block. One range for a block-major cache; up to 2 x layers
/// for a layer-major one (fewer where allocations happen to touch). Throws
/// InvalidArgument when an extent overflows.
std::vector<DeviceRegion> pool_extents(std::span<const BlockPool> pools);

}  // namespace kvport
