// SPDX-License-Identifier: Apache-2.0
// The seam between the prefix cache and its tier, turned downward: a lookup
// asks the tier for a run (find_run), allocates the device blocks itself,
// asks the tier to load them (load_run), registers what landed and tells the
// tier (finish_run). A scripted tier checks the protocol: the order of the
// calls, who holds each block after each outcome, and that the tier is never
// told about blocks it brought in.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "core_test_util.hpp"
#include "kvport/core/block_table.hpp"
#include "kvport/core/paged_kv_cache.hpp"
#include "kvport/core/prefix_cache.hpp"

namespace kvport {
namespace {

using test::host_backend;
using test::small_config;  // 3 layers, block_size 4
using test::tokens;
using ::testing::ElementsAre;

class ScriptedTier final : public PrefixCacheTier {
 public:
  enum class Outcome { land_all, land_one, stall, fail };

  std::vector<BlockHash> held;  // what a run may bring in, any order
  Outcome outcome = Outcome::land_all;
  std::vector<std::string> calls;
  std::size_t run_start = 0;
  std::vector<BlockId> given;  // load_run's blocks
  std::vector<BlockId> kept;   // the stalled ones, the tier's until the test releases them
  std::size_t announced = 0;   // on_insert calls

  void on_free_list_empty(PrefixCache& /*cache*/, const std::source_location& /*where*/) override {
    calls.emplace_back("free_list_empty");
  }
  std::size_t reclaimable_blocks() const noexcept override { return 0; }
  void on_insert(PrefixCache& /*cache*/, BlockId /*block*/, const BlockHash& /*hash*/) override {
    ++announced;
  }
  std::size_t find_run(std::span<const BlockHash> hashes, std::size_t start) noexcept override {
    calls.emplace_back("find_run");
    run_start = start;
    std::size_t n = 0;
    while (start + n < hashes.size() && holds(hashes[start + n]))
      ++n;
    return n;
  }
  TierLoad load_run(std::span<const BlockId> blocks) noexcept override {
    calls.emplace_back("load_run");
    given.assign(blocks.begin(), blocks.end());
    switch (outcome) {
      case Outcome::land_all:
        return TierLoad{blocks.size(), 0};
      case Outcome::land_one:
        return TierLoad{blocks.empty() ? 0u : 1u, 0};
      case Outcome::stall:
        kept.assign(blocks.begin(), blocks.end());
        return TierLoad{0, blocks.size()};
      case Outcome::fail:
        return TierLoad{};
    }
    return TierLoad{};
  }
  BlockOrigin run_origin(std::size_t /*i*/) const noexcept override { return BlockOrigin{}; }
  void finish_run() noexcept override { calls.emplace_back("finish_run"); }
  bool holds(const BlockHash& hash) const noexcept override {
    for (const BlockHash& h : held)
      if (h == hash) return true;
    return false;
  }
};

class TierSeamTest : public ::testing::Test {
 protected:
  std::unique_ptr<Backend> backend = host_backend();
  Stream stream = backend->create_stream();
  PagedKvCache cache{small_config(KvCacheLayout::layer_major), 6, *backend};
  PrefixCache pc{cache};
  ScriptedTier tier;
  const std::vector<TokenId> prompt = tokens(12, 40);  // 3 blocks
  const std::vector<BlockHash> hashes = hash_full_blocks(prompt, 4);

  void SetUp() override { pc.set_tier(&tier); }
  void TearDown() override {
    for (BlockId b : tier.kept)
      pc.release(b);
    pc.set_tier(nullptr);
    EXPECT_TRUE(pc.check_invariants().ok);
  }
};

TEST_F(TierSeamTest, ALookupContinuesIntoTheTierAndRegistersWhatLanded) {
  tier.held = {hashes[0], hashes[1], hashes[2]};
  PrefixMatch m = pc.lookup_hashes(hashes);
  EXPECT_THAT(tier.calls, ElementsAre("find_run", "load_run", "finish_run"));
  EXPECT_EQ(tier.run_start, 0u);
  ASSERT_EQ(m.blocks.size(), 3u);
  EXPECT_EQ(m.blocks, tier.given);  // the prefix cache allocated them
  EXPECT_EQ(m.lower_tier_blocks, 3u);
  EXPECT_EQ(m.num_tokens, 12u);
  for (std::size_t i = 0; i < 3; ++i)
    EXPECT_EQ(pc.find(hashes[i]), m.blocks[i]) << "block " << i;
  EXPECT_EQ(tier.announced, 0u);  // the tier is not told about its own blocks
  pc.release_blocks(m.blocks);
  EXPECT_EQ(pc.num_evictable_blocks(), 3u);
}

TEST_F(TierSeamTest, TheRunStartsWhereTheDeviceMatchEnds) {
  {
    BlockTable t(pc);
    t.append_tokens(std::span(prompt).first(4), stream);  // block 0 cached on the device
  }
  EXPECT_EQ(tier.announced, 1u);  // a block the table registered is announced
  tier.held = {hashes[1], hashes[2]};
  PrefixMatch m = pc.lookup_hashes(hashes);
  EXPECT_EQ(tier.run_start, 1u);
  ASSERT_EQ(m.blocks.size(), 3u);
  EXPECT_EQ(m.lower_tier_blocks, 2u);
  EXPECT_EQ(tier.announced, 1u);
  pc.release_blocks(m.blocks);
}

TEST_F(TierSeamTest, BlocksThatDidNotLandAreFreedByThePrefixCache) {
  tier.held = {hashes[0], hashes[1], hashes[2]};
  tier.outcome = ScriptedTier::Outcome::land_one;
  PrefixMatch m = pc.lookup_hashes(hashes);
  ASSERT_EQ(m.blocks.size(), 1u);
  EXPECT_EQ(m.blocks[0], tier.given[0]);
  EXPECT_EQ(cache.num_free_blocks(), 5u);  // the two that did not land are free again
  EXPECT_FALSE(pc.find(hashes[1]).has_value());
  pc.release_blocks(m.blocks);

  tier.calls.clear();
  tier.outcome = ScriptedTier::Outcome::fail;
  const std::size_t free_before = cache.num_free_blocks();
  PrefixMatch none = pc.lookup_hashes(std::span(hashes).subspan(1));  // not cached: the tier's run
  EXPECT_TRUE(none.blocks.empty());
  EXPECT_THAT(tier.calls, ElementsAre("find_run", "load_run"));  // no finish_run
  EXPECT_EQ(cache.num_free_blocks(), free_before);
}

TEST_F(TierSeamTest, StalledBlocksStayTheTiers) {
  tier.held = {hashes[0], hashes[1], hashes[2]};
  tier.outcome = ScriptedTier::Outcome::stall;
  PrefixMatch m = pc.lookup_hashes(hashes);
  EXPECT_TRUE(m.blocks.empty());
  ASSERT_EQ(tier.kept.size(), 3u);
  for (BlockId b : tier.kept)
    EXPECT_EQ(cache.ref_count(b), 1u) << "block " << b;  // the tier's reference
  EXPECT_EQ(cache.num_free_blocks(), 3u);
}

TEST_F(TierSeamTest, TheRunGetsTheBlocksTheDeviceCanGive) {
  std::vector<BlockId> taken;
  for (int i = 0; i < 5; ++i)
    taken.push_back(pc.alloc_block());  // one block left, nothing evictable
  tier.held = {hashes[0], hashes[1], hashes[2]};
  PrefixMatch m = pc.lookup_hashes(hashes);
  EXPECT_EQ(tier.given.size(), 1u);
  EXPECT_EQ(m.blocks.size(), 1u);
  EXPECT_THAT(tier.calls, ElementsAre("find_run", "free_list_empty", "load_run", "finish_run"));
  pc.release_blocks(m.blocks);
  for (BlockId b : taken)
    pc.release(b);
}

}  // namespace
}  // namespace kvport
