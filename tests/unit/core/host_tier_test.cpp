// SPDX-License-Identifier: Apache-2.0
// HostTier: write-back on eviction, write-through, onload on a lookup that
// runs past the device's prefix (data round trip in both layouts), the host
// LRU, exclusive vs inclusive tiers, the invariants of both tiers, and bad
// options. Every case also runs over K-only layers (head_dim_v 0), whose
// slots hold K alone.
#include <gtest/gtest.h>

#include <vector>

#include "core_test_util.hpp"
#include "kvport/core/block_table.hpp"
#include "kvport/core/host_tier.hpp"
#include "kvport/core/paged_kv_cache.hpp"
#include "kvport/core/prefix_cache.hpp"

namespace kvport {
namespace {

using test::host_backend;
using test::small_config;  // block_size 4, 3 layers, 128 bytes per K or V block

using test::tokens;

struct Param {
  KvCacheLayout layout;
  TierPolicy policy;
  bool k_only = false;   // head_dim_v 0: no V pools
  bool adopted = false;  // the cache's pools are the engine's memory
};

KvCacheConfig config_of(const Param& p) {
  KvCacheConfig c = small_config(p.layout);
  if (p.k_only) c.head_dim_v = 0;
  return c;
}

class HostTierTest : public ::testing::TestWithParam<Param> {
 protected:
  std::unique_ptr<Backend> backend = host_backend();
  Stream stream = backend->create_stream();
  test::EngineMemory engine;  // the pools, when adopted; outlives the cache
  PagedKvCache cache =
      test::make_cache(config_of(GetParam()), 4, *backend, GetParam().adopted ? &engine : nullptr);
  PrefixCache pc{cache};

  HostTierOptions options(std::size_t host_blocks,
                          TierInclusion inclusion = TierInclusion::exclusive) const {
    HostTierOptions o;
    o.num_host_blocks = host_blocks;
    o.policy = GetParam().policy;
    o.inclusion = inclusion;
    o.offload_batch = 2;
    return o;
  }

  // Writes a pattern unique to (tag, layer, K/V) into every layer of `block`.
  void fill(BlockId block, std::size_t tag) {
    test::write_pattern_block(cache, block, tag, stream);
  }
  bool holds(BlockId block, std::size_t tag) {
    return test::holds_pattern_block(cache, block, tag, stream);
  }

  // A sequence of 2 full blocks (8 tokens from `first`), each block filled
  // with the pattern of its tag (first + index), then released.
  void cache_sequence(TokenId first, HostTier& tier) {
    BlockTable t(pc);
    const std::vector<TokenId> prompt = tokens(8, first);
    ASSERT_EQ(t.reuse_cached_prefix(prompt, stream), 0u);
    t.append_tokens(prompt, stream);
    for (std::size_t i = 0; i < t.num_blocks(); ++i)
      fill(t.blocks()[i], first + i);
    tier.poll();  // write-through copies queue after the step's writes
  }
};

TEST_P(HostTierTest, EvictedBlocksComeBackFromTheHostWithTheirContents) {
  HostTier tier(pc, options(8));
  EXPECT_EQ(tier.slot_bytes(), 3u * (GetParam().k_only ? 1 : 2) * 128);
  cache_sequence(100, tier);  // blocks A0 A1
  cache_sequence(200, tier);  // blocks B0 B1: the device (4 blocks) is full of cached blocks
  EXPECT_TIER_INVARIANTS(tier);
  cache_sequence(300, tier);  // evicts A0 A1 to the host
  tier.synchronize();
  EXPECT_TIER_INVARIANTS(tier);
  const std::vector<BlockHash> a = hash_full_blocks(tokens(8, 100), 4);
  EXPECT_TRUE(tier.is_on_host(a[0]));
  EXPECT_TRUE(tier.is_on_host(a[1]));
  EXPECT_FALSE(pc.find(a[0]).has_value());
  EXPECT_GE(tier.counters().offloads, 2u);

  // A lookup of A: nothing on the device, both blocks on the host.
  PrefixMatch m = pc.lookup(tokens(9, 100));
  ASSERT_EQ(m.blocks.size(), 2u);
  EXPECT_EQ(m.lower_tier_blocks, 2u);
  EXPECT_EQ(m.num_tokens, 8u);
  EXPECT_TRUE(holds(m.blocks[0], 100));
  EXPECT_TRUE(holds(m.blocks[1], 101));
  EXPECT_EQ(pc.find(a[0]), m.blocks[0]);  // registered on the device
  EXPECT_EQ(tier.counters().onloads, 2u);
  EXPECT_EQ(tier.counters().host_hits, 2u);
  EXPECT_FALSE(tier.is_on_host(a[0]));  // exclusive: the slot was given back
  EXPECT_TIER_INVARIANTS(tier);
  pc.release_blocks(m.blocks);
  EXPECT_TIER_INVARIANTS(tier);
}

TEST_P(HostTierTest, InclusiveTierKeepsItsCopyAndSkipsTheSecondWriteBack) {
  HostTier tier(pc, options(8, TierInclusion::inclusive));
  cache_sequence(100, tier);
  cache_sequence(200, tier);
  cache_sequence(300, tier);
  tier.synchronize();
  PrefixMatch m = pc.lookup(tokens(8, 100));  // A, onloaded; evicts B to the host
  ASSERT_EQ(m.lower_tier_blocks, 2u);
  const std::vector<BlockHash> a = hash_full_blocks(tokens(8, 100), 4);
  EXPECT_TRUE(tier.is_on_host(a[0]));  // inclusive: still on the host too
  pc.release_blocks(m.blocks);         // LRU: C1 C0 A1 A0
  cache_sequence(400, tier);           // evicts C
  tier.synchronize();
  const std::uint64_t offloads = tier.counters().offloads;
  const std::uint64_t already = tier.counters().already_on_host;
  cache_sequence(500, tier);  // evicts A again: the host has it, no copy
  tier.synchronize();
  EXPECT_EQ(tier.counters().already_on_host, already + 2);
  if (GetParam().policy == TierPolicy::write_back) {
    EXPECT_EQ(tier.counters().offloads, offloads);
  }
  EXPECT_TIER_INVARIANTS(tier);
}

TEST_P(HostTierTest, HostLruDropsTheOldestBlockWhenFull) {
  HostTier tier(pc, options(2));
  for (TokenId first : {100, 200, 300, 400})
    cache_sequence(first, tier);
  tier.synchronize();
  EXPECT_TIER_INVARIANTS(tier);
  EXPECT_EQ(tier.num_ready_blocks() + tier.num_filling_blocks() + tier.num_free_host_blocks(), 2u);
  EXPECT_GE(tier.counters().host_evictions, 1u);
  const std::vector<BlockHash> a = hash_full_blocks(tokens(8, 100), 4);
  EXPECT_FALSE(tier.is_on_host(a[0]));  // the oldest went first
  PrefixMatch m = pc.lookup(tokens(8, 100));
  EXPECT_EQ(m.blocks.size(), 0u);
  EXPECT_EQ(tier.host_lru_order().size(), tier.num_ready_blocks());
}

TEST_P(HostTierTest, OnloadStopsWhenNoDeviceBlockIsFree) {
  HostTier tier(pc, options(8));
  cache_sequence(100, tier);
  cache_sequence(200, tier);
  cache_sequence(300, tier);
  tier.synchronize();
  // Hold every device block in use.
  std::vector<BlockId> held;
  while (auto b = pc.try_alloc_block())
    held.push_back(*b);
  PrefixMatch m = pc.lookup(tokens(8, 100));
  EXPECT_EQ(m.blocks.size(), 0u);
  EXPECT_EQ(tier.counters().onload_shortfalls, 2u);
  const std::vector<BlockHash> a = hash_full_blocks(tokens(8, 100), 4);
  EXPECT_TRUE(tier.is_on_host(a[0]));  // still there
  EXPECT_TIER_INVARIANTS(tier);
  pc.release_blocks(held);
  EXPECT_TIER_INVARIANTS(tier);
}

TEST_P(HostTierTest, WriteThroughCopiesRegisteredBlocksAtPoll) {
  HostTier tier(pc, options(8));
  cache_sequence(100, tier);
  tier.synchronize();
  const std::vector<BlockHash> a = hash_full_blocks(tokens(8, 100), 4);
  if (GetParam().policy == TierPolicy::write_through) {
    EXPECT_TRUE(tier.is_on_host(a[0]));
    EXPECT_TRUE(tier.is_on_host(a[1]));
    EXPECT_EQ(tier.counters().offloads, 2u);
  } else {
    EXPECT_FALSE(tier.is_on_host(a[0]));
    EXPECT_EQ(tier.counters().offloads, 0u);
  }
  EXPECT_TIER_INVARIANTS(tier);
}

TEST_P(HostTierTest, OffloadWritesBackAheadWithoutWaiting) {
  HostTier tier(pc, options(8));
  cache_sequence(100, tier);
  cache_sequence(200, tier);
  tier.synchronize();  // write-through: the blocks are held until their copies complete
  EXPECT_EQ(tier.offload(3), 3u);
  EXPECT_TIER_INVARIANTS(tier);
  tier.synchronize();
  EXPECT_EQ(cache.num_free_blocks(), 3u);
  EXPECT_EQ(tier.num_held_device_blocks(), 0u);
  EXPECT_TIER_INVARIANTS(tier);
}

TEST_P(HostTierTest, DestructorGivesEveryBlockBack) {
  {
    HostTier tier(pc, options(8));
    cache_sequence(100, tier);
    cache_sequence(200, tier);
    tier.offload(2);
    EXPECT_EQ(pc.tier(), &tier);
  }
  EXPECT_EQ(pc.tier(), nullptr);
  const InvariantReport r = pc.check_invariants();
  EXPECT_TRUE(r.ok) << r.to_string();
  EXPECT_EQ(r.blocks_in_use, 0u);
}

INSTANTIATE_TEST_SUITE_P(
    LayoutsAndPolicies, HostTierTest,
    ::testing::Values(Param{KvCacheLayout::layer_major, TierPolicy::write_back},
                      Param{KvCacheLayout::block_major, TierPolicy::write_back},
                      Param{KvCacheLayout::layer_major, TierPolicy::write_through},
                      Param{KvCacheLayout::block_major, TierPolicy::write_through},
                      Param{KvCacheLayout::layer_major, TierPolicy::write_back, true},
                      Param{KvCacheLayout::block_major, TierPolicy::write_back, true},
                      Param{KvCacheLayout::layer_major, TierPolicy::write_through, true},
                      Param{KvCacheLayout::block_major, TierPolicy::write_through, true},
                      // The same over the engine's memory (adopted pools).
                      Param{KvCacheLayout::layer_major, TierPolicy::write_back, false, true},
                      Param{KvCacheLayout::block_major, TierPolicy::write_back, false, true},
                      Param{KvCacheLayout::layer_major, TierPolicy::write_through, false, true},
                      Param{KvCacheLayout::block_major, TierPolicy::write_through, true, true}),
    [](const ::testing::TestParamInfo<Param>& p) {
      return std::string(p.param.layout == KvCacheLayout::layer_major ? "layer_major"
                                                                      : "block_major") +
             "_" + (p.param.policy == TierPolicy::write_back ? "write_back" : "write_through") +
             (p.param.k_only ? "_k_only" : "") + (p.param.adopted ? "_adopted" : "");
    });

// An engine registers a block when its tokens are appended, before the
// forward pass writes its KV. An allocation later in the same step that finds
// the free list empty must not copy that block to the host yet (it once
// flushed the write-through queue there, publishing the block's old bytes
// under its hash; the real bytes were then never written back, and a later
// lookup onloaded the old ones).
TEST(HostTier, WriteThroughNeverCopiesABlockBeforeTheStepWroteIt) {
  auto backend = host_backend();
  Stream stream = backend->create_stream();
  for (KvCacheLayout layout : {KvCacheLayout::layer_major, KvCacheLayout::block_major}) {
    PagedKvCache cache(small_config(layout), 6, *backend);
    PrefixCache pc(cache);
    HostTierOptions o;
    o.num_host_blocks = 8;
    o.policy = TierPolicy::write_through;
    o.offload_batch = 1;
    HostTier tier(pc, o, stream);
    {
      BlockTable x(pc);
      x.append_tokens(tokens(8, 900), stream);
      for (std::size_t i = 0; i < 2; ++i)
        test::write_pattern_block(cache, x.blocks()[i], 900 + i, stream);
      tier.poll();
      tier.synchronize();
    }  // X released: 4 free, 2 evictable (on the host too)
    const std::vector<TokenId> ta = tokens(8, 100);
    BlockTable a(pc);
    a.append_tokens(ta, stream);  // A0 A1 registered; their KV is not written yet
    BlockTable c(pc);
    c.append_tokens(tokens(12, 500), stream);  // the third block finds the free list empty
    for (std::size_t i = 0; i < 2; ++i)        // the step's kernels write A's KV now
      test::write_pattern_block(cache, a.blocks()[i], 100 + i, stream);
    tier.poll();  // A's write-through copies: after the writes
    a.release();
    c.release();
    tier.synchronize();
    tier.offload(8);
    tier.synchronize();
    EXPECT_TIER_INVARIANTS(tier);
    BlockTable again(pc);
    again.set_prefix_hit_mode(PrefixHitMode::full);
    ASSERT_EQ(again.reuse_cached_prefix(ta, stream), 8u);
    for (std::size_t i = 0; i < 2; ++i)
      EXPECT_TRUE(test::holds_pattern_block(cache, again.blocks()[i], 100 + i, stream))
          << to_string(layout) << " block " << i << " came back with bytes written before the step";
  }
}

TEST(HostTier, RegionsAreOnePerBlockInTheBlockMajorLayout) {
  auto backend = host_backend();
  for (KvCacheLayout layout : {KvCacheLayout::layer_major, KvCacheLayout::block_major}) {
    PagedKvCache cache(small_config(layout), 4, *backend);
    std::vector<std::byte> slot(HostTier::slot_bytes_for(cache));
    std::vector<HostCopyRegion> regions;
    HostTier::append_block_regions(cache, 2, slot.data(), regions);
    std::size_t bytes = 0;
    for (const HostCopyRegion& r : regions)
      bytes += r.bytes;
    EXPECT_EQ(bytes, slot.size());
    EXPECT_EQ(regions.front().host, slot.data());
    EXPECT_EQ(regions.size(), layout == KvCacheLayout::block_major ? 1u : 6u);
    // K-only layers: one K region per layer (or the whole block), no V.
    KvCacheConfig k_only = small_config(layout);
    k_only.head_dim_v = 0;
    PagedKvCache kc(k_only, 4, *backend);
    std::vector<std::byte> kslot(HostTier::slot_bytes_for(kc));
    EXPECT_EQ(kslot.size(), 3u * 128);
    regions.clear();
    HostTier::append_block_regions(kc, 2, kslot.data(), regions);
    ASSERT_EQ(regions.size(), layout == KvCacheLayout::block_major ? 1u : 3u);
    EXPECT_EQ(regions.back().device.address() + regions.back().bytes,
              kc.k_cache_ptr(2, 2).address() + 128);
  }
}

TEST(HostTier, BadOptionsAreRejected) {
  auto backend = host_backend();
  PagedKvCache cache(small_config(), 4, *backend);
  PrefixCache pc(cache);
  HostTierOptions o;
  test::expect_invalid_argument([&] { HostTier t(pc, o); }, "num_host_blocks must be in");
  o.num_host_blocks = 4;
  o.offload_batch = 0;
  test::expect_invalid_argument([&] { HostTier t(pc, o); }, "offload_batch must be in");
  o.offload_batch = 1;
  o.num_host_blocks = HostTierOptions::kMaxHostBlocks;  // 4 G blocks of 768 bytes: ~3 TiB
  test::expect_invalid_argument([&] { HostTier t(pc, o); }, "more memory than this machine has");
  o.num_host_blocks = 4;
  HostTier first(pc, o);
  test::expect_invalid_argument([&] { HostTier t(pc, o); }, "already has a tier");
  EXPECT_EQ(parse_tier_policy("write-back"), TierPolicy::write_back);
  EXPECT_EQ(parse_tier_policy("write-through"), TierPolicy::write_through);
  EXPECT_FALSE(parse_tier_policy("writeback").has_value());
  EXPECT_STREQ(to_string(TierPolicy::write_through), "write-through");
  EXPECT_STREQ(to_string(TierInclusion::inclusive), "inclusive");
}

}  // namespace
}  // namespace kvport
