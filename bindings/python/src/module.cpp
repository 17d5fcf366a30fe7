// SPDX-License-Identifier: Apache-2.0
// kvport._kvport: the Python module over kvport's C++ API (pybind11).
// docs/bindings/python.md is the user's guide; kvport/__init__.py re-exports
// everything here.
//
// One entry calling the parts, each in a source of its own (parts.hpp):
// errors.cpp (the exception types), bind_config.cpp (module functions,
// KvCacheConfig, counters), pool_view.cpp (PoolView and DLPack),
// bind_cache.cpp (PagedKvCache), bind_adopt.cpp (the engine's memory and
// streams), bind_prefix.cpp (PrefixCache,
// BlockTable), bind_events.cpp (KV events: the methods in events.hpp, on
// PrefixCache and HybridKvCache), bind_layer_spec.cpp (layer specs, groups),
// bind_plan.cpp (the planner), bind_hybrid_cache.cpp and
// bind_hybrid_table.cpp (hybrid caches and tables), bind_batch_view.cpp
// (batch metadata for attention kernels), instances.cpp (no
// object made by __new__ alone), fork_guard.cpp (objects made before a
// fork); convert.hpp holds the conversions they share, state.hpp and
// hybrid_state.hpp the owned state and lifetimes. The DLPack deleter drops a shared_ptr and needs
// no GIL, so a consumer may call it from any thread. Hybrid caches follow the
// same rule with their own state.
#include <pybind11/pybind11.h>

#include "fork_guard.hpp"
#include "parts.hpp"
#include "pool_view.hpp"

PYBIND11_MODULE(_kvport, m) {
  m.doc() = "kvport: a paged KV-cache runtime (docs/bindings/python.md)";
  m.attr("__version__") = KVPORT_VERSION;
  kvport::python::install_fork_guard();
  kvport::python::register_exceptions(m);
  kvport::python::bind_config(m);
  kvport::python::register_pool_view(m);
  kvport::python::bind_cache(m);
  kvport::python::bind_adopt(m);
  kvport::python::bind_events(m);
  kvport::python::bind_prefix(m);
  kvport::python::bind_layer_spec(m);
  kvport::python::bind_plan(m);
  kvport::python::bind_hybrid_cache(m);
  kvport::python::bind_hybrid_table(m);
  kvport::python::bind_batch_view(m);
  kvport::python::guard_construction(m);
}
