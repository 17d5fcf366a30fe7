// SPDX-License-Identifier: Apache-2.0
// The HIP backend: the Backend contract over the HIP runtime.
#pragma once

#include <memory>
#include <string>

#include "kvport/platform/backend.hpp"

namespace kvport {

/// A HIP backend on device `device` (ordinal). hipMalloc/hipFree,
/// hipMemsetAsync, hipMemcpyAsync, non-blocking streams, events without
/// timing; fill_async and copy_batch_async are one kernel launch each, their
/// descriptor tables uploaded through pinned staging buffers guarded by
/// events. Every range is checked against the live allocations before it
/// reaches the device. Throws BackendError ("hip: no device: ...") when the
/// runtime has no usable device.
std::unique_ptr<Backend> make_hip_backend(int device = 0);

/// Registry hooks: device 0, and the reason no device is usable ("" when one
/// is), e.g. "hip: no device: no ROCm-capable device is detected".
std::unique_ptr<Backend> make_default_hip_backend();
std::unique_ptr<Backend> make_hip_backend_on(int device);
std::string probe_hip_backend();

}  // namespace kvport
