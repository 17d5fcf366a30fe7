// SPDX-License-Identifier: Apache-2.0
// Replay of a Mooncake trace over a real model's KV cache groups
// (HybridKvCache, HybridBlockTable): `kvport replay --memory` for any model
// (full attention, sliding window, chunked, MLA or state layers), and beside
// it the same model treated as all full attention, with the same memory.
//
// The workload is run_replay's (replay.hpp: one workload over groups, the
// same rules and result), set up over the model's groups, plus:
//   - memory: `budget_bytes` of the REAL model is split between its groups by
//     plan_kv_cache (max_context_tokens, prefill_chunk_tokens as the step);
//     the simulated pools have those block counts but one tiny layer each, so
//     bytes are MODELED: blocks x the real model's bytes per block.
//   - prefill is chunked: the rest of a prompt after its hit is appended
//     prefill_chunk_tokens at a time (each chunk computed before the next, so
//     the freeing rules run between chunks, as under an engine's chunked
//     prefill); admission succeeds only when every chunk found its blocks.
//   - a request whose peak need in some group exceeds that group's pool is
//     rejected at arrival.
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>
#include <vector>

#include "kvport/core/block_table.hpp"
#include "kvport/core/cache_events.hpp"
#include "kvport/core/host_tier.hpp"
#include "kvport/core/kv_cache_plan.hpp"
#include "kvport/core/layer_spec.hpp"
#include "kvport/core/paged_kv_cache.hpp"
#include "kvport/platform/backend.hpp"
#include "kvport/sim/mooncake_trace.hpp"
#include "kvport/sim/replay.hpp"

namespace kvport::sim {

struct ModelReplayOptions {
  std::vector<LayerSpec> layers;  ///< the model, one spec per layer
  std::size_t block_size = 16;    ///< tokens per block
  std::size_t budget_bytes = 0;   ///< the real model's KV memory (> 0)
  /// The planner's context; 0: the longest request of the trace.
  std::size_t max_context_tokens = 0;
  std::size_t prefill_chunk_tokens = 512;  ///< > 0
  std::size_t trace_block_tokens = 512;    ///< tokens per hash id (> 0)
  std::size_t concurrency = 1024;          ///< most requests running at once (> 0)
  std::uint64_t step_ms = 10;              ///< > 0
  std::size_t state_checkpoint_interval = 1;
  PrefixHitMode prefix_hit_mode = PrefixHitMode::compute_last_token;
  /// Attention groups whose pages match share one pool (split into groups of
  /// equal layer count first: shared_group_layers); false: a pool per group
  /// sized by the plan's ratio of peak needs.
  bool shared_pool = true;
  /// A host tier under every group (HybridHostTier) of host_tier_blocks x
  /// model_block_bytes() of the real model's memory, split between the
  /// groups by split_host_slots (the same tokens in every group); 0: none.
  std::size_t host_tier_blocks = 0;
  TierPolicy tier_policy = TierPolicy::write_back;
  TierInclusion tier_inclusion = TierInclusion::exclusive;
  /// Receives the run's cache events (null: none): every group's, with its
  /// group_idx, kind and window, on the device (GPU) and the host tier
  /// (CPU). Must outlive replay_model.
  CacheEventSink* event_sink = nullptr;
  /// Throws InvalidArgument naming the option for a zero size or no layers.
  void validate() const;
};

/// Two runs' token hit rates over only the requests both admitted: when one
/// run rejects requests the other holds (a long prompt that all-full
/// attention cannot fit), their own hit rates are over different prompts.
struct CommonHitRates {
  std::size_t requests = 0;         ///< admitted by both
  std::uint64_t prompt_tokens = 0;  ///< of those requests
  double a = 0.0;                   ///< run a's hit tokens over prompt_tokens
  double b = 0.0;                   ///< run b's
};

/// CommonHitRates of two results of one trace (`requests`, the trace both
/// replayed). InvalidArgument when a result's request_hit_tokens does not
/// have one entry per request.
CommonHitRates common_hit_rates(std::span<const TraceRequest> requests, const ReplayResult& a,
                                const ReplayResult& b);

/// The unit of ModelReplayOptions::host_tier_blocks: the real model's bytes
/// of one block of every attention layer (the bytes_per_block of the plan's
/// full, MLA, window and chunked groups; state groups hold no blocks), what
/// --host-tier-blocks counts for a model without groups.
std::size_t model_block_bytes(const KvCachePlan& plan) noexcept;

/// Runs the replay. Throws InvalidArgument for bad options or a budget the
/// planner cannot split, and what the scheduler throws.
ReplayResult replay_model(std::span<const TraceRequest> requests, const ModelReplayOptions& options,
                          Backend& backend);

/// `layers` with every sliding-window and chunked layer made full attention
/// of the same heads (what a runtime without groups holds).
std::vector<LayerSpec> as_all_full_attention(std::span<const LayerSpec> layers);

}  // namespace kvport::sim
