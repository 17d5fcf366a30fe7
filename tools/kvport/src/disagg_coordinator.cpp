// SPDX-License-Identifier: Apache-2.0
// `kvport disagg`'s coordinator (disagg_coordinator.hpp).
#include "disagg_coordinator.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <ostream>

#include "kvport/platform/error.hpp"

namespace kvport::cli::disagg {

using nlohmann::json;

namespace {

// What a worker that stops reading its stdin (hung, stopped) may hold up the
// coordinator's write to it: then it is lost, as if its peers reported it.
constexpr std::chrono::milliseconds kMinSendTimeout{2000};

}  // namespace

Coordinator::Coordinator(const RunOptions& options, std::vector<Request> requests,
                         std::size_t skipped)
    : options_(options), requests_(std::move(requests)), pending_(requests_.size()) {
  stats_.requests = requests_.size();
  stats_.skipped = skipped;
}

std::chrono::milliseconds Coordinator::shutdown_grace() const {
  return options_.peer_timeout + std::chrono::milliseconds(2500);
}

// The scratch buffers of the raw reads: what one decode rank pulls for the
// largest request of >= 16 blocks (at most 512 MiB); the idle baseline reads
// what it pulls for a mean one.
void Coordinator::size_baseline() {
  std::uint64_t sum = 0, n = 0, largest = 16;
  for (const Request& r : requests_) {
    if (r.blocks >= 16) {
      sum += r.blocks;
      ++n;
      largest = std::max<std::uint64_t>(largest, r.blocks);
    }
  }
  const std::uint64_t per_block = options_.block_bytes / options_.tp_decode;
  scratch_bytes_ = std::min<std::uint64_t>(largest * per_block, std::uint64_t{512} << 20);
  stats_.baseline_bytes = std::min<std::uint64_t>((n ? sum / n : 16) * per_block, scratch_bytes_);
}

void Coordinator::spawn_all(ProcessGroup& group) {
  for (const Role role : {Role::decode, Role::prefill}) {
    for (std::uint32_t i = 0; i < options_.instances(role); ++i) {
      for (std::uint32_t r = 0; r < options_.tp(role); ++r) {
        WorkerSpec s;
        s.role = role;
        s.instance = i;
        s.rank = r;
        s.tp = options_.tp(role);
        s.config = options_.config;
        s.model_layers = options_.layers;
        s.state_slots = options_.state_slots;
        s.capacity_blocks = options_.capacity_blocks;
        s.peer_timeout = options_.peer_timeout;
        s.lease_ttl = options_.lease_ttl;
        s.bind = options_.bind;
        // The baseline pair: decode 0.0 reads prefill 0.0's scratch.
        if (i == 0 && r == 0) s.scratch_bytes = scratch_bytes_;
        WorkerRecord w;
        w.role = role;
        w.instance = i;
        w.rank = r;
        w.child =
            group.spawn(w.name(), {"/proc/self/exe", "disagg", "--worker", s.to_json().dump()});
        stats_.workers.push_back(std::move(w));
      }
    }
  }
  stats_.processes_started = stats_.workers.size();
}

Outcome Coordinator::stop(Outcome outcome, std::ostream& err, const std::string& why) {
  stats_.failure = why;
  err << "kvport disagg: " << why << '\n';
  stats_.wall_seconds = std::chrono::duration<double>(Clock::now() - started_).count();
  return outcome;
}

template <typename Pred>
bool Coordinator::wait_for(ProcessGroup& group, const TerminationSignals& signals,
                           Clock::time_point deadline, Pred pred) {
  while (!pred()) {
    if (signals.requested() || Clock::now() > deadline) return false;
    pump(group, std::chrono::milliseconds(20));
    if (!stats_.failure.empty()) return false;
  }
  return true;
}

Outcome Coordinator::run(ProcessGroup& group, const TerminationSignals& signals,
                         std::ostream& err) {
  size_baseline();
  started_ = Clock::now();
  const auto deadline = started_ + options_.timeout;
  // Why a phase did not complete: a signal, the deadline, or what went wrong.
  auto phase_failed = [&](const char* phase) {
    if (signals.requested()) {
      return stop(Outcome::interrupted, err,
                  fmt::format("interrupted by signal {} while {}", signals.signal(), phase));
    }
    if (!stats_.failure.empty()) {
      const std::string why = stats_.failure;
      return stop(Outcome::failed, err, why);
    }
    return stop(Outcome::failed, err,
                fmt::format("--timeout-s {} expired while {}", options_.timeout.count(), phase));
  };
  spawn_all(group);

  // Phase 1: every worker ready; then the prefill ranks connect.
  if (!wait_for(group, signals, deadline, [&] {
        return std::all_of(stats_.workers.begin(), stats_.workers.end(),
                           [](const WorkerRecord& w) { return w.ready; });
      })) {
    if (listen_failed_) {
      throw InvalidArgument(fmt::format("--bind {}: the workers cannot listen there: {}",
                                        options_.bind, stats_.failure));
    }
    return phase_failed("the workers were starting");
  }
  json addresses = json::array();
  for (std::uint32_t i = 0; i < options_.decode; ++i) {
    json ranks = json::array();
    for (const WorkerRecord& w : stats_.workers) {
      if (w.role == Role::decode && w.instance == i) ranks.push_back(w.address);
    }
    addresses.push_back(ranks);
  }
  json connect = op_message(op::connect);
  connect[field::decode] = addresses;
  for (const WorkerRecord& w : stats_.workers) {
    if (w.role == Role::prefill) send(group, w, connect);
  }
  if (!wait_for(group, signals, deadline, [&] {
        return std::all_of(stats_.workers.begin(), stats_.workers.end(), [](const WorkerRecord& w) {
          return w.role != Role::prefill || w.connected;
        });
      })) {
    return phase_failed("the prefill workers were connecting");
  }
  // Phase 2: the raw baseline, before any request (the pools are idle).
  json baseline = op_message(op::baseline);
  baseline["bytes"] = stats_.baseline_bytes;
  baseline["repeat"] = 5;
  send(group, *find(Role::decode, 0, 0), baseline);
  if (!wait_for(group, signals, deadline, [&] { return baseline_done_; })) {
    return phase_failed("the baseline transfer was running");
  }
  // Phase 3: the requests, a bounded number in flight.
  dispatching_ = true;
  const std::size_t window = 2 * options_.prefill;
  std::size_t next = 0;
  while (true) {
    std::size_t in_flight = 0;
    for (const Pending& p : pending_)
      in_flight += p.sent && !p.done;
    while (next < requests_.size() && in_flight < window) {
      dispatch(group, next++);
      ++in_flight;
    }
    if (next == requests_.size() && in_flight == 0) break;
    if (signals.requested()) return phase_failed("the requests were replayed");
    if (Clock::now() > deadline) return phase_failed("the requests were replayed");
    if (!alive_any(Role::decode) && !alive_any(Role::prefill)) {
      return stop(Outcome::failed, err, "every worker died");
    }
    pump(group, std::chrono::milliseconds(20));
    maybe_kill(group);
  }
  // Phase 4: drain and collect each survivor's stats. Peers that leave now
  // are not lost.
  finishing_ = true;
  for (const WorkerRecord& w : stats_.workers)
    send(group, w, op_message(op::finish));
  const auto finish_deadline =
      Clock::now() + options_.lease_ttl + 4 * options_.peer_timeout + std::chrono::seconds(10);
  const bool finished =
      wait_for(group, signals, std::min(deadline, finish_deadline) + std::chrono::seconds(5), [&] {
        return std::all_of(stats_.workers.begin(), stats_.workers.end(),
                           [](const WorkerRecord& w) { return !w.alive || w.stats; });
      });
  if (!finished && signals.requested()) return phase_failed("the workers were finishing");
  // A survivor without its stats fails the checks: the report says which.
  stats_.wall_seconds = std::chrono::duration<double>(Clock::now() - started_).count();
  return Outcome::done;
}

void Coordinator::record_exits(const std::vector<ProcessEvent>& exits) {
  for (const ProcessEvent& e : exits) {
    for (WorkerRecord& w : stats_.workers) {
      if (w.child != e.child || w.exit_code) continue;
      w.exit_code = e.exit_code;
      w.exit_signal = e.signal;
      w.force_killed = e.force_killed;
      w.alive = false;
      if (w.end == WorkerEnd::running) w.end = w.stats ? WorkerEnd::finished : WorkerEnd::stopped;
    }
  }
}

bool Coordinator::send(ProcessGroup& group, const WorkerRecord& w, const json& j) {
  if (!w.alive) return false;
  const auto timeout = std::max(kMinSendTimeout, options_.peer_timeout);
  if (group.send_line(w.child, j.dump(), timeout)) return true;
  return false;
}

void Coordinator::send_to_instance(ProcessGroup& group, Role role, std::uint32_t instance,
                                   const json& j) {
  for (const WorkerRecord& w : stats_.workers) {
    if (w.role == role && w.instance == instance) send(group, w, j);
  }
}

json Coordinator::recompute_op(std::size_t index) const {
  json j = op_message(op::recompute);
  j[field::req] = index;
  j[field::tokens] = requests_[index].tokens;
  return j;
}

WorkerRecord* Coordinator::find(Role role, std::uint32_t instance, std::uint32_t rank) {
  for (WorkerRecord& w : stats_.workers) {
    if (w.role == role && w.instance == instance && w.rank == rank) return &w;
  }
  return nullptr;
}

WorkerRecord* Coordinator::find(const std::string& name) {
  for (WorkerRecord& w : stats_.workers) {
    if (w.name() == name) return &w;
  }
  return nullptr;
}

bool Coordinator::instance_alive(Role role, std::uint32_t instance) const {
  return std::all_of(stats_.workers.begin(), stats_.workers.end(), [&](const WorkerRecord& w) {
    return w.role != role || w.instance != instance || w.alive;
  });
}

bool Coordinator::alive_any(Role role) const {
  for (std::uint32_t i = 0; i < options_.instances(role); ++i) {
    if (instance_alive(role, i)) return true;
  }
  return false;
}

std::optional<std::uint32_t> Coordinator::pick(Role role, std::uint32_t& cursor) const {
  const std::uint32_t n = options_.instances(role);
  for (std::uint32_t k = 0; k < n; ++k) {
    const std::uint32_t i = (cursor + k) % n;
    if (instance_alive(role, i)) {
      cursor = i + 1;
      return i;
    }
  }
  return std::nullopt;
}

// Sends a request to a prefill instance feeding a decode instance; without
// one of them alive, it is computed locally where possible (recompute).
void Coordinator::dispatch(ProcessGroup& group, std::size_t index) {
  Pending& r = pending_[index];
  r.sent = true;
  r.ranks_done.clear();
  r.prefill.reset();
  r.fell_back = false;
  r.local_on_prefill = false;
  auto decode = pick(Role::decode, decode_cursor_);
  auto prefill = decode ? pick(Role::prefill, prefill_cursor_) : std::nullopt;
  if (decode && prefill) {
    r.prefill = *prefill;
    r.decode = *decode;
    json j = op_message(op::prefill);
    j[field::req] = index;
    j[field::decode] = *decode;
    j[field::tokens] = requests_[index].tokens;
    send_to_instance(group, Role::prefill, *prefill, j);
  } else if (decode) {
    r.decode = *decode;
    ++stats_.recomputed;
    send_to_instance(group, Role::decode, *decode, recompute_op(index));
  } else if (auto local = pick(Role::prefill, prefill_cursor_)) {
    r.decode = *local;
    r.local_on_prefill = true;
    ++stats_.recomputed;
    send_to_instance(group, Role::prefill, *local, recompute_op(index));
  } else {
    r.sent = false;  // nobody left: the loop stops on "every worker died"
  }
}

// Computes the request without a transfer: on a decode instance, else on a
// prefill instance. Ranks of the same instance that already reported keep
// their report (a worker answers a request once).
void Coordinator::dispatch_recompute(ProcessGroup& group, std::size_t index) {
  Pending& r = pending_[index];
  ++stats_.recomputed;
  r.prefill.reset();
  auto send_missing = [&](Role role, std::uint32_t instance, bool local) {
    if (instance != r.decode || local != r.local_on_prefill) r.ranks_done.clear();
    r.decode = instance;
    r.local_on_prefill = local;
    for (const WorkerRecord& w : stats_.workers) {
      if (w.role == role && w.instance == instance && !r.ranks_done.contains(w.rank)) {
        send(group, w, recompute_op(index));
      }
    }
  };
  if (auto decode = pick(Role::decode, decode_cursor_)) {
    send_missing(Role::decode, *decode, false);
  } else if (auto local = pick(Role::prefill, prefill_cursor_)) {
    send_missing(Role::prefill, *local, true);
  }
}

void Coordinator::pump(ProcessGroup& group, std::chrono::milliseconds timeout) {
  for (const ProcessEvent& e : group.poll(timeout)) {
    WorkerRecord* w = nullptr;
    for (WorkerRecord& x : stats_.workers) {
      if (x.child == e.child) w = &x;
    }
    if (w == nullptr) continue;
    if (e.kind == ProcessEvent::Kind::exited) {
      on_exit(group, *w, e);
      continue;
    }
    if (e.kind != ProcessEvent::Kind::line) continue;
    json j;
    try {
      j = json::parse(e.text);
    } catch (const json::exception&) {
      continue;  // not ours (a library printing to stdout)
    }
    if (j.is_object()) on_event(group, *w, j);
  }
  // A worker that stopped reading its stdin (a write to it timed out) is lost.
  for (WorkerRecord& w : stats_.workers) {
    if (w.alive && w.end == WorkerEnd::running && !group.writable(w.child) && !finishing_ &&
        group.alive(w.child)) {
      mark_lost(group, w, "coordinator (its stdin stayed full)");
    }
  }
}

void Coordinator::on_event(ProcessGroup& group, WorkerRecord& w, const json& j) {
  const std::string name = j.value(field::event, "");
  if (name == event::ready) {
    w.ready = true;
    w.address = j.value("address", "");
    stats_.transport = j.value("transport", "");
    stats_.memory_path = j.value("memory_path", "");
  } else if (name == event::connected) {
    w.connected = true;
    if (stats_.lanes.empty()) stats_.lanes = j.value("lanes", "");
  } else if (name == event::baseline) {
    baseline_done_ = true;
    if (const auto it = j.find("seconds"); it != j.end() && it->is_array()) {
      for (const auto& s : *it) {
        if (s.is_number()) stats_.baseline_seconds.push_back(s.get<double>());
      }
    }
    stats_.baseline_why = j.value(field::why, "");
  } else if (name == event::fatal) {
    // A worker that cannot start or follow the protocol ends the run.
    stats_.notes.push_back(fmt::format("{}: {}", w.name(), j.value(field::why, "")));
    if (stats_.failure.empty()) stats_.failure = stats_.notes.back();
    listen_failed_ = listen_failed_ || (!w.ready && j.value("listen", false));
  } else if (name == event::peer_lost) {
    on_peer_lost(group, w, j);
  } else if (name == event::prefill_failed) {
    const auto index = j.value(field::req, requests_.size());
    if (index < requests_.size()) {
      Pending& r = pending_[index];
      // Only once per request: the first rank that could not lease it.
      if (!r.done && r.prefill == w.instance) {
        r.prefill.reset();
        dispatch_recompute(group, index);
      }
    }
  } else if (name == event::lease_end) {
    ++stats_.lease_ends[j.value("end", "")];
  } else if (name == event::done) {
    on_done(w, j);
  } else if (name == event::stats) {
    w.stats = j;
  }
}

// A worker its peers report lost is lost, whether it died, hung or was
// stopped: it is killed (so that it cannot come back half-way), counted, and
// its requests go to the survivors. The process killed on purpose (--kill)
// is the expected loss: its reports time the detection. Losses while the
// workers finish (peers leaving) are not losses.
void Coordinator::on_peer_lost(ProcessGroup& group, const WorkerRecord& reporter, const json& j) {
  const std::string peer = j.value(field::peer, "");
  WorkerRecord* lost = find(peer);
  if (lost == nullptr) return;
  const bool victim = stats_.kill && stats_.kill->victim == peer;
  if (victim && kill_time_) {
    const double ms = std::chrono::duration<double, std::milli>(Clock::now() - *kill_time_).count();
    stats_.kill->loss_detected_ms_max = std::max(stats_.kill->loss_detected_ms_max, ms);
    ++stats_.kill->loss_reports;
  }
  if (finishing_ || !lost->alive || lost->stats || lost->end != WorkerEnd::running) return;
  mark_lost(group, *lost, reporter.name());
}

void Coordinator::mark_lost(ProcessGroup& group, WorkerRecord& w, const std::string& by) {
  w.end = WorkerEnd::lost;
  w.lost_reported_by = by;
  if (!stats_.kill || stats_.kill->victim != w.name()) {
    ++stats_.workers_lost;
    stats_.notes.push_back(fmt::format("{} lost (reported by {}): killed", w.name(), by));
    // Before the replay a missing worker ends the run at once, as an exit does.
    if (!dispatching_ && stats_.failure.empty()) stats_.failure = stats_.notes.back();
  }
  group.kill(w.child, SIGKILL);
  lose(group, w);
}

void Coordinator::on_done(WorkerRecord& w, const json& j) {
  const auto index = j.value(field::req, requests_.size());
  if (index >= requests_.size()) return;
  Pending& r = pending_[index];
  if (r.done) return;
  const bool expected = (w.role == Role::decode && !r.local_on_prefill && r.decode == w.instance) ||
                        (w.role == Role::prefill && r.local_on_prefill && r.decode == w.instance);
  if (!expected) return;
  r.ranks_done.insert(w.rank);
  if (j.value("ok", false)) {
    ++stats_.transfers;
    const auto bytes = j.value("bytes", std::uint64_t{0});
    const double seconds = j.value("transfer_s", 0.0);
    stats_.bytes += bytes;
    stats_.transfer_seconds += seconds;
    stats_.blocks += j.value("blocks", std::uint64_t{0});
    stats_.latencies.push_back(seconds);
    stats_.e2e_latencies.push_back(j.value("latency_s", 0.0));
    if (j.value("blocks", std::size_t{0}) >= 16) {
      stats_.bulk_bytes += bytes;
      stats_.bulk_seconds += seconds;
    }
    if (const auto raw = j.value("raw_bytes", std::uint64_t{0}); raw > 0) {
      stats_.raw_bytes += raw;
      stats_.raw_seconds += j.value("raw_s", 0.0);
      // The same pull's rate, for a like-for-like ratio.
      stats_.paired_bytes += bytes;
      stats_.paired_seconds += seconds;
      ++stats_.raw_samples;
    }
    if (j.value("wrong_bytes", std::uint64_t{0}) > 0) ++stats_.verification_failures;
    if (const auto groups = j.find("groups"); groups != j.end() && groups->is_array()) {
      if (stats_.groups.size() < groups->size()) stats_.groups.resize(groups->size());
      for (std::size_t g = 0; g < groups->size(); ++g) {
        const json& one = (*groups)[g];
        GroupTotals& t = stats_.groups[g];
        t.kind = one.value("kind", "");
        t.bytes += one.value("bytes", std::uint64_t{0});
        t.wrong_bytes += one.value("wrong_bytes", std::uint64_t{0});
        t.checked_bytes += one.value("checked_bytes", std::uint64_t{0});
        t.blocks += one.value("blocks", std::uint64_t{0});
      }
    }
  } else if (j.value("recomputed", false)) {
    ++stats_.rank_recomputes;
    // A rank that fell back on its own (its pull failed: the prefill died,
    // or the lease ended) recomputed the request: counted once, whether this
    // report or the prefill's loss (lose()) is seen first.
    if (r.prefill && !r.fell_back) {
      ++stats_.recomputed;
      r.fell_back = true;
    }
  } else {
    r.failed = true;  // not even recomputed (no room): the run fails
    stats_.notes.push_back(fmt::format("request {}: {}", index, j.value(field::why, "")));
  }
  if (r.ranks_done.size() == options_.tp(w.role)) {
    r.done = true;
    if (r.failed) {
      ++stats_.failed_requests;
    } else {
      ++stats_.completed;
    }
  }
}

void Coordinator::on_exit(ProcessGroup& group, WorkerRecord& w, const ProcessEvent& e) {
  w.exit_code = e.exit_code;
  w.exit_signal = e.signal;
  if (w.end == WorkerEnd::running) {
    if (w.stats) {
      w.end = WorkerEnd::finished;
    } else {
      w.end = WorkerEnd::exited;
      ++stats_.unexpected_exits;
      stats_.notes.push_back(fmt::format("{} exited unexpectedly (code {}, signal {})", w.name(),
                                         e.exit_code, e.signal));
      // Before the replay a missing worker ends the run at once.
      if (!dispatching_ && stats_.failure.empty()) stats_.failure = stats_.notes.back();
    }
  }
  if (w.alive) lose(group, w);
}

void Coordinator::lose(ProcessGroup& group, WorkerRecord& w) {
  w.alive = false;
  if (w.end == WorkerEnd::finished) return;
  // Requests waiting on the dead instance go elsewhere.
  for (std::size_t i = 0; i < pending_.size(); ++i) {
    Pending& r = pending_[i];
    if (!r.sent || r.done) continue;
    const bool via_dead_prefill =
        w.role == Role::prefill && r.prefill == w.instance && !r.local_on_prefill;
    const bool on_dead_decode =
        w.role == Role::decode && r.decode == w.instance && !r.local_on_prefill;
    const bool local_on_dead =
        w.role == Role::prefill && r.local_on_prefill && r.decode == w.instance;
    if (on_dead_decode || local_on_dead) {
      dispatch_recompute(group, i);
    } else if (via_dead_prefill) {
      // The decode ranks that have not reported compute it themselves; a
      // pull under way from the dead rank fails and is dropped there.
      for (const WorkerRecord& d : stats_.workers) {
        if (d.role == Role::decode && d.instance == r.decode && !r.ranks_done.contains(d.rank)) {
          send(group, d, recompute_op(i));
        }
      }
      if (!r.fell_back) ++stats_.recomputed;  // unless a rank's own fall-back counted it
      r.prefill.reset();                      // a later prefill_failed from its other ranks is moot
    }
  }
}

void Coordinator::maybe_kill(ProcessGroup& group) {
  if (!options_.kill || kill_time_ || stats_.transfers < options_.kill_after) return;
  WorkerRecord* victim = find(*options_.kill, 0, 0);
  if (victim == nullptr || !victim->alive || victim->end != WorkerEnd::running) return;
  // A stopped victim stays "running" until its peers report it lost.
  if (!options_.kill_stops) victim->end = WorkerEnd::killed;
  stats_.kill = KillRecord{victim->name(), options_.kill_stops, stats_.transfers, 0, 0};
  group.kill(victim->child, options_.kill_stops ? SIGSTOP : SIGKILL);
  kill_time_ = Clock::now();
}

}  // namespace kvport::cli::disagg
