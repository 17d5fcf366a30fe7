// SPDX-License-Identifier: Apache-2.0
// The exported C functions of kvport.h for hybrid models: layer specs, the
// planner, hybrid caches (with their group pools lent as kvport_cache
// handles) and hybrid block tables. Each checks its handles and arguments,
// calls the C++ API and maps its exceptions (status.hpp).
#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "arguments.hpp"
#include "handles.hpp"
#include "kvport/core/batch_view.hpp"
#include "kvport/core/hybrid_block_table.hpp"
#include "kvport/core/hybrid_kv_cache.hpp"
#include "kvport/core/kv_cache_plan.hpp"
#include "kvport/core/layer_spec.hpp"
#include "kvport/kvport.h"
#include "status.hpp"

using namespace kvport;
using namespace kvport::capi;

namespace {

std::string field(const std::string& what, const char* name) {
  return what + "." + name;
}

StateTensor to_state_tensor(const kvport_state_tensor& t, const std::string& what) {
  StateTensor out;
  out.name = require(t.name, field(what, "name").c_str());
  if (t.ndim == 0 || t.ndim > KVPORT_STATE_MAX_DIMS)
    throw InvalidArgument(
        field(what, "ndim") + ": " + std::to_string(t.ndim) +
        " is outside [1, KVPORT_STATE_MAX_DIMS = " + std::to_string(KVPORT_STATE_MAX_DIMS) + "]");
  out.shape.assign(t.shape, t.shape + t.ndim);
  if (t.dtype < KVPORT_STATE_F32 || t.dtype > KVPORT_STATE_BF16)
    throw InvalidArgument(field(what, "dtype") + ": " + std::to_string(t.dtype) +
                          " is not a kvport_state_dtype");
  out.dtype = static_cast<StateDtype>(t.dtype);
  return out;
}

// Only the fields of the spec's kind are read (the header's contract), so a
// struct reused across kinds carries no stale field into grouping.
LayerSpec to_layer_spec(const kvport_layer_spec* spec, const std::string& what) {
  require(spec, what.c_str());
  const std::string dtype_what = field(what, "dtype");
  switch (spec->kind) {
    case KVPORT_LAYER_FULL_ATTENTION:
      return LayerSpec::full_attention(spec->num_kv_heads, spec->head_dim_k, spec->head_dim_v,
                                       to_dtype(spec->dtype, dtype_what.c_str()));
    case KVPORT_LAYER_SLIDING_WINDOW:
      return LayerSpec::sliding_window(spec->window, spec->num_kv_heads, spec->head_dim_k,
                                       spec->head_dim_v, to_dtype(spec->dtype, dtype_what.c_str()));
    case KVPORT_LAYER_CHUNKED_LOCAL:
      return LayerSpec::chunked_local(spec->chunk, spec->num_kv_heads, spec->head_dim_k,
                                      spec->head_dim_v, to_dtype(spec->dtype, dtype_what.c_str()));
    case KVPORT_LAYER_MLA: {
      if (spec->mla_format != KVPORT_MLA_PLAIN && spec->mla_format != KVPORT_MLA_FP8_DS_MLA)
        throw InvalidArgument(field(what, "mla_format") + ": " + std::to_string(spec->mla_format) +
                              " is not a kvport_mla_format");
      const MlaFormat format =
          spec->mla_format == KVPORT_MLA_FP8_DS_MLA ? MlaFormat::fp8_ds_mla : MlaFormat::plain;
      return LayerSpec::mla(spec->kv_lora_rank, spec->rope_dim,
                            to_dtype(spec->dtype, dtype_what.c_str()), format);
    }
    case KVPORT_LAYER_STATE: {
      const auto tensors = span_of(spec->state, spec->num_state, field(what, "state").c_str());
      std::vector<StateTensor> out;
      out.reserve(tensors.size());
      for (std::size_t i = 0; i < tensors.size(); ++i)
        out.push_back(to_state_tensor(tensors[i], what + ".state[" + std::to_string(i) + "]"));
      return LayerSpec::recurrent_state(std::move(out));
    }
    case KVPORT_LAYER_NONE:
      return LayerSpec::no_kv();
    default:
      break;
  }
  throw InvalidArgument(field(what, "kind") + ": " + std::to_string(spec->kind) +
                        " is not a kvport_layer_kind");
}

std::vector<LayerSpec> to_layer_specs(const kvport_layer_spec* specs, std::size_t num_layers) {
  const auto in = span_of(specs, num_layers, "specs");
  std::vector<LayerSpec> out;
  out.reserve(in.size());
  for (std::size_t i = 0; i < in.size(); ++i)
    out.push_back(to_layer_spec(&in[i], "specs[" + std::to_string(i) + "]"));
  return out;
}

// `state` points into storage the caller keeps (the cache object).
void write_layer_spec(const LayerSpec& s, const std::vector<kvport_state_tensor>& state,
                      kvport_layer_spec* out) {
  require(out, "out");
  out->kind = static_cast<std::int32_t>(s.kind);
  out->num_kv_heads = s.num_kv_heads;
  out->head_dim_k = s.head_dim_k;
  out->head_dim_v = s.head_dim_v;
  out->dtype = static_cast<std::int32_t>(s.dtype);
  out->window = s.window;
  out->chunk = s.chunk;
  out->kv_lora_rank = s.kv_lora_rank;
  out->rope_dim = s.rope_dim;
  out->mla_format = static_cast<std::int32_t>(s.mla_format);
  out->state = state.empty() ? nullptr : state.data();
  out->num_state = state.size();
}

std::vector<kvport_state_tensor> c_state_tensors(const LayerSpec& s) {
  std::vector<kvport_state_tensor> out;
  for (const StateTensor& t : s.state) {
    kvport_state_tensor c{};
    c.name = t.name.c_str();
    c.ndim = t.shape.size();  // at most KVPORT_STATE_MAX_DIMS: the specs came through the C ABI
    for (std::size_t d = 0; d < t.shape.size() && d < KVPORT_STATE_MAX_DIMS; ++d)
      c.shape[d] = t.shape[d];
    c.dtype = static_cast<std::int32_t>(t.dtype);
    out.push_back(c);
  }
  return out;
}

void write_group_plan(const GroupPlan& g, kvport_group_plan* out) {
  out->kind = static_cast<std::int32_t>(g.spec.kind);
  out->num_layers = g.num_layers;
  out->bytes_per_block = g.bytes_per_block;
  out->bytes_per_token = g.bytes_per_token;
  out->bytes_per_request = g.bytes_per_request;
  out->peak_blocks_per_request = g.peak_blocks_per_request;
  out->num_blocks = g.num_blocks;
  out->bytes = g.bytes;
  out->shared = g.shared ? 1 : 0;
}

/// KVPORT_ERR_INVALID_ARGUMENT unless `capacity` holds `needed` entries (and
/// `out` is not null when it must hold any).
template <class T>
T* check_capacity(T* out, std::size_t capacity, std::size_t needed, const char* op) {
  if (capacity < needed)
    throw InvalidArgument(std::string(op) + ": capacity " + std::to_string(capacity) + " < the " +
                          std::to_string(needed) + " entries to write");
  if (needed > 0) require(out, "out");
  return out;
}

HybridCacheObject& hybrid_object(const kvport_hybrid_cache* handle) {
  return get<HybridCacheObject>(handle);
}
HybridKvCache& hybrid_of(const kvport_hybrid_cache* handle) {
  return *hybrid_object(handle).cache;
}
HybridBlockTable& hybrid_table_of(const kvport_hybrid_block_table* handle) {
  return *get<HybridBlockTableObject>(handle).table;
}

// The handle of a cache just built: its groups' state tensors described once,
// no group pool handle yet.
void describe_groups(HybridCacheObject& object) {
  const HybridKvCache& cache = *object.cache;
  for (std::size_t g = 0; g < cache.num_groups(); ++g)
    object.state_tensors.push_back(c_state_tensors(cache.group(g).spec));
  object.group_handles.assign(cache.num_groups(), nullptr);
}

kvport_hybrid_cache* finish_hybrid_cache(std::unique_ptr<HybridCacheObject> object,
                                         BackendObject& parent) {
  describe_groups(*object);
  return make_handle<kvport_hybrid_cache>(std::move(object), &parent);
}

// What owns the sequences and pools made over `object`: the object itself,
// or for a lent view the prefix cache or cache that lent it (which then
// cannot be destroyed while they live).
Object& owner_of(HybridCacheObject& object) {
  return object.lent ? *object.parent : object;
}

// The lent handle of `view` (in `slot`, made on first use) over `lender`.
kvport_hybrid_cache* lend_groups(HybridKvCache& view, Object& lender, kvport_hybrid_cache*& slot) {
  if (slot == nullptr) {
    auto object = std::make_unique<HybridCacheObject>();
    object->cache = &view;
    describe_groups(*object);
    slot = make_lent_handle<kvport_hybrid_cache>(std::move(object), &lender);
  }
  return slot;
}

}  // namespace

extern "C" {

// ---- layer specs ---------------------------------------------------------------------------

kvport_status kvport_layer_spec_init(kvport_layer_spec* spec) {
  return guard([&] {
    require(spec, "spec");
    *spec = kvport_layer_spec{};
    spec->kind = KVPORT_LAYER_FULL_ATTENTION;
    spec->dtype = KVPORT_DTYPE_BF16;
    spec->mla_format = KVPORT_MLA_PLAIN;
  });
}

kvport_status kvport_layer_spec_validate(const kvport_layer_spec* spec, size_t block_size) {
  return guard([&] { to_layer_spec(spec, "spec").validate(block_size); });
}

kvport_status kvport_layer_spec_describe(const kvport_layer_spec* spec, char* text,
                                         size_t text_size, size_t* text_needed) {
  return guard([&] {
    const std::string s = to_layer_spec(spec, "spec").describe();
    write_text(s, text, text_size, text_needed);
  });
}

kvport_status kvport_layer_spec_block_bytes(const kvport_layer_spec* spec, size_t block_size,
                                            size_t* out) {
  return guard([&] {
    const LayerSpec s = to_layer_spec(spec, "spec");
    s.validate(block_size);
    put(out, s.block_bytes(block_size), "out");
  });
}

kvport_status kvport_layer_spec_state_bytes(const kvport_layer_spec* spec, size_t* out) {
  return guard([&] {
    const LayerSpec s = to_layer_spec(spec, "spec");
    s.validate(1);
    put(out, s.state_bytes(), "out");
  });
}

kvport_status kvport_layer_spec_state_offset(const kvport_layer_spec* spec, size_t index,
                                             size_t* out) {
  return guard([&] {
    const LayerSpec s = to_layer_spec(spec, "spec");
    s.validate(1);
    put(out, s.state_offset(index), "out");
  });
}

// ---- the hybrid planner --------------------------------------------------------------------

kvport_status kvport_plan_request_init(kvport_plan_request* request) {
  return guard([&] {
    require(request, "request");
    const KvCachePlanRequest defaults;
    request->budget_bytes = defaults.budget_bytes;
    request->max_context_tokens = defaults.max_context_tokens;
    request->max_requests = defaults.max_requests;
    request->step_tokens = defaults.step_tokens;
    request->state_checkpoints = defaults.state_checkpoints;
    request->shared_pool = defaults.shared_pool ? 1 : 0;
  });
}

kvport_status kvport_plan_kv_cache(const kvport_layer_spec* specs, size_t num_layers,
                                   size_t block_size, const kvport_plan_request* request,
                                   kvport_plan* out_plan, kvport_group_plan* out_groups,
                                   size_t groups_capacity) {
  return guard([&] {
    const std::vector<LayerSpec> layers = to_layer_specs(specs, num_layers);
    require(request, "request");
    require(out_plan, "out_plan");
    if (groups_capacity > 0) require(out_groups, "out_groups (with groups_capacity > 0)");
    KvCachePlanRequest r;
    r.budget_bytes = request->budget_bytes;
    r.max_context_tokens = request->max_context_tokens;
    r.max_requests = request->max_requests;
    r.step_tokens = request->step_tokens;
    r.state_checkpoints = request->state_checkpoints;
    r.shared_pool = request->shared_pool != 0;
    std::size_t split = 0;
    const std::vector<KvCacheGroup> groups =
        planned_groups(layers, block_size, r.shared_pool, KvCacheLayout::layer_major, &split);
    if (groups_capacity > 0)
      check_capacity(out_groups, groups_capacity, groups.size(), "kvport_plan_kv_cache");
    const KvCachePlan plan = plan_kv_cache(groups, block_size, r);
    out_plan->block_size = plan.block_size;
    out_plan->num_groups = plan.groups.size();
    out_plan->total_bytes = plan.total_bytes;
    out_plan->max_concurrent_requests = plan.max_concurrent_requests;
    out_plan->peak_bytes_per_request = plan.peak_bytes_per_request;
    out_plan->all_full_peak_bytes_per_request = plan.all_full_peak_bytes_per_request;
    out_plan->shared_pool_peak_bytes_per_request = plan.shared_pool_peak_bytes_per_request;
    out_plan->ratio_to_all_full = plan.ratio_to_all_full();
    out_plan->shared_blocks = plan.shared_blocks;
    out_plan->shared_bytes = plan.shared_bytes;
    out_plan->max_group_layers = split;
    out_plan->max_context_tokens = plan.max_context_tokens;
    if (groups_capacity > 0) {
      for (std::size_t g = 0; g < plan.groups.size(); ++g)
        write_group_plan(plan.groups[g], &out_groups[g]);
    }
  });
}

// ---- hybrid caches ---------------------------------------------------------------------------

kvport_status kvport_hybrid_cache_create(kvport_backend* backend, const kvport_layer_spec* specs,
                                         size_t num_layers, size_t block_size,
                                         size_t state_checkpoint_interval,
                                         const size_t* blocks_per_group, size_t num_groups,
                                         kvport_hybrid_cache** out) {
  // A pool per group: no shared pool, every layer of a spec in one group.
  return kvport_hybrid_cache_create_shared(backend, specs, num_layers, block_size,
                                           state_checkpoint_interval, 0, 0, blocks_per_group,
                                           num_groups, out);
}

kvport_status kvport_hybrid_cache_create_shared(kvport_backend* backend,
                                                const kvport_layer_spec* specs, size_t num_layers,
                                                size_t block_size, size_t state_checkpoint_interval,
                                                size_t max_group_layers, size_t shared_blocks,
                                                const size_t* blocks_per_group, size_t num_groups,
                                                kvport_hybrid_cache** out) {
  return guard([&] {
    BackendObject& parent = get<BackendObject>(backend);
    HybridKvCacheConfig config;
    config.layers = to_layer_specs(specs, num_layers);
    config.block_size = block_size;
    config.state_checkpoint_interval = state_checkpoint_interval;
    config.max_group_layers = max_group_layers;
    HybridPoolSizes sizes;
    sizes.shared_blocks = shared_blocks;
    const auto counts = span_of(blocks_per_group, num_groups, "blocks_per_group");
    sizes.group_blocks.assign(counts.begin(), counts.end());
    require(out, "out");
    auto object = std::make_unique<HybridCacheObject>();
    object->owned = std::make_unique<HybridKvCache>(std::move(config), sizes, *parent.backend);
    object->cache = object->owned.get();
    *out = finish_hybrid_cache(std::move(object), parent);
  });
}

kvport_status kvport_hybrid_cache_shared_pool_blocks(const kvport_hybrid_cache* cache,
                                                     size_t* out) {
  return guard([&] {
    const SharedBlockPool* pool = hybrid_of(cache).shared_pool();
    put(out, pool != nullptr ? pool->num_blocks() : std::size_t{0}, "out");
  });
}

kvport_status kvport_hybrid_cache_group_in_shared_pool(const kvport_hybrid_cache* cache,
                                                       size_t group, int32_t* out) {
  return guard([&] {
    put(out, static_cast<std::int32_t>(hybrid_of(cache).in_shared_pool(group) ? 1 : 0), "out");
  });
}

kvport_status kvport_hybrid_cache_destroy(kvport_hybrid_cache* cache) {
  return guard([&] { retire(cache, Kind::hybrid_cache); });
}

kvport_status kvport_hybrid_cache_num_layers(const kvport_hybrid_cache* cache, size_t* out) {
  return guard([&] { put(out, hybrid_of(cache).num_layers(), "out"); });
}

kvport_status kvport_hybrid_cache_num_groups(const kvport_hybrid_cache* cache, size_t* out) {
  return guard([&] { put(out, hybrid_of(cache).num_groups(), "out"); });
}

kvport_status kvport_hybrid_cache_block_size(const kvport_hybrid_cache* cache, size_t* out) {
  return guard([&] { put(out, hybrid_of(cache).block_size(), "out"); });
}

kvport_status kvport_hybrid_cache_total_bytes(const kvport_hybrid_cache* cache, size_t* out) {
  return guard([&] { put(out, hybrid_of(cache).total_bytes(), "out"); });
}

kvport_status kvport_hybrid_cache_group_kind(const kvport_hybrid_cache* cache, size_t group,
                                             int32_t* out) {
  return guard([&] {
    const HybridKvCache& c = hybrid_of(cache);
    put(out, static_cast<std::int32_t>(c.group(group).spec.kind), "out");
  });
}

kvport_status kvport_hybrid_cache_group_spec(const kvport_hybrid_cache* cache, size_t group,
                                             kvport_layer_spec* out) {
  return guard([&] {
    const HybridCacheObject& object = hybrid_object(cache);
    const LayerSpec& spec = object.cache->group(group).spec;  // OutOfRange first
    write_layer_spec(spec, object.state_tensors[group], out);
  });
}

kvport_status kvport_hybrid_cache_group_num_layers(const kvport_hybrid_cache* cache, size_t group,
                                                   size_t* out) {
  return guard([&] {
    const HybridKvCache& c = hybrid_of(cache);
    put(out, c.group(group).layers.size(), "out");
  });
}

kvport_status kvport_hybrid_cache_group_layers(const kvport_hybrid_cache* cache, size_t group,
                                               size_t* out, size_t capacity, size_t* out_count) {
  return guard([&] {
    const HybridKvCache& c = hybrid_of(cache);
    const std::vector<std::size_t>& layers = c.group(group).layers;
    require(out_count, "out_count");
    check_capacity(out, capacity, layers.size(), "kvport_hybrid_cache_group_layers");
    std::copy(layers.begin(), layers.end(), out);
    *out_count = layers.size();
  });
}

kvport_status kvport_hybrid_cache_group_blocks_in_use(const kvport_hybrid_cache* cache,
                                                      size_t group, size_t* out) {
  return guard([&] {
    const HybridKvCache& c = hybrid_of(cache);
    put(out, c.blocks_in_use(group), "out");
  });
}

kvport_status kvport_hybrid_cache_group_cache(kvport_hybrid_cache* cache, size_t group,
                                              kvport_cache** out) {
  return guard([&] {
    HybridCacheObject& object = hybrid_object(cache);
    PagedKvCache& group_pool = object.cache->group_cache(group);  // OutOfRange first
    require(out, "out");
    if (object.group_handles[group] == nullptr) {
      auto pool = std::make_unique<CacheObject>();
      pool->cache = &group_pool;
      for (const KvCacheDtype d : pool->cache->config().layer_dtypes)
        pool->layer_dtypes.push_back(static_cast<std::int32_t>(d));
      object.group_handles[group] =
          make_lent_handle<kvport_cache>(std::move(pool), &owner_of(object));
    }
    *out = object.group_handles[group];
  });
}

kvport_status kvport_hybrid_cache_locate(const kvport_hybrid_cache* cache, size_t layer,
                                         bool* out_has_kv, size_t* out_group, size_t* out_index) {
  return guard([&] {
    const HybridKvCache& c = hybrid_of(cache);
    require(out_has_kv, "out_has_kv");
    const std::optional<LayerLocation> at = c.locate(layer);
    *out_has_kv = at.has_value();
    if (!at) return;
    if (out_group != nullptr) *out_group = at->group;
    if (out_index != nullptr) *out_index = at->index;
  });
}

kvport_status kvport_hybrid_cache_hit_counters(const kvport_hybrid_cache* cache,
                                               kvport_hybrid_hit_counters* out) {
  return guard([&] {
    const HybridHitCounters& k = hybrid_of(cache).hit_counters();
    require(out, "out");
    out->lookups = k.lookups;
    out->lookup_tokens = k.lookup_tokens;
    out->hit_tokens = k.hit_tokens;
    out->state_checkpoints = k.state_checkpoints;
  });
}

kvport_status kvport_hybrid_cache_check_invariants(const kvport_hybrid_cache* cache,
                                                   kvport_invariant_report* report, char* text,
                                                   size_t text_size, size_t* text_needed) {
  return guard([&] {
    const HybridKvCache& c = hybrid_of(cache);
    write_report(c.check_invariants(), report, text, text_size, text_needed);
  });
}

kvport_status kvport_hybrid_cache_synchronize(kvport_hybrid_cache* cache) {
  return guard([&] { hybrid_of(cache).synchronize(); });
}

kvport_status kvport_prefix_cache_as_groups(kvport_prefix_cache* prefix,
                                            kvport_hybrid_cache** out) {
  return guard([&] {
    PrefixCacheObject& object = get<PrefixCacheObject>(prefix);
    require(out, "out");
    *out = lend_groups(HybridKvCache::over(*object.prefix), object, object.groups);
  });
}

kvport_status kvport_cache_as_groups(kvport_cache* cache, kvport_hybrid_cache** out) {
  return guard([&] {
    CacheObject& object = get<CacheObject>(cache);
    require(out, "out");
    if (object.lent) {
      throw InvalidArgument(
          "kvport_cache_as_groups: this cache is a hybrid cache's group pool; its groups are the "
          "hybrid cache's");
    }
    *out = lend_groups(HybridKvCache::over(*object.cache), object, object.groups);
  });
}

// ---- hybrid block tables ---------------------------------------------------------------------

kvport_status kvport_hybrid_block_table_create(kvport_hybrid_cache* cache, uint64_t extra_key,
                                               kvport_hybrid_block_table** out) {
  return guard([&] {
    HybridCacheObject& parent = hybrid_object(cache);
    require(out, "out");
    auto object = std::make_unique<HybridBlockTableObject>();
    object->table = std::make_unique<HybridBlockTable>(*parent.cache, extra_key);
    *out = make_handle<kvport_hybrid_block_table>(std::move(object), &owner_of(parent));
  });
}

kvport_status kvport_hybrid_block_table_destroy(kvport_hybrid_block_table* table) {
  return guard([&] { retire(table, Kind::hybrid_block_table); });
}

kvport_status kvport_hybrid_block_table_reuse_cached_prefix(kvport_hybrid_block_table* table,
                                                            const uint32_t* prompt,
                                                            size_t num_tokens,
                                                            kvport_stream* stream,
                                                            size_t* out_hit_tokens) {
  return guard([&] {
    HybridBlockTable& t = hybrid_table_of(table);
    const auto tokens = span_of(prompt, num_tokens, "prompt");
    require(out_hit_tokens, "out_hit_tokens");
    const StreamView s = stream_for(t.cache().backend(), stream);
    *out_hit_tokens = t.reuse_cached_prefix(tokens, s);
  });
}

kvport_status kvport_hybrid_block_table_set_prefix_hit_mode(kvport_hybrid_block_table* table,
                                                            int32_t mode) {
  return guard([&] {
    HybridBlockTable& t = hybrid_table_of(table);
    t.set_prefix_hit_mode(
        to_prefix_hit_mode(mode, "kvport_hybrid_block_table_set_prefix_hit_mode"));
  });
}

kvport_status kvport_hybrid_block_table_prefix_hit_mode(const kvport_hybrid_block_table* table,
                                                        int32_t* out) {
  return guard(
      [&] { put(out, prefix_hit_mode_value(hybrid_table_of(table).prefix_hit_mode()), "out"); });
}

kvport_status kvport_hybrid_block_table_set_keep_shared_windows(kvport_hybrid_block_table* table,
                                                                int32_t keep) {
  return guard([&] { hybrid_table_of(table).set_keep_shared_windows(keep != 0); });
}

kvport_status kvport_hybrid_block_table_keeps_shared_windows(const kvport_hybrid_block_table* table,
                                                             int32_t* out) {
  return guard([&] {
    put(out, static_cast<std::int32_t>(hybrid_table_of(table).keeps_shared_windows() ? 1 : 0),
        "out");
  });
}

kvport_status kvport_hybrid_block_table_set_copy_last_block(kvport_hybrid_block_table* table,
                                                            int32_t copy) {
  return guard([&] { hybrid_table_of(table).set_copy_last_block(copy != 0); });
}

kvport_status kvport_hybrid_block_table_copies_last_block(const kvport_hybrid_block_table* table,
                                                          int32_t* out) {
  return guard([&] {
    put(out, static_cast<std::int32_t>(hybrid_table_of(table).copies_last_block() ? 1 : 0), "out");
  });
}

kvport_status kvport_hybrid_block_table_keep_hit_point(kvport_hybrid_block_table* table) {
  return guard([&] { hybrid_table_of(table).keep_hit_point(); });
}

kvport_status kvport_hybrid_block_table_num_kept_blocks(const kvport_hybrid_block_table* table,
                                                        size_t group, size_t* out) {
  return guard([&] { put(out, hybrid_table_of(table).num_kept_blocks(group), "out"); });
}

kvport_status kvport_hybrid_block_table_append_tokens(kvport_hybrid_block_table* table,
                                                      const uint32_t* tokens, size_t num_tokens,
                                                      kvport_stream* stream) {
  return guard([&] {
    HybridBlockTable& t = hybrid_table_of(table);
    const auto ids = span_of(tokens, num_tokens, "tokens");
    t.append_tokens(ids, stream_for(t.cache().backend(), stream));
  });
}

namespace {

// Copies a table's ids out (KVPORT_ERR_INVALID_ARGUMENT when `out` is short).
void copy_ids(std::span<const BlockId> ids, uint32_t* out, size_t capacity, size_t* out_count,
              const char* who) {
  require(out_count, "out_count");
  check_capacity(out, capacity, ids.size(), who);
  std::copy(ids.begin(), ids.end(), out);
  *out_count = ids.size();
}

}  // namespace

kvport_status kvport_hybrid_block_table_append_draft(kvport_hybrid_block_table* table,
                                                     const uint32_t* tokens, size_t num_tokens,
                                                     kvport_stream* stream) {
  return guard([&] {
    HybridBlockTable& t = hybrid_table_of(table);
    const auto ids = span_of(tokens, num_tokens, "tokens");
    t.append_draft(ids, stream_for(t.cache().backend(), stream));
  });
}

kvport_status kvport_hybrid_block_table_can_append_draft(const kvport_hybrid_block_table* table,
                                                         size_t num_tokens, bool* out) {
  return guard([&] { put(out, hybrid_table_of(table).can_append_draft(num_tokens), "out"); });
}

kvport_status kvport_hybrid_block_table_draft_state_slots(const kvport_hybrid_block_table* table,
                                                          size_t group, uint32_t* out,
                                                          size_t capacity, size_t* out_count) {
  return guard([&] {
    copy_ids(hybrid_table_of(table).draft_state_slots(group), out, capacity, out_count,
             "kvport_hybrid_block_table_draft_state_slots");
  });
}

kvport_status kvport_hybrid_block_table_commit(kvport_hybrid_block_table* table,
                                               size_t num_tokens) {
  return guard([&] { hybrid_table_of(table).commit(num_tokens); });
}

kvport_status kvport_hybrid_block_table_truncate(kvport_hybrid_block_table* table,
                                                 size_t num_tokens) {
  return guard([&] { hybrid_table_of(table).truncate(num_tokens); });
}

kvport_status kvport_hybrid_block_table_num_draft_tokens(const kvport_hybrid_block_table* table,
                                                         size_t* out) {
  return guard([&] { put(out, hybrid_table_of(table).num_draft_tokens(), "out"); });
}

kvport_status kvport_hybrid_block_table_num_committed(const kvport_hybrid_block_table* table,
                                                      size_t* out) {
  return guard([&] { put(out, hybrid_table_of(table).num_committed(), "out"); });
}

kvport_status kvport_hybrid_block_table_check_invariants(const kvport_hybrid_block_table* table,
                                                         kvport_invariant_report* report,
                                                         char* text, size_t text_size,
                                                         size_t* text_needed) {
  return guard([&] {
    write_report(hybrid_table_of(table).check_invariants(), report, text, text_size, text_needed);
  });
}

kvport_status kvport_hybrid_block_table_can_append(const kvport_hybrid_block_table* table,
                                                   size_t num_tokens, bool* out) {
  return guard([&] { put(out, hybrid_table_of(table).can_append(num_tokens), "out"); });
}

kvport_status kvport_hybrid_block_table_blocks_needed(const kvport_hybrid_block_table* table,
                                                      size_t num_tokens, kvport_group_need* out,
                                                      size_t capacity, size_t* out_count) {
  return guard([&] {
    const HybridBlockTable& t = hybrid_table_of(table);
    require(out_count, "out_count");
    check_capacity(out, capacity, t.cache().num_groups(),
                   "kvport_hybrid_block_table_blocks_needed");
    const std::vector<HybridBlockTable::GroupNeed> needs = t.blocks_needed(num_tokens);
    for (std::size_t g = 0; g < needs.size(); ++g)
      out[g] = kvport_group_need{needs[g].fresh, needs[g].released};
    *out_count = needs.size();
  });
}

kvport_status kvport_hybrid_block_table_fork(const kvport_hybrid_block_table* table,
                                             kvport_stream* stream,
                                             kvport_hybrid_block_table** out) {
  return guard([&] {
    const HybridBlockTableObject& source = get<HybridBlockTableObject>(table);
    const HybridBlockTable& t = *source.table;
    const StreamView s = stream_for(t.cache().backend(), stream);
    require(out, "out");
    auto object = std::make_unique<HybridBlockTableObject>();
    object->table = std::make_unique<HybridBlockTable>(t.fork(s));
    *out = make_handle<kvport_hybrid_block_table>(std::move(object), source.parent);
  });
}

kvport_status kvport_hybrid_block_table_release(kvport_hybrid_block_table* table) {
  return guard([&] { hybrid_table_of(table).release(); });
}

kvport_status kvport_hybrid_block_table_num_tokens(const kvport_hybrid_block_table* table,
                                                   size_t* out) {
  return guard([&] { put(out, hybrid_table_of(table).num_tokens(), "out"); });
}

kvport_status kvport_hybrid_block_table_num_blocks(const kvport_hybrid_block_table* table,
                                                   size_t group, size_t* out) {
  return guard([&] {
    const HybridBlockTable& t = hybrid_table_of(table);
    put(out, t.blocks(group).size(), "out");
  });
}

kvport_status kvport_hybrid_block_table_num_live_blocks(const kvport_hybrid_block_table* table,
                                                        size_t group, size_t* out) {
  return guard([&] {
    const HybridBlockTable& t = hybrid_table_of(table);
    put(out, t.num_live_blocks(group), "out");
  });
}

kvport_status kvport_hybrid_block_table_blocks(const kvport_hybrid_block_table* table, size_t group,
                                               uint32_t* out, size_t capacity, size_t* out_count) {
  static_assert(kNullBlock == KVPORT_NULL_BLOCK);
  return guard([&] {
    copy_ids(hybrid_table_of(table).blocks(group), out, capacity, out_count,
             "kvport_hybrid_block_table_blocks");
  });
}

kvport_status kvport_hybrid_block_table_state_slot(const kvport_hybrid_block_table* table,
                                                   size_t group, bool* out_has_slot,
                                                   uint32_t* out_slot) {
  return guard([&] {
    const HybridBlockTable& t = hybrid_table_of(table);
    require(out_has_slot, "out_has_slot");
    require(out_slot, "out_slot");
    const std::optional<BlockId> slot = t.state_slot(group);
    *out_has_slot = slot.has_value();
    if (slot) *out_slot = *slot;
  });
}

kvport_status kvport_hybrid_block_table_copy_on_writes(const kvport_hybrid_block_table* table,
                                                       uint64_t* out) {
  return guard([&] { put(out, hybrid_table_of(table).copy_on_writes(), "out"); });
}

// ---- batch metadata ---------------------------------------------------------------------

}  // extern "C"

namespace {

std::vector<kvport::BatchSequence> batch_of(const kvport_batch* batch) {
  require(batch, "batch");
  const auto tables = span_of(batch->tables, batch->num_sequences, "batch->tables");
  const auto counts = span_of(batch->num_new_tokens, batch->num_sequences, "batch->num_new_tokens");
  std::vector<kvport::BatchSequence> out;
  out.reserve(tables.size());
  for (std::size_t i = 0; i < tables.size(); ++i)
    out.push_back(kvport::BatchSequence{&hybrid_table_of(tables[i]), counts[i]});
  return out;
}

kvport::KernelBlocks kernel_of(const kvport_batch* batch) {
  return kvport::KernelBlocks{batch->kernel_block_size, batch->null_block};
}

// A row builder (block-table rows or token locations) writing `num_rows`
// rows of `row_width` int32 at `out`.
kvport_status build_rows(kvport::BatchRowBuilder build, const kvport_batch* batch, size_t row_width,
                         int32_t* out, size_t num_rows, const char* what) {
  return guard([&] {
    const std::vector<kvport::BatchSequence> b = batch_of(batch);
    if (num_rows > 0) require(out, what);
    build(b, batch->group, kernel_of(batch), row_width, {out, num_rows * row_width});
  });
}

}  // namespace

extern "C" {

kvport_status kvport_vllm_row_width(size_t max_model_len, size_t kernel_block_size, size_t* out) {
  return guard([&] { put(out, kvport::vllm_row_width(max_model_len, kernel_block_size), "out"); });
}

kvport_status kvport_build_block_table_rows(const kvport_batch* batch, size_t row_width,
                                            int32_t* rows, size_t num_rows) {
  return build_rows(&kvport::build_block_table_rows, batch, row_width, rows, num_rows, "rows");
}

kvport_status kvport_build_token_locations(const kvport_batch* batch, size_t row_width,
                                           int32_t* locations, size_t num_rows) {
  return build_rows(&kvport::build_token_locations, batch, row_width, locations, num_rows,
                    "locations");
}

kvport_status kvport_build_slot_mapping(const kvport_batch* batch, int64_t* slots, size_t num_slots,
                                        size_t* out_count) {
  return guard([&] {
    const std::vector<kvport::BatchSequence> b = batch_of(batch);
    require(out_count, "out_count");
    if (num_slots > 0) require(slots, "slots");
    *out_count = kvport::build_slot_mapping(b, batch->group, kernel_of(batch), {slots, num_slots});
  });
}

kvport_status kvport_build_flashinfer_pages(const kvport_batch* batch, int32_t* indptr,
                                            int32_t* indices, size_t indices_capacity,
                                            int32_t* last_page_len, int32_t* kv_len,
                                            size_t* out_num_indices) {
  return guard([&] {
    const std::vector<kvport::BatchSequence> b = batch_of(batch);
    require(out_num_indices, "out_num_indices");
    const kvport::FlashInferPages p =
        kvport::build_flashinfer_pages(b, batch->group, kernel_of(batch));
    *out_num_indices = p.indices.size();
    if (indices == nullptr && indices_capacity == 0) return;  // the count only
    check_capacity(indices, indices_capacity, p.indices.size(), "kvport_build_flashinfer_pages");
    require(indptr, "indptr");
    std::copy(p.indptr.begin(), p.indptr.end(), indptr);
    std::copy(p.indices.begin(), p.indices.end(), indices);
    if (last_page_len != nullptr)
      std::copy(p.last_page_len.begin(), p.last_page_len.end(), last_page_len);
    if (kv_len != nullptr) std::copy(p.kv_len.begin(), p.kv_len.end(), kv_len);
  });
}

}  // extern "C"
