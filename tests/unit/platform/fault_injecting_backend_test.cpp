// SPDX-License-Identifier: Apache-2.0
// FaultInjectingBackend: plans (Nth call, every call from N, probability under
// a seed, combined), synchronous and deferred faults, where and how often a
// deferred error surfaces, counters, live allocations and bad plans. The inner
// backend is the host backend; every check reads the memory back.
#include "kvport/platform/fault_injecting_backend.hpp"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <limits>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "kvport/backends/host_backend.hpp"
#include "kvport/platform/backend.hpp"
#include "kvport/platform/error.hpp"
#include "kvport/platform/log.hpp"
#include "kvport/testing/fault_report.hpp"
#include "kvport/testing/support.hpp"

namespace kvport {
namespace {

using kvport::testing::message_of;
using ::testing::AllOf;
using ::testing::HasSubstr;
using Bytes = std::vector<std::uint8_t>;

constexpr std::size_t kMiB = std::size_t{1} << 20;
constexpr std::size_t kBytes = 4096;

std::unique_ptr<Backend> host() {
  return make_host_backend(HostBackendOptions{64 * kMiB});
}

// Captures warnings whatever KVPORT_LOG_LEVEL says.
class WarnCapture {
 public:
  WarnCapture() : saved_(log::level()) { log::set_level(log::Level::warn); }
  ~WarnCapture() { log::set_level(saved_); }
  WarnCapture(const WarnCapture&) = delete;
  WarnCapture& operator=(const WarnCapture&) = delete;
  std::string text() const { return capture_.text(); }

 private:
  log::Level saved_;
  log::ScopedCapture capture_;
};

class FaultInjectingBackendTest : public ::testing::Test {
 protected:
  // A buffer of kBytes holding `value`.
  DevicePtr buffer(std::uint8_t value) {
    DevicePtr p = fb_.alloc(kBytes);
    owned_.push_back(p);
    fb_.memset_async(p, value, kBytes, fb_.default_stream());
    fb_.synchronize(fb_.default_stream());
    return p;
  }

  // Reads through the inner backend, so that no plan of the decorator applies.
  Bytes read(DevicePtr p, std::size_t bytes = kBytes) {
    Bytes out(bytes);
    fb_.inner().copy_d2h(out.data(), p, bytes, fb_.inner().default_stream());
    return out;
  }

  void TearDown() override {
    fb_.clear_plans();
    for (DevicePtr p : owned_)
      fb_.free(p);
  }

  FaultInjectingBackend fb_{host()};
  std::vector<DevicePtr> owned_;
};

// ---- identity and forwarding ---------------------------------------------------------

TEST_F(FaultInjectingBackendTest, NameAndQueriesForwardToTheInnerBackend) {
  EXPECT_EQ(fb_.name(), "fault(host)");
  EXPECT_EQ(fb_.inner().name(), "host");
  EXPECT_EQ(fb_.device_count(), 1);
  EXPECT_EQ(fb_.memory_kind(), MemoryKind::host);  // the inner backend's
  EXPECT_EQ(fb_.inner().memory_kind(), MemoryKind::host);
  EXPECT_EQ(fb_.mem_info().total_bytes, 64 * kMiB);
  DevicePtr p = buffer(0x5A);
  EXPECT_EQ(fb_.mem_info().free_bytes, fb_.inner().mem_info().free_bytes);
  EXPECT_LT(fb_.mem_info().free_bytes, 64 * kMiB);
  EXPECT_EQ(read(p), Bytes(kBytes, 0x5A));
}

TEST_F(FaultInjectingBackendTest, ANullInnerBackendIsAnInvalidArgument) {
  EXPECT_THAT(
      message_of<InvalidArgument>([] { FaultInjectingBackend fb{std::unique_ptr<Backend>()}; }),
      HasSubstr("null"));
}

TEST_F(FaultInjectingBackendTest, ANonOwningDecoratorLeavesItsInnerBackendAlive) {
  std::unique_ptr<Backend> inner = host();
  DevicePtr p;
  {
    FaultInjectingBackend fb(*inner);
    EXPECT_EQ(fb.name(), "fault(host)");
    EXPECT_EQ(&fb.inner(), inner.get());
    p = fb.alloc(kBytes);
    Stream s = fb.create_stream();
    fb.memset_async(p, 0x21, kBytes, s);
    s.synchronize();
  }
  Bytes out(kBytes);
  inner->copy_d2h(out.data(), p, kBytes, inner->default_stream());
  EXPECT_EQ(out, Bytes(kBytes, 0x21));
  EXPECT_TRUE(inner->free(p));
}

TEST_F(FaultInjectingBackendTest, WithoutAPlanEveryCallIsCountedAndForwarded) {
  DevicePtr a = buffer(1), c = buffer(2);
  Stream s = fb_.create_stream();
  const FillRegion regions[] = {{a, 10}, {a.offset(100), 10}};
  fb_.fill_async(regions, 3, s);
  const CopyRegion copies[] = {{c, a, 16}};
  fb_.copy_batch_async(copies, s);
  const PoolGeometry pools[] = {{a, 64, 64}};
  BlockPoolSet set = fb_.register_block_pools(pools, 4);
  const std::uint32_t ids[] = {2};
  fb_.fill_blocks_async(set, ids, 9, s);
  // Host batches both ways: a's bytes 100..115 out, then into c's 48..63.
  Bytes staging(16, 0);
  const HostCopyRegion out[] = {{a.offset(100), staging.data(), 16}};
  fb_.copy_batch_d2h_async(out, s);
  const HostCopyRegion in[] = {{c.offset(48), staging.data(), 16}};
  fb_.copy_batch_h2d_async(in, s);
  s.synchronize();
  Event e = fb_.create_event();
  e.record(s);
  e.synchronize();

  Bytes expect_a(kBytes, 1), expect_c(kBytes, 2);
  std::fill_n(expect_a.begin(), 10, 3);
  std::fill_n(expect_a.begin() + 100, 10, 3);
  std::copy_n(expect_a.begin(), 16, expect_c.begin());  // the batch copy ran after the fill
  std::copy_n(expect_a.begin() + 100, 16, expect_c.begin() + 48);  // through the host
  std::fill_n(expect_a.begin() + 128, 64, 9);
  EXPECT_EQ(read(a), expect_a);
  EXPECT_EQ(read(c), expect_c);

  EXPECT_EQ(fb_.counts(FaultKind::alloc).calls, 2u);
  EXPECT_EQ(fb_.counts(FaultKind::fill).calls, 2u + 2u);  // two memsets, fill, fill_blocks
  EXPECT_EQ(fb_.counts(FaultKind::copy).calls, 3u);       // copy batch, two host batches
  EXPECT_EQ(fb_.inner().call_counts().copy_host_batch, 2u);
  EXPECT_EQ(fb_.counts(FaultKind::synchronize).calls, 2u + 2u);  // two buffers, stream, event
  EXPECT_EQ(fb_.counts(FaultKind::stream_create).calls, 1u);
  EXPECT_EQ(fb_.counts(FaultKind::event_create).calls, 1u);
  EXPECT_EQ(fb_.counts(FaultKind::register_pools).calls, 1u);
  for (std::size_t k = 0; k < kFaultKindCount; ++k) {
    EXPECT_EQ(fb_.counts(static_cast<FaultKind>(k)).faults, 0u) << k;
  }
  fb_.reset_fault_counts();
  EXPECT_EQ(fb_.counts(FaultKind::fill).calls, 0u);
}

TEST_F(FaultInjectingBackendTest, KindNames) {
  EXPECT_EQ(to_string(FaultKind::alloc), "alloc");
  EXPECT_EQ(to_string(FaultKind::fill), "fill");
  EXPECT_EQ(to_string(FaultKind::copy), "copy");
  EXPECT_EQ(to_string(FaultKind::synchronize), "synchronize");
  EXPECT_EQ(to_string(FaultKind::stream_create), "stream_create");
  EXPECT_EQ(to_string(FaultKind::event_create), "event_create");
  EXPECT_EQ(to_string(FaultKind::register_pools), "register_pools");
  EXPECT_EQ(to_string(static_cast<FaultKind>(99)), "unknown");
}

// ---- plans -------------------------------------------------------------------------

TEST_F(FaultInjectingBackendTest, NthAllocFailsOnceWithAnInjectedOutOfMemory) {
  fb_.set_plan(FaultKind::alloc, {.nth = 3});
  std::vector<DevicePtr> got;
  got.push_back(fb_.alloc(100));
  got.push_back(fb_.alloc(100));
  const std::string message = message_of<OutOfMemory>([&] { fb_.alloc(100); });
  EXPECT_THAT(message, AllOf(HasSubstr("fault(host)"), HasSubstr("injected"),
                             HasSubstr("alloc call #3"), HasSubstr("requested 100 bytes")));
  got.push_back(fb_.alloc(100));
  got.push_back(fb_.alloc(100));
  EXPECT_EQ(fb_.counts(FaultKind::alloc).calls, 5u);
  EXPECT_EQ(fb_.counts(FaultKind::alloc).faults, 1u);
  EXPECT_EQ(fb_.inner().call_counts().alloc, 4u);  // the failed call never reached it
  EXPECT_EQ(fb_.live_allocations(), 4u);
  for (DevicePtr p : got)
    EXPECT_TRUE(fb_.free(p));
}

TEST_F(FaultInjectingBackendTest, CallsAreNumberedFromWhenThePlanWasSet) {
  owned_.push_back(fb_.alloc(64));
  owned_.push_back(fb_.alloc(64));
  fb_.set_plan(FaultKind::alloc, {.nth = 1});
  EXPECT_THROW(fb_.alloc(64), OutOfMemory);
  owned_.push_back(fb_.alloc(64));
  // Setting a plan again restarts the numbering.
  fb_.set_plan(FaultKind::alloc, {.nth = 2});
  owned_.push_back(fb_.alloc(64));
  EXPECT_THAT(message_of<OutOfMemory>([&] { fb_.alloc(64); }), HasSubstr("alloc call #2"));
  ASSERT_TRUE(fb_.plan(FaultKind::alloc).has_value());
  EXPECT_EQ(fb_.plan(FaultKind::alloc)->nth, 2u);
  EXPECT_FALSE(fb_.plan(FaultKind::copy).has_value());
}

TEST_F(FaultInjectingBackendTest, EveryCallFromNthFailsUntilThePlanIsCleared) {
  DevicePtr a = buffer(0x11), c = buffer(0x22);
  fb_.set_plan(FaultKind::copy, {.from_nth = 2});
  StreamView s = fb_.default_stream();
  fb_.copy_d2d_async(c, a, 8, s);  // call 1
  for (int call = 2; call <= 5; ++call) {
    try {
      fb_.copy_d2d_async(c.offset(8), a, 8, s);
      ADD_FAILURE() << "call " << call << " did not fail";
    } catch (const BackendError& e) {
      EXPECT_EQ(e.native_code(), kInjectedFaultCode);
      EXPECT_EQ(e.call(), "copy_d2d_async");
      EXPECT_EQ(e.backend(), "fault(host)");
      EXPECT_THAT(e.what(), HasSubstr("injected fault: copy call #" + std::to_string(call)));
    }
  }
  fb_.clear_plan(FaultKind::copy);
  fb_.copy_d2d_async(c.offset(16), a, 8, s);
  fb_.synchronize(s);
  Bytes expected(kBytes, 0x22);
  std::fill_n(expected.begin(), 8, 0x11);
  std::fill_n(expected.begin() + 16, 8, 0x11);  // the failed copies wrote nothing
  EXPECT_EQ(read(c), expected);
  EXPECT_EQ(fb_.counts(FaultKind::copy).calls, 6u);
  EXPECT_EQ(fb_.counts(FaultKind::copy).faults, 4u);
}

TEST_F(FaultInjectingBackendTest, ConditionsCombine) {
  DevicePtr a = buffer(0);
  fb_.set_plan(FaultKind::fill, {.nth = 2, .from_nth = 5});
  std::vector<int> failed;
  for (int call = 1; call <= 7; ++call) {
    try {
      fb_.memset_async(a, 1, 16, fb_.default_stream());
    } catch (const BackendError&) {
      failed.push_back(call);
    }
  }
  EXPECT_EQ(failed, (std::vector<int>{2, 5, 6, 7}));
}

// The calls (1-based) that fail among `calls` fills under `plan`, on a fresh
// decorator.
std::vector<int> failing_fills(const FaultPlan& plan, int calls) {
  FaultInjectingBackend fb(host());
  DevicePtr p = fb.alloc(64);
  fb.set_plan(FaultKind::fill, plan);
  std::vector<int> failed;
  for (int call = 1; call <= calls; ++call) {
    try {
      fb.memset_async(p, 0, 64, fb.default_stream());
    } catch (const BackendError&) {
      failed.push_back(call);
    }
  }
  fb.clear_plans();
  fb.synchronize(fb.default_stream());
  fb.free(p);
  return failed;
}

TEST_F(FaultInjectingBackendTest, ProbabilityUnderASeedIsDeterministic) {
  constexpr int kCalls = 400;
  const auto first = failing_fills({.probability = 0.25, .seed = 42}, kCalls);
  const auto again = failing_fills({.probability = 0.25, .seed = 42}, kCalls);
  const auto other = failing_fills({.probability = 0.25, .seed = 43}, kCalls);
  EXPECT_EQ(first, again);
  EXPECT_NE(first, other);
  // About a quarter of the calls (binomial: sd ~ 8.7 around 100).
  EXPECT_GT(first.size(), 50u);
  EXPECT_LT(first.size(), 150u);
  EXPECT_TRUE(failing_fills({.probability = 0.0, .seed = 1}, 100).empty());
  EXPECT_EQ(failing_fills({.probability = 1.0, .seed = 1}, 100).size(), 100u);
  // Other conditions do not shift the draws: same sequence, plus call 1.
  auto with_first = failing_fills({.nth = 1, .probability = 0.25, .seed = 42}, kCalls);
  auto expected = first;
  if (expected.empty() || expected.front() != 1) expected.insert(expected.begin(), 1);
  EXPECT_EQ(with_first, expected);
}

TEST_F(FaultInjectingBackendTest, ProbabilityDrawsArePerKind) {
  // Calls of another kind in between do not change the fill sequence.
  const auto plain = failing_fills({.probability = 0.5, .seed = 7}, 64);
  FaultInjectingBackend fb(host());
  DevicePtr p = fb.alloc(64);
  fb.set_plan(FaultKind::fill, {.probability = 0.5, .seed = 7});
  fb.set_plan(FaultKind::copy, {.probability = 0.5, .seed = 7});
  std::vector<int> failed;
  std::uint8_t host_bytes[8] = {};
  for (int call = 1; call <= 64; ++call) {
    try {
      fb.copy_h2d_async(p, host_bytes, 8, fb.default_stream());
    } catch (const BackendError&) {
    }
    try {
      fb.memset_async(p, 0, 64, fb.default_stream());
    } catch (const BackendError&) {
      failed.push_back(call);
    }
  }
  fb.clear_plans();
  fb.synchronize(fb.default_stream());
  fb.free(p);
  EXPECT_EQ(failed, plain);
}

// ---- synchronous and deferred faults ---------------------------------------------------

TEST_F(FaultInjectingBackendTest, ASynchronousFillFaultThrowsAtTheCallAndQueuesNothing) {
  DevicePtr a = buffer(0x33);
  Stream s = fb_.create_stream();
  fb_.set_plan(FaultKind::fill, {.nth = 1});
  const auto inner_before = fb_.inner().call_counts();
  EXPECT_THAT(message_of<BackendError>([&] { fb_.memset_async(a, 0, kBytes, s); }),
              AllOf(HasSubstr("memset_async"), HasSubstr("injected fault: fill call #1")));
  EXPECT_EQ(fb_.inner().call_counts().memset, inner_before.memset);
  EXPECT_NO_THROW(s.synchronize());  // nothing pending
  EXPECT_EQ(read(a), Bytes(kBytes, 0x33));
}

TEST_F(FaultInjectingBackendTest, EveryFillAndCopyCallIsCovered) {
  DevicePtr a = buffer(0), c = buffer(0);
  StreamView s = fb_.default_stream();
  const PoolGeometry pools[] = {{a, 64, 64}};
  BlockPoolSet set = fb_.register_block_pools(pools, 4);
  fb_.set_plan(FaultKind::fill, {.from_nth = 1});
  fb_.set_plan(FaultKind::copy, {.from_nth = 1});
  const FillRegion regions[] = {{a, 8}};
  const std::uint32_t ids[] = {1};
  const CopyRegion copies[] = {{c, a, 8}};
  Bytes host_bytes(8, 0x77);
  EXPECT_THROW(fb_.memset_async(a, 1, 8, s), BackendError);
  EXPECT_THROW(fb_.fill_async(regions, 1, s), BackendError);
  EXPECT_THROW(fb_.fill_blocks_async(set, ids, 1, s), BackendError);
  EXPECT_THROW(fb_.copy_h2d_async(a, host_bytes.data(), 8, s), BackendError);
  EXPECT_THROW(fb_.copy_d2h_async(host_bytes.data(), a, 8, s), BackendError);
  EXPECT_THROW(fb_.copy_d2d_async(c, a, 8, s), BackendError);
  EXPECT_THROW(fb_.copy_batch_async(copies, s), BackendError);
  EXPECT_THROW(fb_.copy_h2d(a, host_bytes.data(), 8, s), BackendError);
  const HostCopyRegion host_regions[] = {{a, host_bytes.data(), 8}};
  EXPECT_THROW(fb_.copy_batch_h2d_async(host_regions, s), BackendError);
  EXPECT_THROW(fb_.copy_batch_d2h_async(host_regions, s), BackendError);
  EXPECT_EQ(fb_.inner().call_counts().copy_host_batch, 0u);  // nothing reached the inner backend
  EXPECT_EQ(fb_.counts(FaultKind::fill).faults, 3u);
  EXPECT_EQ(fb_.counts(FaultKind::copy).faults, 7u);
  fb_.clear_plans();
  fb_.synchronize(s);
  EXPECT_EQ(read(a), Bytes(kBytes, 0));
  EXPECT_EQ(read(c), Bytes(kBytes, 0));
  EXPECT_EQ(host_bytes, Bytes(8, 0x77));
}

TEST_F(FaultInjectingBackendTest, ADeferredFaultSurfacesAtTheNextSynchronizeOfThatStreamOnce) {
  DevicePtr a = buffer(0x44);
  Stream s1 = fb_.create_stream(), s2 = fb_.create_stream();
  fb_.set_plan(FaultKind::fill, {.nth = 1, .mode = FaultMode::deferred});
  fb_.memset_async(a, 0, kBytes, s1);  // returns normally
  EXPECT_EQ(fb_.counts(FaultKind::fill).faults, 1u);
  EXPECT_NO_THROW(s2.synchronize());                       // another stream
  EXPECT_NO_THROW(fb_.synchronize(fb_.default_stream()));  // nor the default one
  const std::string message = message_of<BackendError>([&] { s1.synchronize(); });
  EXPECT_THAT(message, AllOf(HasSubstr("fault(host)"), HasSubstr("memset_async"),
                             HasSubstr("injected deferred fault: fill call #1")));
  EXPECT_NO_THROW(s1.synchronize());        // once
  EXPECT_EQ(read(a), Bytes(kBytes, 0x44));  // the faulted memset did nothing
  // The stream is usable again.
  fb_.memset_async(a, 0x45, kBytes, s1);
  s1.synchronize();
  EXPECT_EQ(read(a), Bytes(kBytes, 0x45));
}

TEST_F(FaultInjectingBackendTest, ADeferredCopyFaultFailsTheBlockingCopyAtItsSynchronize) {
  DevicePtr a = buffer(0x55);
  fb_.set_plan(FaultKind::copy, {.nth = 1, .mode = FaultMode::deferred});
  Bytes out(kBytes, 0xEE);
  EXPECT_THAT(
      message_of<BackendError>([&] { fb_.copy_d2h(out.data(), a, kBytes, fb_.default_stream()); }),
      HasSubstr("copy_d2h_async"));
  EXPECT_EQ(out, Bytes(kBytes, 0xEE));  // not copied
  fb_.copy_d2h(out.data(), a, kBytes, fb_.default_stream());
  EXPECT_EQ(out, Bytes(kBytes, 0x55));
}

TEST_F(FaultInjectingBackendTest, WorkQueuedAroundADeferredFaultStillRuns) {
  DevicePtr a = buffer(0), c = buffer(0);
  Stream s = fb_.create_stream();
  fb_.set_plan(FaultKind::fill, {.nth = 2, .mode = FaultMode::deferred});
  fb_.memset_async(a, 1, kBytes, s);
  fb_.memset_async(c, 2, kBytes, s);  // faulted
  fb_.memset_async(a.offset(8), 3, 8, s);
  EXPECT_THROW(s.synchronize(), BackendError);
  Bytes expected(kBytes, 1);
  std::fill_n(expected.begin() + 8, 8, 3);
  EXPECT_EQ(read(a), expected);
  EXPECT_EQ(read(c), Bytes(kBytes, 0));
}

TEST_F(FaultInjectingBackendTest, SeveralPendingErrorsSurfaceOnePerSynchronize) {
  DevicePtr a = buffer(0);
  Stream s = fb_.create_stream();
  fb_.set_plan(FaultKind::fill, {.from_nth = 1, .mode = FaultMode::deferred});
  fb_.memset_async(a, 1, 8, s);
  fb_.memset_async(a, 2, 8, s);
  fb_.inject_async_fault(s);  // the inner backend's own asynchronous error
  EXPECT_THAT(message_of<BackendError>([&] { s.synchronize(); }), HasSubstr("fill call #1"));
  EXPECT_THAT(message_of<BackendError>([&] { s.synchronize(); }), HasSubstr("fill call #2"));
  EXPECT_THAT(message_of<BackendError>([&] { s.synchronize(); }),
              AllOf(HasSubstr("host"), HasSubstr("inject_async_fault")));
  EXPECT_NO_THROW(s.synchronize());
}

TEST_F(FaultInjectingBackendTest, AStreamDestroyedWithPendingErrorsLogsThem) {
  DevicePtr a = buffer(0);
  WarnCapture capture;
  {
    Stream s = fb_.create_stream();
    fb_.set_plan(FaultKind::fill, {.nth = 1, .mode = FaultMode::deferred});
    fb_.memset_async(a, 1, 8, s);
    fb_.inject_async_fault(s);
  }
  const std::string text = capture.text();
  EXPECT_THAT(text, AllOf(HasSubstr("never synchronized"),
                          HasSubstr("injected deferred fault: fill call #1"),
                          HasSubstr("injected asynchronous fault")));
}

TEST_F(FaultInjectingBackendTest, TheDecoratorsDestructionLogsTheDefaultStreamsPendingError) {
  WarnCapture capture;
  {
    FaultInjectingBackend fb(host());
    DevicePtr p = fb.alloc(64);
    fb.set_plan(FaultKind::fill, {.nth = 1, .mode = FaultMode::deferred});
    fb.memset_async(p, 1, 64, fb.default_stream());
    fb.free(p);
  }
  EXPECT_THAT(capture.text(), AllOf(HasSubstr("default stream"), HasSubstr("fill call #1")));
}

TEST_F(FaultInjectingBackendTest, ASynchronizeFaultFailsAfterTheWorkIsDone) {
  DevicePtr a = buffer(0);
  Stream s = fb_.create_stream();
  fb_.memset_async(a, 0x66, kBytes, s);
  fb_.set_plan(FaultKind::synchronize, {.nth = 1});
  EXPECT_THAT(message_of<BackendError>([&] { s.synchronize(); }),
              AllOf(HasSubstr("synchronize"), HasSubstr("injected fault: synchronize call #1")));
  EXPECT_EQ(read(a), Bytes(kBytes, 0x66));  // the wait happened
  EXPECT_NO_THROW(s.synchronize());
}

TEST_F(FaultInjectingBackendTest, ASynchronizeFaultKeepsTheStreamsOwnErrorForLater) {
  Stream s = fb_.create_stream();
  fb_.inject_async_fault(s);
  fb_.set_plan(FaultKind::synchronize, {.nth = 1});
  EXPECT_THAT(message_of<BackendError>([&] { s.synchronize(); }), HasSubstr("injected fault"));
  EXPECT_THAT(message_of<BackendError>([&] { s.synchronize(); }),
              HasSubstr("injected asynchronous fault"));
  EXPECT_NO_THROW(s.synchronize());
}

TEST_F(FaultInjectingBackendTest, EventSynchronizeIsASynchronizeCall) {
  Stream s = fb_.create_stream();
  Event e = fb_.create_event();
  e.record(s);
  fb_.set_plan(FaultKind::synchronize, {.nth = 1});
  EXPECT_THAT(message_of<BackendError>([&] { e.synchronize(); }), HasSubstr("synchronize_event"));
  EXPECT_NO_THROW(e.synchronize());
  EXPECT_EQ(fb_.counts(FaultKind::synchronize).calls, 2u);
}

TEST_F(FaultInjectingBackendTest, StreamEventAndPoolCreationFaults) {
  fb_.set_plan(FaultKind::stream_create, {.nth = 1});
  EXPECT_THAT(message_of<BackendError>([&] { fb_.create_stream(); }), HasSubstr("create_stream"));
  Stream s = fb_.create_stream();
  fb_.set_plan(FaultKind::event_create, {.from_nth = 1});
  EXPECT_THAT(message_of<BackendError>([&] { fb_.create_event(); }), HasSubstr("create_event"));
  EXPECT_THAT(message_of<BackendError>([&] { fb_.create_timing_event(); }),
              HasSubstr("create_timing_event"));
  fb_.clear_plan(FaultKind::event_create);
  Event start = fb_.create_timing_event(), stop = fb_.create_timing_event();
  start.record(s);
  stop.record(s);
  EXPECT_GE(fb_.elapsed_seconds(start, stop), 0.0);

  DevicePtr a = buffer(0);
  const PoolGeometry pools[] = {{a, 64, 64}};
  fb_.set_plan(FaultKind::register_pools, {.nth = 1});
  EXPECT_THAT(message_of<BackendError>([&] { fb_.register_block_pools(pools, 4); }),
              HasSubstr("register_block_pools"));
  BlockPoolSet set = fb_.register_block_pools(pools, 4);
  EXPECT_EQ(set.backend(), &fb_);
  EXPECT_EQ(fb_.counts(FaultKind::register_pools).faults, 1u);
}

TEST_F(FaultInjectingBackendTest, AStaleStreamViewIsRejected) {
  DevicePtr a = buffer(0);
  std::optional<Stream> s(fb_.create_stream());
  const StreamView stale = s->view();
  s.reset();
  EXPECT_THAT(message_of<InvalidArgument>([&] { fb_.memset_async(a, 0, 8, stale); }),
              HasSubstr("not a live stream"));
  EXPECT_THROW(fb_.synchronize(stale), InvalidArgument);
}

// ---- live allocations ---------------------------------------------------------------------

TEST_F(FaultInjectingBackendTest, LiveAllocationsFollowAllocsAndFrees) {
  EXPECT_EQ(fb_.live_allocations(), 0u);
  DevicePtr a = fb_.alloc(100), c = fb_.alloc(300);
  EXPECT_EQ(fb_.live_allocations(), 2u);
  EXPECT_EQ(fb_.live_bytes(), 400u);
  fb_.set_plan(FaultKind::alloc, {.nth = 1});
  EXPECT_THROW(fb_.alloc(50), OutOfMemory);
  EXPECT_EQ(fb_.live_allocations(), 2u);
  {
    DeviceBuffer buffer(fb_, 1000);
    EXPECT_EQ(fb_.live_bytes(), 1400u);
  }
  EXPECT_EQ(fb_.live_bytes(), 400u);
  EXPECT_THROW(fb_.alloc(std::numeric_limits<std::size_t>::max() / 2), OutOfMemory);  // real
  EXPECT_EQ(fb_.live_allocations(), 2u);
  {
    WarnCapture rejected;
    EXPECT_FALSE(fb_.free(a.offset(16)));
    EXPECT_THAT(rejected.text(), HasSubstr("fault(host): free"));
  }
  EXPECT_EQ(fb_.live_allocations(), 2u);
  EXPECT_TRUE(fb_.free(a));
  EXPECT_EQ(fb_.live_allocations(), 1u);
  EXPECT_EQ(fb_.live_bytes(), 300u);
  EXPECT_TRUE(fb_.free(c));
  EXPECT_EQ(fb_.live_allocations(), 0u);
  EXPECT_EQ(fb_.live_bytes(), 0u);
  EXPECT_EQ(fb_.inner().mem_info().free_bytes, fb_.inner().mem_info().total_bytes);
}

// ---- bad plans ----------------------------------------------------------------------------

TEST_F(FaultInjectingBackendTest, BadPlansAreInvalidArgumentsAndKeepThePreviousPlan) {
  fb_.set_plan(FaultKind::fill, {.nth = 4});
  const std::pair<FaultKind, FaultPlan> bad[] = {
      {FaultKind::fill, {}},
      {FaultKind::fill, {.nth = 0}},
      {FaultKind::fill, {.from_nth = 0}},
      {FaultKind::fill, {.probability = -0.1}},
      {FaultKind::fill, {.probability = 1.5}},
      {FaultKind::fill, {.probability = std::numeric_limits<double>::quiet_NaN()}},
      {FaultKind::fill, {.nth = 1, .mode = static_cast<FaultMode>(7)}},
      {FaultKind::alloc, {.nth = 1, .mode = FaultMode::deferred}},
      {FaultKind::synchronize, {.nth = 1, .mode = FaultMode::deferred}},
      {FaultKind::stream_create, {.nth = 1, .mode = FaultMode::deferred}},
      {FaultKind::event_create, {.nth = 1, .mode = FaultMode::deferred}},
      {FaultKind::register_pools, {.nth = 1, .mode = FaultMode::deferred}},
      {static_cast<FaultKind>(kFaultKindCount), {.nth = 1}},
  };
  for (const auto& [kind, plan] : bad) {
    EXPECT_THROW(fb_.set_plan(kind, plan), InvalidArgument) << static_cast<int>(kind);
  }
  EXPECT_THAT(message_of<InvalidArgument>([&] { fb_.set_plan(FaultKind::copy, {.nth = 0}); }),
              AllOf(HasSubstr("set_plan(copy)"), HasSubstr("nth")));
  EXPECT_THAT(
      message_of<InvalidArgument>([&] { fb_.set_plan(FaultKind::copy, {.probability = 2.0}); }),
      HasSubstr("outside [0, 1]"));
  EXPECT_THAT(message_of<InvalidArgument>(
                  [&] { fb_.set_plan(FaultKind::alloc, {.nth = 1, .mode = FaultMode::deferred}); }),
              HasSubstr("deferred"));
  EXPECT_THROW(fb_.counts(static_cast<FaultKind>(-1)), InvalidArgument);
  EXPECT_THROW(fb_.clear_plan(static_cast<FaultKind>(kFaultKindCount)), InvalidArgument);
  EXPECT_THROW((void)fb_.plan(static_cast<FaultKind>(kFaultKindCount)), InvalidArgument);
  // The valid plan is still there, numbering untouched.
  ASSERT_TRUE(fb_.plan(FaultKind::fill).has_value());
  EXPECT_EQ(fb_.plan(FaultKind::fill)->nth, 4u);
  EXPECT_FALSE(fb_.plan(FaultKind::copy).has_value());
  EXPECT_FALSE(fb_.plan(FaultKind::alloc).has_value());
  // Edge values are fine.
  EXPECT_NO_THROW(fb_.set_plan(FaultKind::copy, {.probability = 0.0}));
  EXPECT_NO_THROW(fb_.set_plan(FaultKind::copy, {.probability = 1.0}));
}

// ---- threads ---------------------------------------------------------------------------

TEST_F(FaultInjectingBackendTest, ThreadsOnTheirOwnStreamsShareOnePlanSafely) {
  constexpr int kThreads = 2, kCalls = 200;
  fb_.set_plan(FaultKind::fill, {.probability = 0.3, .seed = 5, .mode = FaultMode::deferred});
  fb_.set_plan(FaultKind::alloc, {.probability = 0.1, .seed = 6});
  std::vector<int> errors(kThreads, 0), oom(kThreads, 0);
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&, t] {
      Stream s = fb_.create_stream();
      for (int i = 0; i < kCalls; ++i) {
        DevicePtr p;
        try {
          p = fb_.alloc(256);
        } catch (const OutOfMemory&) {
          ++oom[t];
          continue;
        }
        fb_.memset_async(p, static_cast<std::uint8_t>(i), 256, s);
        try {
          s.synchronize();
        } catch (const BackendError&) {
          ++errors[t];
        }
        fb_.free(p);
      }
    });
  }
  for (std::thread& t : threads)
    t.join();
  const FaultCounts fills = fb_.counts(FaultKind::fill);
  const FaultCounts allocs = fb_.counts(FaultKind::alloc);
  EXPECT_EQ(allocs.calls, std::uint64_t{kThreads * kCalls});
  EXPECT_EQ(allocs.faults, std::uint64_t(oom[0] + oom[1]));
  EXPECT_EQ(fills.calls, allocs.calls - allocs.faults);
  EXPECT_EQ(fills.faults, std::uint64_t(errors[0] + errors[1]));  // each surfaced once
  EXPECT_GT(fills.faults, 0u);
  EXPECT_EQ(fb_.live_allocations(), 0u);
}

TEST_F(FaultInjectingBackendTest, TheProcessWideFaultCountAddsUpEveryDecorator) {
  const std::uint64_t before = FaultInjectingBackend::faults_injected_in_process();
  fb_.set_plan(FaultKind::alloc, {.from_nth = 1});
  EXPECT_THROW(fb_.alloc(256), OutOfMemory);
  FaultInjectingBackend other(make_host_backend(HostBackendOptions{64 * kMiB}));
  other.set_plan(FaultKind::alloc, {.nth = 1});
  EXPECT_THROW(other.alloc(256), OutOfMemory);
  EXPECT_EQ(FaultInjectingBackend::faults_injected_in_process(), before + 2);
}

}  // namespace
}  // namespace kvport
