// SPDX-License-Identifier: Apache-2.0
// The requests of a trace in arrival order, handed to the scheduler as its
// clock passes them: the arrive/idle half of a trace-driven Workload
// (sim/src/replay_workload.hpp), written once.
#pragma once

#include <algorithm>
#include <cstddef>
#include <numeric>
#include <span>
#include <stdexcept>
#include <vector>

#include "kvport/sim/mooncake_trace.hpp"
#include "kvport/sim/scheduler.hpp"

namespace kvport::sim {

class TraceArrivals {
 public:
  /// Orders `requests` by timestamp, stably (equal timestamps keep trace
  /// order). The span must outlive this object.
  explicit TraceArrivals(std::span<const TraceRequest> requests) : requests_(requests) {
    order_.resize(requests.size());
    std::iota(order_.begin(), order_.end(), std::size_t{0});
    std::stable_sort(order_.begin(), order_.end(), [&](std::size_t a, std::size_t b) {
      return requests_[a].timestamp_ms < requests_[b].timestamp_ms;
    });
  }

  /// The first request's timestamp (0 for an empty trace).
  double first_arrival_ms() const noexcept {
    return order_.empty() ? 0.0 : requests_[order_.front()].timestamp_ms;
  }

  /// Workload::arrive: every request that arrived by scheduler.now_ms() is
  /// enqueued, or rejected (Scheduler::reject, then on_reject(request)) when
  /// fits(request) is false: a request that cannot run even alone in an
  /// empty cache would only preempt itself and start over.
  template <typename Fits, typename OnReject>
  void arrive(Scheduler& scheduler, Fits&& fits, OnReject&& on_reject) {
    for (; next_ < order_.size() && requests_[order_[next_]].timestamp_ms <= scheduler.now_ms();
         ++next_) {
      const std::size_t index = order_[next_];
      if (!fits(requests_[index])) {
        scheduler.reject();
        on_reject(requests_[index]);
        continue;
      }
      scheduler.enqueue(index);
    }
  }

  /// Workload::idle: moves the clock to the next arrival; std::logic_error
  /// when none is left (the scheduler lost requests: a bug).
  void idle(Scheduler& scheduler) const {
    if (next_ == order_.size()) throw std::logic_error("kvport replay: requests lost (a bug)");
    scheduler.advance_to(requests_[order_[next_]].timestamp_ms);
  }

 private:
  std::span<const TraceRequest> requests_;
  std::vector<std::size_t> order_;  // request indices by arrival
  std::size_t next_ = 0;            // the next of order_ to arrive
};

}  // namespace kvport::sim
