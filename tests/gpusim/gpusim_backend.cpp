// SPDX-License-Identifier: Apache-2.0
#include "gpusim_backend.hpp"

#include <array>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <map>
#include <mutex>
#include <unordered_set>

#include "gpu_backend.hpp"
#include "gpu_chunks.hpp"

namespace kvport::testing {
namespace {

enum Status : int {
  ok = 0,
  invalid_value = 1,
  out_of_memory = 2,
  invalid_configuration = 9,
  invalid_device = 101,
  invalid_context = 201,
  invalid_handle = 400,
  not_ready = 600,
  launch_failure = 719,
};

struct SimStream {
  int device;
};
struct SimEvent {
  int device;
  std::chrono::steady_clock::time_point recorded;  // work runs at launch, so at record
  bool ever_recorded = false;
  bool complete = true;
  const SimStream* stream = nullptr;  // where it was last recorded
};

struct Allocation {
  std::size_t bytes;
  int device;
};

struct Device {
  std::size_t capacity = 0;
  std::size_t used = 0;
  Status lost = ok;  // a sticky error: every call on the device returns it
};

// The whole simulated runtime, behind one mutex (never held while "kernels"
// run).
struct Sim {
  std::mutex mutex;
  std::array<Device, kGpusimDevices> devices{};
  std::map<std::uintptr_t, Allocation> allocations;
  std::unordered_set<SimEvent*> events;
  GpusimStats stats;
  bool held = false;
  Status fail_launch = ok, fail_malloc = ok, fail_host_alloc = ok;
};

Sim& sim() {
  static Sim s;
  return s;
}

thread_local int current_device = 0;
thread_local Status last_error = ok;

Status set_error(Status s) {
  if (s != ok) last_error = s;
  return s;
}

// Takes and clears a pending injected failure.
Status take(Status& injected) {
  const Status s = injected;
  injected = ok;
  return s;
}

std::size_t rounded(std::size_t n) {
  return (n + kAllocAlignment - 1) / kAllocAlignment * kAllocAlignment;
}

// A call that needs `device` to be current (and alive). Under the sim lock.
Status on_device(Sim& s, int device) {
  if (device != current_device) {
    ++s.stats.wrong_device_calls;
    return invalid_handle;
  }
  return s.devices[static_cast<std::size_t>(device)].lost;
}

// Whether [p, p + n) lies in a simulated device allocation.
bool is_device_memory(const Sim& s, const void* p) {
  const auto a = reinterpret_cast<std::uintptr_t>(p);
  auto it = s.allocations.upper_bound(a);
  if (it == s.allocations.begin()) return false;
  --it;
  return a < it->first + it->second.bytes;
}

// The API struct, shaped like ApiCuda / ApiHip (checked by VendorApi).
struct ApiSim {
  using Status = testing::Status;
  using Stream = SimStream*;
  using Event = SimEvent*;
  static constexpr Status success = ok;
  static constexpr Status not_ready = testing::not_ready;
  static constexpr const char* name = "gpusim";
  // The simulated device's memory is host memory.
  static constexpr MemoryKind memory_kind = MemoryKind::host;
  static constexpr unsigned stream_non_blocking = 1;
  static constexpr unsigned event_disable_timing = 2;
  static constexpr unsigned event_default = 0;
  // A null SimStream is not a stream: wrap_stream refuses it (tested).
  static constexpr bool wraps_null_stream = false;

  static const char* error_string(Status s) {
    switch (s) {
      case ok:
        return "no error";
      case invalid_value:
        return "invalid argument";
      case out_of_memory:
        return "out of memory";
      case invalid_configuration:
        return "invalid configuration argument";
      case invalid_device:
        return "invalid device ordinal";
      case invalid_context:
        return "invalid device context";
      case invalid_handle:
        return "invalid resource handle (simulated: another device is current)";
      case testing::not_ready:
        return "device not ready";
      case launch_failure:
        return "unspecified launch failure (simulated trap)";
    }
    return "unknown error";
  }
  static void clear_error() noexcept { last_error = ok; }
  static bool is_out_of_memory(Status s) { return s == out_of_memory; }
  static bool is_device_lost(Status s) { return s == launch_failure; }

  static Status get_device_count(int* n) {
    *n = kGpusimDevices;
    return ok;
  }
  static Status get_device(int* d) {
    *d = current_device;
    return ok;
  }
  static Status set_device(int d) {
    if (d < 0 || d >= kGpusimDevices) return set_error(invalid_device);
    current_device = d;
    return ok;
  }
  static Status mem_get_info(std::size_t* free_bytes, std::size_t* total) {
    Sim& s = sim();
    std::lock_guard lock(s.mutex);
    const Device& d = s.devices[static_cast<std::size_t>(current_device)];
    if (d.lost != ok) return set_error(d.lost);
    *free_bytes = d.capacity - d.used;
    *total = d.capacity;
    return ok;
  }
  static Status malloc(void** p, std::size_t n) {
    Sim& s = sim();
    std::lock_guard lock(s.mutex);
    Device& d = s.devices[static_cast<std::size_t>(current_device)];
    if (d.lost != ok) return set_error(d.lost);
    if (const Status injected = take(s.fail_malloc); injected != ok) return set_error(injected);
    if (n > d.capacity - d.used || rounded(n) > d.capacity - d.used)
      return set_error(out_of_memory);
    *p = std::aligned_alloc(kAllocAlignment, rounded(n));
    if (*p == nullptr) return set_error(out_of_memory);
    d.used += rounded(n);
    s.allocations.emplace(reinterpret_cast<std::uintptr_t>(*p),
                          Allocation{rounded(n), current_device});
    return ok;
  }
  // Releases the memory even on a lost device (the context owned it), so a
  // test that loses a device leaks nothing.
  static Status free(void* p) {
    Sim& s = sim();
    std::lock_guard lock(s.mutex);
    auto it = s.allocations.find(reinterpret_cast<std::uintptr_t>(p));
    if (it == s.allocations.end()) return set_error(invalid_value);
    Device& d = s.devices[static_cast<std::size_t>(it->second.device)];
    if (d.lost == ok && it->second.device != current_device) {
      ++s.stats.wrong_device_calls;
      return set_error(invalid_handle);
    }
    d.used -= it->second.bytes;
    s.allocations.erase(it);
    std::free(p);
    return set_error(d.lost);
  }
  static Status host_alloc(void** p, std::size_t n) {
    Sim& s = sim();
    std::lock_guard lock(s.mutex);
    if (const Status injected = take(s.fail_host_alloc); injected != ok) return set_error(injected);
    if (n > SIZE_MAX - kHostAllocAlignment) return set_error(out_of_memory);
    *p = std::aligned_alloc(kHostAllocAlignment, (n + kHostAllocAlignment - 1) /
                                                     kHostAllocAlignment * kHostAllocAlignment);
    if (*p == nullptr) return set_error(out_of_memory);
    ++s.stats.pinned_allocs;
    return ok;
  }
  static Status host_free(void* p) {
    std::free(p);
    return ok;
  }
  static Status stream_create(Stream* out, unsigned) {
    Sim& s = sim();
    std::lock_guard lock(s.mutex);
    if (const Status lost = s.devices[static_cast<std::size_t>(current_device)].lost; lost != ok) {
      return set_error(lost);
    }
    *out = new SimStream{current_device};
    return ok;
  }
  static Status stream_destroy(Stream st) {
    Sim& s = sim();
    std::lock_guard lock(s.mutex);
    const Status lost = s.devices[static_cast<std::size_t>(st->device)].lost;
    for (SimEvent* e : s.events) {
      if (e->stream == st) e->stream = nullptr;
    }
    ++s.stats.streams_destroyed;
    delete st;
    return set_error(lost);
  }
  // Completes the events recorded on `st` (work runs at launch; held events
  // are what a real stream would still be running).
  static Status stream_synchronize(Stream st) {
    Sim& s = sim();
    std::lock_guard lock(s.mutex);
    for (SimEvent* e : s.events) {
      if (e->stream == st) e->complete = true;
    }
    return set_error(s.devices[static_cast<std::size_t>(st->device)].lost);
  }
  static Status event_create(Event* out, unsigned) {
    Sim& s = sim();
    std::lock_guard lock(s.mutex);
    if (const Status lost = s.devices[static_cast<std::size_t>(current_device)].lost; lost != ok) {
      return set_error(lost);
    }
    *out = new SimEvent{current_device, {}, false, true, nullptr};
    s.events.insert(*out);
    return ok;
  }
  static Status event_destroy(Event e) {
    Sim& s = sim();
    std::lock_guard lock(s.mutex);
    s.events.erase(e);
    const Status lost = s.devices[static_cast<std::size_t>(e->device)].lost;
    delete e;
    return set_error(lost);
  }
  static Status event_elapsed_ms(float* ms, Event start, Event end) {
    if (!start->ever_recorded || !end->ever_recorded) return set_error(invalid_value);
    *ms = std::chrono::duration<float, std::milli>(end->recorded - start->recorded).count();
    return ok;
  }
  static Status event_record(Event e, Stream st) {
    Sim& s = sim();
    std::lock_guard lock(s.mutex);
    if (e->device != st->device) return set_error(invalid_handle);
    if (const Status status = on_device(s, st->device); status != ok) return set_error(status);
    e->recorded = std::chrono::steady_clock::now();
    e->ever_recorded = true;
    e->complete = !s.held;
    e->stream = st;
    return ok;
  }
  static Status event_query(Event e) {
    Sim& s = sim();
    std::lock_guard lock(s.mutex);
    if (const Status lost = s.devices[static_cast<std::size_t>(e->device)].lost; lost != ok) {
      return set_error(lost);
    }
    return e->complete ? ok : testing::not_ready;
  }
  static Status event_synchronize(Event e) {
    Sim& s = sim();
    std::lock_guard lock(s.mutex);
    if (!e->complete) {
      ++s.stats.blocking_waits;
      e->complete = true;
    }
    return set_error(s.devices[static_cast<std::size_t>(e->device)].lost);
  }
  static Status stream_wait_event(Stream st, Event) {
    Sim& s = sim();
    std::lock_guard lock(s.mutex);
    return set_error(on_device(s, st->device));
  }
  static Status memset_async(void* p, int v, std::size_t n, Stream st) {
    {
      Sim& s = sim();
      std::lock_guard lock(s.mutex);
      if (const Status status = on_device(s, st->device); status != ok) return set_error(status);
    }
    std::memset(p, v, n);
    return ok;
  }
  static Status memcpy_async(void* d, const void* src, std::size_t n, Stream st) {
    {
      Sim& s = sim();
      std::lock_guard lock(s.mutex);
      if (const Status status = on_device(s, st->device); status != ok) return set_error(status);
      if (is_device_memory(s, d) && !is_device_memory(s, src)) ++s.stats.uploads;
    }
    std::memcpy(d, src, n);
    return ok;
  }
  // One simulated runtime call for the whole batch, as cudaMemcpyBatchAsync.
  static Status memcpy_batch_async(void* const* dsts, const void* const* srcs,
                                   const std::size_t* sizes, std::size_t count, Stream st) {
    {
      Sim& s = sim();
      std::lock_guard lock(s.mutex);
      if (const Status status = on_device(s, st->device); status != ok) return set_error(status);
      ++s.stats.batch_copies;
    }
    for (std::size_t i = 0; i < count; ++i)
      std::memcpy(dsts[i], srcs[i], sizes[i]);
    return ok;
  }

  // A launch: device checks and injected failures first, then the work.
  template <class Work>
  static Status launch(Stream st, Work work) {
    {
      Sim& s = sim();
      std::lock_guard lock(s.mutex);
      if (const Status status = on_device(s, st->device); status != ok) return set_error(status);
      if (const Status injected = take(s.fail_launch); injected != ok) {
        if (injected == launch_failure) {
          s.devices[static_cast<std::size_t>(st->device)].lost = launch_failure;
        }
        return set_error(injected);
      }
      ++s.stats.launches;
    }
    work();
    return ok;
  }

  // "Kernels": the kernels' chunk mapping, each chunk's lanes one after another.
  static void fill(const gpu::FillDescriptor* d, std::uint64_t count, std::uint64_t chunks,
                   std::uint8_t value) {
    for (std::uint64_t c = 0; c < chunks; ++c) {
      const gpu::FillSpan span = gpu::fill_chunk(d, count, c);
      for (std::uint64_t lane = 0; lane < gpu::kThreadsPerBlock; ++lane) {
        gpu::fill_bytes(reinterpret_cast<unsigned char*>(span.address), span.bytes, value, lane,
                        gpu::kThreadsPerBlock);
      }
    }
  }
  static void copy(const gpu::CopyDescriptor* d, std::uint64_t count, std::uint64_t chunks) {
    for (std::uint64_t c = 0; c < chunks; ++c) {
      const gpu::CopySpan span = gpu::copy_chunk(d, count, c);
      for (std::uint64_t lane = 0; lane < gpu::kThreadsPerBlock; ++lane) {
        gpu::copy_bytes(reinterpret_cast<unsigned char*>(span.dst),
                        reinterpret_cast<const unsigned char*>(span.src), span.bytes, lane,
                        gpu::kThreadsPerBlock);
      }
    }
  }
  static void fill_blocks(const gpu::PoolDescriptor* pools, std::uint64_t num_pools,
                          std::uint64_t chunks_per_block, const std::uint32_t* ids,
                          std::uint64_t num_ids, std::uint8_t value) {
    for (std::uint64_t c = 0; c < chunks_per_block * num_ids; ++c) {
      const gpu::FillSpan span = gpu::block_chunk(pools, num_pools, chunks_per_block, ids, c);
      for (std::uint64_t lane = 0; lane < gpu::kThreadsPerBlock; ++lane) {
        gpu::fill_bytes(reinterpret_cast<unsigned char*>(span.address), span.bytes, value, lane,
                        gpu::kThreadsPerBlock);
      }
    }
  }

  // Device tables and by-value tables run the same loops: the difference a
  // GPU sees (where the descriptors live) shows here as the absence of an
  // upload in the stats.
  static Status launch_fill_table(const gpu::FillDescriptor* d, std::uint64_t count,
                                  std::uint64_t chunks, std::uint8_t value, Stream st) {
    return launch(st, [&] { fill(d, count, chunks, value); });
  }
  static Status launch_fill_by_value(const gpu::FillDescriptor* d, std::uint64_t count,
                                     std::uint64_t chunks, std::uint8_t value, Stream st) {
    if (count > gpu::kMaxInlineFills) return set_error(invalid_value);
    return launch(st, [&] { fill(d, count, chunks, value); });
  }
  static Status launch_copy_table(const gpu::CopyDescriptor* d, std::uint64_t count,
                                  std::uint64_t chunks, Stream st) {
    return launch(st, [&] { copy(d, count, chunks); });
  }
  static Status launch_copy_by_value(const gpu::CopyDescriptor* d, std::uint64_t count,
                                     std::uint64_t chunks, Stream st) {
    if (count > gpu::kMaxInlineCopies) return set_error(invalid_value);
    return launch(st, [&] { copy(d, count, chunks); });
  }
  static Status launch_fill_blocks_table(const gpu::PoolDescriptor* pools, std::uint64_t num_pools,
                                         std::uint64_t chunks_per_block, const std::uint32_t* ids,
                                         std::uint64_t num_ids, std::uint8_t value, Stream st) {
    return launch(st,
                  [&] { fill_blocks(pools, num_pools, chunks_per_block, ids, num_ids, value); });
  }
  static Status launch_fill_blocks_by_value(const gpu::PoolDescriptor* pools,
                                            std::uint64_t num_pools, std::uint64_t chunks_per_block,
                                            const std::uint32_t* ids, std::uint64_t num_ids,
                                            std::uint8_t value, Stream st) {
    if (num_ids > gpu::kMaxInlineIds) return set_error(invalid_value);
    return launch(st,
                  [&] { fill_blocks(pools, num_pools, chunks_per_block, ids, num_ids, value); });
  }
  // The trap: sticky and context-wide, as on a GPU.
  static Status launch_fault(Stream st) {
    Sim& s = sim();
    std::lock_guard lock(s.mutex);
    if (const Status status = on_device(s, st->device); status != ok) return set_error(status);
    ++s.stats.launches;
    s.devices[static_cast<std::size_t>(st->device)].lost = launch_failure;
    return ok;
  }
};

static_assert(gpu::VendorApi<ApiSim>);

}  // namespace

std::unique_ptr<Backend> make_gpusim_backend(std::size_t capacity_bytes, int device) {
  if (device >= 0 && device < kGpusimDevices) {
    Sim& s = sim();
    std::lock_guard lock(s.mutex);
    Device& d = s.devices[static_cast<std::size_t>(device)];
    d.capacity = capacity_bytes;
    d.lost = ok;  // a fresh context
  }
  return std::make_unique<gpu::GpuBackend<ApiSim>>(device);
}

GpusimStats gpusim_stats() {
  Sim& s = sim();
  std::lock_guard lock(s.mutex);
  return s.stats;
}

void gpusim_reset_stats() {
  Sim& s = sim();
  std::lock_guard lock(s.mutex);
  s.stats = {};
}

int gpusim_current_device() {
  return current_device;
}

void gpusim_set_current_device(int device) {
  current_device = device;
}

void gpusim_leave_stale_error() {
  last_error = invalid_value;
}

void gpusim_fail_next_launch(int code) {
  Sim& s = sim();
  std::lock_guard lock(s.mutex);
  s.fail_launch = static_cast<Status>(code);
}

void gpusim_fail_next_malloc(int code) {
  Sim& s = sim();
  std::lock_guard lock(s.mutex);
  s.fail_malloc = static_cast<Status>(code);
}

void gpusim_fail_next_host_alloc(int code) {
  Sim& s = sim();
  std::lock_guard lock(s.mutex);
  s.fail_host_alloc = static_cast<Status>(code);
}

void* gpusim_create_native_stream(int device) {
  const int previous = current_device;
  current_device = device;
  SimStream* st = nullptr;
  const Status status = ApiSim::stream_create(&st, ApiSim::stream_non_blocking);
  current_device = previous;
  if (status != ok)
    throw BackendError("gpusim", "stream_create", status, ApiSim::error_string(status));
  return st;
}

void gpusim_destroy_native_stream(void* stream) {
  (void)ApiSim::stream_destroy(static_cast<SimStream*>(stream));
}

void* gpusim_malloc_native(std::size_t bytes, int device) {
  const int previous = current_device;
  current_device = device;
  void* p = nullptr;
  const Status status = ApiSim::malloc(&p, bytes);
  current_device = previous;
  if (status != ok) throw BackendError("gpusim", "malloc", status, ApiSim::error_string(status));
  return p;
}

void gpusim_free_native(void* ptr) {
  Sim& s = sim();
  int device = 0;
  {
    std::lock_guard lock(s.mutex);
    const auto it = s.allocations.find(reinterpret_cast<std::uintptr_t>(ptr));
    if (it == s.allocations.end()) return;
    device = it->second.device;
  }
  const int previous = current_device;
  current_device = device;
  (void)ApiSim::free(ptr);
  current_device = previous;
}

bool gpusim_memset_native(void* stream, void* ptr, std::uint8_t value, std::size_t bytes) {
  const int previous = current_device;
  current_device = static_cast<SimStream*>(stream)->device;
  const Status status = ApiSim::memset_async(ptr, value, bytes, static_cast<SimStream*>(stream));
  current_device = previous;
  return status == ok;
}

void gpusim_hold_completion(bool held) {
  Sim& s = sim();
  std::lock_guard lock(s.mutex);
  s.held = held;
  if (!held) {
    for (SimEvent* e : s.events)
      e->complete = true;
  }
}

}  // namespace kvport::testing
