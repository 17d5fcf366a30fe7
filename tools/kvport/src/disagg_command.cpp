// `kvport disagg`: replays a Mooncake trace through prefill and decode worker
// processes on 127.0.0.1 that move KV blocks over UCX (kvport::transfer), and
// reports what moved, how fast (against one contiguous UCX transfer of the
// same bytes, measured in the same run), what was verified, what leaked, and
// how the survivors handled a process killed on purpose (--kill).
#include <arpa/inet.h>
#include <fmt/format.h>
#include <netinet/in.h>

#include <CLI/CLI.hpp>
#include <algorithm>
#include <chrono>
#include <cmath>
#include <map>
#include <memory>
#include <nlohmann/json.hpp>
#include <optional>
#include <ostream>
#include <set>
#include <string>
#include <vector>

#include "cache_options.hpp"
#include "command.hpp"
#include "disagg.hpp"
#include "kvport/cli/cli.hpp"
#include "kvport/cli/flag_values.hpp"
#include "kvport/platform/error.hpp"
#include "kvport/sim/mooncake_trace.hpp"
#include "kvport/sim/trace_tokens.hpp"
#include "process_group.hpp"
#include "text_table.hpp"

namespace kvport::cli {
namespace {

using nlohmann::json;
using Clock = std::chrono::steady_clock;
using disagg::WorkerSpec;

// Mooncake traces hash prompts in blocks of 512 tokens.
constexpr std::size_t kTraceBlockTokens = 512;

struct Worker {
  int child = -1;
  std::string role;
  std::uint32_t instance = 0;
  std::uint32_t rank = 0;
  std::string address;
  bool ready = false;
  bool connected = false;
  bool alive = true;
  bool killed = false;  // by --kill
  std::optional<json> stats;
};

struct Request {
  std::size_t index = 0;
  std::vector<TokenId> tokens;
  std::size_t blocks = 0;
  std::optional<std::uint32_t> prefill;  // instance
  std::uint32_t decode = 0;              // instance, or the prefill instance for a local recompute
  bool local_on_prefill = false;
  std::set<std::uint32_t> ranks_done;  // ranks of the instance that reported
  bool done = false;
  bool sent = false;
  bool failed = false;  // a rank could not compute it at all
};

double percentile(std::vector<double> v, double p) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  const double pos = p * static_cast<double>(v.size() - 1);
  const auto lo = static_cast<std::size_t>(std::floor(pos));
  const auto hi = static_cast<std::size_t>(std::ceil(pos));
  return v[lo] + (v[hi] - v[lo]) * (pos - static_cast<double>(lo));
}

class DisaggCommand final : public Command {
 public:
  void add_options(CLI::App& app) override {
    shape_.add_to(app, "llama-3-8b");
    app.add_option("--trace", trace_, "Mooncake trace (JSON lines) to replay")->type_name("FILE");
    app.add_option("--prefill", prefill_, "Prefill instances (default 1)")->type_name("N");
    app.add_option("--decode", decode_, "Decode instances (default 1)")->type_name("M");
    app.add_option("--tp-prefill", tp_prefill_,
                   "Tensor-parallel ranks per prefill instance (default 1)")
        ->type_name("P");
    app.add_option("--tp-decode", tp_decode_,
                   "Tensor-parallel ranks per decode instance (default 1)")
        ->type_name("D");
    app.add_option("--capacity-blocks", capacity_, "KV blocks of each worker's cache")
        ->type_name("B");
    app.add_option("--requests", max_requests_, "Replay at most this many requests of the trace")
        ->type_name("N");
    app.add_option("--kill", kill_role_,
                   "Kill one process of this role with SIGKILL: prefill or decode")
        ->type_name("ROLE");
    app.add_option("--after", kill_after_, "... after this many completed transfers (with --kill)")
        ->type_name("N");
    app.add_option("--peer-timeout-ms", peer_timeout_ms_,
                   "A peer silent this long is lost (default 1500; the loss bound)")
        ->type_name("MS");
    app.add_option("--lease-ttl-ms", lease_ttl_ms_,
                   "Prefill leases expire after this (default 10000)")
        ->type_name("MS");
    app.add_option("--timeout-s", timeout_s_,
                   "Give up (and stop every process) after this (default 3600)")
        ->type_name("S");
    app.add_option("--bind", bind_, "Local address the workers listen on (default 127.0.0.1)")
        ->type_name("HOST");
    app.add_flag("--json", json_, "Print the report as JSON");
    app.add_option("--worker", worker_spec_, "Internal: run as a worker with this spec")->group("");
  }

  int execute(std::ostream& out, std::ostream& err) override {
    if (!worker_spec_.empty()) {
      json spec;
      try {
        spec = json::parse(worker_spec_);
      } catch (const json::exception& e) {
        throw InvalidArgument(std::string("--worker: not JSON: ") + e.what());
      }
      return disagg::run_worker(WorkerSpec::from_json(spec), out);
    }
    validate();
    load_trace();
    TerminationSignals signals;
    ProcessGroup group;
    const int code = coordinate(group, signals, err);
    group.shutdown(std::chrono::milliseconds(2000));
    report(out, code);
    return code == 2 ? 2 : (checks_pass() ? 0 : 1);
  }

 private:
  void validate() {
    if (trace_.empty()) throw InvalidArgument("--trace: a Mooncake trace file is required");
    if (capacity_ == 0) throw InvalidArgument("--capacity-blocks: required, > 0");
    if (prefill_ == 0 || prefill_ > 16) throw InvalidArgument("--prefill: expected 1..16");
    if (decode_ == 0 || decode_ > 16) throw InvalidArgument("--decode: expected 1..16");
    if (tp_prefill_ == 0 || tp_prefill_ > 8) throw InvalidArgument("--tp-prefill: expected 1..8");
    if (tp_decode_ == 0 || tp_decode_ > 8) throw InvalidArgument("--tp-decode: expected 1..8");
    if (prefill_ * tp_prefill_ + decode_ * tp_decode_ > 32) {
      throw InvalidArgument("at most 32 worker processes (instances x tensor-parallel ranks)");
    }
    {
      in6_addr probe{};
      if (::inet_pton(AF_INET, bind_.c_str(), &probe) != 1 &&
          ::inet_pton(AF_INET6, bind_.c_str(), &probe) != 1) {
        throw InvalidArgument(fmt::format("--bind: '{}' is not an IPv4 or IPv6 address", bind_));
      }
    }
    if (!kill_role_.empty() && kill_role_ != "prefill" && kill_role_ != "decode") {
      throw InvalidArgument(
          fmt::format("--kill: expected prefill or decode, got '{}'", kill_role_));
    }
    if (kill_role_.empty() && kill_after_) throw InvalidArgument("--after needs --kill");
    if (peer_timeout_ms_ <= 0 || lease_ttl_ms_ <= 0 || timeout_s_ <= 0) {
      throw InvalidArgument("--peer-timeout-ms, --lease-ttl-ms and --timeout-s must be > 0");
    }
    config_ = shape_.resolve().config;
    model_ = shape_.resolve().model.name;
    for (std::uint32_t tp : {tp_prefill_, tp_decode_}) {
      if (config_.num_kv_heads % tp != 0) {
        throw InvalidArgument(fmt::format("{} KV heads do not split over tensor-parallel size {}",
                                          config_.num_kv_heads, tp));
      }
    }
    if (tp_prefill_ != tp_decode_ && config_.layout != KvCacheLayout::layer_major) {
      throw InvalidArgument(
          "different --tp-prefill and --tp-decode need --layout layer-major (head slicing)");
    }
    const double bytes =
        static_cast<double>(config_.bytes_per_block()) * static_cast<double>(capacity_);
    if (bytes > 64.0 * (1u << 30)) {
      throw InvalidArgument(
          fmt::format("--capacity-blocks: {} blocks of {} bytes is over 64 GiB per process",
                      capacity_, config_.bytes_per_block()));
    }
  }

  void load_trace() {
    const auto trace = sim::read_mooncake_trace(trace_);
    const std::size_t count =
        max_requests_ ? std::min<std::size_t>(*max_requests_, trace.size()) : trace.size();
    for (std::size_t i = 0; i < count; ++i) {
      Request r;
      r.index = i;
      sim::sequence_tokens(trace[i], i, kTraceBlockTokens, trace[i].input_length, r.tokens);
      r.blocks = (r.tokens.size() + config_.block_size - 1) / config_.block_size;
      if (r.blocks > capacity_) {
        ++skipped_;
        continue;
      }
      requests_.push_back(std::move(r));
    }
    if (requests_.empty()) {
      throw InvalidArgument(fmt::format(
          "--trace: no request fits --capacity-blocks {} ({} skipped)", capacity_, skipped_));
    }
  }

  WorkerSpec spec(const std::string& role, std::uint32_t instance, std::uint32_t rank) const {
    WorkerSpec s;
    s.role = role;
    s.instance = instance;
    s.rank = rank;
    s.tp = role == "prefill" ? tp_prefill_ : tp_decode_;
    s.config = config_;
    s.capacity_blocks = capacity_;
    s.peer_timeout = std::chrono::milliseconds(peer_timeout_ms_);
    s.lease_ttl = std::chrono::milliseconds(lease_ttl_ms_);
    s.bind = bind_;
    // The baseline pair: decode 0.0 reads prefill 0.0's scratch.
    if (instance == 0 && rank == 0) s.scratch_bytes = scratch_bytes_;
    return s;
  }

  // The scratch buffers of the raw reads: what one decode rank pulls for the
  // largest request of >= 16 blocks (at most 512 MiB); the idle baseline
  // reads what it pulls for a mean one.
  void size_baseline() {
    std::uint64_t sum = 0, n = 0, largest = 16;
    for (const Request& r : requests_) {
      if (r.blocks >= 16) {
        sum += r.blocks;
        ++n;
        largest = std::max<std::uint64_t>(largest, r.blocks);
      }
    }
    const std::uint64_t per_block = config_.bytes_per_block() / tp_decode_;
    scratch_bytes_ = std::min<std::uint64_t>(largest * per_block, std::uint64_t{512} << 20);
    baseline_bytes_ = std::min<std::uint64_t>((n ? sum / n : 16) * per_block, scratch_bytes_);
  }

  bool send(ProcessGroup& group, const Worker& w, const json& j) {
    return w.alive && group.send_line(w.child, j.dump());
  }

  int coordinate(ProcessGroup& group, TerminationSignals& signals, std::ostream& err) {
    size_baseline();
    started_ = Clock::now();
    const auto deadline = started_ + std::chrono::seconds(timeout_s_);
    auto add = [&](const std::string& role, std::uint32_t instances, std::uint32_t tp) {
      for (std::uint32_t i = 0; i < instances; ++i) {
        for (std::uint32_t r = 0; r < tp; ++r) {
          Worker w;
          w.role = role;
          w.instance = i;
          w.rank = r;
          w.child = group.spawn(
              fmt::format("{}{}.{}", role, i, r),
              {"/proc/self/exe", "disagg", "--worker", spec(role, i, r).to_json().dump()});
          workers_.push_back(w);
        }
      }
    };
    add("decode", decode_, tp_decode_);
    add("prefill", prefill_, tp_prefill_);
    processes_started_ = workers_.size();

    // Phase 1: every worker ready; then the prefill ranks connect.
    if (!wait_for(group, signals, deadline, [&] {
          return std::all_of(workers_.begin(), workers_.end(),
                             [](const Worker& w) { return w.ready; });
        })) {
      if (listen_failed_) {
        throw InvalidArgument(
            fmt::format("--bind {}: the workers cannot listen there: {}", bind_, failure_));
      }
      return fail(err, failure_.empty() ? "the workers did not start" : failure_);
    }
    json addresses = json::array();
    for (std::uint32_t i = 0; i < decode_; ++i) {
      json ranks = json::array();
      for (const Worker& w : workers_) {
        if (w.role == "decode" && w.instance == i) ranks.push_back(w.address);
      }
      addresses.push_back(ranks);
    }
    for (const Worker& w : workers_) {
      if (w.role == "prefill") send(group, w, {{"op", "connect"}, {"decode", addresses}});
    }
    if (!wait_for(group, signals, deadline, [&] {
          return std::all_of(workers_.begin(), workers_.end(),
                             [](const Worker& w) { return w.role != "prefill" || w.connected; });
        })) {
      return fail(err, "the prefill workers did not connect");
    }
    // Phase 2: the raw baseline, before any request (the pools are idle).
    send(group, find("decode", 0, 0),
         {{"op", "baseline"}, {"bytes", baseline_bytes_}, {"repeat", 5}});
    if (!wait_for(group, signals, deadline, [&] { return baseline_done_; })) {
      return fail(err, "the baseline transfer did not finish");
    }
    // Phase 3: the requests, a bounded number in flight.
    dispatching_ = true;
    const std::size_t window = 2 * prefill_;
    std::size_t next = 0;
    while (true) {
      std::size_t in_flight = 0;
      for (const Request& r : requests_)
        in_flight += r.sent && !r.done;
      while (next < requests_.size() && in_flight < window) {
        dispatch(group, requests_[next++]);
        ++in_flight;
      }
      if (next == requests_.size() && in_flight == 0) break;
      if (signals.requested()) return fail(err, "interrupted");
      if (Clock::now() > deadline)
        return fail(err, fmt::format("not done within --timeout-s {}", timeout_s_));
      if (!alive_any("decode") && !alive_any("prefill")) return fail(err, "every worker died");
      pump(group, std::chrono::milliseconds(20));
      maybe_kill(group);
    }
    // Phase 4: drain and collect each survivor's stats.
    for (const Worker& w : workers_)
      send(group, w, {{"op", "finish"}});
    const auto finish_deadline = Clock::now() +
                                 std::chrono::milliseconds(lease_ttl_ms_ + 4 * peer_timeout_ms_) +
                                 std::chrono::seconds(10);
    wait_for(group, signals, std::min(deadline, finish_deadline) + std::chrono::seconds(5), [&] {
      return std::all_of(workers_.begin(), workers_.end(),
                         [](const Worker& w) { return !w.alive || w.stats; });
    });
    wall_seconds_ = std::chrono::duration<double>(Clock::now() - started_).count();
    return 0;
  }

  int fail(std::ostream& err, const std::string& why) {
    failure_ = why;
    err << "kvport disagg: " << why << '\n';
    wall_seconds_ = std::chrono::duration<double>(Clock::now() - started_).count();
    return 1;
  }

  template <typename Pred>
  bool wait_for(ProcessGroup& group, TerminationSignals& signals, Clock::time_point deadline,
                Pred pred) {
    while (!pred()) {
      if (signals.requested() || Clock::now() > deadline) return false;
      pump(group, std::chrono::milliseconds(20));
      if (!failure_.empty()) return false;
    }
    return true;
  }

  Worker& find(const std::string& role, std::uint32_t instance, std::uint32_t rank) {
    for (Worker& w : workers_) {
      if (w.role == role && w.instance == instance && w.rank == rank) return w;
    }
    throw InvalidArgument("no such worker");
  }

  bool instance_alive(const std::string& role, std::uint32_t instance) const {
    return std::all_of(workers_.begin(), workers_.end(), [&](const Worker& w) {
      return w.role != role || w.instance != instance || w.alive;
    });
  }

  bool alive_any(const std::string& role) const {
    const std::uint32_t n = role == "prefill" ? prefill_ : decode_;
    for (std::uint32_t i = 0; i < n; ++i) {
      if (instance_alive(role, i)) return true;
    }
    return false;
  }

  std::optional<std::uint32_t> pick(const std::string& role, std::uint32_t& cursor) const {
    const std::uint32_t n = role == "prefill" ? prefill_ : decode_;
    for (std::uint32_t k = 0; k < n; ++k) {
      const std::uint32_t i = (cursor + k) % n;
      if (instance_alive(role, i)) {
        cursor = i + 1;
        return i;
      }
    }
    return std::nullopt;
  }

  void send_to_instance(ProcessGroup& group, const std::string& role, std::uint32_t instance,
                        const json& j) {
    for (const Worker& w : workers_) {
      if (w.role == role && w.instance == instance) send(group, w, j);
    }
  }

  // Sends a request to a prefill instance feeding a decode instance; without
  // one of them alive, it is computed locally where possible (recompute).
  void dispatch(ProcessGroup& group, Request& r) {
    r.sent = true;
    r.ranks_done.clear();
    r.prefill.reset();
    r.local_on_prefill = false;
    auto decode = pick("decode", decode_cursor_);
    auto prefill = decode ? pick("prefill", prefill_cursor_) : std::nullopt;
    if (decode && prefill) {
      r.prefill = *prefill;
      r.decode = *decode;
      send_to_instance(
          group, "prefill", *prefill,
          {{"op", "prefill"}, {"req", r.index}, {"decode", *decode}, {"tokens", r.tokens}});
    } else if (decode) {
      r.decode = *decode;
      ++recomputed_;
      send_to_instance(group, "decode", *decode,
                       {{"op", "recompute"}, {"req", r.index}, {"tokens", r.tokens}});
    } else if (auto local = pick("prefill", prefill_cursor_)) {
      r.decode = *local;
      r.local_on_prefill = true;
      ++recomputed_;
      send_to_instance(group, "prefill", *local,
                       {{"op", "recompute"}, {"req", r.index}, {"tokens", r.tokens}});
    } else {
      r.sent = false;  // nobody left: the loop stops on "every worker died"
    }
  }

  Request* request(std::uint64_t index) {
    for (Request& r : requests_) {
      if (r.index == index) return &r;
    }
    return nullptr;
  }

  void pump(ProcessGroup& group, std::chrono::milliseconds timeout) {
    for (const ProcessEvent& e : group.poll(timeout)) {
      Worker* w = nullptr;
      for (Worker& x : workers_) {
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
      on_event(group, *w, j);
    }
  }

  void on_exit(ProcessGroup& group, Worker& w, const ProcessEvent& e) {
    w.alive = false;
    if (w.stats) return;  // finished normally
    if (!w.killed) {
      ++unexpected_exits_;
      failure_notes_.push_back(fmt::format("{}{}.{} exited unexpectedly (code {}, signal {})",
                                           w.role, w.instance, w.rank, e.exit_code, e.signal));
      // Before the replay a missing worker ends the run at once.
      if (!dispatching_ && failure_.empty()) failure_ = failure_notes_.back();
    }
    // Requests waiting on the dead instance go elsewhere.
    for (Request& r : requests_) {
      if (!r.sent || r.done) continue;
      const bool via_dead_prefill =
          w.role == "prefill" && r.prefill == w.instance && !r.local_on_prefill;
      const bool on_dead_decode =
          w.role == "decode" && r.decode == w.instance && !r.local_on_prefill;
      const bool local_on_dead =
          w.role == "prefill" && r.local_on_prefill && r.decode == w.instance;
      if (on_dead_decode || local_on_dead) {
        dispatch_recompute(group, r);
      } else if (via_dead_prefill) {
        // The decode ranks that have not reported compute it themselves;
        // a pull under way from the dead rank fails and is dropped there.
        for (const Worker& d : workers_) {
          if (d.role == "decode" && d.instance == r.decode && !r.ranks_done.contains(d.rank)) {
            send(group, d, {{"op", "recompute"}, {"req", r.index}, {"tokens", r.tokens}});
          }
        }
        ++recomputed_;
        r.prefill.reset();  // a later prefill_failed from its other ranks is moot
      }
    }
  }

  // Computes the request without a transfer: on a decode instance, else on a
  // prefill instance. Ranks of the same instance that already reported keep
  // their report (a worker answers a request once).
  void dispatch_recompute(ProcessGroup& group, Request& r) {
    ++recomputed_;
    r.prefill.reset();
    auto send_missing = [&](const std::string& role, std::uint32_t instance, bool local) {
      if (instance != r.decode || local != r.local_on_prefill) r.ranks_done.clear();
      r.decode = instance;
      r.local_on_prefill = local;
      for (const Worker& w : workers_) {
        if (w.role == role && w.instance == instance && !r.ranks_done.contains(w.rank)) {
          send(group, w, {{"op", "recompute"}, {"req", r.index}, {"tokens", r.tokens}});
        }
      }
    };
    if (auto decode = pick("decode", decode_cursor_)) {
      send_missing("decode", *decode, false);
    } else if (auto local = pick("prefill", prefill_cursor_)) {
      send_missing("prefill", *local, true);
    }
  }

  void on_event(ProcessGroup& group, Worker& w, const json& j) {
    const std::string event = j.value("event", "");
    if (event == "ready") {
      w.ready = true;
      w.address = j.value("address", "");
      transport_ = j.value("transport", "");
      memory_path_ = j.value("memory_path", "");
    } else if (event == "connected") {
      w.connected = true;
      if (lanes_.empty()) lanes_ = j.value("lanes", "");
    } else if (event == "baseline") {
      baseline_done_ = true;
      for (const auto& s : j.at("seconds"))
        baseline_seconds_.push_back(s.get<double>());
      baseline_why_ = j.value("why", "");
    } else if (event == "fatal") {
      // A worker that cannot start or follow the protocol ends the run.
      failure_notes_.push_back(
          fmt::format("{}{}.{}: {}", w.role, w.instance, w.rank, j.value("why", "")));
      if (failure_.empty()) failure_ = failure_notes_.back();
      listen_failed_ = listen_failed_ || (!w.ready && j.value("listen", false));
    } else if (event == "peer_lost") {
      // The detection time of the process killed on purpose; other losses
      // (an instance's other ranks, workers leaving at the end) are not it.
      if (kill_time_ && j.value("peer", "") == victim_name_) {
        const double ms =
            std::chrono::duration<double, std::milli>(Clock::now() - *kill_time_).count();
        loss_detect_ms_ = std::max(loss_detect_ms_, ms);
        ++loss_reports_;
      }
    } else if (event == "prefill_failed") {
      if (Request* r = request(j.at("req").get<std::uint64_t>());
          r && !r->done && r->prefill == w.instance) {
        // Only once per request: the first rank that could not lease it.
        r->prefill.reset();
        dispatch_recompute(group, *r);
      }
    } else if (event == "lease_end") {
      ++lease_ends_[j.value("end", "")];
    } else if (event == "done") {
      on_done(w, j);
    } else if (event == "stats") {
      w.stats = j;
    }
  }

  void on_done(Worker& w, const json& j) {
    Request* r = request(j.at("req").get<std::uint64_t>());
    if (r == nullptr || r->done) return;
    const bool expected = (w.role == "decode" && !r->local_on_prefill && r->decode == w.instance) ||
                          (w.role == "prefill" && r->local_on_prefill && r->decode == w.instance);
    if (!expected) return;
    r->ranks_done.insert(w.rank);
    if (j.value("ok", false)) {
      ++transfers_;
      const auto bytes = j.value("bytes", std::uint64_t{0});
      const double seconds = j.value("transfer_s", 0.0);
      bytes_ += bytes;
      transfer_seconds_ += seconds;
      blocks_ += j.value("blocks", std::uint64_t{0});
      latencies_.push_back(seconds);
      e2e_latencies_.push_back(j.value("latency_s", 0.0));
      if (j.value("blocks", std::size_t{0}) >= 16) {
        bulk_bytes_ += bytes;
        bulk_seconds_ += seconds;
      }
      if (const auto raw = j.value("raw_bytes", std::uint64_t{0}); raw > 0) {
        raw_bytes_ += raw;
        raw_seconds_ += j.value("raw_s", 0.0);
        // The same pull's rate, for a like-for-like ratio.
        paired_bytes_ += bytes;
        paired_seconds_ += seconds;
        ++raw_samples_;
      }
      if (j.value("wrong_bytes", std::uint64_t{0}) > 0) ++verification_failures_;
    } else if (j.value("recomputed", false)) {
      ++rank_recomputes_;
    } else {
      r->failed = true;  // not even recomputed (no room): the run fails
      failure_notes_.push_back(fmt::format("request {}: {}", r->index, j.value("why", "")));
    }
    const std::uint32_t ranks = w.role == "decode" ? tp_decode_ : tp_prefill_;
    if (r->ranks_done.size() == ranks) {
      r->done = true;
      if (r->failed) {
        ++failed_requests_;
      } else {
        ++completed_;
      }
    }
  }

  void maybe_kill(ProcessGroup& group) {
    if (kill_role_.empty() || kill_time_ || transfers_ < kill_after_.value_or(1)) return;
    Worker& victim = find(kill_role_, 0, 0);
    if (!victim.alive) return;
    victim.killed = true;
    victim_name_ = fmt::format("{}{}.{}", victim.role, victim.instance, victim.rank);
    group.kill(victim.child, SIGKILL);
    kill_time_ = Clock::now();
    kill_at_transfers_ = transfers_;
  }

  bool checks_pass() const {
    if (!failure_.empty() || verification_failures_ > 0 || unexpected_exits_ > 0) return false;
    if (completed_ != requests_.size()) return false;
    for (const Worker& w : workers_) {
      if (w.killed) continue;
      if (!w.stats || (*w.stats).value("leaked_blocks", 1) != 0 ||
          !(*w.stats).value("invariants_ok", false)) {
        return false;
      }
    }
    return !kill_time_ ||
           (loss_reports_ > 0 && loss_detect_ms_ <= static_cast<double>(peer_timeout_ms_) + 500);
  }

  json report_json(int code) const {
    const double gbps =
        transfer_seconds_ > 0 ? static_cast<double>(bytes_) / transfer_seconds_ / 1e9 : 0;
    const double bulk_gbps =
        bulk_seconds_ > 0 ? static_cast<double>(bulk_bytes_) / bulk_seconds_ / 1e9 : 0;
    const double idle_s = baseline_seconds_.empty() ? 0 : percentile(baseline_seconds_, 0.5);
    const double idle_gbps = idle_s > 0 ? static_cast<double>(baseline_bytes_) / idle_s / 1e9 : 0;
    const double raw_gbps =
        raw_seconds_ > 0 ? static_cast<double>(raw_bytes_) / raw_seconds_ / 1e9 : 0;
    const double paired_gbps =
        paired_seconds_ > 0 ? static_cast<double>(paired_bytes_) / paired_seconds_ / 1e9 : 0;
    json leaks = json::array();
    for (const Worker& w : workers_) {
      json entry{
          {"role", w.role}, {"instance", w.instance}, {"rank", w.rank}, {"killed", w.killed}};
      if (w.stats) {
        entry["leaked_blocks"] = (*w.stats).value("leaked_blocks", -1);
        entry["invariants_ok"] = (*w.stats).value("invariants_ok", false);
        entry["stats"] = *w.stats;
      } else {
        entry["leaked_blocks"] = nullptr;
      }
      leaks.push_back(entry);
    }
    json j{
        {"model", model_},
        {"trace", trace_},
        {"prefill_instances", prefill_},
        {"decode_instances", decode_},
        {"tp_prefill", tp_prefill_},
        {"tp_decode", tp_decode_},
        {"capacity_blocks", capacity_},
        {"block_bytes", config_.bytes_per_block()},
        {"transport", transport_},
        {"memory_path", memory_path_},
        {"data_lanes", lanes_},
        {"requests", requests_.size()},
        {"requests_completed", completed_},
        {"requests_failed", failed_requests_},
        {"requests_skipped_too_large", skipped_},
        {"requests_recomputed", recomputed_},
        {"rank_recomputes", rank_recomputes_},
        {"transfers", transfers_},
        {"blocks_transferred", blocks_},
        {"bytes_transferred", bytes_},
        {"transfer_gbps", gbps},
        {"bulk_transfer_gbps", bulk_gbps},
        {"transfer_latency_ms",
         {{"p50", percentile(latencies_, 0.5) * 1e3}, {"p99", percentile(latencies_, 0.99) * 1e3}}},
        {"request_latency_ms",
         {{"p50", percentile(e2e_latencies_, 0.5) * 1e3},
          {"p99", percentile(e2e_latencies_, 0.99) * 1e3}}},
        {"raw_ucx",
         {{"gbps", raw_gbps},
          {"samples", raw_samples_},
          {"bytes", raw_bytes_},
          {"paired_transfer_gbps", paired_gbps},
          {"idle_gbps", idle_gbps},
          {"idle_bytes", baseline_bytes_},
          {"why", baseline_why_}}},
        {"ratio_vs_raw", raw_gbps > 0 ? paired_gbps / raw_gbps : 0},
        {"ratio_vs_idle_raw", idle_gbps > 0 ? bulk_gbps / idle_gbps : 0},
        {"verification_failures", verification_failures_},
        {"leases", lease_ends_},
        {"processes_started", processes_started_},
        {"unexpected_exits", unexpected_exits_},
        {"workers", leaks},
        {"wall_seconds", wall_seconds_},
        {"ok", code == 0 && checks_pass()}};
    std::uint64_t leaked = 0;
    for (const Worker& w : workers_) {
      if (w.stats) leaked += (*w.stats).value("leaked_blocks", std::uint64_t{0});
    }
    j["leaked_blocks"] = leaked;
    if (!kill_role_.empty() && !kill_time_) {
      j["kill"] = {{"role", kill_role_},
                   {"performed", false},
                   {"why", fmt::format("the run had {} transfers, --after asked for {}", transfers_,
                                       kill_after_.value_or(1))}};
    }
    if (kill_time_) {
      j["kill"] = {{"role", kill_role_},
                   {"performed", true},
                   {"after_transfers", kill_at_transfers_},
                   {"loss_reports", loss_reports_},
                   {"loss_detected_ms_max", loss_detect_ms_},
                   {"bound_ms", peer_timeout_ms_}};
    }
    if (!failure_.empty()) j["failure"] = failure_;
    if (!failure_notes_.empty()) j["notes"] = failure_notes_;
    return j;
  }

  void report(std::ostream& out, int code) const {
    const json j = report_json(code);
    if (json_) {
      out << j.dump(2) << '\n';
      return;
    }
    out << fmt::format(
        "kvport disagg: {} prefill x TP{} -> {} decode x TP{}, {} ({} bytes/block), {}\n", prefill_,
        tp_prefill_, decode_, tp_decode_, model_, config_.bytes_per_block(), transport_);
    TextTable t({"", "value"});
    t.add_row(
        {"requests (completed / replayed)", fmt::format("{} / {}", completed_, requests_.size())});
    t.add_row({"skipped (larger than capacity)", std::to_string(skipped_)});
    t.add_row({"recomputed (no transfer)", std::to_string(recomputed_)});
    t.add_row({"transfers / blocks", fmt::format("{} / {}", transfers_, blocks_)});
    t.add_row(
        {"bytes transferred", fmt::format("{:.1f} MiB", static_cast<double>(bytes_) / (1 << 20))});
    t.add_row({"transfer GB/s (all / >= 16 blocks)",
               fmt::format("{:.2f} / {:.2f}", j["transfer_gbps"].get<double>(),
                           j["bulk_transfer_gbps"].get<double>())});
    t.add_row({"raw UCX GB/s, one contiguous read (n)",
               fmt::format("{:.2f} ({})", j["raw_ucx"]["gbps"].get<double>(), raw_samples_)});
    t.add_row({"ratio (same pulls / raw, same moments)",
               fmt::format("{:.2f}", j["ratio_vs_raw"].get<double>())});
    t.add_row({"raw UCX GB/s before the replay (idle)",
               fmt::format("{:.2f} ({:.1f} MiB)", j["raw_ucx"]["idle_gbps"].get<double>(),
                           static_cast<double>(baseline_bytes_) / (1 << 20))});
    t.add_row({"transfer latency p50 / p99",
               fmt::format("{:.2f} / {:.2f} ms", j["transfer_latency_ms"]["p50"].get<double>(),
                           j["transfer_latency_ms"]["p99"].get<double>())});
    t.add_row({"verification failures", std::to_string(verification_failures_)});
    t.add_row(
        {"leaked blocks (all workers)", std::to_string(j["leaked_blocks"].get<std::uint64_t>())});
    if (!kill_role_.empty() && !kill_time_) {
      t.add_row({"killed", fmt::format("nobody: {} transfers, --after {}", transfers_,
                                       kill_after_.value_or(1))});
    }
    if (kill_time_) {
      t.add_row(
          {"killed", fmt::format("{}0.0 after {} transfers", kill_role_, kill_at_transfers_)});
      t.add_row({"loss detected (max over survivors)",
                 fmt::format("{:.0f} ms (bound {} ms)", loss_detect_ms_, peer_timeout_ms_)});
    }
    t.add_row({"wall time", fmt::format("{:.1f} s", wall_seconds_)});
    t.print(out);
    for (const std::string& note : failure_notes_)
      out << "note: " << note << '\n';
    if (!failure_.empty()) out << "FAILED: " << failure_ << '\n';
    out << (j["ok"].get<bool>() ? "Result OK\n" : "Result FAILED\n");
  }

  CacheShapeOptions shape_;
  std::string trace_;
  std::uint32_t prefill_ = 1, decode_ = 1, tp_prefill_ = 1, tp_decode_ = 1;
  std::size_t capacity_ = 0;
  std::optional<std::size_t> max_requests_;
  std::string kill_role_;
  std::optional<std::uint64_t> kill_after_;
  std::int64_t peer_timeout_ms_ = 1500, lease_ttl_ms_ = 10000, timeout_s_ = 3600;
  bool json_ = false;
  std::string bind_ = "127.0.0.1";
  std::string worker_spec_;

  KvCacheConfig config_;
  std::string model_;
  std::vector<Request> requests_;
  std::size_t skipped_ = 0;
  std::vector<Worker> workers_;
  std::size_t processes_started_ = 0;
  std::uint64_t baseline_bytes_ = 0, scratch_bytes_ = 0;
  bool baseline_done_ = false;
  std::vector<double> baseline_seconds_;
  std::string baseline_why_;
  std::string transport_, memory_path_, lanes_;
  std::uint32_t decode_cursor_ = 0, prefill_cursor_ = 0;
  std::uint64_t transfers_ = 0, blocks_ = 0, bytes_ = 0, bulk_bytes_ = 0;
  double transfer_seconds_ = 0, bulk_seconds_ = 0;
  std::uint64_t raw_bytes_ = 0, paired_bytes_ = 0, raw_samples_ = 0;
  double raw_seconds_ = 0, paired_seconds_ = 0;
  std::vector<double> latencies_, e2e_latencies_;
  std::uint64_t verification_failures_ = 0, completed_ = 0, recomputed_ = 0, rank_recomputes_ = 0;
  std::uint64_t unexpected_exits_ = 0;
  std::map<std::string, std::uint64_t> lease_ends_;
  std::optional<Clock::time_point> kill_time_;
  std::uint64_t kill_at_transfers_ = 0;
  double loss_detect_ms_ = 0;
  std::uint64_t loss_reports_ = 0;
  std::string victim_name_;
  Clock::time_point started_ = Clock::now();
  double wall_seconds_ = 0;
  std::string failure_;
  bool listen_failed_ = false;
  bool dispatching_ = false;
  std::uint64_t failed_requests_ = 0;
  std::vector<std::string> failure_notes_;
};

}  // namespace

std::unique_ptr<Command> make_disagg_command() {
  return std::make_unique<DisaggCommand>();
}

}  // namespace kvport::cli
