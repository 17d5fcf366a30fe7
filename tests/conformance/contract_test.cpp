// SPDX-License-Identifier: Apache-2.0
// Details of the Backend contract every backend must honour, beyond moving
// bytes: pointers checked at call time (use after free), stale and moved-from
// stream and event handles, DeviceBuffer ownership, and call counts. These
// were host-only unit tests; here gpusim, fault_host, CUDA and HIP run them
// too. (Events never recorded: streams_test.cpp and
// TimingEventsMeasureDeviceWork.)
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cstdint>
#include <optional>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

#include "conformance.hpp"
#include "kvport/platform/backend.hpp"
#include "kvport/platform/error.hpp"
#include "kvport/testing/support.hpp"

namespace kvport::conformance {
namespace {

using kvport::testing::message_of;
using ::testing::AllOf;
using ::testing::HasSubstr;

std::string hex(DevicePtr p) {
  std::ostringstream out;
  out << std::showbase << std::hex << p.address();
  return out.str();
}

// ---- pointers ----------------------------------------------------------------------

TEST_P(Conformance, UseAfterFreeIsRejectedAtCallTime) {
  // Every asynchronous operation checks its ranges when it is called, and
  // names the operation (and, for two-pointer operations, which side) in the
  // InvalidArgument; nothing reaches the stream.
  const DevicePtr keep = alloc(256);
  const DevicePtr gone = b().alloc(512);
  ASSERT_TRUE(b().free(gone));
  std::uint8_t host[8] = {};
  StreamView s = stream();
  // The message names the pointer and the freed allocation it lay in.
  EXPECT_THAT(message_of<InvalidArgument>([&] { b().memset_async(gone.offset(10), 0, 8, s); }),
              AllOf(HasSubstr("memset_async"), HasSubstr("use after free"),
                    HasSubstr(hex(gone.offset(10))), HasSubstr(hex(gone))));
  EXPECT_THAT(message_of<InvalidArgument>([&] { b().copy_h2d_async(gone, host, 8, s); }),
              AllOf(HasSubstr("copy_h2d_async"), HasSubstr("use after free")));
  EXPECT_THAT(message_of<InvalidArgument>([&] { b().copy_d2h_async(host, gone, 8, s); }),
              AllOf(HasSubstr("copy_d2h_async"), HasSubstr("use after free")));
  EXPECT_THAT(message_of<InvalidArgument>([&] { b().copy_d2d_async(keep, gone, 8, s); }),
              AllOf(HasSubstr("copy_d2d_async (source)"), HasSubstr("use after free")));
  EXPECT_THAT(message_of<InvalidArgument>([&] { b().copy_d2d_async(gone, keep, 8, s); }),
              AllOf(HasSubstr("copy_d2d_async (destination)"), HasSubstr("use after free")));
  const FillRegion fills[] = {{keep, 8}, {gone, 8}};
  EXPECT_THAT(message_of<InvalidArgument>([&] { b().fill_async(fills, 0, s); }),
              AllOf(HasSubstr("fill_async"), HasSubstr("use after free")));
  const CopyRegion copies[] = {{gone, keep, 8}};
  EXPECT_THAT(message_of<InvalidArgument>([&] { b().copy_batch_async(copies, s); }),
              AllOf(HasSubstr("copy_batch_async (destination)"), HasSubstr("use after free")));
  EXPECT_NO_THROW(b().synchronize(s));  // nothing was queued, so no error either
}

// ---- stream and event handles ---------------------------------------------------------

// A view of a stream that was created and destroyed.
StreamView destroyed_stream_view(Backend& backend) {
  Stream s = backend.create_stream();
  return s.view();
}

// Every call that takes a stream rejects `stale` (a destroyed stream's view)
// with "not a live stream": a fill into `p` (64 bytes), synchronize, and an
// event's record and wait.
void expect_stream_rejected(Backend& backend, DevicePtr p, StreamView stale) {
  EXPECT_THAT(message_of<InvalidArgument>([&] { backend.memset_async(p, 0, 64, stale); }),
              HasSubstr("not a live stream"));
  EXPECT_THAT(message_of<InvalidArgument>([&] { backend.synchronize(stale); }),
              HasSubstr("not a live stream"));
  Event e = backend.create_event();
  EXPECT_THAT(message_of<InvalidArgument>([&] { e.record(stale); }),
              HasSubstr("not a live stream"));
  EXPECT_THAT(message_of<InvalidArgument>([&] { e.wait(stale); }), HasSubstr("not a live stream"));
}

TEST_P(Conformance, DestroyedStreamIsRejected) {
  // The contract (StreamView, stream.hpp): backends reject a view that names
  // a destroyed stream.
  const DevicePtr p = alloc(64);
  expect_stream_rejected(b(), p, destroyed_stream_view(b()));
}

TEST_P(Conformance, DestroyedStreamIsRejectedAfterANewStreamIsCreated) {
  // A new stream may well get the destroyed one's native handle back; the
  // stale view must still be rejected, not queue work on the newcomer.
  const DevicePtr p = alloc(64);
  const StreamView stale = destroyed_stream_view(b());
  Stream fresh = b().create_stream();
  expect_stream_rejected(b(), p, stale);
  b().memset_async(p, 0x2B, 64, fresh);
  EXPECT_NO_THROW(fresh.synchronize());
  EXPECT_EQ(download(p, 64), Bytes(64, 0x2B));
}

TEST_P(Conformance, MovedFromHandlesThrow) {
  Stream s = b().create_stream();
  Stream moved = std::move(s);
  EXPECT_THAT(message_of<InvalidArgument>([&] { s.synchronize(); }),  // NOLINT: use after move
              HasSubstr("moved-from"));
  EXPECT_NO_THROW(moved.synchronize());
  EXPECT_THAT(message_of<InvalidArgument>([&] { b().synchronize(s); }),  // NOLINT
              HasSubstr("moved-from"));
  Event e = b().create_event();
  Event e2 = std::move(e);
  EXPECT_THAT(message_of<InvalidArgument>([&] { e.record(moved); }),  // NOLINT
              HasSubstr("moved-from"));
  EXPECT_THROW(e.wait(moved), InvalidArgument);    // NOLINT
  EXPECT_THROW(e.synchronize(), InvalidArgument);  // NOLINT
  EXPECT_NO_THROW(e2.record(moved));
  EXPECT_NO_THROW(e2.synchronize());
}

TEST_P(Conformance, StreamMoveAssignmentReleasesTheOldStream) {
  Stream a = b().create_stream();
  const StreamView old_view = a.view();
  a = b().create_stream();
  EXPECT_THROW(b().synchronize(old_view), InvalidArgument);
  EXPECT_NO_THROW(a.synchronize());
}

TEST_P(Conformance, StreamAliveFollowsEachStreamsLifetime) {
  // Backend::stream_alive: what a caller that remembers streams (the cache's
  // destructor) asks before it waits, instead of guessing from an error.
  EXPECT_TRUE(b().stream_alive(b().default_stream()));
  std::optional<Stream> s(b().create_stream());
  const StreamView view = s->view();
  EXPECT_TRUE(b().stream_alive(view));
  b().memset_async(alloc(64), 0, 64, view);  // work queued does not change it
  EXPECT_TRUE(b().stream_alive(view));
  s.reset();
  const CallCounts before = b().call_counts();
  EXPECT_FALSE(b().stream_alive(view)) << "dead after destroy";
  // A new stream may get the old native handle back; the old view stays dead.
  Stream fresh = b().create_stream();
  EXPECT_FALSE(b().stream_alive(view));
  EXPECT_TRUE(b().stream_alive(fresh));
  // Moved-from and move-assigned-over handles.
  Stream moved = std::move(fresh);
  EXPECT_FALSE(b().stream_alive(fresh.view()));  // NOLINT(bugprone-use-after-move): the point
  EXPECT_TRUE(b().stream_alive(moved));
  const StreamView replaced = moved.view();
  moved = b().create_stream();
  EXPECT_FALSE(b().stream_alive(replaced));
  EXPECT_TRUE(b().stream_alive(moved));
  // A stream of another backend is not one of this backend's.
  std::unique_ptr<Backend> other = make_any_backend(GetParam());
  Stream foreign = other->create_stream();
  EXPECT_FALSE(b().stream_alive(foreign));
  EXPECT_FALSE(b().stream_alive(other->default_stream()));
  EXPECT_TRUE(other->stream_alive(foreign));
  // A query: it queues nothing and waits for nothing.
  const CallCounts after = b().call_counts();
  EXPECT_EQ(after.synchronize, before.synchronize);
  EXPECT_EQ(after.device_ops(), before.device_ops());
  EXPECT_TRUE(b().stream_alive(b().default_stream()));
}

// ---- DeviceBuffer ------------------------------------------------------------------------

TEST_P(Conformance, DeviceBufferFreesOnDestructionAndMoveAssignment) {
  // Whether a pointer is still allocated is asked of free() itself: it
  // returns false for memory already freed (mem_info is too coarse on GPUs).
  DevicePtr first, second;
  {
    DeviceBuffer a(b(), 1000);
    first = a.ptr();
    EXPECT_EQ(a.size(), 1000u);
    EXPECT_EQ(a.backend(), &b());
    EXPECT_FALSE(a.ptr().is_null());

    DeviceBuffer moved = std::move(a);
    EXPECT_TRUE(a.ptr().is_null());  // NOLINT: checking the moved-from state
    EXPECT_EQ(a.backend(), nullptr);
    EXPECT_EQ(a.size(), 0u);
    EXPECT_EQ(moved.ptr(), first);
    EXPECT_EQ(moved.size(), 1000u);

    DeviceBuffer c(b(), 5000);
    second = c.ptr();
    c = std::move(moved);  // c's own 5000 bytes are released here
    EXPECT_EQ(c.ptr(), first);
    EXPECT_EQ(c.size(), 1000u);
    EXPECT_FALSE(b().free(second)) << "move assignment kept the old allocation";
    b().memset_async(c.ptr(), 0x5A, 1000, stream());
    EXPECT_EQ(download(c.ptr(), 1000), Bytes(1000, 0x5A));
  }
  EXPECT_FALSE(b().free(first)) << "the destructor did not free the allocation";
  DeviceBuffer empty;  // a default buffer owns nothing
  EXPECT_TRUE(empty.ptr().is_null());
  EXPECT_EQ(empty.backend(), nullptr);
}

// ---- call counts ---------------------------------------------------------------------------

TEST_P(Conformance, CallCountsCountEachPublicCallOnce) {
  const DevicePtr a = alloc(4096), c = alloc(4096);
  std::vector<std::uint8_t> host(64);
  StreamView s = stream();
  b().reset_call_counts();
  b().memset_async(a, 0, 4096, s);
  std::vector<FillRegion> fills;
  for (std::size_t i = 0; i < 64; ++i)
    fills.push_back({a.offset(i * 64), 32});
  b().fill_async(fills, 1, s);
  b().copy_h2d_async(a, host.data(), 64, s);
  b().copy_d2h_async(host.data(), a, 64, s);
  b().copy_d2d_async(c, a, 64, s);
  std::vector<CopyRegion> copies;
  for (std::size_t i = 0; i < 16; ++i)
    copies.push_back({c.offset(i * 256), a.offset(i * 256), 128});
  b().copy_batch_async(copies, s);
  std::vector<HostCopyRegion> host_copies;
  for (std::size_t i = 0; i < 8; ++i)
    host_copies.push_back({a.offset(1024 + i * 256), host.data() + i * 8, 8});
  b().copy_batch_h2d_async(host_copies, s);
  b().copy_batch_d2h_async(host_copies, s);
  b().synchronize(s);
  const DevicePtr p = b().alloc(10);
  b().free(p);
  const CallCounts counts = b().call_counts();
  EXPECT_EQ(counts.memset, 1u);
  EXPECT_EQ(counts.fill, 1u);
  EXPECT_EQ(counts.copy, 3u);
  EXPECT_EQ(counts.copy_batch, 1u);
  EXPECT_EQ(counts.copy_host_batch, 2u);
  EXPECT_EQ(counts.synchronize, 1u);
  EXPECT_EQ(counts.alloc, 1u);
  EXPECT_EQ(counts.free, 1u);
  EXPECT_EQ(counts.device_ops(), 8u);
  b().reset_call_counts();
  EXPECT_EQ(b().call_counts().device_ops(), 0u);
  EXPECT_EQ(b().call_counts().alloc, 0u);
}

TEST_P(Conformance, EmptyFillAndBatchAreNotCounted) {
  b().reset_call_counts();
  b().fill_async({}, 0, stream());
  b().copy_batch_async({}, stream());
  EXPECT_EQ(b().call_counts().device_ops(), 0u);
}

}  // namespace
}  // namespace kvport::conformance
