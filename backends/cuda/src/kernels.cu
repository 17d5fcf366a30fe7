// CUDA build of the shared kernels in backends/common/gpu_kernels.inc.
#include <cuda_runtime.h>

#define KVPORT_KERNEL_NS cuda_kernels
#define KVPORT_STREAM_T cudaStream_t
#define KVPORT_GET_LAST_ERROR cudaGetLastError
#define KVPORT_DEVICE_TRAP __trap()
#include "gpu_kernels.inc"
