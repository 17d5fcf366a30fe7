// SPDX-License-Identifier: Apache-2.0
// PagedKvCache under injected backend faults (FaultInjectingBackend over the
// host backend): a construction that fails at any allocation or at the pool
// registration leaks nothing; a failed zero / poison / copy leaves refcounts,
// the free list, counters and the pools' bytes as they were; an asynchronous
// failure surfaces at the next synchronize of its stream and is never lost.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cstddef>
#include <cstdint>
#include <future>
#include <memory>
#include <string>
#include <vector>

#include "core_test_util.hpp"
#include "kvport/backends/host_backend.hpp"
#include "kvport/core/paged_kv_cache.hpp"
#include "kvport/platform/error.hpp"
#include "kvport/platform/fault_injecting_backend.hpp"

namespace kvport {
namespace {

using kvport::testing::message_of;
using ::testing::AllOf;
using ::testing::HasSubstr;

PagedKvCacheOptions no_trace() {
  PagedKvCacheOptions options;
  options.trace = false;
  return options;
}

struct ConfigCase {
  const char* name;
  KvCacheConfig config;
  std::size_t allocations;  // pool allocations the constructor makes
};

std::vector<ConfigCase> config_cases() {
  KvCacheConfig six_layers = test::small_config();
  six_layers.num_layers = 6;
  return {
      {"layer_major", test::small_config(), 6},
      {"layer_major_6_layers", six_layers, 12},
      {"layer_major_mixed", test::mixed_config(), 6},
      {"block_major", test::small_config(KvCacheLayout::block_major), 1},
      {"block_major_mixed", test::mixed_config(KvCacheLayout::block_major), 1},
  };
}

class PagedKvCacheFaultTest : public ::testing::Test {
 protected:
  void expect_nothing_allocated() {
    EXPECT_EQ(fb_.live_allocations(), 0u);
    EXPECT_EQ(fb_.live_bytes(), 0u);
    const MemInfo info = fb_.inner().mem_info();
    EXPECT_EQ(info.free_bytes, info.total_bytes);
  }

  FaultInjectingBackend fb_{test::host_backend()};
};

// ---- construction --------------------------------------------------------------------

TEST_F(PagedKvCacheFaultTest, AConstructionFailingAtAnyAllocationReleasesTheOthers) {
  for (const ConfigCase& c : config_cases()) {
    SCOPED_TRACE(c.name);
    for (std::size_t i = 1; i <= c.allocations; ++i) {
      SCOPED_TRACE(i);
      fb_.set_plan(FaultKind::alloc, {.nth = i});
      fb_.reset_fault_counts();
      EXPECT_THAT(
          message_of<OutOfMemory>([&] { PagedKvCache cache(c.config, 16, fb_, no_trace()); }),
          AllOf(HasSubstr("injected"), HasSubstr("alloc call #" + std::to_string(i))));
      EXPECT_EQ(fb_.counts(FaultKind::alloc).calls, i);  // stopped at the failure
      EXPECT_EQ(fb_.counts(FaultKind::register_pools).calls, 0u);
      expect_nothing_allocated();
    }
    // One past the last allocation: the construction succeeds.
    fb_.set_plan(FaultKind::alloc, {.nth = c.allocations + 1});
    {
      PagedKvCache cache(c.config, 16, fb_, no_trace());
      EXPECT_EQ(fb_.live_allocations(), c.allocations);
      EXPECT_EQ(fb_.live_bytes(), cache.total_bytes());
      EXPECT_TRUE(cache.check_invariants().ok);
    }
    expect_nothing_allocated();
    fb_.clear_plans();
  }
}

TEST_F(PagedKvCacheFaultTest, AConstructionFailingAtEveryAllocationFromTheFirstLeaksNothing) {
  fb_.set_plan(FaultKind::alloc, {.from_nth = 1});
  for (const ConfigCase& c : config_cases()) {
    SCOPED_TRACE(c.name);
    EXPECT_THROW(PagedKvCache(c.config, 16, fb_, no_trace()), OutOfMemory);
    expect_nothing_allocated();
  }
}

TEST_F(PagedKvCacheFaultTest, AFailedPoolRegistrationReleasesEveryAllocation) {
  for (const ConfigCase& c : config_cases()) {
    SCOPED_TRACE(c.name);
    fb_.set_plan(FaultKind::register_pools, {.nth = 1});
    fb_.reset_fault_counts();
    EXPECT_THAT(
        message_of<BackendError>([&] { PagedKvCache cache(c.config, 16, fb_, no_trace()); }),
        AllOf(HasSubstr("register_block_pools"), HasSubstr("injected")));
    EXPECT_EQ(fb_.counts(FaultKind::alloc).calls, c.allocations);  // all made, all released
    expect_nothing_allocated();
  }
}

TEST_F(PagedKvCacheFaultTest, ARandomlyFailingBackendNeverLeaksAConstruction) {
  test::QuietLog quiet;  // 200 constructions
  // Seeded: the same constructions fail on every run.
  fb_.set_plan(FaultKind::alloc, {.probability = 0.2, .seed = 2024});
  fb_.set_plan(FaultKind::register_pools, {.probability = 0.2, .seed = 2025});
  std::size_t built = 0, failed = 0;
  for (int round = 0; round < 40; ++round) {
    for (const ConfigCase& c : config_cases()) {
      try {
        PagedKvCache cache(c.config, 8, fb_, no_trace());
        ++built;
        EXPECT_EQ(fb_.live_allocations(), c.allocations);
      } catch (const Error&) {
        ++failed;
      }
      expect_nothing_allocated();
    }
  }
  EXPECT_GT(built, 0u);
  EXPECT_GT(failed, 0u);
}

// ---- failed zero / poison ------------------------------------------------------------------

// What a failed device operation must not change.
struct CacheState {
  std::vector<std::uint32_t> ref_counts;
  std::size_t free_blocks;
  std::uint64_t allocs, frees, ignored_double_frees, exhaustion_events;
  std::size_t peak;

  static CacheState of(const PagedKvCache& cache) {
    CacheState s{{},
                 cache.num_free_blocks(),
                 cache.counters().allocs,
                 cache.counters().frees,
                 cache.counters().ignored_double_frees,
                 cache.counters().exhaustion_events,
                 cache.counters().peak_blocks_in_use};
    for (BlockId b = 0; b < cache.num_blocks(); ++b)
      s.ref_counts.push_back(cache.ref_count(b));
    return s;
  }
  friend bool operator==(const CacheState&, const CacheState&) = default;
};

// A cache of 8 blocks with every block's bytes set to its pattern, blocks 1, 2
// and 4 in use (block 1 shared), and the free list (top first) 0, 3, 5, 6, 7.
struct Scenario {
  Scenario(Backend& backend, const KvCacheConfig& config)
      : cache(config, 8, backend, no_trace()), stream(backend.create_stream()) {
    for (std::size_t l = 0; l < cache.num_layers(); ++l) {
      for (BlockId b = 0; b < cache.num_blocks(); ++b) {
        cache.write_block(l, b, test::pattern(cache.k_block_bytes(l), b, l, false),
                          test::pattern(cache.v_block_bytes(l), b, l, true), stream);
      }
    }
    for (int i = 0; i < 5; ++i)
      cache.alloc_block();  // 0 .. 4
    cache.inc_ref(1);
    cache.free_block(3);
    cache.free_block(0);
  }

  // Every block still holds its pattern.
  void expect_patterns(StreamView on) {
    for (std::size_t l = 0; l < cache.num_layers(); ++l) {
      for (BlockId b = 0; b < cache.num_blocks(); ++b) {
        const PagedKvCache::HostBlock got = cache.read_block(l, b, on);
        EXPECT_EQ(got.k, test::pattern(cache.k_block_bytes(l), b, l, false)) << l << "/" << b;
        EXPECT_EQ(got.v, test::pattern(cache.v_block_bytes(l), b, l, true)) << l << "/" << b;
      }
    }
  }

  // The free list hands out the same blocks in the same order as before.
  void expect_alloc_order() {
    std::vector<BlockId> order;
    while (auto b = cache.try_alloc_block())
      order.push_back(*b);
    EXPECT_EQ(order, (std::vector<BlockId>{0, 3, 5, 6, 7}));
  }

  PagedKvCache cache;
  Stream stream;
};

const std::vector<BlockId> kBatch = {0, 1, 2, 3, 6};

TEST_F(PagedKvCacheFaultTest, ASynchronouslyFailingZeroOrPoisonChangesNothing) {
  for (const ConfigCase& c : config_cases()) {
    for (const bool poison : {false, true}) {
      SCOPED_TRACE(std::string(c.name) + (poison ? " poison" : " zero"));
      Scenario s(fb_, c.config);
      const CacheState before = CacheState::of(s.cache);
      fb_.set_plan(FaultKind::fill, {.nth = 1});
      const std::string message = message_of<BackendError>([&] {
        poison ? s.cache.poison_blocks(kBatch, s.stream) : s.cache.zero_blocks(kBatch, s.stream);
      });
      EXPECT_THAT(message, AllOf(HasSubstr("fill_blocks_async"), HasSubstr("injected fault")));
      fb_.clear_plans();
      EXPECT_NO_THROW(s.stream.synchronize());  // nothing was queued, nothing pending
      EXPECT_TRUE(CacheState::of(s.cache) == before);
      EXPECT_TRUE(s.cache.check_invariants().ok) << s.cache.check_invariants().to_string();
      s.expect_patterns(s.stream);
      s.expect_alloc_order();
    }
  }
}

TEST_F(PagedKvCacheFaultTest, ADeferredZeroOrPoisonFailureSurfacesAtSynchronizeAndChangesNothing) {
  for (const ConfigCase& c : config_cases()) {
    for (const bool poison : {false, true}) {
      SCOPED_TRACE(std::string(c.name) + (poison ? " poison" : " zero"));
      Scenario s(fb_, c.config);
      const CacheState before = CacheState::of(s.cache);
      fb_.set_plan(FaultKind::fill, {.nth = 1, .mode = FaultMode::deferred});
      poison ? s.cache.poison_blocks(kBatch, s.stream)
             : s.cache.zero_blocks(kBatch, s.stream);  // returns: the error is asynchronous
      fb_.clear_plans();
      EXPECT_TRUE(CacheState::of(s.cache) == before);
      EXPECT_THAT(message_of<BackendError>([&] { s.stream.synchronize(); }),
                  AllOf(HasSubstr("fill_blocks_async"), HasSubstr("injected deferred fault")));
      EXPECT_NO_THROW(s.stream.synchronize());  // once
      EXPECT_TRUE(CacheState::of(s.cache) == before);
      EXPECT_TRUE(s.cache.check_invariants().ok) << s.cache.check_invariants().to_string();
      s.expect_patterns(s.stream);
      s.expect_alloc_order();
    }
  }
}

TEST_F(PagedKvCacheFaultTest, AfterAFailedZeroTheNextZeroWorks) {
  Scenario s(fb_, test::small_config());
  fb_.set_plan(FaultKind::fill, {.nth = 1, .mode = FaultMode::deferred});
  s.cache.zero_blocks(kBatch, s.stream);
  EXPECT_THROW(s.stream.synchronize(), BackendError);
  s.cache.zero_blocks(kBatch, s.stream);  // call 2: no fault
  for (std::size_t l = 0; l < s.cache.num_layers(); ++l) {
    for (BlockId b : kBatch) {
      const auto got = s.cache.read_block(l, b, s.stream);
      EXPECT_EQ(got.k, std::vector<std::uint8_t>(s.cache.k_block_bytes(l), 0)) << l << "/" << b;
      EXPECT_EQ(got.v, std::vector<std::uint8_t>(s.cache.v_block_bytes(l), 0)) << l << "/" << b;
    }
  }
}

// ---- asynchronous failures -------------------------------------------------------------------

TEST_F(PagedKvCacheFaultTest, AnAsyncFailureSurfacesAtTheNextSynchronizeOfThatStreamOnly) {
  Scenario s(fb_, test::small_config());
  Stream other = fb_.create_stream();
  fb_.set_plan(FaultKind::fill, {.nth = 1, .mode = FaultMode::deferred});
  s.cache.poison_blocks(kBatch, s.stream);
  fb_.clear_plans();
  // Other streams do not see it: their reads synchronize without an error.
  EXPECT_NO_THROW(s.cache.read_block(0, 1, other));
  EXPECT_NO_THROW(fb_.synchronize(fb_.default_stream()));
  // read_block synchronizes its stream: that is where the error comes out.
  EXPECT_THAT(message_of<BackendError>([&] { s.cache.read_block(0, 1, s.stream); }),
              HasSubstr("injected deferred fault: fill call #1"));
  s.expect_patterns(s.stream);  // then the stream works again
  EXPECT_EQ(fb_.counts(FaultKind::fill).faults, 1u);
}

TEST_F(PagedKvCacheFaultTest, AnAsyncFailureOnADestroyedStreamIsLoggedNotLost) {
  test::LogRecorder log(log::Level::warn);
  {
    Scenario s(fb_, test::small_config());
    fb_.set_plan(FaultKind::fill, {.nth = 1, .mode = FaultMode::deferred});
    s.cache.zero_blocks(kBatch, s.stream);
    fb_.clear_plans();
  }  // the stream goes without a synchronize
  EXPECT_EQ(log.find(log::Level::warn, "never synchronized").size(), 1u);
  EXPECT_EQ(log.find(log::Level::warn, "injected deferred fault: fill call #1").size(), 1u);
  expect_nothing_allocated();
}

// ---- failed copies ---------------------------------------------------------------------------

TEST_F(PagedKvCacheFaultTest, AFailedWriteBlockLeavesTheBlockAndTheCacheAsTheyWere) {
  for (const FaultMode mode : {FaultMode::synchronous, FaultMode::deferred}) {
    SCOPED_TRACE(mode == FaultMode::deferred ? "deferred" : "synchronous");
    Scenario s(fb_, test::small_config());
    const CacheState before = CacheState::of(s.cache);
    // Both copies of write_block (K then V) fail.
    fb_.set_plan(FaultKind::copy, {.from_nth = 1, .mode = mode});
    const std::vector<std::uint8_t> k(s.cache.k_block_bytes(1), 0xAB),
        v(s.cache.v_block_bytes(1), 0xCD);
    EXPECT_THROW(s.cache.write_block(1, 2, k, v, s.stream), BackendError);
    fb_.clear_plans();
    // Deferred: the V copy's error is still pending; one synchronize takes it.
    if (mode == FaultMode::deferred) {
      EXPECT_THROW(s.stream.synchronize(), BackendError);
    }
    EXPECT_NO_THROW(s.stream.synchronize());
    EXPECT_TRUE(CacheState::of(s.cache) == before);
    s.expect_patterns(s.stream);
  }
}

// ---- work still queued at destruction, synchronize() ------------------------------------------

TEST_F(PagedKvCacheFaultTest, TheDestructorWaitsForQueuedWorkAndLogsItsErrorInsteadOfThrowing) {
  test::LogRecorder log(log::Level::warn);
  Stream stream = fb_.create_stream();  // outlives the cache
  {
    PagedKvCache cache(test::small_config(), 8, fb_, no_trace());
    fb_.set_plan(FaultKind::fill, {.nth = 1, .mode = FaultMode::deferred});
    cache.zero_blocks(kBatch, stream);
    fb_.clear_plans();
    fb_.reset_fault_counts();
  }  // no synchronize: the destructor's
  EXPECT_EQ(fb_.counts(FaultKind::synchronize).calls, 1u);
  const std::vector<std::string> logged =
      log.find(log::Level::error, "injected deferred fault: fill call #1");
  ASSERT_EQ(logged.size(), 1u);
  EXPECT_THAT(logged[0], HasSubstr("~PagedKvCache"));
  EXPECT_NO_THROW(stream.synchronize()) << "the error came out once, in the log";
  expect_nothing_allocated();
}

TEST_F(PagedKvCacheFaultTest, SynchronizeWaitsForEveryStreamThenRethrowsTheFirstError) {
  Stream a = fb_.create_stream();
  Stream b = fb_.create_stream();
  PagedKvCache cache(test::small_config(), 8, fb_, no_trace());
  fb_.set_plan(FaultKind::fill, {.nth = 1, .mode = FaultMode::deferred});
  cache.zero_blocks(kBatch, a);
  fb_.clear_plans();
  cache.poison_block(7, b);
  ASSERT_EQ(cache.queued_streams().size(), 2u);
  fb_.reset_fault_counts();
  EXPECT_THAT(message_of<BackendError>([&] { cache.synchronize(); }),
              HasSubstr("injected deferred fault: fill call #1"));
  EXPECT_EQ(fb_.counts(FaultKind::synchronize).calls, 2u) << "b was waited for too";
  EXPECT_TRUE(cache.queued_streams().empty());
  EXPECT_NO_THROW(cache.synchronize());
  EXPECT_EQ(fb_.counts(FaultKind::synchronize).calls, 2u) << "nothing queued since";
  EXPECT_NO_THROW(a.synchronize()) << "reported once";
}

// ---- an InvalidArgument of a live stream is its error, not "destroyed" ------------------------

// The host backend reports a use after free asynchronously, as an
// InvalidArgument at the next synchronize of the stream the work was queued
// on: here the memset of a buffer freed while the memset waited behind a
// gate, on a stream the cache also queued a fill on. The cache once took any
// InvalidArgument from Backend::synchronize for "the stream was destroyed"
// and dropped it; it now asks Backend::stream_alive.
class QueuedUseAfterFree {
 public:
  explicit QueuedUseAfterFree(Backend& backend) : backend_(backend) {}
  ~QueuedUseAfterFree() { open(); }
  QueuedUseAfterFree(const QueuedUseAfterFree&) = delete;
  QueuedUseAfterFree& operator=(const QueuedUseAfterFree&) = delete;

  // Holds `stream`, queues a memset of a buffer behind the hold, frees the
  // buffer: when the hold opens, the memset finds it gone.
  void queue_on(StreamView stream) {
    host_enqueue_for_testing(backend_, stream, [f = gate_] { f.wait(); });
    const DevicePtr doomed = backend_.alloc(4096);
    backend_.memset_async(doomed, 0xEE, 4096, stream);  // valid at the call
    ASSERT_TRUE(backend_.free(doomed));                 // nothing runs on it yet: no wait
  }
  void open() {
    if (!opened_) promise_.set_value();
    opened_ = true;
  }

 private:
  Backend& backend_;
  std::promise<void> promise_;
  std::shared_future<void> gate_ = promise_.get_future().share();
  bool opened_ = false;
};

TEST(PagedKvCacheLiveStreamError, SynchronizeRethrowsAnAsynchronousUseAfterFree) {
  std::unique_ptr<Backend> backend = test::host_backend();
  Stream s = backend->create_stream();
  PagedKvCache cache(test::small_config(), 8, *backend, no_trace());
  QueuedUseAfterFree fault(*backend);
  cache.zero_block(0, s);  // the cache now waits for s
  fault.queue_on(s);
  fault.open();
  ASSERT_TRUE(backend->stream_alive(s));
  EXPECT_THAT(message_of<InvalidArgument>([&] { cache.synchronize(); }),
              AllOf(HasSubstr("memset_async"), HasSubstr("use after free")));
  EXPECT_TRUE(cache.queued_streams().empty());
  EXPECT_NO_THROW(s.synchronize()) << "reported once, by the cache";
  EXPECT_NO_THROW(cache.synchronize());
}

TEST(PagedKvCacheLiveStreamError, TheDestructorLogsAnAsynchronousUseAfterFree) {
  test::LogRecorder log(log::Level::warn);
  std::unique_ptr<Backend> backend = test::host_backend();
  Stream s = backend->create_stream();  // outlives the cache
  {
    PagedKvCache cache(test::small_config(), 8, *backend, no_trace());
    QueuedUseAfterFree fault(*backend);
    cache.poison_block(3, s);
    fault.queue_on(s);
    fault.open();
  }  // no synchronize: the destructor's
  const std::vector<std::string> logged = log.find(log::Level::error, "use after free");
  ASSERT_EQ(logged.size(), 1u);
  EXPECT_THAT(logged[0], AllOf(HasSubstr("~PagedKvCache"), HasSubstr("memset_async")));
  EXPECT_NO_THROW(s.synchronize()) << "the error came out once, in the log";
}

TEST(PagedKvCacheLiveStreamError, OnlyADestroyedStreamIsSkippedAndItIsNotSynchronized) {
  std::unique_ptr<Backend> backend = test::host_backend();
  Stream live = backend->create_stream();
  PagedKvCache cache(test::small_config(), 8, *backend, no_trace());
  QueuedUseAfterFree fault(*backend);
  {
    Stream gone = backend->create_stream();
    cache.zero_block(0, gone);
  }  // destroyed first: remembered first
  cache.zero_block(1, live);
  fault.queue_on(live);
  fault.open();
  ASSERT_EQ(cache.queued_streams().size(), 2u);
  EXPECT_FALSE(backend->stream_alive(cache.queued_streams()[0]));
  backend->reset_call_counts();
  EXPECT_THAT(message_of<InvalidArgument>([&] { cache.synchronize(); }),
              HasSubstr("use after free"));
  EXPECT_EQ(backend->call_counts().synchronize, 1u) << "the dead stream is not asked at all";
}

TEST_F(PagedKvCacheFaultTest, AReadOrWriteWhoseSecondCopyFailsWaitsForTheFirst) {
  Scenario s(fb_, test::small_config());
  for (const bool write : {false, true}) {
    SCOPED_TRACE(write ? "write_block" : "read_block");
    fb_.set_plan(FaultKind::copy, {.nth = 2});  // the V copy; the K copy is queued
    fb_.reset_fault_counts();
    const std::vector<std::uint8_t> k(s.cache.k_block_bytes(1), 0xAB),
        v(s.cache.v_block_bytes(1), 0xCD);
    if (write) {
      EXPECT_THROW(s.cache.write_block(1, 2, k, v, s.stream), BackendError);
    } else {
      EXPECT_THROW((void)s.cache.read_block(1, 2, s.stream), BackendError);
    }
    fb_.clear_plans();
    EXPECT_EQ(fb_.counts(FaultKind::copy).faults, 1u);
    EXPECT_EQ(fb_.counts(FaultKind::synchronize).calls, 1u)
        << "the queued K copy was waited for before its buffer could go";
    EXPECT_TRUE(s.cache.queued_streams().empty()) << "nothing of it is left queued";
  }
}

}  // namespace
}  // namespace kvport
