// SPDX-License-Identifier: Apache-2.0
// DeviceBuffer: RAII ownership of one device allocation (Backend::alloc).
#pragma once

#include <cstddef>
#include <utility>

#include "kvport/platform/device_ptr.hpp"

namespace kvport {

class Backend;

/// RAII ownership of one allocation. Move-only; frees in the destructor.
class DeviceBuffer {
 public:
  DeviceBuffer() noexcept = default;
  /// Allocates `bytes` on `backend` (see Backend::alloc for errors).
  DeviceBuffer(Backend& backend, std::size_t bytes);
  DeviceBuffer(DeviceBuffer&& other) noexcept { swap(other); }
  DeviceBuffer& operator=(DeviceBuffer&& other) noexcept {
    DeviceBuffer(std::move(other)).swap(*this);
    return *this;
  }
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;
  /// Frees the allocation (Backend::free, noexcept).
  ~DeviceBuffer();

  DevicePtr ptr() const noexcept { return ptr_; }
  std::size_t size() const noexcept { return bytes_; }
  Backend* backend() const noexcept { return backend_; }

  void swap(DeviceBuffer& other) noexcept {
    std::swap(backend_, other.backend_);
    std::swap(ptr_, other.ptr_);
    std::swap(bytes_, other.bytes_);
  }

 private:
  Backend* backend_ = nullptr;
  DevicePtr ptr_;
  std::size_t bytes_ = 0;
};

}  // namespace kvport
