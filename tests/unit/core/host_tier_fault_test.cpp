// SPDX-License-Identifier: Apache-2.0
// HostTier under injected backend faults (FaultInjectingBackend): a failed
// host allocation at construction propagates and leaks nothing; a failed
// copy, in any direction (write-back at eviction, write-through at poll,
// onload in a lookup), at the call or surfacing at the tier's synchronize,
// is rolled back: a failed write-back leaves its blocks evicted and not on
// the host, a failed onload leaves the lookup with its device hit only, and
// nothing stale is ever returned. The sweeps fail the Nth eligible call of a
// fixed workload for N = 1, 2, ... until a run sees no fault.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "core_test_util.hpp"
#include "kvport/core/host_tier.hpp"
#include "kvport/core/paged_kv_cache.hpp"
#include "kvport/core/prefix_cache.hpp"
#include "kvport/platform/error.hpp"
#include "kvport/platform/fault_injecting_backend.hpp"

namespace kvport {
namespace {

#define ASSERT_TIER_INVARIANTS(tier, what)                  \
  do {                                                      \
    const InvariantReport r_ = (tier).check_invariants();   \
    ASSERT_TRUE(r_.ok) << (what) << ": " << r_.to_string(); \
  } while (0)

using test::seq_hashes;  // sequence k: 4-token blocks from 1000 * k
using test::tag_of;
using test::tokens;

// A FaultInjectingBackend over a host backend, a 4-block cache, its prefix
// cache and (optionally) a HostTier, built and torn down in order, with the
// leak checks after the teardown.
class World {
 public:
  explicit World(HostTierOptions options, KvCacheLayout layout = KvCacheLayout::layer_major,
                 std::size_t num_blocks = 4)
      : options_(options) {
    fb.emplace(test::host_backend());
    stream.emplace(fb->create_stream());
    cache.emplace(test::small_config(layout), num_blocks, *fb);
    pc.emplace(*cache);
  }

  void make_tier() { tier.emplace(*pc, options_); }

  // Destroys everything and checks that no device or host memory leaked and
  // that no block stayed referenced.
  void tear_down_and_check_leaks() {
    if (tier) {
      tier.reset();
      const InvariantReport r = pc->check_invariants();
      EXPECT_TRUE(r.ok) << r.to_string();
      EXPECT_EQ(pc->tier(), nullptr);
    }
    pc.reset();
    EXPECT_EQ(cache->num_free_blocks(), cache->num_blocks()) << "a block stayed referenced";
    cache.reset();
    stream.reset();
    EXPECT_EQ(fb->live_allocations(), 0u) << "device memory leaked";
    const CallCounts inner = fb->inner().call_counts();
    EXPECT_EQ(inner.host_alloc, inner.host_free) << "pinned host memory leaked";
    fb.reset();
  }

  // Writes the pattern of `tag` into every layer of `block` (on the test's
  // stream, synchronized).
  void fill(BlockId block, std::size_t tag) {
    test::write_pattern_block(*cache, block, tag, *stream);
  }
  bool holds(BlockId block, std::size_t tag) {
    return test::holds_pattern_block(*cache, block, tag, *stream);
  }

  // Registers sequence `k` (`blocks` blocks) on the device, each block
  // filled with its pattern, and releases it (last block first: it is
  // evicted first).
  void cache_sequence(std::size_t k, std::size_t blocks = 2) {
    const std::vector<BlockHash> h = seq_hashes(k, blocks);
    std::vector<BlockId> table;
    for (std::size_t i = 0; i < blocks; ++i) {
      const BlockId b = pc->alloc_block();
      fill(b, tag_of(k, i));
      ASSERT_TRUE(pc->insert(h[i], b));
      table.push_back(b);
    }
    pc->release_blocks(table);
  }

  std::optional<FaultInjectingBackend> fb;
  std::optional<Stream> stream;
  std::optional<PagedKvCache> cache;
  std::optional<PrefixCache> pc;
  std::optional<HostTier> tier;

 private:
  HostTierOptions options_;
};

HostTierOptions tier_options(TierPolicy policy = TierPolicy::write_back,
                             TierInclusion inclusion = TierInclusion::exclusive,
                             std::size_t host_blocks = 4) {
  HostTierOptions o;
  o.num_host_blocks = host_blocks;
  o.policy = policy;
  o.inclusion = inclusion;
  o.offload_batch = 2;
  return o;
}

// ---- construction ---------------------------------------------------------------------------

TEST(HostTierFault, AFailedHostAllocationPropagatesAndLeaksNothing) {
  World w(tier_options());
  w.fb->set_plan(FaultKind::alloc, {.nth = 1});
  EXPECT_THROW(w.make_tier(), OutOfMemory);
  EXPECT_EQ(w.fb->counts(FaultKind::alloc).faults, 1u);
  EXPECT_FALSE(w.tier.has_value());
  EXPECT_EQ(w.pc->tier(), nullptr) << "a tier that failed to construct is not installed";
  const CallCounts inner = w.fb->inner().call_counts();
  EXPECT_EQ(inner.host_alloc, inner.host_free);
  // The prefix cache works on, and a tier can be installed afterwards.
  w.fb->clear_plans();
  w.make_tier();
  w.cache_sequence(1);
  w.cache_sequence(2);
  w.cache_sequence(3);  // evicts 1 to the host
  w.tier->synchronize();
  EXPECT_TRUE(w.tier->is_on_host(seq_hashes(1)[0]));
  ASSERT_TIER_INVARIANTS(*w.tier, "after the retry");
  w.tear_down_and_check_leaks();
}

TEST(HostTierFault, FailedStreamOrEventCreationPropagatesAndLeaksNothing) {
  for (const FaultKind kind : {FaultKind::stream_create, FaultKind::event_create}) {
    for (std::uint64_t nth = 1;; ++nth) {
      SCOPED_TRACE(std::string(to_string(kind)) + " #" + std::to_string(nth));
      World w(tier_options());
      w.fb->set_plan(kind, {.nth = nth});
      bool threw = false;
      try {
        w.make_tier();
      } catch (const BackendError&) {
        threw = true;
      }
      const bool faulted = w.fb->counts(kind).faults != 0;
      EXPECT_EQ(threw, faulted);
      EXPECT_EQ(w.pc->tier() != nullptr, !threw);
      w.tear_down_and_check_leaks();
      if (!faulted) break;
    }
  }
}

// ---- a failed write-back --------------------------------------------------------------------

class HostTierOffloadFault : public ::testing::TestWithParam<FaultMode> {};

TEST_P(HostTierOffloadFault, AnExplicitOffloadThatFailsLeavesTheBlocksEvictedAndNotOnTheHost) {
  World w(tier_options());
  w.make_tier();
  w.cache_sequence(1);
  w.cache_sequence(2);
  const std::vector<BlockHash> h1 = seq_hashes(1);
  w.fb->set_plan(FaultKind::copy, {.nth = 1, .mode = GetParam()});
  EXPECT_EQ(w.tier->offload(2), 2u);  // sequence 1, least recently used
  ASSERT_TIER_INVARIANTS(*w.tier, "after the offload");
  w.tier->synchronize();  // a deferred fault surfaces here, and is rolled back
  EXPECT_EQ(w.fb->counts(FaultKind::copy).faults, 1u);
  ASSERT_TIER_INVARIANTS(*w.tier, "after the synchronize");
  for (const BlockHash& h : h1) {
    EXPECT_FALSE(w.pc->find(h).has_value()) << "evicted from the device";
    EXPECT_FALSE(w.tier->is_on_host(h)) << "but not on the host";
  }
  EXPECT_EQ(w.tier->counters().aborted_transfers, 1u);
  EXPECT_EQ(w.tier->counters().aborted_blocks, 2u);
  EXPECT_EQ(w.tier->counters().offloads, 0u);
  EXPECT_EQ(w.tier->num_held_device_blocks(), 0u);
  EXPECT_EQ(w.tier->num_filling_blocks(), 0u);
  EXPECT_EQ(w.tier->num_free_host_blocks(), 4u) << "the slots came back";
  EXPECT_EQ(w.cache->num_free_blocks(), 2u) << "the blocks came back";
  // A lookup finds nothing, and the tier works on.
  w.fb->clear_plans();
  const PrefixMatch m = w.pc->lookup_hashes(h1);
  EXPECT_TRUE(m.blocks.empty());
  EXPECT_EQ(m.lower_tier_blocks, 0u);
  w.cache_sequence(3);
  w.cache_sequence(4);  // evicts 2 to the host
  w.tier->synchronize();
  EXPECT_TRUE(w.tier->is_on_host(seq_hashes(2)[0]));
  ASSERT_TIER_INVARIANTS(*w.tier, "at the end");
  w.tear_down_and_check_leaks();
}

TEST_P(HostTierOffloadFault, AWriteBackAtEvictionThatFailsStillFreesTheBlocks) {
  World w(tier_options());
  w.make_tier();
  w.cache_sequence(1);
  w.cache_sequence(2);
  w.fb->set_plan(FaultKind::copy, {.nth = 1, .mode = GetParam()});
  // The allocation finds the free list empty: the tier writes back sequence 1
  // and waits for the copy; a failed copy still frees the blocks (uncached).
  std::vector<BlockId> got;
  got.push_back(w.pc->alloc_block());
  EXPECT_EQ(w.fb->counts(FaultKind::copy).faults, 1u);
  w.fb->clear_plans();
  got.push_back(w.pc->alloc_block());
  ASSERT_TIER_INVARIANTS(*w.tier, "after the allocations");
  w.tier->synchronize();
  for (const BlockHash& h : seq_hashes(1)) {
    EXPECT_FALSE(w.pc->find(h).has_value());
    EXPECT_FALSE(w.tier->is_on_host(h));
  }
  EXPECT_EQ(w.tier->counters().aborted_transfers, 1u);
  EXPECT_EQ(w.tier->counters().aborted_blocks, 2u);
  // The freed blocks hold whatever the caller writes, and sequence 2 is intact.
  w.fill(got[0], 77);
  w.fill(got[1], 78);
  const PrefixMatch m = w.pc->lookup_hashes(seq_hashes(2));
  ASSERT_EQ(m.blocks.size(), 2u);
  EXPECT_TRUE(w.holds(m.blocks[0], tag_of(2, 0)));
  EXPECT_TRUE(w.holds(m.blocks[1], tag_of(2, 1)));
  w.pc->release_blocks(m.blocks);
  w.pc->release_blocks(got);
  ASSERT_TIER_INVARIANTS(*w.tier, "at the end");
  w.tear_down_and_check_leaks();
}

TEST_P(HostTierOffloadFault, AWriteThroughThatFailsLeavesTheBlocksCachedOnTheDeviceOnly) {
  World w(tier_options(TierPolicy::write_through));
  w.make_tier();
  w.cache_sequence(1);
  w.fb->set_plan(FaultKind::copy, {.nth = 1, .mode = GetParam()});
  w.tier->poll();  // queues the write-through of sequence 1
  ASSERT_TIER_INVARIANTS(*w.tier, "after the poll");
  w.tier->synchronize();
  EXPECT_EQ(w.fb->counts(FaultKind::copy).faults, 1u);
  w.fb->clear_plans();
  ASSERT_TIER_INVARIANTS(*w.tier, "after the synchronize");
  EXPECT_EQ(w.tier->counters().aborted_transfers, 1u);
  EXPECT_EQ(w.tier->counters().aborted_blocks, 2u);
  EXPECT_EQ(w.tier->num_held_device_blocks(), 0u);
  const std::vector<BlockHash> h1 = seq_hashes(1);
  for (const BlockHash& h : h1) {
    EXPECT_TRUE(w.pc->find(h).has_value()) << "still cached on the device";
    EXPECT_FALSE(w.tier->is_on_host(h));
    EXPECT_TRUE(w.pc->is_evictable(*w.pc->find(h))) << "the tier's reference went back";
  }
  // Evicted later, sequence 1 is written back then, and comes back intact.
  w.cache_sequence(2);
  w.tier->poll();
  w.cache_sequence(3);  // evicts 1
  w.tier->synchronize();
  EXPECT_TRUE(w.tier->is_on_host(h1[0]));
  const PrefixMatch m = w.pc->lookup_hashes(h1);
  ASSERT_EQ(m.blocks.size(), 2u);
  EXPECT_EQ(m.lower_tier_blocks, 2u);
  EXPECT_TRUE(w.holds(m.blocks[0], tag_of(1, 0)));
  EXPECT_TRUE(w.holds(m.blocks[1], tag_of(1, 1)));
  w.pc->release_blocks(m.blocks);
  ASSERT_TIER_INVARIANTS(*w.tier, "at the end");
  w.tear_down_and_check_leaks();
}

INSTANTIATE_TEST_SUITE_P(Modes, HostTierOffloadFault,
                         ::testing::Values(FaultMode::synchronous, FaultMode::deferred),
                         [](const auto& p) {
                           return std::string(p.param == FaultMode::synchronous ? "at_the_call"
                                                                                : "deferred");
                         });

// ---- a failed onload ------------------------------------------------------------------------

struct OnloadParam {
  FaultKind kind;
  FaultMode mode;
  TierInclusion inclusion;
};

class HostTierOnloadFault : public ::testing::TestWithParam<OnloadParam> {};

TEST_P(HostTierOnloadFault, AFailedOnloadLeavesTheDeviceHitOnlyAndNeverStaleData) {
  const OnloadParam p = GetParam();
  World w(tier_options(TierPolicy::write_back, p.inclusion));
  w.make_tier();
  // Sequence 1 of 3 blocks: block 0 stays on the device, 1 and 2 go to the
  // host.
  w.cache_sequence(1, 3);
  const std::vector<BlockHash> h = seq_hashes(1, 3);
  EXPECT_EQ(w.tier->offload(2), 2u);
  w.tier->synchronize();
  ASSERT_TRUE(w.pc->find(h[0]).has_value());
  ASSERT_TRUE(w.tier->is_on_host(h[1]));
  ASSERT_TRUE(w.tier->is_on_host(h[2]));
  // The freed blocks are overwritten: an onload that "succeeded" without its
  // copy would show these bytes.
  {
    std::vector<BlockId> scratch;
    while (w.cache->num_free_blocks() != 0) {
      scratch.push_back(w.pc->alloc_block());
      w.fill(scratch.back(), 99);
    }
    w.pc->release_blocks(scratch);
  }
  if (p.kind == FaultKind::copy) {
    w.fb->set_plan(FaultKind::copy, {.nth = 1, .mode = p.mode});
  } else {
    w.fb->set_plan(FaultKind::synchronize, {.nth = 1});
  }
  PrefixMatch m = w.pc->lookup_hashes(h);
  EXPECT_EQ(w.fb->counts(p.kind).faults, 1u);
  w.fb->clear_plans();
  ASSERT_TIER_INVARIANTS(*w.tier, "after the failed onload");
  ASSERT_EQ(m.blocks.size(), 1u) << "the device part only";
  EXPECT_EQ(m.lower_tier_blocks, 0u);
  EXPECT_EQ(m.num_tokens, 4u);
  EXPECT_EQ(m.hashes.size(), 1u);
  EXPECT_TRUE(w.holds(m.blocks[0], tag_of(1, 0)));
  EXPECT_EQ(w.tier->counters().aborted_transfers, 1u);
  EXPECT_EQ(w.tier->counters().aborted_blocks, 2u);
  EXPECT_EQ(w.tier->counters().onloads, 0u);
  EXPECT_FALSE(w.pc->find(h[1]).has_value()) << "nothing stale registered on the device";
  EXPECT_FALSE(w.pc->find(h[2]).has_value());
  EXPECT_TRUE(w.tier->is_on_host(h[1])) << "the host copies stay";
  EXPECT_TRUE(w.tier->is_on_host(h[2]));
  w.pc->release_blocks(m.blocks);
  // The same lookup, without a fault: the whole prefix, the right bytes.
  m = w.pc->lookup_hashes(h);
  ASSERT_EQ(m.blocks.size(), 3u);
  EXPECT_EQ(m.lower_tier_blocks, 2u);
  for (std::size_t i = 0; i < 3; ++i)
    EXPECT_TRUE(w.holds(m.blocks[i], tag_of(1, i))) << "block " << i;
  w.pc->release_blocks(m.blocks);
  ASSERT_TIER_INVARIANTS(*w.tier, "at the end");
  w.tear_down_and_check_leaks();
}

INSTANTIATE_TEST_SUITE_P(
    Faults, HostTierOnloadFault,
    ::testing::Values(
        OnloadParam{FaultKind::copy, FaultMode::synchronous, TierInclusion::exclusive},
        OnloadParam{FaultKind::copy, FaultMode::deferred, TierInclusion::exclusive},
        OnloadParam{FaultKind::synchronize, FaultMode::synchronous, TierInclusion::exclusive},
        OnloadParam{FaultKind::copy, FaultMode::synchronous, TierInclusion::inclusive},
        OnloadParam{FaultKind::copy, FaultMode::deferred, TierInclusion::inclusive},
        OnloadParam{FaultKind::synchronize, FaultMode::synchronous, TierInclusion::inclusive}),
    [](const auto& p) {
      std::string name = p.param.kind == FaultKind::copy ? "copy_" : "synchronize_";
      name += p.param.mode == FaultMode::synchronous ? "at_the_call" : "deferred";
      name += p.param.inclusion == TierInclusion::exclusive ? "_exclusive" : "_inclusive";
      return name;
    });

// ---- the sweep ------------------------------------------------------------------------------

// Which calls a sweep fails: the Nth call of `kind` made inside a tier
// operation (an allocation that writes back, a lookup that onloads, poll,
// offload, synchronize), never the test's own pattern writes and reads.
struct SweepParam {
  FaultKind kind;
  FaultMode mode;
  TierPolicy policy;
  TierInclusion inclusion;
  KvCacheLayout layout;
};

class HostTierFaultSweep : public ::testing::TestWithParam<SweepParam> {
 protected:
  // Runs the workload failing the `nth` eligible call; returns whether a
  // fault was injected.
  bool run(std::uint64_t nth) {
    const SweepParam p = GetParam();
    // Write-through copies every registered block: a host larger than the
    // device keeps blocks the device dropped, so that lookups onload.
    World w(tier_options(p.policy, p.inclusion, p.policy == TierPolicy::write_back ? 4 : 10),
            p.layout, 6);
    w.make_tier();
    std::uint64_t remaining = nth;  // eligible calls to let through, plus one
    bool injected = false;
    std::uint64_t aborted_seen = 0;
    // Runs `fn` with the plan armed, and counts its eligible calls.
    auto tier_op = [&](const char* what, auto&& fn) {
      SCOPED_TRACE(what);
      if (!injected) {
        w.fb->reset_fault_counts();
        w.fb->set_plan(p.kind, {.nth = remaining, .mode = p.mode});
      }
      fn();
      if (!injected) {
        const FaultCounts c = w.fb->counts(p.kind);
        w.fb->clear_plan(p.kind);
        if (c.faults != 0) {
          injected = true;
        } else {
          remaining -= c.calls;
        }
      }
      const InvariantReport r = w.tier->check_invariants();
      EXPECT_TRUE(r.ok) << what << ": " << r.to_string();
      aborted_seen = w.tier->counters().aborted_transfers;
    };
    // A request for sequence k: a lookup (which may onload), checked byte for
    // byte; the missing blocks allocated (which may write back), filled and
    // registered; then released, and a poll as an engine step would.
    auto request = [&](std::size_t k) {
      const std::vector<BlockHash> h = seq_hashes(k, 3);
      PrefixMatch m;
      tier_op("lookup", [&] { m = w.pc->lookup_hashes(h); });
      EXPECT_EQ(m.blocks.size(), m.hashes.size());
      EXPECT_LE(m.lower_tier_blocks, m.blocks.size());
      EXPECT_EQ(m.num_tokens, 4 * m.blocks.size());
      for (std::size_t i = 0; i < m.blocks.size(); ++i) {
        EXPECT_EQ(m.hashes[i], h[i]);
        EXPECT_TRUE(w.holds(m.blocks[i], tag_of(k, i)))
            << "sequence " << k << " block " << i << ": stale data ("
            << (i + m.lower_tier_blocks >= m.blocks.size() ? "onloaded" : "device") << ")";
      }
      std::vector<BlockId> table = m.blocks;
      for (std::size_t i = m.blocks.size(); i < h.size(); ++i) {
        BlockId b = 0;
        tier_op("alloc", [&] { b = w.pc->alloc_block(); });
        w.fill(b, tag_of(k, i));
        w.pc->insert(h[i], b);  // false when cached meanwhile: then a private copy
        table.push_back(b);
      }
      w.pc->release_blocks(table);
      tier_op("poll", [&] { w.tier->poll(); });
    };
    for (std::size_t k : {1, 2, 3, 1, 4, 2, 3})
      request(k);
    tier_op("offload", [&] { w.tier->offload(3); });
    request(4);
    request(1);
    tier_op("synchronize", [&] { w.tier->synchronize(); });
    request(2);
    tier_op("synchronize", [&] { w.tier->synchronize(); });
    if (injected && p.kind != FaultKind::synchronize) {
      EXPECT_GE(aborted_seen, 1u) << "the failed copy was rolled back and counted";
    }
    EXPECT_GT(w.tier->counters().onloads + w.tier->counters().aborted_blocks, 0u);
    w.tear_down_and_check_leaks();
    return injected;
  }
};

TEST_P(HostTierFaultSweep, EveryEligibleCallFailedInTurnKeepsTheTiersConsistent) {
  test::QuietLog quiet;  // every rollback logs an error
  std::uint64_t nth = 1;
  for (; nth < 500; ++nth) {
    SCOPED_TRACE("failing eligible call #" + std::to_string(nth));
    const bool injected = run(nth);
    if (::testing::Test::HasFatalFailure()) return;
    if (!injected) break;
  }
  RecordProperty("runs", static_cast<int>(nth));
  EXPECT_GT(nth, 3u) << "the workload makes several eligible calls";
  EXPECT_LT(nth, 500u) << "the sweep ended with a run without a fault";
}

INSTANTIATE_TEST_SUITE_P(
    Plans, HostTierFaultSweep,
    ::testing::Values(SweepParam{FaultKind::copy, FaultMode::synchronous, TierPolicy::write_back,
                                 TierInclusion::exclusive, KvCacheLayout::layer_major},
                      SweepParam{FaultKind::copy, FaultMode::deferred, TierPolicy::write_back,
                                 TierInclusion::exclusive, KvCacheLayout::block_major},
                      SweepParam{FaultKind::synchronize, FaultMode::synchronous,
                                 TierPolicy::write_back, TierInclusion::exclusive,
                                 KvCacheLayout::layer_major},
                      SweepParam{FaultKind::copy, FaultMode::synchronous, TierPolicy::write_through,
                                 TierInclusion::exclusive, KvCacheLayout::block_major},
                      SweepParam{FaultKind::copy, FaultMode::deferred, TierPolicy::write_through,
                                 TierInclusion::exclusive, KvCacheLayout::layer_major},
                      SweepParam{FaultKind::synchronize, FaultMode::synchronous,
                                 TierPolicy::write_through, TierInclusion::inclusive,
                                 KvCacheLayout::layer_major},
                      SweepParam{FaultKind::copy, FaultMode::synchronous, TierPolicy::write_back,
                                 TierInclusion::inclusive, KvCacheLayout::layer_major},
                      SweepParam{FaultKind::copy, FaultMode::deferred, TierPolicy::write_back,
                                 TierInclusion::inclusive, KvCacheLayout::layer_major}),
    [](const auto& p) {
      std::string name = p.param.kind == FaultKind::copy ? "copy_" : "synchronize_";
      name += p.param.mode == FaultMode::synchronous ? "at_the_call_" : "deferred_";
      name += p.param.policy == TierPolicy::write_back ? "write_back_" : "write_through_";
      name += to_string(p.param.inclusion);
      name += "_";
      name += to_string(p.param.layout);
      return name;
    });

}  // namespace
}  // namespace kvport
