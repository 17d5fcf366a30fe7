// SPDX-License-Identifier: Apache-2.0
#include "kvport/core/block_regions.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <cstdint>

#include "kvport/platform/error.hpp"

namespace kvport {
namespace {

void check_ids(std::span<const BlockPool> pools, std::span<const BlockId> blocks, const char* op) {
  for (const BlockPool& pool : pools) {
    for (std::size_t i = 0; i < blocks.size(); ++i) {
      if (blocks[i] >= pool.num_blocks) {
        throw OutOfRange(fmt::format("{}: block {} (entry {}) out of range (num_blocks = {})", op,
                                     blocks[i], i, pool.num_blocks));
      }
    }
  }
}

// The length of the run of consecutive ids starting at blocks[i] (1 in a pool
// that is not dense).
std::size_t run_length(const BlockPool& pool, std::span<const BlockId> blocks, std::size_t i) {
  std::size_t j = i + 1;
  if (pool.dense()) {
    while (j < blocks.size() && blocks[j] == blocks[j - 1] + 1)
      ++j;
  }
  return j - i;
}

}  // namespace

void append_block_regions(std::span<const BlockPool> pools, std::span<const BlockId> blocks,
                          std::vector<DeviceRegion>& out) {
  check_ids(pools, blocks, "append_block_regions");
  // Every run's bytes first, so that nothing is appended when one overflows.
  std::size_t regions = 0;
  for (const BlockPool& pool : pools) {
    for (std::size_t i = 0; i < blocks.size();) {
      const std::size_t n = run_length(pool, blocks, i);
      std::size_t bytes = 0;
      if (__builtin_mul_overflow(n, pool.region_bytes, &bytes)) {
        throw InvalidArgument(
            fmt::format("append_block_regions: a run of {} blocks of {} bytes overflows size_t", n,
                        pool.region_bytes));
      }
      ++regions;
      i += n;
    }
  }
  out.reserve(out.size() + regions);
  for (const BlockPool& pool : pools) {
    for (std::size_t i = 0; i < blocks.size();) {
      const std::size_t n = run_length(pool, blocks, i);
      out.push_back(DeviceRegion{pool.region(blocks[i]).ptr, n * pool.region_bytes});
      i += n;
    }
  }
}

std::vector<DeviceRegion> block_regions(const PagedKvCache& cache,
                                        std::span<const BlockId> blocks) {
  std::vector<DeviceRegion> out;
  append_block_regions(cache.memory_pools(), blocks, out);
  return out;
}

std::size_t block_image_bytes(std::span<const BlockPool> pools) {
  std::size_t total = 0;
  for (const BlockPool& pool : pools) {
    if (__builtin_add_overflow(total, pool.region_bytes, &total))
      throw InvalidArgument("block_image_bytes: a block's bytes overflow size_t");
  }
  return total;
}

void append_host_copy_regions(std::span<const BlockPool> pools, std::span<const BlockId> blocks,
                              std::byte* host, std::size_t host_stride,
                              std::vector<HostCopyRegion>& out) {
  check_ids(pools, blocks, "append_host_copy_regions");
  if (blocks.size() > 1) {
    const std::size_t image = block_image_bytes(pools);
    if (host_stride < image) {
      throw InvalidArgument(fmt::format(
          "append_host_copy_regions: host images {} bytes apart overlap (a block is {} bytes)",
          host_stride, image));
    }
  }
  out.reserve(out.size() + blocks.size() * pools.size());
  for (std::size_t i = 0; i < blocks.size(); ++i) {
    std::byte* image = host + i * host_stride;
    for (const BlockPool& pool : pools) {
      const DeviceRegion r = pool.region(blocks[i]);
      out.push_back(HostCopyRegion{r.ptr, image, r.bytes});
      image += r.bytes;
    }
  }
}

std::vector<DeviceRegion> pool_extents(std::span<const BlockPool> pools) {
  std::vector<DeviceRegion> ranges;
  ranges.reserve(pools.size());
  for (const BlockPool& pool : pools)
    ranges.push_back(DeviceRegion{pool.base, pool.extent()});
  std::sort(ranges.begin(), ranges.end(),
            [](const DeviceRegion& a, const DeviceRegion& b) { return a.ptr < b.ptr; });
  std::vector<DeviceRegion> merged;
  for (const DeviceRegion& r : ranges) {
    const std::uintptr_t end = r.ptr.offset(r.bytes).address();
    if (!merged.empty()) {
      DeviceRegion& last = merged.back();
      const std::uintptr_t last_end = last.ptr.address() + last.bytes;
      if (r.ptr.address() <= last_end) {
        last.bytes = std::max(last_end, end) - last.ptr.address();
        continue;
      }
    }
    merged.push_back(r);
  }
  return merged;
}

}  // namespace kvport
