// SPDX-License-Identifier: Apache-2.0
#include "staging.hpp"

#include <fmt/format.h>

#include "kvport/core/block_regions.hpp"
#include "kvport/platform/error.hpp"

namespace kvport::transfer {

namespace {

std::uint64_t total_of(std::span<const std::pair<std::uint64_t, std::uint64_t>> ranges) {
  std::uint64_t total = 0;
  for (const auto& [begin, end] : ranges)
    total += end - begin;
  return total;
}

std::vector<std::pair<std::uint64_t, std::uint64_t>> merged_extents(const PagedKvCache& cache) {
  std::vector<std::pair<std::uint64_t, std::uint64_t>> out;
  for (const DeviceRegion& r : pool_extents(cache.memory_pools()))
    out.emplace_back(r.ptr.address(), r.ptr.address() + r.bytes);
  return out;
}

}  // namespace

Staging::Staging(PagedKvCache& cache)
    : cache_(cache),
      ranges_(merged_extents(cache)),
      mirror_(cache.backend(), total_of(ranges_)),
      stream_(cache.backend().create_stream()) {
  for (const BlockPool& p : cache.memory_pools()) {
    pools_.push_back(
        {p.base.address(), mirror_of(p.base.address()), p.stride, p.region_bytes, p.dense()});
  }
}

std::uint64_t Staging::mirror_base() const noexcept {
  return reinterpret_cast<std::uint64_t>(mirror_.data());
}

std::uint64_t Staging::mirror_of(std::uint64_t addr) const {
  std::uint64_t offset = 0;
  for (const auto& [begin, end] : ranges_) {
    if (addr >= begin && addr < end) return mirror_base() + offset + (addr - begin);
    offset += end - begin;
  }
  throw InvalidArgument(fmt::format("staging: address {:#x} is outside the pools", addr));
}

PoolAddresses Staging::mirror_addresses(const PoolAddresses& device) const {
  PoolAddresses out = device;
  for (auto& a : out.k_base)
    a = mirror_of(a);
  if (cache_.config().has_v()) {  // K-only layers: the V entries stay 0
    for (auto& a : out.v_base)
      a = mirror_of(a);
  }
  return out;
}

std::vector<HostCopyRegion> Staging::regions(std::span<const BlockId> blocks) const {
  std::vector<HostCopyRegion> out;
  for (const Pool& p : pools_) {
    for (std::size_t i = 0; i < blocks.size();) {
      const std::uint64_t first = blocks[i];
      std::uint64_t bytes = p.region_bytes;
      std::size_t j = i + 1;
      while (p.dense && j < blocks.size() && blocks[j] == blocks[j - 1] + 1) {
        bytes += p.stride;
        ++j;
      }
      const std::uint64_t offset = first * p.stride;
      out.push_back({DevicePtr(p.device_base + offset),
                     reinterpret_cast<void*>(p.mirror_base + offset), bytes});
      i = j;
    }
  }
  return out;
}

void Staging::to_mirror(std::span<const HostCopyRegion> regions) {
  cache_.backend().copy_batch_d2h_async(regions, stream_);
  cache_.backend().synchronize(stream_);
}

void Staging::from_mirror(std::span<const HostCopyRegion> regions) {
  cache_.backend().copy_batch_h2d_async(regions, stream_);
  cache_.backend().synchronize(stream_);
}

}  // namespace kvport::transfer
