// SPDX-License-Identifier: Apache-2.0
// Property test: random operation streams (requests with shared prompts,
// forks, appends, releases, evictions, raw refcount calls, double frees)
// against the plain reference model in kvport/testing/kv_model.hpp, compared
// after every step, with check_invariants() after every step too.
#include <gtest/gtest.h>

#include <random>

#include "core_test_util.hpp"
#include "kvport/testing/kv_model.hpp"

namespace kvport {
namespace {

using kvport::testing::KvDriver;
using kvport::testing::KvOp;
using kvport::testing::KvOpKind;

struct Scenario {
  std::uint32_t seed;
  std::size_t num_blocks;
  KvCacheLayout layout;
};

class KvModelProperty : public ::testing::TestWithParam<Scenario> {};

TEST_P(KvModelProperty, RandomOperationStreamsMatchTheModel) {
  const Scenario s = GetParam();
  std::unique_ptr<Backend> backend = test::host_backend();
  Stream stream = backend->create_stream();
  PagedKvCache cache(test::small_config(s.layout), s.num_blocks, *backend);
  test::QuietLog quiet;  // the stream makes deliberate double frees
  std::mt19937 rng(s.seed);
  // Weighted toward the request lifecycle: lookups, appends and releases.
  const std::discrete_distribution<int> pick({3, 2, 2, 3, 1, 1, 1, 1, 2, 8, 6, 1, 5});
  std::size_t evictions_seen = 0;
  {
    KvDriver driver(cache, stream);
    for (int step = 0; step < 3000; ++step) {
      std::discrete_distribution<int> d = pick;
      const KvOp op{static_cast<KvOpKind>(d(rng)), static_cast<std::uint32_t>(rng()),
                    static_cast<std::uint32_t>(rng())};
      const std::string diff = driver.apply(op);
      ASSERT_EQ(diff, "") << "seed " << s.seed << " step " << step;
    }
    backend->synchronize(stream);  // the queued fills, before the blocks go
    evictions_seen = driver.prefix_cache().counters().evictions;
    const PrefixCacheCounters& c = driver.prefix_cache().counters();
    EXPECT_GT(c.hits, 0u) << "the stream must exercise hits";
    EXPECT_GT(driver.model().copy_on_writes, 0u) << "and copy-on-write";
    EXPECT_GT(driver.model().ignored_double_frees, 0u) << "and double frees";
  }
  EXPECT_GT(evictions_seen, 0u) << "the stream must exercise eviction";
  EXPECT_EQ(cache.num_free_blocks(), s.num_blocks) << "everything released at the end";
  EXPECT_TRUE(cache.check_invariants().ok);
}

INSTANTIATE_TEST_SUITE_P(Seeds, KvModelProperty,
                         ::testing::Values(Scenario{1, 8, KvCacheLayout::layer_major},
                                           Scenario{2, 16, KvCacheLayout::layer_major},
                                           Scenario{3, 32, KvCacheLayout::block_major},
                                           Scenario{4, 12, KvCacheLayout::block_major},
                                           Scenario{5, 24, KvCacheLayout::layer_major}));

}  // namespace
}  // namespace kvport
