// SPDX-License-Identifier: Apache-2.0
// The router index (kvport::router) on a Mooncake trace: index operations
// per second and decision latency, as Dynamo reports for its KV indexer.
//
// Setup (once, untimed): the trace (KVPORT_ROUTER_TRACE, default
// tests/data/mooncake_small.jsonl; token ids from the hash ids as `kvport
// replay` makes them, 512 tokens per hash id) runs over 4 instances, each a
// PagedKvCache + PrefixCache of KVPORT_ROUTER_INSTANCE_BLOCKS blocks (default
// 65,536) of 16 tokens, routed by the prefix-aware policy. Each request looks
// up its prompt on its instance, allocates and registers the blocks it
// misses (evicting least recently used ones), and runs until 16 later
// requests have arrived (its blocks are its instance's load). The cache
// events this produces are synthesized here as vLLM's block pool emits them
// (a BlockRemoved of one hash per eviction while the missing blocks are
// allocated, then one BlockStored of the blocks registered; one batch per
// request, sequence numbers from 0 per instance), since the events are what
// the index consumes; token_ids are left empty (the index keys blocks by
// their hashes). The recorded index is checked against the caches: every
// instance's GPU entries == its cached blocks.
//
// Timed:
//  - BM_RouterTraceReplay: the recorded run again through a fresh Router:
//    for each request, set the instances' loads, decide (hash the prompt,
//    match, score, pick: timed one by one for p50/p99), then apply the
//    batches it produced. Manual time: the sum of the decide and apply
//    sections (token synthesis excluded). prehashed:1 passes the prompt's
//    block hashes in (Request::block_hashes, computed untimed, as a frontend
//    that hands them on to the engine would): lookups and scoring only.
//  - BM_RouterIndexApply: only the batches, into a fresh index.
//  - BM_RouterDecideFull: only decisions, on the index in its final state.
// Counters: ops_per_s = (events + decisions) / s (the measure),
// index_ops_per_s = (block updates + decisions) / s, events_per_s,
// block_ops_per_s, decisions_per_s, decision_p50_us / decision_p99_us (wall
// clock) and decision_cpu_p50_us / decision_cpu_p99_us (this thread's CPU
// time: the same without the time the shared machine's scheduler gave the
// core to another process), decide_ns_per_block (decide time per block up to
// the end of the longest prefix held, + 1: hashing and lookup).
#include <benchmark/benchmark.h>

#include <algorithm>
#include <array>
#include <chrono>
#include <cstdint>
#include <cstdlib>
#include <ctime>
#include <deque>
#include <memory>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "kvport/backends/host_backend.hpp"
#include "kvport/core/block_hash.hpp"
#include "kvport/core/cache_events.hpp"
#include "kvport/core/paged_kv_cache.hpp"
#include "kvport/core/prefix_cache.hpp"
#include "kvport/router/router.hpp"
#include "kvport/sim/mooncake_trace.hpp"
#include "kvport/sim/trace_tokens.hpp"
#include "thread_clock.hpp"

#ifndef KVPORT_SOURCE_DIR
#define KVPORT_SOURCE_DIR "."
#endif

namespace kvport::bench {
namespace {

using router::InstanceId;
using SteadyClock = std::chrono::steady_clock;

constexpr std::size_t kInstances = 4;
constexpr std::uint32_t kBlockTokens = 16;
constexpr std::size_t kTraceBlockTokens = 512;
constexpr std::size_t kRunningWindow = 16;

std::string trace_path() {
  const char* env = std::getenv("KVPORT_ROUTER_TRACE");
  return env != nullptr && *env != '\0' ? env
                                        : KVPORT_SOURCE_DIR "/tests/data/mooncake_small.jsonl";
}

std::size_t instance_blocks() {
  const char* env = std::getenv("KVPORT_ROUTER_INSTANCE_BLOCKS");
  return env != nullptr && *env != '\0' ? std::stoul(env) : 65536;
}

KvCacheConfig tiny_config() {  // the pools are never touched: keep them small
  KvCacheConfig c;
  c.num_layers = 1;
  c.block_size = kBlockTokens;
  c.num_kv_heads = 1;
  c.head_dim_k = c.head_dim_v = 1;
  return c;
}

router::IndexOptions index_options() {
  router::IndexOptions o;
  o.block_size = kBlockTokens;
  return o;
}

struct Step {
  std::size_t request = 0;                                 // index into the trace
  std::array<router::InstanceLoad, kInstances> loads{};    // before the decision
  std::vector<std::pair<InstanceId, EventBatch>> batches;  // after it
};

struct Recording {
  std::vector<sim::TraceRequest> trace;
  std::vector<Step> steps;
  std::uint64_t events = 0;
  std::uint64_t block_ops = 0;
  std::uint64_t prompt_blocks = 0;
  std::uint64_t hit_blocks = 0;
};

struct Instance {
  std::unique_ptr<Backend> backend = make_host_backend();
  PagedKvCache kv;
  PrefixCache pc;
  std::uint64_t next_seq = 0;
  router::InstanceLoad load;
  explicit Instance(std::size_t blocks) : kv(tiny_config(), blocks, *backend), pc(kv) {}
};

void push_stored(EventBatch& b, std::uint64_t hash, std::optional<std::uint64_t> parent) {
  if (b.events.empty() || !std::holds_alternative<BlockStored>(b.events.back())) {
    BlockStored s;
    s.parent_block_hash = parent;
    s.block_size = kBlockTokens;
    b.events.emplace_back(std::move(s));
  }
  std::get<BlockStored>(b.events.back()).block_hashes.push_back(hash);
}

Recording record() {
  Recording rec;
  rec.trace = sim::read_mooncake_trace(trace_path());
  const std::size_t blocks = instance_blocks();
  std::vector<std::unique_ptr<Instance>> inst;
  for (std::size_t i = 0; i < kInstances; ++i)
    inst.push_back(std::make_unique<Instance>(blocks));
  router::Router r(index_options(), router::ScoringOptions{}, router::make_prefix_aware_policy());
  for (InstanceId i = 0; i < kInstances; ++i)
    r.index().add_instance(i, router::Clock::time_point{});

  struct Running {
    InstanceId instance;
    std::vector<BlockId> table;
  };
  std::deque<Running> running;
  std::vector<TokenId> tokens;
  std::vector<std::pair<BlockId, BlockHash>> evicted;
  router::Decision d;
  for (std::size_t q = 0; q < rec.trace.size(); ++q) {
    const sim::TraceRequest& req = rec.trace[q];
    sim::sequence_tokens(req, q, kTraceBlockTokens, req.input_length, tokens);
    Step step;
    step.request = q;
    for (InstanceId i = 0; i < kInstances; ++i) {
      step.loads[i] = inst[i]->load;
      r.set_load(i, inst[i]->load.running_requests, inst[i]->load.blocks_in_use);
    }
    r.decide(router::Request{tokens}, d);
    const InstanceId chosen = *d.instance;
    Instance& in = *inst[chosen];

    const std::vector<BlockHash> hashes = hash_full_blocks(tokens, kBlockTokens);
    PrefixMatch m = in.pc.lookup_hashes(hashes);
    rec.prompt_blocks += hashes.size();
    rec.hit_blocks += m.blocks.size();
    Running run{chosen, std::move(m.blocks)};
    // As vLLM's block pool does: allocate the missing blocks first (each
    // eviction one BlockRemoved of one hash), then register them (one
    // BlockStored of the run).
    EventBatch batch;
    const std::size_t first_new = run.table.size();
    for (std::size_t b = first_new; b < hashes.size(); ++b) {
      if (in.kv.num_free_blocks() == 0) {
        evicted.clear();
        if (in.pc.detach_lru(1, evicted) == 0) break;  // everything in use: run with less
        BlockRemoved removed;
        removed.block_hashes.push_back(event_hash(evicted[0].second));
        batch.events.emplace_back(std::move(removed));
        in.pc.release(evicted[0].first);
      }
      run.table.push_back(in.pc.alloc_block());
    }
    for (std::size_t b = first_new; b < run.table.size(); ++b) {
      if (in.pc.insert(hashes[b], run.table[b])) {
        push_stored(
            batch, event_hash(hashes[b]),
            b == 0 ? std::nullopt : std::optional<std::uint64_t>(event_hash(hashes[b - 1])));
      }
    }
    if (!batch.events.empty()) {
      batch.seq = in.next_seq++;
      batch.ts = req.timestamp_ms / 1000.0;
      for (const CacheEvent& e : batch.events) {
        ++rec.events;
        std::visit(
            [&](const auto& ev) {
              if constexpr (!std::is_same_v<std::decay_t<decltype(ev)>, AllBlocksCleared>) {
                rec.block_ops += ev.block_hashes.size();
              }
            },
            e);
      }
      r.index().apply(chosen, batch, router::Clock::time_point{});
      step.batches.emplace_back(chosen, std::move(batch));
    }
    in.load.running_requests += 1;
    in.load.blocks_in_use += run.table.size();
    running.push_back(std::move(run));
    while (running.size() > kRunningWindow) {
      Running& done = running.front();
      Instance& di = *inst[done.instance];
      di.load.running_requests -= 1;
      di.load.blocks_in_use -= done.table.size();
      di.pc.release_blocks(done.table);
      running.pop_front();
    }
    rec.steps.push_back(std::move(step));
  }
  // The index followed every cache exactly.
  for (InstanceId i = 0; i < kInstances; ++i) {
    const router::InstanceStatus st = r.index().status(i);
    if (st.blocks[0] != inst[i]->pc.num_cached_blocks() ||
        st.need.kind != router::Need::Kind::nothing) {
      throw std::runtime_error("router_bench: the index lost track of instance " +
                               std::to_string(i) + ": " + std::to_string(st.blocks[0]) +
                               " entries, " + std::to_string(inst[i]->pc.num_cached_blocks()) +
                               " cached");
    }
  }
  return rec;
}

const Recording& recording() {
  static const Recording rec = record();
  return rec;
}

double seconds(SteadyClock::duration d) {
  return std::chrono::duration<double>(d).count();
}

// This thread's CPU time: a decision's latency without the time the
// scheduler gave the core to another process (the machine is shared).
double thread_cpu_us() {
  return thread_cpu_ns() / 1e3;
}

double percentile(std::vector<double>& v, double p) {
  if (v.empty()) return 0;
  const auto k = static_cast<std::size_t>(p * static_cast<double>(v.size() - 1));
  std::nth_element(v.begin(), v.begin() + static_cast<std::ptrdiff_t>(k), v.end());
  return v[k];
}

void add_info(benchmark::State& state, const Recording& rec) {
  state.counters["requests"] = static_cast<double>(rec.trace.size());
  state.counters["events"] = static_cast<double>(rec.events);
  state.counters["block_ops"] = static_cast<double>(rec.block_ops);
  state.counters["hit_rate"] = rec.prompt_blocks == 0 ? 0.0
                                                      : static_cast<double>(rec.hit_blocks) /
                                                            static_cast<double>(rec.prompt_blocks);
}

void BM_RouterTraceReplay(benchmark::State& state) {
  const Recording& rec = recording();
  const bool prehashed = state.range(0) != 0;
  std::vector<TokenId> tokens;
  std::vector<BlockHash> hashes;
  std::vector<double> lat_us, cpu_us;
  lat_us.reserve(rec.steps.size() * 4);
  cpu_us.reserve(rec.steps.size() * 4);
  router::Decision d;
  double decide_s = 0, apply_s = 0;
  double looked_up = 0;  // blocks up to the end of the longest prefix, + 1
  for (auto _ : state) {
    router::Router r(index_options(), router::ScoringOptions{}, router::make_prefix_aware_policy());
    for (InstanceId i = 0; i < kInstances; ++i)
      r.index().add_instance(i, router::Clock::time_point{});
    double busy = 0;
    for (const Step& step : rec.steps) {
      const sim::TraceRequest& req = rec.trace[step.request];
      sim::sequence_tokens(req, step.request, kTraceBlockTokens, req.input_length, tokens);
      if (prehashed) hashes = hash_full_blocks(tokens, kBlockTokens);
      const double c0 = thread_cpu_us();
      const auto t0 = SteadyClock::now();
      for (InstanceId i = 0; i < kInstances; ++i)
        r.set_load(i, step.loads[i].running_requests, step.loads[i].blocks_in_use);
      r.decide(router::Request{tokens, 0,
                               prehashed ? std::span<const BlockHash>(hashes)
                                         : std::span<const BlockHash>()},
               d);
      const auto t1 = SteadyClock::now();
      cpu_us.push_back(thread_cpu_us() - c0);
      for (const auto& [id, batch] : step.batches)
        r.index().apply(id, batch, router::Clock::time_point{});
      const auto t2 = SteadyClock::now();
      benchmark::DoNotOptimize(d.instance);
      lat_us.push_back(seconds(t1 - t0) * 1e6);
      std::uint32_t longest = 0;
      for (const router::InstanceScore& sc : d.scores)
        longest = std::max(longest, sc.matched_blocks);
      looked_up += std::min<double>(d.request_blocks, longest + 1.0);
      decide_s += seconds(t1 - t0);
      apply_s += seconds(t2 - t1);
      busy += seconds(t2 - t0);
    }
    state.SetIterationTime(busy);
  }
  const auto iters = static_cast<double>(state.iterations());
  const double decisions = iters * static_cast<double>(rec.steps.size());
  const double events = iters * static_cast<double>(rec.events);
  const double block_ops = iters * static_cast<double>(rec.block_ops);
  add_info(state, rec);
  state.counters["ops_per_s"] = (events + decisions) / (decide_s + apply_s);
  state.counters["index_ops_per_s"] = (block_ops + decisions) / (decide_s + apply_s);
  state.counters["events_per_s"] = events / apply_s;
  state.counters["block_ops_per_s"] = block_ops / apply_s;
  state.counters["decisions_per_s"] = decisions / decide_s;
  state.counters["decision_p50_us"] = percentile(lat_us, 0.50);
  state.counters["decision_p99_us"] = percentile(lat_us, 0.99);
  state.counters["decide_ns_per_block"] = looked_up == 0 ? 0.0 : decide_s * 1e9 / looked_up;
  state.counters["decision_cpu_p50_us"] = percentile(cpu_us, 0.50);
  state.counters["decision_cpu_p99_us"] = percentile(cpu_us, 0.99);
}
BENCHMARK(BM_RouterTraceReplay)
    ->ArgName("prehashed")
    ->Arg(0)
    ->Arg(1)
    ->UseManualTime()
    ->Unit(benchmark::kMillisecond);

void BM_RouterIndexApply(benchmark::State& state) {
  const Recording& rec = recording();
  double total = 0;
  for (auto _ : state) {
    router::RouterIndex idx(index_options());
    for (InstanceId i = 0; i < kInstances; ++i)
      idx.add_instance(i, router::Clock::time_point{});
    const auto t0 = SteadyClock::now();
    for (const Step& step : rec.steps)
      for (const auto& [id, batch] : step.batches)
        idx.apply(id, batch, router::Clock::time_point{});
    const double s = seconds(SteadyClock::now() - t0);
    benchmark::DoNotOptimize(idx.num_blocks());
    total += s;
    state.SetIterationTime(s);
  }
  const auto iters = static_cast<double>(state.iterations());
  add_info(state, rec);
  state.counters["events_per_s"] = iters * static_cast<double>(rec.events) / total;
  state.counters["block_ops_per_s"] = iters * static_cast<double>(rec.block_ops) / total;
}
BENCHMARK(BM_RouterIndexApply)->UseManualTime()->Unit(benchmark::kMillisecond);

void BM_RouterDecideFull(benchmark::State& state) {
  const Recording& rec = recording();
  router::Router r(index_options(), router::ScoringOptions{}, router::make_prefix_aware_policy());
  for (InstanceId i = 0; i < kInstances; ++i)
    r.index().add_instance(i, router::Clock::time_point{});
  for (const Step& step : rec.steps)
    for (const auto& [id, batch] : step.batches)
      r.index().apply(id, batch, router::Clock::time_point{});
  std::vector<TokenId> tokens;
  std::vector<double> lat_us;
  router::Decision d;
  double total = 0;
  for (auto _ : state) {
    double busy = 0;
    for (const Step& step : rec.steps) {
      const sim::TraceRequest& req = rec.trace[step.request];
      sim::sequence_tokens(req, step.request, kTraceBlockTokens, req.input_length, tokens);
      const auto t0 = SteadyClock::now();
      r.decide(router::Request{tokens}, d);
      const double s = seconds(SteadyClock::now() - t0);
      benchmark::DoNotOptimize(d.instance);
      lat_us.push_back(s * 1e6);
      busy += s;
    }
    total += busy;
    state.SetIterationTime(busy);
  }
  add_info(state, rec);
  state.counters["decisions_per_s"] =
      static_cast<double>(state.iterations()) * static_cast<double>(rec.steps.size()) / total;
  state.counters["decision_p50_us"] = percentile(lat_us, 0.50);
  state.counters["decision_p99_us"] = percentile(lat_us, 0.99);
}
BENCHMARK(BM_RouterDecideFull)->UseManualTime()->Unit(benchmark::kMillisecond);

}  // namespace
}  // namespace kvport::bench
