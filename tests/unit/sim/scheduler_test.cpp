// SPDX-License-Identifier: Apache-2.0
// The one scheduler loop (kvport::sim::Scheduler) on a toy workload whose
// "cache" is a counter of free blocks: the order of events the rules in
// scheduler.hpp promise, and its errors.
#include "kvport/sim/scheduler.hpp"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <stdexcept>
#include <string>
#include <vector>

#include "kvport/platform/error.hpp"
#include "kvport/testing/support.hpp"

namespace kvport::sim {
namespace {

using kvport::testing::message_of;
using ::testing::ElementsAre;
using ::testing::HasSubstr;

// Requests of `prompt` blocks that each generate `output` tokens, one block
// per token; all arrive at step 1. Every call is logged.
class ToyWorkload final : public Workload {
 public:
  struct Request {
    std::size_t prompt = 1;
    std::size_t output = 1;
    std::size_t generated = 0;
    std::size_t held = 0;  // blocks
  };

  ToyWorkload(std::size_t blocks, std::vector<Request> requests)
      : free_(blocks), requests_(std::move(requests)) {}

  std::size_t num_requests() const override { return requests_.size(); }
  void arrive(Scheduler& s) override {
    for (; arrived_ < requests_.size(); ++arrived_) {
      if (requests_[arrived_].prompt > reject_above_) {
        s.reject();
      } else {
        s.enqueue(arrived_);
      }
    }
  }
  void idle(Scheduler& /*s*/) override { throw std::logic_error("toy: idle"); }
  bool reserve_token(RequestId id) override {
    if (free_ == 0) return false;
    --free_;
    ++requests_[id].held;
    return true;
  }
  void decode_token(RequestId id) override {
    ++requests_[id].generated;
    log.push_back("d" + std::to_string(id));
  }
  bool finished(RequestId id) const override {
    return requests_[id].generated >= requests_[id].output;
  }
  bool try_admit(RequestId id, const Scheduler& /*s*/) override {
    ++admit_attempts;
    const std::size_t need = requests_[id].prompt + requests_[id].generated;
    if (need > free_) return false;
    free_ -= need;
    requests_[id].held = need;
    log.push_back("a" + std::to_string(id));
    return true;
  }
  void release(RequestId id) override {
    free_ += requests_[id].held;
    requests_[id].held = 0;
    log.push_back("r" + std::to_string(id));
  }
  void on_complete(RequestId id, double at_ms) override {
    log.push_back("c" + std::to_string(id) + "@" + std::to_string(static_cast<int>(at_ms)));
  }
  void after_admission(const Scheduler& /*s*/) override { log.push_back("|"); }
  bool end_step(const Scheduler& s) override { return s.step() < stop_after_; }
  std::string stall_message(RequestId head, const Scheduler& /*s*/) const override {
    return "toy: stalled on " + std::to_string(head);
  }

  std::vector<std::string> log;
  std::size_t admit_attempts = 0;
  std::size_t reject_above_ = 1000;
  std::uint64_t stop_after_ = 1000;
  std::size_t free_;

 private:
  std::vector<Request> requests_;
  std::size_t arrived_ = 0;
};

TEST(sim_scheduler, RejectsBadOptions) {
  ToyWorkload w(4, {});
  EXPECT_THAT(
      message_of<InvalidArgument>([&] { Scheduler(w, SchedulerOptions{.max_running = 0}); }),
      HasSubstr("max_running"));
  EXPECT_THAT(message_of<InvalidArgument>([&] { Scheduler(w, SchedulerOptions{.step_ms = 0.0}); }),
              HasSubstr("step_ms"));
}

TEST(sim_scheduler, RetireBeforeAdmissionFreesBlocksForTheSameStep) {
  // Two requests of 2 blocks and 1 token in a 3-block cache: request 1 can
  // only run once request 0 gave its blocks back.
  ToyWorkload w(3, {{2, 1}, {2, 1}});
  Scheduler s(w, SchedulerOptions{.max_running = 4, .step_ms = 10.0, .start_ms = 100.0});
  const SchedulerStats stats = s.run();
  EXPECT_EQ(stats.completed, 2u);
  EXPECT_EQ(stats.steps, 3u);
  // Step 1 admits 0; step 2: 0 decodes, completes, 1 is admitted; step 3: 1.
  EXPECT_THAT(w.log,
              ElementsAre("a0", "|", "d0", "r0", "c0@120", "a1", "|", "d1", "r1", "c1@130", "|"));
  EXPECT_EQ(w.free_, 3u);
}

TEST(sim_scheduler, RetireAfterAdmissionFreesBlocksForTheNextStep) {
  ToyWorkload w(3, {{2, 1}, {2, 1}});
  Scheduler s(w, SchedulerOptions{.max_running = 4,
                                  .retire = RetirePoint::after_admission,
                                  .retry_head_after_release = false});
  const SchedulerStats stats = s.run();
  EXPECT_EQ(stats.completed, 2u);
  EXPECT_EQ(stats.steps, 4u);
  EXPECT_THAT(
      w.log, ElementsAre("a0", "|", "d0", "|", "r0", "c0@20", "a1", "|", "d1", "|", "r1", "c1@40"));
}

TEST(sim_scheduler, TheHeadIsRetriedOnlyAfterAReleaseWhenAsked) {
  // Request 0 holds the cache for 3 steps; request 1 waits for it.
  for (const bool after_release : {true, false}) {
    ToyWorkload w(4, {{2, 2}, {3, 1}});
    Scheduler s(w, SchedulerOptions{.retry_head_after_release = after_release});
    s.run();
    // Without the flag the head is tried in steps 1 and 2 while request 0
    // runs; with it, once in step 1 and again after request 0 completed.
    EXPECT_EQ(w.admit_attempts, after_release ? 3u : 4u) << after_release;
  }
}

TEST(sim_scheduler, PreemptsTheNewestAndAdmitsNothingInThatStep) {
  // Two requests of 1 block that generate 3 tokens in a 4-block cache: in
  // step 3 request 0 finds no block, so request 1 (the newest) is preempted
  // before request 0 decodes, and nothing is admitted in that step.
  ToyWorkload w(4, {{1, 3}, {1, 3}});
  Scheduler s(w, SchedulerOptions{.max_running = 2});
  const SchedulerStats stats = s.run();
  EXPECT_EQ(stats.completed, 2u);
  EXPECT_EQ(stats.preemptions, 1u);
  EXPECT_THAT(std::vector<std::string>(w.log.begin(), w.log.begin() + 12),
              ElementsAre("a0", "a1", "|", "d0", "d1", "|", "r1", "d0", "|", "d0", "r0", "c0@40"));
  // Step 1 tries both, step 3 none (it preempted), step 4 request 1 again.
  EXPECT_EQ(w.admit_attempts, 3u);
}

TEST(sim_scheduler, ARequestThatNeverFitsIsAStall) {
  ToyWorkload w(3, {{5, 1}});
  Scheduler s(w, SchedulerOptions{});
  EXPECT_THAT(message_of<std::logic_error>([&] { s.run(); }), HasSubstr("toy: stalled on 0"));
}

TEST(sim_scheduler, RejectedRequestsEndTheRunAndEndStepCanStopIt) {
  ToyWorkload rejecting(3, {{5, 1}, {1, 1}});
  rejecting.reject_above_ = 4;
  Scheduler a(rejecting, SchedulerOptions{});
  const SchedulerStats stats = a.run();
  EXPECT_EQ(stats.rejected, 1u);
  EXPECT_EQ(stats.completed, 1u);

  ToyWorkload stopping(100, {{1, 50}});
  stopping.stop_after_ = 5;
  Scheduler b(stopping, SchedulerOptions{});
  EXPECT_EQ(b.run().steps, 5u);
  EXPECT_EQ(b.running().size(), 1u);  // left running for the workload to clean up
}

TEST(sim_scheduler, AllRejectedEndsTheRunWithoutIdling) {
  // Every request is refused at arrival: the run ends there, without asking
  // the workload to skip idle time (the toy's idle() throws).
  ToyWorkload w(3, {{5, 1}, {6, 1}});
  w.reject_above_ = 4;
  Scheduler s(w, SchedulerOptions{});
  const SchedulerStats stats = s.run();
  EXPECT_EQ(stats.rejected, 2u);
  EXPECT_EQ(stats.steps, 0u);
}

TEST(sim_scheduler, AStepThatPreemptsAndEmptiesTheBatchIsNotAStall) {
  // 3 blocks. Step 2: request 0 takes the last free block and finishes,
  // request 1 finds none and preempts itself; request 0 then retires, so
  // nothing runs and request 1 waits in a step that may not admit. Step 3
  // admits it again.
  ToyWorkload w(3, {{1, 1}, {1, 2}});
  Scheduler s(w, SchedulerOptions{.max_running = 2});
  const SchedulerStats stats = s.run();
  EXPECT_EQ(stats.completed, 2u);
  EXPECT_EQ(stats.preemptions, 1u);
  EXPECT_EQ(stats.steps, 5u);
  EXPECT_THAT(std::vector<std::string>(w.log.begin(), w.log.begin() + 9),
              ElementsAre("a0", "a1", "|", "d0", "r1", "r0", "c0@20", "|", "a1"));
  EXPECT_EQ(w.free_, 3u);
}

TEST(sim_scheduler, NothingToGenerateCompletesInTheStepOfAdmission) {
  ToyWorkload w(3, {{1, 0}});
  Scheduler s(w, SchedulerOptions{});
  EXPECT_EQ(s.run().steps, 1u);
  EXPECT_THAT(w.log, ElementsAre("a0", "r0", "c0@10", "|"));
}

}  // namespace
}  // namespace kvport::sim
