// SPDX-License-Identifier: Apache-2.0
// `kvport disagg`'s run as data: the validated options, what the coordinator
// counted (one Stats), the checks that decide the exit status, and the
// report in JSON and as text. disagg_command.cpp fills RunOptions,
// disagg_coordinator.cpp fills Stats.
#pragma once

#include <chrono>
#include <cstdint>
#include <iosfwd>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "disagg.hpp"
#include "kvport/core/kv_cache_config.hpp"
#include "kvport/core/layer_spec.hpp"

namespace kvport::cli::disagg {

/// The command's options, validated.
struct RunOptions {
  std::string model;
  std::string trace;
  KvCacheConfig config;
  /// A hybrid or MLA model (`--model` of one): its layers, the model's
  /// heads; `config` then gives only the block size and layout. Empty: one
  /// PagedKvCache of `config` per worker.
  std::vector<LayerSpec> layers;
  /// Hybrid models: the slots of each state group per worker.
  std::size_t state_slots = 0;
  /// Bytes of one block of every layer with blocks, the model's heads
  /// (config.bytes_per_block() without `layers`).
  std::uint64_t block_bytes = 0;
  std::uint32_t prefill = 1, decode = 1, tp_prefill = 1, tp_decode = 1;
  std::size_t capacity_blocks = 0;
  std::optional<Role> kill;      ///< --kill: SIGKILL rank 0 of instance 0 of this role
  std::uint64_t kill_after = 1;  ///< --after: ... once this many transfers completed
  /// --kill-signal: false SIGKILL (a crash), true SIGSTOP (a hang: the victim
  /// stays alive, silent, until its peers report it lost).
  bool kill_stops = false;
  std::chrono::milliseconds peer_timeout{1500};
  std::chrono::milliseconds lease_ttl{10000};
  std::chrono::seconds timeout{3600};
  std::string bind = "127.0.0.1";

  std::uint32_t instances(Role role) const { return role == Role::prefill ? prefill : decode; }
  std::uint32_t tp(Role role) const { return role == Role::prefill ? tp_prefill : tp_decode; }
};

/// How a worker's part in the run ended.
enum class WorkerEnd {
  running,   ///< no exit seen (only while the run goes on)
  finished,  ///< sent its stats at the end
  killed,    ///< by --kill (SIGKILL)
  lost,      ///< reported lost by a peer (hung, stopped): then killed by the coordinator
  exited,    ///< exited (or crashed) on its own before its stats
  stopped,   ///< stopped by the coordinator at the end of a failed or interrupted run
};
std::string_view to_string(WorkerEnd end) noexcept;

/// One worker process.
struct WorkerRecord {
  Role role = Role::prefill;
  std::uint32_t instance = 0;
  std::uint32_t rank = 0;
  int child = -1;  ///< ProcessGroup index
  std::string address;
  bool ready = false;
  bool connected = false;
  bool alive = true;  ///< the coordinator still routes to it
  WorkerEnd end = WorkerEnd::running;
  std::string lost_reported_by;  ///< WorkerEnd::lost: the first peer that reported it
  std::optional<nlohmann::json> stats;
  /// Its exit, once reaped: the code (-1 when signalled) and the signal (0: none).
  std::optional<int> exit_code;
  int exit_signal = 0;
  bool force_killed = false;  ///< SIGKILLed at shutdown after the grace period

  std::string name() const { return worker_name(role, instance, rank); }
};

/// The kill --kill asked for, once performed.
struct KillRecord {
  std::string victim;    ///< worker_name
  bool stopped = false;  ///< SIGSTOP (--kill-signal stop), else SIGKILL
  std::uint64_t after_transfers = 0;
  std::uint64_t loss_reports = 0;  ///< peer_lost events naming the victim
  double loss_detected_ms_max = 0;
};

/// What moved in one KV cache group (hybrid models), over every completed
/// pull.
struct GroupTotals {
  std::string kind;
  std::uint64_t bytes = 0, wrong_bytes = 0, checked_bytes = 0, blocks = 0;
};

/// Everything the coordinator counted.
struct Stats {
  std::vector<GroupTotals> groups;  ///< hybrid models only
  std::vector<WorkerRecord> workers;
  std::size_t requests = 0, skipped = 0;
  std::uint64_t completed = 0, failed_requests = 0, recomputed = 0, rank_recomputes = 0;
  std::uint64_t transfers = 0, blocks = 0, bytes = 0, bulk_bytes = 0;
  double transfer_seconds = 0, bulk_seconds = 0;
  std::uint64_t raw_bytes = 0, paired_bytes = 0, raw_samples = 0;
  double raw_seconds = 0, paired_seconds = 0;
  std::vector<double> latencies, e2e_latencies;
  std::uint64_t verification_failures = 0;
  std::uint64_t unexpected_exits = 0;  ///< WorkerEnd::exited
  std::uint64_t workers_lost = 0;      ///< WorkerEnd::lost, the --kill victim not counted
  std::map<std::string, std::uint64_t> lease_ends;
  std::uint64_t baseline_bytes = 0;
  std::vector<double> baseline_seconds;
  std::string baseline_why;
  std::string transport, memory_path, lanes;
  std::optional<KillRecord> kill;
  std::size_t processes_started = 0;
  double wall_seconds = 0;
  std::string failure;  ///< why the run stopped early; empty when it did not
  std::vector<std::string> notes;
};

/// True when the run passed: no failure, every request completed, no wrong
/// byte, no worker lost or exited other than the one --kill killed, no
/// leaked block or broken invariant in a survivor, and a kill (if any)
/// reported by a peer within the loss bound (+ 500 ms).
bool checks_pass(const RunOptions& options, const Stats& stats);

/// The report as one JSON object ("ok" is checks_pass()).
nlohmann::json report_json(const RunOptions& options, const Stats& stats);

/// The report as a table, then notes, then "Result OK" or "Result FAILED".
void print_report(std::ostream& out, const RunOptions& options, const Stats& stats);

}  // namespace kvport::cli::disagg
