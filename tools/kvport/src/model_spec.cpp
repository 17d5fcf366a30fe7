// SPDX-License-Identifier: Apache-2.0
#include "kvport/cli/model_spec.hpp"

#include <fcntl.h>
#include <fmt/format.h>
#include <fmt/ranges.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <cctype>
#include <cerrno>
#include <cstdint>
#include <limits>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <system_error>
#include <vector>

#include "hf_fields.hpp"
#include "hf_layers.hpp"
#include "kvport/platform/error.hpp"
#include "kvport/sim/file_error.hpp"
#include "kvport/sim/json_input.hpp"
#include "kvport/sim/model_presets.hpp"
#include "text.hpp"

namespace kvport::cli {
namespace {

using nlohmann::json;

// The config keys kvport reads, at the top level or under "text_config",
// besides those of the layer readers (hf_layers.hpp).
constexpr std::array<std::string_view, 7> kShapeKeys{
    "_name_or_path",       "model_type", "num_hidden_layers", "num_attention_heads",
    "num_key_value_heads", "head_dim",   "hidden_size"};

bool is_shape_key(std::string_view key) {
  return std::find(kShapeKeys.begin(), kShapeKeys.end(), key) != kShapeKeys.end() ||
         is_layer_key(key);
}

// A key that shapes the KV cache: a shape or layer key other than the names
// (a multimodal config's top-level model_type, "gemma3", legitimately differs
// from its text_config's, "gemma3_text").
bool is_cache_shaping_key(std::string_view key) {
  return key != "_name_or_path" && key != "model_type" && is_shape_key(key);
}

// A value for an error line: its JSON, cut short (a layer_types list has one
// entry per layer).
std::string value_text(const json& value) {
  return text::one_line(value.dump(), 40);
}

// Multimodal configs (Llava, Gemma 3, Llama 4, ...) keep the language model's
// shape in "text_config", which is what transformers' get_text_config() and
// vLLM read; some also repeat a few of its fields at the top level. When
// text_config holds any cache-shaping key, the model is text_config, with the
// shaping keys only the top level holds added (vLLM falls back to the top
// level's torch_dtype so); a key both hold with different values is refused,
// as kvport cannot tell which one the engine uses. Otherwise the model is the
// top level. Returns the merged object, or nullopt for the top level.
// Cost: one copy of text_config's kept keys.
std::optional<json> text_model(const json& root, std::string_view source) {
  const auto text = root.find("text_config");
  if (text == root.end() || !text->is_object()) return std::nullopt;
  // A null field is an absent one, on either side.
  bool shapes = false;
  for (const auto& item : text->items())
    shapes = shapes || (is_cache_shaping_key(item.key()) && !item.value().is_null());
  if (!shapes) return std::nullopt;
  json merged = *text;
  for (const auto& item : root.items()) {
    if (!is_cache_shaping_key(item.key()) || item.value().is_null()) continue;
    const auto inner = text->find(item.key());
    if (inner == text->end() || inner->is_null()) {
      merged[item.key()] = item.value();
    } else if (*inner != item.value()) {
      throw InvalidArgument(fmt::format(
          "HF config '{}': '{}' is {} at the top level but {} in text_config; kvport cannot tell "
          "which one shapes the KV cache (make them equal or remove one)",
          source, item.key(), value_text(item.value()), value_text(*inner)));
    }
  }
  return merged;
}

// The family keys (hf_layers.hpp) of one object that were not kept: a few
// names are enough to refuse the config.
constexpr std::size_t kMaxUnkeptFamilyKeys = 4;

void note_unkept(std::vector<std::string>& names, const std::string& key) {
  if (names.size() < kMaxUnkeptFamilyKeys) names.push_back(key);
}

// The shape of the first layer that keeps blocks: what ModelSpec's
// num_kv_heads and head dims say of a hybrid model.
void set_shape_of_hybrid(ModelSpec& spec) {
  spec.num_layers = spec.layers.size();
  for (const LayerSpec& layer : spec.layers) {
    if (layer.kind == LayerKind::mla) {
      spec.num_kv_heads = 1;
      spec.head_dim_k = layer.kv_lora_rank + layer.rope_dim;
      spec.head_dim_v = 0;
      return;
    }
    if (layer.has_blocks()) {
      spec.num_kv_heads = layer.num_kv_heads;
      spec.head_dim_k = layer.head_dim_k;
      spec.head_dim_v = layer.head_dim_v;
      return;
    }
  }
}

}  // namespace

std::string layer_kinds_text(std::span<const LayerSpec> layers) {
  std::vector<std::pair<LayerKind, std::size_t>> counts;
  for (const LayerSpec& layer : layers) {
    const auto it = std::find_if(counts.begin(), counts.end(),
                                 [&](const auto& c) { return c.first == layer.kind; });
    if (it == counts.end()) {
      counts.emplace_back(layer.kind, 1);
    } else {
      ++it->second;
    }
  }
  std::string out;
  for (const auto& [kind, n] : counts) {
    // to_string names state layers "mamba" (vLLM's event name), which would
    // mislabel linear attention.
    const std::string_view name = kind == LayerKind::state ? "state" : to_string(kind);
    out += fmt::format("{}{} {}", out.empty() ? "" : ", ", n, name);
  }
  return out;
}

ModelSpec find_model_preset(std::string_view name) {
  if (const std::optional<sim::ModelPreset> preset = sim::find_model_preset(name)) {
    ModelSpec spec;
    spec.name = std::string(preset->name);
    spec.source = "preset";
    spec.num_layers = preset->num_layers;
    spec.num_kv_heads = preset->num_kv_heads;
    spec.head_dim_k = spec.head_dim_v = preset->head_dim;
    spec.max_position_embeddings = preset->max_position_embeddings;
    if (preset->is_hybrid()) {
      spec.layers = preset->layer_specs();
      set_shape_of_hybrid(spec);
    }
    return spec;
  }
  // A long name is cut so that the list of known presets stays on the line.
  const std::string shown =
      name.size() > 64 ? std::string(name.substr(0, 61)) + "..." : std::string(name);
  throw InvalidArgument(
      fmt::format("unknown model preset '{}' (known: {})", shown, sim::model_preset_names()));
}

HfConfigFields parse_hf_config(std::string_view json_text, std::string_view source) {
  const std::size_t last = json_text.find_last_not_of(" \t\r\n");
  if (last == std::string_view::npos) {
    throw InvalidArgument(fmt::format("HF config '{}': not valid JSON: the file is empty", source));
  }
  // Trailing white space cannot make a text valid or invalid; it need not go
  // through the lexer byte by byte.
  json_text = json_text.substr(0, last + 1);
  // The DOM costs ~100 bytes per value and per level: keep only the keys
  // kvport reads (everything is still checked to be JSON).
  std::string top_key;
  std::vector<std::string> unkept_top, unkept_text;
  const std::string prefix = fmt::format("HF config '{}': ", source);
  sim::JsonInputOptions input;
  input.prefix = prefix;
  input.malformed = "not valid JSON";
  input.max_depth = kMaxHfConfigDepth;
  // The longest list a reader keeps is one entry per layer (layer_types).
  input.max_kept_elements = kMaxModelLayers;
  input.keep_key = [&](int depth, const std::string& key) {
    if (depth == 1) {
      top_key = key;
      if (top_key == "text_config" || is_shape_key(top_key)) return true;
      if (is_shape_family_key(key)) note_unkept(unkept_top, key);
      return false;
    }
    if (depth == 2 && top_key == "text_config") {
      if (is_shape_key(key)) return true;
      if (is_shape_family_key(key)) note_unkept(unkept_text, key);
      return false;
    }
    return true;
  };
  const json root = sim::parse_json_input(json_text, input);
  if (!root.is_object()) {
    throw InvalidArgument(
        fmt::format("HF config '{}': expected a JSON object, got {}", source, root.type_name()));
  }

  HfConfigFields fields;
  fields.name = "hf-config";
  for (const char* key : {"_name_or_path", "model_type"}) {
    const auto it = root.find(key);
    if (it != root.end() && it->is_string() && !it->get<std::string>().empty()) {
      // Printed on the Model line and in JSON: escaped and cut like an error
      // line, so that a hostile name can neither drive the terminal nor fill it.
      fields.name = text::one_line(it->get<std::string>(), kMaxModelNameBytes - 3);  // + "..."
      break;
    }
  }

  // The language model's fields: text_config's when it holds any (text_model).
  const std::optional<json> text = text_model(root, source);
  const json* model = text ? &*text : &root;
  const bool nested = text.has_value();
  if (nested) unkept_text.insert(unkept_text.end(), unkept_top.begin(), unkept_top.end());
  const HfFields config(*model, source);

  fields.num_layers = config.count("num_hidden_layers");
  if (fields.num_layers && *fields.num_layers > kMaxModelLayers) {
    throw InvalidArgument(
        fmt::format("HF config '{}': 'num_hidden_layers' is {}, more than the {} layers kvport "
                    "supports",
                    source, *fields.num_layers, kMaxModelLayers));
  }
  const auto attention_heads = config.count("num_attention_heads");
  fields.num_kv_heads = config.count("num_key_value_heads");
  if (!fields.num_kv_heads) fields.num_kv_heads = attention_heads;
  fields.head_dim = config.count("head_dim");
  if (!fields.head_dim) {
    const auto hidden = config.count("hidden_size");
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
  fields.max_position_embeddings = config.count("max_position_embeddings");

  // The architecture: the language model's own model_type ("gemma3_text"),
  // else the config's ("gemma3").
  std::string model_type;
  for (const json* object : {model, &root}) {
    const auto it = object->find("model_type");
    if (it != object->end() && it->is_string()) {
      model_type = it->get<std::string>();
      break;
    }
  }
  fields.layers =
      read_hf_layers(HfModelView{config, model_type, nested ? unkept_text : unkept_top,
                                 fields.num_layers, fields.num_kv_heads, fields.head_dim});
  return fields;
}

namespace {

// Closes a file descriptor on every path out of load_hf_config.
class FileDescriptor {
 public:
  explicit FileDescriptor(int fd) noexcept : fd_(fd) {}
  ~FileDescriptor() {
    if (fd_ >= 0) ::close(fd_);
  }
  FileDescriptor(const FileDescriptor&) = delete;
  FileDescriptor& operator=(const FileDescriptor&) = delete;
  int get() const noexcept { return fd_; }

 private:
  int fd_;
};

}  // namespace

HfConfigFields load_hf_config(const std::filesystem::path& path) {
  const std::string name = path.string();
  const auto cannot_read = [&](const std::string& why) {
    return InvalidArgument(fmt::format("cannot read HF config '{}': {}", name, why));
  };
  // O_NONBLOCK: opening a FIFO that has no writer must not wait forever. It is
  // cleared below, so that a pipe with a writer (`<(cat config.json)`) is read
  // to its end.
  const FileDescriptor fd(::open(path.c_str(), O_RDONLY | O_NONBLOCK | O_CLOEXEC));
  if (fd.get() < 0) {
    const int error = errno;
    if (error == EISDIR) throw cannot_read("is a directory (pass the config.json file)");
    throw cannot_read(sim::errno_text(error));
  }
  struct stat info {};
  if (::fstat(fd.get(), &info) != 0) throw cannot_read(sim::errno_text(errno));
  if (S_ISDIR(info.st_mode)) throw cannot_read("is a directory (pass the config.json file)");
  const auto too_large = [&](const std::string& size) {
    return InvalidArgument(fmt::format(
        "HF config '{}': {} is larger than the limit of 16 MiB ({} bytes) for a config file", name,
        size, kMaxHfConfigBytes));
  };
  // A regular file's size is known before reading it; a device or a pipe
  // (/dev/zero) is read up to one byte past the limit.
  if (S_ISREG(info.st_mode) && static_cast<std::uintmax_t>(info.st_size) > kMaxHfConfigBytes) {
    throw too_large(fmt::format("the file ({} bytes)", info.st_size));
  }
  if (const int flags = ::fcntl(fd.get(), F_GETFL); flags >= 0) {
    (void)::fcntl(fd.get(), F_SETFL, flags & ~O_NONBLOCK);
  }
  std::string text;
  std::array<char, 64 * 1024> chunk{};
  for (;;) {
    const ::ssize_t n = ::read(fd.get(), chunk.data(), chunk.size());
    if (n < 0) {
      if (errno == EINTR) continue;
      throw cannot_read(sim::errno_text(errno));
    }
    if (n == 0) break;
    text.append(chunk.data(), static_cast<std::size_t>(n));
    if (text.size() > kMaxHfConfigBytes) throw too_large("its content");
  }
  return parse_hf_config(text, name);
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
    HfConfigFields fields = load_hf_config(*overrides.hf_config);
    spec.name = fields.name;
    spec.source = "hf-config";
    spec.max_position_embeddings = fields.max_position_embeddings;
    spec.layers = std::move(fields.layers);
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
  if (spec.is_hybrid()) {
    if (any_flag) {
      throw InvalidArgument(fmt::format(
          "--layers, --kv-heads and --head-dim[-k|-v] set one shape for every layer, and '{}' is "
          "a hybrid model whose layers differ ({}): they cannot override it",
          spec.name, layer_kinds_text(spec.layers)));
    }
    set_shape_of_hybrid(spec);
    return spec;
  }
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
