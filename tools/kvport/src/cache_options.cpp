// SPDX-License-Identifier: Apache-2.0
#include "cache_options.hpp"

#include <fmt/format.h>

#include <CLI/CLI.hpp>
#include <algorithm>
#include <utility>

#include "kvport/cli/flag_values.hpp"
#include "kvport/cli/layer_dtypes.hpp"
#include "kvport/platform/error.hpp"
#include "kvport/platform/registry.hpp"
#include "text.hpp"

namespace kvport::cli {
namespace {

std::optional<std::size_t> count_flag(const TextFlag& flag, std::string_view name) {
  if (!flag.given()) return std::nullopt;
  return parse_positive_count(flag.value, name);
}

// vLLM's --kv-cache-dtype fp8_ds_mla: a latent format, not an element dtype.
bool is_ds_mla(std::string_view value) {
  std::string name = text::lower(text::trim(value));
  std::replace(name.begin(), name.end(), '-', '_');
  return name == "fp8_ds_mla";
}

std::optional<StateDtype> state_dtype_flag(const TextFlag& flag, std::string_view name) {
  if (!flag.given()) return std::nullopt;
  if (const auto dtype = parse_state_dtype(text::lower(text::trim(flag.value)))) return dtype;
  throw InvalidArgument(
      fmt::format("{}: unknown state dtype '{}' (known: f32, f16, bf16)", name, flag.value));
}

}  // namespace

CLI::Option* add_text_flag(CLI::App& app, const char* name, TextFlag& flag, const char* type,
                           const std::string& help) {
  flag.option = app.add_option(name, flag.value, help);
  // Repeating a flag overrides it, so that scripts can append to a command line.
  flag.option->type_name(type)->multi_option_policy(CLI::MultiOptionPolicy::TakeLast);
  return flag.option;
}

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
  add_text_flag(app, "--model", model_, "NAME", model_help)->group("Model");
  add_text_flag(app, "--hf-config", hf_config_, "PATH",
                "Hugging Face config.json: num_hidden_layers, num_key_value_heads, head_dim")
      ->group("Model");
  add_text_flag(app, "--layers", layers_, "N", "Number of layers (overrides the preset/config)")
      ->group("Model");
  add_text_flag(app, "--kv-heads", kv_heads_, "N", "KV heads per layer (overrides)")
      ->group("Model");
  add_text_flag(app, "--head-dim", head_dim_, "N", "Head dim of K and V (overrides)")
      ->group("Model");
  add_text_flag(app, "--head-dim-k", head_dim_k_, "N", "Head dim of K only (overrides)")
      ->group("Model");
  add_text_flag(app, "--head-dim-v", head_dim_v_, "N", "Head dim of V only (overrides)")
      ->group("Model");

  dtype_.value = "bf16";
  add_text_flag(
      app, "--dtype", dtype_, "DTYPE",
      "Element format: f16, bf16, fp8_e4m3, fp8_e5m2, nvfp4, turbo2/3/4/8 (default bf16); "
      "MLA models also fp8_ds_mla (vLLM's 656-byte DeepSeek latent)")
      ->group("Cache");
  add_text_flag(
      app, "--layer-dtypes", layer_dtypes_, "SPEC",
      "Per-layer dtypes: overrides like 'first:bf16,last:bf16' or '0-3:bf16,31:f16', or one "
      "dtype per layer 'bf16,fp8,...'")
      ->group("Cache");
  block_size_.value = "16";
  add_text_flag(app, "--block-size", block_size_, "TOKENS", "Tokens per block (default 16)")
      ->group("Cache");
  layout_.value = "layer_major";
  add_text_flag(app, "--layout", layout_, "LAYOUT", "layer_major (default) or block_major")
      ->group("Cache");
  add_text_flag(app, "--state-dtype", state_dtype_, "DTYPE",
                "State layers (Mamba, linear attention): f32, f16 or bf16 for every state tensor "
                "(default: the model dtype, the SSM state as the config's mamba_ssm_cache_dtype)")
      ->group("Cache");
  add_text_flag(app, "--ssm-state-dtype", ssm_state_dtype_, "DTYPE",
                "State layers: f32, f16 or bf16 for the SSM (recurrent) state only")
      ->group("Cache");
}

ModelOverrides CacheShapeOptions::overrides() const {
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
  return overrides;
}

CacheShapeOptions::Resolved CacheShapeOptions::resolve_full_attention(ModelSpec model) const {
  if (is_ds_mla(dtype_.value)) {
    throw InvalidArgument(fmt::format(
        "--dtype fp8_ds_mla is an MLA latent format, and '{}' has no MLA layers", model.name));
  }
  for (const auto& [flag, name] : {std::pair{&state_dtype_, "--state-dtype"},
                                   std::pair{&ssm_state_dtype_, "--ssm-state-dtype"}}) {
    if (flag->given()) {
      throw InvalidArgument(fmt::format("{}: '{}' has no state layers", name, model.name));
    }
  }
  Resolved resolved;
  resolved.model = std::move(model);
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

CacheShapeOptions::Resolved CacheShapeOptions::resolve() const {
  ModelSpec model = resolve_model_spec(overrides(), default_model_);
  if (model.is_hybrid()) {
    throw InvalidArgument(fmt::format(
        "'{}' is a hybrid model ({}): this command runs models whose every layer is full "
        "attention of one shape (kvport plan plans hybrid models)",
        model.name, layer_kinds_text(model.layers)));
  }
  return resolve_full_attention(std::move(model));
}

CacheShapeOptions::Layered CacheShapeOptions::resolve_layers() const {
  Layered out;
  out.model = resolve_model_spec(overrides(), default_model_);
  if (!out.model.is_hybrid()) {
    Resolved full = resolve_full_attention(out.model);
    out.layers = layer_specs_of(full.config);
    out.dtype = std::string(to_string(full.config.dtype));
    out.block_size = full.config.block_size;
    out.layout = full.config.layout;
    out.full_attention = std::move(full);
    return out;
  }

  out.block_size = parse_positive_count(block_size_.value, "--block-size");
  out.layout = parse_layout_value(layout_.value, "--layout");
  out.layers = out.model.layers;
  const std::string& name = out.model.name;
  if (is_ds_mla(dtype_.value)) {
    out.dtype = "fp8_ds_mla";
    for (LayerSpec& layer : out.layers) {
      if (layer.kind == LayerKind::mla) {
        layer = LayerSpec::mla(layer.kv_lora_rank, layer.rope_dim, KvCacheDtype::bf16,
                               MlaFormat::fp8_ds_mla);
      } else if (layer.has_blocks()) {
        throw InvalidArgument(
            fmt::format("--dtype fp8_ds_mla is an MLA latent format, and '{}' also has {} layers",
                        name, to_string(layer.kind)));
      }
    }
    if (layer_dtypes_.given()) {
      throw InvalidArgument(
          "--layer-dtypes: fp8_ds_mla fixes the element types of every MLA layer");
    }
  } else {
    const KvCacheDtype dtype = parse_dtype_value(dtype_.value, "--dtype");
    out.dtype = std::string(to_string(dtype));
    std::vector<KvCacheDtype> per_layer(out.layers.size(), dtype);
    if (layer_dtypes_.given()) {
      per_layer = parse_layer_dtypes(layer_dtypes_.value, out.layers.size(), dtype);
    }
    for (std::size_t i = 0; i < out.layers.size(); ++i) {
      LayerSpec& layer = out.layers[i];
      if (layer.has_blocks()) {
        layer.dtype = per_layer[i];
      } else if (per_layer[i] != dtype) {
        throw InvalidArgument(
            fmt::format("--layer-dtypes: layer {} of '{}' is a {} layer, which keeps no KV blocks "
                        "(--state-dtype "
                        "sets the state layers' dtype)",
                        i, name, to_string(layer.kind)));
      }
    }
  }

  const std::optional<StateDtype> all_state = state_dtype_flag(state_dtype_, "--state-dtype");
  const std::optional<StateDtype> ssm_state =
      state_dtype_flag(ssm_state_dtype_, "--ssm-state-dtype");
  if (all_state || ssm_state) {
    const bool has_state = std::any_of(out.layers.begin(), out.layers.end(),
                                       [](const LayerSpec& l) { return l.has_state(); });
    if (!has_state) {
      throw InvalidArgument(fmt::format("{}: '{}' has no state layers",
                                        all_state ? "--state-dtype" : "--ssm-state-dtype", name));
    }
    for (LayerSpec& layer : out.layers) {
      for (StateTensor& tensor : layer.state) {
        const bool conv = tensor.name == "conv";
        if (all_state) tensor.dtype = *all_state;
        if (ssm_state && !conv) tensor.dtype = *ssm_state;
      }
    }
  }
  return out;
}

void BudgetOptions::add_to(CLI::App& app, std::string_view default_memory) {
  memory_.value = std::string(default_memory);
  add_text_flag(
      app, "--memory", memory_, "SIZE|device",
      fmt::format("KV-cache memory budget: a size (80GiB, 512MiB, 1.5GB, bytes) or 'device' "
                  "= free device memory x --utilization (default {})",
                  default_memory))
      ->group("Memory");
  utilization_.value = "0.9";
  add_text_flag(app, "--utilization", utilization_, "FRACTION",
                "Share of free device memory for --memory device, in (0, 1] (default 0.9)")
      ->group("Memory");
  add_text_flag(
      app, "--backend", backend_, "NAME",
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
