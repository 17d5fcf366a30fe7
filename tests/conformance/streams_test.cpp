// SPDX-License-Identifier: Apache-2.0
// Streams, events and threads: descriptor staging while a stream is busy (on
// one stream, then from four threads at once), events ordering every batched
// operation across streams, waits on an event never recorded, and calls from
// a second thread.
#include <algorithm>
#include <chrono>
#include <cstdint>
#include <functional>
#include <random>
#include <thread>
#include <vector>

#include "conformance.hpp"
#include "kvport/platform/error.hpp"

namespace kvport::conformance {
namespace {

// ---- staging under load ------------------------------------------------------------------

// What one stream works on in the staging test. `busy` takes the large
// memsets queued first; each fill call has its own slab of `fills`, each
// batched copy its own slab of `copies` (sources anywhere in `sources`), so
// every call's result is visible at the end.
struct LoadBuffers {
  static constexpr std::size_t kCalls = 10;  // of each kind
  static constexpr std::size_t kSlab = 64 * kKiB;
  DevicePtr busy;
  std::size_t busy_bytes = 0;
  DevicePtr fills, copies, sources;
  Bytes fills0, copies0, sources0;  // models
};

LoadBuffers make_load_buffers(const std::function<DevicePtr(const Bytes&)>& upload,
                              const std::function<DevicePtr(std::size_t)>& alloc,
                              std::size_t busy_bytes, std::uint64_t seed) {
  LoadBuffers l;
  l.busy_bytes = busy_bytes;
  l.busy = alloc(busy_bytes);
  l.fills0 = random_bytes(LoadBuffers::kCalls * LoadBuffers::kSlab, seed);
  l.copies0 = random_bytes(LoadBuffers::kCalls * LoadBuffers::kSlab, seed + 1);
  l.sources0 = random_bytes(LoadBuffers::kSlab, seed + 2);
  l.fills = upload(l.fills0);
  l.copies = upload(l.copies0);
  l.sources = upload(l.sources0);
  return l;
}

// Queues `busy_memsets` memsets of the whole busy buffer on `s`, then, behind
// them, kCalls fill_async and kCalls copy_batch_async calls of 201 to 400
// regions each (more than fits in a kernel's parameters: the descriptors go
// through the staging slots), each with its own value and region set; then
// reads everything back on `s` and compares with the model.
void run_staging_load(Backend& b, StreamView s, LoadBuffers& l, int busy_memsets,
                      std::uint64_t seed) {
  std::mt19937_64 rng(seed);
  for (int i = 0; i < busy_memsets; ++i)
    b.memset_async(l.busy, static_cast<std::uint8_t>(0x80 + i), l.busy_bytes, s);
  for (std::size_t call = 0; call < LoadBuffers::kCalls; ++call) {
    const std::size_t slab = call * LoadBuffers::kSlab;
    const std::size_t count = 201 + rng() % 200;
    const auto value = static_cast<std::uint8_t>(0x10 + 7 * call + seed % 5);
    {
      std::vector<FillRegion> regions;
      std::size_t cursor = rng() % 8;
      for (std::size_t i = 0; i < count; ++i) {
        const std::size_t size = 1 + rng() % 120;
        if (cursor + size > LoadBuffers::kSlab) break;
        regions.push_back({l.fills.offset(slab + cursor), size});
        std::fill_n(l.fills0.begin() + static_cast<std::ptrdiff_t>(slab + cursor), size, value);
        cursor += size + 1 + rng() % 30;
      }
      EXPECT_GT(regions.size(), 200u);
      std::shuffle(regions.begin(), regions.end(), rng);
      b.fill_async(regions, value, s);
      // The span is consumed: scribbling over it now changes nothing.
      std::fill(regions.begin(), regions.end(), FillRegion{l.busy, 1});
    }
    {
      std::vector<CopyRegion> regions;
      std::size_t cursor = rng() % 8;
      for (std::size_t i = 0; i < count; ++i) {
        const std::size_t size = 1 + rng() % 120;
        if (cursor + size > LoadBuffers::kSlab) break;
        const std::size_t from = rng() % (LoadBuffers::kSlab - size);
        regions.push_back({l.copies.offset(slab + cursor), l.sources.offset(from), size});
        std::copy_n(l.sources0.begin() + static_cast<std::ptrdiff_t>(from), size,
                    l.copies0.begin() + static_cast<std::ptrdiff_t>(slab + cursor));
        cursor += size + 1 + rng() % 30;
      }
      EXPECT_GT(regions.size(), 200u);
      std::shuffle(regions.begin(), regions.end(), rng);
      b.copy_batch_async(regions, s);
      std::fill(regions.begin(), regions.end(), CopyRegion{l.copies, l.sources, 1});
    }
  }
  Bytes fills(l.fills0.size()), copies(l.copies0.size()), busy_tail(4096);
  b.copy_d2h_async(fills.data(), l.fills, fills.size(), s);
  b.copy_d2h_async(copies.data(), l.copies, copies.size(), s);
  b.copy_d2h_async(busy_tail.data(), l.busy.offset(l.busy_bytes - 4096), 4096, s);
  b.synchronize(s);
  EXPECT_TRUE(same_bytes(fills, l.fills0)) << "fill_async results";
  EXPECT_TRUE(same_bytes(copies, l.copies0)) << "copy_batch_async results";
  EXPECT_EQ(busy_tail, Bytes(4096, static_cast<std::uint8_t>(0x80 + busy_memsets - 1)));
}

TEST_P(Conformance, StagingUnderLoadKeepsEveryCallsDescriptors) {
  LoadBuffers l = make_load_buffers([&](const Bytes& c) { return upload(c); },
                                    [&](std::size_t n) { return alloc(n); }, 64 * kMiB, 61);
  Stream s = b().create_stream();
  run_staging_load(b(), s, l, 4, 62);
}

TEST_P(Conformance, StagingUnderLoadFromFourThreadsOnFourStreams) {
  constexpr int kThreads = 4;
  std::vector<LoadBuffers> loads;
  for (int t = 0; t < kThreads; ++t) {
    loads.push_back(make_load_buffers([&](const Bytes& c) { return upload(c); },
                                      [&](std::size_t n) { return alloc(n); }, 32 * kMiB,
                                      70 + 10 * static_cast<std::uint64_t>(t)));
  }
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&, t] {
      Stream s = b().create_stream();
      run_staging_load(b(), s, loads[static_cast<std::size_t>(t)], 2,
                       100 + static_cast<std::uint64_t>(t));
    });
  }
  for (std::thread& t : threads)
    t.join();
}

// ---- events across streams ---------------------------------------------------------------

// One round of producer / consumer: the producer is held busy by a large
// memset, then resets `target` and runs `produce`; the consumer waits for the
// producer's event, runs `consume` (which overlaps what the producer wrote, so
// the order shows), copies `target` elsewhere and reads it back.
class CrossStream {
 public:
  CrossStream(Backend& b, DevicePtr busy, std::size_t busy_bytes, DevicePtr target, DevicePtr out,
              std::size_t bytes)
      : b_(b), busy_(busy), busy_bytes_(busy_bytes), target_(target), out_(out), bytes_(bytes) {}

  void round(std::uint8_t base, const std::function<void(StreamView)>& produce,
             const std::function<void(StreamView)>& consume, const Bytes& expected) {
    Stream producer = b_.create_stream(), consumer = b_.create_stream();
    Event ready = b_.create_event();
    b_.memset_async(busy_, base, busy_bytes_, producer);
    b_.memset_async(target_, base, bytes_, producer);
    produce(producer);
    ready.record(producer);
    ready.wait(consumer);
    consume(consumer);
    b_.copy_d2d_async(out_, target_, bytes_, consumer);
    Bytes back(bytes_);
    b_.copy_d2h_async(back.data(), out_, bytes_, consumer);
    consumer.synchronize();
    EXPECT_TRUE(same_bytes(back, expected));
    producer.synchronize();
  }

 private:
  Backend& b_;
  DevicePtr busy_;
  std::size_t busy_bytes_;
  DevicePtr target_, out_;
  std::size_t bytes_;
};

// `count` regions of 1 to 200 bytes at random places in [0, bytes).
std::vector<std::pair<std::size_t, std::size_t>> random_layout(std::size_t count, std::size_t bytes,
                                                               std::uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::vector<std::pair<std::size_t, std::size_t>> out;
  for (std::size_t i = 0; i < count; ++i) {
    const std::size_t size = 1 + rng() % 200;
    out.emplace_back(rng() % (bytes - size), size);
  }
  return out;
}

TEST_P(Conformance, EventsOrderFillsAndBatchedCopiesAcrossStreams) {
  constexpr std::size_t kBusy = 64 * kMiB, kBytes = kMiB;
  DevicePtr busy = alloc(kBusy), target = alloc(kBytes), out = alloc(kBytes);
  CrossStream x(b(), busy, kBusy, target, out, kBytes);

  for (const std::uint8_t base : {std::uint8_t{0x01}, std::uint8_t{0x02}}) {
    SCOPED_TRACE(static_cast<int>(base));
    {
      SCOPED_TRACE("fill_async");
      Bytes expected(kBytes, base);
      std::vector<FillRegion> first, second;
      for (auto [offset, n] : random_layout(300, kBytes, 80 + base)) {
        first.push_back({target.offset(offset), n});
        std::fill_n(expected.begin() + static_cast<std::ptrdiff_t>(offset), n, 0xA1);
      }
      for (auto [offset, n] : random_layout(250, kBytes, 90 + base)) {
        second.push_back({target.offset(offset), n});
        std::fill_n(expected.begin() + static_cast<std::ptrdiff_t>(offset), n, 0xB2);
      }
      x.round(
          base, [&](StreamView s) { b().fill_async(first, 0xA1, s); },
          [&](StreamView s) { b().fill_async(second, 0xB2, s); }, expected);
    }
    {
      SCOPED_TRACE("fill_blocks_async");
      // Two pools over `target`: blocks of 1000 bytes every 2048, and of 300
      // every 1024 from 600000.
      constexpr std::size_t kBlocks = 256;
      const PoolGeometry pools[] = {{target, 1000, 2048}, {target.offset(600000), 300, 1024}};
      BlockPoolSet set = b().register_block_pools(pools, kBlocks);
      std::vector<std::uint32_t> even, thirds;
      for (std::uint32_t id = 0; id < kBlocks; id += 2)
        even.push_back(id);
      for (std::uint32_t id = 0; id < kBlocks; id += 3)
        thirds.push_back(id);
      Bytes expected(kBytes, base);
      for (auto [ids, value] : {std::pair{&even, 0xC3}, std::pair{&thirds, 0xD4}}) {
        for (std::uint32_t id : *ids) {
          for (const PoolGeometry& p : pools) {
            std::fill_n(expected.begin() + static_cast<std::ptrdiff_t>(
                                               p.base.address() - target.address() + id * p.stride),
                        p.bytes, static_cast<std::uint8_t>(value));
          }
        }
      }
      x.round(
          base, [&](StreamView s) { b().fill_blocks_async(set, even, 0xC3, s); },
          [&](StreamView s) { b().fill_blocks_async(set, thirds, 0xD4, s); }, expected);
    }
    {
      SCOPED_TRACE("copy_batch_async");
      const Bytes src0 = random_bytes(kBytes, 100 + base), src1 = random_bytes(kBytes, 110 + base);
      DevicePtr src_a = upload(src0), src_b = upload(src1);
      Bytes expected(kBytes, base);
      // Within one batch no destination may overlap another: slots of 256
      // bytes, each used once per batch, a random part of it copied.
      std::vector<CopyRegion> first, second;
      std::mt19937_64 rng(120 + base);
      for (auto [batch, src, model] :
           {std::tuple{&first, src_a, &src0}, std::tuple{&second, src_b, &src1}}) {
        for (std::size_t slot = 0; slot < kBytes / 256; ++slot) {
          if (rng() % 4 == 0) continue;
          const std::size_t at = slot * 256 + rng() % 64, n = 1 + rng() % 192;
          const std::size_t from = rng() % (kBytes - n);
          batch->push_back({target.offset(at), src.offset(from), n});
          std::copy_n(model->begin() + static_cast<std::ptrdiff_t>(from), n,
                      expected.begin() + static_cast<std::ptrdiff_t>(at));
        }
      }
      x.round(
          base, [&](StreamView s) { b().copy_batch_async(first, s); },
          [&](StreamView s) { b().copy_batch_async(second, s); }, expected);
    }
  }
}

// ---- events never recorded ---------------------------------------------------------------

TEST_P(Conformance, WaitingOnAnEventNeverRecordedDoesNotBlock) {
  // The contract (Event, stream.hpp): an event that was never recorded is
  // complete, as in CUDA: synchronizing it returns at once, and a stream told
  // to wait for it does not wait.
  const Bytes content = random_bytes(64 * kKiB, 130);
  DevicePtr p = upload(content);
  Event never = b().create_event();
  Event never_timed = b().create_timing_event();
  const auto start = std::chrono::steady_clock::now();
  never.synchronize();
  b().synchronize_event(never_timed);
  Stream s = b().create_stream();
  never.wait(s);
  b().wait_event(s, never_timed);
  b().wait_event(stream(), never);
  b().memset_async(p.offset(100), 0x3D, 1000, s);
  s.synchronize();
  b().synchronize(stream());
  const double seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  EXPECT_LT(seconds, 10.0);
  Bytes expected = content;
  std::fill_n(expected.begin() + 100, 1000, 0x3D);
  EXPECT_TRUE(same_bytes(download(p, content.size()), expected));

  // Once recorded, the event orders work as usual.
  b().memset_async(p, 0x4E, 64 * kKiB, s);
  never.record(s);
  never.wait(stream());
  std::fill(expected.begin(), expected.end(), 0x4E);
  EXPECT_TRUE(same_bytes(download(p, content.size()), expected));
}

TEST_P(Conformance, QueryEventReportsCompletionWithoutWaiting) {
  // Backend::query_event / Event::query: true for an event never recorded;
  // once it says true for a record, the work queued before the record is
  // complete and visible from another stream without any wait.
  Event event = b().create_event();
  EXPECT_TRUE(event.query());
  constexpr std::size_t kBytes = 16 * kMiB;
  DevicePtr p = alloc(kBytes);
  Stream s = b().create_stream();
  for (std::uint8_t round = 1; round <= 4; ++round)
    b().memset_async(p, round, kBytes, s);
  event.record(s);
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(20);
  bool done = false;
  while (!(done = b().query_event(event)) && std::chrono::steady_clock::now() < deadline)
    std::this_thread::yield();
  ASSERT_TRUE(done) << "the event did not complete within 20 s";
  Stream reader = b().create_stream();  // ordered by nothing: the query is the only order
  Bytes back(kBytes);
  b().copy_d2h(back.data(), p, kBytes, reader);
  EXPECT_TRUE(std::all_of(back.begin(), back.end(), [](std::uint8_t v) { return v == 4; }));
  s.synchronize();
  EXPECT_TRUE(event.query());  // still complete: nothing recorded since

  Event moved = std::move(event);
  EXPECT_THROW(static_cast<void>(event.query()), InvalidArgument);  // NOLINT: moved-from on purpose
  EXPECT_TRUE(moved.query());
}

// ---- threads -----------------------------------------------------------------------------

TEST_P(Conformance, CallsFromASecondThread) {
  constexpr std::size_t kBytes = 4 * kMiB;
  const Bytes content = random_bytes(kBytes, 140);
  DevicePtr shared = alloc(kBytes);  // allocated here, written by the other thread
  Bytes thread_back;
  DevicePtr thread_alloc;
  std::thread other([&] {
    // Everything from this thread: allocation, stream, event, fills, copies.
    Stream s = b().create_stream();
    DevicePtr mine = b().alloc(kBytes);
    b().copy_h2d_async(mine, content.data(), kBytes, s);
    const FillRegion regions[] = {{mine.offset(10), 1000}, {mine.offset(kBytes - 7), 7}};
    b().fill_async(regions, 0x5F, s);
    b().copy_d2d_async(shared, mine, kBytes, s);
    Event done = b().create_event();
    done.record(s);
    done.synchronize();
    thread_back.resize(kBytes);
    b().copy_d2h(thread_back.data(), mine, kBytes, s);
    thread_alloc = mine;  // freed by the main thread
  });
  // Meanwhile, work on the main thread.
  const Bytes mine0 = random_bytes(kMiB, 141);
  DevicePtr mine = upload(mine0);
  b().memset_async(mine.offset(5), 0x60, 5000, stream());
  Bytes mine_expected = mine0;
  std::fill_n(mine_expected.begin() + 5, 5000, 0x60);
  EXPECT_TRUE(same_bytes(download(mine, kMiB), mine_expected));
  other.join();

  Bytes expected = content;
  std::fill_n(expected.begin() + 10, 1000, 0x5F);
  std::fill_n(expected.end() - 7, 7, 0x5F);
  EXPECT_TRUE(same_bytes(thread_back, expected));
  EXPECT_TRUE(same_bytes(download(shared, kBytes), expected));
  EXPECT_TRUE(b().free(thread_alloc));  // another thread's allocation
}

}  // namespace
}  // namespace kvport::conformance
