// SPDX-License-Identifier: Apache-2.0
#include "kvport/sim/replay.hpp"

#include <fmt/format.h>

#include <cmath>
#include <memory>
#include <optional>
#include <vector>

#include "kvport/core/host_tier.hpp"
#include "kvport/core/hybrid_host_tier.hpp"
#include "kvport/core/hybrid_kv_cache.hpp"
#include "kvport/core/prefix_cache.hpp"
#include "kvport/platform/byte_size.hpp"
#include "kvport/platform/error.hpp"
#include "kvport/platform/host_memory.hpp"
#include "kvport/sim/model_presets.hpp"
#include "replay_workload.hpp"

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
  HybridKvCache& groups = HybridKvCache::over(prefix);  // the cache as its one group
  const Stream stream = backend.create_stream();
  std::unique_ptr<HybridHostTier> tier;
  if (options.host_tier_blocks != 0) {
    HybridHostTierOptions tier_options;
    tier_options.slots_per_group = {options.host_tier_blocks};
    tier_options.policy = options.tier_policy;
    tier_options.inclusion = options.tier_inclusion;
    tier_options.host_free_watermark = options.host_free_watermark;
    try {
      tier = std::make_unique<HybridHostTier>(groups, tier_options, stream);
    } catch (const InvalidArgument& e) {
      throw InvalidArgument(
          fmt::format("--host-tier-blocks {}: {}", options.host_tier_blocks, e.what()));
    }
  }
  HostTier* host = tier ? tier->group_tier(0) : nullptr;
  if (options.event_sink != nullptr) {
    prefix.set_event_sink(options.event_sink);
    if (host != nullptr) host->set_event_sink(options.event_sink);
  }
  if (options.lower_tier) {
    LowerTierStore* store = options.lower_tier(cache.config(), host->slot_bytes());
    if (store != nullptr) host->set_lower_tier(store);
  }
  detail::ReplayWorkloadOptions run = detail::shared_workload_options(options);
  run.check_every = options.check_every;
  run.copy_last_block = true;  // as BlockTable
  run.fit_before_onload = true;
  run.write_contents = static_cast<bool>(options.lower_tier);
  run.feed = options.feed;
  run.on_step = &options.on_step;
  run.progress = &options.progress;
  GroupUsage usage;
  usage.spec = groups.group(0).spec;
  usage.num_layers = 1;
  usage.num_blocks = options.capacity_blocks;
  usage.bytes_per_block = model_block_bytes(options);
  usage.host_slots = options.host_tier_blocks;
  ReplayResult result = detail::run_replay_workload(requests, run, groups, tier.get(), stream,
                                                    std::vector<GroupUsage>{usage});
  result.host_tier_blocks = options.host_tier_blocks;
  result.model_block_bytes = usage.bytes_per_block;
  result.host_link_gbps = options.host_link_gbps;
  return result;
}

}  // namespace kvport::sim
