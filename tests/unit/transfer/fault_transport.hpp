// SPDX-License-Identifier: Apache-2.0
// A Transport decorator for fault drills: it wraps the UCX transport an Agent
// would make (AgentOptions::transport_factory) and, at one chosen step (the
// n-th post, or the n-th notification sent, counted from FaultControl::arm),
// injects one fault:
//   submit_throws     post() throws before anything is posted
//   completion_error  the operations run, then done(false) is reported
//   partial_error     as completion_error, after garbage was written over the
//                     first half of every local range (a read that landed
//                     part of its bytes, then failed)
//   stall             the operations run but done never comes; when the
//                     connection is closed its close does not complete
//                     either, until FaultControl::release(): then garbage is
//                     written over the local ranges (late bytes landing) and
//                     done(false) and the close's done run, in that order
//   connection_error  the connection fails: on_error at the next progress();
//                     a post's done(false) then, a notification is dropped
//   lose_message      the notification is not sent (a lost message); for
//                     notifications only (arm() refuses it for a post, and
//                     the post kinds for a notification)
// Every callback runs inside a call the agent makes (progress(), or the call
// itself), with the agent's lock held, as the Transport contract says.
#pragma once

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <span>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "kvport/transfer/agent.hpp"
#include "kvport/transfer/transport.hpp"
#include "messages.hpp"

namespace kvport::transfer::test {

enum class FaultKind {
  submit_throws,
  completion_error,
  partial_error,
  stall,
  connection_error,
  lose_message,
};

inline const char* to_string(FaultKind k) {
  switch (k) {
    case FaultKind::submit_throws:
      return "submit_throws";
    case FaultKind::completion_error:
      return "completion_error";
    case FaultKind::partial_error:
      return "partial_error";
    case FaultKind::stall:
      return "stall";
    case FaultKind::connection_error:
      return "connection_error";
    case FaultKind::lose_message:
      return "lose_message";
  }
  return "?";
}

/// Which calls count as steps: post() calls, or sends of a notification
/// (handshake messages and heartbeats are not counted).
enum class FaultStep { post, notify };

inline const char* to_string(FaultStep s) {
  return s == FaultStep::post ? "post" : "notify";
}

/// Shared between the test and the decorator (thread-safe).
class FaultControl {
 public:
  /// From now on, count `step` calls and inject `kind` at the `nth` (1-based).
  /// A notification takes lose_message or connection_error; a post any
  /// other kind (std::invalid_argument otherwise).
  void arm(FaultStep step, std::size_t nth, FaultKind kind) {
    const bool message_fault =
        kind == FaultKind::lose_message || kind == FaultKind::connection_error;
    if (nth == 0 || (step == FaultStep::notify && !message_fault) ||
        (step == FaultStep::post && kind == FaultKind::lose_message)) {
      throw std::invalid_argument("FaultControl::arm: that fault does not apply to that step");
    }
    std::lock_guard lock(mutex_);
    armed_ = true;
    step_ = step;
    nth_ = nth;
    kind_ = kind;
    seen_ = 0;
  }
  /// Whether the fault was injected.
  bool fired() const { return fired_.load(); }
  /// The notification kind the fault hit (notify steps), 0 otherwise.
  std::uint32_t fired_kind() const { return fired_kind_.load(); }
  /// A stalled operation is held (its done not yet run).
  bool stalled() const { return stalled_.load(); }
  /// Lets a stall end (at the transport's next progress()).
  void release() { released_.store(true); }
  bool released() const { return released_.load(); }

  // ---- for the decorator ----
  // Counts one call of `step`; returns the fault to inject now, if any.
  std::optional<FaultKind> count(FaultStep step) {
    std::lock_guard lock(mutex_);
    if (!armed_ || step != step_) return std::nullopt;
    if (++seen_ != nth_) return std::nullopt;
    armed_ = false;
    fired_.store(true);
    return kind_;
  }
  void set_fired_kind(std::uint32_t k) { fired_kind_.store(k); }
  void set_stalled(bool s) { stalled_.store(s); }

 private:
  mutable std::mutex mutex_;
  bool armed_ = false;
  FaultStep step_ = FaultStep::post;
  std::size_t nth_ = 0;
  FaultKind kind_ = FaultKind::submit_throws;
  std::size_t seen_ = 0;
  std::atomic<bool> fired_{false};
  std::atomic<std::uint32_t> fired_kind_{0};
  std::atomic<bool> stalled_{false};
  std::atomic<bool> released_{false};
};

class FaultInjectingTransport final : public Transport {
 public:
  using Done = std::function<void(bool, const std::string&)>;

  FaultInjectingTransport(std::shared_ptr<FaultControl> control, const TransportEvents& events)
      : control_(std::move(control)), events_(events), inner_(make_ucx_transport(events)) {}
  // The inner transport goes first: its teardown may complete a close whose
  // done this decorator holds.
  ~FaultInjectingTransport() override { inner_.reset(); }

  /// An AgentOptions::transport_factory injecting through `control`.
  static std::function<std::unique_ptr<Transport>(const TransportEvents&)> factory(
      std::shared_ptr<FaultControl> control) {
    return [control](const TransportEvents& events) -> std::unique_ptr<Transport> {
      return std::make_unique<FaultInjectingTransport>(control, events);
    };
  }

  std::string description() const override { return "faults over " + inner_->description(); }
  bool supports(MemoryKind kind) const noexcept override { return inner_->supports(kind); }
  std::string listen(const std::string& host, std::uint16_t port) override {
    return inner_->listen(host, port);
  }
  ConnId connect(const std::string& host, std::uint16_t port) override {
    return inner_->connect(host, port);
  }
  std::vector<std::uint8_t> local_address() override { return inner_->local_address(); }
  ConnId connect_to(std::span<const std::uint8_t> address, bool peer_errors) override {
    return inner_->connect_to(address, peer_errors);
  }

  void close(ConnId conn, bool force, std::function<void()> done) override {
    if (!stall_ || stall_->conn != conn || stall_->closed) {
      inner_->close(conn, force, std::move(done));
      return;
    }
    // The stalled operation's connection: its close completes only after
    // release().
    stall_->closed = true;
    inner_->close(conn, force, [this, done = std::move(done)] {
      if (stall_) stall_->close_done = done;
    });
  }

  std::vector<std::uint8_t> register_memory(std::uint64_t base, std::uint64_t bytes,
                                            MemoryKind kind) override {
    return inner_->register_memory(base, bytes, kind);
  }
  std::uint64_t import_remote_key(ConnId conn, std::span<const std::uint8_t> key) override {
    return inner_->import_remote_key(conn, key);
  }

  void send(ConnId conn, std::span<const std::uint8_t> message) override {
    std::uint32_t kind = 0;
    if (!is_notify(message, kind)) {
      inner_->send(conn, message);
      return;
    }
    const std::optional<FaultKind> fault = control_->count(FaultStep::notify);
    if (!fault) {
      inner_->send(conn, message);
      return;
    }
    control_->set_fired_kind(kind);
    if (*fault == FaultKind::connection_error) errors_.push_back(conn);  // and the message is lost
  }

  void post(ConnId conn, Direction direction, std::span<const RmaOp> ops,
            std::span<const std::uint64_t> remote_keys, Done done) override {
    const std::optional<FaultKind> fault = control_->count(FaultStep::post);
    if (!fault) {
      inner_->post(conn, direction, ops, remote_keys, std::move(done));
      return;
    }
    std::vector<RmaOp> local(ops.begin(), ops.end());
    const bool read = direction == Direction::read;
    switch (*fault) {
      case FaultKind::submit_throws:
        throw TransferError("injected: the transport refused the post");
      case FaultKind::completion_error:
      case FaultKind::partial_error: {
        const bool partial = *fault == FaultKind::partial_error;
        inner_->post(conn, direction, ops, remote_keys,
                     [done = std::move(done), local = std::move(local), partial, read](
                         bool, const std::string&) {
                       if (partial && read) scribble(local, 2);
                       done(false, partial ? "injected: failed after a partial write"
                                           : "injected: the completion reported an error");
                     });
        return;
      }
      case FaultKind::stall: {
        stall_ = Stall{};
        stall_->conn = conn;
        stall_->ops = std::move(local);
        stall_->done = std::move(done);
        stall_->read = read;
        control_->set_stalled(true);
        inner_->post(conn, direction, ops, remote_keys,
                     [](bool, const std::string&) {});  // the real completion is swallowed
        return;
      }
      case FaultKind::connection_error:
        errors_.push_back(conn);
        failed_posts_.push_back(std::move(done));  // nothing posted; fails with the connection
        return;
      case FaultKind::lose_message:  // refused by arm()
        inner_->post(conn, direction, ops, remote_keys, std::move(done));
        return;
    }
  }

  std::string connection_info(ConnId conn) override { return inner_->connection_info(conn); }

  bool progress() override {
    bool busy = inner_->progress();
    if (!errors_.empty()) {
      busy = true;
      for (ConnId c : std::exchange(errors_, {})) {
        if (events_.on_error) events_.on_error(c, "injected: the connection dropped");
      }
      for (Done& d : std::exchange(failed_posts_, {}))
        d(false, "injected: the connection dropped");
    }
    if (stall_ && control_->released()) {
      busy = true;
      Stall s = std::move(*stall_);
      stall_.reset();
      control_->set_stalled(false);
      if (s.read) scribble(s.ops, 1);  // late bytes land before the transport lets go
      s.done(false, "injected: stalled, cancelled at the close");
      if (s.close_done) s.close_done();
    }
    return busy;
  }

  int event_fd() const noexcept override { return inner_->event_fd(); }
  bool arm() override {
    if (!errors_.empty() || (stall_ && control_->released())) return false;
    return inner_->arm();
  }

 private:
  struct Stall {
    ConnId conn = 0;
    std::vector<RmaOp> ops;
    Done done;
    bool read = true;
    bool closed = false;
    std::function<void()> close_done;
  };

  // Writes garbage over the first 1/`fraction` of every op's local range.
  static void scribble(const std::vector<RmaOp>& ops, std::uint64_t fraction) {
    for (const RmaOp& op : ops) {
      const std::uint64_t n = std::max<std::uint64_t>(1, op.bytes / fraction);
      std::memset(reinterpret_cast<void*>(static_cast<std::uintptr_t>(op.local)), 0xA5, n);
    }
  }

  static bool is_notify(std::span<const std::uint8_t> message, std::uint32_t& kind) {
    try {
      wire::Reader r(message, "message");
      if (read_envelope(r) != MsgType::notify) return false;
      kind = parse_notify(r, 0).kind;
      return true;
    } catch (const std::exception&) {
      return false;
    }
  }

  std::shared_ptr<FaultControl> control_;
  const TransportEvents& events_;
  std::unique_ptr<Transport> inner_;
  std::optional<Stall> stall_;
  std::vector<ConnId> errors_;
  std::vector<Done> failed_posts_;
};

}  // namespace kvport::transfer::test
