#include "kvport/core/prefix_cache.hpp"

#include <fmt/format.h>

#include <boost/intrusive/list.hpp>
#include <unordered_map>
#include <utility>

#include "kvport/platform/error.hpp"
#include "kvport/platform/log.hpp"

namespace kvport {
namespace {

// One per block. The hook links the block into the LRU list while it is
// evictable; boost's safe-link mode asserts (in debug builds) that a linked
// node is never destroyed or linked twice.
struct Entry : boost::intrusive::list_base_hook<> {
  BlockHash hash;
  bool cached = false;
};

using LruList = boost::intrusive::list<Entry, boost::intrusive::constant_time_size<true>>;

}  // namespace

struct PrefixCache::State {
  explicit State(PagedKvCache& cache) : kv(&cache), entries(cache.num_blocks()) {
    map.reserve(cache.num_blocks());  // at most one hash per block: never rehashes
  }
  ~State() { lru.clear(); }  // unlink before the entries go

  BlockId id_of(const Entry& e) const { return static_cast<BlockId>(&e - entries.data()); }

  void check(BlockId block, const char* op) const {
    if (block >= entries.size()) {
      throw InvalidArgument(fmt::format("PrefixCache::{}: block {} out of range (num_blocks = {})",
                                        op, block, entries.size()));
    }
  }

  // Drops the least recently used evictable block's hash and returns the
  // block to the free list.
  void evict_one(const std::source_location& where) {
    Entry& e = lru.front();
    lru.pop_front();
    map.erase(e.hash);
    e.cached = false;
    ++counters.evictions;
    kv->return_evicted_block(id_of(e), where);
  }

  void make_room(const std::source_location& where) {
    if (kv->num_free_blocks() == 0 && !lru.empty()) evict_one(where);
  }

  PagedKvCache* kv;
  std::vector<Entry> entries;  // never resized: the LRU list points into it
  LruList lru;                 // front: least recently used
  std::unordered_map<BlockHash, BlockId, BlockHashHasher> map;
  PrefixCacheCounters counters;
};

PrefixCache::PrefixCache(PagedKvCache& cache) : state_(std::make_unique<State>(cache)) {}

PrefixCache::~PrefixCache() {
  State& s = *state_;
  for (Entry& e : s.entries) {
    if (!e.cached) continue;
    if (e.is_linked()) s.lru.erase(s.lru.iterator_to(e));
    e.cached = false;
    try {
      s.kv->return_evicted_block(s.id_of(e));
    } catch (...) {  // logging failed: the reference is dropped regardless
    }
  }
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
  for (const BlockHash& h : hashes) {
    auto it = s.map.find(h);
    if (it == s.map.end()) break;
    match.blocks.push_back(it->second);
  }
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
      if (e.is_linked()) s.lru.erase(s.lru.iterator_to(e));
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
  return match;
}

// ---- allocation and release ------------------------------------------------------------

BlockId PrefixCache::alloc_block(std::source_location where) {
  state_->make_room(where);
  return state_->kv->alloc_block(where);
}

std::optional<BlockId> PrefixCache::try_alloc_block(std::source_location where) {
  state_->make_room(where);
  return state_->kv->try_alloc_block(where);
}

bool PrefixCache::insert(const BlockHash& hash, BlockId block, std::source_location where) {
  State& s = *state_;
  s.check(block, "insert");
  if (s.kv->ref_count(block) == 0) {
    throw InvalidArgument(fmt::format(
        "PrefixCache::insert: block {} is free (refcount 0); only a block a sequence holds can "
        "be cached",
        block));
  }
  Entry& e = s.entries[block];
  if (e.cached) return false;
  auto [it, inserted] = s.map.emplace(hash, block);
  if (!inserted) return false;
  try {
    s.kv->inc_ref(block, where);
  } catch (...) {
    s.map.erase(it);
    throw;
  }
  e.hash = hash;
  e.cached = true;
  ++s.counters.inserts;
  return true;
}

void PrefixCache::release(BlockId block, std::source_location where) {
  State& s = *state_;
  s.check(block, "release");
  Entry& e = s.entries[block];
  if (!e.cached) {
    s.kv->dec_ref(block, where);  // handles (and reports) refcount 0 itself
    return;
  }
  const std::uint32_t refs = s.kv->ref_count(block);
  if (refs <= 1) {
    ++s.counters.ignored_releases;
    log::error(fmt::format(
        "PrefixCache::release on cached block {} that no sequence holds (from {}:{} in {}) - a "
        "double free; ignored so that the cached block is not freed while it is in the cache",
        block, where.file_name(), where.line(), where.function_name()));
    return;
  }
  s.kv->dec_ref(block, where);
  if (refs == 2) s.lru.push_back(e);  // only the cache's reference is left
}

void PrefixCache::release_blocks(std::span<const BlockId> table, std::source_location where) {
  for (BlockId block : table)
    state_->check(block, "release_blocks");
  for (auto it = table.rbegin(); it != table.rend(); ++it)
    release(*it, where);
}

std::size_t PrefixCache::evict(std::size_t max_blocks, std::source_location where) {
  std::size_t n = 0;
  for (; n < max_blocks && !state_->lru.empty(); ++n)
    state_->evict_one(where);
  return n;
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
  auto it = state_->map.find(hash);
  if (it == state_->map.end()) return std::nullopt;
  return it->second;
}

bool PrefixCache::is_evictable(BlockId block) const {
  state_->check(block, "is_evictable");
  return state_->entries[block].is_linked();
}

std::vector<BlockId> PrefixCache::lru_order() const {
  std::vector<BlockId> order;
  order.reserve(state_->lru.size());
  for (const Entry& e : state_->lru)
    order.push_back(state_->id_of(e));
  return order;
}

std::size_t PrefixCache::num_cached_blocks() const noexcept {
  return state_->map.size();
}

std::size_t PrefixCache::num_evictable_blocks() const noexcept {
  return state_->lru.size();
}

std::size_t PrefixCache::num_available_blocks() const noexcept {
  return state_->kv->num_free_blocks() + state_->lru.size();
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

// ---- diagnostics ----------------------------------------------------------------------------

InvariantReport PrefixCache::check_invariants() const {
  const State& s = *state_;
  InvariantReport report = s.kv->check_invariants();
  std::size_t cached = 0;
  std::size_t linked = 0;
  for (BlockId b = 0; b < s.entries.size(); ++b) {
    const Entry& e = s.entries[b];
    const std::uint32_t rc = s.kv->ref_count(b);
    if (e.is_linked()) ++linked;
    if (!e.cached) {
      if (e.is_linked())
        report.add_violation(fmt::format("block {} is in the LRU list but not cached", b));
      continue;
    }
    ++cached;
    auto it = s.map.find(e.hash);
    if (it == s.map.end() || it->second != b) {
      report.add_violation(
          fmt::format("cached block {} (hash {}) is not what the hash map holds for its hash", b,
                      e.hash.to_string()));
    }
    if (rc == 0) {
      report.add_violation(fmt::format("cached block {} is free (refcount 0)", b));
    } else if (rc == 1 && !e.is_linked()) {
      report.add_violation(fmt::format(
          "cached block {} is held only by the cache but is not in the LRU list (released around "
          "the prefix cache?)",
          b));
    } else if (rc >= 2 && e.is_linked()) {
      report.add_violation(
          fmt::format("block {} is in the LRU list while in use (refcount {})", b, rc));
    }
  }
  if (s.map.size() != cached) {
    report.add_violation(
        fmt::format("the hash map has {} entries but {} blocks are cached", s.map.size(), cached));
  }
  for (const auto& [hash, b] : s.map) {
    if (b >= s.entries.size() || !s.entries[b].cached || !(s.entries[b].hash == hash)) {
      report.add_violation(fmt::format("hash {} maps to block {}, which is not cached under it",
                                       hash.to_string(), b));
    }
  }
  if (linked != s.lru.size()) {
    report.add_violation(
        fmt::format("the LRU list has {} entries but {} blocks are linked", s.lru.size(), linked));
  }
  report.evictable_blocks = s.lru.size();
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
