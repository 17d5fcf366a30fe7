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
#include <string>
#include <system_error>
#include <vector>

#include "kvport/platform/error.hpp"
#include "kvport/sim/file_error.hpp"
#include "kvport/sim/json_input.hpp"
#include "kvport/sim/model_presets.hpp"
#include "text.hpp"

namespace kvport::cli {
namespace {

using nlohmann::json;

// The config keys kvport reads, at the top level or under "text_config".
constexpr std::array<std::string_view, 7> kShapeKeys{
    "_name_or_path",       "model_type", "num_hidden_layers", "num_attention_heads",
    "num_key_value_heads", "head_dim",   "hidden_size"};

bool is_shape_key(std::string_view key) {
  return std::find(kShapeKeys.begin(), kShapeKeys.end(), key) != kShapeKeys.end();
}

// A JSON value for an error message, shortened so that the message stays one
// readable line. Arrays and objects are named, not printed: dump() recurses
// once per level of nesting.
std::string short_dump(const json& value) {
  if (value.is_array()) return "an array";
  if (value.is_object()) return "an object";
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

ModelSpec find_model_preset(std::string_view name) {
  if (const std::optional<sim::ModelPreset> preset = sim::find_model_preset(name)) {
    const KvCacheConfig config = sim::preset_config(*preset);  // refuses hybrid models
    return ModelSpec{std::string(preset->name), "preset",          config.num_layers,
                     config.num_kv_heads,       config.head_dim_k, config.head_dim_v};
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
  const std::string prefix = fmt::format("HF config '{}': ", source);
  sim::JsonInputOptions input;
  input.prefix = prefix;
  input.malformed = "not valid JSON";
  input.max_depth = kMaxHfConfigDepth;
  input.keep_key = [&](int depth, const std::string& key) {
    if (depth == 1) {
      top_key = key;
      return top_key == "text_config" || is_shape_key(top_key);
    }
    if (depth == 2 && top_key == "text_config") return is_shape_key(key);
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
  if (fields.num_layers && *fields.num_layers > kMaxModelLayers) {
    throw InvalidArgument(
        fmt::format("HF config '{}': 'num_hidden_layers' is {}, more than the {} layers kvport "
                    "supports",
                    source, *fields.num_layers, kMaxModelLayers));
  }
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
