// SPDX-License-Identifier: Apache-2.0
// PagedKvCache on the host backend: free list, refcounts, pointers in both
// layouts, zero/poison read back from the pools, coalescing, construction and
// destruction accounting.
#include "kvport/core/paged_kv_cache.hpp"

#include <fmt/format.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <limits>
#include <memory>
#include <numeric>
#include <optional>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "core_test_util.hpp"
#include "kvport/platform/error.hpp"

namespace kvport {
namespace {

using test::expect_invalid_argument;
using test::kMiB;

PagedKvCacheOptions no_trace() {
  PagedKvCacheOptions options;
  options.trace = false;
  return options;
}

class PagedKvCacheTest : public ::testing::Test {
 protected:
  PagedKvCache make(std::size_t num_blocks, KvCacheConfig config = test::small_config()) {
    return PagedKvCache(std::move(config), num_blocks, *backend_, no_trace());
  }

  std::unique_ptr<Backend> backend_ = test::host_backend();
  Stream stream_ = backend_->create_stream();
};

// ---- free list and refcounts -----------------------------------------------------------

TEST_F(PagedKvCacheTest, FreshCacheHandsOutBlocksInAscendingOrder) {
  PagedKvCache cache = make(8);
  EXPECT_EQ(cache.num_blocks(), 8u);
  EXPECT_EQ(cache.num_free_blocks(), 8u);
  for (BlockId expected = 0; expected < 8; ++expected) {
    EXPECT_EQ(cache.alloc_block(), expected);
    EXPECT_EQ(cache.ref_count(expected), 1u);
    EXPECT_EQ(cache.num_free_blocks(), 8u - expected - 1);
    EXPECT_EQ(cache.num_blocks_in_use(), expected + 1u);
  }
}

TEST_F(PagedKvCacheTest, TryAllocAlsoHandsOutAscendingOrder) {
  PagedKvCache cache = make(4);
  EXPECT_EQ(cache.try_alloc_block(), std::optional<BlockId>(0));
  EXPECT_EQ(cache.alloc_block(), 1u);
  EXPECT_EQ(cache.try_alloc_block(), std::optional<BlockId>(2));
  EXPECT_EQ(cache.ref_count(2), 1u);
}

TEST_F(PagedKvCacheTest, AllocBlockThrowsCacheExhaustedWithExactMessage) {
  PagedKvCache cache = make(2);
  cache.alloc_block();
  cache.alloc_block();
  try {
    cache.alloc_block();
    FAIL() << "expected CacheExhausted";
  } catch (const CacheExhausted& e) {
    EXPECT_STREQ(e.what(), "KV cache exhausted: no free blocks");
  }
  // Still exhausted, and the failed call changed nothing.
  EXPECT_THROW(cache.alloc_block(), CacheExhausted);
  EXPECT_EQ(cache.num_free_blocks(), 0u);
  EXPECT_EQ(cache.ref_count(0), 1u);
  EXPECT_EQ(cache.ref_count(1), 1u);
  EXPECT_EQ(cache.counters().exhaustion_events, 2u);
  EXPECT_EQ(cache.counters().allocs, 2u);
  EXPECT_TRUE(cache.check_invariants().ok);
}

TEST_F(PagedKvCacheTest, CacheExhaustedIsAKvportError) {
  PagedKvCache cache = make(1);
  cache.alloc_block();
  EXPECT_THROW(cache.alloc_block(), Error);
}

TEST_F(PagedKvCacheTest, TryAllocReturnsNulloptWhenExhausted) {
  PagedKvCache cache = make(1);
  EXPECT_EQ(cache.try_alloc_block(), std::optional<BlockId>(0));
  EXPECT_EQ(cache.try_alloc_block(), std::nullopt);
  EXPECT_EQ(cache.try_alloc_block(), std::nullopt);
  EXPECT_EQ(cache.counters().exhaustion_events, 2u);
  EXPECT_EQ(cache.counters().allocs, 1u);
  cache.free_block(0);
  EXPECT_EQ(cache.try_alloc_block(), std::optional<BlockId>(0));
}

TEST_F(PagedKvCacheTest, FreedBlocksAreReusedLastInFirstOut) {
  PagedKvCache cache = make(8);
  for (int i = 0; i < 5; ++i)
    cache.alloc_block();  // 0..4
  EXPECT_TRUE(cache.free_block(1));
  EXPECT_EQ(cache.alloc_block(), 1u);  // the freed block, not 5
  EXPECT_TRUE(cache.dec_ref(0));
  EXPECT_TRUE(cache.dec_ref(3));
  EXPECT_TRUE(cache.dec_ref(2));
  EXPECT_EQ(cache.alloc_block(), 2u);
  EXPECT_EQ(cache.alloc_block(), 3u);
  EXPECT_EQ(cache.alloc_block(), 0u);
  EXPECT_EQ(cache.alloc_block(), 5u);  // then the untouched tail, in order
  EXPECT_EQ(cache.alloc_block(), 6u);
}

TEST_F(PagedKvCacheTest, RefcountLifecycle) {
  PagedKvCache cache = make(4);
  const BlockId b = cache.alloc_block();
  cache.inc_ref(b);
  cache.inc_ref(b);
  EXPECT_EQ(cache.ref_count(b), 3u);
  EXPECT_FALSE(cache.dec_ref(b));
  EXPECT_EQ(cache.ref_count(b), 2u);
  EXPECT_FALSE(cache.free_block(b));
  EXPECT_EQ(cache.ref_count(b), 1u);
  EXPECT_EQ(cache.num_free_blocks(), 3u);
  EXPECT_TRUE(cache.dec_ref(b));
  EXPECT_EQ(cache.ref_count(b), 0u);
  EXPECT_EQ(cache.num_free_blocks(), 4u);
  EXPECT_TRUE(cache.check_invariants().ok);
}

TEST_F(PagedKvCacheTest, DoubleFreeIsIgnoredCountedAndLogged) {
  PagedKvCache cache = make(4);
  cache.alloc_block();  // 0
  cache.alloc_block();  // 1
  test::LogRecorder log;
  EXPECT_TRUE(cache.dec_ref(1));
  EXPECT_FALSE(cache.dec_ref(1));     // double free
  EXPECT_FALSE(cache.free_block(1));  // and again, through free_block
  EXPECT_EQ(cache.ref_count(1), 0u);  // never wraps
  EXPECT_EQ(cache.num_free_blocks(), 3u);
  EXPECT_EQ(cache.counters().ignored_double_frees, 2u);
  EXPECT_EQ(cache.counters().frees, 1u);
  EXPECT_EQ(log.find(log::Level::error, "block 1 with 0 refs").size(), 2u);

  const InvariantReport report = cache.check_invariants();
  EXPECT_TRUE(report.ok) << report.to_string();

  // Block 1 is handed out once only: the free list holds it once.
  std::multiset<BlockId> handed_out{0};
  while (auto b = cache.try_alloc_block())
    handed_out.insert(*b);
  EXPECT_EQ(handed_out, (std::multiset<BlockId>{0, 1, 2, 3}));
}

TEST_F(PagedKvCacheTest, DecRefOfNeverAllocatedBlockIsIgnored) {
  PagedKvCache cache = make(4);
  test::LogRecorder log;
  EXPECT_FALSE(cache.dec_ref(2));
  EXPECT_EQ(cache.num_free_blocks(), 4u);
  EXPECT_EQ(cache.counters().ignored_double_frees, 1u);
  EXPECT_EQ(log.find(log::Level::error, "block 2 with 0 refs").size(), 1u);
  EXPECT_TRUE(cache.check_invariants().ok);
  // The free list order is untouched: 0, 1, 2, 3.
  for (BlockId expected = 0; expected < 4; ++expected)
    EXPECT_EQ(cache.alloc_block(), expected);
}

TEST_F(PagedKvCacheTest, DoubleFreeLogWithoutTraceSaysHowToEnableIt) {
  PagedKvCache cache = make(2);
  test::LogRecorder log;
  cache.dec_ref(0);
  const auto messages = log.find(log::Level::error, "block 0 with 0 refs");
  ASSERT_EQ(messages.size(), 1u);
  EXPECT_NE(messages[0].find("KVPORT_KV_TRACE=1"), std::string::npos) << messages[0];
}

TEST_F(PagedKvCacheTest, IncRefOnFreeBlockThrows) {
  PagedKvCache cache = make(4);
  expect_invalid_argument([&] { cache.inc_ref(2); }, "free");
  EXPECT_EQ(cache.ref_count(2), 0u);

  const BlockId b = cache.alloc_block();  // 0
  cache.free_block(b);
  expect_invalid_argument([&] { cache.inc_ref(b); }, "free");
  EXPECT_EQ(cache.ref_count(b), 0u);
  EXPECT_EQ(cache.num_free_blocks(), 4u);
  EXPECT_TRUE(cache.check_invariants().ok);
  EXPECT_EQ(cache.alloc_block(), b);  // still on the free list, still on top
}

TEST_F(PagedKvCacheTest, ReturnEvictedBlockDropsTheCachesReference) {
  PagedKvCache cache = make(4);
  const BlockId b = cache.alloc_block();
  cache.inc_ref(b);                // the prefix cache takes a reference
  EXPECT_FALSE(cache.dec_ref(b));  // the sequence finishes
  EXPECT_EQ(cache.ref_count(b), 1u);
  EXPECT_EQ(cache.num_free_blocks(), 3u);

  cache.return_evicted_block(b);  // the prefix cache evicts it
  EXPECT_EQ(cache.ref_count(b), 0u);
  EXPECT_EQ(cache.num_free_blocks(), 4u);
  EXPECT_EQ(cache.counters().frees, 1u);
  EXPECT_TRUE(cache.check_invariants().ok);
  EXPECT_EQ(cache.alloc_block(), b);
}

TEST_F(PagedKvCacheTest, ReturnEvictedBlockWithSharersKeepsItInUse) {
  PagedKvCache cache = make(4);
  const BlockId b = cache.alloc_block();
  cache.inc_ref(b);
  cache.inc_ref(b);
  cache.return_evicted_block(b);
  EXPECT_EQ(cache.ref_count(b), 2u);
  EXPECT_EQ(cache.num_free_blocks(), 3u);
}

TEST_F(PagedKvCacheTest, ReturnEvictedBlockAtZeroWarnsAndIsIgnored) {
  PagedKvCache cache = make(4);
  const BlockId b = cache.alloc_block();
  cache.free_block(b);
  test::LogRecorder log;
  cache.return_evicted_block(b);
  EXPECT_EQ(cache.ref_count(b), 0u);
  EXPECT_EQ(cache.num_free_blocks(), 4u);
  EXPECT_EQ(cache.counters().ignored_double_frees, 1u);
  EXPECT_EQ(cache.counters().frees, 1u);
  const auto warnings = log.find(log::Level::warn, "return_evicted_block");
  ASSERT_EQ(warnings.size(), 1u);
  EXPECT_NE(warnings[0].find("block 0"), std::string::npos) << warnings[0];
  EXPECT_TRUE(log.find(log::Level::error, "").empty());
  EXPECT_TRUE(cache.check_invariants().ok);
  std::set<BlockId> handed_out;
  while (auto id = cache.try_alloc_block()) {
    EXPECT_TRUE(handed_out.insert(*id).second) << "block " << *id << " handed out twice";
  }
  EXPECT_EQ(handed_out.size(), 4u);
}

TEST_F(PagedKvCacheTest, FreeBlocksReleasesEveryIdInOrder) {
  PagedKvCache cache = make(8);
  for (int i = 0; i < 4; ++i)
    cache.alloc_block();  // 0..3
  const std::vector<BlockId> table = {2, 0, 3};
  cache.free_blocks(table);
  EXPECT_EQ(cache.num_free_blocks(), 7u);
  EXPECT_EQ(cache.ref_count(1), 1u);
  // Pushed 2, 0, 3 in order: LIFO pops 3, 0, 2.
  EXPECT_EQ(cache.alloc_block(), 3u);
  EXPECT_EQ(cache.alloc_block(), 0u);
  EXPECT_EQ(cache.alloc_block(), 2u);
  EXPECT_EQ(cache.counters().frees, 3u);
}

TEST_F(PagedKvCacheTest, FreeBlocksValidatesEveryIdFirst) {
  PagedKvCache cache = make(8);
  for (int i = 0; i < 3; ++i)
    cache.alloc_block();
  const std::vector<BlockId> table = {0, 1, 8, 2};
  expect_invalid_argument([&] { cache.free_blocks(table); }, "out of range");
  EXPECT_EQ(cache.ref_count(0), 1u);
  EXPECT_EQ(cache.ref_count(1), 1u);
  EXPECT_EQ(cache.ref_count(2), 1u);
  EXPECT_EQ(cache.num_free_blocks(), 5u);
  EXPECT_EQ(cache.counters().frees, 0u);
  EXPECT_TRUE(cache.check_invariants().ok);
}

TEST_F(PagedKvCacheTest, FreeBlocksWithASharedBlockListedTwice) {
  PagedKvCache cache = make(4);
  const BlockId b = cache.alloc_block();
  cache.inc_ref(b);
  const std::vector<BlockId> table = {b, b};
  cache.free_blocks(table);
  EXPECT_EQ(cache.ref_count(b), 0u);
  EXPECT_EQ(cache.num_free_blocks(), 4u);
  EXPECT_EQ(cache.counters().ignored_double_frees, 0u);
  EXPECT_TRUE(cache.check_invariants().ok);
}

TEST_F(PagedKvCacheTest, FreeBlocksEmptyTableIsANoOp) {
  PagedKvCache cache = make(4);
  cache.alloc_block();
  cache.free_blocks({});
  EXPECT_EQ(cache.num_free_blocks(), 3u);
}

TEST_F(PagedKvCacheTest, OutOfRangeIdsThrowForEveryAccessor) {
  PagedKvCache cache = make(4);  // 3 layers
  for (int i = 0; i < 4; ++i)
    cache.alloc_block();
  const std::uint64_t fills_before = backend_->call_counts().device_ops();
  std::vector<std::uint8_t> k(cache.k_block_bytes(0)), v(cache.v_block_bytes(0));
  const BlockId bad_blocks[] = {4, 5, std::numeric_limits<BlockId>::max()};
  const std::size_t bad_layers[] = {3, std::numeric_limits<std::size_t>::max()};
  const StreamView s = stream_;

  for (BlockId bad : bad_blocks) {
    SCOPED_TRACE(::testing::Message() << "block " << bad);
    const std::vector<BlockId> batch = {0, bad};
    const std::pair<const char*, std::function<void()>> calls[] = {
        {"ref_count", [&] { (void)cache.ref_count(bad); }},
        {"inc_ref", [&] { cache.inc_ref(bad); }},
        {"dec_ref", [&] { cache.dec_ref(bad); }},
        {"free_block", [&] { cache.free_block(bad); }},
        {"free_blocks", [&] { cache.free_blocks(batch); }},
        {"return_evicted_block", [&] { cache.return_evicted_block(bad); }},
        {"k_cache_ptr", [&] { (void)cache.k_cache_ptr(0, bad); }},
        {"v_cache_ptr", [&] { (void)cache.v_cache_ptr(0, bad); }},
        {"zero_block", [&] { cache.zero_block(bad, s); }},
        {"poison_block", [&] { cache.poison_block(bad, s); }},
        {"zero_blocks", [&] { cache.zero_blocks(batch, s); }},
        {"poison_blocks", [&] { cache.poison_blocks(batch, s); }},
        {"read_block", [&] { (void)cache.read_block(0, bad, s); }},
        {"write_block", [&] { cache.write_block(0, bad, k, v, s); }},
    };
    for (const auto& [name, call] : calls) {
      SCOPED_TRACE(name);
      expect_invalid_argument(call, "out of range");
      expect_invalid_argument(call, name);  // the message names the operation
    }
  }
  for (std::size_t bad : bad_layers) {
    SCOPED_TRACE(::testing::Message() << "layer " << bad);
    const std::pair<const char*, std::function<void()>> calls[] = {
        {"k_cache_ptr", [&] { (void)cache.k_cache_ptr(bad, 0); }},
        {"v_cache_ptr", [&] { (void)cache.v_cache_ptr(bad, 0); }},
        {"pool", [&] { (void)cache.pool(bad, KvPart::k); }},
        {"pool", [&] { (void)cache.pool(bad, KvPart::v); }},
        {"k_pool_ptr", [&] { (void)cache.k_pool_ptr(bad); }},
        {"v_pool_ptr", [&] { (void)cache.v_pool_ptr(bad); }},
        {"k_block_stride", [&] { (void)cache.k_block_stride(bad); }},
        {"v_block_stride", [&] { (void)cache.v_block_stride(bad); }},
        {"k_block_bytes", [&] { (void)cache.k_block_bytes(bad); }},
        {"v_block_bytes", [&] { (void)cache.v_block_bytes(bad); }},
        {"dtype_for_layer", [&] { (void)cache.dtype_for_layer(bad); }},
        {"read_block", [&] { (void)cache.read_block(bad, 0, s); }},
        {"write_block", [&] { cache.write_block(bad, 0, k, v, s); }},
    };
    for (const auto& [name, call] : calls) {
      SCOPED_TRACE(name);
      expect_invalid_argument(call, "out of range");
      expect_invalid_argument(call, name);
    }
  }
  // Nothing reached the device and no refcount moved.
  EXPECT_EQ(backend_->call_counts().device_ops(), fills_before);
  for (BlockId b = 0; b < 4; ++b)
    EXPECT_EQ(cache.ref_count(b), 1u);
  EXPECT_EQ(cache.num_free_blocks(), 0u);
  EXPECT_EQ(cache.counters().ignored_double_frees, 0u);
}

TEST_F(PagedKvCacheTest, CheckInvariantsOnAHealthyCache) {
  PagedKvCache cache = make(8);
  InvariantReport report = cache.check_invariants();
  EXPECT_TRUE(report.ok);
  EXPECT_EQ(report.blocks_checked, 8u);
  EXPECT_EQ(report.free_blocks, 8u);
  EXPECT_EQ(report.blocks_in_use, 0u);
  EXPECT_TRUE(report.violations.empty());
  EXPECT_EQ(report.to_string(), "ok: 8 blocks, 8 free, 0 in use");

  cache.alloc_block();
  cache.alloc_block();
  cache.inc_ref(1);
  report = cache.check_invariants();
  EXPECT_TRUE(report.ok);
  EXPECT_EQ(report.free_blocks, 6u);
  EXPECT_EQ(report.blocks_in_use, 2u);
  EXPECT_EQ(report.to_string(), "ok: 8 blocks, 6 free, 2 in use");
}

TEST(InvariantReport, ToStringListsViolations) {
  InvariantReport report;
  report.ok = false;
  report.blocks_checked = 4;
  report.violations = {"block 1 is on the free list 2 times", "block 3 leaked"};
  const std::string text = report.to_string();
  EXPECT_NE(text.find("FAILED"), std::string::npos) << text;
  EXPECT_NE(text.find("block 1 is on the free list 2 times"), std::string::npos) << text;
  EXPECT_NE(text.find("block 3 leaked"), std::string::npos) << text;
}

TEST_F(PagedKvCacheTest, Counters) {
  PagedKvCache cache = make(4);
  EXPECT_EQ(cache.counters().allocs, 0u);
  EXPECT_EQ(cache.counters().peak_blocks_in_use, 0u);
  const BlockId a = cache.alloc_block();
  const BlockId b = *cache.try_alloc_block();
  const BlockId c = cache.alloc_block();
  EXPECT_EQ(cache.counters().peak_blocks_in_use, 3u);
  cache.inc_ref(a);
  cache.dec_ref(a);  // not a free: still referenced
  EXPECT_EQ(cache.counters().frees, 0u);
  cache.free_block(b);
  cache.free_block(c);
  EXPECT_EQ(cache.counters().frees, 2u);
  EXPECT_EQ(cache.counters().peak_blocks_in_use, 3u);  // a peak, not the current value
  cache.alloc_block();
  EXPECT_EQ(cache.counters().peak_blocks_in_use, 3u);
  cache.alloc_block();
  cache.alloc_block();
  EXPECT_EQ(cache.counters().peak_blocks_in_use, 4u);
  EXPECT_EQ(cache.try_alloc_block(), std::nullopt);
  EXPECT_EQ(cache.counters().allocs, 6u);
  EXPECT_EQ(cache.counters().exhaustion_events, 1u);
  EXPECT_EQ(cache.counters().ignored_double_frees, 0u);
}

// ---- construction and destruction --------------------------------------------------------

TEST_F(PagedKvCacheTest, ZeroBlocksThrowsBeforeAllocating) {
  expect_invalid_argument([&] { make(0); }, "num_blocks");
  EXPECT_EQ(backend_->call_counts().alloc, 0u);
}

TEST_F(PagedKvCacheTest, MoreBlocksThan32BitIdsThrowsBeforeAllocating) {
  expect_invalid_argument([&] { make(std::size_t{1} << 32); }, "num_blocks");
  EXPECT_EQ(backend_->call_counts().alloc, 0u);
}

TEST_F(PagedKvCacheTest, InvalidConfigThrowsBeforeAllocating) {
  KvCacheConfig config = test::small_config();
  config.num_kv_heads = 0;
  expect_invalid_argument([&] { make(4, config); }, "num_kv_heads");
  config = test::small_config();
  config.layer_dtypes = {KvCacheDtype::bf16};
  expect_invalid_argument([&] { make(4, config); }, "layer_dtypes");
  EXPECT_EQ(backend_->call_counts().alloc, 0u);
}

TEST_F(PagedKvCacheTest, TotalSizeOverflowThrowsBeforeAllocating) {
  // 2^34-byte K and V regions: 2^35 bytes per block; 2^32 - 1 blocks overflow size_t.
  KvCacheConfig config;
  config.num_layers = 1;
  config.block_size = std::size_t{1} << 20;
  config.num_kv_heads = 64;
  config.head_dim_k = 128;
  config.head_dim_v = 128;
  config.dtype = KvCacheDtype::f16;
  ASSERT_EQ(config.bytes_per_block(), std::size_t{1} << 35);
  expect_invalid_argument([&] { make(std::numeric_limits<BlockId>::max(), config); }, "overflow");
  EXPECT_EQ(backend_->call_counts().alloc, 0u);
}

TEST(PagedKvCacheConstruction, AllocatesOnePoolPerLayerAndKvInLayerMajor) {
  auto backend = test::host_backend();
  {
    PagedKvCache cache(test::small_config(), 16, *backend, no_trace());
    EXPECT_EQ(backend->call_counts().alloc, 6u);  // 3 layers x K, V
    // 16 blocks x 128 bytes = 2048 bytes per pool (a multiple of 256).
    EXPECT_EQ(backend->mem_info().total_bytes - backend->mem_info().free_bytes, 6u * 2048);
    EXPECT_EQ(cache.total_bytes(), 16u * 3 * 2 * 128);
  }
  EXPECT_EQ(backend->call_counts().free, 6u);
  EXPECT_EQ(backend->mem_info().free_bytes, backend->mem_info().total_bytes);
}

TEST(PagedKvCacheConstruction, AllocatesOneRegionInBlockMajor) {
  auto backend = test::host_backend();
  {
    PagedKvCache cache(test::mixed_config(KvCacheLayout::block_major), 16, *backend, no_trace());
    EXPECT_EQ(backend->call_counts().alloc, 1u);
    EXPECT_EQ(cache.total_bytes(), 16u * test::kMixedBytesPerBlock);
  }
  EXPECT_EQ(backend->call_counts().free, 1u);
  EXPECT_EQ(backend->mem_info().free_bytes, backend->mem_info().total_bytes);
}

TEST(PagedKvCacheConstruction, FailureMidwayFreesEveryPool) {
  // small_config, 16 blocks: every pool is 2048 bytes (a multiple of the 256-byte
  // allocation granule), allocated K0, V0, K1, V1, K2, V2. A capacity of
  // n * 2048 + 1024 bytes fits exactly n pools.
  for (std::size_t fits = 0; fits < 6; ++fits) {
    SCOPED_TRACE(::testing::Message() << fits << " pools fit");
    const std::size_t capacity = fits * 2048 + 1024;
    auto backend = test::host_backend(capacity);
    EXPECT_THROW(PagedKvCache(test::small_config(), 16, *backend, no_trace()), OutOfMemory);
    EXPECT_EQ(backend->mem_info().free_bytes, capacity);
    EXPECT_EQ(backend->call_counts().free, fits);
    EXPECT_EQ(backend->call_counts().alloc, fits + 1);  // the last one failed
  }
  // With room for all six it succeeds.
  auto backend = test::host_backend(6 * 2048);
  EXPECT_NO_THROW(PagedKvCache(test::small_config(), 16, *backend, no_trace()));
  EXPECT_EQ(backend->mem_info().free_bytes, 6u * 2048);
}

TEST(PagedKvCacheConstruction, FailureInBlockMajorLeavesNothingAllocated) {
  auto backend = test::host_backend(4096);
  EXPECT_THROW(
      PagedKvCache(test::small_config(KvCacheLayout::block_major), 16, *backend, no_trace()),
      OutOfMemory);
  EXPECT_EQ(backend->mem_info().free_bytes, 4096u);
}

TEST(PagedKvCacheConstruction, MoveConstructorTransfersOwnership) {
  auto backend = test::host_backend();
  const std::size_t capacity = backend->mem_info().total_bytes;
  test::LogRecorder log;
  std::optional<PagedKvCache> a;
  a.emplace(test::small_config(), 8, *backend, no_trace());
  Stream stream = backend->create_stream();
  const BlockId b0 = a->alloc_block();
  const BlockId b1 = a->alloc_block();
  a->inc_ref(b1);
  a->dec_ref(b0);
  a->alloc_block();  // b0 again
  const DevicePtr k_ptr = a->k_cache_ptr(2, 5);
  const DevicePtr v_pool = a->v_pool_ptr(1);
  const auto k_pattern = test::pattern(a->k_block_bytes(2), 5, 2, false);
  const auto v_pattern = test::pattern(a->v_block_bytes(2), 5, 2, true);
  a->write_block(2, 5, k_pattern, v_pattern, stream);

  std::optional<PagedKvCache> b;
  b.emplace(std::move(*a));
  EXPECT_EQ(a->num_blocks(), 0u);
  EXPECT_EQ(a->num_free_blocks(), 0u);
  a.reset();  // destroying the moved-from cache frees nothing
  EXPECT_EQ(backend->call_counts().free, 0u);

  EXPECT_EQ(b->num_blocks(), 8u);
  EXPECT_EQ(b->num_free_blocks(), 6u);
  EXPECT_EQ(b->ref_count(b0), 1u);
  EXPECT_EQ(b->ref_count(b1), 2u);
  EXPECT_EQ(b->counters().allocs, 3u);
  EXPECT_EQ(b->k_cache_ptr(2, 5), k_ptr);
  EXPECT_EQ(b->v_pool_ptr(1), v_pool);
  EXPECT_TRUE(b->check_invariants().ok);
  const auto back = b->read_block(2, 5, stream);
  EXPECT_EQ(back.k, k_pattern);
  EXPECT_EQ(back.v, v_pattern);
  EXPECT_EQ(b->alloc_block(), 2u);

  b.reset();
  EXPECT_EQ(backend->call_counts().free, 6u);
  EXPECT_EQ(backend->mem_info().free_bytes, capacity);
  EXPECT_TRUE(log.find(log::Level::error, "").empty()) << "e.g. a rejected double free";
}

TEST(PagedKvCacheConstruction, ConfigAndShapeAccessors) {
  auto backend = test::host_backend();
  PagedKvCache cache(test::mixed_config(), 4, *backend, no_trace());
  EXPECT_EQ(cache.num_layers(), 3u);
  EXPECT_EQ(cache.config().head_dim_k, 32u);
  EXPECT_EQ(cache.config().layer_dtypes.size(), 3u);
  EXPECT_EQ(&cache.backend(), backend.get());
  EXPECT_EQ(cache.dtype_for_layer(0), KvCacheDtype::bf16);
  EXPECT_EQ(cache.dtype_for_layer(1), KvCacheDtype::turbo3);
  EXPECT_EQ(cache.dtype_for_layer(2), KvCacheDtype::fp8_e4m3);
}

// ---- work still queued at destruction, synchronize() ------------------------------------------

TEST(PagedKvCacheQueuedWork, TheDestructorWaitsForAFillStillQueuedBeforeFreeingThePools) {
  std::unique_ptr<Backend> backend = test::host_backend();
  Stream stream = backend->create_stream();
  const std::size_t busy_bytes = 128 * kMiB;
  const DevicePtr busy = backend->alloc(busy_bytes);
  {
    PagedKvCache cache(test::llama3_8b_config(), 16, *backend);  // 32 MiB of pools
    std::vector<BlockId> all(16);
    std::iota(all.begin(), all.end(), 0u);
    backend->memset_async(busy, 1, busy_bytes, stream);  // keeps the stream busy
    cache.zero_blocks(all, stream);                      // so the fill is still queued
    cache.poison_blocks(all, stream);
    ASSERT_EQ(cache.queued_streams().size(), 1u);
    backend->reset_call_counts();
  }  // no synchronize
  EXPECT_EQ(backend->call_counts().synchronize, 1u) << "the destructor waited for the stream";
  // Had the pools gone first, the host backend would report the fill's use
  // after free here.
  EXPECT_NO_THROW(stream.synchronize());
  EXPECT_TRUE(backend->free(busy));
}

TEST(PagedKvCacheQueuedWork, SynchronizeWaitsForEveryStreamUsedOnceAndForgetsThem) {
  std::unique_ptr<Backend> backend = test::host_backend();
  Stream a = backend->create_stream();
  Stream b = backend->create_stream();
  PagedKvCache cache(test::small_config(), 8, *backend);
  EXPECT_TRUE(cache.queued_streams().empty());
  cache.zero_block(0, a);
  cache.poison_block(1, b);
  cache.zero_blocks(std::vector<BlockId>{2, 3}, a);
  const BlockCopy copy{1, 4};  // block 1 was written on b too: ordered
  cache.copy_blocks({&copy, 1}, b);
  cache.zero_blocks({}, backend->default_stream());  // queues nothing
  ASSERT_EQ(cache.queued_streams().size(), 2u) << "each stream once, in first-use order";
  EXPECT_TRUE(cache.queued_streams()[0] == a.view());
  EXPECT_TRUE(cache.queued_streams()[1] == b.view());
  backend->reset_call_counts();
  cache.synchronize();
  EXPECT_EQ(backend->call_counts().synchronize, 2u);
  EXPECT_TRUE(cache.queued_streams().empty());
  cache.synchronize();
  EXPECT_EQ(backend->call_counts().synchronize, 2u) << "nothing was queued since";
  // read_block and write_block wait for their own copies.
  (void)cache.read_block(0, 4, a);
  cache.write_block(0, 4, std::vector<std::uint8_t>(cache.k_block_bytes(0)),
                    std::vector<std::uint8_t>(cache.v_block_bytes(0)), b);
  EXPECT_TRUE(cache.queued_streams().empty());
}

TEST(PagedKvCacheQueuedWork, AStreamDestroyedSinceIsSkipped) {
  std::unique_ptr<Backend> backend = test::host_backend();
  PagedKvCache cache(test::small_config(), 8, *backend);
  {
    Stream s = backend->create_stream();
    cache.zero_block(0, s);
  }  // Stream's destructor waited for the fill
  ASSERT_EQ(cache.queued_streams().size(), 1u);
  EXPECT_NO_THROW(cache.synchronize());
  EXPECT_TRUE(cache.queued_streams().empty());
  Stream s = backend->create_stream();
  {
    PagedKvCache other(test::small_config(), 8, *backend);
    {
      Stream gone = backend->create_stream();
      other.poison_block(1, gone);
    }
    other.zero_block(1, s);
  }  // the destructor skips the destroyed stream and waits for s
  EXPECT_NO_THROW(s.synchronize());
}

TEST(PagedKvCacheQueuedWork, ACallTheBackendRejectsRemembersNoStream) {
  std::unique_ptr<Backend> backend = test::host_backend();
  PagedKvCache cache(test::small_config(), 8, *backend);
  {
    std::unique_ptr<Backend> other = test::host_backend();
    Stream foreign = other->create_stream();
    EXPECT_THROW(cache.zero_block(0, foreign), InvalidArgument);
    const BlockCopy copy{0, 1};
    EXPECT_THROW(cache.copy_blocks({&copy, 1}, foreign), InvalidArgument);
  }  // the foreign backend is gone: the destructor must not touch its stream
  EXPECT_TRUE(cache.queued_streams().empty());
}

TEST(PagedKvCacheQueuedWork, AMoveCarriesTheQueuedStreams) {
  std::unique_ptr<Backend> backend = test::host_backend();
  Stream s = backend->create_stream();
  PagedKvCache cache(test::small_config(), 8, *backend);
  cache.zero_block(0, s);
  PagedKvCache moved(std::move(cache));
  EXPECT_EQ(moved.queued_streams().size(), 1u);
  EXPECT_TRUE(cache.queued_streams().empty());  // NOLINT(bugprone-use-after-move): documented
  backend->reset_call_counts();
  moved.synchronize();
  EXPECT_EQ(backend->call_counts().synchronize, 1u);
}

// ---- compute_num_blocks ---------------------------------------------------------------------

TEST(ComputeNumBlocks, DividesTheBudgetByBytesPerBlock) {
  // llama-3-8b bf16: 2 MiB per block.
  const KvCacheConfig llama = test::llama3_8b_config();
  EXPECT_EQ(PagedKvCache::compute_num_blocks(llama, std::size_t{80} << 30), 40960u);
  EXPECT_EQ(PagedKvCache::compute_num_blocks(llama, 2 * kMiB), 1u);
  EXPECT_EQ(PagedKvCache::compute_num_blocks(llama, 2 * kMiB - 1), 0u);
  EXPECT_EQ(PagedKvCache::compute_num_blocks(llama, 0), 0u);
  EXPECT_EQ(
      PagedKvCache::compute_num_blocks(test::mixed_config(), 10 * test::kMixedBytesPerBlock + 1327),
      10u);
  // Block-major: one pool of 3 * 1328 = 3984 bytes, which rounds up to 4096.
  EXPECT_EQ(PagedKvCache::compute_num_blocks(test::mixed_config(KvCacheLayout::block_major),
                                             3 * test::kMixedBytesPerBlock),
            2u);
  EXPECT_EQ(PagedKvCache::compute_num_blocks(test::mixed_config(KvCacheLayout::block_major), 4096),
            3u);
}

TEST(ComputeNumBlocks, TheWorkedExampleInDocsFormatsMd) {
  // docs/formats.md, "Per block, all layers": every pool is rounded up to
  // 256 bytes, so 10 x bytes_per_block is not enough for 10 blocks.
  const KvCacheConfig layer_major = test::mixed_config();
  const KvCacheConfig block_major = test::mixed_config(KvCacheLayout::block_major);
  EXPECT_EQ(layer_major.bytes_per_block(), 1328u);
  EXPECT_EQ(PagedKvCache::compute_num_blocks(layer_major, 13280), 9u);
  EXPECT_EQ(PagedKvCache::compute_num_blocks(layer_major, 13567), 9u);
  EXPECT_EQ(PagedKvCache::compute_num_blocks(layer_major, 13568), 10u);
  EXPECT_EQ(PagedKvCache::compute_num_blocks(block_major, 13280), 9u);
  EXPECT_EQ(PagedKvCache::compute_num_blocks(block_major, 13311), 9u);
  EXPECT_EQ(PagedKvCache::compute_num_blocks(block_major, 13312), 10u);
  // And the allocator agrees: 10 layer-major blocks take exactly 13 568 bytes.
  std::unique_ptr<Backend> exact = test::host_backend(13568);
  EXPECT_NO_THROW(PagedKvCache(layer_major, 10, *exact));
  std::unique_ptr<Backend> short_by_one = test::host_backend(13567);
  EXPECT_THROW(PagedKvCache(layer_major, 10, *short_by_one), OutOfMemory);
  EXPECT_NO_THROW(PagedKvCache(layer_major, 9, *short_by_one));
}

TEST(ComputeNumBlocks, InvalidConfigThrows) {
  KvCacheConfig config = test::llama3_8b_config();
  config.head_dim_k = 0;
  expect_invalid_argument([&] { (void)PagedKvCache::compute_num_blocks(config, kMiB); },
                          "head_dim_k");
  expect_invalid_argument([] { (void)PagedKvCache::compute_num_blocks(KvCacheConfig{}, kMiB); },
                          "num_layers");
}

TEST(ComputeNumBlocks, TheComputedCountFitsWhenPoolsAreGranuleSized) {
  // small_config: 768 bytes per block; 64 blocks -> 8192-byte pools (multiples of 256).
  const std::size_t budget = 64 * 768;
  const std::size_t n = PagedKvCache::compute_num_blocks(test::small_config(), budget);
  ASSERT_EQ(n, 64u);
  auto backend = test::host_backend(budget);
  EXPECT_NO_THROW(PagedKvCache(test::small_config(), n, *backend, no_trace()));
}

TEST(ComputeNumBlocks, CountsThePoolRoundingSoTheResultAlwaysFits) {
  // 1 layer, 1 token, 1 head, head_dim 8, fp8: K and V are 8 data bytes + 8
  // padding = 16 bytes each, 32 per block. 544 / 32 = 17, but two pools of
  // 17 * 16 = 272 bytes round up to 512 each (1024 > 544). 16 blocks: two
  // 256-byte pools.
  KvCacheConfig config;
  config.num_layers = 1;
  config.block_size = 1;
  config.num_kv_heads = 1;
  config.head_dim_k = config.head_dim_v = 8;
  config.dtype = KvCacheDtype::fp8_e4m3;
  const std::size_t budget = 544;
  const std::size_t n = PagedKvCache::compute_num_blocks(config, budget);
  EXPECT_EQ(n, 16u);
  auto backend = test::host_backend(budget);
  EXPECT_NO_THROW(PagedKvCache(config, n, *backend, no_trace()));
  EXPECT_THROW(PagedKvCache(config, n + 1, *backend, no_trace()), OutOfMemory);
  // Block-major: one pool of n * 32 bytes, rounded once.
  config.layout = KvCacheLayout::block_major;
  EXPECT_EQ(PagedKvCache::compute_num_blocks(config, budget), 16u);  // 17 * 32 = 544 -> 768
  EXPECT_EQ(PagedKvCache::compute_num_blocks(config, 768), 24u);
}

TEST(ComputeNumBlocks, CapsAtTheBlockIdRange) {
  KvCacheConfig config = test::small_config();
  const std::size_t huge = std::size_t{1} << 60;
  EXPECT_EQ(PagedKvCache::compute_num_blocks(config, huge), std::numeric_limits<BlockId>::max());
}

// ---- pointers and strides ----------------------------------------------------------------------

struct LayoutParam {
  const char* name;
  KvCacheConfig config;
  std::vector<std::size_t> k_bytes;  // per layer, by hand
  std::vector<std::size_t> v_bytes;
  std::size_t bytes_per_block;
  bool adopted = false;  // the pools are the engine's (the adopting constructor)
};

void PrintTo(const LayoutParam& p, std::ostream* os) {
  *os << p.name << (p.adopted ? "Adopted" : "");
}

// Every layout twice: over pools the backend allocated, and over the
// engine's memory. The same operations must give the same bytes.
std::vector<LayoutParam> owned_and_adopted(std::vector<LayoutParam> params) {
  const std::size_t n = params.size();
  for (std::size_t i = 0; i < n; ++i) {
    LayoutParam adopted = params[i];
    adopted.adopted = true;
    params.push_back(std::move(adopted));
  }
  return params;
}

std::vector<LayoutParam> layout_params(std::optional<KvCacheLayout> only = std::nullopt) {
  std::vector<LayoutParam> all = {
      {"SmallLayerMajor",
       test::small_config(KvCacheLayout::layer_major),
       {128, 128, 128},
       {128, 128, 128},
       768},
      {"SmallBlockMajor",
       test::small_config(KvCacheLayout::block_major),
       {128, 128, 128},
       {128, 128, 128},
       768},
      {"MixedLayerMajor",
       test::mixed_config(KvCacheLayout::layer_major),
       {std::begin(test::kMixedK), std::end(test::kMixedK)},
       {std::begin(test::kMixedV), std::end(test::kMixedV)},
       test::kMixedBytesPerBlock},
      {"MixedBlockMajor",
       test::mixed_config(KvCacheLayout::block_major),
       {std::begin(test::kMixedK), std::end(test::kMixedK)},
       {std::begin(test::kMixedV), std::end(test::kMixedV)},
       test::kMixedBytesPerBlock},
  };
  if (only) std::erase_if(all, [&](const LayoutParam& p) { return p.config.layout != *only; });
  return all;
}

class PagedKvCacheLayoutTest : public ::testing::TestWithParam<LayoutParam> {
 protected:
  static constexpr std::size_t kBlocks = 8;

  PagedKvCacheLayoutTest()
      : cache_(test::make_cache(GetParam().config, kBlocks, *backend_,
                                GetParam().adopted ? &engine_ : nullptr, no_trace())) {}

  bool block_major() const { return GetParam().config.layout == KvCacheLayout::block_major; }

  /// Writes a distinct pattern into every layer's K and V of every block.
  void write_patterns() {
    for (BlockId b = 0; b < kBlocks; ++b) {
      for (std::size_t l = 0; l < cache_.num_layers(); ++l) {
        cache_.write_block(l, b, test::pattern(cache_.k_block_bytes(l), b, l, false),
                           test::pattern(cache_.v_block_bytes(l), b, l, true), stream_);
      }
    }
  }

  /// Every block in `filled` reads back as `value` on every layer, K and V;
  /// every other block still holds its pattern.
  void expect_contents(const std::set<BlockId>& filled, std::uint8_t value) {
    for (BlockId b = 0; b < kBlocks; ++b) {
      for (std::size_t l = 0; l < cache_.num_layers(); ++l) {
        SCOPED_TRACE(::testing::Message() << "block " << b << " layer " << l);
        const PagedKvCache::HostBlock got = cache_.read_block(l, b, stream_);
        ASSERT_EQ(got.k.size(), GetParam().k_bytes[l]);
        ASSERT_EQ(got.v.size(), GetParam().v_bytes[l]);
        if (filled.count(b) != 0) {
          EXPECT_EQ(got.k, std::vector<std::uint8_t>(got.k.size(), value));
          EXPECT_EQ(got.v, std::vector<std::uint8_t>(got.v.size(), value));
        } else {
          EXPECT_EQ(got.k, test::pattern(got.k.size(), b, l, false));
          EXPECT_EQ(got.v, test::pattern(got.v.size(), b, l, true));
        }
      }
    }
  }

  std::unique_ptr<Backend> backend_ = test::host_backend();
  Stream stream_ = backend_->create_stream();
  test::EngineMemory engine_;  // the pools, when adopted; outlives cache_
  PagedKvCache cache_;
};

TEST_P(PagedKvCacheLayoutTest, RegionSizesMatchTheConfig) {
  const LayoutParam& p = GetParam();
  ASSERT_EQ(cache_.num_layers(), p.k_bytes.size());
  for (std::size_t l = 0; l < cache_.num_layers(); ++l) {
    EXPECT_EQ(cache_.k_block_bytes(l), p.k_bytes[l]) << l;
    EXPECT_EQ(cache_.v_block_bytes(l), p.v_bytes[l]) << l;
  }
  EXPECT_EQ(cache_.total_bytes(), kBlocks * p.bytes_per_block);
}

TEST_P(PagedKvCacheLayoutTest, BlockPointersAreBasePlusIndexTimesStride) {
  for (std::size_t l = 0; l < cache_.num_layers(); ++l) {
    const std::size_t k_stride = cache_.k_block_stride(l);
    const std::size_t v_stride = cache_.v_block_stride(l);
    if (block_major()) {
      EXPECT_EQ(k_stride, GetParam().bytes_per_block);
      EXPECT_EQ(v_stride, GetParam().bytes_per_block);
    } else {
      EXPECT_EQ(k_stride, cache_.k_block_bytes(l));
      EXPECT_EQ(v_stride, cache_.v_block_bytes(l));
    }
    for (BlockId b = 0; b < kBlocks; ++b) {
      EXPECT_EQ(cache_.k_cache_ptr(l, b), cache_.k_pool_ptr(l).offset(b * k_stride));
      EXPECT_EQ(cache_.v_cache_ptr(l, b), cache_.v_pool_ptr(l).offset(b * v_stride));
    }
  }
}

// pool() is the geometry the pointer calls forward to; memory_pools() lays a
// block's bytes out pool after pool (layer 0 K, layer 0 V, ... or one whole
// block in block-major layout).
TEST_P(PagedKvCacheLayoutTest, PoolsAreTheGeometryThePointerCallsReport) {
  for (std::size_t l = 0; l < cache_.num_layers(); ++l) {
    SCOPED_TRACE(l);
    const BlockPool& k = cache_.pool(l, KvPart::k);
    const BlockPool& v = cache_.pool(l, KvPart::v);
    EXPECT_EQ(k.base, cache_.k_pool_ptr(l));
    EXPECT_EQ(v.base, cache_.v_pool_ptr(l));
    EXPECT_EQ(k.stride, cache_.k_block_stride(l));
    EXPECT_EQ(v.stride, cache_.v_block_stride(l));
    EXPECT_EQ(k.region_bytes, GetParam().k_bytes[l]);
    EXPECT_EQ(v.region_bytes, GetParam().v_bytes[l]);
    EXPECT_EQ(k.num_blocks, kBlocks);
    EXPECT_EQ(k.dtype, cache_.dtype_for_layer(l));
    EXPECT_EQ(v.dtype, cache_.dtype_for_layer(l));
    for (BlockId b = 0; b < kBlocks; ++b) {
      EXPECT_EQ(k.region(b), (DeviceRegion{cache_.k_cache_ptr(l, b), cache_.k_block_bytes(l)}));
      EXPECT_EQ(v.region(b), (DeviceRegion{cache_.v_cache_ptr(l, b), cache_.v_block_bytes(l)}));
    }
    EXPECT_EQ(k.extent(), (kBlocks - 1) * k.stride + k.region_bytes);
    expect_invalid_argument([&] { (void)k.region(kBlocks); }, "out of range");
  }
  expect_invalid_argument([&] { (void)cache_.pool(cache_.num_layers(), KvPart::k); },
                          "PagedKvCache::pool: layer 3 out of range");

  const std::span<const BlockPool> memory = cache_.memory_pools();
  std::size_t image = 0;
  for (const BlockPool& p : memory) {
    EXPECT_TRUE(p.dense());
    EXPECT_EQ(p.num_blocks, kBlocks);
    image += p.region_bytes;
  }
  EXPECT_EQ(image, GetParam().bytes_per_block);
  if (block_major()) {
    ASSERT_EQ(memory.size(), 1u);
    EXPECT_EQ(memory[0].base, cache_.k_pool_ptr(0));
    EXPECT_EQ(memory[0].extent(), cache_.total_bytes());
  } else {
    ASSERT_EQ(memory.size(), 2 * cache_.num_layers());
    for (std::size_t l = 0; l < cache_.num_layers(); ++l) {
      EXPECT_EQ(memory[2 * l], cache_.pool(l, KvPart::k));
      EXPECT_EQ(memory[2 * l + 1], cache_.pool(l, KvPart::v));
    }
  }
}

TEST_P(PagedKvCacheLayoutTest, RegionsNeverOverlap) {
  struct Region {
    std::uintptr_t begin, end;
    std::string what;
  };
  std::vector<Region> regions;
  for (BlockId b = 0; b < kBlocks; ++b) {
    for (std::size_t l = 0; l < cache_.num_layers(); ++l) {
      const std::uintptr_t k = cache_.k_cache_ptr(l, b).address();
      const std::uintptr_t v = cache_.v_cache_ptr(l, b).address();
      regions.push_back({k, k + cache_.k_block_bytes(l), fmt::format("K l{} b{}", l, b)});
      regions.push_back({v, v + cache_.v_block_bytes(l), fmt::format("V l{} b{}", l, b)});
    }
  }
  std::sort(regions.begin(), regions.end(),
            [](const Region& a, const Region& b) { return a.begin < b.begin; });
  for (std::size_t i = 1; i < regions.size(); ++i) {
    EXPECT_LE(regions[i - 1].end, regions[i].begin)
        << regions[i - 1].what << " overlaps " << regions[i].what;
  }
  // Every region is 16-byte aligned (quantized kernels load 16 bytes at a time).
  for (const Region& r : regions)
    EXPECT_EQ(r.begin % kRegionAlignment, 0u) << r.what;
}

class LayerMajorLayoutTest : public PagedKvCacheLayoutTest {};
class BlockMajorLayoutTest : public PagedKvCacheLayoutTest {};

TEST_P(LayerMajorLayoutTest, PoolsAreSeparateAllocations) {
  ASSERT_FALSE(block_major());
  for (std::size_t l = 0; l < cache_.num_layers(); ++l) {
    EXPECT_EQ(cache_.k_pool_ptr(l).address() % kAllocAlignment, 0u);
    EXPECT_EQ(cache_.v_pool_ptr(l).address() % kAllocAlignment, 0u);
    // Block b of layer l: k_pool(l) + b * k_block_bytes(l).
    EXPECT_EQ(cache_.k_cache_ptr(l, 3), cache_.k_pool_ptr(l).offset(3 * GetParam().k_bytes[l]));
  }
}

TEST_P(BlockMajorLayoutTest, BlocksAreContiguous) {
  ASSERT_TRUE(block_major());
  const std::size_t per_block = GetParam().bytes_per_block;
  const DevicePtr base = cache_.k_pool_ptr(0);
  EXPECT_EQ(base.address() % kAllocAlignment, 0u);
  for (BlockId b = 0; b < kBlocks; ++b) {
    const std::uintptr_t lo = base.address() + b * per_block;
    const std::uintptr_t hi = lo + per_block;
    std::size_t covered = 0;
    for (std::size_t l = 0; l < cache_.num_layers(); ++l) {
      SCOPED_TRACE(::testing::Message() << "block " << b << " layer " << l);
      const std::uintptr_t k = cache_.k_cache_ptr(l, b).address();
      const std::uintptr_t v = cache_.v_cache_ptr(l, b).address();
      EXPECT_GE(k, lo);
      EXPECT_LE(k + cache_.k_block_bytes(l), hi);
      EXPECT_GE(v, lo);
      EXPECT_LE(v + cache_.v_block_bytes(l), hi);
      covered += cache_.k_block_bytes(l) + cache_.v_block_bytes(l);
    }
    // Together with RegionsNeverOverlap: the block's regions tile it exactly.
    EXPECT_EQ(covered, per_block);
  }
}

TEST_P(PagedKvCacheLayoutTest, WriteThenReadRoundTripsEveryRegion) {
  write_patterns();
  expect_contents({}, 0);
}

TEST_P(PagedKvCacheLayoutTest, ZeroBlocksClearsOnlyTheSelectedBlocks) {
  write_patterns();
  const std::vector<BlockId> batch = {5, 1, 2};
  const std::uint64_t fills = backend_->call_counts().fill;
  cache_.zero_blocks(batch, stream_);
  EXPECT_EQ(backend_->call_counts().fill - fills, 1u);
  expect_contents({1, 2, 5}, 0x00);
}

TEST_P(PagedKvCacheLayoutTest, PoisonBlocksSetsEveryByteToFF) {
  write_patterns();
  const std::vector<BlockId> batch = {0, 7, 3};
  const std::uint64_t fills = backend_->call_counts().fill;
  cache_.poison_blocks(batch, stream_);
  EXPECT_EQ(backend_->call_counts().fill - fills, 1u);
  expect_contents({0, 3, 7}, 0xFF);
}

TEST_P(PagedKvCacheLayoutTest, SingleBlockZeroAndPoison) {
  write_patterns();
  std::uint64_t fills = backend_->call_counts().fill;
  cache_.poison_block(6, stream_);
  EXPECT_EQ(backend_->call_counts().fill - fills, 1u);
  expect_contents({6}, 0xFF);
  fills = backend_->call_counts().fill;
  cache_.zero_block(6, stream_);
  EXPECT_EQ(backend_->call_counts().fill - fills, 1u);
  expect_contents({6}, 0x00);
}

TEST_P(PagedKvCacheLayoutTest, ZeroEveryBlockIsOneCallAndOneRunPerPool) {
  write_patterns();
  std::vector<BlockId> all(kBlocks);
  for (BlockId b = 0; b < kBlocks; ++b)
    all[b] = kBlocks - 1 - b;  // descending
  const std::uint64_t fills = backend_->call_counts().fill;
  cache_.zero_blocks(all, stream_);
  EXPECT_EQ(backend_->call_counts().fill - fills, 1u);
  EXPECT_EQ(cache_.last_fill_regions(), block_major() ? 1u : 2 * cache_.num_layers());
  expect_contents({0, 1, 2, 3, 4, 5, 6, 7}, 0x00);
}

TEST_P(PagedKvCacheLayoutTest, DuplicateAndUnsortedIdsFillEachBlockOnce) {
  write_patterns();
  const std::vector<BlockId> batch = {4, 2, 4, 3, 2};
  const std::uint64_t fills = backend_->call_counts().fill;
  cache_.poison_blocks(batch, stream_);
  EXPECT_EQ(backend_->call_counts().fill - fills, 1u);
  EXPECT_EQ(cache_.last_fill_regions(), block_major() ? 1u : 2 * cache_.num_layers());
  expect_contents({2, 3, 4}, 0xFF);
}

TEST_P(PagedKvCacheLayoutTest, OutOfRangeBatchDoesNoDeviceWork) {
  write_patterns();
  const CallCounts before = backend_->call_counts();
  const std::vector<BlockId> batch = {1, 2, kBlocks};
  EXPECT_THROW(cache_.zero_blocks(batch, stream_), InvalidArgument);
  EXPECT_THROW(cache_.poison_blocks(batch, stream_), InvalidArgument);
  EXPECT_EQ(backend_->call_counts().device_ops(), before.device_ops());
  expect_contents({}, 0);
}

TEST_P(PagedKvCacheLayoutTest, FillIsOrderedOnTheStream) {
  // Queue a poison and a zero without synchronizing; the read on the same
  // stream must see the later zero.
  write_patterns();
  const std::vector<BlockId> batch = {3, 4};
  cache_.poison_blocks(batch, stream_);
  cache_.zero_blocks(batch, stream_);
  expect_contents({3, 4}, 0x00);
}

TEST_P(PagedKvCacheLayoutTest, WriteBlockRejectsWrongSizes) {
  write_patterns();
  for (std::size_t l = 0; l < cache_.num_layers(); ++l) {
    const std::vector<std::uint8_t> k(cache_.k_block_bytes(l), 0xAB);
    const std::vector<std::uint8_t> v(cache_.v_block_bytes(l), 0xCD);
    const std::vector<std::uint8_t> k_short(k.size() - 1, 0xAB);
    const std::vector<std::uint8_t> v_long(v.size() + 1, 0xCD);
    expect_invalid_argument([&] { cache_.write_block(l, 1, k_short, v, stream_); }, "write_block");
    expect_invalid_argument([&] { cache_.write_block(l, 1, k, v_long, stream_); }, "write_block");
    expect_invalid_argument([&] { cache_.write_block(l, 1, {}, {}, stream_); }, "write_block");
    // K and V swapped only fits when they have the same size.
    if (k.size() != v.size()) {
      expect_invalid_argument([&] { cache_.write_block(l, 1, v, k, stream_); }, "write_block");
    }
  }
  expect_contents({}, 0);  // nothing was written
}

TEST_P(PagedKvCacheLayoutTest, CoalescesRunsOfBlocks) {
  const std::size_t pools = 2 * cache_.num_layers();
  struct Case {
    std::vector<BlockId> ids;
    std::size_t runs;
  };
  const Case cases[] = {
      {{2, 3, 4, 5}, 1},  // one contiguous run
      {{0, 2, 4}, 3},     // scattered
      {{3, 3, 4, 4}, 1},  // duplicates removed
      {{5, 2, 4, 3}, 1},  // unsorted
      {{7, 0, 1, 5}, 3},  // {0,1} {5} {7}
      {{6}, 1},           // single
      {{0, 1, 2, 3, 4, 5, 6, 7}, 1},
      {{7, 5, 3, 1}, 4},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(::testing::PrintToString(c.ids));
    const std::uint64_t fills = backend_->call_counts().fill;
    cache_.zero_blocks(c.ids, stream_);
    EXPECT_EQ(backend_->call_counts().fill - fills, 1u);
    EXPECT_EQ(cache_.last_fill_regions(), block_major() ? c.runs : c.runs * pools);
  }
}

TEST_P(PagedKvCacheLayoutTest, EmptyBatchQueuesNothing) {
  const std::vector<BlockId> some = {1, 3};
  cache_.zero_blocks(some, stream_);
  ASSERT_GT(cache_.last_fill_regions(), 0u);
  const CallCounts before = backend_->call_counts();
  cache_.zero_blocks({}, stream_);
  cache_.poison_blocks({}, stream_);
  EXPECT_EQ(backend_->call_counts().fill, before.fill);
  EXPECT_EQ(backend_->call_counts().device_ops(), before.device_ops());
  EXPECT_EQ(cache_.last_fill_regions(), 0u);
}

TEST_P(PagedKvCacheLayoutTest, ReadBlockSizesFollowTheLayerDtype) {
  for (std::size_t l = 0; l < cache_.num_layers(); ++l) {
    const PagedKvCache::HostBlock got = cache_.read_block(l, 0, stream_);
    EXPECT_EQ(got.k.size(), GetParam().k_bytes[l]);
    EXPECT_EQ(got.v.size(), GetParam().v_bytes[l]);
  }
}

TEST_P(PagedKvCacheLayoutTest, DestructionReturnsAllMemory) {
  const std::size_t capacity = backend_->mem_info().total_bytes;
  EXPECT_EQ(cache_.adopted(), GetParam().adopted);
  if (GetParam().adopted) {
    // The engine's pools take nothing from the backend, and outlive the cache.
    EXPECT_EQ(backend_->mem_info().free_bytes, capacity);
    const DevicePtr pool = cache_.memory_pools()[0].base;
    { PagedKvCache moved(std::move(cache_)); }
    EXPECT_EQ(backend_->mem_info().free_bytes, capacity);
    static_cast<std::uint8_t*>(pool.get())[0] = 0x5A;  // still the engine's, still valid
    EXPECT_THROW(backend_->memset_async(pool, 0, 1, stream_), InvalidArgument);  // forgotten
    return;
  }
  EXPECT_LT(backend_->mem_info().free_bytes, capacity);
  { PagedKvCache moved(std::move(cache_)); }
  EXPECT_EQ(backend_->mem_info().free_bytes, capacity);
}

std::string layout_name(const ::testing::TestParamInfo<LayoutParam>& param_info) {
  return std::string(param_info.param.name) + (param_info.param.adopted ? "Adopted" : "");
}

INSTANTIATE_TEST_SUITE_P(Layouts, PagedKvCacheLayoutTest,
                         ::testing::ValuesIn(owned_and_adopted(layout_params())), layout_name);
INSTANTIATE_TEST_SUITE_P(Layouts, LayerMajorLayoutTest,
                         ::testing::ValuesIn(layout_params(KvCacheLayout::layer_major)),
                         layout_name);
INSTANTIATE_TEST_SUITE_P(Layouts, BlockMajorLayoutTest,
                         ::testing::ValuesIn(layout_params(KvCacheLayout::block_major)),
                         layout_name);

}  // namespace
}  // namespace kvport

namespace kvport {
namespace {

// K-only layers (head_dim_v 0: MLA's latent, state slots): K pools only, V
// calls that need a pool throw, and zero/copy/read/write cover K alone.
class KOnlyCacheTest : public ::testing::TestWithParam<KvCacheLayout> {
 protected:
  static KvCacheConfig config(KvCacheLayout layout) {
    KvCacheConfig c = test::small_config(layout);  // 3 layers, 128-byte K regions
    c.head_dim_v = 0;
    return c;
  }
  std::unique_ptr<Backend> backend = test::host_backend();
  Stream stream = backend->create_stream();
};

TEST_P(KOnlyCacheTest, KPoolsOnlyAndVCallsThrow) {
  PagedKvCache cache(config(GetParam()), 8, *backend, PagedKvCacheOptions{false});
  const bool layer_major = GetParam() == KvCacheLayout::layer_major;
  EXPECT_EQ(backend->call_counts().alloc, layer_major ? 3u : 1u);
  EXPECT_EQ(cache.total_bytes(), 8u * 3 * 128);
  EXPECT_EQ(cache.v_block_bytes(0), 0u);
  expect_invalid_argument([&] { (void)cache.v_cache_ptr(0, 0); }, "no V");
  expect_invalid_argument([&] { (void)cache.v_pool_ptr(1); }, "no V");
  expect_invalid_argument([&] { (void)cache.v_block_stride(2); }, "no V");
  expect_invalid_argument([&] { (void)cache.v_pool_ptr(3); }, "out of range");
  EXPECT_EQ(cache.k_block_stride(0), layer_major ? 128u : 3u * 128);
  EXPECT_EQ(PagedKvCache::compute_num_blocks(config(GetParam()), 8 * 3 * 128), 8u);
  EXPECT_LT(PagedKvCache::compute_num_blocks(config(GetParam()), 8 * 3 * 128 - 1), 8u);
}

TEST_P(KOnlyCacheTest, PoolsAreKOnly) {
  PagedKvCache cache(config(GetParam()), 8, *backend, PagedKvCacheOptions{false});
  const bool layer_major = GetParam() == KvCacheLayout::layer_major;
  EXPECT_EQ(cache.config().bytes_per_block(), 3u * 128);
  for (std::size_t l = 0; l < 3; ++l) {
    const BlockPool& k = cache.pool(l, KvPart::k);
    EXPECT_EQ(k.region_bytes, 128u);
    EXPECT_EQ(k.stride, layer_major ? 128u : 3u * 128);
    EXPECT_EQ(k.region(5).ptr, cache.k_cache_ptr(l, 5));
    expect_invalid_argument([&] { (void)cache.pool(l, KvPart::v); },
                            "PagedKvCache::pool: the layers have no V (head_dim_v is 0");
  }
  expect_invalid_argument([&] { (void)cache.pool(3, KvPart::v); }, "out of range");
  // The block's image is its K regions: one pool per layer, or the whole block.
  const std::span<const BlockPool> memory = cache.memory_pools();
  ASSERT_EQ(memory.size(), layer_major ? 3u : 1u);
  std::size_t image = 0;
  for (const BlockPool& p : memory)
    image += p.region_bytes;
  EXPECT_EQ(image, 3u * 128);
  if (layer_major) {
    for (std::size_t l = 0; l < 3; ++l)
      EXPECT_EQ(memory[l], cache.pool(l, KvPart::k));
  }
}

TEST_P(KOnlyCacheTest, PoisonAndInvariantsCoverK) {
  PagedKvCache cache(config(GetParam()), 8, *backend, PagedKvCacheOptions{false});
  std::vector<BlockId> held;
  for (int i = 0; i < 5; ++i)
    held.push_back(cache.alloc_block());
  cache.free_block(held[1]);
  const InvariantReport r = cache.check_invariants();
  EXPECT_TRUE(r.ok) << r.to_string();
  EXPECT_EQ(r.blocks_in_use, 4u);
  EXPECT_EQ(r.free_blocks, 4u);
  const std::vector<std::uint8_t> k(128, 7);
  cache.write_block(0, 3, k, {}, stream);
  cache.write_block(0, 4, k, {}, stream);
  const BlockId ids[] = {3, 2};
  cache.poison_blocks(ids, stream);
  cache.synchronize();
  for (std::size_t l = 0; l < 3; ++l) {
    EXPECT_EQ(cache.read_block(l, 3, stream).k, std::vector<std::uint8_t>(128, 0xFF));
    EXPECT_EQ(cache.read_block(l, 2, stream).k, std::vector<std::uint8_t>(128, 0xFF));
  }
  EXPECT_EQ(cache.read_block(0, 4, stream).k, k);
}

TEST_P(KOnlyCacheTest, WriteBlockWithVBytesNamesTheMissingV) {
  PagedKvCache cache(config(GetParam()), 4, *backend, PagedKvCacheOptions{false});
  const std::vector<std::uint8_t> k(128, 1), v(1, 2);
  expect_invalid_argument([&] { cache.write_block(1, 0, k, v, stream); },
                          "the layers have no V: K-only, so v must be empty");
  expect_invalid_argument([&] { cache.write_block(1, 0, v, {}, stream); },
                          "expects 128 K bytes and 0 V bytes");
  EXPECT_EQ(backend->call_counts().device_ops(), 0u);  // nothing was copied
}

TEST_P(KOnlyCacheTest, ZeroCopyReadWriteCoverK) {
  PagedKvCache cache(config(GetParam()), 8, *backend, PagedKvCacheOptions{false});
  std::vector<std::uint8_t> k(128);
  std::iota(k.begin(), k.end(), std::uint8_t{1});
  for (std::size_t layer = 0; layer < 3; ++layer)
    cache.write_block(layer, 2, k, {}, stream);
  expect_invalid_argument([&] { cache.write_block(0, 2, k, k, stream); }, "0 V bytes");
  const BlockCopy c{2, 5};
  cache.copy_blocks({&c, 1}, stream);
  cache.synchronize();
  for (std::size_t layer = 0; layer < 3; ++layer) {
    const PagedKvCache::HostBlock hb = cache.read_block(layer, 5, stream);
    EXPECT_EQ(hb.k, k);
    EXPECT_TRUE(hb.v.empty());
  }
  const BlockId zero = 5;
  cache.zero_blocks({&zero, 1}, stream);
  cache.synchronize();
  EXPECT_EQ(cache.read_block(1, 5, stream).k, std::vector<std::uint8_t>(128, 0));
  EXPECT_EQ(cache.read_block(1, 2, stream).k, k);  // the neighbour is untouched
  EXPECT_EQ(cache.last_fill_regions(), GetParam() == KvCacheLayout::layer_major ? 3u : 1u);
  EXPECT_TRUE(cache.check_invariants().ok);
}

INSTANTIATE_TEST_SUITE_P(Layouts, KOnlyCacheTest,
                         ::testing::Values(KvCacheLayout::layer_major, KvCacheLayout::block_major));

}  // namespace
}  // namespace kvport

namespace kvport {
namespace {

// pool_allocation_bytes is what the constructor takes from the backend, in
// both layouts and for K-only layers, and what compute_num_blocks fits.
TEST(PagedKvCachePoolBytes, MatchesWhatTheConstructorAllocates) {
  KvCacheConfig k_only = test::small_config();
  k_only.head_dim_v = 0;
  for (const KvCacheConfig& config :
       {test::small_config(), test::mixed_config(KvCacheLayout::block_major), k_only}) {
    for (std::size_t blocks : {1u, 7u, 16u}) {
      auto backend = test::host_backend();
      const std::size_t bytes = PagedKvCache::pool_allocation_bytes(config, blocks);
      PagedKvCache cache(config, blocks, *backend, PagedKvCacheOptions{false});
      EXPECT_EQ(backend->mem_info().total_bytes - backend->mem_info().free_bytes, bytes)
          << blocks << " blocks";
      // The budget holds at least these blocks (rounding may leave room for
      // more), and what compute_num_blocks answers fits it.
      const std::size_t fit = PagedKvCache::compute_num_blocks(config, bytes);
      EXPECT_GE(fit, blocks);
      EXPECT_LE(PagedKvCache::pool_allocation_bytes(config, fit), bytes);
      EXPECT_GT(PagedKvCache::pool_allocation_bytes(config, fit + 1), bytes);
    }
  }
  expect_invalid_argument(
      [] { (void)PagedKvCache::pool_allocation_bytes(test::small_config(), SIZE_MAX / 2); },
      "overflows");
  expect_invalid_argument([] { (void)PagedKvCache::pool_allocation_bytes(KvCacheConfig{}, 1); },
                          "num_layers");
}

}  // namespace
}  // namespace kvport
