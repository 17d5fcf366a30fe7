// SPDX-License-Identifier: Apache-2.0
#include "replay_workload.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <chrono>
#include <optional>
#include <stdexcept>
#include <utility>
#include <vector>

#include "kvport/core/block_hash.hpp"
#include "kvport/core/hybrid_block_table.hpp"
#include "kvport/core/kv_cache_plan.hpp"
#include "kvport/core/prefix_cache.hpp"
#include "kvport/core/shared_block_pool.hpp"
#include "kvport/platform/div_ceil.hpp"
#include "kvport/platform/error.hpp"
#include "kvport/sim/scheduler.hpp"
#include "kvport/sim/trace_arrivals.hpp"
#include "kvport/sim/trace_tokens.hpp"

namespace kvport::sim::detail {
namespace {

class ReplayWorkload final : public Workload {
 public:
  ReplayWorkload(std::span<const TraceRequest> requests, const ReplayWorkloadOptions& options,
                 HybridKvCache& cache, HybridHostTier* tier, StreamView stream,
                 std::vector<GroupUsage> groups)
      : requests_(requests),
        options_(options),
        cache_(cache),
        tier_(tier),
        stream_(stream),
        bs_(options.block_size),
        one_group_(cache.num_groups() == 1 && cache.shared_pool() == nullptr),
        state_(requests.size()),
        feed_(options.feed) {
    if (groups.size() != cache.num_groups() || !cache.caches_prefixes()) {
      throw std::logic_error(
          "kvport replay: a cache of prefix caches and a usage entry per group are needed (a bug)");
    }
    result_.groups = std::move(groups);
    if (feed_ != nullptr) arrival_ms_.assign(requests.size(), 0.0);
    // The distinct pools (a shared pool's groups draw from one).
    for (std::size_t g = 0; g < cache.num_groups(); ++g) {
      const PagedKvCache* pool = &cache.group_cache(g);
      if (std::find(pools_.begin(), pools_.end(), pool) == pools_.end()) pools_.push_back(pool);
    }
  }

  ReplayResult run() {
    const auto start = std::chrono::steady_clock::now();
    result_.request_hit_tokens.assign(requests_.size(), -1);
    double first_arrival = arrivals_.first_arrival_ms();
    if (feed_ != nullptr) {
      // The clock starts at the first request handed over (or at the trace's
      // first timestamp when the feed has nothing by then).
      ReplayProgress progress;
      progress.now_ms = first_arrival;
      std::optional<double> first = feed_->wait_next(progress);
      if (!first) feed_done_ = true;
      first_arrival = first.value_or(first_arrival);
    }
    last_finish_ = first_arrival;

    SchedulerOptions scheduling;
    scheduling.max_running = options_.concurrency;
    scheduling.step_ms = static_cast<double>(options_.step_ms);
    scheduling.start_ms = first_arrival;
    scheduling.retire = RetirePoint::before_admission;
    scheduling.retry_head_after_release = true;
    Scheduler scheduler(*this, scheduling);
    const SchedulerStats stats = scheduler.run();
    result_.requests = feed_ != nullptr ? handed_ : requests_.size();
    result_.steps = stats.steps;
    result_.completed = stats.completed;
    result_.rejected = stats.rejected;
    result_.preemptions = stats.preemptions;
    if (stats.steps != 0)
      result_.mean_running = static_cast<double>(running_steps_) / static_cast<double>(stats.steps);

    for (RequestState& s : state_)  // only left after a failed periodic check
      s.table.reset();
    if (tier_ != nullptr) {
      tier_->poll();  // queues the write-throughs of the blocks registered last
      tier_->synchronize();
    }
    cache_.synchronize();
    result_.wall_s =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();

    for (std::size_t g = 0; g < cache_.num_groups(); ++g) {
      const PrefixCacheCounters& counters = cache_.prefix_cache(g).counters();
      result_.evictions += counters.evictions;
      result_.cache_inserts += counters.inserts;
    }
    result_.cached_blocks_at_end = cached_blocks();
    result_.lookups = cache_.prefix_cache(0).counters().lookups;
    for (const PagedKvCache* pool : pools_)
      result_.allocations += pool->counters().allocs;
    const HybridHitCounters& hits = cache_.hit_counters();
    result_.state_checkpoints = hits.state_checkpoints;
    result_.short_hits = hits.short_hits;
    result_.short_hit_tokens = hits.short_hit_tokens;
    result_.simulated_ms = last_finish_ - first_arrival;
    if (admitted_ != 0) result_.mean_queue_ms = queue_ms_sum_ / static_cast<double>(admitted_);
    result_.device_hit_blocks =
        result_.hit_blocks - result_.host_hit_blocks - result_.lower_hit_blocks;
    if (tier_ != nullptr) {
      result_.tier = tier_->total_counters();
      for (std::size_t g = 0; g < cache_.num_groups(); ++g) {
        result_.groups[g].tier_counters = tier_->counters(g);
        if (const HostTier* t = tier_->group_tier(g); t != nullptr)
          result_.host_blocks_at_end += t->num_ready_blocks();
      }
    }
    if (result_.stopped_at_step == 0) {
      result_.invariants = check_invariants();
      if (result_.invariants.blocks_in_use != 0) {
        result_.invariants.add_violation(
            fmt::format("{} blocks are still in use after the last request finished",
                        result_.invariants.blocks_in_use));
      }
    }
    return std::move(result_);
  }

  std::size_t num_requests() const override {
    // With a feed: those handed over, and one more while more may come.
    return feed_ == nullptr ? requests_.size() : handed_ + (feed_done_ ? 0 : 1);
  }

  void arrive(Scheduler& scheduler) override {
    if (options_.on_step != nullptr && *options_.on_step) (*options_.on_step)(progress(scheduler));
    if (feed_ != nullptr) {
      fed_.clear();
      next_known_ = feed_->arrivals(progress(scheduler), fed_);
      for (const ArrivalFeed::Arrival& a : fed_) {
        if (a.index >= requests_.size() || state_[a.index].handed) {
          throw InvalidArgument(
              fmt::format("kvport replay: the feed handed over request {} {}", a.index,
                          a.index >= requests_.size() ? "of no trace line" : "a second time"));
        }
        const TraceRequest& r = requests_[a.index];
        state_[a.index].handed = true;
        arrival_ms_[a.index] = a.arrival_ms;
        ++handed_;
        if (!fits_alone(r.input_length + r.output_length)) {
          scheduler.reject();
          finished(scheduler.now_ms());
          feed_->finished(a.index, scheduler.now_ms(), true);
          continue;
        }
        scheduler.enqueue(a.index);
      }
      return;
    }
    arrivals_.arrive(
        scheduler,
        [&](const TraceRequest& r) { return fits_alone(r.input_length + r.output_length); },
        [&](const TraceRequest& r) { finished(r.timestamp_ms); });
  }

  void idle(Scheduler& scheduler) override {
    if (feed_ == nullptr) {
      arrivals_.idle(scheduler);
      return;
    }
    std::optional<double> next = next_known_;
    if (!next) next = feed_->wait_next(progress(scheduler));
    if (!next) {
      feed_done_ = true;  // num_requests() now says every request is done
      return;
    }
    scheduler.advance_to(std::max(scheduler.now_ms(), *next));
  }

  bool reserve_token(RequestId id) override { return state_[id].table->can_append(1); }

  void decode_token(RequestId id) override {
    RequestState& state = state_[id];
    HybridBlockTable& table = *state.table;
    const TokenId token = unique_token(id, table.num_tokens());
    const std::size_t full = table.num_tokens() / bs_;
    table.append_tokens({&token, 1}, stream_);  // a full block is registered in the cache
    write_contents(table, full);
    if (table.num_tokens() % bs_ == 1 || bs_ == 1) track_peak();  // took a new block
    ++state.generated;
    ++result_.generated_tokens;
  }

  bool finished(RequestId id) const override {
    return state_[id].generated == requests_[id].output_length;
  }

  bool try_admit(RequestId id, const Scheduler& scheduler) override {
    const TraceRequest& request = requests_[id];
    RequestState& state = state_[id];
    const std::size_t context = request.input_length + state.generated;
    sequence_tokens(request, id, options_.trace_block_tokens, context, scratch_);
    if (options_.fit_before_onload && tier_ != nullptr && !fits_after_device_prefix(context))
      return false;
    HybridBlockTable table(cache_);
    table.set_prefix_hit_mode(options_.prefix_hit_mode);
    table.set_copy_last_block(options_.copy_last_block);
    table.set_keep_shared_windows(true);
    const std::uint64_t lower_before = cache_.hit_counters().lower_tier_blocks;
    tier_taken_.clear();
    for (std::size_t g = 0; g < cache_.num_groups(); ++g)
      tier_taken_.push_back(tier_ != nullptr ? tier_->counters(g) : HostTierCounters{});
    const std::size_t hit = table.reuse_cached_prefix(scratch_, stream_);
    if (!state.tried) {
      state.tried = true;
      state.first_hit = hit;
    }
    const bool from_host = cache_.hit_counters().lower_tier_blocks != lower_before;
    const bool copied_last_block = table.copy_on_writes() != 0;
    group_hits_.clear();
    for (std::size_t g = 0; g < cache_.num_groups(); ++g) {
      const bool state_group = cache_.group(g).spec.kind == LayerKind::state;
      group_hits_.push_back(state_group ? (hit != 0 ? 1 : 0) : table.num_live_blocks(g));
      // What the lookup took from the host (and below): after - before.
      HostTierCounters& taken = tier_taken_[g];
      if (tier_ != nullptr) {
        const HostTierCounters after = tier_->counters(g);
        taken.onloads = after.onloads - taken.onloads;
        taken.host_hits = after.host_hits - taken.host_hits;
        taken.lower_tier_hits = after.lower_tier_hits - taken.lower_tier_hits;
      }
    }
    // Admitted only when the whole prefill fits: a try that computed some
    // chunks and then gave up would leave them cached, and its retry would
    // count them as a hit.
    if (!prefill_fits(table, scratch_.size())) {
      result_.releases += live_blocks(table);
      return false;  // the table gives its blocks back
    }
    // Chunked prefill: each chunk is computed before the next is appended.
    for (std::size_t at = hit; at < scratch_.size();) {
      const std::size_t left = scratch_.size() - at;
      const std::size_t n =
          options_.prefill_chunk_tokens == 0 ? left : std::min(options_.prefill_chunk_tokens, left);
      if (!table.can_append(n)) {  // the estimate was short; the table gives everything back
        state.computed_to = std::max(state.computed_to, at);
        result_.releases += live_blocks(table);
        return false;
      }
      const std::size_t full = table.num_tokens() / bs_;
      table.append_tokens(std::span<const TokenId>(scratch_).subspan(at, n), stream_);
      write_contents(table, full);
      at += n;
    }
    track_peak();
    // The next turn of a conversation hits at the end of this prompt: its
    // window blocks stay until the request ends.
    table.keep_hit_point();
    const std::size_t rest = scratch_.size() - hit;
    if (!state.admitted) {
      state.admitted = true;
      ++admitted_;
      // What an earlier try of this request computed is not a hit.
      const std::size_t counted = hit > state.computed_to ? hit : std::min(hit, state.first_hit);
      const std::size_t hit_blocks = div_ceil(counted, bs_);  // a copied last block was a hit too
      result_.prompt_blocks += request.input_length / bs_;
      result_.hit_blocks += hit_blocks;
      if (one_group_) {
        // A fully cached prompt's last block may have been onloaded and then
        // dropped (no block free for its private copy): at most hit_blocks.
        const HostTierCounters& taken = tier_taken_[0];
        const std::uint64_t from_host_blocks = std::min<std::uint64_t>(taken.host_hits, hit_blocks);
        result_.host_hit_blocks += from_host_blocks;
        result_.lower_hit_blocks +=
            std::min<std::uint64_t>(taken.lower_tier_hits, hit_blocks - from_host_blocks);
      }
      if (copied_last_block) ++result_.last_block_copies;
      result_.prompt_tokens += request.input_length;
      result_.hit_tokens += counted;
      result_.request_hit_tokens[id] = static_cast<std::int64_t>(counted);
      if (from_host) result_.host_hit_tokens += counted;
      for (std::size_t g = 0; g < cache_.num_groups(); ++g) {
        result_.groups[g].hit_blocks += group_hits_[g];
        result_.groups[g].host_hit_blocks += tier_taken_[g].onloads;
      }
      const double arrived = feed_ != nullptr ? arrival_ms_[id] : request.timestamp_ms;
      const double queued = scheduler.now_ms() - arrived;
      if (feed_ != nullptr) feed_->admitted(id, hit_blocks, counted, rest);
      queue_ms_sum_ += queued;
      result_.max_queue_ms = std::max(result_.max_queue_ms, queued);
    } else {
      result_.recomputed_tokens += rest;
    }
    result_.prefill_tokens += rest;
    state.table.emplace(std::move(table));
    return true;
  }

  void release(RequestId id) override {
    std::optional<HybridBlockTable>& table = state_[id].table;
    result_.releases += live_blocks(*table);
    table->release();  // last block first: the prefix stays cached longest
    table.reset();
  }

  void on_complete(RequestId id, double at_ms) override {
    finished(at_ms);
    if (feed_ != nullptr) feed_->finished(id, at_ms, false);
  }

  bool end_step(const Scheduler& scheduler) override {
    const std::size_t running = scheduler.running().size();
    result_.peak_running = std::max(result_.peak_running, running);
    running_steps_ += running;
    if (tier_ != nullptr) {
      // The copies queued at the end of the previous step (write-throughs;
      // write-backs are waited for where they start) complete by the end of
      // this one: a step's latency, and the same run on every machine (the
      // host backend's copies run on a worker thread, and poll() alone would
      // see them complete at a time that depends on the machine's load).
      tier_->synchronize();
      tier_->poll();
    }
    for (std::size_t g = 0; g < cache_.num_groups(); ++g) {
      const std::size_t in_use = cache_.blocks_in_use(g);
      GroupUsage& usage = result_.groups[g];
      usage.peak_blocks_in_use = std::max(usage.peak_blocks_in_use, in_use);
      usage.block_steps += in_use;
    }
    if (options_.check_every == 0 || scheduler.step() % options_.check_every != 0) return true;
    InvariantReport report = check_invariants();
    if (report.ok) return true;
    result_.invariants = std::move(report);
    result_.stopped_at_step = scheduler.step();
    return false;
  }

  std::string stall_message(RequestId head, const Scheduler& /*scheduler*/) const override {
    if (!one_group_) {
      return fmt::format(
          "kvport replay: request on line {} cannot be admitted into an empty cache (a bug)",
          requests_[head].line);
    }
    const PrefixCache& prefix = cache_.prefix_cache(0);
    return fmt::format(
        "kvport replay: request on line {} cannot be admitted into an empty cache (a bug): "
        "free {}, evictable {}, in use {}, capacity {}",
        requests_[head].line, prefix.kv_cache().num_free_blocks(), prefix.num_evictable_blocks(),
        prefix.kv_cache().num_blocks_in_use(), prefix.kv_cache().num_blocks());
  }

 private:
  struct RequestState {
    std::size_t generated = 0;
    bool admitted = false;                  // admitted at least once
    bool handed = false;                    // handed over by the feed
    bool tried = false;                     // looked up once
    std::size_t first_hit = 0;              // the first lookup's hit
    std::size_t computed_to = 0;            // tokens a failed try computed (cached now)
    std::optional<HybridBlockTable> table;  // while running
  };

  // Blocks group g needs at the peak of a prefill to `context` tokens: the
  // chunked prefill's peak plus, for a window group, the window the table
  // keeps at the shared point (HybridBlockTable::keep_hit_point and
  // keep_window).
  std::size_t prefill_peak(std::size_t g, std::size_t context, bool hit) const {
    const LayerSpec& spec = cache_.group(g).spec;
    context = std::max<std::size_t>(context, 1);
    const std::size_t step =
        options_.prefill_chunk_tokens == 0 ? context : options_.prefill_chunk_tokens;
    std::size_t peak = peak_blocks_per_request(spec, bs_, context, step, 1);
    if (!hit && spec.kind == LayerKind::sliding_window)
      peak += peak_blocks_per_request(spec, bs_, context, 1, 0);
    return peak;
  }

  // Whether a prefill to `context` tokens finds its peak's blocks in every
  // group (the groups of a shared pool together in it), `held(g)` of them
  // held already; `empty_cache`: in a cache that holds nothing.
  template <typename Held>
  bool prefill_fits(std::size_t context, bool empty_cache, Held held) const {
    std::size_t shared = 0;
    for (std::size_t g = 0; g < cache_.num_groups(); ++g) {
      // A hit's window is kept while the prefill goes on: held, but not
      // released as the prefill slides past it.
      const std::size_t h = held(g);
      const std::size_t peak = prefill_peak(g, context, h != 0);
      const std::size_t need =
          peak - std::min(peak, cache_.group(g).spec.kind == LayerKind::sliding_window ? 0 : h);
      const std::size_t have = empty_cache ? cache_.group_cache(g).num_blocks() : available(g);
      if (cache_.in_shared_pool(g)) {
        shared += need;
      } else if (need > have) {
        return false;
      }
    }
    if (cache_.shared_pool() == nullptr) return true;
    return shared <= (empty_cache ? cache_.shared_pool()->num_blocks()
                                  : cache_.shared_pool()->num_available_blocks());
  }

  // Whether the prefill of `context` tokens fits from where `table` (its
  // hit) stands.
  bool prefill_fits(const HybridBlockTable& table, std::size_t context) const {
    return prefill_fits(context, false, [&](std::size_t g) {
      return cache_.group(g).spec.kind == LayerKind::state ? std::size_t{1}
                                                           : table.num_live_blocks(g);
    });
  }

  // Whether a request of `context` tokens fits an empty cache.
  bool fits_alone(std::size_t context) const {
    return prefill_fits(context, true, [](std::size_t) { return std::size_t{0}; });
  }

  // Blocks group g can take: free or evictable.
  std::size_t available(std::size_t g) const {
    return cache_.prefix_cache(g).num_available_blocks();
  }

  // With a host tier, a lookup onloads the host's part of the prefix into
  // device blocks before the admission check can fail; a failed attempt then
  // gives those blocks back to the device cache (exclusive: the host copies
  // are gone), where waiting evicts them and writes them back again, attempt
  // after attempt. So over one group the head first checks, without a
  // lookup, that it could fit even if every evictable block were free: the
  // blocks of its context past its device-cached prefix (onloaded or
  // prefilled, either way a device block each) against the available ones.
  // When that fails the attempt after the lookup would fail too (the lookup
  // only takes blocks away), so nothing changes but the onloads (and
  // lookups) not made.
  bool fits_after_device_prefix(std::size_t context) {
    const PrefixCache& prefix = cache_.prefix_cache(0);
    const std::vector<BlockHash> hashes = hash_full_blocks(scratch_, bs_);
    std::size_t on_device = 0;
    while (on_device < hashes.size() && prefix.find(hashes[on_device]))
      ++on_device;
    return div_ceil(context, bs_) - on_device <= prefix.num_available_blocks();
  }

  // With a lower tier the blocks reach a disk, where a reader (a restarted
  // run, a test) checks what it finds: each block of group 0 that became
  // full from block `first` on, and is cached under a hash, gets its
  // content: every K and V block of it holds that hash (low then high,
  // little-endian) repeated. The cache's memory is otherwise never written:
  // the blocks would carry whatever the heap held.
  void write_contents(const HybridBlockTable& table, std::size_t first) {
    if (!options_.write_contents) return;
    const PrefixCache& prefix = cache_.prefix_cache(0);
    PagedKvCache& kv = cache_.group_cache(0);
    for (std::size_t i = first; i < table.num_tokens() / bs_; ++i) {
      const BlockId block = table.blocks(0)[i];
      const std::optional<BlockHash> hash = prefix.hash_of(block);
      if (!hash) continue;  // another block holds its hash: this one never leaves
      for (std::size_t layer = 0; layer < kv.num_layers(); ++layer) {
        const auto fill = [&](std::vector<std::uint8_t>& bytes, std::size_t n) {
          bytes.resize(n);
          for (std::size_t j = 0; j < n; ++j) {
            const std::uint64_t word = j % 16 < 8 ? hash->low : hash->high;
            bytes[j] = static_cast<std::uint8_t>(word >> (8 * (j % 8)));
          }
        };
        fill(k_content_, kv.k_block_bytes(layer));
        fill(v_content_, kv.v_block_bytes(layer));
        kv.write_block(layer, block, k_content_, v_content_, stream_);
      }
    }
  }

  ReplayProgress progress(const Scheduler& scheduler) const {
    ReplayProgress p;
    p.now_ms = scheduler.now_ms();
    p.running = scheduler.running().size();
    p.waiting = scheduler.num_waiting();
    p.blocks_in_use = blocks_in_use();
    p.cached_blocks = cached_blocks();
    p.completed = scheduler.stats().completed;
    p.rejected = scheduler.stats().rejected;
    p.prefix = &cache_.prefix_cache(0);
    if (tier_ != nullptr) p.tier = tier_->group_tier(0);
    return p;
  }

  // Blocks neither free nor evictable, over every pool.
  std::size_t blocks_in_use() const {
    std::size_t in_use = 0;
    for (const PagedKvCache* pool : pools_)
      in_use += pool->num_blocks_in_use();
    for (std::size_t g = 0; g < cache_.num_groups(); ++g)
      in_use -= cache_.prefix_cache(g).num_evictable_blocks();
    return in_use;
  }

  // Blocks in the groups' prefix caches.
  std::size_t cached_blocks() const {
    std::size_t n = 0;
    for (std::size_t g = 0; g < cache_.num_groups(); ++g)
      n += cache_.prefix_cache(g).num_cached_blocks();
    return n;
  }

  static std::size_t live_blocks(const HybridBlockTable& table) {
    std::size_t n = 0;
    for (std::size_t g = 0; g < table.cache().num_groups(); ++g)
      n += table.num_live_blocks(g);
    return n;
  }

  InvariantReport check_invariants() const {
    return tier_ != nullptr ? tier_->check_invariants() : cache_.check_invariants();
  }

  void finished(double at) {
    ++finished_;
    last_finish_ = std::max(last_finish_, at);
    if (options_.progress != nullptr && *options_.progress)
      (*options_.progress)(finished_, requests_.size());
  }

  void track_peak() {
    result_.peak_blocks_in_use = std::max(result_.peak_blocks_in_use, blocks_in_use());
  }

  std::span<const TraceRequest> requests_;
  const ReplayWorkloadOptions& options_;
  HybridKvCache& cache_;
  HybridHostTier* tier_;  // nullptr: no host tier
  StreamView stream_;
  std::size_t bs_;
  bool one_group_;                          // one group, no shared pool
  std::vector<const PagedKvCache*> pools_;  // the distinct pools
  std::vector<RequestState> state_;
  TraceArrivals arrivals_{requests_};
  ArrivalFeed* feed_;               // nullptr: arrivals_ hands the trace over
  std::vector<double> arrival_ms_;  // with a feed: when each request arrived
  std::vector<ArrivalFeed::Arrival> fed_;
  std::optional<double> next_known_;  // the feed's next later arrival
  std::size_t handed_ = 0;            // requests the feed handed over
  bool feed_done_ = false;            // the feed said no request will come
  double last_finish_ = 0.0;
  double queue_ms_sum_ = 0.0;
  std::size_t finished_ = 0;  // completed or rejected
  std::size_t admitted_ = 0;  // requests admitted at least once
  std::uint64_t running_steps_ = 0;
  // try_admit's scratch, per group: the tier's counters before the lookup,
  // then what the lookup took (onloads, host and lower-tier hits).
  std::vector<HostTierCounters> tier_taken_;
  std::vector<std::uint64_t> group_hits_;
  std::vector<TokenId> scratch_;
  std::vector<std::uint8_t> k_content_;  // write_contents' buffers
  std::vector<std::uint8_t> v_content_;
  ReplayResult result_;
};

}  // namespace

ReplayResult run_replay_workload(std::span<const TraceRequest> requests,
                                 const ReplayWorkloadOptions& options, HybridKvCache& cache,
                                 HybridHostTier* tier, StreamView stream,
                                 std::vector<GroupUsage> groups) {
  ReplayWorkload workload(requests, options, cache, tier, stream, std::move(groups));
  return workload.run();
}

}  // namespace kvport::sim::detail
