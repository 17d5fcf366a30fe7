// SPDX-License-Identifier: Apache-2.0
// Staging: the pinned host mirror of a cache's pools, for a transport that
// cannot register the cache's device memory. The mirror is one pinned
// allocation holding every pool's extent back to back; where block b of
// each pool lies in it (an offset per pool, plus b x stride) is computed
// once, at construction, so a block list maps to its device <-> mirror
// copies without planning (the peer planner, plan_block_regions, is for the
// two sides of a transfer only).
#pragma once

#include <cstdint>
#include <span>
#include <vector>

#include "kvport/core/paged_kv_cache.hpp"
#include "kvport/platform/backend.hpp"
#include "kvport/transfer/layout.hpp"

namespace kvport::transfer {

class Staging {
 public:
  /// Allocates the mirror (pinned host memory of the cache's backend: the sum
  /// of the pools' merged extents) and a stream. Throws what the backend
  /// throws (OutOfMemory).
  explicit Staging(PagedKvCache& cache);

  /// The mirror's address and size (what the transport registers).
  std::uint64_t mirror_base() const noexcept;
  std::uint64_t mirror_bytes() const noexcept { return mirror_.size(); }

  /// `device` (the cache's pool_addresses) with every base moved into the
  /// mirror: what peers address. V entries of K-only layers stay 0. Throws
  /// InvalidArgument for an address outside the pools.
  PoolAddresses mirror_addresses(const PoolAddresses& device) const;

  /// The device <-> mirror copies of `blocks` (ids below num_blocks, checked
  /// by the caller): per pool, in the order of `blocks`, a run of
  /// consecutive ids in a dense pool as one region. O(pools x blocks).
  std::vector<HostCopyRegion> regions(std::span<const BlockId> blocks) const;

  /// Copies `regions` device -> mirror (to_mirror) or mirror -> device
  /// (from_mirror) on the staging stream and waits for them.
  void to_mirror(std::span<const HostCopyRegion> regions);
  void from_mirror(std::span<const HostCopyRegion> regions);

 private:
  // Where one of the cache's memory pools is, on the device and in the mirror.
  struct Pool {
    std::uint64_t device_base = 0;
    std::uint64_t mirror_base = 0;
    std::uint64_t stride = 0;
    std::uint64_t region_bytes = 0;
    bool dense = false;
  };
  // Mirror address of device address `addr` (inside the pools).
  std::uint64_t mirror_of(std::uint64_t addr) const;

  PagedKvCache& cache_;
  std::vector<std::pair<std::uint64_t, std::uint64_t>> ranges_;  // merged device extents
  HostBuffer mirror_;
  std::vector<Pool> pools_;
  Stream stream_;
};

}  // namespace kvport::transfer
