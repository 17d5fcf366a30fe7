// SPDX-License-Identifier: Apache-2.0
// The hybrid replay: a long-context trace over gpt-oss-like groups admits
// about twice the concurrent requests of the same model as all full
// attention with the same memory, every block comes back, and the bad
// options are named.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cstdio>
#include <map>
#include <set>
#include <tuple>
#include <vector>

#include "kvport/backends/host_backend.hpp"
#include "kvport/core/kv_cache_plan.hpp"
#include "kvport/platform/error.hpp"
#include "kvport/sim/model_replay.hpp"

namespace kvport::sim {
namespace {

std::vector<LayerSpec> gpt_oss_120b() {
  std::vector<LayerSpec> layers;
  for (std::size_t i = 0; i < 36; ++i) {
    layers.push_back(i % 2 == 0 ? LayerSpec::sliding_window(128, 8, 64, 64)
                                : LayerSpec::full_attention(8, 64, 64));
  }
  return layers;
}

// 96 long requests (16k-30k tokens) arriving together; every 4th shares a
// 4k-token system prompt (8 trace blocks of 512).
std::vector<TraceRequest> long_context_trace() {
  std::vector<TraceRequest> out;
  std::uint64_t next_hash = 1000;
  for (std::size_t i = 0; i < 96; ++i) {
    TraceRequest r;
    r.timestamp_ms = static_cast<double>(i % 8);
    r.input_length = 16384 + (i * 1543) % 14336;
    r.output_length = 64 + (i * 37) % 192;
    r.line = i + 1;
    const std::size_t blocks = (r.input_length + 511) / 512;
    for (std::size_t b = 0; b < blocks; ++b)
      r.hash_ids.push_back(i % 4 == 0 && b < 8 ? b : next_hash++);
    out.push_back(r);
  }
  return out;
}

TEST(ModelReplay, GptOssAdmitsAboutTwiceTheRequestsOfAllFull) {
  auto backend = make_host_backend(HostBackendOptions{std::size_t{1} << 30});
  const std::vector<TraceRequest> trace = long_context_trace();
  ModelReplayOptions o;
  o.layers = gpt_oss_120b();
  o.budget_bytes = std::size_t{40} << 30;
  o.max_context_tokens = 32768;
  const ReplayResult hybrid = replay_model(trace, o, *backend);
  o.layers = as_all_full_attention(o.layers);
  const ReplayResult full = replay_model(trace, o, *backend);

  std::printf(
      "hybrid: peak running %zu, mean %.1f, hit rate %.3f, peak bytes %zu, preemptions %zu\n"
      "all-full: peak running %zu, mean %.1f, hit rate %.3f, peak bytes %zu, preemptions %zu\n",
      hybrid.peak_running, hybrid.mean_running, hybrid.token_hit_rate(), hybrid.peak_bytes_in_use(),
      hybrid.preemptions, full.peak_running, full.mean_running, full.token_hit_rate(),
      full.peak_bytes_in_use(), full.preemptions);
  EXPECT_EQ(hybrid.completed, trace.size());
  EXPECT_EQ(full.completed, trace.size());
  EXPECT_TRUE(hybrid.invariants.ok) << hybrid.invariants.to_string();
  EXPECT_TRUE(full.invariants.ok) << full.invariants.to_string();
  ASSERT_EQ(hybrid.groups.size(), 2u);
  ASSERT_EQ(full.groups.size(), 1u);
  EXPECT_LE(hybrid.pool_bytes, o.budget_bytes);
  EXPECT_LE(full.pool_bytes, o.budget_bytes);
  EXPECT_GE(static_cast<double>(hybrid.peak_running), 1.8 * static_cast<double>(full.peak_running))
      << "hybrid " << hybrid.peak_running << ", all-full " << full.peak_running;
  EXPECT_GT(hybrid.hit_tokens, 0u);
  EXPECT_GT(full.hit_tokens, 0u);
  // The window group holds a few blocks per running request, never more
  // than its peak (41 blocks with 512-token prefill chunks).
  EXPECT_LE(hybrid.groups[0].peak_blocks_in_use, 41 * hybrid.peak_running);
  // Per request: every one admitted, their hits add up; the same run
  // compared with itself on the requests both admitted is its own rate.
  for (const ReplayResult* r : {&hybrid, &full}) {
    ASSERT_EQ(r->request_hit_tokens.size(), trace.size());
    std::uint64_t sum = 0;
    for (const std::int64_t h : r->request_hit_tokens) {
      ASSERT_GE(h, 0) << "every request was admitted";
      sum += static_cast<std::uint64_t>(h);
    }
    EXPECT_EQ(sum, r->hit_tokens);
  }
  const CommonHitRates common = common_hit_rates(trace, hybrid, full);
  EXPECT_EQ(common.requests, trace.size());
  EXPECT_DOUBLE_EQ(common.a, hybrid.token_hit_rate());
  EXPECT_DOUBLE_EQ(common.b, full.token_hit_rate());
}

TEST(ModelReplay, CommonHitRatesCountOnlyTheRequestsBothAdmitted) {
  // Request 1 rejected by a, request 2 by b: only request 0 counts.
  const std::vector<TraceRequest> trace = long_context_trace();
  const std::vector<TraceRequest> three(trace.begin(), trace.begin() + 3);
  ReplayResult a, b;
  a.request_hit_tokens = {1024, -1, 4096};
  b.request_hit_tokens = {512, 2048, -1};
  const CommonHitRates c = common_hit_rates(three, a, b);
  EXPECT_EQ(c.requests, 1u);
  EXPECT_EQ(c.prompt_tokens, three[0].input_length);
  EXPECT_DOUBLE_EQ(c.a, 1024.0 / static_cast<double>(three[0].input_length));
  EXPECT_DOUBLE_EQ(c.b, 512.0 / static_cast<double>(three[0].input_length));
  b.request_hit_tokens.pop_back();
  EXPECT_THAT([&] { (void)common_hit_rates(three, a, b); },
              testing::ThrowsMessage<InvalidArgument>(testing::HasSubstr("3 requests")));
}

TEST(ModelReplay, AnAdmissionThatDoesNotFitComputesNothingAndIsNoHit) {
  // Long requests that share nothing, all at once, in memory that holds a
  // few: every hit would be a request's own work from a try that did not
  // fit (its chunks cached, then found by its retry), which is not a hit.
  auto backend = make_host_backend(HostBackendOptions{std::size_t{1} << 30});
  std::vector<TraceRequest> trace = long_context_trace();
  std::uint64_t next_hash = 1u << 20;
  for (TraceRequest& r : trace) {
    for (std::uint64_t& h : r.hash_ids)
      h = next_hash++;
  }
  ModelReplayOptions o;
  o.layers = gpt_oss_120b();
  o.budget_bytes = std::size_t{8} << 30;
  for (bool all_full : {false, true}) {
    if (all_full) o.layers = as_all_full_attention(o.layers);
    const ReplayResult r = replay_model(trace, o, *backend);
    EXPECT_EQ(r.completed, trace.size()) << "all_full " << all_full;
    EXPECT_EQ(r.hit_tokens, 0u) << "all_full " << all_full;
    EXPECT_LT(r.peak_running, trace.size()) << "memory binds";
    EXPECT_TRUE(r.invariants.ok) << r.invariants.to_string();
  }
}

// Request A, then enough unrelated requests to push A out of the device in
// every group, then A's next turn: one at a time (arrivals far apart).
std::vector<TraceRequest> return_after_churn_trace() {
  std::vector<TraceRequest> out;
  auto add = [&](std::vector<std::uint64_t> ids, std::size_t input) {
    TraceRequest r;
    r.timestamp_ms = 100000.0 * static_cast<double>(out.size());
    r.input_length = input;
    r.output_length = 16;
    r.line = out.size() + 1;
    r.hash_ids = std::move(ids);
    out.push_back(r);
  };
  std::vector<std::uint64_t> a;
  for (std::uint64_t b = 0; b < 16; ++b)
    a.push_back(b);
  add(a, 16 * 512);
  for (std::uint64_t k = 1; k <= 12; ++k) {
    std::vector<std::uint64_t> other;
    for (std::uint64_t b = 0; b < 16; ++b)
      other.push_back(1000 * k + b);
    add(other, 16 * 512);
  }
  a.push_back(99);
  add(a, 17 * 512);
  return out;
}

std::vector<LayerSpec> mamba_hybrid() {
  std::vector<LayerSpec> layers;
  for (std::size_t i = 0; i < 8; ++i) {
    layers.push_back(i % 4 == 3 ? LayerSpec::full_attention(8, 128, 128)
                                : LayerSpec::recurrent_state(
                                      {StateTensor{"conv", {4096, 3}, StateDtype::bf16},
                                       StateTensor{"ssm", {64, 64, 128}, StateDtype::f32}}));
  }
  return layers;
}

TEST(ModelReplay, AHostTierBringsEveryGroupBack) {
  auto backend = make_host_backend(HostBackendOptions{std::size_t{1} << 30});
  const std::vector<TraceRequest> trace = return_after_churn_trace();
  for (const bool mamba : {false, true}) {
    SCOPED_TRACE(mamba ? "mamba hybrid" : "gpt-oss");
    ModelReplayOptions o;
    o.layers = mamba ? mamba_hybrid() : gpt_oss_120b();
    o.max_context_tokens = 17 * 512 + 16;
    o.state_checkpoint_interval = 32;  // every 512 tokens
    // Room for about two requests on the device.
    const KvCachePlan plan = plan_kv_cache(group_layers(o.layers, 16), 16, [&] {
      KvCachePlanRequest want;
      want.budget_bytes = std::size_t{1} << 40;
      want.max_context_tokens = o.max_context_tokens;
      want.step_tokens = 512;
      return want;
    }());
    o.budget_bytes = 2 * plan.peak_bytes_per_request + plan.peak_bytes_per_request / 2;
    const ReplayResult bare = replay_model(trace, o, *backend);
    EXPECT_EQ(bare.hit_tokens, 0u);  // A was evicted from every group
    // Room for A and the churn in every group (the Mamba model's unit is its
    // attention block: its checkpoints take most of the host memory).
    o.host_tier_blocks = (mamba ? 5 : 1) * 16 * 17 * 512 / 16;
    const ReplayResult tiered = replay_model(trace, o, *backend);
    EXPECT_TRUE(tiered.invariants.ok) << tiered.invariants.to_string();
    EXPECT_EQ(tiered.completed, trace.size());
    // A's next turn hits its whole first turn (its last 512-token block is
    // the first one that differs... minus the compute-last-token block).
    EXPECT_GE(tiered.hit_tokens, 15u * 512);
    EXPECT_EQ(tiered.host_hit_tokens, tiered.hit_tokens);
    EXPECT_EQ(tiered.host_tier_blocks, o.host_tier_blocks);
    EXPECT_GT(tiered.host_bytes, 0u);
    for (const GroupUsage& g : tiered.groups) {
      SCOPED_TRACE(g.spec.describe());
      EXPECT_GT(g.host_slots, 0u);
      EXPECT_GT(g.host_hit_blocks, 0u);
      EXPECT_LE(g.host_hit_blocks, g.hit_blocks);
      EXPECT_GT(g.tier_counters.offloads, 0u);
      EXPECT_EQ(g.tier_counters.aborted_transfers, 0u);
    }
  }
}

// Every event a sink receives, by where it came from.
struct SourceRecorder final : CacheEventSink {
  std::map<std::tuple<Medium, std::optional<std::uint32_t>, std::optional<std::string>,
                      std::optional<std::uint32_t>>,
           std::size_t>
      stored_by_source;
  std::size_t removed_events = 0, cleared_events = 0;
  void stored(const EventSource& s, const BlockStoredView&) noexcept override {
    ++stored_by_source[{s.medium, s.group_idx, s.spec_kind, s.sliding_window}];
  }
  void removed(const EventSource&, std::span<const BlockHash>) noexcept override {
    ++removed_events;
  }
  void cleared(const EventSource&) noexcept override { ++cleared_events; }
};

TEST(ModelReplay, EventsNameEveryGroupOnTheDeviceAndTheHost) {
  auto backend = make_host_backend(HostBackendOptions{std::size_t{1} << 30});
  const std::vector<TraceRequest> trace = return_after_churn_trace();
  ModelReplayOptions o;
  o.layers = gpt_oss_120b();
  o.max_context_tokens = 17 * 512 + 16;
  // Room for about two requests on the device: blocks go to the host tier.
  const KvCachePlan plan = plan_kv_cache(group_layers(o.layers, 16), 16, [&] {
    KvCachePlanRequest want;
    want.budget_bytes = std::size_t{1} << 40;
    want.max_context_tokens = o.max_context_tokens;
    want.step_tokens = 512;
    return want;
  }());
  o.budget_bytes = 2 * plan.peak_bytes_per_request + plan.peak_bytes_per_request / 2;
  o.host_tier_blocks = 16 * 17 * 512 / 16;
  const ReplayResult bare = replay_model(trace, o, *backend);
  SourceRecorder sink;
  o.event_sink = &sink;
  const ReplayResult with = replay_model(trace, o, *backend);
  EXPECT_EQ(with.hit_tokens, bare.hit_tokens);
  EXPECT_EQ(with.completed, bare.completed);
  EXPECT_TRUE(with.invariants.ok) << with.invariants.to_string();
  std::set<std::pair<Medium, std::uint32_t>> seen;
  for (const auto& [source, n] : sink.stored_by_source) {
    const auto& [medium, group, kind, window] = source;
    ASSERT_TRUE(group.has_value());
    ASSERT_TRUE(kind.has_value());
    EXPECT_TRUE(*kind == "sliding_window" || *kind == "full_attention") << *kind;
    EXPECT_EQ(window.has_value(), *kind == "sliding_window");
    if (window) {
      EXPECT_EQ(*window, 128u);
    }
    seen.emplace(medium, *group);
  }
  // Both groups stored on the device and on the host; the cleared events of
  // every cache and tier at the end.
  EXPECT_TRUE(seen.contains({Medium::gpu, 0}));
  EXPECT_TRUE(seen.contains({Medium::gpu, 1}));
  EXPECT_TRUE(seen.contains({Medium::cpu, 0}));
  EXPECT_TRUE(seen.contains({Medium::cpu, 1}));
  EXPECT_GT(with.host_hit_tokens, 0u);
  EXPECT_GT(sink.cleared_events, 0u);
}

TEST(ModelReplay, OptionsAreValidated) {
  auto backend = make_host_backend(HostBackendOptions{std::size_t{1} << 26});
  ModelReplayOptions o;
  EXPECT_THROW(o.validate(), InvalidArgument);
  o.layers = gpt_oss_120b();
  EXPECT_THROW(o.validate(), InvalidArgument);  // no budget
  o.budget_bytes = 1 << 30;
  o.prefill_chunk_tokens = 0;
  EXPECT_THROW(o.validate(), InvalidArgument);
  o.prefill_chunk_tokens = 512;
  EXPECT_NO_THROW(o.validate());
  o.budget_bytes = 1000;  // less than a block of each group
  const std::vector<TraceRequest> trace = long_context_trace();
  EXPECT_THROW((void)replay_model(trace, o, *backend), InvalidArgument);
}

}  // namespace
}  // namespace kvport::sim
