// SPDX-License-Identifier: Apache-2.0
// The hybrid capacity planner: how a memory budget is split between a model's
// KV cache groups (layer_spec.hpp), and how much each group holds per request.
//
// Design (docs/hybrid-models.md): the budget is split in the ratio of the
// groups' peak needs per request. Attention groups whose pages match share one
// pool (vLLM's design: memory moves between them at run time) and get the sum
// of their shares; the others (state, or pages of another size) keep a pool
// of their own, so no page is ever padded.
#pragma once

#include <cstddef>
#include <optional>
#include <span>
#include <vector>

#include "kvport/core/layer_spec.hpp"
#include "kvport/core/shared_block_pool.hpp"

namespace kvport {

/// What the planner is asked to fit.
struct KvCachePlanRequest {
  std::size_t budget_bytes = 0;        ///< memory for every group's pools together
  std::size_t max_context_tokens = 0;  ///< the longest sequence (prompt + output)
  /// Requests that must run at once, each of max_context_tokens; 0: no
  /// minimum (the plan says how many fit). The split does not depend on it.
  std::size_t max_requests = 0;
  /// Tokens a running request appends per step (1 for decode; the chunk size
  /// under chunked prefill). Window and chunked groups hold this many tokens
  /// beyond their span at the peak.
  std::size_t step_tokens = 1;
  /// Cached state checkpoints kept per request beside its working state
  /// (state groups only).
  std::size_t state_checkpoints = 1;
  /// Let the attention groups whose pages match (shared_pool_geometry) draw
  /// from one SharedBlockPool, so that memory moves between them at run time
  /// (`kvport replay` does by default). false (the default of this API, which
  /// the C, Python and Rust plans and `kvport plan` report): every group gets
  /// a pool of its own.
  bool shared_pool = false;
};

/// One group's share.
struct GroupPlan {
  LayerSpec spec;  ///< of the group's first layer
  std::size_t num_layers = 0;
  std::size_t bytes_per_block = 0;    ///< one block id (one state slot), all layers
  std::size_t bytes_per_token = 0;    ///< per-token kinds, all layers; 0 for state
  std::size_t bytes_per_request = 0;  ///< state kinds: one state, all layers; else 0
  /// Blocks (slots) one request of max_context_tokens holds at its peak.
  std::size_t peak_blocks_per_request = 0;
  /// Blocks (slots) of the group's pool; for a group in the shared pool, the
  /// shared pool's blocks (any of them may come to this group).
  std::size_t num_blocks = 0;
  /// The pool's bytes, allocation rounding included; 0 for a group in the
  /// shared pool (KvCachePlan::shared_bytes has them).
  std::size_t bytes = 0;
  bool shared = false;  ///< the group draws from the plan's shared pool
};

/// The planner's answer.
struct KvCachePlan {
  std::size_t block_size = 0;
  std::vector<GroupPlan> groups;  ///< in group order
  std::size_t total_bytes = 0;    ///< every pool
  /// Requests of max_context_tokens that fit at once (the smallest over groups).
  std::size_t max_concurrent_requests = 0;
  /// Bytes one request of max_context_tokens holds at its peak, over groups.
  std::size_t peak_bytes_per_request = 0;
  /// The same, with every sliding-window and chunked layer treated as full
  /// attention (MLA, full and state layers unchanged): what a runtime without
  /// groups holds.
  std::size_t all_full_peak_bytes_per_request = 0;
  /// The same in one shared pool whose pages are padded to the largest
  /// group's page (the unified-page alternative), for the design comparison.
  std::size_t shared_pool_peak_bytes_per_request = 0;
  /// The shared pool (groups with `shared` set): its blocks, page geometry and
  /// bytes; 0 blocks when no group shares.
  std::size_t shared_blocks = 0;
  SharedPoolGeometry shared_geometry;
  std::size_t shared_bytes = 0;
  /// The context the plan was made for (request.max_context_tokens).
  std::size_t max_context_tokens = 0;

  /// peak_bytes_per_request / all_full_peak_bytes_per_request.
  double ratio_to_all_full() const noexcept;
};

/// Blocks (slots) one request of `context_tokens` holds at its peak in a
/// group of `spec`, appending `step_tokens` at a time (docs/hybrid-models.md
/// has the derivation; HybridBlockTable frees by exactly these rules):
///   full, MLA       ceil(context / block_size)
///   window W        min(full, ceil((W - 2 + step) / block_size) + 1)
///   chunked C       min(full, ceil((C - 1 + step) / block_size))
///   state           1 + state_checkpoints
/// Throws InvalidArgument for zero block_size, context or step.
std::size_t peak_blocks_per_request(const LayerSpec& spec, std::size_t block_size,
                                    std::size_t context_tokens, std::size_t step_tokens,
                                    std::size_t state_checkpoints = 1);

/// The layer count to split `groups` into (group_layers' max_layers_per_group)
/// so that their attention groups can share one pool (vLLM's rule: the
/// smallest attention group's layer count, or the largest when they are within
/// 1.25x of each other); 0 when they cannot share: fewer than two attention
/// groups, block-major layout, or pages of different bytes.
std::size_t shared_group_layers(std::span<const KvCacheGroup> groups, std::size_t block_size,
                                KvCacheLayout layout);

/// The KV cache groups of `layers` that a plan is made over: group_layers,
/// and with `shared_pool` split into groups of at most shared_group_layers()
/// layers, so that the attention groups can share one pool (as group_layers
/// makes them when they cannot). `max_group_layers`, when not null, gets the
/// cap the grouping used (0: none), what HybridKvCacheConfig::max_group_layers
/// takes to build the same groups.
std::vector<KvCacheGroup> planned_groups(std::span<const LayerSpec> layers, std::size_t block_size,
                                         bool shared_pool,
                                         KvCacheLayout layout = KvCacheLayout::layer_major,
                                         std::size_t* max_group_layers = nullptr);

/// The shared pool `groups` can use, and which groups join it: every group
/// with blocks (full, MLA, window, chunked) when there are at least two, the
/// layout is layer-major, every layer's K (and V) region has the same bytes in
/// all of them (so no page is padded), and the slots the groups leave unused
/// (a group of fewer layers than the largest) are at most a quarter of all
/// (group_layers with shared_group_layers gets there: Gemma 3's 52 window and
/// 10 full layers become 6 + 1 groups of up to 10); nullopt otherwise.
/// `members` gets the groups' indices.
std::optional<SharedPoolGeometry> shared_pool_geometry(std::span<const KvCacheGroup> groups,
                                                       std::size_t block_size, KvCacheLayout layout,
                                                       std::vector<std::size_t>* members = nullptr);

/// Splits `request.budget_bytes` between `groups` in the ratio of their peak
/// bytes per request, each share turned into blocks by
/// PagedKvCache::compute_num_blocks (so a cache built from the plan fits the
/// budget). For a single full-attention group the answer is
/// compute_num_blocks of the whole budget. Throws InvalidArgument for no
/// group, a zero block size, budget, context or step; never returns a group of
/// 0 blocks: a budget too small for one block of some group throws
/// InvalidArgument naming the group, and one that holds fewer than
/// request.max_requests requests at their peak throws saying how many fit.
/// With request.shared_pool and a shared_pool_geometry, the groups that share
/// get one pool of the bytes their separate pools would have had together.
KvCachePlan plan_kv_cache(std::span<const KvCacheGroup> groups, std::size_t block_size,
                          const KvCachePlanRequest& request,
                          KvCacheLayout layout = KvCacheLayout::layer_major);

}  // namespace kvport
