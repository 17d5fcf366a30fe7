// SPDX-License-Identifier: Apache-2.0
// KV-cache element formats and their byte formulas.
//
// Every block of every layer stores, for K and for V separately:
//
//   [ data | pad to 16 B | scales | pad to 16 B ]
//
// with E = block_size * num_kv_heads * head_dim elements:
//
//   dtype      data bytes   scale bytes             group (must divide head_dim)
//   f16, bf16  2E           0                       1
//   fp8_*      E            0                       1
//   nvfp4      E/2          E/16  (E4M3 per 16 el.) 16
//   turboN     E*N/8        2 * block_size * heads  8/gcd(8,N) (2:4, 3:8, 4:2, 8:1)
//                           (one fp16 per token-head vector)
//
// docs/formats.md has the derivation and worked examples.
#pragma once

#include <cstddef>
#include <cstdint>
#include <optional>
#include <span>
#include <string_view>

namespace kvport {

enum class KvCacheDtype : std::uint8_t {
  f16,
  bf16,
  fp8_e4m3,
  fp8_e5m2,
  nvfp4,
  turbo2,
  turbo3,
  turbo4,
  turbo8,
};

/// Every dtype, in declaration order.
std::span<const KvCacheDtype> all_dtypes() noexcept;

/// "f16", "bf16", "fp8_e4m3", "fp8_e5m2", "nvfp4", "turbo2", ... .
std::string_view to_string(KvCacheDtype dtype) noexcept;

/// Parses the names of `to_string` (also "fp16", "float16", "bfloat16",
/// "fp8" = fp8_e4m3). Returns nullopt for an unknown name.
std::optional<KvCacheDtype> parse_dtype(std::string_view name) noexcept;

/// Bits per stored element (16, 8, 4, 2, 3, ...).
unsigned bits_per_element(KvCacheDtype dtype) noexcept;

/// Elements of a head_dim that are packed together: head_dim must be a
/// multiple of it (16 for nvfp4 scale groups, 8 for turbo3, ...).
std::size_t element_group(KvCacheDtype dtype) noexcept;

/// Whether the dtype stores scales inside the block (nvfp4, turboN).
bool has_scales(KvCacheDtype dtype) noexcept;

/// Alignment of the data and scale regions inside a block, in bytes.
inline constexpr std::size_t kRegionAlignment = 16;

/// Byte layout of the K (or V) part of one block of one layer.
struct BlockRegionLayout {
  std::size_t data_bytes = 0;     ///< packed element bytes
  std::size_t data_padding = 0;   ///< zero bytes after the data, to kRegionAlignment
  std::size_t scale_offset = 0;   ///< = data_bytes + data_padding
  std::size_t scale_bytes = 0;    ///< 0 for dtypes without scales
  std::size_t scale_padding = 0;  ///< zero bytes after the scales
  std::size_t total_bytes = 0;    ///< the region's size in the pool

  friend bool operator==(const BlockRegionLayout&, const BlockRegionLayout&) = default;
};

/// Computes the layout of one K or V block region. Throws InvalidArgument
/// when a size is zero, head_dim is not a multiple of the dtype's group, or a
/// byte count overflows size_t; the message names `what` (e.g. "head_dim_k").
BlockRegionLayout block_region_layout(KvCacheDtype dtype, std::size_t block_size,
                                      std::size_t num_kv_heads, std::size_t head_dim,
                                      std::string_view what = "head_dim");

}  // namespace kvport
