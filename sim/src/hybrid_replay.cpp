// SPDX-License-Identifier: Apache-2.0
#include "kvport/sim/hybrid_replay.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <chrono>
#include <memory>
#include <numeric>
#include <optional>
#include <stdexcept>
#include <utility>

#include "kvport/core/hybrid_block_table.hpp"
#include "kvport/core/hybrid_host_tier.hpp"
#include "kvport/core/hybrid_kv_cache.hpp"
#include "kvport/core/kv_cache_plan.hpp"
#include "kvport/platform/byte_size.hpp"
#include "kvport/platform/div_ceil.hpp"
#include "kvport/platform/error.hpp"
#include "kvport/platform/size_math.hpp"
#include "kvport/sim/scheduler.hpp"
#include "kvport/sim/trace_arrivals.hpp"
#include "kvport/sim/trace_tokens.hpp"

namespace kvport::sim {
namespace {

// The same kind of layer in a small shape: the simulation needs the rules
// (window, chunk, state), not the bytes, which are modeled. Group g gets
// g + 1 heads (or values) so that no two groups merge.
LayerSpec tiny(const LayerSpec& spec, std::size_t g) {
  const std::size_t n = g + 1;
  switch (spec.kind) {
    case LayerKind::full_attention:
      return LayerSpec::full_attention(n, 8, 8);
    case LayerKind::sliding_window:
      return LayerSpec::sliding_window(spec.window, n, 8, 8);
    case LayerKind::chunked_local:
      return LayerSpec::chunked_local(spec.chunk, n, 8, 8);
    case LayerKind::mla:
      return LayerSpec::mla(8 * n, 0);
    case LayerKind::state:
      return LayerSpec::recurrent_state({StateTensor{"state", {4 * n}, StateDtype::f32}});
    case LayerKind::none:
      break;
  }
  return LayerSpec::no_kv();
}

// A tiny layer of the i-th group in the shared pool: every one has 64-element
// K and V per token (heads x head_dim), so their pages match, and the
// factorization differs per group so that group_layers keeps them apart (the
// groups a split made have equal specs).
LayerSpec tiny_shared(const LayerSpec& spec, std::size_t i) {
  constexpr std::size_t kElements = 64;
  if (i > 6) {
    throw InvalidArgument(fmt::format(
        "kvport replay: the model has more than 7 groups in its shared pool ({} and more); the "
        "simulation tells at most 7 apart",
        i + 1));
  }
  const std::size_t heads = std::size_t{1} << i;
  const std::size_t dim = kElements / heads;
  switch (spec.kind) {
    case LayerKind::sliding_window:
      return LayerSpec::sliding_window(spec.window, heads, dim, dim);
    case LayerKind::chunked_local:
      return LayerSpec::chunked_local(spec.chunk, heads, dim, dim);
    case LayerKind::mla:  // K only: a latent of 64 values
      return LayerSpec::mla(kElements - 8 * i, 8 * i);
    default:
      return LayerSpec::full_attention(heads, dim, dim);
  }
}

class HybridReplayWorkload final : public Workload {
 public:
  HybridReplayWorkload(std::span<const TraceRequest> requests, const HybridReplayOptions& options,
                       HybridKvCache& cache, HybridHostTier* tier,
                       std::vector<HybridGroupUsage>& usage, StreamView stream)
      : requests_(requests),
        options_(options),
        cache_(cache),
        tier_(tier),
        usage_(usage),
        stream_(stream),
        bs_(options.block_size),
        state_(requests.size()) {}

  HybridReplayResult run() {
    result_.requests = requests_.size();
    result_.request_hit_tokens.assign(requests_.size(), -1);
    SchedulerOptions scheduling;
    scheduling.max_running = options_.concurrency;
    scheduling.step_ms = static_cast<double>(options_.step_ms);
    scheduling.start_ms = arrivals_.first_arrival_ms();
    scheduling.retire = RetirePoint::before_admission;
    scheduling.retry_head_after_release = true;
    Scheduler scheduler(*this, scheduling);
    const SchedulerStats stats = scheduler.run();
    result_.steps = stats.steps;
    result_.completed = stats.completed;
    result_.rejected = stats.rejected;
    result_.preemptions = stats.preemptions;
    if (stats.steps != 0)
      result_.mean_running = static_cast<double>(running_steps_) / static_cast<double>(stats.steps);
    for (RequestState& s : state_)
      s.table.reset();
    if (tier_ != nullptr) tier_->synchronize();
    cache_.synchronize();
    const HybridHitCounters& hits = cache_.hit_counters();
    result_.state_checkpoints = hits.state_checkpoints;
    result_.short_hits = hits.short_hits;
    result_.short_hit_tokens = hits.short_hit_tokens;
    result_.invariants = tier_ != nullptr ? tier_->check_invariants() : cache_.check_invariants();
    if (result_.invariants.blocks_in_use != 0) {
      result_.invariants.add_violation(
          fmt::format("{} blocks are still in use after the last request finished",
                      result_.invariants.blocks_in_use));
    }
    return std::move(result_);
  }

  std::size_t num_requests() const override { return requests_.size(); }

  void arrive(Scheduler& scheduler) override {
    arrivals_.arrive(
        scheduler,
        [&](const TraceRequest& r) { return fits_alone(r.input_length + r.output_length); },
        [](const TraceRequest&) {});
  }

  void idle(Scheduler& scheduler) override { arrivals_.idle(scheduler); }

  bool reserve_token(RequestId id) override { return state_[id].table->can_append(1); }

  void decode_token(RequestId id) override {
    RequestState& state = state_[id];
    const TokenId token = unique_token(id, state.table->num_tokens());
    state.table->append_tokens({&token, 1}, stream_);
    ++state.generated;
    ++result_.generated_tokens;
  }

  bool finished(RequestId id) const override {
    return state_[id].generated == requests_[id].output_length;
  }

  bool try_admit(RequestId id, const Scheduler& scheduler) override {
    (void)scheduler;
    const TraceRequest& request = requests_[id];
    RequestState& state = state_[id];
    const std::size_t context = request.input_length + state.generated;
    sequence_tokens(request, id, options_.trace_block_tokens, context, scratch_);
    HybridBlockTable table(cache_);
    table.set_prefix_hit_mode(options_.prefix_hit_mode);
    table.set_keep_shared_windows(true);
    const std::uint64_t lower_before = cache_.hit_counters().lower_tier_blocks;
    onloads_before_.clear();
    for (std::size_t g = 0; g < usage_.size(); ++g)
      onloads_before_.push_back(tier_ != nullptr ? tier_->counters(g).onloads : 0);
    const std::size_t hit = table.reuse_cached_prefix(scratch_, stream_);
    if (!state.tried) {
      state.tried = true;
      state.first_hit = hit;
    }
    const bool from_host = cache_.hit_counters().lower_tier_blocks != lower_before;
    hit_blocks_.clear();
    host_blocks_.clear();
    for (std::size_t g = 0; g < usage_.size(); ++g) {
      const bool state_group = cache_.group(g).spec.kind == LayerKind::state;
      hit_blocks_.push_back(state_group ? (hit != 0 ? 1 : 0) : table.num_live_blocks(g));
      host_blocks_.push_back(tier_ != nullptr ? tier_->counters(g).onloads - onloads_before_[g]
                                              : 0);
    }
    // Admitted only when the whole prefill fits (as the one-group replay
    // does): a try that computed some chunks and then gave up would leave
    // them cached, and its retry would count them as a hit.
    if (!prefill_fits(table, scratch_.size())) return false;
    // Chunked prefill: each chunk is computed before the next is appended.
    for (std::size_t at = hit; at < scratch_.size();) {
      const std::size_t n = std::min(options_.prefill_chunk_tokens, scratch_.size() - at);
      if (!table.can_append(n)) {  // the estimate was short; the table gives everything back
        state.computed_to = std::max(state.computed_to, at);
        return false;
      }
      table.append_tokens(std::span<const TokenId>(scratch_).subspan(at, n), stream_);
      at += n;
    }
    // The next turn of a conversation hits at the end of this prompt: its
    // window blocks stay until the request ends.
    table.keep_hit_point();
    if (!state.admitted) {
      state.admitted = true;
      result_.prompt_tokens += request.input_length;
      // What an earlier try of this request computed is not a hit.
      const std::size_t counted = hit > state.computed_to ? hit : std::min(hit, state.first_hit);
      result_.hit_tokens += counted;
      result_.request_hit_tokens[id] = static_cast<std::int64_t>(counted);
      if (from_host) result_.host_hit_tokens += counted;
      for (std::size_t g = 0; g < usage_.size(); ++g) {
        usage_[g].hit_blocks += hit_blocks_[g];
        usage_[g].host_hit_blocks += host_blocks_[g];
      }
    } else {
      result_.recomputed_tokens += scratch_.size() - hit;
    }
    result_.prefill_tokens += scratch_.size() - hit;
    state.table.emplace(std::move(table));
    return true;
  }

  void release(RequestId id) override { state_[id].table.reset(); }

  bool end_step(const Scheduler& scheduler) override {
    const std::size_t running = scheduler.running().size();
    result_.peak_running = std::max(result_.peak_running, running);
    running_steps_ += running;
    if (tier_ != nullptr) tier_->poll();
    for (std::size_t g = 0; g < usage_.size(); ++g) {
      const std::size_t in_use = cache_.blocks_in_use(g);
      usage_[g].peak_blocks_in_use = std::max(usage_[g].peak_blocks_in_use, in_use);
      usage_[g].block_steps += in_use;
    }
    return true;
  }

  std::string stall_message(RequestId head, const Scheduler& /*scheduler*/) const override {
    return fmt::format(
        "kvport replay: request on line {} cannot be admitted into an empty cache (a bug)",
        requests_[head].line);
  }

 private:
  struct RequestState {
    std::size_t generated = 0;
    bool admitted = false;
    bool tried = false;           // looked up once
    std::size_t first_hit = 0;    // the first lookup's hit
    std::size_t computed_to = 0;  // tokens a failed try computed (cached now)
    std::optional<HybridBlockTable> table;
  };

  // Blocks group g needs at the peak of a prefill to `context` tokens: the
  // chunked prefill's peak plus, for a window or chunked group, the window
  // the table keeps at the shared point (HybridBlockTable::keep_hit_point
  // and keep_window).
  std::size_t prefill_peak(std::size_t g, std::size_t context, bool hit) const {
    const LayerSpec& spec = cache_.group(g).spec;
    context = std::max<std::size_t>(context, 1);
    std::size_t peak =
        peak_blocks_per_request(spec, bs_, context, options_.prefill_chunk_tokens, 1);
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
      const std::size_t have = empty_cache ? cache_.group_cache(g).num_blocks()
                                           : cache_.prefix_cache(g).num_available_blocks();
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

  std::span<const TraceRequest> requests_;
  const HybridReplayOptions& options_;
  HybridKvCache& cache_;
  HybridHostTier* tier_;
  std::vector<HybridGroupUsage>& usage_;
  std::vector<std::uint64_t> onloads_before_;  // scratch of try_admit
  std::vector<std::uint64_t> hit_blocks_;
  std::vector<std::uint64_t> host_blocks_;
  StreamView stream_;
  std::size_t bs_;
  std::vector<RequestState> state_;
  TraceArrivals arrivals_{requests_};
  std::uint64_t running_steps_ = 0;
  std::vector<TokenId> scratch_;
  HybridReplayResult result_;
};

}  // namespace

void HybridReplayOptions::validate() const {
  if (layers.empty()) throw InvalidArgument("replay: the model has no layers");
  if (block_size == 0) throw InvalidArgument("--block-size: must be positive");
  if (budget_bytes == 0) throw InvalidArgument("--memory: the KV memory must be positive");
  if (prefill_chunk_tokens == 0) throw InvalidArgument("--prefill-chunk: must be positive");
  if (trace_block_tokens == 0) throw InvalidArgument("--trace-block-tokens: must be positive");
  if (concurrency == 0) throw InvalidArgument("--concurrency: must be positive");
  if (step_ms == 0) throw InvalidArgument("--step-ms: must be positive");
}

std::size_t HybridReplayResult::peak_bytes_in_use() const noexcept {
  std::size_t total = 0;
  for (const HybridGroupUsage& g : groups)
    total += g.peak_bytes_in_use();
  return total;
}

std::size_t model_block_bytes(const KvCachePlan& plan) noexcept {
  std::size_t bytes = 0;
  for (const GroupPlan& g : plan.groups) {
    if (g.spec.kind != LayerKind::state && g.spec.kind != LayerKind::none)
      bytes = saturating_add(bytes, g.bytes_per_block);
  }
  return bytes;
}

CommonHitRates common_hit_rates(std::span<const TraceRequest> requests, const HybridReplayResult& a,
                                const HybridReplayResult& b) {
  if (a.request_hit_tokens.size() != requests.size() ||
      b.request_hit_tokens.size() != requests.size()) {
    throw InvalidArgument(fmt::format(
        "common_hit_rates: {} requests, but the results have {} and {} per-request hits",
        requests.size(), a.request_hit_tokens.size(), b.request_hit_tokens.size()));
  }
  CommonHitRates r;
  std::uint64_t hits_a = 0, hits_b = 0;
  for (std::size_t i = 0; i < requests.size(); ++i) {
    if (a.request_hit_tokens[i] < 0 || b.request_hit_tokens[i] < 0) continue;
    ++r.requests;
    r.prompt_tokens += requests[i].input_length;
    hits_a += static_cast<std::uint64_t>(a.request_hit_tokens[i]);
    hits_b += static_cast<std::uint64_t>(b.request_hit_tokens[i]);
  }
  if (r.prompt_tokens != 0) {
    r.a = static_cast<double>(hits_a) / static_cast<double>(r.prompt_tokens);
    r.b = static_cast<double>(hits_b) / static_cast<double>(r.prompt_tokens);
  }
  return r;
}

std::vector<LayerSpec> as_all_full_attention(std::span<const LayerSpec> layers) {
  std::vector<LayerSpec> out;
  out.reserve(layers.size());
  for (const LayerSpec& s : layers)
    out.push_back(s.as_full_attention());
  return out;
}

HybridReplayResult replay_hybrid(std::span<const TraceRequest> requests,
                                 const HybridReplayOptions& options, Backend& backend) {
  options.validate();
  const auto start = std::chrono::steady_clock::now();
  const std::vector<KvCacheGroup> groups =
      planned_groups(options.layers, options.block_size, options.shared_pool);
  KvCachePlanRequest want;
  want.budget_bytes = options.budget_bytes;
  want.max_context_tokens = options.max_context_tokens;
  if (want.max_context_tokens == 0) {
    for (const TraceRequest& r : requests)
      want.max_context_tokens = std::max(want.max_context_tokens, r.input_length + r.output_length);
  }
  want.max_context_tokens = std::max<std::size_t>(want.max_context_tokens, 1);
  want.step_tokens = options.prefill_chunk_tokens;
  want.shared_pool = options.shared_pool;
  const KvCachePlan plan = plan_kv_cache(groups, options.block_size, want);

  // The simulated cache: one tiny layer per group, the plan's block counts
  // (the shared pool's groups: tiny layers of one page size).
  HybridKvCacheConfig sim;
  sim.block_size = options.block_size;
  sim.state_checkpoint_interval = options.state_checkpoint_interval;
  std::vector<HybridGroupUsage> usage;
  std::size_t shared_index = 0;
  for (const GroupPlan& g : plan.groups) {
    sim.layers.push_back(g.shared ? tiny_shared(g.spec, shared_index++)
                                  : tiny(g.spec, sim.layers.size()));
    HybridGroupUsage u;
    u.spec = g.spec;
    u.num_layers = g.num_layers;
    u.num_blocks = g.num_blocks;
    u.bytes_per_block = g.bytes_per_block;
    usage.push_back(u);
  }
  HybridPoolSizes sizes;
  sizes.shared_blocks = plan.shared_blocks;
  for (const GroupPlan& g : plan.groups)
    sizes.group_blocks.push_back(g.num_blocks);
  HybridKvCache cache(sim, sizes, backend);
  if (cache.num_groups() != plan.groups.size()) {
    throw std::logic_error("kvport replay: the simulated groups differ from the plan's (a bug)");
  }
  Stream stream = backend.create_stream();
  std::unique_ptr<HybridHostTier> tier;
  std::size_t host_bytes = 0;
  if (options.host_tier_blocks != 0) {
    const std::size_t unit = model_block_bytes(plan);
    if (mul_overflows(options.host_tier_blocks, unit)) {
      throw InvalidArgument(fmt::format("--host-tier-blocks: {} blocks of {} overflow size_t",
                                        options.host_tier_blocks, format_bytes(unit)));
    }
    HybridHostTierOptions t;
    t.slots_per_group =
        split_host_slots(plan, options.host_tier_blocks * unit, options.state_checkpoint_interval);
    t.policy = options.tier_policy;
    t.inclusion = options.tier_inclusion;
    for (std::size_t g = 0; g < plan.groups.size(); ++g) {
      usage[g].host_slots = t.slots_per_group[g];
      host_bytes += t.slots_per_group[g] * plan.groups[g].bytes_per_block;
    }
    try {
      tier = std::make_unique<HybridHostTier>(cache, t, stream);
    } catch (const InvalidArgument& e) {
      throw InvalidArgument(fmt::format("--host-tier-blocks: {}", e.what()));
    }
  }
  if (options.event_sink != nullptr) {
    cache.set_event_sink(options.event_sink);
    if (tier) tier->set_event_sink(options.event_sink);
  }
  HybridReplayWorkload workload(requests, options, cache, tier.get(), usage, stream);
  HybridReplayResult result = workload.run();
  if (tier) {
    for (std::size_t g = 0; g < usage.size(); ++g)
      usage[g].tier_counters = tier->counters(g);
  }
  tier.reset();
  result.host_tier_blocks = options.host_tier_blocks;
  result.host_bytes = host_bytes;
  result.groups = std::move(usage);
  result.budget_bytes = options.budget_bytes;
  result.pool_bytes = plan.total_bytes;
  result.planned_context_tokens = plan.max_context_tokens;
  result.shared_pool_blocks = plan.shared_blocks;
  result.wall_s = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  return result;
}

}  // namespace kvport::sim
