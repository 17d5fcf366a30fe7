// SPDX-License-Identifier: Apache-2.0
// `kvport replay --memory SIZE`: the trace over a model's KV cache groups
// (sim::replay_model), beside the same model as all full attention with the
// same memory, as a report or one JSON object.
#pragma once

#include <optional>
#include <ostream>
#include <string>

#include <nlohmann/json.hpp>

#include "kvport/core/host_tier.hpp"
#include "kvport/events/publisher.hpp"
#include "kvport/sim/model_replay.hpp"

namespace kvport::cli {

/// What the group replay was run with, for the report.
struct GroupReplayRun {
  std::string trace;         ///< the trace's path
  std::string model;         ///< the model's (escaped) name
  std::string model_source;  ///< "preset" or "hf-config"
  sim::ModelReplayOptions options;
  std::vector<sim::TraceRequest> requests;  ///< the trace, as both replays read it
  sim::ReplayResult groups;                 ///< over the model's groups
  sim::ReplayResult all_full;               ///< every window/chunked layer as full attention
  /// With --events: where the groups' replay published its events and the
  /// publisher's counters after its flush (the all-full replay publishes none).
  struct Events {
    std::string endpoint;
    events::PublisherStats stats;
    events::CloseReport close;  ///< the bounded exit flush: what may not have been delivered
  };
  std::optional<Events> events;
};

/// A host tier's counters as the replay reports them ("tier_counters").
nlohmann::ordered_json tier_counters_json(const HostTierCounters& counters);

/// Runs both replays of `run.options` over the trace at `run.trace` (the
/// options' layers are the model's) on a host backend and fills the results;
/// the options' event_sink receives the groups' replay's events only.
/// Throws what the trace reader and replay_model throw.
void run_group_replay(GroupReplayRun& run);

/// The report: the run's settings, a row per group (kind, layers, blocks,
/// bytes per block, peak blocks and bytes in use), and the two replays side
/// by side (requests, peak and mean running, hit rate, preemptions, peak
/// bytes in use, invariants).
void print_group_replay_text(std::ostream& out, const GroupReplayRun& run);

/// The same as one JSON object: {"mode": "groups", "model", "options",
/// "groups": {...result, "group_usage": [...]}, "all_full": {...}}.
void print_group_replay_json(std::ostream& out, const GroupReplayRun& run);

}  // namespace kvport::cli
