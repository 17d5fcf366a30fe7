// Block management on the scheduler's hot path: ns per operation, host
// side only (no device work).
#include <benchmark/benchmark.h>

#include <memory>
#include <numeric>
#include <vector>

#include "kvport/backends/host_backend.hpp"
#include "kvport/core/paged_kv_cache.hpp"
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

}  // namespace
}  // namespace kvport::bench
