// SPDX-License-Identifier: Apache-2.0
// Property test of the two tiers: random request streams (lookups that hit
// the device, onload from the host or miss; allocations that write back;
// releases, offloads, evictions) applied to a PrefixCache + HostTier
// (write-back, exclusive) and to the plain two-LRU reference model of
// kvport/testing/tier_model.hpp, compared after every operation: which hashes
// are on the device and on the host, both LRU orders, the free blocks, every
// lookup's hit (device and host parts), the tier's counters; and every block
// a lookup returns holds the bytes written for its hash. Without the model,
// the tier's other settings (write-through, inclusive, a free watermark,
// polls) run the same streams with the invariants and the byte checks.
// The driver as the fuzzer runs it: full comparisons every 16 operations and
// what each operation touched between them; and over a FaultInjectingBackend
// with armed faults, failing closed.
#include <gtest/gtest.h>

#include <memory>
#include <random>
#include <string>

#include "core_test_util.hpp"
#include "kvport/platform/fault_injecting_backend.hpp"
#include "kvport/testing/tier_model.hpp"

namespace kvport {
namespace {

using kvport::testing::TierDriver;
using kvport::testing::TierOp;
using kvport::testing::TierOpKind;

struct TierScenario {
  std::uint32_t seed;
  std::size_t device_blocks;
  std::size_t host_blocks;
  std::size_t offload_batch;
  KvCacheLayout layout;
  TierPolicy policy = TierPolicy::write_back;
  TierInclusion inclusion = TierInclusion::exclusive;
  std::size_t free_watermark = 0;
};

class TierModelProperty : public ::testing::TestWithParam<TierScenario> {};

TEST_P(TierModelProperty, RandomRequestStreamsMatchTheTwoTierModel) {
  const TierScenario s = GetParam();
  std::unique_ptr<Backend> backend = test::host_backend();
  Stream stream = backend->create_stream();
  PagedKvCache cache(test::small_config(s.layout), s.device_blocks, *backend);
  HostTierOptions o;
  o.num_host_blocks = s.host_blocks;
  o.offload_batch = s.offload_batch;
  o.policy = s.policy;
  o.inclusion = s.inclusion;
  o.free_watermark = s.free_watermark;
  std::mt19937 rng(s.seed);
  // request, lookup, release, offload, evict, poll, synchronize
  std::discrete_distribution<int> pick({10, 2, 8, 2, 1, 2, 1});
  HostTierCounters counters;
  {
    TierDriver driver(cache, stream, o, /*with_model=*/true);
    for (int step = 0; step < 4000; ++step) {
      const TierOp op{static_cast<TierOpKind>(pick(rng)), static_cast<std::uint32_t>(rng()),
                      static_cast<std::uint32_t>(rng())};
      const std::string diff = driver.apply(op);
      ASSERT_EQ(diff, "") << "seed " << s.seed << " step " << step;
    }
    driver.tier().synchronize();
    counters = driver.tier().counters();
    EXPECT_GT(driver.onloaded_blocks(), 100u) << "the stream must onload";
    const bool model = s.policy == TierPolicy::write_back &&
                       s.inclusion == TierInclusion::exclusive && s.free_watermark == 0;
    EXPECT_EQ(driver.with_model(), model);
  }
  EXPECT_GT(counters.offloads, 100u);
  EXPECT_GT(counters.host_evictions, 0u) << "and drop host blocks";
  EXPECT_EQ(cache.num_free_blocks(), s.device_blocks) << "everything released at the end";
  EXPECT_TRUE(cache.check_invariants().ok);
}

INSTANTIATE_TEST_SUITE_P(
    Seeds, TierModelProperty,
    ::testing::Values(TierScenario{1, 14, 6, 1, KvCacheLayout::layer_major},
                      TierScenario{2, 14, 6, 2, KvCacheLayout::block_major},
                      TierScenario{3, 16, 4, 3, KvCacheLayout::layer_major},
                      TierScenario{4, 13, 10, 2, KvCacheLayout::block_major},
                      TierScenario{5, 12, 3, 4, KvCacheLayout::layer_major},
                      // Without the model: invariants and bytes only.
                      TierScenario{6, 14, 6, 2, KvCacheLayout::layer_major,
                                   TierPolicy::write_through},
                      TierScenario{7, 14, 6, 2, KvCacheLayout::block_major, TierPolicy::write_back,
                                   TierInclusion::inclusive},
                      TierScenario{8, 16, 8, 2, KvCacheLayout::layer_major,
                                   TierPolicy::write_through, TierInclusion::inclusive, 3}));

// The fuzzer's setting: a full comparison every 16 operations, what each
// operation touched in between, compare() at the end. A fault operation
// without a FaultInjectingBackend arms nothing.
TEST(TierDriverChecks, TouchedChecksBetweenFullComparisonsAgreeWithTheModel) {
  std::unique_ptr<Backend> backend = test::host_backend();
  Stream stream = backend->create_stream();
  PagedKvCache cache(test::small_config(), 14, *backend);
  HostTierOptions o;
  o.num_host_blocks = 6;
  o.offload_batch = 2;
  std::mt19937 rng(11);
  // request, lookup, release, offload, evict, poll, synchronize, fault
  std::discrete_distribution<int> pick({10, 2, 8, 2, 1, 2, 1, 2});
  {
    TierDriver driver(cache, stream, o, /*with_model=*/true);
    driver.set_full_check_every(16);
    for (int step = 0; step < 4000; ++step) {
      const TierOp op{static_cast<TierOpKind>(pick(rng)), static_cast<std::uint32_t>(rng()),
                      static_cast<std::uint32_t>(rng())};
      ASSERT_EQ(driver.apply(op), "") << "step " << step;
    }
    EXPECT_EQ(driver.compare(), "");
    EXPECT_TRUE(driver.with_model());
    EXPECT_EQ(driver.faults_injected(), 0u);
    EXPECT_GT(driver.onloaded_blocks(), 100u);
  }
  EXPECT_EQ(cache.num_free_blocks(), 14u);
}

struct FaultScenario {
  std::uint32_t seed;
  TierPolicy policy;
  TierInclusion inclusion;
  std::size_t free_watermark;
};

class TierDriverFaults : public ::testing::TestWithParam<FaultScenario> {};

// Armed faults (copies failing at the call or on the stream, synchronizes
// failing) inside the tier's calls: no call throws, the invariants hold after
// every fault, every block a lookup returns holds its hash's bytes, and
// nothing leaks. The model runs until the first fault.
TEST_P(TierDriverFaults, ArmedFaultsInTheTiersCallsFailClosed) {
  const FaultScenario s = GetParam();
  test::QuietLog quiet;  // every rollback logs an error
  FaultInjectingBackend fb(test::host_backend());
  {
    Stream stream = fb.create_stream();
    PagedKvCache cache(test::small_config(), 14, fb);
    HostTierOptions o;
    o.num_host_blocks = 6;
    o.offload_batch = 2;
    o.policy = s.policy;
    o.inclusion = s.inclusion;
    o.free_watermark = s.free_watermark;
    std::mt19937 rng(s.seed);
    std::discrete_distribution<int> pick({10, 2, 8, 2, 1, 2, 1, 3});
    {
      TierDriver driver(cache, stream, o, /*with_model=*/true, &fb);
      driver.set_full_check_every(16);
      for (int step = 0; step < 3000; ++step) {
        const TierOp op{static_cast<TierOpKind>(pick(rng)), static_cast<std::uint32_t>(rng()),
                        static_cast<std::uint32_t>(rng())};
        ASSERT_EQ(driver.apply(op), "") << "seed " << s.seed << " step " << step;
      }
      EXPECT_EQ(driver.compare(), "");
      EXPECT_GT(driver.faults_injected(), 20u);
      EXPECT_FALSE(driver.with_model()) << "dropped at the first fault";
      EXPECT_GT(driver.onloaded_blocks(), 0u);
      EXPECT_GT(driver.tier().counters().aborted_transfers, 0u);
    }
    EXPECT_EQ(cache.num_free_blocks(), 14u);
    EXPECT_TRUE(cache.check_invariants().ok);
    EXPECT_FALSE(fb.plan(FaultKind::copy).has_value()) << "no plan outlives the driver";
  }
  EXPECT_EQ(fb.live_allocations(), 0u);
  const CallCounts inner = fb.inner().call_counts();
  EXPECT_EQ(inner.host_alloc, inner.host_free) << "pinned host memory leaked";
}

INSTANTIATE_TEST_SUITE_P(
    Settings, TierDriverFaults,
    ::testing::Values(FaultScenario{21, TierPolicy::write_back, TierInclusion::exclusive, 0},
                      FaultScenario{22, TierPolicy::write_through, TierInclusion::exclusive, 0},
                      FaultScenario{23, TierPolicy::write_back, TierInclusion::inclusive, 2},
                      FaultScenario{24, TierPolicy::write_through, TierInclusion::inclusive, 3}));

// A lookup_hashes span that names one host block twice (PrefixCache itself
// accepts it: a device block named twice is returned twice, with a reference
// each) once collected the same slot twice as a hit; the exclusive onload then
// freed it twice (5 free slots listed for 4), the next two write-backs shared
// that slot and a lookup of the first returned the second's bytes. The host
// hit now ends at the repeated hash.
TEST(TierModelEdge, AHostBlockNamedTwiceInOneLookup) {
  std::unique_ptr<Backend> backend = test::host_backend();
  PagedKvCache cache(test::small_config(), 4, *backend);
  PrefixCache pc(cache);
  HostTierOptions o;
  o.num_host_blocks = 4;
  HostTier tier(pc, o);
  const BlockHash a{11, 12};
  const BlockId b = pc.alloc_block();
  ASSERT_TRUE(pc.insert(a, b));
  pc.release(b);
  ASSERT_EQ(tier.offload(1), 1u);
  tier.synchronize();
  ASSERT_TRUE(tier.is_on_host(a));
  const std::vector<BlockHash> twice{a, a};
  const PrefixMatch m = pc.lookup_hashes(twice);
  const InvariantReport r = tier.check_invariants();
  EXPECT_TRUE(r.ok) << r.to_string();
  EXPECT_EQ(tier.num_free_host_blocks() + tier.num_ready_blocks() + tier.num_filling_blocks(), 4u);
  pc.release_blocks(m.blocks);
  pc.evict(4);
  // The consequence: two blocks written back, then looked up: each must come
  // back with its own bytes.
  Stream stream = backend->create_stream();
  auto fill = [&](BlockId block, std::size_t tag) {
    test::write_pattern_block(cache, block, tag, stream);
  };
  auto holds = [&](BlockId block, std::size_t tag) {  // every layer's K and V
    return test::holds_pattern_block(cache, block, tag, stream);
  };
  const BlockHash x{21, 22};
  const BlockHash y{31, 32};
  const BlockId bx = pc.alloc_block();
  const BlockId by = pc.alloc_block();
  fill(bx, 1);
  fill(by, 2);
  ASSERT_TRUE(pc.insert(x, bx));
  ASSERT_TRUE(pc.insert(y, by));
  pc.release(bx);
  pc.release(by);
  ASSERT_EQ(tier.offload(1), 1u);  // one at a time (in one batch the backend would
  tier.synchronize();              // reject the overlapping host destinations)
  ASSERT_EQ(tier.offload(1), 1u);
  tier.synchronize();
  const InvariantReport after = tier.check_invariants();
  EXPECT_TRUE(after.ok) << after.to_string();
  for (const auto& [hash, tag] : {std::pair{x, std::size_t{1}}, std::pair{y, std::size_t{2}}}) {
    const PrefixMatch back = pc.lookup_hashes({&hash, 1});
    if (back.blocks.size() == 1) {
      EXPECT_TRUE(holds(back.blocks[0], tag)) << "block " << tag << " came back with other bytes";
    }
    pc.release_blocks(back.blocks);
  }
}

}  // namespace
}  // namespace kvport
