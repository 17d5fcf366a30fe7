// SPDX-License-Identifier: Apache-2.0
#include "group_plan_report.hpp"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <limits>
#include <ostream>

#include "kvport/platform/byte_size.hpp"
#include "kvport/platform/size_math.hpp"
#include "text_table.hpp"

namespace kvport::cli {
namespace {

using nlohmann::ordered_json;

std::size_t peak_bytes(const GroupPlan& g) {
  return saturating_mul(g.peak_blocks_per_request, g.bytes_per_block);
}

// A state group's pool keeps one request's state per block.
std::size_t group_block_size(const GroupPlan& g, const KvCachePlan& plan) {
  return g.spec.has_state() ? 1 : plan.block_size;
}

ordered_json spec_json(const LayerSpec& spec) {
  ordered_json j;
  switch (spec.kind) {
    case LayerKind::full_attention:
    case LayerKind::sliding_window:
    case LayerKind::chunked_local:
      j["num_kv_heads"] = spec.num_kv_heads;
      j["head_dim_k"] = spec.head_dim_k;
      j["head_dim_v"] = spec.head_dim_v;
      j["dtype"] = std::string(to_string(spec.dtype));
      if (spec.kind == LayerKind::sliding_window) j["window"] = spec.window;
      if (spec.kind == LayerKind::chunked_local) j["chunk"] = spec.chunk;
      break;
    case LayerKind::mla:
      j["kv_lora_rank"] = spec.kv_lora_rank;
      j["rope_dim"] = spec.rope_dim;
      j["mla_format"] = std::string(to_string(spec.mla_format));
      j["dtype"] = spec.mla_format == MlaFormat::fp8_ds_mla ? std::string("fp8_ds_mla")
                                                            : std::string(to_string(spec.dtype));
      break;
    case LayerKind::state: {
      ordered_json tensors = ordered_json::array();
      for (const StateTensor& t : spec.state) {
        tensors.push_back({{"name", t.name},
                           {"shape", t.shape},
                           {"dtype", std::string(to_string(t.dtype))},
                           {"bytes", t.bytes()}});
      }
      j["state"] = std::move(tensors);
      j["state_bytes"] = spec.state_bytes();
      break;
    }
    case LayerKind::none:
      break;
  }
  return j;
}

std::string or_dash(std::size_t value) {
  return value == 0 ? std::string("-") : std::to_string(value);
}

}  // namespace

std::string layer_list_text(std::span<const std::size_t> layers, std::size_t max_bytes) {
  std::string list;
  for (std::size_t i = 0; i < layers.size();) {
    std::size_t j = i;
    while (j + 1 < layers.size() && layers[j + 1] == layers[j] + 1)
      ++j;
    const std::string run =
        j == i ? std::to_string(layers[i]) : fmt::format("{}-{}", layers[i], layers[j]);
    const std::string piece = (list.empty() ? "" : ",") + run;
    if (list.size() + piece.size() > max_bytes) {
      list += ",...";
      break;
    }
    list += piece;
    i = j + 1;
  }
  return fmt::format("{}: {}", layers.size(), list);
}

void print_group_table(std::ostream& out, std::span<const KvCacheGroup> groups,
                       const KvCachePlan& plan) {
  TextTable table({"Group", "Layers", "Kind", "Per token", "Per request", "Block bytes",
                   "Peak blocks", "Peak bytes", "Blocks", "Pool bytes"},
                  {TextTable::Align::left, TextTable::Align::left, TextTable::Align::left});
  for (std::size_t i = 0; i < plan.groups.size(); ++i) {
    const GroupPlan& g = plan.groups[i];
    table.add_row({std::to_string(i), layer_list_text(groups[i].layers), g.spec.describe(),
                   or_dash(g.bytes_per_token), or_dash(g.bytes_per_request),
                   std::to_string(g.bytes_per_block), std::to_string(g.peak_blocks_per_request),
                   std::to_string(peak_bytes(g)), std::to_string(g.num_blocks),
                   g.shared ? std::string("shared") : std::to_string(g.bytes)});
  }
  table.print(out);
  out << "(bytes of all the group's layers; Peak: what one request holds at its longest)\n";
  const bool has_state = std::any_of(plan.groups.begin(), plan.groups.end(),
                                     [](const GroupPlan& g) { return g.spec.has_state(); });
  if (has_state) {
    out << "(a state group's block is one request's state, its Per request bytes; the peak holds "
           "the working state and its checkpoints)\n";
  }
  out << '\n';
}

void print_group_totals(std::ostream& out, const KvCachePlan& plan, std::size_t budget_bytes) {
  out << fmt::format("Per request     {} ({}) at its peak\n", plan.peak_bytes_per_request,
                     format_bytes(plan.peak_bytes_per_request));
  out << fmt::format(
      "All full        {} ({}) with every sliding-window and chunked layer held as full "
      "attention: ratio {:.3f}\n",
      plan.all_full_peak_bytes_per_request, format_bytes(plan.all_full_peak_bytes_per_request),
      plan.ratio_to_all_full());
  out << fmt::format("Shared pool     {} ({}) in one pool of pages padded to the largest group's\n",
                     plan.shared_pool_peak_bytes_per_request,
                     format_bytes(plan.shared_pool_peak_bytes_per_request));
  if (plan.shared_blocks != 0) {
    std::vector<std::size_t> members;
    for (std::size_t i = 0; i < plan.groups.size(); ++i)
      if (plan.groups[i].shared) members.push_back(i);
    out << fmt::format(
        "One pool        {} blocks ({}) shared by groups {}: memory moves between them as "
        "requests need it (--separate-pools: a pool per group)\n",
        plan.shared_blocks, format_bytes(plan.shared_bytes), fmt::join(members, ", "));
  }
  out << fmt::format("Requests        {} at once\n", plan.max_concurrent_requests);
  out << fmt::format("Cache bytes     {} ({}; {} of the budget unused)\n", plan.total_bytes,
                     format_bytes(plan.total_bytes),
                     format_bytes(budget_bytes - std::min(budget_bytes, plan.total_bytes)));
}

ordered_json group_plans_json(std::span<const KvCacheGroup> groups, const KvCachePlan& plan) {
  ordered_json out = ordered_json::array();
  for (std::size_t i = 0; i < plan.groups.size(); ++i) {
    const GroupPlan& g = plan.groups[i];
    out.push_back({{"group", i},
                   {"kind", std::string(to_string(g.spec.kind))},
                   {"describe", g.spec.describe()},
                   {"num_layers", g.num_layers},
                   {"layers", groups[i].layers},
                   {"spec", spec_json(g.spec)},
                   {"block_size", group_block_size(g, plan)},
                   {"bytes_per_token", g.bytes_per_token},
                   {"bytes_per_request", g.bytes_per_request},
                   {"bytes_per_block", g.bytes_per_block},
                   {"peak_blocks_per_request", g.peak_blocks_per_request},
                   {"peak_bytes_per_request", peak_bytes(g)},
                   {"num_blocks", g.num_blocks},
                   {"bytes", g.bytes},
                   {"shared", g.shared}});
  }
  return out;
}

void add_group_plan_json(ordered_json& j, std::span<const KvCacheGroup> groups,
                         const KvCachePlan& plan, const GroupPlanRequest& request) {
  j["context_tokens"] = request.context_tokens;
  j["context_origin"] = request.context_origin;
  j["requests"] = request.requests == 0 ? ordered_json(nullptr) : ordered_json(request.requests);
  j["step_tokens"] = request.step_tokens;
  j["state_checkpoints"] = request.state_checkpoints;
  j["total_bytes"] = plan.total_bytes;
  j["max_concurrent_requests"] = plan.max_concurrent_requests;
  j["peak_bytes_per_request"] = plan.peak_bytes_per_request;
  j["all_full_peak_bytes_per_request"] = plan.all_full_peak_bytes_per_request;
  j["ratio_to_all_full"] = plan.ratio_to_all_full();
  j["shared_pool_peak_bytes_per_request"] = plan.shared_pool_peak_bytes_per_request;
  j["shared_pool"] = plan.shared_blocks != 0;
  j["shared_pool_blocks"] = plan.shared_blocks;
  j["shared_pool_bytes"] = plan.shared_bytes;
  j["groups"] = group_plans_json(groups, plan);
}

}  // namespace kvport::cli
