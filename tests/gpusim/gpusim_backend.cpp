#include "gpusim_backend.hpp"

#include <chrono>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <unordered_map>

#include "gpu_backend.hpp"
#include "gpu_chunks.hpp"

namespace kvport::testing {
namespace {

struct SimStream {
  bool fault = false;  // set by the fault "kernel", reported at synchronize
};
struct SimEvent {
  std::chrono::steady_clock::time_point recorded;  // work runs at launch, so at record
  bool ever_recorded = false;
};

// Device memory accounting shared by every simulated backend in the process.
struct SimMemory {
  std::mutex mutex;
  std::size_t capacity = 0;
  std::size_t used = 0;
  std::unordered_map<void*, std::size_t> sizes;
};

SimMemory& sim_memory() {
  static SimMemory memory;
  return memory;
}

std::size_t rounded(std::size_t n) {
  return (n + kAllocAlignment - 1) / kAllocAlignment * kAllocAlignment;
}

// The API struct, shaped like ApiCuda / ApiHip.
struct ApiSim {
  enum Status : int { ok = 0, invalid_value = 1, out_of_memory = 2, launch_failure = 719 };
  using Stream = SimStream*;
  using Event = SimEvent*;
  static constexpr Status success = ok;
  static constexpr const char* name = "gpusim";

  static const char* error_string(Status s) {
    switch (s) {
      case ok:
        return "no error";
      case invalid_value:
        return "invalid argument";
      case out_of_memory:
        return "out of memory";
      case launch_failure:
        return "unspecified launch failure (simulated trap)";
    }
    return "unknown error";
  }
  static void clear_error() noexcept {}

  static Status get_device_count(int* n) {
    *n = 1;
    return ok;
  }
  static Status set_device(int d) { return d == 0 ? ok : invalid_value; }
  static Status mem_get_info(std::size_t* free_bytes, std::size_t* total) {
    SimMemory& m = sim_memory();
    std::lock_guard lock(m.mutex);
    *free_bytes = m.capacity - m.used;
    *total = m.capacity;
    return ok;
  }
  static Status malloc(void** p, std::size_t n) {
    SimMemory& m = sim_memory();
    std::lock_guard lock(m.mutex);
    if (n > m.capacity - m.used || rounded(n) > m.capacity - m.used) return out_of_memory;
    *p = std::aligned_alloc(kAllocAlignment, rounded(n));
    if (*p == nullptr) return out_of_memory;
    m.used += rounded(n);
    m.sizes.emplace(*p, rounded(n));
    return ok;
  }
  static Status free(void* p) {
    SimMemory& m = sim_memory();
    std::lock_guard lock(m.mutex);
    auto it = m.sizes.find(p);
    if (it == m.sizes.end()) return invalid_value;
    m.used -= it->second;
    m.sizes.erase(it);
    std::free(p);
    return ok;
  }
  static Status host_alloc(void** p, std::size_t n) {
    if (n > SIZE_MAX - kHostAllocAlignment) return out_of_memory;
    *p = std::aligned_alloc(kHostAllocAlignment,
                            (n + kHostAllocAlignment - 1) / kHostAllocAlignment * kHostAllocAlignment);
    return *p != nullptr ? ok : out_of_memory;
  }
  static Status host_free(void* p) {
    std::free(p);
    return ok;
  }
  static Status stream_create(Stream* s) {
    *s = new SimStream;
    return ok;
  }
  static Status stream_destroy(Stream s) {
    delete s;
    return ok;
  }
  static Status stream_synchronize(Stream s) {
    if (s->fault) {
      s->fault = false;
      return launch_failure;
    }
    return ok;
  }
  static Status event_create(Event* e) {
    *e = new SimEvent;
    return ok;
  }
  static Status event_destroy(Event e) {
    delete e;
    return ok;
  }
  static Status timing_event_create(Event* e) { return event_create(e); }
  static Status event_elapsed_ms(float* ms, Event start, Event end) {
    if (!start->ever_recorded || !end->ever_recorded) return invalid_value;
    *ms = std::chrono::duration<float, std::milli>(end->recorded - start->recorded).count();
    return ok;
  }
  static Status event_record(Event e, Stream) {
    e->recorded = std::chrono::steady_clock::now();
    e->ever_recorded = true;
    return ok;
  }
  static Status stream_wait_event(Stream, Event) { return ok; }
  static Status event_synchronize(Event) { return ok; }
  static Status memset_async(void* p, int v, std::size_t n, Stream) {
    std::memset(p, v, n);
    return ok;
  }
  static Status memcpy_async(void* d, const void* s, std::size_t n, Stream) {
    std::memcpy(d, s, n);
    return ok;
  }

  // "Kernels": the kernels' chunk mapping, each chunk's lanes one after another.
  static int launch_fill(const gpu::FillDescriptor* d, std::uint64_t count, std::uint64_t chunks,
                         std::uint8_t value, Stream) {
    for (std::uint64_t c = 0; c < chunks; ++c) {
      const gpu::FillSpan span = gpu::fill_chunk(d, count, c);
      for (std::uint64_t lane = 0; lane < gpu::kThreadsPerBlock; ++lane) {
        gpu::fill_bytes(reinterpret_cast<unsigned char*>(span.address), span.bytes, value, lane,
                        gpu::kThreadsPerBlock);
      }
    }
    return ok;
  }
  static int launch_copy(const gpu::CopyDescriptor* d, std::uint64_t count, std::uint64_t chunks,
                         Stream) {
    for (std::uint64_t c = 0; c < chunks; ++c) {
      const gpu::CopySpan span = gpu::copy_chunk(d, count, c);
      for (std::uint64_t lane = 0; lane < gpu::kThreadsPerBlock; ++lane) {
        gpu::copy_bytes(reinterpret_cast<unsigned char*>(span.dst),
                        reinterpret_cast<const unsigned char*>(span.src), span.bytes, lane,
                        gpu::kThreadsPerBlock);
      }
    }
    return ok;
  }
  static int launch_fill_blocks(const gpu::PoolDescriptor* pools, std::uint64_t num_pools,
                                std::uint64_t chunks_per_block, const std::uint32_t* ids,
                                std::uint64_t num_ids, std::uint8_t value, Stream) {
    for (std::uint64_t c = 0; c < chunks_per_block * num_ids; ++c) {
      const gpu::FillSpan span = gpu::block_chunk(pools, num_pools, chunks_per_block, ids, c);
      for (std::uint64_t lane = 0; lane < gpu::kThreadsPerBlock; ++lane) {
        gpu::fill_bytes(reinterpret_cast<unsigned char*>(span.address), span.bytes, value, lane,
                        gpu::kThreadsPerBlock);
      }
    }
    return ok;
  }
  static int launch_fault(Stream s) {
    s->fault = true;
    return ok;
  }
};

}  // namespace

std::unique_ptr<Backend> make_gpusim_backend(std::size_t capacity_bytes) {
  {
    SimMemory& m = sim_memory();
    std::lock_guard lock(m.mutex);
    m.capacity = capacity_bytes;
  }
  return std::make_unique<gpu::GpuBackend<ApiSim>>(0);
}

}  // namespace kvport::testing
