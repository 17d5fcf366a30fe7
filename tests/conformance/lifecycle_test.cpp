// SPDX-License-Identifier: Apache-2.0
// Lifetimes and limits: destroying a stream, a block pool set and a whole
// backend while work is pending; two backends alive at once; device ordinals;
// a real out-of-memory.
#include <algorithm>
#include <cstdint>
#include <string>
#include <vector>

#include "conformance.hpp"
#include "kvport/platform/error.hpp"
#include "kvport/testing/support.hpp"

namespace kvport::conformance {
namespace {

using kvport::testing::message_of;
using ::testing::HasSubstr;

// Memory may come back a little short on a GPU that other processes share.
constexpr std::size_t kMemInfoSlack = 16 * kMiB;

TEST_P(Conformance, DestroyingAStreamWithWorkPendingLetsTheWorkFinish) {
  // The contract (Stream): destruction lets queued work finish, as
  // cudaStreamDestroy does; it may return before the work is done, so an
  // event recorded behind the work tells when.
  constexpr std::size_t kBytes = 64 * kMiB;
  static_assert(kBytes > 2 * kMemInfoSlack);
  const MemInfo before = b().mem_info();
  DevicePtr p = b().alloc(kBytes);
  Event done = b().create_event();
  {
    Stream s = b().create_stream();
    b().memset_async(p, 0x31, kBytes, s);
    b().memset_async(p, 0x32, kBytes, s);
    const FillRegion regions[] = {{p.offset(1000), 5000}, {p.offset(kBytes - 1), 1}};
    b().fill_async(regions, 0x33, s);
    done.record(s);
  }  // destroyed with all of it queued
  done.synchronize();
  Bytes head(8192), tail(4096);
  b().copy_d2h(head.data(), p, head.size(), stream());
  b().copy_d2h(tail.data(), p.offset(kBytes - tail.size()), tail.size(), stream());
  Bytes expected_head(8192, 0x32), expected_tail(4096, 0x32);
  std::fill_n(expected_head.begin() + 1000, 5000, 0x33);
  expected_tail.back() = 0x33;
  EXPECT_TRUE(same_bytes(head, expected_head));
  EXPECT_TRUE(same_bytes(tail, expected_tail));

  // The memory and the backend are fine: the allocation frees, the memory
  // comes back, and new streams and allocations work.
  EXPECT_TRUE(b().free(p));
  EXPECT_GE(b().mem_info().free_bytes + kMemInfoSlack, before.free_bytes);
  Stream s = b().create_stream();
  DevicePtr q = alloc(kBytes);
  b().memset_async(q, 0x34, kBytes, s);
  EXPECT_TRUE(same_bytes(download(q.offset(kBytes - kMiB), kMiB, s), Bytes(kMiB, 0x34)));
}

TEST_P(Conformance, DestroyingABlockPoolSetWithAFillPending) {
  constexpr std::size_t kBlocks = 256, kBlockBytes = 4096, kBusy = 64 * kMiB;
  Bytes model = random_bytes(kBlocks * kBlockBytes, 170);
  DevicePtr pool = upload(model), busy = alloc(kBusy);
  const PoolGeometry pools[] = {{pool, kBlockBytes, kBlockBytes},
                                {pool.offset(100), 50, kBlockBytes}};
  Stream s = b().create_stream();
  b().memset_async(busy, 0x41, kBusy, s);  // holds the stream busy
  std::vector<std::uint32_t> ids = {255, 0, 1, 2, 3, 100, 7};
  {
    BlockPoolSet set = b().register_block_pools(pools, kBlocks);
    b().fill_blocks_async(set, ids, 0x42, s);
  }  // unregistered with the fill queued behind the memset
  for (std::uint32_t id : ids)
    std::fill_n(model.begin() + std::ptrdiff_t{id} * kBlockBytes, kBlockBytes, 0x42);
  EXPECT_TRUE(same_bytes(download(pool, model.size(), s), model));

  // A new set over the same memory works.
  BlockPoolSet again = b().register_block_pools(pools, kBlocks);
  const std::uint32_t more[] = {9, 10};
  b().fill_blocks_async(again, more, 0x43, s);
  for (std::uint32_t id : more) {
    std::fill_n(model.begin() + std::ptrdiff_t{id} * kBlockBytes, kBlockBytes, 0x43);
  }
  EXPECT_TRUE(same_bytes(download(pool, model.size(), s), model));
}

TEST_P(Conformance, DestroyingABackendWithWorkPending) {
  // A second backend is destroyed with work queued on its default stream and
  // on a (destroyed) stream of its own, two allocations and a pinned buffer
  // still live: it must finish or drop the work, free everything, and leave
  // the first backend and the device fine.
  constexpr std::size_t kBytes = 128 * kMiB;
  static_assert(kBytes > 4 * kMemInfoSlack);
  const MemInfo before = b().mem_info();
  {
    std::unique_ptr<Backend> doomed = make_any_backend(GetParam());
    DevicePtr big = doomed->alloc(kBytes), copy = doomed->alloc(kMiB);
    void* pinned = doomed->alloc_host(kMiB);
    {
      Stream s = doomed->create_stream();
      doomed->memset_async(big, 0x51, kBytes, s);
      Event e = doomed->create_event();
      e.record(s);
      e.wait(doomed->default_stream());
    }
    const StreamView d = doomed->default_stream();
    doomed->memset_async(big, 0x52, kBytes, d);
    const FillRegion regions[] = {{big.offset(10), 100}, {big.offset(kBytes - kMiB), 1000}};
    doomed->fill_async(regions, 0x53, d);
    doomed->copy_d2d_async(copy, big.offset(kBytes - kMiB), kMiB, d);
    doomed->copy_d2h_async(pinned, copy, kMiB, d);
  }
  // The first backend is unaffected, and the memory came back: an allocation
  // of the same size works (only its last MiB is touched).
  EXPECT_GE(b().mem_info().free_bytes + kMemInfoSlack, before.free_bytes);
  DevicePtr p = alloc(kBytes);
  b().memset_async(p.offset(kBytes - kMiB), 0x54, kMiB, stream());
  EXPECT_TRUE(same_bytes(download(p.offset(kBytes - kMiB), kMiB), Bytes(kMiB, 0x54)));
  // So does a new backend of the same kind.
  std::unique_ptr<Backend> fresh = make_any_backend(GetParam());
  DevicePtr q = fresh->alloc(kBytes);
  fresh->memset_async(q.offset(kBytes - kMiB), 0x55, kMiB, fresh->default_stream());
  Bytes back(kMiB);
  fresh->copy_d2h(back.data(), q.offset(kBytes - kMiB), kMiB, fresh->default_stream());
  EXPECT_TRUE(same_bytes(back, Bytes(kMiB, 0x55)));
  EXPECT_TRUE(fresh->free(q));
}

TEST_P(Conformance, TwoBackendsAliveAtOnceAreIndependent) {
  std::unique_ptr<Backend> second = make_any_backend(GetParam());
  Backend& c = *second;
  const Bytes a0 = random_bytes(kMiB, 180), c0 = random_bytes(kMiB, 181);
  DevicePtr a = upload(a0);
  DevicePtr x = c.alloc(kMiB);
  c.copy_h2d(x, c0.data(), kMiB, c.default_stream());
  Stream sa = b().create_stream(), sc = c.create_stream();
  b().reset_call_counts();
  c.reset_call_counts();

  // Interleaved work on both, with different values and regions.
  Bytes ea = a0, ec = c0;
  b().memset_async(a, 0x61, 1000, sa);
  std::fill_n(ea.begin(), 1000, 0x61);
  c.memset_async(x.offset(500), 0x62, 1000, sc);
  std::fill_n(ec.begin() + 500, 1000, 0x62);
  const FillRegion fa[] = {{a.offset(5000), 300}, {a.offset(9000), 7}};
  const FillRegion fc[] = {{x.offset(6000), 200}, {x.offset(kMiB - 9), 9}};
  b().fill_async(fa, 0x63, sa);
  c.fill_async(fc, 0x64, sc);
  std::fill_n(ea.begin() + 5000, 300, 0x63);
  std::fill_n(ea.begin() + 9000, 7, 0x63);
  std::fill_n(ec.begin() + 6000, 200, 0x64);
  std::fill_n(ec.end() - 9, 9, 0x64);
  const CopyRegion ca[] = {{a.offset(100000), a.offset(0), 2000}};
  const CopyRegion cc[] = {{x.offset(200000), x.offset(400), 3000}};
  b().copy_batch_async(ca, sa);
  c.copy_batch_async(cc, sc);
  std::copy_n(ea.begin(), 2000, ea.begin() + 100000);
  std::copy_n(ec.begin() + 400, 3000, ec.begin() + 200000);

  // Neither accepts the other's memory, streams or events.
  EXPECT_FALSE(b().free(x));
  EXPECT_FALSE(c.free(a));
  EXPECT_THROW(c.memset_async(x, 0, 1, sa), InvalidArgument);
  Event ea_event = b().create_event();
  EXPECT_THROW(c.record_event(ea_event, sc), InvalidArgument);

  Bytes back_c(kMiB);
  c.copy_d2h(back_c.data(), x, kMiB, sc);
  EXPECT_TRUE(same_bytes(download(a, kMiB, sa), ea));
  EXPECT_TRUE(same_bytes(back_c, ec));
  // Each counted its own calls.
  EXPECT_EQ(b().call_counts().memset, 1u);
  EXPECT_EQ(c.call_counts().memset, 1u);
  EXPECT_EQ(b().call_counts().fill, 1u);
  EXPECT_EQ(c.call_counts().fill, 1u);

  // The first outlives the second.
  EXPECT_TRUE(c.free(x));
  { Stream gone = std::move(sc); }
  second.reset();
  b().memset_async(a, 0x65, kMiB, sa);
  EXPECT_TRUE(same_bytes(download(a, kMiB, sa), Bytes(kMiB, 0x65)));
}

TEST_P(Conformance, InvalidDeviceOrdinalIsAnInvalidArgument) {
  for (const int bad : {1000, -1, b().device_count()}) {
    SCOPED_TRACE(bad);
    EXPECT_THAT(message_of<InvalidArgument>([&] { make_any_backend_on(GetParam(), bad); }),
                HasSubstr(std::to_string(bad)));
  }
  // Ordinal 0 always exists.
  std::unique_ptr<Backend> first = make_any_backend_on(GetParam(), 0);
  DevicePtr p = first->alloc(4096);
  first->memset_async(p, 0x66, 4096, first->default_stream());
  Bytes back(4096);
  first->copy_d2h(back.data(), p, 4096, first->default_stream());
  EXPECT_TRUE(same_bytes(back, Bytes(4096, 0x66)));
  EXPECT_TRUE(first->free(p));
}

TEST_P(Conformance, RealOutOfMemoryLeavesTheBackendUsable) {
  const MemInfo mem = b().mem_info();
  const std::size_t request = mem.free_bytes + kGiB;
  EXPECT_THROW(b().alloc(request), OutOfMemory)
      << "alloc(" << request << ") with " << mem.free_bytes << " bytes free";
  const MemInfo after = b().mem_info();
  EXPECT_LE(after.free_bytes, after.total_bytes);
  EXPECT_GE(after.free_bytes + kMemInfoSlack, mem.free_bytes);  // nothing leaked
  DevicePtr p = alloc(kMiB);
  b().memset_async(p, 0x67, kMiB, stream());
  EXPECT_TRUE(same_bytes(download(p, kMiB), Bytes(kMiB, 0x67)));
}

}  // namespace
}  // namespace kvport::conformance
