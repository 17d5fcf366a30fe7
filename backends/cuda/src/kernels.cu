// SPDX-License-Identifier: Apache-2.0
// CUDA build of the shared kernels in backends/common/gpu_kernels.inc.
#include <cuda_runtime.h>

#define KVPORT_KERNEL_NS cuda_kernels
#define KVPORT_STREAM_T cudaStream_t
#define KVPORT_LAUNCH_KERNEL cudaLaunchKernel
#define KVPORT_GRID_CONSTANT __grid_constant__
#define KVPORT_DEVICE_TRAP __trap()
#include "gpu_kernels.inc"
