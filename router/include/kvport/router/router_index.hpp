// SPDX-License-Identifier: Apache-2.0
// RouterIndex: which engine instance holds which KV block, learned from the
// instances' cache events (cache_events.hpp), exact under the faults of an
// at-least-once event stream: duplicates, gaps (replayed or not), restarts,
// snapshots and instances that go silent.
//
// The index keys blocks by the 64-bit hash events carry (event_hash: the low
// 64 bits of kvport's chained block hash), so a request is matched by hashing
// its tokens the same way (hash_block, block_size of the events). Each block
// keeps one 64-bit instance set per tier (GPU, CPU, other), so at most 64
// instances.
//
// The decoder of the wire (ZeroMQ SUB + msgpack) is not part of this target:
// whoever subscribes hands each decoded batch to apply(), replay answers too,
// and asks needs() what to request.
#pragma once

#include <array>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <optional>
#include <span>
#include <string_view>
#include <utility>
#include <vector>

#include "kvport/core/block_hash.hpp"
#include "kvport/core/cache_events.hpp"

namespace kvport::router {

/// An instance's slot in the index: 0 .. kMaxInstances-1.
using InstanceId = std::uint32_t;

/// The most instances one index follows (the width of its per-block sets).
inline constexpr std::size_t kMaxInstances = 64;

/// The clock of timeouts (expire) and of last-heard times.
using Clock = std::chrono::steady_clock;

/// Where an instance holds a block, as the index scores it: GPU and CPU
/// (vLLM's "GPU"/"CPU" media), other for every other medium ("DISK", or a
/// name the index does not know).
enum class Tier : std::uint8_t { gpu = 0, cpu = 1, other = 2 };
inline constexpr std::size_t kNumTiers = 3;

/// The tier of a published medium name ("GPU" -> gpu, "CPU" -> cpu, anything
/// else -> other).
Tier tier_of_medium(std::string_view medium) noexcept;

/// Options of a RouterIndex. Checked by the constructor (InvalidArgument).
struct IndexOptions {
  /// Tokens per block the router hashes requests with; > 0. Every BlockStored
  /// must carry the same block_size: an instance whose events carry another
  /// is flagged (InstanceStatus::mismatched_block_size) and its stores are
  /// not indexed, since its hashes can never match the router's.
  std::uint32_t block_size = 16;
  /// Batches held per instance while a gap is open (waiting for the replay or
  /// a snapshot); 1 .. 1,000,000. A batch that finds the buffer full is
  /// dropped (counted): the replay, which starts at the first missing
  /// sequence, delivers it again.
  std::size_t max_held_batches = 1024;
  /// An instance not heard from for longer than this is dropped by expire();
  /// > 0.
  Clock::duration instance_timeout = std::chrono::seconds(30);
  /// Which KV cache group of a hybrid model is indexed (events that carry a
  /// group_idx; events without one are always indexed). nullopt: per
  /// instance, the first group whose BlockStored says kv_cache_spec_kind
  /// "full_attention" or "mla_attention" (or group 0 when its stores carry no
  /// kind); events of every other group are counted and ignored.
  std::optional<std::uint32_t> scored_group;
};

/// What the subscriber should ask an instance's publisher for.
struct Need {
  enum class Kind : std::uint8_t {
    nothing,      ///< in sync
    replay_from,  ///< a gap: request the replay of batches from `seq` on
    snapshot,     ///< the replay cannot close it, or the instance was dropped
  };
  Kind kind = Kind::nothing;
  /// The first missing sequence number (replay_from only).
  std::uint64_t seq = 0;

  friend bool operator==(const Need&, const Need&) = default;
};

/// What apply() did with a batch.
enum class ApplyResult : std::uint8_t {
  applied,    ///< in sequence: applied (and any held batches it unblocked)
  duplicate,  ///< seq already applied (or already held): dropped, counted
  held,       ///< after a gap, or while a snapshot is needed: kept for later
  /// A new stream (seq back to 0, or a known seq with another ts): the
  /// instance's entries were cleared, then the batch applied (seq 0) or held.
  restarted,
};

/// Monotonic counters of an index, over all instances.
struct IndexCounters {
  std::uint64_t batches_applied = 0;  ///< batches applied in sequence
  std::uint64_t duplicates = 0;       ///< batches dropped as already applied or held
  std::uint64_t gaps = 0;             ///< times an instance went from in sync to a gap
  std::uint64_t held_dropped = 0;     ///< batches not held: the buffer was full
  std::uint64_t snapshots = 0;        ///< apply_snapshot calls
  std::uint64_t restarts = 0;         ///< restarts detected (seq back to 0)
  std::uint64_t clears = 0;           ///< AllBlocksCleared events applied
  std::uint64_t expired = 0;          ///< instances dropped by expire()
  std::uint64_t blocks_stored = 0;    ///< (block, tier) entries added
  std::uint64_t blocks_removed = 0;   ///< (block, tier) entries removed
  /// BlockStored of a block the instance already held in that tier (no change).
  std::uint64_t redundant_stores = 0;
  /// BlockRemoved of a block the instance did not hold in that tier: ignored.
  std::uint64_t unknown_removals = 0;
  /// Events of a KV cache group other than the scored one: ignored.
  std::uint64_t other_group_events = 0;
  /// BlockStored events whose block_size is not the router's: not indexed.
  std::uint64_t block_size_mismatches = 0;
};

/// One instance as the index sees it.
struct InstanceStatus {
  InstanceId id = 0;
  /// False once expire() dropped it, until a snapshot or a restart brings it
  /// back: a dropped instance is no routing candidate.
  bool active = true;
  /// The last sequence number applied (nullopt: none yet).
  std::optional<std::uint64_t> last_seq;
  Need need;
  std::size_t held_batches = 0;
  /// (block, tier) entries it holds, per tier.
  std::array<std::size_t, kNumTiers> blocks{};
  /// The block_size its events carried where it differs from the router's
  /// (the last one seen); nullopt while they agree.
  std::optional<std::uint32_t> mismatched_block_size;
  Clock::time_point last_heard{};
};

/// The instances holding one block, one bit per instance, per tier.
struct BlockHolders {
  std::array<std::uint64_t, kNumTiers> tiers{};
  /// Instances holding it in any tier.
  std::uint64_t any() const noexcept { return tiers[0] | tiers[1] | tiers[2]; }
};

/// The index. Not thread-safe: one subscriber thread applies and decides (a
/// router of many threads shards requests over copies, or locks).
///
/// Sequence rules, per instance (docs/events.md, "Router index"):
///  - seq == last+1 (0 for the first batch) applies;
///  - seq <= last is a duplicate (at-least-once delivery), dropped and counted;
///  - seq > last+1 opens a gap: the batch is held (at most max_held_batches),
///    needs() says replay_from(last+1); batches that close the gap apply, then
///    the held ones in order (a gap left after them asks for the replay from
///    there); replay_failed() turns the need into a snapshot, which
///    apply_snapshot() satisfies (batches keep being held meanwhile);
///  - seq 0 after a batch other than seq 0 (or a seq 0 batch with another ts
///    than the first) is a restart: the instance's entries are cleared first;
///    so is a batch whose seq was applied but whose ts differs from the one
///    applied (known for the last 64) or is later than the last applied
///    batch's (a restart whose first batches were lost): entries cleared,
///    the batch held, replay_from(0) needed;
///  - AllBlocksCleared clears the instance's entries (of one medium when it
///    names one);
///  - an instance silent for longer than instance_timeout is dropped by
///    expire(): entries cleared, inactive, needs a snapshot (or a restart).
class RouterIndex {
 public:
  /// Throws InvalidArgument for options outside their ranges.
  explicit RouterIndex(IndexOptions options);
  ~RouterIndex();
  RouterIndex(const RouterIndex&) = delete;
  RouterIndex& operator=(const RouterIndex&) = delete;
  RouterIndex(RouterIndex&&) noexcept;
  RouterIndex& operator=(RouterIndex&&) noexcept;

  const IndexOptions& options() const noexcept;

  // ---- instances ----------------------------------------------------------------

  /// Starts following instance `id` (< kMaxInstances), heard from at `now`,
  /// expecting its stream from seq 0. Throws InvalidArgument for an id out of
  /// range or already added.
  void add_instance(InstanceId id, Clock::time_point now);
  /// Stops following `id` and drops its entries. Throws InvalidArgument for
  /// an unknown instance.
  void remove_instance(InstanceId id);
  bool has_instance(InstanceId id) const noexcept;
  /// Followed instances, one bit each.
  std::uint64_t instance_mask() const noexcept;
  /// Active instances (followed and not dropped by expire), one bit each.
  std::uint64_t active_mask() const noexcept;

  // ---- events -------------------------------------------------------------------

  /// Applies, holds or drops one batch of instance `id` received at `now`
  /// (see the class comment). O(blocks in the batch), except that clearing an
  /// instance (AllBlocksCleared, a restart) scans the table: O(table).
  /// Allocates only when the table grows or a batch is held. Throws
  /// InvalidArgument for an unknown instance.
  ApplyResult apply(InstanceId id, const EventBatch& batch, Clock::time_point now);

  /// Replaces everything instance `id` holds (a table scan) by the blocks of `events`
  /// (BlockStored of the cached set; other events are applied in order too)
  /// valid at sequence `seq`, then applies the held batches that follow it.
  /// `ts`: the ts of batch `seq` (the publisher's clock when the snapshot was
  /// taken): held batches earlier than it (of a stream before a restart) are
  /// dropped, the others follow the snapshot; and a restart whose first
  /// batches are lost is told from duplicates right after it. Unknown: every
  /// held batch is dropped (the next one asks for their replay). Brings a
  /// dropped instance back.
  /// Throws InvalidArgument for an unknown instance.
  void apply_snapshot(InstanceId id, std::uint64_t seq, std::span<const CacheEvent> events,
                      Clock::time_point now, std::optional<double> ts = std::nullopt);

  /// What the subscriber should request from instance `id` now. Throws
  /// InvalidArgument for an unknown instance.
  Need needs(InstanceId id) const;

  /// The replay answer ended without closing the gap (the publisher's ring
  /// no longer has the batches): instance `id` needs a snapshot. No effect
  /// unless a replay was needed. Throws InvalidArgument for an unknown one.
  void replay_failed(InstanceId id);

  /// Drops every active instance not heard from for longer than
  /// instance_timeout before `now`: entries cleared, inactive, needs a
  /// snapshot. Returns the dropped instances, one bit each. O(instances),
  /// plus a table scan when one is dropped.
  std::uint64_t expire(Clock::time_point now);

  // ---- queries ------------------------------------------------------------------

  /// Who holds the block with event hash `hash` (all zero: nobody).
  BlockHolders holders(std::uint64_t hash) const noexcept;
  /// Hints that holders(hash) comes soon: starts loading its table slot, so
  /// that lookups of several blocks overlap their cache misses.
  void prefetch(std::uint64_t hash) const noexcept;

  /// The holders of a request's blocks, in order: fills holders[0..n) (the
  /// vector is resized to hashes.size(), its capacity reused) for the first
  /// n blocks such that some instance of `candidates` holds every block up to
  /// and including block n-1 (in any tier), and returns n. O(n) lookups.
  std::size_t match(std::span<const std::uint64_t> hashes, std::uint64_t candidates,
                    std::vector<BlockHolders>& holders) const;

  /// Instance `id`'s state. Throws InvalidArgument for an unknown instance.
  InstanceStatus status(InstanceId id) const;

  /// Every (event hash, tier) instance `id` holds, sorted. O(table): for tests
  /// and diagnostics. Throws InvalidArgument for an unknown instance.
  std::vector<std::pair<std::uint64_t, Tier>> blocks_of(InstanceId id) const;

  /// Distinct blocks in the table.
  std::size_t num_blocks() const noexcept;
  const IndexCounters& counters() const noexcept;

 private:
  struct State;
  std::unique_ptr<State> state_;
};

}  // namespace kvport::router
