// SPDX-License-Identifier: Apache-2.0
#include "kvport/core/shared_block_pool.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <limits>

#include "kvport/core/paged_kv_cache.hpp"
#include "kvport/core/prefix_cache.hpp"
#include "kvport/platform/error.hpp"
#include "kvport/platform/log.hpp"
#include "kvport/platform/size_math.hpp"

namespace kvport {

std::size_t SharedPoolGeometry::bytes_per_block() const noexcept {
  return saturating_mul(num_slots, k_page_bytes + v_page_bytes);
}

SharedBlockPool::SharedBlockPool(std::size_t num_blocks, SharedPoolGeometry geometry,
                                 Backend& backend)
    : num_blocks_(num_blocks), geometry_(geometry), backend_(&backend) {
  if (num_blocks == 0) throw InvalidArgument("SharedBlockPool: num_blocks must be > 0");
  if (num_blocks > kMaxCacheBlocks) {
    throw InvalidArgument(fmt::format(
        "SharedBlockPool: num_blocks = {} exceeds the 32-bit block id range", num_blocks));
  }
  if (geometry.num_slots == 0 || geometry.k_page_bytes == 0) {
    throw InvalidArgument(
        fmt::format("SharedBlockPool: {} layer slots of {}-byte K pages (both must be > 0)",
                    geometry.num_slots, geometry.k_page_bytes));
  }
  if (mul_overflows(num_blocks, geometry.k_page_bytes) ||
      mul_overflows(num_blocks, geometry.v_page_bytes) ||
      mul_overflows(num_blocks, geometry.bytes_per_block()) ||
      geometry.bytes_per_block() == std::numeric_limits<std::size_t>::max()) {
    throw InvalidArgument(fmt::format("SharedBlockPool: {} blocks of {} slots overflow size_t",
                                      num_blocks, geometry.num_slots));
  }
  pools_.reserve(2 * geometry.num_slots);
  try {
    for (std::size_t s = 0; s < geometry.num_slots; ++s) {
      pools_.push_back(backend.alloc(num_blocks * geometry.k_page_bytes));
      pools_.push_back(geometry.v_page_bytes != 0
                           ? backend.alloc(num_blocks * geometry.v_page_bytes)
                           : DevicePtr{});
    }
    free_list_.resize(num_blocks);
    for (std::size_t i = 0; i < num_blocks; ++i)
      free_list_[i] = static_cast<BlockId>(num_blocks - 1 - i);  // pop_back yields 0, 1, 2, ...
  } catch (...) {
    for (auto it = pools_.rbegin(); it != pools_.rend(); ++it) {
      if (!it->is_null()) backend.free(*it);
    }
    throw;
  }
  total_bytes_ = num_blocks * geometry.bytes_per_block();
}

SharedBlockPool::~SharedBlockPool() {
  if (!members_.empty() || !prefixes_.empty()) {
    log::error(fmt::format(
        "SharedBlockPool destroyed while {} caches and {} prefix caches still draw from it (a "
        "bug: destroy them first)",
        members_.size(), prefixes_.size()));
  }
  for (auto it = pools_.rbegin(); it != pools_.rend(); ++it) {
    if (!it->is_null()) backend_->free(*it);
  }
}

DevicePtr SharedBlockPool::k_pool(std::size_t slot) const {
  if (slot >= geometry_.num_slots) {
    throw OutOfRange(
        fmt::format("SharedBlockPool: slot {} out of range ({} slots)", slot, geometry_.num_slots));
  }
  return pools_[2 * slot];
}

DevicePtr SharedBlockPool::v_pool(std::size_t slot) const {
  const DevicePtr k = k_pool(slot);
  (void)k;
  if (geometry_.v_page_bytes == 0)
    throw InvalidArgument("SharedBlockPool: a pool of K-only layers has no V pools");
  return pools_[2 * slot + 1];
}

std::size_t SharedBlockPool::num_evictable_blocks() const noexcept {
  std::size_t n = 0;
  for (const PrefixCache* p : prefixes_)
    n += p->num_evictable_blocks();
  return n;
}

std::size_t SharedBlockPool::num_available_blocks() const noexcept {
  std::size_t n = free_list_.size();
  for (const PrefixCache* p : prefixes_)
    n += p->num_evictable_blocks() + p->tier_reclaimable_blocks();
  return n;
}

void SharedBlockPool::attach(PagedKvCache* cache) {
  members_.push_back(cache);
}

void SharedBlockPool::detach(PagedKvCache* cache) noexcept {
  std::erase(members_, cache);
}

void SharedBlockPool::replace(PagedKvCache* from, PagedKvCache* to) noexcept {
  std::replace(members_.begin(), members_.end(), from, to);
}

void SharedBlockPool::attach(PrefixCache* prefix) {
  prefixes_.push_back(prefix);
}

void SharedBlockPool::detach(PrefixCache* prefix) noexcept {
  std::erase(prefixes_, prefix);
}

void SharedBlockPool::make_room(const std::source_location& where) {
  // The least recently released block of any group, a demoted one
  // (PrefixCache::release_demoted) before every other.
  PrefixCache* oldest = nullptr;
  std::uint64_t oldest_tick = 0;
  bool oldest_demoted = false;
  for (PrefixCache* p : prefixes_) {
    std::uint64_t tick = 0;
    bool demoted = false;
    if (!p->oldest_evictable_tick(tick, demoted)) continue;
    if (oldest == nullptr || (demoted && !oldest_demoted) ||
        (demoted == oldest_demoted && tick < oldest_tick)) {
      oldest = p;
      oldest_tick = tick;
      oldest_demoted = demoted;
    }
  }
  if (oldest != nullptr) {
    oldest->give_up_one(where);
    return;
  }
  // No group has an evictable block: a lower tier may still free one (a
  // write-back whose copy is in flight).
  for (PrefixCache* p : prefixes_) {
    if (!free_list_.empty()) return;
    if (p->tier_reclaimable_blocks() != 0) p->give_up_one(where);
  }
}

InvariantReport SharedBlockPool::check_invariants() const {
  InvariantReport report;
  report.blocks_checked = num_blocks_;
  std::vector<std::uint32_t> on_free_list(num_blocks_, 0);
  for (std::size_t i = 0; i < free_list_.size(); ++i) {
    const BlockId b = free_list_[i];
    if (b >= num_blocks_) {
      report.add_violation(
          fmt::format("shared pool: free list slot {} holds out-of-range block {}", i, b));
      continue;
    }
    ++on_free_list[b];
  }
  for (std::size_t b = 0; b < num_blocks_; ++b) {
    std::size_t holders = 0;
    for (const PagedKvCache* m : members_) {
      if (m->ref_count(static_cast<BlockId>(b)) != 0) ++holders;
    }
    const std::uint32_t n = on_free_list[b];
    if (n > 1)
      report.add_violation(fmt::format("shared pool: block {} is on the free list {} times", b, n));
    if (n >= 1 && holders != 0) {
      report.add_violation(
          fmt::format("shared pool: block {} is on the free list and held by a group", b));
    }
    if (n == 0 && holders == 0) {
      report.add_violation(
          fmt::format("shared pool: block {} is neither free nor held by any group (leaked)", b));
    }
    if (holders > 1) {
      report.add_violation(
          fmt::format("shared pool: block {} is held by {} groups at once", b, holders));
    }
    if (n == 0) {
      ++report.blocks_in_use;
    } else {
      ++report.free_blocks;
    }
  }
  return report;
}

}  // namespace kvport
