// SPDX-License-Identifier: Apache-2.0
// `kvport cluster`: a trace replayed over N engine instances and one router,
// each a process of its own (docs/cli.md, "kvport cluster").
//
// The processes:
//  - an instance (`kvport cluster --instance SPEC`) runs the replay's
//    scheduler and prefix cache (sim/replay.hpp) over the requests the
//    coordinator hands it (an ArrivalFeed on its stdin), publishing its cache
//    events over ZeroMQ on 127.0.0.1 (events/publisher.hpp);
//  - the router (`kvport cluster --router SPEC`) subscribes to every
//    instance's events (router/subscriber.hpp) and decides where each request
//    goes (router/router.hpp);
//  - the coordinator (the command itself) reads the trace and moves the
//    cluster's simulated clock forward in lock-step rounds, one per arrival
//    window of step_ms: every instance runs up to the window, reports its
//    load and its publisher's sequence; the router applies every instance's
//    events up to that sequence, then routes the window's requests, which go
//    to their instances. So each decision sees exactly what the instances
//    had published by then, and the run is the same on every machine (the
//    wall-clock fields aside).
//
// The lines between them (one per message, text):
//   coordinator -> instance: "R <index> <arrival_ms>" a request;
//       "H <ms>" every request arriving before ms has been sent: run until
//       the clock reaches ms, then report; "E" no more requests: run to the
//       end and report; "Q" (after the router compared the cached set) print
//       the result and exit; "abort" the run failed elsewhere: exit (3)
//       without a message.
//   instance -> coordinator: "listen <json>" its endpoints; "at <json>" its
//       clock, publisher sequence (and "flushed": whether every event was
//       published by then), load, and the requests completed and
//       admitted since the last report; "end <json>" the same, with a digest
//       of the cached set; "done <json>" its replay's result.
//   coordinator -> router: "add <id> <events> <replay>", "drop <id>",
//       "sync <id> <next_seq> <running> <blocks>..." (instances side by
//       side), "route <index>...", "verify <id> <count> <sum> <xor>", "end",
//       "abort" (exit without a message).
//   router -> coordinator: "added <id>", "dropped <blocks>",
//       "synced <failed> [<id> of each instance not caught up]...",
//       "to <instance> <matched_blocks>...", "verified <id> <0|1> <count>",
//       "done <json>".
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <iosfwd>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "kvport/events/wire.hpp"
#include "kvport/sim/mooncake_trace.hpp"

namespace kvport::cli::cluster {

/// What an instance process runs (its --instance SPEC, JSON).
struct InstanceSpec {
  std::string trace;
  std::size_t max_requests = 0;  ///< 0: the whole trace
  std::uint32_t id = 0;
  std::size_t capacity_blocks = 0;
  std::size_t block_size = 16;
  std::size_t trace_block_tokens = 512;
  std::size_t concurrency = 64;
  std::uint64_t step_ms = 10;
  /// The events' topic (the first frame) and form ("map" or "positional");
  /// optional in the JSON (these defaults).
  std::string events_topic = "kvport@instance0";
  std::string events_form = "map";

  nlohmann::json to_json() const;
  /// Throws InvalidArgument naming a missing or mistyped field.
  static InstanceSpec from_json(const nlohmann::json& j);
};

/// What the router process runs (its --router SPEC, JSON).
struct RouterSpec {
  std::string trace;
  std::size_t max_requests = 0;
  std::size_t block_size = 16;
  std::size_t trace_block_tokens = 512;
  std::string policy = "prefix_aware";
  double overlap_weight = 1.0;
  /// How long a sync waits for an instance's events before it fails.
  std::uint64_t sync_timeout_ms = 30'000;
  /// The SUB filter: a prefix of every instance's topic (optional in the
  /// JSON; default "kvport@instance").
  std::string events_topic_filter = "kvport@instance";

  nlohmann::json to_json() const;
  /// Throws InvalidArgument naming a missing or mistyped field.
  static RouterSpec from_json(const nlohmann::json& j);
};

/// The digest of a set of 64-bit block hashes: equal sets, equal digests
/// (and unequal ones almost never equal).
struct SetDigest {
  std::uint64_t count = 0;
  std::uint64_t sum = 0;  ///< mod 2^64
  std::uint64_t xor_all = 0;

  void add(std::uint64_t hash) noexcept {
    ++count;
    sum += hash;
    xor_all ^= hash;
  }
  friend bool operator==(const SetDigest&, const SetDigest&) = default;
};

/// The q-quantile (0 <= q <= 1) of `v` by rank (0 for an empty vector).
inline double percentile(std::vector<double> v, double q) {
  if (v.empty()) return 0.0;
  const std::size_t k =
      std::min(v.size() - 1, static_cast<std::size_t>(q * static_cast<double>(v.size())));
  std::nth_element(v.begin(), v.begin() + static_cast<std::ptrdiff_t>(k), v.end());
  return v[k];
}

/// The first `max_requests` requests of the trace (0: all). Throws as
/// sim::read_mooncake_trace.
std::vector<sim::TraceRequest> read_trace(const std::string& path, std::size_t max_requests);

/// The instance process: reads its ops on stdin, writes its lines on `out`.
/// Returns the exit code.
int run_instance(const InstanceSpec& spec, std::ostream& out);

/// The router process.
int run_router(const RouterSpec& spec, std::ostream& out);

}  // namespace kvport::cli::cluster
