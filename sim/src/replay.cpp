// SPDX-License-Identifier: Apache-2.0
#include "kvport/sim/replay.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <limits>
#include <memory>
#include <numeric>
#include <optional>
#include <stdexcept>
#include <utility>
#include <vector>

#include "kvport/core/block_hash.hpp"
#include "kvport/core/block_table.hpp"
#include "kvport/core/host_tier.hpp"
#include "kvport/core/prefix_cache.hpp"
#include "kvport/platform/byte_size.hpp"
#include "kvport/platform/div_ceil.hpp"
#include "kvport/platform/error.hpp"
#include "kvport/platform/host_memory.hpp"
#include "kvport/sim/model_presets.hpp"
#include "kvport/sim/scheduler.hpp"
#include "kvport/sim/trace_arrivals.hpp"
#include "kvport/sim/trace_tokens.hpp"

namespace kvport::sim {

namespace {

// Bytes of one block of the model the transfers are modeled on (bf16).
std::size_t model_block_bytes(const ReplayOptions& options) {
  const std::optional<ModelPreset> preset = find_model_preset(options.model);
  if (!preset) {
    throw InvalidArgument(fmt::format("--model: unknown model '{}' (known: {})", options.model,
                                      model_preset_names()));
  }
  return preset_config(*preset, KvCacheDtype::bf16, options.block_size).bytes_per_block();
}

}  // namespace

void ReplayOptions::validate() const {
  if (capacity_blocks == 0 || capacity_blocks > kMaxCapacityBlocks) {
    throw InvalidArgument(fmt::format("--capacity-blocks: must be in [1, {}], got {}",
                                      kMaxCapacityBlocks, capacity_blocks));
  }
  if (block_size == 0 || block_size > kMaxBlockSize) {
    throw InvalidArgument(
        fmt::format("--block-size: must be in [1, {}], got {}", kMaxBlockSize, block_size));
  }
  if (capacity_blocks > kMaxCapacityTokens / block_size) {
    throw InvalidArgument(
        fmt::format("--capacity-blocks {} x --block-size {} is more than {} tokens of cache",
                    capacity_blocks, block_size, kMaxCapacityTokens));
  }
  if (trace_block_tokens == 0) throw InvalidArgument("--trace-block-tokens: must be positive");
  if (concurrency == 0) throw InvalidArgument("--concurrency: must be positive");
  if (step_ms == 0) throw InvalidArgument("--step-ms: must be positive");
  if (host_tier_blocks > kMaxHostTierBlocks) {
    throw InvalidArgument(
        fmt::format("--host-tier-blocks: must be in [0, {}] (0: no host tier), got {}",
                    kMaxHostTierBlocks, host_tier_blocks));
  }
  // The simulated slot holds K and V of 1 head of dim 1, f16: 4 bytes a token.
  const std::size_t per_block = kHostTierBookkeepingBytes + 4 * block_size;
  if (const std::size_t memory = host_physical_memory();  // 0: unknown, not checked
      memory != 0 && host_tier_blocks > memory / per_block) {
    throw InvalidArgument(fmt::format(
        "--host-tier-blocks: {} host blocks need {} of host memory to simulate ({} per block), "
        "more than this machine has ({})",
        host_tier_blocks, format_bytes(host_tier_blocks * per_block), format_bytes(per_block),
        format_bytes(memory)));
  }
  if (to_string(tier_policy) == std::string_view("unknown")) {
    throw InvalidArgument("--tier-policy: unknown policy (expected write-back or write-through)");
  }
  if (to_string(tier_inclusion) == std::string_view("unknown")) {
    throw InvalidArgument("--tier-inclusion: unknown inclusion (expected exclusive or inclusive)");
  }
  if (lower_tier && host_tier_blocks == 0) {
    throw InvalidArgument(
        "--disk-tier-blocks: needs --host-tier-blocks (the disk tier is under the host tier)");
  }
  if (host_free_watermark != 0 && !lower_tier) {
    throw InvalidArgument("--host-free-watermark: needs a disk tier (--disk-tier-blocks)");
  }
  if (host_free_watermark > host_tier_blocks / 2) {
    throw InvalidArgument(
        fmt::format("--host-free-watermark: at most half the host tier's blocks ({}), got {}",
                    host_tier_blocks / 2, host_free_watermark));
  }
  if (!std::isfinite(host_link_gbps) || host_link_gbps <= 0.0) {
    throw InvalidArgument(
        fmt::format("--host-link-gbps: must be a positive number of GB/s, got {}", host_link_gbps));
  }
  (void)model_block_bytes(*this);
}

namespace {

// The prefix-cache replay as a Workload of the one scheduler loop.
class ReplayWorkload final : public Workload {
 public:
  ReplayWorkload(std::span<const TraceRequest> requests, const ReplayOptions& options,
                 PrefixCache& prefix, HostTier* tier, StreamView stream)
      : requests_(requests),
        options_(options),
        prefix_(prefix),
        tier_(tier),
        stream_(stream),
        bs_(options.block_size),
        state_(requests.size()),
        feed_(options.feed) {
    if (feed_ != nullptr) arrival_ms_.assign(requests.size(), 0.0);
  }

  ReplayResult run() {
    const auto start = std::chrono::steady_clock::now();
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

    for (const RequestId id : scheduler.running())  // only left after a failed periodic check
      state_[id].table.reset();
    if (tier_ != nullptr) {
      tier_->poll();  // queues the write-throughs of the blocks registered last
      tier_->synchronize();
    }
    prefix_.kv_cache().backend().synchronize(stream_);
    result_.wall_s =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();

    const PrefixCacheCounters& counters = prefix_.counters();
    result_.lookups = counters.lookups;
    result_.evictions = counters.evictions;
    result_.cache_inserts = counters.inserts;
    result_.allocations = prefix_.kv_cache().counters().allocs;
    result_.cached_blocks_at_end = prefix_.num_cached_blocks();
    result_.simulated_ms = last_finish_ - first_arrival;
    if (admitted_ != 0) result_.mean_queue_ms = queue_ms_sum_ / static_cast<double>(admitted_);
    result_.device_hit_blocks =
        result_.hit_blocks - result_.host_hit_blocks - result_.lower_hit_blocks;
    if (tier_ != nullptr) {
      result_.host_tier_blocks = tier_->num_host_blocks();
      result_.tier = tier_->counters();
      result_.host_blocks_at_end = tier_->num_ready_blocks();
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
    if (options_.on_step) options_.on_step(progress(scheduler));
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
        if (div_ceil(r.input_length + r.output_length, bs_) > options_.capacity_blocks) {
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
        [&](const TraceRequest& r) {
          return div_ceil(r.input_length + r.output_length, bs_) <= options_.capacity_blocks;
        },
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

  bool reserve_token(RequestId id) override {
    return state_[id].table->blocks_needed(1) <= prefix_.num_available_blocks();
  }

  void decode_token(RequestId id) override {
    RequestState& state = state_[id];
    BlockTable& table = *state.table;
    const TokenId token = unique_token(id, table.num_tokens());
    const std::size_t full = table.num_tokens() / bs_;
    table.append_tokens({&token, 1}, stream_);  // a full block is registered in the cache
    write_contents(table, full);
    if (table.last_block_fill() == 1) track_peak();  // took a new block
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
    if (tier_ != nullptr && !fits_after_device_prefix(context)) return false;
    BlockTable table(prefix_);
    table.set_prefix_hit_mode(options_.prefix_hit_mode);
    const std::uint64_t host_hits_before = host_hits();
    const std::uint64_t lower_hits_before = lower_hits();
    const std::size_t hit = table.reuse_cached_prefix(scratch_, stream_);
    const std::uint64_t onloaded = host_hits() - host_hits_before;
    const std::uint64_t onloaded_below = lower_hits() - lower_hits_before;
    const bool copied_last_block = table.copy_on_writes() != 0;
    const std::size_t hit_blocks = table.num_blocks();  // a copied last block was a hit too
    const std::span<const TokenId> rest = std::span<const TokenId>(scratch_).subspan(hit);
    if (table.blocks_needed(rest.size()) > prefix_.num_available_blocks()) {
      result_.releases += table.num_blocks();
      table.release();
      return false;
    }
    const std::size_t full = table.num_tokens() / bs_;
    table.append_tokens(rest, stream_);
    write_contents(table, full);
    track_peak();
    if (!state.admitted) {
      state.admitted = true;
      ++admitted_;
      result_.prompt_blocks += request.input_length / bs_;
      result_.hit_blocks += hit_blocks;
      // A fully cached prompt's last block may have been onloaded and then
      // dropped (no block free for its private copy): at most hit_blocks.
      const std::uint64_t from_host = std::min<std::uint64_t>(onloaded, hit_blocks);
      result_.host_hit_blocks += from_host;
      result_.lower_hit_blocks += std::min<std::uint64_t>(onloaded_below, hit_blocks - from_host);
      if (copied_last_block) ++result_.last_block_copies;
      result_.prompt_tokens += request.input_length;
      result_.hit_tokens += hit;
      const double arrived = feed_ != nullptr ? arrival_ms_[id] : request.timestamp_ms;
      const double queued = scheduler.now_ms() - arrived;
      if (feed_ != nullptr) feed_->admitted(id, hit_blocks, hit, rest.size());
      queue_ms_sum_ += queued;
      result_.max_queue_ms = std::max(result_.max_queue_ms, queued);
    } else {
      result_.recomputed_tokens += rest.size();
    }
    result_.prefill_tokens += rest.size();
    state.table.emplace(std::move(table));
    return true;
  }

  void release(RequestId id) override {
    std::optional<BlockTable>& table = state_[id].table;
    result_.releases += table->num_blocks();
    table->release();  // last block first: the prefix stays cached longest
    table.reset();
  }

  void on_complete(RequestId id, double at_ms) override {
    finished(at_ms);
    if (feed_ != nullptr) feed_->finished(id, at_ms, false);
  }

  bool end_step(const Scheduler& scheduler) override {
    if (tier_ != nullptr) {
      // The copies queued at the end of the previous step (write-throughs;
      // write-backs are waited for where they start) complete by the end of
      // this one: a step's latency, and the same run on every machine (the
      // host backend's copies run on a worker thread, and poll() alone would
      // see them complete at a time that depends on the machine's load).
      tier_->synchronize();
      tier_->poll();
    }
    if (options_.check_every == 0 || scheduler.step() % options_.check_every != 0) return true;
    InvariantReport report = check_invariants();
    if (report.ok) return true;
    result_.invariants = std::move(report);
    result_.stopped_at_step = scheduler.step();
    return false;
  }

  std::string stall_message(RequestId head, const Scheduler& /*scheduler*/) const override {
    return fmt::format(
        "kvport replay: request on line {} cannot be admitted into an empty cache (a bug): "
        "free {}, evictable {}, in use {}, capacity {}",
        requests_[head].line, prefix_.kv_cache().num_free_blocks(), prefix_.num_evictable_blocks(),
        prefix_.kv_cache().num_blocks_in_use(), options_.capacity_blocks);
  }

 private:
  struct RequestState {
    std::size_t generated = 0;
    bool admitted = false;            // admitted at least once
    bool handed = false;              // handed over by the feed
    std::optional<BlockTable> table;  // while running
  };

  // With a host tier, a lookup onloads the host's part of the prefix into
  // device blocks before the admission check below can fail; a failed attempt
  // then gives those blocks back to the device cache (exclusive: the host
  // copies are gone), where waiting evicts them and writes them back again,
  // attempt after attempt. So the head first checks, without a lookup, that
  // it could fit even if every evictable block were free: the blocks of its
  // context past its device-cached prefix (onloaded or prefilled, either way
  // a device block each) against num_available_blocks(). When that fails the
  // attempt after the lookup would fail too (the lookup only takes blocks
  // away), so nothing changes but the onloads (and lookups) not made.
  bool fits_after_device_prefix(std::size_t context) {
    const std::vector<BlockHash> hashes = hash_full_blocks(scratch_, bs_);
    std::size_t on_device = 0;
    while (on_device < hashes.size() && prefix_.find(hashes[on_device]))
      ++on_device;
    return div_ceil(context, bs_) - on_device <= prefix_.num_available_blocks();
  }

  // With a lower tier the blocks reach a disk, where a reader (a restarted
  // run, a test) checks what it finds: each block that became full from
  // block `first` on, and is cached under a hash, gets its content: every K
  // and V block of it holds that hash (low then high, little-endian)
  // repeated. The cache's memory is otherwise never written: the blocks
  // would carry whatever the heap held.
  void write_contents(const BlockTable& table, std::size_t first) {
    if (!options_.lower_tier) return;
    PagedKvCache& kv = prefix_.kv_cache();
    for (std::size_t i = first; i < table.num_tokens() / bs_; ++i) {
      const BlockId block = table.blocks()[i];
      const std::optional<BlockHash> hash = prefix_.hash_of(block);
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
    p.blocks_in_use = options_.capacity_blocks - prefix_.num_available_blocks();
    p.cached_blocks = prefix_.num_cached_blocks();
    p.tier = tier_;
    p.completed = scheduler.stats().completed;
    p.rejected = scheduler.stats().rejected;
    p.prefix = &prefix_;
    return p;
  }

  std::uint64_t host_hits() const noexcept {
    return tier_ != nullptr ? tier_->counters().host_hits : 0;
  }
  std::uint64_t lower_hits() const noexcept {
    return tier_ != nullptr ? tier_->counters().lower_tier_hits : 0;
  }

  InvariantReport check_invariants() const {
    return tier_ != nullptr ? tier_->check_invariants() : prefix_.check_invariants();
  }

  void finished(double at) {
    ++finished_;
    last_finish_ = std::max(last_finish_, at);
    if (options_.progress) options_.progress(finished_, requests_.size());
  }

  void track_peak() {
    const std::size_t in_use = options_.capacity_blocks - prefix_.num_available_blocks();
    result_.peak_blocks_in_use = std::max(result_.peak_blocks_in_use, in_use);
  }

  std::span<const TraceRequest> requests_;
  const ReplayOptions& options_;
  PrefixCache& prefix_;
  HostTier* tier_;  // nullptr: no host tier
  StreamView stream_;
  std::size_t bs_;
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
  std::vector<TokenId> scratch_;
  std::vector<std::uint8_t> k_content_;  // write_contents' buffers
  std::vector<std::uint8_t> v_content_;
  ReplayResult result_;
};

}  // namespace

ReplayResult run_replay(std::span<const TraceRequest> requests, const ReplayOptions& options,
                        Backend& backend) {
  options.validate();
  if (requests.empty()) throw InvalidArgument("kvport replay: no requests");
  for (const TraceRequest& r : requests) {
    if (r.input_length == 0 || r.input_length > kMaxRequestTokens ||
        r.output_length > kMaxRequestTokens - r.input_length) {
      throw InvalidArgument(fmt::format(
          "request of line {}: input_length {} and output_length {} must be >= 1 and together "
          "at most {}",
          r.line, r.input_length, r.output_length, kMaxRequestTokens));
    }
  }
  // The smallest cache: only the block bookkeeping matters, not the data.
  KvCacheConfig config;
  config.num_layers = 1;
  config.num_kv_heads = 1;
  config.head_dim_k = config.head_dim_v = 1;
  config.dtype = KvCacheDtype::f16;
  config.block_size = options.block_size;
  PagedKvCacheOptions cache_options;
  cache_options.trace = false;  // 16 history entries per block would dwarf the simulation
  PagedKvCache cache(config, options.capacity_blocks, backend, cache_options);
  PrefixCache prefix(cache);
  const Stream stream = backend.create_stream();
  std::unique_ptr<HostTier> tier;
  if (options.host_tier_blocks != 0) {
    HostTierOptions tier_options;
    tier_options.num_host_blocks = options.host_tier_blocks;
    tier_options.policy = options.tier_policy;
    tier_options.inclusion = options.tier_inclusion;
    tier_options.host_free_watermark = options.host_free_watermark;
    try {
      tier = std::make_unique<HostTier>(prefix, tier_options, stream);
    } catch (const InvalidArgument& e) {
      throw InvalidArgument(
          fmt::format("--host-tier-blocks {}: {}", options.host_tier_blocks, e.what()));
    }
  }
  if (options.event_sink != nullptr) {
    prefix.set_event_sink(options.event_sink);
    if (tier) tier->set_event_sink(options.event_sink);
  }
  if (options.lower_tier) {
    LowerTierStore* store = options.lower_tier(cache.config(), tier->slot_bytes());
    if (store != nullptr) tier->set_lower_tier(store);
  }
  ReplayWorkload replay(requests, options, prefix, tier.get(), stream);
  ReplayResult result = replay.run();
  result.model_block_bytes = model_block_bytes(options);
  result.host_link_gbps = options.host_link_gbps;
  return result;
}

}  // namespace kvport::sim
