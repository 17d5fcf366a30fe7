// SPDX-License-Identifier: Apache-2.0
// BlockTable: one sequence's blocks, with fork and copy-on-write.
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>
#include <vector>

#include "kvport/core/block_hash.hpp"
#include "kvport/core/paged_kv_cache.hpp"
#include "kvport/platform/stream.hpp"

namespace kvport {

class PrefixCache;

/// How much of a fully cached prompt BlockTable::reuse_cached_prefix may hit.
enum class PrefixHitMode {
  /// The default, for engines: the hit leaves at least the prompt's last token
  /// to compute, since the model must run on at least one token to give the
  /// logits of the next one (vLLM caps its hit at num_tokens - 1 for the same
  /// reason). Only a block-aligned prompt whose every block is cached is
  /// affected: its hit becomes n - 1 tokens, and the last block, which the
  /// recomputed token writes into, is taken as a private copy of the cached
  /// block (copy-on-write), never the shared cached block itself.
  compute_last_token,
  /// Every cached full block is hit, up to the whole prompt, and shared. For
  /// callers that move or inspect KV without computing anything (nothing may
  /// write into a hit block).
  full,
};

/// "compute_last_token" or "full" ("unknown" outside the enum).
const char* to_string(PrefixHitMode mode) noexcept;

/// The blocks of one sequence (a request, or one branch of a parallel-sampling
/// or beam-search request) and the tokens they hold.
///
/// Over a plain PagedKvCache, or over a PrefixCache: then its blocks come from
/// (and go back to) the prefix cache, every block that fills up is registered
/// under its chained hash, and reuse_cached_prefix() starts a sequence from
/// cached blocks.
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
  ~BlockTable();
  BlockTable(const BlockTable&) = delete;
  BlockTable& operator=(const BlockTable&) = delete;
  /// The moved-from table is empty (and can be reused).
  BlockTable(BlockTable&& other) noexcept;
  /// Releases this table's blocks first.
  BlockTable& operator=(BlockTable&& other) noexcept;

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
  PrefixHitMode prefix_hit_mode() const noexcept { return hit_mode_; }
  void set_prefix_hit_mode(PrefixHitMode mode) noexcept { hit_mode_ = mode; }

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

  std::span<const BlockId> blocks() const noexcept { return blocks_; }
  std::span<const TokenId> tokens() const noexcept { return tokens_; }
  std::size_t num_blocks() const noexcept { return blocks_.size(); }
  std::size_t num_tokens() const noexcept { return tokens_.size(); }
  bool empty() const noexcept { return blocks_.empty(); }
  /// Tokens in the last block (block_size when it is full; 0 when empty).
  std::size_t last_block_fill() const noexcept;
  std::size_t block_size() const noexcept { return block_size_; }
  /// Copy-on-write copies this table made (append_tokens into a shared
  /// block, and reuse_cached_prefix's copy of a fully cached prompt's last
  /// block).
  std::uint64_t copy_on_writes() const noexcept { return copy_on_writes_; }
  PagedKvCache& kv_cache() const noexcept { return *cache_; }
  /// The prefix cache, or nullptr over a plain PagedKvCache.
  PrefixCache* prefix_cache() const noexcept { return prefix_; }

 private:
  // What appending n tokens takes: new blocks past the last one, and whether
  // the shared, partly filled last block must be copied first.
  struct AppendPlan {
    std::size_t fresh_blocks = 0;
    bool copy_on_write = false;
    std::size_t blocks() const noexcept { return fresh_blocks + (copy_on_write ? 1 : 0); }
  };

  BlockTable(PagedKvCache* cache, PrefixCache* prefix, std::uint64_t extra_key);
  AppendPlan plan_append(std::size_t num_tokens) const;
  std::size_t available_blocks() const noexcept;
  BlockId alloc_one();
  void release_one(BlockId block) noexcept;
  void register_full_blocks() noexcept;
  std::size_t reuse_cached_prefix(std::span<const TokenId> prompt, StreamView stream,
                                  bool wait_for_copy);

  PagedKvCache* cache_;
  PrefixCache* prefix_;
  std::uint64_t extra_key_;
  std::size_t block_size_;
  std::vector<BlockId> blocks_;
  std::vector<TokenId> tokens_;
  /// Chained hashes of the first hashes_.size() full blocks (prefix cache
  /// only).
  std::vector<BlockHash> hashes_;
  /// The prompt reuse_cached_prefix hashed and its full-block hashes: when
  /// append_tokens fills those blocks with the same tokens, their hashes are
  /// taken from here instead of hashed again. Cleared at the first mismatch.
  std::vector<TokenId> prompt_;
  std::vector<BlockHash> prompt_hashes_;
  std::uint64_t copy_on_writes_ = 0;
  PrefixHitMode hit_mode_ = PrefixHitMode::compute_last_token;
};

}  // namespace kvport
