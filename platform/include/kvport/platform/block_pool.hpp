// Block pools: equally spaced block regions a KV cache is made of, and a set
// of them registered with a backend for batched block fills
// (Backend::register_block_pools, Backend::fill_blocks_async).
#pragma once

#include <cstddef>
#include <utility>

#include "kvport/platform/device_ptr.hpp"

namespace kvport {

class Backend;

/// A pool of equally spaced block regions: block b's region is
/// [base + b * stride, + bytes). A KV cache is a few of these (one K and one V
/// pool per layer, or one pool in block-major layout).
struct BlockPool {
  DevicePtr base;
  std::size_t bytes = 0;   ///< region size, > 0
  std::size_t stride = 0;  ///< distance between blocks, >= bytes
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
