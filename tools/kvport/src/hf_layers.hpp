// SPDX-License-Identifier: Apache-2.0
// The per-layer KV specs of a Hugging Face config.json: one reader per
// architecture whose layers differ (MLA, sliding window, chunked attention,
// linear attention, Mamba), and the rule that a field which changes the
// cache's shape is never ignored.
#pragma once

#include <cstddef>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "hf_fields.hpp"
#include "kvport/core/layer_spec.hpp"

namespace kvport::cli {

/// Whether parse_hf_config keeps `key` for the layer readers (in the model's
/// object: the top level or "text_config").
bool is_layer_key(std::string_view key);

/// Whether `key` belongs to a family of fields that change the cache's shape
/// on the architectures that own them (ssm_*, mamba_*, linear_*): seen but
/// not kept, such a key is still recorded so that a config of another
/// architecture that has one is refused.
bool is_shape_family_key(std::string_view key);

/// What the readers get: the model's object and what parse_hf_config already
/// read from it.
struct HfModelView {
  HfFields fields;
  std::string model_type;                           ///< "" when the config has none
  std::span<const std::string> unkept_family_keys;  ///< is_shape_family_key names not kept
  std::optional<std::size_t> num_layers;
  std::optional<std::size_t> num_kv_heads;
  std::optional<std::size_t> head_dim;
};

/// One LayerSpec per layer (attention K/V and MLA latents bf16, state in the
/// model dtype or the config's mamba_ssm_cache_dtype), or empty when every
/// layer is full attention of one shape: the plain reading, whose missing
/// fields flags may still give. Throws InvalidArgument, one line naming the
/// config and the field, for a field of a shape-changing family on an
/// architecture that does not own it, an unknown layer_types value, lengths
/// that differ from num_hidden_layers, contradicting fields, and a field a
/// hybrid architecture needs that is missing.
std::vector<LayerSpec> read_hf_layers(const HfModelView& model);

}  // namespace kvport::cli
