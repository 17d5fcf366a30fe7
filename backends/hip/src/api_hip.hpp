// The HIP half of the per-vendor API mapping that GpuBackend<Api> is written
// over. Its CUDA twin is backends/cuda/src/api_cuda.hpp; keep the two in step.
// Compiled by g++ with __HIP_PLATFORM_AMD__ (hip::host), not by hipcc.
#pragma once

#include <hip/hip_runtime_api.h>

#include "gpu_kernels.hpp"

namespace kvport {

struct ApiHip {
  using Status = hipError_t;
  using Stream = hipStream_t;
  using Event = hipEvent_t;
  static constexpr Status success = hipSuccess;
  static constexpr const char* name = "hip";

  static const char* error_string(Status s) { return hipGetErrorString(s); }
  static void clear_error() noexcept { (void)hipGetLastError(); }

  static Status get_device_count(int* n) { return hipGetDeviceCount(n); }
  static Status set_device(int d) { return hipSetDevice(d); }
  static Status mem_get_info(std::size_t* f, std::size_t* t) { return hipMemGetInfo(f, t); }
  static Status malloc(void** p, std::size_t n) { return hipMalloc(p, n); }
  static Status free(void* p) { return hipFree(p); }
  // hipHostMalloc, not the deprecated hipMallocHost.
  static Status host_alloc(void** p, std::size_t n) { return hipHostMalloc(p, n, 0); }
  static Status host_free(void* p) { return hipHostFree(p); }
  static Status stream_create(Stream* s) {
    return hipStreamCreateWithFlags(s, hipStreamNonBlocking);
  }
  static Status stream_destroy(Stream s) { return hipStreamDestroy(s); }
  static Status stream_synchronize(Stream s) { return hipStreamSynchronize(s); }
  static Status event_create(Event* e) { return hipEventCreateWithFlags(e, hipEventDisableTiming); }
  static Status timing_event_create(Event* e) { return hipEventCreate(e); }
  static Status event_elapsed_ms(float* ms, Event start, Event end) {
    return hipEventElapsedTime(ms, start, end);
  }
  static Status event_destroy(Event e) { return hipEventDestroy(e); }
  static Status event_record(Event e, Stream s) { return hipEventRecord(e, s); }
  static Status stream_wait_event(Stream s, Event e) { return hipStreamWaitEvent(s, e, 0); }
  static Status event_synchronize(Event e) { return hipEventSynchronize(e); }
  static Status memset_async(void* p, int v, std::size_t n, Stream s) {
    return hipMemsetAsync(p, v, n, s);
  }
  static Status memcpy_async(void* d, const void* src, std::size_t n, Stream s) {
    return hipMemcpyAsync(d, src, n, hipMemcpyDefault, s);
  }

  static int launch_fill(const gpu::FillDescriptor* d, std::uint64_t count, std::uint64_t chunks,
                         std::uint8_t value, Stream s) {
    return hip_kernels::launch_fill(d, count, chunks, value, s);
  }
  static int launch_copy(const gpu::CopyDescriptor* d, std::uint64_t count, std::uint64_t chunks,
                         Stream s) {
    return hip_kernels::launch_copy(d, count, chunks, s);
  }
  static int launch_fault(Stream s) { return hip_kernels::launch_fault(s); }
  static int launch_fill_blocks(const gpu::PoolDescriptor* pools, std::uint64_t num_pools,
                                std::uint64_t chunks_per_block, const std::uint32_t* ids,
                                std::uint64_t num_ids, std::uint8_t value, Stream s) {
    return hip_kernels::launch_fill_blocks(pools, num_pools, chunks_per_block, ids, num_ids, value,
                                           s);
  }
};

}  // namespace kvport
