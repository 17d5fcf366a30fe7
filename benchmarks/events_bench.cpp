// SPDX-License-Identifier: Apache-2.0
// The events publisher's cost: the hot path (Publisher::stored, what the
// cache pays per event) against a no-op sink, measured side by side in one
// benchmark and reported as a ratio; events per second published end to end
// to a live subscriber; and a snapshot's cost by cached-set size.
#include <benchmark/benchmark.h>

#include <time.h>

#include <atomic>
#include <chrono>
#include <thread>
#include <vector>
#include <zmq.hpp>
#include <zmq_addon.hpp>

#include "kvport/core/block_hash.hpp"
#include "kvport/events/publisher.hpp"
#include "thread_clock.hpp"

namespace {

using namespace kvport;
using kvport::bench::thread_cpu_ns;
using Clock = std::chrono::steady_clock;

class NoopSink final : public CacheEventSink {
 public:
  void stored(const EventSource&, const BlockStoredView& b) noexcept override {
    benchmark::DoNotOptimize(b.hashes.data());
  }
  void removed(const EventSource&, std::span<const BlockHash> h) noexcept override {
    benchmark::DoNotOptimize(h.data());
  }
  void cleared(const EventSource&) noexcept override {}
};

// One event as a cache emits it: 4 blocks of 16 tokens with a parent.
struct Sample {
  std::vector<TokenId> tokens;
  std::vector<BlockHash> hashes;
  BlockStoredView view;
  explicit Sample(std::size_t blocks = 4) : tokens(blocks * 16) {
    for (std::size_t i = 0; i < tokens.size(); ++i)
      tokens[i] = static_cast<TokenId>(i * 31);
    hashes = hash_full_blocks(tokens, 16);
    view.hashes = std::span(hashes).subspan(1);
    view.parent = hashes[0];
    view.tokens = std::span(tokens).subspan(16);
    view.block_size = 16;
  }
};

events::PublisherOptions bench_options() {
  events::PublisherOptions o;
  o.endpoint = "tcp://127.0.0.1:0";
  o.buffer_events = 1 << 20;
  o.buffer_bytes = 1u << 30;
  return o;
}

// Hot path: ns per stored() for the publisher and for a no-op sink, in
// alternating rounds of the same run; counter `ratio` = publisher / no-op.
void BM_EventsHotPathVsNoop(benchmark::State& state) {
  events::Publisher pub(bench_options());
  NoopSink noop;
  CacheEventSink* sinks[2] = {&noop, &pub};
  Sample s;
  const EventSource src{};
  constexpr int round = 1000;
  double ns[2] = {0, 0}, cpu_ns[2] = {0, 0};
  std::int64_t rounds = 0;
  for (auto _ : state) {
    for (int k = 0; k < 2; ++k) {
      const double c0 = thread_cpu_ns();
      const auto t0 = Clock::now();
      for (int i = 0; i < round; ++i)
        sinks[k]->stored(src, s.view);
      ns[k] += std::chrono::duration<double, std::nano>(Clock::now() - t0).count();
      cpu_ns[k] += thread_cpu_ns() - c0;
    }
    ++rounds;
  }
  const auto st = pub.stats();
  state.counters["noop_ns"] = ns[0] / static_cast<double>(rounds * round);
  state.counters["publisher_ns"] = ns[1] / static_cast<double>(rounds * round);
  state.counters["ratio"] = ns[1] / ns[0];
  // The caller's own CPU per call (wall time above includes preemption by
  // the publisher thread and other load on a small machine).
  state.counters["noop_cpu_ns"] = cpu_ns[0] / static_cast<double>(rounds * round);
  state.counters["publisher_cpu_ns"] = cpu_ns[1] / static_cast<double>(rounds * round);
  state.counters["dropped"] = static_cast<double>(st.events_dropped);
  state.SetItemsProcessed(rounds * round * 2);
}
BENCHMARK(BM_EventsHotPathVsNoop)->UseRealTime();

// End to end: events/s from stored() to a SUB socket that decodes nothing
// but counts messages (batches of max_batch_events).
void BM_EventsPublishedEndToEnd(benchmark::State& state) {
  events::PublisherOptions o = bench_options();
  o.max_batch_events = static_cast<std::size_t>(state.range(0));
  o.batch_interval = std::chrono::milliseconds(1);
  events::Publisher pub(o);
  zmq::context_t ctx(1);
  zmq::socket_t sub(ctx, zmq::socket_type::sub);
  sub.set(zmq::sockopt::linger, 0);
  sub.set(zmq::sockopt::rcvtimeo, 100);
  sub.set(zmq::sockopt::rcvhwm, 0);
  sub.set(zmq::sockopt::subscribe, "");
  sub.connect(pub.endpoint());
  std::atomic<std::uint64_t> received{0};
  std::atomic<bool> stop{false};
  std::thread reader([&] {
    while (!stop.load()) {
      std::vector<zmq::message_t> f;
      if (zmq::recv_multipart(sub, std::back_inserter(f))) received.fetch_add(1);
    }
  });
  // Slow joiner: wait for a probe.
  Sample s;
  for (int k = 0; k < 200 && received.load() == 0; ++k) {
    pub.cleared(EventSource{});
    pub.flush(std::chrono::seconds(1));
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  const std::uint64_t batches0 = pub.stats().next_seq;
  const std::uint64_t recv0 = received.load();
  constexpr int per_iter = 10'000;
  std::int64_t events = 0;
  for (auto _ : state) {
    for (int i = 0; i < per_iter; ++i)
      pub.stored(EventSource{}, s.view);
    pub.flush(std::chrono::seconds(10));
    events += per_iter;
  }
  const std::uint64_t batches = pub.stats().next_seq - batches0;
  for (int k = 0; k < 200 && received.load() - recv0 < batches; ++k)
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  stop = true;
  reader.join();
  const auto st = pub.stats();
  state.SetItemsProcessed(events);
  state.counters["batches_received_fraction"] =
      batches ? static_cast<double>(received.load() - recv0) / static_cast<double>(batches) : 0;
  state.counters["dropped"] = static_cast<double>(st.events_dropped);
  state.counters["send_failures"] = static_cast<double>(st.send_failures);
}
BENCHMARK(BM_EventsPublishedEndToEnd)->Arg(64)->Arg(256)->UseRealTime();

// A snapshot of N cached blocks: request to the last frame received.
void BM_EventsSnapshot(benchmark::State& state) {
  events::PublisherOptions o = bench_options();
  o.replay_endpoint = "tcp://127.0.0.1:0";
  o.replay_ring_batches = 16;
  events::Publisher pub(o);
  const std::size_t blocks = static_cast<std::size_t>(state.range(0));
  std::vector<TokenId> tokens(16);
  for (std::size_t b = 0; b < blocks; ++b) {
    const BlockHash h{b * 2654435761u + 1, b};
    tokens[0] = static_cast<TokenId>(b);
    BlockStoredView v;
    v.hashes = std::span(&h, 1);
    v.tokens = tokens;
    v.block_size = 16;
    pub.stored(EventSource{}, v);
  }
  pub.flush(std::chrono::seconds(30));
  zmq::context_t ctx(1);
  zmq::socket_t d(ctx, zmq::socket_type::dealer);
  d.set(zmq::sockopt::linger, 0);
  d.set(zmq::sockopt::rcvtimeo, 10000);
  d.connect(pub.replay_endpoint());
  std::size_t bytes = 0;
  for (auto _ : state) {
    d.send(zmq::buffer(std::string_view()), zmq::send_flags::sndmore);
    d.send(zmq::buffer(events::snapshot_request), zmq::send_flags::none);
    for (int k = 0; k < 2; ++k) {
      std::vector<zmq::message_t> f;
      if (!zmq::recv_multipart(d, std::back_inserter(f))) {
        state.SkipWithError("no snapshot reply");
        return;
      }
      if (k == 0) bytes = f.back().size();
    }
  }
  state.counters["blocks"] = static_cast<double>(blocks);
  state.counters["payload_bytes"] = static_cast<double>(bytes);
  state.counters["time_per_block"] = benchmark::Counter(
      static_cast<double>(blocks),
      benchmark::Counter::kIsIterationInvariantRate | benchmark::Counter::kInvert);
}
BENCHMARK(BM_EventsSnapshot)->Arg(4096)->Arg(65536)->Unit(benchmark::kMillisecond)->UseRealTime();

}  // namespace
