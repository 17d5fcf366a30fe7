// SPDX-License-Identifier: Apache-2.0
// HostBuffer: RAII ownership of one pinned host allocation
// (Backend::alloc_host), the staging memory of the host tier.
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>
#include <utility>

namespace kvport {

class Backend;

/// RAII ownership of one pinned host allocation (Backend::alloc_host).
/// Move-only; frees in the destructor, so the copies that use it must be
/// finished by then.
class HostBuffer {
 public:
  HostBuffer() noexcept = default;
  /// Allocates `bytes` of pinned memory on `backend` (see Backend::alloc_host
  /// for errors).
  HostBuffer(Backend& backend, std::size_t bytes);
  HostBuffer(HostBuffer&& other) noexcept { swap(other); }
  HostBuffer& operator=(HostBuffer&& other) noexcept {
    HostBuffer(std::move(other)).swap(*this);
    return *this;
  }
  HostBuffer(const HostBuffer&) = delete;
  HostBuffer& operator=(const HostBuffer&) = delete;
  /// Frees the allocation (Backend::free_host, noexcept).
  ~HostBuffer();

  void* data() const noexcept { return ptr_; }
  std::size_t size() const noexcept { return bytes_; }
  /// The memory as bytes, for filling or checking from the host.
  std::span<std::uint8_t> bytes() const noexcept {
    return {static_cast<std::uint8_t*>(ptr_), bytes_};
  }
  Backend* backend() const noexcept { return backend_; }

  void swap(HostBuffer& other) noexcept {
    std::swap(backend_, other.backend_);
    std::swap(ptr_, other.ptr_);
    std::swap(bytes_, other.bytes_);
  }

 private:
  Backend* backend_ = nullptr;
  void* ptr_ = nullptr;
  std::size_t bytes_ = 0;
};

}  // namespace kvport
