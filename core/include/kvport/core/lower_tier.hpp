// SPDX-License-Identifier: Apache-2.0
// LowerTierStore: the seam between the host tier (host_tier.hpp) and a
// store below it, such as the disk tier (kvport::disk::DiskTier,
// disk/disk_tier.hpp). Core defines it and never includes the store: the
// store's library implements it, and the engine (or `kvport replay`) hands
// an instance to HostTier::set_lower_tier.
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>
#include <vector>

#include "kvport/core/block_hash.hpp"
#include "kvport/core/cache_events.hpp"

namespace kvport {

/// Blocks below the host tier, keyed by the same chained block hashes, each
/// an image of block_bytes() bytes (a host slot's bytes). Every call is
/// synchronous and bounded by the store's own deadline; none throws: a
/// failure is a shorter answer (fewer blocks kept or read), counted by the
/// store. The store announces its own blocks' events (set_event_sink), as
/// the host tier announces its own. Not thread-safe: the host tier calls it
/// on its own thread.
class LowerTierStore {
 public:
  virtual ~LowerTierStore() = default;

  /// Bytes of one block's image; HostTier::set_lower_tier requires its
  /// slot_bytes().
  virtual std::size_t block_bytes() const noexcept = 0;

  /// Keeps the blocks `images[i]` under `hashes[i]` (the host is dropping
  /// them), as one batch: those it admits and does not hold already, each
  /// visible only once durable, and announced then (stored, to the event
  /// sink) with `origins[i]`, what the block was registered with (empty: each
  /// announced bare). Returns how many became visible. Spans of different
  /// sizes (origins: empty or as many as hashes) or images of the wrong size
  /// keep nothing (0).
  virtual std::size_t put(std::span<const BlockHash> hashes,
                          std::span<const std::span<const std::byte>> images,
                          std::span<const BlockOrigin> origins) noexcept = 0;

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

  /// Every visible hash, least recently used first (snapshot).
  /// O(blocks); may throw std::bad_alloc.
  virtual std::vector<BlockHash> stored_hashes() const = 0;

  // ---- events: the store announces its own blocks ---------------------------

  /// Announces, from now on, every block that becomes visible (stored, with
  /// the origin put() was given) and every one that leaves (removed: evicted
  /// for newer blocks, dropped after a failed or corrupted read, erased, or
  /// lost with a deleted file) to `sink` (nullptr: none) as `source`, for
  /// blocks of `block_size` tokens. Announces nothing of what the store
  /// holds already (snapshot does). HostTier::set_lower_tier and
  /// HostTier::set_event_sink install the host tier's sink here, with its
  /// source and medium DISK. `sink` must stay valid until replaced.
  void set_event_sink(CacheEventSink* sink, EventSource source, std::uint32_t block_size) noexcept;
  /// The sink set_event_sink installed (nullptr: none).
  CacheEventSink* event_sink() const noexcept { return sink_; }
  /// The source the store announces as (medium DISK until set_event_sink).
  const EventSource& event_source() const noexcept { return source_; }
  /// Tokens per block, as its events say (0 until set_event_sink).
  std::uint32_t event_block_size() const noexcept { return block_size_; }
  /// Announces every visible block to `sink` as event_source(), least
  /// recently used first, without parents or tokens: a store keeps only its
  /// blocks' hashes, so only its live stored events carry origins. O(blocks);
  /// may throw std::bad_alloc before announcing anything.
  void snapshot(CacheEventSink& sink) const;

 protected:
  /// For implementations, inside put(): announces `visible`, those of the
  /// put's `hashes` that became visible, in the put's order, each with its
  /// entry of `origins` (parallel to `hashes`; empty: bare).
  void announce_stored(std::span<const BlockHash> hashes, std::span<const BlockOrigin> origins,
                       std::span<const BlockHash> visible) const noexcept;
  /// For implementations: announces that `hashes` left the store.
  void announce_removed(std::span<const BlockHash> hashes) const noexcept;

 private:
  CacheEventSink* sink_ = nullptr;
  EventSource source_{Medium::disk, std::nullopt, std::nullopt, std::nullopt};
  std::uint32_t block_size_ = 0;
};

}  // namespace kvport
