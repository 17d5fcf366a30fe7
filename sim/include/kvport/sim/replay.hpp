// SPDX-License-Identifier: Apache-2.0
// Replay of a Mooncake request trace (mooncake_trace.hpp) over a KV cache
// of groups: the simulation behind `kvport replay`. One workload
// (sim/src/replay_workload.cpp) runs every replay: run_replay sets it up over
// a minimal PrefixCache seen as its one group (HybridKvCache::over), and
// replay_model (model_replay.hpp) over a real model's planned groups. Both
// give a ReplayResult.
//
// Requests run under the one scheduler loop of scheduler.hpp, with these
// choices (RetirePoint::before_admission, retry_head_after_release):
//   - arrival: requests arrive at their timestamp (sorted stably); one that
//     could not run even alone in an empty cache (blocks for input_length +
//     output_length > capacity_blocks) is rejected at arrival; idle time
//     between arrivals is skipped, not simulated step by step.
//   - tokens: a request's prompt is its trace tokens, then unique tokens
//     (trace_tokens.hpp); every generated token is unique to the request.
//   - admission: FIFO, at most `concurrency` running. The head reuses its
//     cached prefix (HybridBlockTable::reuse_cached_prefix; over one group
//     it copies the last block as BlockTable does) and prefills the rest;
//     when the blocks for the rest are not available (free or evictable), it
//     gives the prefix back and waits until a running request releases
//     blocks. Its first admission counts its prompt and hit blocks and its
//     queueing delay; a re-admission after preemption counts its prefill as
//     recomputed.
//   - decode: one token per running request per step, appended to its
//     BlockTable; a token that starts a block needs one free or evictable
//     block, else the newest request is preempted. Full blocks are registered
//     in the prefix cache; released requests give their blocks back last
//     block first, so the prefix stays cached longest.
//   - host tier (host_tier_blocks > 0): a HostTier (core/host_tier.hpp) under
//     the prefix cache: evicted blocks are written back to host slots and a
//     lookup continues on the host past the device's cached prefix, copying
//     those blocks back (onload). At the end of every step the replay waits
//     for the copies queued at the end of the step before
//     (HostTier::synchronize(): a copy takes at most one step, and the run
//     does not depend on the backend's timing) and then calls
//     HostTier::poll(); after the last request poll() and synchronize().
//     With a tier the queue head first checks, without a lookup, that its
//     context could fit if every evictable block were free, so that a
//     failed attempt does not onload the host's blocks only to give them back. The simulated
//     cache's blocks are tiny (1 layer); the transfer bytes and times are
//     MODELED: blocks x the block bytes of `model` at block_size tokens, bf16,
//     over host_link_gbps. With a lower tier (ReplayOptions::lower_tier: the
//     disk) under the host, the host spills to it and lookups continue in
//     it; its I/O is real, of the simulated cache's small blocks.
// The same trace and options always give the same result (apart from the
// wall-clock fields).
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "kvport/core/block_table.hpp"
#include "kvport/core/cache_events.hpp"
#include "kvport/core/host_tier.hpp"
#include "kvport/core/layer_spec.hpp"
#include "kvport/core/lower_tier.hpp"
#include "kvport/core/paged_kv_cache.hpp"
#include "kvport/core/prefix_cache.hpp"
#include "kvport/platform/backend.hpp"
#include "kvport/sim/mooncake_trace.hpp"

namespace kvport::sim {

/// The state of a replay where a feed is asked for arrivals (ArrivalFeed).
struct ReplayProgress {
  double now_ms = 0.0;            ///< the simulated clock
  std::size_t running = 0;        ///< requests running
  std::size_t waiting = 0;        ///< requests queued
  std::size_t blocks_in_use = 0;  ///< blocks neither free nor evictable
  std::size_t cached_blocks = 0;  ///< blocks in the prefix cache
  std::size_t completed = 0;      ///< requests completed so far
  std::size_t rejected = 0;       ///< requests rejected at arrival so far
  /// The replay's prefix cache, as it is now (PrefixCache::snapshot gives
  /// what it holds, e.g. to compare with what its events announced).
  const PrefixCache* prefix = nullptr;
  /// The replay's host tier (null without one): with the prefix cache, every
  /// cache the replay's events come from (HostTier::snapshot).
  const HostTier* tier = nullptr;
};

/// Where a replay's requests come from when they are not all known at the
/// start: `kvport cluster` hands each engine instance the requests its
/// router sends it, as the cluster's clock reaches them. Without a feed a
/// replay runs every request of its trace at its timestamp. Called on the
/// replay's thread; a call may block (waiting for the cluster).
class ArrivalFeed {
 public:
  virtual ~ArrivalFeed() = default;
  /// One request handed to the replay: its index in the replay's requests,
  /// and when it arrives (its timestamp, or later: a request routed again).
  struct Arrival {
    std::size_t index = 0;
    double arrival_ms = 0.0;
  };
  /// Called at the start of every step (and whenever the replay is idle):
  /// appends to `out` every request arriving by `progress.now_ms` that was
  /// not handed over yet, and returns the earliest arrival of those it knows
  /// that come later (nullopt: none known yet). It may block until it knows
  /// every arrival up to now_ms. An index out of range or handed over twice
  /// makes the replay throw InvalidArgument.
  virtual std::optional<double> arrivals(const ReplayProgress& progress,
                                         std::vector<Arrival>& out) = 0;
  /// Called when nothing runs, nothing waits and no later arrival is known:
  /// blocks until one is (returns its time) or no request will come any more
  /// (nullopt: the replay ends).
  virtual std::optional<double> wait_next(const ReplayProgress& progress) = 0;
  /// Request `index` completed (or was rejected: `rejected`) at `at_ms`.
  virtual void finished(std::size_t index, double at_ms, bool rejected) = 0;
  /// Request `index` was admitted for the first time: `hit_blocks` blocks
  /// (`hit_tokens` tokens) of its prompt were cached, `prefill_tokens`
  /// computed.
  virtual void admitted(std::size_t index, std::size_t hit_blocks, std::size_t hit_tokens,
                        std::size_t prefill_tokens) = 0;
};

struct ReplayOptions {
  std::size_t capacity_blocks = 0;       ///< blocks of the KV cache, in [1, kMaxCapacityBlocks]
  std::size_t block_size = 16;           ///< tokens per block, in [1, kMaxBlockSize]
  std::size_t trace_block_tokens = 512;  ///< tokens per hash id (> 0)
  std::size_t concurrency = 64;          ///< most requests running at once (> 0)
  std::uint64_t step_ms = 10;            ///< simulated time of one decode step (> 0)
  /// Run PrefixCache::check_invariants() every this many steps (0: only at
  /// the end). Each check is O(capacity_blocks).
  std::size_t check_every = 0;
  /// How a fully cached prompt is hit (BlockTable::PrefixHitMode): by default
  /// its last token is left to compute (n - 1 tokens hit, the last block a
  /// private copy), as an engine needs; `full` hits every cached block
  /// (`kvport replay --full-prefix-hits`).
  PrefixHitMode prefix_hit_mode = PrefixHitMode::compute_last_token;

  // ---- host tier ------------------------------------------------------------
  /// Host blocks of a HostTier under the prefix cache; 0: no tier. In
  /// [0, kMaxHostTierBlocks], and what the simulation takes for them
  /// (kHostTierBookkeepingBytes + 4 x block_size per block) must fit in this
  /// machine's memory: the modeled host memory (host_tier_blocks x the
  /// model's block bytes) is reported, not checked.
  std::size_t host_tier_blocks = 0;
  TierPolicy tier_policy = TierPolicy::write_back;
  TierInclusion tier_inclusion = TierInclusion::exclusive;
  /// Bandwidth of the host link, GB/s (10^9 bytes/s) per direction, for the
  /// modeled transfer time. Default 50: the effective rate of a PCIe Gen5 x16
  /// link for pinned copies (64 GB/s raw per direction, 128b/130b encoding
  /// and packet overhead leave about 50-55 in practice).
  double host_link_gbps = kPcieGen5x16Gbps;
  /// A store under the host tier (the disk tier of `kvport replay
  /// --disk-tier-blocks`; core stays free of it). Called once, with the
  /// simulated cache's config and its host slot bytes, it returns a store of
  /// those block bytes (LowerTierStore::block_bytes) that it owns and keeps
  /// valid until run_replay returns; the replay installs it with
  /// HostTier::set_lower_tier (a store of other bytes: InvalidArgument).
  /// Needs host_tier_blocks > 0. Empty: no lower tier.
  std::function<LowerTierStore*(const KvCacheConfig& config, std::size_t block_bytes)> lower_tier;
  /// HostTierOptions::host_free_watermark of the host tier (with a lower
  /// tier: poll() keeps this many host slots free by writing down ahead, so
  /// lookups read the lower tier without writing first). 0: off.
  std::size_t host_free_watermark = 0;
  /// The model preset (sim/model_presets.hpp) whose block bytes (every layer's
  /// K and V, bf16, block_size tokens) model the bytes a transfer moves.
  std::string model = "llama-3-8b";

  /// Called after each request finishes (completed or rejected) with the
  /// number finished so far and the total. May be empty.
  std::function<void(std::size_t done, std::size_t total)> progress;

  /// Receives the run's cache events (cache_events.hpp; null: none): the
  /// prefix cache's (medium GPU) and the host tier's (medium CPU), installed
  /// for the run and cleared at its end. Must outlive run_replay. A
  /// publisher (events/publisher.hpp) here is what `kvport replay --events`
  /// measures.
  CacheEventSink* event_sink = nullptr;

  /// Hands the requests over as they arrive (null: every request of the
  /// trace, at its timestamp). With a feed only the requests it hands over
  /// run, each at most once, and the replay ends when the feed says no more
  /// will come; ReplayResult::requests counts those handed over. Must
  /// outlive run_replay.
  ArrivalFeed* feed = nullptr;

  /// Called at the start of every step, on the replay's thread, with the
  /// replay's state then (its prefix cache included), before that step's
  /// arrivals: `kvport replay --events` re-announces the cache's set to its
  /// publisher here after events were dropped (Publisher::resync). Null:
  /// nothing. One call per step; what it throws ends run_replay.
  std::function<void(const ReplayProgress&)> on_step;

  /// 2^22 blocks: the simulation keeps about 100 bytes of bookkeeping per
  /// block (refcount, free list, LRU entry, hash map entry).
  static constexpr std::size_t kMaxCapacityBlocks = std::size_t{1} << 22;
  static constexpr std::size_t kMaxBlockSize = std::size_t{1} << 16;
  /// capacity_blocks * block_size at most 2^28 tokens (1 GiB of pools at 4
  /// bytes per token in the minimal cache).
  static constexpr std::size_t kMaxCapacityTokens = std::size_t{1} << 28;
  /// HostTierOptions::kMaxHostBlocks.
  static constexpr std::size_t kMaxHostTierBlocks = HostTierOptions::kMaxHostBlocks;
  /// Memory the simulation takes per host block besides the slot's bytes
  /// (4 x block_size in the minimal cache): the tier's slot state, index
  /// entry and free-list entry (about 65 bytes; rounded up).
  static constexpr std::size_t kHostTierBookkeepingBytes = 80;
  /// --host-link-gbps's default: PCIe Gen5 x16, effective.
  static constexpr double kPcieGen5x16Gbps = 50.0;

  /// Throws InvalidArgument naming the option (as its --flag) that is out of
  /// range (an unknown model, a link that is not a positive finite number, a
  /// host tier whose bookkeeping needs more memory than this machine has).
  void validate() const;
};

/// One group of a replay's cache, in group order (the minimal cache of
/// run_replay: its one full-attention group).
struct GroupUsage {
  LayerSpec spec;                   ///< the real model's layer (one group: full attention)
  std::size_t num_layers = 0;       ///< the real model's layers in the group
  std::size_t num_blocks = 0;       ///< the group's pool (from the plan)
  std::size_t bytes_per_block = 0;  ///< the real model's bytes of one block (slot)
  std::size_t peak_blocks_in_use = 0;
  std::size_t peak_bytes_in_use() const noexcept { return peak_blocks_in_use * bytes_per_block; }
  std::uint64_t block_steps = 0;  ///< blocks in use summed over steps (mean = / steps)
  /// Blocks (state: checkpoints) the hits of admitted requests took in this
  /// group, at first admission; of those, the ones the host tier copied in.
  std::uint64_t hit_blocks = 0;
  std::uint64_t host_hit_blocks = 0;
  std::size_t host_slots = 0;      ///< the group's host slots (0: no tier)
  HostTierCounters tier_counters;  ///< the group's HostTier at the end
};

/// What a replay measured: run_replay's (one group) and replay_model's (a
/// model's groups) are the same workload and give the same result.
struct ReplayResult {
  std::size_t requests = 0;   ///< in the trace
  std::size_t completed = 0;  ///< generated all their output tokens
  /// Could not run even alone in an empty cache: blocks for input_length +
  /// output_length tokens > capacity_blocks. Never admitted.
  std::size_t rejected = 0;
  std::size_t preemptions = 0;
  std::uint64_t steps = 0;    ///< decode steps simulated
  double simulated_ms = 0.0;  ///< last finish - first arrival, simulated time

  // Prefix reuse, counted once per request, at its first admission.
  std::uint64_t prompt_blocks = 0;  ///< full blocks of the prompts
  std::uint64_t hit_blocks = 0;     ///< of those, found in the cache (copied ones included)
  std::uint64_t prompt_tokens = 0;  ///< input_length of the admitted requests
  /// Tokens the hits cover: hit_blocks * block_size, less one token for each
  /// fully cached prompt hit in PrefixHitMode::compute_last_token.
  std::uint64_t hit_tokens = 0;
  /// Fully cached prompts whose last block was hit as a private copy
  /// (compute_last_token; 0 with full hits).
  std::uint64_t last_block_copies = 0;

  /// Tokens prefilled (appended at admission), recomputation included.
  std::uint64_t prefill_tokens = 0;
  /// Of those, tokens a preempted request prefilled again on re-admission.
  std::uint64_t recomputed_tokens = 0;
  std::uint64_t generated_tokens = 0;

  // Block operations.
  std::uint64_t lookups = 0;        ///< prefix lookups (admission attempts, re-admissions included)
  std::uint64_t allocations = 0;    ///< blocks allocated (PagedKvCache allocs, after evictions)
  std::uint64_t releases = 0;       ///< block references given back by sequences
  std::uint64_t evictions = 0;      ///< cached blocks evicted to make room
  std::uint64_t cache_inserts = 0;  ///< full blocks registered in the prefix cache
  std::size_t peak_blocks_in_use = 0;  ///< most blocks running requests held at once
  std::size_t cached_blocks_at_end = 0;

  // Queueing delay, arrival to first admission, of admitted requests (ms).
  double mean_queue_ms = 0.0;
  double max_queue_ms = 0.0;

  double wall_s = 0.0;  ///< host time of the simulation (not of reading the trace)

  // Running requests and groups.
  std::size_t peak_running = 0;  ///< most requests running at once (at the end of a step)
  double mean_running = 0.0;     ///< running requests, mean over steps
  /// Per group, in group order (one entry for run_replay's cache).
  std::vector<GroupUsage> groups;
  /// Per request, in trace order: the tokens its first admission hit, or -1
  /// when it was never admitted (rejected; with a feed, never handed over).
  /// Lets two runs be compared on the requests both admitted
  /// (common_hit_rates, model_replay.hpp).
  std::vector<std::int64_t> request_hit_tokens;
  std::uint64_t state_checkpoints = 0;  ///< state groups' checkpoints (HybridHitCounters)
  /// Tokens of the hits whose blocks came partly from the host tier, and the
  /// lookups whose hit was decided again because a host block failed to come
  /// in (HybridHitCounters::short_hits), with the tokens they lost.
  std::uint64_t host_hit_tokens = 0;
  std::uint64_t short_hits = 0;
  std::uint64_t short_hit_tokens = 0;

  // The plan of a model's groups (replay_model; 0 for run_replay's cache).
  std::size_t planned_context_tokens = 0;  ///< the context the plan was made for
  std::size_t shared_pool_blocks = 0;      ///< blocks of the shared pool (0: none)
  std::size_t host_bytes = 0;              ///< the real model's bytes of every host slot
  std::size_t budget_bytes = 0;            ///< ModelReplayOptions::budget_bytes
  std::size_t pool_bytes = 0;              ///< the real model's bytes of every pool (<= budget)
  /// The groups' peak bytes in use, summed (each group's own peak).
  std::size_t peak_bytes_in_use() const noexcept {
    std::size_t total = 0;
    for (const GroupUsage& g : groups)
      total += g.peak_bytes_in_use();
    return total;
  }

  // Host tier (all 0 without one). The hit split is taken at the admission
  // that counts the hits (a request's first): device_hit_blocks +
  // host_hit_blocks + lower_hit_blocks == hit_blocks. A host hit is a block onloaded by that
  // admission's lookup; blocks an earlier, failed attempt of the same request
  // onloaded are device hits by then. With several groups the split is not
  // taken (host_hit_blocks and lower_hit_blocks stay 0): see groups[g] and
  // host_hit_tokens.
  std::uint64_t device_hit_blocks = 0;
  std::uint64_t host_hit_blocks = 0;
  /// Blocks that admission's lookup read from the lower tier (through host
  /// slots) and onloaded; 0 without one.
  std::uint64_t lower_hit_blocks = 0;
  std::size_t host_tier_blocks = 0;
  std::size_t model_block_bytes = 0;  ///< bytes of one block of the model (the modeled transfers)
  double host_link_gbps = 0.0;
  /// The tier's counters at the end, summed over groups (bytes of the
  /// simulated cache).
  HostTierCounters tier;
  std::size_t host_blocks_at_end = 0;  ///< ready host blocks after the last request

  /// PrefixCache::check_invariants() (HostTier::check_invariants() with a
  /// host tier: the prefix cache's and the tier's) at the end, or at the first periodic
  /// check that failed (then the run stopped there: stopped_at_step != 0).
  InvariantReport invariants;
  std::uint64_t stopped_at_step = 0;

  double hit_rate() const noexcept { return ratio(hit_blocks, prompt_blocks); }
  double device_hit_rate() const noexcept { return ratio(device_hit_blocks, prompt_blocks); }
  double host_hit_rate() const noexcept { return ratio(host_hit_blocks, prompt_blocks); }
  double lower_hit_rate() const noexcept { return ratio(lower_hit_blocks, prompt_blocks); }
  /// Blocks written back / onloaded, and their modeled bytes and seconds.
  std::uint64_t offloaded_blocks() const noexcept { return tier.offloads; }
  std::uint64_t onloaded_blocks() const noexcept { return tier.onloads; }
  double modeled_offload_bytes() const noexcept { return modeled_bytes(tier.offloads); }
  double modeled_onload_bytes() const noexcept { return modeled_bytes(tier.onloads); }
  double modeled_offload_s() const noexcept { return link_s(modeled_offload_bytes()); }
  double modeled_onload_s() const noexcept { return link_s(modeled_onload_bytes()); }
  /// Both directions one after the other (an upper bound: a PCIe link is
  /// full duplex, and write-backs overlap compute; onloads are waited for).
  double modeled_transfer_s() const noexcept { return modeled_offload_s() + modeled_onload_s(); }
  /// The host tier's modeled memory: host_tier_blocks x model_block_bytes.
  double modeled_host_bytes() const noexcept { return modeled_bytes(host_tier_blocks); }
  double token_hit_rate() const noexcept { return ratio(hit_tokens, prompt_tokens); }
  /// lookups + allocations + releases.
  std::uint64_t operations() const noexcept { return lookups + allocations + releases; }
  double operations_per_s() const noexcept { return per_s(operations()); }
  double requests_per_s() const noexcept { return per_s(requests); }
  bool ok() const noexcept { return invariants.ok && stopped_at_step == 0; }

 private:
  static double ratio(std::uint64_t a, std::uint64_t b) noexcept {
    return b == 0 ? 0.0 : static_cast<double>(a) / static_cast<double>(b);
  }
  double modeled_bytes(std::uint64_t blocks) const noexcept {
    return static_cast<double>(blocks) * static_cast<double>(model_block_bytes);
  }
  double link_s(double bytes) const noexcept {
    return host_link_gbps > 0.0 ? bytes / (host_link_gbps * 1e9) : 0.0;
  }
  double per_s(std::uint64_t n) const noexcept {
    return wall_s > 0.0 ? static_cast<double>(n) / wall_s : 0.0;
  }
};

/// Replays `requests` (in trace order; the simulation sorts them by
/// timestamp, stably) under the rules at the top of this file on a fresh PagedKvCache of
/// options.capacity_blocks blocks on `backend` (1 layer, 1 KV head, head dim 1, f16: its contents
/// do not matter, only the block bookkeeping), with a PrefixCache over it (and a HostTier under
/// that when options.host_tier_blocks > 0). Throws InvalidArgument for bad options or no requests
/// (a HostTier the options cannot build: the message names --host-tier-blocks), and whatever the
/// cache's or the tier's construction throws (OutOfMemory). The
/// requests must satisfy what the reader checks (input_length >= 1, lengths <= kMaxRequestTokens).
ReplayResult run_replay(std::span<const TraceRequest> requests, const ReplayOptions& options,
                        Backend& backend);

}  // namespace kvport::sim
