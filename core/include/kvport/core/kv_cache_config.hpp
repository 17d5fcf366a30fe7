// SPDX-License-Identifier: Apache-2.0
// KvCacheConfig: the shape of a paged KV cache, with validation and byte math.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string_view>
#include <vector>

#include "kvport/core/dtype.hpp"

namespace kvport {

/// Where the blocks of the layers live.
enum class KvCacheLayout : std::uint8_t {
  /// One K pool and one V pool per layer (the reference's layout, vLLM's).
  layer_major,
  /// One pool; block b holds every layer's K and V contiguously
  /// (TensorRT-LLM's), so zeroing a run of blocks is a single region.
  block_major,
};

std::string_view to_string(KvCacheLayout layout) noexcept;

struct KvCacheConfig {
  std::size_t num_layers = 0;
  std::size_t block_size = 16;  ///< tokens per block
  std::size_t num_kv_heads = 0;
  std::size_t head_dim_k = 0;
  /// 0: the layers keep K only, no V (MLA's latent, a state slot): no V
  /// pools, no V regions (docs/formats.md, "K-only layers").
  std::size_t head_dim_v = 0;
  KvCacheDtype dtype = KvCacheDtype::bf16;
  /// Per-layer dtype override (mixed precision). Empty: every layer uses
  /// `dtype`; otherwise exactly num_layers entries.
  std::vector<KvCacheDtype> layer_dtypes;
  KvCacheLayout layout = KvCacheLayout::layer_major;

  /// Whether the layers have a V part (head_dim_v > 0).
  bool has_v() const noexcept { return head_dim_v != 0; }

  /// Throws InvalidArgument naming the field when: a size other than
  /// head_dim_v is zero,
  /// layer_dtypes has a length other than num_layers, a packed dtype's group
  /// does not divide head_dim_k/head_dim_v, or a byte size overflows size_t.
  void validate() const;

  /// The dtype of `layer` (layer_dtypes[layer] or dtype). Throws
  /// OutOfRange for layer >= num_layers.
  KvCacheDtype dtype_for_layer(std::size_t layer) const;

  /// Number of layers whose dtype differs from `dtype` (0 when uniform).
  std::size_t num_override_layers() const noexcept;

  /// Layout of layer `layer`'s K / V region of one block (V: all zero when
  /// the layers have no V).
  BlockRegionLayout k_layout(std::size_t layer) const;
  BlockRegionLayout v_layout(std::size_t layer) const;

  /// Bytes of one block of one layer, K and V separately.
  std::size_t k_block_bytes(std::size_t layer) const { return k_layout(layer).total_bytes; }
  std::size_t v_block_bytes(std::size_t layer) const { return v_layout(layer).total_bytes; }

  /// Bytes of one block across all layers, K + V (K alone for K-only
  /// layers). This is what one block id costs; `compute_num_blocks` divides
  /// a budget by it. Checked for overflow.
  std::size_t bytes_per_block() const;
};

}  // namespace kvport
