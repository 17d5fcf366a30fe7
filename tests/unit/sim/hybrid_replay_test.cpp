// The hybrid replay: a long-context trace over gpt-oss-like groups admits
// about twice the concurrent requests of the same model as all full
// attention with the same memory, every block comes back, and the bad
// options are named.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cstdio>
#include <vector>

#include "kvport/backends/host_backend.hpp"
#include "kvport/platform/error.hpp"
#include "kvport/sim/hybrid_replay.hpp"

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

TEST(HybridReplay, GptOssAdmitsAboutTwiceTheRequestsOfAllFull) {
  auto backend = make_host_backend(HostBackendOptions{std::size_t{1} << 30});
  const std::vector<TraceRequest> trace = long_context_trace();
  HybridReplayOptions o;
  o.layers = gpt_oss_120b();
  o.budget_bytes = std::size_t{40} << 30;
  o.max_context_tokens = 32768;
  const HybridReplayResult hybrid = replay_hybrid(trace, o, *backend);
  o.layers = as_all_full_attention(o.layers);
  const HybridReplayResult full = replay_hybrid(trace, o, *backend);

  std::printf(
      "hybrid: peak running %zu, mean %.1f, hit rate %.3f, peak bytes %zu, preemptions %zu\n"
      "all-full: peak running %zu, mean %.1f, hit rate %.3f, peak bytes %zu, preemptions %zu\n",
      hybrid.peak_running, hybrid.mean_running, hybrid.hit_rate(), hybrid.peak_bytes_in_use(),
      hybrid.preemptions, full.peak_running, full.mean_running, full.hit_rate(),
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
}

TEST(HybridReplay, OptionsAreValidated) {
  auto backend = make_host_backend(HostBackendOptions{std::size_t{1} << 26});
  HybridReplayOptions o;
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
  EXPECT_THROW((void)replay_hybrid(trace, o, *backend), InvalidArgument);
}

}  // namespace
}  // namespace kvport::sim
