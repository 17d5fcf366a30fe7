// SPDX-License-Identifier: Apache-2.0
// block_regions: device regions of block lists (runs coalesced per pool),
// host copy regions of block images, and pool extents, checked by the bytes
// they move on the host backend against read_block / write_block.
#include "kvport/core/block_regions.hpp"

#include <gtest/gtest.h>

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <memory>
#include <vector>

#include "core_test_util.hpp"
#include "kvport/core/host_tier.hpp"
#include "kvport/platform/error.hpp"

namespace kvport {
namespace {

using test::expect_invalid_argument;

constexpr std::size_t kBlocks = 10;

class BlockRegionsTest : public ::testing::TestWithParam<KvCacheLayout> {
 protected:
  bool block_major() const { return GetParam() == KvCacheLayout::block_major; }

  // Every block of every layer, K and V, holds its pattern.
  void write_patterns() {
    for (BlockId b = 0; b < kBlocks; ++b)
      test::write_pattern_block(cache_, b, b, stream_);
  }

  std::unique_ptr<Backend> backend_ = test::host_backend();
  Stream stream_ = backend_->create_stream();
  PagedKvCache cache_{test::mixed_config(GetParam()), kBlocks, *backend_,
                      PagedKvCacheOptions{false}};
};

TEST_P(BlockRegionsTest, RunsOfConsecutiveIdsAreOneRegionPerPool) {
  const BlockId ids[] = {2, 3, 4, 7, 9, 8};  // runs: 2-4, 7, 9, 8
  const std::vector<DeviceRegion> regions = block_regions(cache_, ids);
  const std::span<const BlockPool> pools = cache_.memory_pools();
  ASSERT_EQ(regions.size(), 4 * pools.size());
  for (std::size_t p = 0; p < pools.size(); ++p) {
    const BlockPool& pool = pools[p];
    EXPECT_EQ(regions[4 * p], (DeviceRegion{pool.region(2).ptr, 3 * pool.region_bytes}));
    EXPECT_EQ(regions[4 * p + 1], pool.region(7));
    EXPECT_EQ(regions[4 * p + 2], pool.region(9));
    EXPECT_EQ(regions[4 * p + 3], pool.region(8));
  }
  if (block_major()) {
    EXPECT_EQ(regions[0].bytes, 3 * test::kMixedBytesPerBlock);  // whole blocks
  } else {
    EXPECT_EQ(regions.size(), 4u * 2 * cache_.num_layers());
    EXPECT_EQ(regions[0].ptr, cache_.k_cache_ptr(0, 2));
    EXPECT_EQ(regions[4].ptr, cache_.v_cache_ptr(0, 2));
  }
}

TEST_P(BlockRegionsTest, FillingTheRegionsIsZeroingTheBlocks) {
  write_patterns();
  const BlockId ids[] = {5, 1, 2, 3};
  backend_->fill_async(block_regions(cache_, ids), 0, stream_);
  stream_.synchronize();
  for (BlockId b = 0; b < kBlocks; ++b) {
    const bool zeroed = b == 5 || (b >= 1 && b <= 3);
    for (std::size_t l = 0; l < cache_.num_layers(); ++l) {
      SCOPED_TRACE(::testing::Message() << "block " << b << " layer " << l);
      const PagedKvCache::HostBlock got = cache_.read_block(l, b, stream_);
      EXPECT_EQ(got.k, zeroed ? std::vector<std::uint8_t>(got.k.size(), 0)
                              : test::pattern(got.k.size(), b, l, false));
      EXPECT_EQ(got.v, zeroed ? std::vector<std::uint8_t>(got.v.size(), 0)
                              : test::pattern(got.v.size(), b, l, true));
    }
  }
}

TEST_P(BlockRegionsTest, HostImagesHoldEachLayersKThenV) {
  write_patterns();
  const std::span<const BlockPool> pools = cache_.memory_pools();
  const std::size_t image = block_image_bytes(pools);
  ASSERT_EQ(image, test::kMixedBytesPerBlock);
  const BlockId ids[] = {6, 0, 1};
  const std::size_t stride = image + 16;  // images need not touch
  std::vector<std::byte> host(3 * stride);
  std::vector<HostCopyRegion> regions;
  append_host_copy_regions(pools, ids, host.data(), stride, regions);
  EXPECT_EQ(regions.size(), 3 * pools.size());  // no coalescing across blocks
  backend_->copy_batch_d2h_async(regions, stream_);
  stream_.synchronize();
  for (std::size_t i = 0; i < 3; ++i) {
    const std::byte* at = host.data() + i * stride;
    for (std::size_t l = 0; l < cache_.num_layers(); ++l) {
      SCOPED_TRACE(::testing::Message() << "block " << ids[i] << " layer " << l);
      const std::vector<std::uint8_t> k = test::pattern(test::kMixedK[l], ids[i], l, false);
      const std::vector<std::uint8_t> v = test::pattern(test::kMixedV[l], ids[i], l, true);
      EXPECT_EQ(std::memcmp(at, k.data(), k.size()), 0);
      at += k.size();
      EXPECT_EQ(std::memcmp(at, v.data(), v.size()), 0);
      at += v.size();
    }
  }
  // And back: the images written into other blocks are those blocks' bytes.
  const BlockId targets[] = {4, 5, 9};
  regions.clear();
  append_host_copy_regions(pools, targets, host.data(), stride, regions);
  backend_->copy_batch_h2d_async(regions, stream_);
  stream_.synchronize();
  for (std::size_t i = 0; i < 3; ++i) {
    for (std::size_t l = 0; l < cache_.num_layers(); ++l) {
      const PagedKvCache::HostBlock got = cache_.read_block(l, targets[i], stream_);
      EXPECT_EQ(got.k, test::pattern(test::kMixedK[l], ids[i], l, false));
      EXPECT_EQ(got.v, test::pattern(test::kMixedV[l], ids[i], l, true));
    }
  }
}

TEST_P(BlockRegionsTest, HostTierSlotsAreOneBlocksImage) {
  std::vector<std::byte> slot(HostTier::slot_bytes_for(cache_));
  std::vector<HostCopyRegion> tier, direct;
  HostTier::append_block_regions(cache_, 3, slot.data(), tier);
  const BlockId id = 3;
  append_host_copy_regions(cache_.memory_pools(), {&id, 1}, slot.data(), 0, direct);
  ASSERT_EQ(tier.size(), direct.size());
  for (std::size_t i = 0; i < tier.size(); ++i) {
    EXPECT_EQ(tier[i].device, direct[i].device);
    EXPECT_EQ(tier[i].host, direct[i].host);
    EXPECT_EQ(tier[i].bytes, direct[i].bytes);
  }
}

TEST_P(BlockRegionsTest, ExtentsCoverEveryBlockMerged) {
  const std::vector<DeviceRegion> extents = pool_extents(cache_.memory_pools());
  if (block_major()) {
    ASSERT_EQ(extents.size(), 1u);
    EXPECT_EQ(extents[0], (DeviceRegion{cache_.k_pool_ptr(0), cache_.total_bytes()}));
  } else {
    ASSERT_GE(extents.size(), 1u);
    ASSERT_LE(extents.size(), 2 * cache_.num_layers());
  }
  std::size_t covered = 0;
  for (std::size_t i = 0; i < extents.size(); ++i) {
    covered += extents[i].bytes;
    if (i > 0) {  // sorted, disjoint and not touching
      EXPECT_LT(extents[i - 1].ptr.address() + extents[i - 1].bytes, extents[i].ptr.address());
    }
  }
  EXPECT_EQ(covered, cache_.total_bytes());
  auto inside = [&](DeviceRegion r) {
    for (const DeviceRegion& e : extents) {
      if (r.ptr >= e.ptr && r.ptr.address() + r.bytes <= e.ptr.address() + e.bytes) return true;
    }
    return false;
  };
  for (std::size_t l = 0; l < cache_.num_layers(); ++l) {
    for (KvPart part : kKvParts) {
      EXPECT_TRUE(inside(cache_.pool(l, part).region(0)));
      EXPECT_TRUE(inside(cache_.pool(l, part).region(kBlocks - 1)));
    }
  }
}

TEST_P(BlockRegionsTest, BadIdsThrowBeforeAppending) {
  const BlockId ids[] = {1, 2, kBlocks};
  std::vector<DeviceRegion> regions(1);
  expect_invalid_argument(
      [&] { append_block_regions(cache_.memory_pools(), ids, regions); },
      "append_block_regions: block 10 (entry 2) out of range (num_blocks = 10)");
  EXPECT_EQ(regions.size(), 1u);
  std::vector<HostCopyRegion> host_regions;
  std::vector<std::byte> host(3 * test::kMixedBytesPerBlock);
  expect_invalid_argument(
      [&] {
        append_host_copy_regions(cache_.memory_pools(), ids, host.data(), test::kMixedBytesPerBlock,
                                 host_regions);
      },
      "out of range");
  const BlockId good[] = {1, 2};
  expect_invalid_argument(
      [&] {
        append_host_copy_regions(cache_.memory_pools(), good, host.data(),
                                 test::kMixedBytesPerBlock - 1, host_regions);
      },
      "overlap");
  EXPECT_TRUE(host_regions.empty());
  expect_invalid_argument(
      [&] { HostTier::append_block_regions(cache_, kBlocks, nullptr, host_regions); },
      "out of range");
}

INSTANTIATE_TEST_SUITE_P(Layouts, BlockRegionsTest,
                         ::testing::Values(KvCacheLayout::layer_major, KvCacheLayout::block_major));

// K-only layers (head_dim_v 0): a block's image is each layer's K region.
TEST(BlockRegions, KOnlyBlocksAreTheirKRegions) {
  auto backend = test::host_backend();
  Stream stream = backend->create_stream();
  for (KvCacheLayout layout : {KvCacheLayout::layer_major, KvCacheLayout::block_major}) {
    SCOPED_TRACE(to_string(layout));
    KvCacheConfig config = test::small_config(layout);  // 3 layers, 128-byte K regions
    config.head_dim_v = 0;
    PagedKvCache cache(config, 6, *backend, PagedKvCacheOptions{false});
    for (BlockId b = 0; b < 6; ++b)
      test::write_pattern_block(cache, b, b, stream);
    const BlockId ids[] = {1, 2, 4};
    const std::vector<DeviceRegion> regions = block_regions(cache, ids);
    EXPECT_EQ(regions.size(), layout == KvCacheLayout::block_major ? 2u : 2u * 3);
    EXPECT_EQ(block_image_bytes(cache.memory_pools()), 3u * 128);
    std::vector<std::byte> host(3 * 3 * 128);
    std::vector<HostCopyRegion> copies;
    append_host_copy_regions(cache.memory_pools(), ids, host.data(), 3 * 128, copies);
    backend->copy_batch_d2h_async(copies, stream);
    stream.synchronize();
    for (std::size_t i = 0; i < 3; ++i) {
      for (std::size_t l = 0; l < 3; ++l) {
        const std::vector<std::uint8_t> k = test::pattern(128, ids[i], l, false);
        EXPECT_EQ(std::memcmp(host.data() + (3 * i + l) * 128, k.data(), 128), 0)
            << "block " << ids[i] << " layer " << l;
      }
    }
  }
}

// A pool whose blocks do not touch (stride > region): one region per id.
TEST(BlockRegions, SparsePoolsDoNotCoalesce) {
  const BlockPool sparse{DevicePtr(0x100000), 48, 64, 8, KvCacheDtype::bf16};
  const BlockId ids[] = {1, 2, 3};
  std::vector<DeviceRegion> out;
  append_block_regions({&sparse, 1}, ids, out);
  ASSERT_EQ(out.size(), 3u);
  EXPECT_EQ(out[1], (DeviceRegion{DevicePtr(0x100000 + 2 * 64), 48}));
}

TEST(BlockRegions, ExtentsMergeOverlappingAndTouchingPools) {
  const BlockPool pools[] = {
      {DevicePtr(0x20000), 16, 64, 4, KvCacheDtype::bf16},    // [0x20000, +208)
      {DevicePtr(0x10000), 256, 256, 2, KvCacheDtype::bf16},  // [0x10000, +512): touches next
      {DevicePtr(0x10200), 100, 100, 1, KvCacheDtype::bf16},
      {DevicePtr(0x20010), 16, 64, 4, KvCacheDtype::bf16},  // interleaves the first
  };
  const std::vector<DeviceRegion> extents = pool_extents(pools);
  ASSERT_EQ(extents.size(), 2u);
  EXPECT_EQ(extents[0], (DeviceRegion{DevicePtr(0x10000), 612}));
  EXPECT_EQ(extents[1], (DeviceRegion{DevicePtr(0x20000), 0x10 + 3 * 64 + 16}));
}

}  // namespace
}  // namespace kvport
