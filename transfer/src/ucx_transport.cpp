// The UCX transport: UCP contexts, a worker, a listener, client-server
// endpoints with peer error handling, RMA gets/puts with packed memory keys,
// and one active-message id for the control path. Every call runs under the
// owning Agent's lock (the worker is created UCS_THREAD_MODE_SERIALIZED).
#include <arpa/inet.h>
#include <netdb.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <ucp/api/ucp.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <memory>
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
    return fmt::format("ucx {} (UCX_TLS={}; registers {} memory)", ucp_get_version_string(),
                       tls != nullptr ? tls : "all", kinds);
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
    return out;
  }

  ConnId connect_to(std::span<const std::uint8_t> address, bool peer_errors) override {
    if (address.empty()) throw InvalidArgument("connect_to: an empty address");
    auto conn = new_conn();
    ucp_ep_params_t ep{};
    ep.field_mask = UCP_EP_PARAM_FIELD_REMOTE_ADDRESS | UCP_EP_PARAM_FIELD_ERR_HANDLER |
                    UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE;
    ep.address = reinterpret_cast<const ucp_address_t*>(address.data());
    // Without peer error handling UCX 1.13 may use CMA and shared memory
    // (with it, TCP only); the control connection and the heartbeats detect
    // a lost peer then.
    ep.err_mode = peer_errors ? UCP_ERR_HANDLING_MODE_PEER : UCP_ERR_HANDLING_MODE_NONE;
    conn->peer_errors = peer_errors;
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
    auto* ctx = new CloseContext([this, id, done = std::move(done)] {
      --pending_closes_;
      if (auto c = conns_.find(id); c != conns_.end()) {
        destroy_rkeys(*c->second);
        by_ep_.erase(c->second->ep);
        c->second->ep = nullptr;
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
    auto submit = [&](ucs_status_ptr_t req, OpContext* ctx) {
      if (req == nullptr) {
        delete ctx;
        batch->finish_one(UCS_OK);
      } else if (UCS_PTR_IS_ERR(req)) {
        delete ctx;
        batch->finish_one(UCS_PTR_STATUS(req));
      } else {
        ctx->request = req;
        pending_.insert(ctx);
      }
    };
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
      submit(req, ctx);
    }
    if (write && batch->ok && !ops.empty()) {
      // Puts complete locally; the flush completes when they are remote.
      auto* ctx = new OpContext(batch);
      ctx->owner = this;
      p.user_data = ctx;
      ++batch->remaining;
      submit(ucp_ep_flush_nbx(conn.ep, &p), ctx);
    }
    batch->finish_one(UCS_OK);
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
    if (event_fd_ < 0) return false;
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
    bool peer_errors = true;  // created with UCP_ERR_HANDLING_MODE_PEER
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

  TransportEvents events_;
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
