// Property test: random operation streams (requests over shared prompt
// families, decode, forks, releases, evictions) on hybrid caches of every
// group kind, checked after every step against the rules' definitions
// (kvport/testing/hybrid_model.hpp): hits, null entries, blocks held,
// refused appends, invariants.
#include <gtest/gtest.h>

#include <random>

#include "core_test_util.hpp"
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
  const std::discrete_distribution<int> pick({6, 6, 1, 3, 1});
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

}  // namespace
}  // namespace kvport
