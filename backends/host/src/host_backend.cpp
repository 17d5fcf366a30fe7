// SPDX-License-Identifier: Apache-2.0
#include "kvport/backends/host_backend.hpp"

#include <fmt/format.h>
#include <sys/mman.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <unordered_map>
#include <utility>
#include <vector>

#include "host_stream.hpp"
#include "kvport/platform/allocation_tracker.hpp"
#include "kvport/platform/byte_size.hpp"
#include "kvport/platform/div_ceil.hpp"
#include "kvport/platform/error.hpp"
#include "kvport/platform/log.hpp"
#include "streaming_fill.hpp"

namespace kvport {
namespace {

constexpr const char* kName = "host";
constexpr const char* kPinnedName = "host (pinned host memory)";

using host::Completion;
using host::HostEvent;
using host::HostStream;
using host::StreamingFill;

// ---- the backend -------------------------------------------------------------------

class HostBackend final : public Backend {
 public:
  explicit HostBackend(std::size_t capacity)
      : Backend(kName),
        capacity_(capacity),
        streaming_threshold_(host::streaming_threshold()),
        huge_pages_(huge_pages_from_environment()) {
    streams_.emplace(handle(kDefaultStreamId), std::make_shared<HostStream>());
  }

  ~HostBackend() override {
    // Drain every stream (their queued work uses the allocations), then
    // release what the user did not free.
    std::unordered_map<void*, std::shared_ptr<HostStream>> streams;
    {
      std::lock_guard lock(handles_mutex_);
      streams.swap(streams_);
      events_.clear();
    }
    streams.clear();
    const auto live = tracker_.live();
    if (!live.empty()) {
      log::warn(
          fmt::format("host: backend destroyed with {} live allocations ({} bytes); freeing them",
                      live.size(), tracker_.live_bytes()));
    }
    for (const auto& [base, bytes] : live) {
      (void)tracker_.remove(DevicePtr(base));  // out of the process-wide map before the free
      std::free(reinterpret_cast<void*>(base));
    }
    const auto pinned = host_tracker_.live();
    if (!pinned.empty()) {
      log::warn(
          fmt::format("host: backend destroyed with {} live pinned host allocations; "
                      "freeing them",
                      pinned.size()));
    }
    for (const auto& [base, bytes] : pinned)
      std::free(reinterpret_cast<void*>(base));
  }

  HostBackend(const HostBackend&) = delete;
  HostBackend& operator=(const HostBackend&) = delete;

  // Backs host_enqueue_for_testing: `fn` runs in stream order, unchecked.
  void enqueue_raw(void* stream, std::function<void()> fn) {
    stream_of(stream, "host_enqueue_for_testing")->enqueue(std::move(fn));
  }

 private:
  // Streams are named by a serial number, never by an address: a destroyed
  // stream's address is soon reused by a new one, and a stale StreamView
  // must be rejected rather than silently queue work on the newcomer.
  static constexpr std::uintptr_t kDefaultStreamId = 1;
  static void* handle(std::uintptr_t id) noexcept { return reinterpret_cast<void*>(id); }

  using Use = AllocationTracker::Use;

  // Device memory of 2 MiB or more (every pool of a real cache) is aligned to
  // 2 MiB and advised for transparent huge pages: a batch of scattered blocks
  // touches tens of thousands of 4 KiB pages, each a TLB miss that costs a
  // two-dimensional page walk under a hypervisor (docs/performance.md, "Huge
  // pages"). Only advice: where THP is off it changes nothing.
  // KVPORT_HOST_HUGE_PAGES=0 turns it off (to compare); read at construction.
  static constexpr std::size_t kHugePage = std::size_t{2} << 20;
  static bool huge_pages_from_environment() {
    const char* env = std::getenv("KVPORT_HOST_HUGE_PAGES");
    if (env == nullptr || *env == '\0' || std::strcmp(env, "1") == 0) return true;
    if (std::strcmp(env, "0") == 0) return false;
    throw InvalidArgument(fmt::format(
        "KVPORT_HOST_HUGE_PAGES: '{}' is neither 0 (off) nor 1 (on, the default)", env));
  }
  // Pinned host memory (alloc_host) of 2 MiB or more gets the same advice:
  // staging buffers are fresh memory whose first touch otherwise costs one
  // page fault per 4 KiB (about 0.6 s per 128 MiB under this hypervisor).
  void* allocate_pool_memory(std::size_t size,
                             std::size_t alignment = kAllocAlignment) const noexcept {
    if (size < kHugePage || !huge_pages_) return std::aligned_alloc(alignment, size);
    if (size > SIZE_MAX - kHugePage) return nullptr;
    const std::size_t whole = round_up(size, kHugePage);
    void* p = std::aligned_alloc(kHugePage, whole);
    if (p != nullptr) (void)::madvise(p, whole, MADV_HUGEPAGE);
    return p;
  }

  static std::size_t rounded(std::size_t bytes) noexcept {
    return round_up(bytes, kAllocAlignment);
  }

  // Checks `uses` now (throwing InvalidArgument at call time), then queues
  // `body(uses)` on the stream. The body runs with the memory lock held
  // shared, so a concurrent free waits for it; if anything was freed since
  // the call, the ranges are checked again first and a failure becomes the
  // stream's error at its next synchronize.
  template <class Body>
  void enqueue_checked(void* stream, const char* op, std::vector<Use> uses, Body body) {
    std::shared_ptr<HostStream> s = stream_of(stream, op);
    std::uint64_t generation = 0;
    {
      auto lock = tracker_.read_lock();
      for (Use& u : uses)
        u.serial = tracker_.check_locked(u.ptr, u.bytes, u.what);
      // Read under the same lock as the check: a free landing between the
      // two would otherwise go unnoticed at execution time.
      generation = tracker_.generation_locked();
    }
    s->enqueue([this, generation, uses = std::move(uses), body = std::move(body)] {
      auto lock = tracker_.read_lock();
      if (tracker_.generation_locked() != generation) {
        for (const Use& u : uses)
          tracker_.recheck_locked(u);
      }
      body(uses);
    });
  }

  std::shared_ptr<HostStream> stream_of(void* native, const char* op) const {
    std::lock_guard lock(handles_mutex_);
    auto it = streams_.find(native);
    if (it == streams_.end()) {
      throw InvalidArgument(
          fmt::format("host: {}: stream {} is not a live stream (destroyed?)", op, native));
    }
    return it->second;
  }

  std::shared_ptr<HostEvent> event_of(void* native, const char* op) const {
    std::lock_guard lock(handles_mutex_);
    auto it = events_.find(native);
    if (it == events_.end()) {
      throw InvalidArgument(fmt::format("host: {}: event {} is not a live event", op, native));
    }
    return it->second;
  }

  // ---- Backend ----

  int do_device_count() const override { return 1; }

  MemInfo do_mem_info() const override {
    std::lock_guard lock(capacity_mutex_);
    return MemInfo{capacity_ - used_, capacity_};
  }

  DevicePtr do_alloc(std::size_t bytes) override {
    if (bytes > SIZE_MAX - (kAllocAlignment - 1)) throw OutOfMemory(kName, bytes, 0);
    const std::size_t size = rounded(bytes);
    std::lock_guard lock(capacity_mutex_);
    if (size > capacity_ - used_) throw OutOfMemory(kName, bytes, capacity_ - used_);
    void* p = allocate_pool_memory(size);
    if (p == nullptr) throw OutOfMemory(kName, bytes, capacity_ - used_);
    try {
      tracker_.add(DevicePtr::from(p), bytes);
    } catch (...) {
      std::free(p);
      throw;
    }
    used_ += size;
    return DevicePtr::from(p);
  }

  bool do_free(DevicePtr ptr) noexcept override {
    // remove() waits for operations executing on the memory (they hold the
    // tracker's read lock); queued ones will find it gone and fail.
    const std::optional<std::size_t> bytes = tracker_.remove(ptr);
    if (!bytes) return false;
    std::free(ptr.get());
    std::lock_guard lock(capacity_mutex_);
    used_ -= rounded(*bytes);
    return true;
  }

  // Pinned host memory is plain page-aligned memory here: the host backend's
  // "device" is host memory too. Not counted against the device capacity.
  void* do_alloc_host(std::size_t bytes) override {
    if (bytes > SIZE_MAX - (kHostAllocAlignment - 1)) throw OutOfMemory(kName, bytes, 0);
    const std::size_t size = round_up(bytes, kHostAllocAlignment);
    void* p = allocate_pool_memory(size, kHostAllocAlignment);
    if (p == nullptr) throw OutOfMemory(kName, bytes, 0);
    try {
      host_tracker_.add(DevicePtr::from(p), bytes);
    } catch (...) {
      std::free(p);
      throw;
    }
    return p;
  }

  bool do_free_host(void* ptr) noexcept override {
    if (!host_tracker_.remove(DevicePtr::from(ptr))) return false;
    std::free(ptr);
    return true;
  }

  void* do_create_stream() override {
    auto stream = std::make_shared<HostStream>();
    std::lock_guard lock(handles_mutex_);
    void* native = handle(++last_stream_id_);
    streams_.emplace(native, std::move(stream));
    return native;
  }

  void do_destroy_stream(void* native) noexcept override {
    if (native == handle(kDefaultStreamId)) return;
    std::shared_ptr<HostStream> doomed;
    {
      std::lock_guard lock(handles_mutex_);
      auto it = streams_.find(native);
      if (it == streams_.end()) return;
      doomed = std::move(it->second);
      streams_.erase(it);
    }
    // `doomed` drains its queue and joins its worker here, outside the lock
    // (or in a thread still using it, when that one lets go).
  }

  void* do_default_stream() override { return handle(kDefaultStreamId); }

  // The host backend's "vendor stream" is a worker's queue (a HostStream);
  // its address is the handle vendor_stream gives out and wrap_stream takes
  // back. A wrap is a second serial naming the same queue: destroying it
  // drops one reference, never the queue of a stream still alive.
  void* do_wrap_stream(void* vendor) override {
    if (vendor == nullptr) {
      throw InvalidArgument(
          "host: wrap_stream: a null handle; the host backend has no vendor default stream "
          "(wrap vendor_stream(default_stream()) to share the backend's own)");
    }
    std::lock_guard lock(handles_mutex_);
    for (const auto& [native, stream] : streams_) {
      if (stream.get() != vendor) continue;
      void* wrapped = handle(++last_stream_id_);
      streams_.emplace(wrapped, stream);
      return wrapped;
    }
    throw InvalidArgument(fmt::format(
        "host: wrap_stream: {} is not the queue of a live stream of this backend (the host "
        "backend has no vendor streams: it wraps only what vendor_stream gave out)",
        vendor));
  }

  void* do_vendor_stream(void* native) const override {
    return stream_of(native, "vendor_stream").get();
  }

  void do_adopt_memory(DevicePtr base, std::size_t bytes) override {
    tracker_.add_adopted(base, bytes);
  }

  void do_release_adopted(DevicePtr base) noexcept override {
    // Waits for operations running on the range (they hold the read lock);
    // queued ones will find it gone and fail, as after a free.
    (void)tracker_.remove_adopted(base);
  }

  bool do_stream_alive(void* native) const noexcept override {
    std::lock_guard lock(handles_mutex_);
    return streams_.contains(native);  // the default stream is in it until destruction
  }

  void do_synchronize(void* stream) override { stream_of(stream, "synchronize")->synchronize(); }

  void* do_create_event() override {
    auto event = std::make_shared<HostEvent>();
    void* native = event.get();
    std::lock_guard lock(handles_mutex_);
    events_.emplace(native, std::move(event));
    return native;
  }

  void do_destroy_event(void* native) noexcept override {
    std::lock_guard lock(handles_mutex_);
    events_.erase(native);  // queued work keeps its own reference
  }

  void do_record_event(void* event_native, void* stream) override {
    auto event = event_of(event_native, "record_event");
    auto s = stream_of(stream, "record_event");
    auto completion = std::make_shared<Completion>();
    s->enqueue([completion] { completion->signal(); });
    std::lock_guard lock(event->mutex);
    event->latest = std::move(completion);
  }

  void do_wait_event(void* stream, void* event_native) override {
    auto event = event_of(event_native, "wait_event");
    auto s = stream_of(stream, "wait_event");
    auto completion = event->current();
    if (!completion) return;  // never recorded: nothing to wait for
    s->enqueue([completion] { completion->wait(); });
  }

  // Every host event keeps its completion time, so a timing event is a plain one.
  void* do_create_timing_event() override { return do_create_event(); }

  double do_elapsed_seconds(void* start_native, void* end_native) override {
    auto start = event_of(start_native, "elapsed_seconds")->current();
    auto end = event_of(end_native, "elapsed_seconds")->current();
    if (!start || !end) {
      throw InvalidArgument("host: elapsed_seconds: an event was never recorded");
    }
    return std::chrono::duration<double>(end->when() - start->when()).count();
  }

  void do_synchronize_event(void* event_native) override {
    auto completion = event_of(event_native, "synchronize_event")->current();
    if (completion) completion->wait();
  }

  bool do_query_event(void* event_native) override {
    auto completion = event_of(event_native, "query_event")->current();
    return !completion || completion->done();
  }

  void do_inject_async_fault(void* stream) override {
    stream_of(stream, "inject_async_fault")->enqueue([] {
      throw BackendError(kName, "inject_async_fault", -1, "injected asynchronous fault");
    });
  }

  void do_memset_async(DevicePtr ptr, std::uint8_t value, std::size_t bytes,
                       void* stream) override {
    enqueue_checked(
        stream, "memset_async", {{ptr, bytes, "memset_async"}},
        [value](const std::vector<Use>& u) { std::memset(u[0].ptr.get(), value, u[0].bytes); });
  }

  // ---- block pools: checked once per pool, not once per block region ----

  struct HostPools {
    std::vector<PoolGeometry> pools;
    std::size_t num_blocks = 0;
  };

  // A use covering every block region of one pool (its extent was checked
  // for overflow at registration).
  static Use pool_use(const PoolGeometry& p, std::size_t num_blocks) {
    return Use{p.base, p.extent(num_blocks).value(), "fill_blocks_async"};
  }

  void* do_register_block_pools(std::span<const PoolGeometry> pools,
                                std::size_t num_blocks) override {
    auto table = std::make_unique<HostPools>();
    table->pools.assign(pools.begin(), pools.end());
    table->num_blocks = num_blocks;
    auto lock = tracker_.read_lock();
    for (const PoolGeometry& p : pools) {
      const Use u = pool_use(p, num_blocks);
      tracker_.check_locked(u.ptr, u.bytes, "register_block_pools");
    }
    return table.release();
  }

  void do_unregister_block_pools(void* native) noexcept override {
    delete static_cast<HostPools*>(native);
  }

  // The cache-aware fill: the ranges checked are the pools' whole extents
  // (2 x layers of them), so the calling thread's cost grows with the batch
  // only by a copy and sort of the ids; the worker walks the ids, one fill
  // per run of consecutive ids in a dense pool.
  void do_fill_blocks_async(void* native, std::span<const std::uint32_t> ids, std::uint8_t value,
                            void* stream) override {
    const auto& table = *static_cast<const HostPools*>(native);
    std::vector<Use> uses;
    uses.reserve(table.pools.size());
    for (const PoolGeometry& p : table.pools)
      uses.push_back(pool_use(p, table.num_blocks));
    std::size_t block_bytes = 0;
    for (const PoolGeometry& p : table.pools)
      block_bytes += p.bytes;
    const StreamingFill stream_fill =
        block_bytes * ids.size() >= streaming_threshold_ ? host::streaming_fill() : nullptr;
    // Ascending order: a pool's regions are then written front to back, and
    // neighbouring ids merge into one run. Measured on 160 pools of 32 KiB
    // regions (docs/performance.md): as fast or faster than the caller's
    // order in every case, up to 2x at 32 scattered blocks.
    std::vector<std::uint32_t> sorted(ids.begin(), ids.end());
    std::sort(sorted.begin(), sorted.end());
    enqueue_checked(stream, "fill_blocks_async", std::move(uses),
                    [pools = table.pools, ids = std::move(sorted), value,
                     stream_fill](const std::vector<Use>&) {
                      for (const PoolGeometry& pool : pools) {
                        const bool dense = pool.stride == pool.bytes;
                        std::size_t i = 0;
                        while (i < ids.size()) {
                          std::size_t j = i + 1;
                          while (dense && j < ids.size() && ids[j] == ids[j - 1] + 1)
                            ++j;
                          auto* p = static_cast<unsigned char*>(pool.base.get()) +
                                    std::size_t{ids[i]} * pool.stride;
                          if (stream_fill != nullptr) {
                            stream_fill(p, value, (j - i) * pool.bytes);
                          } else {
                            std::memset(p, value, (j - i) * pool.bytes);
                          }
                          i = j;
                        }
                      }
                      if (stream_fill != nullptr) host::streaming_fence();
                    });
  }

  void do_fill_async(std::span<const FillRegion> regions, std::uint8_t value,
                     void* stream) override {
    std::vector<Use> uses;
    uses.reserve(regions.size());
    for (const FillRegion& r : regions)
      uses.push_back({r.ptr, r.bytes, "fill_async"});
    enqueue_checked(stream, "fill_async", std::move(uses), [value](const std::vector<Use>& u) {
      for (const Use& r : u)
        std::memset(r.ptr.get(), value, r.bytes);
    });
  }

  void do_copy_h2d_async(DevicePtr dst, const void* src, std::size_t bytes, void* stream) override {
    enqueue_checked(
        stream, "copy_h2d_async", {{dst, bytes, "copy_h2d_async"}},
        [src](const std::vector<Use>& u) { std::memcpy(u[0].ptr.get(), src, u[0].bytes); });
  }

  void do_copy_d2h_async(void* dst, DevicePtr src, std::size_t bytes, void* stream) override {
    enqueue_checked(
        stream, "copy_d2h_async", {{src, bytes, "copy_d2h_async"}},
        [dst](const std::vector<Use>& u) { std::memcpy(dst, u[0].ptr.get(), u[0].bytes); });
  }

  void do_copy_d2d_async(DevicePtr dst, DevicePtr src, std::size_t bytes, void* stream) override {
    // uses[0] is the source, uses[1] the destination.
    enqueue_checked(
        stream, "copy_d2d_async",
        {{src, bytes, "copy_d2d_async (source)"}, {dst, bytes, "copy_d2d_async (destination)"}},
        [](const std::vector<Use>& u) { std::memcpy(u[1].ptr.get(), u[0].ptr.get(), u[0].bytes); });
  }

  void do_copy_batch_async(std::span<const CopyRegion> regions, void* stream) override {
    // Two uses per region: source, then destination.
    std::vector<Use> uses;
    uses.reserve(2 * regions.size());
    for (const CopyRegion& r : regions) {
      uses.push_back({r.src, r.bytes, "copy_batch_async (source)"});
      uses.push_back({r.dst, r.bytes, "copy_batch_async (destination)"});
    }
    enqueue_checked(stream, "copy_batch_async", std::move(uses), [](const std::vector<Use>& u) {
      for (std::size_t i = 0; i + 1 < u.size(); i += 2) {
        std::memcpy(u[i + 1].ptr.get(), u[i].ptr.get(), u[i].bytes);
      }
    });
  }

  // One stream operation for the whole batch: the device ranges are checked
  // now and again before it runs if anything was freed meanwhile (then the
  // batch copies nothing and fails at the stream's next synchronize).
  void do_copy_host_batch_async(std::span<const HostCopyRegion> regions,
                                HostCopyDirection direction, void* stream) override {
    const bool to_device = direction == HostCopyDirection::host_to_device;
    const char* op = to_device ? "copy_batch_h2d_async" : "copy_batch_d2h_async";
    std::vector<Use> uses;
    std::vector<void*> hosts;
    uses.reserve(regions.size());
    hosts.reserve(regions.size());
    for (const HostCopyRegion& r : regions) {
      uses.push_back({r.device, r.bytes, op});
      hosts.push_back(r.host);
    }
    enqueue_checked(stream, op, std::move(uses),
                    [hosts = std::move(hosts), to_device](const std::vector<Use>& u) {
                      for (std::size_t i = 0; i < u.size(); ++i) {
                        if (to_device) {
                          std::memcpy(u[i].ptr.get(), hosts[i], u[i].bytes);
                        } else {
                          std::memcpy(hosts[i], u[i].ptr.get(), u[i].bytes);
                        }
                      }
                    });
  }

  const std::size_t capacity_;
  const std::size_t streaming_threshold_;
  const bool huge_pages_;  // KVPORT_HOST_HUGE_PAGES

  AllocationTracker tracker_{kName, MemorySpace::of(MemoryKind::host, 0)};
  AllocationTracker host_tracker_{kPinnedName};  // alloc_host
  mutable std::mutex capacity_mutex_;
  std::size_t used_ = 0;  // bytes rounded up to kAllocAlignment

  mutable std::mutex handles_mutex_;
  std::uintptr_t last_stream_id_ = kDefaultStreamId;
  std::unordered_map<void*, std::shared_ptr<HostStream>> streams_;
  std::unordered_map<void*, std::shared_ptr<HostEvent>> events_;
};

}  // namespace

std::unique_ptr<Backend> make_host_backend(HostBackendOptions options) {
  std::size_t capacity = 0;
  if (options.capacity_bytes) {
    capacity = *options.capacity_bytes;
  } else if (const char* env = std::getenv("KVPORT_HOST_MEMORY"); env != nullptr && *env != '\0') {
    try {
      capacity = parse_byte_size(env);
    } catch (const InvalidArgument& e) {
      throw InvalidArgument(std::string("KVPORT_HOST_MEMORY: ") + e.what());
    }
  } else {
    capacity = host_physical_memory();
  }
  return std::make_unique<HostBackend>(capacity);
}

std::unique_ptr<Backend> make_default_host_backend() {
  return make_host_backend();
}

std::unique_ptr<Backend> make_host_backend_on(int device) {
  if (device != 0) {
    throw InvalidArgument(fmt::format(
        "host: device ordinal {} out of range (the host backend has 1 device, 0)", device));
  }
  return make_host_backend();
}

std::string probe_host_backend() {
  return {};
}

void host_enqueue_for_testing(Backend& backend, StreamView stream, std::function<void()> fn) {
  auto* host = dynamic_cast<HostBackend*>(&backend);
  if (host == nullptr) {
    throw InvalidArgument(fmt::format(
        "host_enqueue_for_testing: backend '{}' is not a host backend", backend.name()));
  }
  if (stream.backend() != &backend) {
    throw InvalidArgument("host_enqueue_for_testing: the stream belongs to another backend");
  }
  if (!fn) throw InvalidArgument("host_enqueue_for_testing: empty function");
  host->enqueue_raw(stream.native(), std::move(fn));
}

}  // namespace kvport
