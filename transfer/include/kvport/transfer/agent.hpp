// SPDX-License-Identifier: Apache-2.0
// Agent: one per process. It registers a PagedKvCache's pools with the
// transport, listens and connects, exchanges pool layouts at a handshake that
// rejects incompatible peers (naming the field), moves block lists (one
// request for the whole list), tracks each transfer to a final state, sends
// small notifications, and watches its peers (a lost peer fails its pending
// transfers within `peer_timeout`). docs/transfer.md has the states and the
// failure table.
#pragma once

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "kvport/core/paged_kv_cache.hpp"
#include "kvport/platform/error.hpp"
#include "kvport/transfer/layout.hpp"
#include "kvport/transfer/transport.hpp"

namespace kvport::transfer {

/// A connection or handshake failed (refused, unreachable, incompatible peer,
/// timed out). The message is one line.
class TransferError : public Error {
 public:
  using Error::Error;
};

/// A transfer's state. pending until final; the final states are sticky.
enum class TransferState : std::uint8_t {
  pending,
  done,       ///< every byte landed (reads: in our blocks; writes: in the peer's)
  peer_lost,  ///< the peer failed or stopped answering; no byte lands after this
  timed_out,  ///< not final within the transfer timeout; the connection was reset
  cancelled,  ///< cancel() was called; no byte lands after this
  failed,     ///< the transport reported an error (the message is in `why`)
};
std::string_view to_string(TransferState state) noexcept;
constexpr bool is_final(TransferState s) noexcept {
  return s != TransferState::pending;
}

/// How the cache's memory reaches the transport.
enum class MemoryPath : std::uint8_t {
  direct,  ///< registered as it is (host memory; device memory with a GPU-enabled UCX)
  staged,  ///< through a pinned host mirror of the pools (copies on the cache's backend)
};
std::string_view to_string(MemoryPath path) noexcept;

/// Handle of a connected peer (an index; never reused by one agent).
using PeerId = std::uint32_t;
/// Handle of a posted transfer (never reused by one agent).
using TransferId = std::uint64_t;

/// A small message between agents: a request id, block ids, an application
/// `kind` and opaque bytes (at most kMaxNotificationBytes in all).
struct Notification {
  PeerId peer = 0;
  std::uint64_t request_id = 0;
  std::uint32_t kind = 0;
  std::vector<BlockId> blocks;
  std::vector<std::uint8_t> payload;
};
inline constexpr std::size_t kMaxNotificationBytes = 4u << 20;

struct AgentOptions {
  /// A name for logs and the peer's PeerInfo.
  std::string name = "kvport";
  /// This cache's place in its tensor-parallel group (head slicing).
  std::uint32_t tp_rank = 0;
  std::uint32_t tp_size = 1;
  /// A peer not heard from for this long is lost: its pending transfers end
  /// peer_lost and its connection is closed. Heartbeats go out every
  /// peer_timeout / 8. A connection to our listener whose hello has not
  /// arrived (or was malformed) this long after it connected is closed.
  std::chrono::milliseconds peer_timeout{2000};
  /// A transfer not final after this long ends timed_out (its connection is
  /// reset so that no byte lands later).
  std::chrono::milliseconds transfer_timeout{30000};
  /// nullopt: direct when the transport can register the cache's memory kind,
  /// staged otherwise. staged on host memory is for testing the staging path.
  std::optional<MemoryPath> memory_path;
  /// Bytes of a registered contiguous scratch buffer (pinned host) for the
  /// raw-bandwidth baseline (read_scratch); 0: none.
  std::size_t scratch_bytes = 0;
  /// More host memory to register and offer to peers (a HostTier's slots,
  /// HostTier::slot_memory(), or any pinned host range), moved with
  /// post_ranges(). Each must stay valid for the agent's lifetime.
  std::vector<std::span<std::byte>> host_regions;
  /// A hybrid model's KV cache groups (layout_groups of its HybridKvCache's
  /// groups), when the cache is one group's pool: the handshake carries them
  /// and a peer must list the same (incompatibility() names the first group
  /// and field that differ). Empty: the cache is the whole model, one
  /// full-attention group. Checked at construction as a peer would decode
  /// them.
  std::vector<LayoutGroup> groups;
  /// Makes the agent's transport from the agent's event handlers (which the
  /// transport calls as TransportEvents says, and must not outlive: the
  /// agent destroys the transport before them). Empty: UCX
  /// (make_ucx_transport). For tests and fault drills: a decorator over the
  /// UCX transport that injects submission failures, failed or partial
  /// completions, stalls, lost messages and dropped connections
  /// (tests/unit/transfer/fault_transport.hpp). The Agent constructor throws
  /// what the factory throws, and InvalidArgument when it returns null.
  std::function<std::unique_ptr<Transport>(const TransportEvents&)> transport_factory;
};

/// One contiguous copy of post_ranges(): `bytes` between our address `local`
/// and the peer's address `remote`.
struct RangeCopy {
  std::uint64_t local = 0;
  std::uint64_t remote = 0;
  std::uint64_t bytes = 0;
};

/// What a peer said about itself at the handshake.
struct PeerInfo {
  PeerId id = 0;
  std::string name;
  PoolLayout layout;
  bool connected = false;  ///< false once lost or closed
};

/// Counters since construction.
struct AgentCounters {
  std::uint64_t transfers_posted = 0;
  std::uint64_t transfers_done = 0;
  std::uint64_t transfers_failed = 0;  ///< peer_lost, timed_out or failed
  std::uint64_t transfers_cancelled = 0;
  std::uint64_t regions_posted = 0;  ///< contiguous operations after merging
  std::uint64_t bytes_read = 0;      ///< of done reads
  std::uint64_t bytes_written = 0;   ///< of done writes
  std::uint64_t notifications_sent = 0;
  std::uint64_t notifications_received = 0;
  std::uint64_t malformed_messages = 0;  ///< dropped, counted
  std::uint64_t peers_lost = 0;
  /// Either side's; also a connection to our listener that sent no usable
  /// hello within peer_timeout (closed).
  std::uint64_t handshakes_rejected = 0;
};

/// Moves a PagedKvCache's blocks to and from peer agents. Thread-safe: every
/// call takes the agent's lock; a progress thread the agent owns drives the
/// transport, heartbeats and timeouts. The cache must outlive the agent and
/// its pools are registered for the agent's lifetime.
class Agent {
 public:
  /// Registers `cache` (pool layout from options.tp_rank/tp_size; memory of
  /// the kind its backend reports, Backend::memory_kind) and starts the
  /// progress thread. Throws InvalidArgument for bad options (a name over
  /// 64 KiB included), TransferError when the transport cannot start.
  Agent(PagedKvCache& cache, AgentOptions options = {});
  /// Cancels pending transfers and waits (bounded by peer_timeout) until the
  /// transport no longer touches the pools, closes every connection, stops
  /// the thread. Never throws.
  ~Agent();
  Agent(const Agent&) = delete;
  Agent& operator=(const Agent&) = delete;

  /// Listens on "host:port" (port 0 picks one); returns the bound "host:port"
  /// to give peers. Throws InvalidArgument for a malformed address,
  /// TransferError when it cannot listen (address in use, not local).
  std::string listen(const std::string& address);

  /// Connects and handshakes; returns the peer once both sides accepted each
  /// other's layouts. Throws InvalidArgument for a malformed address and
  /// TransferError (one line) for a refused or unreachable address, a peer
  /// that did not answer within `timeout`, or an incompatible peer (the
  /// message names the field, e.g. "num_layers differs: 32 here, 16 on the
  /// peer").
  PeerId connect(const std::string& address,
                 std::chrono::milliseconds timeout = std::chrono::seconds(10));

  /// Peers that connected to us or we to them, in handshake order.
  std::vector<PeerId> peers() const;
  /// nullopt for an unknown id.
  std::optional<PeerInfo> peer(PeerId id) const;
  /// How the connection to `id` is carried (UCX lanes and transports, for
  /// diagnostics); empty for an unknown or closed peer.
  std::string peer_transport(PeerId id) const;
  /// This agent's layout (what peers see).
  const PoolLayout& layout() const noexcept { return layout_; }
  MemoryPath memory_path() const noexcept { return memory_path_; }
  /// The transport and what it may use, e.g. "ucx 1.13.1 (tcp, cma, posix)".
  std::string transport_description() const;

  /// Reads (Direction::read: peer's remote_blocks -> our local_blocks) or
  /// writes (our local_blocks -> peer's remote_blocks) the heads both sides hold of
  /// every layer, K and V, as ONE transfer. local_blocks[i] pairs with
  /// remote_blocks[i]. An empty list is done at once. Throws InvalidArgument
  /// (nothing posted) for an unknown or lost peer, lists of different
  /// lengths, out-of-range ids, or a local block that is free (refcount 0).
  /// The caller keeps the local blocks allocated until the transfer is
  /// final; with staging, a write first copies them to the mirror and a read
  /// copies the mirror to them before it is done.
  TransferId post(PeerId peer, Direction direction, std::span<const BlockId> local_blocks,
                  std::span<const BlockId> remote_blocks);

  /// Reads (peer -> us) or writes (us -> peer) arbitrary byte ranges as ONE
  /// transfer: each local range must lie in memory this agent registered
  /// (host_regions, the scratch buffer, or the cache's pools with direct
  /// memory), each remote range in memory the peer offered. Throws
  /// InvalidArgument (nothing posted) otherwise, or for an unknown or lost
  /// peer or an empty range. For block lists use post(), which plans the
  /// ranges from the two layouts.
  TransferId post_ranges(PeerId peer, Direction direction, std::span<const RangeCopy> ranges);

  /// The transfer's state. Throws InvalidArgument for an unknown (or
  /// released) id.
  TransferState poll(TransferId id) const;
  /// Waits until final or `timeout`; returns the state then.
  TransferState wait(TransferId id, std::chrono::milliseconds timeout) const;
  /// One line on why a transfer failed (empty unless failed/peer_lost/timed_out,
  /// or abandoned()).
  std::string why(TransferId id) const;
  /// For a pending transfer the agent has given up on (it passed its
  /// deadline, its peer was lost, or cancel() was called) whose memory the
  /// transport may still write (its connection's close has not completed):
  /// the state it will end in (timed_out, peer_lost or cancelled); the
  /// caller may report the request failed now but must keep the memory
  /// until poll() says final. nullopt for a transfer still running or final.
  /// Throws InvalidArgument for an unknown (or released) id.
  std::optional<TransferState> abandoned(TransferId id) const;
  /// Bytes the transfer moves (its merged regions).
  std::uint64_t bytes(TransferId id) const;
  /// When the transfer was posted and when it became final (equal to posted
  /// while pending), as the agent saw them.
  struct Times {
    std::chrono::steady_clock::time_point posted;
    std::chrono::steady_clock::time_point finished;
  };
  Times times(TransferId id) const;
  /// Requests cancellation. The state becomes cancelled once the transport
  /// no longer touches the local blocks (at once when nothing is in flight);
  /// until then poll() says pending. No effect on a final transfer.
  void cancel(TransferId id);
  /// Forgets a final transfer. Throws InvalidArgument when it is pending.
  void release(TransferId id);

  /// Sends a notification (queued; ordered per peer). Throws InvalidArgument
  /// for an unknown or lost peer or a message over kMaxNotificationBytes.
  void notify(PeerId peer, std::uint64_t request_id, std::uint32_t kind,
              std::span<const BlockId> blocks, std::span<const std::uint8_t> payload = {});
  /// Notifications received since the last call, in arrival order.
  std::vector<Notification> take_notifications();
  /// Peers lost since the last call (each once).
  std::vector<PeerId> take_lost_peers();
  /// Waits until a notification or a lost peer is waiting, or `timeout`.
  bool wait_event(std::chrono::milliseconds timeout) const;

  /// With staging: copies our `blocks` to the mirror so a peer's read sees
  /// them (call after the blocks were written, before offering them). With
  /// direct memory: nothing. Blocks until the copy is done.
  void publish(std::span<const BlockId> blocks);

  /// The raw-bandwidth baseline: reads `bytes` of the peer's scratch buffer
  /// into ours as ONE contiguous operation and returns the seconds it took
  /// from post to final. Throws InvalidArgument when either scratch buffer is
  /// smaller than `bytes`, TransferError when the read fails.
  double read_scratch(PeerId peer, std::size_t bytes);

  AgentCounters counters() const;

 private:
  struct State;
  PoolLayout layout_;
  MemoryPath memory_path_ = MemoryPath::direct;
  std::unique_ptr<State> state_;
};

}  // namespace kvport::transfer
