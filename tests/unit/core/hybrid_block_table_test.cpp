// SPDX-License-Identifier: Apache-2.0
// HybridKvCache and HybridBlockTable over attention groups: the freeing rules
// (window, chunked), the hybrid hit, all-or-nothing appends, fork and
// copy-on-write, and invariants in every group.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <vector>

#include "core_test_util.hpp"
#include "kvport/core/hybrid_block_table.hpp"
#include "kvport/core/hybrid_kv_cache.hpp"
#include "kvport/platform/div_ceil.hpp"

namespace kvport {
namespace {

using test::host_backend;
using test::tokens;
using ::testing::HasSubstr;

constexpr std::size_t kBs = 4;

// Group 0: 2 full-attention layers; group 1: 2 window layers (W = 8);
// group 2: 1 chunked layer (C = 8). Small heads: 64-byte regions.
HybridKvCacheConfig hybrid_config() {
  HybridKvCacheConfig c;
  c.block_size = kBs;
  c.layers = {LayerSpec::sliding_window(8, 1, 8, 8),
              LayerSpec::full_attention(1, 8, 8),
              LayerSpec::chunked_local(8, 1, 8, 8),
              LayerSpec::sliding_window(8, 1, 8, 8),
              LayerSpec::no_kv(),
              LayerSpec::full_attention(1, 8, 8)};
  return c;
}

class HybridTableTest : public ::testing::Test {
 protected:
  std::unique_ptr<Backend> backend = host_backend();
  Stream stream = backend->create_stream();
  std::vector<std::size_t> counts{16, 16, 16};
  HybridKvCache cache{hybrid_config(), counts, *backend};

  void expect_ok() {
    const InvariantReport r = cache.check_invariants();
    EXPECT_TRUE(r.ok) << r.to_string();
  }
  static std::size_t nulls(std::span<const BlockId> blocks) {
    return static_cast<std::size_t>(std::count(blocks.begin(), blocks.end(), kNullBlock));
  }
};

TEST_F(HybridTableTest, GroupsAndLocations) {
  ASSERT_EQ(cache.num_groups(), 3u);
  EXPECT_EQ(cache.group(0).spec.kind, LayerKind::sliding_window);
  EXPECT_EQ(cache.group(1).spec.kind, LayerKind::full_attention);
  EXPECT_EQ(cache.group(2).spec.kind, LayerKind::chunked_local);
  EXPECT_EQ(cache.locate(3)->group, 0u);
  EXPECT_EQ(cache.locate(3)->index, 1u);
  EXPECT_EQ(cache.locate(5)->group, 1u);
  EXPECT_FALSE(cache.locate(4).has_value());
  EXPECT_THROW((void)cache.locate(6), InvalidArgument);
  EXPECT_THROW((void)cache.group(3), InvalidArgument);
  EXPECT_EQ(cache.group_cache(0).num_layers(), 2u);
  EXPECT_EQ(cache.group_cache(2).num_layers(), 1u);
  EXPECT_EQ(cache.total_bytes(), cache.group_cache(0).total_bytes() +
                                     cache.group_cache(1).total_bytes() +
                                     cache.group_cache(2).total_bytes());
  expect_ok();
}

TEST_F(HybridTableTest, ConstructorErrors) {
  const std::vector<std::size_t> two{4, 4};
  EXPECT_THAT(
      [&] {
        try {
          HybridKvCache c(hybrid_config(), two, *backend);
        } catch (const InvalidArgument& e) {
          throw std::runtime_error(e.what());
        }
      },
      ::testing::ThrowsMessage<std::runtime_error>(HasSubstr("2 block counts for 3")));
  const std::vector<std::size_t> zero{4, 0, 4};
  EXPECT_THROW(HybridKvCache(hybrid_config(), zero, *backend), InvalidArgument);
}

TEST_F(HybridTableTest, WindowAndChunkedBlocksAreReleasedAsTheSequenceGrows) {
  HybridBlockTable t(cache);
  for (std::size_t n = 0; n < 40; ++n) {
    const std::vector<TokenId> one{static_cast<TokenId>(n + 1)};
    t.append_tokens(one, stream);
    const std::size_t held = n + 1;
    // Full attention keeps everything.
    EXPECT_EQ(t.num_live_blocks(1), div_ceil(held, kBs));
    // Window 8: blocks wholly before token n - 8 + 1 (n tokens before this
    // append) are null.
    const std::size_t first_w = n + 1 > 8 ? (n + 1 - 8) / kBs : 0;
    EXPECT_EQ(nulls(t.blocks(0)), first_w) << "n=" << n;
    EXPECT_EQ(t.blocks(0).size(), div_ceil(held, kBs));
    // Chunked 8: blocks before the chunk of token n.
    EXPECT_EQ(nulls(t.blocks(2)), n / 8 * 2) << "n=" << n;
    EXPECT_LE(t.num_live_blocks(0), peak_blocks_per_request(cache.group(0).spec, kBs, 1000, 1));
    EXPECT_LE(t.num_live_blocks(2), peak_blocks_per_request(cache.group(2).spec, kBs, 1000, 1));
  }
  // Released full blocks stay cached (evictable) in their group.
  EXPECT_GT(cache.prefix_cache(0).num_evictable_blocks(), 0u);
  EXPECT_EQ(cache.prefix_cache(0).num_cached_blocks(), 10u);  // every full block of 40 tokens
  expect_ok();
  t.release();
  EXPECT_EQ(cache.blocks_in_use(0) + cache.blocks_in_use(1) + cache.blocks_in_use(2), 0u);
  expect_ok();
}

TEST_F(HybridTableTest, HitNeedsEveryGroupsRule) {
  const std::vector<TokenId> prompt = tokens(33);
  {
    HybridBlockTable a(cache);
    a.append_tokens(prompt, stream);
  }
  expect_ok();
  HybridBlockTable b(cache);
  // compute_last_token: at most 32 tokens of 33, all 8 blocks valid.
  EXPECT_EQ(b.reuse_cached_prefix(prompt, stream), 32u);
  // Window: the next token is 32, it needs tokens 25..31 (blocks 6, 7).
  EXPECT_EQ(nulls(b.blocks(0)), 6u);
  // Chunked: token 32 starts a chunk: no block needed.
  EXPECT_EQ(nulls(b.blocks(2)), 8u);
  EXPECT_EQ(nulls(b.blocks(1)), 0u);
  EXPECT_EQ(cache.hit_counters().hit_tokens, 32u);
  b.append_tokens(tokens(1, 33), stream);
  expect_ok();
}

TEST_F(HybridTableTest, AnEvictedWindowBlockShortensTheHit) {
  const std::vector<TokenId> prompt = tokens(33);
  {
    HybridBlockTable a(cache);
    a.append_tokens(prompt, stream);
  }
  // Drop the window group's block 7 (the last one of the prompt): a hit of 8
  // blocks needs it; 7 blocks need blocks 5 and 6, still cached.
  PrefixCache& w = cache.prefix_cache(0);
  const std::vector<BlockHash> h = hash_full_blocks(prompt, kBs);
  const std::optional<BlockId> b7 = w.find(h[7]);
  ASSERT_TRUE(b7.has_value());
  // Evict everything evictable, then check which hashes survive.
  while (w.find(h[7])) {
    ASSERT_EQ(w.evict(1), 1u);
  }
  // The table was released last block first, so block 7 was the least
  // recently used and the only one evicted. A hit of 7 blocks (28 tokens)
  // needs the window's blocks 5 and 6 and the chunk's block 6.
  HybridBlockTable b(cache);
  const std::size_t hit = b.reuse_cached_prefix(prompt, stream);
  EXPECT_EQ(hit, 28u);
  // The hit is valid: its window blocks are live.
  for (std::size_t i = first_needed_block(hit_rule_of(cache.group(0).spec), kBs, hit);
       i < hit / kBs; ++i) {
    EXPECT_NE(b.blocks(0)[i], kNullBlock);
  }
  expect_ok();
}

TEST_F(HybridTableTest, AppendIsAllOrNothingAcrossGroups) {
  // A cache whose window group is small: 3 blocks.
  const std::vector<std::size_t> small{3, 16, 16};
  HybridKvCache c(hybrid_config(), small, *backend);
  HybridBlockTable t(c);
  t.append_tokens(tokens(12), stream);  // window holds 3 blocks
  const auto before_tokens = std::vector<TokenId>(t.tokens().begin(), t.tokens().end());
  const auto before_full = std::vector<BlockId>(t.blocks(1).begin(), t.blocks(1).end());
  const auto before_window = std::vector<BlockId>(t.blocks(0).begin(), t.blocks(0).end());
  // 9 more tokens: the window releases block 0 first (token 12 - 7 = 5 is
  // past it) and needs 3 new blocks: 1 comes back, 0 are free.
  EXPECT_FALSE(t.can_append(9));
  const auto need = t.blocks_needed(9);
  EXPECT_EQ(need[0].fresh, 3u);
  EXPECT_EQ(need[0].released, 1u);
  try {
    t.append_tokens(tokens(9, 100), stream);
    FAIL() << "expected CacheExhausted";
  } catch (const CacheExhausted& e) {
    EXPECT_THAT(e.what(), HasSubstr("group 0 (sliding_window(8)"));
  }
  EXPECT_EQ(std::vector<TokenId>(t.tokens().begin(), t.tokens().end()), before_tokens);
  EXPECT_EQ(std::vector<BlockId>(t.blocks(1).begin(), t.blocks(1).end()), before_full);
  EXPECT_EQ(std::vector<BlockId>(t.blocks(0).begin(), t.blocks(0).end()), before_window);
  EXPECT_TRUE(c.check_invariants().ok);
  // One token fits: it needs one block, and block 0 comes back.
  EXPECT_TRUE(t.can_append(1));
  t.append_tokens(tokens(1, 100), stream);
  EXPECT_EQ(t.blocks(0)[0], kNullBlock);
  EXPECT_TRUE(c.check_invariants().ok);
}

TEST_F(HybridTableTest, ForkSharesLiveBlocksAndCopiesOnWrite) {
  HybridBlockTable parent(cache);
  parent.append_tokens(tokens(14), stream);
  HybridBlockTable child = parent.fork(stream);
  for (std::size_t g = 0; g < 3; ++g) {
    ASSERT_EQ(child.blocks(g).size(), parent.blocks(g).size());
    for (std::size_t i = 0; i < parent.blocks(g).size(); ++i) {
      EXPECT_EQ(child.blocks(g)[i], parent.blocks(g)[i]);
      if (parent.blocks(g)[i] != kNullBlock) {
        EXPECT_GE(cache.group_cache(g).ref_count(parent.blocks(g)[i]), 2u);
      }
    }
  }
  // The last block (2 of 4 tokens) is shared: the child's append copies it
  // in every group.
  child.append_tokens(tokens(1, 500), stream);
  EXPECT_EQ(child.copy_on_writes(), 3u);
  for (std::size_t g = 0; g < 3; ++g)
    EXPECT_NE(child.blocks(g).back(), parent.blocks(g).back());
  expect_ok();
  HybridBlockTable moved = std::move(child);
  EXPECT_TRUE(child.empty());  // NOLINT(bugprone-use-after-move): documented state
  EXPECT_EQ(moved.num_tokens(), 15u);
  moved.release();
  parent.release();
  expect_ok();
}

TEST_F(HybridTableTest, ReuseOnANonEmptyTableThrows) {
  HybridBlockTable t(cache);
  t.append_tokens(tokens(5), stream);
  EXPECT_THROW((void)t.reuse_cached_prefix(tokens(5), stream), InvalidArgument);
  EXPECT_THROW((void)t.blocks(3), InvalidArgument);
}

TEST_F(HybridTableTest, FullModeHitsTheWholePromptAndExtraKeySeparates) {
  const std::vector<TokenId> prompt = tokens(16);
  {
    HybridBlockTable a(cache, /*extra_key=*/7);
    a.append_tokens(prompt, stream);
  }
  HybridBlockTable other_key(cache, 8);
  EXPECT_EQ(other_key.reuse_cached_prefix(prompt, stream), 0u);
  HybridBlockTable last(cache, 7);
  EXPECT_EQ(last.reuse_cached_prefix(prompt, stream), 12u);  // leaves the last token to compute
  HybridBlockTable full(cache, 7);
  full.set_prefix_hit_mode(PrefixHitMode::full);
  EXPECT_EQ(full.reuse_cached_prefix(prompt, stream), 16u);
  expect_ok();
}

// BlockTable's compute-last-token rule as the table's option: a block-aligned
// prompt whose blocks are all cached hits n - 1 tokens; every group's last
// block is a private copy of the cached one, which stays cached, untouched.
TEST_F(HybridTableTest, CopyLastBlockHitsAllButTheLastTokenInEveryGroup) {
  const std::vector<TokenId> prompt = tokens(16);
  const std::vector<BlockHash> h = hash_full_blocks(prompt, kBs);
  {
    HybridBlockTable a(cache);
    a.append_tokens(prompt, stream);
    for (std::size_t g = 0; g < 3; ++g) {
      for (std::size_t i = 0; i < 4; ++i) {
        const BlockId b = a.blocks(g)[i];
        if (b != kNullBlock) test::write_pattern_block(cache.group_cache(g), b, 10 * g + i, stream);
      }
    }
  }
  HybridBlockTable b(cache);
  EXPECT_FALSE(b.copies_last_block());
  b.set_copy_last_block(true);
  EXPECT_TRUE(b.copies_last_block());
  const std::uint64_t hits_before = cache.hit_counters().hit_tokens;
  EXPECT_EQ(b.reuse_cached_prefix(prompt, stream), 15u);
  EXPECT_EQ(b.num_tokens(), 15u);
  EXPECT_EQ(cache.hit_counters().hit_tokens - hits_before, 15u);
  EXPECT_EQ(b.copy_on_writes(), 3u);  // one copy per group
  // Next token 15: the window (8) needs tokens 8..14, the chunk 8..15: blocks
  // 2 and 3; full attention all four.
  EXPECT_EQ(nulls(b.blocks(0)), 2u);
  EXPECT_EQ(nulls(b.blocks(1)), 0u);
  EXPECT_EQ(nulls(b.blocks(2)), 2u);
  for (std::size_t g = 0; g < 3; ++g) {
    SCOPED_TRACE(g);
    PrefixCache& prefix = cache.prefix_cache(g);
    const std::span<const BlockId> blocks = b.blocks(g);
    ASSERT_EQ(blocks.size(), 4u);
    const std::optional<BlockId> cached_last = prefix.find(h[3]);
    ASSERT_TRUE(cached_last.has_value()) << "the cached last block stays cached";
    EXPECT_NE(blocks[3], *cached_last);
    EXPECT_EQ(cache.group_cache(g).ref_count(*cached_last), 1u) << "only the cache holds it";
    EXPECT_TRUE(test::holds_pattern_block(cache.group_cache(g), blocks[3], 10 * g + 3, stream));
    EXPECT_TRUE(test::holds_pattern_block(cache.group_cache(g), *cached_last, 10 * g + 3, stream));
    for (std::size_t i = 0; i < 3; ++i) {
      if (blocks[i] != kNullBlock) {
        EXPECT_EQ(blocks[i], prefix.find(h[i]));
      }
    }
  }
  expect_ok();
  // The engine computes the last token into the copies; the table goes on.
  b.append_tokens(std::span<const TokenId>(prompt).subspan(15), stream);
  EXPECT_EQ(b.num_tokens(), 16u);
  b.append_tokens(tokens(1, 100), stream);
  expect_ok();
}

TEST_F(HybridTableTest, CopyLastBlockFallsBackWhereItCannotCopy) {
  const std::vector<TokenId> prompt = tokens(16);
  {
    HybridBlockTable a(cache);
    a.append_tokens(prompt, stream);
  }
  // Not aligned, full mode, or the option off: the rules as before.
  HybridBlockTable odd(cache);
  odd.set_copy_last_block(true);
  EXPECT_EQ(odd.reuse_cached_prefix(std::span<const TokenId>(prompt).first(15), stream), 12u);
  EXPECT_EQ(odd.copy_on_writes(), 0u);
  HybridBlockTable full(cache);
  full.set_copy_last_block(true);
  full.set_prefix_hit_mode(PrefixHitMode::full);
  EXPECT_EQ(full.reuse_cached_prefix(prompt, stream), 16u);
  EXPECT_EQ(full.copy_on_writes(), 0u);
  // Fork and moves carry the option.
  HybridBlockTable forked = odd.fork(stream);
  EXPECT_TRUE(forked.copies_last_block());
  HybridBlockTable moved(std::move(forked));
  EXPECT_TRUE(moved.copies_last_block());
  expect_ok();
}

TEST(HybridCopyLastBlock, WithoutABlockForACopyTheHitIsTheDefaultRules) {
  // The full group's pool holds the prompt's 4 blocks and nothing else: no
  // block for its copy.
  auto backend = host_backend();
  const Stream stream = backend->create_stream();
  HybridKvCacheConfig c;
  c.block_size = kBs;
  c.layers = {LayerSpec::sliding_window(8, 1, 8, 8), LayerSpec::full_attention(1, 8, 8)};
  const std::vector<std::size_t> counts{8, 4};
  HybridKvCache cache(c, counts, *backend);
  const std::vector<TokenId> prompt = tokens(16);
  {
    HybridBlockTable a(cache);
    a.append_tokens(prompt, stream);
  }
  HybridBlockTable b(cache);
  b.set_copy_last_block(true);
  EXPECT_EQ(b.reuse_cached_prefix(prompt, stream), 12u);
  EXPECT_EQ(b.copy_on_writes(), 0u);
  const InvariantReport r = cache.check_invariants();
  EXPECT_TRUE(r.ok) << r.to_string();
}

// One sequence of a gpt-oss-like model decoded to 32k tokens holds the bytes
// the planner says: the window group stays at its peak.
TEST(HybridLongContext, WindowGroupStaysAtItsPeak) {
  auto backend = host_backend();
  Stream stream = backend->create_stream();
  HybridKvCacheConfig c;
  c.block_size = 16;
  c.layers = {LayerSpec::sliding_window(128, 1, 8, 8), LayerSpec::full_attention(1, 8, 8)};
  const std::vector<std::size_t> counts{64, 2100};
  HybridKvCache cache(c, counts, *backend);
  HybridBlockTable t(cache);
  std::vector<TokenId> one(1);
  std::size_t peak_window = 0;
  for (std::size_t n = 0; n < 32768; ++n) {
    one[0] = static_cast<TokenId>(n % 50000);
    t.append_tokens(one, stream);
    peak_window = std::max(peak_window, t.num_live_blocks(0));
  }
  EXPECT_EQ(t.num_live_blocks(1), 2048u);
  EXPECT_EQ(peak_window, peak_blocks_per_request(cache.group(0).spec, 16, 32768, 1));
  EXPECT_TRUE(cache.check_invariants().ok);
}

}  // namespace
}  // namespace kvport

namespace kvport {
namespace {

// A Mamba-hybrid: group 0 full attention (1 layer), group 1 state (2 layers,
// a 32-byte state each), group 2 MLA (1 layer, no V). Checkpoints every block.
class HybridStateTest : public ::testing::Test {
 protected:
  static HybridKvCacheConfig config(std::size_t interval) {
    HybridKvCacheConfig c;
    c.block_size = kBs;
    c.state_checkpoint_interval = interval;
    const LayerSpec state = LayerSpec::recurrent_state(
        {StateTensor{"ssm", {2, 2}, StateDtype::f32}, StateTensor{"conv", {3}, StateDtype::f16}});
    c.layers = {LayerSpec::full_attention(1, 8, 8), state, state, LayerSpec::mla(8, 4)};
    return c;
  }
  std::unique_ptr<Backend> backend = host_backend();
  Stream stream = backend->create_stream();
  std::vector<std::size_t> counts{16, 8, 16};
  HybridKvCache cache{config(1), counts, *backend};

  PagedKvCache& state_pool() { return cache.group_cache(1); }
  // Writes `seed` into every byte of the working state of `t` (both layers).
  void write_state(const HybridBlockTable& t, std::uint8_t seed) {
    const BlockId slot = *t.state_slot(1);
    for (std::size_t layer = 0; layer < 2; ++layer) {
      const std::vector<std::uint8_t> bytes(state_pool().k_block_bytes(layer), seed);
      state_pool().write_block(layer, slot, bytes, {}, stream);
    }
  }
  std::vector<std::uint8_t> read_state(BlockId slot, std::size_t layer = 0) {
    return state_pool().read_block(layer, slot, stream).k;
  }
  void expect_ok() {
    const InvariantReport r = cache.check_invariants();
    EXPECT_TRUE(r.ok) << r.to_string();
  }
};

TEST_F(HybridStateTest, PoolsHoldTheSpecsBytes) {
  ASSERT_EQ(cache.num_groups(), 3u);
  EXPECT_EQ(cache.group(1).spec.kind, LayerKind::state);
  EXPECT_EQ(state_pool().config().block_size, 1u);
  EXPECT_EQ(state_pool().k_block_bytes(0), 32u);  // 16 B ssm + 6 B conv padded to 16
  EXPECT_FALSE(state_pool().config().has_v());
  EXPECT_EQ(cache.group_cache(2).k_block_bytes(0), kBs * 12 * 2);  // MLA: 12 bf16 a token
  EXPECT_FALSE(cache.group_cache(2).config().has_v());
  EXPECT_EQ(cache.locate(2)->group, 1u);
  EXPECT_EQ(cache.locate(2)->index, 1u);
}

TEST_F(HybridStateTest, ANewSequenceGetsAZeroedStateSlot) {
  HybridBlockTable t(cache);
  EXPECT_FALSE(t.state_slot(1).has_value());
  EXPECT_TRUE(t.blocks(1).empty());
  t.append_tokens(tokens(3), stream);
  ASSERT_TRUE(t.state_slot(1).has_value());
  cache.synchronize();
  EXPECT_EQ(read_state(*t.state_slot(1)), std::vector<std::uint8_t>(32, 0));
  EXPECT_EQ(cache.blocks_in_use(1), 1u);
  expect_ok();
}

TEST_F(HybridStateTest, CheckpointsAreTakenAtBlockBoundariesAndHit) {
  const std::vector<TokenId> prompt = tokens(9);
  {
    HybridBlockTable a(cache);
    a.append_tokens(std::span<const TokenId>(prompt).subspan(0, 4), stream);  // 1 block
    write_state(a, 0x11);  // the engine computed tokens 0..3
    a.append_tokens(std::span<const TokenId>(prompt).subspan(4, 4), stream);  // checkpoint at 4
    write_state(a, 0x22);
    a.append_tokens(std::span<const TokenId>(prompt).subspan(8, 1), stream);  // checkpoint at 8
  }
  EXPECT_EQ(cache.hit_counters().state_checkpoints, 2u);
  EXPECT_EQ(cache.prefix_cache(1).num_cached_blocks(), 2u);
  expect_ok();
  HybridBlockTable b(cache);
  EXPECT_EQ(b.reuse_cached_prefix(prompt, stream), 8u);  // the checkpoint at exactly 8
  ASSERT_TRUE(b.state_slot(1).has_value());
  cache.synchronize();
  EXPECT_EQ(read_state(*b.state_slot(1), 0), std::vector<std::uint8_t>(32, 0x22));
  EXPECT_EQ(read_state(*b.state_slot(1), 1), std::vector<std::uint8_t>(32, 0x22));
  // The checkpoint itself stays cached for the next request.
  EXPECT_EQ(cache.prefix_cache(1).num_cached_blocks(), 2u);
  expect_ok();
}

TEST_F(HybridStateTest, WithoutACheckpointAtTheHitPointTheHitStopsEarlier) {
  HybridKvCache sparse(config(2), counts, *backend);  // a checkpoint every 2 blocks
  const std::vector<TokenId> prompt = tokens(13);
  {
    HybridBlockTable a(sparse);
    for (std::size_t at = 0; at < 12; at += 4)
      a.append_tokens(std::span<const TokenId>(prompt).subspan(at, 4), stream);
    a.append_tokens(std::span<const TokenId>(prompt).subspan(12, 1), stream);
  }
  // Checkpoints at 8 only (4 and 12 are not multiples of 2 blocks); full
  // attention holds 3 blocks.
  EXPECT_EQ(sparse.hit_counters().state_checkpoints, 1u);
  HybridBlockTable b(sparse);
  EXPECT_EQ(b.reuse_cached_prefix(prompt, stream), 8u);
  EXPECT_EQ(b.blocks(0).size(), 2u);
  EXPECT_TRUE(sparse.check_invariants().ok);
  // No checkpoints at all: no hit in a model with state.
  HybridKvCache none(config(0), counts, *backend);
  {
    HybridBlockTable a(none);
    a.append_tokens(prompt, stream);
    a.append_tokens(tokens(1, 100), stream);
  }
  HybridBlockTable c(none);
  EXPECT_EQ(c.reuse_cached_prefix(prompt, stream), 0u);
  EXPECT_EQ(none.hit_counters().state_checkpoints, 0u);
}

TEST_F(HybridStateTest, CopyLastBlockDoesNotApplyWithAStateGroup) {
  // A state exists at block boundaries only: the hit stays vLLM's n - bs.
  const std::vector<TokenId> prompt = tokens(8);
  {
    HybridBlockTable a(cache);  // checkpoints after tokens 4 and 8
    a.append_tokens(std::span<const TokenId>(prompt).first(4), stream);
    a.append_tokens(std::span<const TokenId>(prompt).subspan(4), stream);
  }
  HybridBlockTable b(cache);
  b.set_copy_last_block(true);
  EXPECT_EQ(b.reuse_cached_prefix(prompt, stream), 4u);
  EXPECT_EQ(b.copy_on_writes(), 0u);
  expect_ok();
}

TEST_F(HybridStateTest, ForkCopiesTheState) {
  HybridBlockTable parent(cache);
  parent.append_tokens(tokens(6), stream);
  write_state(parent, 0x5A);
  HybridBlockTable child = parent.fork(stream);
  ASSERT_TRUE(child.state_slot(1).has_value());
  EXPECT_NE(*child.state_slot(1), *parent.state_slot(1));
  cache.synchronize();
  EXPECT_EQ(read_state(*child.state_slot(1), 1), std::vector<std::uint8_t>(32, 0x5A));
  // MLA and full blocks are shared.
  EXPECT_EQ(child.blocks(2)[0], parent.blocks(2)[0]);
  EXPECT_EQ(cache.group_cache(2).ref_count(parent.blocks(2)[0]), 3u);  // 2 tables + the cache
  expect_ok();
}

TEST_F(HybridStateTest, ForkWithoutAFreeStateSlotThrowsAndChangesNothing) {
  const std::vector<std::size_t> one_slot{16, 1, 16};
  HybridKvCache tight(config(0), one_slot, *backend);
  HybridBlockTable parent(tight);
  parent.append_tokens(tokens(6), stream);
  EXPECT_THROW((void)parent.fork(stream), CacheExhausted);
  EXPECT_EQ(tight.group_cache(0).ref_count(parent.blocks(0)[0]), 2u);  // parent + cache
  EXPECT_TRUE(tight.check_invariants().ok);
  // A second sequence cannot get a state slot either: all or nothing.
  HybridBlockTable other(tight);
  EXPECT_FALSE(other.can_append(1));
  EXPECT_THROW(other.append_tokens(tokens(1), stream), CacheExhausted);
  EXPECT_EQ(tight.blocks_in_use(0), 2u);
  EXPECT_TRUE(tight.check_invariants().ok);
}

}  // namespace
}  // namespace kvport
