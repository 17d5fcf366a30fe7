// SPDX-License-Identifier: Apache-2.0
// Prefix caching and block tables under injected backend faults: a failed
// copy-on-write leaves the table (and every refcount, the free list and the
// prefix cache) as it was; a failed zero / poison changes no prefix-cache
// state; a deferred copy failure surfaces at the next synchronize.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <numeric>
#include <vector>

#include "core_test_util.hpp"
#include "kvport/core/block_table.hpp"
#include "kvport/core/paged_kv_cache.hpp"
#include "kvport/core/prefix_cache.hpp"
#include "kvport/platform/error.hpp"
#include "kvport/platform/fault_injecting_backend.hpp"
#include "kvport/testing/fault_report.hpp"

namespace kvport {
namespace {

using ::testing::ElementsAre;
using ::testing::ElementsAreArray;
using ::testing::HasSubstr;

std::vector<TokenId> tokens(std::size_t n, TokenId first = 1) {
  std::vector<TokenId> t(n);
  std::iota(t.begin(), t.end(), first);
  return t;
}

// Everything a failed operation must leave untouched.
struct Snapshot {
  std::vector<std::uint32_t> refcounts;
  std::size_t free_blocks;
  std::vector<BlockId> lru;
  std::size_t cached;
  PrefixCacheCounters counters;

  static Snapshot of(const PrefixCache& pc) {
    Snapshot s;
    const PagedKvCache& kv = pc.kv_cache();
    for (BlockId b = 0; b < kv.num_blocks(); ++b)
      s.refcounts.push_back(kv.ref_count(b));
    s.free_blocks = kv.num_free_blocks();
    s.lru = pc.lru_order();
    s.cached = pc.num_cached_blocks();
    s.counters = pc.counters();
    return s;
  }
  void expect_same(const PrefixCache& pc) const {
    const Snapshot now = of(pc);
    EXPECT_EQ(now.refcounts, refcounts);
    EXPECT_EQ(now.free_blocks, free_blocks);
    EXPECT_EQ(now.lru, lru);
    EXPECT_EQ(now.cached, cached);
    EXPECT_EQ(now.counters.hits, counters.hits);
    EXPECT_EQ(now.counters.evictions, counters.evictions);
    EXPECT_EQ(now.counters.inserts, counters.inserts);
    const InvariantReport r = pc.check_invariants();
    EXPECT_TRUE(r.ok) << r.to_string();
  }
};

class PrefixCacheFaultTest : public ::testing::TestWithParam<KvCacheLayout> {
 protected:
  FaultInjectingBackend fb{test::host_backend()};
  Stream stream = fb.create_stream();
  PagedKvCache cache{test::small_config(GetParam()), 8, fb};
  PrefixCache pc{cache};

  // Two cached blocks in the LRU list, and `a`: one full cached block and a
  // partial one (6 tokens).
  void populate(BlockTable& a) {
    BlockTable warm(pc);
    warm.append_tokens(tokens(8, 500), stream);
    warm.release();
    a.append_tokens(tokens(6), stream);
  }
};

TEST_P(PrefixCacheFaultTest, AFailedCopyOnWriteLeavesTheTableAsItWas) {
  BlockTable a(pc);
  populate(a);
  BlockTable b = a.fork();
  const std::vector<BlockId> blocks_before(b.blocks().begin(), b.blocks().end());
  const Snapshot before = Snapshot::of(pc);
  fb.set_plan(FaultKind::copy, {.nth = 1});
  EXPECT_THROW(b.append_tokens(tokens(3, 90), stream), BackendError);
  EXPECT_EQ(fb.counts(FaultKind::copy).faults, 1u);
  EXPECT_THAT(b.blocks(), ElementsAreArray(blocks_before));
  EXPECT_THAT(b.tokens(), ElementsAreArray(tokens(6)));
  EXPECT_EQ(b.copy_on_writes(), 0u);
  before.expect_same(pc);
  // The failed attempt may not poison later ones: the retry copies.
  fb.clear_plans();
  b.append_tokens(tokens(3, 90), stream);
  EXPECT_EQ(b.copy_on_writes(), 1u);
  EXPECT_TRUE(pc.check_invariants().ok);
}

TEST_P(PrefixCacheFaultTest, ADeferredCopyFailureSurfacesAtTheNextSynchronize) {
  BlockTable a(pc);
  populate(a);
  BlockTable b = a.fork();
  fb.set_plan(FaultKind::copy, {.nth = 1, .mode = FaultMode::deferred});
  b.append_tokens(tokens(1, 90), stream);  // queued; the error is the device's
  EXPECT_EQ(b.copy_on_writes(), 1u);
  EXPECT_THROW(fb.synchronize(stream), BackendError);
  fb.synchronize(stream);  // reported once, then the stream works again
  EXPECT_TRUE(pc.check_invariants().ok) << "host-side state stays consistent";
}

TEST_P(PrefixCacheFaultTest, AFailedCopyOfAFullyCachedPromptsLastBlockChangesNothing) {
  {
    BlockTable warm(pc);
    warm.append_tokens(tokens(8), stream);
  }  // blocks 0 and 1 cached and evictable
  const Snapshot before = Snapshot::of(pc);
  auto sorted = [](std::vector<BlockId> v) {
    std::sort(v.begin(), v.end());
    return v;
  };
  auto expect_as_before = [&] {
    const Snapshot now = Snapshot::of(pc);
    EXPECT_EQ(now.refcounts, before.refcounts);
    EXPECT_EQ(now.free_blocks, before.free_blocks);
    EXPECT_EQ(sorted(now.lru), sorted(before.lru));
    EXPECT_EQ(now.cached, before.cached);
    const InvariantReport r = pc.check_invariants();
    EXPECT_TRUE(r.ok) << r.to_string();
  };
  // At the call, on the caller's stream.
  fb.set_plan(FaultKind::copy, {.nth = 1});
  BlockTable t(pc);
  EXPECT_THROW(t.reuse_cached_prefix(tokens(8), stream), BackendError);
  EXPECT_TRUE(t.empty());
  EXPECT_EQ(t.copy_on_writes(), 0u);
  expect_as_before();
  // On the device, with the one-argument form: its synchronize sees it.
  fb.set_plan(FaultKind::copy, {.nth = 1, .mode = FaultMode::deferred});
  EXPECT_THROW(t.reuse_cached_prefix(tokens(8)), BackendError);
  EXPECT_TRUE(t.empty());
  expect_as_before();
  // The stream form returns; the error is the stream's, as for append_tokens.
  fb.set_plan(FaultKind::copy, {.nth = 1, .mode = FaultMode::deferred});
  EXPECT_EQ(t.reuse_cached_prefix(tokens(8), stream), 7u);
  EXPECT_THROW(fb.synchronize(stream), BackendError);
  fb.clear_plans();
  EXPECT_TRUE(pc.check_invariants().ok);
}

TEST_P(PrefixCacheFaultTest, AFailedZeroOrPoisonChangesNoPrefixCacheState) {
  BlockTable a(pc);
  populate(a);
  const Snapshot before = Snapshot::of(pc);
  for (const FaultMode mode : {FaultMode::synchronous, FaultMode::deferred}) {
    fb.set_plan(FaultKind::fill, {.nth = 1, .mode = mode});
    fb.reset_fault_counts();
    if (mode == FaultMode::synchronous) {
      EXPECT_THROW(cache.zero_blocks(a.blocks(), stream), BackendError);
    } else {
      cache.poison_blocks(a.blocks(), stream);
      EXPECT_THROW(fb.synchronize(stream), BackendError);
    }
    EXPECT_EQ(fb.counts(FaultKind::fill).faults, 1u);
    before.expect_same(pc);
  }
}

TEST_P(PrefixCacheFaultTest, RandomCopyAndFillFaultsNeverBreakTheInvariants) {
  fb.set_plan(FaultKind::copy, {.probability = 0.3, .seed = 11});
  fb.set_plan(FaultKind::fill, {.probability = 0.3, .seed = 12});
  std::vector<BlockTable> tables;
  std::size_t faults_seen = 0;
  for (int step = 0; step < 300; ++step) {
    try {
      switch (step % 5) {
        case 0:
          if (tables.size() < 4) {
            tables.emplace_back(pc);
            const std::vector<TokenId> prompt = tokens(1 + step % 11);
            const std::size_t reused = tables.back().reuse_cached_prefix(prompt);
            tables.back().append_tokens(std::span<const TokenId>(prompt).subspan(reused), stream);
          }
          break;
        case 1:
          if (!tables.empty() && tables.size() < 6)
            tables.push_back(tables[step % tables.size()].fork());
          break;
        case 2:
          if (!tables.empty())
            tables[step % tables.size()].append_tokens(tokens(1 + step % 3, 700), stream);
          break;
        case 3:
          if (!tables.empty()) cache.zero_blocks(tables[step % tables.size()].blocks(), stream);
          break;
        case 4:
          if (!tables.empty())
            tables.erase(tables.begin() + static_cast<std::ptrdiff_t>(step % tables.size()));
          break;
      }
    } catch (const BackendError&) {
      ++faults_seen;
    } catch (const CacheExhausted&) {
    }
    const InvariantReport r = pc.check_invariants();
    ASSERT_TRUE(r.ok) << "step " << step << ": " << r.to_string();
  }
  EXPECT_GT(faults_seen, 0u);
  tables.clear();
  pc.evict(8);
  EXPECT_EQ(cache.num_free_blocks(), 8u) << "no reference leaked through a failure";
}

INSTANTIATE_TEST_SUITE_P(Layouts, PrefixCacheFaultTest,
                         ::testing::Values(KvCacheLayout::layer_major, KvCacheLayout::block_major),
                         [](const auto& p) { return std::string(to_string(p.param)); });

}  // namespace
}  // namespace kvport
