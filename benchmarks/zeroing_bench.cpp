// SPDX-License-Identifier: Apache-2.0
// Block zeroing, three strategies on the same cache in the same run (see
// sim/include/kvport/sim/zeroing.hpp): reference (2 x layers
// x blocks memsets), batched (PagedKvCache::zero_blocks, one call) and limit
// (one contiguous memset of the same bytes). The benchmark's time is the
// device time of one iteration of all three strategies (manual time from
// timing events), so --benchmark_min_time bounds what a case really costs: the
// reference strategy alone is up to 2 x 80 layers x 256 blocks = 40,960
// memsets per iteration, and timing only the (tiny) batched strategy made
// Google Benchmark iterate for minutes per case on a GPU. The counters carry
// each strategy's throughput and seconds per batch, and the ratios, measured
// in the same iterations.
//
// Runs on every compiled backend that has a device (host always).
#include <benchmark/benchmark.h>
#include <fmt/format.h>

#include <cstdlib>
#include <map>
#include <memory>
#include <string>

#include "kvport/platform/log.hpp"
#include "kvport/platform/registry.hpp"
#include "kvport/sim/zeroing.hpp"

namespace kvport::bench {
namespace {

using sim::IdPattern;
using sim::StrategyResult;
using sim::zeroing_shapes;
using sim::ZeroingBench;
using sim::ZeroingShape;

constexpr std::size_t kMaxBatch = 256;

// One bench (cache + limit buffer) alive at a time: the 70B one holds 3.75 GiB.
// Benchmarks are registered grouped by (backend, shape, layout), so each is
// built once.
struct Current {
  std::string key;
  std::unique_ptr<Backend> backend;
  std::unique_ptr<ZeroingBench> bench;
};

Current& current() {
  static Current c;
  return c;
}

ZeroingBench& bench_for(const std::string& backend, const ZeroingShape& shape,
                        KvCacheLayout layout) {
  Current& c = current();
  const std::string key = fmt::format("{}/{}/{}", backend, shape.name, to_string(layout));
  if (c.key != key) {
    c.bench.reset();
    if (!c.backend || c.backend->name() != backend) c.backend = make_backend(backend);
    c.bench = std::make_unique<ZeroingBench>(*c.backend, shape, layout, kMaxBatch);
    c.key = key;
  }
  return *c.bench;
}

void zeroing(benchmark::State& state, std::string backend, ZeroingShape shape, KvCacheLayout layout,
             IdPattern pattern) {
  const auto batch = static_cast<std::size_t>(state.range(0));
  ZeroingBench& bench = bench_for(backend, shape, layout);
  const std::vector<BlockId> ids = bench.ids(batch, pattern);
  const std::size_t bytes = bench.bytes_per_batch(batch);
  double reference_s = 0, batched_s = 0, limit_s = 0;
  double reference_calls = 0, batched_calls = 0, limit_calls = 0;
  for (auto _ : state) {
    const StrategyResult r = bench.run_reference(ids);
    const StrategyResult b = bench.run_batched(ids);
    const StrategyResult l = bench.run_limit(bytes);
    state.SetIterationTime(r.seconds + b.seconds + l.seconds);
    reference_s += r.seconds;
    batched_s += b.seconds;
    limit_s += l.seconds;
    reference_calls = r.calls;
    batched_calls = b.calls;
    limit_calls = l.calls;
  }
  const double n = static_cast<double>(state.iterations());
  const double total = static_cast<double>(bytes) * n;
  // No SetBytesProcessed: over the manual time (all three strategies) it would
  // be no strategy's throughput; each strategy's is a counter below.
  state.counters["bytes"] = static_cast<double>(bytes);
  state.counters["reference_bytes_per_s"] = total / reference_s;
  state.counters["batched_bytes_per_s"] = total / batched_s;
  state.counters["limit_bytes_per_s"] = total / limit_s;
  state.counters["reference_seconds"] = reference_s / n;
  state.counters["batched_seconds"] = batched_s / n;
  state.counters["limit_seconds"] = limit_s / n;
  state.counters["reference_calls"] = reference_calls;
  state.counters["batched_calls"] = batched_calls;
  state.counters["limit_calls"] = limit_calls;
  state.counters["batched_over_limit"] = limit_s / batched_s;
  state.counters["batched_over_reference"] = reference_s / batched_s;
}

// Registered before main() runs, for every backend with a device. The
// library's info lines ("KV cache on host: ...") would drown the table.
const bool registered = [] {
  if (std::getenv("KVPORT_LOG_LEVEL") == nullptr) log::set_level(log::Level::warn);
  for (const BackendInfo& info : compiled_backends()) {
    if (!info.available) continue;
    for (const ZeroingShape& shape : zeroing_shapes()) {
      for (KvCacheLayout layout : {KvCacheLayout::layer_major, KvCacheLayout::block_major}) {
        for (IdPattern pattern : {IdPattern::contiguous, IdPattern::scattered}) {
          const std::string name = fmt::format("Zeroing/{}/{}/{}/{}", info.name, shape.name,
                                               to_string(layout), to_string(pattern));
          benchmark::RegisterBenchmark(name.c_str(), zeroing, info.name, shape, layout, pattern)
              ->Arg(1)
              ->Arg(16)
              ->Arg(256)
              ->UseManualTime()
              ->Unit(benchmark::kMicrosecond);
        }
      }
    }
  }
  return true;
}();

}  // namespace
}  // namespace kvport::bench
