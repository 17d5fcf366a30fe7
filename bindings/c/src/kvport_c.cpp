// SPDX-License-Identifier: Apache-2.0
// The exported C functions of kvport.h: each checks its handles and what
// C++ cannot see (null pointers, enum values, buffer capacities), calls the
// C++ API, which checks ids and layers itself (kvport::OutOfRange), and maps
// its exceptions in guard() (status.hpp).
#include <algorithm>
#include <cstring>
#include <limits>
#include <span>
#include <stdexcept>
#include <string>
#include <string_view>

#include "arguments.hpp"
#include "handles.hpp"
#include "kvport/core/dtype.hpp"
#include "kvport/kvport.h"
#include "kvport/platform/registry.hpp"
#include "status.hpp"

using namespace kvport;
using namespace kvport::capi;

namespace {

KvCacheConfig to_config(const kvport_config* c) {
  require(c, "config");
  KvCacheConfig out;
  out.num_layers = c->num_layers;
  out.block_size = c->block_size;
  out.num_kv_heads = c->num_kv_heads;
  out.head_dim_k = c->head_dim_k;
  out.head_dim_v = c->head_dim_v;
  out.dtype = to_dtype(c->dtype, "config.dtype");
  if (c->layout != KVPORT_LAYOUT_LAYER_MAJOR && c->layout != KVPORT_LAYOUT_BLOCK_MAJOR)
    throw InvalidArgument("config.layout: " + std::to_string(c->layout) +
                          " is not a kvport_layout");
  out.layout = c->layout == KVPORT_LAYOUT_BLOCK_MAJOR ? KvCacheLayout::block_major
                                                      : KvCacheLayout::layer_major;
  if (c->num_layer_dtypes > 0) {
    // The array holds exactly num_layers entries: check the count before
    // reading (or reserving for) that many.
    if (c->num_layer_dtypes != c->num_layers) {
      throw InvalidArgument("config.num_layer_dtypes: " + std::to_string(c->num_layer_dtypes) +
                            " entries for " + std::to_string(c->num_layers) +
                            " layers (one per layer, or 0 for a uniform dtype)");
    }
    require(c->layer_dtypes, "config.layer_dtypes (with num_layer_dtypes > 0)");
    out.layer_dtypes.reserve(c->num_layer_dtypes);
    for (std::size_t i = 0; i < c->num_layer_dtypes; ++i)
      out.layer_dtypes.push_back(to_dtype(c->layer_dtypes[i], "config.layer_dtypes"));
  }
  return out;
}

PagedKvCache& cache_of(const kvport_cache* handle) {
  return *get<CacheObject>(handle).cache;
}

// The cache of a handle whose blocks the caller may allocate and release:
// not a hybrid cache's group pool, whose blocks its hybrid tables own.
PagedKvCache& owned_cache_of(const kvport_cache* handle, const char* op) {
  const CacheObject& object = get<CacheObject>(handle);
  if (object.lent)
    throw InvalidArgument(std::string(op) +
                          ": the cache is a hybrid cache's group pool (borrowed): its blocks "
                          "are allocated and released by hybrid block tables");
  return *object.cache;
}
PrefixCache& prefix_of(const kvport_prefix_cache* handle) {
  return *get<PrefixCacheObject>(handle).prefix;
}
BlockTable& table_of(const kvport_block_table* handle) {
  return *get<BlockTableObject>(handle).table;
}

void* raw(DevicePtr p) {
  return p.get();
}

void write_layout(const BlockRegionLayout& l, kvport_region_layout* out) {
  require(out, "out");
  out->data_bytes = l.data_bytes;
  out->data_padding = l.data_padding;
  out->scale_offset = l.scale_offset;
  out->scale_bytes = l.scale_bytes;
  out->scale_padding = l.scale_padding;
  out->total_bytes = l.total_bytes;
}

std::uint32_t* check_lookup_capacity(std::size_t num_tokens, std::size_t block_size,
                                     std::uint32_t* out, std::size_t capacity) {
  const std::size_t most = num_tokens / block_size;
  if (capacity < most)
    throw InvalidArgument("kvport_prefix_cache_lookup: out_capacity " + std::to_string(capacity) +
                          " < num_tokens / block_size = " + std::to_string(most));
  if (most > 0) require(out, "out_blocks");
  return out;
}

}  // namespace

extern "C" {

// ---- version --------------------------------------------------------------------

const char* kvport_version_string(void) {
  return KVPORT_VERSION_STRING;
}

kvport_status kvport_version(uint32_t* major, uint32_t* minor, uint32_t* patch) {
  if (major != nullptr) *major = KVPORT_VERSION_MAJOR;
  if (minor != nullptr) *minor = KVPORT_VERSION_MINOR;
  if (patch != nullptr) *patch = KVPORT_VERSION_PATCH;
  return KVPORT_OK;
}

// ---- backends ------------------------------------------------------------------------

kvport_status kvport_backend_create(const char* name, kvport_backend** out) {
  return guard([&] {
    require(name, "name");
    require(out, "out");
    std::unique_ptr<Backend> backend =
        std::string_view(name) == "default" ? default_backend() : make_backend(name);
    *out =
        make_handle<kvport_backend>(std::make_unique<BackendObject>(std::move(backend)), nullptr);
  });
}

kvport_status kvport_backend_create_on(const char* name, int device, kvport_backend** out) {
  return guard([&] {
    require(name, "name");
    require(out, "out");
    if (std::string_view(name) == "default")
      throw InvalidArgument("kvport_backend_create_on: \"default\" has no device ordinal");
    *out = make_handle<kvport_backend>(std::make_unique<BackendObject>(make_backend(name, device)),
                                       nullptr);
  });
}

kvport_status kvport_backend_destroy(kvport_backend* backend) {
  return guard([&] { retire(backend, Kind::backend); });
}

kvport_status kvport_backend_name(const kvport_backend* backend, const char** out) {
  return guard([&] { put(out, get<BackendObject>(backend).backend->name().c_str(), "out"); });
}

kvport_status kvport_backend_device_count(const kvport_backend* backend, int* out) {
  return guard([&] {
    Backend& b = *get<BackendObject>(backend).backend;
    put(out, b.device_count(), "out");
  });
}

kvport_status kvport_backend_mem_info(const kvport_backend* backend, size_t* free_bytes,
                                      size_t* total_bytes) {
  return guard([&] {
    const MemInfo info = get<BackendObject>(backend).backend->mem_info();
    if (free_bytes != nullptr) *free_bytes = info.free_bytes;
    if (total_bytes != nullptr) *total_bytes = info.total_bytes;
  });
}

kvport_status kvport_backend_synchronize(kvport_backend* backend) {
  return guard([&] {
    Backend& b = *get<BackendObject>(backend).backend;
    b.synchronize(b.default_stream());
  });
}

// ---- streams --------------------------------------------------------------------------

kvport_status kvport_stream_create(kvport_backend* backend, kvport_stream** out) {
  return guard([&] {
    BackendObject& parent = get<BackendObject>(backend);
    require(out, "out");
    auto object = std::make_unique<StreamObject>(parent.backend->create_stream());
    object->backend = parent.backend.get();
    *out = make_handle<kvport_stream>(std::move(object), &parent);
  });
}

kvport_status kvport_stream_destroy(kvport_stream* stream) {
  return guard([&] { retire(stream, Kind::stream); });
}

kvport_status kvport_stream_synchronize(kvport_stream* stream) {
  return guard([&] {
    const StreamObject& object = get<StreamObject>(stream);
    object.backend->synchronize(object.view());
  });
}

// ---- configuration --------------------------------------------------------------------

kvport_status kvport_config_init(kvport_config* config) {
  return guard([&] {
    require(config, "config");
    const KvCacheConfig defaults;
    config->num_layers = defaults.num_layers;
    config->block_size = defaults.block_size;
    config->num_kv_heads = defaults.num_kv_heads;
    config->head_dim_k = defaults.head_dim_k;
    config->head_dim_v = defaults.head_dim_v;
    config->dtype = static_cast<std::int32_t>(defaults.dtype);
    config->layout = static_cast<std::int32_t>(defaults.layout);
    config->layer_dtypes = nullptr;
    config->num_layer_dtypes = 0;
  });
}

kvport_status kvport_config_validate(const kvport_config* config) {
  return guard([&] { to_config(config).validate(); });
}

kvport_status kvport_config_bytes_per_block(const kvport_config* config, size_t* out) {
  return guard([&] {
    const KvCacheConfig c = to_config(config);
    c.validate();
    put(out, c.bytes_per_block(), "out");
  });
}

kvport_status kvport_compute_num_blocks(const kvport_config* config, size_t available_bytes,
                                        size_t* out) {
  return guard([&] {
    put(out, PagedKvCache::compute_num_blocks(to_config(config), available_bytes), "out");
  });
}

const char* kvport_dtype_name(int32_t dtype) {
  if (dtype < 0 || dtype > KVPORT_DTYPE_TURBO8) return nullptr;
  return to_string(static_cast<KvCacheDtype>(dtype)).data();  // literals: NUL-terminated
}

kvport_status kvport_dtype_from_name(const char* name, int32_t* out) {
  return guard([&] {
    require(name, "name");
    const std::optional<KvCacheDtype> d = parse_dtype(name);
    if (!d) throw InvalidArgument(std::string("unknown dtype '") + name + "'");
    put(out, static_cast<std::int32_t>(*d), "out");
  });
}

kvport_status kvport_block_region_layout(int32_t dtype, size_t block_size, size_t num_kv_heads,
                                         size_t head_dim, kvport_region_layout* out) {
  return guard([&] {
    const KvCacheDtype d = to_dtype(dtype, "dtype");
    write_layout(block_region_layout(d, block_size, num_kv_heads, head_dim), out);
  });
}

// ---- caches ---------------------------------------------------------------------------

kvport_status kvport_cache_create(const kvport_config* config, size_t num_blocks,
                                  kvport_backend* backend, kvport_cache** out) {
  return guard([&] {
    KvCacheConfig c = to_config(config);
    BackendObject& parent = get<BackendObject>(backend);
    require(out, "out");
    auto object = std::make_unique<CacheObject>();
    for (const KvCacheDtype d : c.layer_dtypes)
      object->layer_dtypes.push_back(static_cast<std::int32_t>(d));
    object->owned = std::make_unique<PagedKvCache>(std::move(c), num_blocks, *parent.backend);
    object->cache = object->owned.get();
    *out = make_handle<kvport_cache>(std::move(object), &parent);
  });
}

kvport_status kvport_cache_destroy(kvport_cache* cache) {
  return guard([&] { retire(cache, Kind::cache); });
}

kvport_status kvport_cache_config(const kvport_cache* cache, kvport_config* out) {
  return guard([&] {
    const CacheObject& object = get<CacheObject>(cache);
    require(out, "out");
    const KvCacheConfig& c = object.cache->config();
    out->num_layers = c.num_layers;
    out->block_size = c.block_size;
    out->num_kv_heads = c.num_kv_heads;
    out->head_dim_k = c.head_dim_k;
    out->head_dim_v = c.head_dim_v;
    out->dtype = static_cast<std::int32_t>(c.dtype);
    out->layout = static_cast<std::int32_t>(c.layout);
    out->layer_dtypes = object.layer_dtypes.empty() ? nullptr : object.layer_dtypes.data();
    out->num_layer_dtypes = object.layer_dtypes.size();
  });
}

kvport_status kvport_cache_num_blocks(const kvport_cache* cache, size_t* out) {
  return guard([&] { put(out, cache_of(cache).num_blocks(), "out"); });
}

kvport_status kvport_cache_num_free_blocks(const kvport_cache* cache, size_t* out) {
  return guard([&] { put(out, cache_of(cache).num_free_blocks(), "out"); });
}

kvport_status kvport_cache_num_blocks_in_use(const kvport_cache* cache, size_t* out) {
  return guard([&] { put(out, cache_of(cache).num_blocks_in_use(), "out"); });
}

kvport_status kvport_cache_num_layers(const kvport_cache* cache, size_t* out) {
  return guard([&] { put(out, cache_of(cache).num_layers(), "out"); });
}

kvport_status kvport_cache_total_bytes(const kvport_cache* cache, size_t* out) {
  return guard([&] { put(out, cache_of(cache).total_bytes(), "out"); });
}

kvport_status kvport_cache_alloc(kvport_cache* cache, uint32_t* out_block) {
  return guard([&] {
    PagedKvCache& c = owned_cache_of(cache, "kvport_cache_alloc");
    require(out_block, "out_block");
    *out_block = c.alloc_block();
  });
}

kvport_status kvport_cache_try_alloc(kvport_cache* cache, uint32_t* out_block,
                                     bool* out_allocated) {
  return guard([&] {
    PagedKvCache& c = owned_cache_of(cache, "kvport_cache_try_alloc");
    require(out_block, "out_block");
    require(out_allocated, "out_allocated");
    const std::optional<BlockId> b = c.try_alloc_block();
    *out_allocated = b.has_value();
    if (b) *out_block = *b;
  });
}

kvport_status kvport_cache_inc_ref(kvport_cache* cache, uint32_t block) {
  return guard([&] {
    PagedKvCache& c = owned_cache_of(cache, "kvport_cache_inc_ref");
    c.inc_ref(block);
  });
}

kvport_status kvport_cache_dec_ref(kvport_cache* cache, uint32_t block, bool* out_freed) {
  return guard([&] {
    PagedKvCache& c = owned_cache_of(cache, "kvport_cache_dec_ref");
    const bool freed = c.dec_ref(block);
    if (out_freed != nullptr) *out_freed = freed;
  });
}

kvport_status kvport_cache_free(kvport_cache* cache, uint32_t block, bool* out_freed) {
  return guard([&] {
    PagedKvCache& c = owned_cache_of(cache, "kvport_cache_free");
    const bool freed = c.free_block(block);
    if (out_freed != nullptr) *out_freed = freed;
  });
}

kvport_status kvport_cache_free_blocks(kvport_cache* cache, const uint32_t* blocks, size_t count) {
  return guard([&] {
    PagedKvCache& c = owned_cache_of(cache, "kvport_cache_free_blocks");
    const auto ids = span_of(blocks, count, "blocks");
    c.free_blocks(ids);
  });
}

kvport_status kvport_cache_return_evicted_block(kvport_cache* cache, uint32_t block) {
  return guard([&] {
    PagedKvCache& c = owned_cache_of(cache, "kvport_cache_return_evicted_block");
    c.return_evicted_block(block);
  });
}

kvport_status kvport_cache_ref_count(const kvport_cache* cache, uint32_t block, uint32_t* out) {
  return guard([&] {
    const PagedKvCache& c = cache_of(cache);
    put(out, c.ref_count(block), "out");
  });
}

kvport_status kvport_cache_k_ptr(const kvport_cache* cache, size_t layer, uint32_t block,
                                 void** out) {
  return guard([&] {
    const PagedKvCache& c = cache_of(cache);
    put(out, raw(c.k_cache_ptr(layer, block)), "out");
  });
}

kvport_status kvport_cache_v_ptr(const kvport_cache* cache, size_t layer, uint32_t block,
                                 void** out) {
  return guard([&] {
    const PagedKvCache& c = cache_of(cache);
    put(out, raw(c.v_cache_ptr(layer, block)), "out");
  });
}

kvport_status kvport_cache_k_pool_ptr(const kvport_cache* cache, size_t layer, void** out) {
  return guard([&] {
    const PagedKvCache& c = cache_of(cache);
    put(out, raw(c.k_pool_ptr(layer)), "out");
  });
}

kvport_status kvport_cache_v_pool_ptr(const kvport_cache* cache, size_t layer, void** out) {
  return guard([&] {
    const PagedKvCache& c = cache_of(cache);
    put(out, raw(c.v_pool_ptr(layer)), "out");
  });
}

kvport_status kvport_cache_k_block_stride(const kvport_cache* cache, size_t layer, size_t* out) {
  return guard([&] {
    const PagedKvCache& c = cache_of(cache);
    put(out, c.k_block_stride(layer), "out");
  });
}

kvport_status kvport_cache_v_block_stride(const kvport_cache* cache, size_t layer, size_t* out) {
  return guard([&] {
    const PagedKvCache& c = cache_of(cache);
    put(out, c.v_block_stride(layer), "out");
  });
}

kvport_status kvport_cache_k_block_bytes(const kvport_cache* cache, size_t layer, size_t* out) {
  return guard([&] {
    const PagedKvCache& c = cache_of(cache);
    put(out, c.k_block_bytes(layer), "out");
  });
}

kvport_status kvport_cache_v_block_bytes(const kvport_cache* cache, size_t layer, size_t* out) {
  return guard([&] {
    const PagedKvCache& c = cache_of(cache);
    put(out, c.v_block_bytes(layer), "out");
  });
}

kvport_status kvport_cache_k_region_layout(const kvport_cache* cache, size_t layer,
                                           kvport_region_layout* out) {
  return guard([&] {
    const PagedKvCache& c = cache_of(cache);
    write_layout(c.config().k_layout(layer), out);
  });
}

kvport_status kvport_cache_v_region_layout(const kvport_cache* cache, size_t layer,
                                           kvport_region_layout* out) {
  return guard([&] {
    const PagedKvCache& c = cache_of(cache);
    write_layout(c.config().v_layout(layer), out);
  });
}

kvport_status kvport_cache_layer_dtype(const kvport_cache* cache, size_t layer, int32_t* out) {
  return guard([&] {
    const PagedKvCache& c = cache_of(cache);
    put(out, static_cast<std::int32_t>(c.dtype_for_layer(layer)), "out");
  });
}

kvport_status kvport_cache_zero_blocks(kvport_cache* cache, const uint32_t* blocks, size_t count,
                                       kvport_stream* stream) {
  return guard([&] {
    PagedKvCache& c = cache_of(cache);
    const auto ids = span_of(blocks, count, "blocks");
    c.zero_blocks(ids, stream_for(c.backend(), stream));
  });
}

kvport_status kvport_cache_poison_blocks(kvport_cache* cache, const uint32_t* blocks, size_t count,
                                         kvport_stream* stream) {
  return guard([&] {
    PagedKvCache& c = cache_of(cache);
    const auto ids = span_of(blocks, count, "blocks");
    c.poison_blocks(ids, stream_for(c.backend(), stream));
  });
}

kvport_status kvport_cache_zero_block(kvport_cache* cache, uint32_t block, kvport_stream* stream) {
  return kvport_cache_zero_blocks(cache, &block, 1, stream);
}

kvport_status kvport_cache_poison_block(kvport_cache* cache, uint32_t block,
                                        kvport_stream* stream) {
  return kvport_cache_poison_blocks(cache, &block, 1, stream);
}

kvport_status kvport_cache_copy_blocks(kvport_cache* cache, const kvport_block_copy* copies,
                                       size_t count, kvport_stream* stream) {
  return guard([&] {
    PagedKvCache& c = cache_of(cache);
    const auto pairs = span_of(copies, count, "copies");
    std::vector<BlockCopy> converted;
    converted.reserve(pairs.size());
    for (const kvport_block_copy& p : pairs) {
      converted.push_back(BlockCopy{p.src, p.dst});
    }
    c.copy_blocks(converted, stream_for(c.backend(), stream));
  });
}

kvport_status kvport_cache_read_block(const kvport_cache* cache, size_t layer, uint32_t block,
                                      void* k_out, size_t k_bytes, void* v_out, size_t v_bytes,
                                      kvport_stream* stream) {
  return guard([&] {
    const PagedKvCache& c = cache_of(cache);
    if (k_bytes != c.k_block_bytes(layer) || v_bytes != c.v_block_bytes(layer))
      throw InvalidArgument("kvport_cache_read_block: buffers of " + std::to_string(k_bytes) +
                            " / " + std::to_string(v_bytes) + " bytes, the block has " +
                            std::to_string(c.k_block_bytes(layer)) + " / " +
                            std::to_string(c.v_block_bytes(layer)));
    require(k_out, "k_out");
    if (v_bytes > 0) require(v_out, "v_out");
    const PagedKvCache::HostBlock host =
        c.read_block(layer, block, stream_for(c.backend(), stream));
    std::memcpy(k_out, host.k.data(), host.k.size());
    if (!host.v.empty()) std::memcpy(v_out, host.v.data(), host.v.size());
  });
}

kvport_status kvport_cache_write_block(kvport_cache* cache, size_t layer, uint32_t block,
                                       const void* k, size_t k_bytes, const void* v, size_t v_bytes,
                                       kvport_stream* stream) {
  return guard([&] {
    PagedKvCache& c = cache_of(cache);
    require(k, "k");
    if (v_bytes > 0) require(v, "v");
    c.write_block(layer, block, {static_cast<const std::uint8_t*>(k), k_bytes},
                  {static_cast<const std::uint8_t*>(v), v_bytes}, stream_for(c.backend(), stream));
  });
}

kvport_status kvport_cache_synchronize(kvport_cache* cache) {
  return guard([&] { cache_of(cache).synchronize(); });
}

kvport_status kvport_cache_counters_get(const kvport_cache* cache, kvport_cache_counters* out) {
  return guard([&] {
    const KvCacheCounters& k = cache_of(cache).counters();
    require(out, "out");
    out->allocs = k.allocs;
    out->frees = k.frees;
    out->ignored_double_frees = k.ignored_double_frees;
    out->exhaustion_events = k.exhaustion_events;
    out->peak_blocks_in_use = k.peak_blocks_in_use;
  });
}

kvport_status kvport_cache_check_invariants(const kvport_cache* cache,
                                            kvport_invariant_report* report, char* text,
                                            size_t text_size, size_t* text_needed) {
  return guard([&] {
    const PagedKvCache& c = cache_of(cache);
    write_report(c.check_invariants(), report, text, text_size, text_needed);
  });
}

// ---- prefix caches -----------------------------------------------------------------------

kvport_status kvport_prefix_cache_create(kvport_cache* cache, kvport_prefix_cache** out) {
  return guard([&] {
    CacheObject& parent = get<CacheObject>(cache);
    (void)owned_cache_of(cache, "kvport_prefix_cache_create");
    require(out, "out");
    auto object = std::make_unique<PrefixCacheObject>();
    object->prefix = std::make_unique<PrefixCache>(*parent.cache);
    *out = make_handle<kvport_prefix_cache>(std::move(object), &parent);
  });
}

kvport_status kvport_prefix_cache_destroy(kvport_prefix_cache* prefix_cache) {
  return guard([&] { retire(prefix_cache, Kind::prefix_cache); });
}

kvport_status kvport_prefix_cache_lookup(kvport_prefix_cache* prefix_cache, const uint32_t* tokens,
                                         size_t num_tokens, uint64_t extra_key,
                                         uint32_t* out_blocks, size_t out_capacity,
                                         size_t* out_num_blocks, size_t* out_num_tokens) {
  return guard([&] {
    PrefixCache& p = prefix_of(prefix_cache);
    const auto prompt = span_of(tokens, num_tokens, "tokens");
    require(out_num_blocks, "out_num_blocks");
    std::uint32_t* out =
        check_lookup_capacity(num_tokens, p.block_size(), out_blocks, out_capacity);
    const PrefixMatch match = p.lookup(prompt, extra_key);
    if (match.blocks.size() > out_capacity) {  // cannot happen: a match is at most `most` blocks
      p.release_blocks(match.blocks);
      throw std::logic_error("kvport_prefix_cache_lookup: match longer than the prompt");
    }
    std::copy(match.blocks.begin(), match.blocks.end(), out);
    *out_num_blocks = match.blocks.size();
    if (out_num_tokens != nullptr) *out_num_tokens = match.num_tokens;
  });
}

kvport_status kvport_prefix_cache_alloc(kvport_prefix_cache* prefix_cache, uint32_t* out_block) {
  return guard([&] {
    PrefixCache& p = prefix_of(prefix_cache);
    require(out_block, "out_block");
    *out_block = p.alloc_block();
  });
}

kvport_status kvport_prefix_cache_try_alloc(kvport_prefix_cache* prefix_cache, uint32_t* out_block,
                                            bool* out_allocated) {
  return guard([&] {
    PrefixCache& p = prefix_of(prefix_cache);
    require(out_block, "out_block");
    require(out_allocated, "out_allocated");
    const std::optional<BlockId> b = p.try_alloc_block();
    *out_allocated = b.has_value();
    if (b) *out_block = *b;
  });
}

kvport_status kvport_prefix_cache_release(kvport_prefix_cache* prefix_cache, uint32_t block) {
  return guard([&] {
    PrefixCache& p = prefix_of(prefix_cache);
    p.release(block);
  });
}

kvport_status kvport_prefix_cache_release_blocks(kvport_prefix_cache* prefix_cache,
                                                 const uint32_t* blocks, size_t count) {
  return guard([&] {
    PrefixCache& p = prefix_of(prefix_cache);
    const auto ids = span_of(blocks, count, "blocks");
    p.release_blocks(ids);
  });
}

kvport_status kvport_prefix_cache_evict(kvport_prefix_cache* prefix_cache, size_t max_blocks,
                                        size_t* out_evicted) {
  return guard([&] {
    const std::size_t n = prefix_of(prefix_cache).evict(max_blocks);
    if (out_evicted != nullptr) *out_evicted = n;
  });
}

kvport_status kvport_prefix_cache_num_cached_blocks(const kvport_prefix_cache* prefix_cache,
                                                    size_t* out) {
  return guard([&] { put(out, prefix_of(prefix_cache).num_cached_blocks(), "out"); });
}

kvport_status kvport_prefix_cache_num_evictable_blocks(const kvport_prefix_cache* prefix_cache,
                                                       size_t* out) {
  return guard([&] { put(out, prefix_of(prefix_cache).num_evictable_blocks(), "out"); });
}

kvport_status kvport_prefix_cache_num_available_blocks(const kvport_prefix_cache* prefix_cache,
                                                       size_t* out) {
  return guard([&] { put(out, prefix_of(prefix_cache).num_available_blocks(), "out"); });
}

kvport_status kvport_prefix_cache_counters_get(const kvport_prefix_cache* prefix_cache,
                                               kvport_prefix_cache_counters* out) {
  return guard([&] {
    const PrefixCacheCounters& k = prefix_of(prefix_cache).counters();
    require(out, "out");
    out->lookups = k.lookups;
    out->hits = k.hits;
    out->misses = k.misses;
    out->inserts = k.inserts;
    out->evictions = k.evictions;
    out->ignored_releases = k.ignored_releases;
  });
}

kvport_status kvport_prefix_cache_check_invariants(const kvport_prefix_cache* prefix_cache,
                                                   kvport_invariant_report* report, char* text,
                                                   size_t text_size, size_t* text_needed) {
  return guard([&] {
    const PrefixCache& p = prefix_of(prefix_cache);
    write_report(p.check_invariants(), report, text, text_size, text_needed);
  });
}

// ---- block tables ---------------------------------------------------------------------------

kvport_status kvport_block_table_create(kvport_cache* cache, kvport_block_table** out) {
  return guard([&] {
    CacheObject& parent = get<CacheObject>(cache);
    (void)owned_cache_of(cache, "kvport_block_table_create");
    require(out, "out");
    auto object = std::make_unique<BlockTableObject>();
    object->table = std::make_unique<BlockTable>(*parent.cache);
    *out = make_handle<kvport_block_table>(std::move(object), &parent);
  });
}

kvport_status kvport_block_table_create_prefixed(kvport_prefix_cache* prefix_cache,
                                                 uint64_t extra_key, kvport_block_table** out) {
  return guard([&] {
    PrefixCacheObject& parent = get<PrefixCacheObject>(prefix_cache);
    require(out, "out");
    auto object = std::make_unique<BlockTableObject>();
    object->table = std::make_unique<BlockTable>(*parent.prefix, extra_key);
    *out = make_handle<kvport_block_table>(std::move(object), &parent);
  });
}

kvport_status kvport_block_table_destroy(kvport_block_table* table) {
  return guard([&] { retire(table, Kind::block_table); });
}

kvport_status kvport_block_table_reuse_cached_prefix(kvport_block_table* table,
                                                     const uint32_t* prompt, size_t num_tokens,
                                                     kvport_stream* stream,
                                                     size_t* out_hit_tokens) {
  return guard([&] {
    BlockTable& t = table_of(table);
    const auto tokens = span_of(prompt, num_tokens, "prompt");
    require(out_hit_tokens, "out_hit_tokens");
    *out_hit_tokens = stream == nullptr ? t.reuse_cached_prefix(tokens)
                                        : t.reuse_cached_prefix(
                                              tokens, stream_for(t.kv_cache().backend(), stream));
  });
}

kvport_status kvport_block_table_set_prefix_hit_mode(kvport_block_table* table, int32_t mode) {
  return guard([&] {
    BlockTable& t = table_of(table);
    t.set_prefix_hit_mode(to_prefix_hit_mode(mode, "kvport_block_table_set_prefix_hit_mode"));
  });
}

kvport_status kvport_block_table_prefix_hit_mode(const kvport_block_table* table, int32_t* out) {
  return guard([&] { put(out, prefix_hit_mode_value(table_of(table).prefix_hit_mode()), "out"); });
}

kvport_status kvport_block_table_append_tokens(kvport_block_table* table, const uint32_t* tokens,
                                               size_t num_tokens, kvport_stream* stream) {
  return guard([&] {
    BlockTable& t = table_of(table);
    t.append_tokens(span_of(tokens, num_tokens, "tokens"),
                    stream_for(t.kv_cache().backend(), stream));
  });
}

kvport_status kvport_block_table_blocks_needed(const kvport_block_table* table, size_t num_tokens,
                                               size_t* out) {
  return guard([&] { put(out, table_of(table).blocks_needed(num_tokens), "out"); });
}

kvport_status kvport_block_table_fork(const kvport_block_table* table, kvport_block_table** out) {
  return guard([&] {
    BlockTableObject& source = get<BlockTableObject>(table);
    require(out, "out");
    auto object = std::make_unique<BlockTableObject>();
    object->table = std::make_unique<BlockTable>(source.table->fork());
    *out = make_handle<kvport_block_table>(std::move(object), source.parent);
  });
}

kvport_status kvport_block_table_release(kvport_block_table* table) {
  return guard([&] { table_of(table).release(); });
}

kvport_status kvport_block_table_blocks(const kvport_block_table* table,
                                        const uint32_t** out_blocks, size_t* out_count) {
  return guard([&] {
    const std::span<const BlockId> ids = table_of(table).blocks();
    require(out_blocks, "out_blocks");
    require(out_count, "out_count");
    *out_blocks = ids.empty() ? nullptr : ids.data();
    *out_count = ids.size();
  });
}

kvport_status kvport_block_table_num_tokens(const kvport_block_table* table, size_t* out) {
  return guard([&] { put(out, table_of(table).num_tokens(), "out"); });
}

kvport_status kvport_block_table_copy_on_writes(const kvport_block_table* table, uint64_t* out) {
  return guard([&] { put(out, table_of(table).copy_on_writes(), "out"); });
}

// ---- testing -------------------------------------------------------------------------------

kvport_status kvport_testing_inject_async_fault(kvport_backend* backend, kvport_stream* stream) {
  return guard([&] {
    Backend& b = *get<BackendObject>(backend).backend;
    b.inject_async_fault(stream_for(b, stream));
  });
}

kvport_status kvport_testing_fail_with(int32_t status) {
  return guard([&] {
    const std::string what =
        std::string("kvport_testing_fail_with(") + kvport_status_name(status) + ")";
    switch (status) {
      case KVPORT_OK:
        return;
      case KVPORT_ERR_ERROR:
        throw Error(what);
      case KVPORT_ERR_INVALID_ARGUMENT:
        throw InvalidArgument(what);
      case KVPORT_ERR_CACHE_EXHAUSTED:
        throw CacheExhausted("KV cache exhausted: " + what);
      case KVPORT_ERR_OUT_OF_MEMORY:
        throw OutOfMemory("testing", 1, 0);
      case KVPORT_ERR_BACKEND:
        throw BackendError("testing", what, -1, "injected");
      case KVPORT_ERR_DEVICE_LOST:
        throw DeviceLost("testing", what, -1, "injected");
      case KVPORT_ERR_OUT_OF_RANGE:
        throw OutOfRange(what);
      case KVPORT_ERR_INVALID_HANDLE:
      case KVPORT_ERR_HANDLE_IN_USE:
        throw StatusError(static_cast<kvport_status>(status), what);
      case KVPORT_ERR_UNKNOWN:
        throw std::logic_error(what);
    }
    throw InvalidArgument("kvport_testing_fail_with: " + std::to_string(status) +
                          " is not a kvport_status");
  });
}

}  // extern "C"

namespace kvport::capi {

KvCacheConfig config_from_c(const kvport_config* config) {
  return to_config(config);
}

}  // namespace kvport::capi
