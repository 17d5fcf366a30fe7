#include "cache_options.hpp"

#include <fmt/format.h>

#include <CLI/CLI.hpp>

#include "kvport/cli/flag_values.hpp"
#include "kvport/cli/layer_dtypes.hpp"
#include "kvport/platform/error.hpp"
#include "kvport/platform/registry.hpp"

namespace kvport::cli {
namespace {

CLI::Option* add_text(CLI::App& app, const char* name, TextFlag& flag, const char* type,
                      const std::string& help) {
  flag.option = app.add_option(name, flag.value, help);
  // Repeating a flag overrides it, so that scripts can append to a command line.
  flag.option->type_name(type)->multi_option_policy(CLI::MultiOptionPolicy::TakeLast);
  return flag.option;
}

std::optional<std::size_t> count_flag(const TextFlag& flag, std::string_view name) {
  if (!flag.given()) return std::nullopt;
  return parse_positive_count(flag.value, name);
}

}  // namespace

bool TextFlag::given() const {
  return option != nullptr && option->count() > 0;
}

void CacheShapeOptions::add_to(CLI::App& app, std::string_view default_model) {
  default_model_ = std::string(default_model);
  const std::string model_help =
      default_model.empty()
          ? std::string(
                "Built-in model preset (llama-3-8b, llama-3-70b, qwen2.5-7b, mistral-7b, "
                "...)")
          : fmt::format(
                "Built-in model preset (llama-3-8b, llama-3-70b, qwen2.5-7b, mistral-7b, ...; "
                "default {})",
                default_model);
  add_text(app, "--model", model_, "NAME", model_help)->group("Model");
  add_text(app, "--hf-config", hf_config_, "PATH",
           "Hugging Face config.json: num_hidden_layers, num_key_value_heads, head_dim")
      ->group("Model");
  add_text(app, "--layers", layers_, "N", "Number of layers (overrides the preset/config)")
      ->group("Model");
  add_text(app, "--kv-heads", kv_heads_, "N", "KV heads per layer (overrides)")->group("Model");
  add_text(app, "--head-dim", head_dim_, "N", "Head dim of K and V (overrides)")->group("Model");
  add_text(app, "--head-dim-k", head_dim_k_, "N", "Head dim of K only (overrides)")->group("Model");
  add_text(app, "--head-dim-v", head_dim_v_, "N", "Head dim of V only (overrides)")->group("Model");

  dtype_.value = "bf16";
  add_text(app, "--dtype", dtype_, "DTYPE",
           "Element format: f16, bf16, fp8_e4m3, fp8_e5m2, nvfp4, turbo2/3/4/8 (default bf16)")
      ->group("Cache");
  add_text(app, "--layer-dtypes", layer_dtypes_, "SPEC",
           "Per-layer dtypes: overrides like 'first:bf16,last:bf16' or '0-3:bf16,31:f16', or one "
           "dtype per layer 'bf16,fp8,...'")
      ->group("Cache");
  block_size_.value = "16";
  add_text(app, "--block-size", block_size_, "TOKENS", "Tokens per block (default 16)")
      ->group("Cache");
  layout_.value = "layer_major";
  add_text(app, "--layout", layout_, "LAYOUT", "layer_major (default) or block_major")
      ->group("Cache");
}

CacheShapeOptions::Resolved CacheShapeOptions::resolve() const {
  ModelOverrides overrides;
  if (model_.given()) overrides.preset = model_.value;
  if (hf_config_.given()) {
    if (hf_config_.value.empty()) throw InvalidArgument("--hf-config: empty path");
    overrides.hf_config = hf_config_.value;
  }
  overrides.num_layers = count_flag(layers_, "--layers");
  overrides.num_kv_heads = count_flag(kv_heads_, "--kv-heads");
  overrides.head_dim = count_flag(head_dim_, "--head-dim");
  overrides.head_dim_k = count_flag(head_dim_k_, "--head-dim-k");
  overrides.head_dim_v = count_flag(head_dim_v_, "--head-dim-v");

  Resolved resolved;
  resolved.model = resolve_model_spec(overrides, default_model_);
  KvCacheConfig& config = resolved.config;
  config.num_layers = resolved.model.num_layers;
  config.num_kv_heads = resolved.model.num_kv_heads;
  config.head_dim_k = resolved.model.head_dim_k;
  config.head_dim_v = resolved.model.head_dim_v;
  config.dtype = parse_dtype_value(dtype_.value, "--dtype");
  config.block_size = parse_positive_count(block_size_.value, "--block-size");
  config.layout = parse_layout_value(layout_.value, "--layout");
  // An overflowing shape is reported as such first; then the layer limit,
  // before --layer-dtypes builds a dtype per layer and the plan a row per
  // layer. Presets and configs are within it (parse_hf_config checks), so only
  // --layers can exceed it.
  (void)config.bytes_per_block();
  if (config.num_layers > kMaxModelLayers) {
    throw InvalidArgument(fmt::format("--layers: {} layers is more than the {} kvport supports",
                                      config.num_layers, kMaxModelLayers));
  }
  if (layer_dtypes_.given()) {
    config.layer_dtypes = parse_layer_dtypes(layer_dtypes_.value, config.num_layers, config.dtype);
  }
  config.validate();
  return resolved;
}

void BudgetOptions::add_to(CLI::App& app, std::string_view default_memory) {
  memory_.value = std::string(default_memory);
  add_text(app, "--memory", memory_, "SIZE|device",
           fmt::format("KV-cache memory budget: a size (80GiB, 512MiB, 1.5GB, bytes) or 'device' "
                       "= free device memory x --utilization (default {})",
                       default_memory))
      ->group("Memory");
  utilization_.value = "0.9";
  add_text(app, "--utilization", utilization_, "FRACTION",
           "Share of free device memory for --memory device, in (0, 1] (default 0.9)")
      ->group("Memory");
  add_text(app, "--backend", backend_, "NAME",
           "Backend (host, cuda, hip; default $KVPORT_BACKEND, else the first GPU with a device, "
           "else host)")
      ->group("Memory");
}

std::unique_ptr<Backend> BudgetOptions::make_backend() const {
  if (backend_.given()) return kvport::make_backend(backend_.value);
  return kvport::default_backend();
}

MemoryBudgetSpec BudgetOptions::memory_spec() const {
  const MemoryBudgetSpec spec = parse_memory_budget(memory_.value);
  if (utilization_.given() && !spec.device) {
    throw InvalidArgument(
        fmt::format("--utilization applies to --memory device only, not to a fixed size ('{}')",
                    memory_.value));
  }
  return spec;
}

MemoryBudget BudgetOptions::resolve(const Backend* backend) const {
  const MemoryBudgetSpec spec = memory_spec();
  const double utilization = parse_fraction(utilization_.value, "--utilization");
  return resolve_memory_budget(spec, memory_.value, utilization, backend);
}

}  // namespace kvport::cli
