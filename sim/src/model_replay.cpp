// SPDX-License-Identifier: Apache-2.0
#include "kvport/sim/model_replay.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <chrono>
#include <memory>
#include <stdexcept>
#include <utility>

#include "kvport/core/hybrid_host_tier.hpp"
#include "kvport/core/hybrid_kv_cache.hpp"
#include "kvport/core/kv_cache_plan.hpp"
#include "kvport/platform/byte_size.hpp"
#include "kvport/platform/error.hpp"
#include "kvport/platform/size_math.hpp"
#include "replay_workload.hpp"

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

}  // namespace

void ModelReplayOptions::validate() const {
  if (layers.empty()) throw InvalidArgument("replay: the model has no layers");
  if (block_size == 0) throw InvalidArgument("--block-size: must be positive");
  if (budget_bytes == 0) throw InvalidArgument("--memory: the KV memory must be positive");
  if (prefill_chunk_tokens == 0) throw InvalidArgument("--prefill-chunk: must be positive");
  if (trace_block_tokens == 0) throw InvalidArgument("--trace-block-tokens: must be positive");
  if (concurrency == 0) throw InvalidArgument("--concurrency: must be positive");
  if (step_ms == 0) throw InvalidArgument("--step-ms: must be positive");
}

std::size_t model_block_bytes(const KvCachePlan& plan) noexcept {
  std::size_t bytes = 0;
  for (const GroupPlan& g : plan.groups) {
    if (g.spec.kind != LayerKind::state && g.spec.kind != LayerKind::none)
      bytes = saturating_add(bytes, g.bytes_per_block);
  }
  return bytes;
}

CommonHitRates common_hit_rates(std::span<const TraceRequest> requests, const ReplayResult& a,
                                const ReplayResult& b) {
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

ReplayResult replay_model(std::span<const TraceRequest> requests, const ModelReplayOptions& options,
                          Backend& backend) {
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
  std::vector<GroupUsage> usage;
  std::size_t shared_index = 0;
  for (const GroupPlan& g : plan.groups) {
    sim.layers.push_back(g.shared ? tiny_shared(g.spec, shared_index++)
                                  : tiny(g.spec, sim.layers.size()));
    GroupUsage u;
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
  detail::ReplayWorkloadOptions run = detail::shared_workload_options(options);
  run.prefill_chunk_tokens = options.prefill_chunk_tokens;
  ReplayResult result =
      detail::run_replay_workload(requests, run, cache, tier.get(), stream, std::move(usage));
  tier.reset();
  result.host_tier_blocks = options.host_tier_blocks;
  result.host_bytes = host_bytes;
  result.model_block_bytes = model_block_bytes(plan);
  result.budget_bytes = options.budget_bytes;
  result.pool_bytes = plan.total_bytes;
  result.planned_context_tokens = plan.max_context_tokens;
  result.shared_pool_blocks = plan.shared_blocks;
  result.wall_s = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  return result;
}

}  // namespace kvport::sim
