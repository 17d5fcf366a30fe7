// SPDX-License-Identifier: Apache-2.0
// Deterministic KV content for checking block transfers without a model: the
// bytes of every (layer, K/V, head, token position) are derived from the
// token id at that position, so a receiver that knows the tokens verifies
// every byte it received.
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>

#include "kvport/core/block_hash.hpp"
#include "kvport/core/paged_kv_cache.hpp"
#include "kvport/platform/stream.hpp"
#include "kvport/transfer/layout.hpp"

namespace kvport::transfer {

/// Writes the content of `tokens` into `blocks` of `cache` (block i holds
/// positions [i * block_size, (i + 1) * block_size); positions past the last
/// token are written as if token id 0): every layer, K and V (K alone for
/// K-only layers), the heads this rank holds as `layout` says (global head =
/// tp_rank * num_kv_heads + local head), data and scale bytes as PoolLayout's
/// head-major order; padding bytes are zero. Byte j of the (layer, kv, global
/// head, position) vector is a fixed function of (token id, layer, kv, global
/// head, position, j): the same on every rank and every TP size, so a TP-2
/// rank's half of a block equals the matching half of the TP-1 block. Copies
/// through host staging on `stream` and waits for them: one pinned buffer and
/// one batched host-to-device copy per chunk of up to 64 MiB of whole blocks
/// (one chunk for short lists). Throws InvalidArgument (before any copy) when
/// blocks.size() * block_size < tokens.size(), an id is out of range or listed
/// twice, or `layout` does not describe `cache` (pool_layout(cache,
/// layout.tp_rank, layout.tp_size) != layout). An empty `blocks` does nothing.
///
/// `first_block` > 0 writes the tail of a sequence whose first blocks exist
/// already (a cached prefix): blocks[i] then holds positions
/// [(first_block + i) * block_size, ...) of `tokens`, the whole sequence, and
/// (first_block + blocks.size()) * block_size must cover tokens.size().
void write_kv_content(PagedKvCache& cache, const PoolLayout& layout,
                      std::span<const BlockId> blocks, std::span<const TokenId> tokens,
                      StreamView stream, std::size_t first_block = 0);

/// Result of verify_kv_content.
struct ContentCheck {
  std::uint64_t bytes_checked = 0;
  std::uint64_t bytes_wrong = 0;  ///< data and scale bytes that differ
  bool ok() const noexcept { return bytes_wrong == 0 && bytes_checked > 0; }
};

/// Reads `blocks` back (through host staging on `stream`) and compares every
/// data and scale byte of the heads this rank holds with what
/// write_kv_content writes for `tokens`. Padding is not checked (head-sliced
/// transfers do not move it). Same preconditions and staging as
/// write_kv_content (one batched device-to-host copy per chunk); an empty `blocks`
/// checks nothing (ok() is false).
ContentCheck verify_kv_content(PagedKvCache& cache, const PoolLayout& layout,
                               std::span<const BlockId> blocks, std::span<const TokenId> tokens,
                               StreamView stream, std::size_t first_block = 0);

}  // namespace kvport::transfer
