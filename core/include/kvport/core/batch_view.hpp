// SPDX-License-Identifier: Apache-2.0
// Batch metadata for attention kernels: what an engine hands its kernels each
// step, built from the sequences' HybridBlockTables for one KV cache group,
// in the exact dtypes, shapes and padding of each consumer
// (docs/batch-metadata.md has a worked example of each):
//  - vLLM v1's block-table rows (int32 [rows, row_width], left-aligned) and
//    slot mapping (int64, one per new token, -1 padding);
//  - FlashInfer's CSR page table (int32 indptr [B + 1], indices,
//    last_page_len [B] in [1, page_size]; kv_len [B] for MLA);
//  - SGLang's token locations (req_to_token: int32, one KV slot per token).
// These are host builders (the rows rebuilt each step); keeping the rows on
// the device and shipping only the changes is the next step of issue 32.
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>
#include <vector>

#include "kvport/core/hybrid_block_table.hpp"

namespace kvport {

/// One sequence of a step's batch: its table and how many of its last tokens
/// (committed and draft: HybridBlockTable::num_tokens()) the step computes,
/// at least 1.
struct BatchSequence {
  const HybridBlockTable* table = nullptr;
  std::size_t num_new_tokens = 0;
};

/// How the kernels address blocks.
struct KernelBlocks {
  /// Tokens per kernel block; it must divide the cache's block size (0: the
  /// cache's). Cache block b is kernel blocks b * k .. b * k + k - 1, k = the
  /// cache's block size / kernel_block_size (vLLM's rule for a manager block
  /// larger than the kernel's).
  std::size_t kernel_block_size = 0;
  /// The id written for entries a window or chunk released and for padding
  /// (vLLM reserves block 0 as its null block and never hands it out; the
  /// kernels never read those entries: the window or chunk masks them).
  std::int32_t null_block = 0;
};

/// vLLM v1's row width: cdiv(max_model_len, kernel_block_size) rounded up to
/// a multiple of 128 / kernel_block_size (some kernels need it; 1 when the
/// kernel block is 128 tokens or more). InvalidArgument for 0 sizes.
std::size_t vllm_row_width(std::size_t max_model_len, std::size_t kernel_block_size);

/// Writes group `group`'s block-table rows of `batch` into `rows` (row-major
/// int32 [rows.size() / row_width, row_width]): row i holds sequence i's
/// kernel block ids for every position it holds (released entries as
/// null_block), left-aligned, then null_block; rows past the batch are all
/// null_block. InvalidArgument (nothing written) for an empty table or a
/// sequence that is not (num_new_tokens in [1, num_tokens]), tables of
/// different caches, a state group, a kernel block size that does not
/// divide the block size, a block id that does not fit int32 once expanded,
/// rows.size() not a multiple of row_width or with fewer rows than
/// sequences, or a sequence with more kernel blocks than row_width (named).
/// OutOfRange for a group past the cache's.
void build_block_table_rows(std::span<const BatchSequence> batch, std::size_t group,
                            const KernelBlocks& kernel, std::size_t row_width,
                            std::span<std::int32_t> rows);

/// The signature build_block_table_rows and build_token_locations share (the
/// bindings pass either).
using BatchRowBuilder = void (*)(std::span<const BatchSequence>, std::size_t, const KernelBlocks&,
                                 std::size_t, std::span<std::int32_t>);

/// Writes the slot of every new token of `batch`, sequence by sequence,
/// into `slots` (int64: kernel block id * kernel_block_size + offset in it)
/// and -1 past them; returns the number of new tokens. A new token whose
/// block a window released cannot be written: InvalidArgument (it never
/// happens for the tokens a step appends). Errors as build_block_table_rows,
/// and InvalidArgument when `slots` is shorter than the new tokens.
std::size_t build_slot_mapping(std::span<const BatchSequence> batch, std::size_t group,
                               const KernelBlocks& kernel, std::span<std::int64_t> slots);

/// SGLang's token-granular form (req_to_token): writes each sequence's KV
/// location for every position it holds (kernel block id * kernel_block_size
/// + offset: the slot build_slot_mapping gives a new token) into row i of
/// `locations` (row-major int32 [locations.size() / row_width, row_width]),
/// null_block for positions a window or chunk released, past the sequence's
/// end and in rows past the batch. Errors as build_block_table_rows (a
/// sequence longer than row_width tokens, named).
void build_token_locations(std::span<const BatchSequence> batch, std::size_t group,
                           const KernelBlocks& kernel, std::size_t row_width,
                           std::span<std::int32_t> locations);

/// FlashInfer's paged-KV description of a batch (BatchDecode/BatchPrefill
/// with paged KV; BatchMLAPagedAttention reads kv_len instead of
/// last_page_len). Pages are kernel blocks.
struct FlashInferPages {
  /// [B + 1], indptr[0] = 0, non-decreasing: sequence i's pages are
  /// indices[indptr[i] .. indptr[i + 1]).
  std::vector<std::int32_t> indptr;
  /// Every sequence's pages in position order (released ones as null_block).
  std::vector<std::int32_t> indices;
  /// [B], each in [1, page_size]: tokens in the sequence's last page.
  std::vector<std::int32_t> last_page_len;
  /// [B]: tokens each sequence holds (MLA's kv_len).
  std::vector<std::int32_t> kv_len;
  /// The page size (kernel block size) the values assume.
  std::size_t page_size = 0;
};

/// Group `group`'s FlashInfer description of `batch`: seq_len = page_size *
/// (pages - 1) + last_page_len for every sequence. Errors as
/// build_block_table_rows (no row width).
FlashInferPages build_flashinfer_pages(std::span<const BatchSequence> batch, std::size_t group,
                                       const KernelBlocks& kernel);

}  // namespace kvport
