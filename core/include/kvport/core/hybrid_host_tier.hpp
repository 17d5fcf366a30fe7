// SPDX-License-Identifier: Apache-2.0
// HybridHostTier: the host tier (host_tier.hpp) under every KV cache group of
// a HybridKvCache, each group with host slots of its own size.
#pragma once

#include <cstddef>
#include <memory>
#include <span>
#include <vector>

#include "kvport/core/host_tier.hpp"
#include "kvport/core/hybrid_kv_cache.hpp"
#include "kvport/core/kv_cache_plan.hpp"
#include "kvport/platform/stream.hpp"

namespace kvport {

/// Configuration of a HybridHostTier.
struct HybridHostTierOptions {
  /// Host slots of each group (one entry per group, in group order); a slot
  /// holds one block of the group (every layer of the group), or one state
  /// checkpoint of a state group. 0: the group has no host tier (its lookups
  /// end on the device). At least one entry > 0; each in
  /// [0, HostTierOptions::kMaxHostBlocks].
  std::vector<std::size_t> slots_per_group;
  /// The rest applies to every group's tier (HostTierOptions).
  TierPolicy policy = TierPolicy::write_back;
  TierInclusion inclusion = TierInclusion::exclusive;
  std::size_t offload_batch = 32;
  std::size_t free_watermark = 0;
  /// HostTierOptions::host_free_watermark of every group's tier: with a lower
  /// tier, poll() keeps this many host slots free by writing down ahead.
  std::size_t host_free_watermark = 0;
};

/// Host slots per group for `host_bytes` of host memory, so that the host
/// holds the same tokens in every group: n slots in each block group (full
/// attention, MLA, window, chunked: a slot covers block_size tokens) and
/// n / state_checkpoint_interval checkpoint slots in each state group (one
/// checkpoint every interval blocks; none when the interval is 0), with n as
/// large as the bytes allow. Not the device's split: a window group's pool
/// is sized for its peak, not for caching, and its hits would otherwise end
/// first, on the host as on the device. Throws InvalidArgument for a plan
/// without groups or bytes.
std::vector<std::size_t> split_host_slots(const KvCachePlan& plan, std::size_t host_bytes,
                                          std::size_t state_checkpoint_interval);

/// One HostTier per group (with slots) of a HybridKvCache, installed in the
/// group's prefix cache: every group's evicted blocks (full attention and MLA
/// blocks, window and chunked blocks, state checkpoints) are written back to
/// host slots of the group's size under the two-phase rules of HostTier (no
/// slot visible or reused before its copy completed; a failed copy rolls
/// back and publishes nothing).
///
/// Lookups: HybridBlockTable::reuse_cached_prefix counts a block as cached
/// when the device or the group's tier holds it, decides the hybrid hit on
/// that, and only then copies the host's blocks in. A host block that fails
/// to come in makes the hit be decided again on what is there (fail closed:
/// HybridHitCounters::short_hits); a host hit that has the attention blocks
/// but not a state group's checkpoint is no hit for that group, so the hit
/// ends at the last point where every group has what it needs.
///
/// A model of one group is the one-group case: over HybridKvCache::over(a
/// prefix cache) this is a HostTier under that prefix cache, and its hits are
/// the single lookup of the one-group table (BlockTable's).
///
/// Not thread-safe. The cache must outlive the tier; the destructor waits for
/// every copy and uninstalls every group's tier.
class HybridHostTier {
 public:
  /// Throws InvalidArgument for a count of entries other than the number of
  /// groups, no group with slots, options out of range (HostTier's, naming
  /// the group), a group's prefix cache that already has a tier, or slots of
  /// every group together needing more memory than the machine has;
  /// OutOfMemory when host memory cannot be pinned. Nothing stays installed
  /// when it throws.
  HybridHostTier(HybridKvCache& cache, const HybridHostTierOptions& options,
                 StreamView compute_stream);
  /// As above, with the backend's default stream as the compute stream.
  HybridHostTier(HybridKvCache& cache, const HybridHostTierOptions& options);
  ~HybridHostTier();
  HybridHostTier(const HybridHostTier&) = delete;
  HybridHostTier& operator=(const HybridHostTier&) = delete;

  /// HostTier::poll of every group's tier (once per engine step).
  void poll();
  /// HostTier::synchronize of every group's tier.
  void synchronize();

  /// Installs `sink` (nullptr: none) in every group's tier
  /// (HostTier::set_event_sink), each announced as
  /// cache().group_event_source(g, Medium::cpu). Throws std::bad_alloc
  /// (groups installed before stay installed).
  void set_event_sink(CacheEventSink* sink);
  /// HostTier::set_lower_tier of group g's tier: a store of that group's
  /// slot bytes (each group needs its own, e.g. a disk directory per group).
  /// Lookups then continue in it under the hybrid hit rule (holds() counts
  /// its blocks; a block that fails to come in makes the hit be decided
  /// again). Throws InvalidArgument for a group out of range or without a
  /// tier, and as HostTier::set_lower_tier.
  void set_lower_tier(std::size_t g, LowerTierStore* store);
  /// HostTier::snapshot of every group's tier, group 0 first.
  void snapshot(CacheEventSink& sink) const;

  std::size_t num_groups() const noexcept { return tiers_.size(); }
  /// Group g's tier, or nullptr when it has no slots. InvalidArgument out of
  /// range.
  HostTier* group_tier(std::size_t g) const;
  /// Group g's counters (all zero without a tier). InvalidArgument out of
  /// range.
  HostTierCounters counters(std::size_t g) const;
  /// Every group's counters summed (bytes are each group's own slot bytes).
  HostTierCounters total_counters() const;
  /// Pinned host bytes of every group's slots.
  std::size_t host_bytes() const noexcept;
  const HybridHostTierOptions& options() const noexcept { return options_; }
  HybridKvCache& cache() const noexcept { return *cache_; }

  /// Every group's HostTier::check_invariants() (or the prefix cache's, for a
  /// group without a tier), violations prefixed with "group g: ".
  InvariantReport check_invariants() const;

 private:
  HybridKvCache* cache_;
  HybridHostTierOptions options_;
  std::vector<std::unique_ptr<HostTier>> tiers_;
};

}  // namespace kvport
