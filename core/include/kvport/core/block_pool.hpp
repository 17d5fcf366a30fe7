// SPDX-License-Identifier: Apache-2.0
// BlockPool: where one layer's K (or V) bytes of every block are. The
// vocabulary of block geometry; PagedKvCache::pool() hands these out, and
// block_regions.hpp turns block ids into byte regions over them.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string_view>

#include "kvport/core/block_id.hpp"
#include "kvport/core/dtype.hpp"
#include "kvport/platform/block_pool.hpp"
#include "kvport/platform/device_ptr.hpp"
#include "kvport/platform/device_region.hpp"

namespace kvport {

/// Which part of a layer's KV data: K, or V (which K-only layers lack).
enum class KvPart : std::uint8_t { k, v };

/// Both parts, in the order a block's bytes hold them (K before V).
inline constexpr KvPart kKvParts[] = {KvPart::k, KvPart::v};

/// "K" or "V".
std::string_view to_string(KvPart part) noexcept;

/// `num_blocks` equally spaced block regions of one dtype: block b's region
/// is [base + b * stride, + region_bytes). A layer's K (or V) pool in
/// layer-major layout has stride == region_bytes; in block-major layout the
/// stride is the whole block (every layer's K and V) and the pools of all
/// layers interleave in one allocation. A plain value: it owns nothing.
struct BlockPool {
  DevicePtr base;                ///< block 0's region
  std::size_t region_bytes = 0;  ///< bytes of one block's region
  std::size_t stride = 0;        ///< bytes between consecutive blocks, >= region_bytes
  std::size_t num_blocks = 0;
  KvCacheDtype dtype = KvCacheDtype::bf16;

  /// Block `block`'s region: (base + block * stride, region_bytes). O(1).
  /// Throws OutOfRange for block >= num_blocks, InvalidArgument for an address that
  /// overflows.
  DeviceRegion region(BlockId block) const;

  /// Bytes from block 0's first byte to the last block's last byte:
  /// (num_blocks - 1) * stride + region_bytes (pool_extent, the one
  /// implementation of the formula); 0 without blocks. Throws InvalidArgument
  /// when it overflows size_t.
  std::size_t extent() const;

  /// Whether consecutive blocks' regions touch (stride == region_bytes), so a
  /// run of consecutive ids is one region.
  bool dense() const noexcept { return stride == region_bytes; }

  /// The geometry a backend registers (base, region size, stride).
  PoolGeometry geometry() const noexcept { return {base, region_bytes, stride}; }

  friend bool operator==(const BlockPool&, const BlockPool&) noexcept = default;
};

}  // namespace kvport
