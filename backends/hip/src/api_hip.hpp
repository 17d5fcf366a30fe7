// SPDX-License-Identifier: Apache-2.0
// The HIP half of the per-vendor API mapping that GpuBackend<Api> is written
// over, checked by the VendorApi concept (backends/common/vendor_api.hpp). Its
// CUDA twin is backends/cuda/src/api_cuda.hpp. Policy-free: GpuBackend picks
// the flags, sets the device and classifies the errors. Compiled by g++ with
// __HIP_PLATFORM_AMD__ (hip::host), not by hipcc.
#pragma once

#include <hip/hip_runtime_api.h>

#include "gpu_kernels.hpp"
#include "kvport/platform/memory_kind.hpp"

namespace kvport {

struct ApiHip {
  using Status = hipError_t;
  using Stream = hipStream_t;
  using Event = hipEvent_t;
  static constexpr Status success = hipSuccess;
  static constexpr Status not_ready = hipErrorNotReady;
  static constexpr const char* name = "hip";
  static constexpr MemoryKind memory_kind = MemoryKind::rocm;
  static constexpr unsigned stream_non_blocking = hipStreamNonBlocking;
  static constexpr unsigned event_disable_timing = hipEventDisableTiming;
  static constexpr unsigned event_default = hipEventDefault;
  static constexpr bool wraps_null_stream = true;

  static const char* error_string(Status s) { return hipGetErrorString(s); }
  // Drops a non-sticky error so that it does not resurface at the next call;
  // sticky errors stay, as CUDA allows nothing else.
  static void clear_error() noexcept { (void)hipGetLastError(); }
  static bool is_out_of_memory(Status s) { return s == hipErrorOutOfMemory; }
  // The sticky errors HIP reports after a device fault. (On ROCm a
  // device-side trap usually aborts the process before any status returns:
  // see docs/backends.md.)
  static bool is_device_lost(Status s) {
    switch (s) {
      case hipErrorECCNotCorrectable:
      case hipErrorIllegalAddress:
      case hipErrorLaunchTimeOut:
      case hipErrorContextIsDestroyed:
      case hipErrorAssert:
      case hipErrorLaunchFailure:
        return true;
      default:
        return false;
    }
  }

  static Status get_device_count(int* n) { return hipGetDeviceCount(n); }
  static Status get_device(int* d) { return hipGetDevice(d); }
  static Status set_device(int d) { return hipSetDevice(d); }
  static Status mem_get_info(std::size_t* f, std::size_t* t) { return hipMemGetInfo(f, t); }
  static Status malloc(void** p, std::size_t n) { return hipMalloc(p, n); }
  static Status free(void* p) { return hipFree(p); }
  static Status host_alloc(void** p, std::size_t n) {
    return hipHostMalloc(p, n, hipHostMallocDefault);
  }
  static Status host_free(void* p) { return hipHostFree(p); }
  static Status stream_create(Stream* s, unsigned flags) {
    return hipStreamCreateWithFlags(s, flags);
  }
  static Status stream_destroy(Stream s) { return hipStreamDestroy(s); }
  static Status stream_synchronize(Stream s) { return hipStreamSynchronize(s); }
  static Status event_create(Event* e, unsigned flags) { return hipEventCreateWithFlags(e, flags); }
  static Status event_elapsed_ms(float* ms, Event start, Event end) {
    return hipEventElapsedTime(ms, start, end);
  }
  static Status event_destroy(Event e) { return hipEventDestroy(e); }
  static Status event_record(Event e, Stream s) { return hipEventRecord(e, s); }
  static Status event_query(Event e) { return hipEventQuery(e); }
  static Status stream_wait_event(Stream s, Event e) { return hipStreamWaitEvent(s, e, 0); }
  static Status event_synchronize(Event e) { return hipEventSynchronize(e); }
  static Status memset_async(void* p, int v, std::size_t n, Stream s) {
    return hipMemsetAsync(p, v, n, s);
  }
  static Status memcpy_async(void* d, const void* src, std::size_t n, Stream s) {
    return hipMemcpyAsync(d, src, n, hipMemcpyDefault, s);
  }
  // ROCm has no batched memcpy call: one hipMemcpyAsync per region.
  static Status memcpy_batch_async(void* const* dsts, const void* const* srcs,
                                   const std::size_t* sizes, std::size_t count, Stream s) {
    for (std::size_t i = 0; i < count; ++i) {
      const Status status = hipMemcpyAsync(dsts[i], srcs[i], sizes[i], hipMemcpyDefault, s);
      if (status != hipSuccess) return status;
    }
    return hipSuccess;
  }

  static Status launch_fill_table(const gpu::FillDescriptor* d, std::uint64_t count,
                                  std::uint64_t chunks, std::uint8_t value, Stream s) {
    return static_cast<Status>(hip_kernels::launch_fill_table(d, count, chunks, value, s));
  }
  static Status launch_fill_by_value(const gpu::FillDescriptor* d, std::uint64_t count,
                                     std::uint64_t chunks, std::uint8_t value, Stream s) {
    return static_cast<Status>(hip_kernels::launch_fill_by_value(d, count, chunks, value, s));
  }
  static Status launch_copy_table(const gpu::CopyDescriptor* d, std::uint64_t count,
                                  std::uint64_t chunks, Stream s) {
    return static_cast<Status>(hip_kernels::launch_copy_table(d, count, chunks, s));
  }
  static Status launch_copy_by_value(const gpu::CopyDescriptor* d, std::uint64_t count,
                                     std::uint64_t chunks, Stream s) {
    return static_cast<Status>(hip_kernels::launch_copy_by_value(d, count, chunks, s));
  }
  static Status launch_fill_blocks_table(const gpu::PoolDescriptor* pools, std::uint64_t num_pools,
                                         std::uint64_t chunks_per_block, const std::uint32_t* ids,
                                         std::uint64_t num_ids, std::uint8_t value, Stream s) {
    return static_cast<Status>(hip_kernels::launch_fill_blocks_table(
        pools, num_pools, chunks_per_block, ids, num_ids, value, s));
  }
  static Status launch_fill_blocks_by_value(const gpu::PoolDescriptor* pools,
                                            std::uint64_t num_pools, std::uint64_t chunks_per_block,
                                            const std::uint32_t* ids, std::uint64_t num_ids,
                                            std::uint8_t value, Stream s) {
    return static_cast<Status>(hip_kernels::launch_fill_blocks_by_value(
        pools, num_pools, chunks_per_block, ids, num_ids, value, s));
  }
  static Status launch_fault(Stream s) { return static_cast<Status>(hip_kernels::launch_fault(s)); }
};

}  // namespace kvport
