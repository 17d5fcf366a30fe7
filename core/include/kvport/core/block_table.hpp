// SPDX-License-Identifier: Apache-2.0
// BlockTable: one sequence's blocks, with fork and copy-on-write.
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>
#include <vector>

#include "kvport/core/block_hash.hpp"
#include "kvport/core/hybrid_block_table.hpp"
#include "kvport/core/paged_kv_cache.hpp"
#include "kvport/core/prefix_hit_mode.hpp"
#include "kvport/platform/stream.hpp"

namespace kvport {

class PrefixCache;

/// The blocks of one sequence (a request, or one branch of a parallel-sampling
/// or beam-search request) and the tokens they hold.
///
/// Over a plain PagedKvCache, or over a PrefixCache: then its blocks come from
/// (and go back to) the prefix cache, every block that fills up is registered
/// under its chained hash, and reuse_cached_prefix() starts a sequence from
/// cached blocks.
///
/// A model of one full-attention group is the one-group case of KV cache
/// groups, and this is that case: a BlockTable is a HybridBlockTable over
/// the cache's one-group view (HybridKvCache::over) with the copy-last-block
/// rule on (HybridBlockTable::set_copy_last_block), given this interface of
/// one block list. Every call below forwards to it; group_table() is that
/// sequence.
///
/// Every block is shared by reference count: fork() gives a child that shares
/// all of them, and the first append into a shared, partly filled last block
/// copies it (copy-on-write) with one batched device copy of all layers, K and
/// V. Full blocks are never written again, so they are never copied.
///
/// Every mutating call gives the strong guarantee: when it throws, the table,
/// the refcounts, the free list and the prefix cache's entries are as they
/// were. (An asynchronous device error in a copy-on-write surfaces at the
/// next synchronize of the stream; the table then already uses the new block,
/// whose contents are undefined, as after any failed device copy.)
///
/// Not thread-safe. The cache (and prefix cache) must outlive the table. The
/// destructor releases every block.
///
/// Work still queued (a copy-on-write copy, the engine's own kernels) when the
/// table releases its blocks or is destroyed: releasing frees no memory (the
/// pools belong to the PagedKvCache, whose destructor waits for the work it
/// queued), so the table neither waits nor needs to. A released block can go
/// to a new owner at once: the new owner's work must be ordered after the
/// queued work, which holds when both use one stream (otherwise record an
/// event or synchronize first), as with any block freed while in flight.
class BlockTable {
 public:
  /// An empty table over `cache`.
  explicit BlockTable(PagedKvCache& cache);
  /// An empty table over `prefix_cache`; `extra_key` (e.g. a LoRA adapter id)
  /// goes into every block hash, so sequences with different keys never share
  /// cached blocks.
  explicit BlockTable(PrefixCache& prefix_cache, std::uint64_t extra_key = 0);
  ~BlockTable() = default;
  BlockTable(const BlockTable&) = delete;
  BlockTable& operator=(const BlockTable&) = delete;
  /// The moved-from table is empty (and can be reused).
  BlockTable(BlockTable&& other) noexcept = default;
  /// Releases this table's blocks first.
  BlockTable& operator=(BlockTable&& other) noexcept = default;

  /// Starts an empty table with the longest cached prefix of full blocks of
  /// `prompt` (PrefixCache::lookup) and returns how many tokens it covers: the
  /// table then holds that many tokens, and the rest of the prompt is appended
  /// with append_tokens. Returns 0 over a plain PagedKvCache. With a
  /// HostTier under the prefix cache the hit continues on the host: those
  /// blocks are copied in (the call waits for that copy) and count as hits;
  /// a failed copy only shortens the hit (host_tier.hpp).
  ///
  /// With prefix_hit_mode() == full the hit is every cached full block (a
  /// multiple of the block size, up to the whole prompt). With the default,
  /// compute_last_token, a hit of the whole prompt (n tokens, block-aligned,
  /// every block cached) is capped at n - 1 tokens:
  ///  - the last block is copied into a fresh block (one batched copy of all
  ///    layers, K and V, on `stream`) and the table holds the copy, refcount 1,
  ///    with block_size - 1 tokens; the engine recomputes one token, whose KV
  ///    goes into the copy's last slot, and the cached block stays untouched.
  ///    Chosen over stopping the hit before that block (vLLM's choice, whose
  ///    hit is n - block_size) because one block copy is cheaper than
  ///    recomputing block_size - 1 tokens, more so for large blocks, and the
  ///    hit the caller sees is the n - 1 an engine expects. Counted in
  ///    copy_on_writes().
  ///  - when no block is free or evictable for the copy, the hit stops before
  ///    the last block instead (n - block_size tokens, the last block's
  ///    reference is given back). This call then does not throw
  ///    CacheExhausted: blocks_needed() of the rest reports the block the
  ///    append needs, so the caller's usual admission check sees the shortage
  ///    where it already handles it.
  ///  - with block_size 1 the hit stops before the last block (that is
  ///    already n - 1 tokens; a copy would hold nothing).
  ///
  /// Throws InvalidArgument when the table is not empty; a backend error of
  /// the copy (BackendError, or InvalidArgument for a bad stream) propagates
  /// with the strong guarantee (the table stays empty, every reference taken
  /// is given back). As for append_tokens, the cached block's reference is
  /// given back as soon as the copy is queued: work that could reuse that
  /// block must be ordered after the copy (same stream, or an event).
  std::size_t reuse_cached_prefix(std::span<const TokenId> prompt, StreamView stream);

  /// As above, with a copy (if any) on the backend's default stream, which
  /// this call then synchronizes, so the copy is complete whatever stream the
  /// caller uses next. An asynchronous error that synchronize reports (the
  /// copy's, or an earlier one still pending on the default stream) is
  /// rethrown (BackendError) with the strong guarantee. Pass a stream to avoid
  /// the wait. The copy reads the cached block on the default stream: work
  /// queued on another stream that writes that block (a zero_blocks of it
  /// before it was cached, the engine's own kernels) must be complete or
  /// ordered before the default stream first; a caller that works on one
  /// stream passes it instead.
  std::size_t reuse_cached_prefix(std::span<const TokenId> prompt);

  /// How reuse_cached_prefix treats a fully cached prompt; compute_last_token
  /// unless set. fork() and moves carry it over; release() keeps it.
  PrefixHitMode prefix_hit_mode() const noexcept { return table_.prefix_hit_mode(); }
  void set_prefix_hit_mode(PrefixHitMode mode) noexcept { table_.set_prefix_hit_mode(mode); }

  /// Appends `tokens`: fills the last block, then allocates blocks as needed
  /// (from the prefix cache, evicting, when there is one). If the last block
  /// is partly filled and shared, it is first copied to a new block on
  /// `stream` (copy-on-write) and the table switches to the copy. Full blocks
  /// are registered in the prefix cache. All or nothing: when the blocks it
  /// needs are not available it throws CacheExhausted before any change.
  void append_tokens(std::span<const TokenId> tokens, StreamView stream);

  /// New blocks appending `num_tokens` would take, copy-on-write included.
  std::size_t blocks_needed(std::size_t num_tokens) const;

  /// A table that shares every block of this one (one inc_ref each) and has
  /// the same tokens.
  BlockTable fork() const;

  /// Releases every block (last block first, so that over a prefix cache the
  /// head of the sequence stays cached longest) and empties the table.
  void release() noexcept;

  std::span<const BlockId> blocks() const noexcept { return table_.group_blocks(0); }
  std::span<const TokenId> tokens() const noexcept { return table_.tokens(); }
  std::size_t num_blocks() const noexcept { return blocks().size(); }
  std::size_t num_tokens() const noexcept { return table_.num_tokens(); }
  bool empty() const noexcept { return table_.empty(); }
  /// Tokens in the last block (block_size when it is full; 0 when empty).
  std::size_t last_block_fill() const noexcept;
  std::size_t block_size() const noexcept { return cache_->config().block_size; }
  /// Copy-on-write copies this table made (append_tokens into a shared
  /// block, and reuse_cached_prefix's copy of a fully cached prompt's last
  /// block).
  std::uint64_t copy_on_writes() const noexcept { return table_.copy_on_writes(); }
  PagedKvCache& kv_cache() const noexcept { return *cache_; }
  /// The prefix cache, or nullptr over a plain PagedKvCache.
  PrefixCache* prefix_cache() const noexcept { return prefix_; }
  /// The sequence over groups this table is: one group, group 0, over
  /// HybridKvCache::over(prefix cache, or cache).
  const HybridBlockTable& group_table() const noexcept { return table_; }

 private:
  BlockTable(HybridBlockTable table, PagedKvCache* cache, PrefixCache* prefix) noexcept;

  HybridBlockTable table_;
  PagedKvCache* cache_;
  PrefixCache* prefix_;
};

}  // namespace kvport
