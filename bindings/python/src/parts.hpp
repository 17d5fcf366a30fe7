// SPDX-License-Identifier: Apache-2.0
// The parts of the kvport._kvport module that live in sources of their own,
// registered from PYBIND11_MODULE (module.cpp), and what they take from each
// other.
#pragma once

#include <pybind11/pybind11.h>

#include <memory>

#include "kvport/core/paged_kv_cache.hpp"
#include "kvport/platform/backend.hpp"

namespace kvport::python {

namespace py = pybind11;

/// kvport.Error and its subclasses, and the translator from C++ errors
/// (errors.cpp).
void register_exceptions(py::module_& m);
/// dtypes(), compiled_backends(), block_region_layout(), BlockRegionLayout,
/// KvCacheConfig, the counters and InvariantReport (bind_config.cpp).
void bind_config(py::module_& m);
/// PagedKvCache (bind_cache.cpp).
void bind_cache(py::module_& m);
/// PagedKvCache.adopt / adopted_pool_bytes / adopted, use_stream /
/// stream_handle, and kvport.stream_handle: the engine's memory and streams
/// (bind_adopt.cpp; after bind_cache).
void bind_adopt(py::module_& m);
/// PrefixMatch, PrefixCache, BlockTable (bind_prefix.cpp).
void bind_prefix(py::module_& m);

/// EventPublisherStats (bind_events.cpp; the events methods of PrefixCache
/// and HybridKvCache are in events.hpp).
void bind_events(py::module_& m);

/// NULL_BLOCK, StateTensor, LayerSpec, KvCacheGroup, group_layers
/// (bind_layer_spec.cpp).
void bind_layer_spec(py::module_& m);
/// GroupPlan, KvCachePlan, plan_kv_cache (bind_plan.cpp).
void bind_plan(py::module_& m);
/// HybridHitCounters, HybridKvCache (bind_hybrid_cache.cpp; the state in
/// hybrid_state.hpp).
void bind_hybrid_cache(py::module_& m);
/// GroupNeed, HybridBlockTable (bind_hybrid_table.cpp).
void bind_hybrid_table(py::module_& m);
// Batch metadata for attention kernels (bind_batch_view.cpp).
void bind_batch_view(py::module_& m);

/// Makes `Class.__new__(Class)` without `Class(...)` a TypeError for every
/// class registered in `m` so far (instances.cpp); called last.
void guard_construction(py::module_& m);

/// A kvport.PagedKvCache over `pool`, a hybrid cache's group pool
/// (bind_cache.cpp): pointers, strides, views, read/write and checks work on it;
/// allocation, refcounts and prefix caches or block tables over it raise
/// InvalidArgument (its blocks belong to the hybrid tables). It holds
/// `lender`, which keeps the pool (and `backend`) alive.
py::object borrowed_cache(std::shared_ptr<const void> lender, Backend& backend, int device,
                          PagedKvCache& pool);

}  // namespace kvport::python
