// SPDX-License-Identifier: Apache-2.0
#include "kvport/core/prefix_cache.hpp"

#include "kvport/core/hybrid_kv_cache.hpp"
#include "kvport/core/shared_block_pool.hpp"

#include <absl/container/flat_hash_set.h>
#include <fmt/format.h>

#include <algorithm>
#include <array>
#include <cstdint>
#include <exception>
#include <limits>
#include <new>
#include <utility>

#include "kvport/platform/error.hpp"
#include "kvport/platform/log.hpp"
#include "log_nothrow.hpp"

namespace kvport {
namespace {

// One per block, indexed by block id. `gen` counts the block's joins of the
// LRU queue, so a queue slot left over from an earlier join is recognised as
// stale (lazy deletion, below).
struct Entry {
  BlockHash hash;
  std::uint32_t gen = 0;
  bool cached = false;
  bool linked = false;   // evictable: its newest queue slot is live
  bool demoted = false;  // linked in the demoted queue (release_demoted)
};

// The hash index is a set of block ids whose key is the block's hash, kept in
// the per-block entries: a slot is 4 bytes instead of 24 (hash + id), so the
// table at half load costs ~10 bytes per block and mostly stays in cache. A
// lookup by hash is heterogeneous (is_transparent). The keys are uniform
// XXH3-128 hashes, so the table's hash is their low word, unmixed.
struct IdHash {
  using is_transparent = void;
  const Entry* entries;
  std::size_t operator()(BlockId b) const noexcept { return entries[b].hash.low; }
  std::size_t operator()(const BlockHash& h) const noexcept { return h.low; }
};

struct IdEq {
  using is_transparent = void;
  const Entry* entries;
  bool operator()(BlockId a, BlockId b) const noexcept {
    return entries[a].hash == entries[b].hash;
  }
  bool operator()(BlockId a, const BlockHash& h) const noexcept { return entries[a].hash == h; }
  bool operator()(const BlockHash& h, BlockId b) const noexcept { return entries[b].hash == h; }
};

using HashIndex = absl::flat_hash_set<BlockId, IdHash, IdEq>;

// What a block was last registered with (PrefixCache::keep_block_origins).
struct OriginRecord {
  BlockHash parent;
  std::uint64_t extra_key = 0;
  bool registered = false;  // since origins are kept
  bool has_parent = false;
  bool has_tokens = false;
};

static_assert(sizeof(OriginRecord) == 32, "prefix_cache.hpp and docs/events.md say 32 bytes");

// A slot of the LRU queue: live while entries[block] is linked with this gen.
struct QueueSlot {
  BlockId block;
  std::uint32_t gen;
};

// One queue of evictable blocks (below): its slots, some stale, from `head`.
struct LruQueue {
  std::vector<QueueSlot> slots;
  std::size_t head = 0;    // the slots before it are consumed
  std::size_t live = 0;    // live slots
  std::size_t pushes = 0;  // since the last compaction
  // The head last found live (oldest()) and the state's unlink count then:
  // while neither moved it is still live, and its tick is known, so a shared
  // pool's scan for the oldest block of every group reads no entry again.
  std::size_t checked_head = SIZE_MAX;
  std::uint64_t checked_unlinks = 0;
  std::uint64_t checked_tick = 0;
};

}  // namespace

// The LRU order is a FIFO queue of release events with lazy deletion: a block
// that becomes evictable is appended (the tail is the most recently used); a
// lookup hit only clears the block's `linked` flag, leaving its slot behind as
// stale, and eviction skips stale slots at the head. So a hit touches no
// neighbour (a linked list's unlink writes two other blocks' entries, two
// cache misses on a large cache), and the order of the live slots is exactly
// the order a doubly-linked LRU list would hold. The queue is compacted when
// more than half of it is stale, which keeps it under 2 * evictable + 64
// slots (the consumed head included) and every operation amortized O(1).
struct PrefixCache::State {
  explicit State(PagedKvCache& cache)
      : kv(&cache),
        pool(cache.shared_pool()),
        entries(cache.num_blocks()),
        index(0, IdHash{entries.data()}, IdEq{entries.data()}) {
    if (pool != nullptr) ticks.assign(cache.num_blocks(), 0);
    // At most one hash per block. Reserving 1/8 above that keeps the load
    // under the 25/32 at which absl grows instead of dropping tombstones in
    // place, and at least 32 keeps the table above one group (16 slots),
    // where absl always grows: the index never reallocates after this.
    const std::size_t n = cache.num_blocks();
    index.reserve(std::max<std::size_t>(n + n / 8 + 1, 32));
    // link() never holds more than 2 * num_blocks + 65 slots (see there), so
    // with this capacity it never reallocates: a release does not throw.
    lru.slots.reserve(2 * n + 65);
  }

  BlockId id_of(std::size_t i) const { return static_cast<BlockId>(i); }

  void check(BlockId block, const char* op) const {
    if (block >= entries.size()) {
      throw OutOfRange(fmt::format("PrefixCache::{}: block {} out of range (num_blocks = {})", op,
                                   block, entries.size()));
    }
  }

  bool live(const QueueSlot& q) const {
    const Entry& e = entries[q.block];
    return e.linked && e.gen == q.gen;
  }

  // Appends `block` (cached, refcount 1) at the most recently used end of
  // queue `q` (lru, or demoted: which must be reserved). Before the push a
  // queue holds at most 2 * live + 64 slots (else it is compacted to live -
  // 1), so it never passes 2 * num_blocks + 65.
  void link(BlockId block, LruQueue& q) noexcept {
    Entry& e = entries[block];
    ++e.gen;
    e.linked = true;
    e.demoted = &q == &demoted;
    ++q.live;
    if (pool != nullptr) ticks[block] = pool->next_tick();
    push(q, {block, e.gen});
  }
  void link(BlockId block) noexcept { link(block, lru); }

  void unlink(Entry& e) {
    ++unlinks;
    e.linked = false;
    --(e.demoted ? demoted : lru).live;
    e.demoted = false;
  }

  std::size_t evictable() const noexcept { return lru.live + demoted.live; }

  // Appends `slot` to `q` (whose live count includes it), compacting it
  // first: when more than half of it is stale, dropping the stale slots and
  // the consumed head, and every 2^31 pushes, so that no stale slot outlives
  // 2^32 joins of its block (a wrapped gen).
  void push(LruQueue& q, QueueSlot slot) noexcept {
    if (q.slots.size() > 2 * q.live + 64 || q.pushes >= kMaxPushes) {
      std::size_t out = 0;
      for (std::size_t i = q.head; i < q.slots.size(); ++i) {
        if (live(q.slots[i])) q.slots[out++] = q.slots[i];
      }
      q.slots.resize(out);
      q.head = 0;
      q.pushes = 0;
      q.checked_head = SIZE_MAX;
    }
    q.slots.push_back(slot);
    ++q.pushes;
  }

  // The queue eviction takes from: the demoted blocks first.
  LruQueue& victims() noexcept { return demoted.live != 0 ? demoted : lru; }

  // The oldest live slot (some block must be evictable), the stale head
  // dropped.
  const QueueSlot& oldest() noexcept {
    LruQueue& q = victims();
    if (q.head == q.checked_head && q.checked_unlinks == unlinks) return q.slots[q.head];
    while (!live(q.slots[q.head]))
      ++q.head;
    q.checked_head = q.head;
    q.checked_unlinks = unlinks;
    q.checked_tick = pool != nullptr ? ticks[q.slots[q.head].block] : 0;
    return q.slots[q.head];
  }

  // The next block to evict (a demoted one first); some block must be
  // evictable.
  BlockId pop_lru() {
    LruQueue& q = victims();
    const BlockId block = oldest().block;
    ++q.head;
    unlink(entries[block]);
    // The next eviction (a shared pool's scan, which asks every group for
    // its oldest block) reads the new head's entry and tick: fetch them now.
    if (q.head < q.slots.size()) {
      const BlockId next = q.slots[q.head].block;
      __builtin_prefetch(&entries[next]);
      if (pool != nullptr) __builtin_prefetch(&ticks[next]);
    }
    return block;
  }

  // Drops the least recently used evictable block's hash and returns the
  // block to the free list.
  void evict_one(const std::source_location& where) {
    const BlockId block = detach_one();
    kv->return_evicted_block(block, where);
  }

  // Drops the least recently used evictable block's hash; the block keeps
  // the cache's reference (refcount 1), now the caller's.
  BlockId detach_one() {
    const BlockId block = pop_lru();
    // Evictions come in runs (a prefill evicts one block per block) and the
    // next victims are known: fetch the entry of the one kFar ahead and,
    // its entry having arrived by now, the index slot of the one kNear ahead,
    // so that a run of evictions does not wait on each of those misses.
    constexpr std::size_t kNear = 8;
    constexpr std::size_t kFar = 16;
    const LruQueue& q = victims();
    if (q.head + kFar < q.slots.size()) __builtin_prefetch(&entries[q.slots[q.head + kFar].block]);
    if (q.head + kNear < q.slots.size())
      index.prefetch(entries[q.slots[q.head + kNear].block].hash);
    Entry& e = entries[block];
    index.erase(block);
    e.cached = false;
    ++counters.evictions;
    if (sink != nullptr) note_removed(e.hash);
    return block;
  }

  // ---- events ------------------------------------------------------------------------
  // Removals are gathered (evictions come in runs) and handed to the sink at
  // the end of the operation that evicted, and before any stored event, so
  // the sink sees them in the order they happened.
  void note_removed(const BlockHash& hash) noexcept {
    if (removed_count == removed.size()) flush_removed();
    removed[removed_count++] = hash;
  }
  void flush_removed() noexcept {
    if (removed_count == 0 || sink == nullptr) {
      removed_count = 0;
      return;
    }
    sink->removed(source, std::span<const BlockHash>(removed.data(), removed_count));
    removed_count = 0;
  }

  void record_origin(BlockId block, const std::optional<BlockHash>& parent,
                     std::span<const TokenId> tokens, std::uint64_t extra_key) noexcept {
    OriginRecord& o = origins[block];
    o.registered = true;
    o.has_parent = parent.has_value();
    o.parent = parent.value_or(BlockHash{});
    o.extra_key = extra_key;
    o.has_tokens = !tokens.empty();
    if (o.has_tokens) std::copy(tokens.begin(), tokens.end(), origin_tokens_of(block).begin());
  }
  std::span<TokenId> origin_tokens_of(BlockId block) noexcept {
    return {origin_tokens.data() + std::size_t{block} * origin_bs, origin_bs};
  }
  std::span<const TokenId> origin_tokens_of(BlockId block) const noexcept {
    return {origin_tokens.data() + std::size_t{block} * origin_bs, origin_bs};
  }

  void emit_stored(std::span<const BlockHash> hashes, const std::optional<BlockHash>& parent,
                   std::span<const TokenId> tokens, std::uint64_t extra_key) noexcept {
    flush_removed();
    BlockStoredView view;
    view.hashes = hashes;
    view.parent = parent;
    view.tokens = tokens;
    view.block_size = static_cast<std::uint32_t>(origin_bs);
    view.extra_key = extra_key;
    sink->stored(source, view);
  }

  // Registers `block` (in range, held) under `hash` with its origin; false
  // when the block or the hash is cached already. Throws what inc_ref throws
  // (a refcount at its limit), changing nothing.
  // A block the tier brought in (`from_tier`) is not announced to it.
  bool register_block(PrefixCache& self, const BlockHash& hash, BlockId block,
                      const std::optional<BlockHash>& parent, std::span<const TokenId> tokens,
                      std::uint64_t extra_key, const std::source_location& where,
                      bool from_tier = false) {
    Entry& e = entries[block];
    if (e.cached) return false;
    // The index hashes and compares a block by entries[block].hash, so the
    // hash goes in first; an uncached block's hash is never read, so a failed
    // insert leaves nothing behind.
    e.hash = hash;
    auto [it, inserted] = index.insert(block);
    if (!inserted) return false;
    try {
      kv->inc_ref(block, where);
    } catch (...) {
      index.erase(it);
      throw;
    }
    e.cached = true;
    ++counters.inserts;
    if (!origins.empty()) record_origin(block, parent, tokens, extra_key);
    if (tier != nullptr && !from_tier) tier->on_insert(self, block, hash);
    return true;
  }

  // The lookup's continuation below the device (PrefixCacheTier): the tier
  // finds and pins a run after the device's match, this cache allocates the
  // device blocks for it, the tier loads them, this cache registers what
  // landed (announced as stored on the device, not to the tier: it holds
  // them already) and appends it to `match`.
  void load_from_tier(PrefixCache& self, std::span<const BlockHash> hashes, PrefixMatch& match,
                      const std::source_location& where) noexcept {
    const std::size_t start = match.blocks.size();
    const std::size_t run = tier->find_run(hashes, start);
    if (run == 0) return;
    std::vector<BlockId> blocks;
    std::size_t offered = 0;  // blocks handed to the tier: all, unless allocating failed
    try {
      blocks.reserve(run);
      match.blocks.reserve(start + run);  // the appends below must not throw
      match.hashes.reserve(start + run);
      for (std::size_t i = 0; i < run; ++i) {
        const std::optional<BlockId> block = self.try_alloc_block(where);
        if (!block) break;
        blocks.push_back(*block);
      }
      offered = blocks.size();
    } catch (const std::exception& e) {
      detail::log_error_nothrow("PrefixCache: allocating {} block(s) for the tier's run failed: {}",
                                run, e.what());
    }
    const TierLoad load = tier->load_run(std::span<const BlockId>(blocks).first(offered));
    const std::size_t landed = load.landed;
    for (std::size_t i = blocks.size(); i-- > landed + load.kept;) {
      try {
        self.release(blocks[i], where);  // uncached: freed, its contents never seen
      } catch (...) {                    // only logging can throw; the release itself happened
      }
    }
    if (landed == 0) return;
    for (std::size_t i = 0; i < landed; ++i) {
      const BlockHash& hash = hashes[start + i];
      const BlockOrigin origin = tier->run_origin(i);
      try {
        if (register_block(self, hash, blocks[i], origin.parent, origin.tokens, origin.extra_key,
                           where, /*from_tier=*/true) &&
            sink != nullptr)
          emit_stored({&hash, 1}, origin.parent, origin.tokens, origin.extra_key);
      } catch (const std::exception& e) {  // a refcount overflow: the block stays private
        detail::log_error_nothrow("PrefixCache: registering block {} from the tier failed: {}",
                                  blocks[i], e.what());
      }
      match.blocks.push_back(blocks[i]);
      match.hashes.push_back(hash);
    }
    match.num_tokens = match.blocks.size() * self.block_size();
    match.lower_tier_blocks += landed;
    tier->finish_run();
  }

  // Drops a sequence's reference on `block` (in range): a cached block whose
  // last sequence reference goes joins queue `q` (reserved); an uncached one
  // goes back as PagedKvCache::dec_ref says. A release of a cached block no
  // sequence holds is logged, counted and ignored (a double free).
  void release_into(BlockId block, const std::source_location& where, LruQueue& q) {
    if (!entries[block].cached) {
      kv->dec_ref(block, where);  // handles (and reports) refcount 0 itself
      return;
    }
    const std::uint32_t refs = kv->ref_count(block);
    if (refs <= 1) {
      ++counters.ignored_releases;
      log::error(fmt::format(
          "PrefixCache::release on cached block {} that no sequence holds (from {}:{} in {}) - a "
          "double free; ignored so that the cached block is not freed while it is in the cache",
          block, where.file_name(), where.line(), where.function_name()));
      return;
    }
    kv->dec_ref(block, where);
    if (refs == 2) link(block, q);  // only the cache's reference is left
  }

  void check_held(BlockId block, const char* op) const {
    check(block, op);
    if (kv->ref_count(block) == 0) {
      throw InvalidArgument(fmt::format(
          "PrefixCache::{}: block {} is free (refcount 0); only a block a sequence holds can "
          "be cached",
          op, block));
    }
  }

  void make_room(PrefixCache& self, const std::source_location& where) {
    if (kv->num_free_blocks() != 0) return;
    if (pool != nullptr) {  // the oldest evictable block of any group goes
      pool->make_room(where);
      return;
    }
    give_up_one(self, where);
  }

  void give_up_one(PrefixCache& self, const std::source_location& where) {
    if (tier != nullptr) tier->on_free_list_empty(self, where);
    if (kv->num_free_blocks() == 0 && evictable() != 0) {
      evict_one(where);
      flush_removed();
    }
  }

  static constexpr std::size_t kMaxPushes = std::size_t{1} << 31;

  PagedKvCache* kv;
  SharedBlockPool* pool;             // the kv cache's shared pool, or nullptr
  std::vector<std::uint64_t> ticks;  // shared pool: each block's last release time
  std::vector<Entry> entries;        // never resized: the index's hasher points into it
  HashIndex index;                   // the cached blocks, keyed by their hash
  LruQueue lru;                      // released blocks, least recently first
  LruQueue demoted;                  // release_demoted's blocks, evicted before lru's
  std::uint64_t unlinks = 0;         // blocks that left a queue (LruQueue::checked_head)
  PrefixCacheCounters counters;
  PrefixCacheTier* tier = nullptr;
  // Events: the sink (nullptr: none) and what it is told the source is; the
  // removals not handed over yet; the blocks' origins once kept (empty
  // before: one record and block_size tokens per block).
  CacheEventSink* sink = nullptr;
  EventSource source;
  std::array<BlockHash, 64> removed{};
  std::size_t removed_count = 0;
  std::vector<OriginRecord> origins;
  std::vector<TokenId> origin_tokens;
  std::size_t origin_bs = kv->config().block_size;  // tokens a registered block covers
};

PrefixCache::PrefixCache(PagedKvCache& cache) : state_(std::make_unique<State>(cache)) {
  if (state_->pool != nullptr) state_->pool->attach(this);
}

bool PrefixCache::oldest_evictable_tick(std::uint64_t& tick, bool& demoted) {
  State& s = *state_;
  if (s.evictable() == 0) return false;
  demoted = s.demoted.live != 0;
  (void)s.oldest();
  tick = s.victims().checked_tick;
  return true;
}

void PrefixCache::give_up_one(const std::source_location& where) {
  state_->give_up_one(*this, where);
}

std::size_t PrefixCache::tier_reclaimable_blocks() const noexcept {
  return state_->tier != nullptr ? state_->tier->reclaimable_blocks() : 0;
}

PrefixCache::~PrefixCache() {
  State& s = *state_;
  if (s.sink != nullptr) s.sink->cleared(s.source);
  for (std::size_t b = 0; b < s.entries.size(); ++b) {
    Entry& e = s.entries[b];
    if (!e.cached) continue;
    e.cached = false;
    e.linked = false;
    try {
      s.kv->return_evicted_block(s.id_of(b));
    } catch (...) {  // logging failed: the reference is dropped regardless
    }
  }
  if (s.pool != nullptr) s.pool->detach(this);
}

// ---- lookup -----------------------------------------------------------------------------

PrefixMatch PrefixCache::lookup(std::span<const TokenId> tokens, std::uint64_t extra_key,
                                std::source_location where) {
  const std::vector<BlockHash> hashes = hash_full_blocks(tokens, block_size(), extra_key);
  return lookup_hashes(hashes, where);
}

PrefixMatch PrefixCache::lookup_hashes(std::span<const BlockHash> hashes,
                                       std::source_location where) {
  State& s = *state_;
  PrefixMatch match;
  // On a cache larger than the CPU's caches each probe misses; prefetching a
  // few hashes ahead overlaps those misses (a lookup usually hits on).
  constexpr std::size_t kAhead = 16;
  for (std::size_t i = 0; i < std::min(kAhead, hashes.size()); ++i)
    s.index.prefetch(hashes[i]);
  match.blocks.reserve(hashes.size());
  for (std::size_t i = 0; i < hashes.size(); ++i) {
    if (i + kAhead < hashes.size()) s.index.prefetch(hashes[i + kAhead]);
    auto it = s.index.find(hashes[i]);
    if (it == s.index.end()) break;
    match.blocks.push_back(*it);
  }
  // The blocks after the match are usually prefilled and registered next:
  // start fetching where the first of their hashes go in the index.
  constexpr std::size_t kRegisterAhead = 64;
  const std::size_t end = std::min(hashes.size(), match.blocks.size() + 1 + kRegisterAhead);
  for (std::size_t i = match.blocks.size() + 1; i < end; ++i)
    s.index.prefetch(hashes[i]);
  match.hashes.assign(hashes.begin(),
                      hashes.begin() + static_cast<std::ptrdiff_t>(match.blocks.size()));
  // Nothing below allocates; inc_ref throws only when a refcount would pass
  // 2^32 - 1, and then the references taken so far are given back.
  std::size_t taken = 0;
  try {
    for (; taken < match.blocks.size(); ++taken) {
      const BlockId b = match.blocks[taken];
      s.kv->inc_ref(b, where);
      Entry& e = s.entries[b];
      if (e.linked) s.unlink(e);
    }
  } catch (...) {
    for (std::size_t i = taken; i-- > 0;)
      release(match.blocks[i], where);
    throw;
  }
  match.num_tokens = match.blocks.size() * block_size();
  ++s.counters.lookups;
  s.counters.hits += match.blocks.size();
  s.counters.misses += hashes.size() - match.blocks.size();
  if (s.tier != nullptr && match.blocks.size() < hashes.size())
    s.load_from_tier(*this, hashes, match, where);
  return match;
}

// ---- allocation and release ------------------------------------------------------------

BlockId PrefixCache::alloc_block(std::source_location where) {
  state_->make_room(*this, where);
  return state_->kv->alloc_block(where);
}

std::optional<BlockId> PrefixCache::try_alloc_block(std::source_location where) {
  state_->make_room(*this, where);
  return state_->kv->try_alloc_block(where);
}

bool PrefixCache::insert(const BlockHash& hash, BlockId block, std::source_location where) {
  return insert(hash, block, BlockOrigin{}, where);
}

bool PrefixCache::insert(const BlockHash& hash, BlockId block, const BlockOrigin& origin,
                         std::source_location where) {
  State& s = *state_;
  s.check_held(block, "insert");
  if (!origin.tokens.empty() && origin.tokens.size() != s.origin_bs) {
    throw InvalidArgument(fmt::format("PrefixCache::insert: {} tokens for one block of {}",
                                      origin.tokens.size(), s.origin_bs));
  }
  if (!s.register_block(*this, hash, block, origin.parent, origin.tokens, origin.extra_key,
                        where)) {
    return false;
  }
  if (s.sink != nullptr) s.emit_stored({&hash, 1}, origin.parent, origin.tokens, origin.extra_key);
  return true;
}

std::size_t PrefixCache::insert_run(std::span<const BlockHash> hashes,
                                    std::span<const BlockId> blocks, const BlockOrigin& origin,
                                    std::source_location where) {
  State& s = *state_;
  const std::size_t n = hashes.size();
  const std::size_t bs = s.origin_bs;
  if (blocks.size() != n) {
    throw InvalidArgument(
        fmt::format("PrefixCache::insert_run: {} blocks for {} hashes", blocks.size(), n));
  }
  if (!origin.tokens.empty() && origin.tokens.size() != n * bs) {
    throw InvalidArgument(fmt::format("PrefixCache::insert_run: {} tokens for {} blocks of {}",
                                      origin.tokens.size(), n, bs));
  }
  for (BlockId b : blocks)
    s.check_held(b, "insert_run");
  if (!s.origins.empty()) {
    // The blocks' origin records are scattered over num_blocks of them: start
    // fetching every one the run writes, so that the copies below overlap
    // those misses instead of waiting on each.
    for (BlockId b : blocks) {
      __builtin_prefetch(&s.origins[b], 1);
      __builtin_prefetch(s.origin_tokens.data() + std::size_t{b} * s.origin_bs, 1);
    }
  }
  auto parent_of = [&](std::size_t i) {
    return i == 0 ? origin.parent : std::optional<BlockHash>(hashes[i - 1]);
  };
  auto tokens_of = [&](std::size_t i, std::size_t count) {
    return origin.tokens.empty() ? std::span<const TokenId>{}
                                 : origin.tokens.subspan(i * bs, count * bs);
  };
  constexpr std::size_t kNone = std::numeric_limits<std::size_t>::max();
  std::size_t run = kNone;  // the first block of the run of registered blocks
  auto flush = [&](std::size_t end) {
    if (run != kNone && s.sink != nullptr) {
      s.emit_stored(hashes.subspan(run, end - run), parent_of(run), tokens_of(run, end - run),
                    origin.extra_key);
    }
    run = kNone;
  };
  std::size_t registered = 0;
  for (std::size_t i = 0; i < n; ++i) {
    bool ok = false;
    try {
      ok = s.register_block(*this, hashes[i], blocks[i], parent_of(i), tokens_of(i, 1),
                            origin.extra_key, where);
    } catch (const std::exception& e) {  // a refcount at its limit: the block stays uncached
      try {
        log::error(fmt::format("PrefixCache::insert_run: block {} not registered: {}", blocks[i],
                               e.what()));
      } catch (...) {
      }
    }
    if (ok) {
      ++registered;
      if (run == kNone) run = i;
    } else {
      flush(i);
    }
  }
  flush(n);
  return registered;
}

void PrefixCache::release(BlockId block, std::source_location where) {
  State& s = *state_;
  s.check(block, "release");
  s.release_into(block, where, s.lru);
}

void PrefixCache::release_demoted(BlockId block, std::source_location where) {
  State& s = *state_;
  s.check(block, "release_demoted");
  LruQueue* queue = &s.demoted;
  if (s.demoted.slots.capacity() == 0) {
    try {
      s.demoted.slots.reserve(2 * s.entries.size() + 65);
    } catch (const std::bad_alloc&) {  // no demoted queue: an ordinary release
      queue = &s.lru;
    }
  }
  s.release_into(block, where, *queue);
}

void PrefixCache::release_blocks(std::span<const BlockId> table, std::source_location where) {
  for (BlockId block : table)
    state_->check(block, "release_blocks");
  for (auto it = table.rbegin(); it != table.rend(); ++it)
    release(*it, where);
}

std::size_t PrefixCache::evict(std::size_t max_blocks, std::source_location where) {
  std::size_t n = 0;
  for (; n < max_blocks && state_->evictable() != 0; ++n)
    state_->evict_one(where);
  state_->flush_removed();
  return n;
}

std::size_t PrefixCache::detach_lru(std::size_t max_blocks,
                                    std::vector<std::pair<BlockId, BlockHash>>& out,
                                    std::source_location /*where*/) {
  State& s = *state_;
  const std::size_t n = std::min(max_blocks, s.evictable());
  out.reserve(out.size() + n);  // the only allocation: nothing is detached if it throws
  for (std::size_t i = 0; i < n; ++i) {
    const BlockId block = s.detach_one();
    out.emplace_back(block, s.entries[block].hash);
  }
  s.flush_removed();
  return n;
}

bool PrefixCache::reset(std::source_location where) {
  State& s = *state_;
  if (s.index.size() != s.evictable()) return false;
  CacheEventSink* const sink = s.sink;
  s.sink = nullptr;  // one cleared, not a removal per block
  while (s.evictable() != 0)
    s.evict_one(where);
  s.sink = sink;
  if (sink != nullptr) sink->cleared(s.source);
  return true;
}

void PrefixCache::set_tier(PrefixCacheTier* tier) noexcept {
  state_->tier = tier;
}

PrefixCacheTier* PrefixCache::tier() const noexcept {
  return state_->tier;
}

// ---- events ---------------------------------------------------------------------------------

void PrefixCache::set_event_sink(CacheEventSink* sink, EventSource source) {
  State& s = *state_;
  if (sink != nullptr) keep_block_origins();
  s.sink = sink;
  s.source = std::move(source);
}

CacheEventSink* PrefixCache::event_sink() const noexcept {
  return state_->sink;
}

const EventSource& PrefixCache::event_source() const noexcept {
  return state_->source;
}

void PrefixCache::keep_block_origins() {
  State& s = *state_;
  if (!s.origins.empty() || s.entries.empty()) return;
  std::vector<TokenId> tokens(s.entries.size() * s.origin_bs);
  s.origins.resize(s.entries.size());  // tokens first: nothing kept when either throws
  s.origin_tokens = std::move(tokens);
}

void PrefixCache::set_tokens_per_block(std::size_t tokens) {
  State& s = *state_;
  if (tokens == 0) throw InvalidArgument("PrefixCache::set_tokens_per_block: 0 tokens");
  if (!s.origins.empty() && tokens != s.origin_bs) {
    throw InvalidArgument(fmt::format(
        "PrefixCache::set_tokens_per_block: origins of {} tokens are kept already", s.origin_bs));
  }
  s.origin_bs = tokens;
}

std::size_t PrefixCache::tokens_per_block() const noexcept {
  return state_->origin_bs;
}

bool PrefixCache::keeps_block_origins() const noexcept {
  return !state_->origins.empty();
}

std::optional<BlockOrigin> PrefixCache::block_origin(BlockId block) const {
  const State& s = *state_;
  s.check(block, "block_origin");
  if (s.origins.empty() || !s.origins[block].registered) return std::nullopt;
  const OriginRecord& o = s.origins[block];
  BlockOrigin origin;
  if (o.has_parent) origin.parent = o.parent;
  if (o.has_tokens) origin.tokens = s.origin_tokens_of(block);
  origin.extra_key = o.extra_key;
  return origin;
}

void PrefixCache::snapshot(CacheEventSink& sink) const {
  const State& s = *state_;
  const std::uint32_t bs = static_cast<std::uint32_t>(s.origin_bs);
  std::vector<bool> seen(s.entries.size(), false);
  std::vector<BlockId> chain;
  auto announce = [&](BlockId b) {
    const Entry& e = s.entries[b];
    const std::optional<BlockOrigin> o = block_origin(b);
    sink.stored(s.source, stored_view({&e.hash, 1}, bs, o ? &*o : nullptr));
  };
  for (BlockId b : s.index) {
    if (seen[b]) continue;
    // Up the chain while the parent is cached and not announced yet, then
    // down again: every parent that is cached comes before its children.
    chain.clear();
    for (BlockId c = b;;) {
      seen[c] = true;
      chain.push_back(c);
      if (s.origins.empty() || !s.origins[c].has_parent) break;
      auto it = s.index.find(s.origins[c].parent);
      if (it == s.index.end() || seen[*it]) break;
      c = *it;
    }
    for (auto it = chain.rbegin(); it != chain.rend(); ++it)
      announce(*it);
  }
}

// ---- state ----------------------------------------------------------------------------------

bool PrefixCache::is_cached(BlockId block) const {
  state_->check(block, "is_cached");
  return state_->entries[block].cached;
}

std::optional<BlockHash> PrefixCache::hash_of(BlockId block) const {
  state_->check(block, "hash_of");
  const Entry& e = state_->entries[block];
  if (!e.cached) return std::nullopt;
  return e.hash;
}

std::optional<BlockId> PrefixCache::find(const BlockHash& hash) const {
  auto it = state_->index.find(hash);
  if (it == state_->index.end()) return std::nullopt;
  return *it;
}

bool PrefixCache::is_evictable(BlockId block) const {
  state_->check(block, "is_evictable");
  return state_->entries[block].linked;
}

std::vector<BlockId> PrefixCache::lru_order() const {
  const State& s = *state_;
  std::vector<BlockId> order;
  order.reserve(s.evictable());
  for (const LruQueue* q : {&s.demoted, &s.lru}) {
    for (std::size_t i = q->head; i < q->slots.size(); ++i) {
      if (s.live(q->slots[i])) order.push_back(q->slots[i].block);
    }
  }
  return order;
}

std::size_t PrefixCache::num_cached_blocks() const noexcept {
  return state_->index.size();
}

std::size_t PrefixCache::num_evictable_blocks() const noexcept {
  return state_->evictable();
}

std::size_t PrefixCache::num_available_blocks() const noexcept {
  const State& s = *state_;
  if (s.pool != nullptr) return s.pool->num_available_blocks();
  return s.kv->num_free_blocks() + s.evictable() +
         (s.tier != nullptr ? s.tier->reclaimable_blocks() : 0);
}

std::size_t PrefixCache::block_size() const noexcept {
  return state_->kv->config().block_size;
}

PagedKvCache& PrefixCache::kv_cache() const noexcept {
  return *state_->kv;
}

const PrefixCacheCounters& PrefixCache::counters() const noexcept {
  return state_->counters;
}

PrefixCacheMemory PrefixCache::memory_usage() const noexcept {
  const State& s = *state_;
  PrefixCacheMemory m;
  m.entry_bytes = s.entries.capacity() * sizeof(Entry);
  // absl's table: one control byte per slot plus a cloned group (16 bytes)
  // and a sentinel, then the slots.
  const std::size_t slots = s.index.capacity();
  m.index_bytes = slots == 0 ? 0 : slots * (1 + sizeof(BlockId)) + 16;
  m.lru_bytes = (s.lru.slots.capacity() + s.demoted.slots.capacity()) * sizeof(QueueSlot);
  m.origin_bytes =
      s.origins.capacity() * sizeof(OriginRecord) + s.origin_tokens.capacity() * sizeof(TokenId);
  return m;
}

// ---- diagnostics ----------------------------------------------------------------------------

InvariantReport PrefixCache::check_invariants() const {
  const State& s = *state_;
  InvariantReport report = s.kv->check_invariants();
  std::size_t cached = 0;
  std::size_t linked = 0;
  for (BlockId b = 0; b < s.entries.size(); ++b) {
    const Entry& e = s.entries[b];
    const std::uint32_t rc = s.kv->ref_count(b);
    if (e.linked) ++linked;
    if (!e.cached) {
      if (e.linked)
        report.add_violation(fmt::format("block {} is in the LRU list but not cached", b));
      continue;
    }
    ++cached;
    auto it = s.index.find(e.hash);
    if (it == s.index.end() || *it != b) {
      report.add_violation(
          fmt::format("cached block {} (hash {}) is not what the hash map holds for its hash", b,
                      e.hash.to_string()));
    }
    if (rc == 0) {
      report.add_violation(fmt::format("cached block {} is free (refcount 0)", b));
    } else if (rc == 1 && !e.linked) {
      report.add_violation(fmt::format(
          "cached block {} is held only by the cache but is not in the LRU list (released around "
          "the prefix cache?)",
          b));
    } else if (rc >= 2 && e.linked) {
      report.add_violation(
          fmt::format("block {} is in the LRU list while in use (refcount {})", b, rc));
    }
  }
  if (s.index.size() != cached) {
    report.add_violation(fmt::format("the hash map has {} entries but {} blocks are cached",
                                     s.index.size(), cached));
  }
  for (BlockId b : s.index) {
    if (b >= s.entries.size() || !s.entries[b].cached) {
      report.add_violation(fmt::format("the hash map holds block {}, which is not cached", b));
    }
  }
  std::size_t live = 0;
  for (const LruQueue* queue : {&s.lru, &s.demoted}) {
    const bool demoted = queue == &s.demoted;
    std::size_t live_here = 0;
    for (std::size_t i = queue->head; i < queue->slots.size(); ++i) {
      const QueueSlot& q = queue->slots[i];
      if (q.block >= s.entries.size()) {
        report.add_violation(fmt::format("the LRU queue holds block {}, out of range", q.block));
      } else if (s.live(q)) {
        ++live_here;
        if (s.entries[q.block].demoted != demoted)
          report.add_violation(fmt::format("block {} is live in the wrong LRU queue", q.block));
      }
    }
    if (live_here != queue->live) {
      report.add_violation(fmt::format("the {} queue counts {} blocks but holds {}",
                                       demoted ? "demoted" : "LRU", queue->live, live_here));
    }
    live += live_here;
  }
  if (linked != s.evictable() || live != s.evictable()) {
    report.add_violation(fmt::format(
        "the LRU list counts {} evictable blocks, but {} blocks are linked and {} queue slots live",
        s.evictable(), linked, live));
  }
  report.evictable_blocks = s.evictable();
  report.cached_blocks = cached;
  report.blocks_in_use -= std::min(report.blocks_in_use, report.evictable_blocks);
  if (report.free_blocks + report.evictable_blocks + report.blocks_in_use !=
      report.blocks_checked) {
    report.add_violation(fmt::format("{} free + {} evictable + {} in use != {} blocks",
                                     report.free_blocks, report.evictable_blocks,
                                     report.blocks_in_use, report.blocks_checked));
  }
  return report;
}

}  // namespace kvport
