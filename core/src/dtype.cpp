// SPDX-License-Identifier: Apache-2.0
#include "kvport/core/dtype.hpp"

#include <fmt/format.h>

#include <array>
#include <limits>

#include "kvport/platform/error.hpp"
#include "kvport/platform/size_math.hpp"

namespace kvport {
namespace {

constexpr std::array kAllDtypes{
    KvCacheDtype::f16,      KvCacheDtype::bf16,   KvCacheDtype::fp8_e4m3,
    KvCacheDtype::fp8_e5m2, KvCacheDtype::nvfp4,  KvCacheDtype::turbo2,
    KvCacheDtype::turbo3,   KvCacheDtype::turbo4, KvCacheDtype::turbo8,
};

// a * b, throwing InvalidArgument naming `what` on overflow.
std::size_t checked_mul(std::size_t a, std::size_t b, std::string_view what) {
  if (mul_overflows(a, b)) {
    throw InvalidArgument(
        fmt::format("KvCacheConfig: {}: byte size overflows ({} * {})", what, a, b));
  }
  return a * b;
}

std::size_t checked_add(std::size_t a, std::size_t b, std::string_view what) {
  if (add_overflows(a, b)) {
    throw InvalidArgument(
        fmt::format("KvCacheConfig: {}: byte size overflows ({} + {})", what, a, b));
  }
  return a + b;
}

std::size_t padding_to(std::size_t bytes, std::size_t alignment) {
  return (alignment - bytes % alignment) % alignment;
}

}  // namespace

std::span<const KvCacheDtype> all_dtypes() noexcept {
  return kAllDtypes;
}

std::string_view to_string(KvCacheDtype dtype) noexcept {
  switch (dtype) {
    case KvCacheDtype::f16:
      return "f16";
    case KvCacheDtype::bf16:
      return "bf16";
    case KvCacheDtype::fp8_e4m3:
      return "fp8_e4m3";
    case KvCacheDtype::fp8_e5m2:
      return "fp8_e5m2";
    case KvCacheDtype::nvfp4:
      return "nvfp4";
    case KvCacheDtype::turbo2:
      return "turbo2";
    case KvCacheDtype::turbo3:
      return "turbo3";
    case KvCacheDtype::turbo4:
      return "turbo4";
    case KvCacheDtype::turbo8:
      return "turbo8";
  }
  return "unknown";
}

std::optional<KvCacheDtype> parse_dtype(std::string_view name) noexcept {
  for (KvCacheDtype d : kAllDtypes) {
    if (to_string(d) == name) return d;
  }
  if (name == "fp16" || name == "float16" || name == "half") return KvCacheDtype::f16;
  if (name == "bfloat16") return KvCacheDtype::bf16;
  if (name == "fp8") return KvCacheDtype::fp8_e4m3;
  return std::nullopt;
}

unsigned bits_per_element(KvCacheDtype dtype) noexcept {
  switch (dtype) {
    case KvCacheDtype::f16:
    case KvCacheDtype::bf16:
      return 16;
    case KvCacheDtype::fp8_e4m3:
    case KvCacheDtype::fp8_e5m2:
    case KvCacheDtype::turbo8:
      return 8;
    case KvCacheDtype::nvfp4:
    case KvCacheDtype::turbo4:
      return 4;
    case KvCacheDtype::turbo3:
      return 3;
    case KvCacheDtype::turbo2:
      return 2;
  }
  return 0;
}

std::size_t element_group(KvCacheDtype dtype) noexcept {
  switch (dtype) {
    case KvCacheDtype::nvfp4:
      return 16;  // one E4M3 scale per 16 elements
    case KvCacheDtype::turbo2:
      return 4;  // 4 x 2 bits = 1 byte
    case KvCacheDtype::turbo3:
      return 8;  // 8 x 3 bits = 3 bytes
    case KvCacheDtype::turbo4:
      return 2;  // 2 x 4 bits = 1 byte
    default:
      return 1;
  }
}

bool has_scales(KvCacheDtype dtype) noexcept {
  switch (dtype) {
    case KvCacheDtype::nvfp4:
    case KvCacheDtype::turbo2:
    case KvCacheDtype::turbo3:
    case KvCacheDtype::turbo4:
    case KvCacheDtype::turbo8:
      return true;
    default:
      return false;
  }
}

BlockRegionLayout block_region_layout(KvCacheDtype dtype, std::size_t block_size,
                                      std::size_t num_kv_heads, std::size_t head_dim,
                                      std::string_view what) {
  if (block_size == 0) throw InvalidArgument("KvCacheConfig: block_size must be > 0");
  if (num_kv_heads == 0) throw InvalidArgument("KvCacheConfig: num_kv_heads must be > 0");
  if (head_dim == 0) throw InvalidArgument(fmt::format("KvCacheConfig: {} must be > 0", what));
  const std::size_t group = element_group(dtype);
  if (head_dim % group != 0) {
    throw InvalidArgument(
        fmt::format("KvCacheConfig: {} = {} is not a multiple of {}, the element group of dtype {}",
                    what, head_dim, group, to_string(dtype)));
  }
  const std::size_t vectors = checked_mul(block_size, num_kv_heads, what);  // token-head vectors
  const std::size_t elements = checked_mul(vectors, head_dim, what);
  // elements * bits / 8, exact because head_dim is a multiple of the group.
  const std::size_t data_bits = checked_mul(elements, bits_per_element(dtype), what);

  BlockRegionLayout l;
  l.data_bytes = data_bits / 8;
  l.data_padding = padding_to(l.data_bytes, kRegionAlignment);
  l.scale_offset = checked_add(l.data_bytes, l.data_padding, what);
  switch (dtype) {
    case KvCacheDtype::nvfp4:
      l.scale_bytes = elements / 16;
      break;
    case KvCacheDtype::turbo2:
    case KvCacheDtype::turbo3:
    case KvCacheDtype::turbo4:
    case KvCacheDtype::turbo8:
      l.scale_bytes = checked_mul(vectors, 2, what);
      break;
    default:
      l.scale_bytes = 0;
      break;
  }
  l.scale_padding = padding_to(l.scale_bytes, kRegionAlignment);
  l.total_bytes =
      checked_add(checked_add(l.scale_offset, l.scale_bytes, what), l.scale_padding, what);
  return l;
}

}  // namespace kvport
