// SPDX-License-Identifier: Apache-2.0
// Transport: the wire under an Agent. One implementation today (UCX's UCP:
// RMA with memory keys for block data, active messages for the control
// path); the interface is small so an NCCL/RCCL transport can be added for
// GPU clusters. Not thread-safe: the Agent serializes every call under its
// own lock, and callbacks run inside progress().
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "kvport/platform/memory_kind.hpp"

namespace kvport::transfer {

/// A connection's handle inside one transport (never reused).
using ConnId = std::uint64_t;

/// Where registered memory lives: the platform's vocabulary, which a Backend
/// reports for its allocations (Backend::memory_kind).
using MemoryKind = kvport::MemoryKind;
/// "host", "cuda", "rocm".
std::string_view to_string(MemoryKind kind) noexcept;

/// Which way a transfer moves bytes, seen from the side that posts it: read
/// brings the peer's bytes into our memory, write sends ours to the peer.
enum class Direction : std::uint8_t { read, write };
/// "read", "write".
std::string_view to_string(Direction direction) noexcept;

/// One contiguous one-sided operation: `bytes` between a local address and a
/// remote address, both inside registered memory.
struct RmaOp {
  std::uint64_t local = 0;
  std::uint64_t remote = 0;
  std::uint64_t bytes = 0;
};

/// What a transport reports to its owner (called from progress() or, for
/// errors found at a call, from that call).
struct TransportEvents {
  /// A peer connected to our listener.
  std::function<void(ConnId)> on_accept;
  /// A message arrived on a connection.
  std::function<void(ConnId, std::span<const std::uint8_t>)> on_message;
  /// A connection failed (peer gone, refused, unreachable); `why` is one line.
  /// After it no message arrives on that connection.
  std::function<void(ConnId, const std::string& why)> on_error;
};

class Transport {
 public:
  virtual ~Transport() = default;
  /// "ucx" and the transports it may use, e.g. "ucx (tcp, cma, posix)".
  virtual std::string description() const = 0;
  /// Whether memory of `kind` can be registered directly (GPUDirect for
  /// cuda/rocm); false means the agent stages it through pinned host memory.
  virtual bool supports(MemoryKind kind) const noexcept = 0;

  /// Listens on `host:port` (port 0: any); returns the bound "host:port".
  virtual std::string listen(const std::string& host, std::uint16_t port) = 0;
  /// Starts connecting; the connection is usable at once (messages queue) and
  /// fails through on_error.
  virtual ConnId connect(const std::string& host, std::uint16_t port) = 0;
  /// This process's transport address for connect_to (opaque bytes a peer
  /// receives through the handshake).
  virtual std::vector<std::uint8_t> local_address() = 0;
  /// Connects to a peer's local_address() for one-sided operations. UCX
  /// picks shared memory and cross-memory attach (CMA) for a peer on the same
  /// host only on such a connection, not on one made through a listener, and
  /// only without peer error handling (`peer_errors` false): such a
  /// connection reports no failure and can only be closed with a flush.
  /// Messages are not received on it. Fails through on_error.
  virtual ConnId connect_to(std::span<const std::uint8_t> address, bool peer_errors) = 0;
  /// Closes a connection; `force` cancels its outstanding operations (their
  /// completions report an error). Idempotent. `done` runs once the
  /// transport no longer touches memory for this connection.
  virtual void close(ConnId conn, bool force, std::function<void()> done) = 0;

  /// Registers [base, base + bytes) of `kind`; returns the bytes a peer
  /// needs to access it (a packed remote key).
  virtual std::vector<std::uint8_t> register_memory(std::uint64_t base, std::uint64_t bytes,
                                                    MemoryKind kind) = 0;
  /// Makes a peer's packed key usable on `conn`; returns a handle for post().
  virtual std::uint64_t import_remote_key(ConnId conn, std::span<const std::uint8_t> key) = 0;

  /// Sends a message (copied before return; delivered in order per
  /// connection).
  virtual void send(ConnId conn, std::span<const std::uint8_t> message) = 0;

  /// Posts reads (Direction::read: remote -> local) or writes (local ->
  /// remote), as the agent was asked, never inverted at this seam; `remote_key`
  /// of each op from import_remote_key. `done(ok, why)` runs exactly once,
  /// when every op is final (for writes: remotely complete); ops already
  /// posted are never abandoned, so memory stays in use until `done`.
  virtual void post(ConnId conn, Direction direction, std::span<const RmaOp> ops,
                    std::span<const std::uint64_t> remote_keys,
                    std::function<void(bool ok, const std::string& why)> done) = 0;

  /// Posts like post(), on the wire library's own operations only (for UCX:
  /// UCX's, never the transport's direct copies between processes on one
  /// host): the baseline a raw figure measures. By default post().
  virtual void post_baseline(ConnId conn, Direction direction, std::span<const RmaOp> ops,
                             std::span<const std::uint64_t> remote_keys,
                             std::function<void(bool ok, const std::string& why)> done) {
    post(conn, direction, ops, remote_keys, std::move(done));
  }

  /// What the connection uses (for UCX: its lanes and transports, as
  /// ucp_ep_print_info prints them); empty for an unknown connection.
  virtual std::string connection_info(ConnId conn) = 0;

  /// Makes progress; returns true when something happened.
  virtual bool progress() = 0;

  /// A file descriptor that becomes readable when the transport has work
  /// (after arm() said true), or -1 when the transport has none: then the
  /// owner polls progress() on a timer.
  virtual int event_fd() const noexcept = 0;
  /// Prepares event_fd() for a wait; false when events are already pending
  /// (call progress() instead of waiting).
  virtual bool arm() = 0;
};

/// The UCX (UCP) transport. `events` must outlive it.
std::unique_ptr<Transport> make_ucx_transport(const TransportEvents& events);

}  // namespace kvport::transfer
