// SPDX-License-Identifier: Apache-2.0
// BlockPool: block regions at base + b * stride, the extent formula and its
// overflow, the parts' names.
#include "kvport/core/block_pool.hpp"

#include <gtest/gtest.h>

#include <cstddef>
#include <limits>

#include "core_test_util.hpp"
#include "kvport/platform/error.hpp"

namespace kvport {
namespace {

using test::expect_invalid_argument;

constexpr std::size_t kMax = std::numeric_limits<std::size_t>::max();

TEST(BlockPool, RegionIsBasePlusBlockTimesStride) {
  const BlockPool pool{DevicePtr(0x10000), 100, 256, 4, KvCacheDtype::fp8_e4m3};
  EXPECT_EQ(pool.region(0), (DeviceRegion{DevicePtr(0x10000), 100}));
  EXPECT_EQ(pool.region(3), (DeviceRegion{DevicePtr(0x10000 + 3 * 256), 100}));
  EXPECT_EQ(pool.extent(), 3u * 256 + 100);
  EXPECT_FALSE(pool.dense());
  EXPECT_EQ(pool.geometry(), (PoolGeometry{DevicePtr(0x10000), 100, 256}));
}

TEST(BlockPool, DensePoolExtentIsAllBlocks) {
  const BlockPool pool{DevicePtr(0x10000), 128, 128, 8, KvCacheDtype::bf16};
  EXPECT_TRUE(pool.dense());
  EXPECT_EQ(pool.extent(), 8u * 128);
  EXPECT_EQ((BlockPool{DevicePtr(0x10000), 128, 128, 0, KvCacheDtype::bf16}.extent()), 0u);
}

TEST(BlockPool, ErrorsNameTheBlockAndTheOverflow) {
  const BlockPool pool{DevicePtr(0x10000), 100, 256, 4, KvCacheDtype::bf16};
  expect_invalid_argument([&] { (void)pool.region(4); }, "block 4 out of range (num_blocks = 4)");
  const BlockPool huge{DevicePtr(0x10000), 1, kMax / 2 + 1, 3, KvCacheDtype::bf16};  // 2 x 2^63
  expect_invalid_argument([&] { (void)huge.extent(); }, "overflow");
  expect_invalid_argument([&] { (void)huge.region(2); }, "overflows");
}

TEST(KvPart, NamesAndOrder) {
  EXPECT_EQ(to_string(KvPart::k), "K");
  EXPECT_EQ(to_string(KvPart::v), "V");
  static_assert(kKvParts[0] == KvPart::k && kKvParts[1] == KvPart::v);
}

}  // namespace
}  // namespace kvport
