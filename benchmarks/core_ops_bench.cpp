// SPDX-License-Identifier: Apache-2.0
// Block management on the scheduler's hot path: ns per operation, host
// side only (no device work).
#include <benchmark/benchmark.h>

#include <chrono>
#include <memory>
#include <numeric>
#include <vector>

#include "kvport/backends/host_backend.hpp"
#include "kvport/core/block_hash.hpp"
#include "kvport/core/block_table.hpp"
#include "kvport/core/paged_kv_cache.hpp"
#include "kvport/core/prefix_cache.hpp"
#include "kvport/platform/log.hpp"

namespace kvport::bench {
namespace {

constexpr std::size_t kBlocks = 4096;

// A cache whose pools are never touched: the operations measured are host
// bookkeeping only. Tiny blocks keep the pools small.
struct Fixture {
  std::unique_ptr<Backend> backend = make_host_backend();
  PagedKvCache cache;

  explicit Fixture(bool trace) : cache(config(), kBlocks, *backend, PagedKvCacheOptions{trace}) {}

  static KvCacheConfig config() {
    KvCacheConfig c;
    c.num_layers = 32;
    c.block_size = 16;
    c.num_kv_heads = 1;
    c.head_dim_k = c.head_dim_v = 8;
    return c;
  }
};

void BM_AllocFreePair(benchmark::State& state) {
  Fixture f(state.range(0) != 0);
  for (auto _ : state) {
    const BlockId id = f.cache.alloc_block();
    benchmark::DoNotOptimize(id);
    f.cache.free_block(id);
  }
  state.SetItemsProcessed(state.iterations());
  state.SetLabel(state.range(0) != 0 ? "tracing on" : "tracing off");
}
BENCHMARK(BM_AllocFreePair)->ArgName("trace")->Arg(0)->Arg(1);

void BM_IncDecRef(benchmark::State& state) {
  Fixture f(state.range(0) != 0);
  const BlockId id = f.cache.alloc_block();
  for (auto _ : state) {
    f.cache.inc_ref(id);
    benchmark::DoNotOptimize(f.cache.dec_ref(id));
  }
  state.SetItemsProcessed(state.iterations());
  state.SetLabel(state.range(0) != 0 ? "tracing on" : "tracing off");
}
BENCHMARK(BM_IncDecRef)->ArgName("trace")->Arg(0)->Arg(1);

// free_blocks of a 1k-block table; the allocations happen with the clock
// paused. Items are blocks, so the time per item is the cost per block.
void BM_FreeBlocksTable1k(benchmark::State& state) {
  Fixture f(false);
  std::vector<BlockId> table(1024);
  for (auto _ : state) {
    state.PauseTiming();
    for (BlockId& id : table)
      id = f.cache.alloc_block();
    state.ResumeTiming();
    f.cache.free_blocks(table);
  }
  state.SetItemsProcessed(state.iterations() * static_cast<std::int64_t>(table.size()));
}
BENCHMARK(BM_FreeBlocksTable1k);

void BM_TryAllocAtExhaustion(benchmark::State& state) {
  Fixture f(false);
  while (f.cache.try_alloc_block()) {
  }
  for (auto _ : state)
    benchmark::DoNotOptimize(f.cache.try_alloc_block());
  state.SetItemsProcessed(state.iterations());
}
BENCHMARK(BM_TryAllocAtExhaustion);

// ---- prefix caching: cost per block of lookup + allocate ------------------------------

constexpr std::size_t kPromptTokens = 1024;  // 64 blocks of 16 tokens

std::vector<TokenId> prompt_tokens(std::uint32_t seed) {
  std::vector<TokenId> t(kPromptTokens);
  for (std::size_t i = 0; i < t.size(); ++i)
    t[i] = static_cast<TokenId>((seed * 2654435761u + i * 40503u) % 128000u);
  return t;
}

// The baseline in the same run: the same 64 blocks through the plain
// PagedKvCache (alloc + free, no hashing), ns per block.
double plain_ns_per_block(PagedKvCache& cache) {
  constexpr int kRounds = 2000;
  const std::size_t blocks = kPromptTokens / cache.config().block_size;
  std::vector<BlockId> table(blocks);
  const auto start = std::chrono::steady_clock::now();
  for (int r = 0; r < kRounds; ++r) {
    for (BlockId& id : table)
      id = cache.alloc_block();
    benchmark::DoNotOptimize(table.data());
    cache.free_blocks(table);
  }
  const std::chrono::duration<double, std::nano> ns = std::chrono::steady_clock::now() - start;
  return ns.count() / (kRounds * static_cast<double>(blocks));
}

void report_per_block(benchmark::State& state, PagedKvCache& cache, double measured_ns) {
  const std::size_t blocks = kPromptTokens / cache.config().block_size;
  state.SetItemsProcessed(state.iterations() * static_cast<std::int64_t>(blocks));
  Fixture baseline(false);  // the prefix cache may hold every block of `cache`
  const double plain = plain_ns_per_block(baseline.cache);
  state.counters["ns_per_block"] = measured_ns;
  state.counters["plain_ns_per_block"] = plain;
  state.counters["x_plain"] = measured_ns / plain;
}

double ns_per_block(const benchmark::State& state, std::chrono::steady_clock::duration spent,
                    std::size_t blocks) {
  return std::chrono::duration<double, std::nano>(spent).count() /
         (static_cast<double>(state.iterations()) * static_cast<double>(blocks));
}

// Every prompt is new: lookup misses all 64 blocks, the table allocates them
// (evicting the least recently used cached blocks once the free list is
// empty), hashes and registers each, then releases them into the LRU list.
void BM_PrefixPrefillMiss(benchmark::State& state) {
  Fixture f(false);
  PrefixCache pc(f.cache);
  Stream stream = f.backend->create_stream();
  std::uint32_t seed = 1;
  const std::size_t blocks = kPromptTokens / f.cache.config().block_size;
  std::chrono::steady_clock::duration spent{};
  for (auto _ : state) {
    const std::vector<TokenId> prompt = prompt_tokens(seed++);
    const auto start = std::chrono::steady_clock::now();
    BlockTable t(pc);
    const std::size_t reused = t.reuse_cached_prefix(prompt);
    t.append_tokens(std::span<const TokenId>(prompt).subspan(reused), stream);
    t.release();
    spent += std::chrono::steady_clock::now() - start;
  }
  state.counters["evictions"] = static_cast<double>(pc.counters().evictions);
  report_per_block(state, f.cache, ns_per_block(state, spent, blocks));
}
BENCHMARK(BM_PrefixPrefillMiss);

// The same prompt every time: lookup hits all 64 blocks (hash, find, take a
// reference, leave the LRU list), then the table releases them back.
void BM_PrefixLookupHit(benchmark::State& state) {
  Fixture f(false);
  PrefixCache pc(f.cache);
  Stream stream = f.backend->create_stream();
  const std::vector<TokenId> prompt = prompt_tokens(7);
  {
    BlockTable warm(pc);
    warm.append_tokens(prompt, stream);
  }
  const std::size_t blocks = kPromptTokens / f.cache.config().block_size;
  const auto start = std::chrono::steady_clock::now();
  for (auto _ : state) {
    BlockTable t(pc);
    benchmark::DoNotOptimize(t.reuse_cached_prefix(prompt));
    t.release();
  }
  const auto spent = std::chrono::steady_clock::now() - start;
  state.counters["hit_rate"] = pc.counters().hit_rate();
  report_per_block(state, f.cache, ns_per_block(state, spent, blocks));
}
BENCHMARK(BM_PrefixLookupHit);

// Decode: one token per append, with prefix caching (a block is hashed and
// registered every 16 tokens). The table restarts every 8192 tokens; the time
// per token must not grow with the sequence length.
void BM_DecodeAppendToken(benchmark::State& state) {
  Fixture f(false);
  PrefixCache pc(f.cache);
  Stream stream = f.backend->create_stream();
  BlockTable t(pc);
  TokenId next = 0;
  for (auto _ : state) {
    if (t.num_tokens() == 8192) t.release();
    const TokenId token = next++;
    t.append_tokens({&token, 1}, stream);
  }
  state.SetItemsProcessed(state.iterations());
}
BENCHMARK(BM_DecodeAppendToken);

// The hashing share: XXH3-128 chained over 64 blocks of 16 token ids.
void BM_HashFullBlocks(benchmark::State& state) {
  const std::vector<TokenId> prompt = prompt_tokens(3);
  for (auto _ : state)
    benchmark::DoNotOptimize(hash_full_blocks(prompt, 16));
  state.SetItemsProcessed(state.iterations() * static_cast<std::int64_t>(kPromptTokens / 16));
}
BENCHMARK(BM_HashFullBlocks);

}  // namespace
}  // namespace kvport::bench
