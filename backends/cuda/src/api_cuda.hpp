// SPDX-License-Identifier: Apache-2.0
// The CUDA half of the per-vendor API mapping that GpuBackend<Api> is written
// over, checked by the VendorApi concept (backends/common/vendor_api.hpp). Its
// HIP twin is backends/hip/src/api_hip.hpp. Policy-free: GpuBackend picks the
// flags, sets the device and classifies the errors.
#pragma once

#include <cuda_runtime_api.h>

#include "gpu_kernels.hpp"
#include "kvport/platform/memory_kind.hpp"

namespace kvport {

struct ApiCuda {
  using Status = cudaError_t;
  using Stream = cudaStream_t;
  using Event = cudaEvent_t;
  static constexpr Status success = cudaSuccess;
  static constexpr Status not_ready = cudaErrorNotReady;
  static constexpr const char* name = "cuda";
  static constexpr MemoryKind memory_kind = MemoryKind::cuda;
  static constexpr unsigned stream_non_blocking = cudaStreamNonBlocking;
  static constexpr unsigned event_disable_timing = cudaEventDisableTiming;
  static constexpr unsigned event_default = cudaEventDefault;
  static constexpr bool wraps_null_stream = true;

  static const char* error_string(Status s) { return cudaGetErrorString(s); }
  // Drops a non-sticky error so that it does not resurface at the next call;
  // sticky errors stay, as CUDA allows nothing else.
  static void clear_error() noexcept { (void)cudaGetLastError(); }
  static bool is_out_of_memory(Status s) { return s == cudaErrorMemoryAllocation; }
  // The sticky errors: the context is corrupt and every later call fails
  // (CUDA runtime API documentation, "Error Handling").
  static bool is_device_lost(Status s) {
    switch (s) {
      case cudaErrorECCUncorrectable:
      case cudaErrorIllegalAddress:
      case cudaErrorLaunchTimeout:
      case cudaErrorContextIsDestroyed:
      case cudaErrorAssert:
      case cudaErrorHardwareStackError:
      case cudaErrorIllegalInstruction:
      case cudaErrorMisalignedAddress:
      case cudaErrorInvalidAddressSpace:
      case cudaErrorInvalidPc:
      case cudaErrorLaunchFailure:
        return true;
      default:
        return false;
    }
  }

  static Status get_device_count(int* n) { return cudaGetDeviceCount(n); }
  static Status get_device(int* d) { return cudaGetDevice(d); }
  static Status set_device(int d) { return cudaSetDevice(d); }
  static Status mem_get_info(std::size_t* f, std::size_t* t) { return cudaMemGetInfo(f, t); }
  static Status malloc(void** p, std::size_t n) { return cudaMalloc(p, n); }
  static Status free(void* p) { return cudaFree(p); }
  static Status host_alloc(void** p, std::size_t n) {
    return cudaHostAlloc(p, n, cudaHostAllocDefault);
  }
  static Status host_free(void* p) { return cudaFreeHost(p); }
  static Status stream_create(Stream* s, unsigned flags) {
    return cudaStreamCreateWithFlags(s, flags);
  }
  static Status stream_destroy(Stream s) { return cudaStreamDestroy(s); }
  static Status stream_synchronize(Stream s) { return cudaStreamSynchronize(s); }
  static Status event_create(Event* e, unsigned flags) {
    return cudaEventCreateWithFlags(e, flags);
  }
  static Status event_elapsed_ms(float* ms, Event start, Event end) {
    return cudaEventElapsedTime(ms, start, end);
  }
  static Status event_destroy(Event e) { return cudaEventDestroy(e); }
  static Status event_record(Event e, Stream s) { return cudaEventRecord(e, s); }
  static Status event_query(Event e) { return cudaEventQuery(e); }
  static Status stream_wait_event(Stream s, Event e) { return cudaStreamWaitEvent(s, e, 0); }
  static Status event_synchronize(Event e) { return cudaEventSynchronize(e); }
  static Status memset_async(void* p, int v, std::size_t n, Stream s) {
    return cudaMemsetAsync(p, v, n, s);
  }
  static Status memcpy_async(void* d, const void* src, std::size_t n, Stream s) {
    return cudaMemcpyAsync(d, src, n, cudaMemcpyDefault, s);
  }
  // One cudaMemcpyBatchAsync (CUDA 12.8+) for the whole batch. Its signature
  // changed in CUDA 13 (const arrays, no failIdx out-parameter): the one place
  // that knows. A runtime or driver without it (older toolkit, or
  // cudaErrorNotSupported / cudaErrorCallRequiresNewerDriver at run time)
  // gets one cudaMemcpyAsync per region instead. The sources are read in
  // stream order (cudaMemcpySrcAccessOrderStream), as cudaMemcpyAsync does.
  static Status memcpy_batch_async(void* const* dsts, const void* const* srcs,
                                   const std::size_t* sizes, std::size_t count, Stream s) {
#if CUDART_VERSION >= 12080
    cudaMemcpyAttributes attrs{};
    attrs.srcAccessOrder = cudaMemcpySrcAccessOrderStream;
    std::size_t attrs_index = 0;
#if CUDART_VERSION >= 13000
    const Status batched =
        cudaMemcpyBatchAsync(dsts, srcs, sizes, count, &attrs, &attrs_index, 1, s);
#else
    std::size_t fail_index = 0;
    const Status batched = cudaMemcpyBatchAsync(const_cast<void**>(dsts), const_cast<void**>(srcs),
                                                const_cast<std::size_t*>(sizes), count, &attrs,
                                                &attrs_index, 1, &fail_index, s);
#endif
    if (batched != cudaErrorNotSupported && batched != cudaErrorCallRequiresNewerDriver) {
      return batched;
    }
    (void)cudaGetLastError();  // fall back to one copy per region
#endif
    for (std::size_t i = 0; i < count; ++i) {
      const Status status = cudaMemcpyAsync(dsts[i], srcs[i], sizes[i], cudaMemcpyDefault, s);
      if (status != cudaSuccess) return status;
    }
    return cudaSuccess;
  }

  static Status launch_fill_table(const gpu::FillDescriptor* d, std::uint64_t count,
                                  std::uint64_t chunks, std::uint8_t value, Stream s) {
    return static_cast<Status>(cuda_kernels::launch_fill_table(d, count, chunks, value, s));
  }
  static Status launch_fill_by_value(const gpu::FillDescriptor* d, std::uint64_t count,
                                     std::uint64_t chunks, std::uint8_t value, Stream s) {
    return static_cast<Status>(cuda_kernels::launch_fill_by_value(d, count, chunks, value, s));
  }
  static Status launch_copy_table(const gpu::CopyDescriptor* d, std::uint64_t count,
                                  std::uint64_t chunks, Stream s) {
    return static_cast<Status>(cuda_kernels::launch_copy_table(d, count, chunks, s));
  }
  static Status launch_copy_by_value(const gpu::CopyDescriptor* d, std::uint64_t count,
                                     std::uint64_t chunks, Stream s) {
    return static_cast<Status>(cuda_kernels::launch_copy_by_value(d, count, chunks, s));
  }
  static Status launch_fill_blocks_table(const gpu::PoolDescriptor* pools, std::uint64_t num_pools,
                                         std::uint64_t chunks_per_block, const std::uint32_t* ids,
                                         std::uint64_t num_ids, std::uint8_t value, Stream s) {
    return static_cast<Status>(cuda_kernels::launch_fill_blocks_table(
        pools, num_pools, chunks_per_block, ids, num_ids, value, s));
  }
  static Status launch_fill_blocks_by_value(const gpu::PoolDescriptor* pools,
                                            std::uint64_t num_pools, std::uint64_t chunks_per_block,
                                            const std::uint32_t* ids, std::uint64_t num_ids,
                                            std::uint8_t value, Stream s) {
    return static_cast<Status>(cuda_kernels::launch_fill_blocks_by_value(
        pools, num_pools, chunks_per_block, ids, num_ids, value, s));
  }
  static Status launch_fault(Stream s) {
    return static_cast<Status>(cuda_kernels::launch_fault(s));
  }
};

}  // namespace kvport
