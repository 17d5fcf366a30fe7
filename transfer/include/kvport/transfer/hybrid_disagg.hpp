// SPDX-License-Identifier: Apache-2.0
// The disaggregation protocol for a hybrid model (a HybridKvCache of several
// KV cache groups): one Agent per group in each process, one PrefillNode or
// DecodeNode per group, and a thin layer that makes a request ONE lease
// across the groups: the decode side reports a request ok only when every
// group's part was pulled and confirmed, then registers every group's blocks
// in the groups' prefix caches; when any group fails, every group's blocks of
// the request are freed and the result is failed (all or nothing).
//
// What moves per group (docs/transfer.md): full attention and MLA every block
// of the sequence; a sliding-window or chunked group only the blocks in its
// window; a state group one slot, the state after the request's tokens.
// Attention kinds are head-sliced across TP ranks; MLA latents and state are
// replicated (every rank holds all of it), so only one prefill rank offers
// them (replica_rank) and each decode rank pulls them from that rank alone.
//
// Neither node is thread-safe; drive each from one thread by calling poll().
#pragma once

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "kvport/core/hybrid_kv_cache.hpp"
#include "kvport/transfer/agent.hpp"
#include "kvport/transfer/disagg.hpp"
#include "kvport/transfer/kv_content.hpp"

namespace kvport::transfer {

/// Whether a group's content is the same on every TP rank (MLA latents, which
/// SGLang too writes from one rank only, and state: kvport treats a state
/// group's slot as replicated, each rank holding the whole state). Such a
/// group's agent uses tp_rank 0 / tp_size 1 on every rank.
bool replicated_group(const KvCacheGroup& group) noexcept;

/// The prefill rank that offers a request's replicated groups:
/// request_id % prefill_tp_size. InvalidArgument for a size of 0.
std::uint32_t replica_rank(std::uint64_t request_id, std::uint32_t prefill_tp_size);

/// The blocks group `group` moves for a sequence of `num_tokens` tokens:
/// full attention and MLA from block 0; a window or chunk group from
/// first_needed_block at the last block boundary, (num_tokens / bs) * bs (the
/// blocks in the window of the next token, and of a prefix hit at the full
/// blocks); a state group one slot. InvalidArgument for 0 tokens or a block
/// index over 32 bits.
LeaseExtent lease_extent(const KvCacheGroup& group, std::size_t block_size, std::size_t num_tokens);

/// One AgentOptions per group of `cache`, a rank's share of the model (the
/// attention groups hold num_kv_heads / tp_size heads each): `base` with
/// name "<base.name>.g<g>", tp_rank/tp_size (0/1 for replicated groups) and
/// `groups` = the whole model's layout groups (attention heads multiplied
/// back by tp_size), so that every group's handshake checks the whole model.
/// InvalidArgument for tp_size 0 or tp_rank >= tp_size.
std::vector<AgentOptions> hybrid_agent_options(const HybridKvCache& cache, std::uint32_t tp_rank,
                                               std::uint32_t tp_size,
                                               const AgentOptions& base = {});

/// A rank's layer specs of a model: attention kinds with num_kv_heads /
/// tp_size heads, MLA, state and none unchanged. InvalidArgument when
/// tp_size is 0 or does not divide an attention layer's heads.
std::vector<LayerSpec> rank_layer_specs(std::span<const LayerSpec> model_layers,
                                        std::uint32_t tp_size);

/// The pool layout of group g's pool as the agent of `options` (its
/// tp_rank/tp_size) would describe it without groups: what write/verify
/// content take.
PoolLayout group_content_layout(const HybridKvCache& cache, std::size_t g,
                                const AgentOptions& options);

/// The token a state slot's content is derived from: a fixed function of
/// every token (the state after them). The slot is written as
/// write_kv_content of this one token.
TokenId state_content_token(std::span<const TokenId> tokens) noexcept;

/// Writes (verifies) the content of `tokens` into group g's `blocks` as the
/// extent says: attention kinds and MLA as write_kv_content from
/// extent.first_block; a state extent one slot of state_content_token.
/// `layout` from group_content_layout. Same errors as write_kv_content.
void write_group_content(const HybridKvCache& cache, std::size_t g, const PoolLayout& layout,
                         std::span<const BlockId> blocks, std::span<const TokenId> tokens,
                         const LeaseExtent& extent, StreamView stream);
ContentCheck verify_group_content(const HybridKvCache& cache, std::size_t g,
                                  const PoolLayout& layout, std::span<const BlockId> blocks,
                                  std::span<const TokenId> tokens, const LeaseExtent& extent,
                                  StreamView stream);

/// The prefill side of a hybrid model: one PrefillNode per group.
class HybridPrefillNode {
 public:
  /// agents[g] registers cache.group_cache(g) (hybrid_agent_options).
  /// tp_rank/tp_size: this rank's place in the prefill TP group (which
  /// requests' replicated groups it offers). Everything must outlive the
  /// node. InvalidArgument for a count of agents other than the groups, a
  /// null agent, or tp_rank >= tp_size.
  HybridPrefillNode(HybridKvCache& cache, std::span<Agent* const> agents, std::uint32_t tp_rank,
                    std::uint32_t tp_size, PrefillOptions options = {});
  ~HybridPrefillNode();
  HybridPrefillNode(const HybridPrefillNode&) = delete;
  HybridPrefillNode& operator=(const HybridPrefillNode&) = delete;

  /// Whether this rank offers group g of `request_id`: every head-sliced
  /// group, a replicated group only on replica_rank(request_id, tp_size).
  bool offers(std::uint64_t request_id, std::size_t g) const;

  /// Offers a request as one lease over the groups this rank offers.
  /// blocks[g]: group g's blocks for lease_extent(group(g), bs, n), filled
  /// with the content of `tokens`; the caller's reference on each passes to
  /// the node (a group this rank does not offer may be empty; its blocks, if
  /// any, are released at once). decode_peers[g]: the decode peers of
  /// agents[g]. Returns false when this rank offers no group of the request
  /// (everything was released; no result will be reported). Throws
  /// InvalidArgument (the caller keeps every reference; nothing is offered)
  /// for lists not one per group, or what PrefillNode::offer throws for any
  /// group.
  bool offer(std::uint64_t request_id, std::uint32_t tp_group,
             std::span<const std::vector<BlockId>> blocks, std::span<const TokenId> tokens,
             std::span<const std::vector<PeerId>> decode_peers);

  /// Polls every group and returns the requests whose lease ended: pulled
  /// when every group's lease was pulled, otherwise the first group's end
  /// that was not (the other groups' leases are then aborted at once, so the
  /// decode side is told they are revoked).
  std::vector<LeaseResult> poll();

  /// Aborts every group's lease of the request. False for an unknown id.
  bool abort(std::uint64_t request_id);

  std::size_t num_groups() const noexcept;
  /// Requests with a lease in some group.
  std::size_t active_leases() const noexcept;
  /// Blocks (slots) group g's leases hold.
  std::size_t held_blocks(std::size_t g) const;
  /// Group g's node (its counters). InvalidArgument out of range.
  const PrefillNode& group_node(std::size_t g) const;

 private:
  struct State;
  std::unique_ptr<State> state_;
};

/// One group's part of a hybrid decode result.
struct HybridGroupResult {
  /// ok: the group's blocks (a state group: its slot), one reference each
  /// for the caller (release through the group's prefix cache); the full
  /// ones (a state slot whose tokens end on a block boundary) are cached.
  std::vector<BlockId> blocks;
  LeaseExtent extent;
  std::uint64_t bytes = 0;
  std::size_t registered = 0;  ///< blocks (checkpoints) inserted in the prefix cache
};

/// A request the hybrid decode side finished.
struct HybridDecodeResult {
  std::uint64_t request_id = 0;
  std::uint32_t tp_group = 0;
  bool ok = false;
  std::string why;  ///< failure: "group g (kind): ..." of the first group that failed
  std::vector<TokenId> tokens;
  /// ok: one entry per group; empty on failure (every group's blocks freed).
  std::vector<HybridGroupResult> groups;
  std::uint64_t bytes = 0;      ///< every group
  double latency_seconds = 0;   ///< the slowest group's
  double transfer_seconds = 0;  ///< the slowest group's
};

struct HybridDecodeCounters {
  std::uint64_t requests_completed = 0;
  std::uint64_t requests_failed = 0;
  /// Group results of a request that had already failed or been aborted
  /// (their blocks were freed).
  std::uint64_t late_results = 0;
  std::uint64_t blocks_registered = 0;  ///< every group, state checkpoints included
};

/// The decode side of a hybrid model: one DecodeNode per group (with
/// register_blocks off), all or nothing across the groups.
class HybridDecodeNode {
 public:
  /// agents[g] registers cache.group_cache(g). `options` go to every group's
  /// node (register_blocks is forced off: this node registers). A request of
  /// which some group reported while another group's node has not heard of
  /// it for assemble_timeout fails ("no lease part").
  HybridDecodeNode(HybridKvCache& cache, std::span<Agent* const> agents,
                   DecodeOptions options = {});
  /// Releases what it holds; every group's node waits for its transfers.
  ~HybridDecodeNode();
  HybridDecodeNode(const HybridDecodeNode&) = delete;
  HybridDecodeNode& operator=(const HybridDecodeNode&) = delete;

  /// Polls every group; returns the requests finished since the last call.
  std::vector<HybridDecodeResult> poll();

  /// Drops a request in every group (refused to the prefill ranks; blocks
  /// freed once no transfer can write them). No result is reported. False
  /// when no group knew it.
  bool abort(std::uint64_t request_id);

  std::size_t num_groups() const noexcept;
  /// Requests some group is assembling, pulling or confirming, or that wait
  /// for the other groups.
  std::size_t pending_requests() const;
  /// Blocks (slots) of group g held for requests not yet reported.
  std::size_t held_blocks(std::size_t g) const;
  const DecodeNode& group_node(std::size_t g) const;
  const HybridDecodeCounters& counters() const noexcept;

 private:
  struct State;
  std::unique_ptr<State> state_;
};

}  // namespace kvport::transfer
