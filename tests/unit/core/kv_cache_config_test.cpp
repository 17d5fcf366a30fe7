// SPDX-License-Identifier: Apache-2.0
// KvCacheConfig validation and per-block byte math. Expected sizes are worked
// out by hand from dtype.hpp's formulas.
#include "kvport/core/kv_cache_config.hpp"

#include <gtest/gtest.h>

#include <cstddef>
#include <limits>

#include "core_test_util.hpp"
#include "kvport/platform/error.hpp"

namespace kvport {
namespace {

using test::expect_invalid_argument;
using test::llama3_8b_config;

constexpr std::size_t kMax = std::numeric_limits<std::size_t>::max();

TEST(KvCacheConfig, ValidConfigsPass) {
  EXPECT_NO_THROW(llama3_8b_config().validate());
  EXPECT_NO_THROW(test::small_config().validate());
  EXPECT_NO_THROW(test::mixed_config().validate());
  EXPECT_NO_THROW(test::mixed_config(KvCacheLayout::block_major).validate());
}

TEST(KvCacheConfig, ZeroSizesThrowNamingTheField) {
  struct Case {
    const char* field;
    std::size_t KvCacheConfig::*member;
  };
  const Case cases[] = {{"num_layers", &KvCacheConfig::num_layers},
                        {"block_size", &KvCacheConfig::block_size},
                        {"num_kv_heads", &KvCacheConfig::num_kv_heads},
                        {"head_dim_k", &KvCacheConfig::head_dim_k}};
  for (const Case& c : cases) {
    SCOPED_TRACE(c.field);
    KvCacheConfig config = llama3_8b_config();
    config.*c.member = 0;
    expect_invalid_argument([&] { config.validate(); }, c.field);
  }
}

// head_dim_v 0 is not an error: K-only layers (MLA's latent, state slots).
TEST(KvCacheConfig, KOnlyLayersHaveNoVBytes) {
  KvCacheConfig config = llama3_8b_config();
  config.num_kv_heads = 1;
  config.head_dim_k = 576;
  config.head_dim_v = 0;
  EXPECT_NO_THROW(config.validate());
  EXPECT_FALSE(config.has_v());
  EXPECT_EQ(config.v_block_bytes(0), 0u);
  EXPECT_EQ(config.v_layout(3), BlockRegionLayout{});
  EXPECT_EQ(config.bytes_per_block(), 32u * 16 * 576 * 2);
  expect_invalid_argument([&] { (void)config.v_layout(32); }, "out of range");
  EXPECT_TRUE(llama3_8b_config().has_v());
}

TEST(KvCacheConfig, DefaultConfigIsInvalid) {
  // A default-constructed config has no layers/heads: it must not silently pass.
  expect_invalid_argument([] { KvCacheConfig{}.validate(); }, "num_layers");
}

TEST(KvCacheConfig, LayerDtypesLengthMustMatchNumLayers) {
  KvCacheConfig config = llama3_8b_config();
  config.layer_dtypes.assign(31, KvCacheDtype::bf16);
  expect_invalid_argument([&] { config.validate(); }, "layer_dtypes");
  expect_invalid_argument([&] { (void)config.bytes_per_block(); }, "layer_dtypes");
  config.layer_dtypes.assign(33, KvCacheDtype::bf16);
  expect_invalid_argument([&] { config.validate(); }, "layer_dtypes");
  // A config edited after validation is never read past its layer_dtypes.
  config.layer_dtypes.assign(2, KvCacheDtype::bf16);
  expect_invalid_argument([&] { (void)config.dtype_for_layer(10); }, "layer_dtypes has 2 entries");
  config.layer_dtypes.assign(32, KvCacheDtype::bf16);
  EXPECT_NO_THROW(config.validate());
  config.layer_dtypes.clear();
  EXPECT_NO_THROW(config.validate());
}

TEST(KvCacheConfig, PackedGroupMustDivideHeadDims) {
  KvCacheConfig config = llama3_8b_config();
  config.dtype = KvCacheDtype::nvfp4;
  config.head_dim_k = 72;  // 72 % 16 = 8
  expect_invalid_argument([&] { config.validate(); }, "head_dim_k");
  config.head_dim_k = 128;
  config.head_dim_v = 24;  // 24 % 16 = 8
  expect_invalid_argument([&] { config.validate(); }, "head_dim_v");
  config.head_dim_v = 64;
  EXPECT_NO_THROW(config.validate());

  config.dtype = KvCacheDtype::turbo3;
  config.head_dim_v = 68;  // 68 % 8 = 4
  expect_invalid_argument([&] { config.validate(); }, "head_dim_v");
}

TEST(KvCacheConfig, PackedGroupIsCheckedForOverriddenLayersToo) {
  // The base dtype is fine for head_dim 4, but layer 2 is turbo3 (group 8).
  KvCacheConfig config = test::small_config();
  config.head_dim_k = 4;
  config.head_dim_v = 8;
  config.layer_dtypes = {KvCacheDtype::bf16, KvCacheDtype::bf16, KvCacheDtype::turbo3};
  expect_invalid_argument([&] { config.validate(); }, "head_dim_k");
  config.layer_dtypes[2] = KvCacheDtype::turbo4;  // group 2 divides 4
  EXPECT_NO_THROW(config.validate());
}

TEST(KvCacheConfig, HugeSizesThrowOverflow) {
  {
    KvCacheConfig config = llama3_8b_config();
    config.block_size = kMax / 4;
    expect_invalid_argument([&] { config.validate(); }, "overflow");
  }
  {
    KvCacheConfig config = llama3_8b_config();
    config.num_kv_heads = kMax / 2;
    expect_invalid_argument([&] { config.validate(); }, "overflow");
  }
  {
    KvCacheConfig config = llama3_8b_config();
    config.head_dim_v = kMax / 16 * 16;
    expect_invalid_argument([&] { config.validate(); }, "overflow");
  }
  {
    // Each layer's K + V fits (2 x 2^60 bytes) but 8 layers of it do not.
    KvCacheConfig config;
    config.num_layers = 8;
    config.block_size = std::size_t{1} << 40;
    config.num_kv_heads = 1;
    config.head_dim_k = std::size_t{1} << 19;  // E = 2^59, bf16: 2^60 bytes
    config.head_dim_v = std::size_t{1} << 19;
    expect_invalid_argument([&] { config.validate(); }, "overflow");
    expect_invalid_argument([&] { (void)config.bytes_per_block(); }, "overflow");
    config.num_layers = 7;
    EXPECT_EQ(config.bytes_per_block(), 7 * (std::size_t{1} << 61));
  }
  {
    // Same, through the per-layer (mixed dtype) summation path.
    KvCacheConfig config;
    config.num_layers = 8;
    config.block_size = std::size_t{1} << 40;
    config.num_kv_heads = 1;
    config.head_dim_k = std::size_t{1} << 19;
    config.head_dim_v = std::size_t{1} << 19;
    config.dtype = KvCacheDtype::f16;
    config.layer_dtypes.assign(8, KvCacheDtype::bf16);
    expect_invalid_argument([&] { config.validate(); }, "overflow");
    config.num_layers = 7;
    config.layer_dtypes.assign(7, KvCacheDtype::bf16);
    EXPECT_EQ(config.bytes_per_block(), 7 * (std::size_t{1} << 61));
  }
  {
    KvCacheConfig config = llama3_8b_config();
    config.num_layers = kMax / 1000;  // x 65536 bytes per layer
    expect_invalid_argument([&] { config.validate(); }, "overflow");
  }
}

TEST(KvCacheConfig, DifferentKAndVHeadDims) {
  // DeepSeek-style: K 192, V 128, bf16, block 16, 8 heads.
  KvCacheConfig config = llama3_8b_config();
  config.num_layers = 2;
  config.head_dim_k = 192;
  config.head_dim_v = 128;
  ASSERT_NO_THROW(config.validate());
  EXPECT_EQ(config.k_block_bytes(0), 16u * 8 * 192 * 2);  // 49152
  EXPECT_EQ(config.v_block_bytes(0), 16u * 8 * 128 * 2);  // 32768
  EXPECT_EQ(config.k_block_bytes(1), 49152u);
  EXPECT_EQ(config.v_block_bytes(1), 32768u);
  EXPECT_EQ(config.bytes_per_block(), 2u * (49152 + 32768));
}

TEST(KvCacheConfig, BytesPerBlockUniform) {
  // llama-3-8b bf16: 32 layers x (K 32768 + V 32768) = 2 MiB per block.
  EXPECT_EQ(llama3_8b_config().bytes_per_block(), 32u * 65536);
  EXPECT_EQ(llama3_8b_config().bytes_per_block(), std::size_t{2} << 20);

  KvCacheConfig fp8 = llama3_8b_config();
  fp8.dtype = KvCacheDtype::fp8_e4m3;
  EXPECT_EQ(fp8.bytes_per_block(), std::size_t{1} << 20);

  KvCacheConfig nvfp4 = llama3_8b_config();
  nvfp4.dtype = KvCacheDtype::nvfp4;
  EXPECT_EQ(nvfp4.bytes_per_block(), 32u * 2 * 9216);  // 8192 data + 1024 scales

  // A layer_dtypes list equal to the base dtype is still uniform.
  KvCacheConfig listed = llama3_8b_config();
  listed.layer_dtypes.assign(32, KvCacheDtype::bf16);
  EXPECT_EQ(listed.bytes_per_block(), std::size_t{2} << 20);
  EXPECT_EQ(listed.num_override_layers(), 0u);
}

TEST(KvCacheConfig, BytesPerBlockMixed) {
  // llama-3-8b shape with layers {bf16, fp8_e4m3, turbo4}:
  //   bf16: 2 x 32768 = 65536; fp8: 2 x 16384 = 32768;
  //   turbo4: 2 x (8192 data + 256 scales) = 16896.
  KvCacheConfig config = llama3_8b_config();
  config.num_layers = 3;
  config.layer_dtypes = {KvCacheDtype::bf16, KvCacheDtype::fp8_e4m3, KvCacheDtype::turbo4};
  EXPECT_EQ(config.bytes_per_block(), 65536u + 32768u + 16896u);
  EXPECT_EQ(config.k_block_bytes(0), 32768u);
  EXPECT_EQ(config.k_block_bytes(1), 16384u);
  EXPECT_EQ(config.k_block_bytes(2), 8448u);
  EXPECT_EQ(config.v_block_bytes(2), 8448u);

  const BlockRegionLayout turbo = config.k_layout(2);
  EXPECT_EQ(turbo.data_bytes, 8192u);
  EXPECT_EQ(turbo.scale_offset, 8192u);
  EXPECT_EQ(turbo.scale_bytes, 256u);
  EXPECT_EQ(turbo.total_bytes, 8448u);

  EXPECT_EQ(test::mixed_config().bytes_per_block(), test::kMixedBytesPerBlock);
  for (std::size_t layer = 0; layer < 3; ++layer) {
    EXPECT_EQ(test::mixed_config().k_block_bytes(layer), test::kMixedK[layer]) << layer;
    EXPECT_EQ(test::mixed_config().v_block_bytes(layer), test::kMixedV[layer]) << layer;
  }
}

TEST(KvCacheConfig, MixedLlama70bExampleOfFormatsDoc) {
  // docs/formats.md: 80 layers, fp8 with bf16 first and last layers.
  KvCacheConfig config = llama3_8b_config();
  config.num_layers = 80;
  EXPECT_EQ(config.bytes_per_block(), 5242880u);  // 80 x 65536, all bf16
  config.dtype = KvCacheDtype::fp8_e4m3;
  config.layer_dtypes.assign(80, KvCacheDtype::fp8_e4m3);
  config.layer_dtypes.front() = config.layer_dtypes.back() = KvCacheDtype::bf16;
  EXPECT_EQ(config.bytes_per_block(), 2u * 65536 + 78u * 32768);
  EXPECT_EQ(config.bytes_per_block(), 2686976u);
  EXPECT_EQ(config.num_override_layers(), 2u);
}

TEST(KvCacheConfig, BytesPerBlockDoesNotDependOnLayout) {
  EXPECT_EQ(test::mixed_config(KvCacheLayout::block_major).bytes_per_block(),
            test::kMixedBytesPerBlock);
  EXPECT_EQ(test::small_config(KvCacheLayout::block_major).bytes_per_block(), 3u * 2 * 128);
}

TEST(KvCacheConfig, PerLayerDtypes) {
  KvCacheConfig config = test::small_config();
  EXPECT_EQ(config.dtype_for_layer(0), KvCacheDtype::bf16);
  EXPECT_EQ(config.dtype_for_layer(2), KvCacheDtype::bf16);
  config.layer_dtypes = {KvCacheDtype::turbo4, KvCacheDtype::bf16, KvCacheDtype::fp8_e5m2};
  EXPECT_EQ(config.dtype_for_layer(0), KvCacheDtype::turbo4);
  EXPECT_EQ(config.dtype_for_layer(1), KvCacheDtype::bf16);
  EXPECT_EQ(config.dtype_for_layer(2), KvCacheDtype::fp8_e5m2);
  expect_invalid_argument([&] { (void)config.dtype_for_layer(3); }, "layer 3");
  expect_invalid_argument([&] { (void)config.k_layout(3); }, "out of range");
  expect_invalid_argument([&] { (void)config.v_block_bytes(3); }, "out of range");
}

TEST(KvCacheConfig, NumOverrideLayers) {
  KvCacheConfig config = test::small_config();
  EXPECT_EQ(config.num_override_layers(), 0u);
  config.layer_dtypes = {KvCacheDtype::bf16, KvCacheDtype::bf16, KvCacheDtype::bf16};
  EXPECT_EQ(config.num_override_layers(), 0u);
  config.layer_dtypes = {KvCacheDtype::f16, KvCacheDtype::bf16, KvCacheDtype::bf16};
  EXPECT_EQ(config.num_override_layers(), 1u);
  config.dtype = KvCacheDtype::turbo3;
  EXPECT_EQ(config.num_override_layers(), 3u);
  config.layer_dtypes = {KvCacheDtype::turbo3, KvCacheDtype::bf16, KvCacheDtype::turbo3};
  EXPECT_EQ(config.num_override_layers(), 1u);
}

TEST(KvCacheConfig, LayoutNames) {
  EXPECT_EQ(to_string(KvCacheLayout::layer_major), "layer_major");
  EXPECT_EQ(to_string(KvCacheLayout::block_major), "block_major");
}

}  // namespace
}  // namespace kvport
