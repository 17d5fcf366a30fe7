// SPDX-License-Identifier: Apache-2.0
// Batched copies between device memory and host memory: copy_batch_h2d_async
// and copy_batch_d2h_async. Scattered block-sized regions both ways, with
// pinned (alloc_host) and pageable (std::vector) host memory, one call per
// batch, the checks made at call time, stream order, and faults that surface
// at synchronize and leave the destination untouched.
#include <algorithm>
#include <cstdint>
#include <cstring>
#include <utility>
#include <vector>

#include "conformance.hpp"
#include "kvport/backends/host_backend.hpp"
#include "kvport/platform/error.hpp"
#include "kvport/platform/fault_injecting_backend.hpp"
#include "kvport/testing/support.hpp"

namespace kvport::conformance {
namespace {

using kvport::testing::message_of;
using ::testing::AllOf;
using ::testing::AnyOf;
using ::testing::HasSubstr;

constexpr std::size_t kBlock = 16 * kKiB + 64;  // a block that is not a power of two
constexpr std::size_t kBlocks = 24;
// Device blocks in the order the host slots hold them: scattered, not sorted.
constexpr std::uint32_t kIds[] = {17, 3, 22, 0, 9, 10, 11, 5};
constexpr std::size_t kSlots = std::size(kIds);

// Moves the slots of `host_in` (slot i holds block kIds[i]) into a device pool
// of kBlocks blocks and back into `host_out` in reverse slot order, checking
// that each batch is one call and that no other byte changes.
void check_round_trip(Backend& b, DevicePtr pool, std::uint8_t* host_in, std::uint8_t* host_out,
                      std::uint64_t seed) {
  const Bytes initial = random_bytes(kBlocks * kBlock, seed);
  const Bytes slots = random_bytes(kSlots * kBlock, seed + 1);
  b.copy_h2d(pool, initial.data(), initial.size(), b.default_stream());
  std::memcpy(host_in, slots.data(), slots.size());
  std::memset(host_out, 0xEE, slots.size());

  std::vector<HostCopyRegion> up, down;
  for (std::size_t i = 0; i < kSlots; ++i) {
    up.push_back({pool.offset(kIds[i] * kBlock), host_in + i * kBlock, kBlock});
    const std::size_t back = kSlots - 1 - i;  // a different order on the way back
    down.push_back({pool.offset(kIds[back] * kBlock), host_out + back * kBlock, kBlock});
  }
  up.push_back({pool.offset(kKiB), host_in, 0});  // zero bytes: checked, skipped

  Stream s = b.create_stream();
  b.reset_call_counts();
  b.copy_batch_h2d_async(up, s);
  b.copy_batch_d2h_async(down, s);
  const CallCounts counts = b.call_counts();
  EXPECT_EQ(counts.copy_host_batch, 2u);
  EXPECT_EQ(counts.device_ops(), 2u);
  s.synchronize();

  Bytes expected = initial;
  for (std::size_t i = 0; i < kSlots; ++i) {
    std::copy_n(slots.begin() + static_cast<std::ptrdiff_t>(i * kBlock), kBlock,
                expected.begin() + static_cast<std::ptrdiff_t>(kIds[i] * kBlock));
  }
  Bytes device(kBlocks * kBlock);
  b.copy_d2h(device.data(), pool, device.size(), b.default_stream());
  EXPECT_TRUE(same_bytes(device, expected));
  EXPECT_TRUE(same_bytes(Bytes(host_out, host_out + slots.size()), slots));
}

TEST_P(Conformance, HostCopyBatchRoundTripsScatteredBlocksThroughPinnedMemory) {
  const DevicePtr pool = alloc(kBlocks * kBlock);
  HostBuffer in(b(), kSlots * kBlock), out(b(), kSlots * kBlock);
  check_round_trip(b(), pool, static_cast<std::uint8_t*>(in.data()),
                   static_cast<std::uint8_t*>(out.data()), 300);
}

TEST_P(Conformance, HostCopyBatchRoundTripsScatteredBlocksThroughPageableMemory) {
  const DevicePtr pool = alloc(kBlocks * kBlock);
  std::vector<std::uint8_t> in(kSlots * kBlock), out(kSlots * kBlock);
  check_round_trip(b(), pool, in.data(), out.data(), 310);
}

TEST_P(Conformance, HostCopyBatchOfOddRegionsAcrossAllocations) {
  // Odd sizes at odd offsets in two allocations, 1000 regions in one call.
  const DevicePtr a = alloc(3 * kMiB), c = alloc(kMiB + 7);
  const Bytes a_initial = random_bytes(3 * kMiB, 320), c_initial = random_bytes(kMiB + 7, 321);
  b().copy_h2d(a, a_initial.data(), a_initial.size(), stream());
  b().copy_h2d(c, c_initial.data(), c_initial.size(), stream());
  std::vector<std::uint8_t> host(2 * kMiB);
  const Bytes content = random_bytes(host.size(), 322);
  std::copy(content.begin(), content.end(), host.begin());
  std::vector<HostCopyRegion> regions;
  Bytes a_expected = a_initial, c_expected = c_initial;
  std::size_t h = 0;
  for (std::size_t i = 0; i < 1000; ++i) {
    const std::size_t bytes = 1 + (i * 37) % 1500;
    const bool first = i % 2 == 0;
    const std::size_t offset = (i / 2) * 1601 + 3;  // gaps between regions stay untouched
    regions.push_back({(first ? a : c).offset(offset), host.data() + h, bytes});
    Bytes& expected = first ? a_expected : c_expected;
    std::copy_n(content.begin() + static_cast<std::ptrdiff_t>(h), bytes,
                expected.begin() + static_cast<std::ptrdiff_t>(offset));
    h += bytes + 5;
  }
  ASSERT_LE(h, host.size());
  b().reset_call_counts();
  b().copy_batch_h2d_async(regions, stream());
  EXPECT_EQ(b().call_counts().device_ops(), 1u);
  b().synchronize(stream());
  EXPECT_TRUE(same_bytes(download(a, a_expected.size()), a_expected));
  EXPECT_TRUE(same_bytes(download(c, c_expected.size()), c_expected));

  // And back into a zeroed host buffer: the regions' bytes, zero in the gaps.
  std::vector<std::uint8_t> back(host.size(), 0);
  for (HostCopyRegion& r : regions)
    r.host = back.data() + (static_cast<std::uint8_t*>(r.host) - host.data());
  b().copy_batch_d2h_async(regions, stream());
  b().synchronize(stream());
  Bytes expected_back(host.size(), 0);
  for (const HostCopyRegion& r : regions) {
    const auto at = static_cast<std::uint8_t*>(r.host) - back.data();
    std::copy_n(content.begin() + at, r.bytes, expected_back.begin() + at);
  }
  EXPECT_TRUE(same_bytes(Bytes(back.begin(), back.end()), expected_back));
}

TEST_P(Conformance, HostCopyBatchIsCheckedAtCallTimeAndQueuesNothingOnError) {
  const DevicePtr keep = alloc(4096);
  const DevicePtr gone = b().alloc(4096);
  ASSERT_TRUE(b().free(gone));
  const Bytes initial = random_bytes(4096, 330);
  b().copy_h2d(keep, initial.data(), initial.size(), stream());
  std::vector<std::uint8_t> host(8192, 0x5C);
  StreamView s = stream();

  auto rejected_both_ways = [&](std::vector<HostCopyRegion> regions, const char* what) {
    SCOPED_TRACE(what);
    EXPECT_THAT(message_of<InvalidArgument>([&] { b().copy_batch_h2d_async(regions, s); }),
                AllOf(HasSubstr("copy_batch_h2d_async"), HasSubstr(what)));
    EXPECT_THAT(message_of<InvalidArgument>([&] { b().copy_batch_d2h_async(regions, s); }),
                AllOf(HasSubstr("copy_batch_d2h_async"), HasSubstr(what)));
  };
  // A good region first: the bad one later in the span rejects the whole call.
  rejected_both_ways({{keep, host.data(), 64}, {gone.offset(8), host.data() + 64, 64}},
                     "use after free");
  rejected_both_ways({{keep, host.data(), 64}, {keep.offset(4000), host.data() + 64, 97}},
                     "out of bounds");
  rejected_both_ways({{keep, host.data(), 64}, {keep.offset(64), nullptr, 64}},
                     "null host pointer");
  rejected_both_ways({{DevicePtr{}, host.data(), 64}}, "null device pointer");
  rejected_both_ways({{keep, nullptr, 0}}, "null host pointer");  // even for zero bytes
  // Host memory is not device memory: "bad pointer", or "use after free" when
  // the heap handed out an address that a freed device allocation once held.
  const HostCopyRegion not_device[] = {{keep, host.data(), 64},
                                       {DevicePtr::from(host.data()), host.data() + 64, 64}};
  EXPECT_THAT(message_of<InvalidArgument>([&] { b().copy_batch_h2d_async(not_device, s); }),
              AllOf(HasSubstr("copy_batch_h2d_async"),
                    AnyOf(HasSubstr("bad pointer"), HasSubstr("use after free"))));
  EXPECT_THAT(message_of<InvalidArgument>([&] { b().copy_batch_d2h_async(not_device, s); }),
              AllOf(HasSubstr("copy_batch_d2h_async"),
                    AnyOf(HasSubstr("bad pointer"), HasSubstr("use after free"))));

  // Overlapping destinations: device ranges on the way in, host ranges out.
  const HostCopyRegion same_device[] = {{keep, host.data(), 128},
                                        {keep.offset(127), host.data() + 1000, 10}};
  EXPECT_THAT(message_of<InvalidArgument>([&] { b().copy_batch_h2d_async(same_device, s); }),
              HasSubstr("device destinations of regions 0 and 1 overlap"));
  const HostCopyRegion same_host[] = {{keep.offset(1000), host.data() + 100, 50},
                                      {keep, host.data(), 101}};
  EXPECT_THAT(message_of<InvalidArgument>([&] { b().copy_batch_d2h_async(same_host, s); }),
              HasSubstr("host destinations of regions 1 and 0 overlap"));

  EXPECT_NO_THROW(b().synchronize(s));  // nothing was queued, so nothing fails
  EXPECT_TRUE(same_bytes(download(keep, 4096), initial));
  EXPECT_EQ(host, std::vector<std::uint8_t>(8192, 0x5C));

  // Overlapping sources are fine: one host slot into two blocks, one block
  // into two host slots.
  const HostCopyRegion fan_out[] = {{keep, host.data(), 100}, {keep.offset(200), host.data(), 100}};
  b().copy_batch_h2d_async(fan_out, s);
  const HostCopyRegion fan_in[] = {{keep, host.data() + 4096, 300},
                                   {keep, host.data() + 6000, 300}};
  b().copy_batch_d2h_async(fan_in, s);
  b().synchronize(s);
  Bytes expected = initial;
  std::fill_n(expected.begin(), 100, 0x5C);
  std::fill_n(expected.begin() + 200, 100, 0x5C);
  EXPECT_TRUE(same_bytes(Bytes(host.begin() + 4096, host.begin() + 4396),
                         Bytes(expected.begin(), expected.begin() + 300)));
  EXPECT_TRUE(same_bytes(Bytes(host.begin() + 6000, host.begin() + 6300),
                         Bytes(expected.begin(), expected.begin() + 300)));
}

TEST_P(Conformance, EmptyHostCopyBatchIsANoOpAndNotCounted) {
  b().reset_call_counts();
  b().copy_batch_h2d_async({}, stream());
  b().copy_batch_d2h_async({}, stream());
  EXPECT_EQ(b().call_counts().copy_host_batch, 0u);
  EXPECT_EQ(b().call_counts().device_ops(), 0u);
  // A batch of zero-byte regions is a call: checked and counted, copies nothing.
  const DevicePtr p = alloc(64);
  std::uint8_t host[4] = {};
  const HostCopyRegion nothing[] = {{p, host, 0}, {p.offset(10), host, 0}};
  b().copy_batch_h2d_async(nothing, stream());
  EXPECT_EQ(b().call_counts().copy_host_batch, 1u);
  EXPECT_NO_THROW(b().synchronize(stream()));
}

TEST_P(Conformance, HostCopyBatchRunsInStreamOrderWithOtherWork) {
  // memset, batch in, fill over part of it, batch out, then device-to-device
  // and another batch out: each step sees the one before, on one stream with
  // a single synchronize at the end.
  constexpr std::size_t kBytes = 4 * kMiB;
  const DevicePtr d = alloc(kBytes), e = alloc(kBytes);
  HostBuffer in(b(), kBytes), mid(b(), kBytes), out(b(), kBytes);
  const Bytes content = random_bytes(kBytes, 340);
  std::memcpy(in.data(), content.data(), kBytes);
  Stream s = b().create_stream();
  auto* in_p = static_cast<std::uint8_t*>(in.data());
  auto* mid_p = static_cast<std::uint8_t*>(mid.data());
  auto* out_p = static_cast<std::uint8_t*>(out.data());

  b().memset_async(d, 0x11, kBytes, s);
  const HostCopyRegion halves_in[] = {{d.offset(kBytes / 2), in_p, kBytes / 2},
                                      {d, in_p + kBytes / 2, kBytes / 4}};
  b().copy_batch_h2d_async(halves_in, s);
  const FillRegion fills[] = {{d.offset(kBytes / 2 + 1000), 5000}};
  b().fill_async(fills, 0x22, s);
  const HostCopyRegion whole_mid[] = {{d, mid_p, kBytes}};
  b().copy_batch_d2h_async(whole_mid, s);
  b().copy_d2d_async(e, d, kBytes, s);
  b().memset_async(d, 0x33, kBytes, s);  // after the copies: they must not see it
  const HostCopyRegion whole_out[] = {{e, out_p, kBytes}};
  b().copy_batch_d2h_async(whole_out, s);
  s.synchronize();

  Bytes expected(kBytes, 0x11);
  std::copy_n(content.begin(), kBytes / 2, expected.begin() + kBytes / 2);
  std::copy_n(content.begin() + kBytes / 2, kBytes / 4, expected.begin());
  std::fill_n(expected.begin() + kBytes / 2 + 1000, 5000, 0x22);
  EXPECT_TRUE(same_bytes(Bytes(mid_p, mid_p + kBytes), expected));
  EXPECT_TRUE(same_bytes(Bytes(out_p, out_p + kBytes), expected));
  EXPECT_TRUE(same_bytes(download(d, kBytes), Bytes(kBytes, 0x33)));
}

TEST_P(Conformance, AFailedHostCopyBatchSurfacesAtSynchronizeAndWritesNothing) {
  // A copy that fails on the stream (injected by the fault decorator over
  // this backend) returns normally, throws at the stream's next synchronize,
  // once, and leaves its destinations as they were; the next batch works.
  FaultInjectingBackend fb(make_any_backend(GetParam()));
  constexpr std::size_t kBytes = 64 * kKiB;
  DeviceBuffer d(fb, kBytes);
  const Bytes initial = random_bytes(kBytes, 350);
  fb.copy_h2d(d.ptr(), initial.data(), kBytes, fb.default_stream());
  HostBuffer host(fb, kBytes);
  auto* h = static_cast<std::uint8_t*>(host.data());
  std::memset(h, 0x7A, kBytes);
  Stream s = fb.create_stream();
  const HostCopyRegion regions[] = {{d.ptr(), h, kBytes / 2},
                                    {d.ptr().offset(kBytes / 2), h + kBytes / 2, kBytes / 2}};

  fb.set_plan(FaultKind::copy, {.nth = 1, .mode = FaultMode::deferred});
  fb.copy_batch_h2d_async(regions, s);  // returns normally
  EXPECT_THAT(message_of<BackendError>([&] { s.synchronize(); }),
              HasSubstr("copy_batch_h2d_async"));
  EXPECT_NO_THROW(s.synchronize());  // reported once
  Bytes device(kBytes);
  fb.copy_d2h(device.data(), d.ptr(), kBytes, s);
  EXPECT_TRUE(same_bytes(device, initial));

  fb.set_plan(FaultKind::copy, {.nth = 1, .mode = FaultMode::deferred});
  fb.copy_batch_d2h_async(regions, s);
  EXPECT_THROW(s.synchronize(), BackendError);
  EXPECT_EQ(Bytes(h, h + kBytes), Bytes(kBytes, 0x7A));

  fb.clear_plans();
  fb.copy_batch_d2h_async(regions, s);
  s.synchronize();
  EXPECT_TRUE(same_bytes(Bytes(h, h + kBytes), initial));
  EXPECT_EQ(fb.counts(FaultKind::copy).faults, 2u);
}

}  // namespace
}  // namespace kvport::conformance
