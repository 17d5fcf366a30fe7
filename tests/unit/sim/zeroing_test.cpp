// SPDX-License-Identifier: Apache-2.0
// The zeroing benchmarks' regression guard that needs no timing: the backend
// calls each strategy makes per batch, counted by the backend.
#include "kvport/sim/zeroing.hpp"

#include <gtest/gtest.h>

#include <algorithm>
#include <set>

#include "kvport/backends/host_backend.hpp"
#include "kvport/platform/error.hpp"

namespace kvport::sim {
namespace {

class ZeroingCalls : public ::testing::TestWithParam<KvCacheLayout> {};

TEST_P(ZeroingCalls, BatchedIsOneCallReferenceIsTwoPerLayerPerBlockLimitIsOne) {
  auto backend = make_host_backend();
  for (const ZeroingShape& shape : zeroing_shapes()) {
    if (shape.name == "llama-3-70b") continue;  // 80 layers: checked by the sanity run's size
    SCOPED_TRACE(shape.name);
    ZeroingBench bench(*backend, shape, GetParam(), 16);
    const double layers = static_cast<double>(shape.config.num_layers);
    for (IdPattern pattern : {IdPattern::contiguous, IdPattern::scattered}) {
      for (std::size_t batch : {1, 16}) {
        const ZeroingResult r = bench.measure(batch, pattern, 1);
        EXPECT_EQ(r.batched.calls, 1.0);
        EXPECT_EQ(r.limit.calls, 1.0);
        EXPECT_EQ(r.reference.calls, 2.0 * layers * static_cast<double>(batch));
        EXPECT_EQ(r.bytes, batch * shape.config.bytes_per_block());
        EXPECT_EQ(r.block_ids, bench.ids(batch, pattern));
        EXPECT_EQ(r.num_blocks, 32u);
        EXPECT_GT(r.batched_over_limit(), 0.0);
        EXPECT_GT(r.batched_over_reference(), 0.0);
      }
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Layouts, ZeroingCalls,
                         ::testing::Values(KvCacheLayout::layer_major, KvCacheLayout::block_major));

TEST(ZeroingBench, IdPatterns) {
  auto backend = make_host_backend();
  ZeroingBench bench(*backend, zeroing_shapes().front(), KvCacheLayout::layer_major, 8);
  EXPECT_EQ(bench.ids(4, IdPattern::contiguous), (std::vector<BlockId>{0, 1, 2, 3}));
  std::vector<BlockId> scattered = bench.ids(8, IdPattern::scattered);
  std::sort(scattered.begin(), scattered.end());
  for (std::size_t i = 1; i < scattered.size(); ++i)
    EXPECT_GE(scattered[i] - scattered[i - 1], 2u);
  EXPECT_EQ(std::set<BlockId>(scattered.begin(), scattered.end()).size(), 8u);
  EXPECT_THROW(bench.ids(9, IdPattern::scattered), InvalidArgument);
}

TEST(ZeroingBench, EveryStrategyZeroesWhatItClaims) {
  auto backend = make_host_backend();
  ZeroingBench bench(*backend, zeroing_shapes().front(), KvCacheLayout::block_major, 4);
  PagedKvCache& cache = bench.cache();
  const auto ids = bench.ids(4, IdPattern::scattered);
  for (StrategyResult (ZeroingBench::*run)(const std::vector<BlockId>&) :
       {&ZeroingBench::run_reference, &ZeroingBench::run_batched}) {
    cache.poison_blocks(ids, backend->default_stream());
    backend->synchronize(backend->default_stream());
    (bench.*run)(ids);
    for (BlockId id : ids) {
      for (std::size_t layer : {std::size_t{0}, cache.num_layers() - 1}) {
        const auto block = cache.read_block(layer, id, backend->default_stream());
        EXPECT_TRUE(std::all_of(block.k.begin(), block.k.end(), [](auto b) { return b == 0; }));
        EXPECT_TRUE(std::all_of(block.v.begin(), block.v.end(), [](auto b) { return b == 0; }));
      }
    }
  }
}

}  // namespace
}  // namespace kvport::sim
