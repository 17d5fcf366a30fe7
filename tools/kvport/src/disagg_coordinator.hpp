// SPDX-License-Identifier: Apache-2.0
// `kvport disagg`'s coordinator: starts the worker processes, runs the
// phases (ready, connect, baseline, replay, finish), dispatches each request
// to a prefill instance feeding a decode instance, and fails over: a request
// whose worker exited, was killed, or was reported lost by a peer is
// recomputed on a survivor.
#pragma once

#include <cstdint>
#include <iosfwd>
#include <set>
#include <vector>

#include <nlohmann/json.hpp>

#include "disagg_report.hpp"
#include "kvport/core/block_hash.hpp"
#include "process_group.hpp"

namespace kvport::cli::disagg {

/// One request of the trace, as the workers get it.
struct Request {
  std::size_t index = 0;
  std::vector<TokenId> tokens;
  std::size_t blocks = 0;
};

/// How the phases ended.
enum class Outcome {
  done,         ///< every request was answered and the survivors were asked to finish
  failed,       ///< a phase could not complete (Stats::failure says why)
  interrupted,  ///< SIGINT, SIGTERM or SIGHUP (Stats::failure says when)
};

class Coordinator {
 public:
  /// `requests` fit the capacity; `skipped` did not (for the report).
  Coordinator(const RunOptions& options, std::vector<Request> requests, std::size_t skipped);

  /// Spawns the workers into `group` and runs the phases until done, a
  /// failure, an interrupt (polled from `signals`) or --timeout-s. Writes
  /// one "kvport disagg: <why>" line to `err` when it stops early. Throws
  /// InvalidArgument when no worker can listen on --bind (bad input).
  /// The caller shuts `group` down afterwards and passes its exits to
  /// record_exits().
  Outcome run(ProcessGroup& group, const TerminationSignals& signals, std::ostream& err);

  /// Records how each worker ended from ProcessGroup::shutdown()'s exits.
  void record_exits(const std::vector<ProcessEvent>& exits);

  /// The shutdown grace: a worker told to stop (its stdin closed) says bye
  /// to its peers and waits at most the loss bound for its transfers.
  std::chrono::milliseconds shutdown_grace() const;

  const Stats& stats() const noexcept { return stats_; }

 private:
  struct Pending {                         // a request's progress
    std::optional<std::uint32_t> prefill;  // instance
    std::uint32_t decode = 0;  // instance, or the prefill instance for a local recompute
    bool local_on_prefill = false;
    std::set<std::uint32_t> ranks_done;  // ranks of the instance that reported
    bool done = false;
    bool sent = false;
    bool failed = false;     // a rank could not compute it at all
    bool fell_back = false;  // a rank recomputed it after its pull failed (counted once)
  };

  using Clock = std::chrono::steady_clock;

  void spawn_all(ProcessGroup& group);
  Outcome stop(Outcome outcome, std::ostream& err, const std::string& why);
  template <typename Pred>
  bool wait_for(ProcessGroup& group, const TerminationSignals& signals, Clock::time_point deadline,
                Pred pred);
  void size_baseline();

  bool send(ProcessGroup& group, const WorkerRecord& w, const nlohmann::json& j);
  void send_to_instance(ProcessGroup& group, Role role, std::uint32_t instance,
                        const nlohmann::json& j);
  nlohmann::json recompute_op(std::size_t index) const;
  WorkerRecord* find(Role role, std::uint32_t instance, std::uint32_t rank);
  WorkerRecord* find(const std::string& name);
  bool instance_alive(Role role, std::uint32_t instance) const;
  bool alive_any(Role role) const;
  std::optional<std::uint32_t> pick(Role role, std::uint32_t& cursor) const;

  void dispatch(ProcessGroup& group, std::size_t index);
  void dispatch_recompute(ProcessGroup& group, std::size_t index);
  void pump(ProcessGroup& group, std::chrono::milliseconds timeout);
  void on_event(ProcessGroup& group, WorkerRecord& w, const nlohmann::json& j);
  void on_peer_lost(ProcessGroup& group, const WorkerRecord& reporter, const nlohmann::json& j);
  void on_done(WorkerRecord& w, const nlohmann::json& j);
  void on_exit(ProcessGroup& group, WorkerRecord& w, const ProcessEvent& e);
  // Counts `w` lost (`by` reported it), SIGKILLs its process group, lose()s it.
  void mark_lost(ProcessGroup& group, WorkerRecord& w, const std::string& by);
  // Stops routing to `w` and sends its requests elsewhere.
  void lose(ProcessGroup& group, WorkerRecord& w);
  void maybe_kill(ProcessGroup& group);

  RunOptions options_;
  std::vector<Request> requests_;
  std::vector<Pending> pending_;
  Stats stats_;
  std::uint64_t scratch_bytes_ = 0;
  bool baseline_done_ = false;
  bool listen_failed_ = false;
  bool dispatching_ = false;
  bool finishing_ = false;
  std::uint32_t decode_cursor_ = 0, prefill_cursor_ = 0;
  std::optional<Clock::time_point> kill_time_;
  Clock::time_point started_ = Clock::now();
};

}  // namespace kvport::cli::disagg
