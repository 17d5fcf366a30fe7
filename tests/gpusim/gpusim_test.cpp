// SPDX-License-Identifier: Apache-2.0
// GpuBackend's policies that only hardware would otherwise show, checked on
// the simulated vendor API (gpusim_backend.hpp): the current device per
// thread, launch and allocation error classification, the sticky device-lost
// state, staging that grows instead of blocking, by-value small batches, the
// pool table's last-use events and the skipped re-validation of pools.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <thread>
#include <vector>

#include "gpu_backend.hpp"
#include "gpusim_backend.hpp"
#include "kvport/core/host_tier.hpp"
#include "kvport/core/paged_kv_cache.hpp"
#include "kvport/core/prefix_cache.hpp"
#include "kvport/platform/backend.hpp"
#include "kvport/platform/error.hpp"
#include "kvport/testing/support.hpp"

namespace kvport {
namespace {

using kvport::testing::gpusim_free_native;
using kvport::testing::gpusim_malloc_native;
using kvport::testing::gpusim_stats;
using kvport::testing::GpusimStats;
using kvport::testing::make_gpusim_backend;
using kvport::testing::message_of;
using ::testing::HasSubstr;
using Bytes = std::vector<std::uint8_t>;

constexpr std::size_t kMiB = 1024 * 1024;

class Gpusim : public ::testing::Test {
 protected:
  void SetUp() override {
    testing::gpusim_set_current_device(0);
    testing::gpusim_hold_completion(false);
    testing::gpusim_reset_stats();
  }
  void TearDown() override {
    testing::gpusim_hold_completion(false);
    testing::gpusim_set_current_device(0);
  }

  static Bytes download(Backend& b, DevicePtr p, std::size_t bytes) {
    Bytes out(bytes);
    b.copy_d2h(out.data(), p, bytes, b.default_stream());
    return out;
  }
};

// Many fill regions: more than fit in kernel parameters, so they are staged.
std::vector<FillRegion> staged_regions(DevicePtr p, std::size_t count) {
  std::vector<FillRegion> regions;
  for (std::size_t i = 0; i < count; ++i)
    regions.push_back(FillRegion{p.offset(2 * i), 1});
  return regions;
}

// ---- the current device ----------------------------------------------------------

TEST_F(Gpusim, TwoBackendsOnTwoDevicesInOneThread) {
  auto b0 = make_gpusim_backend(256 * kMiB, 0);
  auto b1 = make_gpusim_backend(256 * kMiB, 1);
  DeviceBuffer a0(*b0, 4096), a1(*b1, 4096);
  Stream s0 = b0->create_stream(), s1 = b1->create_stream();
  Event e0 = b0->create_event();
  for (int round = 0; round < 3; ++round) {
    const auto v = static_cast<std::uint8_t>(round + 1);
    b0->memset_async(a0.ptr(), v, 4096, s0);
    b1->memset_async(a1.ptr(), static_cast<std::uint8_t>(v + 100), 4096, s1);
    const FillRegion r0[] = {{a0.ptr(), 100}}, r1[] = {{a1.ptr().offset(100), 100}};
    b0->fill_async(r0, 0xA0, s0);
    b1->fill_async(r1, 0xA1, s1);
    e0.record(s0);
    e0.synchronize();
    s1.synchronize();
  }
  Bytes want0(4096, 3), want1(4096, 103);
  std::fill_n(want0.begin(), 100, 0xA0);
  std::fill_n(want1.begin() + 100, 100, 0xA1);
  EXPECT_EQ(download(*b0, a0.ptr(), 4096), want0);
  EXPECT_EQ(download(*b1, a1.ptr(), 4096), want1);
  EXPECT_EQ(gpusim_stats().wrong_device_calls, 0u);
}

TEST_F(Gpusim, TheCallersCurrentDeviceIsLeftAsItWas) {
  auto b1 = make_gpusim_backend(256 * kMiB, 1);
  for (int caller : {0, 1}) {
    testing::gpusim_set_current_device(caller);
    DevicePtr p = b1->alloc(1024);
    EXPECT_EQ(testing::gpusim_current_device(), caller);
    b1->memset_async(p, 7, 1024, b1->default_stream());
    const FillRegion r[] = {{p, 10}};
    b1->fill_async(r, 9, b1->default_stream());
    b1->synchronize(b1->default_stream());
    EXPECT_EQ(testing::gpusim_current_device(), caller);
    EXPECT_TRUE(b1->free(p));
    EXPECT_EQ(testing::gpusim_current_device(), caller);
  }
  EXPECT_EQ(gpusim_stats().wrong_device_calls, 0u);
}

TEST_F(Gpusim, ABackendOnDevice1WorksFromAnotherThread) {
  auto b1 = make_gpusim_backend(256 * kMiB, 1);
  DeviceBuffer buf(*b1, 8192);
  Bytes back;
  std::thread worker([&] {  // a new thread starts on device 0
    Stream s = b1->create_stream();
    b1->memset_async(buf.ptr(), 0x5C, 8192, s);
    const std::uint32_t ids[] = {1};
    const PoolGeometry pool[] = {{buf.ptr(), 1024, 1024}};
    BlockPoolSet set = b1->register_block_pools(pool, 8);
    b1->fill_blocks_async(set, ids, 0x11, s);
    back.resize(8192);
    b1->copy_d2h(back.data(), buf.ptr(), 8192, s);
  });
  worker.join();
  Bytes want(8192, 0x5C);
  std::fill_n(want.begin() + 1024, 1024, 0x11);
  EXPECT_EQ(back, want);
  EXPECT_EQ(gpusim_stats().wrong_device_calls, 0u);
}

TEST_F(Gpusim, AnInvalidDeviceOrdinalIsAnInvalidArgument) {
  EXPECT_THROW(make_gpusim_backend(kMiB, 2), InvalidArgument);
  EXPECT_THAT(message_of([] { make_gpusim_backend(kMiB, -1); }), HasSubstr("ordinal -1"));
}

// ---- launch and allocation errors ----------------------------------------------

TEST_F(Gpusim, AStaleErrorOnTheThreadDoesNotFailALaunch) {
  auto b = make_gpusim_backend(256 * kMiB);
  DeviceBuffer buf(*b, 4096);
  testing::gpusim_leave_stale_error();
  const FillRegion r[] = {{buf.ptr(), 4096}};
  EXPECT_NO_THROW(b->fill_async(r, 0x42, b->default_stream()));
  EXPECT_EQ(download(*b, buf.ptr(), 4096), Bytes(4096, 0x42));
}

TEST_F(Gpusim, AFailedLaunchNamesTheLaunchAndTheBackendStaysUsable) {
  auto b = make_gpusim_backend(256 * kMiB);
  DeviceBuffer buf(*b, 4096);
  const FillRegion r[] = {{buf.ptr(), 4096}};
  testing::gpusim_fail_next_launch(9);
  try {
    b->fill_async(r, 1, b->default_stream());
    ADD_FAILURE() << "no exception";
  } catch (const DeviceLost&) {
    ADD_FAILURE() << "a launch configuration error is not a lost device";
  } catch (const BackendError& e) {
    EXPECT_EQ(e.native_code(), 9);
    EXPECT_THAT(e.what(), HasSubstr("launch_fill_by_value"));
  }
  EXPECT_FALSE(b->device_lost());
  b->fill_async(r, 2, b->default_stream());
  EXPECT_EQ(download(*b, buf.ptr(), 4096), Bytes(4096, 2));
}

TEST_F(Gpusim, OnlyTheOutOfMemoryCodeIsOutOfMemory) {
  auto b = make_gpusim_backend(256 * kMiB);
  testing::gpusim_fail_next_malloc(2);
  EXPECT_THROW(b->alloc(1024), OutOfMemory);
  testing::gpusim_fail_next_malloc(201);
  try {
    b->alloc(1024);
    ADD_FAILURE() << "no exception";
  } catch (const OutOfMemory&) {
    ADD_FAILURE() << "an invalid context must not read as out of memory";
  } catch (const BackendError& e) {
    EXPECT_EQ(e.native_code(), 201);
    EXPECT_THAT(e.what(), HasSubstr("invalid device context"));
  }
  testing::gpusim_fail_next_host_alloc(2);
  EXPECT_THROW(b->alloc_host(4096), OutOfMemory);
  testing::gpusim_fail_next_host_alloc(201);
  EXPECT_THROW(
      {
        try {
          b->alloc_host(4096);
        } catch (const OutOfMemory&) {
          ADD_FAILURE() << "host_alloc: invalid context read as out of memory";
        }
      },
      BackendError);
  DeviceBuffer still(*b, 1024);  // and the backend works
  EXPECT_NE(still.ptr().address(), 0u);
}

TEST_F(Gpusim, AFaultLosesTheDeviceForEveryLaterCall) {
  auto b = make_gpusim_backend(256 * kMiB);
  {
    DeviceBuffer buf(*b, 4096);
    Stream s = b->create_stream();
    b->inject_async_fault(s);
    EXPECT_THROW(s.synchronize(), DeviceLost);
    EXPECT_TRUE(b->device_lost());
    // Context-wide: other streams, allocation (never OutOfMemory), events.
    EXPECT_THROW(b->synchronize(b->default_stream()), DeviceLost);
    EXPECT_THROW(b->memset_async(buf.ptr(), 0, 16, b->default_stream()), DeviceLost);
    EXPECT_THROW(b->alloc(1024), DeviceLost);
    EXPECT_THROW(b->create_stream(), DeviceLost);
    const std::string message = message_of([&] { b->mem_info(); });
    EXPECT_THAT(message, HasSubstr("device lost"));
    EXPECT_THAT(message, HasSubstr("error 719"));
  }  // releasing still works, and leaks nothing under ASan
  b.reset();
  auto fresh = make_gpusim_backend(256 * kMiB);  // a new context is fine
  EXPECT_FALSE(fresh->device_lost());
  DeviceBuffer ok(*fresh, 64);
  fresh->memset_async(ok.ptr(), 3, 64, fresh->default_stream());
  EXPECT_EQ(download(*fresh, ok.ptr(), 64), Bytes(64, 3));
}

TEST_F(Gpusim, AStickyLaunchFailureIsDeviceLost) {
  auto b = make_gpusim_backend(256 * kMiB);
  DeviceBuffer buf(*b, 4096);
  const FillRegion r[] = {{buf.ptr(), 16}};
  testing::gpusim_fail_next_launch(719);
  EXPECT_THROW(b->fill_async(r, 1, b->default_stream()), DeviceLost);
  EXPECT_TRUE(b->device_lost());
}

// ---- batches by value and staging --------------------------------------------------

KvCacheConfig small_config(KvCacheLayout layout) {
  KvCacheConfig c;
  c.num_layers = 4;
  c.block_size = 16;
  c.num_kv_heads = 2;
  c.head_dim_k = 32;
  c.head_dim_v = 32;
  c.dtype = KvCacheDtype::bf16;
  c.layout = layout;
  return c;
}

TEST_F(Gpusim, AHostCopyBatchIsOneRuntimeCallSkippingZeroByteRegions) {
  auto b = make_gpusim_backend(64 * kMiB);
  DeviceBuffer d(*b, kMiB);
  HostBuffer host(*b, kMiB);
  auto* h = static_cast<std::uint8_t*>(host.data());
  for (std::size_t i = 0; i < kMiB; ++i)
    h[i] = static_cast<std::uint8_t>(i * 7);
  std::vector<HostCopyRegion> regions;
  for (std::size_t i = 0; i < 100; ++i)
    regions.push_back({d.ptr().offset(i * 4096), h + (99 - i) * 4096,
                       i % 10 == 0 ? std::size_t{0} : std::size_t{4096}});
  testing::gpusim_reset_stats();
  b->copy_batch_h2d_async(regions, b->default_stream());
  EXPECT_EQ(gpusim_stats().batch_copies, 1u);
  EXPECT_EQ(gpusim_stats().uploads, 0u);  // no per-region memcpy_async
  const Bytes back = download(*b, d.ptr(), 100 * 4096);
  for (std::size_t i = 1; i < 100; i += 9) {
    if (i % 10 == 0) continue;
    EXPECT_EQ(Bytes(back.begin() + static_cast<std::ptrdiff_t>(i * 4096),
                    back.begin() + static_cast<std::ptrdiff_t>((i + 1) * 4096)),
              Bytes(h + (99 - i) * 4096, h + (100 - i) * 4096))
        << i;
  }
  // Only zero-byte regions: checked, counted, but nothing reaches the runtime.
  const HostCopyRegion nothing[] = {{d.ptr(), h, 0}};
  testing::gpusim_reset_stats();
  b->copy_batch_d2h_async(nothing, b->default_stream());
  EXPECT_EQ(gpusim_stats().batch_copies, 0u);
}

TEST_F(Gpusim, ZeroingOneBlockIsOneLaunchWithNoUpload) {
  for (KvCacheLayout layout : {KvCacheLayout::layer_major, KvCacheLayout::block_major}) {
    auto b = make_gpusim_backend(256 * kMiB);
    PagedKvCache cache(small_config(layout), 2000, *b, PagedKvCacheOptions{false});
    const auto counted = [&](std::vector<BlockId> ids) {
      testing::gpusim_reset_stats();
      cache.zero_blocks(ids, b->default_stream());
      b->synchronize(b->default_stream());
      return gpusim_stats();
    };
    GpusimStats one = counted({7});
    EXPECT_EQ(one.launches, 1u);
    EXPECT_EQ(one.uploads, 0u);
    std::vector<BlockId> many(960);
    for (std::size_t i = 0; i < many.size(); ++i)
      many[i] = static_cast<BlockId>(2 * i);
    GpusimStats by_value = counted(many);  // the most ids that travel by value
    EXPECT_EQ(by_value.launches, 1u);
    EXPECT_EQ(by_value.uploads, 0u);
    many.push_back(1999);
    GpusimStats staged = counted(many);
    EXPECT_EQ(staged.launches, 1u);
    EXPECT_EQ(staged.uploads, 1u);
    for (BlockId id : {BlockId{7}, BlockId{1998}, BlockId{1999}}) {
      const auto got = cache.read_block(2, id, b->default_stream());
      EXPECT_EQ(got.k, Bytes(got.k.size(), 0)) << id;
    }
  }
}

TEST_F(Gpusim, FullStagingSlotsGrowTheRingInsteadOfBlocking) {
  auto b = make_gpusim_backend(256 * kMiB);
  DeviceBuffer buf(*b, 1 << 16);
  b->memset_async(buf.ptr(), 0, 1 << 16, b->default_stream());
  b->synchronize(b->default_stream());
  const std::vector<FillRegion> regions = staged_regions(buf.ptr(), 1000);
  testing::gpusim_reset_stats();
  testing::gpusim_hold_completion(true);  // every upload stays "in flight"
  for (int i = 1; i <= 10; ++i)
    b->fill_async(regions, static_cast<std::uint8_t>(i), b->default_stream());
  GpusimStats held = gpusim_stats();
  EXPECT_EQ(held.blocking_waits, 0u) << "a fill waited for an earlier one's staging slot";
  EXPECT_EQ(held.uploads, 10u);
  EXPECT_GE(held.pinned_allocs, 10u);  // one new slot per fill in flight
  testing::gpusim_hold_completion(false);
  testing::gpusim_reset_stats();
  for (int i = 11; i <= 20; ++i)
    b->fill_async(regions, static_cast<std::uint8_t>(i), b->default_stream());
  EXPECT_EQ(gpusim_stats().pinned_allocs, 0u) << "finished slots are reused";
  const Bytes back = download(*b, buf.ptr(), 2000);
  for (std::size_t i = 0; i < 2000; ++i)
    ASSERT_EQ(back[i], i % 2 == 0 ? 20 : 0) << i;
}

TEST_F(Gpusim, AFullRingWaitsForTheOldestSlotOnly) {
  auto b = make_gpusim_backend(256 * kMiB);
  DeviceBuffer buf(*b, 1 << 16);
  const std::vector<FillRegion> regions = staged_regions(buf.ptr(), 1000);
  testing::gpusim_hold_completion(true);
  for (std::size_t i = 0; i < gpu::kMaxStagingSlots; ++i)
    b->fill_async(regions, 1, b->default_stream());
  testing::gpusim_reset_stats();
  b->fill_async(regions, 2, b->default_stream());
  EXPECT_EQ(gpusim_stats().blocking_waits, 1u);
  EXPECT_EQ(gpusim_stats().pinned_allocs, 0u);
}

TEST_F(Gpusim, StagingFromFourThreadsAtOnce) {
  auto b = make_gpusim_backend(256 * kMiB);
  constexpr int kThreads = 4, kRounds = 20;
  std::vector<DeviceBuffer> bufs;
  for (int t = 0; t < kThreads; ++t)
    bufs.emplace_back(*b, 4096);
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&, t] {
      Stream s = b->create_stream();
      const std::vector<FillRegion> regions = staged_regions(bufs[t].ptr(), 1000);
      for (int r = 0; r < kRounds; ++r)
        b->fill_async(regions, static_cast<std::uint8_t>(t * kRounds + r), s);
      s.synchronize();
    });
  }
  for (std::thread& t : threads)
    t.join();
  for (int t = 0; t < kThreads; ++t) {
    const Bytes back = download(*b, bufs[t].ptr(), 2000);
    EXPECT_EQ(back[0], t * kRounds + kRounds - 1);
    EXPECT_EQ(back[1998], t * kRounds + kRounds - 1);
  }
}

// ---- registered pools -----------------------------------------------------------------

TEST_F(Gpusim, UnregisteringWaitsForTheLastFillOnEveryStream) {
  auto b = make_gpusim_backend(256 * kMiB);
  DeviceBuffer buf(*b, 64 * 1024);
  const PoolGeometry pool[] = {{buf.ptr(), 1024, 1024}};
  Stream s1 = b->create_stream(), s2 = b->create_stream();
  {
    BlockPoolSet set = b->register_block_pools(pool, 64);
    testing::gpusim_hold_completion(true);
    const std::uint32_t a[] = {1, 2}, c[] = {3};
    b->fill_blocks_async(set, a, 1, s1);
    b->fill_blocks_async(set, a, 2, s1);  // same stream: one event, re-recorded
    b->fill_blocks_async(set, c, 3, s2);
    testing::gpusim_reset_stats();
  }  // unregisters
  EXPECT_EQ(gpusim_stats().blocking_waits, 2u) << "one wait per stream that used the table";
}

TEST_F(Gpusim, RegisteredPoolsAreRecheckedOnlyAfterAFree) {
  auto b = make_gpusim_backend(256 * kMiB);
  DeviceBuffer pool_memory(*b, 16 * 1024);
  const PoolGeometry pool[] = {{pool_memory.ptr(), 1024, 1024}};
  BlockPoolSet set = b->register_block_pools(pool, 16);
  const std::uint32_t ids[] = {3};
  b->fill_blocks_async(set, ids, 0x33, b->default_stream());
  {
    DeviceBuffer unrelated(*b, 4096);  // freed: the generation moves, the pools still check out
  }
  EXPECT_NO_THROW(b->fill_blocks_async(set, ids, 0x34, b->default_stream()));
  const DevicePtr old = pool_memory.ptr();
  pool_memory = DeviceBuffer();
  EXPECT_THAT(message_of([&] { b->fill_blocks_async(set, ids, 0, b->default_stream()); }),
              HasSubstr("use after free"));
  // Even when a new allocation takes the same address.
  DeviceBuffer again(*b, 16 * 1024);
  if (again.ptr() == old) {
    EXPECT_THROW(b->fill_blocks_async(set, ids, 0, b->default_stream()), InvalidArgument);
  }
}

}  // namespace
}  // namespace kvport

namespace kvport {
namespace {

// ---- an engine's own vendor stream -------------------------------------------------

class GpusimWrap : public ::testing::Test {
 protected:
  void SetUp() override {
    testing::gpusim_set_current_device(0);
    testing::gpusim_reset_stats();
  }
};

TEST_F(GpusimWrap, AnEnginesStreamIsWrappedUsedAndNeverDestroyed) {
  // The stream comes from the runtime directly, as cudaStreamCreate in an
  // engine: no backend made it. Work the engine queues on it and work kvport
  // queues through the wrap land on the same vendor stream, and neither the
  // wrap's release nor the backend's destruction destroys it.
  void* engine_stream = testing::gpusim_create_native_stream(0);
  std::vector<std::uint8_t> back(4096);
  {
    auto backend = make_gpusim_backend(64 * kMiB);
    const DevicePtr p = backend->alloc(4096);
    WrappedStream wrapped = backend->wrap_stream(engine_stream);
    EXPECT_EQ(wrapped.vendor_handle(), engine_stream);
    ASSERT_TRUE(testing::gpusim_memset_native(engine_stream, p.get(), 0x42, 4096));
    backend->copy_d2h(back.data(), p, 4096, wrapped);
    EXPECT_EQ(back, std::vector<std::uint8_t>(4096, 0x42));
    const std::uint64_t destroyed = gpusim_stats().streams_destroyed;
    wrapped.release();
    EXPECT_EQ(gpusim_stats().streams_destroyed, destroyed);
    backend->free(p);
    testing::gpusim_reset_stats();
    backend.reset();
    // The backend destroyed its own default stream only.
    EXPECT_EQ(gpusim_stats().streams_destroyed, 1u);
  }
  // The engine's stream still works.
  auto backend = make_gpusim_backend(64 * kMiB);
  const DevicePtr p = backend->alloc(64);
  EXPECT_TRUE(testing::gpusim_memset_native(engine_stream, p.get(), 0x01, 64));
  backend->free(p);
  testing::gpusim_destroy_native_stream(engine_stream);
}

TEST_F(GpusimWrap, AWrappedStreamOfALostDeviceIsRefused) {
  void* engine_stream = testing::gpusim_create_native_stream(0);
  auto backend = make_gpusim_backend(64 * kMiB);
  backend->inject_async_fault(backend->default_stream());
  EXPECT_THROW(backend->synchronize(backend->default_stream()), DeviceLost);
  EXPECT_THROW((void)backend->wrap_stream(engine_stream), DeviceLost);
  backend.reset();
  testing::gpusim_destroy_native_stream(engine_stream);
}

}  // namespace
}  // namespace kvport

namespace kvport {
namespace {

// ---- a cache over the engine's device memory -------------------------------------

KvCacheConfig sim_config(KvCacheLayout layout) {
  KvCacheConfig c;
  c.num_layers = 3;
  c.block_size = 4;
  c.num_kv_heads = 2;
  c.head_dim_k = 8;
  c.head_dim_v = 8;
  c.dtype = KvCacheDtype::bf16;
  c.layout = layout;
  return c;
}

class GpusimAdopted : public ::testing::TestWithParam<KvCacheLayout> {
 protected:
  void SetUp() override { testing::gpusim_set_current_device(0); }
};

TEST_P(GpusimAdopted, SameOperationsSameBytesAsAnOwnedCache) {
  // The engine's memory is simulated device memory the engine allocated
  // itself (cudaMalloc; another backend's allocation cannot be adopted:
  // adopted ranges are process-wide); the GPU backend's code (range checks
  // against the adopted ranges, the device pool table, batched kernels) runs
  // over it as over its own pools, and the bytes match an owned cache's after
  // the same work.
  auto backend = make_gpusim_backend(64 * kMiB);
  const KvCacheConfig config = sim_config(GetParam());
  constexpr std::size_t kBlocks = 40;  // past the by-value limits: staged uploads too
  std::vector<DevicePtr> memory;
  std::vector<AdoptedPool> pools;
  for (std::size_t bytes : PagedKvCache::adopted_pool_bytes(config, kBlocks)) {
    memory.push_back(DevicePtr::from(gpusim_malloc_native(bytes)));
    pools.push_back({memory.back(), bytes});
  }
  DevicePtr probe;  // layer 0 K of block 1: in pool 0 in both layouts
  {
    PagedKvCache owned(config, kBlocks, *backend, PagedKvCacheOptions{false});
    PagedKvCache adopted(config, kBlocks, *backend, pools, PagedKvCacheOptions{false});
    EXPECT_TRUE(adopted.adopted());
    Stream s = backend->create_stream();
    std::vector<BlockId> all(kBlocks);
    for (std::size_t i = 0; i < kBlocks; ++i)
      all[i] = static_cast<BlockId>(i);
    for (PagedKvCache* c : {&owned, &adopted}) {
      c->poison_blocks(all, s);
      std::vector<BlockId> some;
      for (BlockId b = 0; b < kBlocks; b += 3)
        some.push_back(b);
      c->zero_blocks(some, s);
      for (std::size_t layer = 0; layer < config.num_layers; ++layer) {
        Bytes k(c->k_block_bytes(layer)), v(c->v_block_bytes(layer));
        for (std::size_t i = 0; i < k.size(); ++i)
          k[i] = static_cast<std::uint8_t>(i * 7 + layer);
        for (std::size_t i = 0; i < v.size(); ++i)
          v[i] = static_cast<std::uint8_t>(i * 5 + layer);
        c->write_block(layer, 4, k, v, s);
      }
      std::vector<BlockCopy> copies;
      for (BlockId b = 0; b < 17; ++b)
        copies.push_back({4, static_cast<BlockId>(20 + b)});
      c->copy_blocks(copies, s);
      c->synchronize();
    }
    for (BlockId b = 0; b < kBlocks; ++b) {
      for (std::size_t layer = 0; layer < config.num_layers; ++layer) {
        const auto o = owned.read_block(layer, b, s);
        const auto a = adopted.read_block(layer, b, s);
        ASSERT_EQ(o.k, a.k) << "block " << b << " layer " << layer;
        ASSERT_EQ(o.v, a.v) << "block " << b << " layer " << layer;
      }
    }
    // The bytes are in the engine's memory.
    probe = adopted.k_cache_ptr(0, 1);
    Bytes first(1);
    backend->copy_d2h(first.data(), probe, 1, backend->default_stream());
    EXPECT_EQ(first[0], 0xFF);
    // A prefix cache and a host tier build over the adopted pools (their
    // round trips over adopted pools run on the host backend:
    // host_tier_test's "adopted" cases).
    PrefixCache pc(adopted);
    HostTierOptions options;
    options.num_host_blocks = 4;
    HostTier tier(pc, options, s);
    EXPECT_EQ(tier.slot_bytes(), config.bytes_per_block());
  }
  // Never freed, and free again once the cache is gone: another backend
  // object adopts pool 0 and finds the cache's bytes there.
  {
    auto engine = make_gpusim_backend(64 * kMiB);
    AdoptedMemory again = engine->adopt_memory(pools[0].base, pools[0].bytes);
    Bytes first(1);
    engine->copy_d2h(first.data(), probe, 1, engine->default_stream());
    EXPECT_EQ(first[0], 0xFF);
  }
  // The engine frees its own memory.
  for (DevicePtr p : memory)
    gpusim_free_native(p.get());
}

INSTANTIATE_TEST_SUITE_P(Layouts, GpusimAdopted,
                         ::testing::Values(KvCacheLayout::layer_major, KvCacheLayout::block_major));

}  // namespace
}  // namespace kvport
