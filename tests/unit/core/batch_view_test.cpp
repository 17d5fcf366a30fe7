// SPDX-License-Identifier: Apache-2.0
// Batch metadata for attention kernels (batch_view.hpp), checked against each
// consumer's rules: vLLM v1's rows (int32, left-aligned, the null block for
// released entries and padding, widths a multiple of 128 / kernel block) and
// slot mapping (int64, block * block_size + offset, -1 padding); FlashInfer's
// CSR pages (indptr from 0, non-decreasing; last_page_len in [1, page_size];
// seq_len = page_size * (pages - 1) + last_page_len); kernel blocks smaller
// than the cache's (block b is kernel blocks b*k .. b*k + k - 1).
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cstdint>
#include <vector>

#include "core_test_util.hpp"
#include "kvport/core/batch_view.hpp"
#include "kvport/core/hybrid_block_table.hpp"
#include "kvport/core/hybrid_kv_cache.hpp"
#include "kvport/platform/div_ceil.hpp"

namespace kvport {
namespace {

using test::host_backend;
using test::tokens;

constexpr std::size_t kBs = 4;

// Group 0: window W = 4; group 1: full attention; group 2: a state.
HybridKvCacheConfig config() {
  HybridKvCacheConfig c;
  c.block_size = kBs;
  c.layers = {LayerSpec::sliding_window(4, 1, 8, 8), LayerSpec::full_attention(1, 8, 8),
              LayerSpec::recurrent_state({StateTensor{"s", {2}, StateDtype::f32}})};
  return c;
}

class BatchViewTest : public ::testing::Test {
 protected:
  std::unique_ptr<Backend> backend = host_backend();
  Stream stream = backend->create_stream();
  HybridKvCache cache{config(), std::vector<std::size_t>{32, 32, 8}, *backend};
  HybridBlockTable a{cache};
  HybridBlockTable b{cache};

  void SetUp() override {
    a.append_tokens(tokens(9, 1), stream);   // 3 blocks
    for (TokenId t = 100; t < 104; ++t)      // decode: the window frees its first blocks
      a.append_tokens({&t, 1}, stream);      // 13 tokens, 4 blocks
    b.append_tokens(tokens(3, 50), stream);  // 1 block, partly filled
  }
  std::vector<BatchSequence> batch() const { return {{&a, 1}, {&b, 3}}; }
};

TEST(VllmRowWidth, RoundsUpToTheKernelsAlignment) {
  EXPECT_EQ(vllm_row_width(100, 16), 8u);  // 7 blocks, a multiple of 128 / 16 = 8
  EXPECT_EQ(vllm_row_width(4096, 16), 256u);
  EXPECT_EQ(vllm_row_width(4097, 16), 264u);
  EXPECT_EQ(vllm_row_width(1000, 128), 8u);  // alignment 1
  EXPECT_EQ(vllm_row_width(10, 256), 1u);
  EXPECT_EQ(vllm_row_width(1, 1), 128u);
  test::expect_invalid_argument([] { (void)vllm_row_width(0, 16); }, "must be positive");
  test::expect_invalid_argument([] { (void)vllm_row_width(16, 0); }, "must be positive");
}

TEST_F(BatchViewTest, RowsAreLeftAlignedWithTheNullBlockForReleasedEntriesAndPadding) {
  const std::size_t width = 8;
  std::vector<std::int32_t> rows(3 * width, 12345);
  build_block_table_rows(batch(), 1, KernelBlocks{}, width, rows);  // full attention
  const std::span<const BlockId> fa = a.blocks(1);
  ASSERT_EQ(fa.size(), 4u);
  for (std::size_t j = 0; j < width; ++j) {
    EXPECT_EQ(rows[j], j < 4 ? static_cast<std::int32_t>(fa[j]) : 0) << j;
    EXPECT_EQ(rows[width + j], j < 1 ? static_cast<std::int32_t>(b.blocks(1)[0]) : 0) << j;
    EXPECT_EQ(rows[2 * width + j], 0) << "a padding row";
  }
  // The window group: released entries are the null block (here -1).
  build_block_table_rows(batch(), 0, KernelBlocks{0, -1}, width, rows);
  const std::span<const BlockId> w = a.blocks(0);
  ASSERT_EQ(w[0], kNullBlock);
  for (std::size_t j = 0; j < 4; ++j)
    EXPECT_EQ(rows[j], w[j] == kNullBlock ? -1 : static_cast<std::int32_t>(w[j])) << j;
  EXPECT_EQ(rows[4], -1);
  EXPECT_EQ(rows[2 * width], -1);
}

TEST_F(BatchViewTest, SmallerKernelBlocksExpandEachBlock) {
  // Kernel blocks of 2 tokens: block x is kernel blocks 2x and 2x + 1.
  const std::size_t width = vllm_row_width(16, 2);  // 64
  std::vector<std::int32_t> rows(2 * width);
  build_block_table_rows(batch(), 1, KernelBlocks{2, 0}, width, rows);
  const std::span<const BlockId> fa = a.blocks(1);
  for (std::size_t j = 0; j < div_ceil(13, 2); ++j)
    EXPECT_EQ(rows[j], static_cast<std::int32_t>(fa[j / 2] * 2 + j % 2)) << j;
  EXPECT_EQ(rows[7], 0);  // 13 tokens: 7 kernel blocks
  EXPECT_EQ(rows[width + 0], static_cast<std::int32_t>(b.blocks(1)[0] * 2));
  EXPECT_EQ(rows[width + 1], static_cast<std::int32_t>(b.blocks(1)[0] * 2 + 1));
  EXPECT_EQ(rows[width + 2], 0);
}

TEST_F(BatchViewTest, SlotMappingIsBlockTimesSizePlusOffsetWhateverTheKernelBlock) {
  std::vector<std::int64_t> slots(6, 777);
  EXPECT_EQ(build_slot_mapping(batch(), 1, KernelBlocks{}, slots), 4u);
  // a's new token is position 12 (block 3, offset 0); b's are 0, 1, 2.
  EXPECT_EQ(slots[0], static_cast<std::int64_t>(a.blocks(1)[3]) * 4);
  for (std::int64_t o = 0; o < 3; ++o)
    EXPECT_EQ(slots[1 + o], static_cast<std::int64_t>(b.blocks(1)[0]) * 4 + o);
  EXPECT_EQ(slots[4], -1);
  EXPECT_EQ(slots[5], -1);
  // Kernel blocks of 1 or 2 tokens address the same token slots.
  for (std::size_t kbs : {1u, 2u}) {
    std::vector<std::int64_t> other(6);
    EXPECT_EQ(build_slot_mapping(batch(), 1, KernelBlocks{kbs, 0}, other), 4u);
    EXPECT_EQ(other, slots) << "kernel block " << kbs;
  }
  // The window group's new tokens are in live blocks.
  EXPECT_EQ(build_slot_mapping(batch(), 0, KernelBlocks{}, slots), 4u);
  EXPECT_EQ(slots[0], static_cast<std::int64_t>(a.blocks(0)[3]) * 4);
}

TEST_F(BatchViewTest, TokenLocationsAreOneSlotPerToken) {
  const std::size_t width = 16;
  std::vector<std::int32_t> loc(3 * width, 55);
  build_token_locations(batch(), 0, KernelBlocks{0, -1}, width, loc);  // the window group
  const std::span<const BlockId> w = a.blocks(0);
  for (std::size_t pos = 0; pos < width; ++pos) {
    const std::int32_t want = pos >= 13 || w[pos / kBs] == kNullBlock
                                  ? -1
                                  : static_cast<std::int32_t>(w[pos / kBs] * kBs + pos % kBs);
    EXPECT_EQ(loc[pos], want) << pos;
  }
  EXPECT_EQ(loc[0], -1);  // released by the window
  for (std::size_t pos = 0; pos < width; ++pos)
    EXPECT_EQ(loc[2 * width + pos], -1);  // a padding row
  // A new token's location is its slot in the slot mapping, whatever the
  // kernel block size.
  std::vector<std::int64_t> slots(4);
  (void)build_slot_mapping(batch(), 1, KernelBlocks{}, slots);
  for (std::size_t kbs : {4u, 2u}) {
    build_token_locations(batch(), 1, KernelBlocks{kbs, 0}, width, loc);
    EXPECT_EQ(loc[12], slots[0]);
    EXPECT_EQ(loc[width + 0], slots[1]);
    EXPECT_EQ(loc[width + 2], slots[3]);
  }
  std::vector<std::int32_t> narrow(2 * 8);
  test::expect_invalid_argument(
      [&] { build_token_locations(batch(), 1, KernelBlocks{}, 8, narrow); },
      "sequence 0 holds 13 tokens, more than a row of 8");
  test::expect_invalid_argument(
      [&] { build_token_locations(batch(), 1, KernelBlocks{}, 16, narrow); }, "not rows of width");
}

TEST_F(BatchViewTest, FlashInferPagesFollowItsRules) {
  for (std::size_t kbs : {4u, 2u, 1u}) {
    const FlashInferPages p = build_flashinfer_pages(batch(), 1, KernelBlocks{kbs, 0});
    EXPECT_EQ(p.page_size, kbs);
    ASSERT_EQ(p.indptr.size(), 3u);
    EXPECT_EQ(p.indptr[0], 0);
    const std::vector<const HybridBlockTable*> tables{&a, &b};
    for (std::size_t i = 0; i < 2; ++i) {
      const std::int32_t pages = p.indptr[i + 1] - p.indptr[i];
      EXPECT_GE(pages, 1);
      EXPECT_GE(p.last_page_len[i], 1);
      EXPECT_LE(p.last_page_len[i], static_cast<std::int32_t>(kbs));
      const std::size_t n = tables[i]->num_tokens();
      EXPECT_EQ(static_cast<std::size_t>(pages - 1) * kbs + p.last_page_len[i], n);
      EXPECT_EQ(p.kv_len[i], static_cast<std::int32_t>(n));
    }
    EXPECT_EQ(p.indices.size(), static_cast<std::size_t>(p.indptr[2]));
    // The same pages as the rows.
    std::vector<std::int32_t> rows(2 * 64);
    build_block_table_rows(batch(), 1, KernelBlocks{kbs, 0}, 64, rows);
    for (std::int32_t j = 0; j < p.indptr[1]; ++j)
      EXPECT_EQ(p.indices[j], rows[j]);
    for (std::int32_t j = p.indptr[1]; j < p.indptr[2]; ++j)
      EXPECT_EQ(p.indices[j], rows[64 + j - p.indptr[1]]);
  }
}

TEST_F(BatchViewTest, DraftTokensHaveSlotsToo) {
  HybridBlockTable c(cache);
  c.append_tokens(tokens(4, 200), stream);
  c.append_draft(tokens(3, 300), stream);  // the verifier computes 1 + 3 positions
  const std::vector<BatchSequence> verify{{&c, 4}};
  std::vector<std::int64_t> slots(4);
  EXPECT_EQ(build_slot_mapping(verify, 1, KernelBlocks{}, slots), 4u);
  EXPECT_EQ(slots[0], static_cast<std::int64_t>(c.blocks(1)[0]) * 4 + 3);
  EXPECT_EQ(slots[1], static_cast<std::int64_t>(c.blocks(1)[1]) * 4);
  const FlashInferPages p = build_flashinfer_pages(verify, 1, KernelBlocks{});
  EXPECT_EQ(p.kv_len[0], 7);
  EXPECT_EQ(p.last_page_len[0], 3);
}

TEST_F(BatchViewTest, ErrorsNameWhatIsWrong) {
  std::vector<std::int32_t> rows(16);
  std::vector<std::int64_t> slots(8);
  const KernelBlocks k;
  test::expect_invalid_argument([&] { build_block_table_rows({}, 1, k, 8, rows); }, "empty");
  const std::vector<BatchSequence> none{{nullptr, 1}};
  test::expect_invalid_argument([&] { build_block_table_rows(none, 1, k, 8, rows); },
                                "has no table");
  const std::vector<BatchSequence> zero{{&a, 0}};
  test::expect_invalid_argument([&] { (void)build_slot_mapping(zero, 1, k, slots); },
                                "0 new tokens");
  const std::vector<BatchSequence> too_many{{&b, 4}};
  test::expect_invalid_argument([&] { (void)build_flashinfer_pages(too_many, 1, k); },
                                "4 new tokens of the 3");
  test::expect_invalid_argument([&] { build_block_table_rows(batch(), 2, k, 8, rows); },
                                "keeps a state");
  EXPECT_THROW(build_block_table_rows(batch(), 3, k, 8, rows), OutOfRange);
  test::expect_invalid_argument(
      [&] {
        build_block_table_rows(batch(), 1, KernelBlocks{3, 0}, 8, rows);
      },
      "does not divide");
  std::vector<std::int32_t> narrow(6);
  test::expect_invalid_argument([&] { build_block_table_rows(batch(), 1, k, 3, narrow); },
                                "sequence 0 holds 4 kernel blocks");
  test::expect_invalid_argument([&] { build_block_table_rows(batch(), 1, k, 16, rows); },
                                "not rows of width 16 for 2");
  test::expect_invalid_argument([&] { build_block_table_rows(batch(), 1, k, 5, rows); },
                                "not rows of width 5");
  std::vector<std::int64_t> short_slots(3);
  test::expect_invalid_argument([&] { (void)build_slot_mapping(batch(), 1, k, short_slots); },
                                "3 slots for 4 new tokens");
  // A new token in a block the window released: the engine asked for more
  // new tokens than the step appended.
  const std::vector<BatchSequence> stale{{&a, 13}};
  test::expect_invalid_argument([&] { (void)build_slot_mapping(stale, 0, k, slots); }, "released");
  HybridKvCache other(config(), std::vector<std::size_t>{8, 8, 4}, *backend);
  HybridBlockTable x(other);
  x.append_tokens(tokens(2, 1), stream);
  const std::vector<BatchSequence> mixed{{&a, 1}, {&x, 1}};
  test::expect_invalid_argument([&] { build_block_table_rows(mixed, 1, k, 8, rows); },
                                "another cache");
}

}  // namespace
}  // namespace kvport
