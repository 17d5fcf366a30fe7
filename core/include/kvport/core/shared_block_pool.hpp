// SPDX-License-Identifier: Apache-2.0
// SharedBlockPool: one pool of blocks that several KV cache groups draw from,
// so that memory goes to whichever group needs it at run time.
//
// Design (docs/hybrid-models.md "One pool over groups"): the pool owns
// `num_slots` layer slots, each a K pool (and a V pool) of num_blocks pages
// of equal bytes. A group of n <= num_slots layers is a PagedKvCache over the
// first n slots (its layer i uses slot i), so layers of different groups share
// the pool's memory; a block id indexes page b of every slot and belongs to
// one group at a time. The groups draw block ids from the pool's one LIFO free
// list; each group keeps its own refcounts, trace and prefix cache. When the
// free list is empty, an allocation in any group evicts the least recently
// released evictable block over every group's prefix cache (one LRU order
// across groups, by a pool-wide clock).
#pragma once

#include <cstddef>
#include <cstdint>
#include <source_location>
#include <vector>

#include "kvport/core/block_id.hpp"
#include "kvport/platform/backend.hpp"

namespace kvport {

class PagedKvCache;
class PrefixCache;
struct InvariantReport;

/// The page geometry of a shared pool.
struct SharedPoolGeometry {
  std::size_t num_slots = 0;     ///< layer slots: the most layers one group may have
  std::size_t k_page_bytes = 0;  ///< bytes of one layer's K for one block
  std::size_t v_page_bytes = 0;  ///< bytes of one layer's V for one block (0: K-only layers)
  /// Bytes one block id costs: num_slots * (k_page_bytes + v_page_bytes).
  std::size_t bytes_per_block() const noexcept;
  friend bool operator==(const SharedPoolGeometry&, const SharedPoolGeometry&) = default;
};

/// Block ids and memory several groups share. Build group caches over it with
/// PagedKvCache's pool constructor (and a PrefixCache over each); it must
/// outlive them. Not thread-safe (one scheduler thread, like PagedKvCache).
class SharedBlockPool {
 public:
  /// Allocates 2 * num_slots pools (num_slots when v_page_bytes is 0) of
  /// num_blocks pages on `backend`. Throws InvalidArgument for 0 blocks or
  /// slots, a zero K page, more than 2^32 - 1 blocks or a size that overflows;
  /// what Backend::alloc throws (everything allocated before is freed).
  /// `backend` must outlive the pool.
  SharedBlockPool(std::size_t num_blocks, SharedPoolGeometry geometry, Backend& backend);
  /// Frees the memory. Every cache over the pool must be gone (one left is a
  /// bug: logged, and the memory is freed anyway).
  ~SharedBlockPool();
  SharedBlockPool(const SharedBlockPool&) = delete;
  SharedBlockPool& operator=(const SharedBlockPool&) = delete;

  std::size_t num_blocks() const noexcept { return num_blocks_; }
  const SharedPoolGeometry& geometry() const noexcept { return geometry_; }
  /// Block ids on the free list (free in every group).
  std::size_t num_free_blocks() const noexcept { return free_list_.size(); }
  /// Blocks held only by a member prefix cache (evictable), over every group.
  std::size_t num_evictable_blocks() const noexcept;
  /// Free + evictable + what the members' lower tiers can reclaim: the blocks
  /// any one group's allocations can get.
  std::size_t num_available_blocks() const noexcept;
  /// Slot `slot`'s K pool (V pool); OutOfRange past num_slots, InvalidArgument
  /// for the V pool of a K-only pool.
  DevicePtr k_pool(std::size_t slot) const;
  DevicePtr v_pool(std::size_t slot) const;
  /// Bytes of every pool.
  std::size_t total_bytes() const noexcept { return total_bytes_; }
  Backend& backend() const noexcept { return *backend_; }
  /// Caches (groups) drawing from the pool now.
  std::size_t num_members() const noexcept { return members_.size(); }

  /// The pool's own invariants, across its members: every free-list entry in
  /// range, once, with refcount 0 in every group; every other block held
  /// (refcount > 0) by exactly one group; free + held == num_blocks. Each
  /// member's own invariants are its PrefixCache::check_invariants().
  /// O(num_blocks * members).
  InvariantReport check_invariants() const;

 private:
  friend class PagedKvCache;
  friend class PrefixCache;

  void attach(PagedKvCache* cache);
  void detach(PagedKvCache* cache) noexcept;
  void replace(PagedKvCache* from, PagedKvCache* to) noexcept;
  void attach(PrefixCache* prefix);
  void detach(PrefixCache* prefix) noexcept;
  std::uint64_t next_tick() noexcept { return ++clock_; }
  // Frees one block when the free list is empty: the member prefix cache
  // whose next victim is the oldest gives it up, a demoted block
  // (PrefixCache::release_demoted) before any other (through its lower tier
  // first, as its own allocations do).
  void make_room(const std::source_location& where);

  std::size_t num_blocks_ = 0;
  SharedPoolGeometry geometry_;
  Backend* backend_ = nullptr;
  std::vector<DevicePtr> pools_;  // [2 * slot + part]; V entries null for K-only
  std::size_t total_bytes_ = 0;
  std::vector<BlockId> free_list_;  // top of the stack at the back
  std::vector<PagedKvCache*> members_;
  std::vector<PrefixCache*> prefixes_;
  std::uint64_t clock_ = 0;
};

}  // namespace kvport
