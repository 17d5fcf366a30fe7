// SPDX-License-Identifier: Apache-2.0
// The end-to-end statement: the KV kvport serves gives the right attention.
// A decode loop over full-attention, sliding-window, chunked and MLA groups (the
// reference model of kvport/testing/paged_attention.hpp) serves many
// requests through HybridBlockTables: shared prefixes hitting the cache,
// forks with copy-on-write, preemption and recompute, speculative steps
// with random accepts and rejects. After every step the attention output of
// every live request, read through the batch view's rows, equals the dense
// recomputation from its tokens bit for bit.
#include <gtest/gtest.h>

#include <memory>
#include <string>
#include <vector>

#include "core_test_util.hpp"
#include "kvport/core/hybrid_block_table.hpp"
#include "kvport/core/hybrid_host_tier.hpp"
#include "kvport/core/hybrid_kv_cache.hpp"
#include "kvport/testing/attention_loop.hpp"
#include "kvport/testing/paged_attention.hpp"

namespace kvport {
namespace {

using testing::attention_model;
using testing::AttentionLoopCounts;
using testing::PagedAttentionModel;
using testing::run_attention_loop;

TEST(AttentionExactness, EveryStepEqualsTheDenseRecomputation) {
  for (const bool shared : {false, true}) {
    std::unique_ptr<Backend> backend = test::host_backend();
    Stream stream = backend->create_stream();
    HybridPoolSizes sizes;
    if (shared) {
      sizes.shared_blocks = 64;
      sizes.group_blocks = {0, 0, 0};
    } else {
      sizes.group_blocks = {48, 48, 48, 48};
    }
    HybridKvCache cache(attention_model(shared), sizes, *backend);
    AttentionLoopCounts counts;
    const std::string diff = run_attention_loop(cache, stream, shared ? 7u : 3u, 300, counts);
    ASSERT_EQ(diff, "") << (shared ? "shared pool" : "a pool per group");
    EXPECT_EQ(counts.steps, 300u);
    EXPECT_GT(counts.hits, 10u) << "the loop must hit cached prefixes";
    EXPECT_GT(counts.forks, 5u);
    EXPECT_GT(counts.speculative, 20u);
    EXPECT_GT(counts.preemptions, 10u);
    EXPECT_GT(counts.checked, 1000u);
    const InvariantReport r = cache.check_invariants();
    EXPECT_TRUE(r.ok) << r.to_string();
  }
}

// The same loop with a host tier under every group and small device pools:
// blocks are written back to the host, evicted on the device, and hits bring
// them back (onloads) before attention reads them.
TEST(AttentionExactness, BlocksBackFromTheHostTierAttendExactly) {
  std::unique_ptr<Backend> backend = test::host_backend();
  Stream stream = backend->create_stream();
  HybridKvCache cache(attention_model(false), std::vector<std::size_t>{24, 24, 24, 24}, *backend);
  HybridHostTierOptions o;
  o.slots_per_group = {32, 32, 32, 32};
  o.offload_batch = 4;
  HybridHostTier tier(cache, o, stream);
  AttentionLoopCounts counts;
  const std::string diff = run_attention_loop(cache, stream, 11u, 300, counts, &tier);
  ASSERT_EQ(diff, "");
  EXPECT_GT(counts.hits, 10u);
  EXPECT_GT(cache.hit_counters().lower_tier_blocks, 0u) << "some hits must come from the host";
  EXPECT_GT(tier.total_counters().offloads, 0u);
  EXPECT_GT(counts.checked, 500u);
  const InvariantReport r = tier.check_invariants();
  EXPECT_TRUE(r.ok) << r.to_string();
}

// The check can fail: a KV slot written for the wrong position is found.
TEST(AttentionExactness, AStaleSlotIsFound) {
  std::unique_ptr<Backend> backend = test::host_backend();
  Stream stream = backend->create_stream();
  HybridKvCache cache(attention_model(false), std::vector<std::size_t>{16, 16, 16, 16}, *backend);
  PagedAttentionModel m(cache, stream);
  HybridBlockTable t(cache);
  const std::vector<TokenId> p = test::tokens(6, 1);
  t.append_tokens(p, stream);
  m.write_new(t, 6);
  std::string error;
  EXPECT_EQ(*m.paged(t, 1, error), m.dense(t, 1));
  const TokenId next = 9;
  t.append_tokens({&next, 1}, stream);  // its KV is never written: stale
  EXPECT_NE(*m.paged(t, 1, error), m.dense(t, 1));
}

}  // namespace
}  // namespace kvport
