// SPDX-License-Identifier: Apache-2.0
// The hybrid hit rule against a brute-force reference: find_hybrid_hit on
// random rules and cached sets, and HybridBlockTable on random hybrid
// workloads (shared prefixes, evictions, forks), checked against the longest
// prefix valid for every group computed by scanning every candidate.
#include <gtest/gtest.h>

#include <random>
#include <vector>

#include "core_test_util.hpp"
#include "kvport/core/hybrid_block_table.hpp"
#include "kvport/core/hybrid_kv_cache.hpp"

namespace kvport {
namespace {

// The definition, written out: the largest p <= max such that every group's
// blocks [first_needed_block(p * bs), p) are cached (state: block p - 1).
std::size_t brute_force_hit(std::span<const GroupHitRule> rules, std::size_t bs,
                            std::size_t max_blocks, const std::vector<std::vector<bool>>& cached) {
  for (std::size_t p = max_blocks + 1; p-- > 0;) {
    bool ok = true;
    for (std::size_t g = 0; g < rules.size() && ok; ++g) {
      if (p == 0) break;
      if (rules[g].kind == LayerKind::state) {
        ok = cached[g][p - 1];
        continue;
      }
      for (std::size_t i = first_needed_block(rules[g], bs, p * bs); i < p && ok; ++i)
        ok = cached[g][i];
    }
    if (ok) return p;
  }
  return 0;
}

GroupHitRule random_rule(std::mt19937& rng, std::size_t bs) {
  switch (rng() % 5) {
    case 0:
      return {LayerKind::full_attention, 0, 0};
    case 1:
      return {LayerKind::mla, 0, 0};
    case 2:
      return {LayerKind::sliding_window, 1 + rng() % (4 * bs), 0};
    case 3:
      return {LayerKind::chunked_local, 0, bs * (1 + rng() % 4)};
    default:
      return {LayerKind::state, 0, 0};
  }
}

TEST(FindHybridHit, MatchesTheBruteForceReference) {
  std::mt19937 rng(20261201);
  for (int iter = 0; iter < 20000; ++iter) {
    const std::size_t bs = 1 + rng() % 4;
    const std::size_t groups = 1 + rng() % 4;
    const std::size_t max_blocks = rng() % 24;
    std::vector<GroupHitRule> rules;
    std::vector<std::vector<bool>> cached(groups, std::vector<bool>(max_blocks));
    const std::size_t density = 50 + rng() % 50;  // percent cached
    for (std::size_t g = 0; g < groups; ++g) {
      rules.push_back(random_rule(rng, bs));
      for (std::size_t i = 0; i < max_blocks; ++i)
        cached[g][i] = rng() % 100 < density;
    }
    std::size_t calls = 0;
    const std::size_t got =
        find_hybrid_hit(rules, bs, max_blocks, [&](std::size_t g, std::size_t i) {
          ++calls;
          EXPECT_LT(i, max_blocks);
          return static_cast<bool>(cached[g][i]);
        });
    ASSERT_EQ(got, brute_force_hit(rules, bs, max_blocks, cached)) << "iteration " << iter;
  }
}

TEST(FindHybridHit, WindowScanStopsAtTheFirstValidCandidate) {
  // One window group of 2 blocks' span, everything cached: the scan probes
  // only the blocks the window needs, not the whole prompt.
  const GroupHitRule full{LayerKind::full_attention, 0, 0};
  const GroupHitRule window{LayerKind::sliding_window, 8, 0};
  const std::vector<GroupHitRule> rules{full, window};
  std::size_t window_calls = 0;
  const std::size_t hit = find_hybrid_hit(rules, 4, 1000, [&](std::size_t g, std::size_t) {
    window_calls += g == 1 ? 1 : 0;
    return true;
  });
  EXPECT_EQ(hit, 1000u);
  EXPECT_LE(window_calls, 2u);
}

// Random workloads through HybridBlockTable: before each lookup the reference
// computes the hit from each group's prefix cache (find), then the table must
// hit exactly that and hold a valid span in every group.
TEST(HybridBlockTableReference, RandomWorkloadsHitWhatTheReferenceSays) {
  std::mt19937 rng(7);
  auto backend = test::host_backend();
  Stream stream = backend->create_stream();
  std::size_t hits = 0, partial_window_hits = 0;
  for (int config = 0; config < 12; ++config) {
    const std::size_t bs = 1 + rng() % 4;
    HybridKvCacheConfig c;
    c.block_size = bs;
    const std::size_t num_groups = 1 + rng() % 4;
    for (std::size_t g = 0; g < num_groups; ++g) {
      const GroupHitRule r = random_rule(rng, bs);
      switch (r.kind) {
        case LayerKind::sliding_window:
          c.layers.push_back(LayerSpec::sliding_window(r.window, 1, 8, 8));
          break;
        case LayerKind::chunked_local:
          c.layers.push_back(LayerSpec::chunked_local(r.chunk, 1, 8, 8));
          break;
        case LayerKind::state:
          c.layers.push_back(
              LayerSpec::recurrent_state({StateTensor{"s", {4 + g}, StateDtype::f32}}));
          break;
        case LayerKind::mla:
          c.layers.push_back(LayerSpec::mla(8 + g, 4));
          break;
        default:
          c.layers.push_back(LayerSpec::full_attention(1 + g, 8, 8));
          break;
      }
    }
    std::vector<std::size_t> counts;
    const std::vector<KvCacheGroup> groups = group_layers(c.layers, bs);
    for (std::size_t g = 0; g < groups.size(); ++g)
      counts.push_back(8 + rng() % 40);
    c.state_checkpoint_interval = rng() % 3;  // 0: no checkpoints
    HybridKvCache cache(c, counts, *backend);
    std::vector<std::vector<TokenId>> prefixes;
    for (int p = 0; p < 4; ++p) {
      std::vector<TokenId> t(rng() % 30);
      for (TokenId& x : t)
        x = static_cast<TokenId>(rng() % 3);
      prefixes.push_back(t);
    }
    std::vector<HybridBlockTable> live;
    for (int step = 0; step < 300; ++step) {
      // A prompt: a shared prefix plus a random tail.
      std::vector<TokenId> prompt = prefixes[rng() % prefixes.size()];
      const std::size_t tail = rng() % 12;
      for (std::size_t i = 0; i < tail; ++i)
        prompt.push_back(static_cast<TokenId>(rng() % 3));
      HybridBlockTable t(cache);
      if (rng() % 2 == 0) t.set_prefix_hit_mode(PrefixHitMode::full);
      const std::size_t max_blocks = t.prefix_hit_mode() == PrefixHitMode::full
                                         ? prompt.size() / bs
                                         : (prompt.empty() ? 0 : (prompt.size() - 1) / bs);
      const std::vector<BlockHash> h = hash_full_blocks(prompt, bs);
      std::vector<GroupHitRule> rules;
      std::vector<std::vector<bool>> cached(cache.num_groups(), std::vector<bool>(max_blocks));
      for (std::size_t g = 0; g < cache.num_groups(); ++g) {
        rules.push_back(hit_rule_of(cache.group(g).spec));
        for (std::size_t i = 0; i < max_blocks; ++i)
          cached[g][i] = cache.prefix_cache(g).find(h[i]).has_value();
      }
      const std::size_t expected = brute_force_hit(rules, bs, max_blocks, cached);
      ASSERT_EQ(t.reuse_cached_prefix(prompt, stream), expected * bs)
          << "config " << config << " step " << step;
      hits += expected > 0 ? 1 : 0;
      for (std::size_t g = 0; g < cache.num_groups(); ++g) {
        std::size_t full_chain = 0;
        while (full_chain < max_blocks && cached[g][full_chain])
          ++full_chain;
        if (rules[g].kind != LayerKind::full_attention && expected > full_chain)
          ++partial_window_hits;  // a hit past a gap this group does not need
      }
      for (std::size_t g = 0; g < cache.num_groups(); ++g) {
        const std::size_t first = first_needed_block(rules[g], bs, expected * bs);
        for (std::size_t i = 0; i < expected; ++i) {
          if (i < first) {
            EXPECT_EQ(t.blocks(g)[i], kNullBlock);
          } else {
            EXPECT_EQ(cache.prefix_cache(g).find(h[i]), t.blocks(g)[i]);
          }
        }
      }
      const std::span<const TokenId> rest(prompt.data() + t.num_tokens(),
                                          prompt.size() - t.num_tokens());
      if (t.can_append(rest.size())) {
        t.append_tokens(rest, stream);
        if (rng() % 3 == 0) live.push_back(t.fork(stream));
        live.push_back(std::move(t));
      } else {
        EXPECT_THROW(t.append_tokens(rest, stream), CacheExhausted);
      }
      // Finish some sequences, evict a little.
      while (live.size() > 3 || (!live.empty() && rng() % 3 == 0)) {
        live.erase(live.begin() + static_cast<std::ptrdiff_t>(rng() % live.size()));
      }
      if (rng() % 5 == 0) {
        const std::size_t g = rng() % cache.num_groups();
        (void)cache.prefix_cache(g).evict(1 + rng() % 3);
      }
      const InvariantReport r = cache.check_invariants();
      ASSERT_TRUE(r.ok) << r.to_string();
    }
  }
  // The workload exercises the rule: many hits, some past blocks a window or
  // chunked group no longer holds.
  EXPECT_GT(hits, 500u);
  EXPECT_GT(partial_window_hits, 20u);
}

}  // namespace
}  // namespace kvport
