// SPDX-License-Identifier: Apache-2.0
// RouterIndex's rules one at a time, Router's scoring worked out by hand
// (GPU and CPU weights, load, tie-breaks), the policies, block-size mismatch,
// hybrid models' groups, and every error path.
#include <gtest/gtest.h>

#include <chrono>
#include <cstdint>
#include <limits>
#include <memory>
#include <numeric>
#include <random>
#include <vector>

#include "kvport/core/block_hash.hpp"
#include "kvport/core/cache_events.hpp"
#include "kvport/platform/error.hpp"
#include "kvport/router/router.hpp"
#include "kvport/router/router_index.hpp"

namespace kvport::router {
namespace {

constexpr std::uint32_t kBs = 4;
const Clock::time_point t0{};

std::vector<TokenId> tokens(std::size_t n, TokenId first = 100) {
  std::vector<TokenId> t(n);
  std::iota(t.begin(), t.end(), first);
  return t;
}

// The event hashes of the full blocks of `t`, as kvport's caches publish them.
std::vector<std::uint64_t> event_hashes(const std::vector<TokenId>& t, std::uint64_t extra = 0) {
  std::vector<std::uint64_t> out;
  for (const BlockHash& h : hash_full_blocks(t, kBs, extra))
    out.push_back(event_hash(h));
  return out;
}

BlockStored stored(std::vector<std::uint64_t> hashes, const char* medium = "GPU",
                   std::uint32_t block_size = kBs) {
  BlockStored s;
  s.block_hashes = std::move(hashes);
  s.medium = medium;
  s.block_size = block_size;
  return s;
}

BlockRemoved removed(std::vector<std::uint64_t> hashes, const char* medium = "GPU") {
  BlockRemoved r;
  r.block_hashes = std::move(hashes);
  r.medium = medium;
  return r;
}

EventBatch batch(std::uint64_t seq, std::vector<CacheEvent> events, double ts = -1) {
  EventBatch b;
  b.seq = seq;
  b.ts = ts < 0 ? static_cast<double>(seq) : ts;
  b.events = std::move(events);
  return b;
}

IndexOptions options() {
  IndexOptions o;
  o.block_size = kBs;
  o.max_held_batches = 8;
  o.instance_timeout = std::chrono::seconds(10);
  return o;
}

using Blocks = std::vector<std::pair<std::uint64_t, Tier>>;

// ---- index: sequence rules ---------------------------------------------------------

TEST(RouterIndex, AppliesInSequenceAndDropsDuplicates) {
  RouterIndex idx(options());
  idx.add_instance(0, t0);
  EXPECT_EQ(idx.apply(0, batch(0, {stored({1, 2})}), t0), ApplyResult::applied);
  EXPECT_EQ(idx.apply(0, batch(0, {stored({3})}), t0), ApplyResult::duplicate);
  EXPECT_EQ(idx.apply(0, batch(1, {removed({1})}), t0), ApplyResult::applied);
  EXPECT_EQ(idx.apply(0, batch(1, {removed({2})}), t0), ApplyResult::duplicate);
  EXPECT_EQ(idx.blocks_of(0), (Blocks{{2, Tier::gpu}}));
  EXPECT_EQ(idx.counters().duplicates, 2u);
  EXPECT_EQ(idx.status(0).last_seq, 1u);
  EXPECT_EQ(idx.needs(0), Need{});
}

TEST(RouterIndex, GapNeedsReplayAndHeldBatchesApplyAfterIt) {
  RouterIndex idx(options());
  idx.add_instance(0, t0);
  idx.apply(0, batch(0, {stored({1})}), t0);
  EXPECT_EQ(idx.apply(0, batch(3, {stored({4})}), t0), ApplyResult::held);
  EXPECT_EQ(idx.apply(0, batch(4, {removed({1})}), t0), ApplyResult::held);
  EXPECT_EQ(idx.needs(0), (Need{Need::Kind::replay_from, 1}));
  EXPECT_EQ(idx.blocks_of(0), (Blocks{{1, Tier::gpu}}));  // nothing held applied yet
  EXPECT_EQ(idx.status(0).held_batches, 2u);
  // The replay: 1 and 2 close the gap, then the held 3 and 4 apply.
  EXPECT_EQ(idx.apply(0, batch(1, {stored({2})}), t0), ApplyResult::applied);
  EXPECT_EQ(idx.needs(0), (Need{Need::Kind::replay_from, 2}));
  EXPECT_EQ(idx.apply(0, batch(2, {stored({3})}), t0), ApplyResult::applied);
  EXPECT_EQ(idx.apply(0, batch(3, {stored({4})}), t0), ApplyResult::duplicate);  // replayed too
  EXPECT_EQ(idx.needs(0), Need{});
  EXPECT_EQ(idx.status(0).last_seq, 4u);
  EXPECT_EQ(idx.blocks_of(0), (Blocks{{2, Tier::gpu}, {3, Tier::gpu}, {4, Tier::gpu}}));
  EXPECT_EQ(idx.counters().gaps, 1u);
}

TEST(RouterIndex, FailedReplayNeedsSnapshotWhichReplacesEntriesExactly) {
  RouterIndex idx(options());
  idx.add_instance(0, t0);
  idx.apply(0, batch(0, {stored({1, 2})}), t0);
  idx.apply(0, batch(5, {stored({9})}), t0);
  idx.apply(0, batch(7, {stored({10})}), t0);
  idx.replay_failed(0);
  EXPECT_EQ(idx.needs(0).kind, Need::Kind::snapshot);
  // Batches keep being held while the snapshot is awaited.
  EXPECT_EQ(idx.apply(0, batch(6, {stored({11})}), t0), ApplyResult::held);
  // The snapshot at seq 5: blocks 2 and 9 (1 was evicted meanwhile).
  const std::vector<CacheEvent> snap{stored({2, 9})};
  idx.apply_snapshot(0, 5, snap, t0, 5.0);
  EXPECT_EQ(idx.needs(0), Need{});
  EXPECT_EQ(idx.status(0).last_seq, 7u);  // 6 and 7 held, applied after it
  EXPECT_EQ(idx.blocks_of(0),
            (Blocks{{2, Tier::gpu}, {9, Tier::gpu}, {10, Tier::gpu}, {11, Tier::gpu}}));
  EXPECT_EQ(idx.counters().snapshots, 1u);
}

TEST(RouterIndex, ReplayFailedWithoutAGapChangesNothing) {
  RouterIndex idx(options());
  idx.add_instance(0, t0);
  idx.replay_failed(0);
  EXPECT_EQ(idx.needs(0), Need{});
}

TEST(RouterIndex, SnapshotLeavesAGapAfterItWhenHeldBatchesDoNotFollow) {
  RouterIndex idx(options());
  idx.add_instance(0, t0);
  idx.apply(0, batch(4, {stored({1})}), t0);
  idx.apply(0, batch(9, {stored({2})}), t0);
  idx.replay_failed(0);
  idx.apply_snapshot(0, 6, std::vector<CacheEvent>{stored({5})}, t0, 6.0);
  // 4 is older than the snapshot (dropped); 9 waits for 7 and 8.
  EXPECT_EQ(idx.needs(0), (Need{Need::Kind::replay_from, 7}));
  EXPECT_EQ(idx.status(0).held_batches, 1u);
  EXPECT_EQ(idx.blocks_of(0), (Blocks{{5, Tier::gpu}}));
}

TEST(RouterIndex, SnapshotDropsHeldBatchesOfAnEarlierStreamOrAllWithoutItsTs) {
  RouterIndex idx(options());
  idx.add_instance(0, t0);
  idx.apply(0, batch(0, {stored({1})}, 10.0), t0);
  idx.apply(0, batch(8, {stored({2})}, 18.0), t0);  // of the stream before a restart
  idx.apply(0, batch(9, {stored({3})}, 31.0), t0);  // of the new one
  idx.replay_failed(0);
  idx.apply_snapshot(0, 7, std::vector<CacheEvent>{stored({5})}, t0, 30.0);
  EXPECT_EQ(idx.needs(0), (Need{Need::Kind::replay_from, 8}));
  EXPECT_EQ(idx.status(0).held_batches, 1u);
  // Without the snapshot's ts nothing held is trusted.
  idx.replay_failed(0);
  idx.apply_snapshot(0, 7, std::vector<CacheEvent>{stored({5})}, t0);
  EXPECT_EQ(idx.needs(0), Need{});
  EXPECT_EQ(idx.status(0).held_batches, 0u);
  EXPECT_EQ(idx.blocks_of(0), (Blocks{{5, Tier::gpu}}));
}

TEST(RouterIndex, HeldBatchesAreBoundedAndTheReplayDeliversTheDroppedOnes) {
  IndexOptions o = options();
  o.max_held_batches = 2;
  RouterIndex idx(o);
  idx.add_instance(0, t0);
  for (std::uint64_t s = 2; s <= 5; ++s)
    idx.apply(0, batch(s, {stored({s})}), t0);
  EXPECT_EQ(idx.status(0).held_batches, 2u);
  EXPECT_EQ(idx.counters().held_dropped, 2u);
  EXPECT_EQ(idx.needs(0), (Need{Need::Kind::replay_from, 0}));
  // The replay from 0 delivers everything again.
  for (std::uint64_t s = 0; s <= 5; ++s)
    idx.apply(0, batch(s, {stored({s})}), t0);
  EXPECT_EQ(idx.needs(0), Need{});
  EXPECT_EQ(idx.status(0).blocks[0], 6u);
}

TEST(RouterIndex, RestartAtSeqZeroClearsTheInstance) {
  RouterIndex idx(options());
  idx.add_instance(0, t0);
  idx.add_instance(1, t0);
  idx.apply(0, batch(0, {stored({1, 2})}), t0);
  idx.apply(0, batch(1, {stored({3})}), t0);
  idx.apply(1, batch(0, {stored({1})}), t0);
  EXPECT_EQ(idx.apply(0, batch(0, {stored({7})}, 100.0), t0), ApplyResult::restarted);
  EXPECT_EQ(idx.blocks_of(0), (Blocks{{7, Tier::gpu}}));
  EXPECT_EQ(idx.blocks_of(1), (Blocks{{1, Tier::gpu}}));  // others untouched
  EXPECT_EQ(idx.counters().restarts, 1u);
}

TEST(RouterIndex, SeqZeroAgainIsADuplicateWhenItsTsIsTheSameAndARestartOtherwise) {
  RouterIndex idx(options());
  idx.add_instance(0, t0);
  idx.apply(0, batch(0, {stored({1})}, 5.0), t0);
  EXPECT_EQ(idx.apply(0, batch(0, {stored({1})}, 5.0), t0), ApplyResult::duplicate);
  EXPECT_EQ(idx.apply(0, batch(0, {stored({2})}, 6.0), t0), ApplyResult::restarted);
  EXPECT_EQ(idx.blocks_of(0), (Blocks{{2, Tier::gpu}}));
}

TEST(RouterIndex, RestartWhoseSeqZeroWasLostIsToldByItsTs) {
  RouterIndex idx(options());
  idx.add_instance(0, t0);
  for (std::uint64_t s = 0; s < 5; ++s)
    idx.apply(0, batch(s, {stored({s + 10})}, 1.0 + static_cast<double>(s)), t0);
  // The new stream's seq 2 (its 0 and 1 were lost): another ts than the 2 applied.
  EXPECT_EQ(idx.apply(0, batch(2, {stored({99})}, 500.0), t0), ApplyResult::restarted);
  EXPECT_TRUE(idx.blocks_of(0).empty());
  EXPECT_EQ(idx.needs(0), (Need{Need::Kind::replay_from, 0}));
  idx.apply(0, batch(0, {stored({97})}, 498.0), t0);
  idx.apply(0, batch(1, {stored({98})}, 499.0), t0);
  EXPECT_EQ(idx.needs(0), Need{});
  EXPECT_EQ(idx.blocks_of(0), (Blocks{{97, Tier::gpu}, {98, Tier::gpu}, {99, Tier::gpu}}));
}

TEST(RouterIndex, AllBlocksClearedClearsEverythingOrOneMedium) {
  RouterIndex idx(options());
  idx.add_instance(0, t0);
  idx.apply(0, batch(0, {stored({1}), stored({2}, "CPU"), stored({3}, "DISK")}), t0);
  AllBlocksCleared cpu;
  cpu.medium = "CPU";
  idx.apply(0, batch(1, {cpu}), t0);
  EXPECT_EQ(idx.blocks_of(0), (Blocks{{1, Tier::gpu}, {3, Tier::other}}));
  idx.apply(0, batch(2, {AllBlocksCleared{}}), t0);
  EXPECT_TRUE(idx.blocks_of(0).empty());
  EXPECT_EQ(idx.num_blocks(), 0u);
  EXPECT_EQ(idx.counters().clears, 2u);
}

TEST(RouterIndex, RemovalOfANeverStoredBlockIsCountedAndIgnored) {
  RouterIndex idx(options());
  idx.add_instance(0, t0);
  idx.apply(0, batch(0, {stored({1})}), t0);
  idx.apply(0, batch(1, {removed({5}), removed({1}, "CPU")}), t0);
  EXPECT_EQ(idx.blocks_of(0), (Blocks{{1, Tier::gpu}}));
  EXPECT_EQ(idx.counters().unknown_removals, 2u);
  idx.apply(0, batch(2, {stored({1})}), t0);
  EXPECT_EQ(idx.counters().redundant_stores, 1u);
}

TEST(RouterIndex, SilentInstanceExpiresAndComesBackBySnapshotOrRestart) {
  RouterIndex idx(options());
  idx.add_instance(0, t0);
  idx.add_instance(1, t0);
  idx.apply(0, batch(0, {stored({1})}), t0);
  idx.apply(1, batch(0, {stored({1, 2})}), t0);
  const auto t1 = t0 + std::chrono::seconds(8);
  idx.apply(1, batch(1, {}), t1);
  EXPECT_EQ(idx.expire(t0 + std::chrono::seconds(10)), 0u);  // not longer than the timeout
  EXPECT_EQ(idx.expire(t0 + std::chrono::seconds(11)), 1u);  // instance 0 only
  EXPECT_FALSE(idx.status(0).active);
  EXPECT_EQ(idx.active_mask(), 2u);
  EXPECT_TRUE(idx.blocks_of(0).empty());
  EXPECT_EQ(idx.blocks_of(1), (Blocks{{1, Tier::gpu}, {2, Tier::gpu}}));
  EXPECT_EQ(idx.needs(0).kind, Need::Kind::snapshot);
  // It speaks again: held until the snapshot.
  EXPECT_EQ(idx.apply(0, batch(2, {stored({4})}), t1), ApplyResult::held);
  idx.apply_snapshot(0, 1, std::vector<CacheEvent>{stored({3})}, t1, 1.0);
  EXPECT_TRUE(idx.status(0).active);
  EXPECT_EQ(idx.blocks_of(0), (Blocks{{3, Tier::gpu}, {4, Tier::gpu}}));
  // Expired again, then restarted from seq 0: back without a snapshot.
  idx.expire(t1 + std::chrono::seconds(30));
  EXPECT_EQ(idx.apply(0, batch(0, {stored({8})}), t1), ApplyResult::restarted);
  EXPECT_TRUE(idx.status(0).active);
  EXPECT_EQ(idx.blocks_of(0), (Blocks{{8, Tier::gpu}}));
  EXPECT_EQ(idx.counters().expired, 3u);  // 0, 0 again, and 1 at the second expire
}

TEST(RouterIndex, RemoveInstanceDropsItsEntries) {
  RouterIndex idx(options());
  idx.add_instance(3, t0);
  idx.apply(3, batch(0, {stored({1, 2})}), t0);
  idx.remove_instance(3);
  EXPECT_FALSE(idx.has_instance(3));
  EXPECT_EQ(idx.num_blocks(), 0u);
  idx.add_instance(3, t0);  // a fresh slot
  EXPECT_TRUE(idx.blocks_of(3).empty());
}

TEST(RouterIndex, HybridModelIndexesTheFullAttentionGroupOnly) {
  RouterIndex idx(options());
  idx.add_instance(0, t0);
  BlockStored swa = stored({50});
  swa.group_idx = 0;  // on this model the sliding-window group comes first
  swa.kv_cache_spec_kind = "sliding_window";
  BlockStored full = stored({60, 61});
  full.group_idx = 1;
  full.kv_cache_spec_kind = "full_attention";
  BlockRemoved swa_rm = removed({60});
  swa_rm.group_idx = 0;
  BlockRemoved full_rm = removed({61});
  full_rm.group_idx = 1;
  idx.apply(0, batch(0, {swa, full, swa_rm, full_rm}), t0);
  EXPECT_EQ(idx.blocks_of(0), (Blocks{{60, Tier::gpu}}));
  EXPECT_EQ(idx.counters().other_group_events, 2u);
}

TEST(RouterIndex, ScoredGroupOptionOverridesTheKind) {
  IndexOptions o = options();
  o.scored_group = 2;
  RouterIndex idx(o);
  idx.add_instance(0, t0);
  BlockStored a = stored({1});
  a.group_idx = 0;
  a.kv_cache_spec_kind = "full_attention";
  BlockStored b = stored({2});
  b.group_idx = 2;
  b.kv_cache_spec_kind = "mamba";
  idx.apply(0, batch(0, {a, b, stored({3})}), t0);  // no group_idx: always indexed
  EXPECT_EQ(idx.blocks_of(0), (Blocks{{2, Tier::gpu}, {3, Tier::gpu}}));
}

TEST(RouterIndex, BlockSizeMismatchIsFlaggedAndNotIndexed) {
  RouterIndex idx(options());
  idx.add_instance(0, t0);
  idx.apply(0, batch(0, {stored({1, 2}, "GPU", 16)}), t0);
  EXPECT_TRUE(idx.blocks_of(0).empty());
  EXPECT_EQ(idx.status(0).mismatched_block_size, 16u);
  EXPECT_EQ(idx.counters().block_size_mismatches, 1u);
}

TEST(RouterIndex, MatchStopsWhereNoCandidateHoldsThePrefix) {
  RouterIndex idx(options());
  idx.add_instance(0, t0);
  idx.add_instance(1, t0);
  idx.apply(0, batch(0, {stored({1, 2})}), t0);
  idx.apply(1, batch(0, {stored({1, 3, 4})}), t0);
  std::vector<BlockHolders> h;
  const std::vector<std::uint64_t> q{1, 3, 4, 5};
  EXPECT_EQ(idx.match(q, 0b11, h), 3u);
  EXPECT_EQ(h[0].tiers[0], 0b11u);
  EXPECT_EQ(h[1].tiers[0], 0b10u);
  EXPECT_EQ(idx.match(q, 0b01, h), 1u);  // instance 0 alone: 3 is not held
  EXPECT_EQ(idx.match(std::vector<std::uint64_t>{2, 1}, 0b10, h), 0u);
}

// ---- router: scoring by hand --------------------------------------------------------

struct Fixture {
  Router router{options(), ScoringOptions{}, make_prefix_aware_policy()};
  std::vector<TokenId> req = tokens(4 * kBs + 2);  // 4 full blocks + 2 tokens: 5 blocks
  std::vector<std::uint64_t> h = event_hashes(req);
  Fixture() {
    for (InstanceId i = 0; i < 3; ++i)
      router.index().add_instance(i, t0);
  }
};

TEST(Router, RequestHashesAreKvportsChainHashes) {
  Fixture f;
  ASSERT_EQ(f.h.size(), 4u);
  f.router.index().apply(0, batch(0, {stored(f.h)}), t0);
  const Decision d = f.router.decide(Request{f.req});
  EXPECT_EQ(d.request_blocks, 4u);
  EXPECT_EQ(d.scores[0].matched_blocks, 4u);
  // Another extra key (a LoRA adapter) hashes to other blocks.
  const Decision lora = f.router.decide(Request{f.req, 7});
  EXPECT_EQ(lora.scores[0].matched_blocks, 0u);
  f.router.index().apply(1, batch(0, {stored(event_hashes(f.req, 7))}), t0);
  EXPECT_EQ(f.router.decide(Request{f.req, 7}).scores[1].matched_blocks, 4u);
}

TEST(Router, PrecomputedBlockHashesDecideTheSameAndAreChecked) {
  Fixture f;
  f.router.index().apply(0, batch(0, {stored({f.h[0], f.h[1]})}), t0);
  f.router.index().apply(1, batch(0, {stored({f.h[0]}, "CPU")}), t0);
  const std::vector<BlockHash> hashes = hash_full_blocks(f.req, kBs);
  const Decision a = f.router.decide(Request{f.req});
  const Decision b = f.router.decide(Request{f.req, 0, hashes});
  ASSERT_EQ(b.scores.size(), a.scores.size());
  for (std::size_t i = 0; i < a.scores.size(); ++i) {
    EXPECT_EQ(b.scores[i].matched_blocks, a.scores[i].matched_blocks);
    EXPECT_EQ(b.scores[i].gpu_blocks, a.scores[i].gpu_blocks);
    EXPECT_DOUBLE_EQ(b.scores[i].cost, a.scores[i].cost);
  }
  EXPECT_EQ(b.instance, a.instance);
  EXPECT_EQ(b.scores[0].matched_blocks, 2u);
  const std::span<const BlockHash> short_by_one(hashes.data(), hashes.size() - 1);
  EXPECT_THROW(f.router.decide(Request{f.req, 0, short_by_one}), InvalidArgument);
}

TEST(Router, GpuBlocksWeighOneAndCpuBlocksPointEight) {
  Fixture f;
  // Instance 0: blocks 0-1 on the GPU. Instance 1: blocks 0-2 on the CPU.
  // Instance 2: block 0 on both, block 1 on the CPU.
  f.router.index().apply(0, batch(0, {stored({f.h[0], f.h[1]})}), t0);
  f.router.index().apply(1, batch(0, {stored({f.h[0], f.h[1], f.h[2]}, "CPU")}), t0);
  f.router.index().apply(2, batch(0, {stored({f.h[0]}), stored({f.h[0], f.h[1]}, "CPU")}), t0);
  const Decision d = f.router.decide(Request{f.req});
  ASSERT_EQ(d.scores.size(), 3u);
  EXPECT_DOUBLE_EQ(d.scores[0].prefix_score, 2.0);
  EXPECT_DOUBLE_EQ(d.scores[1].prefix_score, 2.4);
  EXPECT_DOUBLE_EQ(d.scores[2].prefix_score, 1.8);
  EXPECT_EQ(d.scores[2].gpu_blocks, 1u);
  EXPECT_EQ(d.scores[2].cpu_blocks, 1u);
  // 5 blocks to compute without a hit.
  EXPECT_DOUBLE_EQ(d.scores[0].prefill_blocks, 3.0);
  EXPECT_DOUBLE_EQ(d.scores[1].cost, 5.0 - 2.4);
  EXPECT_EQ(d.instance, 1u);
  // Load: instance 1 decodes 1 block -> cost 3.6 > instance 0's 3.0.
  f.router.set_load(1, 1, 1);
  const Decision d2 = f.router.decide(Request{f.req});
  EXPECT_DOUBLE_EQ(d2.scores[1].cost, 3.6);
  EXPECT_EQ(d2.instance, 0u);
}

TEST(Router, OverlapWeightScalesPrefillAgainstLoad) {
  ScoringOptions s;
  s.overlap_weight = 4.0;
  Router r(options(), s, make_prefix_aware_policy());
  r.index().add_instance(0, t0);
  r.index().add_instance(1, t0);
  const auto req = tokens(4 * kBs);
  const auto h = event_hashes(req);
  r.index().apply(0, batch(0, {stored(h)}), t0);
  r.set_load(0, 3, 10);  // cost 4*0 + 10 = 10 vs instance 1: 4*4 + 0 = 16
  EXPECT_EQ(r.decide(Request{req}).instance, 0u);
  r.set_load(0, 3, 17);
  EXPECT_EQ(r.decide(Request{req}).instance, 1u);
}

TEST(Router, EqualCostsGoToFewerRunningRequestsThenFewerBlocksThenTheLowerId) {
  Fixture f;
  // No prefix anywhere: cost = 5 + blocks_in_use.
  f.router.set_load(0, 2, 3);
  f.router.set_load(1, 1, 3);
  f.router.set_load(2, 1, 3);
  EXPECT_EQ(f.router.decide(Request{f.req}).instance, 1u);
  f.router.set_load(1, 2, 3);
  EXPECT_EQ(f.router.decide(Request{f.req}).instance, 2u);
  // Instance 0 with a one-block prefix and one more block in use: cost 4 + 4 = 8 = 5 + 3.
  f.router.index().apply(0, batch(0, {stored({f.h[0]})}), t0);
  f.router.set_load(0, 1, 4);
  f.router.set_load(2, 2, 3);
  const Decision d = f.router.decide(Request{f.req});
  EXPECT_DOUBLE_EQ(d.scores[0].cost, d.scores[2].cost);
  EXPECT_EQ(d.instance, 0u);  // fewer running requests
  EXPECT_EQ(f.router.load(0).blocks_in_use, 4u);
}

TEST(Router, PrefixStopsAtTheFirstBlockAnInstanceLacks) {
  Fixture f;
  f.router.index().apply(0, batch(0, {stored({f.h[0], f.h[2], f.h[3]})}), t0);
  const Decision d = f.router.decide(Request{f.req});
  EXPECT_EQ(d.scores[0].matched_blocks, 1u);
  EXPECT_DOUBLE_EQ(d.scores[0].prefix_score, 1.0);
}

TEST(Router, RoundRobinCyclesOverCandidatesAndSkipsExpiredOnes) {
  Fixture f;
  f.router.set_policy(make_policy("round_robin"));
  EXPECT_EQ(f.router.policy().name(), "round_robin");
  std::vector<InstanceId> got;
  for (int k = 0; k < 4; ++k)
    got.push_back(*f.router.decide(Request{f.req}).instance);
  EXPECT_EQ(got, (std::vector<InstanceId>{0, 1, 2, 0}));
  f.router.index().apply(0, batch(0, {}), t0 + std::chrono::seconds(20));
  f.router.index().apply(2, batch(0, {}), t0 + std::chrono::seconds(20));
  f.router.index().expire(t0 + std::chrono::seconds(20));  // instance 1 dropped
  const Decision d = f.router.decide(Request{f.req});
  EXPECT_FALSE(d.scores[1].candidate);
  EXPECT_EQ(d.instance, 2u);
  EXPECT_EQ(f.router.decide(Request{f.req}).instance, 0u);
  EXPECT_EQ(f.router.decide(Request{f.req}).instance, 2u);
}

TEST(Router, LeastLoadedIgnoresPrefixes) {
  Fixture f;
  f.router.set_policy(make_policy("least_loaded"));
  f.router.index().apply(0, batch(0, {stored(f.h)}), t0);
  f.router.set_load(0, 1, 0);
  f.router.set_load(1, 0, 9);
  f.router.set_load(2, 0, 5);
  EXPECT_EQ(f.router.decide(Request{f.req}).instance, 2u);
  EXPECT_EQ(make_policy("prefix_aware")->name(), "prefix_aware");
}

TEST(Router, NoCandidateMeansNoInstance) {
  Router r(options(), ScoringOptions{}, make_prefix_aware_policy());
  EXPECT_FALSE(r.decide(Request{tokens(8)}).instance.has_value());
  r.index().add_instance(0, t0);
  r.index().expire(t0 + std::chrono::hours(1));
  const Decision d = r.decide(Request{tokens(8)});
  EXPECT_FALSE(d.instance.has_value());
  ASSERT_EQ(d.scores.size(), 1u);
  EXPECT_FALSE(d.scores[0].candidate);
}

TEST(Router, BlockSizeMismatchIsReportedInTheDecision) {
  Fixture f;
  // Instance 1 runs with 8-token blocks: its hashes are of other blocks.
  const std::vector<TokenId> req = f.req;
  std::vector<std::uint64_t> h8;
  for (const BlockHash& h : hash_full_blocks(req, 8))
    h8.push_back(event_hash(h));
  f.router.index().apply(1, batch(0, {stored(h8, "GPU", 8)}), t0);
  const Decision d = f.router.decide(Request{req});
  EXPECT_TRUE(d.block_size_mismatch);
  EXPECT_TRUE(d.scores[1].block_size_mismatch);
  EXPECT_FALSE(d.scores[0].block_size_mismatch);
  EXPECT_EQ(d.scores[1].matched_blocks, 0u);
  EXPECT_EQ(f.router.index().status(1).mismatched_block_size, 8u);
  // A restart with the right block size clears the flag.
  f.router.index().apply(1, batch(0, {stored({f.h[0]})}, 50.0), t0);
  EXPECT_FALSE(f.router.decide(Request{req}).block_size_mismatch);
}

TEST(Router, DecideReusesTheDecisionsStorage) {
  Fixture f;
  Decision d;
  f.router.decide(Request{f.req}, d);
  const auto* data = d.scores.data();
  f.router.decide(Request{f.req}, d);
  EXPECT_EQ(d.scores.data(), data);
  EXPECT_EQ(d.scores.size(), 3u);
}

TEST(Router, ScoresEqualABruteForceMatchOverRandomIndexes) {
  // Prefixes across the 16-block chunks decide hashes in, holes, several
  // tiers per block, expired instances: every instance's matched and
  // per-tier blocks equal a block-by-block walk of holders().
  std::mt19937_64 rng(7);
  for (int round = 0; round < 200; ++round) {
    Router r(options(), ScoringOptions{}, make_prefix_aware_policy());
    const auto req = tokens(4 * 50 + 3, static_cast<TokenId>(round * 1000));
    const auto h = event_hashes(req);
    const InstanceId n = 1 + static_cast<InstanceId>(rng() % 6);
    for (InstanceId i = 0; i < n; ++i) {
      r.index().add_instance(i, t0);
      // A prefix of random length, then random further blocks, random tiers.
      const std::size_t len = rng() % 60;
      std::vector<CacheEvent> ev;
      for (std::size_t b = 0; b < h.size(); ++b) {
        if (b >= len && rng() % 4 != 0) continue;
        const char* medium = rng() % 3 == 0 ? "GPU" : rng() % 2 == 0 ? "CPU" : "DISK";
        ev.emplace_back(stored({h[b]}, medium));
        if (rng() % 5 == 0) ev.emplace_back(stored({h[b]}, "CPU"));
      }
      r.index().apply(i, batch(0, std::move(ev)), i % 3 == 2 ? t0 - std::chrono::hours(1) : t0);
    }
    r.index().expire(t0 + std::chrono::seconds(5));  // instances 2 and 5 dropped
    const Decision d = r.decide(Request{req});
    ASSERT_EQ(d.scores.size(), n);
    for (const InstanceScore& s : d.scores) {
      SCOPED_TRACE(::testing::Message() << "round " << round << " instance " << s.id);
      std::uint32_t matched = 0, gpu = 0, cpu = 0, other = 0;
      const std::uint64_t b = std::uint64_t{1} << s.id;
      for (std::size_t k = 0; s.candidate && k < h.size(); ++k) {
        const BlockHolders hh = r.index().holders(h[k]);
        if ((hh.any() & b) == 0) break;
        ++matched;
        ((hh.tiers[0] & b) != 0 ? gpu : (hh.tiers[1] & b) != 0 ? cpu : other) += 1;
      }
      EXPECT_EQ(s.candidate, s.id % 3 != 2);
      EXPECT_EQ(s.matched_blocks, matched);
      EXPECT_EQ(s.gpu_blocks, gpu);
      EXPECT_EQ(s.cpu_blocks, cpu);
      EXPECT_EQ(s.other_blocks, other);
      EXPECT_DOUBLE_EQ(s.prefix_score, gpu + 0.8 * cpu + 0.5 * other);
      EXPECT_DOUBLE_EQ(s.cost, 51.0 - s.prefix_score);
    }
  }
}

// ---- errors ---------------------------------------------------------------------------

TEST(RouterErrors, BadIndexOptionsThrow) {
  IndexOptions o = options();
  o.block_size = 0;
  EXPECT_THROW(RouterIndex{o}, InvalidArgument);
  o = options();
  o.max_held_batches = 0;
  EXPECT_THROW(RouterIndex{o}, InvalidArgument);
  o.max_held_batches = 1'000'001;
  EXPECT_THROW(RouterIndex{o}, InvalidArgument);
  o = options();
  o.instance_timeout = Clock::duration::zero();
  EXPECT_THROW(RouterIndex{o}, InvalidArgument);
  o.block_size = 0;
  EXPECT_THROW((Router{o, ScoringOptions{}, make_round_robin_policy()}), InvalidArgument);
}

TEST(RouterErrors, BadScoringOptionsAndPoliciesThrow) {
  auto make = [](ScoringOptions s) { Router r(options(), s, make_round_robin_policy()); };
  ScoringOptions s;
  s.gpu_weight = 1.5;
  EXPECT_THROW(make(s), InvalidArgument);
  s = {};
  s.cpu_weight = -0.1;
  EXPECT_THROW(make(s), InvalidArgument);
  s = {};
  s.other_weight = 0.9;  // above cpu_weight
  EXPECT_THROW(make(s), InvalidArgument);
  s = {};
  s.overlap_weight = -1;
  EXPECT_THROW(make(s), InvalidArgument);
  s = {};
  s.gpu_weight = std::numeric_limits<double>::quiet_NaN();
  EXPECT_THROW(make(s), InvalidArgument);
  EXPECT_THROW((Router{options(), ScoringOptions{}, nullptr}), InvalidArgument);
  Router r(options(), ScoringOptions{}, make_round_robin_policy());
  EXPECT_THROW(r.set_policy(nullptr), InvalidArgument);
  EXPECT_THROW(make_policy("random"), InvalidArgument);
}

TEST(RouterErrors, UnknownInstancesThrow) {
  Router r(options(), ScoringOptions{}, make_prefix_aware_policy());
  RouterIndex& idx = r.index();
  idx.add_instance(0, t0);
  EXPECT_THROW(idx.add_instance(0, t0), InvalidArgument);
  EXPECT_THROW(idx.add_instance(64, t0), InvalidArgument);
  const std::vector<CacheEvent> none;
  for (InstanceId bad : {1u, 64u, 1000u}) {
    SCOPED_TRACE(bad);
    EXPECT_THROW(idx.apply(bad, batch(0, {}), t0), InvalidArgument);
    EXPECT_THROW(idx.apply_snapshot(bad, 0, none, t0), InvalidArgument);
    EXPECT_THROW(idx.needs(bad), InvalidArgument);
    EXPECT_THROW(idx.replay_failed(bad), InvalidArgument);
    EXPECT_THROW(idx.status(bad), InvalidArgument);
    EXPECT_THROW(idx.blocks_of(bad), InvalidArgument);
    EXPECT_THROW(idx.remove_instance(bad), InvalidArgument);
    EXPECT_THROW(r.set_load(bad, 0, 0), InvalidArgument);
    EXPECT_THROW(r.load(bad), InvalidArgument);
  }
  idx.remove_instance(0);
  EXPECT_THROW(idx.apply(0, batch(0, {}), t0), InvalidArgument);
}

TEST(RouterErrors, AMisbehavingPolicyIsAnError) {
  class Bad final : public Policy {
   public:
    std::string_view name() const noexcept override { return "bad"; }
    std::size_t choose(std::span<const InstanceScore> scores) override { return scores.size(); }
  };
  Router r(options(), ScoringOptions{}, std::make_unique<Bad>());
  r.index().add_instance(0, t0);
  EXPECT_THROW(r.decide(Request{tokens(8)}), Error);
}

TEST(Tier, OfMedium) {
  EXPECT_EQ(tier_of_medium("GPU"), Tier::gpu);
  EXPECT_EQ(tier_of_medium("CPU"), Tier::cpu);
  EXPECT_EQ(tier_of_medium("DISK"), Tier::other);
  EXPECT_EQ(tier_of_medium("gpu"), Tier::other);
}

}  // namespace
}  // namespace kvport::router
