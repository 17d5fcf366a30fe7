// SPDX-License-Identifier: Apache-2.0
// The capacity plan behind `kvport plan` and `kvport demo`.
#include "kvport/cli/capacity_plan.hpp"
#include "kvport/testing/sim_support.hpp"

#include <gtest/gtest.h>

namespace kvport::cli {
namespace {

KvCacheConfig small_config() {
  return kvport::testing::tiny_sim_config();
}

TEST(cli_capacity_plan, CollapsesRunsOfIdenticalLayers) {
  KvCacheConfig c = small_config();
  c.num_layers = 5;
  c.layer_dtypes = {KvCacheDtype::bf16, KvCacheDtype::fp8_e4m3, KvCacheDtype::fp8_e4m3,
                    KvCacheDtype::bf16, KvCacheDtype::bf16};
  const CapacityPlan plan = make_capacity_plan(c, std::size_t{1} << 20);
  const auto ranges = collapse_layers(plan.layers);
  ASSERT_EQ(ranges.size(), 3u);
  EXPECT_EQ(ranges[0].first, 0u);
  EXPECT_EQ(ranges[0].last, 0u);
  EXPECT_EQ(ranges[1].first, 1u);
  EXPECT_EQ(ranges[1].last, 2u);
  EXPECT_EQ(ranges[1].bytes.dtype, KvCacheDtype::fp8_e4m3);
  EXPECT_EQ(ranges[2].count(), 2u);
  EXPECT_EQ(plan.bytes_per_block, c.bytes_per_block());
  EXPECT_EQ(plan.num_blocks, (std::size_t{1} << 20) / c.bytes_per_block());
}

}  // namespace
}  // namespace kvport::cli
