// SPDX-License-Identifier: Apache-2.0
// VendorApi: the contract between GpuBackend<Api> (gpu_backend.hpp) and one
// vendor's runtime (ApiCuda, ApiHip, and gpusim's ApiSim for tests), as a
// C++20 concept. A missing or mistyped member of an API struct is a compile
// error that names the requirement, not a comment that goes stale.
//
// An API struct is a thin, policy-free mapping: one static function per
// runtime call, returning the vendor's status. Policy (which stream and event
// flags, when to set the device, how errors are classified into kvport
// exceptions) is chosen once, in GpuBackend.
#pragma once

#include <concepts>
#include <cstddef>
#include <cstdint>

#include "gpu_kernels.hpp"
#include "kvport/platform/memory_kind.hpp"

namespace kvport::gpu {

template <class A>
concept VendorApi = requires(typename A::Status status, typename A::Stream stream,
                             typename A::Stream* stream_out, typename A::Event event,
                             typename A::Event* event_out, int* int_out, int device, void** ptr_out,
                             void* ptr, const void* cptr, std::size_t* size_out, std::size_t bytes,
                             unsigned flags, float* ms_out, std::uint8_t value,
                             const FillDescriptor* fills, const CopyDescriptor* copies,
                             const PoolDescriptor* pools, const std::uint32_t* ids,
                             std::uint64_t count, void* const* ptr_list,
                             const void* const* cptr_list, const std::size_t* sizes) {
  // ---- identity and status codes
  requires std::equality_comparable<typename A::Status>;
  { A::success } -> std::convertible_to<typename A::Status>;
  /// What event_query returns for an event whose work is still running.
  { A::not_ready } -> std::convertible_to<typename A::Status>;
  { A::name } -> std::convertible_to<const char*>;
  /// Where the runtime's allocations live (Backend::memory_kind).
  { A::memory_kind } -> std::convertible_to<MemoryKind>;
  { A::error_string(status) } -> std::convertible_to<const char*>;
  /// Drops the thread's last (non-sticky) error so it cannot resurface.
  { A::clear_error() }
  noexcept;
  /// The runtime's own out-of-memory code (cudaErrorMemoryAllocation, ...):
  /// only that is OutOfMemory; any other allocation failure is a BackendError.
  { A::is_out_of_memory(status) } -> std::same_as<bool>;
  /// A sticky, context-wide error after which every call fails (DeviceLost).
  { A::is_device_lost(status) } -> std::same_as<bool>;

  // ---- flags GpuBackend chooses from
  { A::stream_non_blocking } -> std::convertible_to<unsigned>;
  { A::event_disable_timing } -> std::convertible_to<unsigned>;
  { A::event_default } -> std::convertible_to<unsigned>;
  /// Whether a null stream handle is the runtime's legacy default stream
  /// (CUDA, HIP), which Backend::wrap_stream then accepts.
  { A::wraps_null_stream } -> std::convertible_to<bool>;

  // ---- devices and memory
  { A::get_device_count(int_out) } -> std::same_as<typename A::Status>;
  { A::get_device(int_out) } -> std::same_as<typename A::Status>;
  { A::set_device(device) } -> std::same_as<typename A::Status>;
  { A::mem_get_info(size_out, size_out) } -> std::same_as<typename A::Status>;
  { A::malloc(ptr_out, bytes) } -> std::same_as<typename A::Status>;
  { A::free(ptr) } -> std::same_as<typename A::Status>;
  /// Page-locked host memory (cudaHostAlloc / hipHostMalloc).
  { A::host_alloc(ptr_out, bytes) } -> std::same_as<typename A::Status>;
  { A::host_free(ptr) } -> std::same_as<typename A::Status>;

  // ---- streams and events
  { A::stream_create(stream_out, flags) } -> std::same_as<typename A::Status>;
  { A::stream_destroy(stream) } -> std::same_as<typename A::Status>;
  { A::stream_synchronize(stream) } -> std::same_as<typename A::Status>;
  { A::event_create(event_out, flags) } -> std::same_as<typename A::Status>;
  { A::event_destroy(event) } -> std::same_as<typename A::Status>;
  { A::event_record(event, stream) } -> std::same_as<typename A::Status>;
  /// success when the event's work is done, not_ready while it runs.
  { A::event_query(event) } -> std::same_as<typename A::Status>;
  { A::event_synchronize(event) } -> std::same_as<typename A::Status>;
  { A::event_elapsed_ms(ms_out, event, event) } -> std::same_as<typename A::Status>;
  { A::stream_wait_event(stream, event) } -> std::same_as<typename A::Status>;

  // ---- asynchronous work
  { A::memset_async(ptr, device, bytes, stream) } -> std::same_as<typename A::Status>;
  { A::memcpy_async(ptr, cptr, bytes, stream) } -> std::same_as<typename A::Status>;
  /// `bytes` copies dsts[i] <- srcs[i] of sizes[i] bytes (each > 0), queued by
  /// one call, in any order among themselves: cudaMemcpyBatchAsync where the
  /// runtime has it, else one memcpy_async per copy. On a failure part of the
  /// batch may already be queued; the status is the first failure's.
  {
    A::memcpy_batch_async(ptr_list, cptr_list, sizes, bytes, stream)
    } -> std::same_as<typename A::Status>;

  // ---- kernels (gpu_kernels.inc). Each returns the status of the launch
  // itself (cudaLaunchKernel / hipLaunchKernel), never a stale error another
  // call left on the thread. *_table variants read descriptors from device
  // memory; *_by_value ones take host descriptors (count <= the kMaxInline*
  // limits) and pass them as kernel parameters: no upload, no staging.
  { A::launch_fill_table(fills, count, count, value, stream) } -> std::same_as<typename A::Status>;
  {
    A::launch_fill_by_value(fills, count, count, value, stream)
    } -> std::same_as<typename A::Status>;
  { A::launch_copy_table(copies, count, count, stream) } -> std::same_as<typename A::Status>;
  { A::launch_copy_by_value(copies, count, count, stream) } -> std::same_as<typename A::Status>;
  {
    A::launch_fill_blocks_table(pools, count, count, ids, count, value, stream)
    } -> std::same_as<typename A::Status>;
  {
    A::launch_fill_blocks_by_value(pools, count, count, ids, count, value, stream)
    } -> std::same_as<typename A::Status>;
  /// A kernel that traps: Backend::inject_async_fault.
  { A::launch_fault(stream) } -> std::same_as<typename A::Status>;
};

}  // namespace kvport::gpu
