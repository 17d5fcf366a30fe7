// Agent: handshake, transfers, notifications and peer liveness over a
// Transport. One lock guards everything; the progress thread and the callers
// take it in turn, and transport callbacks run with it held.
#include "kvport/transfer/agent.hpp"

#include <poll.h>
#include <signal.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <condition_variable>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <map>
#include <mutex>
#include <random>
#include <thread>
#include <unordered_map>

#include <fmt/format.h>

#include "kvport/core/block_regions.hpp"
#include "kvport/platform/host_buffer.hpp"
#include "kvport/platform/log.hpp"
#include "kvport/platform/stream.hpp"

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

namespace {

using Clock = std::chrono::steady_clock;

constexpr std::uint32_t kMagic = 0x5450564b;  // "KVPT"
constexpr std::uint8_t kVersion = 1;
// A packed UCX memory key or worker address is a few hundred bytes.
constexpr std::size_t kMaxKeyBytes = 64 * 1024;

enum class MsgType : std::uint8_t {
  hello = 1,
  accept = 2,
  reject = 3,
  notify = 4,
  heartbeat = 5,
  bye = 6
};

// Little-endian message writer / bounds-checked reader.
class Writer {
 public:
  explicit Writer(MsgType type) {
    u32(kMagic);
    u8(kVersion);
    u8(static_cast<std::uint8_t>(type));
  }
  void u8(std::uint8_t v) { bytes_.push_back(v); }
  void u32(std::uint32_t v) { put(v); }
  void u64(std::uint64_t v) { put(v); }
  void blob(std::span<const std::uint8_t> b) {
    u32(static_cast<std::uint32_t>(b.size()));
    bytes_.insert(bytes_.end(), b.begin(), b.end());
  }
  void str(std::string_view s) {
    blob({reinterpret_cast<const std::uint8_t*>(s.data()), s.size()});
  }
  std::vector<std::uint8_t>& bytes() { return bytes_; }

 private:
  template <typename T>
  void put(T v) {
    for (std::size_t i = 0; i < sizeof(T); ++i)
      bytes_.push_back(static_cast<std::uint8_t>(v >> (8 * i)));
  }
  std::vector<std::uint8_t> bytes_;
};

class Reader {
 public:
  explicit Reader(std::span<const std::uint8_t> b) : b_(b) {}
  std::uint8_t u8() { return static_cast<std::uint8_t>(get(1)); }
  std::uint32_t u32() { return static_cast<std::uint32_t>(get(4)); }
  std::uint64_t u64() { return get(8); }
  std::span<const std::uint8_t> blob() {
    const std::size_t n = u32();
    need(n);
    auto out = b_.subspan(pos_, n);
    pos_ += n;
    return out;
  }
  std::string str() {
    auto s = blob();
    return {reinterpret_cast<const char*>(s.data()), s.size()};
  }
  bool at_end() const { return pos_ == b_.size(); }

 private:
  void need(std::size_t n) const {
    if (b_.size() - pos_ < n) throw InvalidArgument("truncated message");
  }
  std::uint64_t get(std::size_t n) {
    need(n);
    std::uint64_t v = 0;
    for (std::size_t i = 0; i < n; ++i)
      v |= std::uint64_t{b_[pos_ + i]} << (8 * i);
    pos_ += n;
    return v;
  }
  std::span<const std::uint8_t> b_;
  std::size_t pos_ = 0;
};

// A registered range and the key a peer uses for it.
struct Region {
  std::uint64_t base = 0;
  std::uint64_t bytes = 0;
  std::vector<std::uint8_t> key;
};

// A peer's registered range, with the key imported on our connection.
struct RemoteRegion {
  std::uint64_t base = 0;
  std::uint64_t bytes = 0;
  std::uint64_t key = 0;
};

// What a hello/accept message carries.
struct Hello {
  std::uint64_t uuid = 0;
  std::string name;
  PoolLayout layout;
  std::uint64_t hash = 0;
  PoolAddresses pools;
  std::vector<Region> regions;
  std::uint64_t scratch_base = 0;
  std::uint64_t scratch_bytes = 0;
  std::vector<std::uint8_t> address;  // the transport's, for one-sided operations
  std::string host;                   // this boot of this machine (host_identity())
  std::uint32_t pid = 0;
};

// This boot of this machine: the hostname and the kernel's boot id. Two
// agents with the same identity share a host (and its process ids).
std::string host_identity() {
  char name[256] = {};
  ::gethostname(name, sizeof name - 1);
  std::string boot;
  if (FILE* f = std::fopen("/proc/sys/kernel/random/boot_id", "r")) {
    char buf[64] = {};
    if (std::fgets(buf, sizeof buf, f) != nullptr) boot = buf;
    std::fclose(f);
  }
  return std::string(name) + "/" + boot;
}

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

MemoryKind memory_kind_of(const Backend& backend) {
  const std::string name = backend.name();
  if (name.find("cuda") != std::string::npos) return MemoryKind::cuda;
  if (name.find("hip") != std::string::npos) return MemoryKind::rocm;
  return MemoryKind::host;
}

}  // namespace

struct Agent::State {
  enum class PeerStatus { handshaking, connected, rejected, lost };

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
    Clock::time_point last_heard = Clock::now();
    Clock::time_point last_sent = Clock::now();
  };

  struct Transfer {
    PeerId peer = 0;
    bool read = true;
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
  HostBuffer mirror;
  std::vector<std::pair<std::uint64_t, std::uint64_t>> pool_ranges;  // merged device ranges
  HostBuffer scratch_storage;
  std::uint64_t scratch_base = 0;
  std::optional<Stream> stage_stream;
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

  State(Agent& a, PagedKvCache& c, AgentOptions o) : agent(a), cache(c), options(std::move(o)) {
    std::random_device rd;
    uuid = (std::uint64_t{rd()} << 32) ^ rd() ^ static_cast<std::uint64_t>(::getpid());
  }

  // ---- setup -------------------------------------------------------------------

  void register_memory(MemoryKind kind) {
    device_pools = pool_addresses(cache);
    // The pools' extents, merged (block-major layers share one allocation).
    for (const DeviceRegion& r : pool_extents(cache.memory_pools()))
      pool_ranges.emplace_back(r.ptr.address(), r.ptr.address() + r.bytes);
    if (agent.memory_path_ == MemoryPath::direct) {
      wire_pools = device_pools;
      for (const auto& [begin, end] : pool_ranges) {
        regions.push_back(
            {begin, end - begin, transport->register_memory(begin, end - begin, kind)});
      }
    } else {
      std::uint64_t total = 0;
      for (const auto& [begin, end] : pool_ranges)
        total += end - begin;
      mirror = HostBuffer(cache.backend(), total);
      const auto base = reinterpret_cast<std::uint64_t>(mirror.data());
      regions.push_back({base, total, transport->register_memory(base, total, MemoryKind::host)});
      wire_pools = device_pools;
      auto to_mirror = [&](std::uint64_t addr) {
        std::uint64_t offset = 0;
        for (const auto& [begin, end] : pool_ranges) {
          if (addr >= begin && addr < end) return base + offset + (addr - begin);
          offset += end - begin;
        }
        throw InvalidArgument("staging: a pool address outside the pools");
      };
      for (auto& a : wire_pools.k_base)
        a = to_mirror(a);
      if (cache.config().has_v()) {  // K-only layers: the V entries stay 0
        for (auto& a : wire_pools.v_base)
          a = to_mirror(a);
      }
      stage_stream.emplace(cache.backend().create_stream());
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

  // Whether [addr, addr + bytes) lies in memory we registered (host memory
  // only: with staging the device pools are not the transport's).
  bool local_registered(std::uint64_t addr, std::uint64_t bytes) const {
    for (const Region& r : regions) {
      if (addr >= r.base && bytes <= r.bytes && addr - r.base <= r.bytes - bytes) return true;
    }
    return false;
  }

  // ---- messages ----------------------------------------------------------------

  std::vector<std::uint8_t> hello_message(MsgType type) const {
    Writer w(type);
    w.u64(uuid);
    w.str(options.name);
    w.blob(encode(agent.layout_));
    w.u64(compatibility_hash(agent.layout_));
    for (std::size_t l = 0; l < agent.layout_.num_layers; ++l) {
      w.u64(wire_pools.k_base[l]);
      w.u64(wire_pools.v_base[l]);
      w.u64(wire_pools.k_stride[l]);
      w.u64(wire_pools.v_stride[l]);
    }
    w.u32(static_cast<std::uint32_t>(regions.size()));
    for (const Region& r : regions) {
      w.u64(r.base);
      w.u64(r.bytes);
      w.blob(r.key);
    }
    w.u64(scratch_base);
    w.u64(options.scratch_bytes);
    w.blob(address);
    w.str(host);
    w.u32(static_cast<std::uint32_t>(::getpid()));
    return std::move(w.bytes());
  }

  static Hello parse_hello(Reader& r) {
    Hello h;
    h.uuid = r.u64();
    h.name = r.str();
    h.layout = decode_pool_layout(r.blob());
    h.hash = r.u64();
    if (h.hash != compatibility_hash(h.layout))
      throw InvalidArgument("hello: compatibility hash mismatch");
    for (std::size_t l = 0; l < h.layout.num_layers; ++l) {
      h.pools.k_base.push_back(r.u64());
      h.pools.v_base.push_back(r.u64());
      h.pools.k_stride.push_back(r.u64());
      h.pools.v_stride.push_back(r.u64());
    }
    const std::uint32_t count = r.u32();
    if (count > 65536) throw InvalidArgument("hello: too many regions");
    for (std::uint32_t i = 0; i < count; ++i) {
      Region region;
      region.base = r.u64();
      region.bytes = r.u64();
      auto key = r.blob();
      // UCX unpacks keys and addresses without bounds checks of its own.
      if (key.empty() || key.size() > kMaxKeyBytes)
        throw InvalidArgument("hello: bad memory key size");
      region.key.assign(key.begin(), key.end());
      h.regions.push_back(std::move(region));
    }
    h.scratch_base = r.u64();
    h.scratch_bytes = r.u64();
    auto address = r.blob();
    if (address.size() > kMaxKeyBytes) throw InvalidArgument("hello: bad address size");
    h.address.assign(address.begin(), address.end());
    h.host = r.str();
    h.pid = r.u32();
    if (!r.at_end()) throw InvalidArgument("hello: trailing bytes");
    return h;
  }

  void send(Peer& p, const std::vector<std::uint8_t>& bytes) {
    transport->send(p.conn, bytes);
    p.last_sent = Clock::now();
  }

  // Opens the data connection, imports the peer's keys on it; after it the
  // peer is connected.
  // Throws (the peer stays unconnected, its data connection closed) when
  // the transport cannot use what the peer sent.
  void adopt(Peer& p, Hello h) {
    try {
      // Same host: no peer error handling on the data connection, so that
      // UCX may use CMA and shared memory; a lost peer's transfers then end
      // when its process is gone (reap_dead_peers) or the flush completes.
      p.same_host = !h.host.empty() && h.host == host;
      p.data = h.address.empty() ? p.conn : transport->connect_to(h.address, !p.same_host);
      by_conn[p.data] = p.id;
      for (const Region& region : h.regions) {
        RemoteRegion rr{region.base, region.bytes,
                        transport->import_remote_key(p.data, region.key)};
        if (h.scratch_bytes > 0 && region.base == h.scratch_base) p.scratch = rr;
        p.regions.push_back(rr);
      }
    } catch (...) {
      if (p.data != 0 && p.data != p.conn) transport->close(p.data, false, nullptr);
      p.data = 0;
      p.regions.clear();
      p.scratch.reset();
      throw;
    }
    p.hello = std::move(h);
    p.status = PeerStatus::connected;
    p.last_heard = Clock::now();
  }

  void on_accept(ConnId conn) {
    Peer p;
    p.id = ++next_peer;
    p.conn = conn;
    by_conn[conn] = p.id;
    peers.emplace(p.id, std::move(p));
  }

  void on_message(ConnId conn, std::span<const std::uint8_t> bytes) {
    auto pit = by_conn.find(conn);
    if (pit == by_conn.end()) return;
    Peer& p = peers.at(pit->second);
    p.last_heard = Clock::now();
    try {
      Reader r(bytes);
      if (r.u32() != kMagic || r.u8() != kVersion) throw InvalidArgument("bad magic or version");
      const auto type = static_cast<MsgType>(r.u8());
      switch (type) {
        case MsgType::hello: {
          if (p.status != PeerStatus::handshaking || p.outgoing)
            throw InvalidArgument("unexpected hello");
          Hello h = parse_hello(r);
          if (auto why = incompatibility(agent.layout_, h.layout)) {
            ++counters.handshakes_rejected;
            Writer w(MsgType::reject);
            w.str(*why);
            w.blob(encode(agent.layout_));
            send(p, w.bytes());
            log::warn(
                fmt::format("transfer: {} rejected peer '{}': {}", options.name, h.name, *why));
            p.status = PeerStatus::rejected;
            p.why = *why;
            transport->close(p.conn, false, nullptr);
            return;
          }
          try {
            adopt(p, std::move(h));
          } catch (const Error& e) {
            ++counters.handshakes_rejected;
            Writer w(MsgType::reject);
            w.str(fmt::format("the peer's memory keys or address are unusable here: {}", e.what()));
            w.blob(encode(agent.layout_));
            send(p, w.bytes());
            p.status = PeerStatus::rejected;
            p.why = e.what();
            transport->close(p.conn, false, nullptr);
            return;
          }
          send(p, hello_message(MsgType::accept));
          return;
        }
        case MsgType::accept: {
          if (p.status != PeerStatus::handshaking || !p.outgoing)
            throw InvalidArgument("unexpected accept");
          Hello h = parse_hello(r);
          if (auto why = incompatibility(agent.layout_, h.layout)) {
            reject_outgoing(p, *why);
            return;
          }
          try {
            adopt(p, std::move(h));
          } catch (const Error& e) {
            reject_outgoing(
                p,
                fmt::format("the peer's memory keys or address are unusable here: {}", e.what()));
          }
          return;
        }
        case MsgType::reject: {
          if (p.status != PeerStatus::handshaking || !p.outgoing)
            throw InvalidArgument("unexpected reject");
          const std::string theirs = r.str();
          std::string why = theirs;
          try {
            if (auto mine = incompatibility(agent.layout_, decode_pool_layout(r.blob())))
              why = *mine;
          } catch (const InvalidArgument&) {
          }
          reject_outgoing(p, why);
          return;
        }
        case MsgType::notify: {
          if (p.status != PeerStatus::connected)
            throw InvalidArgument("notification before the handshake");
          Notification n;
          n.peer = p.id;
          n.request_id = r.u64();
          n.kind = r.u32();
          const std::uint32_t count = r.u32();
          if (count > kMaxNotificationBytes / sizeof(BlockId))
            throw InvalidArgument("too many blocks");
          n.blocks.reserve(count);
          for (std::uint32_t i = 0; i < count; ++i)
            n.blocks.push_back(r.u32());
          auto payload = r.blob();
          n.payload.assign(payload.begin(), payload.end());
          if (!r.at_end()) throw InvalidArgument("trailing bytes");
          ++counters.notifications_received;
          inbox.push_back(std::move(n));
          return;
        }
        case MsgType::heartbeat:
          return;
        case MsgType::bye:
          lose_peer(p, "the peer closed the connection", false);
          return;
      }
      throw InvalidArgument("unknown message type");
    } catch (const Error& e) {
      ++counters.malformed_messages;
      log::warn(fmt::format("transfer: {} dropped a malformed message from peer {}: {}",
                            options.name, p.id, e.what()));
    }
  }

  // Closes both connections. Once the data connection is closed the
  // transport no longer touches our memory for this peer, so the peer's
  // pending transfers end then, even if their operations never report (UCX
  // does not complete an operation on an endpoint without error handling
  // whose peer died).
  // Ends every pending transfer with the peer (their operations can no
  // longer touch our memory).
  void end_transfers(PeerId id, const char* why) {
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
  void reap_dead_peers() {
    for (auto& [id, p] : peers) {
      if (p.status != PeerStatus::lost || p.transfers_ended || !p.same_host || p.hello.pid == 0)
        continue;
      if (::kill(static_cast<pid_t>(p.hello.pid), 0) == 0 || errno != ESRCH) continue;
      for (int i = 0; i < 256 && transport->progress(); ++i) {
      }
      end_transfers(id, "the peer's process exited");
    }
  }

  void close_peer(Peer& p, bool force) {
    const PeerId id = p.id;
    auto end = [this, id] { end_transfers(id, "the connection was closed"); };
    if (p.data != 0 && p.data != p.conn) {
      transport->close(p.data, force, end);
      transport->close(p.conn, force, nullptr);
    } else {
      transport->close(p.conn, force, end);
    }
  }

  void reject_outgoing(Peer& p, const std::string& why) {
    ++counters.handshakes_rejected;
    p.status = PeerStatus::rejected;
    p.why = why;
    transport->close(p.conn, true, nullptr);
  }

  void on_error(ConnId conn, const std::string& why) {
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
  void lose_peer(Peer& p, const std::string& why, bool count_loss) {
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
      log::write(count_loss ? log::Level::warn : log::Level::info,
                 fmt::format("transfer: {} lost peer {} ('{}'): {}", options.name, p.id,
                             p.hello.name, why));
    }
    close_peer(p, true);
  }

  // ---- transfers ---------------------------------------------------------------

  // Makes a transfer final (once: a late callback of one ended by its
  // connection's close is ignored).
  void finish(TransferId id, bool ok, const std::string& why) {
    auto it = transfers.find(id);
    if (it == transfers.end() || it->second.state != TransferState::pending) return;
    Transfer& t = it->second;
    if (ok && !t.fail_as && !t.stage_in.empty()) {
      try {
        cache.backend().copy_batch_h2d_async(t.stage_in, *stage_stream);
        cache.backend().synchronize(*stage_stream);
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
      (t.read ? counters.bytes_read : counters.bytes_written) += t.bytes;
    }
    changed.notify_all();
  }

  const RemoteRegion& remote_region(const Peer& p, std::uint64_t addr, std::uint64_t bytes) const {
    for (const RemoteRegion& r : p.regions) {
      if (addr >= r.base && bytes <= r.bytes && addr - r.base <= r.bytes - bytes) return r;
    }
    throw InvalidArgument(fmt::format("post: peer {} has no registered memory at {:#x} (+{} bytes)",
                                      p.id, addr, bytes));
  }

  TransferId start(Peer& p, bool read, std::vector<RmaOp> ops, std::vector<std::uint64_t> keys,
                   std::vector<HostCopyRegion> stage_in) {
    const TransferId id = ++next_transfer;
    Transfer& t = transfers[id];
    t.peer = p.id;
    t.read = read;
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
      transport->post(p.data, !read, ops, keys,
                      [this, id](bool ok, const std::string& why) { finish(id, ok, why); });
    } catch (...) {
      // Refused before any operation was posted: no record of it stays.
      transfers.erase(id);
      --counters.transfers_posted;
      counters.regions_posted -= ops.size();
      throw;
    }
    return id;
  }

  Peer& connected_peer(PeerId id, const char* what) {
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

  Transfer& transfer(TransferId id, const char* what) {
    auto it = transfers.find(id);
    if (it == transfers.end())
      throw InvalidArgument(fmt::format("{}: unknown transfer {}", what, id));
    return it->second;
  }

  // Device <-> mirror regions of `blocks` (staging).
  std::vector<HostCopyRegion> stage_regions(std::span<const BlockId> blocks) const {
    std::vector<HostCopyRegion> out;
    for (const CopyRegion& r : plan_block_regions(agent.layout_, device_pools, blocks,
                                                  agent.layout_, wire_pools, blocks)) {
      out.push_back({DevicePtr(r.local), reinterpret_cast<void*>(r.remote), r.bytes});
    }
    return out;
  }

  // ---- the progress thread -----------------------------------------------------

  void housekeeping(Clock::time_point now) {
    reap_dead_peers();
    const auto beat = std::max(options.peer_timeout / 8, std::chrono::milliseconds(1));
    for (auto& [id, p] : peers) {
      if (p.status != PeerStatus::connected) continue;
      if (now - p.last_heard > options.peer_timeout) {
        lose_peer(p, fmt::format("no message for {} ms", options.peer_timeout.count()), true);
        continue;
      }
      if (now - p.last_sent >= beat) {
        Writer w(MsgType::heartbeat);
        send(p, w.bytes());
      }
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

  bool active() const {
    for (const auto& [id, t] : transfers) {
      if (t.state == TransferState::pending) return true;
    }
    for (const auto& [id, p] : peers) {
      if (p.status == PeerStatus::handshaking) return true;
    }
    return false;
  }

  // The progress thread: progress, heartbeats, deadlines. Idle, it sleeps on
  // the transport's event fd (at most 5 ms, for the timers), or 1 ms without
  // one; while a transfer of ours is pending it polls every 50 us.
  void run() {
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
};

Agent::Agent(PagedKvCache& cache, AgentOptions options) {
  if (options.peer_timeout.count() <= 0) throw InvalidArgument("Agent: peer_timeout must be > 0");
  if (options.transfer_timeout.count() <= 0)
    throw InvalidArgument("Agent: transfer_timeout must be > 0");
  layout_ = pool_layout(cache, options.tp_rank, options.tp_size);
  state_ = std::make_unique<State>(*this, cache, std::move(options));
  State& s = *state_;
  s.events.on_accept = [&s](ConnId c) { s.on_accept(c); };
  s.events.on_message = [&s](ConnId c, std::span<const std::uint8_t> b) { s.on_message(c, b); };
  s.events.on_error = [&s](ConnId c, const std::string& why) { s.on_error(c, why); };
  s.transport = make_ucx_transport(s.events);
  const MemoryKind kind = memory_kind_of(cache.backend());
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
        Writer w(MsgType::bye);
        s.send(p, w.bytes());
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
  s.send(s.peers.at(id), s.hello_message(MsgType::hello));
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

TransferId Agent::post(PeerId peer_id, bool read, std::span<const BlockId> local_blocks,
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
  std::vector<CopyRegion> plan = plan_block_regions(layout_, s.wire_pools, local_blocks,
                                                    p.hello.layout, p.hello.pools, remote_blocks);
  std::vector<RmaOp> ops;
  std::vector<std::uint64_t> keys;
  ops.reserve(plan.size());
  keys.reserve(plan.size());
  for (const CopyRegion& r : plan) {
    keys.push_back(s.remote_region(p, r.remote, r.bytes).key);
    ops.push_back({r.local, r.remote, r.bytes});
  }
  std::vector<HostCopyRegion> stage_in;
  if (memory_path_ == MemoryPath::staged && !local_blocks.empty()) {
    std::vector<HostCopyRegion> regions = s.stage_regions(local_blocks);
    if (read) {
      stage_in = std::move(regions);
    } else {
      s.cache.backend().copy_batch_d2h_async(regions, *s.stage_stream);
      s.cache.backend().synchronize(*s.stage_stream);
    }
  }
  return s.start(p, read, std::move(ops), std::move(keys), std::move(stage_in));
}

TransferId Agent::post_ranges(PeerId peer_id, bool read, std::span<const RangeCopy> ranges) {
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
  return s.start(p, read, std::move(ops), std::move(keys), {});
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
  if (blocks.size() * sizeof(BlockId) + payload.size() > kMaxNotificationBytes) {
    throw InvalidArgument(fmt::format("notify: {} blocks and {} payload bytes exceed {} bytes",
                                      blocks.size(), payload.size(), kMaxNotificationBytes));
  }
  State& s = *state_;
  std::lock_guard lock(s.mutex);
  State::Peer& p = s.connected_peer(peer_id, "notify");
  Writer w(MsgType::notify);
  w.u64(request_id);
  w.u32(kind);
  w.u32(static_cast<std::uint32_t>(blocks.size()));
  for (BlockId b : blocks)
    w.u32(b);
  w.blob(payload);
  s.send(p, w.bytes());
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
  if (memory_path_ != MemoryPath::staged || blocks.empty()) return;
  State& s = *state_;
  std::lock_guard lock(s.mutex);
  for (BlockId b : blocks) {
    if (b >= s.cache.num_blocks())
      throw InvalidArgument(fmt::format("publish: block {} out of range", b));
  }
  auto regions = s.stage_regions(blocks);
  s.cache.backend().copy_batch_d2h_async(regions, *s.stage_stream);
  s.cache.backend().synchronize(*s.stage_stream);
}

double Agent::read_scratch(PeerId peer_id, std::size_t bytes) {
  State& s = *state_;
  TransferId id = 0;
  {
    std::lock_guard lock(s.mutex);
    State::Peer& p = s.connected_peer(peer_id, "read_scratch");
    if (!p.scratch || p.scratch->bytes < bytes || s.options.scratch_bytes < bytes || bytes == 0) {
      throw InvalidArgument(fmt::format(
          "read_scratch: {} bytes do not fit the scratch buffers (ours {}, the peer's {})", bytes,
          s.options.scratch_bytes, p.scratch ? p.scratch->bytes : 0));
    }
    id = s.start(p, true, {RmaOp{s.scratch_base, p.scratch->base, bytes}}, {p.scratch->key}, {});
  }
  const TransferState st = wait(id, s.options.transfer_timeout + std::chrono::seconds(1));
  std::lock_guard lock(s.mutex);
  State::Transfer& t = s.transfer(id, "read_scratch");
  if (st != TransferState::done) {
    if (st == TransferState::pending) {
      t.cancel_requested = true;  // released by nobody: a bounded leak of one record
      throw TransferError("read_scratch: the read did not finish");
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
