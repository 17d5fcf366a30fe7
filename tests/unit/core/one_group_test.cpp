// SPDX-License-Identifier: Apache-2.0
// A model of one full-attention group is the one-group case of groups:
// HybridKvCache::over() views a prefix cache (or a plain PagedKvCache) as a
// cache of one group, and BlockTable is a HybridBlockTable over that view.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <vector>

#include "core_test_util.hpp"
#include "kvport/core/block_table.hpp"
#include "kvport/core/host_tier.hpp"
#include "kvport/core/hybrid_block_table.hpp"
#include "kvport/core/hybrid_host_tier.hpp"
#include "kvport/core/hybrid_kv_cache.hpp"
#include "kvport/core/paged_kv_cache.hpp"
#include "kvport/core/prefix_cache.hpp"
#include "kvport/platform/error.hpp"

namespace kvport {
namespace {

using test::host_backend;
using test::small_config;  // 3 layers, block_size 4, 128-byte K and V regions
using test::tokens;
using ::testing::ElementsAreArray;

class OneGroupTest : public ::testing::Test {
 protected:
  std::unique_ptr<Backend> backend = host_backend();
  Stream stream = backend->create_stream();
  PagedKvCache cache{small_config(KvCacheLayout::layer_major), 6, *backend};
  PrefixCache pc{cache};
};

TEST_F(OneGroupTest, OverAPrefixCacheIsOneFullAttentionGroupOfItsPool) {
  HybridKvCache& view = HybridKvCache::over(pc);
  EXPECT_EQ(&view, &HybridKvCache::over(pc));  // made once, kept by the prefix cache
  ASSERT_EQ(view.num_groups(), 1u);
  EXPECT_EQ(view.group(0).spec.kind, LayerKind::full_attention);
  EXPECT_EQ(view.group(0).layers, (std::vector<std::size_t>{0, 1, 2}));
  EXPECT_EQ(view.num_layers(), 3u);
  EXPECT_EQ(view.block_size(), 4u);
  EXPECT_EQ(&view.group_cache(0), &cache);
  EXPECT_EQ(&view.prefix_cache(0), &pc);
  EXPECT_TRUE(view.caches_prefixes());
  EXPECT_FALSE(view.in_shared_pool(0));
  EXPECT_EQ(view.shared_pool(), nullptr);
  EXPECT_EQ(view.total_bytes(), cache.total_bytes());
  ASSERT_TRUE(view.locate(2).has_value());
  EXPECT_EQ(view.locate(2)->group, 0u);
  EXPECT_EQ(view.locate(2)->index, 2u);
  EXPECT_THROW((void)view.group(1), OutOfRange);
  EXPECT_THROW((void)view.locate(3), OutOfRange);
  EXPECT_TRUE(view.check_invariants().ok);
}

TEST_F(OneGroupTest, BlockTableIsTheOneGroupTableOverTheView) {
  BlockTable t(pc, /*extra_key=*/7);
  const HybridBlockTable& g = t.group_table();
  EXPECT_EQ(&g.cache(), &HybridKvCache::over(pc));
  EXPECT_TRUE(g.copies_last_block());  // BlockTable's compute_last_token rule
  t.append_tokens(tokens(10), stream);
  EXPECT_THAT(g.blocks(0), ElementsAreArray(t.blocks()));
  EXPECT_EQ(g.num_tokens(), 10u);
  EXPECT_EQ(HybridKvCache::over(pc).blocks_in_use(0), 3u);
  t.release();
  EXPECT_EQ(HybridKvCache::over(pc).blocks_in_use(0), 0u);
  EXPECT_EQ(pc.num_cached_blocks(), 2u);  // the two full blocks stay cached

  // A table of the same key over the view hits what BlockTable cached.
  HybridBlockTable h(HybridKvCache::over(pc), 7);
  EXPECT_EQ(h.reuse_cached_prefix(tokens(10), stream), 8u);
  EXPECT_EQ(HybridKvCache::over(pc).hit_counters().hit_tokens, 8u);
}

TEST_F(OneGroupTest, OverAPlainCacheAllocatesAndFreesWithoutCaching) {
  HybridKvCache& view = HybridKvCache::over(cache);
  EXPECT_EQ(&view, &HybridKvCache::over(cache));
  EXPECT_FALSE(view.caches_prefixes());
  EXPECT_THROW((void)view.prefix_cache(0), InvalidArgument);
  {
    HybridBlockTable t(view);
    EXPECT_EQ(t.reuse_cached_prefix(tokens(8), stream), 0u);
    t.append_tokens(tokens(8), stream);
    EXPECT_EQ(t.num_live_blocks(0), 2u);
    EXPECT_EQ(cache.num_free_blocks(), 4u);
    EXPECT_EQ(view.blocks_in_use(0), 2u);
    HybridBlockTable child = t.fork(stream);
    t.append_tokens(tokens(1, 50), stream);  // a fresh block, nothing shared to copy
    EXPECT_EQ(cache.num_free_blocks(), 3u);
    EXPECT_TRUE(view.check_invariants().ok);
  }
  EXPECT_EQ(cache.num_free_blocks(), 6u);  // nothing was cached: every block is free
  EXPECT_EQ(pc.num_cached_blocks(), 0u);
  EXPECT_TRUE(cache.check_invariants().ok);
}

// The prompt's block hashes, computed by the lookup, are taken by the
// appends that fill those blocks with the prompt's tokens, and only by them.
TEST_F(OneGroupTest, AppendedBlocksAreRegisteredUnderTheHashesOfTheirOwnTokens) {
  const std::vector<TokenId> prompt = tokens(12);  // 3 blocks
  const std::vector<BlockHash> want = hash_full_blocks(prompt, 4);
  {
    BlockTable t(pc);
    ASSERT_EQ(t.reuse_cached_prefix(prompt, stream), 0u);
    t.append_tokens(std::span(prompt).first(5), stream);  // the prompt, in two appends
    t.append_tokens(std::span(prompt).subspan(5), stream);
    for (std::size_t i = 0; i < 3; ++i)
      EXPECT_EQ(pc.find(want[i]), t.blocks()[i]) << "block " << i;
  }
  BlockTable u(pc);
  std::vector<TokenId> other = tokens(12, 100);
  ASSERT_EQ(u.reuse_cached_prefix(other, stream), 0u);
  other[5] = 7;  // block 1 differs from what was looked up
  u.append_tokens(other, stream);
  const std::vector<BlockHash> got = hash_full_blocks(other, 4);
  for (std::size_t i = 0; i < 3; ++i)
    EXPECT_EQ(pc.find(got[i]), u.blocks()[i]) << "block " << i;
  EXPECT_FALSE(pc.find(hash_full_blocks(tokens(12, 100), 4)[1]).has_value());
}

TEST_F(OneGroupTest, ExhaustionOfOneGroupNamesNoGroup) {
  BlockTable t(pc);
  try {
    t.append_tokens(tokens(28), stream);  // 7 blocks of 6
    FAIL() << "no CacheExhausted";
  } catch (const CacheExhausted& e) {
    EXPECT_THAT(e.what(), ::testing::HasSubstr("needs 7 blocks, 6 are free or evictable"));
  }
  EXPECT_TRUE(t.empty());
}

// Over one group the last block of a fully cached prompt is copied even when
// the hit came up from a lower tier (a cache of several groups does not copy
// there: its hit is decided before anything is brought in).
TEST_F(OneGroupTest, CopyLastBlockWithALowerTierOverOneGroup) {
  HostTierOptions o;
  o.num_host_blocks = 8;
  HostTier tier(pc, o);
  auto cache_prompt = [&](TokenId first) {
    BlockTable t(pc);
    t.append_tokens(tokens(8, first), stream);
    for (std::size_t i = 0; i < t.num_blocks(); ++i)
      test::write_pattern_block(cache, t.blocks()[i], first + i, stream);
    tier.poll();
  };
  cache_prompt(100);
  cache_prompt(200);
  cache_prompt(300);
  cache_prompt(400);  // 6 device blocks: 100's were evicted to the host
  tier.synchronize();
  const std::vector<BlockHash> a = hash_full_blocks(tokens(8, 100), 4);
  ASSERT_FALSE(pc.find(a[1]).has_value());
  ASSERT_TRUE(tier.is_on_host(a[1]));

  HybridKvCache& view = HybridKvCache::over(pc);
  HybridBlockTable h(view);
  h.set_copy_last_block(true);
  const std::uint64_t onloaded = view.hit_counters().lower_tier_blocks;
  EXPECT_EQ(h.reuse_cached_prefix(tokens(8, 100), stream), 7u);
  EXPECT_EQ(view.hit_counters().lower_tier_blocks - onloaded, 2u);
  EXPECT_EQ(h.copy_on_writes(), 1u);
  ASSERT_EQ(h.num_live_blocks(0), 2u);
  backend->synchronize(stream);
  EXPECT_TRUE(test::holds_pattern_block(cache, h.blocks(0)[0], 100, stream));
  EXPECT_TRUE(test::holds_pattern_block(cache, h.blocks(0)[1], 101, stream));  // the copy
  EXPECT_NE(pc.find(a[1]), h.blocks(0)[1]);  // the cached block stays untouched
  EXPECT_TIER_INVARIANTS(tier);
}

// The tier over groups of a one-group cache is a HostTier under the prefix
// cache: BlockTables hit what it wrote back, as under a HostTier of their own.
TEST_F(OneGroupTest, TheHostTierOverGroupsOfOneGroupIsTheHostTierOfThePrefixCache) {
  HybridKvCache& view = HybridKvCache::over(pc);
  HybridHostTierOptions o;
  o.slots_per_group = {8};
  o.free_watermark = 1;
  o.host_free_watermark = 2;  // the options reach the group's HostTier
  HybridHostTier tier(view, o);
  ASSERT_NE(tier.group_tier(0), nullptr);
  EXPECT_EQ(pc.tier(), tier.group_tier(0));
  EXPECT_EQ(tier.group_tier(0)->options().free_watermark, 1u);
  EXPECT_EQ(tier.group_tier(0)->options().host_free_watermark, 2u);
  for (TokenId first : {100, 200, 300, 400}) {
    BlockTable t(pc);
    t.append_tokens(tokens(8, first), stream);
    for (std::size_t i = 0; i < t.num_blocks(); ++i)
      test::write_pattern_block(cache, t.blocks()[i], first + i, stream);
    tier.poll();
  }
  tier.synchronize();
  const std::vector<BlockHash> a = hash_full_blocks(tokens(8, 100), 4);
  ASSERT_FALSE(pc.find(a[0]).has_value());  // evicted, written back
  BlockTable t(pc);
  EXPECT_EQ(t.reuse_cached_prefix(tokens(9, 100), stream), 8u);
  EXPECT_EQ(tier.group_tier(0)->counters().onloads, 2u);
  backend->synchronize(stream);
  EXPECT_TRUE(test::holds_pattern_block(cache, t.blocks()[0], 100, stream));
  EXPECT_TRUE(test::holds_pattern_block(cache, t.blocks()[1], 101, stream));
}

}  // namespace
}  // namespace kvport
