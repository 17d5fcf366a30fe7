// SPDX-License-Identifier: Apache-2.0
#include "kvport/core/hybrid_host_tier.hpp"

#include <fmt/format.h>

#include <exception>

#include "group_reports.hpp"
#include "kvport/platform/byte_size.hpp"
#include "kvport/platform/error.hpp"
#include "kvport/platform/host_memory.hpp"
#include "kvport/platform/size_math.hpp"

namespace kvport {

std::vector<std::size_t> split_host_slots(const KvCachePlan& plan, std::size_t host_bytes,
                                          std::size_t state_checkpoint_interval) {
  if (plan.groups.empty() || plan.total_bytes == 0) {
    throw InvalidArgument("split_host_slots: the plan has no groups or no bytes");
  }
  // Bytes of one block's worth of tokens in every group: a slot of each
  // block group, 1 / interval of a checkpoint slot of each state group.
  const long double interval = static_cast<long double>(state_checkpoint_interval);
  long double per_block = 0.0L;
  for (const GroupPlan& g : plan.groups) {
    if (g.spec.kind == LayerKind::none) continue;
    if (g.spec.kind == LayerKind::state) {
      if (state_checkpoint_interval != 0)
        per_block += static_cast<long double>(g.bytes_per_block) / interval;
    } else {
      per_block += static_cast<long double>(g.bytes_per_block);
    }
  }
  std::vector<std::size_t> slots(plan.groups.size(), 0);
  if (per_block == 0.0L) return slots;
  const long double blocks = static_cast<long double>(host_bytes) / per_block;
  const long double limit = static_cast<long double>(HostTierOptions::kMaxHostBlocks);
  auto whole = [&](long double n) { return static_cast<std::size_t>(n < limit ? n : limit); };
  for (std::size_t g = 0; g < plan.groups.size(); ++g) {
    const LayerKind kind = plan.groups[g].spec.kind;
    if (kind == LayerKind::none) continue;
    if (kind != LayerKind::state) {
      slots[g] = whole(blocks);
    } else if (state_checkpoint_interval != 0) {
      slots[g] = whole(blocks / interval);
    }
  }
  return slots;
}

namespace {

void validate(const HybridKvCache& cache, const HybridHostTierOptions& o) {
  if (o.slots_per_group.size() != cache.num_groups()) {
    throw InvalidArgument(fmt::format("HybridHostTier: {} slot counts for {} KV cache groups",
                                      o.slots_per_group.size(), cache.num_groups()));
  }
  std::size_t bytes = 0;
  bool any = false;
  for (std::size_t g = 0; g < cache.num_groups(); ++g) {
    const std::size_t n = o.slots_per_group[g];
    if (n == 0) continue;
    any = true;
    if (n > HostTierOptions::kMaxHostBlocks) {
      throw InvalidArgument(
          fmt::format("HybridHostTier: group {} ({}): {} host slots, more than {}", g,
                      cache.group(g).spec.describe(), n, HostTierOptions::kMaxHostBlocks));
    }
    const std::size_t slot = HostTier::slot_bytes_for(cache.group_cache(g));
    if (mul_overflows(n, slot) || add_overflows(bytes, n * slot)) {
      throw InvalidArgument("HybridHostTier: the host slots' bytes overflow size_t");
    }
    bytes += n * slot;
  }
  if (!any) throw InvalidArgument("HybridHostTier: no group has host slots");
  const std::size_t memory = host_physical_memory();  // 0: unknown, not checked
  if (memory != 0 && bytes > memory) {
    throw InvalidArgument(
        fmt::format("HybridHostTier: the host slots of every group need {}, more memory than "
                    "this machine has ({})",
                    format_bytes(bytes), format_bytes(memory)));
  }
}

}  // namespace

HybridHostTier::HybridHostTier(HybridKvCache& cache, const HybridHostTierOptions& options,
                               StreamView compute_stream)
    : cache_(&cache), options_(options) {
  validate(cache, options);
  tiers_.resize(cache.num_groups());
  // A throw destroys the tiers built so far (each uninstalls itself).
  for (std::size_t g = 0; g < cache.num_groups(); ++g) {
    if (options.slots_per_group[g] == 0) continue;
    HostTierOptions o;
    o.num_host_blocks = options.slots_per_group[g];
    o.policy = options.policy;
    o.inclusion = options.inclusion;
    o.offload_batch = options.offload_batch;
    o.free_watermark = options.free_watermark;
    o.host_free_watermark = options.host_free_watermark;
    try {
      tiers_[g] = std::make_unique<HostTier>(cache.prefix_cache(g), o, compute_stream);
    } catch (const InvalidArgument& e) {
      throw InvalidArgument(
          fmt::format("group {} ({}): {}", g, cache.group(g).spec.describe(), e.what()));
    }
  }
}

HybridHostTier::HybridHostTier(HybridKvCache& cache, const HybridHostTierOptions& options)
    : HybridHostTier(cache, options, cache.backend().default_stream()) {}

HybridHostTier::~HybridHostTier() = default;

void HybridHostTier::poll() {
  for (const auto& t : tiers_)
    if (t) t->poll();
}

void HybridHostTier::synchronize() {
  for (const auto& t : tiers_)
    if (t) t->synchronize();
}

void HybridHostTier::set_event_sink(CacheEventSink* sink) {
  for (std::size_t g = 0; g < tiers_.size(); ++g)
    if (tiers_[g]) tiers_[g]->set_event_sink(sink, cache_->group_event_source(g, Medium::cpu));
}

void HybridHostTier::snapshot(CacheEventSink& sink) const {
  for (const auto& t : tiers_)
    if (t) t->snapshot(sink);
}

HostTier* HybridHostTier::group_tier(std::size_t g) const {
  if (g >= tiers_.size()) {
    throw OutOfRange(
        fmt::format("HybridHostTier: group {} out of range ({} groups)", g, tiers_.size()));
  }
  return tiers_[g].get();
}

void HybridHostTier::set_lower_tier(std::size_t g, LowerTierStore* store) {
  HostTier* tier = group_tier(g);
  if (tier == nullptr) {
    throw InvalidArgument(fmt::format("HybridHostTier: group {} has no host tier", g));
  }
  tier->set_lower_tier(store);
}

HostTierCounters HybridHostTier::counters(std::size_t g) const {
  const HostTier* t = group_tier(g);
  return t != nullptr ? t->counters() : HostTierCounters{};
}

HostTierCounters HybridHostTier::total_counters() const {
  HostTierCounters sum;
  for (const auto& t : tiers_) {
    if (!t) continue;
    sum += t->counters();
  }
  return sum;
}

std::size_t HybridHostTier::host_bytes() const noexcept {
  std::size_t bytes = 0;
  for (const auto& t : tiers_)
    if (t) bytes += t->slot_memory().size();
  return bytes;
}

InvariantReport HybridHostTier::check_invariants() const {
  std::vector<InvariantReport> reports;
  reports.reserve(tiers_.size());
  for (std::size_t g = 0; g < tiers_.size(); ++g)
    reports.push_back(tiers_[g] ? tiers_[g]->check_invariants()
                                : cache_->prefix_cache(g).check_invariants());
  return detail::merge_group_reports(reports);
}

}  // namespace kvport
