// SPDX-License-Identifier: Apache-2.0
// The one scheduler simulation loop behind `kvport replay` (replay.hpp) and
// `kvport demo` (serving_sim.hpp): a discrete-event, single-threaded model of
// a vLLM-style continuous-batching scheduler. What differs between the two
// simulations (where requests come from, how their blocks are managed) is a
// Workload; the order of events is the Scheduler's and is the same for both.
//
// Each step of `step_ms` simulated milliseconds:
//   1. arrive:  the workload enqueues the requests that arrived (FIFO queue).
//               With nothing running or waiting afterwards, the run ends if
//               every request completed or was rejected; otherwise the
//               workload is asked to skip the idle time (Workload::idle) and
//               no step is counted.
//   2. decode:  every running request, oldest first, reserves room for one
//               more token (Workload::reserve_token). While it cannot, the
//               newest running request is preempted - possibly the request
//               itself: its blocks are given back (Workload::release) and it
//               returns to the FRONT of the queue, to recompute its prompt
//               and the tokens it had generated when admitted again. A
//               request that got its room generates its token
//               (Workload::decode_token).
//   3. retire (RetirePoint::before_admission): requests that generated all
//               their tokens give their blocks back and complete.
//   4. admit:   unless anything was preempted in this step (as vLLM), the
//               head of the queue is admitted while fewer than max_running
//               requests run and Workload::try_admit finds room for it. When
//               it does not, admission stops for this step; with
//               retry_head_after_release, the head is tried again only after
//               some running request gave blocks back. With
//               before_admission, a request admitted with nothing to generate
//               completes at once.
//      After an admission step (one that did not preempt), nothing running
//      and a request waiting means the head can never run: std::logic_error
//      (a bug in the workload's limits). A step that preempted every running
//      request leaves them waiting; the next step admits them.
//   5. Workload::after_admission (e.g. one zeroing batch for the step).
//   6. retire (RetirePoint::after_admission): as 3, at the end of the step,
//               so blocks freed by completions serve the next step's
//               admissions only.
//   7. Workload::end_step; the clock advances by step_ms.
// A request completes at the end of the step it finished in (now + step_ms).
// The run ends when every request completed or was rejected, or when
// end_step asks to stop. The same workload and options give the same run.
#pragma once

#include <cstddef>
#include <cstdint>
#include <deque>
#include <span>
#include <string>
#include <vector>

namespace kvport::sim {

/// A request's index in its workload, 0-based.
using RequestId = std::size_t;

/// When requests that generated all their tokens give their blocks back.
enum class RetirePoint {
  before_admission,  ///< right after decode: admission in the same step reuses their blocks
  after_admission,   ///< at the end of the step: their blocks serve the next step
};

struct SchedulerOptions {
  std::size_t max_running = 64;  ///< most requests running at once (> 0)
  double step_ms = 10.0;         ///< simulated time of one step (> 0)
  double start_ms = 0.0;         ///< the clock at the first step
  RetirePoint retire = RetirePoint::before_admission;
  /// After the head of the queue did not fit, try it again only once a
  /// running request gave blocks back (saves a lookup per step when nothing
  /// changed); false: try it in every step.
  bool retry_head_after_release = true;
};

struct SchedulerStats {
  std::uint64_t steps = 0;      ///< steps simulated (idle time skipped is not a step)
  std::size_t completed = 0;    ///< requests that generated all their tokens
  std::size_t rejected = 0;     ///< requests the workload refused at arrival
  std::size_t preemptions = 0;  ///< requests sent back to the queue
};

class Scheduler;

/// What the scheduler simulates: the requests, where they come from, and the
/// KV-cache bookkeeping of each. Every call but the const ones may change the
/// cache; the scheduler calls them in the order documented above.
class Workload {
 public:
  virtual ~Workload() = default;

  /// Requests in the workload; the run ends when all completed or were
  /// rejected. Asked again every step, so that a workload whose requests are
  /// handed to it as it runs (replay.hpp, ArrivalFeed) can count one more
  /// while more may come.
  virtual std::size_t num_requests() const = 0;
  /// Step 1: enqueue (Scheduler::enqueue) or reject (Scheduler::reject) the
  /// requests that arrive by scheduler.now_ms().
  virtual void arrive(Scheduler& scheduler) = 0;
  /// Nothing runs or waits after arrive: move the clock to the next arrival
  /// (Scheduler::advance_to), or throw std::logic_error when there is none.
  virtual void idle(Scheduler& scheduler) = 0;
  /// Room for one more token of running request `id`; false when the cache
  /// has no block for it (the scheduler then preempts and asks again).
  virtual bool reserve_token(RequestId id) = 0;
  /// Running request `id` generates one token into the room reserved.
  virtual void decode_token(RequestId id) = 0;
  /// Whether request `id` has generated all its tokens.
  virtual bool finished(RequestId id) const = 0;
  /// Admits waiting request `id` (its prompt and the tokens it had
  /// generated), or returns false, changing nothing, when it does not fit.
  virtual bool try_admit(RequestId id, const Scheduler& scheduler) = 0;
  /// Running request `id` gives all its blocks back (completion or preemption).
  virtual void release(RequestId id) = 0;
  /// Request `id` completed; `at_ms` is the end of its last step.
  virtual void on_complete(RequestId id, double at_ms);
  /// Step 5, after admission.
  virtual void after_admission(const Scheduler& scheduler);
  /// Step 7; false stops the run (e.g. a failed invariant check).
  virtual bool end_step(const Scheduler& scheduler);
  /// The message of the std::logic_error thrown when `head` waits with
  /// nothing running (see step 4).
  virtual std::string stall_message(RequestId head, const Scheduler& scheduler) const = 0;
};

/// Runs a Workload under the rules above. One run per Scheduler.
class Scheduler {
 public:
  /// Throws InvalidArgument when max_running is 0 or step_ms is not > 0.
  Scheduler(Workload& workload, const SchedulerOptions& options);

  /// Runs until every request completed or was rejected (or end_step said
  /// stop). Throws what the workload throws, and std::logic_error on a stall.
  SchedulerStats run();

  // For the workload's callbacks.

  /// Appends request `id` to the back of the queue.
  void enqueue(RequestId id);
  /// Counts one request refused at arrival; it never runs.
  void reject() noexcept { ++stats_.rejected; }
  /// Moves the clock forward to `ms` (idle time, not a step).
  void advance_to(double ms) noexcept { now_ms_ = ms; }

  /// The simulated time at the start of the current step.
  double now_ms() const noexcept { return now_ms_; }
  /// The number of the current step (1-based), or of the last one after run().
  std::uint64_t step() const noexcept { return stats_.steps; }
  const SchedulerOptions& options() const noexcept { return options_; }
  const SchedulerStats& stats() const noexcept { return stats_; }
  /// Running requests in admission order: the newest last.
  std::span<const RequestId> running() const noexcept { return running_; }
  std::size_t num_waiting() const noexcept { return waiting_.size(); }
  /// Nothing running and nothing waiting.
  bool idle() const noexcept { return running_.empty() && waiting_.empty(); }

 private:
  bool decode();
  void preempt_newest();
  void retire_finished();
  void complete(RequestId id);
  void admit();

  Workload& workload_;
  SchedulerOptions options_;
  SchedulerStats stats_;
  double now_ms_;
  std::deque<RequestId> waiting_;
  std::vector<RequestId> running_;  // in admission order: newest last
  bool head_blocked_ = false;       // the head of the queue waits for blocks
};

}  // namespace kvport::sim
