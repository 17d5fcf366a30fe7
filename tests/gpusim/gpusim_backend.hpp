// SPDX-License-Identifier: Apache-2.0
// gpusim: the GPU backend (GpuBackend<Api>, backends/common/gpu_backend.hpp)
// over a CPU simulation of the vendor API, for machines without a GPU.
//
// Everything host-side runs for real: allocation tracking and range checks,
// descriptor tables with their chunk prefix sums, by-value small batches,
// pinned staging slots and the events guarding them, the device-resident pool
// table of the cache-aware fill. "Kernel launches" run the kernels' own chunk
// mapping and per-lane byte loops (backends/common/gpu_chunks.hpp) on the CPU,
// lane by lane. Work runs synchronously at launch.
//
// The simulated runtime is strict where a real one would be wrong silently or
// fail only on hardware, so the backend's policies can be tested on a CPU:
// - two devices, and a current device per thread (cudaSetDevice semantics):
//   memory, streams and events belong to the device current when they were
//   made, and using them while another device is current is an error;
// - a fault kernel is sticky and context-wide: every later call on that
//   device fails, as after a trap on CUDA;
// - errors can be injected into the next launch or allocation, a stale error
//   can be left on a thread, and event completion can be held back to model
//   work still in flight.
// Test-only: not in the backend registry.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>

#include "kvport/platform/backend.hpp"

namespace kvport::testing {

/// Simulated devices: ordinals 0 and 1.
inline constexpr int kGpusimDevices = 2;

/// A GpuBackend over the simulated API on `device`, which gets
/// `capacity_bytes` of "device" memory. A device lost by an earlier backend is
/// usable again (a new context). Throws as GpuBackend's constructor.
std::unique_ptr<Backend> make_gpusim_backend(std::size_t capacity_bytes = std::size_t{4} << 30,
                                             int device = 0);

/// What the simulated runtime saw since the last gpusim_reset_stats().
struct GpusimStats {
  std::uint64_t launches = 0;            ///< kernel launches (any kind)
  std::uint64_t uploads = 0;             ///< memcpy_async from host to device memory
  std::uint64_t pinned_allocs = 0;       ///< host_alloc calls that succeeded
  std::uint64_t batch_copies = 0;        ///< memcpy_batch_async calls (any number of regions)
  std::uint64_t blocking_waits = 0;      ///< event_synchronize on an event still in flight
  std::uint64_t wrong_device_calls = 0;  ///< calls rejected: another device was current
  std::uint64_t streams_destroyed = 0;   ///< stream_destroy calls
};
GpusimStats gpusim_stats();
void gpusim_reset_stats();

/// The calling thread's current simulated device (0 on a new thread), and
/// setting it, as cudaGetDevice / cudaSetDevice would.
int gpusim_current_device();
void gpusim_set_current_device(int device);

/// Leaves a non-sticky error on the calling thread, as a failed call of
/// another library would; only clear_error() drops it.
void gpusim_leave_stale_error();

/// The next kernel launch / device malloc / host_alloc, on any thread, fails
/// with the simulated status `code`: 2 out of memory, 9 invalid launch
/// configuration, 201 invalid context, 719 launch failure (sticky: loses the
/// device).
void gpusim_fail_next_launch(int code);
void gpusim_fail_next_malloc(int code);
void gpusim_fail_next_host_alloc(int code);

/// A simulated vendor stream made outside any backend, as an engine makes its
/// own (cudaStreamCreate), on `device`; destroy it with
/// gpusim_destroy_native_stream. For Backend::wrap_stream tests. Throws
/// BackendError on a lost device.
void* gpusim_create_native_stream(int device = 0);
void gpusim_destroy_native_stream(void* stream);

/// Simulated device memory allocated outside any backend, as an engine's own
/// allocator gives it out (cudaMalloc), on `device`; free it with
/// gpusim_free_native. For Backend::adopt_memory tests. Throws BackendError
/// when the runtime refuses.
void* gpusim_malloc_native(std::size_t bytes, int device = 0);
void gpusim_free_native(void* ptr);

/// The engine's own work on its stream: a memset queued directly on the
/// simulated runtime (cudaMemsetAsync), not through a backend. False when the
/// runtime refused it.
bool gpusim_memset_native(void* stream, void* ptr, std::uint8_t value, std::size_t bytes);

/// While held, events recorded stay in flight: event_query answers not-ready
/// and event_synchronize counts a blocking wait (then completes the event).
/// Releasing completes every event.
void gpusim_hold_completion(bool held);

}  // namespace kvport::testing
