#include "kvport/cli/model_spec.hpp"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <array>
#include <cctype>
#include <cstdint>
#include <fstream>
#include <limits>
#include <nlohmann/json.hpp>
#include <sstream>
#include <vector>

#include "kvport/platform/error.hpp"

namespace kvport::cli {
namespace {

using nlohmann::json;

// Sorted by name; `kvport plan --model x` lists them in this order.
constexpr std::array kPresets{
    ModelPreset{"llama-3-70b", 80, 8, 128},     ModelPreset{"llama-3-8b", 32, 8, 128},
    ModelPreset{"llama-3.1-405b", 126, 8, 128}, ModelPreset{"mistral-7b", 32, 8, 128},
    ModelPreset{"mixtral-8x7b", 32, 8, 128},    ModelPreset{"qwen2.5-0.5b", 24, 2, 64},
    ModelPreset{"qwen2.5-72b", 80, 8, 128},     ModelPreset{"qwen2.5-7b", 28, 4, 128},
};

bool iequals(std::string_view a, std::string_view b) noexcept {
  return std::equal(a.begin(), a.end(), b.begin(), b.end(), [](char x, char y) {
    return std::tolower(static_cast<unsigned char>(x)) ==
           std::tolower(static_cast<unsigned char>(y));
  });
}

// A JSON value for an error message, shortened so that the message stays one
// readable line.
std::string short_dump(const json& value) {
  std::string text = value.dump();
  if (text.size() > 40) text = text.substr(0, 37) + "...";
  return text;
}

// `key` of `object` as a count > 0; empty when absent or null.
std::optional<std::size_t> positive_field(const json& object, const char* key,
                                          std::string_view source) {
  const auto it = object.find(key);
  if (it == object.end() || it->is_null()) return std::nullopt;
  if (it->is_number_unsigned()) {
    const auto value = it->get<std::uint64_t>();
    if (value > 0 && value <= std::numeric_limits<std::size_t>::max()) {
      return static_cast<std::size_t>(value);
    }
  }
  throw InvalidArgument(fmt::format("HF config '{}': '{}' must be a positive integer, got {}",
                                    source, key, short_dump(*it)));
}

}  // namespace

std::span<const ModelPreset> model_presets() noexcept {
  return kPresets;
}

ModelSpec find_model_preset(std::string_view name) {
  for (const ModelPreset& preset : kPresets) {
    if (iequals(preset.name, name)) {
      return ModelSpec{std::string(preset.name), "preset",        preset.num_layers,
                       preset.num_kv_heads,      preset.head_dim, preset.head_dim};
    }
  }
  std::vector<std::string_view> names;
  for (const ModelPreset& preset : kPresets)
    names.push_back(preset.name);
  throw InvalidArgument(
      fmt::format("unknown model preset '{}' (known: {})", name, fmt::join(names, ", ")));
}

HfConfigFields parse_hf_config(std::string_view json_text, std::string_view source) {
  json root;
  try {
    root = json::parse(json_text);
  } catch (const json::exception& e) {
    throw InvalidArgument(fmt::format("HF config '{}': not valid JSON: {}", source, e.what()));
  }
  if (!root.is_object()) {
    throw InvalidArgument(
        fmt::format("HF config '{}': expected a JSON object, got {}", source, root.type_name()));
  }

  HfConfigFields fields;
  fields.name = "hf-config";
  for (const char* key : {"_name_or_path", "model_type"}) {
    const auto it = root.find(key);
    if (it != root.end() && it->is_string() && !it->get<std::string>().empty()) {
      fields.name = it->get<std::string>();
      break;
    }
  }

  // Multimodal configs (Llava, Gemma 3, ...) keep the language model's shape in
  // "text_config".
  const json* model = &root;
  if (!root.contains("num_hidden_layers")) {
    const auto it = root.find("text_config");
    if (it != root.end() && it->is_object()) model = &*it;
  }

  fields.num_layers = positive_field(*model, "num_hidden_layers", source);
  const auto attention_heads = positive_field(*model, "num_attention_heads", source);
  fields.num_kv_heads = positive_field(*model, "num_key_value_heads", source);
  if (!fields.num_kv_heads) fields.num_kv_heads = attention_heads;
  fields.head_dim = positive_field(*model, "head_dim", source);
  if (!fields.head_dim) {
    const auto hidden = positive_field(*model, "hidden_size", source);
    if (hidden && attention_heads) {
      if (*hidden % *attention_heads != 0) {
        throw InvalidArgument(fmt::format(
            "HF config '{}': hidden_size {} is not a multiple of num_attention_heads {} (give "
            "head_dim in the config or --head-dim)",
            source, *hidden, *attention_heads));
      }
      fields.head_dim = *hidden / *attention_heads;
    }
  }
  return fields;
}

HfConfigFields load_hf_config(const std::filesystem::path& path) {
  std::error_code ec;
  if (std::filesystem::is_directory(path, ec)) {
    throw InvalidArgument(fmt::format(
        "cannot read HF config '{}': is a directory (pass the config.json file)", path.string()));
  }
  std::ifstream in(path, std::ios::binary);
  if (!in) {
    throw InvalidArgument(
        fmt::format("cannot read HF config '{}': {}", path.string(),
                    std::filesystem::exists(path, ec) ? "permission denied" : "no such file"));
  }
  std::ostringstream text;
  text << in.rdbuf();
  if (in.bad()) throw InvalidArgument(fmt::format("cannot read HF config '{}'", path.string()));
  return parse_hf_config(text.str(), path.string());
}

ModelSpec resolve_model_spec(const ModelOverrides& overrides, std::string_view default_preset) {
  if (overrides.preset && overrides.hf_config) {
    throw InvalidArgument("--model and --hf-config both give the model: use one of them");
  }
  if (overrides.head_dim && (overrides.head_dim_k || overrides.head_dim_v)) {
    throw InvalidArgument(
        "--head-dim sets both K and V head dims: do not combine it with --head-dim-k/--head-dim-v");
  }

  ModelSpec spec;
  std::optional<std::size_t> layers, kv_heads, head_dim_k, head_dim_v;
  std::string missing_hint = "use --model NAME or --hf-config PATH, or give them as flags";
  if (overrides.hf_config) {
    const HfConfigFields fields = load_hf_config(*overrides.hf_config);
    spec.name = fields.name;
    spec.source = "hf-config";
    layers = fields.num_layers;
    kv_heads = fields.num_kv_heads;
    head_dim_k = head_dim_v = fields.head_dim;
    missing_hint =
        fmt::format("'{}' does not give them: pass them as flags", overrides.hf_config->string());
  } else if (overrides.preset || !default_preset.empty()) {
    spec =
        find_model_preset(overrides.preset ? std::string_view(*overrides.preset) : default_preset);
    layers = spec.num_layers;
    kv_heads = spec.num_kv_heads;
    head_dim_k = spec.head_dim_k;
    head_dim_v = spec.head_dim_v;
  } else {
    spec.name = "custom";
    spec.source = "flags";
  }

  const bool any_flag = overrides.num_layers || overrides.num_kv_heads || overrides.head_dim ||
                        overrides.head_dim_k || overrides.head_dim_v;
  if (any_flag && spec.source != "flags") spec.source += "+flags";
  if (overrides.num_layers) layers = overrides.num_layers;
  if (overrides.num_kv_heads) kv_heads = overrides.num_kv_heads;
  if (overrides.head_dim) head_dim_k = head_dim_v = overrides.head_dim;
  if (overrides.head_dim_k) head_dim_k = overrides.head_dim_k;
  if (overrides.head_dim_v) head_dim_v = overrides.head_dim_v;

  if (spec.source == "flags" && !any_flag) {
    throw InvalidArgument(
        "no model given: use --model NAME, --hf-config PATH, or --layers, --kv-heads and "
        "--head-dim");
  }
  std::vector<std::string_view> missing;
  if (!layers) missing.push_back("number of layers (--layers)");
  if (!kv_heads) missing.push_back("KV heads (--kv-heads)");
  if (!head_dim_k && !head_dim_v) {
    missing.push_back("head dim (--head-dim)");
  } else if (!head_dim_k) {
    missing.push_back("K head dim (--head-dim-k)");
  } else if (!head_dim_v) {
    missing.push_back("V head dim (--head-dim-v)");
  }
  if (!missing.empty()) {
    throw InvalidArgument(
        fmt::format("incomplete model: missing {}; {}", fmt::join(missing, ", "), missing_hint));
  }
  spec.num_layers = *layers;
  spec.num_kv_heads = *kv_heads;
  spec.head_dim_k = *head_dim_k;
  spec.head_dim_v = *head_dim_v;
  return spec;
}

}  // namespace kvport::cli
