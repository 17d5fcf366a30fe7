// SPDX-License-Identifier: Apache-2.0
// HostTier over a lower tier (lower_tier.hpp), here an in-memory store with
// an LRU, an admission filter and injected read failures: blocks the host
// drops go down and come back up through a host slot with their contents,
// exclusive and inclusive; a failed read ends the hit there (fail closed);
// holds() counts the lower tier; its events carry medium DISK; bad input.
#include <gtest/gtest.h>

#include <algorithm>
#include <list>
#include <map>
#include <optional>
#include <set>
#include <string>
#include <vector>

#include "core_test_util.hpp"
#include "kvport/core/block_table.hpp"
#include "kvport/core/host_tier.hpp"
#include "kvport/core/hybrid_host_tier.hpp"
#include "kvport/core/lower_tier.hpp"
#include "kvport/core/prefix_cache.hpp"
#include "memory_store.hpp"

namespace kvport {
namespace {

using test::host_backend;
using test::MemoryStore;
using test::small_config;
using test::tokens;

// The hashes each medium holds, rebuilt from the events.
class MediumSink final : public CacheEventSink {
 public:
  void stored(const EventSource& source, const BlockStoredView& v) noexcept override {
    for (std::size_t i = 0; i < v.hashes.size(); ++i) {
      if (!held[source.medium].insert(key(v.hashes[i])).second) ++errors;
      if (source.medium == Medium::disk) {
        disk_parent[key(v.hashes[i])] = i == 0 ? v.parent : v.hashes[i - 1];
      }
    }
  }
  void removed(const EventSource& source, std::span<const BlockHash> hashes) noexcept override {
    for (const BlockHash& h : hashes)
      if (held[source.medium].erase(key(h)) != 1) ++errors;
  }
  void cleared(const EventSource& source) noexcept override { held[source.medium].clear(); }

  static std::pair<std::uint64_t, std::uint64_t> key(const BlockHash& h) { return {h.high, h.low}; }
  bool has(Medium m, const BlockHash& h) const {
    const auto it = held.find(m);
    return it != held.end() && it->second.contains(key(h));
  }

  std::map<Medium, std::set<std::pair<std::uint64_t, std::uint64_t>>> held;
  std::map<std::pair<std::uint64_t, std::uint64_t>, std::optional<BlockHash>> disk_parent;
  int errors = 0;
};

class LowerTierTest : public ::testing::TestWithParam<KvCacheLayout> {
 protected:
  std::unique_ptr<Backend> backend = host_backend();
  Stream stream = backend->create_stream();
  PagedKvCache cache = test::make_cache(small_config(GetParam()), 4, *backend, nullptr);
  PrefixCache pc{cache};

  static HostTierOptions options(TierInclusion inclusion = TierInclusion::exclusive) {
    HostTierOptions o;
    o.num_host_blocks = 4;
    o.inclusion = inclusion;
    o.offload_batch = 2;
    return o;
  }

  // A sequence of 2 full blocks (8 tokens from `first`), block i filled with
  // the pattern of tag first + i, then released.
  void cache_sequence(TokenId first, HostTier& tier) {
    BlockTable t(pc);
    const std::vector<TokenId> prompt = tokens(8, first);
    t.reuse_cached_prefix(prompt, stream);
    t.append_tokens(std::span<const TokenId>(prompt).subspan(t.num_tokens()), stream);
    for (std::size_t i = 0; i < t.num_blocks(); ++i)
      test::write_pattern_block(cache, t.blocks()[i], first + i, stream);
    tier.poll();
  }

  // Sequences 100..500 through a device of 4 blocks and a host of 4: the
  // device ends with 400 and 500, the host with 200 and 300, and 100 was
  // dropped by the host (into the lower tier, when there is one).
  void fill_five(HostTier& tier) {
    for (TokenId first : {100, 200, 300, 400, 500})
      cache_sequence(first, tier);
    tier.synchronize();
  }

  std::vector<BlockHash> hashes_of(TokenId first) const {
    return hash_full_blocks(tokens(8, first), 4);
  }

  // fill_five with host_free_watermark `watermark`, a poll, then the lookup
  // of sequence 100 (in the lower tier): who wrote host blocks down.
  void lookup_after_fill(std::size_t watermark) {
    MemoryStore store(HostTier::slot_bytes_for(cache), 16);  // outlives the tier
    HostTierOptions o = options();
    o.host_free_watermark = watermark;
    HostTier tier(pc, o);
    tier.set_lower_tier(&store);
    fill_five(tier);
    tier.poll();
    if (watermark != 0) {
      EXPECT_GE(tier.num_free_host_blocks(), watermark);
      EXPECT_GT(tier.counters().poll_spills, 0u);
    } else {
      EXPECT_EQ(tier.num_free_host_blocks(), 0u);
      EXPECT_EQ(tier.counters().poll_spills, 0u);
    }
    PrefixMatch m = pc.lookup(tokens(9, 100));
    ASSERT_EQ(m.blocks.size(), 2u);
    EXPECT_EQ(m.lower_tier_blocks, 2u);
    EXPECT_TRUE(test::holds_pattern_block(cache, m.blocks[0], 100, stream));
    EXPECT_TRUE(test::holds_pattern_block(cache, m.blocks[1], 101, stream));
    // Written down before the read (the onload's device evictions may write
    // the host's blocks down afterwards, as any write-back does).
    EXPECT_EQ(tier.counters().lookup_spills, watermark != 0 ? 0u : 2u);
    EXPECT_GE(tier.counters().lower_tier_offers,
              tier.counters().lookup_spills + tier.counters().poll_spills);
    EXPECT_TIER_INVARIANTS(tier);
    pc.release_blocks(m.blocks);
    EXPECT_TIER_INVARIANTS(tier);
  }
};

TEST_P(LowerTierTest, DroppedHostBlocksComeBackThroughAHostSlotWithTheirContents) {
  MemoryStore store(HostTier::slot_bytes_for(cache), 16);  // outlives the tier
  HostTier tier(pc, options());
  tier.set_lower_tier(&store);
  EXPECT_EQ(tier.lower_tier(), &store);
  EXPECT_EQ(store.event_block_size(), pc.tokens_per_block());  // announcing as the tier's disk
  fill_five(tier);
  const std::vector<BlockHash> a = hashes_of(100);
  EXPECT_TRUE(store.contains(a[0]));
  EXPECT_TRUE(store.contains(a[1]));
  EXPECT_FALSE(tier.is_on_host(a[0]));
  EXPECT_EQ(tier.counters().lower_tier_offers, 2u);
  EXPECT_EQ(tier.counters().lower_tier_writes, 2u);
  EXPECT_EQ(store.put_calls, 1u);  // one batch
  EXPECT_TIER_INVARIANTS(tier);

  PrefixMatch m = pc.lookup(tokens(9, 100));
  ASSERT_EQ(m.blocks.size(), 2u);
  EXPECT_EQ(m.lower_tier_blocks, 2u);
  EXPECT_TRUE(test::holds_pattern_block(cache, m.blocks[0], 100, stream));
  EXPECT_TRUE(test::holds_pattern_block(cache, m.blocks[1], 101, stream));
  EXPECT_EQ(store.get_calls, 1u);  // one read batch
  EXPECT_EQ(tier.counters().lower_tier_hits, 2u);
  EXPECT_EQ(tier.counters().host_hits, 0u);
  EXPECT_EQ(tier.counters().onloads, 2u);
  // Exclusive: the blocks left the lower tier and the host on their way up.
  EXPECT_FALSE(store.contains(a[0]));
  EXPECT_FALSE(tier.is_on_host(a[0]));
  EXPECT_EQ(pc.find(a[0]), m.blocks[0]);
  EXPECT_TIER_INVARIANTS(tier);
  pc.release_blocks(m.blocks);
  EXPECT_TIER_INVARIANTS(tier);
}

TEST_P(LowerTierTest, AHitRunsDeviceThenHostThenLowerTierInOneLookup) {
  MemoryStore store(HostTier::slot_bytes_for(cache), 16);  // outlives the tier
  HostTier tier(pc, options());
  tier.set_lower_tier(&store);
  // One sequence of 4 blocks whose first block stays on the device, the
  // next on the host and the last two in the lower tier: 16 tokens from 100.
  BlockTable t(pc);
  const std::vector<TokenId> prompt = tokens(16, 100);
  t.append_tokens(prompt, stream);
  for (std::size_t i = 0; i < 4; ++i)
    test::write_pattern_block(cache, t.blocks()[i], 100 + i, stream);
  t.release();
  const std::vector<BlockHash> h = hash_full_blocks(prompt, 4);
  // Released last block first: LRU order 3 2 1 0. Push 3, 2, 1 down.
  ASSERT_EQ(tier.offload(3), 3u);
  tier.synchronize();
  for (int i = 0; i < 2; ++i)
    cache_sequence(static_cast<TokenId>(200 + 100 * i), tier);
  tier.synchronize();
  ASSERT_TRUE(pc.find(h[0]).has_value() || tier.is_on_host(h[0]) || store.contains(h[0]));
  std::size_t on_device = 0, on_host = 0, below = 0;
  for (const BlockHash& x : h) {
    on_device += pc.find(x).has_value();
    on_host += tier.is_on_host(x);
    below += store.contains(x);
  }
  EXPECT_EQ(on_device + on_host + below, 4u);
  EXPECT_GE(below, 1u);
  PrefixMatch m = pc.lookup(prompt);
  ASSERT_EQ(m.blocks.size(), 4u);
  for (std::size_t i = 0; i < 4; ++i)
    EXPECT_TRUE(test::holds_pattern_block(cache, m.blocks[i], 100 + i, stream)) << i;
  EXPECT_EQ(tier.counters().lower_tier_hits, below);
  EXPECT_TIER_INVARIANTS(tier);
  pc.release_blocks(m.blocks);
}

TEST_P(LowerTierTest, AHashNamedTwiceEndsTheRunInTheLowerTier) {
  MemoryStore store(HostTier::slot_bytes_for(cache), 16);  // outlives the tier
  HostTier tier(pc, options());
  tier.set_lower_tier(&store);
  fill_five(tier);
  const std::vector<BlockHash> a = hashes_of(100);
  ASSERT_TRUE(store.contains(a[0]));
  // A caller's span, not a chain: the second a[0] ends the hit after one.
  const std::vector<BlockHash> twice{a[0], a[0], a[1]};
  PrefixMatch m = pc.lookup_hashes(twice);
  ASSERT_EQ(m.blocks.size(), 1u);
  EXPECT_TRUE(test::holds_pattern_block(cache, m.blocks[0], 100, stream));
  EXPECT_EQ(tier.counters().lower_tier_hits, 1u);
  EXPECT_TIER_INVARIANTS(tier);
  pc.release_blocks(m.blocks);
  EXPECT_TIER_INVARIANTS(tier);
}

TEST_P(LowerTierTest, InclusiveTierLeavesTheBlockInTheLowerTier) {
  MemoryStore store(HostTier::slot_bytes_for(cache), 16);  // outlives the tier
  HostTier tier(pc, options(TierInclusion::inclusive));
  tier.set_lower_tier(&store);
  fill_five(tier);
  const std::vector<BlockHash> a = hashes_of(100);
  ASSERT_TRUE(store.contains(a[0]));
  PrefixMatch m = pc.lookup(tokens(9, 100));
  ASSERT_EQ(m.blocks.size(), 2u);
  EXPECT_TRUE(store.contains(a[0]));
  EXPECT_TRUE(store.contains(a[1]));
  EXPECT_TRUE(tier.is_on_host(a[0]));  // and on the host
  EXPECT_TIER_INVARIANTS(tier);
  pc.release_blocks(m.blocks);
}

TEST_P(LowerTierTest, AFailedReadEndsTheHitThereAndServesNothingOfIt) {
  MemoryStore store(HostTier::slot_bytes_for(cache), 16);  // outlives the tier
  HostTier tier(pc, options());
  tier.set_lower_tier(&store);
  fill_five(tier);
  const std::vector<BlockHash> a = hashes_of(100);
  store.reads_left = 1;  // the second block's read fails
  PrefixMatch m = pc.lookup(tokens(9, 100));
  ASSERT_EQ(m.blocks.size(), 1u);
  EXPECT_TRUE(test::holds_pattern_block(cache, m.blocks[0], 100, stream));
  EXPECT_EQ(tier.counters().lower_tier_hits, 1u);
  EXPECT_EQ(tier.counters().lower_tier_shortfalls, 1u);
  EXPECT_FALSE(store.contains(a[1]));  // dropped by the store
  EXPECT_FALSE(tier.is_on_host(a[1]));
  EXPECT_FALSE(pc.find(a[1]).has_value());
  EXPECT_TIER_INVARIANTS(tier);
  pc.release_blocks(m.blocks);

  // Every read failing: no hit at all, the lookup is a miss.
  store.reads_left = 0;
  const std::vector<BlockHash> b = hashes_of(200);
  const bool b_below = store.contains(b[0]);
  PrefixMatch none = pc.lookup(tokens(9, 200));
  if (b_below) {
    EXPECT_TRUE(none.blocks.empty());
  }
  EXPECT_TIER_INVARIANTS(tier);
  pc.release_blocks(none.blocks);
}

TEST_P(LowerTierTest, HoldsCountsTheLowerTierAndUninstallingStopsIt) {
  MemoryStore store(HostTier::slot_bytes_for(cache), 16);  // outlives the tier
  HostTier tier(pc, options());
  tier.set_lower_tier(&store);
  fill_five(tier);
  const PrefixCacheTier& as_tier = tier;
  const BlockHash a0 = hashes_of(100)[0];
  (void)as_tier;
  EXPECT_TRUE(pc.tier() == &tier);
  // holds() is private to the PrefixCacheTier interface: reach it through it.
  const PrefixCacheTier* base = pc.tier();
  EXPECT_TRUE(base->holds(a0));
  tier.set_lower_tier(nullptr);
  EXPECT_EQ(store.event_block_size(), 0u);  // no longer announcing for the tier
  EXPECT_FALSE(base->holds(a0));
  PrefixMatch m = pc.lookup(tokens(9, 100));
  EXPECT_TRUE(m.blocks.empty());  // the lower tier is not asked any more
  EXPECT_EQ(store.get_calls, 0u);
  EXPECT_TIER_INVARIANTS(tier);
}

// Without a watermark the lookup of the dropped sequence finds the host full
// and writes two host blocks down before it reads; with host_free_watermark 2
// poll() has written them down already, and the lookup only reads.
TEST_P(LowerTierTest, WithoutAHostFreeWatermarkALookupWritesBeforeItReads) {
  lookup_after_fill(0);
}

TEST_P(LowerTierTest, AHostFreeWatermarkWritesDownInPollSoALookupOnlyReads) {
  lookup_after_fill(2);
}

TEST_P(LowerTierTest, AHostFreeWatermarkAboveHalfTheHostIsRefused) {
  HostTierOptions o = options();
  o.host_free_watermark = 3;  // of 4 host blocks
  test::expect_invalid_argument([&] { HostTier tier(pc, o); }, "host_free_watermark");
  // Without a lower tier poll() has nothing to write down to.
  o.host_free_watermark = 2;
  HostTier tier(pc, o);
  fill_five(tier);
  tier.poll();
  EXPECT_EQ(tier.counters().poll_spills, 0u);
  EXPECT_EQ(tier.counters().lookup_spills, 0u);
}

TEST_P(LowerTierTest, AStoreOfAnotherBlockSizeIsRefused) {
  HostTier tier(pc, options());
  MemoryStore wrong(tier.slot_bytes() + 1, 4);
  test::expect_invalid_argument([&] { tier.set_lower_tier(&wrong); }, "host slots");
  EXPECT_EQ(tier.lower_tier(), nullptr);
  EXPECT_EQ(wrong.event_block_size(), 0u);
}

TEST_P(LowerTierTest, AdmissionCountsTheLookupsHits) {
  MemoryStore store(HostTier::slot_bytes_for(cache), 16);  // outlives the tier
  HostTier tier(pc, options());
  store.min_hits = 1;  // only blocks hit at least once go down
  tier.set_lower_tier(&store);
  cache_sequence(100, tier);
  // A hit on 100's blocks (a lookup that runs past them): they qualify.
  PrefixMatch m = pc.lookup(tokens(13, 100));
  EXPECT_EQ(m.blocks.size(), 2u);
  pc.release_blocks(m.blocks);
  for (TokenId first : {200, 300, 400, 500, 600})
    cache_sequence(first, tier);
  tier.synchronize();
  // 100 and 200 were dropped by the host: only 100 was hit.
  EXPECT_TRUE(store.contains(hashes_of(100)[0]));
  EXPECT_FALSE(store.contains(hashes_of(200)[0]));
  EXPECT_EQ(store.not_admitted, 2u);
  EXPECT_EQ(tier.counters().lower_tier_offers, 4u);
  EXPECT_EQ(tier.counters().lower_tier_writes, 2u);
  EXPECT_TIER_INVARIANTS(tier);
}

TEST_P(LowerTierTest, LowerTierEventsCarryMediumDisk) {
  MediumSink sink;
  {
    MemoryStore store(HostTier::slot_bytes_for(cache), 4);  // two sequences; outlives the tier
    HostTier tier(pc, options());
    pc.set_event_sink(&sink);
    tier.set_event_sink(&sink);
    tier.set_lower_tier(&store);
    fill_five(tier);
    const std::vector<BlockHash> a = hashes_of(100);
    EXPECT_TRUE(sink.has(Medium::disk, a[0]));
    EXPECT_TRUE(sink.has(Medium::disk, a[1]));
    EXPECT_FALSE(sink.has(Medium::cpu, a[0]));
    // Announced with the parents the host slots kept.
    ASSERT_EQ(sink.disk_parent.size(), 2u);
    EXPECT_FALSE(sink.disk_parent[MediumSink::key(a[0])].has_value());
    EXPECT_EQ(sink.disk_parent[MediumSink::key(a[1])], std::optional<BlockHash>(a[0]));
    // Two more sequences: the store (4 blocks) takes b, then evicts a for c.
    cache_sequence(600, tier);
    cache_sequence(700, tier);
    tier.synchronize();
    const std::vector<BlockHash> b = hashes_of(200);
    EXPECT_FALSE(sink.has(Medium::disk, a[0]));
    EXPECT_TRUE(sink.has(Medium::disk, b[0]));
    // Up again: removed from DISK, stored on the device.
    PrefixMatch m = pc.lookup(tokens(9, 200));
    ASSERT_EQ(m.blocks.size(), 2u);
    EXPECT_FALSE(sink.has(Medium::disk, b[0]));
    EXPECT_TRUE(sink.has(Medium::gpu, b[0]));
    pc.release_blocks(m.blocks);
    // The snapshot lists the same disk blocks as the live events.
    MediumSink snap;
    tier.snapshot(snap);
    EXPECT_EQ(snap.held[Medium::disk], sink.held[Medium::disk]);
    EXPECT_EQ(snap.held[Medium::cpu], sink.held[Medium::cpu]);
    EXPECT_EQ(sink.errors, 0);
    pc.set_event_sink(nullptr);
  }
  EXPECT_TRUE(sink.held[Medium::disk].empty());  // cleared with the tier
  EXPECT_EQ(sink.errors, 0);
}

// The store announces its own blocks to whatever sink the tier has, in
// whichever order the two were installed, and stops when the tier's stops.
TEST_P(LowerTierTest, TheStoreAnnouncesToTheTiersSinkWhicheverCameFirst) {
  MediumSink sink;
  MemoryStore store(HostTier::slot_bytes_for(cache), 4);  // outlives the tier
  {
    HostTier tier(pc, options());
    tier.set_lower_tier(&store);
    EXPECT_EQ(store.event_sink(), nullptr);
    pc.set_event_sink(&sink);
    tier.set_event_sink(&sink,
                        EventSource{Medium::cpu, 3u, std::string("full_attention"), std::nullopt});
    EXPECT_EQ(store.event_sink(), &sink);
    EXPECT_EQ(store.event_source().medium, Medium::disk);
    EXPECT_EQ(store.event_source().group_idx, std::optional<std::uint32_t>(3));
    fill_five(tier);
    EXPECT_TRUE(sink.has(Medium::disk, hashes_of(100)[0]));
    tier.set_event_sink(nullptr);
    EXPECT_EQ(store.event_sink(), nullptr);
    pc.set_event_sink(nullptr);
  }
  EXPECT_EQ(store.event_sink(), nullptr);
  EXPECT_EQ(sink.errors, 0);
}

TEST_P(LowerTierTest, InstallingAStoreThatHoldsBlocksAnnouncesThem) {
  MemoryStore store(HostTier::slot_bytes_for(cache), 8);  // outlives the tier
  HostTier tier(pc, options());
  std::vector<std::byte> image(tier.slot_bytes(), std::byte{7});
  const std::vector<BlockHash> a = hashes_of(100);
  const std::span<const std::byte> images[2] = {image, image};
  ASSERT_EQ(store.put(a, images, {}), 2u);  // a store that was warm at start
  MediumSink sink;
  tier.set_event_sink(&sink);
  tier.set_lower_tier(&store);
  EXPECT_TRUE(sink.has(Medium::disk, a[0]));
  EXPECT_TRUE(sink.has(Medium::disk, a[1]));
  tier.set_event_sink(nullptr);
}

INSTANTIATE_TEST_SUITE_P(Layouts, LowerTierTest,
                         ::testing::Values(KvCacheLayout::layer_major, KvCacheLayout::block_major),
                         [](const auto& param_info) {
                           return param_info.param == KvCacheLayout::layer_major ? "LayerMajor"
                                                                                 : "BlockMajor";
                         });

// The hybrid tier hands a group its own store; groups without a tier or out
// of range are refused.
TEST(HybridLowerTier, SetLowerTierChecksTheGroup) {
  std::unique_ptr<Backend> backend = host_backend();
  const std::vector<std::size_t> device{10, 10, 6};
  HybridKvCache cache(test::three_group_config(), device, *backend);
  HybridHostTierOptions o;
  o.slots_per_group = {4, 0, 4};
  HybridHostTier tier(cache, o);
  MemoryStore store(tier.group_tier(0)->slot_bytes(), 8);
  tier.set_lower_tier(0, &store);
  EXPECT_EQ(tier.group_tier(0)->lower_tier(), &store);
  test::expect_invalid_argument([&] { tier.set_lower_tier(1, &store); }, "no host tier");
  EXPECT_THROW(tier.set_lower_tier(3, &store), OutOfRange);
  tier.set_lower_tier(0, nullptr);
  EXPECT_EQ(store.event_block_size(), 0u);  // no longer announcing for the tier
}

}  // namespace
}  // namespace kvport
