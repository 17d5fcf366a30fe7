// SPDX-License-Identifier: Apache-2.0
// LayerSpec: what one model layer keeps in the KV cache (full attention, MLA,
// sliding window, chunked local attention, recurrent state, or nothing), and
// KvCacheGroup: the layers of one spec, which share one block pool.
//
// Byte formulas (docs/formats.md, docs/hybrid-models.md):
//   full / window / chunked   K and V regions of block_region_layout (dtype.hpp)
//   MLA plain                 one latent of (kv_lora_rank + rope_dim) values of
//                             `dtype` per token, no V
//   MLA fp8_ds_mla            per token: kv_lora_rank fp8 values, one fp32 scale
//                             per 128 of them, rope_dim bf16 values (656 B for
//                             DeepSeek-V3: 512 + 16 + 128), no V
//   state                     per request: every state tensor, each padded to
//                             kRegionAlignment, one after the other
#pragma once

#include <cstddef>
#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "kvport/core/dtype.hpp"
#include "kvport/core/kv_cache_config.hpp"

namespace kvport {

/// What a layer keeps per token (attention kinds) or per request (state).
enum class LayerKind : std::uint8_t {
  full_attention,  ///< K and V of every token
  mla,             ///< one latent vector per token (DeepSeek's multi-head latent attention)
  sliding_window,  ///< K and V of the last `window` tokens
  chunked_local,   ///< K and V of the tokens of the current chunk of `chunk` tokens
  state,           ///< a fixed per-request state (linear attention, Mamba)
  none,            ///< no KV (an MLP-only layer)
};

/// "full_attention", "mla_attention", "sliding_window", "chunked_local",
/// "mamba" (the names vLLM's KV events use where it has one), "none".
std::string_view to_string(LayerKind kind) noexcept;

/// Parses the names of `to_string` (also "mla", "state"). nullopt if unknown.
std::optional<LayerKind> parse_layer_kind(std::string_view name) noexcept;

/// Element types of recurrent state (fp32 is usual for SSM state).
enum class StateDtype : std::uint8_t { f32, f16, bf16 };

/// "f32", "f16", "bf16".
std::string_view to_string(StateDtype dtype) noexcept;
/// Parses "f32"/"float32"/"fp32", "f16"/"float16"/"fp16", "bf16"/"bfloat16".
std::optional<StateDtype> parse_state_dtype(std::string_view name) noexcept;
/// 4, 2 or 2.
std::size_t state_dtype_bytes(StateDtype dtype) noexcept;

/// One tensor of a layer's per-request state, e.g. Mamba2's SSM state
/// [heads, head_dim, state_size] or its convolution state [channels, kernel - 1].
struct StateTensor {
  std::string name;
  std::vector<std::size_t> shape;
  StateDtype dtype = StateDtype::f32;

  /// Product of `shape`. Throws InvalidArgument on overflow, an empty shape
  /// or a 0 dimension (naming the tensor and the dimension's index).
  std::size_t num_elements() const;
  /// num_elements() * element bytes, unpadded (overflow-checked).
  std::size_t bytes() const;

  friend bool operator==(const StateTensor&, const StateTensor&) = default;
};

/// The in-cache format of an MLA latent.
enum class MlaFormat : std::uint8_t {
  /// (kv_lora_rank + rope_dim) values of the layer's dtype.
  plain,
  /// vLLM's fp8_ds_mla: kv_lora_rank fp8 e4m3 values, kv_lora_rank / 128 fp32
  /// scales, rope_dim bf16 values (656 B per token for 512 + 64).
  fp8_ds_mla,
};

/// "plain", "fp8_ds_mla".
std::string_view to_string(MlaFormat format) noexcept;

/// The KV geometry of one layer. Build one with the named constructors; the
/// fields a kind does not use stay 0 / empty and are ignored by equality.
struct LayerSpec {
  LayerKind kind = LayerKind::full_attention;
  // Attention kinds (full, sliding_window, chunked_local).
  std::size_t num_kv_heads = 0;
  std::size_t head_dim_k = 0;
  std::size_t head_dim_v = 0;
  /// Element dtype of attention K/V and of a plain MLA latent.
  KvCacheDtype dtype = KvCacheDtype::bf16;
  std::size_t window = 0;  ///< sliding_window: tokens attended (the token itself included)
  std::size_t chunk = 0;   ///< chunked_local: tokens per chunk
  // MLA.
  std::size_t kv_lora_rank = 0;
  std::size_t rope_dim = 0;
  MlaFormat mla_format = MlaFormat::plain;
  // state.
  std::vector<StateTensor> state;

  static LayerSpec full_attention(std::size_t num_kv_heads, std::size_t head_dim_k,
                                  std::size_t head_dim_v, KvCacheDtype dtype = KvCacheDtype::bf16);
  static LayerSpec sliding_window(std::size_t window, std::size_t num_kv_heads,
                                  std::size_t head_dim_k, std::size_t head_dim_v,
                                  KvCacheDtype dtype = KvCacheDtype::bf16);
  static LayerSpec chunked_local(std::size_t chunk, std::size_t num_kv_heads,
                                 std::size_t head_dim_k, std::size_t head_dim_v,
                                 KvCacheDtype dtype = KvCacheDtype::bf16);
  static LayerSpec mla(std::size_t kv_lora_rank, std::size_t rope_dim,
                       KvCacheDtype dtype = KvCacheDtype::bf16,
                       MlaFormat format = MlaFormat::plain);
  static LayerSpec recurrent_state(std::vector<StateTensor> tensors);
  static LayerSpec no_kv();

  /// True for the kinds that keep KV per token in blocks (full, MLA, window,
  /// chunked).
  bool has_blocks() const noexcept;
  bool has_state() const noexcept { return kind == LayerKind::state; }

  /// Throws InvalidArgument naming the field when a size the kind needs is
  /// zero, a packed dtype's group does not divide a head dim, a window or
  /// chunk is zero, a chunk is not a multiple of `block_size` (chunk
  /// boundaries must fall on block boundaries), an fp8_ds_mla rank is not a
  /// multiple of 128, a state has no tensor, two state tensors of one name
  /// (the message names it), a tensor with an empty shape or a 0 dimension
  /// (the message names the tensor and the dimension), or a byte count
  /// overflows. Cost: O(tensors^2) name comparisons for a state layer.
  void validate(std::size_t block_size) const;

  /// The pool config of `num_layers` layers of this spec (has_blocks() or
  /// has_state() only; InvalidArgument otherwise). Attention kinds: today's
  /// config. MLA: one "head" of the latent, no V (head_dim_v 0); fp8_ds_mla
  /// is held as opaque bytes (dtype fp8_e4m3, one byte an element). State: one
  /// block is one request's state (block_size 1), opaque bytes of
  /// state_bytes() (dtype fp8_e4m3), no V.
  KvCacheConfig pool_config(std::size_t num_layers, std::size_t block_size,
                            KvCacheLayout layout = KvCacheLayout::layer_major) const;

  /// Bytes of one block of one layer (K + V regions, scales and padding
  /// included); 0 for state and none.
  std::size_t block_bytes(std::size_t block_size) const;

  /// Bytes one token costs in one layer, without block padding: K + V data
  /// and scales (attention), the latent (MLA); 0 for state and none. For
  /// dtypes whose scales are per block this is block_bytes / block_size
  /// rounded up.
  std::size_t token_bytes(std::size_t block_size) const;

  /// Bytes of one request's state in one layer: every tensor padded to
  /// kRegionAlignment; 0 for the other kinds.
  std::size_t state_bytes() const;

  /// Offset of state tensor `i` inside the state region (padded sums).
  /// OutOfRange for i >= state.size() (and for a layer without state).
  std::size_t state_offset(std::size_t i) const;

  /// One line: "sliding_window(128) 8x64 bf16" (K/V head dims written
  /// "8x192/128" when they differ), "mla(512+64) bf16",
  /// "state(ssm 128x64x128 f32, conv 9216x3 f32)", "none".
  std::string describe() const;

  /// This layer as a runtime without groups holds it: a sliding-window or
  /// chunked layer as full attention of the same heads and dtype; the other
  /// kinds unchanged.
  LayerSpec as_full_attention() const;

  /// Whether two layers can share one pool: same kind and shape; the dtype of
  /// attention layers may differ (a group's pool keeps per-layer dtypes, as
  /// KvCacheConfig::layer_dtypes does).
  bool same_group_as(const LayerSpec& other) const noexcept;

  friend bool operator==(const LayerSpec&, const LayerSpec&) = default;
};

/// The layers of one spec. Every layer of a group is in its pool, in model
/// order; layer i of the model is the group's layer `index_of(i)`.
struct KvCacheGroup {
  LayerSpec spec;                          ///< of the group's first layer
  std::vector<std::size_t> layers;         ///< model layer indices, ascending
  std::vector<KvCacheDtype> layer_dtypes;  ///< one per layer (attention and plain MLA)
};

/// Groups `layers` by LayerSpec::same_group_as, in order of each group's first
/// layer; `none` layers belong to no group. With max_layers_per_group > 0, a
/// group that has that many layers is full and the next layer of its spec
/// starts a new group (vLLM's split of a model's layers into groups of equal
/// layer count, so that their pages can share one pool: shared_group_layers
/// in kv_cache_plan.hpp). Validates each spec. Throws InvalidArgument for an
/// empty list or a list of only `none` layers.
std::vector<KvCacheGroup> group_layers(std::span<const LayerSpec> layers, std::size_t block_size,
                                       std::size_t max_layers_per_group = 0);

/// The pool config of `group`: LayerSpec::pool_config with the group's layer
/// count and per-layer dtypes.
KvCacheConfig group_pool_config(const KvCacheGroup& group, std::size_t block_size,
                                KvCacheLayout layout = KvCacheLayout::layer_major);

/// Every layer of `config` as a full-attention LayerSpec (today's models).
std::vector<LayerSpec> layer_specs_of(const KvCacheConfig& config);

}  // namespace kvport
