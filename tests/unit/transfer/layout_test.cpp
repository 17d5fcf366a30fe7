// SPDX-License-Identifier: Apache-2.0
// PoolLayout: the handshake encoding (round trip, every malformed input), the
// compatibility hash and check, head overlap, and the region planner, checked
// byte-exact by copying planned regions between two real host-backend caches.
#include "kvport/transfer/layout.hpp"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <limits>
#include <stdexcept>
#include <tuple>

#include "transfer_test_util.hpp"

namespace kvport::transfer {
namespace {

using test::host_backend;
using test::make_layout;
using test::message_of;
using ::testing::HasSubstr;

// ---- pool_layout ----------------------------------------------------------------------

TEST(PoolLayoutTest, DescribesACacheWithEveryLayerDtype) {
  auto backend = host_backend();
  PagedKvCache cache(test::mixed_shape(2, KvCacheLayout::block_major), 7, *backend);
  const PoolLayout l = pool_layout(cache, 1, 4);
  EXPECT_EQ(l.num_layers, 5u);
  EXPECT_EQ(l.block_size, 4u);
  EXPECT_EQ(l.num_kv_heads, 2u);
  EXPECT_EQ(l.head_dim_k, 32u);
  EXPECT_EQ(l.head_dim_v, 16u);
  EXPECT_EQ(l.layer_dtypes, cache.config().layer_dtypes);
  EXPECT_EQ(l.layout, KvCacheLayout::block_major);
  EXPECT_EQ(l.tp_rank, 1u);
  EXPECT_EQ(l.tp_size, 4u);
  EXPECT_EQ(l.num_blocks, 7u);
  EXPECT_EQ(l.total_kv_heads(), 8u);
  EXPECT_EQ(l.to_config().bytes_per_block(), cache.config().bytes_per_block());
}

TEST(PoolLayoutTest, UniformCacheListsItsDtypeOncePerLayer) {
  auto backend = host_backend();
  PagedKvCache cache(test::shape(2, KvCacheDtype::fp8_e5m2), 3, *backend);
  const PoolLayout l = pool_layout(cache);
  EXPECT_EQ(l.layer_dtypes, std::vector<KvCacheDtype>(3, KvCacheDtype::fp8_e5m2));
  EXPECT_EQ(l.tp_rank, 0u);
  EXPECT_EQ(l.tp_size, 1u);
  const KvCacheConfig c = l.to_config();
  EXPECT_NO_THROW(c.validate());
  EXPECT_EQ(c.dtype_for_layer(2), KvCacheDtype::fp8_e5m2);
}

TEST(PoolLayoutTest, AddressesAreTheCachesPools) {
  auto backend = host_backend();
  for (KvCacheLayout layout : {KvCacheLayout::layer_major, KvCacheLayout::block_major}) {
    PagedKvCache cache(test::mixed_shape(2, layout), 5, *backend);
    const PoolAddresses a = pool_addresses(cache);
    ASSERT_EQ(a.k_base.size(), cache.num_layers());
    for (std::size_t l = 0; l < cache.num_layers(); ++l) {
      for (KvPart part : kKvParts) {
        const BlockPool& pool = cache.pool(l, part);
        EXPECT_EQ(a.at(l, part).base, pool.base.address());
        EXPECT_EQ(a.at(l, part).stride, pool.stride);
      }
    }
    EXPECT_THROW((void)a.at(cache.num_layers(), KvPart::v), std::out_of_range);
  }
}

TEST(PoolLayoutTest, RejectsABadTensorParallelRank) {
  auto backend = host_backend();
  PagedKvCache cache(test::shape(2), 3, *backend);
  EXPECT_THAT(message_of<InvalidArgument>([&] { pool_layout(cache, 0, 0); }), HasSubstr("tp_size"));
  EXPECT_THAT(message_of<InvalidArgument>([&] { pool_layout(cache, 2, 2); }),
              HasSubstr("tp_rank 2"));
}

// ---- encode / decode --------------------------------------------------------------------

PoolLayout odd_layout() {
  PoolLayout l = make_layout(4, 3, KvCacheDtype::turbo4, KvCacheLayout::block_major, 2, 5,
                             std::uint64_t{1} << 40);
  l.layer_dtypes[1] = KvCacheDtype::nvfp4;
  l.layer_dtypes[3] = KvCacheDtype::f16;
  l.head_dim_v = 64;
  return l;
}

TEST(PoolLayoutCodecTest, RoundTrips) {
  for (const PoolLayout& l :
       {make_layout(1, 1), make_layout(32, 8), odd_layout(),
        make_layout(4096, 1, KvCacheDtype::turbo8, KvCacheLayout::layer_major, 0, 1, 1)}) {
    const std::vector<std::uint8_t> bytes = encode(l);
    EXPECT_EQ(bytes.size(), 43u + l.num_layers);
    EXPECT_EQ(decode_pool_layout(bytes), l);
  }
}

TEST(PoolLayoutCodecTest, IsVersionedAndLittleEndian) {
  const std::vector<std::uint8_t> b = encode(odd_layout());
  EXPECT_EQ(std::vector<std::uint8_t>(b.begin(), b.begin() + 4),
            (std::vector<std::uint8_t>{'K', 'V', 'P', 'L'}));
  EXPECT_EQ(b[4], 1);  // version 1, little-endian
  EXPECT_EQ(b[5], 0);
  EXPECT_EQ(b[6], 4);  // num_layers
  EXPECT_EQ(b[7], 0);
  EXPECT_EQ(b[26], static_cast<std::uint8_t>(KvCacheLayout::block_major));
  EXPECT_EQ(b[35 + 5], 1);  // num_blocks = 2^40: byte 5 of the u64
  EXPECT_EQ(b[43 + 1], static_cast<std::uint8_t>(KvCacheDtype::nvfp4));
}

TEST(PoolLayoutCodecTest, EveryTruncationThrowsWithoutReadingPastTheSpan) {
  const std::vector<std::uint8_t> full = encode(odd_layout());
  for (std::size_t n = 0; n < full.size(); ++n) {
    // A buffer of exactly n bytes, so that a read past it is a heap overflow
    // the sanitizer presets catch.
    const std::vector<std::uint8_t> cut(full.begin(), full.begin() + static_cast<long>(n));
    const std::string what = message_of<InvalidArgument>([&] { decode_pool_layout(cut); });
    EXPECT_THAT(what, HasSubstr("PoolLayout decode")) << "at " << n << " bytes";
    if (n >= 4 && n < 43) {
      EXPECT_THAT(what, HasSubstr("truncated")) << "at " << n << " bytes";
    }
  }
  EXPECT_THAT(message_of<InvalidArgument>(
                  [&] { decode_pool_layout(std::span(full).first(full.size() - 1)); }),
              HasSubstr("truncated message: 46 bytes, 47 expected for 4 layers"));
}

TEST(PoolLayoutCodecTest, TrailingBytesAreRejected) {
  std::vector<std::uint8_t> b = encode(odd_layout());
  b.push_back(0);
  EXPECT_THAT(message_of<InvalidArgument>([&] { decode_pool_layout(b); }), HasSubstr("overlong"));
}

TEST(PoolLayoutCodecTest, BadMagicAndVersionAreNamed) {
  std::vector<std::uint8_t> b = encode(odd_layout());
  b[0] = 'X';
  EXPECT_THAT(message_of<InvalidArgument>([&] { decode_pool_layout(b); }), HasSubstr("bad magic"));
  b = encode(odd_layout());
  b[4] = 3;  // 1: no group list, 2: groups; 3 is a later build's
  EXPECT_THAT(message_of<InvalidArgument>([&] { decode_pool_layout(b); }),
              HasSubstr("unsupported version 3 (this build reads versions 1 and 2)"));
  b = encode(odd_layout());
  b[4] = 0;
  b[5] = 1;  // 256: the u16 is little-endian
  EXPECT_THAT(message_of<InvalidArgument>([&] { decode_pool_layout(b); }),
              HasSubstr("unsupported version 256"));
}

// Sets the little-endian u32 at `offset`.
void put_u32(std::vector<std::uint8_t>& b, std::size_t offset, std::uint32_t v) {
  for (std::size_t i = 0; i < 4; ++i)
    b[offset + i] = static_cast<std::uint8_t>(v >> (8 * i));
}

TEST(PoolLayoutCodecTest, ZeroSizesAreNamed) {
  const std::vector<std::pair<std::size_t, const char*>> fields = {
      {6, "num_layers is 0"},
      {10, "block_size is 0"},
      {14, "num_kv_heads is 0"},
      {18, "head_dim_k is 0"},
      {31, "tp_size is 0"}};  // head_dim_v 0: K-only
  for (const auto& [offset, text] : fields) {
    std::vector<std::uint8_t> b = encode(odd_layout());
    put_u32(b, offset, 0);
    EXPECT_THAT(message_of<InvalidArgument>([&] { decode_pool_layout(b); }), HasSubstr(text));
  }
  std::vector<std::uint8_t> b = encode(odd_layout());
  for (std::size_t i = 35; i < 43; ++i)
    b[i] = 0;
  EXPECT_THAT(message_of<InvalidArgument>([&] { decode_pool_layout(b); }),
              HasSubstr("num_blocks is 0"));
}

TEST(PoolLayoutCodecTest, OutOfRangeFieldsAreNamed) {
  std::vector<std::uint8_t> b = encode(odd_layout());
  put_u32(b, 27, 5);  // tp_rank = tp_size
  EXPECT_THAT(message_of<InvalidArgument>([&] { decode_pool_layout(b); }),
              HasSubstr("tp_rank 5 is not below tp_size 5"));

  b = encode(odd_layout());
  b[26] = 2;
  EXPECT_THAT(message_of<InvalidArgument>([&] { decode_pool_layout(b); }),
              HasSubstr("unknown layout 2"));

  b = encode(odd_layout());
  b[43 + 2] = static_cast<std::uint8_t>(all_dtypes().size());
  EXPECT_THAT(message_of<InvalidArgument>([&] { decode_pool_layout(b); }),
              HasSubstr("layer 2 has unknown dtype 9"));

  b = encode(odd_layout());
  put_u32(b, 6, 4097);
  EXPECT_THAT(message_of<InvalidArgument>([&] { decode_pool_layout(b); }),
              HasSubstr("num_layers 4097 exceeds the limit of 4096"));

  b = encode(odd_layout());
  put_u32(b, 6, std::numeric_limits<std::uint32_t>::max());
  EXPECT_THAT(message_of<InvalidArgument>([&] { decode_pool_layout(b); }), HasSubstr("num_layers"));

  // A head_dim that is not a multiple of nvfp4's group of 16.
  b = encode(odd_layout());
  put_u32(b, 18, 24);
  EXPECT_THAT(message_of<InvalidArgument>([&] { decode_pool_layout(b); }),
              HasSubstr("head_dim_k = 24"));
}

TEST(PoolLayoutCodecTest, EverySingleByteCorruptionDecodesOrThrowsInvalidArgument) {
  const std::vector<std::uint8_t> full = encode(odd_layout());
  for (std::size_t i = 0; i < full.size(); ++i) {
    for (std::uint8_t v :
         {std::uint8_t{0}, std::uint8_t{1}, std::uint8_t{0x7F}, std::uint8_t{0xFF}}) {
      std::vector<std::uint8_t> b = full;
      b[i] = v;
      try {
        const PoolLayout l = decode_pool_layout(b);
        EXPECT_EQ(l.layer_dtypes.size(), l.num_layers);
        EXPECT_LT(l.tp_rank, l.tp_size);
      } catch (const InvalidArgument&) {
      }
    }
  }
}

TEST(PoolLayoutCodecTest, EncodeRejectsAnInconsistentLayout) {
  PoolLayout l = make_layout(3, 2);
  l.layer_dtypes.pop_back();
  EXPECT_THAT(message_of<InvalidArgument>([&] { encode(l); }), HasSubstr("layer_dtypes"));
}

// ---- compatibility ----------------------------------------------------------------------

TEST(CompatibilityTest, HashCoversTheFieldsPeersShare) {
  const PoolLayout base = make_layout(32, 8);
  const std::uint64_t h = compatibility_hash(base);
  auto differs = [&](auto edit) {
    PoolLayout l = base;
    edit(l);
    return compatibility_hash(l) != h;
  };
  EXPECT_TRUE(differs([](PoolLayout& l) {
    l.num_layers = 16;
    l.layer_dtypes.resize(16);
  }));
  EXPECT_TRUE(differs([](PoolLayout& l) { l.block_size = 32; }));
  EXPECT_TRUE(differs([](PoolLayout& l) { l.head_dim_k = 64; }));
  EXPECT_TRUE(differs([](PoolLayout& l) { l.head_dim_v = 64; }));
  EXPECT_TRUE(differs([](PoolLayout& l) { l.num_kv_heads = 4; }));
  EXPECT_TRUE(differs([](PoolLayout& l) { l.layer_dtypes[31] = KvCacheDtype::fp8_e4m3; }));
  // Not hashed: what compatible peers may have differently.
  EXPECT_FALSE(differs([](PoolLayout& l) { l.num_blocks = 5; }));
  EXPECT_FALSE(differs([](PoolLayout& l) { l.layout = KvCacheLayout::block_major; }));
  EXPECT_FALSE(differs([](PoolLayout& l) {
    l.num_kv_heads = 2;  // TP 4: the same 8 heads in total
    l.tp_size = 4;
    l.tp_rank = 3;
  }));
  EXPECT_EQ(compatibility_hash(base), compatibility_hash(make_layout(32, 8)));
}

TEST(CompatibilityTest, EqualLayoutsAndTheirLegalVariantsAreCompatible) {
  const PoolLayout a = make_layout(32, 8);
  EXPECT_EQ(incompatibility(a, a), std::nullopt);
  PoolLayout b = a;
  b.layout = KvCacheLayout::block_major;
  b.num_blocks = 3;
  EXPECT_EQ(incompatibility(a, b), std::nullopt);  // equal TP: layouts may differ
  EXPECT_EQ(incompatibility(b, b), std::nullopt);
  const PoolLayout tp2 = make_layout(32, 4, KvCacheDtype::bf16, KvCacheLayout::layer_major, 1, 2);
  EXPECT_EQ(incompatibility(a, tp2), std::nullopt);
  EXPECT_EQ(incompatibility(tp2, a), std::nullopt);
}

TEST(CompatibilityTest, NamesTheFirstDifferingFieldWithBothValues) {
  const PoolLayout a = make_layout(32, 8);
  auto why = [&](auto edit) {
    PoolLayout b = a;
    edit(b);
    return incompatibility(a, b).value_or("(compatible)");
  };
  EXPECT_EQ(why([](PoolLayout& l) {
              l.num_layers = 16;
              l.layer_dtypes.resize(16);
            }),
            "num_layers differs: 32 here, 16 on the peer");
  EXPECT_EQ(why([](PoolLayout& l) { l.block_size = 32; }),
            "block_size differs: 16 here, 32 on the peer");
  EXPECT_EQ(why([](PoolLayout& l) { l.head_dim_k = 64; }),
            "head_dim_k differs: 128 here, 64 on the peer");
  EXPECT_EQ(why([](PoolLayout& l) { l.head_dim_v = 256; }),
            "head_dim_v differs: 128 here, 256 on the peer");
  EXPECT_EQ(why([](PoolLayout& l) { l.layer_dtypes[3] = KvCacheDtype::fp8_e4m3; }),
            "layer 3 dtype differs: bf16 here, fp8_e4m3 on the peer");
  EXPECT_EQ(why([](PoolLayout& l) {
              l.num_kv_heads = 2;
              l.tp_size = 2;
            }),
            "total kv heads differ: 8 here (8 x tp_size 1), 4 on the peer (2 x tp_size 2)");
  EXPECT_THAT(why([](PoolLayout& l) {
                l.num_kv_heads = 4;
                l.tp_size = 2;
                l.layout = KvCacheLayout::block_major;
              }),
              HasSubstr("tensor-parallel head slicing needs the layer-major layout on both sides"));
  EXPECT_THAT(why([](PoolLayout& l) { l.tp_rank = 1; }),
              HasSubstr("tp_rank 1 is not below tp_size 1 on the peer"));
  EXPECT_THAT(why([](PoolLayout& l) { l.tp_size = 0; }), HasSubstr("tp_size is 0 on the peer"));
  EXPECT_THAT(why([](PoolLayout& l) { l.layer_dtypes.pop_back(); }),
              HasSubstr("layer_dtypes has 31 entries for 32 layers on the peer"));
  // The local side's own problems say "here".
  PoolLayout bad = a;
  bad.tp_rank = 4;
  EXPECT_THAT(incompatibility(bad, a).value_or(""), HasSubstr("here"));
  // Both sides' layouts matter: block-major here with head slicing.
  PoolLayout bm = a;
  bm.layout = KvCacheLayout::block_major;
  EXPECT_THAT(
      incompatibility(bm, make_layout(32, 4, KvCacheDtype::bf16, KvCacheLayout::layer_major, 0, 2))
          .value_or(""),
      HasSubstr("block_major) here"));
}

TEST(HeadOverlapTest, IntersectsTheGlobalHeadRanges) {
  const PoolLayout tp1 = make_layout(2, 8);
  auto tp = [](std::uint32_t heads, std::uint32_t rank, std::uint32_t size) {
    return make_layout(2, heads, KvCacheDtype::bf16, KvCacheLayout::layer_major, rank, size);
  };
  EXPECT_EQ(head_overlap(tp1, tp1), (HeadRange{0, 8}));
  EXPECT_EQ(head_overlap(tp1, tp(4, 1, 2)), (HeadRange{4, 4}));
  EXPECT_EQ(head_overlap(tp(4, 1, 2), tp1), (HeadRange{4, 4}));
  EXPECT_EQ(head_overlap(tp(4, 1, 2), tp(2, 3, 4)), (HeadRange{6, 2}));
  EXPECT_EQ(head_overlap(tp(4, 0, 2), tp(2, 3, 4)), std::nullopt);
  EXPECT_EQ(head_overlap(tp(2, 1, 4), tp(4, 0, 2)), (HeadRange{2, 2}));
}

// ---- the planner on synthetic addresses -------------------------------------------------

// Addresses of a pool at `base` laid out as PagedKvCache lays out `l`
// (bf16 only: K and V regions of one layer have the same size).
PoolAddresses synthetic_pools(const PoolLayout& l, std::uint64_t base) {
  const BlockRegionLayout r =
      block_region_layout(l.layer_dtypes[0], l.block_size, l.num_kv_heads, l.head_dim_k);
  PoolAddresses a;
  for (std::uint32_t layer = 0; layer < l.num_layers; ++layer) {
    if (l.layout == KvCacheLayout::layer_major) {
      const std::uint64_t pool_bytes = r.total_bytes * l.num_blocks;
      a.k_base.push_back(base + (2 * layer) * pool_bytes);
      a.v_base.push_back(base + (2 * layer + 1) * pool_bytes);
      a.k_stride.push_back(r.total_bytes);
      a.v_stride.push_back(r.total_bytes);
    } else {
      const std::uint64_t block = 2 * r.total_bytes * l.num_layers;
      a.k_base.push_back(base + 2 * layer * r.total_bytes);
      a.v_base.push_back(base + (2 * layer + 1) * r.total_bytes);
      a.k_stride.push_back(block);
      a.v_stride.push_back(block);
    }
  }
  return a;
}

constexpr std::uint64_t kLocalBase = 0x10'0000'0000;
constexpr std::uint64_t kRemoteBase = 0x20'0000'0000;

TEST(PlanBlockRegionsTest, ConsecutiveIdsCostTwoRegionsPerLayerInLayerMajor) {
  const PoolLayout l = make_layout(32, 8);
  const std::vector<BlockId> local = {4, 5, 6, 7}, remote = {10, 11, 12, 13};
  const auto regions = plan_block_regions(l, synthetic_pools(l, kLocalBase), local, l,
                                          synthetic_pools(l, kRemoteBase), remote);
  ASSERT_EQ(regions.size(), 64u);
  const std::uint64_t region = 16 * 8 * 128 * 2;  // 32 KiB
  const std::uint64_t pool = region * 64;
  EXPECT_EQ(regions[0], (TransferRegion{kLocalBase + 4 * region, kRemoteBase + 10 * region,
                                    4 * region}));  // layer 0 K
  EXPECT_EQ(regions[1], (TransferRegion{kLocalBase + pool + 4 * region,
                                    kRemoteBase + pool + 10 * region, 4 * region}));  // layer 0 V
  EXPECT_EQ(total_bytes(regions), 4 * 64 * region);
}

TEST(PlanBlockRegionsTest, ConsecutiveIdsAreOneRegionInBlockMajor) {
  const PoolLayout l = make_layout(32, 8, KvCacheDtype::bf16, KvCacheLayout::block_major);
  const std::vector<BlockId> local = {4, 5, 6, 7}, remote = {10, 11, 12, 13};
  const auto regions = plan_block_regions(l, synthetic_pools(l, kLocalBase), local, l,
                                          synthetic_pools(l, kRemoteBase), remote);
  const std::uint64_t block = 2 * 32 * 16 * 8 * 128 * 2;  // 2 MiB
  ASSERT_EQ(regions.size(), 1u);
  EXPECT_EQ(regions[0], (TransferRegion{kLocalBase + 4 * block, kRemoteBase + 10 * block, 4 * block}));
}

TEST(PlanBlockRegionsTest, RunsBreakWhereEitherSideIsNotConsecutive) {
  const PoolLayout lm = make_layout(2, 8);
  const PoolLayout bm = make_layout(2, 8, KvCacheDtype::bf16, KvCacheLayout::block_major);
  const std::vector<BlockId> local = {0, 1, 2, 5}, remote = {3, 4, 9, 10};
  // Runs on both sides: {0,1}<->{3,4}, {2}<->{9}, {5}<->{10}.
  EXPECT_EQ(plan_block_regions(lm, synthetic_pools(lm, kLocalBase), local, lm,
                               synthetic_pools(lm, kRemoteBase), remote)
                .size(),
            3u * 4);
  EXPECT_EQ(plan_block_regions(bm, synthetic_pools(bm, kLocalBase), local, bm,
                               synthetic_pools(bm, kRemoteBase), remote)
                .size(),
            3u);
  EXPECT_TRUE(plan_block_regions(lm, synthetic_pools(lm, kLocalBase), {}, lm,
                                 synthetic_pools(lm, kRemoteBase), {})
                  .empty());
}

TEST(PlanBlockRegionsTest, MixedLayoutsMoveWholeRegions) {
  const PoolLayout lm = make_layout(3, 8);
  const PoolLayout bm = make_layout(3, 8, KvCacheDtype::bf16, KvCacheLayout::block_major);
  const std::vector<BlockId> ids = {1, 2, 3};
  const std::uint64_t region = 16 * 8 * 128 * 2;
  for (const auto& [a, b] : {std::pair{lm, bm}, std::pair{bm, lm}}) {
    const auto regions = plan_block_regions(a, synthetic_pools(a, kLocalBase), ids, b,
                                            synthetic_pools(b, kRemoteBase), ids);
    EXPECT_EQ(regions.size(), 3u * 2 * 3);  // nothing is contiguous on both sides
    EXPECT_EQ(total_bytes(regions), 3 * 2 * 3 * region);
    for (const TransferRegion& r : regions)
      EXPECT_EQ(r.bytes, region);
  }
}

TEST(PlanBlockRegionsTest, HeadSlicingMovesTheCommonHeadsOnly) {
  const PoolLayout tp1 = make_layout(2, 8);
  const PoolLayout rank1 = make_layout(2, 4, KvCacheDtype::bf16, KvCacheLayout::layer_major, 1, 2);
  const std::vector<BlockId> ids = {0, 1};
  const auto regions = plan_block_regions(tp1, synthetic_pools(tp1, kLocalBase), ids, rank1,
                                          synthetic_pools(rank1, kRemoteBase), ids);
  const std::uint64_t head = 16 * 128 * 2;  // one head's data in one block: 4 KiB
  ASSERT_EQ(regions.size(), 2u * 2 * 2);    // layers x K/V x blocks, nothing merges
  // Local heads 4..7 of block 0 (region of 8 heads) <- the peer's whole block 0.
  EXPECT_EQ(regions[0], (TransferRegion{kLocalBase + 4 * head, kRemoteBase, 4 * head}));
  // Block 1 of layer 0's K: one local region (8 heads) and one peer region on.
  EXPECT_EQ(regions[1],
            (TransferRegion{kLocalBase + 8 * head + 4 * head, kRemoteBase + 4 * head, 4 * head}));
  EXPECT_EQ(total_bytes(regions), 2 * 2 * 2 * 4 * head);
}

TEST(PlanBlockRegionsTest, RejectsBadInputBeforePlanning) {
  const PoolLayout l = make_layout(2, 8);
  const PoolAddresses la = synthetic_pools(l, kLocalBase), ra = synthetic_pools(l, kRemoteBase);
  const std::vector<BlockId> two = {0, 1}, three = {0, 1, 2};
  auto plan = [&](const PoolLayout& a, const PoolAddresses& pa, std::span<const BlockId> ia,
                  const PoolLayout& b, const PoolAddresses& pb, std::span<const BlockId> ib) {
    return message_of<InvalidArgument>([&] { plan_block_regions(a, pa, ia, b, pb, ib); });
  };
  EXPECT_THAT(plan(l, la, two, l, ra, three), HasSubstr("2 local block ids but 3 remote ones"));
  const std::vector<BlockId> far = {0, 64};
  EXPECT_THAT(plan(l, la, far, l, ra, two),
              HasSubstr("local block id 64 (entry 1) is out of range (64 blocks)"));
  EXPECT_THAT(plan(l, la, two, l, ra, far), HasSubstr("remote block id 64"));

  PoolLayout other = l;
  other.head_dim_v = 64;
  EXPECT_THAT(plan(l, la, two, other, ra, two),
              HasSubstr("incompatible layouts: head_dim_v differs: 128 here, 64 on the peer"));
  const PoolLayout bm_tp2 = make_layout(2, 4, KvCacheDtype::bf16, KvCacheLayout::block_major, 0, 2);
  EXPECT_THAT(plan(l, la, two, bm_tp2, ra, two), HasSubstr("layer-major layout on both sides"));

  const PoolLayout r0 = make_layout(2, 4, KvCacheDtype::bf16, KvCacheLayout::layer_major, 0, 2);
  const PoolLayout r3 = make_layout(2, 2, KvCacheDtype::bf16, KvCacheLayout::layer_major, 3, 4);
  EXPECT_THAT(
      plan(r0, synthetic_pools(r0, kLocalBase), two, r3, synthetic_pools(r3, kRemoteBase), two),
      HasSubstr("no common heads: global heads [0, 4) here, [6, 8) on the peer"));

  PoolAddresses short_pools = ra;
  short_pools.v_stride.pop_back();
  EXPECT_THAT(plan(l, la, two, l, short_pools, two),
              HasSubstr("remote pool addresses have 1 v_stride entries for 2 layers"));

  PoolAddresses huge = ra;
  huge.k_base[1] = std::numeric_limits<std::uint64_t>::max() - 16;
  EXPECT_THAT(plan(l, la, two, l, huge, two), HasSubstr("overflows"));
  huge = ra;
  huge.k_stride[0] = std::numeric_limits<std::uint64_t>::max();  // block 1 wraps
  EXPECT_THAT(plan(l, la, two, l, huge, two), HasSubstr("overflows"));
}

// ---- K-only layers ------------------------------------------------------------------

KvCacheConfig k_only_shape(KvCacheLayout layout, KvCacheDtype dtype = KvCacheDtype::bf16) {
  KvCacheConfig c = test::shape(2, dtype, layout);
  c.head_dim_v = 0;
  return c;
}

TEST(KOnlyLayoutTest, DescribesEncodesAndRefusesAPeerWithV) {
  auto backend = host_backend();
  PagedKvCache cache(k_only_shape(KvCacheLayout::block_major), 6, *backend);
  const PoolLayout l = pool_layout(cache);
  EXPECT_FALSE(l.has_v());
  EXPECT_EQ(l.head_dim_v, 0u);
  EXPECT_EQ(decode_pool_layout(encode(l)), l);
  EXPECT_EQ(l.to_config().bytes_per_block(), cache.config().bytes_per_block());
  PoolLayout with_v = l;
  with_v.head_dim_v = 16;
  EXPECT_NE(compatibility_hash(l), compatibility_hash(with_v));
  EXPECT_EQ(incompatibility(l, with_v), "head_dim_v differs: 0 here, 16 on the peer");
  const PoolAddresses a = pool_addresses(cache);
  ASSERT_EQ(a.v_base.size(), 3u);
  EXPECT_EQ(a.v_base, std::vector<std::uint64_t>(3, 0));  // no V pools
  EXPECT_EQ(a.v_stride, std::vector<std::uint64_t>(3, 0));
  EXPECT_EQ(a.at(2, KvPart::k).base, cache.k_pool_ptr(2).address());
}

TEST(KOnlyLayoutTest, PlansKRegionsOnly) {
  auto backend = host_backend();
  const std::vector<BlockId> ids = {1, 2, 3};
  for (KvCacheLayout layout : {KvCacheLayout::layer_major, KvCacheLayout::block_major}) {
    SCOPED_TRACE(to_string(layout));
    PagedKvCache a(k_only_shape(layout), 6, *backend), b(k_only_shape(layout), 6, *backend);
    const auto regions = plan_block_regions(pool_layout(a), pool_addresses(a), ids, pool_layout(b),
                                            pool_addresses(b), ids);
    // One run: a region per layer's K pool, or one for the whole run.
    EXPECT_EQ(regions.size(), layout == KvCacheLayout::layer_major ? 3u : 1u);
    EXPECT_EQ(total_bytes(regions), 3 * a.config().bytes_per_block());
  }
}

// K-only caches of every layout pair and of two TP sizes move every K byte
// through the planner (write_kv_content / verify_kv_content: K alone).
TEST(KOnlyLayoutTest, MovesEveryKByteExact) {
  auto backend = host_backend();
  StreamView stream = backend->default_stream();
  const std::vector<TokenId> tokens = test::tokens_of(10);
  const std::vector<BlockId> src_ids = {0, 1, 2}, dst_ids = {5, 1, 2};
  for (const auto& [src_layout, dst_layout] :
       {std::pair{KvCacheLayout::layer_major, KvCacheLayout::block_major},
        std::pair{KvCacheLayout::block_major, KvCacheLayout::layer_major},
        std::pair{KvCacheLayout::block_major, KvCacheLayout::block_major}}) {
    PagedKvCache src(k_only_shape(src_layout, KvCacheDtype::turbo4), 4, *backend);
    PagedKvCache dst(k_only_shape(dst_layout, KvCacheDtype::turbo4), 8, *backend);
    dst.poison_blocks(dst_ids, stream);
    write_kv_content(src, pool_layout(src), src_ids, tokens, stream);
    EXPECT_FALSE(verify_kv_content(dst, pool_layout(dst), dst_ids, tokens, stream).ok());
    const auto regions = plan_block_regions(pool_layout(dst), pool_addresses(dst), dst_ids,
                                            pool_layout(src), pool_addresses(src), src_ids);
    test::copy_to_local(regions);
    const ContentCheck check = verify_kv_content(dst, pool_layout(dst), dst_ids, tokens, stream);
    EXPECT_TRUE(check.ok()) << check.bytes_wrong << " wrong of " << check.bytes_checked;
    EXPECT_EQ(total_bytes(regions), 3 * src.config().bytes_per_block());
  }
  // Head slicing: a TP-1 K-only cache to rank 1 of 2.
  KvCacheConfig whole = k_only_shape(KvCacheLayout::layer_major, KvCacheDtype::nvfp4);
  KvCacheConfig half = whole;
  half.num_kv_heads = 1;
  PagedKvCache tp1(whole, 4, *backend), rank1(half, 4, *backend);
  write_kv_content(tp1, pool_layout(tp1), src_ids, tokens, stream);
  const PoolLayout rl = pool_layout(rank1, 1, 2);
  const auto regions = plan_block_regions(rl, pool_addresses(rank1), src_ids, pool_layout(tp1),
                                          pool_addresses(tp1), src_ids);
  test::copy_to_local(regions);
  EXPECT_TRUE(verify_kv_content(rank1, rl, src_ids, tokens, stream).ok());
}

// ---- the planner, byte-exact between real caches ----------------------------------------

// Copies blocks between caches of every combination of TP sizes through the
// planner, and checks the receiving ranks with verify_kv_content: every data
// and scale byte of the heads each rank holds arrives, from whichever source
// rank holds it.
class PlannedTransferTest
    : public ::testing::TestWithParam<std::tuple<KvCacheDtype, std::uint32_t, std::uint32_t>> {};

TEST_P(PlannedTransferTest, MovesEveryHeadByteExact) {
  const auto [dtype, src_tp, dst_tp] = GetParam();
  constexpr std::uint32_t kTotalHeads = 4;
  auto backend = host_backend();
  StreamView stream = backend->default_stream();
  const std::vector<TokenId> tokens = test::tokens_of(9);  // 3 blocks, the last partial
  const std::vector<BlockId> src_ids = {5, 6, 2};
  const std::vector<BlockId> dst_ids = {1, 2, 3};

  std::vector<PagedKvCache> src, dst;
  for (std::uint32_t r = 0; r < src_tp; ++r) {
    src.emplace_back(test::shape(kTotalHeads / src_tp, dtype), 8, *backend);
    src.back().poison_blocks(src_ids, stream);
    write_kv_content(src.back(), pool_layout(src.back(), r, src_tp), src_ids, tokens, stream);
  }
  for (std::uint32_t r = 0; r < dst_tp; ++r) {
    dst.emplace_back(test::shape(kTotalHeads / dst_tp, dtype), 4, *backend);
    dst.back().poison_blocks(dst_ids, stream);
  }
  backend->synchronize(stream);

  for (std::uint32_t d = 0; d < dst_tp; ++d) {
    const PoolLayout dl = pool_layout(dst[d], d, dst_tp);
    EXPECT_FALSE(verify_kv_content(dst[d], dl, dst_ids, tokens, stream).ok());
    std::uint64_t moved = 0;
    for (std::uint32_t s = 0; s < src_tp; ++s) {
      const PoolLayout sl = pool_layout(src[s], s, src_tp);
      if (!head_overlap(dl, sl)) continue;
      const auto regions = plan_block_regions(dl, pool_addresses(dst[d]), dst_ids, sl,
                                              pool_addresses(src[s]), src_ids);
      test::copy_to_local(regions);
      moved += total_bytes(regions);
    }
    const ContentCheck check = verify_kv_content(dst[d], dl, dst_ids, tokens, stream);
    EXPECT_TRUE(check.ok()) << check.bytes_wrong << " wrong of " << check.bytes_checked;
    if (src_tp == dst_tp) {
      EXPECT_EQ(moved, dst_ids.size() * dst[d].config().bytes_per_block());
    } else {
      EXPECT_EQ(moved, check.bytes_checked);  // data and scales, no padding
    }

    // One corrupted data byte, then one scale byte, is found exactly.
    std::uint8_t* data = test::byte_at(dst[d].k_cache_ptr(1, dst_ids[2]), 3);
    *data ^= 0x01;
    EXPECT_EQ(verify_kv_content(dst[d], dl, dst_ids, tokens, stream).bytes_wrong, 1u);
    *data ^= 0x01;
    const BlockRegionLayout v = dst[d].config().v_layout(2);
    if (v.scale_bytes != 0) {
      std::uint8_t* scale = test::byte_at(dst[d].v_cache_ptr(2, dst_ids[0]), v.scale_offset + 1);
      *scale ^= 0x80;
      EXPECT_EQ(verify_kv_content(dst[d], dl, dst_ids, tokens, stream).bytes_wrong, 1u);
      *scale ^= 0x80;
    }
    EXPECT_TRUE(verify_kv_content(dst[d], dl, dst_ids, tokens, stream).ok());
  }
}

INSTANTIATE_TEST_SUITE_P(
    TensorParallelSizes, PlannedTransferTest,
    ::testing::Combine(::testing::Values(KvCacheDtype::bf16, KvCacheDtype::nvfp4,
                                         KvCacheDtype::turbo4, KvCacheDtype::turbo3),
                       ::testing::Values(1u, 2u, 4u), ::testing::Values(1u, 2u, 4u)),
    [](const auto& p) {
      return std::string(to_string(std::get<0>(p.param))) + "_tp" +
             std::to_string(std::get<1>(p.param)) + "_to_tp" + std::to_string(std::get<2>(p.param));
    });

// Equal TP sizes between layer-major and block-major caches, mixed precision
// (scales and padding in some layers): whole regions move, padding included.
TEST(PlannedTransferMixedLayoutTest, MovesWholeRegionsBetweenLayouts) {
  auto backend = host_backend();
  StreamView stream = backend->default_stream();
  const std::vector<TokenId> tokens = test::tokens_of(16);
  const std::vector<BlockId> src_ids = {0, 1, 2, 3};
  const std::vector<BlockId> dst_ids = {6, 2, 3, 0};
  for (const auto& [src_layout, dst_layout] :
       {std::pair{KvCacheLayout::layer_major, KvCacheLayout::block_major},
        std::pair{KvCacheLayout::block_major, KvCacheLayout::layer_major},
        std::pair{KvCacheLayout::block_major, KvCacheLayout::block_major},
        std::pair{KvCacheLayout::layer_major, KvCacheLayout::layer_major}}) {
    PagedKvCache src(test::mixed_shape(2, src_layout), 4, *backend);
    PagedKvCache dst(test::mixed_shape(2, dst_layout), 8, *backend);
    dst.poison_blocks(dst_ids, stream);
    write_kv_content(src, pool_layout(src), src_ids, tokens, stream);
    const auto regions = plan_block_regions(pool_layout(dst), pool_addresses(dst), dst_ids,
                                            pool_layout(src), pool_addresses(src), src_ids);
    test::copy_to_local(regions);
    EXPECT_TRUE(verify_kv_content(dst, pool_layout(dst), dst_ids, tokens, stream).ok());
    EXPECT_EQ(total_bytes(regions), 4 * src.config().bytes_per_block());
    // Padding moved too: every byte of every region is the source's.
    for (std::size_t i = 0; i < src_ids.size(); ++i) {
      for (std::size_t layer = 0; layer < 5; ++layer) {
        const auto a = src.read_block(layer, src_ids[i], stream);
        const auto b = dst.read_block(layer, dst_ids[i], stream);
        EXPECT_EQ(a.k, b.k);
        EXPECT_EQ(a.v, b.v);
      }
    }
    if (src_layout == KvCacheLayout::block_major && dst_layout == KvCacheLayout::block_major) {
      EXPECT_EQ(regions.size(), 3u);  // runs {6}<-{0}, {2,3}<-{1,2}, {0}<-{3}
    }
  }
}

}  // namespace
}  // namespace kvport::transfer
