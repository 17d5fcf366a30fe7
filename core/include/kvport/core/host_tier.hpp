// SPDX-License-Identifier: Apache-2.0
// HostTier: a host-memory tier under the prefix cache. Blocks evicted from
// the device are written back to pinned host memory, and a lookup that runs
// past the device's cached prefix continues in host memory and copies those
// blocks back in (onload).
#pragma once

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <optional>
#include <source_location>
#include <span>
#include <string_view>
#include <utility>
#include <vector>

#include "kvport/core/block_hash.hpp"
#include "kvport/core/lower_tier.hpp"
#include "kvport/core/paged_kv_cache.hpp"
#include "kvport/core/prefix_cache.hpp"
#include "kvport/platform/backend.hpp"
#include "kvport/platform/stream.hpp"

namespace kvport {

/// When a cached device block is copied to the host tier.
enum class TierPolicy : std::uint8_t {
  /// When it is evicted from the device (and not on the host already). The
  /// default: only blocks the device drops cross the link.
  write_back,
  /// As soon as it is registered (filled): queued by the next poll() after
  /// its PrefixCache::insert (an engine registers a block before the forward
  /// pass writes its KV, so never earlier: an allocation that finds the free
  /// list empty meanwhile gives the queued blocks no sequence holds back to
  /// the LRU uncopied instead), so an eviction later needs no copy. Blocks the
  /// device evicts before their copy (or that the host dropped) are still
  /// written back.
  write_through,
};

/// "write-back" / "write-through" ("unknown" outside the enum).
const char* to_string(TierPolicy policy) noexcept;
/// Parses "write-back" or "write-through"; nullopt for anything else.
std::optional<TierPolicy> parse_tier_policy(std::string_view text) noexcept;

/// What happens to a host block when a lookup copies it onto the device.
enum class TierInclusion : std::uint8_t {
  /// The host gives its slot back: the device and host tiers hold disjoint
  /// blocks and add up to one larger cache (the default: on a Mooncake-style
  /// trace it hits more: docs/performance.md has the figures). The block
  /// is written back again when the device evicts it.
  exclusive,
  /// The host keeps its copy: a block onloaded once and evicted again costs
  /// no second write-back, but occupies both tiers meanwhile.
  inclusive,
};

/// "exclusive" / "inclusive".
const char* to_string(TierInclusion inclusion) noexcept;

/// Configuration of a HostTier.
struct HostTierOptions {
  /// Host blocks (slots), each holding one device block: every layer's K and
  /// V, contiguously. In [1, kMaxHostBlocks].
  std::size_t num_host_blocks = 0;
  TierPolicy policy = TierPolicy::write_back;
  TierInclusion inclusion = TierInclusion::exclusive;
  /// Blocks written back at once when an allocation finds the device's free
  /// list empty (least recently used first, one copy call for all of them):
  /// the allocation then waits for that one copy, and the next
  /// offload_batch - 1 allocations find free blocks. In [1, 65536].
  std::size_t offload_batch = 32;
  /// When > 0, poll() writes back least recently used blocks ahead of need
  /// (without waiting) while fewer than this many device blocks are free or
  /// being written back, so allocations rarely wait. 0: only on demand.
  std::size_t free_watermark = 0;
  /// With a lower tier (set_lower_tier): when fewer than this many host slots
  /// are free, poll() writes the least recently used host blocks down (one
  /// batch) until twice this many are, so that a lookup that reads from the
  /// lower tier, and a write-back, find free slots instead of writing first.
  /// 0: the host writes down only when a call needs the room. At most
  /// num_host_blocks / 2.
  std::size_t host_free_watermark = 0;
  /// How long the tier waits for its copies (an onload in a lookup, a
  /// write-back an allocation needs, synchronize()). A batch that has not
  /// completed by then is abandoned: its device blocks and host slots are
  /// quarantined (held, invisible, not reused) until the copy can no longer
  /// write into them (its event completes: poll() checks, and the destructor
  /// waits without a deadline), the tier goes on with a new stream, and a
  /// lookup keeps the hit it had without those blocks. Counted in
  /// HostTierCounters::stalled_transfers. 0: wait without a deadline. In
  /// [0, 1 hour].
  std::chrono::milliseconds copy_timeout{10000};

  static constexpr std::chrono::milliseconds kMaxCopyTimeout{3600 * 1000};
  static constexpr std::size_t kMaxHostBlocks = (std::size_t{1} << 32) - 2;
  static constexpr std::size_t kMaxOffloadBatch = 65536;
};

/// Monotonic counters since construction. Bytes are the bytes copied.
struct HostTierCounters {
  std::uint64_t offloads = 0;       ///< blocks copied device -> host and published
  std::uint64_t offload_bytes = 0;  ///< bytes of those
  std::uint64_t onloads = 0;        ///< blocks copied host -> device and registered
  std::uint64_t onload_bytes = 0;   ///< bytes of those
  /// Blocks a lookup found on the host. host_hits + lower_tier_hits ==
  /// onloads.
  std::uint64_t host_hits = 0;
  std::uint64_t host_evictions = 0;  ///< host blocks dropped to make room for newer ones
  /// Copy batches that failed (at the call, or at the stream's synchronize)
  /// and were rolled back, and the blocks they carried.
  std::uint64_t aborted_transfers = 0;
  std::uint64_t aborted_blocks = 0;
  /// Device evictions that needed no copy: the host had the block already.
  std::uint64_t already_on_host = 0;
  /// Device evictions dropped without a copy: every host slot was in flight.
  std::uint64_t dropped_offloads = 0;
  /// Allocations that waited for copies in flight (the device's free list was
  /// empty and only write-backs could free blocks); counted once each.
  std::uint64_t offload_waits = 0;
  /// Host hits cut short because no device block was free for the copy.
  std::uint64_t onload_shortfalls = 0;
  /// Copy batches abandoned at HostTierOptions::copy_timeout, and the block
  /// copies they carried (their memory quarantined until they end).
  std::uint64_t stalled_transfers = 0;
  std::uint64_t stalled_blocks = 0;
  // The lower tier (set_lower_tier; all 0 without one).
  /// Ready host blocks offered to the lower tier as the host dropped them
  /// (to make room), and how many of those it kept (the rest: not admitted,
  /// held already, or failed; the store counts which).
  std::uint64_t lower_tier_offers = 0;
  std::uint64_t lower_tier_writes = 0;
  /// Blocks a lookup read from the lower tier into host slots and onloaded.
  std::uint64_t lower_tier_hits = 0;
  /// Blocks a lookup found in the lower tier but did not get: the read
  /// failed, came short, did not verify or missed its deadline, or no host
  /// slot was free for it (the hit ends there).
  std::uint64_t lower_tier_shortfalls = 0;
  /// Host blocks written down to make room inside a lookup (before it could
  /// read the lower tier's blocks: on the lookup's path), and by poll() to
  /// keep host_free_watermark slots free (off it).
  std::uint64_t lookup_spills = 0;
  std::uint64_t poll_spills = 0;

  /// Adds every counter of `other` (HybridHostTier's totals over groups).
  HostTierCounters& operator+=(const HostTierCounters& other) noexcept;
};

/// A host-memory tier under a PrefixCache, keyed by the same chained block
/// hashes, with an LRU order of its own.
///
/// A lookup through the PrefixCache (or BlockTable::reuse_cached_prefix)
/// returns the longest prefix cached on the device and then continues on the
/// host: those blocks are copied into freshly allocated device blocks as one
/// batch, registered in the device prefix cache, and appended to the match
/// (PrefixMatch::lower_tier_blocks says how many). The lookup waits for that
/// copy: the caller gets blocks whose contents are there.
///
/// Lower tier (set_lower_tier, e.g. the disk tier): the host's least
/// recently used blocks, when it drops them for newer ones, are offered to the
/// lower tier first, one batch per call that needs the room (a write-back, a
/// lookup); a lookup continues past the host's blocks in the lower tier: what
/// it finds there is read into host slots (one batch), becomes a host block,
/// and is onloaded with the host's hits in the one device batch. Exclusive
/// inclusion erases a block from the lower tier once it is on the host.
///
/// States. A device block is free, evictable, in use (PrefixCache), or held
/// by the tier while its write-back copy is in flight (counted as in use:
/// not handed out by any allocation until the copy completed). A host slot is
/// free, filling (its copy is in flight; invisible to lookups) or ready (in
/// the host index and LRU order). Completion is observed with an event
/// (poll(), non-blocking) or a synchronize of the tier's own stream (when an
/// allocation has nothing else to take, and for an onload); only then are
/// slots published and blocks freed. A copy that fails, at the call or at
/// that synchronize, rolls back every transfer not yet completed: its slots
/// are freed, its device blocks are released (a failed write-back leaves the
/// block evicted but not cached on the host; a failed onload leaves the
/// lookup with its device hit only), and aborted_transfers counts it.
///
/// Streams. Copies run on a stream the tier creates. Before each copy the
/// tier's stream waits (an event, not a host wait) for the work queued so far
/// on `compute_stream`, where the engine's kernels write the blocks' KV; work
/// on other streams that writes blocks must be ordered before it.
///
/// Host memory: one pinned allocation (Backend::alloc_host) of
/// num_host_blocks * slot_bytes(), made at construction, and the slots'
/// origins for events (origin_bytes_per_slot() each, ordinary memory).
///
/// Not thread-safe (like PrefixCache). The PrefixCache must outlive the tier;
/// the constructor installs the tier in it (PrefixCache::set_tier) and the
/// destructor waits for every copy in flight, gives back every block it
/// holds and uninstalls it.
class HostTier final : public PrefixCacheTier {
 public:
  /// Throws InvalidArgument for options out of range, for a prefix cache
  /// that already has a tier, and when the host blocks need more memory than
  /// the machine has; OutOfMemory when the memory cannot be pinned.
  HostTier(PrefixCache& prefix_cache, const HostTierOptions& options, StreamView compute_stream);
  /// As above, with the backend's default stream as the compute stream.
  HostTier(PrefixCache& prefix_cache, const HostTierOptions& options);
  ~HostTier() override;
  HostTier(const HostTier&) = delete;
  HostTier& operator=(const HostTier&) = delete;

  /// Call once per engine step, after the step's kernels are queued on the
  /// compute stream: completes the copies that finished (non-blocking),
  /// queues the write-through copies of blocks registered since the last
  /// call, and writes back ahead to keep free_watermark blocks free; with a
  /// lower tier and host_free_watermark, writes host blocks down to keep that
  /// many host slots free (synchronously, as the lower tier's put is).
  void poll();

  /// Waits for every copy in flight and completes it (or rolls it back, when
  /// the stream reports an error: the error is logged and counted, not
  /// thrown).
  void synchronize();

  /// Writes back up to `max_blocks` (at most num_host_blocks) least recently
  /// used evictable device blocks now (evicting them) without waiting; they
  /// become free when the copy completes (poll / synchronize). Returns how
  /// many were evicted.
  std::size_t offload(std::size_t max_blocks);

  // ---- lower tier (lower_tier.hpp) ---------------------------------------------------------

  /// Installs `store` under the host (nullptr: none, the default): from then
  /// on the host offers it the blocks it drops and lookups continue in it
  /// (see the class comment); holds() counts its blocks. The store must stay
  /// valid until it is uninstalled or the tier destroyed. The store
  /// announces its own blocks to the tier's event sink
  /// (LowerTierStore::set_event_sink: the tier's source, medium DISK), and
  /// what it holds already at once when a sink is installed; an uninstalled
  /// store announces nothing more. Throws InvalidArgument when its
  /// block_bytes() is not slot_bytes(), std::bad_alloc announcing what it
  /// holds (nothing changes then).
  void set_lower_tier(LowerTierStore* store);
  LowerTierStore* lower_tier() const noexcept;

  // ---- events (cache_events.hpp) -----------------------------------------------------------

  /// Installs `sink` (nullptr: none, the default) for the host's events,
  /// announced as `source` (medium CPU; HybridHostTier sets the group): stored
  /// when a slot's copy completed and it became visible to lookups (never
  /// before: a copy that fails, is rolled back or is abandoned at its deadline
  /// announces nothing), removed when a visible slot is dropped (reused for a
  /// newer block, or given back after an exclusive onload: the block then
  /// leaves the host, and the device's prefix cache announces it stored),
  /// cleared by the destructor when a sink is still installed. The lower tier
  /// announces its own blocks to the same sink with the same source but
  /// medium DISK: stored once durable there (with the parent and tokens the
  /// host slot kept, which the tier hands it with the blocks), removed when
  /// the store drops them. Called inside
  /// the tier's calls and the prefix cache's (on the cache's thread); the sink
  /// must stay valid until it is uninstalled or the tier destroyed. Each slot
  /// keeps the parent, tokens and extra key its block was registered with on
  /// the device (origin_bytes_per_slot(), allocated at construction), taken
  /// from PrefixCache::block_origin: installing a sink makes the prefix cache
  /// keep origins (PrefixCache::keep_block_origins; std::bad_alloc when it
  /// cannot), and a block that reached the host before is announced without
  /// tokens. An onloaded block is registered on the device with its origin.
  void set_event_sink(CacheEventSink* sink,
                      EventSource source = {Medium::cpu, std::nullopt, std::nullopt, std::nullopt});
  CacheEventSink* event_sink() const noexcept;
  const EventSource& event_source() const noexcept;
  /// The BlockStored events of every visible host block (one per block, a
  /// block after its parent where the parent is visible too), with
  /// event_source(); then, with a lower tier, its LowerTierStore::snapshot
  /// (medium DISK, without parents or tokens). On the tier's thread, as
  /// PrefixCache::snapshot.
  void snapshot(CacheEventSink& sink) const;
  /// Host memory each slot's origin takes (besides slot_bytes()): 32 bytes
  /// plus block_size token ids.
  std::size_t origin_bytes_per_slot() const noexcept;

  // ---- state --------------------------------------------------------------------------

  /// Whether `hash` is on the host and visible to lookups (its copy done).
  bool is_on_host(const BlockHash& hash) const;
  /// Host blocks by state.
  std::size_t num_host_blocks() const noexcept;
  std::size_t num_ready_blocks() const noexcept;
  std::size_t num_filling_blocks() const noexcept;
  std::size_t num_free_host_blocks() const noexcept;
  /// Device blocks the tier holds while their copies are in flight or queued
  /// (write-backs and write-throughs), or quarantined.
  std::size_t num_held_device_blocks() const noexcept;
  /// Device blocks and host slots held by copies abandoned at their deadline
  /// (HostTierOptions::copy_timeout) that have not ended yet.
  std::size_t num_quarantined_blocks() const noexcept;
  std::size_t num_quarantined_slots() const noexcept;
  /// Bytes of one host block: every layer's K and V block (K only for K-only
  /// layers).
  std::size_t slot_bytes() const noexcept;
  /// The host blocks' ready hashes, least recently used first. O(n), for
  /// tests and diagnostics.
  std::vector<BlockHash> host_lru_order() const;
  const HostTierOptions& options() const noexcept;
  const HostTierCounters& counters() const noexcept;
  PrefixCache& prefix_cache() const noexcept;

  /// PrefixCache::check_invariants() plus the tier's: every host slot in
  /// exactly one state and free + filling + ready == num_host_blocks; the
  /// host index holds exactly the filling and ready slots under their hashes;
  /// the host LRU order holds exactly the ready slots; no slot is pinned
  /// between calls; every device block the tier holds is in use and
  /// uncached (write-back) or cached (write-through). O(num_host_blocks +
  /// num_blocks).
  InvariantReport check_invariants() const;

  /// The pinned host memory of every slot (one allocation of
  /// num_host_blocks x slot bytes), e.g. to register it with a transfer agent
  /// (AgentOptions::host_regions) so that peers can read host-tier blocks.
  std::span<std::byte> slot_memory() const noexcept;

  /// The regions of one block's copy between the device and a host slot at
  /// `slot` (slot_bytes() bytes): the block's image over
  /// cache.memory_pools(), each layer's K block then its V block (none for
  /// K-only layers) in layer order: one region per block in block-major
  /// layout, 2 * num_layers (num_layers K-only) in layer-major, whose pools
  /// are separate allocations even when adjacent. Appended to `out`
  /// (append_host_copy_regions of block_regions.hpp for one block); throws
  /// InvalidArgument for an out-of-range block, before appending.
  static void append_block_regions(const PagedKvCache& cache, BlockId block, std::byte* slot,
                                   std::vector<HostCopyRegion>& out);
  /// Bytes of one host slot for `cache`: its config's bytes_per_block().
  static std::size_t slot_bytes_for(const PagedKvCache& cache);

 private:
  void on_free_list_empty(PrefixCache& cache, const std::source_location& where) override;
  void on_insert(PrefixCache& cache, BlockId block, const BlockHash& hash) override;
  std::size_t reclaimable_blocks() const noexcept override;
  std::size_t find_run(std::span<const BlockHash> hashes, std::size_t start) noexcept override;
  TierLoad load_run(std::span<const BlockId> blocks) noexcept override;
  BlockOrigin run_origin(std::size_t i) const noexcept override;
  void finish_run() noexcept override;
  bool holds(const BlockHash& hash) const noexcept override;

  struct State;
  std::unique_ptr<State> state_;
};

}  // namespace kvport
