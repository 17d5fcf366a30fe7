// SPDX-License-Identifier: Apache-2.0
// The disaggregation protocol in one process: a prefill node leases blocks,
// decode nodes pull, confirm and cache them; and the failure rules: expired
// leases, aborts on either side followed by reuse, late notifications, lost
// peers, no room. Every wait is bounded.
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <cstdlib>

#include "agent_pair.hpp"
#include "kvport/core/prefix_cache.hpp"
#include "kvport/transfer/disagg.hpp"
#include "kvport/transfer/kv_content.hpp"

namespace kvport::transfer {
namespace {

using ::testing::HasSubstr;

// A side with a prefix cache.
struct Node {
  Side side;
  PrefixCache prefix;
  Node(const KvCacheConfig& c, std::size_t blocks, AgentOptions o)
      : side(c, blocks, std::move(o)), prefix(side.cache) {}
  // Allocates and fills blocks for `t` the way a prefill rank does.
  std::vector<BlockId> prefill(const std::vector<TokenId>& t) {
    std::vector<BlockId> blocks;
    for (std::size_t i = 0; i < (t.size() + 15) / 16; ++i)
      blocks.push_back(prefix.alloc_block());
    write_kv_content(side.cache, side.layout(), blocks, t, side.stream);
    side.agent->publish(blocks);
    return blocks;
  }
};

struct Pair {
  Node prefill;
  Node decode;
  PeerId to_decode = 0;
  PeerId to_prefill = 0;
  explicit Pair(std::size_t decode_blocks = 16, KvCacheLayout layout = KvCacheLayout::layer_major)
      : prefill(config(layout), 16, named("prefill")),
        decode(config(layout), decode_blocks, named("decode")) {
    const std::string address = decode.side.agent->listen("127.0.0.1:0");
    to_decode = prefill.side.agent->connect(address, 5s);
    eventually([&] { return !decode.side.agent->peers().empty(); });
    to_prefill = decode.side.agent->peers().at(0);
  }
};

TEST(Disagg, DecodePullsVerifiesAndCaches) {
  for (auto layout : {KvCacheLayout::layer_major, KvCacheLayout::block_major}) {
    Pair p(16, layout);
    PrefillNode prefill(*p.prefill.side.agent, p.prefill.prefix);
    DecodeNode decode(*p.decode.side.agent, p.decode.prefix);
    auto t = tokens(3 * 16 + 4, 11);
    auto blocks = p.prefill.prefill(t);
    prefill.offer(42, 0, blocks, t, std::vector<PeerId>{p.to_decode});
    EXPECT_EQ(prefill.held_blocks(), 4u);
    std::vector<DecodeResult> results;
    std::vector<LeaseResult> leases;
    ASSERT_TRUE(eventually([&] {
      for (auto& r : decode.poll())
        results.push_back(std::move(r));
      for (auto& l : prefill.poll())
        leases.push_back(l);
      return !results.empty() && !leases.empty();
    }));
    ASSERT_EQ(results.size(), 1u);
    const DecodeResult& r = results[0];
    EXPECT_TRUE(r.ok) << r.why;
    EXPECT_EQ(r.request_id, 42u);
    EXPECT_EQ(r.tokens, t);
    ASSERT_EQ(r.blocks.size(), 4u);
    EXPECT_GT(r.bytes, 0u);
    EXPECT_TRUE(verify_kv_content(p.decode.side.cache, p.decode.side.layout(), r.blocks, t,
                                  p.decode.side.stream)
                    .ok());
    EXPECT_EQ(decode.counters().blocks_registered, 3u);  // full blocks only
    EXPECT_EQ(p.decode.prefix.lookup(t).blocks.size(), 3u);
    ASSERT_EQ(leases.size(), 1u);
    EXPECT_EQ(leases[0].end, LeaseEnd::pulled);
    EXPECT_EQ(prefill.held_blocks(), 0u);
    EXPECT_EQ(decode.held_blocks(), 0u);
    p.decode.prefix.release_blocks(r.blocks);
    EXPECT_TRUE(p.prefill.prefix.check_invariants().ok);
  }
}

TEST(Disagg, LeaseExpiresWhenNobodyPulls) {
  Pair p;
  PrefillOptions o;
  o.lease_ttl = 100ms;
  PrefillNode prefill(*p.prefill.side.agent, p.prefill.prefix, o);
  auto t = tokens(32);
  prefill.offer(1, 0, p.prefill.prefill(t), t, std::vector<PeerId>{p.to_decode});
  const std::size_t free_before = p.prefill.side.cache.num_free_blocks();
  std::vector<LeaseResult> leases;
  ASSERT_TRUE(eventually([&] {
    for (auto& l : prefill.poll())
      leases.push_back(l);
    return !leases.empty();
  }));
  EXPECT_EQ(leases[0].end, LeaseEnd::expired);
  EXPECT_EQ(prefill.counters().leases_expired, 1u);
  EXPECT_EQ(prefill.held_blocks(), 0u);
  EXPECT_EQ(p.prefill.side.cache.num_free_blocks(), free_before + 2);
  // The decode side learns the lease is void when it finally pulls.
  DecodeNode decode(*p.decode.side.agent, p.decode.prefix);
  std::vector<DecodeResult> results;
  ASSERT_TRUE(eventually([&] {
    for (auto& r : decode.poll())
      results.push_back(std::move(r));
    prefill.poll();
    return !results.empty();
  }));
  EXPECT_FALSE(results[0].ok);
  EXPECT_THAT(results[0].why, HasSubstr("revoked"));
  EXPECT_EQ(decode.held_blocks(), 0u);
  EXPECT_EQ(p.decode.side.cache.num_blocks_in_use(), 0u);
  EXPECT_EQ(decode.counters().revoked, 1u);  // told at expiry, before it pulled
}

TEST(Disagg, PrefillAbortThenReuseNeverCorruptsEitherSide) {
  Pair p;
  PrefillNode prefill(*p.prefill.side.agent, p.prefill.prefix);
  DecodeNode decode(*p.decode.side.agent, p.decode.prefix);
  auto t = tokens(32, 1);
  auto blocks = p.prefill.prefill(t);
  prefill.offer(7, 0, blocks, t, std::vector<PeerId>{p.to_decode});
  ASSERT_TRUE(prefill.abort(7));
  EXPECT_FALSE(prefill.abort(7));
  EXPECT_EQ(prefill.held_blocks(), 0u);
  // The new owner gets the same blocks (LIFO) and writes its own KV.
  auto other = tokens(32, 2);
  auto reused = p.prefill.prefill(other);
  EXPECT_EQ(std::set<BlockId>(reused.begin(), reused.end()),
            std::set<BlockId>(blocks.begin(), blocks.end()));
  std::vector<DecodeResult> results;
  ASSERT_TRUE(eventually([&] {
    for (auto& r : decode.poll())
      results.push_back(std::move(r));
    prefill.poll();
    return !results.empty();
  }));
  EXPECT_FALSE(results[0].ok);  // what it read belongs to request 2: discarded
  EXPECT_THAT(results[0].why, HasSubstr("revoked"));
  EXPECT_TRUE(verify_kv_content(p.prefill.side.cache, p.prefill.side.layout(), reused, other,
                                p.prefill.side.stream)
                  .ok());
  EXPECT_EQ(p.decode.side.cache.num_blocks_in_use(), 0u);
  EXPECT_EQ(p.decode.prefix.num_cached_blocks(), 0u);
  EXPECT_EQ(prefill.counters().late_notifications, 1u);  // the pull of an ended lease
  EXPECT_EQ(decode.counters().transfers, 1u);
  p.prefill.prefix.release_blocks(reused);
}

TEST(Disagg, DecodeAbortFreesOnlyAfterTheTransferIsFinal) {
  // The abort must find the pull still pending: on the RMA path, whose gets
  // the peer's process serves, not the direct copy (done microseconds after
  // the post).
  ::setenv("KVPORT_UCX_BULK", "rma", 1);
  struct Unset {
    ~Unset() { ::unsetenv("KVPORT_UCX_BULK"); }
  } unset;
  Pair p;
  PrefillNode prefill(*p.prefill.side.agent, p.prefill.prefix);
  DecodeNode decode(*p.decode.side.agent, p.decode.prefix);
  auto t = tokens(48, 3);
  prefill.offer(9, 0, p.prefill.prefill(t), t, std::vector<PeerId>{p.to_decode});
  ASSERT_TRUE(eventually([&] {
    decode.poll();
    return decode.held_blocks() > 0;
  }));
  ASSERT_TRUE(decode.abort(9));
  ASSERT_TRUE(eventually([&] {
    EXPECT_TRUE(decode.poll().empty());  // an aborted request reports nothing
    return decode.pending_requests() == 0;
  }));
  EXPECT_FALSE(decode.abort(9));
  EXPECT_EQ(decode.held_blocks(), 0u);
  EXPECT_EQ(p.decode.side.cache.num_blocks_in_use(), 0u);
  // The new owner's data is what it wrote.
  auto mine = tokens(48, 4);
  std::vector<BlockId> reused;
  for (int i = 0; i < 3; ++i)
    reused.push_back(p.decode.prefix.alloc_block());
  write_kv_content(p.decode.side.cache, p.decode.side.layout(), reused, mine, p.decode.side.stream);
  std::vector<LeaseResult> leases;
  ASSERT_TRUE(eventually([&] {
    for (auto& l : prefill.poll())
      leases.push_back(l);
    decode.poll();
    return !leases.empty();
  }));
  EXPECT_EQ(leases[0].end, LeaseEnd::refused);
  EXPECT_TRUE(verify_kv_content(p.decode.side.cache, p.decode.side.layout(), reused, mine,
                                p.decode.side.stream)
                  .ok());
  p.decode.prefix.release_blocks(reused);
}

TEST(Disagg, NoRoomIsRefusedAfterTheAssembleTimeout) {
  Pair p(2);  // the decode side has 2 blocks; the request needs 3
  PrefillNode prefill(*p.prefill.side.agent, p.prefill.prefix);
  DecodeOptions o;
  o.assemble_timeout = 100ms;
  DecodeNode decode(*p.decode.side.agent, p.decode.prefix, o);
  auto t = tokens(48);
  prefill.offer(5, 0, p.prefill.prefill(t), t, std::vector<PeerId>{p.to_decode});
  std::vector<DecodeResult> results;
  std::vector<LeaseResult> leases;
  ASSERT_TRUE(eventually([&] {
    for (auto& r : decode.poll())
      results.push_back(std::move(r));
    for (auto& l : prefill.poll())
      leases.push_back(l);
    return !results.empty() && !leases.empty();
  }));
  EXPECT_FALSE(results[0].ok);
  EXPECT_THAT(results[0].why, HasSubstr("no room"));
  EXPECT_EQ(decode.counters().no_room, 1u);
  EXPECT_EQ(leases[0].end, LeaseEnd::refused);
  EXPECT_EQ(p.decode.side.cache.num_blocks_in_use(), 0u);
}

TEST(Disagg, LostPrefillFailsTheRequestAndFreesTheDecodeSide) {
  auto p = std::make_unique<Pair>();
  DecodeNode decode(*p->decode.side.agent, p->decode.prefix);
  {
    PrefillNode prefill(*p->prefill.side.agent, p->prefill.prefix);
    auto t = tokens(32);
    prefill.offer(3, 0, p->prefill.prefill(t), t, std::vector<PeerId>{p->to_decode});
    ASSERT_TRUE(eventually([&] {
      decode.poll();
      return decode.pending_requests() > 0;
    }));
    // The prefill side goes away before confirming.
  }
  p->prefill.side.agent.reset();
  std::vector<DecodeResult> results;
  ASSERT_TRUE(eventually([&] {
    for (auto& r : decode.poll())
      results.push_back(std::move(r));
    return !results.empty();
  }));
  EXPECT_FALSE(results[0].ok);
  EXPECT_EQ(decode.held_blocks(), 0u);
  EXPECT_EQ(p->decode.side.cache.num_blocks_in_use(), 0u);
}

TEST(Disagg, LateAndMalformedNotificationsAreCountedAndIgnored) {
  Pair p;
  PrefillNode prefill(*p.prefill.side.agent, p.prefill.prefix);
  DecodeNode decode(*p.decode.side.agent, p.decode.prefix);
  // A pulled for a lease that never existed, and a confirm for a request the
  // decode side does not track.
  std::vector<std::uint8_t> lease{99, 0, 0, 0, 0, 0, 0, 0};
  p.decode.side.agent->notify(p.to_prefill, 1234, static_cast<std::uint32_t>(DisaggKind::pulled),
                              {}, lease);
  p.prefill.side.agent->notify(p.to_decode, 1234, static_cast<std::uint32_t>(DisaggKind::confirm),
                               {}, lease);
  p.prefill.side.agent->notify(p.to_decode, 1, static_cast<std::uint32_t>(DisaggKind::lease), {},
                               {});
  ASSERT_TRUE(eventually([&] {
    prefill.poll();
    decode.poll();
    return prefill.counters().late_notifications >= 1 && decode.counters().late_notifications >= 3;
  }));
  EXPECT_EQ(prefill.held_blocks(), 0u);
  EXPECT_EQ(decode.pending_requests(), 0u);
}

TEST(Disagg, OfferRejectsBadInput) {
  Pair p;
  PrefillNode prefill(*p.prefill.side.agent, p.prefill.prefix);
  auto t = tokens(32);
  auto blocks = p.prefill.prefill(t);
  EXPECT_THROW(prefill.offer(1, 0, blocks, t, {}), InvalidArgument);
  EXPECT_THROW(
      prefill.offer(1, 0, std::vector<BlockId>{blocks[0]}, t, std::vector<PeerId>{p.to_decode}),
      InvalidArgument);
  EXPECT_THROW(prefill.offer(1, 0, blocks, t, std::vector<PeerId>{999}), InvalidArgument);
  prefill.offer(1, 0, blocks, t, std::vector<PeerId>{p.to_decode});
  EXPECT_THROW(prefill.offer(1, 0, blocks, t, std::vector<PeerId>{p.to_decode}), InvalidArgument);
  PrefillOptions bad;
  bad.lease_ttl = 0ms;
  EXPECT_THROW(PrefillNode(*p.prefill.side.agent, p.prefill.prefix, bad), InvalidArgument);
}

TEST(Disagg, TensorParallelTwoToOneThroughNodes) {
  // Two prefill ranks (2 heads each) feed one decode rank (4 heads).
  Node d(config(KvCacheLayout::layer_major, 4), 8, named("decode"));
  Node p0(config(KvCacheLayout::layer_major, 2), 8, named("prefill0", 0, 2));
  Node p1(config(KvCacheLayout::layer_major, 2), 8, named("prefill1", 1, 2));
  const std::string address = d.side.agent->listen("127.0.0.1:0");
  const PeerId d0 = p0.side.agent->connect(address, 5s);
  const PeerId d1 = p1.side.agent->connect(address, 5s);
  PrefillNode n0(*p0.side.agent, p0.prefix);
  PrefillNode n1(*p1.side.agent, p1.prefix);
  DecodeNode decode(*d.side.agent, d.prefix);
  auto t = tokens(40, 8);
  n0.offer(77, 3, p0.prefill(t), t, std::vector<PeerId>{d0});
  n1.offer(77, 3, p1.prefill(t), t, std::vector<PeerId>{d1});
  std::vector<DecodeResult> results;
  ASSERT_TRUE(eventually([&] {
    for (auto& r : decode.poll())
      results.push_back(std::move(r));
    n0.poll();
    n1.poll();
    return !results.empty() && n0.held_blocks() == 0 && n1.held_blocks() == 0;
  }));
  ASSERT_TRUE(results[0].ok) << results[0].why;
  EXPECT_EQ(results[0].group, 3u);
  EXPECT_TRUE(
      verify_kv_content(d.side.cache, d.side.layout(), results[0].blocks, t, d.side.stream).ok());
  EXPECT_EQ(decode.counters().transfers, 2u);
  d.prefix.release_blocks(results[0].blocks);
}

}  // namespace
}  // namespace kvport::transfer
