// SPDX-License-Identifier: Apache-2.0
// PrefixCache: automatic prefix caching over a PagedKvCache, with LRU
// eviction of cached blocks no sequence holds.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <optional>
#include <source_location>
#include <span>
#include <vector>

#include "kvport/core/block_hash.hpp"
#include "kvport/core/cache_events.hpp"
#include "kvport/core/paged_kv_cache.hpp"

namespace kvport {

/// Monotonic counters since construction.
struct PrefixCacheCounters {
  std::uint64_t lookups = 0;  ///< lookup calls
  /// Full blocks a lookup found cached on the device.
  std::uint64_t hits = 0;
  /// Full blocks after the device's longest cached prefix (a lower tier's
  /// hits among them are counted by the tier: HostTierCounters::host_hits).
  std::uint64_t misses = 0;
  std::uint64_t inserts = 0;           ///< blocks registered under a new hash
  std::uint64_t evictions = 0;         ///< cached blocks dropped to make room (or by evict())
  std::uint64_t ignored_releases = 0;  ///< release() of a block no sequence held

  /// hits / (hits + misses); 0 before the first full block was looked up.
  double hit_rate() const noexcept {
    const std::uint64_t total = hits + misses;
    return total == 0 ? 0.0 : static_cast<double>(hits) / static_cast<double>(total);
  }
};

/// Bytes the prefix cache's own bookkeeping holds (not the KV pools, not the
/// PagedKvCache's refcounts and free list), from the containers' capacities;
/// the allocator's per-allocation overhead is not included.
struct PrefixCacheMemory {
  std::size_t entry_bytes = 0;  ///< per-block records: hash, cached/evictable flags
  std::size_t index_bytes = 0;  ///< the hash -> block index (an open-addressing table)
  std::size_t lru_bytes = 0;    ///< the LRU queue
  /// The blocks' origins (parent, tokens), kept only once an event sink was
  /// installed (PrefixCache::keep_block_origins); 0 before.
  std::size_t origin_bytes = 0;
  /// The sum of the four.
  std::size_t total() const noexcept {
    return entry_bytes + index_bytes + lru_bytes + origin_bytes;
  }
};

/// The longest cached prefix lookup() found.
struct PrefixMatch {
  /// One block per matched full block, in sequence order; the caller owns one
  /// reference on each (give it back with PrefixCache::release).
  std::vector<BlockId> blocks;
  /// The chained hashes of those blocks.
  std::vector<BlockHash> hashes;
  /// blocks.size() * block_size.
  std::size_t num_tokens = 0;
  /// Of `blocks`, how many (at the end) a lower tier (HostTier) copied in
  /// for this lookup; the others were cached on the device.
  std::size_t lower_tier_blocks = 0;
};

class PrefixCache;
class HybridKvCache;

/// A lower tier of the prefix cache (HostTier is the one kvport has).
/// Installed with PrefixCache::set_tier; the tier must outlive its
/// installation.
///
/// A lookup continues below the device with the seam turned downward (vLLM's
/// lookup, prepare load, complete load; Dynamo's "the target pool
/// allocates"): the prefix cache asks the tier for a run (find_run: the tier
/// pins its slots, reading lower-tier blocks into them first), allocates the
/// device blocks itself, asks the tier to load them (load_run), registers
/// what landed, and tells the tier (finish_run). On that path the tier calls
/// nothing of the prefix cache. Only on_free_list_empty, on the allocation
/// path, may use the prefix cache's public API (detach_lru, release) to free
/// blocks it wrote back.
/// What PrefixCacheTier::load_run did with the blocks it was given, in
/// order: the first `landed` hold the run's contents and are the caller's
/// again; the next `kept` the tier holds (in quarantine: a copy that missed
/// its deadline may still write them; the tier releases them later); the
/// rest the caller releases (nothing was written that anyone will read).
struct TierLoad {
  std::size_t landed = 0;
  std::size_t kept = 0;
};

class PrefixCacheTier {
 public:
  virtual ~PrefixCacheTier() = default;
  /// An allocation found the free list empty. The tier may free blocks (for
  /// instance by writing evictable ones back and then freeing them); when the
  /// list is still empty afterwards, the prefix cache evicts as usual.
  virtual void on_free_list_empty(PrefixCache& cache, const std::source_location& where) = 0;
  /// Device blocks the tier holds that it can make free or evictable on
  /// demand (on_free_list_empty): they count in num_available_blocks().
  virtual std::size_t reclaimable_blocks() const noexcept = 0;
  /// `block` was just registered under `hash` by PrefixCache::insert.
  virtual void on_insert(PrefixCache& cache, BlockId block, const BlockHash& hash) = 0;
  /// A lookup of `hashes` matched the first `start` on the device: how many
  /// of the hashes that follow the tier can bring in, in order, each pinned
  /// (kept from reuse) until load_run. 0 ends the lookup's run here (nothing
  /// pinned). Must not throw: a failure is a shorter run.
  virtual std::size_t find_run(std::span<const BlockHash> hashes, std::size_t start) noexcept = 0;
  /// Copies the first blocks.size() blocks of the run find_run pinned
  /// (blocks.size() <= its count) into `blocks`, device blocks the prefix
  /// cache allocated (one reference each), and waits; the rest of the run is
  /// unpinned. What became of each block: TierLoad. With landed > 0 the
  /// caller registers those blocks (run_origin(i) is block i's origin) and
  /// then calls finish_run; with landed == 0 the run is over.
  virtual TierLoad load_run(std::span<const BlockId> blocks) noexcept = 0;
  /// What block i of the loaded run holds (its parent, tokens, extra key),
  /// valid until finish_run.
  virtual BlockOrigin run_origin(std::size_t i) const noexcept = 0;
  /// The loaded blocks are registered: the tier lets their slots go (an
  /// exclusive tier) or keeps them (inclusive), and counts the onload.
  virtual void finish_run() noexcept = 0;
  /// Whether a lookup reaching `hash` would find it in the tier now (its
  /// copy complete, visible): a probe that takes nothing and copies nothing,
  /// for lookups that decide a hit before bringing its blocks in (the hybrid
  /// hit rule, HybridBlockTable::reuse_cached_prefix).
  virtual bool holds(const BlockHash& hash) const noexcept = 0;
};

/// Automatic prefix caching, as in vLLM: full blocks are registered under the
/// chained hash of their tokens (block_hash.hpp), and a new sequence reuses
/// the longest cached prefix of its prompt.
///
/// Ownership: the prefix cache holds ONE reference on every cached block.
/// Each block is in exactly one of three states:
///  - free: refcount 0, on the PagedKvCache's free list;
///  - evictable: cached, refcount 1 (only the cache's), in the LRU list;
///  - in use: some sequence holds it (refcount >= 1 uncached, >= 2 cached).
///
/// A cached block is evicted only when the free list is empty, least recently
/// released first; its hash is dropped and the block goes back to the free
/// list through PagedKvCache::return_evicted_block.
///
/// Sequences allocate, share and release blocks through this class (or a
/// BlockTable over it), not through the PagedKvCache directly: a release that
/// bypasses it would leave an evictable block off the LRU list, which
/// check_invariants() reports. Not thread-safe, like PagedKvCache. The
/// PagedKvCache must outlive the prefix cache, and the prefix cache every
/// BlockTable over it. Destruction drops the cache's reference on every
/// cached block (evictable ones go back to the free list).
class PrefixCache {
 public:
  /// Manages prefix caching for `cache`, whose config().block_size is the
  /// block size the hashes cover.
  explicit PrefixCache(PagedKvCache& cache);
  ~PrefixCache();
  PrefixCache(const PrefixCache&) = delete;
  PrefixCache& operator=(const PrefixCache&) = delete;

  // ---- lookup -------------------------------------------------------------------

  /// The longest cached prefix of full blocks of `tokens` under `extra_key`.
  /// Takes a reference on each returned block (an evictable one leaves the
  /// LRU list). Counts the matched blocks as hits and the remaining full
  /// blocks as misses (of the device: a lower tier, when one is set, then
  /// extends the match with the blocks it holds and counts those itself).
  PrefixMatch lookup(std::span<const TokenId> tokens, std::uint64_t extra_key = 0,
                     std::source_location where = std::source_location::current());

  /// As lookup, for hashes the caller already computed (hash_full_blocks).
  PrefixMatch lookup_hashes(std::span<const BlockHash> hashes,
                            std::source_location where = std::source_location::current());

  // ---- allocation and release -----------------------------------------------------

  /// A block for a sequence, refcount 1: from the free list, or, when it is
  /// empty, by evicting the least recently used evictable block. Throws
  /// CacheExhausted when neither has a block.
  BlockId alloc_block(std::source_location where = std::source_location::current());

  /// As alloc_block, but nullopt when no block is free or evictable.
  std::optional<BlockId> try_alloc_block(
      std::source_location where = std::source_location::current());

  /// Registers the full block `block` (which a sequence holds) under `hash`
  /// and takes the cache's reference on it. Returns false, and changes
  /// nothing, when `hash` is already cached (the block then stays a private
  /// copy of content the cache has) or the block is already cached. Throws
  /// OutOfRange for an out-of-range block, InvalidArgument for a free one. Strong guarantee.
  bool insert(const BlockHash& hash, BlockId block,
              std::source_location where = std::source_location::current());

  /// As above, with what the block holds (its parent and tokens), which the
  /// BlockStored event of an installed sink carries and block_origin() keeps.
  /// Also throws InvalidArgument when origin.tokens is neither empty nor
  /// tokens_per_block() tokens long.
  bool insert(const BlockHash& hash, BlockId block, const BlockOrigin& origin,
              std::source_location where = std::source_location::current());

  /// Registers consecutive full blocks of one sequence at once: block i under
  /// hashes[i], with origin.parent before the first and origin.tokens (empty,
  /// or tokens_per_block() per block) their tokens. Each block as insert() does,
  /// except that one that cannot be registered (its hash or the block cached
  /// already, or its refcount at its limit) is skipped and the others go on.
  /// An installed sink gets one BlockStored per unbroken run of newly
  /// registered blocks (vLLM publishes one per request and step). Returns how
  /// many were registered. Throws InvalidArgument, before any change, for
  /// spans of different lengths, tokens of the wrong length, or a block out
  /// of range or free. Allocates nothing.
  std::size_t insert_run(std::span<const BlockHash> hashes, std::span<const BlockId> blocks,
                         const BlockOrigin& origin,
                         std::source_location where = std::source_location::current());

  /// Gives back a sequence's reference. An uncached block is dec_ref'd (and
  /// freed at 0); a cached block whose last sequence reference goes joins the
  /// LRU tail (most recently used). A release of a cached block no sequence
  /// holds is a caller bug: logged, counted in ignored_releases and ignored,
  /// as PagedKvCache::dec_ref does at refcount 0. Throws InvalidArgument out
  /// of range.
  void release(BlockId block, std::source_location where = std::source_location::current());

  /// release() for a block a running sequence's freeing rules let go (a
  /// sliding-window or chunked group's block that left its span): when its
  /// last sequence reference goes, a cached block joins a demoted queue whose
  /// blocks are evicted before every other evictable block (here, and in a
  /// shared pool before any member's other blocks), oldest first. Such a
  /// block serves only a hit exactly where it ends a window; the blocks a
  /// table keeps for its hit points (HybridBlockTable::keep_hit_point) are
  /// released as usual. Otherwise as release() (and as release() when the
  /// queue, reserved on the first call, cannot be allocated). Throws
  /// InvalidArgument out of range.
  void release_demoted(BlockId block, std::source_location where = std::source_location::current());

  /// Releases a sequence's block table, last block first: the tail joins the
  /// LRU list before the head, so a shared prefix stays cached longest.
  /// Validates every id before any release.
  void release_blocks(std::span<const BlockId> table,
                      std::source_location where = std::source_location::current());

  /// Evicts up to `max_blocks` evictable blocks, least recently used first,
  /// whether or not the free list is empty (to hand memory back, or in
  /// tests). Returns how many were evicted. A tier (set_tier) is not told:
  /// the evicted blocks' contents are dropped.
  std::size_t evict(std::size_t max_blocks,
                    std::source_location where = std::source_location::current());

  /// Evicts up to `max_blocks` evictable blocks, least recently used first,
  /// like evict(), but hands the cache's reference on each to the caller
  /// instead of freeing it: each block is appended to `out` with the hash it
  /// was cached under and comes back uncached, refcount 1, owned by the
  /// caller, who gives it back with release() (a lower tier copies it out
  /// first). Counted as evictions. Returns how many were appended.
  std::size_t detach_lru(std::size_t max_blocks, std::vector<std::pair<BlockId, BlockHash>>& out,
                         std::source_location where = std::source_location::current());

  /// Drops every cached block at once, as vLLM's reset_prefix_cache: only
  /// when no sequence (and no tier's copy) holds a cached block, i.e. every
  /// cached block is evictable; otherwise returns false and changes nothing.
  /// The blocks go back to the free list (counted as evictions; a tier is not
  /// told, its own blocks stay) and an installed sink gets one cleared
  /// instead of a removal per block.
  bool reset(std::source_location where = std::source_location::current());

  // ---- a lower tier -------------------------------------------------------------------

  /// Installs `tier` (nullptr: none) as the lower tier: see PrefixCacheTier.
  /// HostTier installs itself and removes itself in its destructor.
  void set_tier(PrefixCacheTier* tier) noexcept;
  PrefixCacheTier* tier() const noexcept;

  // ---- events (cache_events.hpp) -------------------------------------------------------

  /// Installs `sink` (nullptr: none, the default) for this cache's events,
  /// announced as `source` (medium GPU; a group's index, kind and window for a
  /// HybridKvCache's group): stored when blocks are registered (insert,
  /// insert_run, a lower tier's onload), removed when they stop being cached
  /// (an eviction at allocation, evict(), detach_lru(): a block handed to a
  /// lower tier leaves this medium), cleared by the destructor when a sink is
  /// still installed. Called inside those operations, on the cache's thread;
  /// the sink must stay valid until it is uninstalled or the cache destroyed.
  /// Without a sink nothing is recorded or called. The first sink makes the
  /// cache keep every block's origin from then on (keep_block_origins): blocks
  /// registered before are announced (by snapshot) without parent or tokens.
  /// Throws std::bad_alloc when that memory cannot be had (nothing installed).
  void set_event_sink(CacheEventSink* sink, EventSource source = {});
  CacheEventSink* event_sink() const noexcept;
  /// The source set with the sink (a default GPU source before).
  const EventSource& event_source() const noexcept;

  /// The BlockStored events that describe every block cached now, one per
  /// block, a block after its parent where the parent is cached too, with
  /// event_source(): a sink (a publisher's buffer) that starts late or lost
  /// events gets the whole set. A snapshot is taken on the cache's thread,
  /// like every call (the cache is not thread-safe); a publisher asks that
  /// thread for it and hands the events over. O(num_blocks); allocates.
  void snapshot(CacheEventSink& sink) const;

  /// Keeps the origin (parent, tokens, extra key) of every block registered
  /// from now on: tokens_per_block() token ids and 32 bytes per block of the
  /// PagedKvCache, allocated once by the first call (set_event_sink calls it,
  /// and so does a HostTier's, whose events need the tokens of the blocks it
  /// is handed). Throws std::bad_alloc.
  void keep_block_origins();
  bool keeps_block_origins() const noexcept;
  /// Tokens one registered block covers, as origins and events carry them:
  /// block_size() unless set. A state group's prefix cache (block_size() 1:
  /// one slot per state) covers a block of the hybrid cache's size
  /// (HybridKvCache sets it). Throws InvalidArgument for 0, or for another
  /// count once origins are kept.
  void set_tokens_per_block(std::size_t tokens);
  std::size_t tokens_per_block() const noexcept;
  /// The origin `block` was last registered with (its tokens a view into the
  /// cache's memory, valid until the block is registered again), or nullopt
  /// when origins are not kept or the block was never registered since. Kept
  /// after the block is evicted, so that a tier it was handed to by
  /// detach_lru can read it. OutOfRange out of range.
  std::optional<BlockOrigin> block_origin(BlockId block) const;

  // ---- state ------------------------------------------------------------------------

  bool is_cached(BlockId block) const;
  /// The hash `block` is cached under, or nullopt.
  std::optional<BlockHash> hash_of(BlockId block) const;
  /// The cached block for `hash`, or nullopt; takes no reference.
  std::optional<BlockId> find(const BlockHash& hash) const;
  /// Whether `block` is in the LRU list.
  bool is_evictable(BlockId block) const;
  /// The LRU list, least recently used (next evicted) first. O(n), for tests
  /// and diagnostics.
  std::vector<BlockId> lru_order() const;

  std::size_t num_cached_blocks() const noexcept;
  std::size_t num_evictable_blocks() const noexcept;
  /// Blocks an allocation can get: free plus evictable, plus the blocks a
  /// tier holds and gives back on demand (PrefixCacheTier::reclaimable_blocks).
  std::size_t num_available_blocks() const noexcept;
  std::size_t block_size() const noexcept;
  PagedKvCache& kv_cache() const noexcept;
  const PrefixCacheCounters& counters() const noexcept;
  /// The bookkeeping's memory. It is all allocated at construction and does
  /// not change afterwards: about 50 bytes per block of the PagedKvCache
  /// (docs/performance.md has the breakdown), whether or not it is cached;
  /// plus, once an event sink was installed, the blocks' origins.
  PrefixCacheMemory memory_usage() const noexcept;

  /// PagedKvCache::check_invariants() plus: every evictable block is cached
  /// with refcount 1; every cached block with refcount 1 is evictable and
  /// every other cached block has refcount >= 2 (a cached block is never
  /// free); the hash map and the per-block hashes agree; free + evictable +
  /// in use == num_blocks. O(num_blocks).
  InvariantReport check_invariants() const;

 private:
  friend class SharedBlockPool;
  // For a shared pool (shared_block_pool.hpp): the pool-wide release time of
  // this cache's least recently released evictable block (false: none); give
  // up one block to the pool (the tier first, as make_room does); what the
  // tier can reclaim.
  bool oldest_evictable_tick(std::uint64_t& tick, bool& demoted);
  void give_up_one(const std::source_location& where);
  std::size_t tier_reclaimable_blocks() const noexcept;

  struct State;
  std::unique_ptr<State> state_;
  // HybridKvCache::over(*this), made on first use; destroyed before state_.
  friend class HybridKvCache;
  std::unique_ptr<HybridKvCache> group_view_;
};

}  // namespace kvport
