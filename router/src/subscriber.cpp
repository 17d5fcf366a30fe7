// SPDX-License-Identifier: Apache-2.0
#include "kvport/router/subscriber.hpp"

#include <algorithm>
#include <array>
#include <iterator>
#include <map>
#include <optional>
#include <span>
#include <string_view>
#include <thread>
#include <utility>
#include <vector>

#include <zmq.hpp>
#include <zmq_addon.hpp>

#include "kvport/events/publisher.hpp"
#include "kvport/events/wire.hpp"
#include "kvport/platform/error.hpp"

namespace kvport::router {
namespace {

using std::chrono::milliseconds;

// Frames kept of one message: a live message has 3, an answer 3 (with the
// empty delimiter); the frames of a longer one are discarded as read.
constexpr std::size_t kMaxParts = 4;
// wait_for's longest single wait, so that it sees tail_timeout pass.
constexpr milliseconds kWaitSlice{10};

std::span<const std::byte> bytes_of(const zmq::message_t& m) {
  return {static_cast<const std::byte*>(m.data()), m.size()};
}

// ZeroMQ takes a tcp port modulo 65536 and connects to port 0 without
// complaint: a connect endpoint needs a real port.
void check_endpoint(const std::string& endpoint, const char* what) {
  if (endpoint.empty())
    throw InvalidArgument(std::string("router subscriber: the ") + what + " endpoint is empty");
  if (!endpoint.starts_with("tcp://")) return;
  const std::size_t colon = endpoint.rfind(':');
  const std::string port = endpoint.substr(colon + 1);
  const bool digits =
      !port.empty() && port.size() <= 5 &&
      std::all_of(port.begin(), port.end(), [](char c) { return c >= '0' && c <= '9'; });
  if (!digits || std::stoul(port) == 0 || std::stoul(port) > 65535) {
    throw InvalidArgument(std::string("router subscriber: the ") + what + " endpoint '" + endpoint +
                          "' has no port in [1, 65535]");
  }
}

void connect_or_throw(zmq::socket_t& s, const std::string& endpoint, const char* what) {
  try {
    s.connect(endpoint);
  } catch (const zmq::error_t& e) {
    throw InvalidArgument(std::string("router subscriber: cannot connect the ") + what +
                          " endpoint '" + endpoint + "': " + e.what());
  }
}

}  // namespace

struct Subscriber::Impl {
  // The request in flight on an instance's DEALER.
  struct Request {
    enum class Kind : std::uint8_t { none, replay, snapshot };
    Kind kind = Kind::none;
    Clock::time_point deadline{};
    std::uint64_t start = 0;                     // replay: the first seq asked for
    std::optional<std::uint64_t> last_returned;  // replay: the last seq answered
    bool applied = false;                        // snapshot: answered and applied
    // When the last frame of the answer came (none yet: nullopt).
    std::optional<Clock::time_point> last_frame;
  };

  struct Instance {
    InstanceId id = 0;
    InstanceEndpoints endpoints;
    zmq::socket_t sub;
    std::optional<zmq::socket_t> dealer;
    std::uint64_t dealer_generation = 0;
    Request request;
    // No snapshot request before this (after an answer without one).
    Clock::time_point snapshot_not_before{};
    // The need last counted as unserviceable (no replay endpoint).
    Need unserved;
    // The last snapshot applied: its S and ts. A batch with seq < S and a ts
    // not later than the snapshot's is one it contained (a copy still
    // queued on the SUB): dropped here, since the index knows the ts of
    // batch S-1 only as the snapshot's and would take the copy for a batch
    // of a restarted stream.
    std::optional<std::pair<std::uint64_t, double>> snapshot_floor;
  };

  RouterIndex& index;
  SubscriberOptions opt;
  SubscriberStats stats;
  zmq::context_t ctx{1};
  std::map<InstanceId, Instance> instances;
  std::size_t rotation = 0;  // poll()'s first socket, rotating

  static std::int64_t max_frame(std::size_t bytes) noexcept {
    return static_cast<std::int64_t>(std::min<std::size_t>(bytes, INT64_MAX));
  }

  Impl(RouterIndex& idx, SubscriberOptions o) : index(idx), opt(std::move(o)) {}

  Instance& get(InstanceId id, const char* what) {
    const auto it = instances.find(id);
    if (it == instances.end()) {
      throw InvalidArgument(std::string("router subscriber: ") + what + ": unknown instance " +
                            std::to_string(id));
    }
    return it->second;
  }

  void open_dealer(Instance& inst) {
    inst.dealer.emplace(ctx, zmq::socket_type::dealer);
    inst.dealer->set(zmq::sockopt::linger, 0);
    // Bounded: a full pipe stops ZeroMQ reading the connection, which a
    // kvport publisher waits out (ROUTER_MANDATORY) and a vLLM one answers
    // by dropping the tail (a truncated answer, asked for again).
    inst.dealer->set(zmq::sockopt::rcvhwm, opt.receive_high_water_mark);
    // A larger frame ends the session with the publisher (a protocol error;
    // ZeroMQ does not reconnect: reopen_dealer does): snapshots are the
    // largest frames.
    inst.dealer->set(zmq::sockopt::maxmsgsize, max_frame(opt.max_snapshot_bytes));
    connect_or_throw(*inst.dealer, inst.endpoints.replay, "replay");
    ++inst.dealer_generation;
  }

  // Drops the request in flight and whatever answer is still on its way:
  // a new socket, so no late frame is taken for the next request's.
  void cancel_request(Instance& inst) {
    inst.request = Request{};
    reopen_dealer(inst);
  }
  void reopen_dealer(Instance& inst) {
    if (inst.dealer) {
      inst.dealer->close();
      open_dealer(inst);
    }
  }

  bool send_request(Instance& inst, std::span<const std::byte> body, Clock::time_point now) {
    try {
      // The empty delimiter first, as vLLM's replay clients send it.
      if (!inst.dealer->send(zmq::message_t(),
                             zmq::send_flags::sndmore | zmq::send_flags::dontwait))
        return false;
      inst.dealer->send(zmq::buffer(body.data(), body.size()), zmq::send_flags::dontwait);
    } catch (const zmq::error_t&) {
      return false;
    }
    inst.request.deadline = now + opt.request_timeout;
    return true;
  }

  void request_replay(Instance& inst, std::uint64_t start, Clock::time_point now) {
    const auto frame = events::encode_seq(start);
    if (!send_request(inst, frame, now)) return;
    inst.request.kind = Request::Kind::replay;
    inst.request.start = start;
    ++stats.replay_requests;
  }

  void request_snapshot(Instance& inst, Clock::time_point now) {
    const std::string_view body = events::snapshot_request;
    if (!send_request(inst, std::as_bytes(std::span(body.data(), body.size())), now)) return;
    inst.request.kind = Request::Kind::snapshot;
    ++stats.snapshot_requests;
  }

  // Deadlines first, then what the index needs.
  void act(Instance& inst, Clock::time_point now) {
    if (inst.request.kind != Request::Kind::none) {
      const auto& last = inst.request.last_frame;
      if (last && now - *last >= opt.tail_timeout) {
        // The answer began, then stopped without its terminator: the
        // publisher dropped its tail (a ROUTER past its high water mark
        // drops). Ended here, so that what is still missing is asked for
        // again now, not after request_timeout.
        ++stats.truncated_answers;
        finish(inst);
        reopen_dealer(inst);
      } else if (now < inst.request.deadline) {
        return;
      } else {
        ++stats.request_timeouts;
        const bool replay = inst.request.kind == Request::Kind::replay;
        cancel_request(inst);
        if (replay && index.needs(inst.id).kind == Need::Kind::replay_from)
          index.replay_failed(inst.id);
      }
    }
    const Need need = index.needs(inst.id);
    if (need.kind == Need::Kind::nothing) {
      inst.unserved = Need{};
      return;
    }
    if (!inst.dealer) {
      if (need != inst.unserved) {
        ++stats.unserviceable_needs;
        inst.unserved = need;
      }
      return;
    }
    if (need.kind == Need::Kind::replay_from) {
      request_replay(inst, need.seq, now);
    } else if (now >= inst.snapshot_not_before) {
      request_snapshot(inst, now);
    }
  }

  // One decoded batch, live or replayed, to the index.
  void deliver(Instance& inst, const EventBatch& batch, Clock::time_point now, bool live) {
    if (inst.snapshot_floor && batch.seq < inst.snapshot_floor->first &&
        batch.ts <= inst.snapshot_floor->second) {
      ++stats.duplicates;
      return;
    }
    const std::uint64_t before = index.counters().batches_applied;
    const ApplyResult result = index.apply(inst.id, batch, now);
    // Held batches the index applies after this one count too.
    const std::uint64_t applied = index.counters().batches_applied - before;
    stats.applied += applied;
    switch (result) {
      case ApplyResult::applied:
        break;
      case ApplyResult::duplicate:
        ++stats.duplicates;
        break;
      case ApplyResult::held:
        ++stats.held;
        break;
      case ApplyResult::restarted:
        ++stats.restarts;
        if (applied == 0) ++stats.held;
        inst.snapshot_floor.reset();
        // A request sent to the old stream: its answer would be of it.
        if (live) cancel_request(inst);
        break;
    }
  }

  std::optional<events::DecodeResult> decode(const zmq::message_t& payload, std::uint64_t seq,
                                             std::size_t limit) {
    if (payload.size() > limit) {
      ++stats.malformed;
      return std::nullopt;
    }
    events::DecodeResult r = events::decode_batch(bytes_of(payload), seq);
    if (!r.ok()) {
      ++stats.malformed;
      return std::nullopt;
    }
    stats.unknown_events += r.unknown_events;
    return r;
  }

  void on_live(Instance& inst, const std::vector<zmq::message_t>& frames, Clock::time_point now) {
    ++stats.messages;
    if (frames.size() != 3) {
      ++stats.malformed;
      return;
    }
    const auto seq = events::decode_seq(bytes_of(frames[1]));
    if (!seq) {
      ++stats.malformed;
      return;
    }
    if (auto r = decode(frames[2], *seq, opt.max_message_bytes))
      deliver(inst, *r->batch, now, true);
  }

  // The end of an answer.
  void finish(Instance& inst) {
    const Request req = inst.request;
    inst.request = Request{};
    if (req.kind == Request::Kind::replay) {
      const Need need = index.needs(inst.id);
      // Still missing: the batch asked for first, or one the answer went
      // past. A gap beyond the answer is newer than it: asked for next.
      if (need.kind == Need::Kind::replay_from && need.seq >= req.start &&
          (need.seq == req.start || (req.last_returned && need.seq <= *req.last_returned))) {
        ++stats.replay_misses;
        index.replay_failed(inst.id);
      }
    } else if (req.kind == Request::Kind::snapshot && !req.applied) {
      // No snapshot in the answer (a publisher without them answers the
      // terminator alone): ask again no sooner than a timeout would have.
      inst.snapshot_not_before = req.deadline;
    }
  }

  void on_answer(Instance& inst, std::vector<zmq::message_t>& frames, Clock::time_point now) {
    // [seq, payload], after the empty delimiter the publisher echoes.
    std::span<zmq::message_t> f(frames);
    if (f.size() == 3 && f[0].size() == 0) f = f.subspan(1);
    if (f.size() != 2) {
      ++stats.malformed;
      return;
    }
    const auto seq = events::decode_seq(bytes_of(f[0]));
    if (!seq) {
      ++stats.malformed;
      return;
    }
    if (inst.request.kind == Request::Kind::none) return;  // nothing asked: stray
    if (*seq == events::end_of_replay_seq) {
      finish(inst);
      return;
    }
    // An answer still coming is not timed out.
    inst.request.last_frame = now;
    inst.request.deadline = std::max(inst.request.deadline, now + opt.request_timeout);
    auto r = decode(f[1], *seq,
                    inst.request.kind == Request::Kind::replay ? opt.max_message_bytes
                                                               : opt.max_snapshot_bytes);
    if (inst.request.kind == Request::Kind::replay) {
      ++stats.replayed_batches;
      inst.request.last_returned = *seq;
      if (r) deliver(inst, *r->batch, now, false);
      return;
    }
    // A snapshot: the set left by every batch with seq < S. The index's
    // snapshot is "after batch seq": S - 1.
    if (!r || index.needs(inst.id).kind != Need::Kind::snapshot) return;
    std::vector<CacheEvent>& evs = r->batch->events;
    const double ts = r->batch->ts;
    if (*seq == 0) {
      // Nothing published yet: the stream from its beginning.
      index.remove_instance(inst.id);
      index.add_instance(inst.id, now);
    } else {
      const std::uint64_t before = index.counters().batches_applied;
      index.apply_snapshot(inst.id, *seq - 1, evs, now, ts);
      stats.applied += index.counters().batches_applied - before;  // held ones that follow
    }
    inst.snapshot_floor.emplace(*seq, ts);
    inst.request.applied = true;
    ++stats.snapshots_applied;
  }

  // One message, frame by frame: at most kMaxParts frames are kept, the
  // rest read and discarded (a message of endless frames costs nothing
  // here). False when nothing is queued; `parts` is the count of frames.
  static bool receive(zmq::socket_t& s, std::vector<zmq::message_t>& frames, std::size_t& parts,
                      std::size_t& bytes) {
    frames.clear();
    parts = 0;
    zmq::message_t part;
    if (!s.recv(part, zmq::recv_flags::dontwait)) return false;
    while (true) {
      ++parts;
      bytes += part.size();
      const bool more = part.more();
      if (frames.size() < kMaxParts) frames.push_back(std::move(part));
      if (!more) return true;
      part = zmq::message_t();
      (void)s.recv(part, zmq::recv_flags::none);  // ZeroMQ delivers a message whole
    }
  }

  // A message is queued on `s` (a recv would return one now).
  static bool readable(zmq::socket_t& s) noexcept {
    try {
      return (s.get(zmq::sockopt::events) & ZMQ_POLLIN) != 0;
    } catch (const zmq::error_t&) {
      return false;
    }
  }

  // The work one poll() may still do.
  struct Budget {
    std::size_t messages = 0;
    std::size_t bytes = 0;
    Clock::time_point until{};
    bool spent() const noexcept { return messages == 0 || bytes == 0 || Clock::now() >= until; }
  };

  // Receives what is queued on one socket, within the poll's budget.
  // Returns the messages handled.
  std::size_t drain(Instance& inst, bool dealer, Clock::time_point now, Budget& budget) {
    std::size_t n = 0;
    const std::uint64_t generation = inst.dealer_generation;
    std::vector<zmq::message_t> frames;
    while (true) {
      if (dealer && (!inst.dealer || inst.dealer_generation != generation)) break;
      zmq::socket_t& s = dealer ? *inst.dealer : inst.sub;
      if (budget.spent()) {
        // A stop only where the budget left work queued: a further recv
        // would have returned a message (ZMQ_EVENTS says so without one).
        if (readable(s)) ++stats.budget_stops;
        break;
      }
      std::size_t parts = 0, bytes = 0;
      try {
        if (!receive(s, frames, parts, bytes)) break;
      } catch (const zmq::error_t&) {
        break;
      }
      ++n;
      --budget.messages;
      budget.bytes -= std::min(budget.bytes, bytes);
      if (parts > kMaxParts) {
        if (!dealer) ++stats.messages;
        ++stats.malformed;
        ++stats.too_many_parts;
        continue;
      }
      if (dealer) {
        on_answer(inst, frames, now);
      } else {
        on_live(inst, frames, now);
      }
    }
    return n;
  }

  void act_all(Clock::time_point now) {
    for (auto& [id, inst] : instances)
      act(inst, now);
  }

  std::size_t poll(milliseconds timeout) {
    Clock::time_point now = Clock::now();
    act_all(now);
    std::vector<zmq::pollitem_t> items;
    std::vector<std::pair<Instance*, bool>> owners;
    items.reserve(2 * instances.size());
    milliseconds wait = std::max(timeout, milliseconds(0));
    for (auto& [id, inst] : instances) {
      items.push_back({inst.sub.handle(), 0, ZMQ_POLLIN, 0});
      owners.emplace_back(&inst, false);
      if (inst.dealer) {
        items.push_back({inst.dealer->handle(), 0, ZMQ_POLLIN, 0});
        owners.emplace_back(&inst, true);
      }
      if (inst.request.kind != Request::Kind::none) {
        Clock::time_point due = inst.request.deadline;
        if (inst.request.last_frame)
          due = std::min(due, *inst.request.last_frame + opt.tail_timeout);
        const auto left = std::chrono::ceil<milliseconds>(due - now);
        wait = std::clamp(left, milliseconds(0), wait);
      }
    }
    std::size_t handled = 0;
    Budget budget;
    budget.messages = opt.max_poll_messages;
    budget.bytes = opt.max_poll_bytes;
    if (items.empty()) {
      std::this_thread::sleep_for(wait);  // a caller's loop must not spin
    } else {
      try {
        zmq::poll(items.data(), items.size(), wait);
      } catch (const zmq::error_t&) {  // EINTR: nothing received this time
      }
      now = Clock::now();
      budget.until = now + opt.poll_work_budget;
      // Answers first (they close gaps), then the live sockets, from a
      // rotating first one so that a flooding instance cannot starve the
      // others of the budget.
      const std::size_t n = items.size();
      for (int pass = 0; pass < 2; ++pass) {
        for (std::size_t j = 0; j < n; ++j) {
          const std::size_t k = (j + rotation) % n;
          if (owners[k].second != (pass == 0) || (items[k].revents & ZMQ_POLLIN) == 0) continue;
          handled += drain(*owners[k].first, owners[k].second, now, budget);
        }
      }
      ++rotation;
    }
    now = Clock::now();
    if (opt.expire_silent) index.expire(now);
    act_all(now);
    return handled;
  }
};

Subscriber::Subscriber(RouterIndex& index, SubscriberOptions options) {
  if (options.request_timeout.count() <= 0)
    throw InvalidArgument("router subscriber: request_timeout must be > 0");
  if (options.tail_timeout.count() <= 0)
    throw InvalidArgument("router subscriber: tail_timeout must be > 0");
  if (options.max_message_bytes == 0)
    throw InvalidArgument("router subscriber: max_message_bytes must be > 0");
  if (options.receive_high_water_mark <= 0)
    throw InvalidArgument("router subscriber: receive_high_water_mark must be > 0");
  if (options.max_snapshot_bytes == 0 || options.max_poll_messages == 0 ||
      options.max_poll_bytes == 0 || options.poll_work_budget.count() <= 0)
    throw InvalidArgument(
        "router subscriber: max_snapshot_bytes, max_poll_messages, max_poll_bytes and "
        "poll_work_budget must be > 0");
  impl_ = std::make_unique<Impl>(index, std::move(options));
}

Subscriber::~Subscriber() = default;

void Subscriber::add_instance(InstanceId id, const InstanceEndpoints& endpoints,
                              Clock::time_point now) {
  Impl& m = *impl_;
  if (m.instances.contains(id) || m.index.has_instance(id) || id >= kMaxInstances) {
    throw InvalidArgument("router subscriber: add_instance: instance " + std::to_string(id) +
                          (id >= kMaxInstances ? " is out of range" : " is known"));
  }
  check_endpoint(endpoints.events, "events");
  if (!endpoints.replay.empty()) check_endpoint(endpoints.replay, "replay");
  Impl::Instance inst{.id = id,
                      .endpoints = endpoints,
                      .sub = zmq::socket_t(m.ctx, zmq::socket_type::sub),
                      .dealer = std::nullopt,
                      .dealer_generation = 0,
                      .request = {},
                      .snapshot_not_before = {},
                      .unserved = {},
                      .snapshot_floor = std::nullopt};
  inst.sub.set(zmq::sockopt::linger, 0);
  inst.sub.set(zmq::sockopt::rcvhwm, m.opt.receive_high_water_mark);
  // A larger frame ends the session (a protocol error; ZeroMQ does not
  // reconnect, the instance goes silent): never read.
  inst.sub.set(zmq::sockopt::maxmsgsize, Impl::max_frame(m.opt.max_message_bytes));
  inst.sub.set(zmq::sockopt::subscribe, m.opt.topic);
  connect_or_throw(inst.sub, endpoints.events, "events");
  if (!endpoints.replay.empty()) m.open_dealer(inst);
  m.index.add_instance(id, now);
  m.instances.emplace(id, std::move(inst));
}

void Subscriber::remove_instance(InstanceId id) {
  Impl& m = *impl_;
  m.get(id, "remove_instance");
  m.instances.erase(id);  // closes its sockets
  m.index.remove_instance(id);
}

std::size_t Subscriber::poll(std::chrono::milliseconds timeout) {
  return impl_->poll(timeout);
}

bool Subscriber::wait_for(InstanceId id, std::uint64_t next_seq,
                          std::chrono::milliseconds timeout) {
  Impl& m = *impl_;
  Impl::Instance& inst = m.get(id, "wait_for");
  const Clock::time_point start = Clock::now();
  const Clock::time_point deadline = start + timeout;
  Clock::time_point progress = start;
  std::optional<std::uint64_t> seen = m.index.status(id).last_seq;
  while (true) {
    const Clock::time_point now = Clock::now();
    const InstanceStatus st = m.index.status(id);
    const bool all = next_seq == 0 || (st.last_seq && *st.last_seq + 1 >= next_seq);
    if (all && st.need.kind == Need::Kind::nothing) return true;
    if (st.last_seq != seen) {
      seen = st.last_seq;
      progress = now;
    }
    if (now >= deadline) return false;
    // A loss at the tail: nothing tells the index a batch is missing.
    if (!all && st.need.kind == Need::Kind::nothing && inst.dealer &&
        inst.request.kind == Impl::Request::Kind::none && now - progress >= m.opt.tail_timeout) {
      m.request_replay(inst, st.last_seq ? *st.last_seq + 1 : 0, now);
      progress = now;
    }
    const auto left = std::chrono::ceil<milliseconds>(deadline - now);
    m.poll(std::min(left, kWaitSlice));
  }
}

SubscriberStats Subscriber::stats() const noexcept {
  return impl_->stats;
}

}  // namespace kvport::router
