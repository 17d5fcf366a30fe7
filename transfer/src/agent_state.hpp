// SPDX-License-Identifier: Apache-2.0
// Agent::State: what an Agent holds behind its pimpl, shared by the files
// that implement it. One lock guards everything; the progress thread and the
// callers take it in turn, and transport callbacks run with it held.
//   agent.cpp      peers (liveness, loss), transfers, the progress thread,
//                  the public API
//   handshake.cpp  hello / accept / reject: adopting a peer, reject_incoming
//                  and reject_outgoing
//   staging.cpp    the pinned mirror (Staging), when memory is staged
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <deque>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <unordered_map>
#include <vector>

#include "handshake.hpp"
#include "kvport/platform/host_buffer.hpp"
#include "kvport/transfer/agent.hpp"
#include "messages.hpp"
#include "staging.hpp"
#include "wire_codec.hpp"

namespace kvport::transfer {

struct Agent::State {
  using Clock = std::chrono::steady_clock;

  enum class PeerStatus { handshaking, connected, rejected, lost };

  // A peer's registered range, with the key imported on our connection.
  struct RemoteRegion {
    std::uint64_t base = 0;
    std::uint64_t bytes = 0;
    std::uint64_t key = 0;
  };

  struct Peer {
    PeerId id = 0;
    ConnId conn = 0;  // handshake, notifications, heartbeats
    ConnId data = 0;  // one-sided operations (a connection to the peer's address)
    bool same_host = false;
    bool transfers_ended = false;  // after a loss: its transfers are final
    PeerStatus status = PeerStatus::handshaking;
    bool outgoing = false;
    std::string address;
    std::string why;  // rejection or loss
    Hello hello;
    std::vector<RemoteRegion> regions;
    std::optional<RemoteRegion> scratch;
    Clock::time_point since = Clock::now();  // the connection's start (handshake deadline)
    Clock::time_point last_heard = Clock::now();
    Clock::time_point last_sent = Clock::now();
  };

  struct Transfer {
    PeerId peer = 0;
    Direction direction = Direction::read;
    TransferState state = TransferState::pending;
    std::optional<TransferState> fail_as;  // set when the peer was lost / timed out
    bool cancel_requested = false;
    std::string why;
    std::uint64_t bytes = 0;
    Clock::time_point posted;
    Clock::time_point deadline;
    Clock::time_point finished;
    std::vector<HostCopyRegion> stage_in;  // mirror -> device after a staged read
  };

  Agent& agent;
  PagedKvCache& cache;
  AgentOptions options;
  std::uint64_t uuid = 0;

  mutable std::mutex mutex;
  mutable std::condition_variable changed;
  TransportEvents events;
  std::unique_ptr<Transport> transport;

  PoolAddresses device_pools;  // the cache's own addresses
  PoolAddresses wire_pools;    // what peers address (device_pools, or the mirror's)
  std::vector<Region> regions;
  std::optional<Staging> staging;  // with MemoryPath::staged
  HostBuffer scratch_storage;
  std::uint64_t scratch_base = 0;
  // A read into the scratch buffer abandoned while pending (its peer was
  // lost, or it passed its deadline): the buffer is not read into again
  // until that transfer ended (the peer can no longer write it).
  std::optional<TransferId> abandoned_scratch_read;
  std::vector<std::uint8_t> address;  // the transport's, sent at the handshake
  std::string host = host_identity();

  std::map<PeerId, Peer> peers;
  std::unordered_map<ConnId, PeerId> by_conn;
  PeerId next_peer = 0;
  std::unordered_map<TransferId, Transfer> transfers;
  TransferId next_transfer = 0;
  std::deque<Notification> inbox;
  std::deque<PeerId> lost;
  AgentCounters counters;
  bool listening = false;

  std::atomic<bool> stop{false};
  std::thread thread;

  State(Agent& a, PagedKvCache& c, AgentOptions o);

  // ---- setup (agent.cpp) ---------------------------------------------------------
  void register_memory(MemoryKind kind);
  // Whether [addr, addr + bytes) lies in memory we registered (host memory
  // only: with staging the device pools are not the transport's).
  bool local_registered(std::uint64_t addr, std::uint64_t bytes) const;

  // ---- handshake (handshake.cpp) -------------------------------------------------
  // What our hello/accept says about us.
  Hello self() const;
  std::vector<std::uint8_t> hello_bytes(MsgType type) const;
  void on_hello(Peer& p, wire::Reader& r);
  void on_accept_message(Peer& p, wire::Reader& r);
  void on_reject_message(Peer& p, wire::Reader& r);
  // Opens the data connection, imports the peer's keys on it; after it the
  // peer is connected. Throws (the peer stays unconnected, its data
  // connection closed) when the transport cannot use what the peer sent.
  void adopt(Peer& p, Hello h);
  // We refuse a peer that connected to us: tell it why (with our layout),
  // close.
  void reject_incoming(Peer& p, const std::string& why);
  // We refuse (or were refused by) the peer we connected to: close.
  void reject_outgoing(Peer& p, const std::string& why);

  // ---- peers (agent.cpp) ---------------------------------------------------------
  void send(Peer& p, const std::vector<std::uint8_t>& bytes);
  void on_accept(ConnId conn);
  void on_message(ConnId conn, std::span<const std::uint8_t> bytes);
  void on_error(ConnId conn, const std::string& why);
  void end_transfers(PeerId id, const char* why);
  void reap_dead_peers();
  void close_peer(Peer& p, bool force);
  void lose_peer(Peer& p, const std::string& why, bool count_loss);
  Peer& connected_peer(PeerId id, const char* what);

  // ---- transfers (agent.cpp) -----------------------------------------------------
  void finish(TransferId id, bool ok, const std::string& why);
  const RemoteRegion& remote_region(const Peer& p, std::uint64_t addr, std::uint64_t bytes) const;
  // `baseline`: through Transport::post_baseline (the raw figure).
  TransferId start(Peer& p, Direction direction, std::vector<RmaOp> ops,
                   std::vector<std::uint64_t> keys, std::vector<HostCopyRegion> stage_in,
                   bool baseline = false);
  Transfer& transfer(TransferId id, const char* what);

  // ---- the progress thread (agent.cpp) -------------------------------------------
  void housekeeping(Clock::time_point now);
  bool active() const;
  void run();
};

}  // namespace kvport::transfer
