// SPDX-License-Identifier: Apache-2.0
#include "kvport/sim/serving_sim.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <chrono>
#include <limits>
#include <optional>
#include <stdexcept>
#include <utility>

#include "kvport/platform/backend.hpp"
#include "kvport/platform/div_ceil.hpp"
#include "kvport/platform/error.hpp"
#include "kvport/sim/scheduler.hpp"
#include "kvport/sim/split_mix.hpp"

namespace kvport::sim {
namespace {

using Random = SplitMix64;

struct SharedPrompt {
  std::vector<BlockId> blocks;
  std::size_t users = 0;  // running requests holding a reference
};

struct Request {
  std::size_t id = 0;
  std::optional<std::size_t> shared;  // index of its system prompt
  std::size_t prompt_tokens = 0;      // its own prompt, after the shared one
  std::size_t output_tokens = 0;
  std::size_t generated = 0;      // output tokens whose K/V is in the cache
  std::vector<BlockId> table;     // shared prompt blocks, then its own
  std::size_t shared_blocks = 0;  // leading entries of `table` that are shared

  std::size_t own_blocks() const noexcept { return table.size() - shared_blocks; }
  std::size_t context_tokens() const noexcept { return prompt_tokens + generated; }
};

class Simulation final : public Workload {
 public:
  Simulation(PagedKvCache& cache, StreamView stream, const ServingSimOptions& options)
      : cache_(cache),
        stream_(stream),
        options_(options),
        random_(options.seed),
        block_size_(cache.config().block_size),
        baseline_(cache.counters()) {}

  ServingSimResult run() {
    const auto start = std::chrono::steady_clock::now();
    result_.requests = options_.requests;
    requests_.reserve(options_.requests);
    pin_shared_prompts();
    SchedulerOptions scheduling;
    scheduling.max_running = options_.max_running;
    scheduling.retire = RetirePoint::after_admission;
    scheduling.retry_head_after_release = false;
    Scheduler scheduler(*this, scheduling);
    const SchedulerStats stats = scheduler.run();
    result_.steps = static_cast<std::size_t>(stats.steps);
    result_.completed = stats.completed;
    result_.preemptions = stats.preemptions;
    release_shared_prompts();
    const auto loop_end = std::chrono::steady_clock::now();
    cache_.backend().synchronize(stream_);
    const auto end = std::chrono::steady_clock::now();
    result_.loop_s = std::chrono::duration<double>(loop_end - start).count();
    result_.elapsed_s = std::chrono::duration<double>(end - start).count();
    check_counters();
    return std::move(result_);
  }

  std::size_t num_requests() const override { return options_.requests; }

  void arrive(Scheduler& scheduler) override {
    if (arrived_ == options_.requests) return;
    std::size_t count = random_.uniform(0, 3);
    if (count == 0 && scheduler.idle()) count = 1;  // no idle steps
    for (std::size_t i = 0; i < count && arrived_ < options_.requests; ++i) {
      Request request;
      request.id = arrived_++;
      if (!shared_.empty()) {
        const std::size_t pick = random_.uniform(0, shared_.size());  // == size(): no prompt
        if (pick < shared_.size()) request.shared = pick;
      }
      std::size_t prompt = random_.uniform(1, std::max<std::size_t>(1, options_.max_prompt_tokens));
      std::size_t output = random_.uniform(1, std::max<std::size_t>(1, options_.max_output_tokens));
      prompt = std::min(prompt, std::max<std::size_t>(1, max_own_tokens_ / 2));
      output = std::min(output, max_own_tokens_ - prompt);
      request.prompt_tokens = prompt;
      request.output_tokens = output;
      requests_.push_back(std::move(request));
      scheduler.enqueue(requests_.back().id);
    }
  }

  void idle(Scheduler& /*scheduler*/) override {
    // arrive() always brings a request into an idle scheduler while any is left.
    throw std::logic_error("demo: no request running or waiting before all completed (a bug)");
  }

  // The slot for the token a running request feeds this step: its own blocks
  // must cover its context plus that token.
  bool reserve_token(RequestId id) override {
    Request& request = requests_[id];
    const std::size_t needed = div_ceil(request.context_tokens() + 1, block_size_);
    while (request.own_blocks() < needed) {
      const auto block = alloc();
      if (!block) return false;
      request.table.push_back(*block);
    }
    return true;
  }

  void decode_token(RequestId id) override {
    ++requests_[id].generated;
    ++result_.generated_tokens;
  }

  bool finished(RequestId id) const override {
    const Request& request = requests_[id];
    return request.generated >= request.output_tokens;
  }

  // The waiting request's prompt fits when its blocks are free, keeping a
  // small watermark for running requests to grow, unless nothing runs.
  bool try_admit(RequestId id, const Scheduler& scheduler) override {
    Request& request = requests_[id];
    const std::size_t needed = div_ceil(request.context_tokens(), block_size_);
    const std::size_t reserve = scheduler.running().empty() ? 0 : cache_.num_blocks() / 100;
    if (cache_.num_free_blocks() < needed + reserve) return false;
    if (request.shared) {
      SharedPrompt& prompt = shared_[*request.shared];
      for (BlockId block : prompt.blocks) {
        cache_.inc_ref(block);
        ++result_.inc_refs;
        request.table.push_back(block);
      }
      request.shared_blocks = prompt.blocks.size();
      ++prompt.users;
    }
    for (std::size_t b = 0; b < needed; ++b) {
      const auto block = alloc();
      if (!block) throw std::logic_error("demo: a block counted as free could not be allocated");
      request.table.push_back(*block);
    }
    result_.prompt_tokens += request.context_tokens();
    return true;
  }

  // Frees the request's table; shared prompt blocks drop back to the pinned
  // reference.
  void release(RequestId id) override {
    Request& request = requests_[id];
    cache_.free_blocks(request.table);
    result_.dec_refs += request.table.size();
    expected_frees_ += request.own_blocks();
    if (request.shared) --shared_[*request.shared].users;
    request.table.clear();
    request.shared_blocks = 0;
  }

  // ONE zero_blocks call for every block handed out this step.
  void after_admission(const Scheduler& /*scheduler*/) override {
    if (new_blocks_.empty()) return;
    cache_.zero_blocks(new_blocks_, stream_);
    ++result_.zero_batches;
    result_.zeroed_blocks += new_blocks_.size();
    new_blocks_.clear();
  }

  bool end_step(const Scheduler& scheduler) override {
    verify_refcounts(scheduler);
    return true;
  }

  std::string stall_message(RequestId head, const Scheduler& scheduler) const override {
    const Request& request = requests_[head];
    return fmt::format("demo: scheduler stalled at step {}: request {} needs {} blocks, {} free",
                       scheduler.step(), request.id,
                       div_ceil(request.context_tokens(), block_size_), cache_.num_free_blocks());
  }

 private:
  std::optional<BlockId> alloc() {
    const std::optional<BlockId> block = cache_.try_alloc_block();
    if (block) {
      ++result_.allocs;
      new_blocks_.push_back(*block);
      result_.peak_blocks_in_use = std::max(result_.peak_blocks_in_use, cache_.num_blocks_in_use());
    } else {
      ++result_.alloc_failures;
    }
    return block;
  }

  void discrepancy(std::string message) {
    constexpr std::size_t kMaxListed = 16;
    if (result_.discrepancies.size() < kMaxListed) {
      result_.discrepancies.push_back(std::move(message));
    } else if (result_.discrepancies.size() == kMaxListed) {
      result_.discrepancies.push_back("... (further discrepancies not listed)");
    }
  }

  // System prompts live in the prefix cache, which holds one reference on each
  // of their blocks for the whole run. They take at most a quarter of the cache.
  void pin_shared_prompts() {
    const std::size_t limit = cache_.num_blocks() / 4;
    std::size_t pinned = 0;
    for (std::size_t i = 0; i < options_.shared_prompts; ++i) {
      const std::size_t blocks = random_.uniform(1, 4);
      if (pinned + blocks > limit) break;
      SharedPrompt prompt;
      for (std::size_t b = 0; b < blocks; ++b)
        prompt.blocks.push_back(alloc().value());
      pinned += blocks;
      shared_.push_back(std::move(prompt));
    }
    result_.shared_prompts = shared_.size();
    result_.shared_prompt_blocks = pinned;
    // One request never needs more than what the pinned prompts leave free.
    const std::size_t free_blocks = cache_.num_blocks() - pinned;
    max_own_tokens_ = block_size_ > std::numeric_limits<std::size_t>::max() / free_blocks
                          ? std::numeric_limits<std::size_t>::max()
                          : free_blocks * block_size_;
  }

  void release_shared_prompts() {
    for (SharedPrompt& prompt : shared_) {
      for (BlockId block : prompt.blocks) {
        cache_.dec_ref(block);
        ++result_.dec_refs;
        ++expected_frees_;
      }
      prompt.blocks.clear();
    }
  }

  // The cache's refcounts must match the simulation's own bookkeeping.
  void verify_refcounts(const Scheduler& scheduler) {
    const std::uint64_t step = scheduler.step();
    std::size_t expected_in_use = 0;
    for (std::size_t p = 0; p < shared_.size(); ++p) {
      const SharedPrompt& prompt = shared_[p];
      expected_in_use += prompt.blocks.size();
      for (BlockId block : prompt.blocks) {
        const std::uint32_t rc = cache_.ref_count(block);
        if (rc != 1 + prompt.users) {
          discrepancy(fmt::format("step {}: shared prompt {} block {} has refcount {}, expected {}",
                                  step, p, block, rc, 1 + prompt.users));
        }
      }
    }
    for (const RequestId id : scheduler.running()) {
      const Request& request = requests_[id];
      expected_in_use += request.own_blocks();
      for (std::size_t i = request.shared_blocks; i < request.table.size(); ++i) {
        const std::uint32_t rc = cache_.ref_count(request.table[i]);
        if (rc != 1) {
          discrepancy(fmt::format("step {}: request {} block {} has refcount {}, expected 1", step,
                                  request.id, request.table[i], rc));
        }
      }
    }
    if (cache_.num_blocks_in_use() != expected_in_use) {
      discrepancy(fmt::format("step {}: {} blocks in use, the requests hold {}", step,
                              cache_.num_blocks_in_use(), expected_in_use));
    }
  }

  void check_counters() {
    const KvCacheCounters& now = cache_.counters();
    auto expect = [&](const char* name, std::uint64_t actual, std::uint64_t expected) {
      if (actual != expected) {
        discrepancy(fmt::format("counter {} grew by {}, expected {}", name, actual, expected));
      }
    };
    expect("allocs", now.allocs - baseline_.allocs, result_.allocs);
    expect("frees", now.frees - baseline_.frees, expected_frees_);
    expect("exhaustion_events", now.exhaustion_events - baseline_.exhaustion_events,
           result_.alloc_failures);
    expect("ignored_double_frees", now.ignored_double_frees - baseline_.ignored_double_frees, 0);
    if (baseline_.peak_blocks_in_use == 0 && now.peak_blocks_in_use != result_.peak_blocks_in_use) {
      discrepancy(fmt::format("counter peak_blocks_in_use is {}, the simulation saw {}",
                              now.peak_blocks_in_use, result_.peak_blocks_in_use));
    }
    if (cache_.num_blocks_in_use() != 0) {
      discrepancy(fmt::format("{} blocks still in use after every request finished",
                              cache_.num_blocks_in_use()));
    }
  }

  PagedKvCache& cache_;
  StreamView stream_;
  ServingSimOptions options_;
  Random random_;
  std::size_t block_size_;
  KvCacheCounters baseline_;

  std::vector<SharedPrompt> shared_;
  std::size_t max_own_tokens_ = 0;
  std::size_t arrived_ = 0;
  std::vector<Request> requests_;  // by id, in order of arrival
  std::vector<BlockId> new_blocks_;
  std::uint64_t expected_frees_ = 0;
  ServingSimResult result_;
};

}  // namespace

ServingSimResult run_serving_simulation(PagedKvCache& cache, StreamView stream,
                                        const ServingSimOptions& options) {
  if (options.requests == 0) throw InvalidArgument("demo: requests must be > 0");
  if (options.max_running == 0) throw InvalidArgument("demo: max_running must be > 0");
  if (cache.num_blocks_in_use() != 0) {
    throw InvalidArgument(fmt::format("demo: the cache must start empty ({} blocks in use)",
                                      cache.num_blocks_in_use()));
  }
  return Simulation(cache, stream, options).run();
}

}  // namespace kvport::sim
