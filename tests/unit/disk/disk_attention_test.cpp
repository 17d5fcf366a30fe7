// SPDX-License-Identifier: Apache-2.0
// The attention exactness loop (kvport/testing/attention_loop.hpp) with a
// disk tier under every group's host tier: small device pools and fewer
// host slots than the loop's cached blocks, so blocks go device -> host ->
// disk and come back through hits (read from disk into host slots, then
// onloaded) before attention reads them. Every step's attention, through the
// batch view's rows, equals the dense recomputation bit for bit.
#include <gtest/gtest.h>

#include <memory>
#include <string>
#include <vector>

#include "../core/core_test_util.hpp"
#include "disk_test_util.hpp"
#include "kvport/core/hybrid_host_tier.hpp"
#include "kvport/core/hybrid_kv_cache.hpp"
#include "kvport/disk/disk_tier.hpp"
#include "kvport/testing/attention_loop.hpp"

namespace kvport {
namespace {

TEST(DiskAttentionExactness, BlocksBackFromTheDiskAttendExactly) {
  disk::test::TempDir dir;
  std::unique_ptr<Backend> backend = test::host_backend();
  Stream stream = backend->create_stream();
  HybridKvCache cache(testing::attention_model(false), std::vector<std::size_t>{24, 24, 24, 24},
                      *backend);
  HybridHostTierOptions o;
  o.slots_per_group = {6, 6, 6, 6};
  o.offload_batch = 4;
  HybridHostTier tier(cache, o, stream);
  // One store per group, each of that group's slot size.
  std::vector<std::unique_ptr<disk::DiskTier>> stores;
  for (std::size_t g = 0; g < cache.num_groups(); ++g) {
    disk::DiskStoreOptions d;
    d.dir = dir.path() / ("group" + std::to_string(g));
    d.num_slots = 128;
    d.block_bytes = tier.group_tier(g)->slot_bytes();
    d.layout = disk::layout_fields(cache.group_cache(g).config());
    stores.push_back(disk::DiskTier::open(d));
    tier.set_lower_tier(g, stores.back().get());
  }
  testing::AttentionLoopCounts counts;
  const std::string diff = testing::run_attention_loop(cache, stream, 13u, 300, counts, &tier);
  ASSERT_EQ(diff, "");
  const HostTierCounters c = tier.total_counters();
  EXPECT_GT(c.lower_tier_writes, 0u) << "blocks must reach the disk";
  EXPECT_GT(c.lower_tier_hits, 0u) << "and come back from it";
  EXPECT_GT(counts.hits, 10u);
  EXPECT_GT(counts.checked, 500u);
  const InvariantReport r = tier.check_invariants();
  EXPECT_TRUE(r.ok) << r.to_string();
  for (std::size_t g = 0; g < cache.num_groups(); ++g)
    tier.set_lower_tier(g, nullptr);
}

}  // namespace
}  // namespace kvport
