// SPDX-License-Identifier: Apache-2.0
#include "kvport/backends/hip_backend.hpp"

#include "api_hip.hpp"
#include "gpu_backend.hpp"

namespace kvport {

std::unique_ptr<Backend> make_hip_backend(int device) {
  return std::make_unique<gpu::GpuBackend<ApiHip>>(device);
}

std::unique_ptr<Backend> make_default_hip_backend() {
  return make_hip_backend(0);
}

std::unique_ptr<Backend> make_hip_backend_on(int device) {
  return make_hip_backend(device);
}

std::string probe_hip_backend() {
  return gpu::probe<ApiHip>(0);
}

}  // namespace kvport
