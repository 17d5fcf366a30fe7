// SPDX-License-Identifier: Apache-2.0
// The planner: GroupPlan, KvCachePlan and plan_kv_cache (kvport._kvport).
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <cstddef>
#include <sstream>
#include <vector>

#include "convert.hpp"
#include "kvport/core/kv_cache_plan.hpp"
#include "kvport/core/layer_spec.hpp"
#include "parts.hpp"

namespace kvport::python {

void bind_plan(py::module_& m) {
  // ---- the planner --------------------------------------------------------------------
  py::class_<GroupPlan>(m, "GroupPlan", "One group's share of a plan.")
      .def_readonly("spec", &GroupPlan::spec)
      .def_readonly("num_layers", &GroupPlan::num_layers)
      .def_readonly("bytes_per_block", &GroupPlan::bytes_per_block)
      .def_readonly("bytes_per_token", &GroupPlan::bytes_per_token)
      .def_readonly("bytes_per_request", &GroupPlan::bytes_per_request)
      .def_readonly("peak_blocks_per_request", &GroupPlan::peak_blocks_per_request)
      .def_readonly("num_blocks", &GroupPlan::num_blocks)
      .def_readonly("bytes", &GroupPlan::bytes)
      .def_readonly("shared", &GroupPlan::shared,
                    "Whether the group draws from the plan's shared pool.")
      .def("__repr__", [](const GroupPlan& g) {
        std::ostringstream s;
        s << "GroupPlan(" << g.spec.describe() << " x " << g.num_layers
          << ", num_blocks=" << g.num_blocks
          << ", peak_blocks_per_request=" << g.peak_blocks_per_request << ", bytes=" << g.bytes
          << ")";
        return s.str();
      });
  py::class_<KvCachePlan>(m, "KvCachePlan",
                          "How a memory budget is split between a model's groups; pass it to "
                          "HybridKvCache as blocks_per_group.")
      .def_readonly("block_size", &KvCachePlan::block_size)
      .def_readonly("groups", &KvCachePlan::groups)
      .def_readonly("total_bytes", &KvCachePlan::total_bytes)
      .def_readonly("max_concurrent_requests", &KvCachePlan::max_concurrent_requests)
      .def_readonly("peak_bytes_per_request", &KvCachePlan::peak_bytes_per_request)
      .def_readonly("all_full_peak_bytes_per_request",
                    &KvCachePlan::all_full_peak_bytes_per_request)
      .def_readonly("shared_pool_peak_bytes_per_request",
                    &KvCachePlan::shared_pool_peak_bytes_per_request)
      .def_readonly("shared_blocks", &KvCachePlan::shared_blocks,
                    "Blocks of the pool the shared groups draw from (0: none).")
      .def_readonly("max_context_tokens", &KvCachePlan::max_context_tokens,
                    "The context the plan was made for.")
      .def_property_readonly("ratio_to_all_full", &KvCachePlan::ratio_to_all_full)
      .def_property_readonly("blocks_per_group",
                             [](const KvCachePlan& p) {
                               std::vector<std::size_t> out;
                               for (const GroupPlan& g : p.groups)
                                 out.push_back(g.num_blocks);
                               return out;
                             })
      .def("__repr__", [](const KvCachePlan& p) {
        std::ostringstream s;
        s << "KvCachePlan(block_size=" << p.block_size << ", groups=" << p.groups.size()
          << ", total_bytes=" << p.total_bytes
          << ", max_concurrent_requests=" << p.max_concurrent_requests
          << ", ratio_to_all_full=" << p.ratio_to_all_full() << ")";
        return s.str();
      });
  m.def(
      "plan_kv_cache",
      [](const std::vector<LayerSpec>& layers, std::size_t block_size, std::size_t budget_bytes,
         std::size_t max_context_tokens, std::size_t max_requests, std::size_t step_tokens,
         std::size_t state_checkpoints, bool shared_pool) {
        KvCachePlanRequest r;
        r.budget_bytes = budget_bytes;
        r.max_context_tokens = max_context_tokens;
        r.max_requests = max_requests;
        r.step_tokens = step_tokens;
        r.state_checkpoints = state_checkpoints;
        r.shared_pool = shared_pool;
        return plan_kv_cache(planned_groups(layers, block_size, shared_pool), block_size, r);
      },
      py::arg("layers"), py::arg("block_size"), py::arg("budget_bytes"),
      py::arg("max_context_tokens"), py::kw_only(), py::arg("max_requests") = 0,
      py::arg("step_tokens") = 1, py::arg("state_checkpoints") = 1, py::arg("shared_pool") = false,
      "Splits budget_bytes between the groups of `layers` in the ratio of their peak need per "
      "request of max_context_tokens (layer-major pools). shared_pool=True: the attention "
      "groups whose pages match (split into groups of equal layer count first) share one pool "
      "of shared_blocks blocks, and memory moves between them at run time.");
}

}  // namespace kvport::python
