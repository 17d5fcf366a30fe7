// SPDX-License-Identifier: Apache-2.0
// HostTier against slow copies and concurrent streams.
//
// Slow stream: a GatedBackend (tests/support) holds the tier's copies on its
// stream until the test opens the gate, so "the copy has not run yet" is a
// state the test controls instead of a race it hopes to win. While a
// write-back is held its device blocks stay held (never handed out), its host
// slots stay filling (invisible to lookups), poll() sees the event not done,
// and an allocation that needs those blocks waits (a blocked synchronize)
// instead of reusing them; data patterns prove the host copy holds what the
// block held before anyone could overwrite it.
//
// Concurrency (built and run by the tsan preset too): the tier works on one
// thread while a second thread copies and fills blocks of its own on another
// stream of the same backend.
#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <string>
#include <thread>
#include <vector>

#include "core_test_util.hpp"
#include "kvport/core/host_tier.hpp"
#include "kvport/core/paged_kv_cache.hpp"
#include "kvport/core/prefix_cache.hpp"
#include "kvport/testing/gated_backend.hpp"

namespace kvport {
namespace {

using kvport::testing::GatedBackend;
using kvport::testing::GateHolds;

#define ASSERT_TIER_OK(tier)                              \
  do {                                                    \
    const InvariantReport r_ = (tier).check_invariants(); \
    ASSERT_TRUE(r_.ok) << r_.to_string();                 \
  } while (0)

using test::seq_hashes;  // sequence k: 4-token blocks from 1000 * k
using test::tag_of;
using test::tokens;

class HostTierSlowStream : public ::testing::TestWithParam<KvCacheLayout> {
 protected:
  GatedBackend gb{test::host_backend()};
  Stream stream = gb.create_stream();
  PagedKvCache cache{test::small_config(GetParam()), 4, gb};
  PrefixCache pc{cache};

  static HostTierOptions options(TierPolicy policy = TierPolicy::write_back,
                                 std::size_t host_blocks = 4) {
    HostTierOptions o;
    o.num_host_blocks = host_blocks;
    o.policy = policy;
    o.offload_batch = 2;
    // The gate opens at a blocked synchronize: these tests watch the tier
    // wait without a deadline (the deadline tests below set one).
    o.copy_timeout = std::chrono::milliseconds(0);
    return o;
  }
  // A deadline short enough that a held copy misses it.
  static HostTierOptions with_deadline() {
    HostTierOptions o = options();
    o.copy_timeout = std::chrono::milliseconds(20);
    return o;
  }

  void fill(BlockId block, std::size_t tag) {
    test::write_pattern_block(cache, block, tag, stream);
  }
  bool holds(BlockId block, std::size_t tag) {
    return test::holds_pattern_block(cache, block, tag, stream);
  }
  // Sequence k (2 blocks) cached on the device with its patterns; returns
  // its blocks.
  std::vector<BlockId> cache_sequence(std::size_t k) {
    const std::vector<BlockHash> h = seq_hashes(k);
    std::vector<BlockId> table;
    for (std::size_t i = 0; i < h.size(); ++i) {
      const BlockId b = pc.alloc_block();
      fill(b, tag_of(k, i));
      EXPECT_TRUE(pc.insert(h[i], b));
      table.push_back(b);
    }
    pc.release_blocks(table);
    return table;
  }
  // Looks sequence k up and expects all of it, with its patterns.
  void expect_sequence_back(std::size_t k, std::size_t from_host) {
    const PrefixMatch m = pc.lookup_hashes(seq_hashes(k));
    ASSERT_EQ(m.blocks.size(), 2u);
    EXPECT_EQ(m.lower_tier_blocks, from_host);
    EXPECT_TRUE(holds(m.blocks[0], tag_of(k, 0))) << "sequence " << k << " block 0";
    EXPECT_TRUE(holds(m.blocks[1], tag_of(k, 1))) << "sequence " << k << " block 1";
    pc.release_blocks(m.blocks);
  }
};

TEST_P(HostTierSlowStream, AHeldWriteBackKeepsItsBlocksAndSlotsAndAnAllocationWaitsForIt) {
  HostTier tier(pc, options());
  const std::vector<BlockId> one = cache_sequence(1);
  cache_sequence(2);
  const std::vector<BlockHash> h1 = seq_hashes(1);
  gb.close_gate();
  EXPECT_EQ(tier.offload(2), 2u);  // sequence 1: its copy is held
  EXPECT_EQ(gb.held_copies(), 1u);
  for (int i = 0; i < 3; ++i)
    tier.poll();
  EXPECT_GE(gb.queries_not_done(), 1u) << "poll asked, and the copy was not done";
  EXPECT_EQ(gb.blocked_synchronizes(), 0u) << "poll never waits";
  ASSERT_TIER_OK(tier);
  EXPECT_EQ(tier.num_filling_blocks(), 2u);
  EXPECT_EQ(tier.num_held_device_blocks(), 2u);
  EXPECT_EQ(cache.num_free_blocks(), 0u) << "held blocks are not free";
  for (std::size_t i = 0; i < 2; ++i) {
    EXPECT_GT(cache.ref_count(one[i]), 0u);
    EXPECT_FALSE(pc.is_cached(one[i])) << "evicted";
    EXPECT_FALSE(tier.is_on_host(h1[i])) << "filling: invisible";
  }
  // A lookup does not see the filling slots (nothing to onload from yet).
  {
    const PrefixMatch m = pc.lookup_hashes(h1);
    EXPECT_TRUE(m.blocks.empty());
    EXPECT_EQ(m.lower_tier_blocks, 0u);
    EXPECT_EQ(gb.blocked_synchronizes(), 0u);
  }
  // An allocation: the free list is empty, sequence 2 is evictable, but the
  // tier's own held blocks come first: it must wait for their copy, and
  // nothing may be handed out before.
  bool checked = false;
  gb.set_on_blocked_synchronize([&] {
    checked = true;
    EXPECT_EQ(cache.num_free_blocks(), 0u) << "a held block was freed before its copy";
    for (BlockId b : one)
      EXPECT_GT(cache.ref_count(b), 0u);
    EXPECT_FALSE(tier.is_on_host(h1[0]));
  });
  std::vector<BlockId> got{pc.alloc_block(), pc.alloc_block()};
  gb.set_on_blocked_synchronize(nullptr);
  EXPECT_TRUE(checked) << "the allocation waited for the held copy";
  EXPECT_EQ(gb.blocked_synchronizes(), 1u);
  EXPECT_EQ(tier.counters().offload_waits, 1u);
  EXPECT_TRUE(tier.is_on_host(h1[0]));
  EXPECT_TRUE(tier.is_on_host(h1[1]));
  EXPECT_TRUE(pc.find(seq_hashes(2)[0]).has_value()) << "sequence 2 was not evicted";
  // The blocks handed out are sequence 1's old blocks: overwrite them.
  std::vector<BlockId> sorted_got = got;
  std::sort(sorted_got.begin(), sorted_got.end());
  std::vector<BlockId> sorted_one = one;
  std::sort(sorted_one.begin(), sorted_one.end());
  EXPECT_EQ(sorted_got, sorted_one);
  fill(got[0], 98);
  fill(got[1], 99);
  pc.release_blocks(got);
  ASSERT_TIER_OK(tier);
  // The host copy holds what the blocks held before: the patterns of 1.
  expect_sequence_back(1, 2);
  ASSERT_TIER_OK(tier);
}

TEST_P(HostTierSlowStream, AHeldOnloadRegistersNothingUntilItsCopyCompleted) {
  HostTier tier(pc, options());
  cache_sequence(1);
  cache_sequence(2);
  EXPECT_EQ(tier.offload(2), 2u);
  tier.synchronize();
  const std::vector<BlockHash> h1 = seq_hashes(1);
  ASSERT_TRUE(tier.is_on_host(h1[0]));
  // The two free blocks get other bytes first.
  {
    std::vector<BlockId> scratch{pc.alloc_block(), pc.alloc_block()};
    fill(scratch[0], 98);
    fill(scratch[1], 99);
    pc.release_blocks(scratch);
  }
  gb.close_gate({.d2h = false, .h2d = true});
  bool checked = false;
  gb.set_on_blocked_synchronize([&] {
    checked = true;
    EXPECT_FALSE(pc.find(h1[0]).has_value()) << "registered before its copy completed";
    EXPECT_FALSE(pc.find(h1[1]).has_value());
    EXPECT_EQ(tier.num_ready_blocks(), 2u) << "the source slots are still there";
  });
  const PrefixMatch m = pc.lookup_hashes(h1);
  gb.set_on_blocked_synchronize(nullptr);
  EXPECT_TRUE(checked) << "the onload waited for its copy";
  EXPECT_EQ(gb.held_copies(), 1u);
  ASSERT_EQ(m.blocks.size(), 2u);
  EXPECT_EQ(m.lower_tier_blocks, 2u);
  EXPECT_TRUE(holds(m.blocks[0], tag_of(1, 0)));
  EXPECT_TRUE(holds(m.blocks[1], tag_of(1, 1)));
  pc.release_blocks(m.blocks);
  ASSERT_TIER_OK(tier);
}

TEST_P(HostTierSlowStream, AHeldWriteThroughKeepsItsBlocksCachedAndUnevictable) {
  HostTier tier(pc, options(TierPolicy::write_through));
  gb.close_gate();
  const std::vector<BlockId> one = cache_sequence(1);
  tier.poll();  // queues the write-through: held
  tier.poll();
  EXPECT_EQ(gb.held_copies(), 1u);
  EXPECT_GE(gb.queries_not_done(), 1u);
  const std::vector<BlockHash> h1 = seq_hashes(1);
  for (std::size_t i = 0; i < 2; ++i) {
    EXPECT_EQ(cache.ref_count(one[i]), 2u) << "the cache's reference and the tier's";
    EXPECT_FALSE(pc.is_evictable(one[i]));
    EXPECT_FALSE(tier.is_on_host(h1[i]));
  }
  EXPECT_EQ(pc.evict(4), 0u) << "a block whose copy is in flight is not evicted";
  ASSERT_TIER_OK(tier);
  tier.synchronize();
  EXPECT_EQ(gb.blocked_synchronizes(), 1u);
  EXPECT_TRUE(tier.is_on_host(h1[0]));
  EXPECT_TRUE(pc.is_evictable(one[0]));
  // Evicted now (no copy: the host has it), overwritten, and back intact.
  cache_sequence(2);
  tier.poll();
  tier.synchronize();
  std::vector<BlockId> got{pc.alloc_block(), pc.alloc_block()};  // evicts 1
  EXPECT_FALSE(pc.find(h1[0]).has_value());
  fill(got[0], 98);
  fill(got[1], 99);
  pc.release_blocks(got);
  expect_sequence_back(1, 2);
  ASSERT_TIER_OK(tier);
}

TEST_P(HostTierSlowStream, AFillingSlotIsNeverReusedForAnotherBlock) {
  HostTier tier(pc, options(TierPolicy::write_back, 2));
  cache_sequence(1);
  cache_sequence(2);
  gb.close_gate();
  EXPECT_EQ(tier.offload(2), 2u);  // sequence 1 fills both slots
  EXPECT_EQ(tier.offload(2), 2u);  // sequence 2: no slot (both filling): dropped
  EXPECT_EQ(gb.held_copies(), 1u) << "no second copy into the filling slots";
  EXPECT_EQ(tier.counters().dropped_offloads, 2u);
  EXPECT_EQ(tier.num_filling_blocks(), 2u);
  EXPECT_EQ(tier.num_held_device_blocks(), 2u);
  EXPECT_EQ(cache.num_free_blocks(), 2u) << "sequence 2's blocks, dropped without a copy";
  ASSERT_TIER_OK(tier);
  gb.open_gate();
  tier.synchronize();
  EXPECT_TRUE(tier.is_on_host(seq_hashes(1)[0]));
  EXPECT_FALSE(tier.is_on_host(seq_hashes(2)[0]));
  expect_sequence_back(1, 2);
  ASSERT_TIER_OK(tier);
}

// When recording copies_done after a queued copy throws, queue_copies
// synchronizes the tier's stream (so the queued copy finishes before the
// rollback). An error from that synchronize may belong to an EARLIER batch
// still in flight whose copy failed on the stream: it was once dropped, the
// next wait_all saw a clean stream and published that batch with bytes its
// copy never wrote. Now every transfer in flight is rolled back and counted.
TEST_P(HostTierSlowStream, AnEarlierCopysErrorIsNotLostWhenALaterCopyFailsToQueue) {
  HostTier tier(pc, options());
  cache_sequence(1);
  cache_sequence(2);
  const std::vector<BlockHash> h1 = seq_hashes(1);
  gb.fail_next_host_copy();
  EXPECT_EQ(tier.offload(2), 2u);  // sequence 1: its copy fails on the stream
  gb.fail_record_event(2);         // the next batch: copies_done cannot be recorded
  EXPECT_EQ(tier.offload(2), 2u);  // sequence 2: rolled back at the call
  // The rollback's synchronize reported sequence 1's error: both rolled back.
  EXPECT_EQ(tier.counters().aborted_transfers, 2u);
  tier.synchronize();
  ASSERT_TIER_OK(tier);
  EXPECT_FALSE(tier.is_on_host(h1[0])) << "its copy failed: it is not on the host";
  EXPECT_FALSE(tier.is_on_host(h1[1]));
  EXPECT_EQ(tier.counters().aborted_transfers, 2u) << "both failures rolled back and counted";
  // Never stale data: a lookup returns the right bytes or nothing.
  const PrefixMatch m = pc.lookup_hashes(h1);
  for (std::size_t i = 0; i < m.blocks.size(); ++i)
    EXPECT_TRUE(holds(m.blocks[i], tag_of(1, i))) << "block " << i << " onloaded garbage";
  pc.release_blocks(m.blocks);
  ASSERT_TIER_OK(tier);
}

// The control: the same failed copy alone is rolled back at the synchronize.
TEST_P(HostTierSlowStream, AFailedCopyOnTheStreamIsRolledBackAtTheSynchronize) {
  HostTier tier(pc, options());
  cache_sequence(1);
  cache_sequence(2);
  const std::vector<BlockHash> h1 = seq_hashes(1);
  gb.fail_next_host_copy();
  EXPECT_EQ(tier.offload(2), 2u);
  tier.synchronize();
  ASSERT_TIER_OK(tier);
  EXPECT_FALSE(tier.is_on_host(h1[0]));
  EXPECT_EQ(tier.counters().aborted_transfers, 1u);
  EXPECT_EQ(tier.counters().aborted_blocks, 2u);
  const PrefixMatch m = pc.lookup_hashes(h1);
  EXPECT_TRUE(m.blocks.empty());
  pc.release_blocks(m.blocks);
  ASSERT_TIER_OK(tier);
}

INSTANTIATE_TEST_SUITE_P(Layouts, HostTierSlowStream,
                         ::testing::Values(KvCacheLayout::layer_major, KvCacheLayout::block_major),
                         [](const auto& p) { return std::string(to_string(p.param)); });

// ---- concurrency ----------------------------------------------------------------------------

// One thread drives the tier (writes, lookups that onload, polls, offloads,
// synchronizes) on a 16-block cache; a second thread owns 4 other blocks of
// the same cache (allocated before it starts) and copies patterns into them,
// fills and reads them back on a stream of its own, through the backend only
// (PagedKvCache and PrefixCache are not thread-safe; the backend is, one
// thread per stream). Under TSan: no race; everywhere: every onload and every
// read-back is byte-exact.
// Deadlines: a held onload misses its deadline. The lookup keeps its device
// hit (none here), the onload's device blocks stay held and its host slots
// pinned (the device may still write them) until the copy ends; then poll()
// gives them back, and the host blocks, never consumed, hit with their bytes.
TEST_P(HostTierSlowStream, AnOnloadThatMissesItsDeadlineIsQuarantinedAndTheHitIsShorter) {
  test::QuietLog quiet;
  HostTier tier(pc, with_deadline(), stream);
  const std::vector<BlockId> blocks = cache_sequence(1);
  const std::vector<BlockHash> h = seq_hashes(1);
  ASSERT_EQ(tier.offload(2), 2u);
  tier.synchronize();  // the gate is open: the write-back completes
  ASSERT_TRUE(tier.is_on_host(h[0]) && tier.is_on_host(h[1]));
  ASSERT_EQ(cache.num_free_blocks(), 4u);

  gb.close_gate(GateHolds{.d2h = false, .h2d = true});
  {
    const PrefixMatch m = pc.lookup_hashes(h);
    EXPECT_TRUE(m.blocks.empty()) << "no block whose copy did not complete";
    EXPECT_EQ(m.lower_tier_blocks, 0u);
  }
  EXPECT_EQ(gb.blocked_synchronizes(), 0u) << "the deadline, not a blocking wait";
  EXPECT_EQ(tier.counters().stalled_transfers, 1u);
  EXPECT_EQ(tier.counters().stalled_blocks, 2u);
  EXPECT_EQ(tier.counters().onloads, 0u);
  EXPECT_EQ(tier.num_quarantined_blocks(), 2u);
  EXPECT_EQ(cache.num_free_blocks(), 2u) << "the onload's blocks are held";
  ASSERT_TIER_OK(tier);
  // The slots are still on the host but read by the held copy: not offered.
  EXPECT_TRUE(tier.is_on_host(h[0]));
  {
    const PrefixMatch m = pc.lookup_hashes(h);
    EXPECT_TRUE(m.blocks.empty());
  }
  tier.poll();  // still held: nothing changes
  EXPECT_EQ(tier.num_quarantined_blocks(), 2u);

  gb.open_gate();
  stream.synchronize();
  for (int i = 0; i < 100 && tier.num_quarantined_blocks() != 0; ++i) {
    tier.poll();
    if (tier.num_quarantined_blocks() != 0)
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  EXPECT_EQ(tier.num_quarantined_blocks(), 0u);
  EXPECT_EQ(cache.num_free_blocks(), 4u);
  ASSERT_TIER_OK(tier);
  // The host blocks were never consumed: the next lookup gets them, right.
  const PrefixMatch m = pc.lookup_hashes(h);
  ASSERT_EQ(m.blocks.size(), 2u);
  EXPECT_EQ(m.lower_tier_blocks, 2u);
  EXPECT_TRUE(holds(m.blocks[0], tag_of(1, 0)));
  EXPECT_TRUE(holds(m.blocks[1], tag_of(1, 1)));
  pc.release_blocks(m.blocks);
  (void)blocks;
}

// A held write-back misses its deadline at synchronize(): its slots are
// quarantined (invisible, never published: their bytes are not trusted), its
// blocks held, and an allocation cannot take them; when the copy ends poll()
// frees both, and the block is not on the host.
TEST_P(HostTierSlowStream, AWriteBackThatMissesItsDeadlineIsQuarantinedAndNeverPublished) {
  test::QuietLog quiet;
  HostTier tier(pc, with_deadline(), stream);
  cache_sequence(1);
  const std::vector<BlockHash> h = seq_hashes(1);
  gb.close_gate(GateHolds{.d2h = true, .h2d = false});
  ASSERT_EQ(tier.offload(2), 2u);
  tier.synchronize();
  EXPECT_EQ(gb.blocked_synchronizes(), 0u);
  EXPECT_EQ(tier.counters().stalled_transfers, 1u);
  EXPECT_EQ(tier.counters().offloads, 0u);
  EXPECT_EQ(tier.num_quarantined_slots(), 2u);
  EXPECT_EQ(tier.num_quarantined_blocks(), 2u);
  EXPECT_EQ(tier.num_filling_blocks(), 0u);
  EXPECT_FALSE(tier.is_on_host(h[0]));
  EXPECT_EQ(cache.num_free_blocks(), 2u);
  ASSERT_TIER_OK(tier);
  // Two free blocks, nothing evictable, two quarantined: a third allocation fails.
  std::vector<BlockId> taken;
  for (int i = 0; i < 2; ++i)
    taken.push_back(pc.alloc_block());
  EXPECT_FALSE(pc.try_alloc_block().has_value());
  pc.release_blocks(taken);

  gb.open_gate();
  for (int i = 0; i < 100 && tier.num_quarantined_blocks() != 0; ++i) {
    tier.poll();
    if (tier.num_quarantined_blocks() != 0)
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  EXPECT_EQ(tier.num_quarantined_slots(), 0u);
  EXPECT_EQ(tier.num_free_host_blocks(), 4u);
  EXPECT_EQ(cache.num_free_blocks(), 4u);
  EXPECT_FALSE(tier.is_on_host(h[0]));
  EXPECT_FALSE(pc.lookup_hashes(h).blocks.size() > 0);
  ASSERT_TIER_OK(tier);
}

// Destroying the tier with copies in quarantine waits for them (the memory
// is freed only when no copy can write it) and gives every block back.
TEST_P(HostTierSlowStream, TheDestructorWaitsForQuarantinedCopies) {
  test::QuietLog quiet;
  {
    HostTier tier(pc, with_deadline(), stream);
    cache_sequence(1);
    gb.close_gate(GateHolds{.d2h = true, .h2d = false});
    ASSERT_EQ(tier.offload(2), 2u);
    tier.synchronize();
    ASSERT_EQ(tier.num_quarantined_blocks(), 2u);
  }
  EXPECT_GE(gb.blocked_synchronizes(), 1u) << "the destructor waited";
  EXPECT_EQ(cache.num_free_blocks(), 4u);
  const InvariantReport r = pc.check_invariants();
  EXPECT_TRUE(r.ok) << r.to_string();
}

TEST(HostTierOptionsCheck, CopyTimeoutRange) {
  auto backend = test::host_backend();
  PagedKvCache cache(test::small_config(), 4, *backend);
  PrefixCache pc(cache);
  HostTierOptions o;
  o.num_host_blocks = 4;
  o.copy_timeout = std::chrono::milliseconds(-1);
  EXPECT_THROW(HostTier(pc, o), InvalidArgument);
  o.copy_timeout = HostTierOptions::kMaxCopyTimeout + std::chrono::milliseconds(1);
  EXPECT_THROW(HostTier(pc, o), InvalidArgument);
  o.copy_timeout = std::chrono::milliseconds(0);
  EXPECT_NO_THROW(HostTier(pc, o));
}

class HostTierConcurrency : public ::testing::TestWithParam<TierPolicy> {};

TEST_P(HostTierConcurrency, TheTierWorksWhileAnotherStreamCopiesOtherBlocks) {
  std::unique_ptr<Backend> backend = test::host_backend();
  Stream main_stream = backend->create_stream();
  PagedKvCache cache(test::small_config(), 16, *backend);
  PrefixCache pc(cache);
  HostTierOptions o;
  // Room for all 15 distinct blocks: with write-through the host also holds
  // copies of blocks still on the device, and a smaller host thrashes (each
  // step's write-throughs push out the blocks the next lookups need).
  o.num_host_blocks = 16;
  o.policy = GetParam();
  o.offload_batch = 2;
  o.free_watermark = 2;
  HostTier tier(pc, o);

  // The second thread's blocks and their addresses, fixed before it starts.
  std::vector<BlockId> theirs;
  for (int i = 0; i < 4; ++i)
    theirs.push_back(pc.alloc_block());
  struct Range {
    DevicePtr ptr;
    std::size_t bytes;
  };
  std::vector<Range> ranges;
  for (BlockId b : theirs) {
    for (std::size_t layer = 0; layer < cache.num_layers(); ++layer) {
      ranges.push_back({cache.k_cache_ptr(layer, b), cache.k_block_bytes(layer)});
      ranges.push_back({cache.v_cache_ptr(layer, b), cache.v_block_bytes(layer)});
    }
  }
  std::atomic<bool> stop{false};
  std::atomic<int> other_rounds{0};
  std::atomic<int> other_errors{0};
  std::thread other([&] {
    Stream s = backend->create_stream();
    std::vector<std::uint8_t> back;
    for (std::uint8_t round = 1; !stop.load(std::memory_order_relaxed) || other_rounds < 20;
         round = static_cast<std::uint8_t>(round % 200 + 1)) {
      // Fill all, then copy a pattern into each range, then read each back.
      std::vector<FillRegion> fills;
      for (const Range& r : ranges)
        fills.push_back({r.ptr, r.bytes});
      backend->fill_async(fills, 0xEE, s);
      std::vector<std::vector<std::uint8_t>> patterns;
      for (std::size_t i = 0; i < ranges.size(); ++i)
        patterns.push_back(test::pattern(ranges[i].bytes, round + i, i, false));
      for (std::size_t i = 0; i < ranges.size(); ++i)
        backend->copy_h2d_async(ranges[i].ptr, patterns[i].data(), ranges[i].bytes, s);
      for (std::size_t i = 0; i < ranges.size(); ++i) {
        back.assign(ranges[i].bytes, 0);
        backend->copy_d2h(back.data(), ranges[i].ptr, ranges[i].bytes, s);
        if (back != patterns[i]) ++other_errors;
      }
      ++other_rounds;
    }
    s.synchronize();
  });

  auto fill = [&](BlockId block, std::size_t tag) {
    test::write_pattern_block(cache, block, tag, main_stream);
  };
  auto holds = [&](BlockId block, std::size_t tag) {
    return test::holds_pattern_block(cache, block, tag, main_stream);
  };
  std::size_t onloaded = 0;
  std::size_t bad = 0;
  for (int step = 0; step < 120; ++step) {
    // 5 sequences of 3 blocks: more than the device holds, less than both tiers.
    const std::size_t k = 1 + static_cast<std::size_t>(step * 3) % 5;
    const std::vector<BlockHash> h = seq_hashes(k, 3);
    const PrefixMatch m = pc.lookup_hashes(h);
    onloaded += m.lower_tier_blocks;
    for (std::size_t i = 0; i < m.blocks.size(); ++i)
      if (!holds(m.blocks[i], tag_of(k, i))) ++bad;
    std::vector<BlockId> table = m.blocks;
    for (std::size_t i = m.blocks.size(); i < h.size(); ++i) {
      const BlockId b = pc.alloc_block();
      fill(b, tag_of(k, i));
      pc.insert(h[i], b);
      table.push_back(b);
    }
    pc.release_blocks(table);
    tier.poll();
    if (step % 5 == 0) tier.offload(2);
    if (step % 11 == 0) tier.synchronize();
    const InvariantReport r = tier.check_invariants();
    ASSERT_TRUE(r.ok) << "step " << step << ": " << r.to_string();
  }
  stop = true;
  other.join();
  tier.synchronize();
  EXPECT_EQ(bad, 0u) << "a lookup returned stale bytes";
  EXPECT_GT(onloaded, 0u) << "the workload must onload";
  EXPECT_GT(tier.counters().offloads, 0u);
  EXPECT_EQ(other_errors.load(), 0) << "the other stream's blocks were disturbed";
  EXPECT_GE(other_rounds.load(), 20);
  pc.release_blocks(theirs);
  ASSERT_TIER_OK(tier);
}

INSTANTIATE_TEST_SUITE_P(Policies, HostTierConcurrency,
                         ::testing::Values(TierPolicy::write_back, TierPolicy::write_through),
                         [](const auto& p) {
                           return std::string(p.param == TierPolicy::write_back ? "write_back"
                                                                                : "write_through");
                         });

}  // namespace
}  // namespace kvport
