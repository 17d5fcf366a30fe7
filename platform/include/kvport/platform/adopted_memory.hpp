// SPDX-License-Identifier: Apache-2.0
// AdoptedMemory: memory an engine allocated (a PyTorch tensor, a cudaMalloc of
// its own), registered with a backend so that kvport's calls address it.
#pragma once

#include <cstddef>
#include <utility>

#include "kvport/platform/device_ptr.hpp"

namespace kvport {

class Backend;

/// A registration of `size()` bytes at `ptr()` with one backend
/// (Backend::adopt_memory): while it lives, every backend call accepts ranges
/// inside it as it accepts memory from alloc(), with the same range checks.
/// kvport never frees the memory: Backend::free on it is refused (false,
/// logged), and neither this registration's destruction nor the backend's
/// releases it. Move-only. Destruction forgets the range (noexcept); work
/// still queued on it that runs later fails as a use after free on the host
/// backend, so finish it first (the caller owns the memory's lifetime).
class AdoptedMemory {
 public:
  AdoptedMemory() noexcept = default;
  AdoptedMemory(AdoptedMemory&& other) noexcept { swap(other); }
  AdoptedMemory& operator=(AdoptedMemory&& other) noexcept {
    AdoptedMemory(std::move(other)).swap(*this);
    return *this;
  }
  AdoptedMemory(const AdoptedMemory&) = delete;
  AdoptedMemory& operator=(const AdoptedMemory&) = delete;
  /// Forgets the registration; the memory stays the caller's. Never throws.
  ~AdoptedMemory();

  DevicePtr ptr() const noexcept { return ptr_; }
  std::size_t size() const noexcept { return bytes_; }
  Backend* backend() const noexcept { return backend_; }

  void swap(AdoptedMemory& other) noexcept {
    std::swap(backend_, other.backend_);
    std::swap(ptr_, other.ptr_);
    std::swap(bytes_, other.bytes_);
  }

 private:
  friend class Backend;
  AdoptedMemory(Backend* backend, DevicePtr ptr, std::size_t bytes) noexcept
      : backend_(backend), ptr_(ptr), bytes_(bytes) {}

  Backend* backend_ = nullptr;
  DevicePtr ptr_;
  std::size_t bytes_ = 0;
};

}  // namespace kvport
