// SPDX-License-Identifier: Apache-2.0
#include "kvport/core/kv_cache_plan.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <limits>

#include "kvport/core/paged_kv_cache.hpp"
#include "kvport/platform/div_ceil.hpp"
#include "kvport/platform/error.hpp"
#include "kvport/platform/size_math.hpp"

namespace kvport {

double KvCachePlan::ratio_to_all_full() const noexcept {
  if (all_full_peak_bytes_per_request == 0) return 0.0;
  return static_cast<double>(peak_bytes_per_request) /
         static_cast<double>(all_full_peak_bytes_per_request);
}

std::size_t peak_blocks_per_request(const LayerSpec& spec, std::size_t block_size,
                                    std::size_t context_tokens, std::size_t step_tokens,
                                    std::size_t state_checkpoints) {
  if (block_size == 0) throw InvalidArgument("peak_blocks_per_request: block_size must be > 0");
  if (context_tokens == 0)
    throw InvalidArgument("peak_blocks_per_request: the context must be > 0 tokens");
  if (step_tokens == 0) throw InvalidArgument("peak_blocks_per_request: step_tokens must be > 0");
  const std::size_t full = div_ceil(context_tokens, block_size);
  switch (spec.kind) {
    case LayerKind::full_attention:
    case LayerKind::mla:
      return full;
    case LayerKind::sliding_window:
      // Held: the blocks covering [n - W + 1, n + step) for some n; a span of
      // W - 1 + step tokens starting anywhere in a block covers at most
      // ceil((W - 2 + step) / bs) + 1 blocks.
      return std::min(full, div_ceil(saturating_add(spec.window, step_tokens) - 2, block_size) + 1);
    case LayerKind::chunked_local:
      // Held: from the chunk start of token n (block-aligned) to n + step.
      return std::min(full, div_ceil(saturating_add(spec.chunk - 1, step_tokens), block_size));
    case LayerKind::state:
      return saturating_add(1, state_checkpoints);
    case LayerKind::none:
      return 0;
  }
  return 0;
}

namespace {

// The page every attention group of `groups` has (K bytes, V bytes) and the
// groups' indices and layer counts; nullopt when some layer's page differs or
// the layout is block-major.
struct GroupPages {
  std::size_t k = 0;
  std::size_t v = 0;
  std::vector<std::size_t> members;
  std::vector<std::size_t> layers;
};

std::optional<GroupPages> group_pages(std::span<const KvCacheGroup> groups, std::size_t block_size,
                                      KvCacheLayout layout) {
  if (layout != KvCacheLayout::layer_major) return std::nullopt;
  GroupPages out;
  for (std::size_t g = 0; g < groups.size(); ++g) {
    if (!groups[g].spec.has_blocks()) continue;
    const KvCacheConfig c = group_pool_config(groups[g], block_size, layout);
    for (std::size_t l = 0; l < c.num_layers; ++l) {
      const std::size_t k = c.k_block_bytes(l);
      const std::size_t v = c.has_v() ? c.v_block_bytes(l) : 0;
      if (out.members.empty() && l == 0) {
        out.k = k;
        out.v = v;
      } else if (k != out.k || v != out.v) {
        return std::nullopt;
      }
    }
    out.members.push_back(g);
    out.layers.push_back(c.num_layers);
  }
  if (out.members.size() < 2) return std::nullopt;
  return out;
}

}  // namespace

std::size_t shared_group_layers(std::span<const KvCacheGroup> groups, std::size_t block_size,
                                KvCacheLayout layout) {
  const std::optional<GroupPages> pages = group_pages(groups, block_size, layout);
  if (!pages) return 0;
  const auto [lo, hi] = std::minmax_element(pages->layers.begin(), pages->layers.end());
  // Within 1.25x: one group each, the smaller ones padded (vLLM's rule).
  return 4 * *hi < 5 * *lo ? *hi : *lo;
}

std::vector<KvCacheGroup> planned_groups(std::span<const LayerSpec> layers, std::size_t block_size,
                                         bool shared_pool, KvCacheLayout layout,
                                         std::size_t* max_group_layers) {
  std::vector<KvCacheGroup> groups = group_layers(layers, block_size);
  const std::size_t split = shared_pool ? shared_group_layers(groups, block_size, layout) : 0;
  if (split != 0) groups = group_layers(layers, block_size, split);
  if (max_group_layers != nullptr) *max_group_layers = split;
  return groups;
}

std::optional<SharedPoolGeometry> shared_pool_geometry(std::span<const KvCacheGroup> groups,
                                                       std::size_t block_size, KvCacheLayout layout,
                                                       std::vector<std::size_t>* members) {
  if (members != nullptr) members->clear();
  std::optional<GroupPages> pages = group_pages(groups, block_size, layout);
  if (!pages) return std::nullopt;
  const std::size_t slots = *std::max_element(pages->layers.begin(), pages->layers.end());
  std::size_t unused = 0;
  for (std::size_t n : pages->layers)
    unused += slots - n;
  if (4 * unused > slots * pages->layers.size()) return std::nullopt;
  if (members != nullptr) *members = std::move(pages->members);
  return SharedPoolGeometry{slots, pages->k, pages->v};
}

KvCachePlan plan_kv_cache(std::span<const KvCacheGroup> groups, std::size_t block_size,
                          const KvCachePlanRequest& request, KvCacheLayout layout) {
  if (groups.empty()) throw InvalidArgument("plan_kv_cache: no KV cache group to plan");
  if (block_size == 0) throw InvalidArgument("plan_kv_cache: block_size must be > 0");
  if (request.budget_bytes == 0) throw InvalidArgument("plan_kv_cache: the memory budget is 0");
  if (request.max_context_tokens == 0)
    throw InvalidArgument("plan_kv_cache: max_context_tokens must be > 0");

  KvCachePlan plan;
  plan.block_size = block_size;
  plan.max_context_tokens = request.max_context_tokens;
  std::vector<KvCacheConfig> configs;
  std::size_t largest_page = 0;
  for (const KvCacheGroup& group : groups) {
    GroupPlan g;
    g.spec = group.spec;
    g.num_layers = group.layers.size();
    KvCacheConfig config = group_pool_config(group, block_size, layout);
    config.validate();
    g.bytes_per_block = config.bytes_per_block();
    if (group.spec.has_blocks()) {
      // Per-layer dtypes: sum the layers' own token bytes.
      for (std::size_t i = 0; i < group.layers.size(); ++i) {
        LayerSpec layer = group.spec;
        if (group.spec.mla_format != MlaFormat::fp8_ds_mla) layer.dtype = group.layer_dtypes[i];
        g.bytes_per_token = saturating_add(g.bytes_per_token, layer.token_bytes(block_size));
      }
    } else {
      g.bytes_per_request = g.bytes_per_block;
    }
    g.peak_blocks_per_request =
        peak_blocks_per_request(group.spec, block_size, request.max_context_tokens,
                                request.step_tokens, request.state_checkpoints);
    plan.peak_bytes_per_request = saturating_add(
        plan.peak_bytes_per_request, saturating_mul(g.peak_blocks_per_request, g.bytes_per_block));
    const LayerSpec full = group.spec.as_full_attention();
    const std::size_t full_peak =
        peak_blocks_per_request(full, block_size, request.max_context_tokens, request.step_tokens,
                                request.state_checkpoints);
    plan.all_full_peak_bytes_per_request = saturating_add(
        plan.all_full_peak_bytes_per_request, saturating_mul(full_peak, g.bytes_per_block));
    largest_page = std::max(largest_page, g.bytes_per_block);
    plan.groups.push_back(std::move(g));
    configs.push_back(std::move(config));
  }
  for (const GroupPlan& g : plan.groups) {
    plan.shared_pool_peak_bytes_per_request =
        saturating_add(plan.shared_pool_peak_bytes_per_request,
                       saturating_mul(g.peak_blocks_per_request, largest_page));
  }

  // Shares in the ratio of the peak bytes per request; the groups of the
  // shared pool pool theirs.
  const long double total_peak = static_cast<long double>(plan.peak_bytes_per_request);
  auto share_of = [&](const GroupPlan& g) {
    return plan.groups.size() == 1 ? 1.0L
                                   : static_cast<long double>(saturating_mul(
                                         g.peak_blocks_per_request, g.bytes_per_block)) /
                                         total_peak;
  };
  std::size_t concurrent = std::numeric_limits<std::size_t>::max();
  std::vector<std::size_t> members;
  std::optional<SharedPoolGeometry> geo;
  if (request.shared_pool) geo = shared_pool_geometry(groups, block_size, layout, &members);
  if (geo) {
    long double share = 0;
    std::size_t peak = 0;
    for (std::size_t i : members) {
      share += share_of(plan.groups[i]);
      peak = saturating_add(peak, plan.groups[i].peak_blocks_per_request);
    }
    const auto budget =
        static_cast<std::size_t>(static_cast<long double>(request.budget_bytes) * share);
    plan.shared_geometry = *geo;
    plan.shared_blocks = std::min(budget / geo->bytes_per_block(), kMaxCacheBlocks);
    if (plan.shared_blocks == 0) {
      throw InvalidArgument(fmt::format(
          "plan_kv_cache: the budget of {} bytes leaves the shared pool {} bytes, less than one "
          "block of {} bytes",
          request.budget_bytes, budget, geo->bytes_per_block()));
    }
    plan.shared_bytes = plan.shared_blocks * geo->bytes_per_block();
    plan.total_bytes = plan.shared_bytes;
    for (std::size_t i : members) {
      plan.groups[i].shared = true;
      plan.groups[i].num_blocks = plan.shared_blocks;
    }
    if (peak > 0) concurrent = plan.shared_blocks / peak;
  }
  for (std::size_t i = 0; i < plan.groups.size(); ++i) {
    GroupPlan& g = plan.groups[i];
    if (g.shared) continue;
    const long double share = share_of(g);
    const auto budget =
        static_cast<std::size_t>(static_cast<long double>(request.budget_bytes) * share);
    g.num_blocks = PagedKvCache::compute_num_blocks(configs[i], budget);
    if (g.num_blocks == 0) {
      throw InvalidArgument(fmt::format(
          "plan_kv_cache: the budget of {} bytes leaves group {} ({}, {} layers) {} bytes, less "
          "than one block of {} bytes",
          request.budget_bytes, i, g.spec.describe(), g.num_layers, budget, g.bytes_per_block));
    }
    g.bytes = PagedKvCache::pool_allocation_bytes(configs[i], g.num_blocks);
    plan.total_bytes = saturating_add(plan.total_bytes, g.bytes);
    if (g.peak_blocks_per_request > 0)
      concurrent = std::min(concurrent, g.num_blocks / g.peak_blocks_per_request);
  }
  plan.max_concurrent_requests =
      concurrent == std::numeric_limits<std::size_t>::max() ? 0 : concurrent;
  if (request.max_requests > plan.max_concurrent_requests) {
    throw InvalidArgument(fmt::format(
        "plan_kv_cache: {} requests of {} tokens need {} bytes at their peak ({} per request); "
        "the budget of {} bytes holds {}",
        request.max_requests, request.max_context_tokens,
        saturating_mul(request.max_requests, plan.peak_bytes_per_request),
        plan.peak_bytes_per_request, request.budget_bytes, plan.max_concurrent_requests));
  }
  return plan;
}

}  // namespace kvport
