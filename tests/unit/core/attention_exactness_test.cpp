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
#include <random>
#include <string>
#include <vector>

#include "core_test_util.hpp"
#include "kvport/core/host_tier.hpp"
#include "kvport/core/hybrid_block_table.hpp"
#include "kvport/core/hybrid_host_tier.hpp"
#include "kvport/core/hybrid_kv_cache.hpp"
#include "kvport/testing/paged_attention.hpp"

namespace kvport {
namespace {

using testing::PagedAttentionModel;

constexpr std::size_t kBs = 4;

// Window W = 8, full attention, chunked local C = 8, and (with a pool per
// group) MLA: its pages (a 16-value latent, no V) differ from the others',
// so a shared pool holds the first three.
HybridKvCacheConfig model(bool shared) {
  HybridKvCacheConfig c;
  c.block_size = kBs;
  constexpr std::size_t d = PagedAttentionModel::kDim;
  c.layers = {LayerSpec::sliding_window(8, 1, d, d), LayerSpec::full_attention(1, d, d),
              LayerSpec::chunked_local(8, 1, d, d)};
  if (!shared) c.layers.push_back(LayerSpec::mla(8, 8));
  return c;
}

struct Counts {
  std::size_t steps = 0;
  std::size_t hits = 0;
  std::size_t forks = 0;
  std::size_t speculative = 0;
  std::size_t preemptions = 0;
  std::size_t checked = 0;
};

// Runs `steps` random engine steps over `cache` (with `tier` under its
// groups: offloads and polls too, so blocks go to the host and come back);
// returns "" or the first difference.
std::string run_loop(HybridKvCache& cache, StreamView stream, std::uint32_t seed, std::size_t steps,
                     Counts& counts, HybridHostTier* tier = nullptr) {
  PagedAttentionModel m(cache, stream);
  std::mt19937 rng(seed);
  std::vector<std::unique_ptr<HybridBlockTable>> live;
  std::vector<std::vector<TokenId>> preempted;
  // Four prompt families over a small vocabulary: shared prefixes.
  auto prompt = [&] {
    const std::size_t family = rng() % 4;
    std::vector<TokenId> p(6 + family * 5);
    for (std::size_t i = 0; i < p.size(); ++i)
      p[i] = static_cast<TokenId>((i * (family + 1)) % 5);
    for (std::size_t i = rng() % 4; i > 0; --i)
      p.push_back(static_cast<TokenId>(rng() % 5));
    return p;
  };
  // Starts a request for `p` (a prefix hit, then prefill); false when it
  // does not fit (nothing held).
  auto start = [&](const std::vector<TokenId>& p) {
    auto t = std::make_unique<HybridBlockTable>(cache);
    const std::size_t hit = t->reuse_cached_prefix(p, stream);
    if (!t->can_append(p.size() - hit)) return false;
    t->append_tokens(std::span<const TokenId>(p).subspan(hit), stream);
    m.write_new(*t, p.size() - hit);
    counts.hits += hit > 0 ? 1 : 0;
    live.push_back(std::move(t));
    return true;
  };
  for (std::size_t step = 0; step < steps; ++step) {
    const auto op = static_cast<std::uint32_t>(rng() % 10);
    if (live.empty() || op < 2) {
      if (!preempted.empty() && rng() % 2 == 0) {  // recompute a preempted request
        if (start(preempted.back())) preempted.pop_back();
      } else {
        (void)start(prompt());
      }
    } else if (op < 3 && live.size() < 8) {  // fork; the child decodes (copy-on-write)
      HybridBlockTable& parent = *live[rng() % live.size()];
      if (parent.can_append(1)) {
        auto child = std::make_unique<HybridBlockTable>(parent.fork(stream));
        const TokenId t = static_cast<TokenId>(rng() % 5);
        if (child->can_append(1)) {  // its copy of the shared last block may not fit
          child->append_tokens({&t, 1}, stream);
          m.write_new(*child, 1);
          live.push_back(std::move(child));
          ++counts.forks;
        }
      }
    } else if (op < 5) {  // a speculative step: draft, verify, accept some
      HybridBlockTable& t = *live[rng() % live.size()];
      const std::size_t k = 1 + rng() % 4;
      if (t.can_append_draft(k + 1)) {
        std::vector<TokenId> drafts(k);
        for (TokenId& d : drafts)
          d = static_cast<TokenId>(rng() % 5);
        t.append_draft(drafts, stream);
        m.write_new(t, k);  // the verifier writes the drafts' KV
        const std::size_t accepted = rng() % (k + 1);
        t.commit(accepted);
        t.truncate(t.num_committed());
        // The verifier's own token, different from the first rejected draft.
        const TokenId bonus =
            accepted < k ? static_cast<TokenId>((drafts[accepted] + 1) % 5) : TokenId{3};
        t.append_tokens({&bonus, 1}, stream);
        m.write_new(t, 1);
        ++counts.speculative;
      }
    } else if (op < 6) {  // preempt: release, recompute later
      const std::size_t i = rng() % live.size();
      preempted.emplace_back(live[i]->tokens().begin(), live[i]->tokens().end());
      live.erase(live.begin() + static_cast<std::ptrdiff_t>(i));
      ++counts.preemptions;
    } else if (op < 7) {  // finish
      live.erase(live.begin() + static_cast<std::ptrdiff_t>(rng() % live.size()));
    } else if (op == 9 && tier != nullptr) {  // write cached blocks back to the host
      for (std::size_t g = 0; g < tier->num_groups(); ++g)
        if (HostTier* t = tier->group_tier(g)) (void)t->offload(rng() % 4);
      tier->poll();
    } else {  // decode one token in every request that fits
      for (auto& t : live) {
        if (t->num_tokens() > 60 || !t->can_append(1)) continue;
        const TokenId tok = static_cast<TokenId>(rng() % 5);
        t->append_tokens({&tok, 1}, stream);
        m.write_new(*t, 1);
      }
      if (tier != nullptr) tier->poll();
    }
    for (const auto& t : live) {
      for (std::size_t g = 0; g < cache.num_groups(); ++g) {
        std::string error;
        const std::optional<std::vector<float>> paged = m.paged(*t, g, error);
        if (!paged) return "step " + std::to_string(step) + ": " + error;
        if (*paged != m.dense(*t, g))
          return "step " + std::to_string(step) + ": group " + std::to_string(g) +
                 "'s attention differs from the dense recomputation";
        ++counts.checked;
      }
    }
    ++counts.steps;
  }
  return "";
}

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
    HybridKvCache cache(model(shared), sizes, *backend);
    Counts counts;
    const std::string diff = run_loop(cache, stream, shared ? 7u : 3u, 300, counts);
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
  HybridKvCache cache(model(false), std::vector<std::size_t>{24, 24, 24, 24}, *backend);
  HybridHostTierOptions o;
  o.slots_per_group = {32, 32, 32, 32};
  o.offload_batch = 4;
  HybridHostTier tier(cache, o, stream);
  Counts counts;
  const std::string diff = run_loop(cache, stream, 11u, 300, counts, &tier);
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
  HybridKvCache cache(model(false), std::vector<std::size_t>{16, 16, 16, 16}, *backend);
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
