// SPDX-License-Identifier: Apache-2.0
// A plain reference model of PagedKvCache + PrefixCache + BlockTable, and a
// driver that applies one operation to both and compares them. The property
// test (tests/unit/core) draws random operations; the fuzz target
// (tests/fuzz) decodes them from bytes. No GoogleTest here.
//
// The model is written for obviousness, not speed: a LIFO vector of free ids,
// a refcount per block, a std::list for the LRU order (O(n) removal), and
// cached blocks keyed by their whole token prefix instead of a hash.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <list>
#include <map>
#include <optional>
#include <span>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

#include "kvport/core/block_table.hpp"
#include "kvport/core/paged_kv_cache.hpp"
#include "kvport/core/prefix_cache.hpp"
#include "kvport/platform/div_ceil.hpp"
#include "kvport/platform/error.hpp"

namespace kvport::testing {

/// The reference semantics of the three core classes together.
class KvModel {
 public:
  struct Table {
    std::vector<BlockId> blocks;
    std::vector<TokenId> tokens;
    std::uint64_t extra_key = 0;
  };

  KvModel(std::size_t num_blocks, std::size_t block_size)
      : block_size_(block_size), refcount_(num_blocks, 0), key_of_(num_blocks) {
    for (std::size_t i = num_blocks; i-- > 0;)
      free_.push_back(static_cast<BlockId>(i));
  }

  // ---- blocks ----

  /// PrefixCache::try_alloc_block: the free list, else evict the LRU head.
  std::optional<BlockId> alloc() {
    if (free_.empty() && !lru_.empty()) evict_front();
    if (free_.empty()) return std::nullopt;
    const BlockId b = free_.back();
    free_.pop_back();
    refcount_[b] = 1;
    touched.push_back(b);
    return b;
  }

  /// PagedKvCache::inc_ref; false where it throws (a free block).
  bool inc_ref(BlockId b) {
    if (refcount_[b] == 0) return false;
    ++refcount_[b];
    touched.push_back(b);
    return true;
  }

  /// PrefixCache::release.
  void release(BlockId b) {
    touched.push_back(b);
    if (key_of_[b]) {
      if (refcount_[b] <= 1) {
        ++ignored_releases;
        return;
      }
      if (--refcount_[b] == 1) lru_.push_back(b);
      return;
    }
    raw_release(b);
  }

  /// PagedKvCache::dec_ref / return_evicted_block on an uncached block.
  void raw_release(BlockId b) {
    touched.push_back(b);
    if (refcount_[b] == 0) {
      ++ignored_double_frees;
      return;
    }
    if (--refcount_[b] == 0) free_.push_back(b);
  }

  std::size_t evict(std::size_t n) {
    std::size_t done = 0;
    for (; done < n && !lru_.empty(); ++done)
      evict_front();
    return done;
  }

  // ---- tables ----

  /// BlockTable::reuse_cached_prefix on an empty table, in the default
  /// PrefixHitMode (compute_last_token).
  std::size_t lookup(Table& t, std::span<const TokenId> prompt) {
    std::vector<BlockId> found;
    const std::size_t full = prompt.size() / block_size_;
    for (std::size_t i = 0; i < full; ++i) {
      auto it = cache_.find(key(t.extra_key, prompt.subspan(0, (i + 1) * block_size_)));
      if (it == cache_.end()) break;
      found.push_back(it->second);
    }
    for (BlockId b : found) {
      if (refcount_[b] == 1) lru_.remove(b);
      ++refcount_[b];
      touched.push_back(b);
    }
    hits += found.size();
    misses += full - found.size();
    t.blocks = found;
    std::size_t hit = found.size() * block_size_;
    // PrefixHitMode::compute_last_token (the default): a hit of the whole
    // prompt leaves its last token to compute. The last block becomes a
    // private copy when a block can be had (not with block_size 1), else the
    // hit stops before it; either way the table's reference on the cached
    // block goes back.
    if (!found.empty() && hit == prompt.size()) {
      const BlockId cached = t.blocks.back();
      const std::optional<BlockId> copy = block_size_ > 1 ? alloc() : std::nullopt;
      if (copy) {
        t.blocks.back() = *copy;
        ++copy_on_writes;
        hit = prompt.size() - 1;
      } else {
        t.blocks.pop_back();
        hit -= block_size_;
      }
      release(cached);
    }
    t.tokens.assign(prompt.begin(), prompt.begin() + static_cast<std::ptrdiff_t>(hit));
    return hit;
  }

  /// BlockTable::append_tokens; false where it throws CacheExhausted.
  bool append(Table& t, std::span<const TokenId> tokens) {
    if (tokens.empty()) return true;
    const std::size_t fill =
        t.blocks.empty() ? 0 : t.tokens.size() - (t.blocks.size() - 1) * block_size_;
    const std::size_t room = t.blocks.empty() ? 0 : block_size_ - fill;
    const bool cow = room > 0 && refcount_[t.blocks.back()] > 1;
    const std::size_t beyond = tokens.size() > room ? tokens.size() - room : 0;
    const std::size_t fresh = div_ceil(beyond, block_size_);
    const std::size_t needed = fresh + (cow ? 1 : 0);
    if (needed > free_.size() + lru_.size()) return false;
    std::vector<BlockId> got;
    for (std::size_t i = 0; i < needed; ++i)
      got.push_back(*alloc());
    std::size_t next = 0;
    if (cow) {
      const BlockId shared = t.blocks.back();
      t.blocks.back() = got[next++];
      release(shared);
      ++copy_on_writes;
    }
    const std::size_t old_full = t.tokens.size() / block_size_;
    t.blocks.insert(t.blocks.end(), got.begin() + static_cast<std::ptrdiff_t>(next), got.end());
    t.tokens.insert(t.tokens.end(), tokens.begin(), tokens.end());
    const std::size_t new_full = t.tokens.size() / block_size_;
    for (std::size_t i = old_full; i < new_full; ++i) {
      const BlockId b = t.blocks[i];
      auto k =
          key(t.extra_key, std::span<const TokenId>(t.tokens).subspan(0, (i + 1) * block_size_));
      if (key_of_[b] || cache_.contains(k)) continue;
      cache_.emplace(k, b);
      key_of_[b] = k;
      ++refcount_[b];
      touched.push_back(b);
    }
    return true;
  }

  Table fork(const Table& t) {
    for (BlockId b : t.blocks) {
      ++refcount_[b];
      touched.push_back(b);
    }
    return t;
  }

  void release(Table& t) {
    for (auto it = t.blocks.rbegin(); it != t.blocks.rend(); ++it)
      release(*it);
    t.blocks.clear();
    t.tokens.clear();
  }

  // ---- state ----

  std::uint32_t refcount(BlockId b) const { return refcount_[b]; }
  const std::vector<BlockId>& free_list() const { return free_; }
  std::vector<BlockId> lru_order() const { return {lru_.begin(), lru_.end()}; }
  bool cached(BlockId b) const { return key_of_[b].has_value(); }
  std::size_t num_cached() const { return cache_.size(); }
  std::size_t block_size() const { return block_size_; }

  /// Blocks whose refcount or cached state the calls since the driver last
  /// cleared it may have changed, repeats allowed: what the driver's
  /// per-operation check compares.
  std::vector<BlockId> touched;

  std::uint64_t hits = 0;
  std::uint64_t misses = 0;
  std::uint64_t evictions = 0;
  std::uint64_t ignored_releases = 0;
  std::uint64_t ignored_double_frees = 0;
  std::uint64_t copy_on_writes = 0;

 private:
  using Key = std::pair<std::uint64_t, std::vector<TokenId>>;

  static Key key(std::uint64_t extra, std::span<const TokenId> prefix) {
    return {extra, std::vector<TokenId>(prefix.begin(), prefix.end())};
  }

  void evict_front() {
    const BlockId b = lru_.front();
    lru_.pop_front();
    touched.push_back(b);
    cache_.erase(*key_of_[b]);
    key_of_[b].reset();
    ++evictions;
    raw_release(b);
  }

  std::size_t block_size_;
  std::vector<std::uint32_t> refcount_;
  std::vector<BlockId> free_;  // top at the back
  std::list<BlockId> lru_;     // front: next evicted
  std::map<Key, BlockId> cache_;
  std::vector<std::optional<Key>> key_of_;
};

/// The operations the driver applies. Operands pick targets modulo what
/// exists, so any pair of numbers is a valid operation.
enum class KvOpKind : std::uint8_t {
  alloc,           ///< PrefixCache::alloc_block into a loose handle (CacheExhausted when none)
  try_alloc,       ///< PrefixCache::try_alloc_block into a loose handle
  inc_ref,         ///< PagedKvCache::inc_ref on a held block; also on a free one (must throw)
  dec_ref,         ///< PrefixCache::release of a loose handle
  free,            ///< PagedKvCache::free_block / dec_ref of a free block (ignored double free)
  return_evicted,  ///< PagedKvCache::return_evicted_block: of a free block, or a loose uncached one
  zero,            ///< zero_blocks over some table's blocks, then read back
  poison,          ///< poison_blocks over a loose handle
  fork,            ///< BlockTable::fork
  append,          ///< BlockTable::append_tokens
  prefix_lookup,   ///< a new table: reuse_cached_prefix + append the rest of the prompt
  evict,           ///< PrefixCache::evict
  release_table,   ///< BlockTable::release
  count
};

struct KvOp {
  KvOpKind kind = KvOpKind::alloc;
  std::uint32_t a = 0;  ///< which target
  std::uint32_t b = 0;  ///< a size or a content choice
};

inline const char* to_string(KvOpKind k) {
  constexpr const char* kNames[] = {
      "alloc",  "try_alloc", "inc_ref", "dec_ref",       "free",  "return_evicted", "zero",
      "poison", "fork",      "append",  "prefix_lookup", "evict", "release_table"};
  return kNames[static_cast<std::size_t>(k)];
}

/// Applies operations to a real PrefixCache (over `cache`) and to a KvModel,
/// and compares them. `cache` must be fresh, with every block free. Tables
/// are capped at kMaxTables, loose handles at kMaxHandles.
///
/// Checks. apply() runs the full compare() (both invariant checks, every
/// block's refcount and cached state, the free list, the LRU order, the
/// counters, every table) after every `full_check_every`-th operation (1, the
/// default: after each one); after the others only what the operation
/// touched: the blocks the model changed (KvModel::touched), the table it
/// made or changed, the free-list size and the counters. A caller with k > 1
/// calls compare() at the end as well.
class KvDriver {
 public:
  static constexpr std::size_t kMaxTables = 8;
  static constexpr std::size_t kMaxHandles = 64;
  static constexpr std::size_t kMaxAppend = 40;

  KvDriver(PagedKvCache& cache, StreamView stream)
      : cache_(&cache),
        stream_(stream),
        prefix_(cache),
        model_(cache.num_blocks(), cache.config().block_size) {}

  ~KvDriver() {
    tables_.clear();  // release before the prefix cache goes
    for (BlockId b : handles_)
      prefix_.release(b);
  }

  /// See the class comment; k >= 1 (0 is taken as 1).
  void set_full_check_every(std::size_t k) { full_check_every_ = std::max<std::size_t>(k, 1); }

  /// Applies `op`; returns "" when real and model still agree, else what
  /// differs.
  std::string apply(const KvOp& op) {
    last_ = op;
    model_.touched.clear();
    touched_table_.reset();
    switch (op.kind) {
      case KvOpKind::alloc:
      case KvOpKind::try_alloc: {
        if (handles_.size() >= kMaxHandles) break;
        const std::optional<BlockId> expect = model_.alloc();
        std::optional<BlockId> got;
        if (op.kind == KvOpKind::alloc) {
          try {
            got = prefix_.alloc_block();
          } catch (const CacheExhausted&) {
          }
        } else {
          got = prefix_.try_alloc_block();
        }
        if (got != expect) return fail("allocated " + str(got) + ", model " + str(expect));
        if (got) handles_.push_back(*got);
        break;
      }
      case KvOpKind::inc_ref: {
        const BlockId b = pick_block(op.a);
        const bool expect = model_.refcount(b) > 0 && !model_only_cache_holds(b);
        if (!expect) {
          // A free block must be refused; a block only the cache holds is
          // skipped (sharing it goes through a lookup).
          if (model_.refcount(b) == 0 && !throws_invalid([&] { cache_->inc_ref(b); }))
            return fail("inc_ref of free block " + std::to_string(b) + " did not throw");
          break;
        }
        if (handles_.size() >= kMaxHandles) break;
        cache_->inc_ref(b);
        model_.inc_ref(b);
        handles_.push_back(b);
        break;
      }
      case KvOpKind::dec_ref: {
        if (handles_.empty()) break;
        const std::size_t i = op.a % handles_.size();
        const BlockId b = handles_[i];
        handles_.erase(handles_.begin() + static_cast<std::ptrdiff_t>(i));
        prefix_.release(b);
        model_.release(b);
        break;
      }
      case KvOpKind::free:
      case KvOpKind::return_evicted: {
        // On a free block: a double free, ignored by both. On a loose
        // uncached handle: an ordinary release.
        const BlockId b = pick_block(op.a);
        if (model_.refcount(b) == 0) {
          if (op.kind == KvOpKind::free) {
            cache_->free_block(b);
          } else {
            cache_->return_evicted_block(b);
          }
          model_.raw_release(b);
        } else if (!handles_.empty()) {
          const std::size_t i = op.b % handles_.size();
          const BlockId h = handles_[i];
          if (model_.cached(h)) break;
          handles_.erase(handles_.begin() + static_cast<std::ptrdiff_t>(i));
          if (op.kind == KvOpKind::free) {
            cache_->free_block(h);
          } else {
            cache_->return_evicted_block(h);
          }
          model_.raw_release(h);
        }
        break;
      }
      case KvOpKind::zero: {
        if (tables_.empty()) break;
        const BlockTable& t = *tables_[op.a % tables_.size()].real;
        if (t.empty()) break;
        cache_->zero_blocks(t.blocks(), stream_);
        const BlockId b = t.blocks()[op.b % t.num_blocks()];
        const PagedKvCache::HostBlock hb =
            cache_->read_block(op.b % cache_->num_layers(), b, stream_);
        const bool zero =
            std::all_of(hb.k.begin(), hb.k.end(), [](std::uint8_t x) { return x == 0; }) &&
            std::all_of(hb.v.begin(), hb.v.end(), [](std::uint8_t x) { return x == 0; });
        if (!zero) return fail("block " + std::to_string(b) + " is not zero after zero_blocks");
        break;
      }
      case KvOpKind::poison: {
        if (handles_.empty()) break;
        cache_->poison_block(handles_[op.a % handles_.size()], stream_);
        cache_->zero_block(handles_[op.a % handles_.size()], stream_);
        break;
      }
      case KvOpKind::fork: {
        if (tables_.empty() || tables_.size() >= kMaxTables) break;
        Pair& parent = tables_[op.a % tables_.size()];
        Pair child;
        child.real = std::make_unique<BlockTable>(parent.real->fork());
        child.model = model_.fork(parent.model);
        tables_.push_back(std::move(child));
        touched_table_ = tables_.size() - 1;
        break;
      }
      case KvOpKind::append: {
        if (tables_.empty()) break;
        touched_table_ = op.a % tables_.size();
        Pair& t = tables_[*touched_table_];
        const std::vector<TokenId> tokens = continuation(t.model, op.b);
        const bool expect = model_.append(t.model, tokens);
        bool got = true;
        try {
          t.real->append_tokens(tokens, stream_);
        } catch (const CacheExhausted&) {
          got = false;
        }
        if (got != expect)
          return fail(std::string("append ") + (got ? "succeeded" : "failed") +
                      ", model disagrees");
        break;
      }
      case KvOpKind::prefix_lookup: {
        if (tables_.size() >= kMaxTables) break;
        Pair t;
        t.model.extra_key = op.b % 7 == 0 ? 1 : 0;
        t.real = std::make_unique<BlockTable>(prefix_, t.model.extra_key);
        // Prompts up to half the cache, so that several fit at once.
        const std::size_t max_prompt =
            std::max<std::size_t>(2, cache_->num_blocks() * model_.block_size() / 2);
        const std::vector<TokenId> prompt = document(op.a % kDocuments, 1 + op.b % max_prompt);
        const std::size_t expect = model_.lookup(t.model, prompt);
        const std::size_t got = t.real->reuse_cached_prefix(prompt, stream_);
        if (got != expect)
          return fail("reused " + std::to_string(got) + " tokens, model " + std::to_string(expect));
        const std::span<const TokenId> rest = std::span<const TokenId>(prompt).subspan(got);
        const bool model_ok = model_.append(t.model, rest);
        bool real_ok = true;
        try {
          t.real->append_tokens(rest, stream_);
        } catch (const CacheExhausted&) {
          real_ok = false;
        }
        if (real_ok != model_ok) return fail("prompt append disagrees with the model");
        tables_.push_back(std::move(t));  // a failed append keeps the reused prefix
        touched_table_ = tables_.size() - 1;
        break;
      }
      case KvOpKind::evict: {
        const std::size_t n = op.b % 8;
        const std::size_t got = prefix_.evict(n);
        const std::size_t expect = model_.evict(n);
        if (got != expect)
          return fail("evicted " + std::to_string(got) + ", model " + std::to_string(expect));
        break;
      }
      case KvOpKind::release_table: {
        if (tables_.empty()) break;
        const std::size_t i = op.a % tables_.size();
        tables_[i].real->release();
        model_.release(tables_[i].model);
        tables_.erase(tables_.begin() + static_cast<std::ptrdiff_t>(i));
        break;
      }
      case KvOpKind::count:
        break;
    }
    if (++applied_ % full_check_every_ == 0) return compare();
    return check_touched();
  }

  /// Every observable of the real objects against the model, and both
  /// invariant checks.
  std::string compare() const {
    const InvariantReport report = prefix_.check_invariants();
    if (!report.ok) return fail("invariants: " + report.to_string());
    for (BlockId b = 0; b < cache_->num_blocks(); ++b) {
      if (std::string d = compare_block(b); !d.empty()) return d;
    }
    if (cache_->num_free_blocks() != model_.free_list().size())
      return fail("free list size differs");
    if (prefix_.lru_order() != model_.lru_order()) return fail("LRU order differs");
    if (std::string d = compare_counters(); !d.empty()) return d;
    for (const Pair& t : tables_) {
      if (std::string d = compare_table(t); !d.empty()) return d;
    }
    return {};
  }

  PrefixCache& prefix_cache() { return prefix_; }
  const KvModel& model() const { return model_; }
  std::size_t num_tables() const { return tables_.size(); }

 private:
  struct Pair {
    std::unique_ptr<BlockTable> real;
    KvModel::Table model;
  };

  static constexpr std::uint32_t kDocuments = 4;

  // What an operation touched, between full compares.
  std::string check_touched() const {
    for (BlockId b : model_.touched) {
      if (std::string d = compare_block(b); !d.empty()) return d;
    }
    if (cache_->num_free_blocks() != model_.free_list().size())
      return fail("free list size differs");
    if (std::string d = compare_counters(); !d.empty()) return d;
    if (touched_table_) return compare_table(tables_[*touched_table_]);
    return {};
  }

  std::string compare_block(BlockId b) const {
    if (cache_->ref_count(b) != model_.refcount(b))
      return fail("block " + std::to_string(b) + " refcount " +
                  std::to_string(cache_->ref_count(b)) + ", model " +
                  std::to_string(model_.refcount(b)));
    if (prefix_.is_cached(b) != model_.cached(b))
      return fail("block " + std::to_string(b) + " cached state differs from the model");
    return {};
  }

  std::string compare_counters() const {
    const PrefixCacheCounters& c = prefix_.counters();
    if (c.hits != model_.hits || c.misses != model_.misses || c.evictions != model_.evictions ||
        c.ignored_releases != model_.ignored_releases)
      return fail("prefix cache counters differ");
    if (cache_->counters().ignored_double_frees != model_.ignored_double_frees)
      return fail("ignored double frees differ");
    return {};
  }

  std::string compare_table(const Pair& t) const {
    if (!std::ranges::equal(t.real->blocks(), t.model.blocks) ||
        !std::ranges::equal(t.real->tokens(), t.model.tokens))
      return fail("a block table differs from the model");
    return {};
  }

  /// Deterministic token ids of document `d`: the shared prompts.
  static std::vector<TokenId> document(std::uint32_t d, std::size_t length) {
    std::vector<TokenId> tokens(length);
    for (std::size_t i = 0; i < length; ++i)
      tokens[i] = static_cast<TokenId>((d * 7919u + i * 31u) % 50000u);
    return tokens;
  }

  /// Tokens to append to `t`: the continuation of document (choice % docs)
  /// or, one time in four, fresh tokens.
  std::vector<TokenId> continuation(const KvModel::Table& t, std::uint32_t choice) {
    const std::size_t n = 1 + (choice >> 2) % kMaxAppend;
    if (choice % 4 == 3) {
      std::vector<TokenId> tokens(n);
      for (TokenId& x : tokens)
        x = 60000u + (fresh_++ % 1000u);
      return tokens;
    }
    const std::vector<TokenId> doc = document(choice % kDocuments, t.tokens.size() + n);
    return {doc.end() - static_cast<std::ptrdiff_t>(n), doc.end()};
  }

  bool model_only_cache_holds(BlockId b) const {
    return model_.cached(b) && model_.refcount(b) == 1;
  }

  BlockId pick_block(std::uint32_t a) const {
    return static_cast<BlockId>(a % cache_->num_blocks());
  }

  template <typename F>
  static bool throws_invalid(F&& f) {
    try {
      f();
    } catch (const InvalidArgument&) {
      return true;
    }
    return false;
  }

  static std::string str(std::optional<BlockId> b) { return b ? std::to_string(*b) : "none"; }

  std::string fail(const std::string& what) const {
    return std::string("after ") + to_string(last_.kind) + "(" + std::to_string(last_.a) + ", " +
           std::to_string(last_.b) + "): " + what;
  }

  PagedKvCache* cache_;
  StreamView stream_;
  PrefixCache prefix_;
  KvModel model_;
  std::vector<Pair> tables_;
  std::vector<BlockId> handles_;  // loose references the driver holds
  std::uint32_t fresh_ = 0;
  std::size_t full_check_every_ = 1;
  std::uint64_t applied_ = 0;
  std::optional<std::size_t> touched_table_;  // the table the operation made or changed
  KvOp last_;
};

}  // namespace kvport::testing
