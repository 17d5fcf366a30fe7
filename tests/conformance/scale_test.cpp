// SPDX-License-Identifier: Apache-2.0
// Sizes that matter on a GPU: offsets past 4 GiB (32-bit index overflow),
// more regions than the kernels' grid has blocks (the grid-stride loop),
// 100 000 block ids, batched copies of multi-chunk regions whose source and
// destination are misaligned alike or differently, and the time of a 1 GiB
// fill against what memory bandwidth allows.
#include <algorithm>
#include <cstdint>
#include <numeric>
#include <random>
#include <vector>

#include "conformance.hpp"
#include "kvport/platform/error.hpp"

namespace kvport::conformance {
namespace {

// A host model of the bytes [origin, origin + size) of one allocation, in
// offsets from the allocation's base.
struct Window {
  std::size_t origin;
  Bytes bytes;

  std::ptrdiff_t at(std::size_t offset) const {
    EXPECT_GE(offset, origin);
    return static_cast<std::ptrdiff_t>(offset - origin);
  }
  void fill(std::size_t offset, std::size_t n, std::uint8_t value) {
    std::fill_n(bytes.begin() + at(offset), n, value);
  }
  // Non-overlapping ranges only.
  void copy(std::size_t dst, std::size_t src, std::size_t n) {
    std::copy_n(bytes.begin() + at(src), n, bytes.begin() + at(dst));
  }
};

TEST_P(Conformance, FillsAndCopiesAtOffsetsBeyond4GiB) {
  constexpr std::size_t k4G = 4 * kGiB;
  constexpr std::size_t kBytes = k4G + 9 * kMiB;  // one allocation
  const MemInfo mem = b().mem_info();
  if (mem.free_bytes < kBytes + 64 * kMiB) {
    GTEST_SKIP() << b().name() << " has " << mem.free_bytes << " bytes free; the test needs "
                 << kBytes + 64 * kMiB << " (one allocation of 4 GiB + 9 MiB, and room to spare)";
  }
  DevicePtr big;
  try {
    big = alloc(kBytes);
  } catch (const OutOfMemory& e) {
    GTEST_SKIP() << "alloc(4 GiB + 9 MiB) failed although mem_info reports " << mem.free_bytes
                 << " bytes free: " << e.what();
  }
  // The model covers [4 GiB - 1 MiB, end): ranges below, across and above the
  // 4 GiB line. Offsets below are from `big`; only the model's pages are
  // ever touched.
  Window w{k4G - kMiB, random_bytes(kBytes - (k4G - kMiB), 41)};
  b().copy_h2d_async(big.offset(w.origin), w.bytes.data(), w.bytes.size(), stream());
  Bytes small0 = random_bytes(kMiB, 42);
  DevicePtr small = upload(small0);

  // memset_async: above the line, and across it.
  b().memset_async(big.offset(k4G + 3), 0x11, 100001, stream());
  w.fill(k4G + 3, 100001, 0x11);
  b().memset_async(big.offset(k4G - 1000), 0x12, 3000, stream());
  w.fill(k4G - 1000, 3000, 0x12);

  // fill_async: multi-chunk regions, one across the line, the very last byte.
  const std::pair<std::size_t, std::size_t> fills[] = {{k4G + 200001, 70000},
                                                       {k4G - 5, 10},
                                                       {kBytes - 1, 1},
                                                       {k4G + 5 * kMiB + 7, 300001},
                                                       {k4G + 8 * kMiB + 100, 65536 * 3}};
  std::vector<FillRegion> regions;
  for (auto [offset, n] : fills) {
    regions.push_back({big.offset(offset), n});
    w.fill(offset, n, 0x22);
  }
  b().fill_async(regions, 0x22, stream());

  // copy_d2d_async: within the far range, and to and from another allocation.
  b().copy_d2d_async(big.offset(k4G + 2 * kMiB + 1), big.offset(k4G + 100), 200000, stream());
  w.copy(k4G + 2 * kMiB + 1, k4G + 100, 200000);
  b().copy_d2d_async(big.offset(k4G + 3 * kMiB + 5), small, 400000, stream());
  std::copy_n(small0.begin(), 400000, w.bytes.begin() + w.at(k4G + 3 * kMiB + 5));
  b().copy_d2d_async(small.offset(17), big.offset(k4G + 6 * kMiB), 300000, stream());
  std::copy_n(w.bytes.begin() + w.at(k4G + 6 * kMiB), 300000, small0.begin() + 17);

  // copy_batch_async: no destination overlaps another region, so the model
  // may apply the copies in any order.
  const CopyRegion batch[] = {
      {big.offset(k4G + 4 * kMiB + 3), big.offset(k4G + kMiB + 64), 150000},
      {big.offset(k4G - 70000), big.offset(k4G + 7 * kMiB + 11), 150000},  // across the line
      {big.offset(kBytes - 100000), big.offset(k4G - 500000), 100000},     // to the very end
      {big.offset(k4G + 5 * kMiB + 1), big.offset(k4G + 5 * kMiB + 400001), 65537},
  };
  b().copy_batch_async(batch, stream());
  for (const CopyRegion& r : batch) {
    w.copy(r.dst.address() - big.address(), r.src.address() - big.address(), r.bytes);
  }

  // fill_blocks_async: two pools of 4104 blocks of 1 MiB, over 4 GiB each.
  // Block 4103 is the last (the second pool's ends at 4104 MiB + 40001, inside
  // the allocation); the second pool's block 4095 lies across the line.
  constexpr std::size_t kBlocks = 4104;
  const PoolGeometry pools[] = {{big, 4101, kMiB}, {big.offset(kMiB - 30000), 70001, kMiB}};
  BlockPoolSet set = b().register_block_pools(pools, kBlocks);
  const std::uint32_t ids[] = {kBlocks - 1, 4095, 4096, 4097};
  b().fill_blocks_async(set, ids, 0x33, stream());
  for (std::uint32_t id : ids) {
    for (const PoolGeometry& p : pools) {
      w.fill(p.base.address() - big.address() + std::size_t{id} * p.stride, p.bytes, 0x33);
    }
  }

  // copy_d2h_async from past the line: the whole model, in one copy.
  EXPECT_TRUE(same_bytes(download(big.offset(w.origin), w.bytes.size()), w.bytes));
  EXPECT_TRUE(same_bytes(download(small, small0.size()), small0));
}

TEST_P(Conformance, FillOfMoreRegionsThanTheGridHasBlocks) {
  // The GPU kernels launch at most 2^20 blocks and stride over the rest: one
  // tiny region per block, so 2^20 + 5 regions need the stride.
  constexpr std::size_t kRegions = (std::size_t{1} << 20) + 5;
  if (kThreadSanitizer && GetParam() == "gpusim") {
    GTEST_SKIP() << "gpusim runs this fill's 2^28 kernel lanes one by one on the calling thread: "
                    "about a minute under ThreadSanitizer, with nothing concurrent to check "
                    "(the other presets run it)";
  }
  Bytes expected = random_bytes(4 * kRegions + 16, 51);
  DevicePtr p = upload(expected);
  std::vector<FillRegion> regions;
  regions.reserve(kRegions);
  for (std::size_t i = 0; i < kRegions; ++i) {
    // 1 to 3 bytes at 4i or 4i + 1: the others stay as they were.
    const std::size_t offset = 4 * i + i % 2, size = 1 + i % 3;
    regions.push_back({p.offset(offset), size});
    std::fill_n(expected.begin() + static_cast<std::ptrdiff_t>(offset), size, 0xA5);
  }
  std::reverse(regions.begin(), regions.end());  // any order: not sorted by address
  const CallCounts before = b().call_counts();
  b().fill_async(regions, 0xA5, stream());
  EXPECT_EQ(b().call_counts().fill - before.fill, 1u);
  EXPECT_TRUE(same_bytes(download(p, expected.size()), expected));
}

TEST_P(Conformance, FillBlocksWith100000Ids) {
  constexpr std::size_t kBlocks = 131072, kIds = 100000;
  // A dense pool (runs of ids coalesce on the host backend) and a sparse one.
  Bytes dense0 = random_bytes(kBlocks * 8, 53), sparse0 = random_bytes(kBlocks * 13, 54);
  DevicePtr dense = upload(dense0), sparse = upload(sparse0);
  const PoolGeometry pools[] = {{dense, 8, 8}, {sparse, 5, 13}};
  BlockPoolSet set = b().register_block_pools(pools, kBlocks);
  std::vector<std::uint32_t> all(kBlocks);
  std::iota(all.begin(), all.end(), 0u);
  std::shuffle(all.begin(), all.end(), std::mt19937(55));
  std::vector<std::uint32_t> ids(all.begin(), all.begin() + kIds);
  std::sort(ids.begin(), ids.begin() + kIds / 2);  // half in runs, half scattered
  const CallCounts before = b().call_counts();
  b().fill_blocks_async(set, ids, 0x5E, stream());
  EXPECT_EQ(b().call_counts().fill - before.fill, 1u);
  for (std::uint32_t id : ids) {
    std::fill_n(dense0.begin() + std::ptrdiff_t{id} * 8, 8, 0x5E);
    std::fill_n(sparse0.begin() + std::ptrdiff_t{id} * 13, 5, 0x5E);
  }
  EXPECT_TRUE(same_bytes(download(dense, dense0.size()), dense0));
  EXPECT_TRUE(same_bytes(download(sparse, sparse0.size()), sparse0));
}

// Regions over one 64 KiB kernel chunk; source and destination misaligned
// (modulo 16, the GPU kernels' vector width) by `src_mis` and `dst_mis`.
void check_large_copy_batch(Backend& b, DevicePtr src, const Bytes& src0, DevicePtr dst,
                            Bytes& dst0,
                            const std::vector<std::pair<std::size_t, std::size_t>>& misalign) {
  const std::size_t sizes[] = {65537, 131077, 200003, 3 * 65536, 65536 + 15, 300001};
  std::vector<CopyRegion> regions;
  std::size_t src_cursor = 0, dst_cursor = 0;
  std::size_t k = 0;
  for (std::size_t size : sizes) {
    for (auto [src_mis, dst_mis] : misalign) {
      const std::size_t from = (src_cursor + 15) / 16 * 16 + src_mis;
      const std::size_t to = (dst_cursor + 15) / 16 * 16 + dst_mis;
      regions.push_back({dst.offset(to), src.offset(from), size});
      std::copy_n(src0.begin() + static_cast<std::ptrdiff_t>(from), size,
                  dst0.begin() + static_cast<std::ptrdiff_t>(to));
      src_cursor = (from + size / 3 + k) % (src0.size() - 400000);  // sources may overlap
      dst_cursor = to + size + 1 + k % 7;                           // destinations do not
      ++k;
    }
  }
  EXPECT_LE(dst_cursor, dst0.size());
  b.copy_batch_async(regions, b.default_stream());
  Bytes back(dst0.size());
  b.copy_d2h(back.data(), dst, back.size(), b.default_stream());
  EXPECT_TRUE(same_bytes(back, dst0));
}

TEST_P(Conformance, CopyBatchOfLargeRegionsMisalignedAlikeAndDifferently) {
  const Bytes src0 = random_bytes(4 * kMiB, 56);
  Bytes dst0 = random_bytes(6 * kMiB, 57);
  DevicePtr src = upload(src0), dst = upload(dst0);
  {
    SCOPED_TRACE("source and destination misaligned alike");
    check_large_copy_batch(b(), src, src0, dst, dst0, {{0, 0}, {3, 3}, {15, 15}, {8, 8}});
  }
  {
    SCOPED_TRACE("source and destination misaligned differently");
    check_large_copy_batch(b(), src, src0, dst, dst0, {{0, 1}, {5, 12}, {15, 0}, {8, 4}});
  }
}

TEST_P(Conformance, TimeOfA1GiBFillIsWithinWhatBandwidthAllows) {
  constexpr std::size_t kBytes = kGiB;
  constexpr double kFastestBytesPerSecond = 20e12;  // no device writes faster than 20 TB/s
  const MemInfo mem = b().mem_info();
  if (mem.free_bytes < kBytes + 64 * kMiB) {
    GTEST_SKIP() << b().name() << " has " << mem.free_bytes << " bytes free; the test needs "
                 << kBytes + 64 * kMiB;
  }
  DevicePtr p = alloc(kBytes);
  Stream s = b().create_stream();
  Event start = b().create_timing_event(), stop = b().create_timing_event();
  start.record(s);
  b().memset_async(p, 0x6B, kBytes, s);
  stop.record(s);
  const double seconds = b().elapsed_seconds(start, stop);
  EXPECT_GE(seconds, static_cast<double>(kBytes) / kFastestBytesPerSecond)
      << "1 GiB filled in " << seconds << " s: faster than any memory";
  EXPECT_LT(seconds, 60.0);
  // The fill is complete once the end event is: check 64 KiB pieces spread
  // over the whole GiB, the first and the last included. (Reading back all of
  // it takes longer than the fill itself under the sanitizers.)
  constexpr std::size_t kPiece = 64 * kKiB, kPieces = 65;
  const Bytes expected(kPiece, 0x6B);
  Bytes back(kPiece);
  for (std::size_t i = 0; i < kPieces; ++i) {
    // 0, 16 MiB - 1 KiB, ..., 1 GiB - 64 KiB: evenly spaced, not page-aligned.
    const std::size_t at = (kBytes - kPiece) / (kPieces - 1) * i;
    b().copy_d2h(back.data(), p.offset(at), kPiece, s);
    ASSERT_TRUE(same_bytes(back, expected)) << "in the 64 KiB at offset " << at;
  }
}

}  // namespace
}  // namespace kvport::conformance
