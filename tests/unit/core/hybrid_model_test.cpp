// SPDX-License-Identifier: Apache-2.0
// Property test: random operation streams (requests over shared prompt
// families, decode, forks, releases, evictions) on hybrid caches of every
// group kind, checked after every step against the rules' definitions
// (kvport/testing/hybrid_model.hpp): hits, null entries, blocks held,
// refused appends, invariants. With a HybridHostTier under the groups (the
// fuzzer's hybrid tier mode): every hit's bytes, the hit and tier counters,
// the tiers' invariants, with and without armed copy faults.
#include <gtest/gtest.h>

#include <memory>
#include <optional>
#include <random>
#include <string>

#include "core_test_util.hpp"
#include "kvport/core/hybrid_host_tier.hpp"
#include "kvport/platform/fault_injecting_backend.hpp"
#include "kvport/testing/hybrid_model.hpp"

namespace kvport {
namespace {

using kvport::testing::HybridDriver;
using kvport::testing::HybridOp;
using kvport::testing::HybridOpKind;

struct Scenario {
  std::uint32_t seed;
  std::size_t block_size;
  std::size_t checkpoint_interval;
  std::vector<LayerSpec> layers;
};

class HybridModelProperty : public ::testing::TestWithParam<Scenario> {};

TEST_P(HybridModelProperty, RandomOperationStreamsKeepEveryRule) {
  const Scenario& s = GetParam();
  std::unique_ptr<Backend> backend = test::host_backend();
  Stream stream = backend->create_stream();
  HybridKvCacheConfig c;
  c.block_size = s.block_size;
  c.state_checkpoint_interval = s.checkpoint_interval;
  c.layers = s.layers;
  std::mt19937 rng(s.seed);
  std::vector<std::size_t> counts;
  for (std::size_t g = 0; g < group_layers(c.layers, c.block_size).size(); ++g)
    counts.push_back(6 + rng() % 20);
  HybridKvCache cache(c, counts, *backend);
  const std::discrete_distribution<int> pick({6, 6, 1, 3, 1, 3});
  {
    HybridDriver driver(cache, stream);
    for (int step = 0; step < 3000; ++step) {
      std::discrete_distribution<int> d = pick;
      const HybridOp op{static_cast<HybridOpKind>(d(rng)), static_cast<std::uint32_t>(rng()),
                        static_cast<std::uint32_t>(rng())};
      const std::string diff = driver.apply(op);
      ASSERT_EQ(diff, "") << "seed " << s.seed << " step " << step;
    }
    EXPECT_GT(driver.hits(), 50u) << "the stream must exercise hits";
    EXPECT_GT(driver.refused_appends(), 0u) << "and exhaustion";
    EXPECT_GT(driver.speculative_steps(), 50u) << "and speculative steps";
    EXPECT_GT(driver.committed_drafts(), 0u);
    driver.release_all();
    cache.synchronize();
  }
  for (std::size_t g = 0; g < cache.num_groups(); ++g)
    EXPECT_EQ(cache.blocks_in_use(g), 0u) << "group " << g;
  EXPECT_TRUE(cache.check_invariants().ok);
}

LayerSpec state_spec() {
  return LayerSpec::recurrent_state({StateTensor{"s", {3}, StateDtype::f32}});
}

INSTANTIATE_TEST_SUITE_P(
    Models, HybridModelProperty,
    ::testing::Values(
        Scenario{
            1, 4, 1, {LayerSpec::sliding_window(6, 1, 8, 8), LayerSpec::full_attention(1, 8, 8)}},
        Scenario{2,
                 2,
                 1,
                 {LayerSpec::chunked_local(4, 1, 8, 8), LayerSpec::full_attention(1, 8, 8),
                  LayerSpec::no_kv()}},
        Scenario{3, 4, 1, {state_spec(), state_spec(), LayerSpec::full_attention(1, 8, 8)}},
        Scenario{4, 3, 2, {LayerSpec::mla(8, 4), state_spec()}},
        Scenario{5,
                 1,
                 3,
                 {LayerSpec::sliding_window(3, 1, 8, 8), LayerSpec::chunked_local(2, 1, 8, 8),
                  state_spec(), LayerSpec::mla(4, 4)}},
        Scenario{6, 4, 1, {LayerSpec::sliding_window(9, 2, 8, 8)}}));

// ---- with a host tier under every group ----

struct TierScenario {
  std::uint32_t seed;
  std::size_t block_size;
  std::size_t checkpoint_interval;
  std::vector<LayerSpec> layers;
  std::vector<std::size_t> host_slots;
  TierPolicy policy = TierPolicy::write_back;
  TierInclusion inclusion = TierInclusion::exclusive;
  std::size_t free_watermark = 0;
};

// A hybrid cache (small pools) and its tier over `backend`, torn down in order.
struct TierWorld {
  TierWorld(const TierScenario& s, Backend& backend) : stream(backend.create_stream()) {
    HybridKvCacheConfig c;
    c.block_size = s.block_size;
    c.state_checkpoint_interval = s.checkpoint_interval;
    c.layers = s.layers;
    const std::size_t ng = group_layers(c.layers, c.block_size).size();
    cache.emplace(c, std::vector<std::size_t>(ng, 8), backend);
    HybridHostTierOptions o;
    o.slots_per_group = s.host_slots;
    o.policy = s.policy;
    o.inclusion = s.inclusion;
    o.free_watermark = s.free_watermark;
    o.offload_batch = 2;
    tier.emplace(*cache, o, stream);
  }
  ~TierWorld() {
    tier.reset();
    cache.reset();
  }
  Stream stream;
  std::optional<HybridKvCache> cache;
  std::optional<HybridHostTier> tier;
};

// start, decode, fork, release, evict, speculate, offload, poll, synchronize
// (, fault)
HybridOp draw(std::mt19937& rng, bool faults) {
  std::discrete_distribution<int> d({6, 6, 1, 3, 1, 2, 1, 2, 1, faults ? 1.0 : 0.0});
  return HybridOp{static_cast<HybridOpKind>(d(rng)), static_cast<std::uint32_t>(rng()),
                  static_cast<std::uint32_t>(rng())};
}

// After release_all: nothing held once the last copies completed.
void expect_nothing_held(TierWorld& w) {
  w.tier->poll();
  w.tier->synchronize();
  for (std::size_t g = 0; g < w.cache->num_groups(); ++g)
    EXPECT_EQ(w.cache->blocks_in_use(g), 0u) << "group " << g;
  EXPECT_TRUE(w.tier->check_invariants().ok) << w.tier->check_invariants().to_string();
}

class HybridTierDriver : public ::testing::TestWithParam<TierScenario> {};

// Random streams over tiered groups, checked after every step: hits come
// from the host with the bytes computed for them, and agree with the rules.
TEST_P(HybridTierDriver, HitsFromTheHostHoldTheirBytes) {
  const TierScenario& s = GetParam();
  std::unique_ptr<Backend> backend = test::host_backend();
  TierWorld w(s, *backend);
  std::mt19937 rng(s.seed);
  HybridDriver driver(*w.cache, w.stream, &*w.tier);
  for (int step = 0; step < 1500; ++step) {
    const HybridOp op = draw(rng, false);
    ASSERT_EQ(driver.apply(op), "") << "seed " << s.seed << " step " << step;
  }
  EXPECT_GT(driver.host_hits(), 5u) << "the stream must hit on the host";
  EXPECT_GT(driver.checked_blocks(), 50u);
  EXPECT_GT(w.cache->hit_counters().lower_tier_blocks, 0u);
  driver.release_all();
  expect_nothing_held(w);
}

// Copies (at the call or deferred) and synchronizes failing inside the
// driver's cache calls: no hit with a wrong byte, invariants right after each
// fault, nothing leaked (device blocks, pinned memory, stream errors).
TEST_P(HybridTierDriver, ArmedFaultsFailClosed) {
  const TierScenario& s = GetParam();
  test::QuietLog quiet;  // rollbacks log errors
  std::uint64_t injected = 0;
  std::uint64_t stopped = 0;
  std::size_t host_hits = 0;
  // A deferred fault on the compute stream ends a stream of operations: a
  // new cache and tier for the next one.
  for (std::uint32_t round = 0; round < 40 && injected < 40; ++round) {
    FaultInjectingBackend fb(test::host_backend());
    {
      TierWorld w(s, fb);
      std::mt19937 rng(s.seed * 1000 + round);
      HybridDriver driver(*w.cache, w.stream, &*w.tier, &fb);
      driver.set_full_check_every(16);  // as the fuzzer runs it
      for (int step = 0; step < 1500 && !driver.stopped(); ++step) {
        const HybridOp op = draw(rng, true);
        ASSERT_EQ(driver.apply(op), "")
            << "seed " << s.seed << " round " << round << " step " << step;
      }
      ASSERT_EQ(driver.check(), "");
      injected += driver.faults_injected();
      stopped += driver.stopped() ? 1 : 0;
      host_hits += driver.host_hits();
      driver.release_all();
      expect_nothing_held(w);
      EXPECT_NO_THROW(fb.synchronize(w.stream));
    }
    EXPECT_EQ(fb.live_allocations(), 0u);
  }
  EXPECT_GE(injected, 40u);
  EXPECT_GT(injected, stopped) << "most faults must leave the stream going";
  EXPECT_GT(host_hits, 0u);
}

LayerSpec tier_state_spec() {
  return LayerSpec::recurrent_state({StateTensor{"s", {4}, StateDtype::f32}});
}

INSTANTIATE_TEST_SUITE_P(
    Settings, HybridTierDriver,
    ::testing::Values(TierScenario{11,
                                   4,
                                   1,
                                   {LayerSpec::full_attention(1, 8, 8),
                                    LayerSpec::sliding_window(8, 1, 8, 8), tier_state_spec()},
                                   {12, 12, 12}},
                      TierScenario{12,
                                   2,
                                   2,
                                   {LayerSpec::mla(8, 4), LayerSpec::chunked_local(4, 1, 8, 8),
                                    tier_state_spec()},
                                   {8, 8, 4},
                                   TierPolicy::write_through,
                                   TierInclusion::inclusive,
                                   1},
                      TierScenario{13,
                                   3,
                                   1,
                                   {LayerSpec::full_attention(2, 8, 8),
                                    LayerSpec::sliding_window(4, 1, 8, 8)},
                                   {16, 0},
                                   TierPolicy::write_back,
                                   TierInclusion::inclusive,
                                   2}));

// The byte check is not vacuous: blocks whose bytes were overwritten behind
// the driver's back are reported at the first hit on them.
TEST(HybridTierDriverChecks, AHitOnOverwrittenBytesIsReported) {
  std::unique_ptr<Backend> backend = test::host_backend();
  const TierScenario s{14,
                       4,
                       1,
                       {LayerSpec::full_attention(1, 8, 8), LayerSpec::sliding_window(8, 1, 8, 8)},
                       {12, 12}};
  TierWorld w(s, *backend);
  HybridDriver driver(*w.cache, w.stream, &*w.tier);
  // Every family twice (cached), then every cached device block overwritten.
  for (std::uint32_t f = 0; f < 8; ++f) {
    ASSERT_EQ(driver.apply({HybridOpKind::start, f % 4, 0}), "");
    ASSERT_EQ(driver.apply({HybridOpKind::release, 0, 0}), "");
  }
  std::size_t overwritten = 0;
  for (std::size_t g = 0; g < w.cache->num_groups(); ++g) {
    PagedKvCache& pool = w.cache->group_cache(g);
    for (BlockId b : w.cache->prefix_cache(g).lru_order()) {
      for (std::size_t layer = 0; layer < pool.num_layers(); ++layer)
        pool.write_block(layer, b, std::vector<std::uint8_t>(pool.k_block_bytes(layer), 0x42),
                         std::vector<std::uint8_t>(pool.v_block_bytes(layer), 0x42), w.stream);
      ++overwritten;
    }
  }
  ASSERT_GT(overwritten, 0u);
  std::string diff;
  for (std::uint32_t f = 0; f < 4 && diff.empty(); ++f)
    diff = driver.apply({HybridOpKind::start, f, 0});
  EXPECT_NE(diff.find("holds wrong bytes"), std::string::npos) << diff;
}

}  // namespace
}  // namespace kvport
