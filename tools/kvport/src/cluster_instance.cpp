// SPDX-License-Identifier: Apache-2.0
// `kvport cluster`'s instance process (cluster.hpp): the replay's scheduler
// and prefix cache over the requests the coordinator hands it, publishing
// the cache's events.
#include <fmt/format.h>

#include <algorithm>
#include <chrono>
#include <deque>
#include <limits>
#include <optional>
#include <ostream>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "cluster.hpp"
#include "disagg_line_input.hpp"
#include "event_form.hpp"
#include "kvport/backends/host_backend.hpp"
#include "kvport/core/cache_events.hpp"
#include "kvport/core/prefix_cache.hpp"
#include "kvport/events/publisher.hpp"
#include "kvport/platform/error.hpp"
#include "kvport/sim/mooncake_trace.hpp"
#include "kvport/sim/replay.hpp"

namespace kvport::cli::cluster {

using json = nlohmann::json;

namespace {

template <typename T>
T field(const json& j, const char* name) {
  if (!j.contains(name)) throw InvalidArgument(fmt::format("cluster spec: no field '{}'", name));
  try {
    return j.at(name).get<T>();
  } catch (const json::exception& e) {
    throw InvalidArgument(fmt::format("cluster spec: field '{}': {}", name, e.what()));
  }
}

// Collects the hashes of a cache's snapshot.
class DigestSink final : public CacheEventSink {
 public:
  void stored(const EventSource& /*source*/, const BlockStoredView& blocks) noexcept override {
    for (const BlockHash& h : blocks.hashes)
      digest.add(event_hash(h));
  }
  void removed(const EventSource& /*source*/,
               std::span<const BlockHash> /*hashes*/) noexcept override {}
  void cleared(const EventSource& /*source*/) noexcept override {}
  SetDigest digest;
};

// The requests the coordinator hands over, read from stdin (cluster.hpp).
class CoordinatorFeed final : public sim::ArrivalFeed {
 public:
  /// Thrown when the coordinator sends "abort": the run failed elsewhere.
  struct Aborted {};

  CoordinatorFeed(events::Publisher& publisher, std::ostream& out, std::size_t num_requests,
                  std::uint32_t id)
      : publisher_(publisher), out_(out), num_requests_(num_requests), id_(id) {}

  std::optional<double> arrivals(const sim::ReplayProgress& progress,
                                 std::vector<Arrival>& out) override {
    // Events were dropped: the publisher's snapshots wait for the cache to
    // re-announce its set (here, between the replay's steps, on its thread).
    if (publisher_.needs_resync() && progress.prefix != nullptr) {
      const PrefixCache& prefix = *progress.prefix;
      if (!publisher_.resync([&](CacheEventSink& s) { prefix.snapshot(s); })) ++resync_failures_;
    }
    while (!ended_ && progress.now_ms >= horizon_)
      sync(progress);
    std::sort(pending_.begin(), pending_.end(),
              [](const Arrival& a, const Arrival& b) { return a.arrival_ms < b.arrival_ms; });
    std::size_t taken = 0;
    while (taken < pending_.size() && pending_[taken].arrival_ms <= progress.now_ms)
      out.push_back(pending_[taken++]);
    pending_.erase(pending_.begin(), pending_.begin() + static_cast<std::ptrdiff_t>(taken));
    if (pending_.empty()) return std::nullopt;
    return pending_.front().arrival_ms;
  }

  std::optional<double> wait_next(const sim::ReplayProgress& progress) override {
    for (;;) {
      if (!pending_.empty()) {
        return std::min_element(
                   pending_.begin(), pending_.end(),
                   [](const auto& a, const auto& b) { return a.arrival_ms < b.arrival_ms; })
            ->arrival_ms;
      }
      if (ended_) {
        report("end", progress);
        // The cache must hold this set until the router compared it: the
        // end of the replay clears it (AllBlocksCleared).
        wait_for_quit();
        return std::nullopt;
      }
      if (progress.now_ms < horizon_) return horizon_;
      sync(progress);
    }
  }

  void finished(std::size_t index, double /*at_ms*/, bool rejected) override {
    (rejected ? rejected_ : completed_).push_back(index);
  }
  void admitted(std::size_t index, std::size_t hit_blocks, std::size_t /*hit_tokens*/,
                std::size_t prefill_tokens) override {
    admitted_.push_back({index, hit_blocks, prefill_tokens});
  }

  std::uint64_t flush_timeouts() const noexcept { return flush_timeouts_; }
  std::uint64_t resync_failures() const noexcept { return resync_failures_; }

 private:
  std::string next_line() {
    while (lines_.empty()) {
      for (std::string& line : input_.read(std::chrono::milliseconds(1000)))
        lines_.push_back(std::move(line));
      if (lines_.empty() && input_.eof()) {
        // Closed without "Q" or "abort": the coordinator died.
        throw Error(
            fmt::format("kvport cluster: instance {}: the coordinator is gone; exiting", id_));
      }
    }
    std::string line = std::move(lines_.front());
    lines_.pop_front();
    if (line == "abort") throw Aborted{};
    return line;
  }

  void wait_for_quit() {
    for (;;) {
      const std::string line = next_line();
      if (line == "Q") return;
      if (!line.empty())
        throw Error(fmt::format("kvport cluster: instance: unexpected op '{}'", line));
    }
  }

  // Answers the last H (if any) and reads ops until the next H or E.
  void sync(const sim::ReplayProgress& progress) {
    if (answer_due_) report("at", progress);
    answer_due_ = false;
    for (;;) {
      const std::string line = next_line();
      if (line.empty()) continue;
      if (line[0] == 'R') {
        Arrival a;
        unsigned long long index = 0;
        if (std::sscanf(line.c_str(), "R %llu %lf", &index, &a.arrival_ms) != 2 ||
            index >= num_requests_) {
          throw Error(fmt::format("kvport cluster: instance: bad op '{}'", line));
        }
        a.index = static_cast<std::size_t>(index);
        pending_.push_back(a);
      } else if (line[0] == 'H') {
        double h = 0;
        if (std::sscanf(line.c_str(), "H %lf", &h) != 1) {
          throw Error(fmt::format("kvport cluster: instance: bad op '{}'", line));
        }
        horizon_ = h;
        answer_due_ = true;
        return;
      } else if (line == "E") {
        ended_ = true;
        return;
      } else {
        throw Error(fmt::format("kvport cluster: instance: unknown op '{}'", line));
      }
    }
  }

  // The load and progress line, after every event so far was published.
  void report(const char* kind, const sim::ReplayProgress& progress) {
    const bool flushed = publisher_.flush(std::chrono::milliseconds(30'000));
    if (!flushed) ++flush_timeouts_;
    const events::PublisherStats stats = publisher_.stats();
    json j;
    // false: next_seq may leave out events still queued (the coordinator
    // then fails the run rather than compare the router's index).
    j["flushed"] = flushed;
    j["now_ms"] = progress.now_ms;
    j["next_seq"] = stats.next_seq;
    j["running"] = progress.running;
    j["waiting"] = progress.waiting;
    j["blocks_in_use"] = progress.blocks_in_use;
    j["cached_blocks"] = progress.cached_blocks;
    j["completed"] = completed_;
    j["rejected"] = rejected_;
    json admitted = json::array();
    for (const Admission& a : admitted_)
      admitted.push_back({a.index, a.hit_blocks, a.prefill_tokens});
    j["admitted"] = std::move(admitted);
    if (std::string_view(kind) == "end" && progress.prefix != nullptr) {
      DigestSink sink;
      progress.prefix->snapshot(sink);
      j["digest"] = {sink.digest.count, sink.digest.sum, sink.digest.xor_all};
    }
    out_ << kind << ' ' << j.dump() << '\n' << std::flush;
    completed_.clear();
    rejected_.clear();
    admitted_.clear();
  }

  struct Admission {
    std::size_t index;
    std::size_t hit_blocks;
    std::size_t prefill_tokens;
  };

  events::Publisher& publisher_;
  std::ostream& out_;
  std::size_t num_requests_;
  std::uint32_t id_;
  disagg::LineInput input_{0};
  std::deque<std::string> lines_;
  std::vector<Arrival> pending_;
  double horizon_ = -std::numeric_limits<double>::infinity();
  bool answer_due_ = false;
  bool ended_ = false;
  std::vector<std::size_t> completed_, rejected_;
  std::vector<Admission> admitted_;
  std::uint64_t flush_timeouts_ = 0;
  std::uint64_t resync_failures_ = 0;
};

}  // namespace

json InstanceSpec::to_json() const {
  return {{"trace", trace},
          {"max_requests", max_requests},
          {"id", id},
          {"capacity_blocks", capacity_blocks},
          {"block_size", block_size},
          {"trace_block_tokens", trace_block_tokens},
          {"concurrency", concurrency},
          {"step_ms", step_ms},
          {"events_topic", events_topic},
          {"events_form", events_form}};
}

InstanceSpec InstanceSpec::from_json(const json& j) {
  InstanceSpec s;
  s.trace = field<std::string>(j, "trace");
  s.max_requests = field<std::size_t>(j, "max_requests");
  s.id = field<std::uint32_t>(j, "id");
  s.capacity_blocks = field<std::size_t>(j, "capacity_blocks");
  s.block_size = field<std::size_t>(j, "block_size");
  s.trace_block_tokens = field<std::size_t>(j, "trace_block_tokens");
  s.concurrency = field<std::size_t>(j, "concurrency");
  s.step_ms = field<std::uint64_t>(j, "step_ms");
  s.events_topic = j.contains("events_topic") ? field<std::string>(j, "events_topic")
                                              : fmt::format("kvport@instance{}", s.id);
  if (j.contains("events_form")) s.events_form = field<std::string>(j, "events_form");
  (void)event_form(s.events_form);
  return s;
}

json RouterSpec::to_json() const {
  return {{"trace", trace},
          {"max_requests", max_requests},
          {"block_size", block_size},
          {"trace_block_tokens", trace_block_tokens},
          {"policy", policy},
          {"overlap_weight", overlap_weight},
          {"sync_timeout_ms", sync_timeout_ms},
          {"events_topic_filter", events_topic_filter}};
}

RouterSpec RouterSpec::from_json(const json& j) {
  RouterSpec s;
  s.trace = field<std::string>(j, "trace");
  s.max_requests = field<std::size_t>(j, "max_requests");
  s.block_size = field<std::size_t>(j, "block_size");
  s.trace_block_tokens = field<std::size_t>(j, "trace_block_tokens");
  s.policy = field<std::string>(j, "policy");
  s.overlap_weight = field<double>(j, "overlap_weight");
  s.sync_timeout_ms = field<std::uint64_t>(j, "sync_timeout_ms");
  if (j.contains("events_topic_filter"))
    s.events_topic_filter = field<std::string>(j, "events_topic_filter");
  return s;
}

std::vector<sim::TraceRequest> read_trace(const std::string& path, std::size_t max_requests) {
  std::vector<sim::TraceRequest> requests = sim::read_mooncake_trace(path);
  if (max_requests != 0 && requests.size() > max_requests) requests.resize(max_requests);
  return requests;
}

int run_instance(const InstanceSpec& spec, std::ostream& out) {
  const std::vector<sim::TraceRequest> requests = read_trace(spec.trace, spec.max_requests);
  events::PublisherOptions po;
  po.endpoint = "tcp://127.0.0.1:0";
  po.replay_endpoint = "tcp://127.0.0.1:0";
  po.topic = spec.events_topic;
  po.form = event_form(spec.events_form);
  po.linger = std::chrono::milliseconds(200);
  events::Publisher publisher(po);
  out << "listen "
      << json{{"events", publisher.endpoint()}, {"replay", publisher.replay_endpoint()}}.dump()
      << '\n'
      << std::flush;

  CoordinatorFeed feed(publisher, out, requests.size(), spec.id);
  sim::ReplayOptions options;
  options.capacity_blocks = spec.capacity_blocks;
  options.block_size = spec.block_size;
  options.trace_block_tokens = spec.trace_block_tokens;
  options.concurrency = spec.concurrency;
  options.step_ms = spec.step_ms;
  options.event_sink = &publisher;
  options.feed = &feed;
  const auto backend = make_host_backend();
  sim::ReplayResult r;
  try {
    r = sim::run_replay(requests, options, *backend);
  } catch (const CoordinatorFeed::Aborted&) {
    return 3;  // the coordinator reports why
  }
  publisher.flush(std::chrono::milliseconds(2'000));
  const events::PublisherStats ps = publisher.stats();
  json j;
  j["ok"] = r.ok();
  j["invariants"] = r.invariants.ok ? "" : r.invariants.to_string();
  j["requests"] = r.requests;
  j["completed"] = r.completed;
  j["rejected"] = r.rejected;
  j["preemptions"] = r.preemptions;
  j["steps"] = r.steps;
  j["prompt_blocks"] = r.prompt_blocks;
  j["hit_blocks"] = r.hit_blocks;
  j["prefill_tokens"] = r.prefill_tokens;
  j["recomputed_tokens"] = r.recomputed_tokens;
  j["evictions"] = r.evictions;
  j["peak_blocks_in_use"] = r.peak_blocks_in_use;
  j["wall_s"] = r.wall_s;
  j["events"] = {{"accepted", ps.events_accepted},
                 {"dropped", ps.events_dropped},
                 {"batches_sent", ps.batches_sent},
                 {"send_failures", ps.send_failures},
                 {"replay_requests", ps.replay_requests},
                 {"snapshots", ps.snapshots},
                 {"loss_gaps", ps.loss_gaps},
                 {"resyncs", ps.resyncs},
                 {"resync_failures", feed.resync_failures()},
                 {"flush_timeouts", feed.flush_timeouts()}};
  out << "done " << j.dump() << '\n' << std::flush;
  return r.ok() ? 0 : 1;
}

}  // namespace kvport::cli::cluster
