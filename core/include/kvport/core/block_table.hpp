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
  /// `prompt` (PrefixCache::lookup) and returns how many tokens it covers (a
  /// multiple of the block size). The rest of the prompt is then appended with
  /// append_tokens. Returns 0 over a plain PagedKvCache. Throws InvalidArgument
  /// when the table is not empty.
  std::size_t reuse_cached_prefix(std::span<const TokenId> prompt);

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
  /// Copy-on-write copies this table made.
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
};

}  // namespace kvport
