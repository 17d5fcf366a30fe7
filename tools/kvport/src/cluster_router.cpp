// SPDX-License-Identifier: Apache-2.0
// `kvport cluster`'s router process (cluster.hpp): follows every instance's
// cache events and routes each request.
#include <fmt/format.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <deque>
#include <ostream>
#include <sstream>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "cluster.hpp"
#include "disagg_line_input.hpp"
#include "kvport/platform/div_ceil.hpp"
#include "kvport/platform/error.hpp"
#include "kvport/router/router.hpp"
#include "kvport/router/subscriber.hpp"
#include "kvport/sim/trace_tokens.hpp"

namespace kvport::cli::cluster {

using json = nlohmann::json;

namespace {

router::InstanceId parse_id(std::istringstream& in, const std::string& line) {
  long long id = -1;
  if (!(in >> id) || id < 0 || id >= static_cast<long long>(router::kMaxInstances)) {
    throw Error(fmt::format("kvport cluster: router: bad instance in '{}'", line));
  }
  return static_cast<router::InstanceId>(id);
}

class RouterProcess {
 public:
  RouterProcess(const RouterSpec& spec, std::ostream& out)
      : spec_(spec),
        out_(out),
        requests_(read_trace(spec.trace, spec.max_requests)),
        router_(index_options(spec), scoring(spec), router::make_policy(spec.policy)),
        subscriber_(router_.index(), subscriber_options(spec)) {}

  int run() {
    for (;;) {
      std::vector<std::string> lines = input_.read(std::chrono::milliseconds(2));
      if (lines.empty()) {
        if (input_.eof()) {
          // Closed without "end" or "abort": the coordinator died.
          std::fprintf(stderr, "kvport cluster: the router: the coordinator is gone; exiting\n");
          return 1;
        }
        (void)subscriber_.poll(std::chrono::milliseconds(0));
        continue;
      }
      for (const std::string& line : lines) {
        if (!handle(line)) return 0;
      }
    }
  }

 private:
  static router::IndexOptions index_options(const RouterSpec& spec) {
    router::IndexOptions o;
    o.block_size = static_cast<std::uint32_t>(spec.block_size);
    // The coordinator tells the router when an instance goes (drop): no
    // instance is dropped for silence, since simulated time runs faster or
    // slower than the wall clock.
    o.instance_timeout = std::chrono::hours(24);
    return o;
  }
  static router::ScoringOptions scoring(const RouterSpec& spec) {
    router::ScoringOptions s;
    s.overlap_weight = spec.overlap_weight;
    return s;
  }
  static router::SubscriberOptions subscriber_options(const RouterSpec& spec) {
    router::SubscriberOptions o;
    o.topic = spec.events_topic_filter;
    o.expire_silent = false;
    return o;
  }

  void reply(const std::string& text) { out_ << text << '\n' << std::flush; }

  // One op; false after "end".
  bool handle(const std::string& line) {
    std::istringstream in(line);
    std::string op;
    in >> op;
    if (op == "add") {
      const router::InstanceId id = parse_id(in, line);
      router::InstanceEndpoints e;
      in >> e.events >> e.replay;
      subscriber_.add_instance(id, e, router::Clock::now());
      reply(fmt::format("added {}", id));
    } else if (op == "drop") {
      const router::InstanceId id = parse_id(in, line);
      const router::InstanceStatus status = router_.index().status(id);
      std::size_t blocks = 0;
      for (const std::size_t b : status.blocks)
        blocks += b;
      subscriber_.remove_instance(id);
      reply(fmt::format("dropped {}", blocks));
    } else if (op == "sync") {
      std::size_t failed = 0;
      std::string missed;
      for (;;) {
        long long id = -1;
        unsigned long long next_seq = 0, running = 0, blocks = 0;
        if (!(in >> id)) break;
        if (!(in >> next_seq >> running >> blocks) || id < 0 ||
            id >= static_cast<long long>(router::kMaxInstances)) {
          throw Error(fmt::format("kvport cluster: router: bad sync '{}'", line));
        }
        const auto iid = static_cast<router::InstanceId>(id);
        if (!subscriber_.wait_for(iid, next_seq,
                                  std::chrono::milliseconds(spec_.sync_timeout_ms))) {
          ++failed;
          missed += fmt::format(" {}", iid);
        }
        router_.set_load(iid, static_cast<std::uint32_t>(running), blocks);
      }
      sync_failures_ += failed;
      reply(fmt::format("synced {}{}", failed, missed));
    } else if (op == "route") {
      std::string answer = "to";
      unsigned long long index = 0;
      while (in >> index) {
        if (index >= requests_.size()) {
          throw Error(fmt::format("kvport cluster: router: no request {}", index));
        }
        answer += route(static_cast<std::size_t>(index));
      }
      reply(answer);
    } else if (op == "verify") {
      const router::InstanceId id = parse_id(in, line);
      SetDigest expected;
      in >> expected.count >> expected.sum >> expected.xor_all;
      SetDigest indexed;
      for (const auto& [hash, tier] : router_.index().blocks_of(id)) {
        if (tier == router::Tier::gpu) indexed.add(hash);
      }
      reply(fmt::format("verified {} {} {}", id, indexed == expected ? 1 : 0, indexed.count));
    } else if (op == "end") {
      reply("done " + summary().dump());
      return false;
    } else if (op == "abort") {
      return false;  // the run failed elsewhere: exit quietly
    } else {
      throw Error(fmt::format("kvport cluster: router: unknown op '{}'", line));
    }
    return true;
  }

  std::string route(std::size_t index) {
    const sim::TraceRequest& r = requests_[index];
    sim::sequence_tokens(r, index, spec_.trace_block_tokens, r.input_length, tokens_);
    router::Request request;
    request.tokens = tokens_;
    const auto start = std::chrono::steady_clock::now();
    router_.decide(request, decision_);
    const auto end = std::chrono::steady_clock::now();
    decision_us_.push_back(std::chrono::duration<double, std::micro>(end - start).count());
    if (!decision_.instance) return " -1 0";
    const router::InstanceId chosen = *decision_.instance;
    std::uint32_t matched = 0;
    for (const router::InstanceScore& s : decision_.scores) {
      if (s.id == chosen) matched = s.matched_blocks;
    }
    // Until the instance reports again: one more request running, holding
    // the blocks of its prompt.
    const router::InstanceLoad load = router_.load(chosen);
    router_.set_load(chosen, load.running_requests + 1,
                     load.blocks_in_use + div_ceil(r.input_length, spec_.block_size));
    return fmt::format(" {} {}", chosen, matched);
  }

  json summary() const {
    const router::IndexCounters& c = router_.index().counters();
    const router::SubscriberStats s = subscriber_.stats();
    double sum = 0;
    for (const double d : decision_us_)
      sum += d;
    json j;
    j["policy"] = spec_.policy;
    j["decisions"] = decision_us_.size();
    j["decision_us"] = {
        {"mean", decision_us_.empty() ? 0.0 : sum / static_cast<double>(decision_us_.size())},
        {"p50", percentile(decision_us_, 0.50)},
        {"p99", percentile(decision_us_, 0.99)},
        {"max",
         decision_us_.empty() ? 0.0 : *std::max_element(decision_us_.begin(), decision_us_.end())}};
    j["sync_failures"] = sync_failures_;
    j["index"] = {{"blocks", router_.index().num_blocks()},
                  {"batches_applied", c.batches_applied},
                  {"duplicates", c.duplicates},
                  {"gaps", c.gaps},
                  {"held_dropped", c.held_dropped},
                  {"snapshots", c.snapshots},
                  {"restarts", c.restarts},
                  {"clears", c.clears},
                  {"blocks_stored", c.blocks_stored},
                  {"blocks_removed", c.blocks_removed}};
    j["subscriber"] = {{"messages", s.messages},
                       {"malformed", s.malformed},
                       {"replay_requests", s.replay_requests},
                       {"replayed_batches", s.replayed_batches},
                       {"replay_misses", s.replay_misses},
                       {"snapshot_requests", s.snapshot_requests},
                       {"snapshots_applied", s.snapshots_applied},
                       {"request_timeouts", s.request_timeouts}};
    return j;
  }

  const RouterSpec& spec_;
  std::ostream& out_;
  std::vector<sim::TraceRequest> requests_;
  router::Router router_;
  router::Subscriber subscriber_;
  disagg::LineInput input_{0};
  std::vector<TokenId> tokens_;
  router::Decision decision_;
  std::vector<double> decision_us_;
  std::uint64_t sync_failures_ = 0;
};

}  // namespace

int run_router(const RouterSpec& spec, std::ostream& out) {
  RouterProcess process(spec, out);
  return process.run();
}

}  // namespace kvport::cli::cluster
