// SPDX-License-Identifier: Apache-2.0
// LowerTierStore: the seam between the host tier (host_tier.hpp) and a
// store below it, such as the disk tier (kvport::disk::DiskTier,
// disk/disk_tier.hpp). Core defines it and never includes the store: the
// store's library implements it, and the engine (or `kvport replay`) hands
// an instance to HostTier::set_lower_tier.
#pragma once

#include <cstddef>
#include <span>
#include <vector>

#include "kvport/core/block_hash.hpp"

namespace kvport {

/// Blocks below the host tier, keyed by the same chained block hashes, each
/// an image of block_bytes() bytes (a host slot's bytes). Every call is
/// synchronous and bounded by the store's own deadline; none throws: a
/// failure is a shorter answer (fewer blocks kept or read), counted by the
/// store. Not thread-safe: the host tier calls it on its own thread.
class LowerTierStore {
 public:
  /// Told of the blocks that become visible in the store and of those that
  /// leave it (for the host tier's events, medium DISK). Called inside the
  /// store's calls; must not throw.
  class Listener {
   public:
    virtual ~Listener() = default;
    /// `hashes` became visible: their data and records are durable.
    virtual void stored(std::span<const BlockHash> hashes) noexcept = 0;
    /// `hashes` left the store: evicted for newer blocks, dropped after a
    /// failed or corrupted read, erased, or lost with a deleted file.
    virtual void removed(std::span<const BlockHash> hashes) noexcept = 0;
  };

  virtual ~LowerTierStore() = default;

  /// Bytes of one block's image; HostTier::set_lower_tier requires its
  /// slot_bytes().
  virtual std::size_t block_bytes() const noexcept = 0;

  /// Keeps the blocks `images[i]` under `hashes[i]` (the host is dropping
  /// them), as one batch: those it admits and does not hold already, each
  /// visible only once durable. Returns how many became visible. Spans of
  /// different sizes or images of the wrong size keep nothing (0).
  virtual std::size_t put(std::span<const BlockHash> hashes,
                          std::span<const std::span<const std::byte>> images) noexcept = 0;

  /// Whether `hash` is stored and visible (no I/O).
  virtual bool contains(const BlockHash& hash) const noexcept = 0;

  /// Reads the longest prefix of `hashes` whose blocks are stored and read
  /// back whole and verified into `out[i]` (block_bytes() each), as one
  /// batch, and returns its length. A block that fails to read or verify
  /// ends the prefix (fail closed: never served); buffers past the returned
  /// length may have been written. Too few or mis-sized buffers: 0.
  virtual std::size_t get_prefix(std::span<const BlockHash> hashes,
                                 std::span<const std::span<std::byte>> out) noexcept = 0;

  /// Makes each of `hashes` that is stored the most recently used (no I/O):
  /// the host tier touches what a lookup is about to read before it spills
  /// blocks down to make room, so that the spill evicts other blocks.
  virtual void touch(std::span<const BlockHash> hashes) noexcept = 0;

  /// Removes each of `hashes` that is stored (an exclusive tier's onload:
  /// the block moved up). Absent ones are ignored.
  virtual void erase(std::span<const BlockHash> hashes) noexcept = 0;

  /// Counts one hit of each of `hashes`, for an admission filter (a store
  /// that admits every block ignores it).
  virtual void note_hits(std::span<const BlockHash> hashes) noexcept = 0;

  /// Every visible hash, least recently used first (HostTier::snapshot).
  /// O(blocks); may throw std::bad_alloc.
  virtual std::vector<BlockHash> stored_hashes() const = 0;

  /// Installs `listener` (nullptr: none). It must stay valid until replaced.
  virtual void set_listener(Listener* listener) noexcept = 0;
};

}  // namespace kvport
