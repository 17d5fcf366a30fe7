// SPDX-License-Identifier: Apache-2.0
// A plain reference model of PrefixCache + HostTier (write-back, exclusive):
// a device LRU and a host LRU over chained block hashes, and a driver that
// applies one operation to the real objects and to the model and compares
// them. The unit test (tests/unit/core/tier_model_test.cpp) draws random
// operations; the fuzz target (tests/fuzz) decodes them from bytes. No
// GoogleTest here.
//
// The driver also runs without the model, for the tier's other settings
// (write-through, inclusive, a free watermark, poll at any time), where the
// completion time of a copy is the host stream's: then it checks the
// invariants of both tiers (as often as the full comparison: TierDriver's
// comment) and that every block a lookup returns holds the bytes written for
// its hash (never stale data). Over a FaultInjectingBackend it also arms
// faults inside the tier's calls and checks that the tier fails closed.
//
// Model, written for obviousness: hashes only (no block ids), a std::list per
// LRU order (O(n) removal), a counter of private (uncached) blocks.
// Copies complete at the same points as in the real tier: an allocation that
// writes back waits for the copy; an onload waits for everything in flight;
// offload() is followed by HostTier::synchronize() in the driver.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <exception>
#include <list>
#include <map>
#include <memory>
#include <optional>
#include <set>
#include <span>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

#include "kvport/core/block_hash.hpp"
#include "kvport/core/host_tier.hpp"
#include "kvport/core/paged_kv_cache.hpp"
#include "kvport/core/prefix_cache.hpp"
#include "kvport/platform/error.hpp"
#include "kvport/platform/fault_injecting_backend.hpp"
#include "kvport/testing/armed_fault.hpp"

namespace kvport::testing {

/// The reference semantics of a PrefixCache with a write-back, exclusive
/// HostTier, between calls (nothing in flight).
class TierModel {
 public:
  /// One block a table holds: cached under a hash, or private.
  struct Ref {
    std::optional<BlockHash> hash;
  };

  TierModel(std::size_t device_blocks, std::size_t host_blocks, std::size_t offload_batch)
      : device_(device_blocks), host_(host_blocks), batch_(offload_batch) {}

  std::size_t free_blocks() const { return device_ - refs_.size() - private_; }

  /// PrefixCache::lookup_hashes: the device prefix, then the host's onload.
  /// Returns the match and sets `onloaded` to how many came from the host.
  std::vector<Ref> lookup(std::span<const BlockHash> chain, std::size_t& onloaded) {
    std::vector<Ref> match;
    std::size_t i = 0;
    while (i < chain.size() && refs_.contains(chain[i]))
      ++i;
    for (std::size_t j = 0; j < i; ++j) {
      if (refs_[chain[j]]++ == 0) device_lru_.remove(chain[j]);
      match.push_back({chain[j]});
      touched.push_back(chain[j]);
    }
    onloaded = 0;
    if (i == chain.size()) return match;
    std::vector<BlockHash> hits;
    for (std::size_t j = i; j < chain.size(); ++j) {
      if (std::find(host_lru_.begin(), host_lru_.end(), chain[j]) == host_lru_.end()) break;
      hits.push_back(chain[j]);
    }
    if (hits.empty()) return match;
    pinned_.insert(hits.begin(), hits.end());
    std::size_t got = 0;
    for (; got < hits.size(); ++got) {
      if (!alloc()) {
        onload_shortfalls += hits.size() - got;
        break;
      }
    }
    pinned_.clear();
    for (std::size_t k = 0; k < got; ++k) {
      const BlockHash& h = hits[k];
      if (refs_.contains(h)) {
        match.push_back({});  // registered already: the copy stays private
      } else {
        --private_;
        refs_[h] = 1;
        match.push_back({h});
      }
      host_lru_.remove(h);  // exclusive: the host gives its slot back
      touched.push_back(h);
    }
    onloads += got;
    onloaded = got;
    return match;
  }

  /// PrefixCache::alloc_block: the free list, else a write-back of the
  /// device's LRU blocks (waited for). A private block, or false.
  bool alloc() {
    if (free_blocks() == 0) write_back(batch_);
    if (free_blocks() == 0) return false;
    ++private_;
    return true;
  }

  /// PrefixCache::insert of the private block `r` under `h`.
  void insert(Ref& r, const BlockHash& h) {
    if (refs_.contains(h)) return;
    --private_;
    refs_[h] = 1;
    r.hash = h;
    touched.push_back(h);
  }

  /// PrefixCache::release_blocks: last block first.
  void release(std::vector<Ref>& table) {
    for (auto it = table.rbegin(); it != table.rend(); ++it) {
      if (!it->hash) {
        --private_;
        continue;
      }
      if (--refs_[*it->hash] == 0) device_lru_.push_back(*it->hash);
      touched.push_back(*it->hash);
    }
    table.clear();
  }

  /// HostTier::offload then synchronize.
  std::size_t offload(std::size_t n) { return write_back(n); }

  /// PrefixCache::evict: dropped, the tier is not told.
  std::size_t evict(std::size_t n) {
    std::size_t done = 0;
    for (; done < n && !device_lru_.empty(); ++done) {
      touched.push_back(device_lru_.front());
      refs_.erase(device_lru_.front());
      device_lru_.pop_front();
    }
    return done;
  }

  bool on_device(const BlockHash& h) const { return refs_.contains(h); }
  bool on_host(const BlockHash& h) const {
    return std::find(host_lru_.begin(), host_lru_.end(), h) != host_lru_.end();
  }
  std::vector<BlockHash> device_lru() const { return {device_lru_.begin(), device_lru_.end()}; }
  std::vector<BlockHash> host_lru() const { return {host_lru_.begin(), host_lru_.end()}; }

  /// Hashes whose place (device, host, neither) the calls since the driver
  /// last cleared it may have changed, repeats allowed: what the driver's
  /// per-operation check compares.
  std::vector<BlockHash> touched;

  std::uint64_t offloads = 0;
  std::uint64_t onloads = 0;
  std::uint64_t host_evictions = 0;
  std::uint64_t already_on_host = 0;
  std::uint64_t dropped_offloads = 0;
  std::uint64_t onload_shortfalls = 0;

 private:
  // Evicts up to n LRU device blocks to the host; the copies complete at once
  // (their slots join the host LRU in eviction order, after all of them took
  // a slot).
  std::size_t write_back(std::size_t n) {
    n = std::min(n, host_);  // more victims than host slots would only be dropped
    std::vector<BlockHash> filling;
    std::size_t done = 0;
    for (; done < n && !device_lru_.empty(); ++done) {
      const BlockHash h = device_lru_.front();
      device_lru_.pop_front();
      refs_.erase(h);
      touched.push_back(h);
      if (auto it = std::find(host_lru_.begin(), host_lru_.end(), h); it != host_lru_.end()) {
        host_lru_.erase(it);
        host_lru_.push_back(h);
        ++already_on_host;
        continue;
      }
      if (std::find(filling.begin(), filling.end(), h) != filling.end()) {
        ++already_on_host;
        continue;
      }
      if (host_lru_.size() + filling.size() < host_) {
        filling.push_back(h);
        continue;
      }
      auto victim = std::find_if(host_lru_.begin(), host_lru_.end(),
                                 [&](const BlockHash& x) { return !pinned_.contains(x); });
      if (victim == host_lru_.end()) {
        ++dropped_offloads;
        continue;
      }
      touched.push_back(*victim);
      host_lru_.erase(victim);
      ++host_evictions;
      filling.push_back(h);
    }
    host_lru_.insert(host_lru_.end(), filling.begin(), filling.end());
    offloads += filling.size();
    return done;
  }

  std::size_t device_;
  std::size_t host_;
  std::size_t batch_;
  struct Less {
    bool operator()(const BlockHash& x, const BlockHash& y) const {
      return std::pair(x.low, x.high) < std::pair(y.low, y.high);
    }
  };
  std::map<BlockHash, std::uint32_t, Less> refs_;  // cached on the device -> table references
  std::list<BlockHash> device_lru_;   // cached, no table reference; front: next evicted
  std::size_t private_ = 0;           // uncached blocks the tables hold
  std::list<BlockHash> host_lru_;     // ready host blocks; front: next dropped
  std::set<BlockHash, Less> pinned_;  // the hits of the onload in progress
};

/// The operations the driver applies; operands pick targets modulo what
/// exists, so any pair of numbers is a valid operation.
enum class TierOpKind : std::uint8_t {
  request,      ///< lookup of a document prefix (may onload), then the rest allocated and filled
  lookup,       ///< lookup only: the match is held as a table
  release,      ///< a table released
  offload,      ///< HostTier::offload(n) then synchronize
  evict,        ///< PrefixCache::evict(n)
  poll,         ///< HostTier::poll (without the model only)
  synchronize,  ///< HostTier::synchronize
  /// With a FaultInjectingBackend only (else nothing): arms a fault, the
  /// (1 + b % 16)th call of one kind (a % 3: copy at the call, copy deferred
  /// to the stream, synchronize) that the tier's calls make from now fails.
  /// A caller that decodes kinds from bytes may leave it out (the fuzzer
  /// decodes it in its fault mode only).
  fault,
  count
};

struct TierOp {
  TierOpKind kind = TierOpKind::request;
  std::uint32_t a = 0;
  std::uint32_t b = 0;
};

inline const char* to_string(TierOpKind k) {
  constexpr const char* kNames[] = {"request", "lookup", "release",     "offload",
                                    "evict",   "poll",   "synchronize", "fault"};
  return kNames[static_cast<std::size_t>(k)];
}

/// Drives a PrefixCache + HostTier over `cache` (fresh, every block free)
/// and, when `options` is write-back, exclusive and without a watermark and
/// `with_model` is set, a TierModel; see the file comment.
///
/// Checks. apply() runs the full compare() (invariants of both tiers, every
/// hash of the documents against the model, both LRU orders, free blocks,
/// counters) after every `full_check_every`-th operation (1, the default:
/// after each one) and after an operation in which a fault was injected;
/// after the others only what the operation touched: the hashes of its chain
/// and those the model moved (TierModel::touched), the free blocks and the
/// counters. A caller with k > 1 calls compare() at the end as well.
///
/// Faults. With `faults` (the FaultInjectingBackend `cache` lives on), a
/// TierOpKind::fault arms one fault, which only the tier's own calls (lookup,
/// allocation, insert, release, offload, evict, poll, synchronize) can hit,
/// never the driver's pattern writes and reads. The tier must fail closed:
/// no call throws (an allocation may still run out: CacheExhausted), both
/// tiers' invariants hold, and every block a lookup returns holds its hash's
/// bytes, read back byte for byte. The model cannot know what a failed copy
/// rolled back, so it is dropped at the first injected fault (with_model()
/// turns false); the byte and invariant checks go on.
class TierDriver {
 public:
  static constexpr std::size_t kDocuments = 8;
  static constexpr std::size_t kMaxChain = 4;
  static constexpr std::size_t kMaxTables = 3;

  TierDriver(PagedKvCache& cache, StreamView stream, const HostTierOptions& options,
             bool with_model, FaultInjectingBackend* faults = nullptr)
      : cache_(&cache),
        stream_(stream),
        prefix_(cache),
        tier_(std::make_unique<HostTier>(prefix_, options)),
        model_(cache.num_blocks(), options.num_host_blocks, options.offload_batch),
        with_model_(with_model && options.policy == TierPolicy::write_back &&
                    options.inclusion == TierInclusion::exclusive && options.free_watermark == 0),
        fault_(faults) {
    const std::size_t block = cache.config().block_size;
    for (std::size_t d = 0; d < kDocuments; ++d) {
      // Documents share their first block in three groups.
      std::vector<TokenId> t(block * kMaxChain);
      for (std::size_t i = 0; i < t.size(); ++i)
        t[i] = static_cast<TokenId>(i < block ? 100 * (d % 3) + i : 10000 * (d + 1) + i);
      chains_.push_back(hash_full_blocks(t, block));
      for (const BlockHash& h : chains_.back())
        if (std::find(universe_.begin(), universe_.end(), h) == universe_.end())
          universe_.push_back(h);
    }
  }

  ~TierDriver() {
    fault_.disarm();
    for (Table& t : tables_)
      prefix_.release_blocks(t.blocks);
    tables_.clear();
    tier_.reset();
  }

  TierDriver(const TierDriver&) = delete;
  TierDriver& operator=(const TierDriver&) = delete;

  bool with_model() const { return with_model_; }
  HostTier& tier() { return *tier_; }
  PrefixCache& prefix_cache() { return prefix_; }
  const TierModel& model() const { return model_; }
  std::uint64_t onloaded_blocks() const { return onloaded_; }
  /// Faults injected into the tier's calls so far (with `faults` only).
  std::uint64_t faults_injected() const { return fault_.injected(); }

  /// See the class comment; k >= 1 (0 is taken as 1).
  void set_full_check_every(std::size_t k) { full_check_every_ = std::max<std::size_t>(k, 1); }

  /// Applies `op`; "" when everything agrees, else what differs.
  std::string apply(const TierOp& op) {
    last_ = op;
    model_.touched.clear();
    faulted_ = false;
    std::span<const BlockHash> chain;
    std::string diff;
    try {
      diff = apply_op(op, chain);
    } catch (const std::exception& e) {
      // Nothing the driver calls may throw here but CacheExhausted, caught
      // where it can come; a fault must fail closed.
      return fail(std::string("a call threw: ") + e.what());
    }
    if (!diff.empty()) return diff;
    if (++applied_ % full_check_every_ == 0 || faulted_) return compare();
    return check_touched(chain);
  }

  /// The invariants, and with the model every observable against it.
  std::string compare() const {
    const InvariantReport r = tier_->check_invariants();
    if (!r.ok) return fail("invariants: " + r.to_string());
    if (!with_model_) return {};
    for (const BlockHash& h : universe_) {
      if (std::string d = compare_hash(h); !d.empty()) return d;
    }
    std::vector<BlockHash> device_lru;
    for (BlockId b : prefix_.lru_order())
      device_lru.push_back(*prefix_.hash_of(b));
    if (device_lru != model_.device_lru()) return fail("the device LRU order differs");
    if (tier_->host_lru_order() != model_.host_lru()) return fail("the host LRU order differs");
    return compare_scalars();
  }

 private:
  // What an operation touched, between full compares: the place of the
  // chain's hashes and of every hash the model moved, free blocks, counters.
  std::string check_touched(std::span<const BlockHash> chain) const {
    if (!with_model_) return {};
    for (const BlockHash& h : chain) {
      if (std::string d = compare_hash(h); !d.empty()) return d;
    }
    for (const BlockHash& h : model_.touched) {
      if (std::string d = compare_hash(h); !d.empty()) return d;
    }
    return compare_scalars();
  }

  std::string compare_hash(const BlockHash& h) const {
    if (prefix_.find(h).has_value() != model_.on_device(h))
      return fail("hash " + h.to_string() + (model_.on_device(h) ? " should" : " should not") +
                  " be on the device");
    if (tier_->is_on_host(h) != model_.on_host(h))
      return fail("hash " + h.to_string() + (model_.on_host(h) ? " should" : " should not") +
                  " be on the host");
    return {};
  }

  std::string compare_scalars() const {
    if (cache_->num_free_blocks() != model_.free_blocks())
      return fail("free blocks " + std::to_string(cache_->num_free_blocks()) + ", model " +
                  std::to_string(model_.free_blocks()));
    const HostTierCounters& c = tier_->counters();
    if (c.offloads != model_.offloads || c.onloads != model_.onloads ||
        c.host_evictions != model_.host_evictions || c.already_on_host != model_.already_on_host ||
        c.dropped_offloads != model_.dropped_offloads ||
        c.onload_shortfalls != model_.onload_shortfalls) {
      std::ostringstream o;
      o << "counters differ: offloads " << c.offloads << "/" << model_.offloads << " onloads "
        << c.onloads << "/" << model_.onloads << " host_evictions " << c.host_evictions << "/"
        << model_.host_evictions << " already_on_host " << c.already_on_host << "/"
        << model_.already_on_host << " dropped " << c.dropped_offloads << "/"
        << model_.dropped_offloads << " shortfalls " << c.onload_shortfalls << "/"
        << model_.onload_shortfalls;
      return fail(o.str());
    }
    return {};
  }

  // ---- faults ----

  // Runs one of the tier's calls under the armed fault (as the fault sweep
  // of host_tier_fault_test.cpp does).
  template <class F>
  decltype(auto) tier_call(F&& fn) {
    return fault_.call(std::forward<F>(fn), [this] {
      faulted_ = true;
      with_model_ = false;  // the model knows nothing of rollbacks
    });
  }

  // ---- operations ----

  std::string apply_op(const TierOp& op, std::span<const BlockHash>& chain_out) {
    switch (op.kind) {
      case TierOpKind::request:
      case TierOpKind::lookup: {
        if (tables_.size() >= kMaxTables) {
          release_table(op.b);
        }
        const std::vector<BlockHash>& doc = chains_[op.a % kDocuments];
        const std::size_t len = 1 + (op.a / kDocuments) % kMaxChain;
        const std::span<const BlockHash> chain(doc.data(), len);
        chain_out = chain;
        Table t;
        const PrefixMatch m = tier_call([&] { return prefix_.lookup_hashes(chain); });
        onloaded_ += m.lower_tier_blocks;
        if (m.blocks.size() != m.hashes.size() || m.lower_tier_blocks > m.blocks.size() ||
            m.num_tokens != m.blocks.size() * prefix_.block_size())
          return fail("an inconsistent PrefixMatch");
        for (std::size_t i = 0; i < m.blocks.size(); ++i) {
          if (m.hashes[i] != chain[i]) return fail("a match hash is not the chain's");
          if (!holds(m.blocks[i], chain[i]))
            return fail("block " + std::to_string(i) + " of a match holds stale bytes (" +
                        (i + m.lower_tier_blocks >= m.blocks.size() ? "onloaded" : "device") + ")");
        }
        t.blocks = m.blocks;
        if (with_model_) {
          std::size_t onloaded = 0;
          t.model = model_.lookup(chain, onloaded);
          if (t.model.size() != m.blocks.size() || onloaded != m.lower_tier_blocks)
            return fail("matched " + std::to_string(m.blocks.size()) + " (" +
                        std::to_string(m.lower_tier_blocks) + " from the host), model " +
                        std::to_string(t.model.size()) + " (" + std::to_string(onloaded) + ")");
        }
        if (op.kind == TierOpKind::request) {
          for (std::size_t i = m.blocks.size(); i < len; ++i) {
            std::optional<BlockId> b;
            try {
              b = tier_call([&] { return prefix_.alloc_block(); });
            } catch (const CacheExhausted&) {
            }
            if (with_model_) {
              const bool expect = model_.alloc();
              if (expect != b.has_value())
                return fail(std::string("allocation ") + (b ? "succeeded" : "failed") +
                            ", model disagrees");
            }
            if (!b) break;
            write(*b, chain[i]);
            const bool inserted = tier_call([&] { return prefix_.insert(chain[i], *b); });
            t.blocks.push_back(*b);
            if (with_model_) {
              t.model.push_back({});
              model_.insert(t.model.back(), chain[i]);
              if (inserted != t.model.back().hash.has_value())
                return fail("insert disagrees with the model");
            }
          }
        }
        tables_.push_back(std::move(t));
        break;
      }
      case TierOpKind::release:
        release_table(op.a);
        break;
      case TierOpKind::offload: {
        const std::size_t n = op.b % 5;
        const std::size_t got = tier_call([&] { return tier_->offload(n); });
        if (with_model_) {
          tier_call([&] { tier_->synchronize(); });
          const std::size_t expect = model_.offload(n);
          if (with_model_ && got != expect)  // the synchronize may have failed: then dropped
            return fail("offloaded " + std::to_string(got) + ", model " + std::to_string(expect));
        }
        break;
      }
      case TierOpKind::evict: {
        const std::size_t n = op.b % 4;
        const std::size_t got = tier_call([&] { return prefix_.evict(n); });
        if (with_model_) {
          const std::size_t expect = model_.evict(n);
          if (got != expect)
            return fail("evicted " + std::to_string(got) + ", model " + std::to_string(expect));
        }
        break;
      }
      case TierOpKind::poll:
        if (!with_model_) tier_call([&] { tier_->poll(); });
        break;
      case TierOpKind::synchronize:
        tier_call([&] { tier_->synchronize(); });
        break;
      case TierOpKind::fault:
        fault_.arm(op.a, op.b);
        break;
      case TierOpKind::count:
        break;
    }
    return {};
  }

 private:
  struct Table {
    std::vector<BlockId> blocks;
    std::vector<TierModel::Ref> model;
  };

  void release_table(std::uint32_t which) {
    if (tables_.empty()) return;
    const std::size_t i = which % tables_.size();
    tier_call([&] { prefix_.release_blocks(tables_[i].blocks); });
    if (with_model_) model_.release(tables_[i].model);
    tables_.erase(tables_.begin() + static_cast<std::ptrdiff_t>(i));
  }

  // The bytes of `h`'s block: layer, K/V and offset mixed with the hash.
  std::vector<std::uint8_t> bytes_for(const BlockHash& h, std::size_t layer, bool v,
                                      std::size_t n) const {
    std::vector<std::uint8_t> out(n);
    for (std::size_t i = 0; i < n; ++i)
      out[i] = static_cast<std::uint8_t>((h.low >> (8 * (i % 8))) ^ (h.high >> (8 * (layer % 8))) ^
                                         (v ? 0x5A : 0xA5) ^ i);
    return out;
  }
  void write(BlockId b, const BlockHash& h) {
    for (std::size_t layer = 0; layer < cache_->num_layers(); ++layer)
      cache_->write_block(layer, b, bytes_for(h, layer, false, cache_->k_block_bytes(layer)),
                          bytes_for(h, layer, true, cache_->v_block_bytes(layer)), stream_);
  }
  bool holds(BlockId b, const BlockHash& h) const {
    for (std::size_t layer = 0; layer < cache_->num_layers(); ++layer) {
      const PagedKvCache::HostBlock hb = cache_->read_block(layer, b, stream_);
      if (hb.k != bytes_for(h, layer, false, hb.k.size()) ||
          hb.v != bytes_for(h, layer, true, hb.v.size()))
        return false;
    }
    return true;
  }

  std::string fail(const std::string& what) const {
    return std::string("after ") + to_string(last_.kind) + "(" + std::to_string(last_.a) + ", " +
           std::to_string(last_.b) + "): " + what;
  }

  PagedKvCache* cache_;
  StreamView stream_;
  PrefixCache prefix_;
  std::unique_ptr<HostTier> tier_;
  TierModel model_;
  bool with_model_;
  ArmedFault fault_;
  bool faulted_ = false;  // a fault was injected in this apply()
  std::size_t full_check_every_ = 1;
  std::uint64_t applied_ = 0;
  std::vector<std::vector<BlockHash>> chains_;
  std::vector<BlockHash> universe_;
  std::vector<Table> tables_;
  std::uint64_t onloaded_ = 0;
  TierOp last_;
};

}  // namespace kvport::testing
