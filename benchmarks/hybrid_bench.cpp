// SPDX-License-Identifier: Apache-2.0
// KV cache groups on the scheduler's hot path: HybridBlockTable against
// BlockTable in the same run, ns per block (host bookkeeping only; tiny
// blocks, no device work but the copies the tables queue).
//
// Each benchmark runs the baseline (BlockTable over one PrefixCache) and the
// hybrid table on the same workload in alternating phases, so both see the
// same machine load, and reports ns_per_block of each and their ratio:
//  - BM_HybridLookupOneGroup: lookup of a cached 64-block prompt in full mode
//    (PrefixHitMode::full, so neither pays the compute-last-token copy) and
//    release, HybridBlockTable over ONE full-attention group. x_single is
//    the cost of the group machinery on today's models.
//  - BM_HybridLookupGptOss: the same prompt over gpt-oss's two groups (full
//    attention + window 128): the hit also checks and takes the window's 8
//    blocks before the hit point. Target: x_single <= 2.
//  - BM_HybridPrefillOneGroup: a new 64-block prompt (miss, allocate, hash,
//    register, release), one full group, against BlockTable.
//  - BM_HybridDecodeOneGroup: one token per append, one full group, against
//    BlockTable; the tables restart every 8192 tokens.
//  - BM_SpeculativeStep/accept:P: speculative decoding over gpt-oss's groups,
//    k = 4 drafts per step (append_draft), P% of them accepted (commit), the
//    rest dropped (truncate), then the verifier's token (append_tokens): ns
//    per token a step adds against today's decode (one append_tokens per
//    token) on the same groups. Target (issue 32): x_decode <= 2.
//  - BM_BatchRowsRebuild/seqs:N: the host builders of batch_view.hpp for a
//    decode step of N sequences of 32k tokens (one full-attention group,
//    16-token blocks): vLLM rows (N x 2048 int32) and slot mapping rebuilt
//    whole, against a memcpy of the same bytes (the floor of any
//    whole-row approach) in the same run. The baseline for issue 32's
//    device-resident rows updated by diffs.
#include <benchmark/benchmark.h>

#include <chrono>
#include <cstring>
#include <memory>
#include <numeric>
#include <vector>

#include "kvport/backends/host_backend.hpp"
#include "kvport/core/batch_view.hpp"
#include "kvport/core/block_table.hpp"
#include "kvport/core/hybrid_block_table.hpp"
#include "kvport/core/hybrid_kv_cache.hpp"
#include "kvport/core/prefix_cache.hpp"

namespace kvport::bench {
namespace {

constexpr std::size_t kBlocks = 4096;
constexpr std::size_t kBlockTokens = 16;
constexpr std::size_t kPromptTokens = 64 * kBlockTokens;
constexpr int kPhase = 64;  // operations per implementation per iteration

using Clock = std::chrono::steady_clock;

std::vector<TokenId> prompt(std::uint32_t seed) {
  std::vector<TokenId> t(kPromptTokens);
  std::iota(t.begin(), t.end(), seed * 1000003u);
  return t;
}

// 32 layers of one full-attention group, tiny heads (the pools are never
// read: bookkeeping only), as core_ops_bench's fixture.
HybridKvCacheConfig one_group() {
  HybridKvCacheConfig c;
  c.block_size = kBlockTokens;
  c.layers.assign(32, LayerSpec::full_attention(1, 8, 8));
  return c;
}

HybridKvCacheConfig gpt_oss_groups() {
  HybridKvCacheConfig c;
  c.block_size = kBlockTokens;
  for (std::size_t i = 0; i < 36; ++i) {
    c.layers.push_back(i % 2 == 0 ? LayerSpec::sliding_window(128, 1, 8, 8)
                                  : LayerSpec::full_attention(1, 8, 8));
  }
  return c;
}

struct Baseline {
  std::unique_ptr<Backend> backend = make_host_backend();
  PagedKvCache cache{
      group_pool_config(group_layers(one_group().layers, kBlockTokens)[0], kBlockTokens), kBlocks,
      *backend};
  PrefixCache prefix{cache};
  Stream stream = backend->create_stream();
};

struct Hybrid {
  std::unique_ptr<Backend> backend = make_host_backend();
  std::vector<std::size_t> counts;
  HybridKvCache cache;
  Stream stream = backend->create_stream();
  explicit Hybrid(const HybridKvCacheConfig& c)
      : counts(group_layers(c.layers, c.block_size).size(), kBlocks), cache(c, counts, *backend) {}
};

void report(benchmark::State& state, Clock::duration base, Clock::duration hybrid,
            double blocks_per_op) {
  const double ops = static_cast<double>(state.iterations()) * kPhase * blocks_per_op;
  const double b = std::chrono::duration<double, std::nano>(base).count() / ops;
  const double h = std::chrono::duration<double, std::nano>(hybrid).count() / ops;
  state.counters["single_ns_per_block"] = b;
  state.counters["hybrid_ns_per_block"] = h;
  state.counters["x_single"] = h / b;
}

void lookup_benchmark(benchmark::State& state, const HybridKvCacheConfig& config) {
  Baseline base;
  Hybrid hyb(config);
  const std::vector<TokenId> p = prompt(7);
  {
    BlockTable warm(base.prefix);
    warm.append_tokens(p, base.stream);
    HybridBlockTable hwarm(hyb.cache);
    hwarm.append_tokens(p, hyb.stream);
  }
  Clock::duration tb{}, th{};
  for (auto _ : state) {
    auto start = Clock::now();
    for (int i = 0; i < kPhase; ++i) {
      BlockTable t(base.prefix);
      t.set_prefix_hit_mode(PrefixHitMode::full);
      benchmark::DoNotOptimize(t.reuse_cached_prefix(p, base.stream));
    }
    tb += Clock::now() - start;
    start = Clock::now();
    for (int i = 0; i < kPhase; ++i) {
      HybridBlockTable t(hyb.cache);
      t.set_prefix_hit_mode(PrefixHitMode::full);
      benchmark::DoNotOptimize(t.reuse_cached_prefix(p, hyb.stream));
    }
    th += Clock::now() - start;
  }
  if (hyb.cache.hit_counters().hit_tokens == 0) state.SkipWithError("the hybrid lookup missed");
  report(state, tb, th, static_cast<double>(kPromptTokens / kBlockTokens));
}

void BM_HybridLookupOneGroup(benchmark::State& state) {
  lookup_benchmark(state, one_group());
}
BENCHMARK(BM_HybridLookupOneGroup);

void BM_HybridLookupGptOss(benchmark::State& state) {
  lookup_benchmark(state, gpt_oss_groups());
}
BENCHMARK(BM_HybridLookupGptOss);

void BM_HybridPrefillOneGroup(benchmark::State& state) {
  Baseline base;
  Hybrid hyb(one_group());
  std::uint32_t seed = 1;
  Clock::duration tb{}, th{};
  for (auto _ : state) {
    std::vector<std::vector<TokenId>> prompts;
    for (int i = 0; i < kPhase; ++i)
      prompts.push_back(prompt(seed++));
    auto start = Clock::now();
    for (const auto& p : prompts) {
      BlockTable t(base.prefix);
      const std::size_t hit = t.reuse_cached_prefix(p, base.stream);
      t.append_tokens(std::span<const TokenId>(p).subspan(hit), base.stream);
    }
    tb += Clock::now() - start;
    start = Clock::now();
    for (const auto& p : prompts) {
      HybridBlockTable t(hyb.cache);
      const std::size_t hit = t.reuse_cached_prefix(p, hyb.stream);
      t.append_tokens(std::span<const TokenId>(p).subspan(hit), hyb.stream);
    }
    th += Clock::now() - start;
  }
  report(state, tb, th, static_cast<double>(kPromptTokens / kBlockTokens));
}
BENCHMARK(BM_HybridPrefillOneGroup);

void BM_HybridDecodeOneGroup(benchmark::State& state) {
  Baseline base;
  Hybrid hyb(one_group());
  BlockTable bt(base.prefix);
  HybridBlockTable ht(hyb.cache);
  TokenId next_b = 0, next_h = 0;
  Clock::duration tb{}, th{};
  for (auto _ : state) {
    auto start = Clock::now();
    for (int i = 0; i < kPhase; ++i) {
      if (bt.num_tokens() == 8192) bt.release();
      const TokenId token = next_b++;
      bt.append_tokens({&token, 1}, base.stream);
    }
    tb += Clock::now() - start;
    start = Clock::now();
    for (int i = 0; i < kPhase; ++i) {
      if (ht.num_tokens() == 8192) ht.release();
      const TokenId token = next_h++;
      ht.append_tokens({&token, 1}, hyb.stream);
    }
    th += Clock::now() - start;
  }
  // Per token here, not per block.
  report(state, tb, th, 1.0);
}
BENCHMARK(BM_HybridDecodeOneGroup);

void BM_SpeculativeStep(benchmark::State& state) {
  constexpr std::size_t kDrafts = 4;
  const auto accepted = static_cast<std::size_t>(state.range(0)) * kDrafts / 100;
  Hybrid dec(gpt_oss_groups());
  Hybrid spec(gpt_oss_groups());
  HybridBlockTable dt(dec.cache);
  HybridBlockTable st(spec.cache);
  TokenId next_d = 0, next_s = 0;
  std::size_t spec_tokens = 0, decode_tokens = 0;
  std::vector<TokenId> drafts(kDrafts);
  Clock::duration td{}, ts{};
  for (auto _ : state) {
    auto start = Clock::now();
    for (int i = 0; i < kPhase; ++i) {
      if (dt.num_tokens() >= 8192) dt.release();
      const TokenId token = next_d++;
      dt.append_tokens({&token, 1}, dec.stream);
      ++decode_tokens;
    }
    td += Clock::now() - start;
    start = Clock::now();
    for (int i = 0; i < kPhase; ++i) {
      if (st.num_tokens() >= 8192) st.release();
      for (TokenId& d : drafts)
        d = next_s++;
      st.append_draft(drafts, spec.stream);
      st.commit(accepted);
      st.truncate(st.num_committed());
      const TokenId bonus = next_s++;
      st.append_tokens({&bonus, 1}, spec.stream);
      spec_tokens += accepted + 1;
    }
    ts += Clock::now() - start;
  }
  const double d =
      std::chrono::duration<double, std::nano>(td).count() / static_cast<double>(decode_tokens);
  const double s =
      std::chrono::duration<double, std::nano>(ts).count() / static_cast<double>(spec_tokens);
  state.counters["decode_ns_per_token"] = d;
  state.counters["spec_ns_per_token"] = s;
  state.counters["x_decode"] = s / d;
}
BENCHMARK(BM_SpeculativeStep)->ArgName("accept")->Arg(0)->Arg(50)->Arg(100);

void BM_BatchRowsRebuild(benchmark::State& state) {
  const auto seqs = static_cast<std::size_t>(state.range(0));
  constexpr std::size_t kTokens = 32768;
  const std::size_t blocks_per_seq = kTokens / kBlockTokens;
  HybridKvCacheConfig c;
  c.block_size = kBlockTokens;
  c.layers = {LayerSpec::full_attention(1, 8, 8)};
  std::unique_ptr<Backend> backend = make_host_backend();
  HybridKvCache cache(c, std::vector<std::size_t>{seqs * blocks_per_seq + 1}, *backend);
  Stream stream = backend->create_stream();
  std::vector<HybridBlockTable> tables;
  tables.reserve(seqs);
  std::vector<TokenId> t(kTokens - 1);
  for (std::size_t i = 0; i < seqs; ++i) {
    std::iota(t.begin(), t.end(), static_cast<TokenId>(i * kTokens));
    tables.emplace_back(cache);
    tables.back().append_tokens(t, stream);
  }
  std::vector<BatchSequence> batch;
  for (const HybridBlockTable& x : tables)
    batch.push_back({&x, 1});
  const std::size_t width = vllm_row_width(kTokens, kBlockTokens);
  std::vector<std::int32_t> rows(seqs * width);
  std::vector<std::int32_t> copy(rows.size());
  std::vector<std::int64_t> slots(seqs);
  Clock::duration tb{}, tc{};
  for (auto _ : state) {
    auto start = Clock::now();
    build_block_table_rows(batch, 0, KernelBlocks{}, width, rows);
    (void)build_slot_mapping(batch, 0, KernelBlocks{}, slots);
    tb += Clock::now() - start;
    benchmark::DoNotOptimize(rows.data());
    start = Clock::now();
    std::memcpy(copy.data(), rows.data(), rows.size() * sizeof(std::int32_t));
    tc += Clock::now() - start;
    benchmark::DoNotOptimize(copy.data());
  }
  const double n = static_cast<double>(state.iterations());
  const double build_us = std::chrono::duration<double, std::micro>(tb).count() / n;
  const double copy_us = std::chrono::duration<double, std::micro>(tc).count() / n;
  state.counters["rebuild_us_per_step"] = build_us;
  state.counters["memcpy_us"] = copy_us;
  state.counters["x_memcpy"] = build_us / copy_us;
  state.counters["row_bytes"] = static_cast<double>(rows.size() * sizeof(std::int32_t));
}
BENCHMARK(BM_BatchRowsRebuild)->ArgName("seqs")->Arg(64)->Arg(256)->Unit(benchmark::kMicrosecond);

}  // namespace
}  // namespace kvport::bench
