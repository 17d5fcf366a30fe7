// SPDX-License-Identifier: Apache-2.0
#include "kvport/core/hybrid_kv_cache.hpp"

#include <fmt/format.h>

#include <exception>
#include <limits>
#include <string>
#include <utility>

#include "group_reports.hpp"
#include "kvport/platform/error.hpp"

namespace kvport {
namespace {

constexpr std::size_t kNoGroup = std::numeric_limits<std::size_t>::max();

HybridPoolSizes sizes_of(const KvCachePlan& plan) {
  HybridPoolSizes out;
  out.shared_blocks = plan.shared_blocks;
  out.group_blocks.reserve(plan.groups.size());
  for (const GroupPlan& g : plan.groups)
    out.group_blocks.push_back(g.num_blocks);
  return out;
}

// `config` grouped as `plan`'s groups were: a plan of split groups
// (shared_group_layers) caps every group at the split's layer count, which is
// its largest group's, so a config that sets no cap takes that one when it
// gives the plan's groups.
HybridKvCacheConfig grouped_as(HybridKvCacheConfig config, const KvCachePlan& plan) {
  if (config.max_group_layers != 0 || plan.groups.empty()) return config;
  if (group_layers(config.layers, config.block_size).size() == plan.groups.size()) return config;
  std::size_t cap = 0;
  for (const GroupPlan& g : plan.groups)
    cap = std::max(cap, g.num_layers);
  if (group_layers(config.layers, config.block_size, cap).size() == plan.groups.size())
    config.max_group_layers = cap;
  return config;
}

HybridPoolSizes sizes_of(std::span<const std::size_t> blocks_per_group) {
  HybridPoolSizes out;
  out.group_blocks.assign(blocks_per_group.begin(), blocks_per_group.end());
  return out;
}

}  // namespace

HybridKvCache::HybridKvCache(HybridKvCacheConfig config,
                             std::span<const std::size_t> blocks_per_group, Backend& backend,
                             PagedKvCacheOptions options)
    : HybridKvCache(std::move(config), sizes_of(blocks_per_group), backend, options) {}

HybridKvCache::HybridKvCache(HybridKvCacheConfig config, const HybridPoolSizes& sizes,
                             Backend& backend, PagedKvCacheOptions options)
    : config_(std::move(config)), backend_(&backend) {
  groups_ = group_layers(config_.layers, config_.block_size, config_.max_group_layers);
  const std::span<const std::size_t> blocks_per_group = sizes.group_blocks;
  if (blocks_per_group.size() != groups_.size()) {
    throw InvalidArgument(fmt::format(
        "HybridKvCache: {} block counts for {} KV cache groups (one per group, in group order)",
        blocks_per_group.size(), groups_.size()));
  }
  in_shared_.assign(groups_.size(), false);
  if (sizes.shared_blocks != 0) {
    std::vector<std::size_t> members;
    const std::optional<SharedPoolGeometry> geo =
        shared_pool_geometry(groups_, config_.block_size, config_.layout, &members);
    if (!geo) {
      throw InvalidArgument(fmt::format(
          "HybridKvCache: a shared pool of {} blocks was asked for, but no two groups can share "
          "one (it needs layer-major layout, attention groups of equal page bytes, and layer "
          "counts that leave at most a quarter of the slots unused: see max_group_layers)",
          sizes.shared_blocks));
    }
    shared_ = std::make_unique<SharedBlockPool>(sizes.shared_blocks, *geo, backend);
    for (std::size_t g : members)
      in_shared_[g] = true;
  }
  locations_.assign(config_.layers.size(), LayerLocation{kNoGroup, 0});
  for (std::size_t g = 0; g < groups_.size(); ++g) {
    for (std::size_t i = 0; i < groups_[g].layers.size(); ++i)
      locations_[groups_[g].layers[i]] = LayerLocation{g, i};
  }
  caches_.reserve(groups_.size());
  prefixes_.reserve(groups_.size());
  for (std::size_t g = 0; g < groups_.size(); ++g) {
    if (!in_shared_[g] && blocks_per_group[g] == 0) {
      throw InvalidArgument(
          fmt::format("HybridKvCache: group {} ({}) has 0 blocks", g, groups_[g].spec.describe()));
    }
    // On a throw the members built so far are destroyed (prefix caches
    // first), freeing every pool.
    KvCacheConfig pool_config = group_pool_config(groups_[g], config_.block_size, config_.layout);
    caches_.push_back(
        in_shared_[g] ? std::make_unique<PagedKvCache>(std::move(pool_config), *shared_, options)
                      : std::make_unique<PagedKvCache>(std::move(pool_config), blocks_per_group[g],
                                                       backend, options));
    prefixes_.push_back(std::make_unique<PrefixCache>(*caches_.back()));
    // A state slot stands for a block of tokens: its events carry them.
    if (groups_[g].spec.has_state()) prefixes_.back()->set_tokens_per_block(config_.block_size);
  }
  for (std::size_t g = 0; g < groups_.size(); ++g) {
    pool_at_.push_back(caches_[g].get());
    prefix_at_.push_back(prefixes_[g].get());
  }
}

HybridKvCache::HybridKvCache(PagedKvCache& cache, PrefixCache* prefix)
    : backend_(&cache.backend()) {
  const KvCacheConfig& kc = cache.config();
  config_.layers = layer_specs_of(kc);
  config_.block_size = kc.block_size;
  config_.layout = kc.layout;
  KvCacheGroup group;
  group.spec = config_.layers.empty() ? LayerSpec{} : config_.layers.front();
  for (std::size_t l = 0; l < kc.num_layers; ++l) {
    group.layers.push_back(l);
    group.layer_dtypes.push_back(kc.dtype_for_layer(l));
    locations_.push_back(LayerLocation{0, l});
  }
  groups_.push_back(std::move(group));
  in_shared_.assign(1, false);
  pool_at_.push_back(&cache);
  prefix_at_.push_back(prefix);
}

HybridKvCache& HybridKvCache::over(PrefixCache& prefix_cache) {
  std::unique_ptr<HybridKvCache>& view = prefix_cache.group_view_;
  if (!view) view.reset(new HybridKvCache(prefix_cache.kv_cache(), &prefix_cache));
  return *view;
}

HybridKvCache& HybridKvCache::over(PagedKvCache& cache) {
  std::unique_ptr<HybridKvCache>& view = cache.group_view_;
  if (!view) view.reset(new HybridKvCache(cache, nullptr));
  return *view;
}

HybridKvCache::HybridKvCache(HybridKvCacheConfig config, const KvCachePlan& plan, Backend& backend,
                             PagedKvCacheOptions options)
    : HybridKvCache(grouped_as(std::move(config), plan), sizes_of(plan), backend, options) {
  if (shared_ && !(shared_->geometry() == plan.shared_geometry)) {
    prefixes_.clear();
    caches_.clear();
    throw InvalidArgument(
        "HybridKvCache: the plan's shared pool does not match the groups' pages (a plan of "
        "other groups)");
  }
}

HybridKvCache::~HybridKvCache() {
  prefixes_.clear();  // they drop their references before the pools go
  caches_.clear();    // and the caches before a shared pool
}

bool HybridKvCache::in_shared_pool(std::size_t g) const {
  (void)group(g);
  return in_shared_[g];
}

const KvCacheGroup& HybridKvCache::group(std::size_t g) const {
  if (g >= groups_.size()) {
    throw OutOfRange(
        fmt::format("HybridKvCache: group {} out of range ({} groups)", g, groups_.size()));
  }
  return groups_[g];
}

PagedKvCache& HybridKvCache::group_cache(std::size_t g) const {
  (void)group(g);
  return *pool_at_[g];
}

PrefixCache& HybridKvCache::prefix_cache(std::size_t g) const {
  (void)group(g);
  if (prefix_at_[g] == nullptr) {
    throw InvalidArgument(
        "HybridKvCache::prefix_cache: this is the one-group cache over a PagedKvCache without a "
        "prefix cache");
  }
  return *prefix_at_[g];
}

std::optional<LayerLocation> HybridKvCache::locate(std::size_t layer) const {
  if (layer >= locations_.size()) {
    throw OutOfRange(
        fmt::format("HybridKvCache: layer {} out of range ({} layers)", layer, locations_.size()));
  }
  if (locations_[layer].group == kNoGroup) return std::nullopt;
  return locations_[layer];
}

std::size_t HybridKvCache::total_bytes() const noexcept {
  std::size_t total = shared_ ? shared_->total_bytes() : 0;
  for (const PagedKvCache* c : pool_at_) {
    if (c->shared_pool() == nullptr) total += c->total_bytes();
  }
  return total;
}

void HybridKvCache::set_event_sink(CacheEventSink* sink) {
  for (std::size_t g = 0; g < prefix_at_.size(); ++g)
    if (prefix_at_[g] != nullptr)
      prefix_at_[g]->set_event_sink(sink, group_event_source(g, Medium::gpu));
}

EventSource HybridKvCache::group_event_source(std::size_t g, Medium medium) const {
  const LayerSpec& spec = group(g).spec;
  EventSource source;
  source.medium = medium;
  source.group_idx = static_cast<std::uint32_t>(g);
  source.spec_kind = std::string(to_string(spec.kind));
  if (spec.kind == LayerKind::sliding_window)
    source.sliding_window = static_cast<std::uint32_t>(spec.window);
  return source;
}

void HybridKvCache::snapshot(CacheEventSink& sink) const {
  for (const PrefixCache* p : prefix_at_)
    if (p != nullptr) p->snapshot(sink);
}

std::size_t HybridKvCache::blocks_in_use(std::size_t g) const {
  const PagedKvCache& pool = group_cache(g);
  const PrefixCache* p = prefix_at_[g];
  return pool.num_blocks_in_use() - (p != nullptr ? p->num_evictable_blocks() : 0);
}

std::vector<InvariantReport> HybridKvCache::check_group_invariants() const {
  std::vector<InvariantReport> out;
  out.reserve(prefix_at_.size());
  for (std::size_t g = 0; g < prefix_at_.size(); ++g)
    out.push_back(prefix_at_[g] != nullptr ? prefix_at_[g]->check_invariants()
                                           : pool_at_[g]->check_invariants());
  return out;
}

InvariantReport detail::merge_group_reports(std::span<const InvariantReport> reports) {
  InvariantReport total;
  for (std::size_t g = 0; g < reports.size(); ++g) {
    const InvariantReport& r = reports[g];
    total.blocks_checked += r.blocks_checked;
    total.free_blocks += r.free_blocks;
    total.blocks_in_use += r.blocks_in_use;
    total.evictable_blocks += r.evictable_blocks;
    total.cached_blocks += r.cached_blocks;
    for (const std::string& v : r.violations)
      total.add_violation(fmt::format("group {}: {}", g, v));
    if (!r.ok && r.violations.empty()) total.add_violation(fmt::format("group {}: not ok", g));
  }
  return total;
}

InvariantReport HybridKvCache::check_invariants() const {
  InvariantReport total = detail::merge_group_reports(check_group_invariants());
  if (shared_) {
    const InvariantReport pool = shared_->check_invariants();
    for (const std::string& v : pool.violations)
      total.add_violation(v);
    if (!pool.ok && pool.violations.empty()) total.add_violation("shared pool: not ok");
    // The groups' reports count the blocks they hold; the pool's free blocks
    // are no group's.
    total.blocks_checked += pool.free_blocks;
    total.free_blocks += pool.free_blocks;
  }
  return total;
}

void HybridKvCache::synchronize() {
  std::exception_ptr first;
  for (PagedKvCache* c : pool_at_) {
    try {
      c->synchronize();
    } catch (...) {
      if (!first) first = std::current_exception();
    }
  }
  if (first) std::rethrow_exception(first);
}

GroupHitRule hit_rule_of(const LayerSpec& spec) noexcept {
  return GroupHitRule{spec.kind, spec.window, spec.chunk};
}

std::size_t first_needed_block(const GroupHitRule& rule, std::size_t block_size,
                               std::size_t position) noexcept {
  switch (rule.kind) {
    case LayerKind::sliding_window:
      return position + 1 > rule.window ? (position + 1 - rule.window) / block_size : 0;
    case LayerKind::chunked_local:
      return rule.chunk == 0 ? 0 : position / rule.chunk * (rule.chunk / block_size);
    case LayerKind::state:
      return position / block_size;
    case LayerKind::full_attention:
    case LayerKind::mla:
    case LayerKind::none:
      return 0;
  }
  return 0;
}

}  // namespace kvport
