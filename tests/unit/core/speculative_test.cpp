// SPDX-License-Identifier: Apache-2.0
// Speculative decoding on HybridBlockTable: draft tokens get KV slots but are
// never hashed, registered or announced; commit registers what the verifier
// accepted; truncate drops the rest and frees only blocks the drafts alone
// used; the freeing rules see the committed length, so a rollback never
// needs a released block; a state group keeps a slot per draft and works on
// with the accepted one's. A seeded random walk over several tables checks
// that no lookup ever hits a rejected token.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <random>
#include <vector>

#include "core_test_util.hpp"
#include "kvport/core/cache_events.hpp"
#include "kvport/core/hybrid_block_table.hpp"
#include "kvport/core/hybrid_kv_cache.hpp"
#include "kvport/platform/div_ceil.hpp"

namespace kvport {
namespace {

using test::host_backend;
using test::tokens;
using ::testing::HasSubstr;

constexpr std::size_t kBs = 4;

// Group 0: window W = 8; group 1: full attention; group 2: chunked C = 8.
HybridKvCacheConfig three_kinds() {
  HybridKvCacheConfig c;
  c.block_size = kBs;
  c.layers = {LayerSpec::sliding_window(8, 1, 8, 8), LayerSpec::full_attention(1, 8, 8),
              LayerSpec::chunked_local(8, 1, 8, 8)};
  return c;
}

// Counts the blocks each event announces stored.
class StoredCounter final : public CacheEventSink {
 public:
  void stored(const EventSource& /*source*/, const BlockStoredView& v) noexcept override {
    stored_blocks += v.hashes.size();
  }
  void removed(const EventSource& /*source*/, std::span<const BlockHash> /*h*/) noexcept override {}
  void cleared(const EventSource& /*source*/) noexcept override {}
  std::size_t stored_blocks = 0;
};

class SpeculativeTest : public ::testing::Test {
 protected:
  std::unique_ptr<Backend> backend = host_backend();
  Stream stream = backend->create_stream();
  HybridKvCache cache{three_kinds(), std::vector<std::size_t>{32, 32, 32}, *backend};

  void expect_ok(const HybridBlockTable& t) {
    const InvariantReport r = t.check_invariants();
    EXPECT_TRUE(r.ok) << r.to_string();
    const InvariantReport c = cache.check_invariants();
    EXPECT_TRUE(c.ok) << c.to_string();
  }
  // What a new request for `prompt` hits now (its table released again).
  std::size_t hit_of(std::span<const TokenId> prompt) {
    HybridBlockTable probe(cache);
    return probe.reuse_cached_prefix(prompt, stream);
  }
  std::size_t in_use() const {
    std::size_t n = 0;
    for (std::size_t g = 0; g < cache.num_groups(); ++g)
      n += cache.blocks_in_use(g);
    return n;
  }
};

TEST_F(SpeculativeTest, DraftTokensAreNeverHitUntilCommitted) {
  StoredCounter sink;
  cache.set_event_sink(&sink);
  HybridBlockTable t(cache);
  const std::vector<TokenId> all = tokens(24, 100);
  t.append_tokens(std::span(all).first(8), stream);  // 2 committed blocks
  const std::size_t announced = sink.stored_blocks;
  t.append_draft(std::span(all).subspan(8, 12), stream);  // 3 more blocks of drafts
  EXPECT_EQ(t.num_tokens(), 20u);
  EXPECT_EQ(t.num_committed(), 8u);
  EXPECT_EQ(t.num_draft_tokens(), 12u);
  EXPECT_THAT(t.draft_tokens(), ::testing::ElementsAreArray(std::span(all).subspan(8, 12)));
  EXPECT_EQ(t.blocks(1).size(), 5u);         // the drafts have KV slots in every group
  EXPECT_EQ(sink.stored_blocks, announced);  // nothing announced for them
  expect_ok(t);
  // Another request with the same 20 tokens hits the committed blocks only.
  EXPECT_EQ(hit_of(std::span(all).first(20)), 8u);
  // The verifier accepts 5 of the 12: block 2 is full of committed tokens now.
  t.commit(5);
  EXPECT_EQ(t.num_committed(), 13u);
  EXPECT_EQ(t.num_draft_tokens(), 7u);
  EXPECT_EQ(sink.stored_blocks, announced + 3);  // block 2 in each of the three groups
  EXPECT_EQ(hit_of(std::span(all).first(20)), 12u);
  expect_ok(t);
  // The rest is rejected: blocks 4 (tokens 16..19) held drafts only and is freed.
  const std::size_t before = in_use();
  t.truncate(t.num_committed());
  EXPECT_EQ(t.num_tokens(), 13u);
  EXPECT_EQ(t.num_draft_tokens(), 0u);
  EXPECT_EQ(t.blocks(1).size(), 4u);
  EXPECT_EQ(in_use(), before - 3);
  expect_ok(t);
  // Decoding goes on with the bonus token, and a different continuation.
  const std::vector<TokenId> bonus{7777};
  t.append_tokens(bonus, stream);
  EXPECT_EQ(t.num_committed(), 14u);
  expect_ok(t);
  cache.set_event_sink(nullptr);
}

TEST_F(SpeculativeTest, ARejectedDraftIsOverwrittenNotHit) {
  HybridBlockTable t(cache);
  t.append_tokens(tokens(4, 1), stream);
  const std::vector<TokenId> draft = tokens(4, 500);
  t.append_draft(draft, stream);  // fills block 1 with drafts
  t.truncate(4);                  // all rejected
  const std::vector<TokenId> real = tokens(4, 900);
  t.append_tokens(real, stream);  // block 1 now full of committed tokens
  std::vector<TokenId> with_draft = tokens(4, 1);
  with_draft.insert(with_draft.end(), draft.begin(), draft.end());
  std::vector<TokenId> with_real = tokens(4, 1);
  with_real.insert(with_real.end(), real.begin(), real.end());
  // One more token each, so that the lookup may hit every full block.
  with_draft.push_back(1);
  with_real.push_back(1);
  EXPECT_EQ(hit_of(with_draft), 4u);  // the rejected tokens are not cached
  EXPECT_EQ(hit_of(with_real), 8u);
  expect_ok(t);
}

TEST_F(SpeculativeTest, FreeingRulesSeeTheCommittedLengthOnly) {
  HybridBlockTable t(cache);
  t.append_tokens(tokens(12, 1), stream);  // blocks 0..2
  // 16 drafts would slide the window (8) and the chunk (8) past blocks 1..3
  // if they were committed: nothing a rollback needs may be released.
  const std::vector<TokenId> more = tokens(4, 50);
  for (int i = 0; i < 4; ++i)
    t.append_draft(more, stream);
  EXPECT_EQ(t.num_tokens(), 28u);
  // Window at 12 committed tokens needs blocks from (12 - 8 + 1) / 4 = 1 on.
  EXPECT_NE(t.blocks(0)[1], kNullBlock);
  EXPECT_NE(t.blocks(0)[2], kNullBlock);
  // Chunk of token 12 starts at block 2; blocks before it were released
  // by the committed appends only.
  EXPECT_NE(t.blocks(2)[2], kNullBlock);
  t.truncate(12);
  EXPECT_EQ(t.blocks(0).size(), 3u);
  expect_ok(t);
  // Committed decode continues as if the drafts never happened.
  t.append_tokens(tokens(8, 70), stream);
  EXPECT_EQ(t.blocks(0)[0], kNullBlock);
  expect_ok(t);
}

TEST_F(SpeculativeTest, CanAppendCountsTheDraftsExactly) {
  HybridKvCache small(three_kinds(), std::vector<std::size_t>{6, 6, 6}, *backend);
  HybridBlockTable t(small);
  t.append_tokens(tokens(8, 1), stream);  // 2 blocks in each group
  // Every group has 4 more blocks (the window frees nothing for drafts: it
  // runs on the committed length): 16 more tokens fit, 17 do not.
  EXPECT_TRUE(t.can_append(16));
  EXPECT_FALSE(t.can_append(17));
  const std::vector<TokenId> drafts = tokens(17, 300);
  try {
    t.append_draft(drafts, stream);
    ADD_FAILURE() << "17 drafts fit 16 tokens of room";
  } catch (const CacheExhausted& e) {
    EXPECT_THAT(e.what(), HasSubstr("group 0"));
  }
  EXPECT_EQ(t.num_tokens(), 8u);  // all or nothing
  t.append_draft(std::span(drafts).first(16), stream);
  EXPECT_FALSE(t.can_append(1));
  t.truncate(8);
  EXPECT_TRUE(t.can_append(16));
  const InvariantReport r = t.check_invariants();
  EXPECT_TRUE(r.ok) << r.to_string();
}

TEST_F(SpeculativeTest, ErrorsNameTheLimit) {
  HybridBlockTable t(cache);
  t.append_tokens(tokens(6, 1), stream);
  t.append_draft(tokens(3, 40), stream);
  test::expect_invalid_argument([&] { t.commit(4); }, "holds 3 draft tokens");
  test::expect_invalid_argument([&] { t.truncate(5); }, "committed tokens, which are never taken");
  test::expect_invalid_argument([&] { t.truncate(10); }, "outside [6, 9]");
  test::expect_invalid_argument([&] { t.append_tokens(tokens(1, 9), stream); },
                                "commit or truncate them first");
  test::expect_invalid_argument([&] { (void)t.fork(stream); }, "commit or truncate them first");
  EXPECT_EQ(t.num_tokens(), 9u);
  t.commit(0);    // nothing
  t.truncate(9);  // keeps everything
  EXPECT_EQ(t.num_draft_tokens(), 3u);
  t.commit(3);
  EXPECT_EQ(t.num_committed(), 9u);
  HybridBlockTable child = t.fork(stream);
  EXPECT_EQ(child.num_tokens(), 9u);
  expect_ok(t);
  expect_ok(child);
}

// Writes `value` into every byte of state slot `slot` of group g (what the
// verifier writes), and reads a slot's first byte back.
void write_state(HybridKvCache& cache, std::size_t g, BlockId slot, std::uint8_t value,
                 StreamView stream) {
  PagedKvCache& pool = cache.group_cache(g);
  for (std::size_t layer = 0; layer < pool.num_layers(); ++layer) {
    pool.write_block(layer, slot, std::vector<std::uint8_t>(pool.k_block_bytes(layer), value),
                     std::vector<std::uint8_t>(pool.v_block_bytes(layer), value), stream);
  }
}
std::uint8_t read_state(HybridKvCache& cache, std::size_t g, BlockId slot, StreamView stream) {
  return cache.group_cache(g).read_block(0, slot, stream).k.at(0);
}

// A Mamba-like model: group 0 a recurrent state, group 1 full attention.
HybridKvCacheConfig state_model() {
  HybridKvCacheConfig c;
  c.block_size = kBs;
  c.state_checkpoint_interval = 1;
  c.layers = {LayerSpec::recurrent_state({StateTensor{"ssm", {2, 2}, StateDtype::f32}}),
              LayerSpec::full_attention(1, 8, 8)};
  return c;
}

TEST_F(SpeculativeTest, AStateGroupKeepsOneSlotPerDraftAndTheAcceptedOneWorks) {
  HybridKvCache with_state(state_model(), std::vector<std::size_t>{8, 16}, *backend);
  HybridBlockTable t(with_state);
  t.append_tokens(tokens(6, 1), stream);
  const BlockId working = *t.state_slot(0);
  EXPECT_TRUE(t.draft_state_slots(0).empty());
  EXPECT_TRUE(t.draft_state_slots(1).empty());  // not a state group
  EXPECT_THROW((void)t.draft_state_slots(2), OutOfRange);
  const std::size_t slots_before = with_state.blocks_in_use(0);
  // 4 drafts: positions 7..10. The verifier writes the state after each.
  t.append_draft(tokens(4, 100), stream);
  const std::vector<BlockId> drafts(t.draft_state_slots(0).begin(), t.draft_state_slots(0).end());
  ASSERT_EQ(drafts.size(), 4u);
  EXPECT_EQ(with_state.blocks_in_use(0), slots_before + 4);
  EXPECT_EQ(std::count(drafts.begin(), drafts.end(), working), 0);
  for (std::size_t i = 0; i < drafts.size(); ++i)
    write_state(with_state, 0, drafts[i], static_cast<std::uint8_t>(10 + i), stream);
  expect_ok(t);
  // 3 accepted: the state after token 9 (drafts[2]) works on; the one after
  // token 8 ends a block (interval 1) and is cached as its checkpoint; the
  // one after 7 and the old working slot are freed.
  const std::uint64_t checkpoints = with_state.hit_counters().state_checkpoints;
  t.commit(3);
  EXPECT_EQ(*t.state_slot(0), drafts[2]);
  EXPECT_EQ(t.draft_state_slots(0).size(), 1u);
  EXPECT_EQ(with_state.hit_counters().state_checkpoints, checkpoints + 1);
  EXPECT_TRUE(with_state.prefix_cache(0).is_cached(drafts[1]));
  t.truncate(9);
  EXPECT_TRUE(t.draft_state_slots(0).empty());
  expect_ok(t);
  // Only the working slot is in use: the checkpoint at 8 is cached, evictable.
  EXPECT_EQ(with_state.blocks_in_use(0), 1u);
  // A new request for the same 8 tokens hits them with the checkpoint's state.
  std::vector<TokenId> prompt = tokens(6, 1);
  for (TokenId x : tokens(2, 100))
    prompt.push_back(x);
  prompt.push_back(5);
  HybridBlockTable again(with_state);
  EXPECT_EQ(again.reuse_cached_prefix(prompt, stream), 8u);
  EXPECT_EQ(read_state(with_state, 0, *again.state_slot(0), stream), 11);  // drafts[1]'s bytes
  expect_ok(again);
  const InvariantReport r = with_state.check_invariants();
  EXPECT_TRUE(r.ok) << r.to_string();
}

TEST_F(SpeculativeTest, DraftStateSlotsAreCountedAndGivenBack) {
  HybridKvCache with_state(state_model(), std::vector<std::size_t>{4, 16}, *backend);
  HybridBlockTable t(with_state);
  t.append_tokens(tokens(2, 1), stream);  // the working slot; no checkpoint yet
  EXPECT_EQ(with_state.blocks_in_use(0), 1u);
  EXPECT_TRUE(t.can_append_draft(3));
  EXPECT_FALSE(t.can_append_draft(4));  // 4 slots in all
  EXPECT_TRUE(t.can_append(4));         // committed tokens take no extra slot
  try {
    t.append_draft(tokens(4, 50), stream);
    ADD_FAILURE() << "4 drafts got 3 free state slots";
  } catch (const CacheExhausted& e) {
    EXPECT_THAT(e.what(), HasSubstr("group 0"));
  }
  EXPECT_EQ(t.num_tokens(), 2u);
  t.append_draft(tokens(3, 50), stream);
  EXPECT_EQ(with_state.blocks_in_use(0), 4u);
  t.truncate(2);  // all rejected
  EXPECT_EQ(with_state.blocks_in_use(0), 1u);
  t.append_draft(tokens(2, 60), stream);
  t.release();
  EXPECT_EQ(with_state.blocks_in_use(0), 0u);
  const InvariantReport r = with_state.check_invariants();
  EXPECT_TRUE(r.ok) << r.to_string();
}

TEST_F(SpeculativeTest, ReleaseAndMoveCarryTheDrafts) {
  HybridBlockTable t(cache);
  t.append_tokens(tokens(5, 1), stream);
  t.append_draft(tokens(6, 60), stream);
  HybridBlockTable moved(std::move(t));
  EXPECT_EQ(moved.num_draft_tokens(), 6u);
  EXPECT_EQ(t.num_tokens(), 0u);  // NOLINT(bugprone-use-after-move): moved-from is empty
  moved.release();
  EXPECT_EQ(moved.num_tokens(), 0u);
  EXPECT_EQ(in_use(), 0u);
}

// Several tables decode with random drafts, accepts and rejects (each
// table's drafts differ from what it then commits). After every step no
// table breaks an invariant, and a lookup of any table's committed tokens
// followed by its rejected drafts never hits past the committed full blocks
// that some table holds.
TEST_F(SpeculativeTest, RandomSpeculationNeverHitsARejectedToken) {
  HybridKvCache big(three_kinds(), std::vector<std::size_t>{256, 256, 256}, *backend);
  std::mt19937 rng(20261207);
  constexpr int kTables = 4;
  std::vector<HybridBlockTable> tables;
  std::vector<std::vector<TokenId>> rejected(kTables);
  // Every request starts with a shared prefix, then a token of its own: each
  // block after the prefix is the request's alone (chained hashes), so a
  // lookup can hit there only what this request committed.
  const std::vector<TokenId> shared = tokens(8, 1);
  TokenId next_request = 50000;
  auto start = [&](HybridBlockTable& t) {
    t.release();
    (void)t.reuse_cached_prefix(shared, stream);
    t.append_tokens(std::span(shared).subspan(t.num_tokens()), stream);
    const TokenId own = next_request++;
    t.append_tokens(std::span(&own, 1), stream);
  };
  for (int i = 0; i < kTables; ++i) {
    tables.emplace_back(big);
    start(tables.back());
  }
  std::size_t steps = 0;
  std::size_t accepted_total = 0;
  std::size_t rejected_total = 0;
  for (int step = 0; step < 300; ++step) {
    const int i = static_cast<int>(rng() % kTables);
    HybridBlockTable& t = tables[i];
    if (t.num_tokens() > 150) start(t);  // a new request
    const std::size_t k = 1 + rng() % 5;
    std::vector<TokenId> drafts(k);
    for (TokenId& d : drafts)
      d = static_cast<TokenId>(100000 + rng() % 50);
    t.append_draft(drafts, stream);
    const std::size_t accepted = rng() % (k + 1);
    t.commit(accepted);
    rejected[i].assign(drafts.begin() + static_cast<std::ptrdiff_t>(accepted), drafts.end());
    t.truncate(t.num_committed());
    accepted_total += accepted;
    rejected_total += k - accepted;
    // The verifier's own token, different from the first rejected draft.
    const TokenId bonus = rejected[i].empty() ? 7 : static_cast<TokenId>(rejected[i][0] + 1000);
    t.append_tokens(std::span(&bonus, 1), stream);
    ++steps;
    for (const HybridBlockTable& x : tables) {
      const InvariantReport r = x.check_invariants();
      ASSERT_TRUE(r.ok) << r.to_string();
    }
    // The committed tokens before the bonus, then the rejected drafts: a hit
    // stops before the first rejected token's block.
    std::vector<TokenId> probe(t.tokens().begin(), t.tokens().end() - 1);
    const std::size_t committed_before = probe.size();
    probe.insert(probe.end(), rejected[i].begin(), rejected[i].end());
    HybridBlockTable p(big);
    const std::size_t hit = p.reuse_cached_prefix(probe, stream);
    ASSERT_LE(hit, committed_before / kBs * kBs) << "step " << step;
  }
  EXPECT_EQ(steps, 300u);
  EXPECT_GT(accepted_total, 0u);
  EXPECT_GT(rejected_total, 0u);
  const InvariantReport r = big.check_invariants();
  EXPECT_TRUE(r.ok) << r.to_string();
}

}  // namespace
}  // namespace kvport
