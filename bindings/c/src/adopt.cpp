// SPDX-License-Identifier: Apache-2.0
// The C ABI's seams for an engine: its own streams (kvport_stream_wrap) and
// its own memory (kvport_cache_create_adopted).
#include <memory>
#include <string>
#include <vector>

#include "arguments.hpp"
#include "handles.hpp"
#include "kvport/kvport.h"
#include "status.hpp"

using namespace kvport;
using namespace kvport::capi;

extern "C" {

kvport_status kvport_stream_wrap(kvport_backend* backend, void* vendor_stream,
                                 kvport_stream** out) {
  return guard([&] {
    BackendObject& parent = get<BackendObject>(backend);
    require(out, "out");
    auto object = std::make_unique<StreamObject>(parent.backend->wrap_stream(vendor_stream));
    object->backend = parent.backend.get();
    *out = make_handle<kvport_stream>(std::move(object), &parent);
  });
}

kvport_status kvport_stream_release(kvport_stream* stream) {
  return guard([&] {
    if (get<StreamObject>(stream).stream) {
      throw InvalidArgument(
          "kvport_stream_release: the stream is kvport's own, not a wrap (destroy it with "
          "kvport_stream_destroy)");
    }
    retire(stream, Kind::stream);  // WrappedStream's destructor: forgets, never destroys
  });
}

kvport_status kvport_stream_vendor_handle(kvport_backend* backend, kvport_stream* stream,
                                          void** out) {
  return guard([&] {
    Backend& b = *get<BackendObject>(backend).backend;
    require(out, "out");
    *out = b.vendor_stream(stream_for(b, stream));
  });
}

kvport_status kvport_cache_adopted_pool_bytes(const kvport_config* config, size_t num_blocks,
                                              size_t* out_bytes, size_t capacity,
                                              size_t* out_count) {
  return guard([&] {
    const KvCacheConfig c = config_from_c(config);
    const std::vector<std::size_t> bytes = PagedKvCache::adopted_pool_bytes(c, num_blocks);
    if (out_count != nullptr) *out_count = bytes.size();
    if (capacity == 0 && out_bytes == nullptr) return;
    if (capacity < bytes.size()) {
      throw InvalidArgument("kvport_cache_adopted_pool_bytes: capacity " +
                            std::to_string(capacity) + " < " + std::to_string(bytes.size()) +
                            " pools");
    }
    require(out_bytes, "out_bytes");
    for (std::size_t i = 0; i < bytes.size(); ++i)
      out_bytes[i] = bytes[i];
  });
}

kvport_status kvport_cache_create_adopted(const kvport_config* config, size_t num_blocks,
                                          kvport_backend* backend, const kvport_pool* pools,
                                          size_t num_pools, kvport_cache** out) {
  return guard([&] {
    KvCacheConfig c = config_from_c(config);
    BackendObject& parent = get<BackendObject>(backend);
    require(out, "out");
    if (num_pools > 0) require(pools, "pools");
    std::vector<AdoptedPool> adopted;
    adopted.reserve(num_pools);
    for (std::size_t i = 0; i < num_pools; ++i)
      adopted.push_back(AdoptedPool{DevicePtr::from(pools[i].base), pools[i].bytes});
    auto object = std::make_unique<CacheObject>();
    for (const KvCacheDtype d : c.layer_dtypes)
      object->layer_dtypes.push_back(static_cast<std::int32_t>(d));
    object->owned =
        std::make_unique<PagedKvCache>(std::move(c), num_blocks, *parent.backend, adopted);
    object->cache = object->owned.get();
    *out = make_handle<kvport_cache>(std::move(object), &parent);
  });
}

kvport_status kvport_cache_is_adopted(const kvport_cache* cache, bool* out) {
  return guard([&] { put(out, get<CacheObject>(cache).cache->adopted(), "out"); });
}

}  // extern "C"
