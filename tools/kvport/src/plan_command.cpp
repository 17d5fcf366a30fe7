// `kvport plan`: how many blocks and tokens of a model's KV cache fit in a
// memory budget, and what each layer's share of a block is.
#include <fmt/format.h>

#include <CLI/CLI.hpp>
#include <memory>
#include <nlohmann/json.hpp>
#include <ostream>

#include "cache_options.hpp"
#include "command.hpp"
#include "kvport/cli/capacity_plan.hpp"
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

class PlanCommand final : public Command {
 public:
  void add_options(CLI::App& app) override {
    app.footer(
        "Examples:\n"
        "  kvport plan --model llama-3-8b --memory 80GiB\n"
        "  kvport plan --hf-config ./config.json --dtype fp8 --layer-dtypes first:bf16,last:bf16\n"
        "  kvport plan --layers 32 --kv-heads 8 --head-dim 128 --memory device --json");
    shape_.add_to(app, "");
    budget_.add_to(app, "device");
    app.add_flag("--json", json_, "Print one JSON object instead of the table");
  }

  int execute(std::ostream& out, std::ostream& /*err*/) override {
    const CacheShapeOptions::Resolved shape = shape_.resolve();
    const MemoryBudgetSpec spec = budget_.memory_spec();
    std::unique_ptr<Backend> backend;
    if (spec.device || budget_.backend_given()) backend = budget_.make_backend();
    const MemoryBudget budget = budget_.resolve(backend.get());
    const CapacityPlan plan = make_capacity_plan(shape.config, budget.bytes);
    if (json_) {
      print_json(out, shape, budget, backend.get(), plan);
    } else {
      print_text(out, shape, budget, plan);
    }
    return 0;
  }

 private:
  static void print_text(std::ostream& out, const CacheShapeOptions::Resolved& shape,
                         const MemoryBudget& budget, const CapacityPlan& plan) {
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
  }

  static void print_json(std::ostream& out, const CacheShapeOptions::Resolved& shape,
                         const MemoryBudget& budget, const Backend* backend,
                         const CapacityPlan& plan) {
    nlohmann::ordered_json j;
    add_shape_fields(j, shape);
    j["backend"] = backend != nullptr ? nlohmann::ordered_json(backend->name()) : nullptr;
    j["memory_bytes"] = budget.bytes;
    j["memory_origin"] = budget.origin;
    j["bytes_per_block"] = plan.bytes_per_block;
    j["num_blocks"] = plan.num_blocks;
    j["capped_by_block_ids"] = plan.capped_by_block_ids;
    j["token_capacity"] = plan.token_capacity;
    j["cache_bytes"] = plan.cache_bytes;
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
  bool json_ = false;
};

}  // namespace

std::unique_ptr<Command> make_plan_command() {
  return std::make_unique<PlanCommand>();
}

}  // namespace kvport::cli
