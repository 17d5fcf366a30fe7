// SPDX-License-Identifier: Apache-2.0
// The helpers that exist once: SplitMix64 and mix64, the model presets and
// errno_text (sim), div_ceil (platform), the block-id limit (core).
#include <gtest/gtest.h>

#include <cerrno>
#include <limits>

#include "kvport/backends/host_backend.hpp"
#include "kvport/core/block_id.hpp"
#include "kvport/core/block_id_limit.hpp"  // the compatibility forward still works
#include "kvport/core/paged_kv_cache.hpp"
#include "kvport/platform/div_ceil.hpp"
#include "kvport/platform/error.hpp"
#include "kvport/sim/file_error.hpp"
#include "kvport/sim/model_presets.hpp"
#include "kvport/sim/split_mix.hpp"

namespace kvport::sim {
namespace {

TEST(sim_helpers, SplitMix64GivesThePublishedSequence) {
  // The reference implementation (Vigna, splitmix64.c) from seed 0.
  SplitMix64 random(0);
  EXPECT_EQ(random.next(), 0xE220'A839'7B1D'CDAFull);
  EXPECT_EQ(random.next(), 0x6E78'9E6A'A1B9'65F4ull);
  EXPECT_EQ(mix64(kGoldenGamma), 0xE220'A839'7B1D'CDAFull);
  SplitMix64 dice(7);
  for (int i = 0; i < 1000; ++i) {
    const std::uint64_t v = dice.uniform(3, 5);
    EXPECT_GE(v, 3u);
    EXPECT_LE(v, 5u);
  }
}

TEST(sim_helpers, DivCeilRoundsUpWithoutOverflow) {
  EXPECT_EQ(div_ceil(0, 16), 0u);
  EXPECT_EQ(div_ceil(1, 16), 1u);
  EXPECT_EQ(div_ceil(16, 16), 1u);
  EXPECT_EQ(div_ceil(17, 16), 2u);
  constexpr std::size_t kMax = static_cast<std::size_t>(-1);
  EXPECT_EQ(div_ceil(kMax, 2), kMax / 2 + 1);
}

TEST(sim_helpers, RoundUpToAMultiple) {
  EXPECT_EQ(round_up(0, 256), 0u);
  EXPECT_EQ(round_up(1, 256), 256u);
  EXPECT_EQ(round_up(256, 256), 256u);
  EXPECT_EQ(round_up(257, 256), 512u);
  EXPECT_EQ(round_up((std::size_t{2} << 20) + 1, std::size_t{2} << 20), std::size_t{4} << 20);
}

TEST(sim_helpers, ModelPresetsAreOneSortedTable) {
  const auto presets = model_presets();
  ASSERT_FALSE(presets.empty());
  EXPECT_TRUE(std::is_sorted(presets.begin(), presets.end(),
                             [](const auto& a, const auto& b) { return a.name < b.name; }));
  const auto llama = find_model_preset("LLaMA-3-70B");
  ASSERT_TRUE(llama);
  EXPECT_EQ(llama->name, "llama-3-70b");
  EXPECT_EQ(llama->num_layers, 80u);
  EXPECT_FALSE(find_model_preset("llama-3-7"));
  EXPECT_FALSE(find_model_preset(""));
  const KvCacheConfig c = preset_config(*llama, KvCacheDtype::fp8_e4m3, 32);
  EXPECT_EQ(c.num_layers, 80u);
  EXPECT_EQ(c.num_kv_heads, 8u);
  EXPECT_EQ(c.head_dim_k, 128u);
  EXPECT_EQ(c.head_dim_v, 128u);
  EXPECT_EQ(c.dtype, KvCacheDtype::fp8_e4m3);
  EXPECT_EQ(c.block_size, 32u);
  EXPECT_NO_THROW(c.validate());
}

TEST(sim_helpers, TheBlockIdLimitIsCoresAndTheCacheEnforcesIt) {
  static_assert(kMaxCacheBlocks == std::numeric_limits<BlockId>::max());
  EXPECT_EQ(kMaxCacheBlocks, 0xFFFF'FFFFu);
  // The null entry of a block table is never an id: ids end at 2^32 - 2.
  static_assert(kNullBlock == 0xFFFF'FFFFu);
  static_assert(std::size_t{kNullBlock} >= kMaxCacheBlocks);
  auto backend = make_host_backend();
  const KvCacheConfig config = preset_config(*find_model_preset("qwen2.5-0.5b"));
  EXPECT_THROW(PagedKvCache(config, kMaxCacheBlocks + 1, *backend), InvalidArgument);
}

TEST(sim_helpers, ErrnoTextIsShortForTheCommonCases) {
  EXPECT_EQ(errno_text(ENOENT), "no such file");
  EXPECT_EQ(errno_text(EACCES), "permission denied");
  EXPECT_EQ(errno_text(EISDIR), "is a directory");
  EXPECT_FALSE(errno_text(EIO).empty());
}

}  // namespace
}  // namespace kvport::sim
