// SPDX-License-Identifier: Apache-2.0
// The seams an engine plugs into, on every backend: its own streams
// (Backend::wrap_stream) and its own memory (Backend::adopt_memory).
//
// The "engine" here is what a backend-generic test can be: for streams, the
// vendor handle of a stream (StreamView::vendor_handle) wrapped back, so the
// engine's work and kvport's share one vendor stream; for memory, an
// allocation of a second backend of the same kind (a second context on the
// same device), which the backend under test never allocated. gpusim's own
// tests (tests/gpusim) also wrap a vendor stream no backend created.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "conformance.hpp"
#include "gpusim_backend.hpp"
#include "kvport/platform/backend.hpp"
#include "kvport/platform/error.hpp"
#include "kvport/testing/support.hpp"

#if KVPORT_CONFORMANCE_CUDA
// The runtimes' C API (file scope: C linkage), declared here so that the suite
// needs no vendor headers.
extern "C" int cudaMalloc(void** ptr, std::size_t bytes);
extern "C" int cudaFree(void* ptr);
#endif
#if KVPORT_CONFORMANCE_HIP
extern "C" int hipMalloc(void** ptr, std::size_t bytes);
extern "C" int hipFree(void* ptr);
#endif

namespace kvport::conformance {
namespace {

using kvport::testing::message_of;
using ::testing::HasSubstr;

// ---- the engine's streams ----------------------------------------------------------

TEST_P(Conformance, WrappedStreamIsOrderedWithTheEnginesWorkOnIt) {
  // The engine queues a large fill on its stream; kvport then copies from the
  // filled buffer through a wrap of the same stream and waits on the wrap
  // only. Ordered on one stream, the copy sees every filled byte.
  Stream engine = b().create_stream();
  void* vendor = engine.view().vendor_handle();
  WrappedStream wrapped = b().wrap_stream(vendor);
  ASSERT_TRUE(wrapped);
  EXPECT_FALSE(wrapped.view() == engine.view());  // a handle of its own
  EXPECT_EQ(wrapped.vendor_handle(), vendor);     // the same vendor stream
  EXPECT_TRUE(b().stream_alive(wrapped));

  const std::size_t bytes = 32 * kMiB;
  const DevicePtr src = alloc(bytes);
  const DevicePtr dst = alloc(bytes);
  b().memset_async(dst, 0x00, bytes, engine);
  b().memset_async(src, 0xA5, bytes, engine);           // the engine's work
  b().copy_d2d_async(dst, src, bytes, wrapped.view());  // kvport's, after it
  b().synchronize(wrapped);
  EXPECT_TRUE(same_bytes(download(dst, bytes, wrapped), Bytes(bytes, 0xA5)));

  // And the other way: work queued through the wrap is waited for by the
  // engine's stream.
  b().memset_async(dst, 0x3C, bytes, wrapped);
  b().synchronize(engine);
  Bytes back(bytes);
  b().copy_d2h(back.data(), dst, bytes, engine);
  EXPECT_TRUE(same_bytes(back, Bytes(bytes, 0x3C)));
}

TEST_P(Conformance, WrappedStreamCarriesEventsAndAsyncErrors) {
  // A wrap is a stream like any other: events record on it and other streams
  // wait for them; an asynchronous error queued through it surfaces at its
  // synchronize.
  Stream engine = b().create_stream();
  WrappedStream wrapped = b().wrap_stream(engine.view().vendor_handle());
  Stream other = b().create_stream();
  const std::size_t bytes = 8 * kMiB;
  const DevicePtr p = alloc(bytes);
  b().memset_async(p, 0x11, bytes, wrapped);
  Event done = b().create_event();
  done.record(wrapped);
  done.wait(other);
  Bytes out(bytes);
  b().copy_d2h_async(out.data(), p, bytes, other);
  b().synchronize(other);
  EXPECT_TRUE(same_bytes(out, Bytes(bytes, 0x11)));
  EXPECT_TRUE(done.query());
}

TEST_P(Conformance, ReleasingAWrapNeverDestroysTheStream) {
  Stream engine = b().create_stream();
  const DevicePtr p = alloc(4096);
  WrappedStream wrapped = b().wrap_stream(engine.view().vendor_handle());
  const StreamView stale = wrapped.view();
  b().memset_async(p, 0x5A, 4096, wrapped);
  b().synchronize(wrapped);
  wrapped.release();
  EXPECT_FALSE(wrapped);
  EXPECT_FALSE(b().stream_alive(stale));
  EXPECT_THAT(message_of<InvalidArgument>([&] { b().memset_async(p, 0, 16, stale); }),
              HasSubstr("not a live stream"));
  EXPECT_THROW(b().synchronize(stale), InvalidArgument);
  EXPECT_THROW((void)stale.vendor_handle(), InvalidArgument);
  EXPECT_THROW(b().synchronize(wrapped), InvalidArgument);  // an empty wrap: no backend

  // The engine's stream is untouched: it still runs work, in order.
  EXPECT_TRUE(b().stream_alive(engine));
  b().memset_async(p, 0x77, 4096, engine);
  Bytes back(4096);
  b().copy_d2h(back.data(), p, 4096, engine);
  EXPECT_TRUE(same_bytes(back, Bytes(4096, 0x77)));

  // The same for the backend's default stream, and for a wrap destroyed by
  // going out of scope or moved over.
  {
    WrappedStream def = b().wrap_stream(stream().vendor_handle());
    WrappedStream moved = std::move(def);
    EXPECT_FALSE(def);  // NOLINT(bugprone-use-after-move): the point
    b().memset_async(p, 0x01, 4096, moved);
    moved = b().wrap_stream(stream().vendor_handle());  // the first wrap is forgotten
    b().synchronize(moved);
  }
  EXPECT_TRUE(b().stream_alive(stream()));
  EXPECT_TRUE(same_bytes(download(p, 4096), Bytes(4096, 0x01)));
}

TEST_P(Conformance, WrappingTwiceGivesTwoRegistrationsOfOneStream) {
  Stream engine = b().create_stream();
  void* vendor = engine.view().vendor_handle();
  WrappedStream a = b().wrap_stream(vendor);
  WrappedStream c = b().wrap_stream(vendor);
  EXPECT_FALSE(a.view() == c.view());
  EXPECT_EQ(a.vendor_handle(), c.vendor_handle());
  a.release();
  EXPECT_TRUE(b().stream_alive(c));
  b().synchronize(c);
}

TEST_P(Conformance, VendorHandleOfAStaleOrForeignViewIsRefused) {
  StreamView stale = [&] {
    Stream s = b().create_stream();
    return s.view();
  }();
  EXPECT_THROW((void)stale.vendor_handle(), InvalidArgument);
  std::unique_ptr<Backend> other = make_any_backend(GetParam());
  EXPECT_THAT(
      message_of<InvalidArgument>([&] { (void)b().vendor_stream(other->default_stream()); }),
      HasSubstr("not one of this backend's"));
}

TEST_P(Conformance, WrapStreamRefusesWhatItCannotWrap) {
  // The host backend wraps only its own queues; a GPU runtime cannot tell a
  // bad handle (the vendor reports it at first use), so only null is checked,
  // and only where the runtime has no null default stream (gpusim).
  if (info_.name == "gpusim") {
    EXPECT_THAT(message_of<InvalidArgument>([&] { (void)b().wrap_stream(nullptr); }),
                HasSubstr("null stream handle"));
  } else if (b().memory_kind() == MemoryKind::host) {
    EXPECT_THAT(message_of<InvalidArgument>([&] { (void)b().wrap_stream(nullptr); }),
                HasSubstr("null handle"));
    int not_a_queue = 0;
    EXPECT_THAT(message_of<InvalidArgument>([&] { (void)b().wrap_stream(&not_a_queue); }),
                HasSubstr("not the queue of a live stream"));
    // A queue of another host backend is not one of this backend's.
    std::unique_ptr<Backend> other = make_any_backend(GetParam());
    EXPECT_THROW((void)b().wrap_stream(other->default_stream().vendor_handle()), InvalidArgument);
  } else {
    GTEST_SKIP() << "a GPU runtime cannot check a stream handle before its first use; "
                    "null is its legacy default stream";
  }
}

// ---- the engine's memory -----------------------------------------------------------

void* engine_malloc(const std::string& backend, std::size_t bytes) {
  if (backend == "host" || backend == "fault_host")
    return std::aligned_alloc(256, (bytes + 255) / 256 * 256);
  if (backend == "gpusim") return kvport::testing::gpusim_malloc_native(bytes);
  void* p = nullptr;
#if KVPORT_CONFORMANCE_CUDA
  if (backend == "cuda") return cudaMalloc(&p, bytes) == 0 ? p : nullptr;
#endif
#if KVPORT_CONFORMANCE_HIP
  if (backend == "hip") return hipMalloc(&p, bytes) == 0 ? p : nullptr;
#endif
  return p;
}

void engine_free(const std::string& backend, void* p) {
  if (backend == "host" || backend == "fault_host") return std::free(p);
  if (backend == "gpusim") return kvport::testing::gpusim_free_native(p);
#if KVPORT_CONFORMANCE_CUDA
  if (backend == "cuda") (void)cudaFree(p);
#endif
#if KVPORT_CONFORMANCE_HIP
  if (backend == "hip") (void)hipFree(p);
#endif
}

// Memory no kvport backend allocated, as an engine's own allocator gives it
// out: aligned_alloc for host memory, the simulated runtime's malloc for
// gpusim, cudaMalloc / hipMalloc for the vendors' backends. (A second backend
// object's allocation will not do: adopted ranges are process-wide, and one
// backend may not adopt what another allocated.) Null where the suite cannot
// allocate it (the tests skip).
struct EngineMemory {
  std::string name;
  DevicePtr ptr;
  std::size_t bytes = 0;
  EngineMemory(std::string backend, std::size_t n) : name(std::move(backend)), bytes(n) {
    ptr = DevicePtr::from(engine_malloc(name, n));
  }
  ~EngineMemory() {
    if (!ptr.is_null()) engine_free(name, ptr.get());
  }
  EngineMemory(const EngineMemory&) = delete;
  EngineMemory& operator=(const EngineMemory&) = delete;
};

#define KVPORT_SKIP_WITHOUT_ENGINE_MEMORY(mem)                              \
  if ((mem).ptr.is_null())                                                  \
  GTEST_SKIP() << "no allocator outside kvport for backend '" << GetParam() \
               << "' in this build (adopted memory must not be another backend's allocation)"

TEST_P(Conformance, AdoptedMemoryTakesEveryOperation) {
  const std::size_t bytes = 1 * kMiB;
  EngineMemory mem(GetParam(), bytes);
  KVPORT_SKIP_WITHOUT_ENGINE_MEMORY(mem);
  AdoptedMemory adopted = b().adopt_memory(mem.ptr, bytes);
  EXPECT_EQ(adopted.ptr(), mem.ptr);
  EXPECT_EQ(adopted.size(), bytes);
  EXPECT_EQ(adopted.backend(), &b());

  Bytes expected = random_bytes(bytes, 23);
  b().copy_h2d(mem.ptr, expected.data(), bytes, stream());
  b().memset_async(mem.ptr.offset(100), 0x11, 50, stream());
  std::fill_n(expected.begin() + 100, 50, 0x11);
  const FillRegion fills[] = {{mem.ptr.offset(1000), 10}, {mem.ptr.offset(5000), 300}};
  b().fill_async(fills, 0x22, stream());
  std::fill_n(expected.begin() + 1000, 10, 0x22);
  std::fill_n(expected.begin() + 5000, 300, 0x22);
  // Copies between adopted and owned memory, both ways.
  const DevicePtr owned = upload(random_bytes(4096, 24));
  b().copy_d2d_async(mem.ptr.offset(8192), owned, 4096, stream());
  std::copy_n(random_bytes(4096, 24).begin(), 4096, expected.begin() + 8192);
  const CopyRegion batch[] = {{owned, mem.ptr, 64}};
  b().copy_batch_async(batch, stream());
  // The cache-aware fill over a pool set in adopted memory.
  const PoolGeometry pool{mem.ptr.offset(65536), 1024, 2048};
  BlockPoolSet set = b().register_block_pools({&pool, 1}, 16);
  const std::uint32_t ids[] = {3, 7};
  b().fill_blocks_async(set, ids, 0x33, stream());
  for (std::uint32_t id : ids)
    std::fill_n(expected.begin() + 65536 + id * 2048, 1024, 0x33);
  EXPECT_TRUE(same_bytes(download(mem.ptr, bytes), expected));
  EXPECT_TRUE(same_bytes(download(owned, 64), Bytes(expected.begin(), expected.begin() + 64)));
  // Ranges are checked as for an allocation.
  EXPECT_THAT(message_of<InvalidArgument>(
                  [&] { b().memset_async(mem.ptr.offset(bytes - 8), 0, 16, stream()); }),
              HasSubstr("out of bounds"));
}

TEST_P(Conformance, AdoptedMemoryIsNeverFreed) {
  const std::size_t bytes = 64 * kKiB;
  EngineMemory mem(GetParam(), bytes);
  KVPORT_SKIP_WITHOUT_ENGINE_MEMORY(mem);
  const Bytes content = random_bytes(bytes, 31);
  {
    AdoptedMemory adopted = b().adopt_memory(mem.ptr, bytes);
    b().copy_h2d(mem.ptr, content.data(), bytes, stream());
    EXPECT_FALSE(b().free(mem.ptr));  // refused and logged: not the backend's to free
    AdoptedMemory moved = std::move(adopted);
    EXPECT_TRUE(same_bytes(download(mem.ptr, bytes), content));
  }
  // The registration is gone: the range is unknown to the backend again ...
  EXPECT_THROW(b().memset_async(mem.ptr, 0, 16, stream()), InvalidArgument);
  // ... and free for another backend object, which finds the engine's bytes
  // intact. A backend destroyed while the memory is adopted does not free it.
  Bytes back(bytes);
  {
    std::unique_ptr<Backend> third = make_any_backend(GetParam());
    AdoptedMemory adopted = third->adopt_memory(mem.ptr, bytes);
    third->copy_d2h(back.data(), mem.ptr, bytes, third->default_stream());
    EXPECT_TRUE(same_bytes(back, content));
    adopted = AdoptedMemory();  // released before its backend, as the contract says
  }
  std::unique_ptr<Backend> fourth = make_any_backend(GetParam());
  AdoptedMemory again = fourth->adopt_memory(mem.ptr, bytes);
  std::fill(back.begin(), back.end(), std::uint8_t{0});
  fourth->copy_d2h(back.data(), mem.ptr, bytes, fourth->default_stream());
  EXPECT_TRUE(same_bytes(back, content));
}

// Adopted ranges are process-wide: a second backend object of the same kind
// (another engine's) can adopt neither the bytes this one adopted nor those it
// allocated, until they are released.
TEST_P(Conformance, AdoptedMemoryIsOneBackendObjectsAtATime) {
  EngineMemory mem(GetParam(), 8192);
  KVPORT_SKIP_WITHOUT_ENGINE_MEMORY(mem);
  std::unique_ptr<Backend> other = make_any_backend(GetParam());
  {
    AdoptedMemory held = b().adopt_memory(mem.ptr, 4096);
    EXPECT_THAT(
        message_of<InvalidArgument>([&] { (void)other->adopt_memory(mem.ptr.offset(4000), 200); }),
        HasSubstr("overlaps an adopted range"));
    EXPECT_NO_THROW((void)other->adopt_memory(mem.ptr.offset(4096), 4096));  // only touches
  }
  EXPECT_NO_THROW((void)other->adopt_memory(mem.ptr, 8192));
  const DevicePtr own = alloc(4096);
  EXPECT_THAT(message_of<InvalidArgument>([&] { (void)other->adopt_memory(own, 4096); }),
              HasSubstr("overlaps a live allocation"));
}

TEST_P(Conformance, AdoptMemoryRejectsBadRanges) {
  EngineMemory mem(GetParam(), 8192);
  KVPORT_SKIP_WITHOUT_ENGINE_MEMORY(mem);
  EXPECT_THAT(message_of<InvalidArgument>([&] { (void)b().adopt_memory(DevicePtr{}, 16); }),
              HasSubstr("null"));
  EXPECT_THAT(message_of<InvalidArgument>([&] { (void)b().adopt_memory(mem.ptr, 0); }),
              HasSubstr("size must be > 0"));
  EXPECT_THAT(
      message_of<InvalidArgument>([&] { (void)b().adopt_memory(DevicePtr(UINTPTR_MAX - 8), 64); }),
      HasSubstr("overflows"));
  // Overlapping the backend's own allocation, or another adoption.
  const DevicePtr own = alloc(4096);
  EXPECT_THAT(message_of<InvalidArgument>([&] { (void)b().adopt_memory(own.offset(100), 16); }),
              HasSubstr("overlaps a live allocation"));
  AdoptedMemory first = b().adopt_memory(mem.ptr.offset(1024), 1024);
  EXPECT_THAT(message_of<InvalidArgument>([&] { (void)b().adopt_memory(mem.ptr, 1025); }),
              HasSubstr("overlaps an adopted range"));
  EXPECT_THAT(
      message_of<InvalidArgument>([&] { (void)b().adopt_memory(mem.ptr.offset(2047), 16); }),
      HasSubstr("overlaps an adopted range"));
  // Neighbours that only touch are fine.
  AdoptedMemory before = b().adopt_memory(mem.ptr, 1024);
  AdoptedMemory after = b().adopt_memory(mem.ptr.offset(2048), 1024);
  EXPECT_EQ(after.size(), 1024u);
}

}  // namespace
}  // namespace kvport::conformance
