// SPDX-License-Identifier: Apache-2.0
// PagedKvCache over pools the engine allocated (the adopting constructor):
// the pools are the engine's bytes exactly, checked against the geometry
// (count, null, alignment, size, overlap, memory the backend already knows),
// and never freed. The operations over adopted pools run in the parametrized
// suites (paged_kv_cache_test, prefix_cache_test, host_tier_test: "Adopted").
#include <fmt/format.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cstdint>
#include <cstdlib>
#include <string>
#include <vector>

#include "core_test_util.hpp"
#include "kvport/core/paged_kv_cache.hpp"
#include "kvport/platform/error.hpp"

namespace kvport {
namespace {

using test::expect_invalid_argument;
using test::small_config;  // 3 layers, 128-byte K and V regions

// One engine buffer that several pools can be carved out of. aligned_alloc
// wants a size that is a multiple of the alignment (ASan aborts otherwise);
// `bytes` stays what was asked for.
struct Buffer {
  explicit Buffer(std::size_t n)
      : bytes(n), p(static_cast<std::uint8_t*>(std::aligned_alloc(256, (n + 255) / 256 * 256))) {}
  ~Buffer() { std::free(p); }
  Buffer(const Buffer&) = delete;
  Buffer& operator=(const Buffer&) = delete;
  DevicePtr at(std::size_t offset) const { return DevicePtr::from(p + offset); }
  std::size_t bytes;
  std::uint8_t* p;
};

constexpr std::size_t kBlocks = 8;
constexpr std::size_t kPool = kBlocks * 128;  // one layer's K (or V) pool of small_config

// Layer-major small_config: 6 pools carved out of one buffer, back to back.
std::vector<AdoptedPool> carve(const Buffer& b, std::size_t gap = 0) {
  std::vector<AdoptedPool> pools;
  for (std::size_t i = 0; i < 6; ++i)
    pools.push_back({b.at(i * (kPool + gap)), kPool});
  return pools;
}

TEST(AdoptedPoolBytes, FollowTheLayoutAndTheLayers) {
  EXPECT_EQ(PagedKvCache::adopted_pool_bytes(small_config(), kBlocks),
            std::vector<std::size_t>(6, kPool));
  EXPECT_EQ(PagedKvCache::adopted_pool_bytes(small_config(KvCacheLayout::block_major), kBlocks),
            std::vector<std::size_t>{kBlocks * 768});
  KvCacheConfig k_only = small_config();
  k_only.head_dim_v = 0;
  EXPECT_EQ(PagedKvCache::adopted_pool_bytes(k_only, kBlocks), std::vector<std::size_t>(3, kPool));
  const std::vector<std::size_t> mixed = PagedKvCache::adopted_pool_bytes(test::mixed_config(), 2);
  ASSERT_EQ(mixed.size(), 6u);
  for (std::size_t l = 0; l < 3; ++l) {
    EXPECT_EQ(mixed[2 * l], 2 * test::kMixedK[l]);
    EXPECT_EQ(mixed[2 * l + 1], 2 * test::kMixedV[l]);
  }
}

TEST(AdoptedKvCache, ThePoolsAreTheEnginesBytes) {
  auto backend = test::host_backend();
  Buffer buf(6 * kPool);
  const std::size_t free_before = backend->mem_info().free_bytes;
  PagedKvCache cache(small_config(), kBlocks, *backend, carve(buf));
  EXPECT_TRUE(cache.adopted());
  EXPECT_EQ(backend->mem_info().free_bytes, free_before);  // nothing allocated
  ASSERT_EQ(cache.memory_pools().size(), 6u);
  for (std::size_t i = 0; i < 6; ++i)
    EXPECT_EQ(cache.memory_pools()[i].base, buf.at(i * kPool)) << i;
  EXPECT_EQ(cache.k_cache_ptr(1, 2), buf.at(2 * kPool + 2 * 128));
  EXPECT_EQ(cache.v_cache_ptr(2, 7), buf.at(5 * kPool + 7 * 128));
  // What the cache writes is in the engine's memory, and the other way round.
  Stream s = backend->create_stream();
  const BlockId b = cache.alloc_block();
  cache.poison_block(b, s);
  s.synchronize();
  EXPECT_EQ(buf.p[3 * kPool + 0], 0xFF);  // layer 1 V, block 0
  buf.p[0] = 0x12;                        // layer 0 K, block 0: the engine writes
  EXPECT_EQ(cache.read_block(0, b, s).k[0], 0x12);
}

TEST(AdoptedKvCache, BlockMajorAndKOnly) {
  auto backend = test::host_backend();
  Buffer buf(kBlocks * 768 + 64);
  const AdoptedPool one{buf.at(0), buf.bytes};  // larger than needed: fine
  PagedKvCache bm(small_config(KvCacheLayout::block_major), kBlocks, *backend,
                  std::span<const AdoptedPool>(&one, 1));
  EXPECT_EQ(bm.k_cache_ptr(0, 1), buf.at(768));
  EXPECT_EQ(bm.v_cache_ptr(2, 1), buf.at(768 + 5 * 128));
  KvCacheConfig k_only = small_config();
  k_only.head_dim_v = 0;
  Buffer kb(3 * kPool);
  const AdoptedPool k_pools[] = {
      {kb.at(0), kPool}, {kb.at(kPool), kPool}, {kb.at(2 * kPool), kPool}};
  PagedKvCache ko(k_only, kBlocks, *backend, k_pools);
  EXPECT_EQ(ko.k_cache_ptr(2, 3), kb.at(2 * kPool + 3 * 128));
}

TEST(AdoptedKvCache, TheGeometryIsCheckedAndTheErrorNamesThePool) {
  auto backend = test::host_backend();
  Buffer buf(8 * kPool);
  const KvCacheConfig c = small_config();
  auto make = [&](std::vector<AdoptedPool> pools) {
    PagedKvCache cache(c, kBlocks, *backend, pools);
  };
  expect_invalid_argument([&] { make({}); }, "no pools");
  auto pools = carve(buf);
  pools.pop_back();
  expect_invalid_argument(
      [&] { make(pools); },
      "5 pools given, the config needs 6 (layer-major: K and V per layer x 3 layers)");
  pools = carve(buf);
  pools[3].base = DevicePtr{};
  expect_invalid_argument([&] { make(pools); }, "pool 3 (layer 1 V): null base pointer");
  pools = carve(buf);
  pools[2].base = buf.at(2 * kPool + 8);
  expect_invalid_argument([&] { make(pools); }, "pool 2 (layer 1 K): base");
  expect_invalid_argument([&] { make(pools); }, "misaligned (needs 16-byte alignment)");
  pools = carve(buf);
  pools[4].bytes = kPool - 1;
  expect_invalid_argument([&] { make(pools); },
                          "pool 4 (layer 2 K): 1023 bytes are too small: 8 blocks need 1024 bytes");
  pools = carve(buf);
  pools[5].base = buf.at(kPool + 512);  // inside layer 0 V
  expect_invalid_argument([&] { make(pools); },
                          "pool 1 (layer 0 V) and pool 5 (layer 2 V) overlap");
  // Nothing was left registered by the failed attempts: a good set still works.
  EXPECT_NO_THROW(make(carve(buf)));
  // Memory the backend already knows: its own allocation, or another cache's pools.
  const DevicePtr own = backend->alloc(6 * kPool);
  std::vector<AdoptedPool> over_own;
  for (std::size_t i = 0; i < 6; ++i)
    over_own.push_back({own.offset(i * kPool), kPool});
  expect_invalid_argument([&] { make(over_own); }, "pool 0 (layer 0 K): host: adopt_memory");
  backend->free(own);
  PagedKvCache first(c, kBlocks, *backend, carve(buf));
  expect_invalid_argument([&] { make(carve(buf)); }, "overlaps an adopted range");
  KvCacheConfig bad = c;
  bad.block_size = 0;
  EXPECT_THROW(PagedKvCache(bad, kBlocks, *backend, carve(buf)), InvalidArgument);
}

TEST(AdoptedKvCache, AFailedAdoptionMidwayLeavesNothingRegistered) {
  // Pool 4 overlaps memory the backend owns: pools 0-3 were registered first
  // and must be forgotten when the constructor throws.
  auto backend = test::host_backend();
  Buffer buf(6 * kPool);
  const DevicePtr own = backend->alloc(kPool);
  auto pools = carve(buf);
  pools[4].base = own;
  EXPECT_THROW(PagedKvCache(small_config(), kBlocks, *backend, pools), InvalidArgument);
  backend->free(own);
  EXPECT_NO_THROW(PagedKvCache(small_config(), kBlocks, *backend, carve(buf)));
}

TEST(AdoptedKvCache, NeverFreedAndWaitedForLikeOwnedPools) {
  auto backend = test::host_backend();
  Buffer buf(6 * kPool);
  Stream s = backend->create_stream();
  {
    PagedKvCache cache(small_config(), kBlocks, *backend, carve(buf));
    std::vector<BlockId> all;
    for (std::size_t i = 0; i < kBlocks; ++i)
      all.push_back(cache.alloc_block());
    cache.poison_blocks(all, s);  // still queued, maybe, at destruction: waited for
    EXPECT_FALSE(backend->free(cache.memory_pools()[0].base));  // refused: the engine's
    PagedKvCache moved(std::move(cache));
    EXPECT_TRUE(moved.adopted());
    EXPECT_FALSE(cache.adopted());  // NOLINT(bugprone-use-after-move): moved from
  }
  for (std::size_t i = 0; i < buf.bytes; ++i)
    ASSERT_EQ(buf.p[i], 0xFF) << i;  // every poison ran, into memory still valid
  // The registration ended with the cache: the same memory can be adopted again.
  EXPECT_NO_THROW(PagedKvCache(small_config(), kBlocks, *backend, carve(buf)));
}

// Two caches over two backend objects (two engines' backends in one process):
// the second cannot adopt the first's pools, adopted or allocated, and can once
// the first cache is gone.
TEST(AdoptedKvCache, TwoBackendObjectsCannotAdoptTheSamePools) {
  auto engine_a = test::host_backend();
  auto engine_b = test::host_backend();
  Buffer buf(6 * kPool);
  const KvCacheConfig c = small_config();
  {
    PagedKvCache first(c, kBlocks, *engine_a, carve(buf));
    const std::string msg = kvport::testing::message_of<InvalidArgument>(
        [&] { PagedKvCache second(c, kBlocks, *engine_b, carve(buf)); });
    EXPECT_THAT(msg, ::testing::HasSubstr(fmt::format(
                         "pool 0 (layer 0 K): host: adopt_memory: [{:#x}, +{}) overlaps an adopted "
                         "range [{:#x}, +{}) of another host backend object (host memory)",
                         buf.at(0).address(), kPool, buf.at(0).address(), kPool)));
    // Nothing of the refused cache stayed registered with engine_b.
    EXPECT_THROW(engine_b->memset_async(buf.at(0), 0, 16, engine_b->default_stream()),
                 InvalidArgument);
  }
  EXPECT_NO_THROW(PagedKvCache(c, kBlocks, *engine_b, carve(buf)));
}

TEST(AdoptedKvCache, AnotherCachesAllocatedPoolIsNotAdoptable) {
  auto engine_a = test::host_backend();
  auto engine_b = test::host_backend();
  const KvCacheConfig c = small_config();
  std::vector<AdoptedPool> views;
  {
    PagedKvCache owner(c, kBlocks, *engine_a);
    for (const auto& pool : owner.memory_pools())
      views.push_back({pool.base, kPool});
    const std::string msg = kvport::testing::message_of<InvalidArgument>(
        [&] { PagedKvCache thief(c, kBlocks, *engine_b, views); });
    EXPECT_THAT(msg, ::testing::HasSubstr("overlaps a live allocation"));
    EXPECT_THAT(msg, ::testing::HasSubstr("of another host backend object"));
  }
}

TEST(AdoptedKvCache, ZeroBlocksIsRefusedBeforeAnyDivision) {
  auto backend = test::host_backend();
  Buffer buf(6 * kPool);
  expect_invalid_argument([] { (void)PagedKvCache::adopted_pool_bytes(small_config(), 0); },
                          "num_blocks must be > 0");
  expect_invalid_argument([&] { PagedKvCache cache(small_config(), 0, *backend, carve(buf)); },
                          "num_blocks must be > 0");
  expect_invalid_argument(
      [] { (void)PagedKvCache::adopted_pool_bytes(small_config(), std::size_t{1} << 33); },
      "exceeds the 32-bit block id range");
}

}  // namespace
}  // namespace kvport
