// SPDX-License-Identifier: Apache-2.0
// The one replay workload: a Mooncake trace under the scheduler loop of
// scheduler.hpp over a cache of groups (HybridKvCache, HybridBlockTable, a
// HybridHostTier under it). run_replay (replay.hpp) runs it over the one-group
// view of a minimal PrefixCache (HybridKvCache::over); replay_model
// (model_replay.hpp) over a model's planned groups. What the two set up
// differently is in ReplayWorkloadOptions; the rules (replay.hpp's) are the
// same for both.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <span>

#include "kvport/core/hybrid_host_tier.hpp"
#include "kvport/core/hybrid_kv_cache.hpp"
#include "kvport/core/prefix_hit_mode.hpp"
#include "kvport/platform/backend.hpp"
#include "kvport/sim/mooncake_trace.hpp"
#include "kvport/sim/replay.hpp"

namespace kvport::sim::detail {

/// The parameters of one replay (ReplayOptions' and ModelReplayOptions'
/// shared ones, and what the setup decides).
struct ReplayWorkloadOptions {
  std::size_t block_size = 16;
  std::size_t trace_block_tokens = 512;
  std::size_t concurrency = 64;
  std::uint64_t step_ms = 10;
  std::size_t check_every = 0;  ///< ReplayOptions::check_every
  PrefixHitMode prefix_hit_mode = PrefixHitMode::compute_last_token;
  /// The rest of a prompt after its hit is appended this many tokens at a
  /// time; 0: all at once.
  std::size_t prefill_chunk_tokens = 0;
  /// HybridBlockTable::set_copy_last_block (a one-group cache: as BlockTable).
  bool copy_last_block = false;
  /// With a host tier over one group: before a lookup, check without one
  /// that the context past the device-cached prefix could fit (replay.hpp).
  bool fit_before_onload = false;
  /// Write each registered block's content (replay.hpp: a lower tier's
  /// blocks are read back and checked).
  bool write_contents = false;
  ArrivalFeed* feed = nullptr;
  const std::function<void(const ReplayProgress&)>* on_step = nullptr;
  const std::function<void(std::size_t, std::size_t)>* progress = nullptr;
};

/// The parameters ReplayOptions and ModelReplayOptions share, from either.
template <typename Options>
ReplayWorkloadOptions shared_workload_options(const Options& options) {
  ReplayWorkloadOptions run;
  run.block_size = options.block_size;
  run.trace_block_tokens = options.trace_block_tokens;
  run.concurrency = options.concurrency;
  run.step_ms = options.step_ms;
  run.prefix_hit_mode = options.prefix_hit_mode;
  return run;
}

/// Runs `requests` over `cache` (and `tier`, null: none) on `stream`. Fills
/// every field of ReplayResult the run decides (not the setup's: the plan,
/// model bytes, link); result.groups must hold one entry per group of the
/// cache, with the setup's fields, and gets the usage. Throws what the
/// scheduler and the feed throw.
ReplayResult run_replay_workload(std::span<const TraceRequest> requests,
                                 const ReplayWorkloadOptions& options, HybridKvCache& cache,
                                 HybridHostTier* tier, StreamView stream,
                                 std::vector<GroupUsage> groups);

}  // namespace kvport::sim::detail
