// SPDX-License-Identifier: Apache-2.0
// Deterministic KV content: what write_kv_content writes (per head, per
// position, the same on every TP size), that verify_kv_content checks every
// data and scale byte and nothing else, the one-batch staging, the errors,
// and the speed on a llama-3-8b-sized batch.
#include "kvport/transfer/kv_content.hpp"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <chrono>
#include <cstdio>

#include "transfer_test_util.hpp"

namespace kvport::transfer {
namespace {

using test::host_backend;
using test::message_of;
using ::testing::HasSubstr;

// Data + scale bytes (no padding) of one block of `c`, this rank's heads.
std::uint64_t checked_bytes_per_block(const KvCacheConfig& c) {
  std::uint64_t n = 0;
  for (std::size_t layer = 0; layer < c.num_layers; ++layer) {
    for (const BlockRegionLayout& r : {c.k_layout(layer), c.v_layout(layer)})
      n += r.data_bytes + r.scale_bytes;
  }
  return n;
}

class KvContentTest : public ::testing::TestWithParam<KvCacheLayout> {
 protected:
  std::unique_ptr<Backend> backend_ = host_backend();
  StreamView stream_ = backend_->default_stream();
};

TEST_P(KvContentTest, WrittenContentVerifies) {
  PagedKvCache cache(test::mixed_shape(2, GetParam()), 8, *backend_);
  const PoolLayout layout = pool_layout(cache);
  const std::vector<BlockId> blocks = {3, 7, 0};
  const std::vector<TokenId> tokens = test::tokens_of(10);
  cache.poison_blocks(blocks, stream_);
  write_kv_content(cache, layout, blocks, tokens, stream_);
  const ContentCheck check = verify_kv_content(cache, layout, blocks, tokens, stream_);
  EXPECT_TRUE(check.ok());
  EXPECT_EQ(check.bytes_wrong, 0u);
  EXPECT_EQ(check.bytes_checked, 3 * checked_bytes_per_block(cache.config()));
}

TEST_P(KvContentTest, UsesOnePinnedBufferAndOneBatchedCopyPerCall) {
  PagedKvCache cache(test::mixed_shape(2, GetParam()), 8, *backend_);
  const PoolLayout layout = pool_layout(cache);
  const std::vector<BlockId> blocks = {1, 2, 3, 5};
  const std::vector<TokenId> tokens = test::tokens_of(16);
  backend_->reset_call_counts();
  write_kv_content(cache, layout, blocks, tokens, stream_);
  CallCounts c = backend_->call_counts();
  EXPECT_EQ(c.copy_host_batch, 1u);
  EXPECT_EQ(c.copy, 0u);
  EXPECT_EQ(c.host_alloc, 1u);
  EXPECT_EQ(c.host_free, 1u);
  EXPECT_EQ(c.synchronize, 1u);
  backend_->reset_call_counts();
  EXPECT_TRUE(verify_kv_content(cache, layout, blocks, tokens, stream_).ok());
  c = backend_->call_counts();
  EXPECT_EQ(c.copy_host_batch, 1u);
  EXPECT_EQ(c.copy, 0u);
  EXPECT_EQ(c.host_alloc, 1u);
  EXPECT_EQ(c.synchronize, 1u);
}

TEST_P(KvContentTest, PaddingIsWrittenAsZeroAndNotChecked) {
  // nvfp4, 1 head: K data 64 B + 8 B scales + 8 B padding.
  PagedKvCache cache(test::shape(1, KvCacheDtype::nvfp4, GetParam()), 2, *backend_);
  const PoolLayout layout = pool_layout(cache);
  const std::vector<BlockId> blocks = {1};
  const std::vector<TokenId> tokens = test::tokens_of(4);
  cache.poison_blocks(blocks, stream_);
  write_kv_content(cache, layout, blocks, tokens, stream_);
  const BlockRegionLayout k = cache.config().k_layout(0);
  ASSERT_GT(k.scale_padding, 0u);
  const auto host = cache.read_block(0, 1, stream_);
  for (std::size_t i = k.scale_offset + k.scale_bytes; i < k.total_bytes; ++i)
    EXPECT_EQ(host.k[i], 0) << "padding byte " << i;
  *test::byte_at(cache.k_cache_ptr(0, 1), k.total_bytes - 1) = 0xAB;
  EXPECT_TRUE(verify_kv_content(cache, layout, blocks, tokens, stream_).ok());
}

TEST_P(KvContentTest, EveryDataAndScaleByteIsChecked) {
  PagedKvCache cache(test::shape(2, KvCacheDtype::turbo3, GetParam(), 2), 2, *backend_);
  const PoolLayout layout = pool_layout(cache);
  const std::vector<BlockId> blocks = {0, 1};
  const std::vector<TokenId> tokens = test::tokens_of(8);
  write_kv_content(cache, layout, blocks, tokens, stream_);
  const KvCacheConfig& c = cache.config();
  std::uint64_t flipped = 0;
  for (std::size_t layer = 0; layer < c.num_layers; ++layer) {
    for (int kv = 0; kv < 2; ++kv) {
      const BlockRegionLayout r = kv == 0 ? c.k_layout(layer) : c.v_layout(layer);
      DevicePtr p = kv == 0 ? cache.k_cache_ptr(layer, 1) : cache.v_cache_ptr(layer, 1);
      for (std::size_t i = 0; i < r.data_bytes; ++i, ++flipped)
        *test::byte_at(p, i) ^= 0x10;
      for (std::size_t i = 0; i < r.scale_bytes; ++i, ++flipped)
        *test::byte_at(p, r.scale_offset + i) ^= 0x01;
    }
  }
  const ContentCheck check = verify_kv_content(cache, layout, blocks, tokens, stream_);
  EXPECT_EQ(check.bytes_wrong, flipped);
  EXPECT_EQ(check.bytes_wrong * 2, check.bytes_checked);
  EXPECT_FALSE(check.ok());
}

INSTANTIATE_TEST_SUITE_P(Layouts, KvContentTest,
                         ::testing::Values(KvCacheLayout::layer_major, KvCacheLayout::block_major),
                         [](const auto& p) { return std::string(to_string(p.param)); });

TEST(KvContentFunctionTest, DependsOnTokensAndPositionNotOnBlockIds) {
  auto backend = host_backend();
  StreamView stream = backend->default_stream();
  PagedKvCache cache(test::shape(2), 8, *backend);
  const PoolLayout layout = pool_layout(cache);
  const std::vector<TokenId> tokens = test::tokens_of(8);
  write_kv_content(cache, layout, std::vector<BlockId>{0, 1}, tokens, stream);
  write_kv_content(cache, layout, std::vector<BlockId>{5, 6}, tokens, stream);
  for (std::size_t layer = 0; layer < 3; ++layer) {
    EXPECT_EQ(cache.read_block(layer, 0, stream).k, cache.read_block(layer, 5, stream).k);
    EXPECT_EQ(cache.read_block(layer, 1, stream).v, cache.read_block(layer, 6, stream).v);
    EXPECT_NE(cache.read_block(layer, 0, stream).k, cache.read_block(layer, 1, stream).k);
    EXPECT_NE(cache.read_block(layer, 0, stream).k, cache.read_block(layer, 0, stream).v);
  }
  // The same token at another position, and another token at the same one,
  // give other bytes; the check sees a swapped pair of tokens.
  std::vector<TokenId> swapped = tokens;
  std::swap(swapped[2], swapped[3]);
  const ContentCheck check =
      verify_kv_content(cache, layout, std::vector<BlockId>{0, 1}, swapped, stream);
  EXPECT_GT(check.bytes_wrong, 0u);
  // Only the two vectors of each (layer, kv, head) differ: 2 tokens x 2
  // heads x (64 B of K + 32 B of V) x 3 layers, up to equal bytes by chance.
  EXPECT_LE(check.bytes_wrong, 2u * 2 * (64 + 32) * 3);
  EXPECT_GT(check.bytes_wrong, 2u * 2 * (64 + 32) * 3 * 9 / 10);
}

TEST(KvContentFunctionTest, PositionsPastTheLastTokenAreToken0) {
  auto backend = host_backend();
  StreamView stream = backend->default_stream();
  PagedKvCache cache(test::shape(2), 4, *backend);
  const PoolLayout layout = pool_layout(cache);
  write_kv_content(cache, layout, std::vector<BlockId>{0, 1}, test::tokens_of(5), stream);
  std::vector<TokenId> padded = test::tokens_of(5);
  padded.resize(8, 0);
  EXPECT_TRUE(verify_kv_content(cache, layout, std::vector<BlockId>{0, 1}, padded, stream).ok());
  write_kv_content(cache, layout, std::vector<BlockId>{2}, {}, stream);
  EXPECT_TRUE(
      verify_kv_content(cache, layout, std::vector<BlockId>{2}, std::vector<TokenId>(4, 0), stream)
          .ok());
}

// A TP-2 rank's share of a block is byte for byte the matching heads of the
// TP-1 block: data and scales, for every dtype family.
TEST(KvContentFunctionTest, TensorParallelRanksHoldTheirHeadsOfTheSameContent) {
  auto backend = host_backend();
  StreamView stream = backend->default_stream();
  const std::vector<TokenId> tokens = test::tokens_of(4);
  const std::vector<BlockId> block = {0};
  for (KvCacheDtype dtype :
       {KvCacheDtype::bf16, KvCacheDtype::fp8_e4m3, KvCacheDtype::nvfp4, KvCacheDtype::turbo3}) {
    PagedKvCache whole(test::shape(4, dtype), 1, *backend);
    write_kv_content(whole, pool_layout(whole), block, tokens, stream);
    for (std::uint32_t rank = 0; rank < 2; ++rank) {
      PagedKvCache half(test::shape(2, dtype), 1, *backend);
      write_kv_content(half, pool_layout(half, rank, 2), block, tokens, stream);
      for (std::size_t layer = 0; layer < 3; ++layer) {
        const BlockRegionLayout w = whole.config().k_layout(layer);
        const BlockRegionLayout h = half.config().k_layout(layer);
        const auto a = whole.read_block(layer, 0, stream).k;
        const auto b = half.read_block(layer, 0, stream).k;
        const std::size_t data = h.data_bytes, scales = h.scale_bytes;
        EXPECT_TRUE(std::equal(b.begin(), b.begin() + static_cast<long>(data),
                               a.begin() + static_cast<long>(rank * data)))
            << to_string(dtype) << " rank " << rank << " layer " << layer;
        EXPECT_TRUE(std::equal(b.begin() + static_cast<long>(h.scale_offset),
                               b.begin() + static_cast<long>(h.scale_offset + scales),
                               a.begin() + static_cast<long>(w.scale_offset + rank * scales)))
            << to_string(dtype) << " rank " << rank << " layer " << layer;
      }
      // And the other rank's layout does not verify it.
      EXPECT_FALSE(
          verify_kv_content(half, pool_layout(half, 1 - rank, 2), block, tokens, stream).ok());
    }
  }
}

TEST(KvContentErrorTest, RejectsBadArgumentsBeforeAnyCopy) {
  auto backend = host_backend();
  StreamView stream = backend->default_stream();
  PagedKvCache cache(test::shape(2), 4, *backend);
  const PoolLayout layout = pool_layout(cache);
  const std::vector<TokenId> tokens = test::tokens_of(9);
  backend->reset_call_counts();
  auto both = [&](const PoolLayout& l, std::vector<BlockId> ids,
                  std::span<const TokenId> t) -> std::string {
    const std::string w =
        message_of<InvalidArgument>([&] { write_kv_content(cache, l, ids, t, stream); });
    const std::string v =
        message_of<InvalidArgument>([&] { verify_kv_content(cache, l, ids, t, stream); });
    EXPECT_THAT(w, HasSubstr("write_kv_content"));
    EXPECT_THAT(v, HasSubstr("verify_kv_content"));
    return w;
  };
  EXPECT_THAT(both(layout, {0, 1}, tokens), HasSubstr("9 tokens do not fit 2 blocks of 4 tokens"));
  EXPECT_THAT(both(layout, {0, 4, 1}, tokens),
              HasSubstr("block id 4 (entry 1) is out of range (4 blocks)"));
  EXPECT_THAT(both(layout, {0, 1, 0}, tokens), HasSubstr("block id 0 appears twice"));

  PoolLayout l = layout;
  l.num_blocks = 5;
  EXPECT_THAT(both(l, {0, 1, 2}, tokens), HasSubstr("does not describe the cache (num_blocks"));
  l = layout;
  l.layout = KvCacheLayout::block_major;
  EXPECT_THAT(both(l, {0, 1, 2}, tokens), HasSubstr("layout: block_major in the layout"));
  l = layout;
  l.tp_rank = 1;
  EXPECT_THAT(both(l, {0, 1, 2}, tokens), HasSubstr("tp_rank 1 with tp_size 1"));
  l = layout;
  l.head_dim_k = 64;
  EXPECT_THAT(both(l, {0, 1, 2}, tokens), HasSubstr("head_dim_k differs"));
  l = pool_layout(cache, 0, 2);
  l.num_kv_heads = 1;  // 2 total heads at TP 2: not this cache's 2 heads
  EXPECT_THAT(both(l, {0, 1, 2}, tokens), HasSubstr("does not describe the cache"));
  EXPECT_EQ(backend->call_counts().device_ops(), 0u);
}

TEST(KvContentErrorTest, AnEmptyBatchWritesNothingAndChecksNothing) {
  auto backend = host_backend();
  StreamView stream = backend->default_stream();
  PagedKvCache cache(test::shape(2), 4, *backend);
  backend->reset_call_counts();
  write_kv_content(cache, pool_layout(cache), {}, {}, stream);
  const ContentCheck check = verify_kv_content(cache, pool_layout(cache), {}, {}, stream);
  EXPECT_EQ(check.bytes_checked, 0u);
  EXPECT_FALSE(check.ok());  // nothing checked is not a pass
  EXPECT_EQ(backend->call_counts().device_ops(), 0u);
}

// 64 llama-3-8b blocks (2 MiB each, 128 MiB) in one call each way, as the
// disagg workers use it; the speed is kvport_bench's (Transfer/content).
// Then a sequence's tail written past a cached prefix (first_block) equals
// the same blocks written whole.
TEST(KvContentFunctionTest, Llama3_8bBatchAndATailPastACachedPrefix) {
  KvCacheConfig c;
  c.num_layers = 32;
  c.block_size = 16;
  c.num_kv_heads = 8;
  c.head_dim_k = 128;
  c.head_dim_v = 128;
  c.dtype = KvCacheDtype::bf16;
  auto backend = host_backend(std::size_t{1} << 30);
  StreamView stream = backend->default_stream();
  PagedKvCache cache(c, 70, *backend);
  const PoolLayout layout = pool_layout(cache);
  std::vector<BlockId> blocks(64);
  std::iota(blocks.begin(), blocks.end(), 0);
  const std::vector<TokenId> tokens = test::tokens_of(64 * 16 - 3);
  write_kv_content(cache, layout, blocks, tokens, stream);
  const ContentCheck check = verify_kv_content(cache, layout, blocks, tokens, stream);
  EXPECT_TRUE(check.ok());
  EXPECT_EQ(check.bytes_checked, 64u * 2 * test::kMiB);
  // The last 3 blocks again, into blocks 64..66, as a tail from block 61.
  const std::vector<BlockId> tail{64, 65, 66};
  write_kv_content(cache, layout, tail, tokens, stream, 61);
  EXPECT_TRUE(verify_kv_content(cache, layout, tail, tokens, stream, 61).ok());
  // The tail's bytes depend on its positions: the blocks before differ.
  EXPECT_FALSE(verify_kv_content(cache, layout, std::vector<BlockId>{64},
                                 std::span<const TokenId>(tokens).first(61 * 16), stream, 60)
                   .ok());
  std::vector<BlockId> whole(blocks.begin(), blocks.begin() + 61);
  whole.insert(whole.end(), tail.begin(), tail.end());
  EXPECT_TRUE(verify_kv_content(cache, layout, whole, tokens, stream).ok());
  // A tail that does not reach the last token is rejected.
  EXPECT_THROW(write_kv_content(cache, layout, tail, tokens, stream, 60), InvalidArgument);
  EXPECT_THROW(verify_kv_content(cache, layout, tail, tokens, stream, 60), InvalidArgument);
}

}  // namespace
}  // namespace kvport::transfer
