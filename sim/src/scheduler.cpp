// SPDX-License-Identifier: Apache-2.0
#include "kvport/sim/scheduler.hpp"

#include <fmt/format.h>

#include <stdexcept>

#include "kvport/platform/error.hpp"

namespace kvport::sim {

void Workload::on_complete(RequestId /*id*/, double /*at_ms*/) {}
void Workload::after_admission(const Scheduler& /*scheduler*/) {}
bool Workload::end_step(const Scheduler& /*scheduler*/) {
  return true;
}

Scheduler::Scheduler(Workload& workload, const SchedulerOptions& options)
    : workload_(workload), options_(options), now_ms_(options.start_ms) {
  if (options.max_running == 0) throw InvalidArgument("Scheduler: max_running must be > 0");
  if (!(options.step_ms > 0.0)) {
    throw InvalidArgument(fmt::format("Scheduler: step_ms must be > 0, got {}", options.step_ms));
  }
}

void Scheduler::enqueue(RequestId id) {
  waiting_.push_back(id);
}

SchedulerStats Scheduler::run() {
  // Read again every step: a workload fed as it runs learns its total late.
  while (stats_.completed + stats_.rejected < workload_.num_requests()) {
    workload_.arrive(*this);
    if (idle()) {
      // The last arrivals may all have been rejected: then the run is over.
      if (stats_.completed + stats_.rejected == workload_.num_requests()) break;
      workload_.idle(*this);
      continue;
    }
    ++stats_.steps;
    const bool preempted = decode();
    if (options_.retire == RetirePoint::before_admission) retire_finished();
    if (!preempted) admit();  // as vLLM: nothing is admitted in a step that preempted
    // A step that preempted every running request admits nothing; the next
    // one will. Otherwise an empty cache that cannot take the head is a stall.
    if (!preempted && running_.empty() && !waiting_.empty()) {
      throw std::logic_error(workload_.stall_message(waiting_.front(), *this));
    }
    workload_.after_admission(*this);
    if (options_.retire == RetirePoint::after_admission) retire_finished();
    const bool go_on = workload_.end_step(*this);
    now_ms_ += options_.step_ms;
    if (!go_on) break;
  }
  return stats_;
}

void Scheduler::preempt_newest() {
  const RequestId victim = running_.back();
  running_.pop_back();
  workload_.release(victim);
  head_blocked_ = false;
  waiting_.push_front(victim);
  ++stats_.preemptions;
}

bool Scheduler::decode() {
  bool preempted = false;
  for (std::size_t i = 0; i < running_.size(); ++i) {
    while (i < running_.size() && !workload_.reserve_token(running_[i])) {
      preempt_newest();
      preempted = true;
    }
    if (i == running_.size()) break;  // it preempted itself
    workload_.decode_token(running_[i]);
  }
  return preempted;
}

void Scheduler::complete(RequestId id) {
  workload_.release(id);
  head_blocked_ = false;
  ++stats_.completed;
  workload_.on_complete(id, now_ms_ + options_.step_ms);
}

void Scheduler::retire_finished() {
  std::size_t kept = 0;
  for (std::size_t i = 0; i < running_.size(); ++i) {
    const RequestId id = running_[i];
    if (workload_.finished(id)) {
      complete(id);
    } else {
      running_[kept++] = id;
    }
  }
  running_.resize(kept);
}

void Scheduler::admit() {
  while (!waiting_.empty() && !(options_.retry_head_after_release && head_blocked_) &&
         running_.size() < options_.max_running) {
    const RequestId id = waiting_.front();
    if (!workload_.try_admit(id, *this)) {
      head_blocked_ = true;
      return;
    }
    waiting_.pop_front();
    running_.push_back(id);
    if (options_.retire == RetirePoint::before_admission && workload_.finished(id)) {
      running_.pop_back();  // nothing to generate
      complete(id);
    }
  }
}

}  // namespace kvport::sim
