// SPDX-License-Identifier: Apache-2.0
#include "hf_layers.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <array>
#include <functional>
#include <limits>
#include <utility>

#include "kvport/sim/state_layers.hpp"

namespace kvport::cli {
namespace {

using nlohmann::json;

// The keys the readers below read, besides parse_hf_config's own.
constexpr std::array<std::string_view, 36> kLayerKeys{
    "max_position_embeddings",
    "torch_dtype",
    "dtype",
    "layer_types",
    "sliding_window",
    "use_sliding_window",
    "max_window_layers",
    "sliding_window_pattern",
    "attention_chunk_size",
    "no_rope_layers",
    "no_rope_layer_interval",
    "kv_lora_rank",
    "qk_rope_head_dim",
    "full_attention_interval",
    "linear_num_key_heads",
    "linear_num_value_heads",
    "linear_key_head_dim",
    "linear_value_head_dim",
    "linear_conv_kernel_dim",
    "hybrid_override_pattern",
    "layers_block_type",
    "ssm_state_size",
    "mamba_num_heads",
    "mamba_head_dim",
    "n_groups",
    "conv_kernel",
    "mamba_ssm_cache_dtype",
    "attention_head_dim",
    "attn_layer_period",
    "attn_layer_offset",
    "mamba_d_state",
    "mamba_d_conv",
    "mamba_expand",
    "mamba_n_heads",
    "mamba_d_head",
    "mamba_n_groups",
};

// Fields that change the cache's shape on the architectures that own them
// (model_type values). On any other architecture kvport would not know what
// they do to the layers, so it refuses the config rather than plan every
// layer as full attention.
struct FieldFamily {
  std::string_view key;  ///< a field, or a prefix ending in '_'
  bool prefix;
  std::array<std::string_view, 3> owners;
};
constexpr std::array kFamilies{
    FieldFamily{"kv_lora_rank", false, {"deepseek_v2", "deepseek_v3", "kimi_k2"}},
    FieldFamily{"linear_", true, {"qwen3_next"}},
    FieldFamily{"mamba_", true, {"nemotron_h", "jamba", "granitemoehybrid"}},
    FieldFamily{"ssm_", true, {"nemotron_h", "jamba", "granitemoehybrid"}},
    FieldFamily{"hybrid_override_pattern", false, {"nemotron_h"}},
    FieldFamily{"layers_block_type", false, {"nemotron_h"}},
    FieldFamily{"attn_layer_period", false, {"jamba"}},
    FieldFamily{"attn_layer_offset", false, {"jamba"}},
    FieldFamily{"full_attention_interval", false, {"qwen3_next"}},
    FieldFamily{"attention_chunk_size", false, {"llama4", "llama4_text"}},
    FieldFamily{"no_rope_layers", false, {"llama4", "llama4_text"}},
    FieldFamily{"sliding_window_pattern", false, {"gemma3", "gemma3_text"}},
};

// Architectures whose `sliding_window` applies to every layer.
constexpr std::array<std::string_view, 4> kWindowEveryLayer{"mistral", "mixtral", "phi3",
                                                            "starcoder2"};
// Qwen2-style: `use_sliding_window` (default false) makes the layers from
// `max_window_layers` on slide.
constexpr std::array<std::string_view, 4> kQwenWindow{"qwen2", "qwen2_moe", "qwen3", "qwen3_moe"};

template <std::size_t N>
bool contains(const std::array<std::string_view, N>& list, std::string_view value) {
  return std::find(list.begin(), list.end(), value) != list.end();
}

// The layers one word of a per-layer list (layer_types, layers_block_type)
// stands for. `make` is called the first time the word is used, so that a
// field only some layers need is only required when such a layer exists.
struct LayerWord {
  std::string_view name;
  std::function<LayerSpec()> make;
};

class Reader {
 public:
  explicit Reader(const HfModelView& model) : m_(model), f_(model.fields) {}

  const HfFields& fields() const { return f_; }
  const std::string& model_type() const { return m_.model_type; }

  // "model_type 'x'", or "a config without model_type".
  std::string architecture() const {
    if (m_.model_type.empty()) return "a config without model_type";
    return "model_type " + quote_config_text(m_.model_type);
  }

  std::size_t num_layers() const {
    if (!m_.num_layers) {
      throw f_.error(
          fmt::format("{} needs 'num_hidden_layers' for its per-layer KV specs", architecture()));
    }
    return *m_.num_layers;
  }

  // Full attention of the config's KV heads and head dim (`head_dim_keys`
  // first, then what parse_hf_config derived).
  LayerSpec full(std::initializer_list<std::string_view> head_dim_keys = {}) const {
    if (!m_.num_kv_heads) {
      throw f_.error(fmt::format(
          "{} needs 'num_key_value_heads' (or 'num_attention_heads') for its attention layers",
          architecture()));
    }
    std::optional<std::size_t> head_dim =
        head_dim_keys.size() > 0 ? f_.count_of(head_dim_keys) : std::nullopt;
    if (!head_dim) head_dim = m_.head_dim;
    if (!head_dim) {
      throw f_.error(fmt::format(
          "{} needs 'head_dim' (or 'hidden_size' and 'num_attention_heads') for its attention "
          "layers",
          architecture()));
    }
    return LayerSpec::full_attention(*m_.num_kv_heads, *head_dim, *head_dim);
  }

  LayerSpec window() const {
    const LayerSpec attention = full();
    if (f_.flag("use_sliding_window") == false) {
      throw f_.error(
          "the config has sliding-window layers, but 'use_sliding_window' is false: which one "
          "holds?");
    }
    const std::optional<std::size_t> window = f_.count("sliding_window");
    if (!window) {
      throw f_.error(
          fmt::format("{} has sliding-window layers but no 'sliding_window'", architecture()));
    }
    return LayerSpec::sliding_window(*window, attention.num_kv_heads, attention.head_dim_k,
                                     attention.head_dim_v);
  }

  LayerSpec chunked() const {
    const LayerSpec attention = full();
    const std::optional<std::size_t> chunk = f_.count("attention_chunk_size");
    if (!chunk) {
      throw f_.error(fmt::format("{} has chunked-attention layers but no 'attention_chunk_size'",
                                 architecture()));
    }
    return LayerSpec::chunked_local(*chunk, attention.num_kv_heads, attention.head_dim_k,
                                    attention.head_dim_v);
  }

  // The model dtype, which vLLM keeps recurrent state in by default.
  StateDtype model_dtype() const {
    for (std::string_view key : {"torch_dtype", "dtype"}) {
      if (const std::optional<std::string> name = f_.text(key)) return state_dtype(key, *name);
    }
    return StateDtype::bf16;
  }

  // The SSM (recurrent) state's dtype: mamba_ssm_cache_dtype ("auto": the
  // model dtype), as vLLM reads it.
  StateDtype ssm_dtype() const {
    const std::optional<std::string> name = f_.text("mamba_ssm_cache_dtype");
    if (!name || *name == "auto") return model_dtype();
    return state_dtype("mamba_ssm_cache_dtype", *name);
  }

  std::size_t require(std::initializer_list<std::string_view> keys) const {
    return f_.require_count(keys, m_.model_type);
  }

  // Fields this architecture's reader does not read but that would change
  // the layers: refused rather than ignored.
  void refuse_unread(std::initializer_list<std::string_view> keys) const {
    for (std::string_view key : keys) {
      if (!f_.has(key)) continue;
      if (key == "sliding_window" && f_.flag("use_sliding_window") == false) continue;
      throw f_.error(fmt::format(
          "'{}' is given, and kvport does not read it for {}: refusing to plan the layers without "
          "it",
          key, architecture()));
    }
  }

  // One spec per word of `words` (the value of `key`), from `vocabulary`.
  std::vector<LayerSpec> from_words(std::string_view key, const std::vector<std::string>& words,
                                    std::span<const LayerWord> vocabulary) const {
    const std::size_t n = num_layers();
    if (words.size() != n) {
      throw f_.error(
          fmt::format("'{}' has {} entries but num_hidden_layers is {}", key, words.size(), n));
    }
    std::vector<std::optional<LayerSpec>> made(vocabulary.size());
    std::vector<LayerSpec> layers;
    layers.reserve(n);
    for (std::size_t i = 0; i < n; ++i) {
      const auto it = std::find_if(vocabulary.begin(), vocabulary.end(),
                                   [&](const LayerWord& w) { return w.name == words[i]; });
      if (it == vocabulary.end()) {
        std::string known;
        for (const LayerWord& w : vocabulary)
          known += fmt::format("{}{}", known.empty() ? "" : ", ", w.name);
        throw f_.error(
            fmt::format("'{}'[{}] is {}, a kind of layer kvport does not know for {} (known: {})",
                        key, i, quote_config_text(words[i]), architecture(), known));
      }
      std::optional<LayerSpec>& spec = made[static_cast<std::size_t>(it - vocabulary.begin())];
      if (!spec) spec = it->make();
      layers.push_back(*spec);
    }
    return layers;
  }

  // Two descriptions of the same layers must agree.
  void agree(std::string_view a, const std::vector<LayerSpec>& x, std::string_view b,
             const std::vector<LayerSpec>& y) const {
    for (std::size_t i = 0; i < std::min(x.size(), y.size()); ++i) {
      if (x[i] != y[i]) {
        throw f_.error(fmt::format("'{}' and '{}' disagree about layer {} ({} vs {})", a, b, i,
                                   x[i].describe(), y[i].describe()));
      }
    }
  }

 private:
  StateDtype state_dtype(std::string_view key, const std::string& name) const {
    if (const std::optional<StateDtype> dtype = parse_state_dtype(name)) return *dtype;
    throw f_.error(
        fmt::format("'{}' is {}: kvport keeps recurrent state in float32, float16 or bfloat16", key,
                    quote_config_text(name)));
  }

  const HfModelView& m_;
  const HfFields& f_;
};

void check_owned_fields(const HfModelView& model) {
  const auto check = [&](std::string_view key) {
    for (const FieldFamily& family : kFamilies) {
      if (family.prefix ? !key.starts_with(family.key) : key != family.key) continue;
      if (std::find(family.owners.begin(), family.owners.end(), model.model_type) !=
              family.owners.end() &&
          !model.model_type.empty()) {
        return;
      }
      std::string owners;
      for (std::string_view owner : family.owners) {
        if (!owner.empty()) owners += fmt::format("{}{}", owners.empty() ? "" : ", ", owner);
      }
      const std::string arch = model.model_type.empty()
                                   ? "a config without model_type"
                                   : "model_type " + quote_config_text(model.model_type);
      throw model.fields.error(fmt::format(
          "{} changes the KV cache's shape, and kvport does not read it for {} (it does for "
          "{}): refusing to plan the layers as full attention",
          quote_config_text(key), arch, owners));
    }
  };
  const json& object = model.fields.object();
  if (object.is_object()) {
    for (const auto& [key, value] : object.items()) {
      if (!value.is_null()) check(key);
    }
  }
  for (const std::string& key : model.unkept_family_keys)
    check(key);
}

// DeepSeek-V2/V3/R1, Kimi K2: one latent of kv_lora_rank + qk_rope_head_dim
// values per token and layer. num_key_value_heads is the expanded head count
// of the attention, not the cache's, and is not read.
std::vector<LayerSpec> mla_layers(const Reader& r) {
  r.refuse_unread({"layer_types", "sliding_window", "attention_chunk_size"});
  const std::size_t n = r.num_layers();
  const std::size_t rank = r.require({"kv_lora_rank"});
  const std::size_t rope = r.require({"qk_rope_head_dim"});
  return std::vector<LayerSpec>(n, LayerSpec::mla(rank, rope));
}

// Qwen3-Next: full attention every full_attention_interval layers (layer i
// when (i + 1) % interval == 0), Gated DeltaNet linear attention elsewhere;
// or the same as layer_types.
std::vector<LayerSpec> qwen3_next_layers(const Reader& r) {
  r.refuse_unread({"sliding_window", "attention_chunk_size"});
  const HfFields& f = r.fields();
  const std::size_t n = r.num_layers();
  const auto linear = [&] {
    return sim::gated_delta_net_state_layer(
        sim::GatedDeltaNetShape{
            r.require({"linear_num_key_heads"}), r.require({"linear_num_value_heads"}),
            r.require({"linear_key_head_dim"}), r.require({"linear_value_head_dim"}),
            r.require({"linear_conv_kernel_dim"})},
        r.model_dtype(), r.ssm_dtype());
  };
  const std::array<LayerWord, 2> words{LayerWord{"full_attention", [&] { return r.full(); }},
                                       LayerWord{"linear_attention", linear}};
  std::optional<std::vector<LayerSpec>> from_types;
  if (const auto types = f.texts("layer_types")) {
    from_types = r.from_words("layer_types", *types, words);
  }
  std::optional<std::vector<LayerSpec>> from_interval;
  if (const std::optional<std::size_t> interval = f.count("full_attention_interval")) {
    if (n % *interval != 0) {
      throw f.error(fmt::format("'full_attention_interval' {} does not divide num_hidden_layers {}",
                                *interval, n));
    }
    std::vector<std::string> types;
    for (std::size_t i = 0; i < n; ++i)
      types.emplace_back((i + 1) % *interval == 0 ? "full_attention" : "linear_attention");
    from_interval = r.from_words("full_attention_interval", types, words);
  }
  if (from_types && from_interval) {
    r.agree("layer_types", *from_types, "full_attention_interval", *from_interval);
  }
  if (from_types) return *from_types;
  if (from_interval) return *from_interval;
  throw f.error(
      fmt::format("{} needs 'layer_types' or 'full_attention_interval'", r.architecture()));
}

// A Mamba2 layer of Nemotron-H's (or Granite 4's) fields; `head_dim` is
// given when the config derives it.
LayerSpec mamba2_layer(const Reader& r, std::optional<std::size_t> head_dim = std::nullopt) {
  return sim::mamba2_state_layer(
      sim::Mamba2Shape{r.require({"mamba_num_heads", "mamba_n_heads"}),
                       head_dim ? *head_dim : r.require({"mamba_head_dim", "mamba_d_head"}),
                       r.require({"ssm_state_size", "mamba_d_state"}),
                       r.require({"n_groups", "mamba_n_groups"}),
                       r.require({"conv_kernel", "mamba_d_conv"})},
      r.model_dtype(), r.ssm_dtype());
}

// Nemotron-H: hybrid_override_pattern (M Mamba2, * attention, - MLP, E MoE)
// or layers_block_type (mamba, attention, mlp, moe); MLP and MoE layers keep
// nothing.
std::vector<LayerSpec> nemotron_h_layers(const Reader& r) {
  r.refuse_unread({"layer_types", "sliding_window", "attention_chunk_size"});
  const HfFields& f = r.fields();
  const std::array<LayerWord, 4> words{
      LayerWord{"mamba", [&] { return mamba2_layer(r); }},
      LayerWord{"attention",
                [&] {
                  return r.full({"head_dim", "attention_head_dim"});
                }},
      LayerWord{"mlp", [] { return LayerSpec::no_kv(); }},
      LayerWord{"moe", [] { return LayerSpec::no_kv(); }}};
  std::optional<std::vector<LayerSpec>> from_pattern;
  if (const std::optional<std::string> pattern = f.text("hybrid_override_pattern")) {
    const std::size_t n = r.num_layers();
    if (pattern->size() != n) {
      throw f.error(
          fmt::format("'hybrid_override_pattern' has {} characters but num_hidden_layers is {}",
                      pattern->size(), n));
    }
    std::vector<std::string> types;
    for (std::size_t i = 0; i < pattern->size(); ++i) {
      const char c = (*pattern)[i];
      const char* type = c == 'M'   ? "mamba"
                         : c == '*' ? "attention"
                         : c == '-' ? "mlp"
                         : c == 'E' ? "moe"
                                    : nullptr;
      if (type == nullptr) {
        throw f.error(fmt::format(
            "'hybrid_override_pattern'[{}] is {}, a kind of layer kvport does not know (known: M "
            "mamba, * attention, - MLP, E MoE)",
            i, quote_config_text(std::string_view(&(*pattern)[i], 1))));
      }
      types.emplace_back(type);
    }
    from_pattern = r.from_words("hybrid_override_pattern", types, words);
  }
  std::optional<std::vector<LayerSpec>> from_types;
  if (const auto types = f.texts("layers_block_type")) {
    from_types = r.from_words("layers_block_type", *types, words);
  }
  if (from_pattern && from_types) {
    r.agree("hybrid_override_pattern", *from_pattern, "layers_block_type", *from_types);
  }
  if (from_pattern) return *from_pattern;
  if (from_types) return *from_types;
  throw f.error(
      fmt::format("{} needs 'hybrid_override_pattern' or 'layers_block_type'", r.architecture()));
}

// Granite 4 (granitemoehybrid): layer_types of mamba and attention; Mamba2
// fields named mamba_n_heads, mamba_d_head ("auto": mamba_expand x
// hidden_size / mamba_n_heads), mamba_d_state, mamba_n_groups, mamba_d_conv.
std::vector<LayerSpec> granite_layers(const Reader& r) {
  r.refuse_unread({"sliding_window", "attention_chunk_size"});
  const HfFields& f = r.fields();
  const auto mamba = [&] {
    const auto d_head = f.object().find("mamba_d_head");
    if (d_head != f.object().end() && d_head->is_string() && d_head->get<std::string>() == "auto") {
      const std::size_t heads = r.require({"mamba_n_heads"});
      const std::size_t expand = r.require({"mamba_expand"});
      const std::size_t hidden = r.require({"hidden_size"});
      if (hidden > std::numeric_limits<std::size_t>::max() / expand ||
          (expand * hidden) % heads != 0) {
        throw f.error(fmt::format(
            "'mamba_d_head' is \"auto\", and mamba_expand {} x hidden_size {} is not a multiple "
            "of mamba_n_heads {}",
            expand, hidden, heads));
      }
      return mamba2_layer(r, expand * hidden / heads);
    }
    return mamba2_layer(r);
  };
  const std::array<LayerWord, 2> words{LayerWord{"attention", [&] { return r.full(); }},
                                       LayerWord{"mamba", mamba}};
  const auto types = f.texts("layer_types");
  if (!types) throw f.error(fmt::format("{} needs 'layer_types'", r.architecture()));
  return r.from_words("layer_types", *types, words);
}

// Jamba: attention where i % attn_layer_period == attn_layer_offset, Mamba
// (v1) elsewhere: intermediate mamba_expand x hidden_size, mamba_d_state,
// mamba_d_conv.
std::vector<LayerSpec> jamba_layers(const Reader& r) {
  r.refuse_unread({"layer_types", "sliding_window", "attention_chunk_size"});
  const HfFields& f = r.fields();
  const std::size_t n = r.num_layers();
  const std::size_t period = r.require({"attn_layer_period"});
  const std::optional<std::size_t> offset = f.index("attn_layer_offset");
  if (!offset) throw f.error(fmt::format("{} needs 'attn_layer_offset'", r.architecture()));
  if (*offset >= period) {
    throw f.error(fmt::format(
        "'attn_layer_offset' {} is not below 'attn_layer_period' {}: no layer would attend",
        *offset, period));
  }
  const auto mamba = [&] {
    const std::size_t expand = r.require({"mamba_expand"});
    const std::size_t hidden = r.require({"hidden_size"});
    if (hidden > std::numeric_limits<std::size_t>::max() / expand) {
      throw f.error(fmt::format("mamba_expand {} x hidden_size {} overflows", expand, hidden));
    }
    return sim::mamba1_state_layer(sim::Mamba1Shape{expand * hidden, r.require({"mamba_d_state"}),
                                                    r.require({"mamba_d_conv"})},
                                   r.model_dtype(), r.ssm_dtype());
  };
  const std::array<LayerWord, 2> words{LayerWord{"attention", [&] { return r.full(); }},
                                       LayerWord{"mamba", mamba}};
  std::vector<std::string> types;
  for (std::size_t i = 0; i < n; ++i)
    types.emplace_back(i % period == *offset ? "attention" : "mamba");
  return r.from_words("attn_layer_period", types, words);
}

// Llama 4: no_rope_layers[i] 1 = RoPE, attending within chunks of
// attention_chunk_size; 0 = NoPE, attending globally. An empty or absent list
// is transformers' default: every no_rope_layer_interval-th layer (4) NoPE.
std::vector<LayerSpec> llama4_layers(const Reader& r) {
  const HfFields& f = r.fields();
  const std::size_t n = r.num_layers();
  std::optional<std::vector<std::size_t>> rope = f.indices("no_rope_layers");
  if (!rope || rope->empty()) {
    const std::size_t interval = f.count("no_rope_layer_interval").value_or(4);
    rope.emplace();
    for (std::size_t i = 0; i < n; ++i)
      rope->push_back((i + 1) % interval != 0 ? 1 : 0);
  }
  if (rope->size() != n) {
    throw f.error(fmt::format("'no_rope_layers' has {} entries but num_hidden_layers is {}",
                              rope->size(), n));
  }
  const bool chunked = f.has("attention_chunk_size");
  std::vector<std::string> types;
  for (std::size_t i = 0; i < n; ++i) {
    if ((*rope)[i] > 1) {
      throw f.error(
          fmt::format("'no_rope_layers'[{}] must be 0 (NoPE) or 1 (RoPE), got {}", i, (*rope)[i]));
    }
    types.emplace_back((*rope)[i] == 1 && chunked ? "chunked_attention" : "full_attention");
  }
  const std::array<LayerWord, 2> words{LayerWord{"full_attention", [&] { return r.full(); }},
                                       LayerWord{"chunked_attention", [&] { return r.chunked(); }}};
  return r.from_words("no_rope_layers", types, words);
}

// Gemma 3: layer i global when (i + 1) % sliding_window_pattern == 0.
std::vector<LayerSpec> gemma3_pattern_layers(const Reader& r, std::size_t pattern) {
  const std::size_t n = r.num_layers();
  std::vector<std::string> types;
  for (std::size_t i = 0; i < n; ++i)
    types.emplace_back((i + 1) % pattern == 0 ? "full_attention" : "sliding_attention");
  const std::array<LayerWord, 2> words{LayerWord{"full_attention", [&] { return r.full(); }},
                                       LayerWord{"sliding_attention", [&] { return r.window(); }}};
  return r.from_words("sliding_window_pattern", types, words);
}

// Models whose layers differ only in how far they attend.
std::vector<LayerSpec> attention_layers(const Reader& r) {
  const HfFields& f = r.fields();
  const std::string& type = r.model_type();
  const bool gemma3 = type == "gemma3" || type == "gemma3_text";
  const bool llama4 = type == "llama4" || type == "llama4_text";
  const std::array<LayerWord, 3> words{LayerWord{"full_attention", [&] { return r.full(); }},
                                       LayerWord{"sliding_attention", [&] { return r.window(); }},
                                       LayerWord{"chunked_attention", [&] { return r.chunked(); }}};

  std::optional<std::vector<LayerSpec>> from_types;
  if (const auto types = f.texts("layer_types")) {
    from_types = r.from_words("layer_types", *types, words);
  }
  std::optional<std::vector<LayerSpec>> derived;
  std::string_view derived_from;
  if (gemma3) {
    if (const std::optional<std::size_t> pattern = f.count("sliding_window_pattern")) {
      derived = gemma3_pattern_layers(r, *pattern);
      derived_from = "sliding_window_pattern";
    }
  } else if (llama4) {
    const auto rope = f.indices("no_rope_layers");
    if (!from_types || (rope && !rope->empty())) {
      derived = llama4_layers(r);
      derived_from = "no_rope_layers";
    }
  } else if (type == "gemma2" && !from_types) {
    // Gemma 2: local and global attention alternate, layer 0 local.
    std::vector<std::string> types;
    for (std::size_t i = 0; i < r.num_layers(); ++i)
      types.emplace_back(i % 2 == 0 ? "sliding_attention" : "full_attention");
    return r.from_words("model_type 'gemma2'", types, words);
  }
  if (from_types && derived) r.agree("layer_types", *from_types, derived_from, *derived);
  if (from_types) return *from_types;
  if (derived) return *derived;
  if (gemma3) {
    throw f.error(
        fmt::format("{} needs 'layer_types' or 'sliding_window_pattern'", r.architecture()));
  }

  // No per-layer list: `sliding_window` is all there is.
  if (!f.has("sliding_window") || f.flag("use_sliding_window") == false) return {};
  if (contains(kQwenWindow, type)) {
    if (f.flag("use_sliding_window") != true) return {};  // the default is off
    const std::optional<std::size_t> from = f.index("max_window_layers");
    if (!from) {
      throw f.error(fmt::format(
          "{} has 'use_sliding_window' true but no 'max_window_layers' (the first layer "
          "that slides)",
          r.architecture()));
    }
    std::vector<std::string> types;
    for (std::size_t i = 0; i < r.num_layers(); ++i)
      types.emplace_back(i >= *from ? "sliding_attention" : "full_attention");
    return r.from_words("max_window_layers", types, words);
  }
  if (contains(kWindowEveryLayer, type)) {
    return std::vector<LayerSpec>(r.num_layers(), r.window());
  }
  throw f.error(fmt::format(
      "'sliding_window' is {}, and kvport does not know which layers of {} attend within it: "
      "refusing to plan them as full attention (give 'layer_types')",
      short_dump(f.object().at("sliding_window")), r.architecture()));
}

bool every_layer_full_of_one_shape(const std::vector<LayerSpec>& layers) {
  return std::all_of(layers.begin(), layers.end(), [&](const LayerSpec& spec) {
    return spec.kind == LayerKind::full_attention && spec == layers.front();
  });
}

}  // namespace

bool is_layer_key(std::string_view key) {
  return contains(kLayerKeys, key);
}

bool is_shape_family_key(std::string_view key) {
  return key.starts_with("ssm_") || key.starts_with("mamba_") || key.starts_with("linear_");
}

std::vector<LayerSpec> read_hf_layers(const HfModelView& model) {
  check_owned_fields(model);
  const Reader r(model);
  const std::string& type = model.model_type;
  std::vector<LayerSpec> layers;
  if (type == "deepseek_v2" || type == "deepseek_v3" || type == "kimi_k2") {
    layers = mla_layers(r);
  } else if (type == "qwen3_next") {
    layers = qwen3_next_layers(r);
  } else if (type == "nemotron_h") {
    layers = nemotron_h_layers(r);
  } else if (type == "granitemoehybrid") {
    layers = granite_layers(r);
  } else if (type == "jamba") {
    layers = jamba_layers(r);
  } else {
    layers = attention_layers(r);
  }
  if (every_layer_full_of_one_shape(layers)) return {};
  return layers;
}

}  // namespace kvport::cli
