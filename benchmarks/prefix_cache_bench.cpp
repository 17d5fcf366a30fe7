// SPDX-License-Identifier: Apache-2.0
// Prefix-cache bookkeeping per block, old design against new in the same run.
//
// `PrefixCache` (core) indexes cached blocks in an absl::flat_hash_set of
// block ids and keeps its LRU order in a lazy-deletion queue. The design it
// replaced, a std::unordered_map<BlockHash, BlockId> and an intrusive
// doubly-linked LRU list whose hooks live in a per-block array (as
// boost::intrusive::list did), is kept below as LegacyPrefixCache, for this
// comparison only. Both run the same workload over their own PagedKvCache of
// the same size, alternating in phases of kPhasePrompts prompts so that both
// see the same machine load; each reports ns of thread CPU time per block.
//
// Workloads (64-block prompts of 16 tokens; the cache is first filled with
// num_blocks / 64 prompts, all released, so every block is cached and
// evictable):
//  - BM_PrefixCacheHitRelease: lookup_hashes of a cached prompt (hashes
//    computed beforehand, as BlockTable reuses them) taking a reference on
//    each block, then release_blocks; prompts visited in a random order, so
//    a large cache does not stay in the CPU caches.
//  - BM_PrefixCachePrefillMiss: a prompt never seen (a new extra key): hash
//    its blocks, lookup_hashes (misses at the first block), then for each
//    block alloc_block (the free list is empty: evicts the LRU head), insert,
//    and finally release_blocks.
#include <benchmark/benchmark.h>

#include <algorithm>
#include <cstdint>
#include <ctime>
#include <memory>
#include <numeric>
#include <random>
#include <span>
#include <stdexcept>
#include <unordered_map>
#include <vector>

#include "kvport/backends/host_backend.hpp"
#include "kvport/core/block_hash.hpp"
#include "kvport/core/paged_kv_cache.hpp"
#include "kvport/core/prefix_cache.hpp"
#include "thread_clock.hpp"

namespace kvport::bench {
namespace {

constexpr std::size_t kBlockTokens = 16;
constexpr std::size_t kPromptBlocks = 64;
constexpr std::size_t kPhasePrompts = 64;  // prompts per implementation per iteration

// The prefix cache before the flat map (kvport 311abaf), reduced to the calls
// the workloads make, with the same data structures and the same steps.
class LegacyPrefixCache {
 public:
  explicit LegacyPrefixCache(PagedKvCache& cache) : kv_(&cache), entries_(cache.num_blocks()) {
    map_.reserve(cache.num_blocks());
    head_.prev = head_.next = &head_;
  }

  PrefixMatch lookup_hashes(std::span<const BlockHash> hashes) {
    PrefixMatch match;
    for (const BlockHash& h : hashes) {
      auto it = map_.find(h);
      if (it == map_.end()) break;
      match.blocks.push_back(it->second);
    }
    match.hashes.assign(hashes.begin(),
                        hashes.begin() + static_cast<std::ptrdiff_t>(match.blocks.size()));
    for (const BlockId b : match.blocks) {
      kv_->inc_ref(b);
      Entry& e = entries_[b];
      if (e.next != nullptr) unlink(e);
    }
    match.num_tokens = match.blocks.size() * kBlockTokens;
    return match;
  }

  BlockId alloc_block() {
    if (kv_->num_free_blocks() == 0 && size_ != 0) {
      Entry& e = *head_.next;
      unlink(e);
      map_.erase(e.hash);
      e.cached = false;
      kv_->return_evicted_block(static_cast<BlockId>(&e - entries_.data()));
    }
    return kv_->alloc_block();
  }

  bool insert(const BlockHash& hash, BlockId block) {
    Entry& e = entries_[block];
    if (e.cached) return false;
    auto [it, inserted] = map_.emplace(hash, block);
    if (!inserted) return false;
    kv_->inc_ref(block);
    e.hash = hash;
    e.cached = true;
    return true;
  }

  void release_blocks(std::span<const BlockId> table) {
    for (auto it = table.rbegin(); it != table.rend(); ++it)
      release(*it);
  }

 private:
  // Hook first, as boost::intrusive::list_base_hook<> lays it out.
  struct Entry {
    Entry* prev = nullptr;
    Entry* next = nullptr;
    BlockHash hash;
    bool cached = false;
  };

  void release(BlockId block) {
    if (block >= entries_.size()) throw std::out_of_range("LegacyPrefixCache::release");
    Entry& e = entries_[block];
    if (!e.cached) {
      kv_->dec_ref(block);
      return;
    }
    const std::uint32_t refs = kv_->ref_count(block);
    kv_->dec_ref(block);
    if (refs == 2) {  // push_back
      e.prev = head_.prev;
      e.next = &head_;
      head_.prev->next = &e;
      head_.prev = &e;
      ++size_;
    }
  }

  void unlink(Entry& e) {  // safe-link mode: the hook is cleared
    e.prev->next = e.next;
    e.next->prev = e.prev;
    e.prev = e.next = nullptr;
    --size_;
  }

  PagedKvCache* kv_;
  std::vector<Entry> entries_;
  Entry head_;
  std::size_t size_ = 0;
  std::unordered_map<BlockHash, BlockId, BlockHashHasher> map_;
};

KvCacheConfig tiny_config() {  // the pools are never touched: keep them small
  KvCacheConfig c;
  c.num_layers = 1;
  c.block_size = kBlockTokens;
  c.num_kv_heads = 1;
  c.head_dim_k = c.head_dim_v = 1;
  return c;
}

std::vector<TokenId> prompt_tokens() {
  std::vector<TokenId> t(kPromptBlocks * kBlockTokens);
  for (std::size_t i = 0; i < t.size(); ++i)
    t[i] = static_cast<TokenId>((i * 40503u + 17u) % 128000u);
  return t;
}

// One implementation over its own PagedKvCache, filled with num_blocks / 64
// cached, evictable prompts; prompt p is prompt_tokens() under extra key p.
template <class Cache>
struct Setup {
  std::unique_ptr<Backend> backend = make_host_backend();
  PagedKvCache kv;
  Cache pc;
  std::vector<TokenId> tokens = prompt_tokens();
  std::size_t prompts;
  std::uint64_t next_key;  // the next never-seen extra key
  std::vector<BlockId> table;

  explicit Setup(std::size_t num_blocks)
      : kv(tiny_config(), num_blocks, *backend),
        pc(kv),
        prompts(num_blocks / kPromptBlocks),
        next_key(prompts) {
    table.reserve(kPromptBlocks);
    for (std::uint64_t p = 0; p < prompts; ++p)
      prefill(hash_full_blocks(tokens, kBlockTokens, p));
  }

  // Lookup (misses), allocate (evicting once the free list is empty),
  // register and release one prompt's blocks.
  void prefill(const std::vector<BlockHash>& hashes) {
    const PrefixMatch m = pc.lookup_hashes(hashes);
    table.assign(m.blocks.begin(), m.blocks.end());
    for (std::size_t i = table.size(); i < hashes.size(); ++i) {
      const BlockId b = pc.alloc_block();
      pc.insert(hashes[i], b);
      table.push_back(b);
    }
    pc.release_blocks(table);
  }

  void miss_phase() {
    for (std::size_t i = 0; i < kPhasePrompts; ++i)
      prefill(hash_full_blocks(tokens, kBlockTokens, next_key++));
  }

  void hit_phase(const std::vector<std::vector<BlockHash>>& hashes,
                 const std::vector<std::uint32_t>& order, std::size_t& cursor) {
    for (std::size_t i = 0; i < kPhasePrompts; ++i) {
      const PrefixMatch m = pc.lookup_hashes(hashes[order[cursor]]);
      cursor = cursor + 1 == order.size() ? 0 : cursor + 1;
      benchmark::DoNotOptimize(m.blocks.data());
      pc.release_blocks(m.blocks);
    }
  }
};

void report(benchmark::State& state, double new_ns, double legacy_ns) {
  const double blocks =
      static_cast<double>(state.iterations()) * static_cast<double>(kPhasePrompts * kPromptBlocks);
  state.counters["ns_per_block"] = new_ns / blocks;
  state.counters["legacy_ns_per_block"] = legacy_ns / blocks;
  state.counters["x_legacy"] = legacy_ns / new_ns;  // how many times faster the new design is
  state.SetLabel("new: flat_hash_set + LRU queue; legacy: unordered_map + intrusive list");
}

void BM_PrefixCacheHitRelease(benchmark::State& state) {
  const auto num_blocks = static_cast<std::size_t>(state.range(0));
  Setup<PrefixCache> fresh(num_blocks);
  Setup<LegacyPrefixCache> legacy(num_blocks);
  std::vector<std::vector<BlockHash>> hashes(fresh.prompts);
  for (std::uint64_t p = 0; p < fresh.prompts; ++p)
    hashes[p] = hash_full_blocks(fresh.tokens, kBlockTokens, p);
  std::vector<std::uint32_t> order(fresh.prompts);
  std::iota(order.begin(), order.end(), 0u);
  std::shuffle(order.begin(), order.end(), std::mt19937(42));
  std::size_t fresh_cursor = 0;
  std::size_t legacy_cursor = 0;
  double fresh_ns = 0;
  double legacy_ns = 0;
  for (auto _ : state) {
    fresh_ns += timed_ns([&] { fresh.hit_phase(hashes, order, fresh_cursor); });
    legacy_ns += timed_ns([&] { legacy.hit_phase(hashes, order, legacy_cursor); });
  }
  if (fresh.pc.counters().hits != state.iterations() * kPhasePrompts * kPromptBlocks)
    state.SkipWithError("a prompt of the hit workload missed");
  report(state, fresh_ns, legacy_ns);
  // The new design's bookkeeping per block (PrefixCache::memory_usage()).
  state.counters["bytes_per_block"] =
      static_cast<double>(fresh.pc.memory_usage().total()) / static_cast<double>(num_blocks);
}
BENCHMARK(BM_PrefixCacheHitRelease)->ArgName("blocks")->Arg(4096)->Arg(262144);

void BM_PrefixCachePrefillMiss(benchmark::State& state) {
  const auto num_blocks = static_cast<std::size_t>(state.range(0));
  Setup<PrefixCache> fresh(num_blocks);
  Setup<LegacyPrefixCache> legacy(num_blocks);
  const std::uint64_t evictions_before = fresh.pc.counters().evictions;
  double fresh_ns = 0;
  double legacy_ns = 0;
  for (auto _ : state) {
    fresh_ns += timed_ns([&] { fresh.miss_phase(); });
    legacy_ns += timed_ns([&] { legacy.miss_phase(); });
  }
  if (fresh.pc.counters().evictions - evictions_before !=
      state.iterations() * kPhasePrompts * kPromptBlocks)
    state.SkipWithError("a block of the miss workload was allocated without eviction");
  report(state, fresh_ns, legacy_ns);
}
BENCHMARK(BM_PrefixCachePrefillMiss)->ArgName("blocks")->Arg(4096)->Arg(262144);

}  // namespace
}  // namespace kvport::bench
