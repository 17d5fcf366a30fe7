// SPDX-License-Identifier: Apache-2.0
#include "kvport/sim/state_layers.hpp"

#include <fmt/format.h>

#include <limits>
#include <string_view>
#include <utility>
#include <vector>

#include "kvport/platform/error.hpp"
#include "kvport/platform/size_math.hpp"

namespace kvport::sim {
namespace {

std::size_t positive(std::size_t value, std::string_view kind, std::string_view field) {
  if (value == 0) throw InvalidArgument(fmt::format("{} state: {} must be > 0", kind, field));
  return value;
}

std::size_t mul(std::size_t a, std::size_t b, std::string_view kind) {
  if (mul_overflows(a, b)) {
    throw InvalidArgument(fmt::format("{} state: a dimension overflows ({} x {})", kind, a, b));
  }
  return a * b;
}

std::size_t add(std::size_t a, std::size_t b, std::string_view kind) {
  if (add_overflows(a, b)) {
    throw InvalidArgument(fmt::format("{} state: a dimension overflows ({} + {})", kind, a, b));
  }
  return a + b;
}

// The convolution keeps the last conv_kernel - 1 inputs.
std::size_t conv_history(std::size_t conv_kernel, std::string_view kind) {
  if (conv_kernel < 2) {
    throw InvalidArgument(
        fmt::format("{} state: the convolution kernel must be >= 2, got {}", kind, conv_kernel));
  }
  return conv_kernel - 1;
}

LayerSpec state_layer(std::size_t conv_channels, std::size_t history, StateDtype conv,
                      std::vector<std::size_t> ssm_shape, std::string ssm_name, StateDtype ssm) {
  std::vector<StateTensor> tensors;
  tensors.push_back(StateTensor{"conv", {conv_channels, history}, conv});
  tensors.push_back(StateTensor{std::move(ssm_name), std::move(ssm_shape), ssm});
  LayerSpec spec = LayerSpec::recurrent_state(std::move(tensors));
  (void)spec.state_bytes();  // overflow of the products
  return spec;
}

}  // namespace

LayerSpec mamba2_state_layer(const Mamba2Shape& s, StateDtype conv, StateDtype ssm) {
  constexpr std::string_view kind = "Mamba2";
  const std::size_t heads = positive(s.num_heads, kind, "num_heads");
  const std::size_t head_dim = positive(s.head_dim, kind, "head_dim");
  const std::size_t state = positive(s.state_size, kind, "state_size");
  const std::size_t groups = positive(s.num_groups, kind, "num_groups");
  const std::size_t history = conv_history(s.conv_kernel, kind);
  const std::size_t channels =
      add(mul(heads, head_dim, kind), mul(mul(2, groups, kind), state, kind), kind);
  return state_layer(channels, history, conv, {heads, head_dim, state}, "ssm", ssm);
}

LayerSpec mamba1_state_layer(const Mamba1Shape& s, StateDtype conv, StateDtype ssm) {
  constexpr std::string_view kind = "Mamba";
  const std::size_t inner = positive(s.intermediate_size, kind, "intermediate_size");
  const std::size_t state = positive(s.state_size, kind, "state_size");
  const std::size_t history = conv_history(s.conv_kernel, kind);
  return state_layer(inner, history, conv, {inner, state}, "ssm", ssm);
}

LayerSpec gated_delta_net_state_layer(const GatedDeltaNetShape& s, StateDtype conv,
                                      StateDtype ssm) {
  constexpr std::string_view kind = "Gated DeltaNet";
  const std::size_t key_heads = positive(s.num_key_heads, kind, "num_key_heads");
  const std::size_t value_heads = positive(s.num_value_heads, kind, "num_value_heads");
  const std::size_t key_dim = positive(s.key_dim, kind, "key_dim");
  const std::size_t value_dim = positive(s.value_dim, kind, "value_dim");
  const std::size_t history = conv_history(s.conv_kernel, kind);
  const std::size_t channels =
      add(mul(mul(2, key_heads, kind), key_dim, kind), mul(value_heads, value_dim, kind), kind);
  return state_layer(channels, history, conv, {value_heads, key_dim, value_dim}, "recurrent", ssm);
}

}  // namespace kvport::sim
