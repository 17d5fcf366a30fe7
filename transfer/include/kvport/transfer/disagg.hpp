// SPDX-License-Identifier: Apache-2.0
// The disaggregation protocol over an Agent: a prefill node holds a request's
// blocks under a lease offered to the decode ranks; each decode rank
// allocates its own blocks (all or nothing), pulls its heads' share from
// every prefill rank that holds some, tells them, and registers the blocks
// in its prefix cache once every prefill rank confirmed its lease was still
// valid; the prefill side then releases its blocks (tail first, so they stay
// cached). docs/transfer.md has the messages, the states and the failure
// table.
//
// Neither node is thread-safe (nor are the caches under them); drive each
// from one thread by calling poll() regularly.
#pragma once

#include <chrono>
#include <cstdint>
#include <map>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "kvport/core/block_hash.hpp"
#include "kvport/core/prefix_cache.hpp"
#include "kvport/transfer/agent.hpp"

namespace kvport::transfer {

/// Notification kinds the protocol uses (Notification::kind).
enum class DisaggKind : std::uint32_t {
  lease =
      1,  ///< prefill -> decode: blocks held for a request (payload: lease id, group, ttl, tokens)
  pulled = 2,   ///< decode -> prefill: the pull of this lease completed
  confirm = 3,  ///< prefill -> decode: the lease was valid when pulled; blocks released
  revoked = 4,  ///< prefill -> decode: unknown lease (expired, aborted): discard what you pulled
  refused = 5,  ///< decode -> prefill: will not pull this lease (failed, aborted, no room)
};

/// How a prefill lease ended.
enum class LeaseEnd : std::uint8_t {
  pulled,     ///< every decode rank pulled and was confirmed
  refused,    ///< a decode rank refused it (its transfer failed, it aborted, no room)
  expired,    ///< the deadline passed before every decode rank answered
  peer_lost,  ///< a decode rank it waited for was lost
  aborted,    ///< PrefillNode::abort
};
std::string_view to_string(LeaseEnd end) noexcept;

/// Which part of a request's sequence a lease's blocks are. The default, the
/// whole sequence, is what every earlier build sends (the lease payload
/// without an extension); anything else adds a versioned extension to the
/// payload (docs/transfer.md), which an earlier decode side drops (the lease
/// then expires: fail closed).
struct LeaseExtent {
  /// The blocks are the sequence's blocks [first_block, ceil(n / block_size))
  /// (a window or chunk group holds only the blocks in its window).
  std::uint32_t first_block = 0;
  /// The blocks are one state slot: a state group's state after every token
  /// (first_block is then 0).
  bool state = false;

  friend bool operator==(const LeaseExtent&, const LeaseExtent&) = default;
};

struct PrefillOptions {
  /// A lease not answered within this is expired and its blocks freed.
  std::chrono::milliseconds lease_ttl{10000};
};

struct PrefillCounters {
  std::uint64_t leases_offered = 0;
  std::uint64_t leases_pulled = 0;
  std::uint64_t leases_refused = 0;
  std::uint64_t leases_expired = 0;
  std::uint64_t leases_lost = 0;  ///< ended because a decode peer was lost
  std::uint64_t leases_aborted = 0;
  std::uint64_t late_notifications = 0;  ///< about a lease that had already ended
  std::uint64_t peers_lost = 0;          ///< decode peers the agent reported lost
};

/// A finished lease, as PrefillNode::poll reports it.
struct LeaseResult {
  std::uint64_t request_id = 0;
  LeaseEnd end = LeaseEnd::pulled;
};

/// The prefill side.
class PrefillNode {
 public:
  /// `agent` and `cache` (the prefix cache over the agent's PagedKvCache) must
  /// outlive the node.
  PrefillNode(Agent& agent, PrefixCache& cache, PrefillOptions options = {});
  /// Releases every block still held (the peers' later messages find no
  /// lease).
  ~PrefillNode();
  PrefillNode(const PrefillNode&) = delete;
  PrefillNode& operator=(const PrefillNode&) = delete;

  /// Offers `blocks` (filled with the KV of `tokens`; the caller's one
  /// reference on each passes to the node) to each of `decode_peers`, which
  /// must all be connected. `group` names this prefill TP group (its ranks
  /// offer the same request with the same group). `extent` says which blocks
  /// of the sequence these are (default: all of them). Throws InvalidArgument
  /// (the caller keeps its references) for an empty peer list, a request id
  /// already leased, blocks that do not match the tokens and extent
  /// (ceil(n / block_size) - first_block blocks, first_block below that; one
  /// slot for a state extent), or an unknown or lost peer.
  void offer(std::uint64_t request_id, std::uint32_t group, std::span<const BlockId> blocks,
             std::span<const TokenId> tokens, std::span<const PeerId> decode_peers,
             LeaseExtent extent = {});

  /// Handles notifications and lost peers, expires leases, and returns the
  /// leases that ended since the last call (their blocks are released).
  std::vector<LeaseResult> poll();

  /// Ends the request's lease now and releases its blocks (tail first); they
  /// can be reused at once: a decode rank that pulls them later is told
  /// `revoked` and discards what it read. Returns false for an unknown id.
  bool abort(std::uint64_t request_id);

  /// Every peer the agent reported lost (or closed) to this node, in order.
  const std::vector<PeerId>& lost_peers() const noexcept;

  std::size_t active_leases() const noexcept;
  /// Blocks the leases hold (a block shared by two leases counts twice).
  std::size_t held_blocks() const noexcept;
  const PrefillCounters& counters() const noexcept;

 private:
  struct State;
  std::unique_ptr<State> state_;
};

struct DecodeOptions {
  /// A request whose lease parts are not all here, or which found no room,
  /// this long after its first part arrived is refused.
  std::chrono::milliseconds assemble_timeout{5000};
  /// A pulled request whose confirmations are not all here after this long
  /// fails (and is refused).
  std::chrono::milliseconds confirm_timeout{5000};
  /// Insert a completed request's full blocks into the prefix cache (the
  /// default). false: the result's blocks are only the caller's, nothing is
  /// inserted (HybridDecodeNode registers every group's blocks itself once
  /// every group of the request completed). A state extent is never
  /// inserted by the node: its hash is the model's block chain, which a
  /// state pool (block size 1) does not know.
  bool register_blocks = true;
};

struct DecodeCounters {
  std::uint64_t requests_completed = 0;
  std::uint64_t requests_failed = 0;
  std::uint64_t lease_parts = 0;
  std::uint64_t transfers = 0;
  std::uint64_t bytes_pulled = 0;
  std::uint64_t revoked = 0;             ///< a prefill rank said the lease had ended
  std::uint64_t late_notifications = 0;  ///< about a request this node no longer tracks
  std::uint64_t no_room = 0;             ///< refused: not enough blocks
  std::uint64_t blocks_registered = 0;   ///< full blocks inserted into the prefix cache
  std::uint64_t peers_lost = 0;          ///< prefill peers the agent reported lost
  /// Pulls that ended timed_out, or were abandoned at their deadline.
  std::uint64_t transfers_timed_out = 0;
  /// Pulls the agent gave up on (deadline, lost peer, abort) while the
  /// transport could still write their blocks: the request was reported
  /// failed at once and its blocks quarantined (held, neither cached nor
  /// free) until the transfer ended; and the blocks so quarantined.
  std::uint64_t transfers_abandoned = 0;
  std::uint64_t blocks_quarantined = 0;
};

/// A request the decode side finished, successfully or not.
struct DecodeResult {
  std::uint64_t request_id = 0;
  std::uint32_t group = 0;
  bool ok = false;
  std::string why;  ///< for a failure: the transfer's state, "revoked", "no room", ...
  /// ok: the blocks, held with one reference for the caller (release them
  /// through the prefix cache); the full ones are also cached. Empty on
  /// failure (the node freed them once no transfer could touch them).
  std::vector<BlockId> blocks;
  std::vector<TokenId> tokens;
  /// Which blocks of the sequence `blocks` are (the lease's extent).
  LeaseExtent extent;
  std::uint64_t bytes = 0;
  double transfer_seconds = 0;  ///< first post to last transfer final
  double latency_seconds = 0;   ///< first lease part received to result
};

/// The decode side.
class DecodeNode {
 public:
  DecodeNode(Agent& agent, PrefixCache& cache, DecodeOptions options = {});
  /// Frees what it holds; waits (up to 60 s each; the agent's transfer
  /// timeout bounds them unless the transport holds a closed connection's
  /// memory longer) for in-flight and quarantined transfers to end first,
  /// and keeps (leaks, logged) the blocks of any that did not.
  ~DecodeNode();
  DecodeNode(const DecodeNode&) = delete;
  DecodeNode& operator=(const DecodeNode&) = delete;

  /// Handles lease parts, starts pulls, collects transfer states and
  /// confirmations; returns the requests that finished since the last call.
  std::vector<DecodeResult> poll();

  /// Drops a request: refused to its prefill ranks; its blocks are freed once
  /// no transfer can write them (at once when none is in flight), so a block
  /// reused afterwards never receives a late byte. Returns false for an
  /// unknown id. No result is reported for it.
  bool abort(std::uint64_t request_id);

  /// Every peer the agent reported lost (or closed) to this node, in order.
  const std::vector<PeerId>& lost_peers() const noexcept;

  /// Requests being assembled, pulled or confirmed.
  std::size_t pending_requests() const noexcept;
  /// Whether `request_id` is one of them.
  bool tracks(std::uint64_t request_id) const noexcept;
  /// Their ids, ascending.
  std::vector<std::uint64_t> pending_request_ids() const;
  /// Blocks allocated for requests not yet reported.
  std::size_t held_blocks() const noexcept;
  /// Blocks of abandoned pulls that the transport may still write (see
  /// DecodeCounters::transfers_abandoned); poll() frees them once their
  /// transfers are final.
  std::size_t quarantined_blocks() const noexcept;
  const DecodeCounters& counters() const noexcept;

 private:
  struct State;
  std::unique_ptr<State> state_;
};

}  // namespace kvport::transfer
