// SPDX-License-Identifier: Apache-2.0
// `kvport cluster`: a Mooncake trace over N engine instances and a router,
// each a process of its own, once per routing policy (cluster.hpp has the
// processes and their lines; docs/cli.md the report).
#include <fmt/format.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <csignal>
#include <cstring>
#include <deque>
#include <map>
#include <numeric>
#include <optional>
#include <ostream>
#include <set>
#include <sstream>
#include <string>
#include <vector>

#include <CLI/CLI.hpp>
#include <nlohmann/json.hpp>

#include "cache_options.hpp"
#include "cluster.hpp"
#include "command.hpp"
#include "event_form.hpp"
#include "kvport/backends/host_backend.hpp"
#include "kvport/cli/cli.hpp"
#include "kvport/cli/flag_values.hpp"
#include "kvport/platform/div_ceil.hpp"
#include "kvport/platform/error.hpp"
#include "kvport/router/router.hpp"
#include "kvport/sim/replay.hpp"
#include "process_group.hpp"
#include "text_table.hpp"

namespace kvport::cli {

using json = nlohmann::json;
using Clock = std::chrono::steady_clock;

namespace cluster {
namespace {

// What the flags say.
struct RunConfig {
  std::string trace;
  std::size_t max_requests = 0;
  std::size_t instances = 4;
  std::size_t capacity_blocks = 0;
  std::size_t block_size = 16;
  std::size_t trace_block_tokens = 512;
  std::size_t concurrency = 64;
  std::uint64_t step_ms = 10;
  // prefix_aware's weight of the blocks to prefill against the blocks in use:
  // Dynamo's default (1) lets the load of full instances decide (their blocks
  // in use differ by more than a prompt's prefix), docs/performance.md.
  double overlap_weight = 20.0;
  std::vector<std::string> policies;
  std::optional<std::uint32_t> kill;
  std::size_t kill_after = 1;
  bool baseline = true;
  std::chrono::seconds timeout{3600};
  // Each instance's topic: "{id}" replaced by its id; the router subscribes
  // to the part before "{id}" (the whole topic without one).
  std::string events_topic = "kvport@instance{id}";
  std::string events_form = "map";
};

std::string topic_of(const std::string& pattern, std::uint32_t id) {
  std::string t = pattern;
  if (const std::size_t at = t.find("{id}"); at != std::string::npos)
    t.replace(at, 4, std::to_string(id));
  return t;
}

constexpr std::size_t kMaxInstances = 16;
// The longest any one reply may take (a horizon's simulation, a sync).
constexpr auto kReplyTimeout = std::chrono::seconds(120);

// The run stopped: why.
struct RunFailure : Error {
  using Error::Error;
};

// max / mean of non-negative values (1 when all are 0).
double max_over_mean(const std::vector<double>& v) {
  if (v.empty()) return 1.0;
  const double sum = std::accumulate(v.begin(), v.end(), 0.0);
  if (sum <= 0.0) return 1.0;
  return *std::max_element(v.begin(), v.end()) / (sum / static_cast<double>(v.size()));
}

// The result of one policy's run.
struct PolicyRun {
  std::string policy;
  bool ok = false;
  std::string failure;
  std::uint64_t prompt_blocks = 0;
  std::uint64_t hit_blocks = 0;
  std::uint64_t instance_hit_blocks = 0;  // the survivors' own counts (a check)
  std::size_t completed = 0;
  std::size_t rejected = 0;
  std::vector<double> prefill_tokens;             // per request, at its (last) first admission
  std::vector<double> mean_running, mean_blocks;  // per instance, time-weighted
  std::vector<std::size_t> requests_routed;       // per instance
  std::vector<int> index_exact;                   // per instance: 1 equal, 0 not, -1 unknown
  json instances = json::array();
  json router;
  json kill;
  std::uint64_t events_accepted = 0, events_dropped = 0, batches_sent = 0, send_failures = 0;
  std::uint64_t sync_failures = 0;
  double simulated_ms = 0.0;
  double wall_s = 0.0;

  double hit_rate() const {
    return prompt_blocks == 0
               ? 0.0
               : static_cast<double>(hit_blocks) / static_cast<double>(prompt_blocks);
  }
};

// One policy's processes and rounds.
class ClusterRun {
 public:
  ClusterRun(const RunConfig& config, const std::vector<sim::TraceRequest>& requests,
             std::string policy, const TerminationSignals& signals)
      : config_(config),
        requests_(requests),
        signals_(signals),
        deadline_(Clock::now() + config.timeout),
        state_(requests.size()) {
    result_.policy = std::move(policy);
    const std::size_t n = config.instances;
    child_.assign(n, -1);
    assigned_.resize(n);
    running_.assign(n, 0);
    blocks_.assign(n, 0);
    running_time_.assign(n, 0.0);
    blocks_time_.assign(n, 0.0);
    next_seq_.assign(n, 0);
    result_.requests_routed.assign(n, 0);
    result_.index_exact.assign(n, -1);
  }

  PolicyRun run() {
    const auto start = Clock::now();
    try {
      start_processes();
      rounds();
      finish();
      result_.ok = result_.failure.empty();
    } catch (const RunFailure& e) {
      result_.failure = e.what();
    }
    if (!result_.ok) abort_children();
    group_.shutdown(std::chrono::milliseconds(2'000));
    result_.wall_s = std::chrono::duration<double>(Clock::now() - start).count();
    return std::move(result_);
  }

 private:
  struct RequestState {
    int instance = -1;
    bool done = false;
    bool admitted = false;
    std::uint64_t hit_blocks = 0;
    std::uint64_t prefill_tokens = 0;
  };

  // ---- processes ------------------------------------------------------------------

  std::vector<std::string> self(const char* flag, const json& spec) const {
    return {"/proc/self/exe", "cluster", flag, spec.dump()};
  }

  void spawn_instance(std::uint32_t id) {
    InstanceSpec spec;
    spec.trace = config_.trace;
    spec.max_requests = config_.max_requests;
    spec.id = id;
    spec.capacity_blocks = config_.capacity_blocks;
    spec.block_size = config_.block_size;
    spec.trace_block_tokens = config_.trace_block_tokens;
    spec.concurrency = config_.concurrency;
    spec.step_ms = config_.step_ms;
    spec.events_topic = topic_of(config_.events_topic, id);
    spec.events_form = config_.events_form;
    child_[id] = group_.spawn(fmt::format("instance{}", id), self("--instance", spec.to_json()));
  }

  // The "listen" line of instance `id`, then the router follows it.
  void connect_instance(std::uint32_t id) {
    const json listen = json::parse(expect(child_[id], "listen"));
    ask(fmt::format("add {} {} {}", id, listen.at("events").get<std::string>(),
                    listen.at("replay").get<std::string>()),
        "added");
  }

  void start_processes() {
    RouterSpec spec;
    spec.trace = config_.trace;
    spec.max_requests = config_.max_requests;
    spec.block_size = config_.block_size;
    spec.trace_block_tokens = config_.trace_block_tokens;
    spec.policy = result_.policy;
    spec.overlap_weight = config_.overlap_weight;
    spec.events_topic_filter = config_.events_topic.substr(0, config_.events_topic.find("{id}"));
    router_ = group_.spawn("router", self("--router", spec.to_json()));
    for (std::uint32_t i = 0; i < config_.instances; ++i)
      spawn_instance(i);
    for (std::uint32_t i = 0; i < config_.instances; ++i)
      connect_instance(i);
  }

  // The next line of `child`, which must start with `kind` + ' '; returns the
  // rest. Lines of the others are kept for later.
  std::string expect(int child, std::string_view kind) {
    const auto limit = std::min(deadline_, Clock::now() + kReplyTimeout);
    for (;;) {
      std::deque<std::string>& queue = lines_[child];
      if (!queue.empty()) {
        std::string line = std::move(queue.front());
        queue.pop_front();
        if (line.size() > kind.size() && line.compare(0, kind.size(), kind) == 0 &&
            line[kind.size()] == ' ') {
          return line.substr(kind.size() + 1);
        }
        throw RunFailure(fmt::format("{}: expected '{}', got '{}'", group_.name(child), kind,
                                     line.substr(0, 200)));
      }
      if (exited_.count(child) != 0) {
        throw RunFailure(fmt::format("{} died while the run waited for its '{}' line: {}",
                                     who(child), kind, exited_[child]));
      }
      if (signals_.requested()) throw RunFailure("interrupted");
      const auto now = Clock::now();
      if (now >= limit) {
        throw RunFailure(
            fmt::format("{} did not answer within {} s", group_.name(child),
                        std::chrono::duration_cast<std::chrono::seconds>(kReplyTimeout).count()));
      }
      for (const ProcessEvent& e : collect(std::chrono::duration_cast<std::chrono::milliseconds>(
               std::min<Clock::duration>(limit - now, std::chrono::milliseconds(500))))) {
        throw RunFailure(fmt::format("{}: {}", who(e.child), e.text));
      }
    }
  }

  // Polls the children once (up to `wait`), keeping their lines and noting
  // their exits; returns what went wrong (a line too long), which expect()
  // fails the run on.
  std::vector<ProcessEvent> collect(std::chrono::milliseconds wait) {
    std::vector<ProcessEvent> errors;
    for (ProcessEvent& e : group_.poll(wait)) {
      if (e.kind == ProcessEvent::Kind::line) {
        lines_[e.child].push_back(std::move(e.text));
      } else if (e.kind == ProcessEvent::Kind::exited) {
        exited_[e.child] = how_it_ended(e);
      } else {
        errors.push_back(std::move(e));
      }
    }
    return errors;
  }

  void send(int child, const std::string& line) {
    if (group_.send_line(child, line, std::chrono::seconds(30))) return;
    // A child that died closed its stdin: say so, once its exit is reaped.
    for (int tries = 0; tries < 10 && exited_.count(child) == 0; ++tries)
      (void)collect(std::chrono::milliseconds(100));
    if (exited_.count(child) != 0) {
      throw RunFailure(fmt::format("{} died before it read the op '{}': {}", who(child),
                                   line.substr(0, line.find(' ')), exited_[child]));
    }
    throw RunFailure(fmt::format("{} no longer reads its ops (30 s)", who(child)));
  }

  // "the router" or "instance 2", for messages.
  std::string who(int child) const {
    if (child == router_) return "the router";
    for (std::size_t i = 0; i < child_.size(); ++i)
      if (child_[i] == child) return fmt::format("instance {}", i);
    return group_.name(child);
  }

  // How a child's exit reads in a message: a signal that this run did not
  // send (the --kill victim is reaped in kill()) came from outside.
  static std::string how_it_ended(const ProcessEvent& e) {
    if (e.signal != 0) {
      return fmt::format("killed by signal {} ({}), which kvport cluster did not send", e.signal,
                         sigdescr_np(e.signal) != nullptr ? sigdescr_np(e.signal) : "unknown");
    }
    return fmt::format("exit code {} (its error, if any, is on stderr above)", e.exit_code);
  }

  // Tells every child still running that the run failed, so that it exits
  // without claiming that the coordinator is gone; shutdown() then reaps it.
  void abort_children() {
    const auto tell = [&](int child) {
      if (child >= 0 && exited_.count(child) == 0)
        (void)group_.send_line(child, "abort", std::chrono::milliseconds(200));
    };
    tell(router_);
    for (const int child : child_)
      tell(child);
  }

  // Sends `line` to the router and returns its answer of `kind`.
  std::string ask(const std::string& line, std::string_view kind) {
    send(router_, line);
    return expect(router_, kind);
  }

  // ---- rounds ---------------------------------------------------------------------

  bool live(std::uint32_t id) const { return child_[id] >= 0; }

  // Records an instance's "at" or "end" report.
  json take_report(std::uint32_t id, std::string_view kind) {
    json j = json::parse(expect(child_[id], kind));
    running_[id] = j.at("running").get<double>();
    blocks_[id] = j.at("blocks_in_use").get<double>();
    next_seq_[id] = j.at("next_seq").get<std::uint64_t>();
    for (const json& c : j.at("completed")) {
      const auto index = c.get<std::size_t>();
      state_.at(index).done = true;
      assigned_[id].erase(index);
    }
    for (const json& c : j.at("rejected")) {
      const auto index = c.get<std::size_t>();
      state_.at(index).done = true;
      assigned_[id].erase(index);
      ++result_.rejected;
    }
    for (const json& a : j.at("admitted")) {
      RequestState& s = state_.at(a.at(0).get<std::size_t>());
      s.admitted = true;
      s.hit_blocks = a.at(1).get<std::uint64_t>();
      s.prefill_tokens = a.at(2).get<std::uint64_t>();
    }
    return j;
  }

  // Every live instance runs to `h` and reports; the router catches up.
  void advance(double h) {
    // The load of each instance held from the previous round until now.
    if (last_h_) {
      const double dt = std::max(0.0, h - *last_h_);
      for (std::size_t i = 0; i < config_.instances; ++i) {
        running_time_[i] += running_[i] * dt;
        blocks_time_[i] += blocks_[i] * dt;
      }
      measured_ms_ += dt;
    }
    last_h_ = h;
    const std::string op = fmt::format("H {}", h);
    for (std::uint32_t i = 0; i < config_.instances; ++i)
      if (live(i)) send(child_[i], op);
    for (std::uint32_t i = 0; i < config_.instances; ++i)
      if (live(i)) (void)take_report(i, "at");
    (void)sync_router();
  }

  // The router applies every live instance's events up to the sequence it
  // reported; returns the instances it did not catch up with in time.
  std::set<std::uint32_t> sync_router() {
    std::string op = "sync";
    for (std::uint32_t i = 0; i < config_.instances; ++i) {
      if (live(i)) {
        op += fmt::format(" {} {} {} {}", i, next_seq_[i], static_cast<std::uint64_t>(running_[i]),
                          static_cast<std::uint64_t>(blocks_[i]));
      }
    }
    std::istringstream answer(ask(op, "synced"));
    std::uint64_t failed = 0;
    answer >> failed;
    result_.sync_failures += failed;
    std::set<std::uint32_t> missed;
    for (std::uint32_t id = 0; answer >> id;)
      missed.insert(id);
    return missed;
  }

  void route(const std::vector<std::size_t>& window, double arrival) {
    std::string op = "route";
    for (const std::size_t index : window)
      op += fmt::format(" {}", index);
    std::istringstream answer(ask(op, "to"));
    for (const std::size_t index : window) {
      long long instance = -1;
      unsigned long long matched = 0;
      if (!(answer >> instance >> matched)) throw RunFailure("router: short 'to' answer");
      if (instance < 0 || static_cast<std::size_t>(instance) >= config_.instances ||
          !live(static_cast<std::uint32_t>(instance))) {
        throw RunFailure(fmt::format("router routed request {} to no live instance", index));
      }
      const auto id = static_cast<std::uint32_t>(instance);
      state_[index].instance = static_cast<int>(instance);
      assigned_[id].insert(index);
      ++result_.requests_routed[id];
      if (killed_ && config_.kill && id == *config_.kill) ++routed_after_restart_;
      const double at = std::max(arrival, requests_[index].timestamp_ms);
      send(child_[id], fmt::format("R {} {}", index, at));
    }
    routed_ += window.size();
  }

  void rounds() {
    std::vector<std::size_t> order(requests_.size());
    std::iota(order.begin(), order.end(), std::size_t{0});
    std::stable_sort(order.begin(), order.end(), [&](std::size_t a, std::size_t b) {
      return requests_[a].timestamp_ms < requests_[b].timestamp_ms;
    });
    const double step = static_cast<double>(config_.step_ms);
    std::size_t k = 0;
    std::vector<std::size_t> window;
    std::vector<std::size_t> reroute;
    double h = order.empty() ? 0.0 : requests_[order.front()].timestamp_ms;
    while (k < order.size() || !reroute.empty()) {
      if (k < order.size()) h = std::max(h, requests_[order[k]].timestamp_ms);
      advance(h);
      window = std::move(reroute);
      reroute.clear();
      while (k < order.size() && requests_[order[k]].timestamp_ms < h + step)
        window.push_back(order[k++]);
      route(window, h);
      if (config_.kill && !killed_ && routed_ >= config_.kill_after) reroute = kill(h);
      h += step;  // a request routed again waits for the next window at the latest
    }
  }

  // SIGKILLs the victim, hands its unfinished requests back, starts it again.
  std::vector<std::size_t> kill(double h) {
    killed_ = true;
    const std::uint32_t victim = *config_.kill;
    const int old = child_[victim];
    const auto start = Clock::now();
    group_.kill(old, SIGKILL);
    while (exited_.count(old) == 0) {
      (void)collect(std::chrono::milliseconds(500));
      if (Clock::now() - start > std::chrono::seconds(10)) throw RunFailure("the kill took >10 s");
    }
    exited_[old] = "killed by --kill";
    child_[victim] = -1;
    const std::size_t dropped = std::stoull(ask(fmt::format("drop {}", victim), "dropped"));
    std::vector<std::size_t> lost(assigned_[victim].begin(), assigned_[victim].end());
    assigned_[victim].clear();
    for (const std::size_t index : lost) {
      state_[index].admitted = false;  // its first admission on the next instance counts
      state_[index].instance = -1;
    }
    const std::uint64_t hits_before = hit_blocks_so_far();
    running_[victim] = blocks_[victim] = 0;
    next_seq_[victim] = 0;
    spawn_instance(victim);
    connect_instance(victim);
    const double restart_ms =
        std::chrono::duration<double, std::milli>(Clock::now() - start).count();
    result_.kill = {{"instance", victim},
                    {"after_requests", routed_},
                    {"at_simulated_ms", h},
                    {"requests_rerouted", lost.size()},
                    {"index_blocks_dropped", dropped},
                    {"restart_wall_ms", restart_ms},
                    {"hit_blocks_before", hits_before}};
    return lost;
  }

  std::uint64_t hit_blocks_so_far() const {
    std::uint64_t n = 0;
    for (const RequestState& s : state_)
      if (s.admitted) n += s.hit_blocks;
    return n;
  }

  void finish() {
    for (std::uint32_t i = 0; i < config_.instances; ++i)
      if (live(i)) send(child_[i], "E");
    std::vector<json> ends(config_.instances);
    for (std::uint32_t i = 0; i < config_.instances; ++i)
      if (live(i)) ends[i] = take_report(i, "end");
    const std::set<std::uint32_t> unsynced = sync_router();
    for (std::uint32_t i = 0; i < config_.instances; ++i) {
      if (!live(i)) continue;
      if (!ends[i].value("flushed", true)) {
        throw RunFailure(
            fmt::format("instance {} did not publish its last events within its flush timeout", i));
      }
      if (unsynced.count(i) != 0) {
        throw RunFailure(
            fmt::format("the router did not apply instance {}'s events up to sequence {} within "
                        "{} ms (its index would be compared with a stream it has not read)",
                        i, next_seq_[i], RouterSpec{}.sync_timeout_ms));
      }
      const json& d = ends[i].at("digest");
      std::istringstream v(
          ask(fmt::format("verify {} {} {} {}", i, d.at(0).get<std::uint64_t>(),
                          d.at(1).get<std::uint64_t>(), d.at(2).get<std::uint64_t>()),
              "verified"));
      int id = 0, equal = 0;
      std::uint64_t indexed = 0;
      v >> id >> equal >> indexed;
      result_.index_exact[i] = equal;
      if (equal != 1) {
        result_.failure = fmt::format(
            "the router's index of instance {} differs from its cache ({} blocks, the cache {})", i,
            indexed, d.at(0).get<std::uint64_t>());
      }
      result_.simulated_ms = std::max(result_.simulated_ms, ends[i].at("now_ms").get<double>());
    }
    for (std::uint32_t i = 0; i < config_.instances; ++i)
      if (live(i)) send(child_[i], "Q");
    for (std::uint32_t i = 0; i < config_.instances; ++i) {
      if (!live(i)) continue;
      json done = json::parse(expect(child_[i], "done"));
      result_.instance_hit_blocks += done.at("hit_blocks").get<std::uint64_t>();
      const json& ev = done.at("events");
      result_.events_accepted += ev.at("accepted").get<std::uint64_t>();
      result_.events_dropped += ev.at("dropped").get<std::uint64_t>();
      result_.batches_sent += ev.at("batches_sent").get<std::uint64_t>();
      result_.send_failures += ev.at("send_failures").get<std::uint64_t>();
      if (!done.at("ok").get<bool>()) {
        result_.failure = fmt::format("instance {}: {}", i, done.at("invariants").dump());
      }
      done["id"] = i;
      result_.instances.push_back(std::move(done));
    }
    result_.router = json::parse(ask("end", "done"));
    for (std::size_t index = 0; index < state_.size(); ++index) {
      const RequestState& s = state_[index];
      if (!s.done) {
        result_.failure = fmt::format("request {} did not finish", index);
        continue;
      }
      if (!s.admitted) continue;  // rejected
      ++result_.completed;
      result_.prompt_blocks += requests_[index].input_length / config_.block_size;
      result_.hit_blocks += s.hit_blocks;
      result_.prefill_tokens.push_back(static_cast<double>(s.prefill_tokens));
    }
    if (measured_ms_ > 0) {
      for (std::size_t i = 0; i < config_.instances; ++i) {
        result_.mean_running.push_back(running_time_[i] / measured_ms_);
        result_.mean_blocks.push_back(blocks_time_[i] / measured_ms_);
      }
    }
    if (!config_.kill && result_.instance_hit_blocks != result_.hit_blocks &&
        result_.failure.empty()) {
      result_.failure = fmt::format("hit blocks: the instances count {}, their reports {}",
                                    result_.instance_hit_blocks, result_.hit_blocks);
    }
    if (!result_.kill.is_null()) {
      result_.kill["hit_blocks_after"] =
          result_.hit_blocks - result_.kill["hit_blocks_before"].get<std::uint64_t>();
      result_.kill["routed_after_restart"] = routed_after_restart_;
    }
  }

  const RunConfig& config_;
  const std::vector<sim::TraceRequest>& requests_;
  const TerminationSignals& signals_;
  Clock::time_point deadline_;
  ProcessGroup group_;
  int router_ = -1;
  std::vector<int> child_;  // per instance id: its child, -1 while down
  std::map<int, std::deque<std::string>> lines_;
  std::map<int, std::string> exited_;
  std::vector<RequestState> state_;
  std::vector<std::set<std::size_t>> assigned_;  // per instance: routed, not finished
  std::vector<double> running_, blocks_;         // per instance, at the last report
  std::vector<double> running_time_, blocks_time_;
  std::vector<std::uint64_t> next_seq_;
  std::optional<double> last_h_;
  double measured_ms_ = 0.0;
  std::size_t routed_ = 0;
  bool killed_ = false;
  std::size_t routed_after_restart_ = 0;  // to the killed instance, once started again
  PolicyRun result_;
};

json policy_json(const PolicyRun& r, const std::optional<sim::ReplayResult>& baseline) {
  json j;
  j["policy"] = r.policy;
  j["ok"] = r.ok;
  j["failure"] = r.failure;
  j["prompt_blocks"] = r.prompt_blocks;
  j["hit_blocks"] = r.hit_blocks;
  j["hit_rate"] = r.hit_rate();
  if (baseline && baseline->hit_blocks != 0) {
    j["hit_blocks_vs_baseline"] =
        static_cast<double>(r.hit_blocks) / static_cast<double>(baseline->hit_blocks);
  }
  j["completed"] = r.completed;
  j["rejected"] = r.rejected;
  j["load_balance"] = {{"running_max_over_mean", max_over_mean(r.mean_running)},
                       {"blocks_max_over_mean", max_over_mean(r.mean_blocks)},
                       {"mean_running", r.mean_running},
                       {"mean_blocks_in_use", r.mean_blocks},
                       {"requests_routed", r.requests_routed}};
  double sum = std::accumulate(r.prefill_tokens.begin(), r.prefill_tokens.end(), 0.0);
  j["prefill_tokens_per_request"] = {
      {"mean", r.prefill_tokens.empty() ? 0.0 : sum / static_cast<double>(r.prefill_tokens.size())},
      {"p50", percentile(r.prefill_tokens, 0.5)},
      {"p99", percentile(r.prefill_tokens, 0.99)}};
  j["events"] = {{"accepted", r.events_accepted},
                 {"dropped", r.events_dropped},
                 {"batches_sent", r.batches_sent},
                 {"send_failures", r.send_failures}};
  j["router"] = r.router;
  j["index_exact"] = r.index_exact;
  j["sync_failures"] = r.sync_failures;
  j["instances"] = r.instances;
  if (!r.kill.is_null()) j["kill"] = r.kill;
  j["simulated_ms"] = r.simulated_ms;
  j["wall_s"] = r.wall_s;
  return j;
}

}  // namespace
}  // namespace cluster

namespace {

class ClusterCommand final : public Command {
 public:
  void add_options(CLI::App& app) override {
    add_text_flag(app, "--trace", trace_, "FILE", "Mooncake trace (JSON lines) to replay");
    add_text_flag(app, "--instances", instances_, "N", "Engine instances, 1..16 (default 4)");
    add_text_flag(app, "--capacity-blocks", capacity_, "B", "KV blocks of each instance's cache");
    add_text_flag(app, "--block-size", block_size_, "T", "Tokens per block (default 16)");
    add_text_flag(app, "--trace-block-tokens", trace_block_tokens_, "T",
                  "Tokens per hash id of the trace (default 512)");
    add_text_flag(app, "--concurrency", concurrency_, "N",
                  "Most requests running at once on each instance (default 64)");
    add_text_flag(app, "--step-ms", step_ms_, "MS", "Simulated time of one step (default 10)");
    add_text_flag(app, "--requests", requests_, "N", "Replay the first N requests of the trace");
    add_text_flag(app, "--policy", policy_, "NAME",
                  "prefix_aware, round_robin, least_loaded, or all (default: all, one run each)");
    add_text_flag(app, "--overlap-weight", overlap_weight_, "W",
                  "prefix_aware's cost: W x blocks to prefill + blocks in use (default 20)");
    add_text_flag(app, "--kill", kill_, "I", "SIGKILL instance I (and start it again) ...");
    add_text_flag(app, "--after", after_, "N", "... once N requests were routed (default 1)");
    add_text_flag(app, "--timeout-s", timeout_s_, "S",
                  "Give up after this, per policy (default 3600)");
    add_text_flag(app, "--events-topic", events_topic_, "TOPIC",
                  "Each instance's events topic, {id} its id (default kvport@instance{id}; "
                  "llm-d: kv@<pod>@<model>, e.g. kv@pod{id}@llama); the router subscribes to "
                  "the part before {id}");
    add_text_flag(app, "--events-form", events_form_, "FORM",
                  "The instances' events: map (default) or positional (older vLLM)");
    app.add_flag("--no-baseline", no_baseline_,
                 "Skip the one-instance baseline (N x B blocks, N x concurrency)");
    app.add_flag("--json", json_, "Print the report as JSON");
    add_text_flag(app, "--instance", instance_spec_, "SPEC", "Internal: run as an instance")
        ->group("");
    add_text_flag(app, "--router", router_spec_, "SPEC", "Internal: run as the router")->group("");
  }

  int execute(std::ostream& out, std::ostream& /*err*/) override {
    if (instance_spec_.given()) {
      return cluster::run_instance(cluster::InstanceSpec::from_json(spec(instance_spec_)), out);
    }
    if (router_spec_.given()) {
      return cluster::run_router(cluster::RouterSpec::from_json(spec(router_spec_)), out);
    }
    const cluster::RunConfig config = validate();
    const std::vector<sim::TraceRequest> requests =
        cluster::read_trace(config.trace, config.max_requests);
    if (requests.empty()) throw InvalidArgument("--trace: no requests");
    std::optional<sim::ReplayResult> baseline;
    if (config.baseline) {
      sim::ReplayOptions o;
      o.capacity_blocks = config.capacity_blocks * config.instances;
      o.block_size = config.block_size;
      o.trace_block_tokens = config.trace_block_tokens;
      o.concurrency = config.concurrency * config.instances;
      o.step_ms = config.step_ms;
      const auto backend = make_host_backend();
      baseline = sim::run_replay(requests, o, *backend);
    }
    TerminationSignals signals;
    std::vector<cluster::PolicyRun> runs;
    for (const std::string& policy : config.policies) {
      cluster::ClusterRun run(config, requests, policy, signals);
      runs.push_back(run.run());
      if (signals.requested()) break;
    }
    bool ok = !runs.empty();
    for (const cluster::PolicyRun& r : runs)
      ok = ok && r.ok;
    if (json_) {
      json j;
      j["ok"] = ok;
      j["trace"] = config.trace;
      j["requests"] = requests.size();
      j["instances"] = config.instances;
      j["capacity_blocks"] = config.capacity_blocks;
      j["block_size"] = config.block_size;
      j["concurrency"] = config.concurrency;
      if (baseline) {
        j["baseline"] = {{"capacity_blocks", config.capacity_blocks * config.instances},
                         {"concurrency", config.concurrency * config.instances},
                         {"prompt_blocks", baseline->prompt_blocks},
                         {"hit_blocks", baseline->hit_blocks},
                         {"hit_rate", baseline->hit_rate()},
                         {"ok", baseline->ok()}};
      }
      j["runs"] = json::array();
      for (const cluster::PolicyRun& r : runs)
        j["runs"].push_back(cluster::policy_json(r, baseline));
      out << j.dump(2) << '\n';
    } else {
      print(out, config, requests.size(), baseline, runs, ok);
    }
    return ok ? kExitOk : kExitCheckFailed;
  }

 private:
  static json spec(const TextFlag& flag) {
    try {
      return json::parse(flag.value);
    } catch (const json::exception& e) {
      throw InvalidArgument(std::string("cluster spec: not JSON: ") + e.what());
    }
  }

  cluster::RunConfig validate() const {
    cluster::RunConfig c;
    if (!trace_.given() || trace_.value.empty()) throw InvalidArgument("--trace: required");
    c.trace = trace_.value;
    if (!capacity_.given()) throw InvalidArgument("--capacity-blocks: required");
    c.capacity_blocks = parse_positive_count(capacity_.value, "--capacity-blocks");
    if (c.capacity_blocks > sim::ReplayOptions::kMaxCapacityBlocks) {
      throw InvalidArgument(fmt::format("--capacity-blocks: must be in [1, {}], got {}",
                                        sim::ReplayOptions::kMaxCapacityBlocks, c.capacity_blocks));
    }
    if (instances_.given()) {
      c.instances = parse_count_in(instances_.value, "--instances", 1, cluster::kMaxInstances);
    }
    if (block_size_.given()) c.block_size = parse_positive_count(block_size_.value, "--block-size");
    if (trace_block_tokens_.given()) {
      c.trace_block_tokens =
          parse_positive_count(trace_block_tokens_.value, "--trace-block-tokens");
    }
    if (concurrency_.given()) {
      c.concurrency = parse_positive_count(concurrency_.value, "--concurrency");
    }
    if (step_ms_.given()) c.step_ms = parse_positive_count(step_ms_.value, "--step-ms");
    if (requests_.given()) c.max_requests = parse_positive_count(requests_.value, "--requests");
    if (overlap_weight_.given()) {
      c.overlap_weight = parse_fraction_or_more(overlap_weight_.value);
    }
    const std::string policy = policy_.given() ? policy_.value : "all";
    if (policy == "all") {
      c.policies = {"prefix_aware", "round_robin", "least_loaded"};
    } else {
      std::string name = policy;
      std::replace(name.begin(), name.end(), '-', '_');
      try {
        (void)router::make_policy(name);
      } catch (const InvalidArgument&) {
        throw InvalidArgument(fmt::format(
            "--policy: unknown policy '{}' (prefix_aware, round_robin, least_loaded or all)",
            policy));
      }
      c.policies = {name};
    }
    if (kill_.given()) {
      c.kill =
          static_cast<std::uint32_t>(parse_count_in(kill_.value, "--kill", 0, c.instances - 1));
    }
    if (after_.given()) {
      if (!kill_.given()) throw InvalidArgument("--after: only with --kill");
      c.kill_after = parse_positive_count(after_.value, "--after");
    }
    if (timeout_s_.given()) {
      c.timeout = std::chrono::seconds(parse_count_in(timeout_s_.value, "--timeout-s", 1, 86'400));
    }
    c.baseline = !no_baseline_;
    if (events_topic_.given()) c.events_topic = events_topic_.value;
    if (events_form_.given()) {
      (void)event_form(events_form_.value);  // throws naming the flag
      c.events_form = events_form_.value;
    }
    // What validate() of one instance's replay would refuse, said once here.
    sim::ReplayOptions o;
    o.capacity_blocks = c.capacity_blocks * (c.baseline ? c.instances : 1);
    o.block_size = c.block_size;
    o.trace_block_tokens = c.trace_block_tokens;
    o.concurrency = c.concurrency;
    o.step_ms = c.step_ms;
    o.validate();
    return c;
  }

  static double parse_fraction_or_more(const std::string& text) {
    double w = 0;
    std::size_t used = 0;
    try {
      w = std::stod(text, &used);
    } catch (const std::exception&) {
      used = 0;
    }
    if (used != text.size() || !std::isfinite(w) || w < 0 || w > 1e6) {
      throw InvalidArgument(
          fmt::format("--overlap-weight: must be a number in [0, 1e6], got '{}'", text));
    }
    return w;
  }

  static void print(std::ostream& out, const cluster::RunConfig& c, std::size_t requests,
                    const std::optional<sim::ReplayResult>& baseline,
                    const std::vector<cluster::PolicyRun>& runs, bool ok) {
    out << fmt::format(
        "kvport cluster: {} requests over {} instances of {} blocks ({} running each)\n", requests,
        c.instances, c.capacity_blocks, c.concurrency);
    if (baseline) {
      out << fmt::format(
          "  baseline: one instance of {} blocks ({} running): {} hit blocks of {} ({:.1f} %)\n",
          c.capacity_blocks * c.instances, c.concurrency * c.instances, baseline->hit_blocks,
          baseline->prompt_blocks, 100.0 * baseline->hit_rate());
    }
    TextTable table({"policy", "hit blocks", "vs baseline", "hit rate", "running max/mean",
                     "blocks max/mean", "prefill tok/req", "events", "dropped", "replays",
                     "decision p50/p99 us", "index exact", "result"});
    for (const cluster::PolicyRun& r : runs) {
      const json j = cluster::policy_json(r, baseline);
      const json& router = r.router;
      // Not compared (the run failed first): "-", never "no".
      const auto count = [&](int v) {
        return std::count(r.index_exact.begin(), r.index_exact.end(), v);
      };
      const std::string exact = count(0) != 0 ? "no" : count(-1) != 0 ? "-" : "yes";
      table.add_row(
          {r.policy, std::to_string(r.hit_blocks),
           j.contains("hit_blocks_vs_baseline")
               ? fmt::format("{:.3f}", j["hit_blocks_vs_baseline"].get<double>())
               : "-",
           fmt::format("{:.1f} %", 100.0 * r.hit_rate()),
           fmt::format("{:.2f}", j["load_balance"]["running_max_over_mean"].get<double>()),
           fmt::format("{:.2f}", j["load_balance"]["blocks_max_over_mean"].get<double>()),
           fmt::format("{:.0f}", j["prefill_tokens_per_request"]["mean"].get<double>()),
           std::to_string(r.events_accepted), std::to_string(r.events_dropped),
           router.is_null()
               ? "-"
               : std::to_string(router["subscriber"]["replay_requests"].get<std::uint64_t>() +
                                router["subscriber"]["snapshot_requests"].get<std::uint64_t>()),
           router.is_null()
               ? "-"
               : fmt::format("{:.1f} / {:.1f}", router["decision_us"]["p50"].get<double>(),
                             router["decision_us"]["p99"].get<double>()),
           exact, r.ok ? "OK" : "FAILED: " + r.failure});
    }
    table.print(out);
    for (const cluster::PolicyRun& r : runs) {
      if (r.kill.is_null()) continue;
      out << fmt::format(
          "  kill ({}): instance {} after {} requests at {:.0f} ms: {} requests routed again, {} "
          "index entries dropped, back in {:.0f} ms\n",
          r.policy, r.kill["instance"].get<std::uint32_t>(),
          r.kill["after_requests"].get<std::size_t>(), r.kill["at_simulated_ms"].get<double>(),
          r.kill["requests_rerouted"].get<std::size_t>(),
          r.kill["index_blocks_dropped"].get<std::size_t>(),
          r.kill["restart_wall_ms"].get<double>());
    }
    out << (ok ? "Result OK\n" : "Result FAILED\n");
  }

  TextFlag trace_, instances_, capacity_, block_size_, trace_block_tokens_, concurrency_, step_ms_,
      requests_, policy_, overlap_weight_, kill_, after_, timeout_s_, events_topic_, events_form_,
      instance_spec_, router_spec_;
  bool no_baseline_ = false;
  bool json_ = false;
};

}  // namespace

std::unique_ptr<Command> make_cluster_command() {
  return std::make_unique<ClusterCommand>();
}

}  // namespace kvport::cli
