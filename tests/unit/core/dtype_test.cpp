// SPDX-License-Identifier: Apache-2.0
// Byte formulas of every KV-cache dtype. Expected values are worked out by hand
// from the table in dtype.hpp:
//
//   [ data | pad to 16 | scales | pad to 16 ],  E = block_size * heads * head_dim
//   f16/bf16: data 2E; fp8: E; nvfp4: E/2 + E/16 scales; turboN: E*N/8 + 2*block_size*heads.
#include "kvport/core/dtype.hpp"

#include <gtest/gtest.h>

#include <cstddef>
#include <limits>
#include <set>
#include <string>
#include <vector>

#include "core_test_util.hpp"
#include "kvport/platform/error.hpp"

namespace kvport {
namespace {

using test::expect_invalid_argument;

struct LayoutCase {
  KvCacheDtype dtype;
  std::size_t block_size, heads, head_dim;
  BlockRegionLayout expected;  // data, data_pad, scale_offset, scales, scale_pad, total
};

void PrintTo(const LayoutCase& c, std::ostream* os) {
  *os << to_string(c.dtype) << " bs=" << c.block_size << " heads=" << c.heads
      << " hd=" << c.head_dim;
}

class BlockRegionLayoutTest : public ::testing::TestWithParam<LayoutCase> {};

TEST_P(BlockRegionLayoutTest, MatchesHandComputedLayout) {
  const LayoutCase& c = GetParam();
  const BlockRegionLayout got = block_region_layout(c.dtype, c.block_size, c.heads, c.head_dim);
  EXPECT_EQ(got.data_bytes, c.expected.data_bytes);
  EXPECT_EQ(got.data_padding, c.expected.data_padding);
  EXPECT_EQ(got.scale_offset, c.expected.scale_offset);
  EXPECT_EQ(got.scale_bytes, c.expected.scale_bytes);
  EXPECT_EQ(got.scale_padding, c.expected.scale_padding);
  EXPECT_EQ(got.total_bytes, c.expected.total_bytes);
  EXPECT_EQ(got, c.expected);
}

// llama-3-8b: block 16, 8 heads, head_dim 128 -> E = 16 * 8 * 128 = 16384 elements,
// 16 * 8 = 128 token-head vectors -> turbo scales 2 * 128 = 256 bytes.
INSTANTIATE_TEST_SUITE_P(
    Llama3Shape, BlockRegionLayoutTest,
    ::testing::Values(
        // 2E = 32768
        LayoutCase{KvCacheDtype::f16, 16, 8, 128, {32768, 0, 32768, 0, 0, 32768}},
        LayoutCase{KvCacheDtype::bf16, 16, 8, 128, {32768, 0, 32768, 0, 0, 32768}},
        // E = 16384
        LayoutCase{KvCacheDtype::fp8_e4m3, 16, 8, 128, {16384, 0, 16384, 0, 0, 16384}},
        LayoutCase{KvCacheDtype::fp8_e5m2, 16, 8, 128, {16384, 0, 16384, 0, 0, 16384}},
        // E/2 = 8192 data, E/16 = 1024 scales -> 9216
        LayoutCase{KvCacheDtype::nvfp4, 16, 8, 128, {8192, 0, 8192, 1024, 0, 9216}},
        // E*2/8 = 4096 + 256 = 4352
        LayoutCase{KvCacheDtype::turbo2, 16, 8, 128, {4096, 0, 4096, 256, 0, 4352}},
        // E*3/8 = 6144 + 256 = 6400
        LayoutCase{KvCacheDtype::turbo3, 16, 8, 128, {6144, 0, 6144, 256, 0, 6400}},
        // E*4/8 = 8192 + 256 = 8448
        LayoutCase{KvCacheDtype::turbo4, 16, 8, 128, {8192, 0, 8192, 256, 0, 8448}},
        // E = 16384 + 256 = 16640
        LayoutCase{KvCacheDtype::turbo8, 16, 8, 128, {16384, 0, 16384, 256, 0, 16640}}));

// Tiny shapes where both paddings matter.
INSTANTIATE_TEST_SUITE_P(
    Padding, BlockRegionLayoutTest,
    ::testing::Values(
        // bs 1, heads 1, hd 8: E = 8, one vector -> turbo scales 2 bytes (pad 14).
        LayoutCase{KvCacheDtype::f16, 1, 1, 8, {16, 0, 16, 0, 0, 16}},
        LayoutCase{KvCacheDtype::bf16, 1, 1, 4, {8, 8, 16, 0, 0, 16}},
        LayoutCase{KvCacheDtype::fp8_e4m3, 1, 1, 8, {8, 8, 16, 0, 0, 16}},
        LayoutCase{KvCacheDtype::fp8_e5m2, 1, 1, 3, {3, 13, 16, 0, 0, 16}},
        // The rows of docs/formats.md's padding table.
        LayoutCase{KvCacheDtype::fp8_e5m2, 1, 1, 4, {4, 12, 16, 0, 0, 16}},
        LayoutCase{KvCacheDtype::bf16, 1, 1, 8, {16, 0, 16, 0, 0, 16}},
        LayoutCase{KvCacheDtype::turbo2, 1, 1, 8, {2, 14, 16, 2, 14, 32}},
        LayoutCase{KvCacheDtype::turbo3, 1, 1, 8, {3, 13, 16, 2, 14, 32}},
        LayoutCase{KvCacheDtype::turbo4, 1, 1, 8, {4, 12, 16, 2, 14, 32}},
        LayoutCase{KvCacheDtype::turbo8, 1, 1, 8, {8, 8, 16, 2, 14, 32}},
        // nvfp4 needs hd % 16 == 0: E = 16 -> data 8 (pad 8), scales 1 (pad 15).
        LayoutCase{KvCacheDtype::nvfp4, 1, 1, 16, {8, 8, 16, 1, 15, 32}},
        // bs 3, heads 1, hd 16: E = 48, 3 vectors -> turbo scales 6 (pad 10).
        LayoutCase{KvCacheDtype::f16, 3, 1, 16, {96, 0, 96, 0, 0, 96}},
        LayoutCase{KvCacheDtype::fp8_e4m3, 3, 1, 16, {48, 0, 48, 0, 0, 48}},
        // nvfp4: data 24 (pad 8), scales 48/16 = 3 (pad 13) -> 48
        LayoutCase{KvCacheDtype::nvfp4, 3, 1, 16, {24, 8, 32, 3, 13, 48}},
        // turbo2: 48*2/8 = 12 (pad 4) + 6 (pad 10) -> 32
        LayoutCase{KvCacheDtype::turbo2, 3, 1, 16, {12, 4, 16, 6, 10, 32}},
        // turbo3: 48*3/8 = 18 (pad 14) + 6 (pad 10) -> 48
        LayoutCase{KvCacheDtype::turbo3, 3, 1, 16, {18, 14, 32, 6, 10, 48}},
        // turbo4: 24 (pad 8) + 6 (pad 10) -> 48
        LayoutCase{KvCacheDtype::turbo4, 3, 1, 16, {24, 8, 32, 6, 10, 48}},
        // turbo8: 48 (pad 0) + 6 (pad 10) -> 64
        LayoutCase{KvCacheDtype::turbo8, 3, 1, 16, {48, 0, 48, 6, 10, 64}},
        // bs 5, heads 3, hd 24: E = 360, 15 vectors -> turbo scales 30 (pad 2).
        // turbo3: 135 data (pad 9) -> 144 + 30 + 2 = 176
        LayoutCase{KvCacheDtype::turbo3, 5, 3, 24, {135, 9, 144, 30, 2, 176}},
        // f16: 720 (720 % 16 = 0)
        LayoutCase{KvCacheDtype::f16, 5, 3, 24, {720, 0, 720, 0, 0, 720}}));

// Structural properties over a grid of shapes, with the data size computed
// from an independent bits table (not from the library).
TEST(BlockRegionLayout, RegionsAreAlignedAndAddUp) {
  struct Bits {
    KvCacheDtype dtype;
    std::size_t bits;
    enum Scales { none, per16, per_vector } scales;
  };
  const Bits table[] = {
      {KvCacheDtype::f16, 16, Bits::none},         {KvCacheDtype::bf16, 16, Bits::none},
      {KvCacheDtype::fp8_e4m3, 8, Bits::none},     {KvCacheDtype::fp8_e5m2, 8, Bits::none},
      {KvCacheDtype::nvfp4, 4, Bits::per16},       {KvCacheDtype::turbo2, 2, Bits::per_vector},
      {KvCacheDtype::turbo3, 3, Bits::per_vector}, {KvCacheDtype::turbo4, 4, Bits::per_vector},
      {KvCacheDtype::turbo8, 8, Bits::per_vector}};
  for (const Bits& b : table) {
    for (std::size_t bs : {1u, 2u, 7u, 16u}) {
      for (std::size_t heads : {1u, 3u, 8u}) {
        for (std::size_t hd : {16u, 48u, 64u, 128u, 256u}) {
          SCOPED_TRACE(::testing::Message()
                       << to_string(b.dtype) << " " << bs << "x" << heads << "x" << hd);
          const BlockRegionLayout l = block_region_layout(b.dtype, bs, heads, hd);
          const std::size_t elements = bs * heads * hd;
          EXPECT_EQ(l.data_bytes, elements * b.bits / 8);
          EXPECT_EQ(l.scale_offset, l.data_bytes + l.data_padding);
          EXPECT_EQ(l.scale_offset % kRegionAlignment, 0u);
          EXPECT_LT(l.data_padding, kRegionAlignment);
          EXPECT_LT(l.scale_padding, kRegionAlignment);
          EXPECT_EQ(l.total_bytes, l.scale_offset + l.scale_bytes + l.scale_padding);
          EXPECT_EQ(l.total_bytes % kRegionAlignment, 0u);
          switch (b.scales) {
            case Bits::none:
              EXPECT_EQ(l.scale_bytes, 0u);
              break;
            case Bits::per16:
              EXPECT_EQ(l.scale_bytes, elements / 16);
              break;
            case Bits::per_vector:
              EXPECT_EQ(l.scale_bytes, 2 * bs * heads);
              break;
          }
        }
      }
    }
  }
}

TEST(BlockRegionLayout, Nvfp4RequiresHeadDimMultipleOf16) {
  EXPECT_NO_THROW(block_region_layout(KvCacheDtype::nvfp4, 16, 8, 16, "head_dim_k"));
  EXPECT_NO_THROW(block_region_layout(KvCacheDtype::nvfp4, 16, 8, 80, "head_dim_k"));
  for (std::size_t hd : {8u, 24u, 72u, 130u}) {
    SCOPED_TRACE(hd);
    expect_invalid_argument(
        [&] { block_region_layout(KvCacheDtype::nvfp4, 16, 8, hd, "head_dim_k"); }, "head_dim_k");
    expect_invalid_argument(
        [&] { block_region_layout(KvCacheDtype::nvfp4, 16, 8, hd, "head_dim_v"); }, "head_dim_v");
  }
  // The message states the value and the group so the user can fix the config.
  expect_invalid_argument([] { block_region_layout(KvCacheDtype::nvfp4, 16, 8, 24, "head_dim_k"); },
                          "24");
  expect_invalid_argument([] { block_region_layout(KvCacheDtype::nvfp4, 16, 8, 24, "head_dim_k"); },
                          "16");
}

TEST(BlockRegionLayout, PackedGroupsOfTurboDtypes) {
  // turbo3 packs 8 elements into 3 bytes.
  EXPECT_NO_THROW(block_region_layout(KvCacheDtype::turbo3, 1, 1, 8));
  EXPECT_NO_THROW(block_region_layout(KvCacheDtype::turbo3, 1, 1, 136));
  for (std::size_t hd : {1u, 4u, 12u, 20u, 130u}) {
    SCOPED_TRACE(hd);
    expect_invalid_argument(
        [&] { block_region_layout(KvCacheDtype::turbo3, 1, 1, hd, "head_dim_v"); }, "head_dim_v");
  }
  // turbo2: 4 per byte; turbo4: 2 per byte; turbo8 / f16 / fp8: any head_dim.
  expect_invalid_argument([] { block_region_layout(KvCacheDtype::turbo2, 1, 1, 6, "head_dim_k"); },
                          "head_dim_k");
  EXPECT_NO_THROW(block_region_layout(KvCacheDtype::turbo2, 1, 1, 4));
  expect_invalid_argument([] { block_region_layout(KvCacheDtype::turbo4, 1, 1, 3, "head_dim_k"); },
                          "head_dim_k");
  EXPECT_NO_THROW(block_region_layout(KvCacheDtype::turbo4, 1, 1, 2));
  EXPECT_NO_THROW(block_region_layout(KvCacheDtype::turbo8, 1, 1, 3));
  EXPECT_NO_THROW(block_region_layout(KvCacheDtype::f16, 1, 1, 3));
  EXPECT_NO_THROW(block_region_layout(KvCacheDtype::fp8_e4m3, 1, 1, 1));
}

TEST(BlockRegionLayout, ZeroSizesThrowNamingTheField) {
  expect_invalid_argument([] { block_region_layout(KvCacheDtype::bf16, 0, 8, 128); }, "block_size");
  expect_invalid_argument([] { block_region_layout(KvCacheDtype::bf16, 16, 0, 128); },
                          "num_kv_heads");
  expect_invalid_argument([] { block_region_layout(KvCacheDtype::bf16, 16, 8, 0, "head_dim_v"); },
                          "head_dim_v");
}

TEST(BlockRegionLayout, OverflowThrowsInsteadOfWrapping) {
  constexpr std::size_t kMax = std::numeric_limits<std::size_t>::max();
  // block_size * heads overflows.
  expect_invalid_argument(
      [] { block_region_layout(KvCacheDtype::bf16, kMax / 2, 4, 128, "head_dim_k"); }, "overflow");
  // 2^62 * 2 = 2^63 elements fit in size_t, but their 16-bit payload does not.
  expect_invalid_argument(
      [] { block_region_layout(KvCacheDtype::f16, std::size_t{1} << 62, 1, 2, "head_dim_k"); },
      "overflow");
  // A large but representable shape (1 GiB of fp8) does not throw.
  EXPECT_NO_THROW(block_region_layout(KvCacheDtype::fp8_e4m3, std::size_t{1} << 20, 1, 1024));
  // Packed dtypes overflow the same way.
  expect_invalid_argument(
      [] { block_region_layout(KvCacheDtype::turbo2, std::size_t{1} << 63, 1, 4, "head_dim_k"); },
      "overflow");
}

TEST(Dtype, AllDtypesInDeclarationOrder) {
  const std::vector<KvCacheDtype> expected = {
      KvCacheDtype::f16,      KvCacheDtype::bf16,   KvCacheDtype::fp8_e4m3,
      KvCacheDtype::fp8_e5m2, KvCacheDtype::nvfp4,  KvCacheDtype::turbo2,
      KvCacheDtype::turbo3,   KvCacheDtype::turbo4, KvCacheDtype::turbo8};
  const auto all = all_dtypes();
  EXPECT_EQ(std::vector<KvCacheDtype>(all.begin(), all.end()), expected);
}

TEST(Dtype, ToStringNames) {
  EXPECT_EQ(to_string(KvCacheDtype::f16), "f16");
  EXPECT_EQ(to_string(KvCacheDtype::bf16), "bf16");
  EXPECT_EQ(to_string(KvCacheDtype::fp8_e4m3), "fp8_e4m3");
  EXPECT_EQ(to_string(KvCacheDtype::fp8_e5m2), "fp8_e5m2");
  EXPECT_EQ(to_string(KvCacheDtype::nvfp4), "nvfp4");
  EXPECT_EQ(to_string(KvCacheDtype::turbo2), "turbo2");
  EXPECT_EQ(to_string(KvCacheDtype::turbo3), "turbo3");
  EXPECT_EQ(to_string(KvCacheDtype::turbo4), "turbo4");
  EXPECT_EQ(to_string(KvCacheDtype::turbo8), "turbo8");
}

TEST(Dtype, ParseRoundTripsEveryName) {
  std::set<std::string> names;
  for (KvCacheDtype d : all_dtypes()) {
    const std::string_view name = to_string(d);
    names.insert(std::string(name));
    const auto parsed = parse_dtype(name);
    ASSERT_TRUE(parsed.has_value()) << name;
    EXPECT_EQ(*parsed, d) << name;
  }
  EXPECT_EQ(names.size(), all_dtypes().size()) << "names must be unique";
}

TEST(Dtype, ParseAliases) {
  EXPECT_EQ(parse_dtype("fp16"), KvCacheDtype::f16);
  EXPECT_EQ(parse_dtype("float16"), KvCacheDtype::f16);
  EXPECT_EQ(parse_dtype("bfloat16"), KvCacheDtype::bf16);
  EXPECT_EQ(parse_dtype("fp8"), KvCacheDtype::fp8_e4m3);
}

TEST(Dtype, ParseRejectsUnknownNames) {
  for (std::string_view bad : {"", "int8", "fp4", "turbo5", "bf16 ", " f16", "f1", "nvfp4x"}) {
    EXPECT_FALSE(parse_dtype(bad).has_value()) << "'" << bad << "'";
  }
}

TEST(Dtype, BitsGroupsAndScales) {
  EXPECT_EQ(bits_per_element(KvCacheDtype::f16), 16u);
  EXPECT_EQ(bits_per_element(KvCacheDtype::bf16), 16u);
  EXPECT_EQ(bits_per_element(KvCacheDtype::fp8_e4m3), 8u);
  EXPECT_EQ(bits_per_element(KvCacheDtype::fp8_e5m2), 8u);
  EXPECT_EQ(bits_per_element(KvCacheDtype::nvfp4), 4u);
  EXPECT_EQ(bits_per_element(KvCacheDtype::turbo2), 2u);
  EXPECT_EQ(bits_per_element(KvCacheDtype::turbo3), 3u);
  EXPECT_EQ(bits_per_element(KvCacheDtype::turbo4), 4u);
  EXPECT_EQ(bits_per_element(KvCacheDtype::turbo8), 8u);

  // 8 / gcd(8, N) for turboN; 16 for nvfp4 scale groups; 1 otherwise.
  EXPECT_EQ(element_group(KvCacheDtype::f16), 1u);
  EXPECT_EQ(element_group(KvCacheDtype::bf16), 1u);
  EXPECT_EQ(element_group(KvCacheDtype::fp8_e4m3), 1u);
  EXPECT_EQ(element_group(KvCacheDtype::fp8_e5m2), 1u);
  EXPECT_EQ(element_group(KvCacheDtype::nvfp4), 16u);
  EXPECT_EQ(element_group(KvCacheDtype::turbo2), 4u);
  EXPECT_EQ(element_group(KvCacheDtype::turbo3), 8u);
  EXPECT_EQ(element_group(KvCacheDtype::turbo4), 2u);
  EXPECT_EQ(element_group(KvCacheDtype::turbo8), 1u);

  EXPECT_FALSE(has_scales(KvCacheDtype::f16));
  EXPECT_FALSE(has_scales(KvCacheDtype::bf16));
  EXPECT_FALSE(has_scales(KvCacheDtype::fp8_e4m3));
  EXPECT_FALSE(has_scales(KvCacheDtype::fp8_e5m2));
  EXPECT_TRUE(has_scales(KvCacheDtype::nvfp4));
  EXPECT_TRUE(has_scales(KvCacheDtype::turbo2));
  EXPECT_TRUE(has_scales(KvCacheDtype::turbo3));
  EXPECT_TRUE(has_scales(KvCacheDtype::turbo4));
  EXPECT_TRUE(has_scales(KvCacheDtype::turbo8));
}

TEST(Dtype, ScaleBytesPresentExactlyWhenDtypeHasScales) {
  for (KvCacheDtype d : all_dtypes()) {
    const BlockRegionLayout l = block_region_layout(d, 16, 8, 128);
    EXPECT_EQ(l.scale_bytes > 0, has_scales(d)) << to_string(d);
  }
}

}  // namespace
}  // namespace kvport
