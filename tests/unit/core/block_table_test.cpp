// SPDX-License-Identifier: Apache-2.0
// BlockTable: appends, fork, copy-on-write (with device contents read back),
// and the all-or-nothing append.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <numeric>
#include <vector>

#include "core_test_util.hpp"
#include "kvport/core/block_table.hpp"
#include "kvport/core/paged_kv_cache.hpp"
#include "kvport/core/prefix_cache.hpp"

namespace kvport {
namespace {

using test::host_backend;
using test::small_config;  // 3 layers, block_size 4, 128-byte K and V regions
using ::testing::ElementsAre;
using ::testing::HasSubstr;

std::vector<TokenId> tokens(std::size_t n, TokenId first = 1) {
  std::vector<TokenId> t(n);
  std::iota(t.begin(), t.end(), first);
  return t;
}

std::vector<std::uint8_t> pattern(std::size_t bytes, std::uint8_t seed) {
  std::vector<std::uint8_t> p(bytes);
  for (std::size_t i = 0; i < bytes; ++i)
    p[i] = static_cast<std::uint8_t>(seed + i * 7);
  return p;
}

// Every layer's K of block `b` gets pattern(seed), its V pattern(seed + 1).
void write_block_pattern(PagedKvCache& cache, BlockId b, std::uint8_t seed, StreamView stream) {
  for (std::size_t layer = 0; layer < cache.num_layers(); ++layer) {
    cache.write_block(layer, b, pattern(cache.k_block_bytes(layer), seed),
                      pattern(cache.v_block_bytes(layer), static_cast<std::uint8_t>(seed + 1)),
                      stream);
  }
}
void expect_block_pattern(PagedKvCache& cache, BlockId b, std::uint8_t seed, StreamView stream) {
  for (std::size_t layer = 0; layer < cache.num_layers(); ++layer) {
    const PagedKvCache::HostBlock hb = cache.read_block(layer, b, stream);
    EXPECT_EQ(hb.k, pattern(cache.k_block_bytes(layer), seed))
        << "block " << b << " layer " << layer;
    EXPECT_EQ(hb.v, pattern(cache.v_block_bytes(layer), static_cast<std::uint8_t>(seed + 1)))
        << "block " << b << " layer " << layer;
  }
}

class BlockTableTest : public ::testing::TestWithParam<KvCacheLayout> {
 protected:
  std::unique_ptr<Backend> backend = host_backend();
  Stream stream = backend->create_stream();
  PagedKvCache cache{small_config(GetParam()), 6, *backend};

  void write_pattern(BlockId b, std::uint8_t seed) { write_block_pattern(cache, b, seed, stream); }
  void expect_pattern(BlockId b, std::uint8_t seed) {
    expect_block_pattern(cache, b, seed, stream);
  }
};

TEST_P(BlockTableTest, AppendAllocatesAsNeededAndTracksTheLastBlock) {
  BlockTable t(cache);
  EXPECT_TRUE(t.empty());
  EXPECT_EQ(t.last_block_fill(), 0u);
  EXPECT_EQ(t.blocks_needed(1), 1u);
  t.append_tokens(tokens(3), stream);
  EXPECT_THAT(t.blocks(), ElementsAre(0u));
  EXPECT_EQ(t.last_block_fill(), 3u);
  EXPECT_EQ(t.blocks_needed(1), 0u);
  EXPECT_EQ(t.blocks_needed(2), 1u);
  t.append_tokens(tokens(1, 4), stream);
  EXPECT_EQ(t.last_block_fill(), 4u);
  EXPECT_EQ(t.num_blocks(), 1u);
  t.append_tokens(tokens(9, 5), stream);
  EXPECT_THAT(t.blocks(), ElementsAre(0u, 1u, 2u, 3u));
  EXPECT_EQ(t.num_tokens(), 13u);
  EXPECT_EQ(t.last_block_fill(), 1u);
  EXPECT_THAT(t.tokens(), ::testing::ElementsAreArray(tokens(13)));
  t.append_tokens({}, stream);
  EXPECT_EQ(t.num_tokens(), 13u);
  EXPECT_EQ(t.prefix_cache(), nullptr);
  EXPECT_THROW(t.reuse_cached_prefix(tokens(3)), InvalidArgument) << "not empty";
  EXPECT_EQ(BlockTable(cache).reuse_cached_prefix(tokens(8)), 0u) << "no prefix cache";
  t.release();
  EXPECT_TRUE(t.empty());
  EXPECT_EQ(cache.num_free_blocks(), 6u);
  EXPECT_TRUE(cache.check_invariants().ok);
}

TEST_P(BlockTableTest, ForkSharesEveryBlockAndCopyOnWriteCopiesAllLayers) {
  BlockTable parent(cache);
  parent.append_tokens(tokens(6), stream);  // block 0 full, block 1 has 2 tokens
  write_pattern(0, 10);
  write_pattern(1, 50);
  BlockTable child = parent.fork();
  EXPECT_THAT(child.blocks(), ElementsAre(0u, 1u));
  EXPECT_EQ(cache.ref_count(0), 2u);
  EXPECT_EQ(cache.ref_count(1), 2u);
  EXPECT_EQ(child.blocks_needed(1), 1u) << "the shared partial block needs a copy";

  const std::uint64_t batches = backend->call_counts().copy_batch;
  child.append_tokens(tokens(1, 100), stream);
  EXPECT_EQ(backend->call_counts().copy_batch, batches + 1)
      << "one batched copy for all layers, K and V";
  EXPECT_EQ(child.copy_on_writes(), 1u);
  EXPECT_THAT(child.blocks(), ElementsAre(0u, 2u)) << "full block 0 stays shared";
  EXPECT_EQ(cache.ref_count(1), 1u);
  EXPECT_EQ(cache.ref_count(2), 1u);
  EXPECT_EQ(cache.ref_count(0), 2u);
  backend->synchronize(stream);
  expect_pattern(2, 50);  // the copy has the parent's data in every layer

  // The parent now owns block 1 alone: it writes in place, no copy.
  parent.append_tokens(tokens(1, 200), stream);
  EXPECT_EQ(parent.copy_on_writes(), 0u);
  EXPECT_THAT(parent.blocks(), ElementsAre(0u, 1u));
  EXPECT_EQ(backend->call_counts().copy_batch, batches + 1);

  // A full shared last block is never copied: appends go to a new block.
  BlockTable grand = BlockTable(cache);
  grand.append_tokens(tokens(4), stream);
  BlockTable grand_child = grand.fork();
  grand_child.append_tokens(tokens(1, 9), stream);
  EXPECT_EQ(grand_child.copy_on_writes(), 0u);
  EXPECT_EQ(grand_child.num_blocks(), 2u);
  parent.release();
  child.release();
  grand.release();
  grand_child.release();
  EXPECT_EQ(cache.num_free_blocks(), 6u);
  EXPECT_TRUE(cache.check_invariants().ok);
}

TEST_P(BlockTableTest, AnAppendThatCannotFitChangesNothing) {
  BlockTable a(cache);
  a.append_tokens(tokens(6), stream);  // 2 blocks
  BlockTable b = a.fork();
  BlockTable c(cache);
  c.append_tokens(tokens(12), stream);  // 3 blocks: 1 free left
  const auto before_free = cache.num_free_blocks();
  const auto before_counters = cache.counters();
  // b needs a copy of the shared partial block plus 2 more: 3 > 1.
  try {
    b.append_tokens(tokens(8, 40), stream);
    FAIL() << "expected CacheExhausted";
  } catch (const CacheExhausted& e) {
    EXPECT_THAT(e.what(), HasSubstr("needs 3 blocks, 1 are free"));
  }
  EXPECT_THAT(b.blocks(), ElementsAre(0u, 1u));
  EXPECT_EQ(b.num_tokens(), 6u);
  EXPECT_EQ(cache.num_free_blocks(), before_free);
  EXPECT_EQ(cache.counters().allocs, before_counters.allocs);
  EXPECT_EQ(cache.ref_count(1), 2u);
  EXPECT_TRUE(cache.check_invariants().ok);
  // What fits still works afterwards.
  b.append_tokens(tokens(2, 40), stream);
  EXPECT_EQ(b.copy_on_writes(), 1u);
}

TEST_P(BlockTableTest, AFailedCopyOnWriteLeavesTheTableAsItWas) {
  BlockTable a(cache);
  a.append_tokens(tokens(2), stream);
  BlockTable b = a.fork();
  // A stream of another backend makes the batched copy throw before queuing.
  std::unique_ptr<Backend> other = host_backend();
  Stream foreign = other->create_stream();
  EXPECT_THROW(b.append_tokens(tokens(1, 9), foreign), InvalidArgument);
  EXPECT_THAT(b.blocks(), ElementsAre(0u));
  EXPECT_EQ(b.num_tokens(), 2u);
  EXPECT_EQ(cache.ref_count(0), 2u);
  EXPECT_EQ(cache.num_free_blocks(), 5u) << "the copy's block went back";
  EXPECT_TRUE(cache.check_invariants().ok);
}

TEST_P(BlockTableTest, MovesAndReuseErrors) {
  BlockTable a(cache);
  a.append_tokens(tokens(5), stream);
  BlockTable b(std::move(a));
  EXPECT_TRUE(a.empty());  // NOLINT(bugprone-use-after-move): documented state
  EXPECT_EQ(b.num_blocks(), 2u);
  BlockTable c(cache);
  c.append_tokens(tokens(1), stream);
  c = std::move(b);  // c's own block is released first
  EXPECT_EQ(c.num_blocks(), 2u);
  EXPECT_EQ(cache.num_free_blocks(), 4u);
  EXPECT_THROW(c.reuse_cached_prefix(tokens(4)), InvalidArgument);
}

TEST_P(BlockTableTest, CopyBlocksValidatesItsBatch) {
  const BlockCopy self{1, 1};
  EXPECT_THROW(cache.copy_blocks({&self, 1}, stream), InvalidArgument);
  const BlockCopy out_of_range{0, 6};
  EXPECT_THROW(cache.copy_blocks({&out_of_range, 1}, stream), InvalidArgument);
  const BlockCopy twice[] = {{0, 2}, {1, 2}};
  EXPECT_THROW(cache.copy_blocks(twice, stream), InvalidArgument);
  const BlockCopy chained[] = {{0, 1}, {1, 2}};
  EXPECT_THROW(cache.copy_blocks(chained, stream), InvalidArgument);
  const std::uint64_t batches = backend->call_counts().copy_batch;
  cache.copy_blocks({}, stream);
  EXPECT_EQ(backend->call_counts().copy_batch, batches);
  write_pattern(0, 3);
  write_pattern(1, 77);
  const BlockCopy fan_out[] = {{0, 4}, {1, 5}, {0, 3}};
  cache.copy_blocks(fan_out, stream);
  backend->synchronize(stream);
  expect_pattern(4, 3);
  expect_pattern(3, 3);
  expect_pattern(5, 77);
}

INSTANTIATE_TEST_SUITE_P(Layouts, BlockTableTest,
                         ::testing::Values(KvCacheLayout::layer_major, KvCacheLayout::block_major),
                         [](const auto& p) { return std::string(to_string(p.param)); });

// ---- a fully cached prompt (PrefixHitMode) ---------------------------------------------------

// 6 blocks of small_config (block_size 4) under a prefix cache; `cached(n)`
// leaves the full blocks of tokens(n) cached and evictable, each holding a
// known pattern (seed 10 + block index in the sequence).
class FullyCachedPromptTest : public ::testing::Test {
 protected:
  std::unique_ptr<Backend> backend = host_backend();
  Stream stream = backend->create_stream();
  PagedKvCache cache{small_config(), 6, *backend};
  PrefixCache pc{cache};

  std::vector<BlockId> cached(std::size_t n, bool keep_holding = false) {
    BlockTable t(pc);
    t.append_tokens(tokens(n), stream);
    const std::vector<BlockId> blocks(t.blocks().begin(), t.blocks().end());
    for (std::size_t i = 0; i < blocks.size(); ++i)
      write_pattern(blocks[i], static_cast<std::uint8_t>(10 + 2 * i));
    if (keep_holding) held_ = std::move(t);
    return blocks;
  }
  void write_pattern(BlockId b, std::uint8_t seed) { write_block_pattern(cache, b, seed, stream); }
  void expect_pattern(BlockId b, std::uint8_t seed) {
    expect_block_pattern(cache, b, seed, stream);
  }
  void expect_invariants() {
    const InvariantReport r = pc.check_invariants();
    EXPECT_TRUE(r.ok) << r.to_string();
  }

  BlockTable held_{cache};
};

TEST_F(FullyCachedPromptTest, APartialHitIsNeverCapped) {
  cached(8);  // blocks 0 and 1
  for (PrefixHitMode mode : {PrefixHitMode::compute_last_token, PrefixHitMode::full}) {
    BlockTable t(pc);
    t.set_prefix_hit_mode(mode);
    EXPECT_EQ(t.reuse_cached_prefix(tokens(9), stream), 8u) << to_string(mode);
    EXPECT_THAT(t.blocks(), ElementsAre(0u, 1u)) << "shared, not copied";
    EXPECT_EQ(t.copy_on_writes(), 0u);
    BlockTable longer(pc);
    longer.set_prefix_hit_mode(mode);
    EXPECT_EQ(longer.reuse_cached_prefix(tokens(12), stream), 8u)
        << "the third block is not cached: tokens are left to compute";
    EXPECT_THAT(longer.blocks(), ElementsAre(0u, 1u));
    EXPECT_EQ(cache.ref_count(1), 3u);
  }
  expect_invariants();
}

TEST_F(FullyCachedPromptTest, ByDefaultTheLastBlockOfAFullyCachedPromptIsAPrivateCopy) {
  const std::vector<BlockId> src = cached(8);
  ASSERT_THAT(src, ElementsAre(0u, 1u));
  const KvCacheCounters before = cache.counters();
  const std::uint64_t hits = pc.counters().hits;

  BlockTable t(pc);
  EXPECT_EQ(t.prefix_hit_mode(), PrefixHitMode::compute_last_token);
  const std::vector<TokenId> prompt = tokens(8);
  EXPECT_EQ(t.reuse_cached_prefix(prompt, stream), 7u) << "n - 1: one token to compute";
  ASSERT_EQ(t.num_blocks(), 2u);
  const BlockId copy = t.blocks()[1];
  EXPECT_EQ(t.blocks()[0], 0u) << "the first block is shared";
  EXPECT_NE(copy, 1u) << "never the cached block itself";
  EXPECT_EQ(cache.ref_count(copy), 1u) << "private";
  EXPECT_FALSE(pc.is_cached(copy));
  EXPECT_EQ(cache.ref_count(0), 2u);
  EXPECT_EQ(cache.ref_count(1), 1u) << "only the cache's reference is left";
  EXPECT_TRUE(pc.is_evictable(1));
  EXPECT_EQ(t.num_tokens(), 7u);
  EXPECT_EQ(t.last_block_fill(), 3u);
  EXPECT_EQ(t.copy_on_writes(), 1u);
  EXPECT_EQ(pc.counters().hits, hits + 2) << "both blocks were found cached";
  EXPECT_EQ(cache.counters().allocs, before.allocs + 1) << "one block for the copy";
  expect_pattern(copy, 12);  // the cached block's contents, all layers, K and V
  expect_invariants();

  // The engine recomputes the last token: no new block, no further copy.
  EXPECT_EQ(t.blocks_needed(1), 0u);
  t.append_tokens(std::span<const TokenId>(prompt).subspan(7), stream);
  EXPECT_EQ(t.num_blocks(), 2u);
  EXPECT_EQ(t.blocks()[1], copy);
  EXPECT_EQ(t.copy_on_writes(), 1u);
  EXPECT_EQ(pc.find(hash_full_blocks(prompt, 4)[1]), std::optional<BlockId>(1u))
      << "the cached block stays the cached one; the copy is a duplicate";
  EXPECT_FALSE(pc.is_cached(copy));

  // Writing the copy leaves the cached block alone.
  write_pattern(copy, 99);
  expect_pattern(1, 12);
  expect_pattern(copy, 99);
  expect_invariants();
}

TEST_F(FullyCachedPromptTest, FullModeHitsEveryCachedBlockShared) {
  cached(8);
  BlockTable t(pc);
  t.set_prefix_hit_mode(PrefixHitMode::full);
  EXPECT_EQ(t.prefix_hit_mode(), PrefixHitMode::full);
  EXPECT_EQ(t.reuse_cached_prefix(tokens(8)), 8u);
  EXPECT_THAT(t.blocks(), ElementsAre(0u, 1u));
  EXPECT_EQ(cache.ref_count(1), 2u);
  EXPECT_EQ(t.copy_on_writes(), 0u);
  EXPECT_EQ(t.blocks_needed(1), 1u) << "the next token starts a new block";
  BlockTable child = t.fork();
  EXPECT_EQ(child.prefix_hit_mode(), PrefixHitMode::full) << "fork carries the mode";
  BlockTable moved(std::move(child));
  EXPECT_EQ(moved.prefix_hit_mode(), PrefixHitMode::full) << "so does a move";
  EXPECT_STREQ(to_string(PrefixHitMode::full), "full");
  EXPECT_STREQ(to_string(PrefixHitMode::compute_last_token), "compute_last_token");
  EXPECT_STREQ(to_string(static_cast<PrefixHitMode>(7)), "unknown");
  expect_invariants();
}

TEST_F(FullyCachedPromptTest, APromptOfOneBlockKeepsOneTokenToCompute) {
  cached(4);  // block 0
  BlockTable t(pc);
  // The one-argument form copies on the default stream and waits for it.
  EXPECT_EQ(t.reuse_cached_prefix(tokens(4)), 3u);
  ASSERT_EQ(t.num_blocks(), 1u);
  EXPECT_NE(t.blocks()[0], 0u);
  EXPECT_EQ(cache.ref_count(t.blocks()[0]), 1u);
  expect_pattern(t.blocks()[0], 10);
  EXPECT_TRUE(pc.is_evictable(0));
  expect_invariants();
}

TEST_F(FullyCachedPromptTest, APromptShorterThanABlockHitsNothing) {
  cached(4);
  BlockTable t(pc);
  EXPECT_EQ(t.reuse_cached_prefix(tokens(3), stream), 0u);
  EXPECT_TRUE(t.empty());
  EXPECT_EQ(t.num_tokens(), 0u);
  EXPECT_EQ(t.reuse_cached_prefix({}, stream), 0u) << "nor does an empty prompt";
  EXPECT_EQ(t.copy_on_writes(), 0u);
  expect_invariants();
}

TEST_F(FullyCachedPromptTest, WithNoBlockForTheCopyTheHitStopsBeforeTheLastBlock) {
  cached(24, /*keep_holding=*/true);  // all 6 blocks in use: nothing free or evictable
  ASSERT_EQ(pc.num_available_blocks(), 0u);
  BlockTable t(pc);
  EXPECT_EQ(t.reuse_cached_prefix(tokens(8), stream), 4u) << "n - block_size, no throw";
  EXPECT_THAT(t.blocks(), ElementsAre(0u));
  EXPECT_EQ(cache.ref_count(0), 3u);
  EXPECT_EQ(cache.ref_count(1), 2u) << "the reference on the last block went back";
  EXPECT_EQ(t.copy_on_writes(), 0u);
  expect_invariants();
  // The shortage shows where callers already check for it.
  EXPECT_EQ(t.blocks_needed(4), 1u);
  EXPECT_THROW(t.append_tokens(std::span<const TokenId>(tokens(8)).subspan(4), stream),
               CacheExhausted);
  t.release();
  held_.release();
  EXPECT_EQ(cache.num_free_blocks(), 0u);
  EXPECT_EQ(pc.num_evictable_blocks(), 6u) << "nothing leaked: every block is evictable";
  expect_invariants();
}

TEST_F(FullyCachedPromptTest, TheCopyMayEvictTheLeastRecentlyUsedBlock) {
  cached(8);  // blocks 0, 1
  {
    BlockTable other(pc);
    other.append_tokens(tokens(16, 500), stream);  // blocks 2..5, all cached
  }
  ASSERT_EQ(cache.num_free_blocks(), 0u);
  ASSERT_EQ(pc.num_evictable_blocks(), 6u);
  BlockTable t(pc);
  EXPECT_EQ(t.reuse_cached_prefix(tokens(8), stream), 7u);
  EXPECT_EQ(pc.counters().evictions, 1u);
  EXPECT_TRUE(pc.is_cached(1)) << "the block being copied is never the one evicted";
  expect_pattern(t.blocks()[1], 12);
  expect_invariants();
}

TEST_F(FullyCachedPromptTest, WithBlockSizeOneTheHitStopsBeforeTheLastToken) {
  KvCacheConfig config = small_config();
  config.block_size = 1;
  PagedKvCache one(config, 4, *backend);
  PrefixCache opc(one);
  {
    BlockTable a(opc);
    a.append_tokens(tokens(3), stream);
  }
  BlockTable t(opc);
  EXPECT_EQ(t.reuse_cached_prefix(tokens(3), stream), 2u);
  EXPECT_THAT(t.blocks(), ElementsAre(0u, 1u)) << "no copy: it would hold no token";
  EXPECT_EQ(t.copy_on_writes(), 0u);
  EXPECT_EQ(t.blocks_needed(1), 1u);
  const InvariantReport r = opc.check_invariants();
  EXPECT_TRUE(r.ok) << r.to_string();
}

TEST_F(FullyCachedPromptTest, ACopyOnADestroyedStreamThrowsAndChangesNothing) {
  cached(8);
  StreamView stale = backend->default_stream();
  {
    Stream gone = backend->create_stream();
    stale = gone.view();
  }
  const std::size_t free_before = cache.num_free_blocks();
  const std::vector<BlockId> lru_before = pc.lru_order();
  BlockTable t(pc);
  EXPECT_THROW(t.reuse_cached_prefix(tokens(8), stale), InvalidArgument);
  EXPECT_TRUE(t.empty());
  EXPECT_EQ(t.num_tokens(), 0u);
  EXPECT_EQ(t.copy_on_writes(), 0u);
  EXPECT_EQ(cache.num_free_blocks(), free_before) << "the block for the copy went back";
  EXPECT_EQ(pc.num_evictable_blocks(), lru_before.size()) << "the hit blocks went back";
  EXPECT_EQ(cache.ref_count(0), 1u);
  EXPECT_EQ(cache.ref_count(1), 1u);
  expect_invariants();
  EXPECT_EQ(t.reuse_cached_prefix(tokens(8), stream), 7u) << "the table is usable";
}

TEST(BlockTableOverPrefixCache, AFailedAppendKeepsThePrefixCacheAsItWas) {
  std::unique_ptr<Backend> backend = host_backend();
  Stream stream = backend->create_stream();
  PagedKvCache cache(small_config(), 4, *backend);
  PrefixCache pc(cache);
  BlockTable a(pc);
  a.append_tokens(tokens(8), stream);
  a.release();  // 2 evictable, 2 free
  BlockTable big(pc);
  EXPECT_THROW(big.append_tokens(tokens(20, 500), stream), CacheExhausted);  // 5 > 4
  EXPECT_EQ(pc.num_cached_blocks(), 2u) << "nothing was evicted for an append that failed";
  EXPECT_EQ(pc.counters().evictions, 0u);
  EXPECT_TRUE(big.empty());
  EXPECT_TRUE(pc.check_invariants().ok);
  big.append_tokens(tokens(16, 500), stream);  // exactly 4: evicts both
  EXPECT_EQ(pc.counters().evictions, 2u);
  EXPECT_TRUE(pc.check_invariants().ok);
}

}  // namespace
}  // namespace kvport
