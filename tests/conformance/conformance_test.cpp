// SPDX-License-Identifier: Apache-2.0
// The core of the backend conformance suite (see conformance.cpp for the
// other files): allocation, memset, batched fills, copies, ordering on one
// stream and across two, contract details, and PagedKvCache end to end.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <memory>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include <sys/wait.h>

#include "conformance.hpp"
#include "kvport/core/paged_kv_cache.hpp"
#include "kvport/platform/backend.hpp"
#include "kvport/platform/error.hpp"
#include "kvport/testing/support.hpp"

namespace kvport::conformance {
namespace {

using kvport::testing::message_of;
using ::testing::HasSubstr;

// ---- allocation ------------------------------------------------------------------

TEST_P(Conformance, AllocationsAreAlignedDistinctAndUsable) {
  const std::size_t sizes[] = {1, 3, 255, 256, 257, 4096, kMiB + 7};
  std::vector<DevicePtr> ptrs;
  for (std::size_t i = 0; i < std::size(sizes); ++i) {
    DevicePtr p = alloc(sizes[i]);
    EXPECT_EQ(p.address() % kAllocAlignment, 0u) << sizes[i];
    b().memset_async(p, static_cast<std::uint8_t>(i + 1), sizes[i], stream());
    ptrs.push_back(p);
  }
  for (std::size_t i = 0; i < std::size(sizes); ++i) {
    EXPECT_EQ(download(ptrs[i], sizes[i]), Bytes(sizes[i], static_cast<std::uint8_t>(i + 1)));
  }
}

TEST_P(Conformance, ZeroSizeAllocationIsAnInvalidArgument) {
  EXPECT_THAT(message_of([&] { b().alloc(0); }), HasSubstr("alloc"));
  EXPECT_THROW(b().alloc(0), InvalidArgument);
}

TEST_P(Conformance, AbsurdSizesAreOutOfMemoryAndTheBackendStaysUsable) {
  for (std::size_t bytes : {SIZE_MAX, SIZE_MAX / 2, std::size_t{1} << 52}) {
    EXPECT_THROW(b().alloc(bytes), OutOfMemory) << bytes;
  }
  DevicePtr p = alloc(4096);
  b().memset_async(p, 0x11, 4096, stream());
  EXPECT_EQ(download(p, 4096), Bytes(4096, 0x11));
}

TEST_P(Conformance, ManyAllocations) {
  constexpr std::size_t kCount = 1000, kBytes = 4 * kKiB;
  std::vector<DevicePtr> ptrs;
  for (std::size_t i = 0; i < kCount; ++i) {
    ptrs.push_back(b().alloc(kBytes));  // freed below, not by the fixture
    b().memset_async(ptrs.back(), static_cast<std::uint8_t>(i), kBytes, stream());
  }
  for (std::size_t i = 0; i < kCount; i += 97) {
    EXPECT_EQ(download(ptrs[i], kBytes), Bytes(kBytes, static_cast<std::uint8_t>(i))) << i;
  }
  for (DevicePtr p : ptrs)
    EXPECT_TRUE(b().free(p));
}

TEST_P(Conformance, FreeRejectsForeignInteriorAndDoubleFrees) {
  int on_the_stack = 0;
  EXPECT_FALSE(b().free(DevicePtr::from(&on_the_stack)));
  DevicePtr p = b().alloc(1024);
  EXPECT_FALSE(b().free(p.offset(16)));
  EXPECT_TRUE(b().free(p));
  EXPECT_FALSE(b().free(p));
  EXPECT_TRUE(b().free(DevicePtr()));
}

TEST_P(Conformance, MemInfoIsSane) {
  const MemInfo before = b().mem_info();
  EXPECT_GT(before.total_bytes, 0u);
  EXPECT_LE(before.free_bytes, before.total_bytes);
  DevicePtr p = alloc(64 * kMiB);
  const MemInfo after = b().mem_info();
  EXPECT_LE(after.free_bytes, before.free_bytes);
  EXPECT_EQ(after.total_bytes, before.total_bytes);
  EXPECT_GE(b().device_count(), 1);
  (void)p;
}

// ---- memset -----------------------------------------------------------------------

TEST_P(Conformance, MemsetEveryByteValueLeavesNeighboursUntouched) {
  constexpr std::size_t kSeg = 64;
  Bytes expected = random_bytes(256 * kSeg, 1);
  DevicePtr p = upload(expected);
  for (std::size_t v = 0; v < 256; ++v) {
    // Bytes 1..62 of each segment; bytes 0 and 63 keep their random value.
    b().memset_async(p.offset(v * kSeg + 1), static_cast<std::uint8_t>(v), kSeg - 2, stream());
    std::fill_n(expected.begin() + static_cast<std::ptrdiff_t>(v * kSeg + 1), kSeg - 2,
                static_cast<std::uint8_t>(v));
  }
  EXPECT_EQ(download(p, expected.size()), expected);
}

TEST_P(Conformance, MemsetSizesAndUnalignedOffsets) {
  constexpr std::size_t kBuf = 256 * kKiB;
  Bytes expected = random_bytes(kBuf, 2);
  DevicePtr p = upload(expected);
  const std::pair<std::size_t, std::size_t> cases[] = {
      {0, 1}, {1, 1}, {3, 7}, {5, 255}, {17, 4099}, {4096, 4096}, {255, 65537}, {70001, 131071}};
  std::uint8_t value = 0x40;
  for (auto [offset, size] : cases) {
    b().memset_async(p.offset(offset), value, size, stream());
    std::fill_n(expected.begin() + static_cast<std::ptrdiff_t>(offset), size, value);
    ++value;
  }
  EXPECT_EQ(download(p, kBuf), expected);
}

TEST_P(Conformance, LargeMemset) {
  constexpr std::size_t kBytes = 64 * kMiB + 3;
  DevicePtr p = alloc(kBytes);
  b().memset_async(p, 0xC3, kBytes, stream());
  const Bytes back = download(p, kBytes);
  EXPECT_EQ(std::count(back.begin(), back.end(), 0xC3), static_cast<std::ptrdiff_t>(kBytes));
}

TEST_P(Conformance, ZeroByteMemsetIsANoOp) {
  const Bytes content = random_bytes(512, 3);
  DevicePtr p = upload(content);
  b().memset_async(p.offset(100), 0, 0, stream());
  EXPECT_EQ(download(p, 512), content);
}

// ---- batched fill ------------------------------------------------------------------

TEST_P(Conformance, BatchedFillOf1_7_1000_100000OddRegions) {
  for (std::size_t count : {1, 7, 1000, 100000}) {
    SCOPED_TRACE(count);
    check_batched_fill(count, 97, static_cast<std::uint32_t>(count));
  }
}

TEST_P(Conformance, BatchedFillOfLargeOddRegions) {
  check_batched_fill(24, 300001, 77);
}

TEST_P(Conformance, BatchedFillAcrossAllocations) {
  const Bytes a0 = random_bytes(1000, 4), b0 = random_bytes(3000, 5);
  DevicePtr a = upload(a0), c = upload(b0);
  const FillRegion regions[] = {{a.offset(1), 998}, {c.offset(2999), 1}, {c, 10}};
  b().fill_async(regions, 0, stream());
  Bytes ea = a0, ec = b0;
  std::fill(ea.begin() + 1, ea.begin() + 999, 0);
  ec[2999] = 0;
  std::fill_n(ec.begin(), 10, 0);
  EXPECT_EQ(download(a, 1000), ea);
  EXPECT_EQ(download(c, 3000), ec);
}

TEST_P(Conformance, FillBlocksOverRegisteredPools) {
  // Two pools: a dense one (stride == bytes) and a sparse one (gaps between
  // blocks stay untouched).
  constexpr std::size_t kBlocks = 50;
  Bytes dense0 = random_bytes(kBlocks * 48, 6), sparse0 = random_bytes(kBlocks * 100, 7);
  DevicePtr dense = upload(dense0), sparse = upload(sparse0);
  const PoolGeometry pools[] = {{dense, 48, 48}, {sparse, 70, 100}};
  BlockPoolSet set = b().register_block_pools(pools, kBlocks);
  EXPECT_EQ(set.num_pools(), 2u);
  EXPECT_FALSE(set.dense());
  const std::vector<std::uint32_t> ids = {49, 0, 1, 2, 17, 33, 34};
  const CallCounts before = b().call_counts();
  b().fill_blocks_async(set, ids, 0xFF, stream());
  EXPECT_EQ(b().call_counts().fill - before.fill, 1u);
  for (std::uint32_t id : ids) {
    std::fill_n(dense0.begin() + id * 48, 48, 0xFF);
    std::fill_n(sparse0.begin() + id * 100, 70, 0xFF);
  }
  EXPECT_EQ(download(dense, dense0.size()), dense0);
  EXPECT_EQ(download(sparse, sparse0.size()), sparse0);

  const std::uint32_t bad[] = {50};
  EXPECT_THAT(message_of([&] { b().fill_blocks_async(set, bad, 0, stream()); }),
              HasSubstr("out of range"));
  const PoolGeometry invalid[] = {{dense, 48, 47}};
  EXPECT_THROW(b().register_block_pools(invalid, kBlocks), InvalidArgument);
  EXPECT_THROW(b().register_block_pools({}, kBlocks), InvalidArgument);
}

// ---- copies -------------------------------------------------------------------------

TEST_P(Conformance, CopiesInEveryDirectionWithOffsets) {
  const Bytes src = random_bytes(5000, 8);
  Bytes a_expected = random_bytes(8192, 9), b_expected = random_bytes(8192, 10);
  DevicePtr a = upload(a_expected), c = upload(b_expected);
  b().copy_h2d_async(a.offset(3), src.data() + 11, 1001, stream());
  std::copy_n(src.begin() + 11, 1001, a_expected.begin() + 3);
  b().copy_d2d_async(c.offset(17), a.offset(3), 1001, stream());
  std::copy_n(a_expected.begin() + 3, 1001, b_expected.begin() + 17);
  Bytes out(1200, 0xEE);
  b().copy_d2h_async(out.data() + 5, c.offset(17), 1001, stream());
  b().synchronize(stream());
  EXPECT_TRUE(std::equal(out.begin() + 5, out.begin() + 1006, src.begin() + 11));
  EXPECT_EQ(out[4], 0xEE);
  EXPECT_EQ(out[1006], 0xEE);
  EXPECT_EQ(download(a, 8192), a_expected);
  EXPECT_EQ(download(c, 8192), b_expected);
}

TEST_P(Conformance, OverlappingDeviceCopyIsRejected) {
  DevicePtr a = alloc(4096);
  EXPECT_THAT(message_of([&] { b().copy_d2d_async(a.offset(100), a, 200, stream()); }),
              HasSubstr("overlap"));
  EXPECT_THROW(b().copy_d2d_async(a, a, 1, stream()), InvalidArgument);
  // Adjacent ranges do not overlap.
  EXPECT_NO_THROW(b().copy_d2d_async(a.offset(200), a, 200, stream()));
  b().synchronize(stream());
}

TEST_P(Conformance, CopyBatchMovesEveryRegionInOneCall) {
  std::mt19937 rng(11);
  const Bytes src0 = random_bytes(2 * kMiB, 12);
  Bytes dst0 = random_bytes(3 * kMiB, 13);
  DevicePtr src = upload(src0), dst = upload(dst0);
  std::vector<CopyRegion> regions;
  std::size_t cursor = 1;
  for (int i = 0; i < 1000; ++i) {
    const std::size_t size = 1 + rng() % 300;
    const std::size_t from = rng() % (src0.size() - size);  // sources may overlap
    regions.push_back(CopyRegion{dst.offset(cursor), src.offset(from), size});
    std::copy_n(src0.begin() + static_cast<std::ptrdiff_t>(from), size,
                dst0.begin() + static_cast<std::ptrdiff_t>(cursor));
    cursor += size + rng() % 3;
  }
  // One region larger than a kernel chunk, unaligned on both sides.
  regions.push_back(CopyRegion{dst.offset(cursor + 5), src.offset(3), 200003});
  std::copy_n(src0.begin() + 3, 200003, dst0.begin() + static_cast<std::ptrdiff_t>(cursor + 5));
  const CallCounts before = b().call_counts();
  b().copy_batch_async(regions, stream());
  EXPECT_EQ(b().call_counts().copy_batch - before.copy_batch, 1u);
  EXPECT_EQ(download(dst, dst0.size()), dst0);
}

TEST_P(Conformance, CopyBatchRejectsOverlappingDestinations) {
  DevicePtr a = alloc(4096), c = alloc(4096);
  const CopyRegion dst_dst[] = {{c, a, 100}, {c.offset(50), a.offset(1000), 100}};
  EXPECT_THROW(b().copy_batch_async(dst_dst, stream()), InvalidArgument);
  const CopyRegion dst_src[] = {{c, a, 100}, {a.offset(2000), c.offset(50), 10}};
  EXPECT_THROW(b().copy_batch_async(dst_src, stream()), InvalidArgument);
}

// ---- ordering -----------------------------------------------------------------------

TEST_P(Conformance, FillThenCopyOnOneStreamSeesTheFill) {
  constexpr std::size_t kBytes = 16 * kMiB;
  DevicePtr a = alloc(kBytes), c = alloc(kBytes);
  Stream s = b().create_stream();
  const FillRegion all[] = {{a, kBytes}};
  b().fill_async(all, 0x77, s);
  b().copy_d2d_async(c, a, kBytes, s);
  Bytes out(kBytes);
  b().copy_d2h_async(out.data(), c, kBytes, s);
  s.synchronize();
  EXPECT_EQ(std::count(out.begin(), out.end(), 0x77), static_cast<std::ptrdiff_t>(kBytes));
}

TEST_P(Conformance, EventOrdersWorkAcrossStreams) {
  constexpr std::size_t kBytes = 64 * kMiB;
  DevicePtr a = alloc(kBytes), c = alloc(kBytes);
  Stream producer = b().create_stream(), consumer = b().create_stream();
  Event ready = b().create_event();
  for (const std::uint8_t round : {std::uint8_t{0x42}, std::uint8_t{0x43}}) {
    b().memset_async(a, round, kBytes, producer);
    ready.record(producer);
    ready.wait(consumer);
    b().copy_d2d_async(c, a, kBytes, consumer);
    Bytes out(kBytes);
    b().copy_d2h_async(out.data(), c, kBytes, consumer);
    consumer.synchronize();
    EXPECT_EQ(std::count(out.begin(), out.end(), round), static_cast<std::ptrdiff_t>(kBytes));
    producer.synchronize();
  }
  ready.synchronize();
}

TEST_P(Conformance, TimingEventsMeasureDeviceWork) {
  constexpr std::size_t kBytes = 64 * kMiB;
  DevicePtr a = alloc(kBytes);
  Stream s = b().create_stream();
  Event start = b().create_timing_event(), stop = b().create_timing_event();
  start.record(s);
  b().memset_async(a, 0x5A, kBytes, s);
  stop.record(s);
  const double seconds = b().elapsed_seconds(start, stop);
  EXPECT_GE(seconds, 0.0);
  EXPECT_LT(seconds, 60.0);
  // The memset is complete once the end event is.
  EXPECT_EQ(download(a, 4096), Bytes(4096, 0x5A));
  Event never = b().create_timing_event();
  EXPECT_THROW(b().elapsed_seconds(start, never), Error);
}

TEST_P(Conformance, SynchronizeSurfacesAnAsynchronousError) {
  if (!info_.is_gpu && b().name() != "gpusim") {
    Stream s = b().create_stream();
    b().inject_async_fault(s);  // returns at once; the error comes later
    EXPECT_THROW(s.synchronize(), BackendError);
    EXPECT_NO_THROW(s.synchronize());  // reported once
    EXPECT_FALSE(b().device_lost());
    return;
  }
  if (!info_.is_gpu) {
    // gpusim models a GPU fault: sticky and context-wide, the device is lost.
    Stream s = b().create_stream();
    b().inject_async_fault(s);
    EXPECT_THROW(s.synchronize(), DeviceLost);
    EXPECT_THROW(b().synchronize(stream()), DeviceLost);  // every stream, every later call
    EXPECT_THROW(b().alloc(64), DeviceLost);              // never OutOfMemory
    EXPECT_TRUE(b().device_lost());
    return;
  }
  // A GPU fault is sticky: the context is lost. Run it in a process of its
  // own. On CUDA the synchronize reports it (DeviceLost). On ROCm a
  // device-side trap usually aborts the process from the runtime before any
  // status comes back: on hip, death by a signal is the expected outcome too.
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  const std::string name = GetParam();
  const bool abort_allowed = name == "hip";
  EXPECT_EXIT(
      {
        auto gpu = make_backend(name);
        gpu->inject_async_fault(gpu->default_stream());
        try {
          gpu->synchronize(gpu->default_stream());
        } catch (const DeviceLost& e) {
          std::fprintf(stderr, "surfaced: %s\n", e.what());
          std::_Exit(gpu->device_lost() ? 0 : 4);
        } catch (const BackendError& e) {
          std::fprintf(stderr, "not reported as device lost: %s\n", e.what());
          std::_Exit(5);
        }
        std::_Exit(3);
      },
      [abort_allowed](int status) {
        if (WIFEXITED(status)) return WEXITSTATUS(status) == 0;
        return abort_allowed && WIFSIGNALED(status);
      },
      abort_allowed ? "" : "surfaced");
}

// ---- contract details ----------------------------------------------------------------

TEST_P(Conformance, NullPointersAreInvalidArguments) {
  DevicePtr p = alloc(64);
  Bytes host(64);
  EXPECT_THROW(b().memset_async(DevicePtr(), 0, 1, stream()), InvalidArgument);
  EXPECT_THROW(b().copy_h2d_async(DevicePtr(), host.data(), 1, stream()), InvalidArgument);
  EXPECT_THROW(b().copy_h2d_async(p, nullptr, 1, stream()), InvalidArgument);
  EXPECT_THROW(b().copy_d2h_async(nullptr, p, 1, stream()), InvalidArgument);
  EXPECT_THROW(b().copy_d2d_async(p, DevicePtr(), 1, stream()), InvalidArgument);
  const FillRegion null_region[] = {{DevicePtr(), 4}};
  EXPECT_THROW(b().fill_async(null_region, 0, stream()), InvalidArgument);
}

TEST_P(Conformance, RangesPastTheAllocationAreRejectedBeforeReachingTheDevice) {
  const Bytes content = random_bytes(1000, 14);
  DevicePtr p = upload(content);
  Bytes host(2000);
  EXPECT_THAT(message_of([&] { b().memset_async(p, 0, 1001, stream()); }),
              HasSubstr("out of bounds"));
  EXPECT_THAT(message_of([&] { b().copy_d2h_async(host.data(), p.offset(999), 2, stream()); }),
              HasSubstr("out of bounds"));
  EXPECT_THAT(message_of([&] { b().copy_h2d_async(p.offset(500), host.data(), 501, stream()); }),
              HasSubstr("out of bounds"));
  const FillRegion past[] = {{p, 10}, {p.offset(990), 11}};
  EXPECT_THROW(b().fill_async(past, 0, stream()), InvalidArgument);
  int on_the_stack = 0;
  EXPECT_THAT(message_of([&] { b().memset_async(DevicePtr::from(&on_the_stack), 0, 4, stream()); }),
              HasSubstr("bad pointer"));
  // Nothing was written, and the backend still works.
  EXPECT_EQ(download(p, 1000), content);
}

TEST_P(Conformance, StreamsOfAnotherBackendAreRejected) {
  auto other = make_any_backend(GetParam());
  DevicePtr p = alloc(16);
  EXPECT_THAT(message_of([&] { b().memset_async(p, 0, 16, other->default_stream()); }),
              HasSubstr("another backend"));
}

// ---- PagedKvCache end to end ------------------------------------------------------------

struct CacheCase {
  const char* name;
  KvCacheLayout layout;
  bool mixed;
};

KvCacheConfig cache_config(const CacheCase& c) {
  KvCacheConfig cfg;
  cfg.num_layers = 4;
  cfg.block_size = 16;
  cfg.num_kv_heads = 2;
  cfg.head_dim_k = 64;
  cfg.head_dim_v = 32;
  cfg.dtype = KvCacheDtype::bf16;
  cfg.layout = c.layout;
  if (c.mixed) {
    cfg.layer_dtypes = {KvCacheDtype::bf16, KvCacheDtype::nvfp4, KvCacheDtype::turbo3,
                        KvCacheDtype::fp8_e5m2};
  }
  return cfg;
}

TEST_P(Conformance, PagedKvCacheZeroPoisonReadWriteEveryLayer) {
  const CacheCase cases[] = {{"layer_major", KvCacheLayout::layer_major, false},
                             {"block_major", KvCacheLayout::block_major, false},
                             {"layer_major_mixed", KvCacheLayout::layer_major, true},
                             {"block_major_mixed", KvCacheLayout::block_major, true}};
  for (const CacheCase& c : cases) {
    SCOPED_TRACE(c.name);
    constexpr std::size_t kBlocks = 37;
    PagedKvCache cache(cache_config(c), kBlocks, b(), PagedKvCacheOptions{false});
    const std::size_t layers = cache.num_layers();
    // expected[layer][block] = (K bytes, V bytes)
    std::vector<std::vector<std::pair<Bytes, Bytes>>> expected(layers);
    for (std::size_t l = 0; l < layers; ++l) {
      for (BlockId blk = 0; blk < kBlocks; ++blk) {
        const auto seed = static_cast<std::uint32_t>(l * 1000 + blk);
        Bytes k = random_bytes(cache.k_block_bytes(l), seed);
        Bytes v = random_bytes(cache.v_block_bytes(l), seed + 500);
        cache.write_block(l, blk, k, v, stream());
        expected[l].emplace_back(std::move(k), std::move(v));
      }
    }
    const std::vector<BlockId> zero = {3, 4, 5, 9, 20}, poison = {36, 0, 10, 9};
    cache.zero_blocks(zero, stream());
    cache.poison_blocks(poison, stream());  // block 9: zeroed, then poisoned
    for (std::size_t l = 0; l < layers; ++l) {
      for (BlockId blk : zero) {
        std::fill(expected[l][blk].first.begin(), expected[l][blk].first.end(), 0);
        std::fill(expected[l][blk].second.begin(), expected[l][blk].second.end(), 0);
      }
      for (BlockId blk : poison) {
        std::fill(expected[l][blk].first.begin(), expected[l][blk].first.end(), 0xFF);
        std::fill(expected[l][blk].second.begin(), expected[l][blk].second.end(), 0xFF);
      }
    }
    for (std::size_t l = 0; l < layers; ++l) {
      for (BlockId blk = 0; blk < kBlocks; ++blk) {
        const auto got = cache.read_block(l, blk, stream());
        ASSERT_EQ(got.k, expected[l][blk].first) << "layer " << l << " block " << blk << " K";
        ASSERT_EQ(got.v, expected[l][blk].second) << "layer " << l << " block " << blk << " V";
      }
    }
  }
}

}  // namespace
}  // namespace kvport::conformance
