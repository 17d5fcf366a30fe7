// SPDX-License-Identifier: Apache-2.0
// HybridHitCounters and HybridKvCache (kvport._kvport): one pool and prefix
// cache per KV cache group, with DLPack views per model layer.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <cstddef>
#include <optional>
#include <sstream>
#include <string>
#include <vector>

#include "events.hpp"
#include "hybrid_state.hpp"
#include "kvport/core/shared_block_pool.hpp"
#include "parts.hpp"

namespace kvport::python {

void bind_hybrid_cache(py::module_& m) {
  // ---- HybridKvCache --------------------------------------------------------------------
  py::class_<HybridHitCounters>(m, "HybridHitCounters")
      .def_readonly("lookups", &HybridHitCounters::lookups)
      .def_readonly("lookup_tokens", &HybridHitCounters::lookup_tokens)
      .def_readonly("hit_tokens", &HybridHitCounters::hit_tokens)
      .def_readonly("state_checkpoints", &HybridHitCounters::state_checkpoints)
      .def_property_readonly("hit_rate", &HybridHitCounters::hit_rate)
      .def("__repr__", [](const HybridHitCounters& c) {
        std::ostringstream s;
        s << "HybridHitCounters(lookups=" << c.lookups << ", lookup_tokens=" << c.lookup_tokens
          << ", hit_tokens=" << c.hit_tokens << ", state_checkpoints=" << c.state_checkpoints
          << ")";
        return s.str();
      });

  py::class_<PyHybridCache> hybrid_cache(m, "HybridKvCache",
                                         "A model's KV cache as KV cache groups: one block pool "
                                         "and one prefix cache per group. A context manager.");
  hybrid_cache
      .def(py::init<const std::vector<py::object>&, const py::object&, std::optional<std::size_t>,
                    const std::string&, int, std::size_t, std::optional<bool>>(),
           py::arg("layers"), py::arg("blocks_per_group"), py::kw_only(),
           py::arg("block_size") = py::none(), py::arg("backend") = "host", py::arg("device") = 0,
           py::arg("state_checkpoint_interval") = 1, py::arg("trace") = py::none(),
           "layers: one LayerSpec per model layer. blocks_per_group: one count per group (in "
           "group order) or a KvCachePlan of the same layers. block_size: 16, or the plan's.")
      .def("__enter__", [](const py::object& self) { return self; })
      .def("__exit__", [](PyHybridCache& c, const py::args&) { c.close(); })
      .def("close", &PyHybridCache::close,
           "Detaches this object; the pools are freed once no table, group pool or view uses "
           "them.")
      .def_property_readonly("closed", &PyHybridCache::closed)
      .def("__repr__", &PyHybridCache::repr)
      .def_property_readonly("num_layers",
                             [](const PyHybridCache& c) { return c.cache().num_layers(); })
      .def_property_readonly("num_groups",
                             [](const PyHybridCache& c) { return c.cache().num_groups(); })
      .def_property_readonly("block_size",
                             [](const PyHybridCache& c) { return c.cache().block_size(); })
      .def_property_readonly(
          "state_checkpoint_interval",
          [](const PyHybridCache& c) { return c.cache().config().state_checkpoint_interval; })
      .def_property_readonly("total_bytes",
                             [](const PyHybridCache& c) { return c.cache().total_bytes(); })
      .def_property_readonly(
          "shared_pool_blocks",
          [](const PyHybridCache& c) {
            const SharedBlockPool* pool = c.cache().shared_pool();
            return pool != nullptr ? pool->num_blocks() : std::size_t{0};
          },
          "Blocks of the pool the attention groups share (0: a pool per group).")
      .def(
          "in_shared_pool",
          [](const PyHybridCache& c, IndexArg g) { return c.cache().in_shared_pool(g); },
          py::arg("group"), "Whether group g draws from the shared pool.")
      .def_property_readonly("backend",
                             [](const PyHybridCache& c) { return c.state()->backend->name(); })
      .def_property_readonly("layers",
                             [](const PyHybridCache& c) { return c.cache().config().layers; })
      .def_property_readonly("groups",
                             [](const PyHybridCache& c) {
                               std::vector<KvCacheGroup> out;
                               for (std::size_t g = 0; g < c.cache().num_groups(); ++g)
                                 out.push_back(c.cache().group(g));
                               return out;
                             })
      .def(
          "group", [](const PyHybridCache& c, IndexArg g) { return c.cache().group(g); },
          py::arg("group"))
      .def(
          "locate",
          [](const PyHybridCache& c, IndexArg layer) -> std::optional<py::tuple> {
            const std::optional<LayerLocation> at = c.cache().locate(layer);
            if (!at) return std::nullopt;
            return py::make_tuple(at->group, at->index);
          },
          py::arg("layer"),
          "(group, index inside the group's pool) of model layer `layer`; None for a layer "
          "without KV.")
      .def("group_pool", &PyHybridCache::group_pool, py::arg("group"),
           "The group's pool as a PagedKvCache (borrowed): config, pointers, strides, k_pool / "
           "v_pool views, read_block / write_block. Allocation on it raises InvalidArgument: "
           "its blocks belong to the HybridBlockTables.")
      .def(
          "blocks_in_use",
          [](const PyHybridCache& c, IndexArg g) { return c.cache().blocks_in_use(g); },
          py::arg("group"), "Blocks (slots) the group holds for sequences.")
      .def(
          "k_pool",
          [](const PyHybridCache& c, IndexArg layer, bool raw) {
            return c.attention_view(layer, true, raw);
          },
          py::arg("layer"), py::kw_only(), py::arg("raw") = false,
          "Model layer `layer`'s K pool (an attention layer), as PagedKvCache.k_pool.")
      .def(
          "v_pool",
          [](const PyHybridCache& c, IndexArg layer, bool raw) {
            return c.attention_view(layer, false, raw);
          },
          py::arg("layer"), py::kw_only(), py::arg("raw") = false)
      .def("latent_pool", &PyHybridCache::latent_view, py::arg("layer"), py::kw_only(),
           py::arg("raw") = false,
           "An MLA layer's latents: [num_blocks, block_size, kv_lora_rank + rope_dim] of the "
           "dtype (fp8_ds_mla: [num_blocks, block_size, 656] uint8).")
      .def("state_pool", &PyHybridCache::state_view, py::arg("layer"), py::arg("tensor"),
           py::kw_only(), py::arg("raw") = false,
           "A state layer's tensor (by name or index) of every slot: [num_slots, *shape], at "
           "its offset inside the slot, with the slot stride. Slots are "
           "HybridBlockTable.state_slot values.")
      .def("views", &PyHybridCache::views, py::arg("layer"), py::kw_only(), py::arg("raw") = false,
           "Every view of model layer `layer`: {'k', 'v'}, {'latent'}, one per state tensor "
           "name, or {} for a layer without KV.")
      .def_property_readonly("hit_counters",
                             [](const PyHybridCache& c) { return c.cache().hit_counters(); })
      .def("check_invariants", [](const PyHybridCache& c) { return c.cache().check_invariants(); })
      .def("group_invariants",
           [](const PyHybridCache& c) { return c.cache().check_group_invariants(); })
      .def("synchronize", [](const PyHybridCache& c) { c.cache().synchronize(); });
  // KV events: every group, with its group_idx and spec kind, medium "GPU".
  def_events<PyHybridCache>(
      hybrid_cache,
      [](const PyHybridCache& self) {
        HybridState& state = *self.state();
        if (state.borrowed()) {
          throw InvalidArgument(
              "HybridKvCache events: this is the one-group view of a prefix cache "
              "(PrefixCache.as_groups()), whose events are the prefix cache's: use its "
              "enable_events");
        }
        HybridKvCache& cache = *state.cache;
        return EventsTarget{&state.publisher,
                            [&cache](CacheEventSink* sink) { cache.set_event_sink(sink); },
                            [&cache](CacheEventSink& sink) { cache.snapshot(sink); },
                            [&cache](CacheEventSink& sink) {
                              for (std::size_t g = 0; g < cache.num_groups(); ++g)
                                sink.cleared(cache.group_event_source(g, Medium::gpu));
                            }};
      },
      "HybridKvCache");
}

}  // namespace kvport::python
