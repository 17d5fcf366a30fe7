// SPDX-License-Identifier: Apache-2.0
// HybridKvCache: a model's KV cache as KV cache groups (layer_spec.hpp), one
// block pool and one prefix cache per group.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <optional>
#include <span>
#include <vector>

#include "kvport/core/kv_cache_plan.hpp"
#include "kvport/core/layer_spec.hpp"
#include "kvport/core/paged_kv_cache.hpp"
#include "kvport/core/prefix_cache.hpp"
#include "kvport/core/shared_block_pool.hpp"

namespace kvport {

/// The shape of a hybrid cache.
struct HybridKvCacheConfig {
  /// One spec per model layer (`none` for layers without KV).
  std::vector<LayerSpec> layers;
  std::size_t block_size = 16;  ///< tokens per block, every group
  KvCacheLayout layout = KvCacheLayout::layer_major;
  /// State groups cache a copy of a sequence's state every this many full
  /// blocks (at token counts that are multiples of interval * block_size), so
  /// that a later request can hit there; 0 caches no state (a hit then stops
  /// at 0 tokens in every model that has a state group).
  std::size_t state_checkpoint_interval = 1;
  /// Layers per group at most (group_layers' max_layers_per_group): 0 groups
  /// every layer of a spec together; shared_group_layers() gives the count
  /// that lets attention groups of unequal layer counts share one pool.
  std::size_t max_group_layers = 0;
};

/// Block counts of a HybridKvCache.
struct HybridPoolSizes {
  /// Blocks of one SharedBlockPool for the groups shared_pool_geometry()
  /// puts in it (attention groups whose pages match); 0: none shares, every
  /// group has a pool of its own.
  std::size_t shared_blocks = 0;
  /// One entry per group: blocks (slots) of the group's own pool. Entries of
  /// groups in the shared pool are ignored.
  std::vector<std::size_t> group_blocks;
};

/// Where a model layer lives.
struct LayerLocation {
  std::size_t group = 0;  ///< its group
  std::size_t index = 0;  ///< its layer index inside the group's pool
};

/// Counters of HybridBlockTable::reuse_cached_prefix over this cache.
struct HybridHitCounters {
  std::uint64_t lookups = 0;
  std::uint64_t lookup_tokens = 0;      ///< prompt tokens looked up
  std::uint64_t hit_tokens = 0;         ///< tokens the hits covered (valid for every group)
  std::uint64_t state_checkpoints = 0;  ///< state copies cached (every state group)
  /// Blocks (state checkpoints included) of the hits that a lower tier
  /// (HostTier) copied in, every group.
  std::uint64_t lower_tier_blocks = 0;
  /// Lookups whose hit had to be decided again because a block the probe
  /// found could not be brought in (a lower tier's copy failed, or the
  /// allocations of an onload evicted a block not yet taken): the request got
  /// the hit that was valid afterwards (fail closed), shorter or none, or
  /// sometimes longer (copies that completed meanwhile made more blocks
  /// visible).
  std::uint64_t short_hits = 0;
  /// Tokens those lookups lost: the first probe's hit minus the hit taken
  /// (0 for one that came out as long or longer).
  std::uint64_t short_hit_tokens = 0;
  double hit_rate() const noexcept {
    return lookup_tokens == 0
               ? 0.0
               : static_cast<double>(hit_tokens) / static_cast<double>(lookup_tokens);
  }
};

/// Every group's pool (a PagedKvCache: refcounts, LIFO free list, double-free
/// guard, trace, invariants, pointers and strides per layer) and its prefix
/// cache. Sequences use it through HybridBlockTable.
///
/// Attention groups whose pages match can share one SharedBlockPool
/// (HybridPoolSizes::shared_blocks, or a plan made with shared_pool): each is
/// then a PagedKvCache over the pool, its layer i on the pool's slot i, and
/// a block id belongs to one group at a time; an allocation in any group
/// evicts the least recently released cached block of any group.
///
/// A group's pool: attention kinds as today; MLA with no V pool; a state
/// group's "blocks" are state slots of one request's state each. Pointers for
/// a model layer: group_cache(locate(layer)->group).k_cache_ptr(index, block).
///
/// Not thread-safe (one scheduler thread), like PagedKvCache.
class HybridKvCache {
 public:
  /// Groups `config.layers` (group_layers) and allocates group g's pool with
  /// `blocks_per_group[g]` blocks (slots). Throws InvalidArgument for a bad
  /// spec, a count of entries other than the number of groups, a zero count,
  /// or what PagedKvCache's constructor throws (everything allocated is freed
  /// first). `backend` must outlive the cache.
  HybridKvCache(HybridKvCacheConfig config, std::span<const std::size_t> blocks_per_group,
                Backend& backend, PagedKvCacheOptions options = {});
  /// Sizes each group from a plan (plan_kv_cache of the same groups),
  /// sharing a pool where the plan does. A plan of groups split to share
  /// (shared_group_layers) is followed when config.max_group_layers is 0:
  /// the cap becomes the plan's largest group. InvalidArgument when the
  /// plan's shared pool does not match the groups' pages.
  HybridKvCache(HybridKvCacheConfig config, const KvCachePlan& plan, Backend& backend,
                PagedKvCacheOptions options = {});
  /// A shared pool of sizes.shared_blocks blocks for the groups that
  /// shared_pool_geometry() lets share (InvalidArgument when shared_blocks > 0
  /// and none can), and a pool of sizes.group_blocks[g] for every other group
  /// (InvalidArgument for a count of entries other than the number of groups
  /// or a zero count of a group not in the shared pool).
  HybridKvCache(HybridKvCacheConfig config, const HybridPoolSizes& sizes, Backend& backend,
                PagedKvCacheOptions options = {});
  ~HybridKvCache();
  HybridKvCache(const HybridKvCache&) = delete;
  HybridKvCache& operator=(const HybridKvCache&) = delete;

  /// The one-group cache over `prefix_cache` and its PagedKvCache: a model of
  /// one full-attention group is the one-group case of groups, and this is
  /// that case over pools the caller built (what BlockTable runs on; a
  /// HybridBlockTable over it is a BlockTable's sequence). Nothing is
  /// allocated and nothing is owned: group 0 is the prefix cache's pool, every
  /// model layer of it a full-attention layer (layer_specs_of), the event sink
  /// and tier stay the prefix cache's own. Made on the first call and kept by
  /// the prefix cache (the same object every call), so it lives as long as the
  /// prefix cache; its hit_counters() count the lookups of every table over it.
  static HybridKvCache& over(PrefixCache& prefix_cache);
  /// The same over a plain `cache` with no prefix cache (kept by the cache):
  /// tables over it allocate from and free to the cache's free list, register
  /// nothing and hit nothing; prefix_cache(0) throws InvalidArgument.
  static HybridKvCache& over(PagedKvCache& cache);
  /// Whether the groups have prefix caches (false only for over(PagedKvCache&)).
  bool caches_prefixes() const noexcept { return prefix_at_.front() != nullptr; }

  const HybridKvCacheConfig& config() const noexcept { return config_; }
  std::size_t block_size() const noexcept { return config_.block_size; }
  std::size_t num_layers() const noexcept { return config_.layers.size(); }
  std::size_t num_groups() const noexcept { return groups_.size(); }
  /// Group g (OutOfRange for g >= num_groups()).
  const KvCacheGroup& group(std::size_t g) const;
  /// Group g's pool and prefix cache (OutOfRange for g >= num_groups();
  /// prefix_cache throws InvalidArgument when !caches_prefixes()).
  PagedKvCache& group_cache(std::size_t g) const;
  PrefixCache& prefix_cache(std::size_t g) const;
  /// Where model layer `layer` is; nullopt for a layer without KV. Throws
  /// OutOfRange for layer >= num_layers().
  std::optional<LayerLocation> locate(std::size_t layer) const;
  /// Bytes of every pool (the shared pool's once).
  std::size_t total_bytes() const noexcept;
  /// The pool the attention groups share, or nullptr when none does.
  SharedBlockPool* shared_pool() const noexcept { return shared_.get(); }
  /// Whether group g draws from the shared pool (OutOfRange out of range).
  bool in_shared_pool(std::size_t g) const;
  /// Blocks (slots) group g holds for sequences: in use and not evictable.
  std::size_t blocks_in_use(std::size_t g) const;
  Backend& backend() const noexcept { return *backend_; }

  /// Installs `sink` (nullptr: none) in every group's prefix cache
  /// (PrefixCache::set_event_sink), each announced as group_event_source(g,
  /// Medium::gpu). A state group's cached checkpoints are announced as blocks
  /// of kind "mamba": the checkpoint after block k as block k (its hash,
  /// parent and tokens), as vLLM announces a mamba group's blocks. Throws
  /// std::bad_alloc (groups installed before stay installed: install nullptr
  /// to undo).
  void set_event_sink(CacheEventSink* sink);
  /// Group g's source on `medium`: group_idx g, kv_cache_spec_kind
  /// to_string(kind) ("full_attention", "mla_attention", "sliding_window",
  /// "chunked_local", "mamba"), sliding_window the window of a sliding-window
  /// group (absent for the others). OutOfRange out of range.
  EventSource group_event_source(std::size_t g, Medium medium) const;
  /// PrefixCache::snapshot of every group, group 0 first.
  void snapshot(CacheEventSink& sink) const;

  const HybridHitCounters& hit_counters() const noexcept { return counters_; }
  HybridHitCounters& hit_counters() noexcept { return counters_; }

  /// Every group's PrefixCache::check_invariants(), violations prefixed with
  /// "group g: "; the counts are sums; with a shared pool, its own
  /// SharedBlockPool::check_invariants() violations too. O(total blocks).
  InvariantReport check_invariants() const;
  /// One report per group.
  std::vector<InvariantReport> check_group_invariants() const;

  /// PagedKvCache::synchronize of every group (every group is synchronized
  /// even when one throws; the first error is rethrown).
  void synchronize();

 private:
  friend class HybridBlockTable;  // reads pool_at_ and prefix_at_ unchecked on its hot paths
  // The view of over(): one group over `cache` and `prefix` (nullptr: none).
  HybridKvCache(PagedKvCache& cache, PrefixCache* prefix);

  HybridKvCacheConfig config_;
  std::vector<KvCacheGroup> groups_;
  std::vector<LayerLocation> locations_;  // per model layer; group == SIZE_MAX for none
  Backend* backend_ = nullptr;
  std::unique_ptr<SharedBlockPool> shared_;  // destroyed after the caches over it
  std::vector<bool> in_shared_;              // per group
  std::vector<std::unique_ptr<PagedKvCache>> caches_;
  std::vector<std::unique_ptr<PrefixCache>> prefixes_;  // destroyed before caches_
  // Group g's pool and prefix cache: caches_[g] and prefixes_[g], or the
  // view's borrowed ones (prefix_at_[0] nullptr over a plain cache).
  std::vector<PagedKvCache*> pool_at_;
  std::vector<PrefixCache*> prefix_at_;
  HybridHitCounters counters_;
};

/// The hybrid hit rule for one group (docs/hybrid-models.md), as
/// find_hybrid_hit takes it.
struct GroupHitRule {
  LayerKind kind = LayerKind::full_attention;
  std::size_t window = 0;  ///< sliding_window
  std::size_t chunk = 0;   ///< chunked_local
};

/// The rule of `spec`.
GroupHitRule hit_rule_of(const LayerSpec& spec) noexcept;

/// The first block a group needs when the next token is at `position`
/// (every block before it may be a null entry): 0 for full attention and MLA;
/// floor(max(0, position - W + 1) / bs) for a window of W; the chunk start of
/// `position`, in blocks, for chunked; `position / bs` for state (a state group
/// holds no blocks: it needs the checkpoint of the block before).
std::size_t first_needed_block(const GroupHitRule& rule, std::size_t block_size,
                               std::size_t position) noexcept;

/// The longest hit, in blocks, valid for every group: the largest p <= max_blocks
/// such that, for every group g, each block i in [first_needed_block(g, p * bs), p)
/// is cached in g (`cached(g, i)`) — for a state group: p == 0 or block p - 1
/// has a cached state. Found as a fixed point (every group may only shorten the
/// candidate, full attention first), with `cached` called only for blocks that
/// decide it (the caller may memoize them). O(max_blocks + hit * W / bs) calls
/// at most per window group; a full group's chain is probed once.
template <typename Cached>
std::size_t find_hybrid_hit(std::span<const GroupHitRule> rules, std::size_t block_size,
                            std::size_t max_blocks, Cached&& cached);

}  // namespace kvport

#include "kvport/core/detail/hybrid_hit_impl.hpp"
