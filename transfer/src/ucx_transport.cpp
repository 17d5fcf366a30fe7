// SPDX-License-Identifier: Apache-2.0
// The UCX transport: UCP contexts, a worker, a listener, client-server
// endpoints with peer error handling, RMA gets/puts with packed memory keys,
// and one active-message id for the control path. Every call runs under the
// owning Agent's lock (the worker is created UCS_THREAD_MODE_SERIALIZED).
//
// Bulk data on a connection to a peer on this host (connect_to without peer
// error handling: shared memory and CMA) is copied by the posting process
// itself with cross-memory attach, process_vm_readv/writev, up to 1024
// ranges a system call (KVPORT_UCX_BULK=cma, the default; the peer's
// process id travels in its local_address()). Where the kernel refuses
// that (ptrace rules), and with KVPORT_UCX_BULK=am, it goes as rendezvous
// active messages; with KVPORT_UCX_BULK=rma as RMA gets and puts.
// UCX 1.13 has no one-sided lane for a get or put
// there (CMA is zero-copy only, and its RMA protocols want a lane with
// buffered operations), so ucp_get/ucp_put become requests the peer's
// process serves by copying through the shared-memory FIFO; a rendezvous
// active message instead has its receiver read the sender's buffer with CMA
// (process_vm_readv) straight into the destination. A write sends one such
// message per op, carrying the destination address, which the receiver
// checks against its registered memory. A read asks the peer (kPullAmId) to
// send the ranges; the peer's process only sends the rendezvous headers,
// and ours copies.
#include <arpa/inet.h>
#include <netdb.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <sys/uio.h>
#include <ucp/api/ucp.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <memory>
#include <random>
#include <string>
#include <unordered_map>
#include <unordered_set>
#include <utility>
#include <vector>

#include <fmt/format.h>

#include "kvport/platform/error.hpp"
#include "kvport/platform/log.hpp"
#include "kvport/transfer/agent.hpp"
#include "kvport/transfer/transport.hpp"

namespace kvport::transfer {

std::string_view to_string(MemoryKind kind) noexcept {
  switch (kind) {
    case MemoryKind::host:
      return "host";
    case MemoryKind::cuda:
      return "cuda";
    case MemoryKind::rocm:
      return "rocm";
  }
  return "unknown";
}

namespace {

constexpr unsigned kControlAmId = 7;
constexpr unsigned kBulkAmId = 8;  // one range of bulk data, rendezvous; header BulkHeader
constexpr unsigned kPullAmId = 9;  // "send me these ranges": header a token, data PullRange[]
constexpr std::size_t kPullRangesPerMessage = 512;
// local_address() ends with our process id and this tag.
constexpr std::uint32_t kPidTag = 0x4350564b;  // "KVPC"
constexpr std::size_t kIovPerCall = 1024;      // IOV_MAX
// One progress() copies directly for about this long (in calls of at most
// kCmaBytesPerCall), then returns so that the owner's timers run (the
// agent's heartbeats go every peer timeout / 8, 190 ms in `kvport disagg`).
// Each round ends in a yield of the progress thread, which under load
// (other processes on the cores) costs a scheduling round: 16 MiB rounds
// halved a pull's speed, 20 ms rounds still cost a quarter.
constexpr auto kCmaRound = std::chrono::milliseconds(100);
constexpr std::uint64_t kCmaBytesPerCall = 4 << 20;
// The smallest range sent as a rendezvous message (KVPORT_UCX_BULK_MIN_BYTES
// overrides it); smaller ones go as RMA. 0: all of them (under load, a 32 KiB
// range pulled as RMA, copied by the peer's process, cost more than a
// rendezvous).
constexpr std::uint64_t kBulkMinBytes = 0;

// The header of a bulk range. A write: token 0 and the destination address
// in `dest`. An answer to a pull: the reader's token and op index (the
// reader knows the destination); `status` non-zero (a ucs_status_t) when
// the peer cannot send the range (no data then).
struct BulkHeader {
  std::uint64_t token = 0;
  std::uint64_t index = 0;
  std::uint64_t dest = 0;
  std::int64_t status = 0;
};

// One range a pull asks for: op `index`, `bytes` at the peer's `src`.
struct PullRange {
  std::uint64_t index = 0;
  std::uint64_t src = 0;
  std::uint64_t bytes = 0;
};

// One batch of RMA ops: done runs when `remaining` reaches zero.
struct Batch {
  std::size_t remaining = 0;
  bool ok = true;
  std::string why;
  std::function<void(bool, const std::string&)> done;

  void finish_one(ucs_status_t status) {
    if (status != UCS_OK && ok) {
      ok = false;
      why = ucs_status_string(status);
    }
    if (--remaining == 0 && done) {
      auto cb = std::move(done);
      done = nullptr;
      cb(ok, why);
    }
  }
};

// A request UCX has not completed yet. The transport keeps the set of them:
// at destruction it releases those that never complete (an operation on an
// endpoint without error handling whose peer died), which UCX requires before
// its worker is destroyed; their callbacks then do nothing.
class UcxTransport;
struct Pending {
  virtual ~Pending() = default;
  void* request = nullptr;
  bool abandoned = false;
  UcxTransport* owner = nullptr;
};

struct OpContext : Pending {
  explicit OpContext(std::shared_ptr<Batch> b) : batch(std::move(b)) {}
  std::shared_ptr<Batch> batch;
};

// A rendezvous send of a bulk range: its header lives until it completes
// (UCX 1.13 does not copy it); `batch` is null for a range served to a
// peer's pull.
struct BulkSendContext : Pending {
  BulkHeader header;
  std::shared_ptr<Batch> batch;
};

// A rendezvous receive into our memory: a range of our pull (`batch` set,
// `conn` the connection it counts against) or a peer's write.
struct BulkRecvContext : Pending {
  std::shared_ptr<Batch> batch;
  ConnId conn = 0;
};

// A read in flight as a pull: its ops, and which of them have not been
// answered yet (the others are received or final).
struct Pull {
  ConnId conn = 0;
  std::shared_ptr<Batch> batch;
  std::vector<RmaOp> ops;
  std::vector<bool> waiting;
  std::size_t left = 0;  // ops still waiting
};

// A message we cannot send from inside a callback: either a peer's pull to
// serve (sent from progress()) or nothing.
struct PullRequest {
  ucp_ep_h reply_ep = nullptr;
  std::uint64_t token = 0;
  std::vector<PullRange> ranges;
};

// A message being sent: the buffer lives until the send completes.
struct SendContext {
  std::vector<std::uint8_t> bytes;
};

struct CloseContext : Pending {
  explicit CloseContext(std::function<void()> d) : done(std::move(d)) {}
  std::function<void()> done;
};

sockaddr_storage resolve(const std::string& host, std::uint16_t port, socklen_t& len) {
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  hints.ai_flags = AI_NUMERICSERV;
  addrinfo* result = nullptr;
  const std::string service = std::to_string(port);
  if (int rc = ::getaddrinfo(host.c_str(), service.c_str(), &hints, &result); rc != 0) {
    throw TransferError(fmt::format("cannot resolve '{}': {}", host, ::gai_strerror(rc)));
  }
  sockaddr_storage storage{};
  std::memcpy(&storage, result->ai_addr, result->ai_addrlen);
  len = result->ai_addrlen;
  ::freeaddrinfo(result);
  return storage;
}

std::string format_address(const sockaddr_storage& addr) {
  char text[INET6_ADDRSTRLEN] = {};
  std::uint16_t port = 0;
  if (addr.ss_family == AF_INET) {
    const auto* in = reinterpret_cast<const sockaddr_in*>(&addr);
    ::inet_ntop(AF_INET, &in->sin_addr, text, sizeof text);
    port = ntohs(in->sin_port);
    return fmt::format("{}:{}", text, port);
  }
  const auto* in6 = reinterpret_cast<const sockaddr_in6*>(&addr);
  ::inet_ntop(AF_INET6, &in6->sin6_addr, text, sizeof text);
  port = ntohs(in6->sin6_port);
  return fmt::format("[{}]:{}", text, port);
}

class UcxTransport final : public Transport {
 public:
  explicit UcxTransport(const TransportEvents& events) : events_(events) {
    ucp_config_t* config = nullptr;
    check(ucp_config_read(nullptr, nullptr, &config), "ucp_config_read");
    ucp_params_t params{};
    params.field_mask = UCP_PARAM_FIELD_FEATURES | UCP_PARAM_FIELD_NAME;
    // WAKEUP: the progress thread sleeps on the worker's event fd instead of
    // a timer, so a TCP peer's requests (RMA over TCP needs the target's
    // progress) are served at once.
    params.features = UCP_FEATURE_RMA | UCP_FEATURE_AM | UCP_FEATURE_WAKEUP;
    params.name = "kvport";
    const ucs_status_t st = ucp_init(&params, config, &context_);
    ucp_config_release(config);
    check(st, "ucp_init");

    ucp_worker_params_t wp{};
    wp.field_mask = UCP_WORKER_PARAM_FIELD_THREAD_MODE;
    wp.thread_mode = UCS_THREAD_MODE_SERIALIZED;
    if (ucs_status_t ws = ucp_worker_create(context_, &wp, &worker_); ws != UCS_OK) {
      ucp_cleanup(context_);
      check(ws, "ucp_worker_create");
    }

    ucp_am_handler_param_t hp{};
    hp.field_mask = UCP_AM_HANDLER_PARAM_FIELD_ID | UCP_AM_HANDLER_PARAM_FIELD_CB |
                    UCP_AM_HANDLER_PARAM_FIELD_ARG;
    hp.id = kControlAmId;
    hp.cb = &UcxTransport::on_am;
    hp.arg = this;
    if (ucs_status_t hs = ucp_worker_set_am_recv_handler(worker_, &hp); hs != UCS_OK) {
      ucp_worker_destroy(worker_);
      ucp_cleanup(context_);
      check(hs, "ucp_worker_set_am_recv_handler");
    }

    for (auto [id, cb] : {std::pair{kBulkAmId, &UcxTransport::on_bulk_am},
                          std::pair{kPullAmId, &UcxTransport::on_pull_am}}) {
      hp.id = id;
      hp.cb = cb;
      if (ucs_status_t hs = ucp_worker_set_am_recv_handler(worker_, &hp); hs != UCS_OK) {
        ucp_worker_destroy(worker_);
        ucp_cleanup(context_);
        check(hs, "ucp_worker_set_am_recv_handler");
      }
    }
    const char* bulk = std::getenv("KVPORT_UCX_BULK");
    const std::string_view mode = bulk != nullptr ? bulk : "cma";
    bulk_am_ = mode != "rma";
    bulk_cma_ = mode == "cma";
    if (const char* min = std::getenv("KVPORT_UCX_BULK_MIN_BYTES"); min != nullptr) {
      char* end = nullptr;
      const unsigned long long v = std::strtoull(min, &end, 10);
      if (end != min && *end == '\0') bulk_min_bytes_ = v;
    }

    if (ucp_worker_get_efd(worker_, &event_fd_) != UCS_OK) event_fd_ = -1;

    ucp_context_attr_t attr{};
    attr.field_mask = UCP_ATTR_FIELD_MEMORY_TYPES;
    if (ucp_context_query(context_, &attr) == UCS_OK) memory_types_ = attr.memory_types;
  }

  ~UcxTransport() override {
    // Force-close what is left, then let the worker finish those requests.
    for (auto& [id, conn] : conns_) {
      if (conn->ep != nullptr && !conn->closing) close(id, true, nullptr);
    }
    for (int i = 0; i < 1000 && pending_closes_ > 0; ++i)
      ucp_worker_progress(worker_);
    // Requests that will never complete: released, so the worker can go.
    std::vector<Pending*> left(pending_.begin(), pending_.end());
    for (Pending* r : left) {
      r->abandoned = true;
      ucp_request_free(r->request);
    }
    for (auto& [id, conn] : conns_)
      destroy_rkeys(*conn);
    for (ucp_conn_request_h req : conn_requests_)
      ucp_listener_reject(listener_, req);
    if (listener_ != nullptr) ucp_listener_destroy(listener_);
    // The worker first, the registrations after it: destroying the worker
    // tears down the endpoints that did not close above, and with them the
    // transports' operations that still refer to the registered memory
    // (a registration unmapped first made ucp_worker_destroy fault, about
    // one teardown in 36 after a SIGINT). A memory handle belongs to the
    // context, so it is unmapped once no worker uses it, before cleanup.
    ucp_worker_destroy(worker_);
    worker_ = nullptr;
    for (ucp_mem_h memh : memhs_)
      ucp_mem_unmap(context_, memh);
    memhs_.clear();
    ucp_cleanup(context_);
    for (Pending* r : left)
      delete r;  // no callback can run any more
  }

  std::string description() const override {
    const char* tls = std::getenv("UCX_TLS");
    std::string kinds = "host";
    if (supports(MemoryKind::cuda)) kinds += ", cuda";
    if (supports(MemoryKind::rocm)) kinds += ", rocm";
    return fmt::format("ucx {} (UCX_TLS={}; registers {} memory; bulk data on this host: {})",
                       ucp_get_version_string(), tls != nullptr ? tls : "all", kinds,
                       bulk_cma_  ? "process_vm_readv/writev, else rendezvous active messages"
                       : bulk_am_ ? "rendezvous active messages (CMA zero-copy)"
                                  : "RMA gets and puts");
  }

  bool supports(MemoryKind kind) const noexcept override {
    switch (kind) {
      case MemoryKind::host:
        return true;
      case MemoryKind::cuda:
        return (memory_types_ & UCS_BIT(UCS_MEMORY_TYPE_CUDA)) != 0;
      case MemoryKind::rocm:
        return (memory_types_ & UCS_BIT(UCS_MEMORY_TYPE_ROCM)) != 0;
    }
    return false;
  }

  std::string listen(const std::string& host, std::uint16_t port) override {
    if (listener_ != nullptr) throw InvalidArgument("listen: this agent already listens");
    socklen_t len = 0;
    sockaddr_storage addr = resolve(host, port, len);
    ucp_listener_params_t lp{};
    lp.field_mask = UCP_LISTENER_PARAM_FIELD_SOCK_ADDR | UCP_LISTENER_PARAM_FIELD_CONN_HANDLER;
    lp.sockaddr.addr = reinterpret_cast<const sockaddr*>(&addr);
    lp.sockaddr.addrlen = len;
    lp.conn_handler.cb = &UcxTransport::on_conn_request;
    lp.conn_handler.arg = this;
    if (ucs_status_t st = ucp_listener_create(worker_, &lp, &listener_); st != UCS_OK) {
      listener_ = nullptr;
      throw TransferError(
          fmt::format("cannot listen on {}:{}: {}", host, port, ucs_status_string(st)));
    }
    ucp_listener_attr_t la{};
    la.field_mask = UCP_LISTENER_ATTR_FIELD_SOCKADDR;
    check(ucp_listener_query(listener_, &la), "ucp_listener_query");
    return format_address(la.sockaddr);
  }

  ConnId connect(const std::string& host, std::uint16_t port) override {
    socklen_t len = 0;
    sockaddr_storage addr = resolve(host, port, len);
    auto conn = new_conn();
    ucp_ep_params_t ep{};
    ep.field_mask = UCP_EP_PARAM_FIELD_FLAGS | UCP_EP_PARAM_FIELD_SOCK_ADDR |
                    UCP_EP_PARAM_FIELD_ERR_HANDLER | UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE;
    ep.flags = UCP_EP_PARAMS_FLAGS_CLIENT_SERVER;
    ep.sockaddr.addr = reinterpret_cast<const sockaddr*>(&addr);
    ep.sockaddr.addrlen = len;
    ep.err_mode = UCP_ERR_HANDLING_MODE_PEER;
    ep.err_handler.cb = &UcxTransport::on_ep_error;
    ep.err_handler.arg = conn;
    if (ucs_status_t st = ucp_ep_create(worker_, &ep, &conn->ep); st != UCS_OK) {
      conn->ep = nullptr;
      const ConnId id = conn->id;
      conns_.erase(id);
      throw TransferError(
          fmt::format("cannot connect to {}:{}: {}", host, port, ucs_status_string(st)));
    }
    by_ep_[conn->ep] = conn->id;
    return conn->id;
  }

  std::vector<std::uint8_t> local_address() override {
    ucp_address_t* address = nullptr;
    std::size_t size = 0;
    check(ucp_worker_get_address(worker_, &address, &size), "ucp_worker_get_address");
    const auto* bytes = reinterpret_cast<const std::uint8_t*>(address);
    std::vector<std::uint8_t> out(bytes, bytes + size);
    ucp_worker_release_address(worker_, address);
    // Then what a same-host peer needs to copy our memory directly: where
    // our nonce lives, its value (the peer reads it back to make sure the
    // process id names us in its pid namespace too), our process id, a tag.
    auto put = [&](std::uint64_t v, int width) {
      for (int i = 0; i < width; ++i)
        out.push_back(static_cast<std::uint8_t>(v >> (8 * i)));
    };
    put(reinterpret_cast<std::uint64_t>(&cma_nonce_), 8);
    put(cma_nonce_, 8);
    put(static_cast<std::uint32_t>(::getpid()), 4);
    put(kPidTag, 4);
    return out;
  }

  ConnId connect_to(std::span<const std::uint8_t> address, bool peer_errors) override {
    if (address.empty()) throw InvalidArgument("connect_to: an empty address");
    auto word = [&](std::size_t at, int bytes) {
      std::uint64_t v = 0;
      for (int i = 0; i < bytes; ++i)
        v |= std::uint64_t{address[at + i]} << (8 * i);
      return v;
    };
    pid_t pid = 0;
    constexpr std::size_t kTrailer = 24;
    if (address.size() > kTrailer && word(address.size() - 4, 4) == kPidTag) {
      const std::size_t at = address.size() - kTrailer;
      if (!peer_errors)
        pid = peer_process(static_cast<pid_t>(word(at + 16, 4)), word(at, 8), word(at + 8, 8));
      address = address.first(at);
    }
    auto conn = new_conn();
    conn->peer_pid = pid;
    ucp_ep_params_t ep{};
    ep.field_mask = UCP_EP_PARAM_FIELD_REMOTE_ADDRESS | UCP_EP_PARAM_FIELD_ERR_HANDLER |
                    UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE;
    ep.address = reinterpret_cast<const ucp_address_t*>(address.data());
    // Without peer error handling UCX 1.13 may use CMA and shared memory
    // (with it, TCP only); the control connection and the heartbeats detect
    // a lost peer then.
    ep.err_mode = peer_errors ? UCP_ERR_HANDLING_MODE_PEER : UCP_ERR_HANDLING_MODE_NONE;
    conn->peer_errors = peer_errors;
    conn->data = true;
    ep.err_handler.cb = &UcxTransport::on_ep_error;
    ep.err_handler.arg = conn;
    if (ucs_status_t st = ucp_ep_create(worker_, &ep, &conn->ep); st != UCS_OK) {
      conn->ep = nullptr;
      conns_.erase(conn->id);
      throw TransferError(
          fmt::format("cannot connect to the peer's address: {}", ucs_status_string(st)));
    }
    return conn->id;
  }

  void close(ConnId id, bool force, std::function<void()> done) override {
    auto it = conns_.find(id);
    if (it == conns_.end() || it->second->ep == nullptr || it->second->closing) {
      if (done) done();
      return;
    }
    Conn& conn = *it->second;
    conn.closing = true;
    ucp_request_param_t p{};
    p.op_attr_mask =
        UCP_OP_ATTR_FIELD_FLAGS | UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA;
    // A failed endpoint can only be force-closed, and UCX force-closes only
    // an endpoint with peer error handling (it refuses the others with
    // "invalid parameter" and leaves them and their operations in place).
    // An endpoint without it is closed with a flush: `done` runs once its
    // operations completed, so no byte of theirs lands after it.
    p.flags = conn.peer_errors && (force || conn.failed) ? UCP_EP_CLOSE_FLAG_FORCE : 0;
    // Reads waiting for the peer's answer end now (an answer that comes
    // later finds no token and is refused); receives already started end
    // by themselves, and `done` waits for them.
    end_pulls(id, "the connection was closed");
    auto* ctx = new CloseContext([this, id, done = std::move(done)] {
      --pending_closes_;
      if (auto c = conns_.find(id); c != conns_.end()) {
        destroy_rkeys(*c->second);
        by_ep_.erase(c->second->ep);
        c->second->ep = nullptr;
        if (c->second->receiving > 0) {
          c->second->closed_done = done;
          return;
        }
      }
      if (done) done();
    });
    p.user_data = ctx;
    p.cb.send = [](void* request, ucs_status_t, void* user) {
      auto* c = static_cast<CloseContext*>(user);
      if (c->abandoned) return;
      c->owner->pending_.erase(c);
      c->done();
      delete c;
      ucp_request_free(request);
    };
    ++pending_closes_;
    ctx->owner = this;
    ucs_status_ptr_t req = ucp_ep_close_nbx(conn.ep, &p);
    if (req != nullptr && !UCS_PTR_IS_ERR(req)) {
      ctx->request = req;
      pending_.insert(ctx);
    }
    if (req == nullptr) {
      ctx->done();
      delete ctx;
    } else if (UCS_PTR_IS_ERR(req)) {
      // Not closed: its operations may still run. `done` never runs, so
      // what waits for it (the transfers' blocks) stays held: leaked, never
      // overwritten.
      --pending_closes_;
      log::error(
          fmt::format("transfer: closing connection {} failed: {}; its transfers stay pending", id,
                      ucs_status_string(UCS_PTR_STATUS(req))));
      delete ctx;
    }
  }

  std::vector<std::uint8_t> register_memory(std::uint64_t base, std::uint64_t bytes,
                                            MemoryKind kind) override {
    ucp_mem_map_params_t mp{};
    mp.field_mask = UCP_MEM_MAP_PARAM_FIELD_ADDRESS | UCP_MEM_MAP_PARAM_FIELD_LENGTH |
                    UCP_MEM_MAP_PARAM_FIELD_MEMORY_TYPE;
    mp.address = reinterpret_cast<void*>(base);
    mp.length = bytes;
    mp.memory_type = kind == MemoryKind::cuda   ? UCS_MEMORY_TYPE_CUDA
                     : kind == MemoryKind::rocm ? UCS_MEMORY_TYPE_ROCM
                                                : UCS_MEMORY_TYPE_HOST;
    ucp_mem_h memh = nullptr;
    check(ucp_mem_map(context_, &mp, &memh), "ucp_mem_map");
    memhs_.push_back(memh);
    registered_.emplace_back(base, bytes);
    void* packed = nullptr;
    std::size_t size = 0;
    check(ucp_rkey_pack(context_, memh, &packed, &size), "ucp_rkey_pack");
    std::vector<std::uint8_t> key(static_cast<std::uint8_t*>(packed),
                                  static_cast<std::uint8_t*>(packed) + size);
    ucp_rkey_buffer_release(packed);
    return key;
  }

  std::uint64_t import_remote_key(ConnId id, std::span<const std::uint8_t> key) override {
    Conn& conn = live(id, "import_remote_key");
    ucp_rkey_h rkey = nullptr;
    if (ucs_status_t st = ucp_ep_rkey_unpack(conn.ep, key.data(), &rkey); st != UCS_OK) {
      throw TransferError(
          fmt::format("the peer's memory key is unusable: {}", ucs_status_string(st)));
    }
    conn.rkeys.push_back(rkey);
    return conn.rkeys.size() - 1;
  }

  void send(ConnId id, std::span<const std::uint8_t> message) override {
    Conn& conn = live(id, "send");
    auto* ctx = new SendContext{{message.begin(), message.end()}};
    ucp_request_param_t p{};
    p.op_attr_mask =
        UCP_OP_ATTR_FIELD_FLAGS | UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA;
    p.flags = UCP_AM_SEND_FLAG_REPLY | UCP_AM_SEND_FLAG_EAGER;
    p.user_data = ctx;
    p.cb.send = [](void* request, ucs_status_t, void* user) {
      delete static_cast<SendContext*>(user);
      ucp_request_free(request);
    };
    ucs_status_ptr_t req = ucp_am_send_nbx(conn.ep, kControlAmId, nullptr, 0, ctx->bytes.data(),
                                           ctx->bytes.size(), &p);
    if (req == nullptr) {
      delete ctx;
    } else if (UCS_PTR_IS_ERR(req)) {
      delete ctx;
      fail(conn, fmt::format("send failed: {}", ucs_status_string(UCS_PTR_STATUS(req))));
    }
  }

  void post(ConnId id, Direction direction, std::span<const RmaOp> ops,
            std::span<const std::uint64_t> remote_keys,
            std::function<void(bool, const std::string&)> done) override {
    const bool write = direction == Direction::write;
    Conn& conn = live(id, "post");
    auto batch = std::make_shared<Batch>();
    batch->remaining = 1;  // this call's own reference, dropped at the end
    batch->done = std::move(done);
    for (std::size_t i = 0; i < ops.size(); ++i) {
      if (remote_keys[i] >= conn.rkeys.size()) throw InvalidArgument("post: unknown remote key");
    }
    // Ranges of at least bulk_min_bytes_ as rendezvous messages, the rest
    // (where a rendezvous's round trips cost more than the copies it saves)
    // as RMA.
    if (bulk_cma_ && !baseline_ && conn.peer_pid > 0 && !ops.empty()) {
      // Copied by progress() (the caller does not wait for the bytes, as
      // with UCX's operations); the worker's wakeup tells the owner's
      // progress thread.
      ++batch->remaining;
      cma_jobs_.push_back({id, write, {ops.begin(), ops.end()}, batch});
      ucp_worker_signal(worker_);
      batch->finish_one(UCS_OK);
      return;
    }
    std::vector<RmaOp> small_ops;
    std::vector<std::uint64_t> small_keys;
    if (bulk_am_ && conn.data && !conn.peer_errors) {
      std::vector<RmaOp> big;
      for (std::size_t i = 0; i < ops.size(); ++i) {
        if (ops[i].bytes >= bulk_min_bytes_) {
          big.push_back(ops[i]);
        } else {
          small_ops.push_back(ops[i]);
          small_keys.push_back(remote_keys[i]);
        }
      }
      if (write) {
        post_am_writes(conn, big, batch);
      } else {
        post_pull(conn, big, batch);
      }
      ops = small_ops;
      remote_keys = small_keys;
    }
    ucp_request_param_t p{};
    p.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA;
    p.cb.send = [](void* request, ucs_status_t status, void* user) {
      auto* ctx = static_cast<OpContext*>(user);
      if (ctx->abandoned) return;
      ctx->owner->pending_.erase(ctx);
      auto owner = std::move(ctx->batch);
      delete ctx;
      ucp_request_free(request);
      owner->finish_one(status);
    };
    for (std::size_t i = 0; i < ops.size(); ++i) {
      if (!batch->ok) break;  // the connection failed: do not pile on
      const RmaOp& op = ops[i];
      auto* ctx = new OpContext(batch);
      ctx->owner = this;
      p.user_data = ctx;
      ++batch->remaining;
      ucp_rkey_h rkey = conn.rkeys[remote_keys[i]];
      void* local = reinterpret_cast<void*>(op.local);
      ucs_status_ptr_t req = write ? ucp_put_nbx(conn.ep, local, op.bytes, op.remote, rkey, &p)
                                   : ucp_get_nbx(conn.ep, local, op.bytes, op.remote, rkey, &p);
      track(req, ctx, *batch);
    }
    if (write && batch->ok && !ops.empty()) {
      // Puts complete locally; the flush completes when they are remote.
      auto* ctx = new OpContext(batch);
      ctx->owner = this;
      p.user_data = ctx;
      ++batch->remaining;
      track(ucp_ep_flush_nbx(conn.ep, &p), ctx, *batch);
    }
    batch->finish_one(UCS_OK);
  }

  // UCX alone: rendezvous active messages (or, with KVPORT_UCX_BULK=rma,
  // RMA), never process_vm_readv/writev.
  void post_baseline(ConnId id, Direction direction, std::span<const RmaOp> ops,
                     std::span<const std::uint64_t> remote_keys,
                     std::function<void(bool, const std::string&)> done) override {
    baseline_ = true;
    struct Reset {
      bool& flag;
      ~Reset() { flag = false; }
    } reset{baseline_};
    post(id, direction, ops, remote_keys, std::move(done));
  }

  std::string connection_info(ConnId id) override {
    auto it = conns_.find(id);
    if (it == conns_.end() || it->second->ep == nullptr) return {};
    char* text = nullptr;
    std::size_t size = 0;
    FILE* stream = ::open_memstream(&text, &size);
    if (stream == nullptr) return {};
    ucp_ep_print_info(it->second->ep, stream);
    std::fclose(stream);
    std::string out(text, size);
    std::free(text);
    return out;
  }

  int event_fd() const noexcept override { return event_fd_; }

  bool arm() override {
    if (event_fd_ < 0 || !cma_jobs_.empty() || !pull_requests_.empty()) return false;
    return ucp_worker_arm(worker_) == UCS_OK;
  }

  bool progress() override {
    // Bounded, so that the owner's timers (heartbeats) run between rounds
    // even while traffic keeps the worker busy.
    bool any = false;
    for (int i = 0; i < 64 && ucp_worker_progress(worker_) != 0; ++i)
      any = true;
    // Accept queued connection requests (outside the listener callback).
    while (!conn_requests_.empty()) {
      ucp_conn_request_h req = conn_requests_.front();
      conn_requests_.pop_front();
      any = true;
      auto conn = new_conn();
      ucp_ep_params_t ep{};
      ep.field_mask = UCP_EP_PARAM_FIELD_CONN_REQUEST | UCP_EP_PARAM_FIELD_ERR_HANDLER |
                      UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE;
      ep.conn_request = req;
      ep.err_mode = UCP_ERR_HANDLING_MODE_PEER;
      ep.err_handler.cb = &UcxTransport::on_ep_error;
      ep.err_handler.arg = conn;
      if (ucs_status_t st = ucp_ep_create(worker_, &ep, &conn->ep); st != UCS_OK) {
        log::warn(fmt::format("transfer: cannot accept a connection: {}", ucs_status_string(st)));
        conns_.erase(conn->id);
        continue;
      }
      by_ep_[conn->ep] = conn->id;
      if (events_.on_accept) events_.on_accept(conn->id);
    }
    if (run_cma_jobs()) any = true;
    // Serve the peers' pulls (sends are not made inside a UCX callback).
    while (!pull_requests_.empty()) {
      PullRequest req = std::move(pull_requests_.front());
      pull_requests_.pop_front();
      any = true;
      serve_pull(req);
    }
    // Deliver what the callbacks queued.
    while (!inbox_.empty()) {
      auto [id, bytes] = std::move(inbox_.front());
      inbox_.pop_front();
      any = true;
      if (events_.on_message) events_.on_message(id, bytes);
    }
    while (!errors_.empty()) {
      auto [id, why] = std::move(errors_.front());
      errors_.pop_front();
      any = true;
      if (events_.on_error) events_.on_error(id, why);
    }
    return any;
  }

 private:
  struct Conn {
    ConnId id = 0;
    ucp_ep_h ep = nullptr;
    bool failed = false;
    bool closing = false;
    bool peer_errors = true;            // created with UCP_ERR_HANDLING_MODE_PEER
    bool data = false;                  // made by connect_to
    pid_t peer_pid = 0;                 // a same-host peer's process, for CMA copies
    int receiving = 0;                  // our pulls' receives in flight on it
    std::function<void()> closed_done;  // close()'s done, once `receiving` is 0
    std::vector<ucp_rkey_h> rkeys;
    UcxTransport* self = nullptr;
  };

  static void check(ucs_status_t st, const char* call) {
    if (st != UCS_OK)
      throw TransferError(fmt::format("{} failed: {}", call, ucs_status_string(st)));
  }

  Conn* new_conn() {
    auto conn = std::make_unique<Conn>();
    conn->id = ++next_conn_;
    conn->self = this;
    Conn* raw = conn.get();
    conns_.emplace(raw->id, std::move(conn));
    return raw;
  }

  Conn& live(ConnId id, const char* what) {
    auto it = conns_.find(id);
    if (it == conns_.end() || it->second->ep == nullptr || it->second->closing) {
      throw InvalidArgument(fmt::format("{}: connection {} is closed", what, id));
    }
    return *it->second;
  }

  void fail(Conn& conn, std::string why) {
    if (conn.failed) return;
    conn.failed = true;
    errors_.emplace_back(conn.id, std::move(why));
  }

  void destroy_rkeys(Conn& conn) {
    for (ucp_rkey_h rkey : conn.rkeys)
      ucp_rkey_destroy(rkey);
    conn.rkeys.clear();
  }

  static void on_conn_request(ucp_conn_request_h req, void* arg) {
    static_cast<UcxTransport*>(arg)->conn_requests_.push_back(req);
  }

  static void on_ep_error(void* arg, ucp_ep_h, ucs_status_t status) {
    auto* conn = static_cast<Conn*>(arg);
    conn->self->fail(*conn, ucs_status_string(status));
  }

  static ucs_status_t on_am(void* arg, const void*, std::size_t, void* data, std::size_t length,
                            const ucp_am_recv_param_t* param) {
    auto* self = static_cast<UcxTransport*>(arg);
    if ((param->recv_attr & UCP_AM_RECV_ATTR_FLAG_RNDV) != 0) return UCS_OK;  // never sent
    ConnId id = 0;
    if ((param->recv_attr & UCP_AM_RECV_ATTR_FIELD_REPLY_EP) != 0) {
      if (auto it = self->by_ep_.find(param->reply_ep); it != self->by_ep_.end()) id = it->second;
    }
    if (id == 0) return UCS_OK;  // not from a connection we know
    const auto* bytes = static_cast<const std::uint8_t*>(data);
    self->inbox_.emplace_back(id, std::vector<std::uint8_t>(bytes, bytes + length));
    return UCS_OK;
  }

  // ---- bulk data copied with cross-memory attach ----

  // A post() whose copies progress() makes: ops[next] from `offset` on are
  // left.
  struct CmaJob {
    ConnId conn = 0;
    bool write = false;
    std::vector<RmaOp> ops;
    std::shared_ptr<Batch> batch;
    std::size_t next = 0;
    std::uint64_t offset = 0;
  };

  // Copies the queued jobs, oldest first, for about kCmaRound, so that the
  // owner's timers (heartbeats) run between rounds of a large transfer. A
  // connection closed meanwhile ends its jobs with an error and nothing more
  // moved.
  bool run_cma_jobs() {
    bool any = false;
    const auto until = std::chrono::steady_clock::now() + kCmaRound;
    while (!cma_jobs_.empty() && std::chrono::steady_clock::now() < until) {
      std::uint64_t budget = kCmaBytesPerCall;
      CmaJob& job = cma_jobs_.front();
      any = true;
      auto it = conns_.find(job.conn);
      int err = 0;
      bool fallback = false;
      if (it == conns_.end() || it->second->ep == nullptr || it->second->closing) {
        fail_batch(*job.batch, "the connection was closed");
      } else {
        const bool untouched = job.next == 0 && job.offset == 0;
        err = cma_copy(it->second->peer_pid, job.write, job.ops, job.next, job.offset, budget);
        if ((err == EPERM || err == ENOSYS) && untouched) {
          fallback = true;
        } else if (err == ESRCH) {
          // The peer's process is gone: the connection has failed too, and
          // says so in this progress() call, so that the owner sees the loss
          // no later than the failed transfer (never only the transfer).
          fail_batch(*job.batch, "the peer's process is gone");
          fail(*it->second, "the peer's process is gone");
        } else if (err != 0) {
          fail_batch(*job.batch,
                     fmt::format("copying the peer's memory failed: {}", std::strerror(err)));
        } else if (job.next < job.ops.size()) {
          continue;  // more of it, while the round lasts
        }
      }
      CmaJob done = std::move(job);
      cma_jobs_.pop_front();
      if (fallback) {
        // Refused before a byte moved: this connection's data goes through
        // UCX from now on, this job first.
        log::warn(fmt::format(
            "transfer: cannot copy a peer's memory directly ({}); its data goes as rendezvous "
            "active messages",
            std::strerror(err)));
        Conn& conn = *it->second;
        conn.peer_pid = 0;
        if (done.write) {
          post_am_writes(conn, done.ops, done.batch);
        } else {
          post_pull(conn, done.ops, done.batch);
        }
      }
      done.batch->finish_one(UCS_OK);
    }
    return any;
  }

  static void fail_batch(Batch& batch, std::string why) {
    if (!batch.ok) return;
    batch.ok = false;
    batch.why = std::move(why);
  }

  // `pid` if reading `bytes` at `at` from it gives `nonce` (it is the peer,
  // and the kernel lets us read its memory), else 0.
  static pid_t peer_process(pid_t pid, std::uint64_t at, std::uint64_t nonce) {
    std::uint64_t seen = 0;
    iovec local{&seen, sizeof seen};
    iovec remote{reinterpret_cast<void*>(at), sizeof seen};
    const ssize_t got = ::process_vm_readv(pid, &local, 1, &remote, 1, 0);
    if (got == sizeof seen && seen == nonce) return pid;
    log::info(fmt::format(
        "transfer: a same-host peer's memory cannot be read directly ({}); its data goes "
        "through UCX",
        got < 0 ? std::strerror(errno) : "another process has its id here"));
    return 0;
  }

  // Copies ops from ops[i] + offset on between our memory and process
  // `pid`'s (write: ours to theirs), up to kIovPerCall ranges a call, until
  // they are done or `budget` bytes moved; advances i, offset and budget.
  // 0 or the errno of the failed call (EPERM or ENOSYS: the kernel refuses
  // this peer; it comes at the first call).
  static int cma_copy(pid_t pid, bool write, std::span<const RmaOp> ops, std::size_t& i,
                      std::uint64_t& offset, std::uint64_t& budget) {
    std::vector<iovec> local;
    std::vector<iovec> remote;
    local.reserve(std::min(ops.size() - i, kIovPerCall));
    remote.reserve(local.capacity());
    while (i < ops.size() && budget > 0) {
      local.clear();
      remote.clear();
      std::uint64_t want = 0;
      for (std::size_t k = i; k < ops.size() && local.size() < kIovPerCall && want < budget; ++k) {
        const std::uint64_t skip = k == i ? offset : 0;
        const std::uint64_t n = std::min(ops[k].bytes - skip, budget - want);
        if (n == 0) continue;
        local.push_back({reinterpret_cast<void*>(ops[k].local + skip), n});
        remote.push_back({reinterpret_cast<void*>(ops[k].remote + skip), n});
        want += n;
      }
      if (want == 0) {
        i = ops.size();  // only empty ranges were left
        break;
      }
      const ssize_t got = write ? ::process_vm_writev(pid, local.data(), local.size(),
                                                      remote.data(), remote.size(), 0)
                                : ::process_vm_readv(pid, local.data(), local.size(), remote.data(),
                                                     remote.size(), 0);
      if (got < 0) return errno;
      if (got == 0) return EFAULT;
      // Advance past what was copied (a short count stops at a range's page
      // the kernel could not reach; the next call reports why).
      auto left = static_cast<std::uint64_t>(got);
      budget -= std::min(budget, left);
      while (left > 0 && i < ops.size()) {
        const std::uint64_t n = ops[i].bytes - offset;
        if (left >= n) {
          left -= n;
          ++i;
          offset = 0;
        } else {
          offset += left;
          left = 0;
        }
      }
      while (i < ops.size() && ops[i].bytes == offset) {
        ++i;
        offset = 0;
      }
    }
    return 0;
  }

  // ---- bulk data as rendezvous active messages ----

  bool registered(std::uint64_t addr, std::uint64_t bytes) const {
    for (auto [base, size] : registered_) {
      if (addr >= base && bytes <= size && addr - base <= size - bytes) return true;
    }
    return false;
  }

  // A write: one rendezvous message per op, which completes once the peer
  // has copied it into its memory (remotely complete).
  void post_am_writes(Conn& conn, std::span<const RmaOp> ops, const std::shared_ptr<Batch>& batch) {
    for (const RmaOp& op : ops) {
      if (!batch->ok) break;  // the connection failed: do not pile on
      auto* ctx = new BulkSendContext;
      ctx->owner = this;
      ctx->batch = batch;
      ctx->header.dest = op.remote;
      ++batch->remaining;
      track(send_bulk(conn.ep, ctx, reinterpret_cast<void*>(op.local), op.bytes), ctx, *batch);
    }
  }

  // The request UCX returned for one op of `batch` (already counted in its
  // `remaining`): done at once (`ctx` freed, the op finished ok), failed at
  // once (freed, finished with the error), or pending until its callback.
  void track(ucs_status_ptr_t req, Pending* ctx, Batch& batch) {
    if (req == nullptr) {
      delete ctx;
      batch.finish_one(UCS_OK);
    } else if (UCS_PTR_IS_ERR(req)) {
      delete ctx;
      batch.finish_one(UCS_PTR_STATUS(req));
    } else {
      ctx->request = req;
      pending_.insert(ctx);
    }
  }

  ucs_status_ptr_t send_bulk(ucp_ep_h ep, BulkSendContext* ctx, void* buffer, std::size_t bytes) {
    ucp_request_param_t p{};
    p.op_attr_mask =
        UCP_OP_ATTR_FIELD_FLAGS | UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA;
    p.flags = UCP_AM_SEND_FLAG_RNDV;
    p.user_data = ctx;
    p.cb.send = [](void* request, ucs_status_t status, void* user) {
      auto* c = static_cast<BulkSendContext*>(user);
      if (c->abandoned) return;
      c->owner->pending_.erase(c);
      auto batch = std::move(c->batch);
      delete c;
      ucp_request_free(request);
      if (batch) batch->finish_one(status);
    };
    return ucp_am_send_nbx(ep, kBulkAmId, &ctx->header, sizeof ctx->header, buffer, bytes, &p);
  }

  // A read: asks the peer to send the ranges (in messages of at most
  // kPullRangesPerMessage); each op ends when its range is received.
  void post_pull(Conn& conn, std::span<const RmaOp> ops, const std::shared_ptr<Batch>& batch) {
    if (ops.empty()) return;
    const std::uint64_t token = ++next_token_;
    auto pull = std::make_unique<Pull>();
    pull->conn = conn.id;
    pull->batch = batch;
    pull->ops.assign(ops.begin(), ops.end());
    pull->waiting.assign(ops.size(), true);
    pull->left = ops.size();
    batch->remaining += ops.size();
    Pull& ref = *pull;
    pulls_.emplace(token, std::move(pull));
    for (std::size_t first = 0; first < ops.size(); first += kPullRangesPerMessage) {
      const std::size_t n = std::min(kPullRangesPerMessage, ops.size() - first);
      auto* ctx = new SendContext{std::vector<std::uint8_t>(sizeof token + n * sizeof(PullRange))};
      std::memcpy(ctx->bytes.data(), &token, sizeof token);
      for (std::size_t i = 0; i < n; ++i) {
        const PullRange r{first + i, ops[first + i].remote, ops[first + i].bytes};
        std::memcpy(ctx->bytes.data() + sizeof token + i * sizeof r, &r, sizeof r);
      }
      ucp_request_param_t p{};
      p.op_attr_mask =
          UCP_OP_ATTR_FIELD_FLAGS | UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA;
      p.flags = UCP_AM_SEND_FLAG_REPLY | UCP_AM_SEND_FLAG_EAGER;
      p.user_data = ctx;
      p.cb.send = [](void* request, ucs_status_t, void* user) {
        delete static_cast<SendContext*>(user);
        ucp_request_free(request);
      };
      ucs_status_ptr_t req =
          ucp_am_send_nbx(conn.ep, kPullAmId, nullptr, 0, ctx->bytes.data(), ctx->bytes.size(), &p);
      if (req == nullptr) {
        delete ctx;
      } else if (UCS_PTR_IS_ERR(req)) {
        delete ctx;
        // These ranges will never be answered: they end now, with the error.
        for (std::size_t i = first; i < first + n; ++i)
          end_pull_op(token, ref, i, UCS_PTR_STATUS(req));
        if (pulls_.find(token) == pulls_.end()) return;
      }
    }
  }

  // Op `index` of pull `token` is final without a receive.
  void end_pull_op(std::uint64_t token, Pull& pull, std::size_t index, ucs_status_t status) {
    if (!pull.waiting[index]) return;
    pull.waiting[index] = false;
    --pull.left;
    auto batch = pull.batch;
    if (pull.left == 0) pulls_.erase(token);  // `pull` is gone now
    batch->finish_one(status);
  }

  // Ends the waiting ops of every pull on `conn`.
  void end_pulls(ConnId conn, const char* why) {
    std::vector<std::uint64_t> tokens;
    for (const auto& [token, pull] : pulls_) {
      if (pull->conn == conn) tokens.push_back(token);
    }
    for (std::uint64_t token : tokens) {
      for (std::size_t k = 0;; ++k) {
        auto it = pulls_.find(token);  // gone once its last op ended
        if (it == pulls_.end() || k >= it->second->ops.size()) break;
        Batch& batch = *it->second->batch;
        if (batch.ok) {
          batch.ok = false;
          batch.why = why;
        }
        end_pull_op(token, *it->second, k, UCS_ERR_CANCELED);
      }
    }
  }

  // Sends the ranges a peer asked for, from our registered memory; a range
  // outside it is answered with an error and no data.
  void serve_pull(const PullRequest& req) {
    for (const PullRange& r : req.ranges) {
      auto* ctx = new BulkSendContext;
      ctx->owner = this;
      ctx->header.token = req.token;
      ctx->header.index = r.index;
      const bool ok = r.bytes > 0 && registered(r.src, r.bytes);
      if (!ok) ctx->header.status = UCS_ERR_INVALID_ADDR;
      ucs_status_ptr_t sent =
          ok ? send_bulk(req.reply_ep, ctx, reinterpret_cast<void*>(r.src), r.bytes)
             : send_status(req.reply_ep, ctx);
      if (sent == nullptr) {
        delete ctx;
      } else if (UCS_PTR_IS_ERR(sent)) {
        delete ctx;
        log::warn(fmt::format("transfer: cannot answer a peer's read: {}",
                              ucs_status_string(UCS_PTR_STATUS(sent))));
      } else {
        ctx->request = sent;
        pending_.insert(ctx);
      }
    }
  }

  // A header-only answer (an error), eager.
  ucs_status_ptr_t send_status(ucp_ep_h ep, BulkSendContext* ctx) {
    ucp_request_param_t p{};
    p.op_attr_mask =
        UCP_OP_ATTR_FIELD_FLAGS | UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA;
    p.flags = UCP_AM_SEND_FLAG_EAGER;
    p.user_data = ctx;
    p.cb.send = [](void* request, ucs_status_t, void* user) {
      auto* c = static_cast<BulkSendContext*>(user);
      if (c->abandoned) return;
      c->owner->pending_.erase(c);
      delete c;
      ucp_request_free(request);
    };
    return ucp_am_send_nbx(ep, kBulkAmId, &ctx->header, sizeof ctx->header, nullptr, 0, &p);
  }

  // Starts receiving `bytes` of a rendezvous message into `dest`.
  ucs_status_t receive(void* desc, std::uint64_t dest, std::size_t bytes,
                       std::shared_ptr<Batch> batch, ConnId conn) {
    auto* ctx = new BulkRecvContext;
    ctx->owner = this;
    ctx->batch = std::move(batch);
    ctx->conn = conn;
    ucp_request_param_t p{};
    p.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA;
    p.user_data = ctx;
    p.cb.recv_am = [](void* request, ucs_status_t status, std::size_t, void* user) {
      auto* c = static_cast<BulkRecvContext*>(user);
      if (c->abandoned) return;
      UcxTransport* self = c->owner;
      self->pending_.erase(c);
      auto b = std::move(c->batch);
      const ConnId id = c->conn;
      delete c;
      ucp_request_free(request);
      self->received(id, b, status);
    };
    if (conn != 0) ++conns_.at(conn)->receiving;
    ucs_status_ptr_t req =
        ucp_am_recv_data_nbx(worker_, desc, reinterpret_cast<void*>(dest), bytes, &p);
    if (req != nullptr && !UCS_PTR_IS_ERR(req)) {
      ctx->request = req;
      pending_.insert(ctx);
      return UCS_INPROGRESS;
    }
    auto b = std::move(ctx->batch);
    delete ctx;
    const ucs_status_t st = req == nullptr ? UCS_OK : UCS_PTR_STATUS(req);
    received(conn, b, st);
    return st;
  }

  void received(ConnId id, const std::shared_ptr<Batch>& batch, ucs_status_t status) {
    if (batch) batch->finish_one(status);
    if (id == 0) return;
    auto it = conns_.find(id);
    if (it == conns_.end()) return;
    Conn& conn = *it->second;
    if (--conn.receiving == 0 && conn.closed_done) {
      auto done = std::move(conn.closed_done);
      conn.closed_done = nullptr;
      done();
    }
  }

  static ucs_status_t on_bulk_am(void* arg, const void* header, std::size_t header_length,
                                 void* data, std::size_t length, const ucp_am_recv_param_t* param) {
    auto* self = static_cast<UcxTransport*>(arg);
    if (header_length != sizeof(BulkHeader)) return UCS_ERR_INVALID_PARAM;
    BulkHeader h;
    std::memcpy(&h, header, sizeof h);
    const bool rndv = (param->recv_attr & UCP_AM_RECV_ATTR_FLAG_RNDV) != 0;
    if (h.token == 0) {
      // A peer's write: only into our registered memory.
      if (!rndv || length == 0 || !self->registered(h.dest, length)) return UCS_ERR_INVALID_ADDR;
      self->receive(data, h.dest, length, nullptr, 0);
      return UCS_OK;
    }
    auto it = self->pulls_.find(h.token);
    if (it == self->pulls_.end()) return UCS_ERR_CANCELED;  // ended (closed) or never ours
    Pull& pull = *it->second;
    if (h.index >= pull.ops.size() || !pull.waiting[h.index]) return UCS_ERR_INVALID_PARAM;
    const RmaOp op = pull.ops[h.index];
    if (h.status != 0 || !rndv || length != op.bytes) {
      const auto st = h.status != 0 ? static_cast<ucs_status_t>(h.status) : UCS_ERR_INVALID_PARAM;
      self->end_pull_op(h.token, pull, h.index, st);
      return UCS_OK;
    }
    pull.waiting[h.index] = false;
    --pull.left;
    auto batch = pull.batch;
    const ConnId conn = pull.conn;
    if (pull.left == 0) self->pulls_.erase(it);
    self->receive(data, op.local, op.bytes, std::move(batch), conn);
    return UCS_OK;
  }

  static ucs_status_t on_pull_am(void* arg, const void*, std::size_t, void* data,
                                 std::size_t length, const ucp_am_recv_param_t* param) {
    auto* self = static_cast<UcxTransport*>(arg);
    if ((param->recv_attr & UCP_AM_RECV_ATTR_FLAG_RNDV) != 0) return UCS_ERR_INVALID_PARAM;
    if ((param->recv_attr & UCP_AM_RECV_ATTR_FIELD_REPLY_EP) == 0 || length < 8 ||
        (length - 8) % sizeof(PullRange) != 0) {
      log::warn("transfer: a peer's read request is malformed; dropped");
      return UCS_OK;
    }
    PullRequest req;
    req.reply_ep = param->reply_ep;
    std::memcpy(&req.token, data, sizeof req.token);
    req.ranges.resize((length - 8) / sizeof(PullRange));
    std::memcpy(req.ranges.data(), static_cast<const std::uint8_t*>(data) + 8,
                req.ranges.size() * sizeof(PullRange));
    self->pull_requests_.push_back(std::move(req));
    return UCS_OK;
  }

  TransportEvents events_;
  bool bulk_am_ = true;
  bool bulk_cma_ = true;
  bool baseline_ = false;  // inside post_baseline
  std::deque<CmaJob> cma_jobs_;
  // A peer reads it back through CMA to check our process id (local_address).
  std::uint64_t cma_nonce_ =
      (std::uint64_t{std::random_device{}()} << 32) ^ std::random_device{}() ^ 0x9e3779b97f4a7c15;
  std::uint64_t bulk_min_bytes_ = kBulkMinBytes;
  std::uint64_t next_token_ = 0;
  std::unordered_map<std::uint64_t, std::unique_ptr<Pull>> pulls_;
  std::deque<PullRequest> pull_requests_;
  std::vector<std::pair<std::uint64_t, std::uint64_t>> registered_;  // base, bytes
  ucp_context_h context_ = nullptr;
  ucp_worker_h worker_ = nullptr;
  ucp_listener_h listener_ = nullptr;
  std::uint64_t memory_types_ = 0;
  int event_fd_ = -1;
  ConnId next_conn_ = 0;
  std::unordered_map<ConnId, std::unique_ptr<Conn>> conns_;
  std::unordered_map<ucp_ep_h, ConnId> by_ep_;
  std::deque<ucp_conn_request_h> conn_requests_;
  std::deque<std::pair<ConnId, std::vector<std::uint8_t>>> inbox_;
  std::deque<std::pair<ConnId, std::string>> errors_;
  std::vector<ucp_mem_h> memhs_;
  int pending_closes_ = 0;
  std::unordered_set<Pending*> pending_;  // requests UCX has not completed

  friend struct Pending;
};

}  // namespace

std::unique_ptr<Transport> make_ucx_transport(const TransportEvents& events) {
  return std::make_unique<UcxTransport>(events);
}

}  // namespace kvport::transfer
