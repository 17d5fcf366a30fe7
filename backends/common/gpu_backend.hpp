// GpuBackend<Api>: the whole Backend contract written once over a small
// per-vendor API mapping (ApiCuda in backends/cuda, ApiHip in backends/hip),
// in the style of alpaka's ApiCudaRt / ApiHipRt. A difference between the
// vendors lives in the Api struct, never here.
//
// Api provides: Status, success, name, error_string, clear_error, Stream,
// Event, and static wrappers get_device_count, set_device, mem_get_info,
// malloc, free, host_alloc, host_free, stream_create, stream_destroy,
// stream_synchronize, event_create, event_destroy, event_record,
// stream_wait_event, event_synchronize, memset_async, memcpy_async, and the
// kernel launchers launch_fill, launch_copy, launch_fill_blocks.
#pragma once

#include <fmt/format.h>

#include <array>
#include <cstring>
#include <memory>
#include <mutex>
#include <unordered_set>
#include <vector>

#include "gpu_kernels.hpp"
#include "kvport/platform/allocation_tracker.hpp"
#include "kvport/platform/backend.hpp"
#include "kvport/platform/error.hpp"
#include "kvport/platform/log.hpp"

namespace kvport::gpu {

/// "<vendor>: no device: <reason>" when the runtime has no usable device,
/// else an empty string.
template <class Api>
std::string probe(int device = 0) {
  int count = 0;
  const typename Api::Status status = Api::get_device_count(&count);
  if (status != Api::success) {
    Api::clear_error();
    return fmt::format("{}: no device: {} (error {})", Api::name, Api::error_string(status),
                       static_cast<long>(status));
  }
  if (count == 0) return fmt::format("{}: no device: the runtime reports 0 devices", Api::name);
  if (device < 0 || device >= count) {
    return fmt::format("{}: no device: ordinal {} out of range ({} devices)", Api::name, device,
                       count);
  }
  return {};
}

template <class Api>
class GpuBackend final : public Backend {
 public:
  using Stream_t = typename Api::Stream;
  using Event_t = typename Api::Event;

  /// Selects `device`. Throws BackendError when the runtime has no usable
  /// device (the message carries the vendor's reason).
  explicit GpuBackend(int device) : Backend(Api::name), device_(device), tracker_(Api::name) {
    int count = 0;
    if (Api::get_device_count(&count) == Api::success && count > 0 &&
        (device < 0 || device >= count)) {
      throw InvalidArgument(fmt::format("{}: device ordinal {} out of range ({} devices)",
                                        Api::name, device, count));
    }
    const std::string reason = probe<Api>(device);
    if (!reason.empty()) throw BackendError(Api::name, "device probe", -1, reason);
    KVPORT_TRY(Api, Api::set_device(device_));
    KVPORT_TRY(Api, Api::stream_create(&default_stream_));
    std::size_t created = 0;
    try {
      for (; created < staging_.size(); ++created) {
        KVPORT_TRY(Api, Api::event_create(&staging_[created].done));
      }
    } catch (...) {  // the destructor will not run: release what exists
      for (std::size_t i = 0; i < created; ++i) {
        KVPORT_TRY_NOTHROW(Api, Api::event_destroy(staging_[i].done));
      }
      KVPORT_TRY_NOTHROW(Api, Api::stream_destroy(default_stream_));
      throw;
    }
  }

  ~GpuBackend() override {
    KVPORT_TRY_NOTHROW(Api, Api::set_device(device_));
    KVPORT_TRY_NOTHROW(Api, Api::stream_synchronize(default_stream_));
    for (Staging& s : staging_) {
      if (s.pending) KVPORT_TRY_NOTHROW(Api, Api::event_synchronize(s.done));
      if (s.host != nullptr) KVPORT_TRY_NOTHROW(Api, Api::host_free(s.host));
      if (s.device != nullptr) KVPORT_TRY_NOTHROW(Api, Api::free(s.device));
      KVPORT_TRY_NOTHROW(Api, Api::event_destroy(s.done));
    }
    for (void* stream : streams_)
      KVPORT_TRY_NOTHROW(Api, Api::stream_destroy(as_stream(stream)));
    for (void* event : events_)
      KVPORT_TRY_NOTHROW(Api, Api::event_destroy(as_event(event)));
    KVPORT_TRY_NOTHROW(Api, Api::stream_destroy(default_stream_));
    for (const auto& [base, bytes] : tracker_.live()) {
      log::warn(fmt::format("{}: backend destroyed with a live allocation [{:#x}, +{}); freeing it",
                            Api::name, base, bytes));
      KVPORT_TRY_NOTHROW(Api, Api::free(reinterpret_cast<void*>(base)));
    }
    for (const auto& [base, bytes] : host_tracker_.live()) {
      log::warn(fmt::format("{}: backend destroyed with a live pinned host allocation [{:#x}, +{}); "
                            "freeing it",
                            Api::name, base, bytes));
      KVPORT_TRY_NOTHROW(Api, Api::host_free(reinterpret_cast<void*>(base)));
    }
  }

 private:
  static Stream_t as_stream(void* native) { return static_cast<Stream_t>(native); }
  static Event_t as_event(void* native) { return static_cast<Event_t>(native); }

  Stream_t stream_of(void* native) const {
    if (native == static_cast<void*>(default_stream_)) return default_stream_;
    std::lock_guard lock(handles_mutex_);
    if (streams_.count(native) == 0) {
      throw InvalidArgument(fmt::format("{}: stream {} is not a live stream", Api::name, native));
    }
    return as_stream(native);
  }

  Event_t event_of(void* native) const {
    std::lock_guard lock(handles_mutex_);
    if (events_.count(native) == 0) {
      throw InvalidArgument(fmt::format("{}: event {} is not a live event", Api::name, native));
    }
    return as_event(native);
  }

  // ---- staging: descriptor uploads through pinned memory ---------------------

  struct Staging {
    void* host = nullptr;    // pinned
    void* device = nullptr;  // descriptor table the kernel reads
    std::size_t capacity = 0;
    Event_t done{};  // recorded after the kernel that read `device`
    bool pending = false;
  };

  // Copies `bytes` of descriptors into a staging slot that no in-flight work
  // still uses, uploads them on `stream`, runs `launch(device_copy)`, and
  // guards the slot with an event. One lock: no other thread can take the slot
  // between the upload and the event record.
  template <class Launch>
  void upload_and_launch(const void* data, std::size_t bytes, Stream_t stream, Launch launch) {
    std::lock_guard lock(staging_mutex_);
    Staging& s = staging_[next_slot_++ % staging_.size()];
    if (s.pending) {
      KVPORT_TRY(Api, Api::event_synchronize(s.done));
      s.pending = false;
    }
    if (s.capacity < bytes) {
      std::size_t capacity = s.capacity == 0 ? 64 * 1024 : s.capacity;
      while (capacity < bytes)
        capacity *= 2;
      if (s.host != nullptr) KVPORT_TRY(Api, Api::host_free(s.host));
      if (s.device != nullptr) KVPORT_TRY(Api, Api::free(s.device));
      s.host = s.device = nullptr;
      s.capacity = 0;
      KVPORT_TRY(Api, Api::host_alloc(&s.host, capacity));
      KVPORT_TRY(Api, Api::malloc(&s.device, capacity));
      s.capacity = capacity;
    }
    std::memcpy(s.host, data, bytes);
    KVPORT_TRY(Api, Api::memcpy_async(s.device, s.host, bytes, stream));
    const typename Api::Status launched = launch(s.device);
    // Record even when the launch failed: the upload is in flight either way.
    KVPORT_TRY(Api, Api::event_record(s.done, stream));
    s.pending = true;
    detail::check_vendor<Api>(launched, "kernel launch");
  }

  // ---- Backend -----------------------------------------------------------------

  int do_device_count() const override {
    int count = 0;
    KVPORT_TRY(Api, Api::get_device_count(&count));
    return count;
  }

  MemInfo do_mem_info() const override {
    KVPORT_TRY(Api, Api::set_device(device_));
    std::size_t free_bytes = 0, total = 0;
    KVPORT_TRY(Api, Api::mem_get_info(&free_bytes, &total));
    return MemInfo{free_bytes, total};
  }

  DevicePtr do_alloc(std::size_t bytes) override {
    KVPORT_TRY(Api, Api::set_device(device_));
    void* p = nullptr;
    const typename Api::Status status = Api::malloc(&p, bytes);
    if (status != Api::success) {
      Api::clear_error();
      std::size_t free_bytes = 0, total = 0;
      if (Api::mem_get_info(&free_bytes, &total) != Api::success) Api::clear_error();
      throw OutOfMemory(Api::name, bytes, free_bytes);
    }
    tracker_.add(DevicePtr::from(p), bytes);
    return DevicePtr::from(p);
  }

  bool do_free(DevicePtr ptr) noexcept override {
    if (!tracker_.remove(ptr)) return false;
    return KVPORT_TRY_NOTHROW(Api, Api::free(ptr.get()));
  }

  void* do_alloc_host(std::size_t bytes) override {
    KVPORT_TRY(Api, Api::set_device(device_));
    void* p = nullptr;
    const typename Api::Status status = Api::host_alloc(&p, bytes);
    if (status != Api::success) {
      Api::clear_error();
      throw OutOfMemory(Api::name, bytes, 0);
    }
    host_tracker_.add(DevicePtr::from(p), bytes);
    return p;
  }

  bool do_free_host(void* ptr) noexcept override {
    if (!host_tracker_.remove(DevicePtr::from(ptr))) return false;
    return KVPORT_TRY_NOTHROW(Api, Api::host_free(ptr));
  }

  void* do_create_stream() override {
    KVPORT_TRY(Api, Api::set_device(device_));
    Stream_t s{};
    KVPORT_TRY(Api, Api::stream_create(&s));
    std::lock_guard lock(handles_mutex_);
    streams_.insert(static_cast<void*>(s));
    return static_cast<void*>(s);
  }

  void do_destroy_stream(void* native) noexcept override {
    {
      std::lock_guard lock(handles_mutex_);
      if (streams_.erase(native) == 0) return;
    }
    KVPORT_TRY_NOTHROW(Api, Api::stream_destroy(as_stream(native)));
  }

  void* do_default_stream() override { return static_cast<void*>(default_stream_); }

  void do_synchronize(void* stream) override {
    KVPORT_TRY(Api, Api::stream_synchronize(stream_of(stream)));
  }

  // Creates an event with `create` (Api::event_create or
  // Api::timing_event_create) and records it as live.
  void* new_event(typename Api::Status (*create)(Event_t*), const char* call) {
    KVPORT_TRY(Api, Api::set_device(device_));
    Event_t e{};
    detail::check_vendor<Api>(create(&e), call);
    std::lock_guard lock(handles_mutex_);
    events_.insert(static_cast<void*>(e));
    return static_cast<void*>(e);
  }

  void* do_create_event() override { return new_event(&Api::event_create, "Api::event_create"); }

  void* do_create_timing_event() override {
    return new_event(&Api::timing_event_create, "Api::timing_event_create");
  }

  double do_elapsed_seconds(void* start, void* end) override {
    const Event_t a = event_of(start), b = event_of(end);
    KVPORT_TRY(Api, Api::event_synchronize(a));
    KVPORT_TRY(Api, Api::event_synchronize(b));
    float ms = 0.0f;
    KVPORT_TRY(Api, Api::event_elapsed_ms(&ms, a, b));
    return static_cast<double>(ms) / 1000.0;
  }

  void do_destroy_event(void* native) noexcept override {
    {
      std::lock_guard lock(handles_mutex_);
      if (events_.erase(native) == 0) return;
    }
    KVPORT_TRY_NOTHROW(Api, Api::event_destroy(as_event(native)));
  }

  void do_record_event(void* event, void* stream) override {
    KVPORT_TRY(Api, Api::event_record(event_of(event), stream_of(stream)));
  }

  void do_wait_event(void* stream, void* event) override {
    KVPORT_TRY(Api, Api::stream_wait_event(stream_of(stream), event_of(event)));
  }

  void do_synchronize_event(void* event) override {
    KVPORT_TRY(Api, Api::event_synchronize(event_of(event)));
  }

  void do_memset_async(DevicePtr ptr, std::uint8_t value, std::size_t bytes,
                       void* stream) override {
    tracker_.check(ptr, bytes, "memset_async");
    if (bytes == 0) return;
    KVPORT_TRY(Api, Api::memset_async(ptr.get(), value, bytes, stream_of(stream)));
  }

  void do_fill_async(std::span<const FillRegion> regions, std::uint8_t value,
                     void* stream) override {
    const Stream_t s = stream_of(stream);
    std::vector<FillDescriptor> descriptors;
    descriptors.reserve(regions.size());
    std::uint64_t chunks = 0;
    {
      auto lock = tracker_.read_lock();
      for (const FillRegion& r : regions) {
        tracker_.check_locked(r.ptr, r.bytes, "fill_async");
        if (r.bytes == 0) continue;
        descriptors.push_back(FillDescriptor{r.ptr.address(), r.bytes, chunks});
        chunks += chunks_for(r.bytes);
      }
    }
    if (descriptors.empty()) return;
    upload_and_launch(
        descriptors.data(), descriptors.size() * sizeof(FillDescriptor), s, [&](void* table) {
          return static_cast<typename Api::Status>(Api::launch_fill(
              static_cast<const FillDescriptor*>(table), descriptors.size(), chunks, value, s));
        });
  }

  void do_copy_h2d_async(DevicePtr dst, const void* src, std::size_t bytes, void* stream) override {
    tracker_.check(dst, bytes, "copy_h2d_async");
    if (bytes == 0) return;
    KVPORT_TRY(Api, Api::memcpy_async(dst.get(), src, bytes, stream_of(stream)));
  }

  void do_copy_d2h_async(void* dst, DevicePtr src, std::size_t bytes, void* stream) override {
    tracker_.check(src, bytes, "copy_d2h_async");
    if (bytes == 0) return;
    KVPORT_TRY(Api, Api::memcpy_async(dst, src.get(), bytes, stream_of(stream)));
  }

  void do_copy_d2d_async(DevicePtr dst, DevicePtr src, std::size_t bytes, void* stream) override {
    tracker_.check(src, bytes, "copy_d2d_async (source)");
    tracker_.check(dst, bytes, "copy_d2d_async (destination)");
    if (bytes == 0) return;
    KVPORT_TRY(Api, Api::memcpy_async(dst.get(), src.get(), bytes, stream_of(stream)));
  }

  void do_copy_batch_async(std::span<const CopyRegion> regions, void* stream) override {
    const Stream_t s = stream_of(stream);
    std::vector<CopyDescriptor> descriptors;
    descriptors.reserve(regions.size());
    std::uint64_t chunks = 0;
    {
      auto lock = tracker_.read_lock();
      for (const CopyRegion& r : regions) {
        tracker_.check_locked(r.src, r.bytes, "copy_batch_async (source)");
        tracker_.check_locked(r.dst, r.bytes, "copy_batch_async (destination)");
        if (r.bytes == 0) continue;
        descriptors.push_back(CopyDescriptor{r.dst.address(), r.src.address(), r.bytes, chunks});
        chunks += chunks_for(r.bytes);
      }
    }
    if (descriptors.empty()) return;
    upload_and_launch(
        descriptors.data(), descriptors.size() * sizeof(CopyDescriptor), s, [&](void* table) {
          return static_cast<typename Api::Status>(Api::launch_copy(
              static_cast<const CopyDescriptor*>(table), descriptors.size(), chunks, s));
        });
  }

  void do_inject_async_fault(void* stream) override {
    detail::check_vendor<Api>(
        static_cast<typename Api::Status>(Api::launch_fault(stream_of(stream))),
        "fault kernel launch");
  }

  // ---- block pools: the table lives on the device --------------------------------

  struct DevicePools {
    std::vector<BlockPool> pools;  // for re-checking against live allocations
    std::size_t num_blocks = 0;
    void* table = nullptr;  // PoolDescriptor[pools.size()] in device memory
    std::uint64_t chunks_per_block = 0;
  };

  void check_pools(const DevicePools& d, const char* op) const {
    auto lock = tracker_.read_lock();
    for (const BlockPool& p : d.pools) {
      tracker_.check_locked(p.base, (d.num_blocks - 1) * p.stride + p.bytes, op);
    }
  }

  void* do_register_block_pools(std::span<const BlockPool> pools, std::size_t num_blocks) override {
    auto d = std::make_unique<DevicePools>();
    d->pools.assign(pools.begin(), pools.end());
    d->num_blocks = num_blocks;
    check_pools(*d, "register_block_pools");
    std::vector<PoolDescriptor> descriptors;
    descriptors.reserve(pools.size());
    for (const BlockPool& p : pools) {
      descriptors.push_back(
          PoolDescriptor{p.base.address(), p.bytes, p.stride, d->chunks_per_block});
      d->chunks_per_block += chunks_for(p.bytes);
    }
    const std::size_t bytes = descriptors.size() * sizeof(PoolDescriptor);
    KVPORT_TRY(Api, Api::set_device(device_));
    KVPORT_TRY(Api, Api::malloc(&d->table, bytes));
    try {
      // One-time upload, then wait: the host vector dies with this call.
      KVPORT_TRY(Api, Api::memcpy_async(d->table, descriptors.data(), bytes, default_stream_));
      KVPORT_TRY(Api, Api::stream_synchronize(default_stream_));
    } catch (...) {
      KVPORT_TRY_NOTHROW(Api, Api::free(d->table));
      throw;
    }
    return d.release();
  }

  void do_unregister_block_pools(void* native) noexcept override {
    std::unique_ptr<DevicePools> d(static_cast<DevicePools*>(native));
    // Fills using the table may still be queued: wait for them (cudaFree
    // would synchronize the device anyway).
    KVPORT_TRY_NOTHROW(Api, Api::set_device(device_));
    KVPORT_TRY_NOTHROW(Api, Api::free(d->table));
  }

  void do_fill_blocks_async(void* native, std::span<const std::uint32_t> ids, std::uint8_t value,
                            void* stream) override {
    const auto& d = *static_cast<const DevicePools*>(native);
    const Stream_t s = stream_of(stream);
    check_pools(d, "fill_blocks_async");
    upload_and_launch(ids.data(), ids.size_bytes(), s, [&](void* uploaded) {
      return static_cast<typename Api::Status>(Api::launch_fill_blocks(
          static_cast<const PoolDescriptor*>(d.table), d.pools.size(), d.chunks_per_block,
          static_cast<const std::uint32_t*>(uploaded), ids.size(), value, s));
    });
  }

  const int device_;
  AllocationTracker tracker_;
  AllocationTracker host_tracker_{std::string(Api::name) + " (pinned host memory)"};
  Stream_t default_stream_{};

  mutable std::mutex handles_mutex_;
  std::unordered_set<void*> streams_;
  std::unordered_set<void*> events_;

  std::mutex staging_mutex_;
  std::array<Staging, 4> staging_{};
  std::size_t next_slot_ = 0;
};

}  // namespace kvport::gpu
