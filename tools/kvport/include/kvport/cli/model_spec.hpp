// SPDX-License-Identifier: Apache-2.0
// The attention shape of a model, as the KV cache sees it: built-in presets,
// Hugging Face config.json files, and command-line overrides.
#pragma once

#include <cstddef>
#include <filesystem>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "kvport/core/layer_spec.hpp"

namespace kvport::cli {

/// The most layers a model may have. Real models have a few hundred at most;
/// the plan keeps a row per layer and --layer-dtypes a dtype per layer, so a
/// config claiming 2^40 layers must fail here rather than run out of memory.
inline constexpr std::size_t kMaxModelLayers = 65536;

/// The largest config.json `load_hf_config` reads. Real ones are a few KiB
/// (at most a few hundred KiB with large label maps); a bigger file is refused
/// before it is read.
inline constexpr std::size_t kMaxHfConfigBytes = std::size_t{16} << 20;

/// The deepest nesting of arrays and objects `parse_hf_config` accepts (real
/// configs nest 3 or 4 levels).
inline constexpr std::size_t kMaxHfConfigDepth = 64;

/// The longest model name kept (a config's _name_or_path may be megabytes).
inline constexpr std::size_t kMaxModelNameBytes = 200;

/// What a KV cache needs to know about a model. Every count is > 0 once a
/// spec has been resolved (`resolve_model_spec`), except head_dim_v of an MLA
/// model (no V).
struct ModelSpec {
  /// "llama-3-8b", a config's _name_or_path or model_type, or "custom":
  /// printable (control characters and bytes that are not UTF-8 written as
  /// \xNN) and at most kMaxModelNameBytes bytes, "..." included.
  std::string name;
  std::string source;  ///< "preset", "hf-config" or "flags"
  /// Of every layer; of a hybrid model, its first attention layer (an MLA
  /// model: one "head" of the latent, kv_lora_rank + rope_dim values, no V).
  std::size_t num_layers = 0;
  std::size_t num_kv_heads = 0;
  std::size_t head_dim_k = 0;
  std::size_t head_dim_v = 0;
  /// A hybrid model's specs, one per layer (K/V and MLA latents bf16, state
  /// in the dtypes of the config); empty when every layer is full attention
  /// of the shape above.
  std::vector<LayerSpec> layers;
  /// The config's max_position_embeddings, when known.
  std::optional<std::size_t> max_position_embeddings;

  bool is_hybrid() const noexcept { return !layers.empty(); }
};

/// How many layers of each kind, in order of first appearance: "18
/// sliding_window, 18 full_attention" (LayerKind names, "state" for state).
std::string layer_kinds_text(std::span<const LayerSpec> layers);

/// The preset called `name` (case-insensitive) of the one table,
/// kvport::sim::model_presets(). Throws InvalidArgument naming
/// the unknown name and listing the known ones.
ModelSpec find_model_preset(std::string_view name);

/// What a Hugging Face config.json contributes. A field is empty when the
/// config does not give it (the command line may still supply it).
struct HfConfigFields {
  /// _name_or_path, else model_type, else "hf-config"; escaped and cut as
  /// ModelSpec::name.
  std::string name;
  std::optional<std::size_t> num_layers;
  std::optional<std::size_t> num_kv_heads;
  std::optional<std::size_t> head_dim;
  std::optional<std::size_t> max_position_embeddings;
  /// A hybrid model's specs, one per layer (see read_hf_layers in
  /// hf_layers.hpp); empty when every layer is full attention of one shape.
  std::vector<LayerSpec> layers;
};

/// Reads the KV-cache shape out of config.json text:
///   num_hidden_layers; num_key_value_heads (default num_attention_heads);
///   head_dim, else hidden_size / num_attention_heads; and, for the
///   architectures whose layers differ (docs/cli.md lists them), the layers'
///   kinds: MLA (kv_lora_rank), sliding window (layer_types, a pattern or
///   sliding_window), chunked attention, linear attention and Mamba state.
/// A multimodal config that nests its language model under "text_config" is
/// read from there whenever text_config holds any field that shapes the cache
/// (even when the top level repeats num_hidden_layers), with the shaping
/// fields only the top level holds (torch_dtype) added. Fields that are absent
/// or null stay empty. Throws InvalidArgument naming `source` when the text is
/// empty, not JSON (a NUL byte included), nested deeper than kMaxHfConfigDepth
/// or not an object, when the top level and text_config give one shaping field
/// different values (the line names the field and both values), when
/// a field has the wrong type or a value <= 0, when num_hidden_layers exceeds
/// kMaxModelLayers, when hidden_size is not a multiple of
/// num_attention_heads, and when the layers cannot be read: an unknown
/// layer_types value, lists whose length is not num_hidden_layers,
/// contradicting fields, or a field that changes the cache's shape
/// (kv_lora_rank, ssm_*, mamba_*, linear_*, ...) on an architecture kvport
/// does not read it for. Only the keys it reads are kept in memory.
HfConfigFields parse_hf_config(std::string_view json_text, std::string_view source);

/// Reads and parses the file at `path` (see parse_hf_config). Throws
/// InvalidArgument when the file is missing, unreadable or a directory, or is
/// larger than kMaxHfConfigBytes (a regular file is refused before it is read;
/// a pipe or device is read up to the limit). A FIFO without a writer reads as
/// empty instead of blocking.
HfConfigFields load_hf_config(const std::filesystem::path& path);

/// Model values given as flags; each one overrides the preset or config.
struct ModelOverrides {
  std::optional<std::string> preset;               ///< --model
  std::optional<std::filesystem::path> hf_config;  ///< --hf-config
  std::optional<std::size_t> num_layers;           ///< --layers
  std::optional<std::size_t> num_kv_heads;         ///< --kv-heads
  std::optional<std::size_t> head_dim;             ///< --head-dim (K and V)
  std::optional<std::size_t> head_dim_k;           ///< --head-dim-k
  std::optional<std::size_t> head_dim_v;           ///< --head-dim-v
};

/// Combines a preset or an HF config with the flag overrides. With neither a
/// preset nor a config, `default_preset` (when not empty) is the base. Throws
/// InvalidArgument when both a preset and a config are given, when --head-dim
/// is combined with --head-dim-k/--head-dim-v, when a shape flag would
/// override a hybrid model (its layers differ: one value cannot replace
/// theirs), or when a value is still missing (the message lists the missing
/// flags). The caller checks the flags' values
/// against kMaxModelLayers (CacheShapeOptions::resolve, after the overflow
/// check of the block's bytes).
ModelSpec resolve_model_spec(const ModelOverrides& overrides, std::string_view default_preset = {});

}  // namespace kvport::cli
