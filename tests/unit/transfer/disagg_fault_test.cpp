// SPDX-License-Identifier: Apache-2.0
// The decode pull path (PrefillNode -> DecodeNode over two agents on
// 127.0.0.1) under injected transport faults (fault_transport.hpp): for every
// step (the n-th post, the n-th notification either side sends) and every
// fault kind, a request is pulled after a clean one that cached its first
// two blocks; afterwards a lookup of its tokens on the decode side returns
// the two cached blocks (a shorter hit) or, when nothing failed, all three,
// and every block it returns holds exactly the content of those tokens. No
// block is leaked or left held on either side, and a stalled pull's blocks
// are quarantined (neither free nor cached) until the transport lets go of
// them: blocks reused meanwhile keep what their new owner wrote. The sweeps
// fault the Nth step for N = 1, 2, ... until a run sees no fault. Timeouts
// are a few hundred milliseconds; every wait is bounded.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cstdio>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "agent_pair.hpp"
#include "fault_transport.hpp"
#include "kvport/core/prefix_cache.hpp"
#include "kvport/platform/div_ceil.hpp"
#include "kvport/transfer/disagg.hpp"
#include "kvport/transfer/kv_content.hpp"

namespace kvport::transfer {
namespace {

using test::FaultControl;
using test::FaultInjectingTransport;
using test::FaultKind;
using test::FaultStep;
using ::testing::HasSubstr;

constexpr std::size_t kBlock = 16;  // config()'s block size
constexpr std::size_t kDecodeBlocks = 10;

AgentOptions drill_options(std::string name, const std::shared_ptr<FaultControl>& faults,
                           std::uint32_t rank = 0, std::uint32_t ranks = 1, bool staged = false) {
  AgentOptions o = named(std::move(name), rank, ranks);
  if (staged) o.memory_path = MemoryPath::staged;
  // Short, but long enough that a clean pull on a loaded machine (these
  // tests run beside others) is never mistaken for a stall.
  o.transfer_timeout = 250ms;
  o.peer_timeout = 1000ms;
  o.transport_factory = FaultInjectingTransport::factory(faults);
  return o;
}

// A side whose agent's transport injects faults, with a prefix cache.
struct FaultNode {
  std::shared_ptr<FaultControl> faults = std::make_shared<FaultControl>();
  Side side;
  PrefixCache prefix;
  // Rank `rank` of `ranks`, holding 4 / ranks of the model's 4 KV heads.
  // `staged`: through the agent's pinned mirror (MemoryPath::staged).
  FaultNode(std::string name, std::size_t blocks, std::uint32_t rank = 0, std::uint32_t ranks = 1,
            bool staged = false)
      : side(config(KvCacheLayout::layer_major, 4 / ranks), blocks,
             drill_options(std::move(name), faults, rank, ranks, staged)),
        prefix(side.cache) {}
  std::vector<BlockId> prefill(const std::vector<TokenId>& t) {
    std::vector<BlockId> blocks;
    for (std::size_t i = 0; i < div_ceil(t.size(), kBlock); ++i)
      blocks.push_back(prefix.alloc_block());
    write_kv_content(side.cache, side.layout(), blocks, t, side.stream);
    side.agent->publish(blocks);
    return blocks;
  }
  // Every block in use is cached and unreferenced (nothing leaked or held).
  void expect_settled(const char* who) {
    const InvariantReport r = prefix.check_invariants();
    EXPECT_TRUE(r.ok) << who << ": " << r.to_string();
    EXPECT_EQ(side.cache.num_blocks_in_use(), prefix.num_evictable_blocks())
        << who << ": a block stayed referenced";
  }
};

// The decode side's hit for `t`: every returned block must hold exactly the
// content of its tokens. Returns the number of blocks (the references are
// given back).
std::size_t checked_hit(FaultNode& decode, const std::vector<TokenId>& t) {
  PrefixMatch m = decode.prefix.lookup(t);
  if (!m.blocks.empty()) {
    const std::vector<TokenId> covered(t.begin(), t.begin() + m.num_tokens);
    const ContentCheck c = verify_kv_content(decode.side.cache, decode.side.layout(), m.blocks,
                                             covered, decode.side.stream);
    EXPECT_TRUE(c.ok()) << c.bytes_wrong << " wrong bytes of " << c.bytes_checked << " in a hit of "
                        << m.blocks.size() << " blocks";
  }
  decode.prefix.release_blocks(m.blocks);
  return m.blocks.size();
}

struct Case {
  bool on_decode = true;  // whose transport injects (else the last prefill rank's)
  FaultStep step = FaultStep::post;
  std::size_t nth = 1;
  FaultKind kind = FaultKind::submit_throws;
  std::uint32_t prefill_ranks = 1;  // 2: a TP-2 prefill group feeds the TP-1 decode rank
  bool staged = false;              // the decode side stages through its pinned mirror
  std::string name() const {
    return std::string(on_decode ? "decode" : "prefill") + " " + test::to_string(step) + " #" +
           std::to_string(nth) + " " + test::to_string(kind) + ", " +
           std::to_string(prefill_ranks) + " prefill rank(s)" + (staged ? ", staged" : "");
  }
};

// One run: a clean request caches the first two blocks of `t`, then the
// faulted request pulls all of `t` (three full blocks and a partial one),
// from every prefill rank (one transfer each). Returns whether the fault
// fired.
// Runs and injected faults of the current test (printed at its end).
struct Tally {
  std::size_t runs = 0;
  std::size_t faults = 0;
};
Tally tally;

// Prints the tally (the figures docs/reliability.md quotes) and resets it.
void print_tally() {
  std::printf("[kvport] %zu runs, %zu transport faults injected\n", tally.runs, tally.faults);
  tally = {};
}

bool run_case(const Case& c) {
  SCOPED_TRACE(c.name());
  ++tally.runs;
  const std::uint32_t ranks = c.prefill_ranks;
  FaultNode decode_side("decode", kDecodeBlocks, 0, 1, c.staged);
  const std::string address = decode_side.side.agent->listen("127.0.0.1:0");
  std::vector<std::unique_ptr<FaultNode>> prefill_sides;
  std::vector<PeerId> to_decode;
  for (std::uint32_t r = 0; r < ranks; ++r) {
    prefill_sides.push_back(
        std::make_unique<FaultNode>("prefill" + std::to_string(r), 16, r, ranks));
    to_decode.push_back(prefill_sides.back()->side.agent->connect(address, 5s));
  }
  EXPECT_TRUE(eventually([&] { return decode_side.side.agent->peers().size() == ranks; }));
  PrefillOptions po;
  po.lease_ttl = 600ms;
  DecodeOptions dopt;
  dopt.assemble_timeout = 600ms;
  dopt.confirm_timeout = 300ms;
  std::vector<std::unique_ptr<PrefillNode>> prefills;
  for (auto& side : prefill_sides)
    prefills.push_back(std::make_unique<PrefillNode>(*side->side.agent, side->prefix, po));
  DecodeNode decode(*decode_side.side.agent, decode_side.prefix, dopt);
  auto active_leases = [&] {
    std::size_t n = 0;
    for (auto& p : prefills)
      n += p->active_leases();
    return n;
  };
  auto offer = [&](std::uint64_t id, const std::vector<TokenId>& tok) {
    for (std::uint32_t r = 0; r < ranks; ++r) {
      prefills[r]->offer(id, 0, prefill_sides[r]->prefill(tok), tok,
                         std::vector<PeerId>{to_decode[r]});
    }
  };

  std::vector<DecodeResult> results;
  std::vector<LeaseResult> leases;
  auto pump = [&] {
    try {
      for (auto& r : decode.poll())
        results.push_back(std::move(r));
      for (auto& p : prefills) {
        for (auto& l : p->poll())
          leases.push_back(l);
      }
    } catch (const std::exception& e) {
      // A node's poll must not throw for a transport fault; a caller that
      // catches and polls on must still never see a wrong byte.
      ADD_FAILURE() << "poll threw: " << e.what();
    }
  };

  // The clean request: 32 tokens, two full blocks, cached on the decode side.
  const std::vector<TokenId> t = tokens(3 * kBlock + 4, 5);
  const std::vector<TokenId> head(t.begin(), t.begin() + 2 * kBlock);
  offer(1, head);
  EXPECT_TRUE(eventually([&] {
    pump();
    return !results.empty() && leases.size() == ranks;
  }));
  if (results.size() != 1 || !results[0].ok) {
    ADD_FAILURE() << "the clean request failed";
    return false;
  }
  decode_side.prefix.release_blocks(results[0].blocks);
  results.clear();
  leases.clear();
  EXPECT_EQ(checked_hit(decode_side, t), 2u);
  const DecodeCounters before = decode.counters();

  FaultNode& faulty = c.on_decode ? decode_side : *prefill_sides.back();
  faulty.faults->arm(c.step, c.nth, c.kind);
  offer(2, t);

  bool quarantine_checked = false;
  std::vector<BlockId> reused;
  const std::vector<TokenId> other = tokens(kDecodeBlocks * kBlock, 77);
  const bool settled = eventually([&] {
    pump();
    if (!quarantine_checked && !results.empty() && faulty.faults->stalled()) {
      // A stalled pull, reported failed while the transport still holds
      // its blocks: they are neither free nor cached (nor evictable), and a
      // lookup sees the shorter hit only.
      quarantine_checked = true;
      EXPECT_FALSE(results[0].ok);
      EXPECT_TRUE(faulty.faults->stalled());
      EXPECT_EQ(decode.quarantined_blocks(), 4u);
      EXPECT_EQ(decode.held_blocks(), 0u);
      PagedKvCache& cache = decode_side.side.cache;
      EXPECT_EQ(cache.num_free_blocks() + decode_side.prefix.num_evictable_blocks(),
                kDecodeBlocks - 4);
      EXPECT_EQ(checked_hit(decode_side, t), 2u);
      // Whatever is free is reused and written by a new owner; the stalled
      // transfer's late bytes must not reach it.
      while (cache.num_free_blocks() > 0)
        reused.push_back(decode_side.prefix.alloc_block());
      std::vector<TokenId> mine(other.begin(), other.begin() + reused.size() * kBlock);
      write_kv_content(cache, decode_side.side.layout(), reused, mine, decode_side.side.stream);
      faulty.faults->release();
    }
    return decode.pending_requests() == 0 && active_leases() == 0 &&
           decode.quarantined_blocks() == 0 && !faulty.faults->stalled();
  });
  EXPECT_TRUE(settled) << "pending " << decode.pending_requests() << ", leases " << active_leases()
                       << ", quarantined " << decode.quarantined_blocks();
  if (faulty.faults->stalled()) {
    faulty.faults->release();
    eventually([&] {
      pump();
      return !faulty.faults->stalled() && decode.quarantined_blocks() == 0;
    });
  }
  if (!reused.empty()) {
    const std::vector<TokenId> mine(other.begin(), other.begin() + reused.size() * kBlock);
    EXPECT_TRUE(verify_kv_content(decode_side.side.cache, decode_side.side.layout(), reused, mine,
                                  decode_side.side.stream)
                    .ok())
        << "a late byte of the stalled transfer landed in a reused block";
    decode_side.prefix.release_blocks(reused);
  }

  const bool fired = faulty.faults->fired();
  const DecodeCounters& after = decode.counters();
  const std::size_t hit = checked_hit(decode_side, t);
  if (!fired) {
    // No fault: the request completed and every byte is right.
    EXPECT_EQ(hit, 3u);
    EXPECT_EQ(results.size(), 1u);
    if (results.size() == 1) {
      EXPECT_TRUE(results[0].ok) << results[0].why;
      if (results[0].ok) {
        EXPECT_TRUE(verify_kv_content(decode_side.side.cache, decode_side.side.layout(),
                                      results[0].blocks, t, decode_side.side.stream)
                        .ok());
        decode_side.prefix.release_blocks(results[0].blocks);
      }
    }
    EXPECT_EQ(after.requests_completed, before.requests_completed + 1);
  } else {
    // A fault: nothing of the request was published; the shorter hit stays
    // and its bytes are right (checked_hit); the failure is reported and
    // counted, unless the decode side never heard of the request.
    EXPECT_EQ(hit, 2u);
    EXPECT_EQ(after.requests_completed, before.requests_completed);
    EXPECT_EQ(after.blocks_registered, before.blocks_registered);
    // With one prefill rank a lost lease is a request the decode side never
    // heard of; with two, the other rank's part is refused after
    // assemble_timeout.
    const bool lease_lost =
        ranks == 1 && !c.on_decode && c.step == FaultStep::notify &&
        faulty.faults->fired_kind() == static_cast<std::uint32_t>(DisaggKind::lease);
    if (lease_lost) {
      EXPECT_TRUE(results.empty());
      EXPECT_EQ(after.requests_failed, before.requests_failed);
    } else {
      EXPECT_EQ(results.size(), 1u);
      if (!results.empty()) {
        EXPECT_FALSE(results[0].ok);
      }
      EXPECT_EQ(after.requests_failed, before.requests_failed + 1);
    }
    EXPECT_EQ(leases.size(), ranks);
    if (!results.empty() && c.step == FaultStep::post) {
      const std::string& why = results[0].why;
      switch (c.kind) {
        case FaultKind::submit_throws:
          // Post n is rank n - 1's (the parts are pulled in rank order).
          EXPECT_THAT(why, HasSubstr("post to prefill rank " + std::to_string(c.nth - 1) +
                                     " failed: injected"));
          // The other ranks' pulls are posted all the same (and waited for).
          EXPECT_EQ(after.transfers, before.transfers + ranks - 1);
          break;
        case FaultKind::completion_error:
        case FaultKind::partial_error:
          EXPECT_THAT(why, HasSubstr("failed: injected"));
          EXPECT_EQ(decode_side.side.agent->counters().transfers_failed, 1u);
          break;
        case FaultKind::stall:
          EXPECT_TRUE(quarantine_checked);
          EXPECT_THAT(why, HasSubstr("abandoned (timed_out)"));
          EXPECT_THAT(why, HasSubstr("blocks are quarantined until the transfer ends"));
          EXPECT_EQ(after.transfers_timed_out, before.transfers_timed_out + 1);
          EXPECT_EQ(after.transfers_abandoned, before.transfers_abandoned + 1);
          EXPECT_EQ(after.blocks_quarantined, before.blocks_quarantined + 4);
          break;
        case FaultKind::connection_error:
          EXPECT_GE(after.peers_lost, 1u);
          break;
        case FaultKind::lose_message:
          break;
      }
    }
  }
  EXPECT_EQ(decode.held_blocks(), 0u);
  EXPECT_EQ(decode.quarantined_blocks(), 0u);
  decode_side.expect_settled("decode");
  for (std::uint32_t r = 0; r < ranks; ++r) {
    EXPECT_EQ(prefills[r]->held_blocks(), 0u);
    prefill_sides[r]->expect_settled("prefill");
  }
  return fired;
}

// Faults the Nth step for N = 1, 2, ... until a run sees no fault; returns
// how many runs fired.
std::size_t sweep(bool on_decode, FaultStep step, FaultKind kind, std::uint32_t ranks = 1,
                  bool staged = false) {
  std::size_t fired = 0;
  for (std::size_t n = 1; n <= 6; ++n) {
    if (!run_case({on_decode, step, n, kind, ranks, staged})) break;
    ++fired;
    ++tally.faults;
    if (::testing::Test::HasFailure()) break;  // one failing case is enough to read
  }
  return fired;
}

TEST(DisaggFault, EveryPullFaultOnTheDecodeSideFailsClosed) {
  for (FaultKind kind : {FaultKind::submit_throws, FaultKind::completion_error,
                         FaultKind::partial_error, FaultKind::stall, FaultKind::connection_error}) {
    // One pull per request: the first post faults, the second run is clean.
    EXPECT_EQ(sweep(true, FaultStep::post, kind), 1u) << test::to_string(kind);
    if (HasFailure()) break;
  }
  print_tally();
}

// The same through the decode agent's pinned mirror: a failed or partial
// read never reaches the blocks (the mirror is copied in only when the read
// is done).
TEST(DisaggFault, EveryPullFaultThroughStagingFailsClosed) {
  for (FaultKind kind : {FaultKind::submit_throws, FaultKind::completion_error,
                         FaultKind::partial_error, FaultKind::stall, FaultKind::connection_error}) {
    EXPECT_EQ(sweep(true, FaultStep::post, kind, 1, true), 1u) << test::to_string(kind);
    if (HasFailure()) break;
  }
  print_tally();
}

// A TP-2 prefill group feeding one decode rank: two pulls per request, so a
// fault in the second comes after the first half of every block's heads
// landed; the request must still fail closed.
TEST(DisaggFault, EveryPullFaultFromATensorParallelGroupFailsClosed) {
  for (FaultKind kind : {FaultKind::submit_throws, FaultKind::completion_error,
                         FaultKind::partial_error, FaultKind::stall, FaultKind::connection_error}) {
    EXPECT_EQ(sweep(true, FaultStep::post, kind, 2), 2u) << test::to_string(kind);
    if (HasFailure()) break;
  }
  print_tally();
}

TEST(DisaggFault, EveryLostOrDroppedNotificationOfATensorParallelGroupFailsClosed) {
  for (FaultKind kind : {FaultKind::lose_message, FaultKind::connection_error}) {
    // The decode side sends `pulled` to each rank; the second rank sends
    // its lease, then `confirm`.
    EXPECT_GE(sweep(true, FaultStep::notify, kind, 2), 2u) << test::to_string(kind);
    if (HasFailure()) break;
    EXPECT_GE(sweep(false, FaultStep::notify, kind, 2), 2u) << test::to_string(kind);
    if (HasFailure()) break;
  }
  print_tally();
}

TEST(DisaggFault, EveryLostOrDroppedNotificationFailsClosed) {
  for (FaultKind kind : {FaultKind::lose_message, FaultKind::connection_error}) {
    // The decode side sends `pulled` (then `refused` after a failure); the
    // prefill side sends the lease, then `confirm`.
    EXPECT_GE(sweep(true, FaultStep::notify, kind), 1u) << test::to_string(kind);
    if (HasFailure()) break;
    EXPECT_GE(sweep(false, FaultStep::notify, kind), 2u) << test::to_string(kind);
    if (HasFailure()) break;
  }
  print_tally();
}

// A DecodeNode destroyed while a stalled pull's blocks are quarantined waits
// for the transport to let go (here: released from another thread) and then
// frees them; nothing is leaked.
TEST(DisaggFault, TheDestructorWaitsForTheQuarantineThenFreesIt) {
  FaultNode prefill_side("prefill", 16);
  FaultNode decode_side("decode", kDecodeBlocks);
  const std::string address = decode_side.side.agent->listen("127.0.0.1:0");
  const PeerId to_decode = prefill_side.side.agent->connect(address, 5s);
  ASSERT_TRUE(eventually([&] { return !decode_side.side.agent->peers().empty(); }));
  PrefillOptions po;
  po.lease_ttl = 600ms;
  PrefillNode prefill(*prefill_side.side.agent, prefill_side.prefix, po);
  auto decode = std::make_unique<DecodeNode>(*decode_side.side.agent, decode_side.prefix);
  decode_side.faults->arm(FaultStep::post, 1, FaultKind::stall);
  const std::vector<TokenId> t = tokens(3 * kBlock, 9);
  prefill.offer(1, 0, prefill_side.prefill(t), t, std::vector<PeerId>{to_decode});
  std::vector<DecodeResult> results;
  ASSERT_TRUE(eventually([&] {
    for (auto& r : decode->poll())
      results.push_back(std::move(r));
    prefill.poll();
    return !results.empty();
  }));
  EXPECT_FALSE(results[0].ok);
  EXPECT_EQ(decode->quarantined_blocks(), 3u);
  EXPECT_EQ(decode->pending_requests(), 0u);
  EXPECT_EQ(decode_side.side.cache.num_blocks_in_use(), 3u);
  ASSERT_TRUE(decode_side.faults->stalled());
  std::thread releaser([&] {
    std::this_thread::sleep_for(100ms);
    decode_side.faults->release();
  });
  const auto start = std::chrono::steady_clock::now();
  decode.reset();
  const auto waited = std::chrono::steady_clock::now() - start;
  releaser.join();
  EXPECT_GE(waited, 90ms) << "the destructor did not wait for the transport";
  EXPECT_LT(waited, 5s);
  EXPECT_FALSE(decode_side.faults->stalled());
  EXPECT_EQ(decode_side.side.cache.num_blocks_in_use(), 0u);
  decode_side.expect_settled("decode");
  eventually([&] {
    prefill.poll();
    return prefill.active_leases() == 0;
  });
  EXPECT_EQ(prefill.held_blocks(), 0u);
}

TEST(AgentFault, FaultControlRefusesAFaultThatDoesNotApplyToItsStep) {
  FaultControl c;
  EXPECT_THROW(c.arm(FaultStep::post, 1, FaultKind::lose_message), std::invalid_argument);
  EXPECT_THROW(c.arm(FaultStep::notify, 1, FaultKind::stall), std::invalid_argument);
  EXPECT_THROW(c.arm(FaultStep::notify, 0, FaultKind::lose_message), std::invalid_argument);
  c.arm(FaultStep::notify, 2, FaultKind::connection_error);
  EXPECT_FALSE(c.count(FaultStep::post));
  EXPECT_FALSE(c.count(FaultStep::notify));
  EXPECT_EQ(c.count(FaultStep::notify), FaultKind::connection_error);
  EXPECT_FALSE(c.count(FaultStep::notify));  // once
  EXPECT_TRUE(c.fired());
}

// ---- the seam and the agent's abandoned state -----------------------------------------------

TEST(AgentFault, TransportFactoryErrorsReachTheCaller) {
  auto backend = make_host_backend(HostBackendOptions{64u << 20});
  PagedKvCache cache(config(KvCacheLayout::layer_major), 4, *backend);
  AgentOptions o;
  o.transport_factory = [](const TransportEvents&) -> std::unique_ptr<Transport> { return {}; };
  EXPECT_THROW({ Agent agent(cache, o); }, InvalidArgument);
  o.transport_factory = [](const TransportEvents&) -> std::unique_ptr<Transport> {
    throw TransferError("no transport here");
  };
  try {
    Agent agent(cache, o);
    ADD_FAILURE() << "constructed";
  } catch (const TransferError& e) {
    EXPECT_THAT(e.what(), HasSubstr("no transport here"));
  }
}

TEST(AgentFault, AStalledReadIsAbandonedAtItsDeadlineAndEndsWhenTheTransportLetsGo) {
  auto faults = std::make_shared<FaultControl>();
  Side a(config(KvCacheLayout::layer_major), 4, drill_options("a", faults));
  Side b(config(KvCacheLayout::layer_major), 4, named("b"));
  auto [to_b, to_a] = link(a, b);
  const auto local = a.alloc(2);
  const auto remote = b.alloc(2);
  faults->arm(FaultStep::post, 1, FaultKind::stall);
  const TransferId id = a.agent->post(to_b, Direction::read, local, remote);
  EXPECT_EQ(a.agent->abandoned(id), std::nullopt);
  ASSERT_TRUE(eventually([&] { return a.agent->abandoned(id).has_value(); }, 3s));
  EXPECT_EQ(a.agent->abandoned(id), TransferState::timed_out);
  EXPECT_EQ(a.agent->poll(id), TransferState::pending);  // the transport still holds it
  EXPECT_THAT(a.agent->why(id), HasSubstr("not done within 250 ms"));
  EXPECT_THROW(a.agent->release(id), InvalidArgument);
  std::this_thread::sleep_for(50ms);
  EXPECT_EQ(a.agent->poll(id), TransferState::pending);
  faults->release();
  EXPECT_EQ(a.agent->wait(id, 3s), TransferState::timed_out);
  EXPECT_EQ(a.agent->abandoned(id), std::nullopt);
  a.agent->release(id);
  EXPECT_THROW((void)a.agent->abandoned(id), InvalidArgument);
  EXPECT_THROW((void)a.agent->abandoned(12345), InvalidArgument);
}

TEST(AgentFault, ACancelledPendingTransferIsAbandonedAsCancelled) {
  auto faults = std::make_shared<FaultControl>();
  AgentOptions o = drill_options("a", faults);
  o.transfer_timeout = 2000ms;
  Side a(config(KvCacheLayout::layer_major), 4, o);
  Side b(config(KvCacheLayout::layer_major), 4, named("b"));
  auto [to_b, to_a] = link(a, b);
  faults->arm(FaultStep::post, 1, FaultKind::stall);
  const TransferId id = a.agent->post(to_b, Direction::read, a.alloc(1), b.alloc(1));
  a.agent->cancel(id);
  EXPECT_EQ(a.agent->abandoned(id), TransferState::cancelled);
  EXPECT_EQ(a.agent->poll(id), TransferState::pending);
  faults->release();
  EXPECT_EQ(a.agent->wait(id, 3s), TransferState::cancelled);
}

// A connection to the listener that never completes its handshake (no
// hello, or a malformed one) is closed after peer_timeout instead of being
// waited on for ever.
TEST(AgentFault, AnIncomingConnectionWithoutAHelloIsClosedAfterThePeerTimeout) {
  for (bool garbage : {false, true}) {
    SCOPED_TRACE(garbage ? "a malformed hello" : "no hello");
    AgentOptions o = named("listener");
    o.peer_timeout = 100ms;
    Side a(config(KvCacheLayout::layer_major), 4, o);
    const std::string address = a.agent->listen("127.0.0.1:0");
    const auto colon = address.rfind(':');
    TransportEvents events;
    std::vector<std::string> errors;
    events.on_error = [&](ConnId, const std::string& why) { errors.push_back(why); };
    std::unique_ptr<Transport> raw = make_ucx_transport(events);
    const ConnId conn = raw->connect(
        address.substr(0, colon), static_cast<std::uint16_t>(std::stoi(address.substr(colon + 1))));
    if (garbage) {
      const std::vector<std::uint8_t> junk{'K', 'V', 'P', 'T', 0xff, 0xff, 1, 2, 3};
      raw->send(conn, junk);
    }
    EXPECT_TRUE(eventually(
        [&] {
          raw->progress();
          return a.agent->counters().handshakes_rejected == 1;
        },
        3s));
    EXPECT_TRUE(a.agent->peers().empty());
    if (garbage) {
      EXPECT_EQ(a.agent->counters().malformed_messages, 1u);
    }
    bool closed = false;
    raw->close(conn, true, [&] { closed = true; });
    EXPECT_TRUE(eventually(
        [&] {
          raw->progress();
          return closed;
        },
        3s));
  }
}

}  // namespace
}  // namespace kvport::transfer
