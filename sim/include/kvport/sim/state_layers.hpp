// SPDX-License-Identifier: Apache-2.0
// The per-request state of recurrent layers (Mamba1, Mamba2, Gated DeltaNet)
// as LayerSpecs: the tensor shapes vLLM allocates for them (its
// mamba_utils.py), written once for the model presets and the config reader.
#pragma once

#include <cstddef>

#include "kvport/core/layer_spec.hpp"

namespace kvport::sim {

/// Mamba2 (Nemotron-H, Granite 4): per layer a convolution state
/// "conv" [heads * head_dim + 2 * groups * state_size, conv_kernel - 1] and an
/// SSM state "ssm" [heads, head_dim, state_size].
struct Mamba2Shape {
  std::size_t num_heads = 0;
  std::size_t head_dim = 0;
  std::size_t state_size = 0;
  std::size_t num_groups = 0;
  std::size_t conv_kernel = 0;
};

/// Mamba1 (Jamba): "conv" [intermediate, conv_kernel - 1] and "ssm"
/// [intermediate, state_size], intermediate = expand * hidden_size.
struct Mamba1Shape {
  std::size_t intermediate_size = 0;
  std::size_t state_size = 0;
  std::size_t conv_kernel = 0;
};

/// Gated DeltaNet (Qwen3-Next's linear attention): "conv"
/// [2 * key_heads * key_dim + value_heads * value_dim, conv_kernel - 1] and
/// "recurrent" [value_heads, key_dim, value_dim].
struct GatedDeltaNetShape {
  std::size_t num_key_heads = 0;
  std::size_t num_value_heads = 0;
  std::size_t key_dim = 0;
  std::size_t value_dim = 0;
  std::size_t conv_kernel = 0;
};

/// The state layer of each shape: the conv tensor first, then the SSM
/// (recurrent) one, in `conv` and `ssm` dtypes. Throws InvalidArgument naming
/// the field when a size is 0, conv_kernel < 2 (no history to keep), or a
/// dimension overflows.
LayerSpec mamba2_state_layer(const Mamba2Shape& shape, StateDtype conv, StateDtype ssm);
LayerSpec mamba1_state_layer(const Mamba1Shape& shape, StateDtype conv, StateDtype ssm);
LayerSpec gated_delta_net_state_layer(const GatedDeltaNetShape& shape, StateDtype conv,
                                      StateDtype ssm);

}  // namespace kvport::sim
