// SPDX-License-Identifier: Apache-2.0
#include "kvport/backends/cuda_backend.hpp"

#include "api_cuda.hpp"
#include "gpu_backend.hpp"

namespace kvport {

std::unique_ptr<Backend> make_cuda_backend(int device) {
  return std::make_unique<gpu::GpuBackend<ApiCuda>>(device);
}

std::unique_ptr<Backend> make_default_cuda_backend() {
  return make_cuda_backend(0);
}

std::unique_ptr<Backend> make_cuda_backend_on(int device) {
  return make_cuda_backend(device);
}

std::string probe_cuda_backend() {
  return gpu::probe<ApiCuda>(0);
}

}  // namespace kvport
