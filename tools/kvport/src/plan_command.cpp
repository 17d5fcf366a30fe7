// SPDX-License-Identifier: Apache-2.0
// `kvport plan`: how many blocks and tokens of a model's KV cache fit in a
// memory budget, and what each layer's share of a block is; for a hybrid
// model, how the budget splits between its KV cache groups and what that
// saves against holding every layer as full attention.
#include <fmt/format.h>

#include <CLI/CLI.hpp>
#include <algorithm>
#include <memory>
#include <nlohmann/json.hpp>
#include <ostream>

#include "cache_options.hpp"
#include "command.hpp"
#include "group_plan_report.hpp"
#include "kvport/cli/capacity_plan.hpp"
#include "kvport/cli/flag_values.hpp"
#include "kvport/core/kv_cache_plan.hpp"
#include "kvport/platform/byte_size.hpp"
#include "shape_json.hpp"
#include "text_table.hpp"

namespace kvport::cli {
namespace {

std::string head_dims(const ModelSpec& model) {
  if (model.head_dim_k == model.head_dim_v) return fmt::format("head dim {}", model.head_dim_k);
  return fmt::format("head dim K {} / V {}", model.head_dim_k, model.head_dim_v);
}

std::string layer_label(const LayerRange& range) {
  if (range.first == range.last) return std::to_string(range.first);
  return fmt::format("{}-{}", range.first, range.last);
}

// The context planned when --context is not given: 32768 tokens, or the
// model's max_position_embeddings when that is shorter.
constexpr std::size_t kDefaultContextTokens = 32768;

// A hybrid model's Model line: its layers, groups, and how many layers of
// each kind (the groups' specs are in the table below it).
std::string group_summary(const CacheShapeOptions::Layered& shape,
                          std::span<const KvCacheGroup> groups) {
  return fmt::format("{} layers in {} KV cache group{} ({})", shape.layers.size(), groups.size(),
                     groups.size() == 1 ? "" : "s", layer_kinds_text(shape.layers));
}

class PlanCommand final : public Command {
 public:
  void add_options(CLI::App& app) override {
    app.footer(
        "Examples:\n"
        "  kvport plan --model llama-3-8b --memory 80GiB\n"
        "  kvport plan --model gpt-oss-120b --memory 80GiB --context 131072\n"
        "  kvport plan --hf-config ./config.json --dtype fp8 --layer-dtypes first:bf16,last:bf16\n"
        "  kvport plan --layers 32 --kv-heads 8 --head-dim 128 --memory device --json");
    shape_.add_to(app, "");
    budget_.add_to(app, "device");
    context_option_ = add_text_option(
        app, "--context", context_, "TOKENS",
        "Tokens of the longest request (prompt + output) the per-request figures "
        "assume (default 32768, or the model's max_position_embeddings if shorter)");
    requests_option_ =
        add_text_option(app, "--requests", requests_, "N",
                        "Requests of --context tokens that must fit at once (an error otherwise)");
    app.add_flag("--separate-pools", separate_pools_,
                 "Models with KV cache groups: a pool per group, sized once by the planner "
                 "(default: the attention groups whose pages match share one pool, split into "
                 "groups of equal layer count first, as kvport replay does)");
    app.add_flag("--json", json_, "Print one JSON object instead of the table");
  }

  int execute(std::ostream& out, std::ostream& /*err*/) override {
    const CacheShapeOptions::Layered shape = shape_.resolve_layers();
    const GroupPlanRequest request = plan_request(shape.model);
    const MemoryBudgetSpec spec = budget_.memory_spec();
    std::unique_ptr<Backend> backend;
    if (spec.device || budget_.backend_given()) backend = budget_.make_backend();
    const MemoryBudget budget = budget_.resolve(backend.get());

    if (shape.full_attention) {
      // Today's plan of one cache, and the planner's per-request figures.
      const CapacityPlan plan = make_capacity_plan(shape.full_attention->config, budget.bytes);
      const std::vector<KvCacheGroup> groups = group_layers(shape.layers, shape.block_size);
      const KvCachePlan groups_plan = plan_groups(shape, groups, request, budget.bytes);
      if (json_) {
        print_json(out, *shape.full_attention, budget, backend.get(), plan, groups, groups_plan,
                   request);
      } else {
        print_text(out, *shape.full_attention, budget, plan, groups_plan, request);
      }
      return 0;
    }
    // One pool over the attention groups by default: groups of unequal layer
    // counts are split first, so that their pages match.
    const std::vector<KvCacheGroup> groups =
        planned_groups(shape.layers, shape.block_size, !separate_pools_, shape.layout);
    const KvCachePlan plan = plan_groups(shape, groups, request, budget.bytes, !separate_pools_);
    if (json_) {
      print_hybrid_json(out, shape, budget, backend.get(), groups, plan, request);
    } else {
      print_hybrid_text(out, shape, budget, groups, plan, request);
    }
    return 0;
  }

 private:
  GroupPlanRequest plan_request(const ModelSpec& model) const {
    GroupPlanRequest request;
    if (context_given()) {
      request.context_tokens = parse_positive_count(context_, "--context");
      request.context_origin = "--context";
    } else if (model.max_position_embeddings &&
               *model.max_position_embeddings < kDefaultContextTokens) {
      request.context_tokens = *model.max_position_embeddings;
      request.context_origin = "default: the model's max_position_embeddings";
    } else {
      request.context_tokens = kDefaultContextTokens;
      request.context_origin = "default";
    }
    if (requests_given()) request.requests = parse_positive_count(requests_, "--requests");
    return request;
  }

  static KvCachePlan plan_groups(const CacheShapeOptions::Layered& shape,
                                 std::span<const KvCacheGroup> groups,
                                 const GroupPlanRequest& request, std::size_t budget_bytes,
                                 bool shared_pool = false) {
    KvCachePlanRequest r;
    r.shared_pool = shared_pool;
    r.budget_bytes = budget_bytes;
    r.max_context_tokens = request.context_tokens;
    r.max_requests = request.requests;
    r.step_tokens = request.step_tokens;
    r.state_checkpoints = request.state_checkpoints;
    return plan_kv_cache(groups, shape.block_size, r, shape.layout);
  }

  static std::string context_line(const GroupPlanRequest& request) {
    return fmt::format("Context         {} tokens per request ({}), {} token{} per step\n",
                       request.context_tokens, request.context_origin, request.step_tokens,
                       request.step_tokens == 1 ? "" : "s");
  }

  static void print_hybrid_text(std::ostream& out, const CacheShapeOptions::Layered& shape,
                                const MemoryBudget& budget, std::span<const KvCacheGroup> groups,
                                const KvCachePlan& plan, const GroupPlanRequest& request) {
    out << fmt::format("Model           {} ({}): {}\n", shape.model.name, shape.model.source,
                       group_summary(shape, groups));
    // Layers whose dtype --layer-dtypes set apart from --dtype.
    const std::size_t overrides = static_cast<std::size_t>(
        std::count_if(shape.layers.begin(), shape.layers.end(), [&](const LayerSpec& layer) {
          return layer.has_blocks() && layer.mla_format == MlaFormat::plain &&
                 to_string(layer.dtype) != shape.dtype;
        }));
    std::string dtype = shape.dtype;
    if (overrides > 0) dtype += fmt::format(" ({} layers overridden)", overrides);
    out << fmt::format("Cache           {}, {} tokens per block, {}\n", dtype, shape.block_size,
                       to_string(shape.layout));
    out << fmt::format("Memory budget   {} ({} bytes; {})\n", format_bytes(budget.bytes),
                       budget.bytes, budget.origin);
    out << context_line(request);
    const bool has_state = std::any_of(groups.begin(), groups.end(),
                                       [](const KvCacheGroup& g) { return g.spec.has_state(); });
    if (has_state) {
      out << fmt::format("State           {} checkpoint{} per request beside its working state\n",
                         request.state_checkpoints, request.state_checkpoints == 1 ? "" : "s");
    }
    out << '\n';
    print_group_table(out, groups, plan);
    print_group_totals(out, plan, budget.bytes);
  }

  static void print_hybrid_json(std::ostream& out, const CacheShapeOptions::Layered& shape,
                                const MemoryBudget& budget, const Backend* backend,
                                std::span<const KvCacheGroup> groups, const KvCachePlan& plan,
                                const GroupPlanRequest& request) {
    nlohmann::ordered_json j;
    const ModelSpec& model = shape.model;
    j["model"] = {{"name", model.name},
                  {"source", model.source},
                  {"num_layers", model.num_layers},
                  {"num_kv_heads", model.num_kv_heads},
                  {"head_dim_k", model.head_dim_k},
                  {"head_dim_v", model.head_dim_v},
                  {"max_position_embeddings", max_position_json(model)},
                  {"hybrid", true}};
    j["dtype"] = shape.dtype;
    j["block_size"] = shape.block_size;
    j["layout"] = std::string(to_string(shape.layout));
    j["backend"] = backend != nullptr ? nlohmann::ordered_json(backend->name()) : nullptr;
    j["memory_bytes"] = budget.bytes;
    j["memory_origin"] = budget.origin;
    add_group_plan_json(j, groups, plan, request);
    // Which group each layer is in (null: a layer that keeps nothing).
    std::vector<nlohmann::ordered_json> group_of(shape.layers.size(), nullptr);
    for (std::size_t g = 0; g < groups.size(); ++g) {
      for (std::size_t layer : groups[g].layers)
        group_of[layer] = g;
    }
    nlohmann::ordered_json layers = nlohmann::ordered_json::array();
    for (std::size_t i = 0; i < shape.layers.size(); ++i) {
      const LayerSpec& spec = shape.layers[i];
      layers.push_back({{"layer", i},
                        {"kind", std::string(to_string(spec.kind))},
                        {"group", group_of[i]},
                        {"dtype", layer_dtype_json(spec)}});
    }
    j["layers"] = std::move(layers);
    out << j.dump(2) << '\n';
  }

  static nlohmann::ordered_json max_position_json(const ModelSpec& model) {
    if (!model.max_position_embeddings) return nullptr;
    return *model.max_position_embeddings;
  }

  static nlohmann::ordered_json layer_dtype_json(const LayerSpec& spec) {
    if (!spec.has_blocks()) return nullptr;
    if (spec.kind == LayerKind::mla && spec.mla_format == MlaFormat::fp8_ds_mla) {
      return "fp8_ds_mla";
    }
    return std::string(to_string(spec.dtype));
  }

  bool context_given() const { return context_option_ != nullptr && context_option_->count() > 0; }
  bool requests_given() const {
    return requests_option_ != nullptr && requests_option_->count() > 0;
  }

  // Kept as text and parsed by kvport, as the shared flags are
  // (cache_options.hpp), so that a bad value gets kvport's message.
  static CLI::Option* add_text_option(CLI::App& app, const char* name, std::string& value,
                                      const char* type, const std::string& help) {
    CLI::Option* option = app.add_option(name, value, help);
    option->type_name(type)->multi_option_policy(CLI::MultiOptionPolicy::TakeLast);
    option->group("Plan");
    return option;
  }

 private:
  static void print_text(std::ostream& out, const CacheShapeOptions::Resolved& shape,
                         const MemoryBudget& budget, const CapacityPlan& plan,
                         const KvCachePlan& groups_plan, const GroupPlanRequest& request) {
    const ModelSpec& model = shape.model;
    const KvCacheConfig& config = shape.config;
    out << fmt::format("Model           {} ({}): {} layers, {} KV heads, {}\n", model.name,
                       model.source, model.num_layers, model.num_kv_heads, head_dims(model));
    std::string dtype = std::string(to_string(config.dtype));
    if (const std::size_t overrides = config.num_override_layers(); overrides > 0) {
      dtype += fmt::format(" ({} layers overridden)", overrides);
    }
    out << fmt::format("Cache           {}, {} tokens per block, {}\n", dtype, config.block_size,
                       to_string(config.layout));
    out << fmt::format("Memory budget   {} ({} bytes; {})\n\n", format_bytes(budget.bytes),
                       budget.bytes, budget.origin);

    TextTable table({"Layers", "Dtype", "K data", "K scales", "K bytes", "V data", "V scales",
                     "V bytes", "K+V per layer"},
                    {TextTable::Align::left, TextTable::Align::left});
    for (const LayerRange& range : collapse_layers(plan.layers)) {
      const LayerBlockBytes& b = range.bytes;
      table.add_row({layer_label(range), std::string(to_string(b.dtype)),
                     std::to_string(b.k.data_bytes), std::to_string(b.k.scale_bytes),
                     std::to_string(b.k.total_bytes), std::to_string(b.v.data_bytes),
                     std::to_string(b.v.scale_bytes), std::to_string(b.v.total_bytes),
                     std::to_string(b.total_bytes())});
    }
    table.print(out);
    out << "(bytes of one block; K/V bytes include padding to 16 B)\n\n";

    out << fmt::format("Bytes per block {} ({}: {} layers, K + V)\n", plan.bytes_per_block,
                       format_bytes(plan.bytes_per_block), config.num_layers);
    out << fmt::format("Blocks          {}{}\n", plan.num_blocks,
                       plan.capped_by_block_ids ? " (capped: block ids are 32-bit)" : "");
    out << fmt::format("Token capacity  {} ({} blocks x {} tokens)\n", plan.token_capacity,
                       plan.num_blocks, config.block_size);
    out << fmt::format("Cache bytes     {} ({}; {} of the budget unused)\n", plan.cache_bytes,
                       format_bytes(plan.cache_bytes),
                       format_bytes(plan.memory_bytes - plan.cache_bytes));
    out << context_line(request);
    const GroupPlan& all = groups_plan.groups.front();
    out << fmt::format("Per request     {} ({}) at its peak ({} blocks); {} requests at once\n",
                       groups_plan.peak_bytes_per_request,
                       format_bytes(groups_plan.peak_bytes_per_request),
                       all.peak_blocks_per_request, groups_plan.max_concurrent_requests);
  }

  static void print_json(std::ostream& out, const CacheShapeOptions::Resolved& shape,
                         const MemoryBudget& budget, const Backend* backend,
                         const CapacityPlan& plan, std::span<const KvCacheGroup> groups,
                         const KvCachePlan& groups_plan, const GroupPlanRequest& request) {
    nlohmann::ordered_json j;
    add_shape_fields(j, shape);
    j["model"]["max_position_embeddings"] = max_position_json(shape.model);
    j["model"]["hybrid"] = false;
    j["backend"] = backend != nullptr ? nlohmann::ordered_json(backend->name()) : nullptr;
    j["memory_bytes"] = budget.bytes;
    j["memory_origin"] = budget.origin;
    j["bytes_per_block"] = plan.bytes_per_block;
    j["num_blocks"] = plan.num_blocks;
    j["capped_by_block_ids"] = plan.capped_by_block_ids;
    j["token_capacity"] = plan.token_capacity;
    j["cache_bytes"] = plan.cache_bytes;
    add_group_plan_json(j, groups, groups_plan, request);
    std::size_t k_data = 0, k_scale = 0, v_data = 0, v_scale = 0;
    nlohmann::ordered_json layers = nlohmann::ordered_json::array();
    for (const LayerBlockBytes& b : plan.layers) {
      k_data += b.k.data_bytes;
      k_scale += b.k.scale_bytes;
      v_data += b.v.data_bytes;
      v_scale += b.v.scale_bytes;
      layers.push_back({{"layer", b.layer},
                        {"dtype", std::string(to_string(b.dtype))},
                        {"k_bytes", b.k.total_bytes},
                        {"v_bytes", b.v.total_bytes},
                        {"k_data_bytes", b.k.data_bytes},
                        {"k_scale_bytes", b.k.scale_bytes},
                        {"v_data_bytes", b.v.data_bytes},
                        {"v_scale_bytes", b.v.scale_bytes}});
    }
    // Per block, summed over the layers.
    j["k_data_bytes"] = k_data;
    j["k_scale_bytes"] = k_scale;
    j["v_data_bytes"] = v_data;
    j["v_scale_bytes"] = v_scale;
    j["layers"] = std::move(layers);
    out << j.dump(2) << '\n';
  }

  CacheShapeOptions shape_;
  BudgetOptions budget_;
  std::string context_, requests_;
  CLI::Option* context_option_ = nullptr;
  CLI::Option* requests_option_ = nullptr;
  bool json_ = false;
  bool separate_pools_ = false;
};

}  // namespace

std::unique_ptr<Command> make_plan_command() {
  return std::make_unique<PlanCommand>();
}

}  // namespace kvport::cli
