// The CUDA half of the per-vendor API mapping that GpuBackend<Api> is written
// over. Its HIP twin is backends/hip/src/api_hip.hpp; keep the two in step.
#pragma once

#include <cuda_runtime_api.h>

#include "gpu_kernels.hpp"

namespace kvport {

struct ApiCuda {
  using Status = cudaError_t;
  using Stream = cudaStream_t;
  using Event = cudaEvent_t;
  static constexpr Status success = cudaSuccess;
  static constexpr const char* name = "cuda";

  static const char* error_string(Status s) { return cudaGetErrorString(s); }
  // Drops a non-sticky error so that it does not resurface at the next call;
  // sticky errors (a kernel fault) stay, as CUDA allows nothing else.
  static void clear_error() noexcept { (void)cudaGetLastError(); }

  static Status get_device_count(int* n) { return cudaGetDeviceCount(n); }
  static Status set_device(int d) { return cudaSetDevice(d); }
  static Status mem_get_info(std::size_t* f, std::size_t* t) { return cudaMemGetInfo(f, t); }
  static Status malloc(void** p, std::size_t n) { return cudaMalloc(p, n); }
  static Status free(void* p) { return cudaFree(p); }
  static Status host_alloc(void** p, std::size_t n) { return cudaMallocHost(p, n); }
  static Status host_free(void* p) { return cudaFreeHost(p); }
  static Status stream_create(Stream* s) {
    return cudaStreamCreateWithFlags(s, cudaStreamNonBlocking);
  }
  static Status stream_destroy(Stream s) { return cudaStreamDestroy(s); }
  static Status stream_synchronize(Stream s) { return cudaStreamSynchronize(s); }
  static Status event_create(Event* e) {
    return cudaEventCreateWithFlags(e, cudaEventDisableTiming);
  }
  static Status timing_event_create(Event* e) { return cudaEventCreate(e); }
  static Status event_elapsed_ms(float* ms, Event start, Event end) {
    return cudaEventElapsedTime(ms, start, end);
  }
  static Status event_destroy(Event e) { return cudaEventDestroy(e); }
  static Status event_record(Event e, Stream s) { return cudaEventRecord(e, s); }
  static Status stream_wait_event(Stream s, Event e) { return cudaStreamWaitEvent(s, e, 0); }
  static Status event_synchronize(Event e) { return cudaEventSynchronize(e); }
  static Status memset_async(void* p, int v, std::size_t n, Stream s) {
    return cudaMemsetAsync(p, v, n, s);
  }
  static Status memcpy_async(void* d, const void* src, std::size_t n, Stream s) {
    return cudaMemcpyAsync(d, src, n, cudaMemcpyDefault, s);
  }

  static int launch_fill(const gpu::FillDescriptor* d, std::uint64_t count, std::uint64_t chunks,
                         std::uint8_t value, Stream s) {
    return cuda_kernels::launch_fill(d, count, chunks, value, s);
  }
  static int launch_copy(const gpu::CopyDescriptor* d, std::uint64_t count, std::uint64_t chunks,
                         Stream s) {
    return cuda_kernels::launch_copy(d, count, chunks, s);
  }
  static int launch_fault(Stream s) { return cuda_kernels::launch_fault(s); }
  static int launch_fill_blocks(const gpu::PoolDescriptor* pools, std::uint64_t num_pools,
                                std::uint64_t chunks_per_block, const std::uint32_t* ids,
                                std::uint64_t num_ids, std::uint8_t value, Stream s) {
    return cuda_kernels::launch_fill_blocks(pools, num_pools, chunks_per_block, ids, num_ids, value,
                                            s);
  }
};

}  // namespace kvport
