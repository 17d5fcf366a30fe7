// SPDX-License-Identifier: Apache-2.0
// HIP build of the shared kernels in backends/common/gpu_kernels.inc
// (compiled by hipcc through a custom command; see backends/hip/CMakeLists.txt).
#include <hip/hip_runtime.h>

#define KVPORT_KERNEL_NS hip_kernels
#define KVPORT_STREAM_T hipStream_t
#define KVPORT_LAUNCH_KERNEL hipLaunchKernel
#define KVPORT_GRID_CONSTANT
#define KVPORT_DEVICE_TRAP __builtin_trap()
#include "gpu_kernels.inc"
