// SPDX-License-Identifier: Apache-2.0
// The publisher over tcp://127.0.0.1: frames and sequence numbers as vLLM
// sends them, dropping when the buffer is full (never blocking), replay from
// a sequence, a replay miss, and snapshots equal to the set the events build.
#include "kvport/events/publisher.hpp"

#include <gtest/gtest.h>

#include <map>
#include <random>
#include <set>
#include <stdexcept>
#include <thread>
#include <tuple>
#include <zmq.hpp>
#include <zmq_addon.hpp>

#include "kvport/platform/error.hpp"
#include "kvport/testing/time_scale.hpp"

namespace kvport::events {
namespace {

using namespace std::chrono_literals;
using kvport::testing::scaled;

PublisherOptions local_options() {
  PublisherOptions o;
  o.endpoint = "tcp://127.0.0.1:0";
  o.batch_interval = 2ms;
  return o;
}

BlockHash bh(std::uint64_t low) {
  return BlockHash{low, ~low};
}

BlockStoredView view(std::span<const BlockHash> hashes, std::optional<BlockHash> parent,
                     std::span<const TokenId> tokens, std::uint32_t block_size) {
  BlockStoredView v;
  v.hashes = hashes;
  v.parent = parent;
  v.tokens = tokens;
  v.block_size = block_size;
  return v;
}

// A SUB socket connected to `endpoint`, ready once the publisher sees it
// (ZeroMQ's slow joiner: wait until a probe batch arrives).
struct Subscriber {
  zmq::context_t ctx{1};
  zmq::socket_t sub{ctx, zmq::socket_type::sub};
  // `rcvhwm`: ZeroMQ's queue on this side (a SUB whose application never
  // reads still has its I/O thread fill this queue).
  Subscriber(const std::string& endpoint, const std::string& topic, int rcvhwm = 1000) {
    sub.set(zmq::sockopt::linger, 0);
    sub.set(zmq::sockopt::rcvhwm, rcvhwm);
    sub.set(zmq::sockopt::rcvbuf, rcvhwm < 1000 ? 64 << 10 : -1);
    sub.set(zmq::sockopt::rcvtimeo, static_cast<int>(scaled(2000ms).count()));
    sub.set(zmq::sockopt::subscribe, topic);
    sub.connect(endpoint);
  }
  // One message; empty when nothing arrived within the timeout.
  std::vector<zmq::message_t> recv() {
    std::vector<zmq::message_t> frames;
    (void)zmq::recv_multipart(sub, std::back_inserter(frames));
    return frames;
  }
};

std::string as_string(const zmq::message_t& m) {
  return std::string(m.data<char>(), m.size());
}
std::uint64_t seq_of(const zmq::message_t& m) {
  return decode_seq(std::as_bytes(std::span(m.data<char>(), m.size()))).value_or(~0ull - 1);
}

// Waits out the slow joiner: publishes "cleared" probes until one arrives.
// Returns the next sequence expected after the probes.
std::uint64_t join(Publisher& pub, Subscriber& s) {
  s.sub.set(zmq::sockopt::rcvtimeo, 50);
  for (int k = 0; k < 100; ++k) {
    pub.cleared(EventSource{});
    EXPECT_TRUE(pub.flush(scaled(2s)));
    auto frames = s.recv();
    if (!frames.empty()) {
      s.sub.set(zmq::sockopt::rcvtimeo, static_cast<int>(scaled(2000ms).count()));
      // Drain probes still queued.
      std::uint64_t next = seq_of(frames[1]) + 1;
      while (next < pub.stats().next_seq) {
        auto more = s.recv();
        if (more.empty()) break;
        next = seq_of(more[1]) + 1;
      }
      return next;
    }
  }
  ADD_FAILURE() << "subscriber never joined";
  return 0;
}

class PublisherForms : public ::testing::TestWithParam<EventForm> {};

TEST_P(PublisherForms, ThreeFramesContiguousSequenceFromZero) {
  PublisherOptions o = local_options();
  o.topic = "kv@test";
  o.form = GetParam();
  o.max_batch_events = 3;
  o.data_parallel_rank = 2;
  Publisher pub(o);
  ASSERT_TRUE(pub.endpoint().starts_with("tcp://127.0.0.1:"));
  ASSERT_NE(pub.endpoint(), "tcp://127.0.0.1:0");
  Subscriber s(pub.endpoint(), o.topic);
  std::uint64_t expect_seq = join(pub, s);
  ASSERT_GT(expect_seq, 0u);

  const std::vector<BlockHash> hashes = {bh(11), bh(12)};
  const std::vector<TokenId> tokens = {1, 2, 3, 4};
  EventSource src{Medium::cpu, 1u, std::string("sliding_window"), 128u};
  for (int k = 0; k < 10; ++k) {
    pub.stored(src, BlockStoredView{hashes, bh(10), tokens, 2, std::string_view("lora")});
  }
  pub.removed(src, hashes);
  ASSERT_TRUE(pub.flush(scaled(2s)));

  std::vector<CacheEvent> got;
  while (got.size() < 11) {
    auto frames = s.recv();
    ASSERT_EQ(frames.size(), 3u);
    EXPECT_EQ(as_string(frames[0]), o.topic);
    ASSERT_EQ(frames[1].size(), 8u);
    EXPECT_EQ(seq_of(frames[1]), expect_seq++);
    const DecodeResult r = decode_batch(as_string(frames[2]));
    ASSERT_TRUE(r.ok()) << r.error;
    EXPECT_EQ(r.batch->data_parallel_rank, 2);
    EXPECT_LE(r.batch->events.size(), 3u);
    EXPECT_GT(r.batch->ts, 1.7e9);
    for (auto& e : r.batch->events)
      got.push_back(e);
  }
  BlockStored want;
  want.block_hashes = {11, 12};
  want.parent_block_hash = 10;
  want.token_ids = tokens;
  want.block_size = 2;
  want.medium = "CPU";
  want.lora_name = "lora";
  want.group_idx = 1;
  want.kv_cache_spec_kind = "sliding_window";
  want.kv_cache_spec_sliding_window = 128;
  for (int k = 0; k < 10; ++k)
    EXPECT_EQ(std::get<BlockStored>(got[k]), want);
  EXPECT_EQ(std::get<BlockRemoved>(got[10]), (BlockRemoved{{11, 12}, "CPU", 1u}));
  const PublisherStats st = pub.stats();
  EXPECT_EQ(st.events_dropped, 0u);
  EXPECT_EQ(st.send_failures, 0u);
  EXPECT_EQ(st.batches_sent, st.next_seq);
}

INSTANTIATE_TEST_SUITE_P(Both, PublisherForms,
                         ::testing::Values(EventForm::map, EventForm::positional));

TEST(Publisher, FullBufferDropsCountedWithoutBlocking) {
  PublisherOptions o = local_options();
  o.buffer_events = 4;
  o.batch_interval = 10s;  // the thread takes nothing until flush or a full batch
  o.max_batch_events = 1000;
  Publisher pub(o);  // no subscriber at all
  const std::vector<BlockHash> hashes = {bh(1)};
  const std::vector<TokenId> tokens = {1};
  const auto t0 = std::chrono::steady_clock::now();
  for (int k = 0; k < 1000; ++k)
    pub.stored(EventSource{}, view(hashes, std::nullopt, tokens, 1));
  EXPECT_LT(std::chrono::steady_clock::now() - t0, 1s);
  PublisherStats st = pub.stats();
  EXPECT_EQ(st.events_accepted, 4u);
  EXPECT_EQ(st.events_dropped, 996u);
  ASSERT_TRUE(pub.flush(scaled(2s)));
  st = pub.stats();
  // One batch of the four (seq 0), one sequence number skipped for the 996
  // dropped (seq 1: a gap), and an empty batch (seq 2) that shows the gap
  // now rather than at the next event.
  EXPECT_EQ(st.next_seq, 3u);
  EXPECT_EQ(st.loss_gaps, 1u);
  EXPECT_EQ(st.batches_sent + st.send_failures, 2u);
}

TEST(Publisher, ByteBoundDrops) {
  PublisherOptions o = local_options();
  o.buffer_bytes = 1000;
  o.batch_interval = 10s;
  o.max_batch_events = 1000;
  Publisher pub(o);
  const std::vector<BlockHash> hashes(100, bh(1));  // 64 + 800 bytes: one fits
  const std::vector<TokenId> tokens(100, 7);
  pub.stored(EventSource{}, view(hashes, std::nullopt, tokens, 1));
  pub.stored(EventSource{}, view(hashes, std::nullopt, tokens, 1));
  EXPECT_EQ(pub.stats().events_accepted, 0u + (64 + 800 + 400 <= 1000));
  EXPECT_GE(pub.stats().events_dropped, 1u);
}

TEST(Publisher, BadOptionsAreInvalidArgument) {
  auto bad = [](auto tweak) {
    PublisherOptions o = local_options();
    tweak(o);
    EXPECT_THROW(Publisher{o}, InvalidArgument);
  };
  bad([](PublisherOptions& o) { o.buffer_events = 0; });
  bad([](PublisherOptions& o) { o.buffer_bytes = 0; });
  bad([](PublisherOptions& o) { o.max_batch_events = 0; });
  bad([](PublisherOptions& o) { o.endpoint = "nonsense"; });
  bad([](PublisherOptions& o) { o.endpoint = ""; });
  bad([](PublisherOptions& o) { o.endpoint = "tcp://127.0.0.1:notaport"; });
  // ZeroMQ itself would bind port 99999 modulo 65536.
  bad([](PublisherOptions& o) { o.endpoint = "tcp://127.0.0.1:99999"; });
  bad([](PublisherOptions& o) { o.replay_endpoint = "tcp://127.0.0.1:65536"; });
  bad([](PublisherOptions& o) { o.endpoint = "tcp://127.0.0.1:-1"; });
  bad([](PublisherOptions& o) {
    o.replay_endpoint = "tcp://127.0.0.1:0";
    o.replay_ring_batches = 0;
  });
  bad([](PublisherOptions& o) { o.replay_endpoint = "bogus://x"; });
  bad([](PublisherOptions& o) { o.max_batch_bytes = 0; });
  bad([](PublisherOptions& o) { o.send_queue_bytes = 0; });
  for (auto tweak : std::vector<void (*)(PublisherOptions&)>{
           [](PublisherOptions& o) { o.replay_ring_bytes = 0; },
           [](PublisherOptions& o) { o.max_requests_per_second = 0; },
           [](PublisherOptions& o) { o.max_pending_answers = 0; },
           [](PublisherOptions& o) { o.answer_timeout = 0ms; },
           [](PublisherOptions& o) { o.snapshot_interval = -1ms; }}) {
    bad([&](PublisherOptions& o) {
      o.replay_endpoint = "tcp://127.0.0.1:0";
      tweak(o);
    });
  }
  // Dynamo reads the rank as an i32: a rank past it is refused, naming it.
  bad([](PublisherOptions& o) { o.data_parallel_rank = std::int64_t{1} << 31; });
  bad([](PublisherOptions& o) { o.data_parallel_rank = -1; });
  try {
    PublisherOptions o = local_options();
    o.data_parallel_rank = std::int64_t{1} << 31;
    Publisher p(o);
    ADD_FAILURE() << "rank 2^31 accepted";
  } catch (const InvalidArgument& e) {
    EXPECT_NE(std::string(e.what()).find("i32"), std::string::npos) << e.what();
  }
  {
    PublisherOptions o = local_options();
    o.data_parallel_rank = INT32_MAX;  // the largest Dynamo reads
    EXPECT_NO_THROW(Publisher{o});
  }
  // A port already bound.
  Publisher first(local_options());
  PublisherOptions o = local_options();
  o.endpoint = first.endpoint();
  try {
    Publisher second(o);
    ADD_FAILURE() << "bound twice";
  } catch (const InvalidArgument& e) {
    EXPECT_NE(std::string(e.what()).find(first.endpoint()), std::string::npos) << e.what();
  }
}

// A DEALER that asks the replay socket as vLLM's clients do ([ "", request ]).
struct ReplayClient {
  zmq::context_t ctx{1};
  zmq::socket_t s{ctx, zmq::socket_type::dealer};
  explicit ReplayClient(const std::string& endpoint) {
    s.set(zmq::sockopt::linger, 0);
    s.set(zmq::sockopt::rcvtimeo, static_cast<int>(scaled(2000ms).count()));
    s.connect(endpoint);
  }
  // [(seq, payload)...] up to the terminator; fails the test without one.
  std::vector<std::pair<std::uint64_t, std::string>> ask(std::string_view request) {
    s.send(zmq::buffer(std::string_view()), zmq::send_flags::sndmore);
    s.send(zmq::buffer(request), zmq::send_flags::none);
    std::vector<std::pair<std::uint64_t, std::string>> out;
    for (int k = 0; k < 100000; ++k) {
      std::vector<zmq::message_t> f;
      if (!zmq::recv_multipart(s, std::back_inserter(f))) {
        ADD_FAILURE() << "no terminator";
        return out;
      }
      EXPECT_EQ(f.size(), 3u);
      if (f.size() != 3) return out;
      EXPECT_EQ(f[0].size(), 0u);
      const std::uint64_t seq = seq_of(f[1]);
      if (seq == end_of_replay_seq) {
        EXPECT_EQ(f[2].size(), 0u);
        return out;
      }
      out.emplace_back(seq, as_string(f[2]));
    }
    return out;
  }
  std::vector<std::pair<std::uint64_t, std::string>> replay(std::uint64_t start) {
    const auto f = encode_seq(start);
    return ask(std::string_view(reinterpret_cast<const char*>(f.data()), f.size()));
  }
};

TEST(Publisher, ReplayFromASequenceAndAMiss) {
  PublisherOptions o = local_options();
  o.max_batch_events = 1;
  o.replay_endpoint = "tcp://127.0.0.1:0";
  o.replay_ring_batches = 5;
  Publisher pub(o);
  ASSERT_TRUE(pub.replay_endpoint().starts_with("tcp://127.0.0.1:"));
  const std::vector<TokenId> tokens = {1};
  for (std::uint64_t k = 0; k < 8; ++k) {
    const std::vector<BlockHash> hashes = {bh(100 + k)};
    pub.stored(EventSource{}, view(hashes, std::nullopt, tokens, 1));
  }
  ASSERT_TRUE(pub.flush(scaled(2s)));
  ASSERT_EQ(pub.stats().next_seq, 8u);
  ReplayClient c(pub.replay_endpoint());
  auto got = c.replay(5);
  ASSERT_EQ(got.size(), 3u);
  for (std::size_t k = 0; k < got.size(); ++k) {
    EXPECT_EQ(got[k].first, 5 + k);
    const DecodeResult r = decode_batch(got[k].second);
    ASSERT_TRUE(r.ok()) << r.error;
    EXPECT_EQ(std::get<BlockStored>(r.batch->events.at(0)).block_hashes.at(0), 105 + k);
  }
  // Older than the ring (seq 3..7 kept): what is kept, starting later than asked.
  got = c.replay(0);
  ASSERT_EQ(got.size(), 5u);
  EXPECT_EQ(got.front().first, 3u);
  // Past the end: only the terminator.
  EXPECT_TRUE(c.replay(100).empty());
  // Neither form: the terminator, counted.
  EXPECT_TRUE(c.ask("what?").empty());
  const PublisherStats st = pub.stats();
  EXPECT_EQ(st.replay_requests, 3u);
  EXPECT_EQ(st.bad_requests, 1u);
}

// The set a snapshot answer holds: (hash, medium) of each BlockStored.
std::set<std::pair<std::uint64_t, std::string>> snapshot_set(const std::string& payload) {
  std::set<std::pair<std::uint64_t, std::string>> out;
  const DecodeResult r = decode_batch(payload);
  EXPECT_TRUE(r.ok()) << r.error;
  if (!r.ok()) return out;
  for (const CacheEvent& e : r.batch->events)
    for (auto h : std::get<BlockStored>(e).block_hashes)
      out.emplace(h, std::get<BlockStored>(e).medium);
  return out;
}

// A drop is never hidden: the sequence skips a number exactly where events
// are missing (the ring never has it), the snapshot is refused while it
// would not be exact, and a resync from the cache's own set makes it exact
// again at that point of the stream.
TEST(Publisher, DropsSkipASequenceNumberAndSnapshotsWaitForAResync) {
  PublisherOptions o = local_options();
  o.buffer_events = 1;     // the hand-off queue: every second event drops
  o.batch_interval = 10s;  // nothing is taken before flush()
  o.max_batch_events = 100;
  o.replay_endpoint = "tcp://127.0.0.1:0";
  Publisher pub(o);
  const std::vector<TokenId> tokens = {1};
  auto put = [&](std::uint64_t h) {
    const std::vector<BlockHash> hs = {bh(h)};
    pub.stored(EventSource{}, view(hs, std::nullopt, tokens, 1));
  };
  put(1);  // accepted
  put(2);  // dropped: the cache holds 1 and 2, the stream will say only 1
  put(3);  // dropped: one gap for the run
  EXPECT_TRUE(pub.needs_resync());
  ASSERT_TRUE(pub.flush(scaled(2s)));
  PublisherStats st = pub.stats();
  EXPECT_EQ(st.events_accepted, 1u);
  EXPECT_EQ(st.events_dropped, 2u);
  EXPECT_EQ(st.loss_gaps, 1u);
  ASSERT_EQ(st.next_seq, 3u);  // 0: event 1; 1: skipped; 2: empty, shows the gap
  ReplayClient c(pub.replay_endpoint());
  auto got = c.replay(0);
  ASSERT_EQ(got.size(), 2u);
  EXPECT_EQ(got[0].first, 0u);
  EXPECT_EQ(got[1].first, 2u) << "seq 1 is the dropped events' gap: never sent, never kept";
  const DecodeResult empty = decode_batch(got[1].second);
  ASSERT_TRUE(empty.ok()) << empty.error;
  EXPECT_TRUE(empty.batch->events.empty());
  // The set it keeps misses block 2 and 3: no snapshot rather than a wrong one.
  EXPECT_TRUE(c.ask(snapshot_request).empty());
  EXPECT_EQ(pub.stats().snapshots_unavailable, 1u);

  // The cache re-announces what it holds (1, 2, 3); the publisher's set is
  // that from here on.
  ASSERT_TRUE(pub.resync([&](CacheEventSink& sink) {
    for (std::uint64_t h : {1, 2, 3}) {
      const std::vector<BlockHash> hs = {bh(h)};
      sink.stored(EventSource{}, view(hs, std::nullopt, tokens, 1));
    }
  }));
  EXPECT_FALSE(pub.needs_resync());
  ASSERT_TRUE(pub.flush(scaled(2s)));  // the marker holds the buffer's one slot
  put(4);
  ASSERT_TRUE(pub.flush(scaled(2s)));
  st = pub.stats();
  EXPECT_EQ(st.resyncs, 1u);
  EXPECT_EQ(st.events_accepted, 2u) << "markers are not events";
  EXPECT_EQ(st.next_seq, 4u);
  got = c.ask(snapshot_request);
  ASSERT_EQ(got.size(), 1u);
  EXPECT_EQ(got[0].first, 4u);
  const std::set<std::pair<std::uint64_t, std::string>> want = {
      {1, "GPU"}, {2, "GPU"}, {3, "GPU"}, {4, "GPU"}};
  EXPECT_EQ(snapshot_set(got[0].second), want);

  // A throwing announce changes nothing and leaves the need.
  put(5);
  put(6);  // dropped
  ASSERT_TRUE(pub.needs_resync());
  EXPECT_THROW(pub.resync([](CacheEventSink&) { throw std::runtime_error("cache gone"); }),
               std::runtime_error);
  EXPECT_TRUE(pub.needs_resync());
}

// Without a replay endpoint no set is kept: drops still skip a sequence
// number, and there is nothing to resync.
TEST(Publisher, DropsWithoutReplaySocketStillShowAGap) {
  PublisherOptions o = local_options();
  o.buffer_events = 1;
  o.batch_interval = 10s;
  Publisher pub(o);
  const std::vector<TokenId> tokens = {1};
  const std::vector<BlockHash> hs = {bh(1)};
  for (int k = 0; k < 3; ++k)
    pub.stored(EventSource{}, view(hs, std::nullopt, tokens, 1));
  EXPECT_FALSE(pub.needs_resync());
  EXPECT_TRUE(pub.resync([](CacheEventSink&) { FAIL() << "not called without a set"; }));
  ASSERT_TRUE(pub.flush(scaled(2s)));
  EXPECT_EQ(pub.stats().loss_gaps, 1u);
  EXPECT_EQ(pub.stats().next_seq, 3u);
}

// A replay longer than ZeroMQ's default high water mark (1,000 messages)
// arrives whole, terminator included.
TEST(Publisher, ReplayOfTheWholeRingArrivesWhole) {
  PublisherOptions o = local_options();
  o.max_batch_events = 1;
  o.replay_endpoint = "tcp://127.0.0.1:0";
  o.replay_ring_batches = 3000;
  Publisher pub(o);
  const std::vector<TokenId> tokens = {1};
  for (std::uint64_t k = 0; k < 3000; ++k) {
    const std::vector<BlockHash> hashes = {bh(1000 + k)};
    pub.stored(EventSource{}, view(hashes, std::nullopt, tokens, 1));
  }
  ASSERT_TRUE(pub.flush(scaled(5s)));
  ASSERT_EQ(pub.stats().next_seq, 3000u);
  ReplayClient c(pub.replay_endpoint());
  const auto got = c.replay(0);
  ASSERT_EQ(got.size(), 3000u);
  for (std::size_t k = 0; k < got.size(); ++k)
    ASSERT_EQ(got[k].first, k);
}

// Every event of a group source carries the group's kind, removals and
// clears included (Dynamo indexes groups by kind and applies removals by
// it), in both forms; the decoder reads such a batch as before.
TEST(Publisher, EveryEventOfAGroupCarriesItsKind) {
  for (EventForm form : {EventForm::map, EventForm::positional}) {
    PublisherOptions o = local_options();
    o.form = form;
    o.replay_endpoint = "tcp://127.0.0.1:0";
    o.batch_interval = 10s;
    Publisher pub(o);
    EventSource src;
    src.group_idx = 1;
    src.spec_kind = "full_attention";
    const std::vector<BlockHash> hs = {bh(1), bh(2)};
    const std::vector<TokenId> tokens = {1, 2};
    pub.stored(src, view(hs, std::nullopt, tokens, 1));
    pub.removed(src, std::span(hs).first(1));
    pub.cleared(src);
    ASSERT_TRUE(pub.flush(scaled(2s)));
    ReplayClient c(pub.replay_endpoint());
    const auto got = c.replay(0);
    ASSERT_EQ(got.size(), 1u);
    const std::string& payload = got[0].second;
    std::size_t kinds = 0;
    for (std::size_t at = payload.find("full_attention"); at != std::string::npos;
         at = payload.find("full_attention", at + 1))
      ++kinds;
    EXPECT_EQ(kinds, 3u) << "stored, removed and cleared each name the kind";
    const DecodeResult r = decode_batch(payload);
    ASSERT_TRUE(r.ok()) << r.error;
    ASSERT_EQ(r.batch->events.size(), 3u);
    EXPECT_EQ(std::get<BlockRemoved>(r.batch->events[1]).group_idx, 1u);
    EXPECT_EQ(std::get<AllBlocksCleared>(r.batch->events[2]).group_idx, 1u);
  }
}

// ---- hostile peers: every bound proven by a counter ------------------------------

// Batches of one event of `tokens` large token ids (5 bytes each on the wire).
void store_big(Publisher& pub, std::uint64_t hash, std::size_t tokens) {
  const std::vector<BlockHash> hs = {bh(hash)};
  const std::vector<TokenId> toks(tokens, 0x7fff'0000u);
  pub.stored(EventSource{}, view(hs, std::nullopt, toks, static_cast<std::uint32_t>(tokens)));
}

// 400 batches of one 12,000-token block (~60 KB each, 24 MB): more than the
// kernel's socket buffers hold.
void store_24_mb(Publisher& pub) {
  for (std::uint64_t k = 0; k < 400; ++k)
    store_big(pub, k, 12'000);
}

// A replay client on `endpoint` that queues at most one frame: what it does
// not read stays in the publisher's queue for it.
zmq::socket_t one_frame_dealer(zmq::context_t& ctx, const std::string& endpoint) {
  zmq::socket_t d{ctx, zmq::socket_type::dealer};
  d.set(zmq::sockopt::linger, 0);
  d.set(zmq::sockopt::rcvhwm, 1);
  d.connect(endpoint);
  return d;
}

// A subscriber that joins and then never reads holds at most
// send_queue_bytes in ZeroMQ: past it the sends fail (counted), a gap.
TEST(PublisherHostile, SubscriberThatNeverReadsIsBoundedBySendQueueBytes) {
  PublisherOptions o = local_options();
  o.max_batch_bytes = 64u << 10;
  o.send_queue_bytes = 128u << 10;  // a high water mark of 2 batches
  o.buffer_bytes = 256u << 20;
  Publisher pub(o);
  Subscriber s(pub.endpoint(), "", 1);
  join(pub, s);  // from here on it reads nothing
  // 400 batches of ~60 KB (24 MB): more than the kernel's socket buffers
  // and the queue's 2 batches.
  for (std::uint64_t k = 0; k < 400; ++k) {
    store_big(pub, k, 12'000);
    ASSERT_TRUE(pub.flush(scaled(2s)));
  }
  const PublisherStats st = pub.stats();
  EXPECT_GT(st.send_failures, 0u) << "the queue to a reader that never reads is bounded";
  EXPECT_LT(st.batches_sent, st.next_seq);
}

// close(): the bounded exit flush. A subscriber that reads everything got
// it all (drained, nothing undelivered); one that never reads is reported:
// what was refused at its high water mark and what the linger may discard.
TEST(PublisherHostile, CloseReportsWhatASlowSubscriberDidNotGet) {
  {
    Publisher pub(local_options());
    Subscriber s(pub.endpoint(), "");
    join(pub, s);
    store_big(pub, 1, 100);
    const CloseReport r = pub.close(scaled(5000ms));
    EXPECT_TRUE(r.flushed);
    EXPECT_TRUE(r.drained);
    EXPECT_EQ(r.not_delivered(), 0u);
    EXPECT_EQ(pub.close(1ms).drained, r.drained) << "a second call returns the first report";
  }
  PublisherOptions o = local_options();
  o.max_batch_bytes = 64u << 10;
  o.send_queue_bytes = 8u << 20;  // 128 batches queued: the linger has something to discard
  o.buffer_bytes = 256u << 20;
  Publisher pub(o);
  Subscriber s(pub.endpoint(), "", 1);
  join(pub, s);  // then never reads
  store_24_mb(pub);
  ASSERT_TRUE(pub.flush(scaled(5000ms)));  // so that close()'s own flush is immediate
  const CloseReport r = pub.close(scaled(200ms));
  EXPECT_TRUE(r.flushed);
  EXPECT_FALSE(r.drained);
  EXPECT_GT(r.events_maybe_discarded, 0u);
  EXPECT_LE(r.events_maybe_discarded, 128u) << "at most one queue's worth of batches";
  EXPECT_GT(r.not_delivered(), 0u);
  EXPECT_EQ(r.events_unsent, pub.stats().events_unsent);
  // Closed: later events drop, counted, and nothing is left running.
  store_big(pub, 9999, 1);
  EXPECT_EQ(pub.stats().events_dropped, 1u);
}

// The replay ring keeps at most replay_ring_bytes: older batches go first.
TEST(PublisherHostile, ReplayRingBoundedInBytes) {
  PublisherOptions o = local_options();
  o.max_batch_events = 1;
  o.replay_endpoint = "tcp://127.0.0.1:0";
  o.replay_ring_bytes = 3 * 5'200;  // three batches of ~5 KB
  Publisher pub(o);
  for (std::uint64_t k = 0; k < 10; ++k)
    store_big(pub, k, 1'000);
  ASSERT_TRUE(pub.flush(scaled(2s)));
  ASSERT_EQ(pub.stats().next_seq, 10u);
  ReplayClient c(pub.replay_endpoint());
  const auto got = c.replay(0);
  ASSERT_FALSE(got.empty());
  EXPECT_LE(got.size(), 3u);
  std::size_t bytes = 0;
  for (const auto& [seq, payload] : got)
    bytes += payload.size();
  EXPECT_LE(bytes, o.replay_ring_bytes);
  EXPECT_EQ(got.back().first, 9u);
  EXPECT_GT(got.front().first, 0u) << "the oldest were dropped: a miss the client sees";
}

// A flood of replay requests from a client that never reads: at most
// max_pending_answers are answered (each stuck at the client's high water
// mark), the rest refused and counted, and live publishing goes on.
TEST(PublisherHostile, ReplayFloodIsRefusedAndLivePublishingGoesOn) {
  PublisherOptions o = local_options();
  o.max_batch_events = 1;
  o.replay_endpoint = "tcp://127.0.0.1:0";
  o.max_batch_bytes = 64u << 10;
  o.send_queue_bytes = 256u << 10;  // 4 answer frames queued per client
  o.max_pending_answers = 4;
  o.answer_timeout = std::chrono::minutes(10);  // never abandoned here
  o.buffer_bytes = 256u << 20;
  Publisher pub(o);
  store_24_mb(pub);  // one answer fills the kernel's buffers too
  ASSERT_TRUE(pub.flush(scaled(2s)));
  zmq::context_t ctx{1};
  zmq::socket_t d = one_frame_dealer(ctx, pub.replay_endpoint());
  constexpr int kRequests = 1'000;
  const auto start = encode_seq(0);
  for (int k = 0; k < kRequests; ++k) {
    d.send(zmq::message_t(), zmq::send_flags::sndmore);
    d.send(zmq::buffer(start.data(), start.size()), zmq::send_flags::none);
  }
  const auto deadline = std::chrono::steady_clock::now() + scaled(10s);
  while (pub.stats().replay_requests + pub.stats().requests_refused < kRequests &&
         std::chrono::steady_clock::now() < deadline)
    std::this_thread::sleep_for(1ms);
  PublisherStats st = pub.stats();
  ASSERT_EQ(st.replay_requests + st.requests_refused, static_cast<std::uint64_t>(kRequests));
  EXPECT_LE(st.replay_requests, 4u);
  EXPECT_GE(st.requests_refused, static_cast<std::uint64_t>(kRequests - 4));
  // Live batches still go out while the answers wait for a reader.
  const std::uint64_t before = st.next_seq;
  for (std::uint64_t k = 0; k < 10; ++k)
    store_big(pub, 1000 + k, 10);
  ASSERT_TRUE(pub.flush(scaled(2s)));
  EXPECT_EQ(pub.stats().next_seq, before + 10);
}

// An answer whose client takes nothing for answer_timeout is dropped.
TEST(PublisherHostile, StuckAnswerAbandoned) {
  PublisherOptions o = local_options();
  o.max_batch_events = 1;
  o.replay_endpoint = "tcp://127.0.0.1:0";
  o.max_batch_bytes = 64u << 10;
  o.send_queue_bytes = 256u << 10;
  o.answer_timeout = 20ms;
  o.buffer_bytes = 256u << 20;
  Publisher pub(o);
  store_24_mb(pub);
  ASSERT_TRUE(pub.flush(scaled(2s)));
  zmq::context_t ctx{1};
  zmq::socket_t d = one_frame_dealer(ctx, pub.replay_endpoint());
  const auto start = encode_seq(0);
  d.send(zmq::message_t(), zmq::send_flags::sndmore);
  d.send(zmq::buffer(start.data(), start.size()), zmq::send_flags::none);
  const auto deadline = std::chrono::steady_clock::now() + scaled(10s);
  while (pub.stats().answers_abandoned == 0 && std::chrono::steady_clock::now() < deadline)
    std::this_thread::sleep_for(1ms);
  EXPECT_EQ(pub.stats().answers_abandoned, 1u);
  EXPECT_EQ(pub.stats().replay_requests, 1u);
}

// A request of more than 3 frames is read frame by frame, its tail
// discarded as read (never all held), counted and not answered; the next
// good request is answered.
TEST(PublisherHostile, RequestWithTooManyFramesCountedNotAnswered) {
  PublisherOptions o = local_options();
  o.replay_endpoint = "tcp://127.0.0.1:0";
  Publisher pub(o);
  store_big(pub, 1, 1);
  ASSERT_TRUE(pub.flush(scaled(2s)));
  ReplayClient c(pub.replay_endpoint());
  for (int k = 0; k < 10'000; ++k)
    c.s.send(zmq::buffer(std::string_view("x")), zmq::send_flags::sndmore);
  c.s.send(zmq::buffer(std::string_view("x")), zmq::send_flags::none);
  // Had the bad request been answered, its terminator would come first.
  EXPECT_EQ(c.replay(0).size(), 1u);
  EXPECT_EQ(pub.stats().bad_requests, 1u);
  EXPECT_EQ(pub.stats().replay_requests, 1u);
}

// As docs/events.md says: a REQ client gets the answer's first message only
// (REQ takes one reply per request); a DEALER gets every batch.
TEST(Publisher, ReqClientGetsOnlyTheFirstMessage) {
  PublisherOptions o = local_options();
  o.max_batch_events = 1;
  o.replay_endpoint = "tcp://127.0.0.1:0";
  Publisher pub(o);
  for (std::uint64_t k = 0; k < 3; ++k)
    store_big(pub, k, 1);
  ASSERT_TRUE(pub.flush(scaled(2s)));
  zmq::context_t ctx{1};
  zmq::socket_t req{ctx, zmq::socket_type::req};
  req.set(zmq::sockopt::linger, 0);
  req.set(zmq::sockopt::rcvtimeo, static_cast<int>(scaled(2000ms).count()));
  req.connect(pub.replay_endpoint());
  const auto start = encode_seq(0);
  req.send(zmq::buffer(start.data(), start.size()), zmq::send_flags::none);
  std::vector<zmq::message_t> first;
  ASSERT_TRUE(zmq::recv_multipart(req, std::back_inserter(first)));
  ASSERT_EQ(first.size(), 2u);
  EXPECT_EQ(seq_of(first[0]), 0u);
  // REQ takes one reply per request: it cannot read the rest of the answer
  // (ZeroMQ refuses the receive, EFSM, and eats the rest at the next send).
  std::vector<zmq::message_t> more;
  EXPECT_THROW((void)zmq::recv_multipart(req, std::back_inserter(more)), zmq::error_t);
  ReplayClient dealer(pub.replay_endpoint());
  EXPECT_EQ(dealer.replay(0).size(), 3u);
}

using BlockTuple = std::tuple<std::string, std::optional<std::uint32_t>, std::uint64_t,
                              std::optional<std::uint64_t>, std::vector<TokenId>>;

// The set a consumer builds from events (the test's own model).
void apply(std::set<BlockTuple>& set, const CacheEvent& ev) {
  if (auto* s = std::get_if<BlockStored>(&ev)) {
    for (std::size_t i = 0; i < s->block_hashes.size(); ++i) {
      std::erase_if(set, [&](const BlockTuple& t) {
        return std::get<0>(t) == s->medium && std::get<1>(t) == s->group_idx &&
               std::get<2>(t) == s->block_hashes[i];
      });
      std::vector<TokenId> tok(s->token_ids.begin() + i * s->block_size,
                               s->token_ids.begin() + (i + 1) * s->block_size);
      set.emplace(s->medium, s->group_idx, s->block_hashes[i],
                  i == 0 ? s->parent_block_hash : s->block_hashes[i - 1], tok);
    }
  } else if (auto* r = std::get_if<BlockRemoved>(&ev)) {
    std::erase_if(set, [&](const BlockTuple& t) {
      return std::get<0>(t) == r->medium && std::get<1>(t) == r->group_idx &&
             std::find(r->block_hashes.begin(), r->block_hashes.end(), std::get<2>(t)) !=
                 r->block_hashes.end();
    });
  } else if (auto* c = std::get_if<AllBlocksCleared>(&ev)) {
    std::erase_if(set, [&](const BlockTuple& t) {
      return (!c->medium || std::get<0>(t) == *c->medium) &&
             (!c->group_idx || std::get<1>(t) == c->group_idx);
    });
  }
}

TEST(Publisher, SnapshotEqualsTheSetTheEventsBuild) {
  PublisherOptions o = local_options();
  o.max_batch_events = 7;
  o.replay_endpoint = "tcp://127.0.0.1:0";
  Publisher pub(o);
  ReplayClient c(pub.replay_endpoint());
  std::mt19937_64 rng(7);
  for (int round = 0; round < 200; ++round) {
    const std::uint64_t base = rng() % 64;
    const std::vector<BlockHash> hashes = {bh(base), bh(base + 1), bh(base + 2)};
    const std::vector<TokenId> tokens = {TokenId(base), 1, 2, 3, 4, 5};
    EventSource src{rng() % 2 ? Medium::gpu : Medium::cpu,
                    rng() % 3 ? std::optional<std::uint32_t>(rng() % 2) : std::nullopt,
                    std::nullopt, std::nullopt};
    switch (rng() % 8) {
      case 0:
        pub.removed(src, std::span(hashes).first(1 + rng() % 3));
        break;
      case 1:
        if (rng() % 4 == 0) pub.cleared(src);
        break;
      default:
        pub.stored(src, view(hashes, bh(base + 999), tokens, 2));
    }
  }
  ASSERT_TRUE(pub.flush(scaled(2s)));
  // The model: replay every batch (the ring holds them all) through apply().
  std::set<BlockTuple> want;
  const auto all = c.replay(0);
  ASSERT_EQ(all.size(), pub.stats().next_seq);
  for (const auto& [seq, payload] : all) {
    const DecodeResult r = decode_batch(payload);
    ASSERT_TRUE(r.ok()) << r.error;
    for (const auto& e : r.batch->events)
      apply(want, e);
  }
  const auto snap = c.ask(snapshot_request);
  ASSERT_EQ(snap.size(), 1u);
  EXPECT_EQ(snap[0].first, pub.stats().next_seq);  // valid after every batch before it
  const DecodeResult r = decode_batch(snap[0].second);
  ASSERT_TRUE(r.ok()) << r.error;
  std::set<BlockTuple> got;
  for (const auto& e : r.batch->events) {
    const auto& s = std::get<BlockStored>(e);
    ASSERT_EQ(s.block_hashes.size(), 1u);
    got.emplace(s.medium, s.group_idx, s.block_hashes[0], s.parent_block_hash, s.token_ids);
  }
  EXPECT_EQ(got.size(), r.batch->events.size());
  EXPECT_EQ(got, want);
  EXPECT_FALSE(want.empty());
  EXPECT_EQ(pub.stats().snapshots, 1u);
}

// Several threads at once (the default: the hot path's spinlock), and one
// with single_producer: every event arrives, each thread's in its order,
// across many chunks, with one event larger than a chunk among them.
void every_event_in_order(int threads, bool single_producer) {
  PublisherOptions o = local_options();
  o.single_producer = single_producer;
  o.buffer_events = 1 << 20;
  o.buffer_bytes = 1u << 30;
  Publisher pub(o);
  Subscriber s(pub.endpoint(), "");
  std::uint64_t next = join(pub, s);
  constexpr std::uint64_t per_thread = 6000;
  const std::vector<TokenId> tokens(16, 3);
  const std::vector<TokenId> huge_tokens(100'000, 9);  // 400 kB: more than a chunk
  std::vector<std::thread> producers;
  for (int t = 0; t < threads; ++t) {
    producers.emplace_back([&, t] {
      for (std::uint64_t k = 0; k < per_thread; ++k) {
        const std::vector<BlockHash> hashes = {bh(std::uint64_t(t) << 32 | k)};
        if (k == per_thread / 2 && t == 0) {
          pub.stored(EventSource{}, view(hashes, std::nullopt, huge_tokens, 100'000));
        } else if (k % 3 == 0) {
          pub.removed(EventSource{Medium::cpu, 1u, std::nullopt, std::nullopt}, hashes);
        } else {
          pub.stored(EventSource{}, view(hashes, bh(7), tokens, 16));
        }
      }
    });
  }
  for (auto& p : producers)
    p.join();
  ASSERT_TRUE(pub.flush(scaled(10s)));
  EXPECT_EQ(pub.stats().events_accepted, per_thread * threads + next);  // the probes too
  std::vector<std::uint64_t> seen(threads, 0);
  std::uint64_t events = 0;
  while (events < per_thread * threads) {
    auto frames = s.recv();
    ASSERT_EQ(frames.size(), 3u) << "after " << events << " events";
    EXPECT_EQ(seq_of(frames[1]), next++);
    const DecodeResult r = decode_batch(as_string(frames[2]));
    ASSERT_TRUE(r.ok()) << r.error;
    for (const CacheEvent& e : r.batch->events) {
      std::uint64_t h = 0;
      if (const auto* st = std::get_if<BlockStored>(&e)) {
        h = st->block_hashes.at(0);
        const bool huge = st->token_ids.size() == huge_tokens.size();
        EXPECT_EQ(st->token_ids, huge ? huge_tokens : tokens);
        EXPECT_EQ(st->parent_block_hash, huge ? std::nullopt : std::optional<std::uint64_t>(7));
      } else {
        const auto& rm = std::get<BlockRemoved>(e);
        h = rm.block_hashes.at(0);
        EXPECT_EQ(rm.medium, "CPU");
        EXPECT_EQ(rm.group_idx, 1u);
      }
      const std::uint64_t t = h >> 32, k = h & 0xffffffffu;
      ASSERT_LT(t, std::uint64_t(threads));
      EXPECT_EQ(k, seen[t]++) << "thread " << t;
      ++events;
    }
  }
  EXPECT_EQ(pub.stats().events_dropped, 0u);
}

TEST(Publisher, ConcurrentProducersEveryEventInOrder) {
  every_event_in_order(4, false);
}

TEST(Publisher, SingleProducerEveryEventInOrder) {
  every_event_in_order(1, true);
}

TEST(Publisher, DestructionFlushesWhatIsBuffered) {
  PublisherOptions o = local_options();
  o.batch_interval = 10s;
  o.max_batch_events = 1000;
  auto pub = std::make_unique<Publisher>(o);
  Subscriber s(pub->endpoint(), "");
  const std::uint64_t next = join(*pub, s);
  const std::vector<BlockHash> hashes = {bh(1)};
  const std::vector<TokenId> tokens = {1};
  for (int k = 0; k < 5; ++k)
    pub->stored(EventSource{}, view(hashes, std::nullopt, tokens, 1));
  pub.reset();
  auto frames = s.recv();
  ASSERT_EQ(frames.size(), 3u);
  EXPECT_EQ(seq_of(frames[1]), next);
  const DecodeResult r = decode_batch(as_string(frames[2]));
  ASSERT_TRUE(r.ok());
  EXPECT_EQ(r.batch->events.size(), 5u);
}

}  // namespace
}  // namespace kvport::events
