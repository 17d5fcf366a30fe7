// SPDX-License-Identifier: Apache-2.0
// Subscriber over tcp://127.0.0.1: a real events::Publisher followed until
// the index holds exactly the publisher's own snapshot set (the slow
// joiner's loss replayed, as a gap and at the tail, and a publisher
// restarted on the same ports); a fake publisher (raw PUB + ROUTER sockets
// in the test) that skips a sequence on purpose, answers replays, misses,
// answers snapshots, stays silent, and sends malformed messages; and the
// error paths.
#include "kvport/router/subscriber.hpp"

#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstring>
#include <memory>
#include <numeric>
#include <optional>
#include <random>
#include <string>
#include <thread>
#include <vector>
#include <zmq.hpp>
#include <zmq_addon.hpp>

#include "kvport/backends/host_backend.hpp"
#include "kvport/core/block_table.hpp"
#include "kvport/core/cache_events.hpp"
#include "kvport/core/paged_kv_cache.hpp"
#include "kvport/core/prefix_cache.hpp"
#include "kvport/events/publisher.hpp"
#include "kvport/events/wire.hpp"
#include "kvport/platform/error.hpp"
#include "kvport/router/router_index.hpp"
#include "kvport/testing/sanitizers.hpp"
#include "kvport/testing/time_scale.hpp"

namespace kvport::router {
namespace {

using namespace std::chrono_literals;
using kvport::testing::scaled;
using Blocks = std::vector<std::pair<std::uint64_t, Tier>>;

// These tests choreograph real sockets against timeouts (a tail wait, an
// instance timeout, a replay in flight), and ThreadSanitizer's slowdown of
// ZeroMQ's I/O threads breaks that choreography even with scaled timeouts.
// The Subscriber is single-threaded, so TSan has little to check here beyond
// libzmq, which is suppressed (tests/tsan.supp): under TSan each test skips,
// saying so; the host and asan presets run every one.
#define SKIP_SOCKET_TIMING_UNDER_TSAN()    \
  if (::kvport::testing::kThreadSanitizer) \
  GTEST_SKIP() << "socket timing test: not run under ThreadSanitizer (host and asan run it)"

constexpr std::uint32_t kBs = 16;  // IndexOptions' default block size

IndexOptions index_options() {
  IndexOptions o;
  o.block_size = kBs;
  return o;
}

std::string as_string(const zmq::message_t& m) {
  return std::string(m.data<char>(), m.size());
}
std::string seq_bytes(std::uint64_t seq) {
  const auto a = events::encode_seq(seq);
  return std::string(reinterpret_cast<const char*>(a.data()), a.size());
}

BlockStored stored(std::vector<std::uint64_t> hashes, const char* medium = "GPU") {
  BlockStored s;
  s.block_hashes = std::move(hashes);
  s.medium = medium;
  s.block_size = kBs;
  return s;
}

EventSource on(Medium medium) {
  EventSource s;
  s.medium = medium;
  return s;
}

EventBatch batch(std::uint64_t seq, std::vector<CacheEvent> events, double ts) {
  EventBatch b;
  b.seq = seq;
  b.ts = ts;
  b.events = std::move(events);
  return b;
}

Blocks gpu(std::vector<std::uint64_t> hashes) {
  Blocks out;
  for (auto h : hashes)
    out.emplace_back(h, Tier::gpu);
  std::sort(out.begin(), out.end());
  return out;
}

// ---- a fake publisher: raw sockets, crafted frames ------------------------------

struct Request {
  std::string identity;
  std::string body;
};

struct FakePublisher {
  zmq::context_t ctx{1};
  zmq::socket_t pub{ctx, zmq::socket_type::pub};
  zmq::socket_t router{ctx, zmq::socket_type::router};
  std::string events_endpoint, replay_endpoint;

  FakePublisher() {
    pub.set(zmq::sockopt::linger, 0);
    router.set(zmq::sockopt::linger, 0);
    pub.bind("tcp://127.0.0.1:*");
    router.bind("tcp://127.0.0.1:*");
    events_endpoint = pub.get(zmq::sockopt::last_endpoint);
    replay_endpoint = router.get(zmq::sockopt::last_endpoint);
  }
  InstanceEndpoints endpoints(bool with_replay = true) const {
    return {events_endpoint, with_replay ? replay_endpoint : std::string()};
  }

  void send_frames(const std::vector<std::string>& frames) {
    for (std::size_t k = 0; k < frames.size(); ++k) {
      pub.send(zmq::buffer(frames[k]),
               k + 1 < frames.size() ? zmq::send_flags::sndmore : zmq::send_flags::none);
    }
  }
  void send(const EventBatch& b) { send_frames({"", seq_bytes(b.seq), events::encode_batch(b)}); }

  // The next request on the ROUTER socket, [identity, "", body].
  std::optional<Request> request(std::chrono::milliseconds timeout = 2s) {
    zmq::pollitem_t item{router.handle(), 0, ZMQ_POLLIN, 0};
    if (zmq::poll(&item, 1, scaled(timeout)) == 0) return std::nullopt;
    std::vector<zmq::message_t> frames;
    (void)zmq::recv_multipart(router, std::back_inserter(frames));
    EXPECT_EQ(frames.size(), 3u);
    if (frames.size() != 3) return std::nullopt;
    EXPECT_EQ(frames[1].size(), 0u) << "the empty delimiter, as vLLM's clients send it";
    return Request{as_string(frames[0]), as_string(frames[2])};
  }
  void answer(const Request& r, std::uint64_t seq, const std::string& payload) {
    router.send(zmq::buffer(r.identity), zmq::send_flags::sndmore);
    router.send(zmq::message_t(), zmq::send_flags::sndmore);
    router.send(zmq::buffer(seq_bytes(seq)), zmq::send_flags::sndmore);
    router.send(zmq::buffer(payload), zmq::send_flags::none);
  }
  void answer(const Request& r, const EventBatch& b) { answer(r, b.seq, events::encode_batch(b)); }
  void end(const Request& r) { answer(r, events::end_of_replay_seq, ""); }
};

// Polls until `pred` holds (true) or `timeout` passes.
template <class Pred>
bool poll_until(Subscriber& sub, Pred pred, std::chrono::milliseconds timeout = 3s) {
  const auto deadline = Clock::now() + scaled(timeout);
  while (!pred()) {
    if (Clock::now() >= deadline) return false;
    sub.poll(5ms);
  }
  return true;
}

// Waits out the slow joiner: sends batch 0 (ts 1.0, storing block 1) until
// the subscriber applied it; its copies are duplicates.
void join(FakePublisher& fake, Subscriber& sub, RouterIndex& index, InstanceId id = 0) {
  const EventBatch b0 = batch(0, {stored({1})}, 1.0);
  const auto deadline = Clock::now() + scaled(3s);
  while (!index.status(id).last_seq && Clock::now() < deadline) {
    fake.send(b0);
    sub.poll(10ms);
  }
  ASSERT_EQ(index.status(id).last_seq, 0u) << "the subscriber never joined";
  // Copies still queued or in flight: drained until none came for a while
  // (a late copy of batch 0 would look like a restart to a later step).
  std::uint64_t seen = 0;
  do {
    seen = sub.stats().messages;
    sub.poll(scaled(20ms));
  } while (sub.stats().messages != seen);
}

// ---- a real publisher ---------------------------------------------------------

events::PublisherOptions publisher_options(const std::string& endpoint = "tcp://127.0.0.1:0",
                                           const std::string& replay = "tcp://127.0.0.1:0") {
  events::PublisherOptions o;
  o.endpoint = endpoint;
  o.replay_endpoint = replay;
  o.batch_interval = 1ms;
  o.max_batch_events = 4;
  return o;
}

std::vector<BlockHash> hashes(std::uint64_t first, std::size_t n) {
  std::vector<BlockHash> out;
  for (std::size_t k = 0; k < n; ++k)
    out.push_back(BlockHash{first + k, ~(first + k)});
  return out;
}

// Stores n blocks from `first` on `medium` (one chain), through the sink API.
void store(events::Publisher& pub, std::uint64_t first, std::size_t n,
           Medium medium = Medium::gpu) {
  const auto hs = hashes(first, n);
  std::vector<TokenId> tokens(n * kBs);
  std::iota(tokens.begin(), tokens.end(), static_cast<TokenId>(first));
  BlockStoredView v;
  v.hashes = hs;
  v.tokens = tokens;
  v.block_size = kBs;
  pub.stored(on(medium), v);
}

// The publisher's own cached set, from a snapshot over a DEALER of the test.
Blocks publisher_set(const std::string& replay_endpoint) {
  zmq::context_t ctx{1};
  zmq::socket_t d{ctx, zmq::socket_type::dealer};
  d.set(zmq::sockopt::linger, 0);
  d.set(zmq::sockopt::rcvtimeo, 2000);
  d.connect(replay_endpoint);
  d.send(zmq::message_t(), zmq::send_flags::sndmore);
  d.send(zmq::buffer(events::snapshot_request), zmq::send_flags::none);
  std::vector<zmq::message_t> frames;
  (void)zmq::recv_multipart(d, std::back_inserter(frames));
  EXPECT_EQ(frames.size(), 3u);
  if (frames.size() != 3) return {};
  const auto r = events::decode_batch(as_string(frames[2]));
  EXPECT_TRUE(r.ok()) << r.error;
  Blocks out;
  for (const CacheEvent& e : r.batch->events) {
    const auto& s = std::get<BlockStored>(e);
    for (auto h : s.block_hashes)
      out.emplace_back(h, tier_of_medium(s.medium));
  }
  std::sort(out.begin(), out.end());
  return out;
}

// A mix of stores (two media), removals and a medium's clear.
void publish_mix(events::Publisher& pub, std::uint64_t base) {
  store(pub, base, 4);
  store(pub, base + 10, 3, Medium::cpu);
  const auto gone = hashes(base + 1, 2);
  pub.removed(on(Medium::gpu), gone);
  store(pub, base + 20, 2, Medium::cpu);
  pub.cleared(on(Medium::cpu));
  store(pub, base + 30, 5);
  store(pub, base + 40, 1, Medium::cpu);
}

TEST(SubscriberPublisher, SlowJoinerGapReplayedIndexEqualsPublisherSet) {
  SKIP_SOCKET_TIMING_UNDER_TSAN();
  events::Publisher pub(publisher_options());
  // Published before anyone subscribed: lost on the SUB.
  publish_mix(pub, 100);
  ASSERT_TRUE(pub.flush(2s));
  const std::uint64_t lost = pub.stats().next_seq;
  ASSERT_GT(lost, 1u);

  RouterIndex index(index_options());
  Subscriber sub(index);
  sub.add_instance(0, {pub.endpoint(), pub.replay_endpoint()}, Clock::now());
  // Live batches until one arrives: its seq is past the lost ones, a gap.
  for (std::uint64_t k = 0; k < 200 && sub.stats().messages == 0; ++k) {
    store(pub, 1000 + k, 1);
    ASSERT_TRUE(pub.flush(2s));
    sub.poll(10ms);
  }
  ASSERT_GT(sub.stats().messages, 0u);
  publish_mix(pub, 5000);
  ASSERT_TRUE(pub.flush(2s));
  ASSERT_TRUE(sub.wait_for(0, pub.stats().next_seq, scaled(3s)));

  EXPECT_EQ(index.blocks_of(0), publisher_set(pub.replay_endpoint()));
  EXPECT_FALSE(index.blocks_of(0).empty());
  const SubscriberStats st = sub.stats();
  EXPECT_GE(index.counters().gaps, 1u);
  EXPECT_GE(st.held, 1u);
  EXPECT_GE(st.replay_requests, 1u);
  EXPECT_GE(st.replayed_batches, lost);
  EXPECT_EQ(st.applied, pub.stats().next_seq);
  EXPECT_EQ(st.malformed, 0u);
  EXPECT_EQ(st.replay_misses, 0u);
  EXPECT_EQ(st.snapshot_requests, 0u);
  EXPECT_EQ(index.status(0).last_seq, pub.stats().next_seq - 1);
}

// A store (or removal) larger than max_batch_bytes goes as chained pieces,
// every batch within the bound (a subscriber refusing larger frames reads
// them all): the index built from them equals one built from whole events.
TEST(SubscriberPublisher, OversizedEventsSplitIntoPiecesIndexAsTheWhole) {
  SKIP_SOCKET_TIMING_UNDER_TSAN();
  events::PublisherOptions split_options = publisher_options();
  split_options.max_batch_bytes = 4096;
  events::Publisher split(split_options);
  events::Publisher whole(publisher_options());
  const auto follow = [](events::Publisher& pub, Subscriber& sub) {
    sub.add_instance(0, {pub.endpoint(), pub.replay_endpoint()}, Clock::now());
    std::uint64_t k = 0;
    for (; k < 200 && sub.stats().messages == 0; ++k) {
      store(pub, 100'000 + k, 1);
      ASSERT_TRUE(pub.flush(scaled(2s)));
      sub.poll(10ms);
    }
    ASSERT_GT(sub.stats().messages, 0u);
    const auto joined = hashes(100'000, k);
    pub.removed(on(Medium::gpu), joined);
    store(pub, 1, 200);                   // 256 + 9 x 200 + 5 x 3200 bytes: 5 pieces of 43
    store(pub, 1000, 500);                // a second chain
    const auto gone = hashes(1000, 450);  // 256 + 9 x 450 bytes: 2 pieces
    pub.removed(on(Medium::gpu), gone);
    ASSERT_TRUE(pub.flush(scaled(2s)));
    ASSERT_TRUE(sub.wait_for(0, pub.stats().next_seq, scaled(3s)));
  };
  RouterIndex split_index(index_options());
  RouterIndex whole_index(index_options());
  SubscriberOptions strict;
  strict.max_message_bytes = 4096 + 256;  // the batch's own keys besides its events
  Subscriber split_sub(split_index, strict);
  Subscriber whole_sub(whole_index);
  follow(split, split_sub);
  follow(whole, whole_sub);
  EXPECT_EQ(split_index.blocks_of(0).size(), 250u);
  EXPECT_EQ(split_index.blocks_of(0), whole_index.blocks_of(0));
  EXPECT_EQ(split_index.blocks_of(0), publisher_set(split.replay_endpoint()));
  EXPECT_EQ(split_sub.stats().malformed, 0u);
  EXPECT_EQ(split.stats().events_dropped, 0u);
}

TEST(SubscriberPublisher, LossAtTheTailReplayedByWaitFor) {
  SKIP_SOCKET_TIMING_UNDER_TSAN();
  events::Publisher pub(publisher_options());
  publish_mix(pub, 7);
  ASSERT_TRUE(pub.flush(2s));
  const std::uint64_t next = pub.stats().next_seq;

  RouterIndex index(index_options());
  SubscriberOptions o;
  o.tail_timeout = scaled(30ms);
  Subscriber sub(index, o);
  sub.add_instance(3, {pub.endpoint(), pub.replay_endpoint()}, Clock::now());
  // Nothing more is published: no gap shows; only wait_for's own replay helps.
  const auto t = Clock::now();
  ASSERT_TRUE(sub.wait_for(3, next, scaled(3s)));
  EXPECT_GE(Clock::now() - t, scaled(30ms));
  EXPECT_EQ(index.blocks_of(3), publisher_set(pub.replay_endpoint()));
  EXPECT_EQ(sub.stats().replay_requests, 1u);
  EXPECT_EQ(sub.stats().replayed_batches, next);
  EXPECT_EQ(sub.stats().messages, 0u);
  EXPECT_EQ(index.counters().gaps, 0u);
}

// The hashes a cache's own snapshot announces (PrefixCache::snapshot), as
// the index keys them.
class SnapshotHashes final : public CacheEventSink {
 public:
  void stored(const EventSource& source, const BlockStoredView& v) noexcept override {
    for (const BlockHash& h : v.hashes)
      blocks.emplace_back(event_hash(h), tier_of_medium(to_string(source.medium)));
  }
  void removed(const EventSource&, std::span<const BlockHash>) noexcept override {}
  void cleared(const EventSource&) noexcept override {}
  Blocks sorted() {
    std::sort(blocks.begin(), blocks.end());
    return blocks;
  }
  Blocks blocks;
};

// Issue 31's core: a publisher whose hand-off queue is tiny drops events
// under a cache's stream of registrations and evictions. The drops show as
// sequence gaps, the replay cannot close them (the ring never had them), the
// snapshot is refused until the cache resyncs the publisher's set, and then
// the router's index of the instance equals the cache's own snapshot.
TEST(SubscriberPublisher, DroppedEventsShowAsGapsAndTheIndexEndsEqualToTheCache) {
  SKIP_SOCKET_TIMING_UNDER_TSAN();
  std::unique_ptr<Backend> backend = make_host_backend(HostBackendOptions{64u << 20});
  KvCacheConfig cfg;
  cfg.num_layers = 1;
  cfg.block_size = kBs;
  cfg.num_kv_heads = 1;
  cfg.head_dim_k = 8;
  cfg.head_dim_v = 8;
  cfg.dtype = KvCacheDtype::bf16;
  PagedKvCache cache(cfg, 24, *backend);
  PrefixCache pc(cache);
  events::PublisherOptions po = publisher_options();
  po.buffer_events = 2;  // the hand-off queue: drops are certain
  po.max_batch_events = 64;
  po.batch_interval = 20ms;
  events::Publisher pub(po);
  pc.set_event_sink(&pub);

  RouterIndex index(index_options());
  SubscriberOptions so;
  so.request_timeout = scaled(200ms);
  so.tail_timeout = scaled(30ms);
  Subscriber sub(index, so);
  sub.add_instance(0, {pub.endpoint(), pub.replay_endpoint()}, Clock::now());

  const StreamView stream = cache.backend().default_stream();
  std::mt19937 rng(31);
  for (int op = 0; op < 600; ++op) {
    // Prompts of one of 12 documents' first 1..4 blocks: registrations,
    // and evictions once the 24 blocks are full.
    std::vector<TokenId> p((1 + rng() % 4) * kBs);
    std::iota(p.begin(), p.end(), static_cast<TokenId>((rng() % 12) * 1000));
    BlockTable t(pc);
    const std::size_t hit = t.reuse_cached_prefix(p, stream);
    const auto rest = std::span<const TokenId>(p).subspan(hit);
    if (t.blocks_needed(rest.size()) <= pc.num_available_blocks()) t.append_tokens(rest, stream);
    if (op % 40 == 39) {  // the thread takes what it holds: live batches between the drops
      ASSERT_TRUE(pub.flush(scaled(2s)));
      sub.poll(1ms);
    }
  }
  const events::PublisherStats mid = pub.stats();
  ASSERT_GT(mid.events_dropped, 0u) << "the test needs drops";
  ASSERT_GE(mid.loss_gaps, 2u) << "and several gaps between live batches";
  // The owner resyncs the publisher's set from the cache (kvport replay and
  // cluster do so between steps when needs_resync()).
  for (int k = 0; k < 10 && pub.needs_resync(); ++k) {
    ASSERT_TRUE(pub.resync([&](CacheEventSink& s) { pc.snapshot(s); }));
    ASSERT_TRUE(pub.flush(scaled(2s)));
  }
  ASSERT_FALSE(pub.needs_resync());
  ASSERT_TRUE(pub.flush(scaled(2s)));
  ASSERT_TRUE(sub.wait_for(0, pub.stats().next_seq, scaled(5s)));

  SnapshotHashes own;
  pc.snapshot(own);
  const Blocks want = own.sorted();
  EXPECT_FALSE(want.empty());
  EXPECT_EQ(index.blocks_of(0), want);
  const events::PublisherStats st = pub.stats();
  EXPECT_GE(st.loss_gaps, 1u);
  EXPECT_GE(st.resyncs, 1u);
  EXPECT_GE(sub.stats().snapshots_applied, 1u) << "the gap was closed by a snapshot";
  EXPECT_GE(sub.stats().replay_misses, 1u) << "the replay cannot hold what was dropped";
  pc.set_event_sink(nullptr);
}

TEST(SubscriberPublisher, RestartedOnTheSamePortsFollowsTheNewStream) {
  SKIP_SOCKET_TIMING_UNDER_TSAN();
  RouterIndex index(index_options());
  SubscriberOptions o;
  o.request_timeout = scaled(300ms);
  o.tail_timeout = scaled(30ms);
  Subscriber sub(index, o);
  std::string events_ep, replay_ep;
  {
    events::Publisher a(publisher_options());
    events_ep = a.endpoint();
    replay_ep = a.replay_endpoint();
    sub.add_instance(1, {events_ep, replay_ep}, Clock::now());
    for (int k = 0; k < 20; ++k) {
      store(a, 100 + 10 * k, 2);
      ASSERT_TRUE(a.flush(2s));
    }
    ASSERT_TRUE(sub.wait_for(1, a.stats().next_seq, scaled(3s)));
    ASSERT_EQ(index.status(1).last_seq, 19u);
    EXPECT_EQ(index.blocks_of(1), publisher_set(replay_ep));
  }
  ASSERT_EQ(sub.stats().restarts, 0u);
  events::Publisher b(publisher_options(events_ep, replay_ep));
  // The new stream starts at seq 0 again; the subscriber reconnects by
  // itself. Its first batches may be lost while it does: the index tells
  // the copies of seqs it applied from a new stream by their later ts.
  for (std::uint64_t k = 0; k < 12 && sub.stats().restarts == 0; ++k) {
    store(b, 9000 + k, 1);
    ASSERT_TRUE(b.flush(2s));
    poll_until(
        sub, [&] { return sub.stats().restarts > 0; }, 40ms);
  }
  ASSERT_GE(sub.stats().restarts, 1u);
  ASSERT_LT(b.stats().next_seq, 20u);
  store(b, 7000, 3, Medium::cpu);
  ASSERT_TRUE(b.flush(2s));
  ASSERT_TRUE(sub.wait_for(1, b.stats().next_seq, scaled(3s)));
  EXPECT_EQ(index.blocks_of(1), publisher_set(replay_ep));
  EXPECT_EQ(index.status(1).last_seq, b.stats().next_seq - 1);
}

// ---- a fake publisher: gaps on purpose ------------------------------------------

TEST(SubscriberFake, GapClosedByTheReplay) {
  SKIP_SOCKET_TIMING_UNDER_TSAN();
  FakePublisher fake;
  RouterIndex index(index_options());
  Subscriber sub(index);
  sub.add_instance(0, fake.endpoints(), Clock::now());
  join(fake, sub, index);

  const EventBatch b1 = batch(1, {stored({11})}, 2.0), b2 = batch(2, {stored({12})}, 3.0),
                   b3 = batch(3, {stored({13})}, 4.0);
  fake.send(b1);
  fake.send(b3);  // 2 skipped
  ASSERT_TRUE(poll_until(sub, [&] { return sub.stats().held == 1; }));
  EXPECT_EQ(index.needs(0), (Need{Need::Kind::replay_from, 2}));
  const auto req = fake.request();
  ASSERT_TRUE(req);
  EXPECT_EQ(req->body, seq_bytes(2));
  EXPECT_EQ(sub.stats().replay_requests, 1u);
  fake.answer(*req, b2);
  fake.answer(*req, b3);
  fake.end(*req);
  ASSERT_TRUE(sub.wait_for(0, 4, scaled(2s)));
  EXPECT_EQ(index.blocks_of(0), gpu({1, 11, 12, 13}));
  // The rest of the answer (b3 again, the terminator) may come later.
  ASSERT_TRUE(poll_until(sub, [&] { return sub.stats().replayed_batches == 2; }));
  sub.poll(20ms);
  const SubscriberStats st = sub.stats();
  EXPECT_EQ(st.replay_misses, 0u);
  EXPECT_GE(st.duplicates, 1u);  // b3 again
  EXPECT_EQ(st.snapshot_requests, 0u);
  // Nothing more is asked.
  EXPECT_FALSE(fake.request(50ms));
}

TEST(SubscriberFake, ReplayMissThenSnapshot) {
  SKIP_SOCKET_TIMING_UNDER_TSAN();
  FakePublisher fake;
  RouterIndex index(index_options());
  Subscriber sub(index);
  sub.add_instance(0, fake.endpoints(), Clock::now());
  join(fake, sub, index);

  fake.send(batch(3, {stored({13})}, 4.0));  // 1 and 2 lost
  ASSERT_TRUE(poll_until(sub, [&] { return sub.stats().held == 1; }));
  auto req = fake.request();
  ASSERT_TRUE(req);
  EXPECT_EQ(req->body, seq_bytes(1));
  // The ring no longer has 1 and 2.
  fake.answer(*req, batch(3, {stored({13})}, 4.0));
  fake.end(*req);
  ASSERT_TRUE(poll_until(sub, [&] { return sub.stats().replay_misses == 1; }));
  req = fake.request();
  ASSERT_TRUE(req);
  EXPECT_EQ(req->body, std::string(events::snapshot_request));
  EXPECT_EQ(sub.stats().snapshot_requests, 1u);
  // Meanwhile batch 5 (after the snapshot's S) arrives live and is held.
  const EventBatch b5 = batch(5, {stored({15})}, 6.5);
  fake.send(b5);
  ASSERT_TRUE(poll_until(sub, [&] { return sub.stats().held == 2; }));
  // The set after batches 0..4: S = 5, stamped when it was taken.
  fake.answer(*req, batch(5, {stored({1}), stored({12}), stored({14})}, 6.0));
  fake.end(*req);
  ASSERT_TRUE(sub.wait_for(0, 6, scaled(2s)));
  EXPECT_EQ(index.blocks_of(0), gpu({1, 12, 14, 15}));
  EXPECT_EQ(sub.stats().snapshots_applied, 1u);
  // A copy of a batch the snapshot contained, still queued: a duplicate, not
  // a restart.
  fake.send(batch(4, {stored({14})}, 5.0));
  fake.send(batch(6, {stored({16})}, 7.0));
  ASSERT_TRUE(sub.wait_for(0, 7, scaled(2s)));
  EXPECT_EQ(index.blocks_of(0), gpu({1, 12, 14, 15, 16}));
  EXPECT_EQ(sub.stats().restarts, 0u);
  EXPECT_EQ(index.counters().restarts, 0u);
}

TEST(SubscriberFake, ReplayTimeoutAsksASnapshotWhichIsAskedAgain) {
  SKIP_SOCKET_TIMING_UNDER_TSAN();
  FakePublisher fake;
  RouterIndex index(index_options());
  SubscriberOptions o;
  o.request_timeout = scaled(100ms);
  Subscriber sub(index, o);
  sub.add_instance(0, fake.endpoints(), Clock::now());
  join(fake, sub, index);

  fake.send(batch(2, {stored({12})}, 3.0));
  ASSERT_TRUE(poll_until(sub, [&] { return sub.stats().replay_requests == 1; }));
  const auto replay = fake.request();
  ASSERT_TRUE(replay);
  EXPECT_EQ(replay->body, seq_bytes(1));
  // No answer: after the timeout, a snapshot (on a new DEALER).
  Subscriber* s = &sub;
  std::optional<Request> snap;
  const auto deadline = Clock::now() + 2s;
  while (!snap && Clock::now() < deadline) {
    s->poll(10ms);
    snap = fake.request(0ms);
  }
  ASSERT_TRUE(snap);
  EXPECT_EQ(snap->body, std::string(events::snapshot_request));
  EXPECT_NE(snap->identity, replay->identity);
  EXPECT_EQ(sub.stats().request_timeouts, 1u);
  EXPECT_EQ(index.needs(0).kind, Need::Kind::snapshot);
  // A late answer to the replay goes to the closed socket: never applied.
  fake.answer(*replay, batch(1, {stored({11})}, 2.0));
  // The snapshot unanswered too: asked again.
  std::optional<Request> again;
  while (!again && Clock::now() < deadline + 1s) {
    s->poll(10ms);
    again = fake.request(0ms);
  }
  ASSERT_TRUE(again);
  EXPECT_EQ(again->body, std::string(events::snapshot_request));
  EXPECT_EQ(sub.stats().request_timeouts, 2u);
  EXPECT_EQ(sub.stats().snapshot_requests, 2u);
  fake.answer(*again, batch(3, {stored({11}), stored({12})}, 3.5));
  fake.end(*again);
  ASSERT_TRUE(sub.wait_for(0, 3, scaled(2s)));
  EXPECT_EQ(index.blocks_of(0), gpu({11, 12}));
  EXPECT_EQ(sub.stats().snapshots_applied, 1u);
  EXPECT_EQ(sub.stats().replayed_batches, 0u);
}

TEST(SubscriberFake, TruncatedAnswerResumedFromWhereItStopped) {
  SKIP_SOCKET_TIMING_UNDER_TSAN();
  FakePublisher fake;
  RouterIndex index(index_options());
  SubscriberOptions o;
  o.tail_timeout = scaled(30ms);  // request_timeout stays 2 s: not waited for
  Subscriber sub(index, o);
  sub.add_instance(0, fake.endpoints(), Clock::now());
  join(fake, sub, index);
  fake.send(batch(5, {stored({15})}, 6.0));
  ASSERT_TRUE(poll_until(sub, [&] { return sub.stats().replay_requests == 1; }));
  auto req = fake.request();
  ASSERT_TRUE(req);
  EXPECT_EQ(req->body, seq_bytes(1));
  // The answer stops after 2, without its terminator (a ROUTER past its
  // high water mark drops the rest).
  fake.answer(*req, batch(1, {stored({11})}, 2.0));
  fake.answer(*req, batch(2, {stored({12})}, 3.0));
  const auto t = Clock::now();
  ASSERT_TRUE(poll_until(
      sub, [&] { return sub.stats().replay_requests == 2; }, 1s));
  EXPECT_LT(Clock::now() - t, 1s);
  EXPECT_EQ(sub.stats().truncated_answers, 1u);
  EXPECT_EQ(sub.stats().request_timeouts, 0u);
  EXPECT_EQ(sub.stats().replay_misses, 0u);
  req = fake.request();
  ASSERT_TRUE(req);
  EXPECT_EQ(req->body, seq_bytes(3));  // from where it stopped
  fake.answer(*req, batch(3, {stored({13})}, 4.0));
  fake.answer(*req, batch(4, {stored({14})}, 5.0));
  fake.end(*req);
  ASSERT_TRUE(sub.wait_for(0, 6, scaled(2s)));
  EXPECT_EQ(index.blocks_of(0), gpu({1, 11, 12, 13, 14, 15}));
  EXPECT_EQ(sub.stats().snapshot_requests, 0u);
}

TEST(SubscriberFake, TailLossAskedByWaitFor) {
  SKIP_SOCKET_TIMING_UNDER_TSAN();
  FakePublisher fake;
  RouterIndex index(index_options());
  SubscriberOptions o;
  o.tail_timeout = scaled(40ms);
  Subscriber sub(index, o);
  sub.add_instance(0, fake.endpoints(), Clock::now());
  join(fake, sub, index);
  fake.send(batch(1, {stored({11})}, 2.0));
  fake.send(batch(2, {stored({12})}, 3.0));
  // Batch 3 lost, and nothing after it: no gap in sight.
  EXPECT_FALSE(sub.wait_for(0, 4, scaled(300ms)));
  EXPECT_EQ(index.status(0).last_seq, 2u);
  EXPECT_EQ(index.needs(0).kind, Need::Kind::nothing);
  const auto req = fake.request(0ms);
  ASSERT_TRUE(req);
  EXPECT_EQ(req->body, seq_bytes(3));
  EXPECT_EQ(sub.stats().replay_requests, 1u);  // one in flight: not asked twice
  fake.answer(*req, batch(3, {stored({13})}, 4.0));
  fake.end(*req);
  ASSERT_TRUE(sub.wait_for(0, 4, scaled(2s)));
  EXPECT_EQ(index.blocks_of(0), gpu({1, 11, 12, 13}));
  EXPECT_EQ(sub.stats().replay_misses, 0u);
}

TEST(SubscriberFake, TailLossTheRingNoLongerHasIsASnapshot) {
  SKIP_SOCKET_TIMING_UNDER_TSAN();
  FakePublisher fake;
  RouterIndex index(index_options());
  SubscriberOptions o;
  o.tail_timeout = scaled(20ms);
  Subscriber sub(index, o);
  sub.add_instance(0, fake.endpoints(), Clock::now());
  join(fake, sub, index);
  EXPECT_FALSE(sub.wait_for(0, 3, scaled(200ms)));
  auto req = fake.request(0ms);
  ASSERT_TRUE(req);
  EXPECT_EQ(req->body, seq_bytes(1));
  fake.answer(*req, batch(2, {stored({12})}, 3.0));  // 1 is gone
  fake.end(*req);
  ASSERT_TRUE(poll_until(sub, [&] { return sub.stats().snapshot_requests == 1; }));
  EXPECT_EQ(sub.stats().replay_misses, 1u);
  req = fake.request();
  ASSERT_TRUE(req);
  fake.answer(*req, batch(3, {stored({12})}, 3.5));
  fake.end(*req);
  ASSERT_TRUE(sub.wait_for(0, 3, scaled(2s)));
  EXPECT_EQ(index.blocks_of(0), gpu({12}));
}

TEST(SubscriberFake, RestartAtSeqZeroClearsTheInstance) {
  SKIP_SOCKET_TIMING_UNDER_TSAN();
  FakePublisher fake;
  RouterIndex index(index_options());
  Subscriber sub(index);
  sub.add_instance(0, fake.endpoints(), Clock::now());
  join(fake, sub, index);
  fake.send(batch(1, {stored({11})}, 2.0));
  ASSERT_TRUE(sub.wait_for(0, 2, scaled(2s)));
  fake.send(batch(0, {stored({50})}, 10.0));  // a new stream
  ASSERT_TRUE(poll_until(sub, [&] { return sub.stats().restarts == 1; }));
  fake.send(batch(1, {stored({51})}, 11.0));
  ASSERT_TRUE(sub.wait_for(0, 2, scaled(2s)));
  EXPECT_EQ(index.blocks_of(0), gpu({50, 51}));
  EXPECT_EQ(sub.stats().replay_requests, 0u);
}

TEST(SubscriberFake, WithoutAReplayEndpointAGapIsCountedAndHeld) {
  SKIP_SOCKET_TIMING_UNDER_TSAN();
  FakePublisher fake;
  RouterIndex index(index_options());
  Subscriber sub(index);
  sub.add_instance(0, fake.endpoints(false), Clock::now());
  join(fake, sub, index);
  fake.send(batch(2, {stored({12})}, 3.0));
  fake.send(batch(3, {stored({13})}, 4.0));
  ASSERT_TRUE(poll_until(sub, [&] { return sub.stats().held == 2; }));
  EXPECT_FALSE(sub.wait_for(0, 4, scaled(100ms)));
  EXPECT_EQ(sub.stats().unserviceable_needs, 1u);  // once, not once a poll
  EXPECT_EQ(sub.stats().replay_requests, 0u);
  EXPECT_EQ(index.status(0).held_batches, 2u);
  EXPECT_FALSE(fake.request(0ms));
  // The missing batch arriving late closes it.
  fake.send(batch(1, {stored({11})}, 2.0));
  ASSERT_TRUE(sub.wait_for(0, 4, scaled(2s)));
  EXPECT_EQ(index.blocks_of(0), gpu({1, 11, 12, 13}));
}

TEST(SubscriberFake, MalformedMessagesAreCountedAndSkipped) {
  SKIP_SOCKET_TIMING_UNDER_TSAN();
  FakePublisher fake;
  RouterIndex index(index_options());
  SubscriberOptions o;
  o.max_message_bytes = 4096;
  Subscriber sub(index, o);
  sub.add_instance(0, fake.endpoints(), Clock::now());
  join(fake, sub, index);
  const std::uint64_t before = sub.stats().messages;
  const std::string good = events::encode_batch(batch(1, {stored({11})}, 2.0));
  fake.send_frames({"only one frame"});
  fake.send_frames({"", seq_bytes(1)});
  fake.send_frames({"", seq_bytes(1).substr(1), good});  // a 7-byte seq
  fake.send_frames({"", seq_bytes(1), "\xc1 not msgpack"});
  fake.send_frames({"", seq_bytes(1), good, "a fourth frame"});
  // [ts, [{"type": "Foo"}], nil]: an event type unknown to the decoder.
  std::string unknown = "\x93\xcb";
  const double ts = 1.5;
  std::uint64_t bits;
  std::memcpy(&bits, &ts, 8);
  for (int k = 7; k >= 0; --k)
    unknown.push_back(static_cast<char>(bits >> (8 * k)));
  unknown +=
      "\x91\x81\xa4type\xa3"
      "Foo\xc0";
  fake.send_frames({"", seq_bytes(1), unknown});
  fake.send_frames({"", seq_bytes(2), good});
  ASSERT_TRUE(poll_until(sub, [&] { return sub.stats().messages == before + 7; }));
  const SubscriberStats st = sub.stats();
  EXPECT_EQ(st.malformed, 5u);
  EXPECT_EQ(st.unknown_events, 1u);
  EXPECT_EQ(index.status(0).last_seq, 2u);  // 1 (no events) and 2 applied
  EXPECT_EQ(index.blocks_of(0), gpu({1, 11}));
}

// ---- hostile publishers: bounded by a counter or an error ------------------------

// A message of 100,000 frames: read frame by frame, all but 4 discarded as
// read, counted; the stream goes on.
TEST(SubscriberHostile, MessageOfEndlessFramesIsCountedAndDiscarded) {
  SKIP_SOCKET_TIMING_UNDER_TSAN();
  FakePublisher fake;
  RouterIndex index(index_options());
  Subscriber sub(index);
  sub.add_instance(0, fake.endpoints(), Clock::now());
  join(fake, sub, index);
  for (int k = 0; k < 100'000; ++k)
    fake.pub.send(zmq::buffer(std::string_view("x")), zmq::send_flags::sndmore);
  fake.pub.send(zmq::buffer(std::string_view("x")), zmq::send_flags::none);
  fake.send(batch(1, {stored({11})}, 2.0));
  ASSERT_TRUE(poll_until(sub, [&] { return index.status(0).last_seq == 1u; }));
  EXPECT_EQ(sub.stats().too_many_parts, 1u);
  EXPECT_EQ(sub.stats().malformed, 1u);
  EXPECT_EQ(index.blocks_of(0), gpu({1, 11}));
}

// A publisher that floods: no poll() handles more than max_poll_messages,
// the rest waits for the next call (counted), and everything applies in
// the end.
TEST(SubscriberHostile, PollDoesAtMostItsBudget) {
  SKIP_SOCKET_TIMING_UNDER_TSAN();
  FakePublisher fake;
  RouterIndex index(index_options());
  SubscriberOptions o;
  o.max_poll_messages = 10;
  // Only the message budget stops a poll here (not a loaded machine's clock).
  o.poll_work_budget = std::chrono::hours(1);
  Subscriber sub(index, o);
  sub.add_instance(0, fake.endpoints(), Clock::now());
  join(fake, sub, index);
  const std::uint64_t stops0 = sub.stats().budget_stops;
  // Exactly one budget's worth: however the polls split it, a budget spent
  // by the last message queued left nothing, and is no stop.
  for (std::uint64_t seq = 1; seq <= 10; ++seq)
    fake.send(batch(seq, {stored({1000 + seq})}, 1.0 + static_cast<double>(seq)));
  auto deadline = Clock::now() + scaled(5s);
  while (index.status(0).last_seq != 10u && Clock::now() < deadline)
    ASSERT_LE(sub.poll(5ms), 10u);
  ASSERT_EQ(index.status(0).last_seq, 10u);
  EXPECT_EQ(sub.stats().budget_stops, stops0);
  // Far more than a budget: some poll does exactly its budget and stops
  // with messages still queued, which later polls take.
  for (std::uint64_t seq = 11; seq <= 200; ++seq)
    fake.send(batch(seq, {stored({1000 + seq})}, 1.0 + static_cast<double>(seq)));
  bool cut = false;
  deadline = Clock::now() + scaled(5s);
  while (index.status(0).last_seq != 200u && Clock::now() < deadline) {
    const std::uint64_t stops = sub.stats().budget_stops;
    const std::size_t handled = sub.poll(5ms);
    ASSERT_LE(handled, 10u);
    if (sub.stats().budget_stops != stops) {
      EXPECT_EQ(handled, 10u) << "a stop only where the budget was spent";
      if (index.status(0).last_seq != 200u) cut = true;
    }
  }
  EXPECT_EQ(index.status(0).last_seq, 200u);
  EXPECT_TRUE(cut) << "the budget cut a poll short with work left";
}

// A frame larger than max_message_bytes is never read: ZeroMQ drops the
// connection that carries it (seen here on the publisher's side as a
// disconnect) and, a protocol error, does not reconnect to that publisher.
TEST(SubscriberHostile, OversizedFrameDisconnectsAndIsNeverRead) {
  SKIP_SOCKET_TIMING_UNDER_TSAN();
  FakePublisher fake;
  ASSERT_EQ(
      zmq_socket_monitor(fake.pub.handle(), "inproc://kvport-pub-monitor", ZMQ_EVENT_DISCONNECTED),
      0);
  zmq::socket_t monitor{fake.ctx, zmq::socket_type::pair};
  monitor.set(zmq::sockopt::linger, 0);
  monitor.set(zmq::sockopt::rcvtimeo, static_cast<int>(scaled(5000ms).count()));
  monitor.connect("inproc://kvport-pub-monitor");
  RouterIndex index(index_options());
  SubscriberOptions o;
  o.max_message_bytes = 4096;
  Subscriber sub(index, o);
  sub.add_instance(0, fake.endpoints(), Clock::now());
  join(fake, sub, index);
  BlockStored big = stored({99});
  big.token_ids.assign(200'000, 100000);  // ~1 MB: far past 4096 bytes
  fake.send(batch(1, {big}, 2.0));
  const std::uint64_t messages = sub.stats().messages;
  std::vector<zmq::message_t> event;
  // Polled while waiting, so the subscriber's side reads what it can.
  bool disconnected = false;
  monitor.set(zmq::sockopt::rcvtimeo, 5);
  const auto deadline = Clock::now() + scaled(5s);
  while (!disconnected && Clock::now() < deadline) {
    sub.poll(5ms);
    event.clear();
    disconnected = zmq::recv_multipart(monitor, std::back_inserter(event)).has_value();
  }
  EXPECT_TRUE(disconnected) << "ZeroMQ refuses the frame by dropping the connection";
  EXPECT_EQ(sub.stats().messages, messages) << "the large frame was never received";
  // ZeroMQ does not reconnect after a protocol error: the instance is
  // silent from here (expired by instance_timeout, docs/reliability.md).
  // Past ZeroMQ's reconnect interval (100 ms), scaled for slow machines.
  const auto quiet_until = Clock::now() + scaled(400ms);
  for (int k = 0; k < 40 || Clock::now() < quiet_until; ++k) {
    fake.send(batch(2, {stored({12})}, 3.0));
    sub.poll(10ms);
  }
  EXPECT_EQ(sub.stats().messages, messages);
  EXPECT_EQ(sub.stats().malformed, 0u);
  EXPECT_EQ(index.blocks_of(0), gpu({1}));
}

TEST(SubscriberFake, MalformedReplayAnswersAreCountedAndTheMissAsksASnapshot) {
  SKIP_SOCKET_TIMING_UNDER_TSAN();
  FakePublisher fake;
  RouterIndex index(index_options());
  Subscriber sub(index);
  sub.add_instance(0, fake.endpoints(), Clock::now());
  join(fake, sub, index);
  fake.send(batch(2, {stored({12})}, 3.0));
  ASSERT_TRUE(poll_until(sub, [&] { return sub.stats().replay_requests == 1; }));
  auto req = fake.request();
  ASSERT_TRUE(req);
  fake.router.send(zmq::buffer(req->identity), zmq::send_flags::sndmore);
  fake.router.send(zmq::buffer(std::string("one frame")), zmq::send_flags::none);
  fake.answer(*req, 1, "garbage");
  fake.end(*req);
  ASSERT_TRUE(poll_until(sub, [&] { return sub.stats().snapshot_requests == 1; }));
  EXPECT_EQ(sub.stats().malformed, 2u);
  EXPECT_EQ(sub.stats().replay_misses, 1u);
}

TEST(SubscriberFake, ExpiredInstanceBroughtBackByASnapshot) {
  SKIP_SOCKET_TIMING_UNDER_TSAN();
  FakePublisher fake;
  IndexOptions io = index_options();
  io.instance_timeout = scaled(150ms);
  RouterIndex index(io);
  Subscriber sub(index);
  sub.add_instance(0, fake.endpoints(), Clock::now());
  join(fake, sub, index);
  fake.send(batch(1, {stored({11})}, 2.0));
  ASSERT_TRUE(sub.wait_for(0, 2, scaled(2s)));
  // Silent: poll's expire drops it; it needs a snapshot, which is asked.
  ASSERT_TRUE(poll_until(sub, [&] { return sub.stats().snapshot_requests == 1; }));
  EXPECT_FALSE(index.status(0).active);
  EXPECT_TRUE(index.blocks_of(0).empty());
  const auto req = fake.request();
  ASSERT_TRUE(req);
  EXPECT_EQ(req->body, std::string(events::snapshot_request));
  fake.answer(*req, batch(2, {stored({1}), stored({11})}, 2.5));
  fake.end(*req);
  ASSERT_TRUE(sub.wait_for(0, 2, scaled(2s)));
  EXPECT_TRUE(index.status(0).active);
  EXPECT_EQ(index.blocks_of(0), gpu({1, 11}));
  EXPECT_EQ(index.status(0).last_seq, 1u);  // the set after batch S - 1
  fake.send(batch(2, {stored({12})}, 3.0));
  ASSERT_TRUE(sub.wait_for(0, 3, scaled(2s)));
  EXPECT_EQ(index.blocks_of(0), gpu({1, 11, 12}));
}

TEST(SubscriberFake, SnapshotOfAnEmptyStreamAndAPublisherWithoutSnapshots) {
  SKIP_SOCKET_TIMING_UNDER_TSAN();
  FakePublisher fake;
  RouterIndex index(index_options());
  SubscriberOptions o;
  o.request_timeout = scaled(150ms);
  Subscriber sub(index, o);
  sub.add_instance(0, fake.endpoints(), Clock::now());
  join(fake, sub, index);
  fake.send(batch(2, {stored({12})}, 3.0));
  ASSERT_TRUE(poll_until(sub, [&] { return sub.stats().replay_requests == 1; }));
  auto req = fake.request();
  ASSERT_TRUE(req);
  fake.end(*req);  // an empty ring: a miss
  ASSERT_TRUE(poll_until(sub, [&] { return sub.stats().snapshot_requests == 1; }));
  req = fake.request();
  ASSERT_TRUE(req);
  // A publisher without snapshots (vLLM's) answers the terminator alone: asked
  // again, but not before a request_timeout passed, and no timeout counted.
  const auto t = Clock::now();
  fake.end(*req);
  ASSERT_TRUE(poll_until(sub, [&] { return sub.stats().snapshot_requests == 2; }));
  EXPECT_GE(Clock::now() - t, 50ms);
  EXPECT_EQ(sub.stats().request_timeouts, 0u);
  req = fake.request();
  ASSERT_TRUE(req);
  // S = 0: nothing published (the stream restarted): from seq 0 again.
  fake.answer(*req, batch(0, {}, 5.0));
  fake.end(*req);
  ASSERT_TRUE(poll_until(sub, [&] { return sub.stats().snapshots_applied == 1; }));
  EXPECT_EQ(index.needs(0).kind, Need::Kind::nothing);
  EXPECT_FALSE(index.status(0).last_seq);
  EXPECT_TRUE(index.blocks_of(0).empty());
  fake.send(batch(0, {stored({70})}, 6.0));
  ASSERT_TRUE(sub.wait_for(0, 1, scaled(2s)));
  EXPECT_EQ(index.blocks_of(0), gpu({70}));
}

// ---- instances and errors -----------------------------------------------------

TEST(SubscriberApi, RemoveInstanceDisconnects) {
  SKIP_SOCKET_TIMING_UNDER_TSAN();
  FakePublisher fake;
  RouterIndex index(index_options());
  Subscriber sub(index);
  sub.add_instance(5, fake.endpoints(), Clock::now());
  join(fake, sub, index, 5);
  sub.remove_instance(5);
  EXPECT_FALSE(index.has_instance(5));
  const std::uint64_t messages = sub.stats().messages;
  fake.send(batch(1, {stored({11})}, 2.0));
  const auto t = Clock::now();
  EXPECT_EQ(sub.poll(50ms), 0u);
  EXPECT_GE(Clock::now() - t, 50ms);  // no instance: it waits, never spins
  EXPECT_EQ(sub.stats().messages, messages);
  EXPECT_THROW(sub.remove_instance(5), InvalidArgument);
  EXPECT_THROW(sub.wait_for(5, 1, scaled(10ms)), InvalidArgument);
  // The id can be added again: a new stream from seq 0.
  sub.add_instance(5, fake.endpoints(), Clock::now());
  EXPECT_TRUE(index.has_instance(5));
  EXPECT_FALSE(index.status(5).last_seq);
}

TEST(SubscriberApi, BadOptionsThrow) {
  SKIP_SOCKET_TIMING_UNDER_TSAN();
  RouterIndex index(index_options());
  auto with = [](auto edit) {
    SubscriberOptions o;
    edit(o);
    return o;
  };
  EXPECT_THROW(Subscriber(index, with([](auto& o) { o.request_timeout = 0ms; })), InvalidArgument);
  EXPECT_THROW(Subscriber(index, with([](auto& o) { o.request_timeout = -5ms; })), InvalidArgument);
  EXPECT_THROW(Subscriber(index, with([](auto& o) { o.tail_timeout = 0ms; })), InvalidArgument);
  EXPECT_THROW(Subscriber(index, with([](auto& o) { o.max_message_bytes = 0; })), InvalidArgument);
  EXPECT_THROW(Subscriber(index, with([](auto& o) { o.receive_high_water_mark = -1; })),
               InvalidArgument);
  EXPECT_THROW(Subscriber(index, with([](auto& o) { o.receive_high_water_mark = 0; })),
               InvalidArgument);
  EXPECT_THROW(Subscriber(index, with([](auto& o) { o.max_snapshot_bytes = 0; })), InvalidArgument);
  EXPECT_THROW(Subscriber(index, with([](auto& o) { o.max_poll_messages = 0; })), InvalidArgument);
  EXPECT_THROW(Subscriber(index, with([](auto& o) { o.max_poll_bytes = 0; })), InvalidArgument);
  EXPECT_THROW(Subscriber(index, with([](auto& o) { o.poll_work_budget = 0ms; })), InvalidArgument);
  EXPECT_NO_THROW(Subscriber(index, with([](auto& o) { o.topic = "kv@"; })));
}

TEST(SubscriberApi, BadEndpointsAndIdsThrowAndAddNothing) {
  SKIP_SOCKET_TIMING_UNDER_TSAN();
  RouterIndex index(index_options());
  Subscriber sub(index);
  const auto now = Clock::now();
  const std::string ok = "tcp://127.0.0.1:5999";
  for (const std::string bad : {"", "bogus://x", "tcp://127.0.0.1", "tcp://127.0.0.1:0",
                                "tcp://127.0.0.1:99999", "tcp://127.0.0.1:12ab", "tcp://"}) {
    EXPECT_THROW(sub.add_instance(0, {bad, ""}, now), InvalidArgument) << bad;
    if (!bad.empty()) {
      EXPECT_THROW(sub.add_instance(0, {ok, bad}, now), InvalidArgument) << bad;
    }
    EXPECT_FALSE(index.has_instance(0)) << bad;
  }
  sub.add_instance(0, {ok, ""}, now);
  EXPECT_THROW(sub.add_instance(0, {ok, ""}, now), InvalidArgument);  // known here
  index.add_instance(1, now);
  EXPECT_THROW(sub.add_instance(1, {ok, ""}, now), InvalidArgument);  // known to the index
  EXPECT_THROW(sub.add_instance(kMaxInstances, {ok, ""}, now), InvalidArgument);
  EXPECT_EQ(sub.poll(0ms), 0u);
}

TEST(SubscriberApi, SilentInstanceExpiredByPoll) {
  SKIP_SOCKET_TIMING_UNDER_TSAN();
  IndexOptions io = index_options();
  io.instance_timeout = scaled(20ms);
  RouterIndex index(io);
  Subscriber sub(index);
  EXPECT_EQ(sub.poll(0ms), 0u);
  FakePublisher fake;
  sub.add_instance(0, fake.endpoints(false), Clock::now());
  join(fake, sub, index);
  // Silent: dropped by poll's expire, then needs a snapshot nothing can give.
  ASSERT_TRUE(poll_until(
      sub, [&] { return !index.status(0).active; }, 1s));
  EXPECT_EQ(index.needs(0).kind, Need::Kind::snapshot);
  EXPECT_TRUE(index.blocks_of(0).empty());
  EXPECT_GE(sub.stats().unserviceable_needs, 1u);
}

}  // namespace
}  // namespace kvport::router
