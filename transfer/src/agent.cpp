// SPDX-License-Identifier: Apache-2.0
// Agent: peers (liveness, loss), transfers, the progress thread and the
// public API over a Transport. What the state holds and which file does what:
// agent_state.hpp. One lock guards everything; the progress thread and the
// callers take it in turn, and transport callbacks run with it held.
#include "kvport/transfer/agent.hpp"

#include <poll.h>
#include <signal.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <random>

#include <fmt/format.h>

#include "agent_state.hpp"
#include "kvport/core/block_regions.hpp"
#include "kvport/platform/log.hpp"

namespace kvport::transfer {

std::string_view to_string(TransferState state) noexcept {
  switch (state) {
    case TransferState::pending:
      return "pending";
    case TransferState::done:
      return "done";
    case TransferState::peer_lost:
      return "peer_lost";
    case TransferState::timed_out:
      return "timed_out";
    case TransferState::cancelled:
      return "cancelled";
    case TransferState::failed:
      return "failed";
  }
  return "unknown";
}

std::string_view to_string(MemoryPath path) noexcept {
  return path == MemoryPath::direct ? "direct" : "staged";
}

std::string_view to_string(Direction direction) noexcept {
  return direction == Direction::read ? "read" : "write";
}

namespace {

using Clock = std::chrono::steady_clock;

std::pair<std::string, std::uint16_t> parse_address(const std::string& address) {
  const auto colon = address.rfind(':');
  if (colon == std::string::npos || colon == 0 || colon + 1 == address.size()) {
    throw InvalidArgument(fmt::format("bad address '{}': expected host:port", address));
  }
  std::string host = address.substr(0, colon);
  if (host.size() > 2 && host.front() == '[' && host.back() == ']')
    host = host.substr(1, host.size() - 2);
  const std::string port_text = address.substr(colon + 1);
  if (port_text.size() > 5 || !std::all_of(port_text.begin(), port_text.end(),
                                           [](char c) { return c >= '0' && c <= '9'; })) {
    throw InvalidArgument(
        fmt::format("bad address '{}': port '{}' is not a number", address, port_text));
  }
  const unsigned long port = std::stoul(port_text);
  if (port > 65535)
    throw InvalidArgument(fmt::format("bad address '{}': port {} > 65535", address, port));
  return {host, static_cast<std::uint16_t>(port)};
}

}  // namespace

Agent::State::State(Agent& a, PagedKvCache& c, AgentOptions o)
    : agent(a), cache(c), options(std::move(o)) {
  std::random_device rd;
  uuid = (std::uint64_t{rd()} << 32) ^ rd() ^ static_cast<std::uint64_t>(::getpid());
}

// ---- setup -----------------------------------------------------------------------

void Agent::State::register_memory(MemoryKind kind) {
  device_pools = pool_addresses(cache);
  if (agent.memory_path_ == MemoryPath::direct) {
    wire_pools = device_pools;
    // The pools' extents, merged (block-major layers share one allocation).
    for (const DeviceRegion& r : pool_extents(cache.memory_pools())) {
      const std::uint64_t base = r.ptr.address();
      regions.push_back({base, r.bytes, transport->register_memory(base, r.bytes, kind)});
    }
  } else {
    staging.emplace(cache);
    const std::uint64_t base = staging->mirror_base();
    const std::uint64_t bytes = staging->mirror_bytes();
    regions.push_back({base, bytes, transport->register_memory(base, bytes, MemoryKind::host)});
    wire_pools = staging->mirror_addresses(device_pools);
  }
  if (options.scratch_bytes > 0) {
    // Pinned host memory of the cache's backend, like the pools' staging.
    scratch_storage = HostBuffer(cache.backend(), options.scratch_bytes);
    std::memset(scratch_storage.data(), 0, options.scratch_bytes);  // fault the pages in now
    scratch_base = reinterpret_cast<std::uint64_t>(scratch_storage.data());
    regions.push_back(
        {scratch_base, options.scratch_bytes,
         transport->register_memory(scratch_base, options.scratch_bytes, MemoryKind::host)});
  }
  for (std::span<std::byte> r : options.host_regions) {
    if (r.empty()) throw InvalidArgument("Agent: an empty host region");
    const auto base = reinterpret_cast<std::uint64_t>(r.data());
    regions.push_back(
        {base, r.size(), transport->register_memory(base, r.size(), MemoryKind::host)});
  }
  address = transport->local_address();
}

bool Agent::State::local_registered(std::uint64_t addr, std::uint64_t bytes) const {
  for (const Region& r : regions) {
    if (addr >= r.base && bytes <= r.bytes && addr - r.base <= r.bytes - bytes) return true;
  }
  return false;
}

// ---- peers -----------------------------------------------------------------------

void Agent::State::send(Peer& p, const std::vector<std::uint8_t>& bytes) {
  transport->send(p.conn, bytes);
  p.last_sent = Clock::now();
}

void Agent::State::on_accept(ConnId conn) {
  Peer p;
  p.id = ++next_peer;
  p.conn = conn;
  by_conn[conn] = p.id;
  peers.emplace(p.id, std::move(p));
}

void Agent::State::on_message(ConnId conn, std::span<const std::uint8_t> bytes) {
  auto pit = by_conn.find(conn);
  if (pit == by_conn.end()) return;
  Peer& p = peers.at(pit->second);
  p.last_heard = Clock::now();
  try {
    wire::Reader r(bytes, "message");
    switch (read_envelope(r)) {
      case MsgType::hello:
        on_hello(p, r);
        return;
      case MsgType::accept:
        on_accept_message(p, r);
        return;
      case MsgType::reject:
        on_reject_message(p, r);
        return;
      case MsgType::notify:
        if (p.status != PeerStatus::connected) r.fail("notification before the handshake");
        inbox.push_back(parse_notify(r, p.id));
        ++counters.notifications_received;
        return;
      case MsgType::heartbeat:
        return;
      case MsgType::bye:
        lose_peer(p, "the peer closed the connection", false);
        return;
    }
  } catch (const Error& e) {
    ++counters.malformed_messages;
    log::warn(fmt::format("transfer: {} dropped a malformed message from peer {}: {}", options.name,
                          p.id, e.what()));
  }
}

// Ends every pending transfer with the peer (their operations can no longer
// touch our memory).
void Agent::State::end_transfers(PeerId id, const char* why) {
  for (auto& [tid, t] : transfers) {
    if (t.peer == id && t.state == TransferState::pending) {
      if (!t.fail_as && !t.cancel_requested) {
        t.fail_as = TransferState::peer_lost;
        t.why = why;
      }
      finish(tid, false, t.why);
    }
  }
  if (auto it = peers.find(id); it != peers.end()) it->second.transfers_ended = true;
}

// A lost peer on this host whose data connection (no peer error handling)
// cannot be force-closed: once its process is gone nothing can write our
// memory for it any more, except what it already queued in our shared
// memory, which a drain of the worker delivers first. Then its transfers
// end. (A live peer's transfers wait for the flush instead.)
void Agent::State::reap_dead_peers() {
  for (auto& [id, p] : peers) {
    if (p.status != PeerStatus::lost || p.transfers_ended || !p.same_host || p.hello.pid == 0)
      continue;
    if (::kill(static_cast<pid_t>(p.hello.pid), 0) == 0 || errno != ESRCH) continue;
    for (int i = 0; i < 256 && transport->progress(); ++i) {
    }
    end_transfers(id, "the peer's process exited");
  }
}

// Closes both connections. Once the data connection is closed the transport
// no longer touches our memory for this peer, so the peer's pending
// transfers end then, even if their operations never report (UCX does not
// complete an operation on an endpoint without error handling whose peer
// died).
void Agent::State::close_peer(Peer& p, bool force) {
  const PeerId id = p.id;
  auto end = [this, id] { end_transfers(id, "the connection was closed"); };
  if (p.data != 0 && p.data != p.conn) {
    transport->close(p.data, force, end);
    transport->close(p.conn, force, nullptr);
  } else {
    transport->close(p.conn, force, end);
  }
}

void Agent::State::on_error(ConnId conn, const std::string& why) {
  auto pit = by_conn.find(conn);
  if (pit == by_conn.end()) return;
  Peer& p = peers.at(pit->second);
  if (p.status == PeerStatus::handshaking) {
    p.status = PeerStatus::rejected;
    p.why = why;
    transport->close(p.conn, true, nullptr);
    return;
  }
  lose_peer(p, why, true);
}

// The peer is gone: its pending transfers end (with `fail_as`) once the
// forced close has cancelled their operations.
void Agent::State::lose_peer(Peer& p, const std::string& why, bool count_loss) {
  if (p.status != PeerStatus::connected) return;
  p.status = PeerStatus::lost;
  p.why = why;
  if (count_loss) ++counters.peers_lost;
  lost.push_back(p.id);
  for (auto& [id, t] : transfers) {
    if (t.peer == p.id && t.state == TransferState::pending && !t.fail_as) {
      t.fail_as = TransferState::peer_lost;
      t.why = why;
    }
  }
  if (!stop.load(std::memory_order_relaxed)) {
    // A peer that said goodbye is news, not trouble.
    log::write(
        count_loss ? log::Level::warn : log::Level::info,
        fmt::format("transfer: {} lost peer {} ('{}'): {}", options.name, p.id, p.hello.name, why));
  }
  close_peer(p, true);
}

Agent::State::Peer& Agent::State::connected_peer(PeerId id, const char* what) {
  auto it = peers.find(id);
  if (it == peers.end() || it->second.status == PeerStatus::handshaking ||
      it->second.status == PeerStatus::rejected) {
    throw InvalidArgument(fmt::format("{}: unknown peer {}", what, id));
  }
  if (it->second.status != PeerStatus::connected) {
    throw InvalidArgument(fmt::format("{}: peer {} is lost ({})", what, id, it->second.why));
  }
  return it->second;
}

// ---- transfers -------------------------------------------------------------------

// Makes a transfer final (once: a late callback of one ended by its
// connection's close is ignored).
void Agent::State::finish(TransferId id, bool ok, const std::string& why) {
  auto it = transfers.find(id);
  if (it == transfers.end() || it->second.state != TransferState::pending) return;
  Transfer& t = it->second;
  if (ok && !t.fail_as && !t.stage_in.empty()) {
    try {
      staging->from_mirror(t.stage_in);
    } catch (const Error& e) {
      ok = false;
      t.why = fmt::format("staging copy failed: {}", e.what());
      t.fail_as = TransferState::failed;
    }
  }
  t.finished = Clock::now();
  if (t.cancel_requested) {
    t.state = TransferState::cancelled;
    ++counters.transfers_cancelled;
  } else if (t.fail_as) {
    t.state = *t.fail_as;
    ++counters.transfers_failed;
  } else if (!ok) {
    t.state = TransferState::failed;
    t.why = why;
    ++counters.transfers_failed;
  } else {
    t.state = TransferState::done;
    ++counters.transfers_done;
    (t.direction == Direction::read ? counters.bytes_read : counters.bytes_written) += t.bytes;
  }
  changed.notify_all();
}

const Agent::State::RemoteRegion& Agent::State::remote_region(const Peer& p, std::uint64_t addr,
                                                              std::uint64_t bytes) const {
  for (const RemoteRegion& r : p.regions) {
    if (addr >= r.base && bytes <= r.bytes && addr - r.base <= r.bytes - bytes) return r;
  }
  throw InvalidArgument(fmt::format("post: peer {} has no registered memory at {:#x} (+{} bytes)",
                                    p.id, addr, bytes));
}

TransferId Agent::State::start(Peer& p, Direction direction, std::vector<RmaOp> ops,
                               std::vector<std::uint64_t> keys,
                               std::vector<HostCopyRegion> stage_in, bool baseline) {
  const TransferId id = ++next_transfer;
  Transfer& t = transfers[id];
  t.peer = p.id;
  t.direction = direction;
  t.posted = Clock::now();
  t.deadline = t.posted + options.transfer_timeout;
  for (const RmaOp& op : ops)
    t.bytes += op.bytes;
  t.stage_in = std::move(stage_in);
  ++counters.transfers_posted;
  counters.regions_posted += ops.size();
  if (ops.empty()) {
    finish(id, true, {});
    return id;
  }
  try {
    auto done = [this, id](bool ok, const std::string& why) { finish(id, ok, why); };
    if (baseline) {
      transport->post_baseline(p.data, direction, ops, keys, std::move(done));
    } else {
      transport->post(p.data, direction, ops, keys, std::move(done));
    }
  } catch (...) {
    // Refused before any operation was posted: no record of it stays.
    transfers.erase(id);
    --counters.transfers_posted;
    counters.regions_posted -= ops.size();
    throw;
  }
  return id;
}

Agent::State::Transfer& Agent::State::transfer(TransferId id, const char* what) {
  auto it = transfers.find(id);
  if (it == transfers.end())
    throw InvalidArgument(fmt::format("{}: unknown transfer {}", what, id));
  return it->second;
}

// ---- the progress thread ---------------------------------------------------------

void Agent::State::housekeeping(Clock::time_point now) {
  reap_dead_peers();
  const auto beat = std::max(options.peer_timeout / 8, std::chrono::milliseconds(1));
  for (auto& [id, p] : peers) {
    if (p.status == PeerStatus::handshaking && !p.outgoing &&
        now - p.since > options.peer_timeout) {
      // A connection to our listener that sent no usable hello (connect()
      // bounds our own handshakes): refused, so that nothing waits on it.
      ++counters.handshakes_rejected;
      p.status = PeerStatus::rejected;
      p.why = fmt::format("no hello within {} ms", options.peer_timeout.count());
      log::warn(fmt::format("transfer: {} closed an incoming connection: {}", options.name, p.why));
      transport->close(p.conn, true, nullptr);
      continue;
    }
    if (p.status != PeerStatus::connected) continue;
    if (now - p.last_heard > options.peer_timeout) {
      lose_peer(p, fmt::format("no message for {} ms", options.peer_timeout.count()), true);
      continue;
    }
    if (now - p.last_sent >= beat) send(p, open_message(MsgType::heartbeat).take());
  }
  for (auto& [id, t] : transfers) {
    if (t.state != TransferState::pending || t.fail_as || now < t.deadline) continue;
    t.fail_as = TransferState::timed_out;
    t.why = fmt::format("not done within {} ms", options.transfer_timeout.count());
    // The connection is reset so that no byte lands later: the peer is
    // lost, its other pending transfers with it.
    if (auto pit = peers.find(t.peer); pit != peers.end()) {
      lose_peer(pit->second, "a transfer timed out; the connection was reset", true);
    }
  }
}

bool Agent::State::active() const {
  for (const auto& [id, t] : transfers) {
    if (t.state == TransferState::pending) return true;
  }
  for (const auto& [id, p] : peers) {
    if (p.status == PeerStatus::handshaking) return true;
  }
  return false;
}

// The progress thread: progress, heartbeats, deadlines. Idle, it sleeps on the
// transport's event fd (at most 5 ms, for the timers), or 1 ms without one;
// while a transfer of ours is pending it polls every 50 us.
void Agent::State::run() {
  const int fd = transport->event_fd();
  while (!stop.load(std::memory_order_acquire)) {
    bool busy = false;
    bool pending = false;
    bool armed = false;
    {
      std::lock_guard lock(mutex);
      try {
        busy = transport->progress();
        housekeeping(Clock::now());
        pending = active();
        if (!busy && !pending && fd >= 0) armed = transport->arm();
      } catch (const std::exception& e) {
        log::error(fmt::format("transfer: {} progress failed: {}", options.name, e.what()));
      }
      if (busy || !inbox.empty() || !lost.empty()) changed.notify_all();
    }
    if (busy) {
      std::this_thread::yield();
    } else if (pending) {
      std::this_thread::sleep_for(std::chrono::microseconds(50));
    } else if (armed) {
      pollfd p{fd, POLLIN, 0};
      ::poll(&p, 1, 5);
    } else if (fd < 0) {
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
    }
  }
}

// ---- the public API --------------------------------------------------------------

Agent::Agent(PagedKvCache& cache, AgentOptions options) {
  if (options.peer_timeout.count() <= 0) throw InvalidArgument("Agent: peer_timeout must be > 0");
  if (options.transfer_timeout.count() <= 0)
    throw InvalidArgument("Agent: transfer_timeout must be > 0");
  if (options.name.size() > kMaxKeyBytes) {
    throw InvalidArgument(fmt::format("Agent: name is {} bytes, over the limit of {}",
                                      options.name.size(), kMaxKeyBytes));
  }
  layout_ = pool_layout(cache, options.tp_rank, options.tp_size);
  layout_.groups = options.groups;
  if (!layout_.groups.empty()) {
    try {
      (void)decode_pool_layout(encode(layout_));  // what a peer will check
    } catch (const InvalidArgument& e) {
      throw InvalidArgument(fmt::format("Agent: groups: {}", e.what()));
    }
  }
  state_ = std::make_unique<State>(*this, cache, std::move(options));
  State& s = *state_;
  s.events.on_accept = [&s](ConnId c) { s.on_accept(c); };
  s.events.on_message = [&s](ConnId c, std::span<const std::uint8_t> b) { s.on_message(c, b); };
  s.events.on_error = [&s](ConnId c, const std::string& why) { s.on_error(c, why); };
  s.transport = s.options.transport_factory ? s.options.transport_factory(s.events)
                                            : make_ucx_transport(s.events);
  if (!s.transport) throw InvalidArgument("Agent: the transport factory returned no transport");
  const MemoryKind kind = cache.backend().memory_kind();
  memory_path_ = s.options.memory_path.value_or(s.transport->supports(kind) ? MemoryPath::direct
                                                                            : MemoryPath::staged);
  if (memory_path_ == MemoryPath::direct && !s.transport->supports(kind)) {
    throw InvalidArgument(fmt::format(
        "Agent: the transport cannot register {} memory directly; use staging", to_string(kind)));
  }
  s.register_memory(kind);
  s.thread = std::thread([&s] { s.run(); });
}

Agent::~Agent() {
  State& s = *state_;
  {
    std::unique_lock lock(s.mutex);
    for (auto& [id, t] : s.transfers) {
      if (t.state == TransferState::pending) t.cancel_requested = true;
    }
    for (auto& [id, p] : s.peers) {
      if (p.status != State::PeerStatus::connected) continue;
      try {
        s.send(p, open_message(MsgType::bye).take());
      } catch (const std::exception&) {
      }
    }
    // Bounded: the peers' loss detection bounds every pending operation.
    s.changed.wait_for(lock, s.options.peer_timeout + std::chrono::milliseconds(500),
                       [&s] { return !s.active(); });
  }
  s.stop.store(true, std::memory_order_release);
  s.thread.join();
  std::lock_guard lock(s.mutex);
  for (int i = 0; i < 50; ++i) {  // let the byes go out
    if (!s.transport->progress()) break;
  }
  s.transport.reset();  // force-closes what is left, unregisters memory
}

std::string Agent::listen(const std::string& address) {
  auto [host, port] = parse_address(address);
  std::lock_guard lock(state_->mutex);
  std::string bound = state_->transport->listen(host, port);
  state_->listening = true;
  return bound;
}

PeerId Agent::connect(const std::string& address, std::chrono::milliseconds timeout) {
  auto [host, port] = parse_address(address);
  State& s = *state_;
  std::unique_lock lock(s.mutex);
  const ConnId conn = s.transport->connect(host, port);
  State::Peer p;
  p.id = ++s.next_peer;
  p.conn = conn;
  p.outgoing = true;
  p.address = address;
  const PeerId id = p.id;
  s.by_conn[conn] = id;
  s.peers.emplace(id, std::move(p));
  s.send(s.peers.at(id), s.hello_bytes(MsgType::hello));
  const bool answered = s.changed.wait_for(
      lock, timeout, [&] { return s.peers.at(id).status != State::PeerStatus::handshaking; });
  State::Peer& peer = s.peers.at(id);
  if (!answered) {
    peer.status = State::PeerStatus::rejected;
    peer.why = "no answer";
    s.transport->close(conn, true, nullptr);
    throw TransferError(
        fmt::format("connect to {}: no answer within {} ms", address, timeout.count()));
  }
  if (peer.status == State::PeerStatus::rejected) {
    throw TransferError(fmt::format("connect to {}: {}", address, peer.why));
  }
  if (peer.status == State::PeerStatus::lost) {
    throw TransferError(fmt::format("connect to {}: the peer went away: {}", address, peer.why));
  }
  return id;
}

std::vector<PeerId> Agent::peers() const {
  std::lock_guard lock(state_->mutex);
  std::vector<PeerId> out;
  for (const auto& [id, p] : state_->peers) {
    if (p.status == State::PeerStatus::connected || p.status == State::PeerStatus::lost)
      out.push_back(id);
  }
  return out;
}

std::optional<PeerInfo> Agent::peer(PeerId id) const {
  std::lock_guard lock(state_->mutex);
  auto it = state_->peers.find(id);
  if (it == state_->peers.end()) return std::nullopt;
  const State::Peer& p = it->second;
  if (p.status != State::PeerStatus::connected && p.status != State::PeerStatus::lost)
    return std::nullopt;
  return PeerInfo{id, p.hello.name, p.hello.layout, p.status == State::PeerStatus::connected};
}

std::string Agent::peer_transport(PeerId id) const {
  std::lock_guard lock(state_->mutex);
  auto it = state_->peers.find(id);
  if (it == state_->peers.end()) return {};
  return state_->transport->connection_info(it->second.data != 0 ? it->second.data
                                                                 : it->second.conn);
}

std::string Agent::transport_description() const {
  std::lock_guard lock(state_->mutex);
  return state_->transport->description();
}

TransferId Agent::post(PeerId peer_id, Direction direction, std::span<const BlockId> local_blocks,
                       std::span<const BlockId> remote_blocks) {
  State& s = *state_;
  std::lock_guard lock(s.mutex);
  State::Peer& p = s.connected_peer(peer_id, "post");
  if (local_blocks.size() != remote_blocks.size()) {
    throw InvalidArgument(fmt::format("post: {} local blocks but {} remote blocks",
                                      local_blocks.size(), remote_blocks.size()));
  }
  for (BlockId b : local_blocks) {
    if (b >= s.cache.num_blocks()) {
      throw InvalidArgument(fmt::format("post: local block {} out of range (num_blocks {})", b,
                                        s.cache.num_blocks()));
    }
    if (s.cache.ref_count(b) == 0)
      throw InvalidArgument(fmt::format("post: local block {} is free", b));
  }
  std::vector<TransferRegion> plan = plan_block_regions(layout_, s.wire_pools, local_blocks,
                                                    p.hello.layout, p.hello.pools, remote_blocks);
  std::vector<RmaOp> ops;
  std::vector<std::uint64_t> keys;
  ops.reserve(plan.size());
  keys.reserve(plan.size());
  for (const TransferRegion& r : plan) {
    keys.push_back(s.remote_region(p, r.remote, r.bytes).key);
    ops.push_back({r.local, r.remote, r.bytes});
  }
  std::vector<HostCopyRegion> stage_in;
  if (s.staging && !local_blocks.empty()) {
    std::vector<HostCopyRegion> regions = s.staging->regions(local_blocks);
    if (direction == Direction::read) {
      stage_in = std::move(regions);  // copied in when the read is done
    } else {
      s.staging->to_mirror(regions);
    }
  }
  return s.start(p, direction, std::move(ops), std::move(keys), std::move(stage_in));
}

TransferId Agent::post_ranges(PeerId peer_id, Direction direction,
                              std::span<const RangeCopy> ranges) {
  State& s = *state_;
  std::lock_guard lock(s.mutex);
  State::Peer& p = s.connected_peer(peer_id, "post_ranges");
  std::vector<RmaOp> ops;
  std::vector<std::uint64_t> keys;
  ops.reserve(ranges.size());
  keys.reserve(ranges.size());
  for (const RangeCopy& r : ranges) {
    if (r.bytes == 0) throw InvalidArgument("post_ranges: an empty range");
    if (!s.local_registered(r.local, r.bytes)) {
      throw InvalidArgument(fmt::format(
          "post_ranges: local range {:#x} (+{} bytes) is not registered memory", r.local, r.bytes));
    }
    keys.push_back(s.remote_region(p, r.remote, r.bytes).key);
    ops.push_back({r.local, r.remote, r.bytes});
  }
  return s.start(p, direction, std::move(ops), std::move(keys), {});
}

TransferState Agent::poll(TransferId id) const {
  std::lock_guard lock(state_->mutex);
  return const_cast<State&>(*state_).transfer(id, "poll").state;
}

TransferState Agent::wait(TransferId id, std::chrono::milliseconds timeout) const {
  State& s = *state_;
  std::unique_lock lock(s.mutex);
  s.transfer(id, "wait");
  s.changed.wait_for(lock, timeout, [&] {
    auto it = s.transfers.find(id);
    return it == s.transfers.end() || is_final(it->second.state);
  });
  return s.transfer(id, "wait").state;
}

std::string Agent::why(TransferId id) const {
  std::lock_guard lock(state_->mutex);
  const auto& t = state_->transfer(id, "why");
  return t.state == TransferState::done || t.state == TransferState::cancelled ? std::string()
                                                                               : t.why;
}

std::optional<TransferState> Agent::abandoned(TransferId id) const {
  std::lock_guard lock(state_->mutex);
  const auto& t = state_->transfer(id, "abandoned");
  if (t.state != TransferState::pending) return std::nullopt;
  if (t.cancel_requested) return TransferState::cancelled;
  return t.fail_as;
}

std::uint64_t Agent::bytes(TransferId id) const {
  std::lock_guard lock(state_->mutex);
  return state_->transfer(id, "bytes").bytes;
}

Agent::Times Agent::times(TransferId id) const {
  std::lock_guard lock(state_->mutex);
  const auto& t = state_->transfer(id, "times");
  return {t.posted, is_final(t.state) ? t.finished : t.posted};
}

void Agent::cancel(TransferId id) {
  std::lock_guard lock(state_->mutex);
  auto& t = state_->transfer(id, "cancel");
  if (t.state == TransferState::pending) t.cancel_requested = true;
}

void Agent::release(TransferId id) {
  std::lock_guard lock(state_->mutex);
  auto& t = state_->transfer(id, "release");
  if (t.state == TransferState::pending) {
    throw InvalidArgument(fmt::format("release: transfer {} is still pending", id));
  }
  state_->transfers.erase(id);
}

void Agent::notify(PeerId peer_id, std::uint64_t request_id, std::uint32_t kind,
                   std::span<const BlockId> blocks, std::span<const std::uint8_t> payload) {
  const std::vector<std::uint8_t> message = notify_message(request_id, kind, blocks, payload);
  State& s = *state_;
  std::lock_guard lock(s.mutex);
  State::Peer& p = s.connected_peer(peer_id, "notify");
  s.send(p, message);
  ++s.counters.notifications_sent;
}

std::vector<Notification> Agent::take_notifications() {
  std::lock_guard lock(state_->mutex);
  std::vector<Notification> out(std::make_move_iterator(state_->inbox.begin()),
                                std::make_move_iterator(state_->inbox.end()));
  state_->inbox.clear();
  return out;
}

std::vector<PeerId> Agent::take_lost_peers() {
  std::lock_guard lock(state_->mutex);
  std::vector<PeerId> out(state_->lost.begin(), state_->lost.end());
  state_->lost.clear();
  return out;
}

bool Agent::wait_event(std::chrono::milliseconds timeout) const {
  State& s = *state_;
  std::unique_lock lock(s.mutex);
  return s.changed.wait_for(lock, timeout, [&] { return !s.inbox.empty() || !s.lost.empty(); });
}

void Agent::publish(std::span<const BlockId> blocks) {
  if (!state_->staging || blocks.empty()) return;
  State& s = *state_;
  std::lock_guard lock(s.mutex);
  for (BlockId b : blocks) {
    if (b >= s.cache.num_blocks())
      throw InvalidArgument(fmt::format("publish: block {} out of range", b));
  }
  s.staging->to_mirror(s.staging->regions(blocks));
}

double Agent::read_scratch(PeerId peer_id, std::size_t bytes) {
  State& s = *state_;
  TransferId id = 0;
  {
    std::lock_guard lock(s.mutex);
    if (s.abandoned_scratch_read) {
      auto it = s.transfers.find(*s.abandoned_scratch_read);
      if (it != s.transfers.end() && it->second.state == TransferState::pending) {
        throw TransferError(
            "read_scratch: an earlier read into the scratch buffer has not ended (its peer was "
            "lost or it passed its deadline); the buffer is quarantined until it does");
      }
      if (it != s.transfers.end()) s.transfers.erase(it);
      s.abandoned_scratch_read.reset();
    }
    State::Peer& p = s.connected_peer(peer_id, "read_scratch");
    if (!p.scratch || p.scratch->bytes < bytes || s.options.scratch_bytes < bytes || bytes == 0) {
      throw InvalidArgument(fmt::format(
          "read_scratch: {} bytes do not fit the scratch buffers (ours {}, the peer's {})", bytes,
          s.options.scratch_bytes, p.scratch ? p.scratch->bytes : 0));
    }
    id = s.start(p, Direction::read, {RmaOp{s.scratch_base, p.scratch->base, bytes}},
                 {p.scratch->key}, {}, /*baseline=*/true);
  }
  // Until the read ends, its deadline passes, or its peer is lost: a peer
  // that stopped (SIGSTOP) is lost by liveness long before the deadline, but
  // its process may still serve the read into our buffer later, so the
  // transfer stays pending and the buffer quarantined (abandoned_scratch_read)
  // while the caller goes on.
  std::unique_lock lock(s.mutex);
  const auto deadline =
      std::chrono::steady_clock::now() + s.options.transfer_timeout + std::chrono::seconds(1);
  auto peer_gone = [&] {
    auto it = s.peers.find(peer_id);
    return it == s.peers.end() || it->second.status != State::PeerStatus::connected;
  };
  s.changed.wait_until(lock, deadline, [&] {
    auto it = s.transfers.find(id);
    return it == s.transfers.end() || is_final(it->second.state) || peer_gone();
  });
  State::Transfer& t = s.transfer(id, "read_scratch");
  const TransferState st = t.state;
  if (st != TransferState::done) {
    if (st == TransferState::pending) {
      t.cancel_requested = true;
      s.abandoned_scratch_read = id;
      throw TransferError(peer_gone() ? "read_scratch: the peer was lost; the read is abandoned"
                                      : "read_scratch: the read did not finish");
    }
    const std::string why = t.why;
    s.transfers.erase(id);
    throw TransferError(fmt::format("read_scratch: the read ended {}: {}", to_string(st), why));
  }
  const double seconds = std::chrono::duration<double>(t.finished - t.posted).count();
  s.transfers.erase(id);
  return seconds;
}

AgentCounters Agent::counters() const {
  std::lock_guard lock(state_->mutex);
  return state_->counters;
}

}  // namespace kvport::transfer
