// SPDX-License-Identifier: Apache-2.0
// The RAII buffers' allocation and release, out of line so that their
// headers need only a declaration of Backend.
#include "kvport/platform/backend.hpp"
#include "kvport/platform/device_buffer.hpp"
#include "kvport/platform/host_buffer.hpp"

namespace kvport {

DeviceBuffer::DeviceBuffer(Backend& backend, std::size_t bytes)
    : backend_(&backend), ptr_(backend.alloc(bytes)), bytes_(bytes) {}

DeviceBuffer::~DeviceBuffer() {
  if (backend_ != nullptr) backend_->free(ptr_);
}

HostBuffer::HostBuffer(Backend& backend, std::size_t bytes)
    : backend_(&backend), ptr_(backend.alloc_host(bytes)), bytes_(bytes) {}

HostBuffer::~HostBuffer() {
  if (backend_ != nullptr) backend_->free_host(ptr_);
}

}  // namespace kvport
