// SPDX-License-Identifier: Apache-2.0
// SharedBlockPool: one pool over attention groups. Its own errors; caches over
// it (shared memory, one free list, refcounts per group, the double-free
// guard, invariants); HybridKvCache with a shared pool (memory that moves
// between groups, one LRU order across groups, admission over the pool); and
// the planner's shared pool.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <limits>
#include <set>
#include <span>
#include <string>
#include <vector>

#include "core_test_util.hpp"
#include "kvport/core/hybrid_block_table.hpp"
#include "kvport/core/hybrid_kv_cache.hpp"
#include "kvport/core/kv_cache_plan.hpp"
#include "kvport/core/shared_block_pool.hpp"
#include "kvport/platform/error.hpp"

namespace kvport {
namespace {

using test::host_backend;
using test::tokens;
using ::testing::HasSubstr;

constexpr std::size_t kBs = 4;

// 2 window layers (W = 8) and 2 full layers, interleaved as gpt-oss's: equal
// pages and layer counts, so the two groups share one pool.
HybridKvCacheConfig gpt_oss_like() {
  HybridKvCacheConfig c;
  c.block_size = kBs;
  c.layers = {LayerSpec::sliding_window(8, 1, 8, 8), LayerSpec::full_attention(1, 8, 8),
              LayerSpec::sliding_window(8, 1, 8, 8), LayerSpec::full_attention(1, 8, 8)};
  return c;
}

KvCacheConfig two_layers() {
  return group_pool_config(group_layers(gpt_oss_like().layers, kBs)[1], kBs,
                           KvCacheLayout::layer_major);
}

SharedPoolGeometry geometry_of(const KvCacheConfig& c) {
  return SharedPoolGeometry{c.num_layers, c.k_block_bytes(0), c.v_block_bytes(0)};
}

TEST(SharedBlockPool, Errors) {
  auto backend = host_backend();
  const SharedPoolGeometry geo = geometry_of(two_layers());
  EXPECT_THAT([&] { SharedBlockPool(0, geo, *backend); },
              ::testing::ThrowsMessage<InvalidArgument>(HasSubstr("num_blocks must be > 0")));
  EXPECT_THROW(SharedBlockPool(8, SharedPoolGeometry{0, 64, 64}, *backend), InvalidArgument);
  EXPECT_THROW(SharedBlockPool(8, SharedPoolGeometry{2, 0, 64}, *backend), InvalidArgument);
  EXPECT_THROW(SharedBlockPool(std::size_t{1} << 33, geo, *backend), InvalidArgument);
  EXPECT_THROW(SharedBlockPool(1u << 20, SharedPoolGeometry{2, std::size_t{1} << 60, 0}, *backend),
               InvalidArgument);
  SharedBlockPool pool(8, geo, *backend);
  EXPECT_EQ(pool.total_bytes(), 8 * geo.bytes_per_block());
  EXPECT_THROW((void)pool.k_pool(2), OutOfRange);
  SharedBlockPool k_only(8, SharedPoolGeometry{1, 64, 0}, *backend);
  EXPECT_THROW((void)k_only.v_pool(0), InvalidArgument);
}

TEST(SharedBlockPool, CachesOverItShareMemoryAndOneFreeList) {
  auto backend = host_backend();
  const KvCacheConfig config = two_layers();
  SharedBlockPool pool(6, geometry_of(config), *backend);
  PagedKvCache a(config, pool);
  PagedKvCache b(config, pool);
  EXPECT_EQ(a.shared_pool(), &pool);
  EXPECT_EQ(pool.num_members(), 2u);
  // Page b of slot l is the same memory in every group.
  EXPECT_EQ(a.k_cache_ptr(1, 3).address(), b.k_cache_ptr(1, 3).address());
  EXPECT_EQ(a.v_cache_ptr(0, 5).address(), pool.v_pool(0).address() + 5 * config.v_block_bytes(0));

  std::set<BlockId> ids;
  for (int i = 0; i < 3; ++i) {
    ids.insert(a.alloc_block());
    ids.insert(b.alloc_block());
  }
  EXPECT_EQ(ids.size(), 6u);  // no id in two groups
  EXPECT_EQ(a.num_free_blocks(), 0u);
  EXPECT_EQ(b.num_free_blocks(), 0u);
  EXPECT_EQ(a.num_blocks_in_use(), 3u);
  EXPECT_THROW((void)a.alloc_block(), CacheExhausted);
  EXPECT_FALSE(b.try_alloc_block().has_value());

  // A free in one group is an allocation in the other (LIFO).
  const BlockId of_a = *ids.begin();
  const bool a_holds = a.ref_count(of_a) != 0;
  PagedKvCache& holder = a_holds ? a : b;
  PagedKvCache& other = a_holds ? b : a;
  // The double-free guard: the other group does not hold it.
  EXPECT_FALSE(other.dec_ref(of_a));
  EXPECT_EQ(other.counters().ignored_double_frees, 1u);
  EXPECT_TRUE(holder.free_block(of_a));
  EXPECT_EQ(other.alloc_block(), of_a);
  EXPECT_TRUE(pool.check_invariants().ok) << pool.check_invariants().to_string();
  EXPECT_TRUE(a.check_invariants().ok) << a.check_invariants().to_string();
  EXPECT_TRUE(b.check_invariants().ok) << b.check_invariants().to_string();
}

TEST(SharedBlockPool, ACacheThatGoesGivesItsBlocksBack) {
  auto backend = host_backend();
  const KvCacheConfig config = two_layers();
  SharedBlockPool pool(4, geometry_of(config), *backend);
  PagedKvCache a(config, pool);
  {
    PagedKvCache b(config, pool);
    (void)b.alloc_block();
    (void)b.alloc_block();
    EXPECT_EQ(pool.num_free_blocks(), 2u);
    PagedKvCache moved(std::move(b));   // the pool follows the move
    EXPECT_EQ(pool.num_members(), 2u);  // a and moved; b is no member any more
  }
  EXPECT_EQ(pool.num_members(), 1u);
  EXPECT_EQ(pool.num_free_blocks(), 4u);
  EXPECT_TRUE(pool.check_invariants().ok) << pool.check_invariants().to_string();
}

TEST(SharedBlockPool, CacheConstructorErrors) {
  auto backend = host_backend();
  const KvCacheConfig config = two_layers();
  SharedBlockPool pool(4, geometry_of(config), *backend);
  KvCacheConfig block_major = config;
  block_major.layout = KvCacheLayout::block_major;
  EXPECT_THAT([&] { PagedKvCache(block_major, pool); },
              ::testing::ThrowsMessage<InvalidArgument>(HasSubstr("layer-major")));
  KvCacheConfig three = config;
  three.num_layers = 3;
  EXPECT_THAT([&] { PagedKvCache(three, pool); },
              ::testing::ThrowsMessage<InvalidArgument>(HasSubstr("do not fit")));
  KvCacheConfig wide = config;
  wide.head_dim_k = 16;
  wide.head_dim_v = 16;
  EXPECT_THAT([&] { PagedKvCache(wide, pool); },
              ::testing::ThrowsMessage<InvalidArgument>(HasSubstr("pages")));
  // A trace that cannot be sized fails after the pools are registered: the
  // registration goes with it, and the pool takes a cache afterwards.
  PagedKvCacheOptions huge_trace;
  huge_trace.trace = true;
  huge_trace.trace_depth = std::numeric_limits<std::size_t>::max();
  EXPECT_THAT([&] { PagedKvCache(config, pool, huge_trace); },
              ::testing::ThrowsMessage<InvalidArgument>(HasSubstr("overflows")));
  EXPECT_EQ(pool.num_members(), 0u);
  PagedKvCache ok(config, pool);
  EXPECT_EQ(pool.num_members(), 1u);
  EXPECT_EQ(ok.alloc_block(), 0u);
}

class SharedHybridTest : public ::testing::Test {
 protected:
  std::unique_ptr<Backend> backend = host_backend();
  Stream stream = backend->create_stream();

  static HybridPoolSizes shared(std::size_t blocks) {
    HybridPoolSizes s;
    s.shared_blocks = blocks;
    s.group_blocks = {0, 0};
    return s;
  }
  static void expect_ok(const HybridKvCache& cache) {
    const InvariantReport r = cache.check_invariants();
    EXPECT_TRUE(r.ok) << r.to_string();
    EXPECT_EQ(r.free_blocks + r.evictable_blocks + r.blocks_in_use, r.blocks_checked);
  }
};

TEST_F(SharedHybridTest, BothGroupsDrawFromOnePool) {
  HybridKvCache cache(gpt_oss_like(), shared(40), *backend);
  ASSERT_NE(cache.shared_pool(), nullptr);
  EXPECT_TRUE(cache.in_shared_pool(0));
  EXPECT_TRUE(cache.in_shared_pool(1));
  EXPECT_THROW((void)cache.in_shared_pool(2), OutOfRange);
  EXPECT_EQ(cache.total_bytes(), cache.shared_pool()->total_bytes());
  EXPECT_EQ(cache.total_bytes(), 40 * 2 * 2 * cache.group_cache(0).config().k_block_bytes(0));
  const InvariantReport r = cache.check_invariants();
  EXPECT_EQ(r.blocks_checked, 40u);
  EXPECT_EQ(r.free_blocks, 40u);
  expect_ok(cache);
}

TEST_F(SharedHybridTest, MemoryGoesToTheGroupThatNeedsIt) {
  // 40 blocks shared by a window group and a full group. One long sequence,
  // appended 4 tokens at a time (prefill in chunks, then decode): the window
  // keeps at most 4 blocks, and the full group takes everything else, far
  // more than any fixed split would have left it.
  HybridKvCache cache(gpt_oss_like(), shared(40), *backend);
  HybridBlockTable t(cache);
  TokenId next = 1;
  while (t.can_append(kBs)) {
    t.append_tokens(tokens(kBs, next), stream);
    next += kBs;
  }
  EXPECT_LE(t.num_live_blocks(0), 4u);
  EXPECT_GE(t.num_live_blocks(1), 36u);
  EXPECT_GE(t.num_live_blocks(0) + t.num_live_blocks(1), 39u);
  // The window's released blocks were cached and then evicted for the full
  // group's blocks.
  EXPECT_GT(cache.prefix_cache(0).counters().evictions, 0u);
  EXPECT_THROW(t.append_tokens(tokens(kBs, next), stream), CacheExhausted);
  expect_ok(cache);
  t.release();
  EXPECT_EQ(cache.blocks_in_use(0) + cache.blocks_in_use(1), 0u);
  // Now short sequences: 5 of 16 tokens hold 4 window and 4 full blocks
  // each, 20 window blocks, where a split by the peak needs of long requests
  // (about 36 : 4) would have left the window group 4.
  std::vector<HybridBlockTable> many;
  for (int i = 0; i < 5; ++i) {
    many.emplace_back(cache);
    many.back().append_tokens(tokens(16, static_cast<TokenId>(5000 + 100 * i)), stream);
  }
  std::size_t window = 0;
  for (const HybridBlockTable& m : many)
    window += m.num_live_blocks(0);
  EXPECT_EQ(window, 20u);
  EXPECT_EQ(cache.blocks_in_use(0), 20u);
  expect_ok(cache);
}

TEST_F(SharedHybridTest, AdmissionCountsTheGroupsTogether) {
  HybridKvCache cache(gpt_oss_like(), shared(12), *backend);
  HybridBlockTable t(cache);
  // 40 tokens: 10 full blocks + 3 window blocks (after the freeing rules the
  // window keeps 3, but an append of 40 from empty needs 10 in each group:
  // nothing is released before the tokens are computed).
  EXPECT_FALSE(t.can_append(40));  // 20 > 12, though each group alone needs 10 <= 12
  EXPECT_THAT([&] { t.append_tokens(tokens(40), stream); },
              ::testing::ThrowsMessage<CacheExhausted>(HasSubstr("shared pool")));
  EXPECT_TRUE(t.empty());
  EXPECT_EQ(cache.shared_pool()->num_free_blocks(), 12u);
  EXPECT_TRUE(t.can_append(24));  // 6 + 6
  t.append_tokens(tokens(24), stream);
  expect_ok(cache);
}

TEST_F(SharedHybridTest, EvictionFollowsOneLruOrderAcrossGroups) {
  HybridKvCache cache(gpt_oss_like(), shared(16), *backend);
  // Sequence a (8 blocks: 4 + 4), released first; then b (8), released.
  {
    HybridBlockTable a(cache);
    a.append_tokens(tokens(16, 1), stream);
  }
  {
    HybridBlockTable b(cache);
    b.append_tokens(tokens(16, 500), stream);
  }
  EXPECT_EQ(cache.shared_pool()->num_free_blocks(), 0u);
  EXPECT_EQ(cache.shared_pool()->num_evictable_blocks(), 16u);
  // A new sequence of 16 tokens needs 8 blocks: a's blocks (released first,
  // in both groups) go; b stays hittable in both groups.
  HybridBlockTable c(cache);
  c.append_tokens(tokens(16, 9000), stream);
  HybridBlockTable hit_b(cache);
  EXPECT_EQ(hit_b.reuse_cached_prefix(tokens(17, 500), stream), 16u);
  HybridBlockTable hit_a(cache);
  EXPECT_EQ(hit_a.reuse_cached_prefix(tokens(17, 1), stream), 0u);
  expect_ok(cache);
}

// Sliding-window blocks before a hit point slide out of every sequence that
// shares the prefix, while the full-attention chain before them stays held:
// under pressure they are evicted and the chain cannot be hit.
// set_keep_shared_windows and keep_hit_point hold them while the sequence
// runs. Run with keeping on and off: off, the same pressure loses the hits.
class KeptWindowsTest : public SharedHybridTest, public ::testing::WithParamInterface<bool> {
 protected:
  // tokens(n, first) in appends of one block.
  static void append_blocks(HybridBlockTable& t, const std::vector<TokenId>& all,
                            StreamView stream) {
    for (std::size_t at = 0; at < all.size(); at += kBs)
      t.append_tokens(std::span<const TokenId>(all).subspan(at, kBs), stream);
  }
  static std::vector<TokenId> concat(std::vector<TokenId> a, const std::vector<TokenId>& b) {
    a.insert(a.end(), b.begin(), b.end());
    return a;
  }
};

TEST_P(KeptWindowsTest, ASharedPrefixAndAPromptEndStayHittableUnderPressure) {
  const bool keep = GetParam();
  HybridKvCache cache(gpt_oss_like(), shared(40), *backend);
  const std::vector<TokenId> prefix = tokens(16, 1);  // 4 blocks; its window: blocks 2, 3
  {
    HybridBlockTable a(cache);
    append_blocks(a, concat(prefix, tokens(16, 100)), stream);
  }
  // b hits the prefix (16 tokens) and computes 16 more: its window slides
  // past the hit point.
  HybridBlockTable b(cache);
  b.set_keep_shared_windows(keep);
  EXPECT_EQ(b.keeps_shared_windows(), keep);
  const std::vector<TokenId> b_prompt = concat(prefix, tokens(16, 200));
  ASSERT_EQ(b.reuse_cached_prefix(b_prompt, stream), 16u);
  append_blocks(b, std::vector<TokenId>(b_prompt.begin() + 16, b_prompt.end()), stream);
  EXPECT_EQ(b.num_kept_blocks(0), keep ? 2u : 0u);  // window blocks 2 and 3
  EXPECT_EQ(b.num_kept_blocks(1), 0u);              // full attention: held anyway
  if (keep) b.keep_hit_point();                     // the end of b's prompt: blocks 6, 7
  EXPECT_EQ(b.num_kept_blocks(0), keep ? 4u : 0u);
  // Decode 8 tokens: the window slides past the prompt's end too.
  append_blocks(b, tokens(8, 300), stream);
  EXPECT_EQ(b.num_live_blocks(0), 3u);
  expect_ok(cache);

  // Pressure: d takes every block it can, evicting whatever is evictable.
  HybridBlockTable d(cache);
  TokenId next = 5000;
  while (d.can_append(kBs)) {
    d.append_tokens(tokens(kBs, next), stream);
    next += kBs;
  }
  EXPECT_EQ(cache.shared_pool()->num_evictable_blocks(), 0u);
  expect_ok(cache);

  // c shares the prefix; e continues b's prompt (the next turn).
  HybridBlockTable c(cache);
  EXPECT_EQ(c.reuse_cached_prefix(concat(prefix, tokens(8, 400)), stream), keep ? 16u : 0u);
  HybridBlockTable e(cache);
  EXPECT_EQ(e.reuse_cached_prefix(concat(b_prompt, tokens(8, 500)), stream), keep ? 32u : 0u);
  expect_ok(cache);

  // The kept references go with the table; fork copies the setting, not them.
  HybridBlockTable f = b.fork(stream);
  EXPECT_EQ(f.keeps_shared_windows(), keep);
  EXPECT_EQ(f.num_kept_blocks(0), 0u);
  EXPECT_THAT([&] { (void)b.num_kept_blocks(2); },
              ::testing::ThrowsMessage<OutOfRange>(HasSubstr("group 2 out of range")));
  for (HybridBlockTable* t : {&b, &c, &d, &e, &f})
    t->release();
  EXPECT_EQ(b.num_kept_blocks(0), 0u);
  EXPECT_EQ(cache.blocks_in_use(0) + cache.blocks_in_use(1), 0u);
  expect_ok(cache);
}

INSTANTIATE_TEST_SUITE_P(KeepOrNot, KeptWindowsTest, ::testing::Bool(),
                         [](const ::testing::TestParamInfo<bool>& p) {
                           return p.param ? std::string("Kept") : std::string("NotKept");
                         });

TEST_F(SharedHybridTest, DemotedBlocksOfAnyGroupGoBeforeOtherBlocks) {
  // a (4 full + 4 window blocks) is released first; then b's window slides,
  // its first window block demoted, and b ends. A new sequence's 2 blocks
  // take b's demoted window block first, then the oldest released block
  // (a's last window block), and a's full-attention chain stays whole.
  HybridKvCache cache(gpt_oss_like(), shared(16), *backend);
  {
    HybridBlockTable a(cache);
    a.append_tokens(tokens(16, 1), stream);
  }
  const std::vector<BlockHash> a_hashes = hash_full_blocks(tokens(16, 1), kBs);
  const std::vector<BlockHash> b_hashes = hash_full_blocks(tokens(16, 500), kBs);
  {
    HybridBlockTable b(cache);
    for (TokenId t = 500; t < 516; t += kBs)
      b.append_tokens(tokens(kBs, t), stream);
    EXPECT_EQ(b.blocks(0)[0], kNullBlock);  // slid out, demoted
  }
  EXPECT_EQ(cache.shared_pool()->num_free_blocks(), 0u);
  ASSERT_TRUE(cache.prefix_cache(0).find(b_hashes[0]).has_value());
  HybridBlockTable c(cache);
  c.append_tokens(tokens(kBs, 9000), stream);  // 1 full + 1 window block
  EXPECT_FALSE(cache.prefix_cache(0).find(b_hashes[0]).has_value()) << "demoted: first out";
  EXPECT_FALSE(cache.prefix_cache(0).find(a_hashes[3]).has_value()) << "then the oldest";
  EXPECT_TRUE(cache.prefix_cache(1).find(a_hashes[3]).has_value());
  HybridBlockTable hit_a(cache);
  EXPECT_EQ(hit_a.reuse_cached_prefix(tokens(17, 1), stream), 12u);
  HybridBlockTable hit_b(cache);
  EXPECT_EQ(hit_b.reuse_cached_prefix(tokens(17, 500), stream), 16u);
  expect_ok(cache);
}

TEST_F(SharedHybridTest, ConstructorErrors) {
  // Unequal layer counts (3 window + 1 full: half the slots of a full block
  // unused): no shared pool can be built.
  HybridKvCacheConfig c = gpt_oss_like();
  c.layers.back() = c.layers.front();
  EXPECT_THAT([&] { HybridKvCache(c, shared(16), *backend); },
              ::testing::ThrowsMessage<InvalidArgument>(HasSubstr("no two groups can share")));
  HybridPoolSizes wrong = shared(16);
  wrong.group_blocks = {0};
  EXPECT_THROW(HybridKvCache(gpt_oss_like(), wrong, *backend), InvalidArgument);
  // A state group beside shared attention groups keeps its own pool (0 slots refused).
  HybridKvCacheConfig with_state = gpt_oss_like();
  with_state.layers.push_back(LayerSpec::recurrent_state({StateTensor{"s", {4, 4}}}));
  HybridPoolSizes sizes = shared(16);
  sizes.group_blocks = {0, 0, 0};
  EXPECT_THAT([&] { HybridKvCache(with_state, sizes, *backend); },
              ::testing::ThrowsMessage<InvalidArgument>(HasSubstr("has 0 blocks")));
  sizes.group_blocks = {0, 0, 4};
  HybridKvCache ok(with_state, sizes, *backend);
  EXPECT_FALSE(ok.in_shared_pool(2));
  EXPECT_EQ(ok.group_cache(2).num_blocks(), 4u);
  EXPECT_EQ(ok.total_bytes(), ok.shared_pool()->total_bytes() + ok.group_cache(2).total_bytes());
}

TEST(SharedPoolPlan, AttentionGroupsOfMatchingPagesShareTheirBudget) {
  const std::vector<KvCacheGroup> groups = group_layers(gpt_oss_like().layers, kBs);
  KvCachePlanRequest want;
  want.budget_bytes = 1 << 20;
  want.max_context_tokens = 1000;
  want.shared_pool = true;
  const KvCachePlan shared = plan_kv_cache(groups, kBs, want);
  ASSERT_GT(shared.shared_blocks, 0u);
  EXPECT_EQ(shared.max_context_tokens, 1000u);
  EXPECT_TRUE(shared.groups[0].shared);
  EXPECT_TRUE(shared.groups[1].shared);
  EXPECT_EQ(shared.groups[1].num_blocks, shared.shared_blocks);
  EXPECT_LE(shared.total_bytes, want.budget_bytes);
  EXPECT_EQ(shared.total_bytes, shared.shared_bytes);
  EXPECT_EQ(shared.shared_bytes, shared.shared_blocks * shared.shared_geometry.bytes_per_block());

  want.shared_pool = false;
  const KvCachePlan separate = plan_kv_cache(groups, kBs, want);
  EXPECT_EQ(separate.shared_blocks, 0u);
  EXPECT_FALSE(separate.groups[0].shared);
  // The shared pool has the blocks the two pools had together (up to rounding).
  EXPECT_GE(shared.shared_blocks + 2,
            (separate.groups[0].num_blocks + separate.groups[1].num_blocks) / 1);
  EXPECT_GE(shared.max_concurrent_requests, separate.max_concurrent_requests);

  auto backend = host_backend();
  HybridKvCache cache(gpt_oss_like(), shared, *backend);
  ASSERT_NE(cache.shared_pool(), nullptr);
  EXPECT_EQ(cache.shared_pool()->num_blocks(), shared.shared_blocks);
  HybridKvCache apart(gpt_oss_like(), separate, *backend);
  EXPECT_EQ(apart.shared_pool(), nullptr);
}

TEST(SharedPoolPlan, NoSharedPoolWherePagesOrLayerCountsDiffer) {
  std::vector<std::size_t> members{7};
  // Unequal layer counts (3 window + 1 full).
  std::vector<LayerSpec> layers = gpt_oss_like().layers;
  layers.back() = layers.front();
  EXPECT_FALSE(
      shared_pool_geometry(group_layers(layers, kBs), kBs, KvCacheLayout::layer_major, &members));
  EXPECT_TRUE(members.empty());
  // Other pages (wider heads in the window group).
  layers = gpt_oss_like().layers;
  layers[0] = layers[2] = LayerSpec::sliding_window(8, 2, 8, 8);
  EXPECT_FALSE(shared_pool_geometry(group_layers(layers, kBs), kBs, KvCacheLayout::layer_major));
  // Block-major layout.
  EXPECT_FALSE(shared_pool_geometry(group_layers(gpt_oss_like().layers, kBs), kBs,
                                    KvCacheLayout::block_major));
  // One attention group.
  layers = {LayerSpec::full_attention(1, 8, 8), LayerSpec::full_attention(1, 8, 8)};
  EXPECT_FALSE(shared_pool_geometry(group_layers(layers, kBs), kBs, KvCacheLayout::layer_major));
  // gpt-oss-like: both groups.
  const auto geo = shared_pool_geometry(group_layers(gpt_oss_like().layers, kBs), kBs,
                                        KvCacheLayout::layer_major, &members);
  ASSERT_TRUE(geo);
  EXPECT_EQ(members, (std::vector<std::size_t>{0, 1}));
  EXPECT_EQ(geo->num_slots, 2u);
}

TEST(SharedPoolPlan, UnequalLayerCountsAreSplitIntoGroupsThatShare) {
  // Gemma 3's pattern: 5 window layers, then 1 full, x 2, plus 2 window: 12
  // window and 2 full layers.
  std::vector<LayerSpec> layers;
  for (int r = 0; r < 2; ++r) {
    for (int i = 0; i < 5; ++i)
      layers.push_back(LayerSpec::sliding_window(8, 1, 8, 8));
    layers.push_back(LayerSpec::full_attention(1, 8, 8));
  }
  layers.push_back(LayerSpec::sliding_window(8, 1, 8, 8));
  layers.push_back(LayerSpec::sliding_window(8, 1, 8, 8));
  const std::vector<KvCacheGroup> whole = group_layers(layers, kBs);
  ASSERT_EQ(whole.size(), 2u);
  EXPECT_FALSE(shared_pool_geometry(whole, kBs, KvCacheLayout::layer_major));
  const std::size_t split = shared_group_layers(whole, kBs, KvCacheLayout::layer_major);
  EXPECT_EQ(split, 2u);  // the smallest group's count
  const std::vector<KvCacheGroup> groups = group_layers(layers, kBs, split);
  ASSERT_EQ(groups.size(), 7u);  // 6 window groups of 2 and 1 full group of 2
  for (const KvCacheGroup& g : groups)
    EXPECT_EQ(g.layers.size(), 2u);
  EXPECT_EQ(groups[0].layers, (std::vector<std::size_t>{0, 1}));
  EXPECT_EQ(groups[1].layers, (std::vector<std::size_t>{2, 3}));
  std::vector<std::size_t> members;
  const auto geo = shared_pool_geometry(groups, kBs, KvCacheLayout::layer_major, &members);
  ASSERT_TRUE(geo);
  EXPECT_EQ(members.size(), 7u);
  EXPECT_EQ(geo->num_slots, 2u);
  // planned_groups: the same split with shared_pool, none without, nor where
  // the groups cannot share (block-major).
  std::size_t cap = 99;
  const std::vector<KvCacheGroup> planned =
      planned_groups(layers, kBs, true, KvCacheLayout::layer_major, &cap);
  EXPECT_EQ(cap, split);
  ASSERT_EQ(planned.size(), groups.size());
  for (std::size_t g = 0; g < groups.size(); ++g)
    EXPECT_EQ(planned[g].layers, groups[g].layers);
  EXPECT_EQ(planned_groups(layers, kBs, false, KvCacheLayout::layer_major, &cap).size(), 2u);
  EXPECT_EQ(cap, 0u);
  EXPECT_EQ(planned_groups(layers, kBs, true, KvCacheLayout::block_major, &cap).size(), 2u);
  EXPECT_EQ(cap, 0u);
  // Within 1.25x (5 and 6): the largest count, one group each (the smaller
  // padded).
  std::vector<LayerSpec> near = {
      LayerSpec::sliding_window(8, 1, 8, 8), LayerSpec::sliding_window(8, 1, 8, 8),
      LayerSpec::sliding_window(8, 1, 8, 8), LayerSpec::sliding_window(8, 1, 8, 8),
      LayerSpec::sliding_window(8, 1, 8, 8)};
  for (int i = 0; i < 6; ++i)
    near.push_back(LayerSpec::full_attention(1, 8, 8));
  EXPECT_EQ(shared_group_layers(group_layers(near, kBs), kBs, KvCacheLayout::layer_major), 6u);
  near.pop_back();  // 5 against 4: not within 1.25x, the smaller count
  near.pop_back();
  EXPECT_EQ(shared_group_layers(group_layers(near, kBs), kBs, KvCacheLayout::layer_major), 4u);
  // A cache over the split groups shares one pool, and a layer finds its group.
  HybridKvCacheConfig c;
  c.block_size = kBs;
  c.layers = layers;
  c.max_group_layers = split;
  auto backend = host_backend();
  HybridPoolSizes sizes;
  sizes.shared_blocks = 32;
  sizes.group_blocks.assign(7, 0);
  HybridKvCache cache(c, sizes, *backend);
  EXPECT_EQ(cache.num_groups(), 7u);
  EXPECT_EQ(cache.locate(5)->group,
            3u);  // the first full layer: after window groups {0,1}, {2,3}, {4,6}
  EXPECT_EQ(cache.locate(13)->group, 6u);
  Stream stream = backend->create_stream();
  HybridBlockTable t(cache);
  t.append_tokens(tokens(8), stream);
  for (std::size_t g = 0; g < 7; ++g)
    EXPECT_EQ(t.num_live_blocks(g), 2u);
  EXPECT_EQ(cache.shared_pool()->num_free_blocks(), 32u - 14u);
  EXPECT_TRUE(cache.check_invariants().ok);

  // A plan of the split groups builds the same cache from a config that sets
  // no cap (the plan's largest group is the split); a plan of other groups
  // is refused.
  KvCachePlanRequest want;
  want.budget_bytes = 1 << 20;
  want.max_context_tokens = 64;
  want.shared_pool = true;
  const KvCachePlan plan = plan_kv_cache(groups, kBs, want);
  ASSERT_GT(plan.shared_blocks, 0u);
  HybridKvCacheConfig uncapped = c;
  uncapped.max_group_layers = 0;
  HybridKvCache from_plan(uncapped, plan, *backend);
  EXPECT_EQ(from_plan.num_groups(), 7u);
  EXPECT_EQ(from_plan.config().max_group_layers, split);
  EXPECT_EQ(from_plan.shared_pool()->num_blocks(), plan.shared_blocks);
  HybridKvCacheConfig other = uncapped;
  other.layers.resize(6);  // 5 window + 1 full: other groups
  EXPECT_THROW(HybridKvCache(other, plan, *backend), InvalidArgument);
}

}  // namespace
}  // namespace kvport
