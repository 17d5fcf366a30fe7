// SPDX-License-Identifier: Apache-2.0
// HybridHostTier: the host tier under every KV cache group. A request's
// blocks evicted from the device in every group (full attention, sliding
// window, state checkpoints) come back from the host as one hybrid hit, with
// the right bytes; a group whose checkpoints are not on the host ends the
// hit; and a copy that fails at any step never gives a lookup a block with
// the wrong bytes (the hit is decided again, shorter, and counted).
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <memory>
#include <optional>
#include <vector>

#include "core_test_util.hpp"
#include "kvport/core/hybrid_block_table.hpp"
#include "kvport/core/hybrid_host_tier.hpp"
#include "kvport/core/hybrid_kv_cache.hpp"
#include "kvport/platform/error.hpp"
#include "kvport/platform/fault_injecting_backend.hpp"
#include "memory_store.hpp"

namespace kvport {
namespace {

using ::testing::HasSubstr;

constexpr std::size_t kBs = test::kHybridBlockSize;

// Group 0: full attention; group 1: a window of 8 tokens (2 blocks); group 2:
// a recurrent state, checkpointed at every block.
HybridKvCacheConfig config() {
  return test::three_group_config();
}

// The content an engine would have written for the block (or state) at the
// chained hash `h` in group `g`.
std::size_t tag(const BlockHash& h, std::size_t g) {
  return static_cast<std::size_t>(h.low % 100003) * 3 + g;
}

std::vector<TokenId> prompt(TokenId first, std::size_t blocks, std::size_t extra = 0) {
  return test::tokens(blocks * kBs + extra, first);
}

// A device cache, its host tier and a stream, over a backend that may inject
// faults; torn down in order.
struct World {
  explicit World(std::vector<std::size_t> host_slots, bool with_tier = true) {
    fb = std::make_unique<FaultInjectingBackend>(test::host_backend());
    stream.emplace(fb->create_stream());
    const std::vector<std::size_t> device{10, 10, 6};
    cache = std::make_unique<HybridKvCache>(config(), device, *fb);
    if (with_tier) {
      HybridHostTierOptions o;
      o.slots_per_group = std::move(host_slots);
      tier = std::make_unique<HybridHostTier>(*cache, o, *stream);
    }
  }
  ~World() {
    tier.reset();
    cache.reset();
    stream.reset();
  }

  // The engine's forward pass over what `t` appended: every live block of
  // the block groups and the working state hold their tags.
  void compute(const HybridBlockTable& t) {
    const std::vector<BlockHash> h = hash_full_blocks(t.tokens(), kBs);
    for (std::size_t g = 0; g < cache->num_groups(); ++g) {
      PagedKvCache& pool = cache->group_cache(g);
      if (const auto slot = t.state_slot(g)) {
        test::write_pattern_block(pool, *slot, tag(h.back(), g), *stream);
        continue;
      }
      const std::span<const BlockId> blocks = t.blocks(g);
      for (std::size_t i = 0; i < blocks.size() && i < h.size(); ++i)
        if (blocks[i] != kNullBlock)
          test::write_pattern_block(pool, blocks[i], tag(h[i], g), *stream);
    }
  }

  // A request: its cached prefix, then the rest a block at a time, each
  // block computed before the next is appended. Returns the hit (tokens).
  std::size_t run(const std::vector<TokenId>& p, bool keep = false) {
    HybridBlockTable t(*cache);
    const std::size_t hit = t.reuse_cached_prefix(p, *stream);
    for (std::size_t at = hit; at < p.size(); at += kBs) {
      const std::size_t n = std::min(kBs, p.size() - at);
      t.append_tokens(std::span<const TokenId>(p).subspan(at, n), *stream);
      compute(t);
      if (tier) tier->poll();
    }
    if (keep) kept.emplace(std::move(t));
    return hit;
  }

  // Whether every block and the state of a table just started from a hit of
  // `hit` tokens of `p` hold what was computed for them.
  ::testing::AssertionResult holds_computed(const HybridBlockTable& t,
                                            const std::vector<TokenId>& p, std::size_t hit) {
    const std::vector<BlockHash> h = hash_full_blocks(p, kBs);
    const std::size_t n = hit / kBs;
    for (std::size_t g = 0; g < cache->num_groups(); ++g) {
      const PagedKvCache& pool = cache->group_cache(g);
      if (cache->group(g).spec.kind == LayerKind::state) {
        const auto slot = t.state_slot(g);
        if (n == 0) continue;
        if (!slot) return ::testing::AssertionFailure() << "group " << g << ": no state slot";
        if (!test::holds_pattern_block(pool, *slot, tag(h[n - 1], g), *stream))
          return ::testing::AssertionFailure() << "group " << g << ": wrong state at " << n;
        continue;
      }
      const std::span<const BlockId> blocks = t.blocks(g);
      for (std::size_t i = 0; i < blocks.size(); ++i) {
        if (blocks[i] == kNullBlock) continue;
        if (!test::holds_pattern_block(pool, blocks[i], tag(h[i], g), *stream))
          return ::testing::AssertionFailure() << "group " << g << ": wrong bytes in block " << i;
      }
    }
    return ::testing::AssertionSuccess();
  }

  InvariantReport invariants() const {
    return tier ? tier->check_invariants() : cache->check_invariants();
  }

  std::unique_ptr<FaultInjectingBackend> fb;
  std::optional<Stream> stream;
  std::unique_ptr<HybridKvCache> cache;
  std::unique_ptr<HybridHostTier> tier;
  std::optional<HybridBlockTable> kept;
};

// Request A (8 blocks and a token: the state after block 8 is checkpointed
// when the token is appended), then three unrelated requests that push A out
// of every group's device pool.
void a_then_churn(World& w) {
  w.run(prompt(1, 8, 1));
  for (TokenId k = 1; k <= 3; ++k)
    w.run(prompt(static_cast<TokenId>(1000 * k), 8));
}

TEST(hybrid_host_tier, EveryGroupComesBackFromTheHostWithItsBytes) {
  World w({32, 32, 32});
  a_then_churn(w);
  ASSERT_TRUE(w.invariants().ok) << w.invariants().to_string();
  const std::vector<TokenId> again = prompt(1, 8, 1);
  HybridBlockTable t(*w.cache);
  const std::size_t hit = t.reuse_cached_prefix(again, *w.stream);
  EXPECT_EQ(hit, 8 * kBs);
  EXPECT_TRUE(w.holds_computed(t, again, hit));
  const HybridHitCounters& c = w.cache->hit_counters();
  EXPECT_GT(c.lower_tier_blocks, 0u);
  EXPECT_EQ(c.short_hits, 0u);
  // Every group's tier wrote back and onloaded (the state: a checkpoint).
  for (std::size_t g = 0; g < 3; ++g) {
    EXPECT_GT(w.tier->counters(g).offloads, 0u) << g;
    EXPECT_GT(w.tier->counters(g).onloads, 0u) << g;
  }
  HostTierCounters sum;
  for (std::size_t g = 0; g < 3; ++g)
    sum += w.tier->counters(g);
  EXPECT_EQ(w.tier->total_counters().onloads, sum.onloads);
  EXPECT_EQ(w.tier->total_counters().offload_bytes, sum.offload_bytes);
  EXPECT_EQ(sum.onloads, w.tier->counters(0).onloads + w.tier->counters(1).onloads +
                             w.tier->counters(2).onloads);
  // Window: only the blocks the window needs at the hit point are held.
  EXPECT_EQ(t.num_live_blocks(1), 2u);
  EXPECT_EQ(t.num_live_blocks(0), 8u);
  t.release();
  EXPECT_TRUE(w.invariants().ok) << w.invariants().to_string();

  // Without a tier the same requests hit nothing: the host is what hit.
  World bare({}, /*with_tier=*/false);
  a_then_churn(bare);
  HybridBlockTable u(*bare.cache);
  EXPECT_EQ(u.reuse_cached_prefix(again, *bare.stream), 0u);
}

// A small host (4 slots a group) over a lower tier per group: A's blocks and
// checkpoints go device -> host -> lower tier in every group, and the hybrid
// hit rule finds them there (holds() counts the lower tier); reads that fail
// make the hit be decided again, shorter, never with wrong bytes.
TEST(hybrid_host_tier, EveryGroupComesBackFromItsLowerTierWithItsBytes) {
  for (const bool failing : {false, true}) {
    SCOPED_TRACE(failing ? "reads fail" : "reads succeed");
    std::vector<std::unique_ptr<test::MemoryStore>> stores;  // outlive the tier
    World w({4, 4, 4});
    for (std::size_t g = 0; g < 3; ++g) {
      stores.push_back(
          std::make_unique<test::MemoryStore>(w.tier->group_tier(g)->slot_bytes(), 64));
      w.tier->set_lower_tier(g, stores.back().get());
    }
    a_then_churn(w);
    ASSERT_TRUE(w.invariants().ok) << w.invariants().to_string();
    std::size_t below = 0;
    for (std::size_t g = 0; g < 3; ++g) {
      EXPECT_GT(w.tier->counters(g).lower_tier_writes, 0u) << g;
      below += stores[g]->size();
    }
    ASSERT_GT(below, 0u);
    if (failing) {
      for (auto& st : stores)
        st->reads_left = 0;
    }
    const std::vector<TokenId> again = prompt(1, 8, 1);
    HybridBlockTable t(*w.cache);
    const std::size_t hit = t.reuse_cached_prefix(again, *w.stream);
    EXPECT_TRUE(w.holds_computed(t, again, hit));
    HostTierCounters sum = w.tier->total_counters();
    if (failing) {
      EXPECT_LT(hit, 8 * kBs);
      EXPECT_EQ(sum.lower_tier_hits, 0u);
      EXPECT_GT(sum.lower_tier_shortfalls, 0u);
    } else {
      EXPECT_EQ(hit, 8 * kBs);
      EXPECT_GT(sum.lower_tier_hits, 0u);
      // 4 host slots cannot take a whole run at once: a lookup stops where
      // the slots run out (a shortfall), and the next one takes the rest.
      EXPECT_EQ(w.cache->hit_counters().short_hits, 0u);
    }
    t.release();
    EXPECT_TRUE(w.invariants().ok) << w.invariants().to_string();
  }
}

TEST(hybrid_host_tier, AStateGroupWithoutItsCheckpointOnTheHostEndsTheHit) {
  World w({32, 32, 0});  // the state group keeps no checkpoint on the host
  a_then_churn(w);
  const std::vector<BlockHash> h = hash_full_blocks(prompt(1, 8), kBs);
  // The attention groups still have A's blocks (device or host) ...
  const auto somewhere = [&](std::size_t g, const BlockHash& x) {
    return w.cache->prefix_cache(g).find(x).has_value() || w.tier->group_tier(g)->is_on_host(x);
  };
  for (const BlockHash& x : h)
    EXPECT_TRUE(somewhere(0, x));
  // ... but no state checkpoint of A is left: no hit.
  HybridBlockTable t(*w.cache);
  EXPECT_EQ(t.reuse_cached_prefix(prompt(1, 8, 1), *w.stream), 0u);
  EXPECT_EQ(w.tier->group_tier(2), nullptr);
  EXPECT_EQ(w.tier->counters(2).offloads, 0u);
}

TEST(hybrid_host_tier, AFailedCopyAtAnyStepNeverHandsOutWrongBytes) {
  test::QuietLog quiet;
  for (const FaultMode mode : {FaultMode::synchronous, FaultMode::deferred}) {
    std::size_t shortened = 0;
    std::size_t errors = 0;
    std::uint64_t n = 1;
    for (;; ++n) {
      SCOPED_TRACE(::testing::Message() << "copy " << n << " fails, mode " << int(mode));
      World w({32, 32, 32});
      a_then_churn(w);
      const std::vector<TokenId> again = prompt(1, 8, 1);
      w.fb->set_plan(FaultKind::copy, {.nth = n, .mode = mode});
      HybridBlockTable t(*w.cache);
      std::size_t hit = 0;
      bool threw = false;
      try {
        hit = t.reuse_cached_prefix(again, *w.stream);
        w.fb->clear_plan(FaultKind::copy);
        w.stream->synchronize();  // the state copy's own error, if it failed
      } catch (const BackendError&) {
        threw = true;  // the state copy on the caller's stream: it sees the error
        ++errors;
      }
      w.fb->clear_plan(FaultKind::copy);
      const bool fired = w.fb->counts(FaultKind::copy).faults > 0;
      if (!threw) {
        EXPECT_TRUE(w.holds_computed(t, again, hit));
        if (hit < 8 * kBs || w.cache->hit_counters().short_hits > 0) ++shortened;
      }
      t.release();
      if (w.tier) w.tier->synchronize();
      const InvariantReport r = w.invariants();
      EXPECT_TRUE(r.ok) << r.to_string();
      if (!fired) {  // past the last copy: the whole hit
        EXPECT_EQ(hit, 8 * kBs);
        break;
      }
    }
    // The sweep reached the onloads, and some failures shortened the hit.
    EXPECT_GT(n, 3u);
    EXPECT_GT(shortened + errors, 0u);
  }
}

TEST(hybrid_host_tier, OptionsAndSizing) {
  auto backend = test::host_backend();
  const std::vector<std::size_t> device{10, 10, 6};
  HybridKvCache cache(config(), device, *backend);
  HybridHostTierOptions o;
  o.slots_per_group = {4, 4};
  EXPECT_THAT([&] { HybridHostTier t(cache, o); },
              ::testing::ThrowsMessage<InvalidArgument>(HasSubstr("2 slot counts for 3")));
  o.slots_per_group = {0, 0, 0};
  EXPECT_THAT([&] { HybridHostTier t(cache, o); },
              ::testing::ThrowsMessage<InvalidArgument>(HasSubstr("no group has host slots")));
  o.slots_per_group = {4, HostTierOptions::kMaxHostBlocks + 1, 0};
  EXPECT_THAT([&] { HybridHostTier t(cache, o); },
              ::testing::ThrowsMessage<InvalidArgument>(HasSubstr("group 1 (")));
  o.slots_per_group = {4, 0, 2};
  o.offload_batch = 0;  // HostTier's own check, named by group
  EXPECT_THAT([&] { HybridHostTier t(cache, o); },
              ::testing::ThrowsMessage<InvalidArgument>(HasSubstr("group 0 (")));
  EXPECT_EQ(cache.prefix_cache(0).tier(), nullptr);  // nothing left installed
  o.offload_batch = 32;
  {
    HybridHostTier t(cache, o);
    EXPECT_NE(t.group_tier(0), nullptr);
    EXPECT_EQ(t.group_tier(1), nullptr);
    EXPECT_THROW((void)t.group_tier(3), InvalidArgument);
    EXPECT_EQ(t.host_bytes(), 4 * HostTier::slot_bytes_for(cache.group_cache(0)) +
                                  2 * HostTier::slot_bytes_for(cache.group_cache(2)));
    // A second tier on the same groups is refused, and the first stays.
    EXPECT_THROW(HybridHostTier(cache, o), InvalidArgument);
    EXPECT_EQ(cache.prefix_cache(0).tier(), t.group_tier(0));
    EXPECT_TRUE(t.check_invariants().ok);
  }
  EXPECT_EQ(cache.prefix_cache(0).tier(), nullptr);

  // Host slots: the same tokens in every group.
  KvCachePlan plan;
  plan.groups.resize(3);
  plan.groups[0].spec = LayerSpec::full_attention(1, 8, 8);
  plan.groups[0].bytes = 300;
  plan.groups[0].bytes_per_block = 10;
  plan.groups[1].spec = LayerSpec::sliding_window(8, 1, 8, 8);
  plan.groups[1].bytes = 20;  // sized for its peak: a small pool
  plan.groups[1].bytes_per_block = 10;
  plan.groups[2].spec = LayerSpec::recurrent_state({StateTensor{"s", {4}, StateDtype::f32}});
  plan.groups[2].bytes = 80;
  plan.groups[2].bytes_per_block = 40;
  plan.total_bytes = 400;
  // A block's worth: 10 + 10 + 40 / 4 = 30 bytes; 900 bytes hold 30 blocks
  // in each block group and 30 / 4 = 7 checkpoints.
  EXPECT_EQ(split_host_slots(plan, 900, 4), (std::vector<std::size_t>{30, 30, 7}));
  // No checkpoints: nothing for the state group, all of it to the others.
  EXPECT_EQ(split_host_slots(plan, 900, 0), (std::vector<std::size_t>{45, 45, 0}));
  EXPECT_EQ(split_host_slots(plan, 0, 4), (std::vector<std::size_t>{0, 0, 0}));
  EXPECT_THROW((void)split_host_slots(KvCachePlan{}, 800, 1), InvalidArgument);
}

}  // namespace
}  // namespace kvport
