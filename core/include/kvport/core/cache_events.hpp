// SPDX-License-Identifier: Apache-2.0
// Cache events: what a cache announces when the set of blocks it holds
// changes, in the terms of vLLM's KV events (BlockStored, BlockRemoved,
// AllBlocksCleared), so that cache-aware routers (llm-d, Dynamo, kvport's
// own router) can follow it; and the sink the cache hands them to.
//
// Two forms:
//  - views (BlockStoredView, ...): what the cache passes its sink on the hot
//    path, spans over its own data, nothing allocated;
//  - owning values (BlockStored, ..., CacheEvent): what a publisher keeps,
//    what a decoder of the wire produces and what a router consumes.
// The wire format itself (msgpack over ZeroMQ) belongs to events/.
#pragma once

#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <variant>
#include <vector>

#include "kvport/core/block_hash.hpp"

namespace kvport {

/// Where a block is held: vLLM's `medium` strings.
enum class Medium : std::uint8_t { gpu, cpu, disk };

/// "GPU", "CPU", "DISK".
std::string_view to_string(Medium medium) noexcept;
/// Parses the names of to_string. nullopt if unknown.
std::optional<Medium> parse_medium(std::string_view name) noexcept;

/// The 64-bit block hash events carry: the low 64 bits of kvport's 128-bit
/// block hash (vLLM publishes the low 64 bits of its digest the same way).
inline std::uint64_t event_hash(const BlockHash& hash) noexcept {
  return hash.low;
}

/// Who announces: the medium and, for a cache with KV cache groups, the
/// group. Set once when a sink is installed (a group's prefix cache, a tier).
struct EventSource {
  Medium medium = Medium::gpu;
  /// The group's index, its spec kind (to_string(LayerKind): "full_attention",
  /// "mla_attention", "sliding_window", "chunked_local", "mamba") and window;
  /// absent for a cache without groups.
  std::optional<std::uint32_t> group_idx;
  std::optional<std::string> spec_kind;
  std::optional<std::uint32_t> sliding_window;

  friend bool operator==(const EventSource&, const EventSource&) = default;
};

/// Blocks that became cached: `hashes` are consecutive blocks of one
/// sequence, `parent` the block before the first (absent for a sequence's
/// first block), `tokens` all tokens of the blocks (hashes.size() *
/// block_size), `lora_name` the adapter (absent: none).
struct BlockStoredView {
  std::span<const BlockHash> hashes;
  std::optional<BlockHash> parent;
  std::span<const TokenId> tokens;
  std::uint32_t block_size = 0;
  std::optional<std::string_view> lora_name;
  /// The extra key the blocks' hashes were chained with (BlockTable's
  /// extra_key: an adapter or other id that changes the KV; 0 for none). The
  /// hashes already include it; a router that rehashes `tokens` cannot see it,
  /// so a publisher passes it on (vLLM's extra_keys) where it is not 0.
  std::uint64_t extra_key = 0;
};

/// What a registered block holds beside its hash: what a BlockStored event
/// announces (below). For a run of blocks (PrefixCache::insert_run)
/// `parent` is the block before the first and `tokens` covers every block.
struct BlockOrigin {
  /// The hash of the block before (absent: a sequence's first block).
  std::optional<BlockHash> parent;
  /// The block's tokens, tokens_per_block() of them per block; empty: not known (the
  /// block is announced without tokens).
  std::span<const TokenId> tokens;
  /// The extra key the hash was chained with (0: none).
  std::uint64_t extra_key = 0;
};

/// The view of blocks `hashes` (of `block_size` tokens each) registered
/// with `origin`; nullptr: announced bare, without parent, tokens or extra
/// key.
inline BlockStoredView stored_view(std::span<const BlockHash> hashes, std::uint32_t block_size,
                                   const BlockOrigin* origin = nullptr) noexcept {
  BlockStoredView view;
  view.hashes = hashes;
  view.block_size = block_size;
  if (origin != nullptr) {
    view.parent = origin->parent;
    view.tokens = origin->tokens;
    view.extra_key = origin->extra_key;
  }
  return view;
}

/// Receives a cache's events. Called on the cache's thread, inside its
/// operations: must not throw and must not block (a publisher copies into a
/// bounded buffer and drops, counted, when it is full).
class CacheEventSink {
 public:
  virtual ~CacheEventSink() = default;
  /// Blocks became cached at `source`.
  virtual void stored(const EventSource& source, const BlockStoredView& blocks) noexcept = 0;
  /// Blocks stopped being cached at `source` (evicted, dropped, failed).
  virtual void removed(const EventSource& source, std::span<const BlockHash> hashes) noexcept = 0;
  /// Everything `source` held was dropped at once.
  virtual void cleared(const EventSource& source) noexcept = 0;
};

// ---- owning values ------------------------------------------------------------

/// vLLM's BlockStored (every field of its map form; lora_id, deprecated there,
/// is not kept).
struct BlockStored {
  std::vector<std::uint64_t> block_hashes;
  std::optional<std::uint64_t> parent_block_hash;
  std::vector<TokenId> token_ids;
  std::uint32_t block_size = 0;
  /// "GPU", "CPU", ... as published (a decoder keeps an unknown medium).
  std::string medium = "GPU";
  std::optional<std::string> lora_name;
  std::optional<std::uint32_t> group_idx;
  std::optional<std::string> kv_cache_spec_kind;
  std::optional<std::uint32_t> kv_cache_spec_sliding_window;

  friend bool operator==(const BlockStored&, const BlockStored&) = default;
};

/// vLLM's BlockRemoved.
struct BlockRemoved {
  std::vector<std::uint64_t> block_hashes;
  std::string medium = "GPU";
  std::optional<std::uint32_t> group_idx;

  friend bool operator==(const BlockRemoved&, const BlockRemoved&) = default;
};

/// vLLM's AllBlocksCleared (no fields). kvport adds the medium and group it
/// applies to where a tier or group cleared alone (absent: everything).
struct AllBlocksCleared {
  std::optional<std::string> medium;
  std::optional<std::uint32_t> group_idx;

  friend bool operator==(const AllBlocksCleared&, const AllBlocksCleared&) = default;
};

/// One event.
using CacheEvent = std::variant<BlockStored, BlockRemoved, AllBlocksCleared>;

/// One published batch: vLLM's `[ts, events, data_parallel_rank]`, with the
/// sequence number its message carried.
struct EventBatch {
  std::uint64_t seq = 0;
  double ts = 0;
  std::vector<CacheEvent> events;
  std::optional<std::int64_t> data_parallel_rank;

  friend bool operator==(const EventBatch&, const EventBatch&) = default;
};

}  // namespace kvport
