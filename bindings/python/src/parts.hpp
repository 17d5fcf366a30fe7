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

/// LayerSpec, StateTensor, KvCacheGroup, plan_kv_cache, HybridKvCache,
/// HybridBlockTable (hybrid.cpp).
void register_hybrid(py::module_& m);

/// A kvport.PagedKvCache over `pool`, a hybrid cache's group pool
/// (module.cpp): pointers, strides, views, read/write and checks work on it;
/// allocation, refcounts and prefix caches or block tables over it raise
/// InvalidArgument (its blocks belong to the hybrid tables). It holds
/// `lender`, which keeps the pool (and `backend`) alive.
py::object borrowed_cache(std::shared_ptr<const void> lender, Backend& backend, int device,
                          PagedKvCache& pool);

}  // namespace kvport::python
