// SPDX-License-Identifier: Apache-2.0
// Pinned host memory: alloc_host / free_host / HostBuffer, and host <-> device
// copies with it, queued on two streams and ordered by an event.
#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#include "conformance.hpp"
#include "kvport/platform/error.hpp"
#include "kvport/testing/support.hpp"

namespace kvport::conformance {
namespace {

using kvport::testing::message_of;
using ::testing::HasSubstr;

bool aligned(const void* p) {
  return reinterpret_cast<std::uintptr_t>(p) % kHostAllocAlignment == 0;
}

TEST_P(Conformance, PinnedHostAllocationsAreAlignedAndUsable) {
  const std::size_t sizes[] = {1, 100, 4095, 4096, 4097, kMiB + 3};
  const CallCounts before = b().call_counts();
  std::vector<void*> ptrs;
  for (std::size_t i = 0; i < std::size(sizes); ++i) {
    void* p = b().alloc_host(sizes[i]);
    ASSERT_NE(p, nullptr);
    EXPECT_TRUE(aligned(p)) << sizes[i];
    std::memset(p, static_cast<int>(i + 1), sizes[i]);  // usable from the host
    ptrs.push_back(p);
  }
  EXPECT_EQ(b().call_counts().host_alloc - before.host_alloc, std::size(sizes));
  // Usable by the device: through device memory and back into another one.
  for (std::size_t i = 0; i < std::size(sizes); ++i) {
    DevicePtr d = alloc(sizes[i]);
    b().copy_h2d(d, ptrs[i], sizes[i], stream());
    b().memset_async(d, 0xEE, sizes[i] / 2, stream());
    void* back = b().alloc_host(sizes[i]);
    b().copy_d2h(back, d, sizes[i], stream());
    Bytes expected(sizes[i], static_cast<std::uint8_t>(i + 1));
    std::fill_n(expected.begin(), sizes[i] / 2, 0xEE);
    const auto* bytes = static_cast<const std::uint8_t*>(back);
    EXPECT_TRUE(same_bytes(Bytes(bytes, bytes + sizes[i]), expected)) << sizes[i];
    EXPECT_TRUE(b().free_host(back));
  }
  for (void* p : ptrs)
    EXPECT_TRUE(b().free_host(p));
  EXPECT_EQ(b().call_counts().host_free - before.host_free, 2 * std::size(sizes));
}

TEST_P(Conformance, PinnedHostMemoryErrors) {
  EXPECT_THAT(message_of<InvalidArgument>([&] { b().alloc_host(0); }), HasSubstr("alloc_host"));
  EXPECT_THROW(b().alloc_host(SIZE_MAX), OutOfMemory);

  const CallCounts before = b().call_counts();
  EXPECT_TRUE(b().free_host(nullptr));  // a no-op, not counted
  EXPECT_EQ(b().call_counts().host_free, before.host_free);

  int on_the_stack = 0;
  EXPECT_FALSE(b().free_host(&on_the_stack));
  std::vector<std::uint8_t> pageable(8192);
  EXPECT_FALSE(b().free_host(pageable.data()));
  DevicePtr device = alloc(4096);
  EXPECT_FALSE(b().free_host(device.get()));  // device memory is not pinned host memory
  void* p = b().alloc_host(8192);
  EXPECT_FALSE(b().free(DevicePtr::from(p)));               // nor the other way round
  EXPECT_FALSE(b().free_host(static_cast<char*>(p) + 16));  // interior
  EXPECT_TRUE(b().free_host(p));
  EXPECT_FALSE(b().free_host(p));  // double free

  // Another backend's pinned memory is foreign, even for a backend of the
  // same kind.
  auto other = make_any_backend(GetParam());
  void* theirs = other->alloc_host(4096);
  EXPECT_FALSE(b().free_host(theirs));
  EXPECT_TRUE(other->free_host(theirs));

  // Rejections changed nothing: the backend still works.
  void* q = b().alloc_host(4096);
  std::memset(q, 0x21, 4096);
  b().copy_h2d(device, q, 4096, stream());
  EXPECT_TRUE(same_bytes(download(device, 4096), Bytes(4096, 0x21)));
  EXPECT_TRUE(b().free_host(q));
}

TEST_P(Conformance, HostBufferOwnsPinnedMemory) {
  const CallCounts before = b().call_counts();
  {
    HostBuffer empty;
    EXPECT_EQ(empty.data(), nullptr);
    EXPECT_EQ(empty.size(), 0u);
    EXPECT_EQ(empty.backend(), nullptr);
    EXPECT_TRUE(empty.bytes().empty());
  }
  EXPECT_EQ(b().call_counts().host_alloc, before.host_alloc);
  EXPECT_EQ(b().call_counts().host_free, before.host_free);

  HostBuffer a(b(), 10000);
  ASSERT_NE(a.data(), nullptr);
  EXPECT_TRUE(aligned(a.data()));
  EXPECT_EQ(a.size(), 10000u);
  EXPECT_EQ(a.backend(), &b());
  ASSERT_EQ(a.bytes().size(), 10000u);
  EXPECT_EQ(a.bytes().data(), a.data());
  const Bytes content = random_bytes(10000, 150);
  std::copy(content.begin(), content.end(), a.bytes().begin());

  // Move construction: the memory changes hands, nothing is freed.
  void* const memory = a.data();
  HostBuffer c(std::move(a));
  EXPECT_EQ(a.data(), nullptr);  // NOLINT(bugprone-use-after-move): the moved-from state
  EXPECT_EQ(a.size(), 0u);
  EXPECT_EQ(a.backend(), nullptr);
  EXPECT_EQ(c.data(), memory);
  EXPECT_EQ(c.size(), 10000u);
  EXPECT_EQ(b().call_counts().host_free, before.host_free);

  // Move assignment frees what the target held.
  HostBuffer d(b(), 64);
  d = std::move(c);
  EXPECT_EQ(b().call_counts().host_free - before.host_free, 1u);
  EXPECT_EQ(d.data(), memory);
  EXPECT_EQ(c.data(), nullptr);  // NOLINT(bugprone-use-after-move)

  // Still usable after the moves: round trip through the device into another
  // HostBuffer.
  DevicePtr dev = alloc(10000);
  b().copy_h2d(dev, d.data(), d.size(), stream());
  HostBuffer back(b(), 10000);
  b().copy_d2h(back.data(), dev, back.size(), stream());
  EXPECT_TRUE(same_bytes(Bytes(back.bytes().begin(), back.bytes().end()), content));

  // Destruction frees exactly once per allocation.
  { HostBuffer gone(std::move(d)); }
  EXPECT_EQ(b().call_counts().host_free - before.host_free, 2u);
  EXPECT_EQ(b().call_counts().host_alloc - before.host_alloc, 3u);
  EXPECT_THROW(HostBuffer failed(b(), 0), InvalidArgument);
}

TEST_P(Conformance, PinnedCopiesOnTwoStreamsOrderedByAnEvent) {
  // h2d from a pinned buffer on stream A; B waits for A's event, works on the
  // data, and copies it into another pinned buffer. Only B is synchronized
  // before the check: the event alone orders A's copy before B's work.
  constexpr std::size_t kBytes = 8 * kMiB;
  HostBuffer in(b(), kBytes), out(b(), kBytes);
  DevicePtr d = alloc(kBytes), e = alloc(kBytes);
  Stream a_stream = b().create_stream(), b_stream = b().create_stream();
  Event uploaded = b().create_event();
  for (std::uint8_t round = 0; round < 2; ++round) {
    SCOPED_TRACE(static_cast<int>(round));
    const Bytes content = random_bytes(kBytes, 160 + round);
    std::memcpy(in.data(), content.data(), kBytes);
    std::memset(out.data(), 0xEE, kBytes);
    b().copy_h2d_async(d, in.data(), kBytes, a_stream);
    uploaded.record(a_stream);
    uploaded.wait(b_stream);
    const std::size_t start = 12345 + round * 1000000u;
    const FillRegion regions[] = {{d.offset(start), 70000}, {d.offset(kBytes - 3), 3}};
    b().fill_async(regions, static_cast<std::uint8_t>(0x70 + round), b_stream);
    b().copy_d2d_async(e, d, kBytes, b_stream);
    b().copy_d2h_async(out.data(), e, kBytes, b_stream);
    b_stream.synchronize();
    Bytes expected = content;
    std::fill_n(expected.begin() + static_cast<std::ptrdiff_t>(start), 70000,
                static_cast<std::uint8_t>(0x70 + round));
    std::fill_n(expected.end() - 3, 3, static_cast<std::uint8_t>(0x70 + round));
    Bytes back(kBytes);
    std::memcpy(back.data(), out.data(), kBytes);
    EXPECT_TRUE(same_bytes(back, expected));
    a_stream.synchronize();  // before `in` is rewritten
  }
}

}  // namespace
}  // namespace kvport::conformance
