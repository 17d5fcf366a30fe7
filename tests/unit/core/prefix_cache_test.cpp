// SPDX-License-Identifier: Apache-2.0
// PrefixCache: hashing, lookups, the LRU order, eviction under pressure, and
// the three-state invariant (free / evictable / in use), checked after every
// step.
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <xxhash.h>

#include <algorithm>
#include <array>
#include <cstring>
#include <list>
#include <map>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "core_test_util.hpp"
#include "kvport/core/block_hash.hpp"
#include "kvport/core/block_table.hpp"
#include "kvport/core/paged_kv_cache.hpp"
#include "kvport/core/prefix_cache.hpp"

namespace kvport {
namespace {

using test::host_backend;
using test::small_config;  // block_size 4
using ::testing::ElementsAre;
using ::testing::HasSubstr;

std::vector<TokenId> tokens(std::size_t n, TokenId first = 100) {
  std::vector<TokenId> t(n);
  std::iota(t.begin(), t.end(), first);
  return t;
}

#define EXPECT_INVARIANTS(pc)                           \
  do {                                                  \
    const InvariantReport r_ = (pc).check_invariants(); \
    EXPECT_TRUE(r_.ok) << r_.to_string();               \
  } while (0)

// Parameter: whether the cache's pools are the engine's memory (adopted).
class PrefixCacheTest : public ::testing::TestWithParam<bool> {
 protected:
  std::unique_ptr<Backend> backend = host_backend();
  Stream stream = backend->create_stream();
  test::EngineMemory engine;  // the pools, when adopted; outlives the cache
  PagedKvCache cache =
      test::make_cache(small_config(), 8, *backend, GetParam() ? &engine : nullptr);
  PrefixCache pc{cache};

  // A sequence of `n` tokens starting at `first`, appended through a table.
  BlockTable sequence(std::size_t n, TokenId first = 100, std::uint64_t key = 0) {
    BlockTable t(pc, key);
    const std::vector<TokenId> prompt = tokens(n, first);
    const std::size_t reused = t.reuse_cached_prefix(prompt);
    t.append_tokens(std::span<const TokenId>(prompt).subspan(reused), stream);
    return t;
  }
};

TEST(BlockHash, ChainsParentTokensAndExtraKey) {
  const std::vector<TokenId> a = tokens(4);
  const BlockHash h = hash_block(std::nullopt, a);
  EXPECT_EQ(h, hash_block(std::nullopt, a));
  EXPECT_NE(h, hash_block(std::nullopt, a, 7)) << "the extra key changes the hash";
  EXPECT_NE(h, hash_block(BlockHash{}, a)) << "a zero parent differs from no parent";
  EXPECT_NE(hash_block(h, a), hash_block(hash_block(std::nullopt, tokens(4, 5)), a))
      << "the same tokens under another parent hash differently";
  std::vector<TokenId> b = a;
  b[3] += 1;
  EXPECT_NE(h, hash_block(std::nullopt, b));
  EXPECT_EQ(h.to_string().size(), 32u);
}

TEST(BlockHash, IsStableAcrossRuns) {
  // Pinned: the hash of a block is part of what an engine may persist or
  // compare between processes; a change of format must be deliberate.
  const std::vector<TokenId> t = {1, 2, 3, 4};
  const BlockHash first = hash_block(std::nullopt, t);
  EXPECT_EQ(first, hash_block(std::nullopt, std::vector<TokenId>{1, 2, 3, 4}));
  const std::vector<BlockHash> chain = hash_full_blocks(tokens(10), 4);
  ASSERT_EQ(chain.size(), 2u) << "a trailing partial block has no hash";
  EXPECT_EQ(chain[0], hash_block(std::nullopt, tokens(4, 100)));
  EXPECT_EQ(chain[1], hash_block(chain[0], tokens(4, 104)));
  EXPECT_THROW(hash_full_blocks(t, 0), InvalidArgument);
}

// The documented message, hashed by the shared libxxhash (this test's call is
// not inlined), equals hash_block's (XXH3 compiled in), and the pinned value
// holds: four little-endian u64 (parent low, parent high, extra key, has
// parent), then the tokens as little-endian u32.
TEST(BlockHash, ExtendChainHashesContinuesAChain) {
  const std::vector<TokenId> t = tokens(23);
  const std::vector<BlockHash> all = hash_full_blocks(t, 4, 9);
  ASSERT_EQ(all.size(), 5u);
  // From empty, from a prefix of the chain, and when nothing is new.
  for (std::size_t have : {0u, 2u, 5u}) {
    std::vector<BlockHash> h(all.begin(), all.begin() + static_cast<std::ptrdiff_t>(have));
    extend_chain_hashes(h, t, 4, 9);
    EXPECT_EQ(h, all) << "from " << have;
  }
  // Tokens appended later extend the same chain.
  std::vector<BlockHash> h;
  extend_chain_hashes(h, std::span<const TokenId>(t).first(10), 4, 9);
  EXPECT_EQ(h.size(), 2u);
  extend_chain_hashes(h, t, 4, 9);
  EXPECT_EQ(h, all);
  // Errors change nothing.
  std::vector<BlockHash> too_many = all;
  EXPECT_THAT(
      [&] { extend_chain_hashes(too_many, std::span<const TokenId>(t).first(8), 4, 9); },
      ::testing::ThrowsMessage<InvalidArgument>(::testing::HasSubstr("5 hashes for 8 tokens")));
  EXPECT_EQ(too_many, all);
  EXPECT_THROW(extend_chain_hashes(h, t, 0), InvalidArgument);
  EXPECT_EQ(h, all);
}

TEST(BlockHash, IsXxh3OfTheDocumentedMessage) {
  const std::vector<TokenId> t = {1, 2, 3, 4};
  const auto reference = [&](std::array<std::uint64_t, 4> head) {
    std::vector<unsigned char> message(sizeof(head) + t.size() * sizeof(TokenId));
    std::memcpy(message.data(), head.data(), sizeof(head));
    std::memcpy(message.data() + sizeof(head), t.data(), t.size() * sizeof(TokenId));
    const XXH128_hash_t h = XXH3_128bits(message.data(), message.size());
    return BlockHash{h.low64, h.high64};
  };
  const BlockHash root = hash_block(std::nullopt, t);
  EXPECT_EQ(root, reference({0, 0, 0, 0}));
  const BlockHash child = hash_block(root, t, 9);
  EXPECT_EQ(child, reference({root.low, root.high, 9, 1}));
  EXPECT_EQ(root.to_string(), "4b9e1a54fe62e2216332e9587f26353a");
}

TEST_P(PrefixCacheTest, FullBlocksAreCachedAndHitAcrossSequences) {
  BlockTable a = sequence(10);  // 2 full blocks + 2 tokens
  EXPECT_THAT(a.blocks(), ElementsAre(0u, 1u, 2u));
  EXPECT_EQ(pc.num_cached_blocks(), 2u);
  EXPECT_TRUE(pc.is_cached(0));
  EXPECT_TRUE(pc.is_cached(1));
  EXPECT_FALSE(pc.is_cached(2)) << "a partial block is never cached";
  EXPECT_EQ(cache.ref_count(0), 2u) << "the sequence's reference and the cache's";
  EXPECT_INVARIANTS(pc);

  BlockTable b(pc);
  const std::vector<TokenId> prompt = tokens(9);
  EXPECT_EQ(b.reuse_cached_prefix(prompt), 8u);
  EXPECT_THAT(b.blocks(), ElementsAre(0u, 1u));
  EXPECT_EQ(cache.ref_count(0), 3u);
  EXPECT_EQ(pc.counters().hits, 2u);
  EXPECT_EQ(pc.counters().misses, 2u) << "a's lookup missed both blocks";
  b.append_tokens(std::span<const TokenId>(prompt).subspan(8), stream);
  EXPECT_THAT(b.blocks(), ElementsAre(0u, 1u, 3u));
  EXPECT_INVARIANTS(pc);

  // A different extra key (another adapter) never shares.
  BlockTable c(pc, 42);
  EXPECT_EQ(c.reuse_cached_prefix(prompt), 0u);
  EXPECT_EQ(pc.counters().misses, 4u);
  EXPECT_DOUBLE_EQ(pc.counters().hit_rate(), 2.0 / 6.0);
  EXPECT_INVARIANTS(pc);
}

TEST_P(PrefixCacheTest, LookupStopsAtTheFirstMissAndCountsTheRest) {
  BlockTable a = sequence(8);
  std::vector<TokenId> prompt = tokens(16);
  prompt[5] = 1;  // second block differs
  const PrefixMatch m = pc.lookup(prompt);
  EXPECT_THAT(m.blocks, ElementsAre(0u));
  EXPECT_EQ(m.num_tokens, 4u);
  EXPECT_EQ(m.hashes.size(), 1u);
  EXPECT_EQ(pc.counters().hits, 1u);
  EXPECT_EQ(pc.counters().misses, 2u + 3u) << "a's own lookup missed 2";
  pc.release_blocks(m.blocks);
  EXPECT_INVARIANTS(pc);
}

TEST_P(PrefixCacheTest, ReleasedCachedBlocksStayResidentInLruOrderTailFirst) {
  BlockTable a = sequence(12);  // blocks 0 1 2, all full and cached
  a.release();
  EXPECT_EQ(pc.num_evictable_blocks(), 3u);
  EXPECT_EQ(pc.num_cached_blocks(), 3u);
  EXPECT_EQ(cache.num_free_blocks(), 5u) << "cached blocks stay resident";
  // The tail joined the LRU list first, so it is evicted first.
  EXPECT_THAT(pc.lru_order(), ElementsAre(2u, 1u, 0u));
  EXPECT_EQ(cache.ref_count(2), 1u);
  const InvariantReport r = pc.check_invariants();
  EXPECT_TRUE(r.ok) << r.to_string();
  EXPECT_EQ(r.free_blocks, 5u);
  EXPECT_EQ(r.evictable_blocks, 3u);
  EXPECT_EQ(r.blocks_in_use, 0u);
  EXPECT_THAT(r.to_string(), HasSubstr("3 evictable"));

  // A hit takes a block out of the LRU list; releasing it again puts it at
  // the most recently used end.
  BlockTable b = sequence(5);  // not fully cached: the hit keeps block 0 itself
  EXPECT_THAT(b.blocks(), ElementsAre(0u, 3u));
  EXPECT_THAT(pc.lru_order(), ElementsAre(2u, 1u));
  b.release();
  EXPECT_THAT(pc.lru_order(), ElementsAre(2u, 1u, 0u));
  EXPECT_INVARIANTS(pc);
}

TEST_P(PrefixCacheTest, EvictsOnlyWhenTheFreeListIsEmpty) {
  BlockTable a = sequence(12);
  a.release();  // 3 evictable, 5 free
  std::vector<BlockId> got;
  for (int i = 0; i < 5; ++i) {
    got.push_back(pc.alloc_block());
    EXPECT_EQ(pc.counters().evictions, 0u) << "free blocks go first";
    EXPECT_INVARIANTS(pc);
  }
  EXPECT_EQ(cache.num_free_blocks(), 0u);
  // Now the least recently used cached block (a's tail, block 2) goes.
  EXPECT_EQ(pc.alloc_block(), 2u);
  EXPECT_EQ(pc.counters().evictions, 1u);
  EXPECT_FALSE(pc.is_cached(2));
  EXPECT_THAT(pc.lru_order(), ElementsAre(1u, 0u));
  EXPECT_INVARIANTS(pc);
  // The shared head is still a hit.
  EXPECT_EQ(pc.lookup(tokens(4)).num_tokens, 4u);
  pc.release(0);
  EXPECT_EQ(pc.try_alloc_block(), 1u);
  EXPECT_EQ(pc.try_alloc_block(), 0u);
  EXPECT_EQ(pc.try_alloc_block(), std::nullopt);
  EXPECT_THROW(pc.alloc_block(), CacheExhausted);
  EXPECT_EQ(pc.counters().evictions, 3u);
  EXPECT_EQ(pc.num_cached_blocks(), 0u);
  EXPECT_INVARIANTS(pc);
}

TEST_P(PrefixCacheTest, DemotedBlocksAreEvictedBeforeEveryOther) {
  BlockTable a = sequence(12);      // blocks 0 1 2
  BlockTable b = sequence(8, 500);  // blocks 3 4
  a.release();                      // LRU 2 1 0
  // b's blocks go back demoted (as a window's slid-out blocks): evicted
  // first, oldest first, though released after a's. (An extra reference
  // each, so that b's own release leaves them held.)
  cache.inc_ref(3);
  cache.inc_ref(4);
  b.release();
  pc.release_demoted(3);
  pc.release_demoted(4);
  EXPECT_THAT(pc.lru_order(), ElementsAre(3u, 4u, 2u, 1u, 0u));
  EXPECT_TRUE(pc.is_evictable(3));
  EXPECT_INVARIANTS(pc);
  // A hit takes a demoted block back; released ordinarily it is an LRU block.
  EXPECT_EQ(pc.lookup(tokens(4, 500)).num_tokens, 4u);
  EXPECT_THAT(pc.lru_order(), ElementsAre(4u, 2u, 1u, 0u));
  pc.release(3);
  EXPECT_THAT(pc.lru_order(), ElementsAre(4u, 2u, 1u, 0u, 3u));
  for (int i = 0; i < 3; ++i)
    (void)pc.alloc_block();         // the 3 free blocks
  EXPECT_EQ(pc.alloc_block(), 4u);  // the demoted block, before a's tail
  EXPECT_EQ(pc.alloc_block(), 2u);
  EXPECT_INVARIANTS(pc);
  // Not the last sequence reference, or an uncached block: as release().
  const BlockId plain = pc.alloc_block();
  pc.release_demoted(plain);
  EXPECT_EQ(cache.ref_count(plain), 0u);
  EXPECT_THAT([&] { pc.release_demoted(99); },
              ::testing::ThrowsMessage<OutOfRange>(HasSubstr("release_demoted")));
  EXPECT_INVARIANTS(pc);
}

TEST_P(PrefixCacheTest, AnEvictedBlockIsNeverHandedOutWhileReferenced) {
  BlockTable a = sequence(8);  // 0 1 cached, held by a
  BlockTable b = sequence(8);  // hits 0 1
  b.release();                 // 0 1 still held by a: not evictable
  EXPECT_EQ(pc.num_evictable_blocks(), 0u);
  std::vector<BlockId> rest;
  while (auto blk = pc.try_alloc_block())
    rest.push_back(*blk);
  EXPECT_EQ(rest.size(), 6u);
  for (BlockId blk : rest)
    EXPECT_THAT(blk, ::testing::Not(::testing::AnyOf(0u, 1u)));
  EXPECT_EQ(cache.ref_count(0), 2u);
  EXPECT_TRUE(pc.is_cached(0));
  EXPECT_INVARIANTS(pc);
  pc.release_blocks(rest);
}

TEST_P(PrefixCacheTest, InsertRules) {
  const BlockId b = pc.alloc_block();
  const BlockHash h = hash_block(std::nullopt, tokens(4));
  EXPECT_TRUE(pc.insert(h, b));
  EXPECT_EQ(pc.hash_of(b), h);
  EXPECT_EQ(pc.find(h), b);
  EXPECT_FALSE(pc.insert(h, b)) << "already cached";
  const BlockId c = pc.alloc_block();
  EXPECT_FALSE(pc.insert(h, c)) << "the hash is taken: c stays a private copy";
  EXPECT_FALSE(pc.is_cached(c));
  EXPECT_THROW(pc.insert(hash_block(std::nullopt, tokens(4, 9)), 5), InvalidArgument)
      << "block 5 is free";
  EXPECT_THROW(pc.insert(h, 99), InvalidArgument);
  EXPECT_EQ(pc.counters().inserts, 1u);
  pc.release(b);
  pc.release(c);
  EXPECT_EQ(pc.lru_order(), std::vector<BlockId>{b});
  EXPECT_INVARIANTS(pc);
}

TEST_P(PrefixCacheTest, DoubleReleaseOfACachedBlockIsIgnored) {
  const BlockId b = pc.alloc_block();
  ASSERT_TRUE(pc.insert(hash_block(std::nullopt, tokens(4)), b));
  pc.release(b);
  test::LogRecorder recorder;
  pc.release(b);  // caller bug: only the cache holds it
  EXPECT_EQ(pc.counters().ignored_releases, 1u);
  EXPECT_EQ(cache.ref_count(b), 1u);
  EXPECT_TRUE(pc.is_evictable(b));
  EXPECT_EQ(recorder.find(log::Level::error, "double free").size(), 1u);
  EXPECT_INVARIANTS(pc);
  EXPECT_THROW(pc.release(8), InvalidArgument);
  EXPECT_THROW(pc.release_blocks(std::vector<BlockId>{b, 8}), InvalidArgument);
  EXPECT_EQ(cache.ref_count(b), 1u) << "validated before any release";
}

TEST_P(PrefixCacheTest, ReleasingAroundThePrefixCacheIsReported) {
  BlockTable a = sequence(4);
  const BlockId b = a.blocks()[0];
  cache.dec_ref(b);  // bypasses the prefix cache: b is left off the LRU list
  const InvariantReport r = pc.check_invariants();
  EXPECT_FALSE(r.ok);
  EXPECT_THAT(r.to_string(), HasSubstr("not in the LRU list"));
  cache.inc_ref(b);  // restore, so the table's release is balanced
  EXPECT_INVARIANTS(pc);
}

TEST_P(PrefixCacheTest, EvictAndDestructionReturnEveryBlock) {
  {
    PrefixCache local(cache);
    BlockTable a(local);
    a.append_tokens(tokens(12), stream);
    BlockTable keep(local);
    keep.append_tokens(tokens(4, 500), stream);
    a.release();
    EXPECT_EQ(local.evict(2), 2u);
    EXPECT_THAT(local.lru_order(), ElementsAre(0u));
    EXPECT_EQ(local.evict(10), 1u);
    EXPECT_EQ(local.counters().evictions, 3u);
    a.append_tokens(tokens(4, 900), stream);
    keep.release();  // its block stays cached until the prefix cache goes
    a.release();
    EXPECT_EQ(local.num_cached_blocks(), 2u);
  }
  EXPECT_EQ(cache.num_free_blocks(), 8u) << "the destructor dropped the cache's references";
  EXPECT_TRUE(cache.check_invariants().ok);
}

TEST_P(PrefixCacheTest, OutOfRangeQueriesThrow) {
  EXPECT_THROW(pc.is_cached(8), InvalidArgument);
  EXPECT_THROW(pc.hash_of(8), InvalidArgument);
  EXPECT_THROW(pc.is_evictable(8), InvalidArgument);
  EXPECT_EQ(pc.find(BlockHash{1, 2}), std::nullopt);
  EXPECT_EQ(pc.block_size(), 4u);
  EXPECT_EQ(&pc.kv_cache(), &cache);
  EXPECT_EQ(pc.num_available_blocks(), 8u);
  EXPECT_DOUBLE_EQ(pc.counters().hit_rate(), 0.0);
}

// A plain model of the contract: a hash -> block map, per-block sequence
// references, and an LRU std::list (evictable blocks, least recently used
// first). Random traffic with thousands of evictions and hits must leave the
// prefix cache's LRU order, eviction choices and lookups equal to it.
TEST(PrefixCacheModel, LruOrderAndEvictionsMatchAReferenceUnderRandomTraffic) {
  constexpr std::size_t kBlocks = 64;
  std::unique_ptr<Backend> backend = host_backend();
  PagedKvCache cache(small_config(), kBlocks, *backend);
  PrefixCache pc(cache);

  std::map<std::uint64_t, BlockId> block_of;  // by hash.low (high = ~low)
  std::map<BlockId, std::uint64_t> hash_of;
  std::vector<std::uint32_t> holds(kBlocks, 0);  // the test's sequence references
  std::vector<BlockId> held;                     // one entry per reference
  std::list<BlockId> lru;
  std::uint64_t next_hash = 1;
  std::size_t evictions = 0;
  std::size_t hits = 0;
  const auto key = [](std::uint64_t low) { return BlockHash{low, ~low}; };
  const auto drop = [&](BlockId b) {
    block_of.erase(hash_of.at(b));
    hash_of.erase(b);
  };
  std::mt19937_64 rng(20261201);

  for (int step = 0; step < 40000; ++step) {
    // Sequences hold at most ~3/4 of the cache, so that allocations evict.
    const unsigned op = held.size() > 3 * kBlocks / 4 ? 50 : static_cast<unsigned>(rng() % 100);
    if (op < 35) {  // a new block, registered under a fresh hash (or a cached one)
      if (pc.num_available_blocks() == 0) continue;
      std::optional<BlockId> victim;
      if (cache.num_free_blocks() == 0) victim = lru.front();
      const BlockId b = pc.alloc_block();
      if (victim) {  // the evicted block goes back to the LIFO free list, and out again
        ASSERT_EQ(b, *victim) << "step " << step;
        lru.pop_front();
        drop(b);
        ++evictions;
      }
      ASSERT_FALSE(pc.is_cached(b));
      ++holds[b];
      held.push_back(b);
      if (rng() % 8 == 0 && !block_of.empty()) {
        const std::uint64_t h = block_of.begin()->first;
        EXPECT_FALSE(pc.insert(key(h), b)) << "a cached hash is not registered twice";
      } else {
        const std::uint64_t h = next_hash++;
        ASSERT_TRUE(pc.insert(key(h), b));
        block_of[h] = b;
        hash_of[b] = h;
      }
    } else if (op < 70) {  // sequences give a few references back
      for (std::size_t k = 1 + rng() % 4; k > 0 && !held.empty(); --k) {
        const std::size_t i = rng() % held.size();
        const BlockId b = held[i];
        held[i] = held.back();
        held.pop_back();
        pc.release(b);
        if (--holds[b] == 0 && hash_of.count(b) != 0) lru.push_back(b);
      }
    } else if (op < 95) {  // a lookup of a chain: cached hashes, then maybe a miss
      std::vector<BlockHash> chain;
      std::vector<BlockId> expect;
      const std::size_t n = 1 + rng() % 6;
      for (std::size_t k = 0; k < n && !block_of.empty(); ++k) {
        auto it = block_of.begin();
        std::advance(it, static_cast<std::ptrdiff_t>(rng() % block_of.size()));
        chain.push_back(key(it->first));
        expect.push_back(it->second);
      }
      if (rng() % 2 == 0) {  // a miss stops the match; what follows is not taken
        chain.push_back(key(next_hash + 1000000));
        if (!block_of.empty()) chain.push_back(key(block_of.begin()->first));
      }
      const PrefixMatch m = pc.lookup_hashes(chain);
      ASSERT_EQ(m.blocks, expect) << "step " << step;
      for (BlockId b : m.blocks) {
        if (holds[b]++ == 0) lru.remove(b);  // the first sequence reference: no longer evictable
        held.push_back(b);
        ++hits;
      }
    } else {  // an explicit eviction of a few blocks
      const std::size_t k = rng() % 4;
      const std::size_t expect = std::min(k, lru.size());
      ASSERT_EQ(pc.evict(k), expect);
      for (std::size_t j = 0; j < expect; ++j) {
        EXPECT_FALSE(pc.is_cached(lru.front()));
        drop(lru.front());
        lru.pop_front();
        ++evictions;
      }
    }
    ASSERT_EQ(pc.lru_order(), std::vector<BlockId>(lru.begin(), lru.end())) << "step " << step;
    ASSERT_EQ(pc.num_cached_blocks(), block_of.size());
    if (step % 500 == 0) {
      const InvariantReport r = pc.check_invariants();
      ASSERT_TRUE(r.ok) << "step " << step << ": " << r.to_string();
    }
  }
  EXPECT_GT(evictions, 1000u) << "the traffic must exercise eviction";
  EXPECT_GT(hits, 10000u);
  EXPECT_EQ(pc.counters().evictions, evictions);
  pc.release_blocks(held);
  EXPECT_INVARIANTS(pc);
}

// The bookkeeping is sized at construction: churn (hits that leave stale LRU
// queue slots behind, evictions, re-registrations) never grows it.
TEST(PrefixCacheMemoryUsage, IsFixedAtConstructionAndSmallPerBlock) {
  constexpr std::size_t kBlocks = 1024;
  std::unique_ptr<Backend> backend = host_backend();
  PagedKvCache cache(small_config(), kBlocks, *backend);
  PrefixCache pc(cache);
  const PrefixCacheMemory before = pc.memory_usage();
  EXPECT_EQ(before.total(), before.entry_bytes + before.index_bytes + before.lru_bytes);
  EXPECT_GE(before.entry_bytes, kBlocks * sizeof(BlockHash)) << "every block keeps its hash";
  EXPECT_GE(before.index_bytes, kBlocks * sizeof(BlockId)) << "room for every block's hash";
  EXPECT_GE(before.lru_bytes, kBlocks * sizeof(BlockId));
  EXPECT_LE(before.total(), kBlocks * 64) << "at most 64 bytes per block";

  // Fill the cache, then hit one block over and over (each hit + release
  // leaves a stale queue slot), and evict through new registrations.
  std::uint64_t h = 1;
  for (std::size_t i = 0; i < kBlocks; ++i) {
    const BlockId b = pc.alloc_block();
    ASSERT_TRUE(pc.insert(BlockHash{h, h}, b));
    ++h;
    pc.release(b);
  }
  const BlockHash hot{5, 5};
  for (int i = 0; i < 100000; ++i) {
    const PrefixMatch m = pc.lookup_hashes({&hot, 1});
    ASSERT_EQ(m.blocks.size(), 1u);
    pc.release(m.blocks[0]);
  }
  for (std::size_t i = 0; i < 4 * kBlocks; ++i) {
    const BlockId b = pc.alloc_block();
    ASSERT_TRUE(pc.insert(BlockHash{h, h}, b));
    ++h;
    pc.release(b);
  }
  EXPECT_EQ(pc.counters().evictions, 4 * kBlocks);
  EXPECT_EQ(pc.num_cached_blocks(), kBlocks);
  const PrefixCacheMemory after = pc.memory_usage();
  EXPECT_EQ(after.entry_bytes, before.entry_bytes);
  EXPECT_EQ(after.index_bytes, before.index_bytes);
  EXPECT_EQ(after.lru_bytes, before.lru_bytes);
  EXPECT_INVARIANTS(pc);
}

INSTANTIATE_TEST_SUITE_P(Pools, PrefixCacheTest, ::testing::Bool(),
                         [](const ::testing::TestParamInfo<bool>& p) {
                           return std::string(p.param ? "adopted" : "owned");
                         });

}  // namespace
}  // namespace kvport
