// SPDX-License-Identifier: Apache-2.0
// The KV cache groups of a plan (kv_cache_plan.hpp) as `kvport plan` reports
// them: one table row or JSON object per group, and the per-request totals
// against holding every layer as full attention.
#pragma once

#include <cstddef>
#include <iosfwd>
#include <nlohmann/json.hpp>
#include <span>
#include <string>

#include "kvport/core/kv_cache_plan.hpp"
#include "kvport/core/layer_spec.hpp"

namespace kvport::cli {

/// What the plan was asked for, as the report states it.
struct GroupPlanRequest {
  std::size_t context_tokens = 0;
  std::string context_origin;  ///< "--context", "default", ...
  std::size_t requests = 0;    ///< --requests; 0: not given
  std::size_t step_tokens = 1;
  std::size_t state_checkpoints = 1;
};

/// "18: 0,2,4,...": the count, then the indices as runs ("0-4,6-10") cut at
/// `max_bytes` with ",...".
std::string layer_list_text(std::span<const std::size_t> layers, std::size_t max_bytes = 24);

/// One row per group: layers, kind (LayerSpec::describe), bytes per token
/// and per request, block bytes, peak blocks per request, blocks, pool bytes.
void print_group_table(std::ostream& out, std::span<const KvCacheGroup> groups,
                       const KvCachePlan& plan);

/// The lines after the table: peak bytes per request, the same with every
/// layer as full attention and in one shared pool, requests at once, total
/// bytes of `budget_bytes`.
void print_group_totals(std::ostream& out, const KvCachePlan& plan, std::size_t budget_bytes);

/// One object per group: "group", "kind", "describe", "num_layers",
/// "layers", "spec" (the kind's fields), "block_size", "bytes_per_token",
/// "bytes_per_request", "bytes_per_block", "peak_blocks_per_request",
/// "peak_bytes_per_request", "num_blocks", "bytes".
nlohmann::ordered_json group_plans_json(std::span<const KvCacheGroup> groups,
                                        const KvCachePlan& plan);

/// Sets the request's fields ("context_tokens", "context_origin", "requests",
/// "step_tokens", "state_checkpoints") and the plan's totals
/// ("total_bytes", "max_concurrent_requests", "peak_bytes_per_request",
/// "all_full_peak_bytes_per_request", "ratio_to_all_full",
/// "shared_pool_peak_bytes_per_request", "groups") on `j`.
void add_group_plan_json(nlohmann::ordered_json& j, std::span<const KvCacheGroup> groups,
                         const KvCachePlan& plan, const GroupPlanRequest& request);

}  // namespace kvport::cli
