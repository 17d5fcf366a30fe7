// SPDX-License-Identifier: Apache-2.0
// What cache events (cache_events.hpp) cost the prefix cache's hot path: the
// same replay-like loop over two PrefixCaches of the same size in one run,
// one without a sink and one with a sink that only counts, alternating in
// phases so that both see the same machine load; each reports ns of thread
// CPU time per request and the ratio (with sink / without).
//
// The loop is a replay's per-request work: a BlockTable looks up the longest
// cached prefix of a prompt (hashing it), appends the rest (allocating, and
// evicting once the free list is empty), registers every new full block
// (with a sink: one BlockStored per request, the tokens copied into the
// cache's origin record) and releases everything. Prompts are 8..64 blocks of
// 16 tokens from 512 documents plus a block of their own, so requests share
// prefixes, the cache (16384 blocks) holds about 90% of what the documents
// need, and about half of the blocks hit.
#include <benchmark/benchmark.h>

#include <cstdint>
#include <ctime>
#include <memory>
#include <random>
#include <span>
#include <vector>

#include "kvport/backends/host_backend.hpp"
#include "kvport/core/block_hash.hpp"
#include "kvport/core/block_table.hpp"
#include "kvport/core/cache_events.hpp"
#include "kvport/core/paged_kv_cache.hpp"
#include "kvport/core/prefix_cache.hpp"
#include "thread_clock.hpp"

namespace kvport::bench {
namespace {

constexpr std::size_t kTokens = 16;
constexpr std::size_t kDocs = 512;
constexpr std::size_t kRequests = 4096;  // the trace, replayed in a loop
constexpr std::size_t kPhase = 64;       // requests per cache per iteration

class CountingSink final : public CacheEventSink {
 public:
  void stored(const EventSource&, const BlockStoredView& v) noexcept override {
    ++events;
    blocks += v.hashes.size();
  }
  void removed(const EventSource&, std::span<const BlockHash> h) noexcept override {
    ++events;
    blocks += h.size();
  }
  void cleared(const EventSource&) noexcept override { ++events; }
  std::uint64_t events = 0;
  std::uint64_t blocks = 0;
};

KvCacheConfig config() {
  KvCacheConfig c;
  c.num_layers = 1;
  c.block_size = kTokens;
  c.num_kv_heads = 1;
  c.head_dim_k = 8;
  c.head_dim_v = 8;
  c.dtype = KvCacheDtype::bf16;
  return c;
}

std::vector<std::vector<TokenId>> make_trace() {
  std::mt19937 rng(7);
  std::vector<std::vector<TokenId>> trace(kRequests);
  for (std::size_t r = 0; r < kRequests; ++r) {
    const std::size_t doc = rng() % kDocs;
    const std::size_t blocks = 8 + rng() % 57;
    std::vector<TokenId>& p = trace[r];
    p.resize((blocks + 1) * kTokens);
    for (std::size_t i = 0; i < blocks * kTokens; ++i)
      p[i] = static_cast<TokenId>((doc * 100003u + i * 40503u + 17u) % 128000u);
    for (std::size_t i = blocks * kTokens; i < p.size(); ++i)
      p[i] = static_cast<TokenId>(200000u + r * kTokens + i);  // the request's own block
  }
  return trace;
}

struct Replay {
  std::unique_ptr<Backend> backend = make_host_backend();
  PagedKvCache kv;
  PrefixCache pc;
  std::size_t cursor = 0;

  explicit Replay(CacheEventSink* sink) : kv(config(), 16384, *backend), pc(kv) {
    pc.set_event_sink(sink);
  }

  void phase(const std::vector<std::vector<TokenId>>& trace) {
    const StreamView stream = backend->default_stream();
    for (std::size_t i = 0; i < kPhase; ++i) {
      const std::vector<TokenId>& p = trace[cursor];
      cursor = cursor + 1 == trace.size() ? 0 : cursor + 1;
      BlockTable t(pc);
      const std::size_t hit = t.reuse_cached_prefix(p, stream);
      t.append_tokens(std::span<const TokenId>(p).subspan(hit), stream);
      benchmark::DoNotOptimize(t.blocks().data());
    }
  }
};

void BM_CacheEventsReplayLoop(benchmark::State& state) {
  const std::vector<std::vector<TokenId>> trace = make_trace();
  CountingSink sink;
  Replay off(nullptr);
  Replay on(&sink);
  // Warm both up to a full cache, so every phase evicts.
  for (std::size_t i = 0; i < kRequests / kPhase; ++i) {
    off.phase(trace);
    on.phase(trace);
  }
  const std::uint64_t events_before = sink.events;
  double off_ns = 0;
  double on_ns = 0;
  for (auto _ : state) {
    off_ns += timed_ns([&] { off.phase(trace); });
    on_ns += timed_ns([&] { on.phase(trace); });
  }
  if (off.pc.counters().inserts != on.pc.counters().inserts ||
      off.pc.counters().evictions != on.pc.counters().evictions) {
    state.SkipWithError("the two caches diverged");
  }
  const double requests = static_cast<double>(state.iterations()) * kPhase;
  state.counters["ns_per_request_no_sink"] = off_ns / requests;
  state.counters["ns_per_request_sink"] = on_ns / requests;
  state.counters["x_no_sink"] = on_ns / off_ns;  // > 1: the sink's cost
  state.counters["events_per_request"] =
      static_cast<double>(sink.events - events_before) / requests;
  state.counters["hit_rate"] = on.pc.counters().hit_rate();
  state.SetLabel("same loop, same run: no sink vs a counting sink");
}
BENCHMARK(BM_CacheEventsReplayLoop)->Unit(benchmark::kMicrosecond);

}  // namespace
}  // namespace kvport::bench
