// SPDX-License-Identifier: Apache-2.0
// Staging (transfer/src/staging.hpp): the pinned mirror's block -> mirror map,
// computed once at construction, checked against the cache's pools (every
// block's mirror copy lies where mirror_addresses says peers address it), the
// number of copies a block list costs, and a byte-exact round trip through
// the mirror on the host backend.
#include "staging.hpp"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cstring>

#include "transfer_test_util.hpp"

namespace kvport::transfer {
namespace {

using test::host_backend;

// The mirror address peers use for block b of layer l's `part`.
std::uint64_t wire_address(const PoolAddresses& wire, std::size_t layer, KvPart part, BlockId b) {
  const PoolAddresses::Pool p = wire.at(layer, part);
  return p.base + std::uint64_t{b} * p.stride;
}

class StagingTest : public ::testing::TestWithParam<KvCacheLayout> {};

TEST_P(StagingTest, RegionsLieWherePeersAddressTheMirror) {
  auto backend = host_backend();
  PagedKvCache cache(test::mixed_shape(2, GetParam()), 8, *backend);
  Staging staging(cache);
  const PoolAddresses device = pool_addresses(cache);
  const PoolAddresses wire = staging.mirror_addresses(device);
  const std::uint64_t lo = staging.mirror_base();
  const std::uint64_t hi = lo + staging.mirror_bytes();
  for (std::size_t l = 0; l < cache.num_layers(); ++l) {
    for (KvPart part : kKvParts) {
      const std::uint64_t a = wire_address(wire, l, part, 7);
      EXPECT_GE(a, lo);
      EXPECT_LE(a + cache.pool(l, part).region_bytes, hi);
      EXPECT_EQ(wire.at(l, part).stride, device.at(l, part).stride);
    }
  }
  // Every copy of one block: from its device region to the wire address of
  // the same (layer, part), i.e. device and mirror differ by one offset per pool.
  const std::vector<BlockId> one = {5};
  const std::vector<HostCopyRegion> regions = staging.regions(one);
  ASSERT_EQ(regions.size(), cache.memory_pools().size());
  for (std::size_t i = 0; i < regions.size(); ++i) {
    const BlockPool& pool = cache.memory_pools()[i];
    EXPECT_EQ(regions[i].device.address(), pool.base.address() + 5 * pool.stride);
    EXPECT_EQ(regions[i].bytes, pool.region_bytes);
  }
  EXPECT_EQ(reinterpret_cast<std::uint64_t>(regions[0].host), wire_address(wire, 0, KvPart::k, 5));
}

TEST_P(StagingTest, ARunOfConsecutiveIdsIsOneCopyPerPool) {
  auto backend = host_backend();
  PagedKvCache cache(test::mixed_shape(2, GetParam()), 8, *backend);
  Staging staging(cache);
  const std::size_t pools = cache.memory_pools().size();
  const std::vector<BlockId> runs = {2, 3, 4, 7};  // two runs
  const std::vector<HostCopyRegion> regions = staging.regions(runs);
  ASSERT_EQ(regions.size(), 2 * pools);
  EXPECT_EQ(regions[0].bytes, 3 * cache.memory_pools()[0].region_bytes);
  EXPECT_EQ(regions[1].bytes, cache.memory_pools()[0].region_bytes);
  const std::vector<BlockId> apart = {6, 1, 3};
  EXPECT_EQ(staging.regions(apart).size(), 3 * pools);
  EXPECT_TRUE(staging.regions({}).empty());
}

TEST_P(StagingTest, RoundTripsEveryByteThroughTheMirror) {
  auto backend = host_backend();
  PagedKvCache cache(test::mixed_shape(2, GetParam()), 6, *backend);
  Staging staging(cache);
  const std::vector<BlockId> blocks = {0, 1, 4};
  std::vector<std::vector<std::uint8_t>> want;
  for (const HostCopyRegion& r : staging.regions(blocks)) {
    std::vector<std::uint8_t> bytes(r.bytes);
    for (std::size_t i = 0; i < bytes.size(); ++i)
      bytes[i] = static_cast<std::uint8_t>(i * 7 + r.device.address());
    std::memcpy(r.device.get(), bytes.data(), bytes.size());
    want.push_back(std::move(bytes));
  }
  const std::vector<HostCopyRegion> regions = staging.regions(blocks);
  staging.to_mirror(regions);
  for (std::size_t i = 0; i < regions.size(); ++i) {
    EXPECT_EQ(std::memcmp(regions[i].host, want[i].data(), want[i].size()), 0) << i;
    std::memset(regions[i].device.get(), 0, regions[i].bytes);
  }
  staging.from_mirror(regions);
  for (std::size_t i = 0; i < regions.size(); ++i)
    EXPECT_EQ(std::memcmp(regions[i].device.get(), want[i].data(), want[i].size()), 0) << i;
}

INSTANTIATE_TEST_SUITE_P(Layouts, StagingTest,
                         ::testing::Values(KvCacheLayout::layer_major, KvCacheLayout::block_major));

TEST(StagingKOnlyTest, KOnlyLayersLeaveTheVEntriesZero) {
  auto backend = host_backend();
  KvCacheConfig c = test::shape(1);
  c.head_dim_v = 0;
  PagedKvCache cache(c, 4, *backend);
  Staging staging(cache);
  const PoolAddresses wire = staging.mirror_addresses(pool_addresses(cache));
  for (std::size_t l = 0; l < cache.num_layers(); ++l) {
    EXPECT_EQ(wire.v_base[l], 0u);
    EXPECT_GE(wire.k_base[l], staging.mirror_base());
  }
  EXPECT_EQ(staging.regions(std::vector<BlockId>{1}).size(), cache.num_layers());
}

}  // namespace
}  // namespace kvport::transfer
