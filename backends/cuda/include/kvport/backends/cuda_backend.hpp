// SPDX-License-Identifier: Apache-2.0
// The CUDA backend: the Backend contract over the CUDA runtime.
#pragma once

#include <memory>
#include <string>

#include "kvport/platform/backend.hpp"

namespace kvport {

/// A CUDA backend on device `device` (ordinal). cudaMalloc/cudaFree,
/// cudaMemsetAsync, cudaMemcpyAsync, non-blocking streams, events without
/// timing; fill_async and copy_batch_async are one kernel launch each, their
/// descriptor tables uploaded through pinned staging buffers guarded by
/// events. Every range is checked against the live allocations before it
/// reaches the device. Throws BackendError ("cuda: no device: ...") when the
/// runtime has no usable device.
std::unique_ptr<Backend> make_cuda_backend(int device = 0);

/// Registry hooks: device 0, and the reason no device is usable ("" when one
/// is), e.g. "cuda: no device: CUDA driver version is insufficient for CUDA
/// runtime version".
std::unique_ptr<Backend> make_default_cuda_backend();
std::unique_ptr<Backend> make_cuda_backend_on(int device);
std::string probe_cuda_backend();

}  // namespace kvport
