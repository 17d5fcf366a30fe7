// SPDX-License-Identifier: Apache-2.0
// Block pool geometry: equally spaced block regions, the one formula for
// their extent, and a set of pools registered with a backend for batched
// block fills (Backend::register_block_pools, Backend::fill_blocks_async).
#pragma once

#include <cstddef>
#include <optional>
#include <utility>

#include "kvport/platform/device_ptr.hpp"

namespace kvport {

class Backend;

/// Bytes from the first byte of block 0 to the last byte of block
/// num_blocks - 1 of a pool whose block b is [b * stride, + region_bytes):
/// (num_blocks - 1) * stride + region_bytes, 0 for no blocks. nullopt when it
/// overflows size_t. The one implementation of the extent formula: backends,
/// core's PoolGeometry and the transfer agent all use it.
constexpr std::optional<std::size_t> pool_extent(std::size_t num_blocks, std::size_t stride,
                                                 std::size_t region_bytes) noexcept {
  if (num_blocks == 0) return std::size_t{0};
  std::size_t last = 0;
  std::size_t extent = 0;
  if (__builtin_mul_overflow(num_blocks - 1, stride, &last) ||
      __builtin_add_overflow(last, region_bytes, &extent)) {
    return std::nullopt;
  }
  return extent;
}

/// Where a pool's block regions are: block b's region is
/// [base + b * stride, + bytes). What a backend registers for fills (a KV
/// cache is a few of these: one K and one V pool per layer, or one pool in
/// block-major layout); core's PoolGeometry adds the block count and the dtype.
struct PoolGeometry {
  DevicePtr base;
  std::size_t bytes = 0;   ///< region size, > 0
  std::size_t stride = 0;  ///< distance between blocks, >= bytes

  /// pool_extent(num_blocks, stride, bytes).
  constexpr std::optional<std::size_t> extent(std::size_t num_blocks) const noexcept {
    return pool_extent(num_blocks, stride, bytes);
  }

  friend constexpr bool operator==(const PoolGeometry&, const PoolGeometry&) noexcept = default;
};

/// Block pools registered with a backend for `fill_blocks_async`. On GPUs the
/// pool table lives on the device, so a fill uploads only block ids. Move-only;
/// unregisters on destruction; must not outlive its backend nor the memory its
/// pools describe.
class BlockPoolSet {
 public:
  BlockPoolSet() noexcept = default;
  BlockPoolSet(BlockPoolSet&& other) noexcept { swap(other); }
  BlockPoolSet& operator=(BlockPoolSet&& other) noexcept {
    BlockPoolSet(std::move(other)).swap(*this);
    return *this;
  }
  BlockPoolSet(const BlockPoolSet&) = delete;
  BlockPoolSet& operator=(const BlockPoolSet&) = delete;
  ~BlockPoolSet();

  Backend* backend() const noexcept { return backend_; }
  void* native() const noexcept { return native_; }
  std::size_t num_blocks() const noexcept { return num_blocks_; }
  std::size_t num_pools() const noexcept { return num_pools_; }
  /// Whether every pool's stride equals its region size, so that runs of
  /// consecutive block ids are one contiguous region per pool.
  bool dense() const noexcept { return dense_; }

  void swap(BlockPoolSet& other) noexcept {
    std::swap(backend_, other.backend_);
    std::swap(native_, other.native_);
    std::swap(num_blocks_, other.num_blocks_);
    std::swap(num_pools_, other.num_pools_);
    std::swap(dense_, other.dense_);
  }

 private:
  friend class Backend;
  Backend* backend_ = nullptr;
  void* native_ = nullptr;
  std::size_t num_blocks_ = 0;
  std::size_t num_pools_ = 0;
  bool dense_ = false;
};

}  // namespace kvport
