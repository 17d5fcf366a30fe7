// SPDX-License-Identifier: Apache-2.0
// GpuBackend<Api>: the whole Backend contract written once over a small
// per-vendor API mapping (ApiCuda in backends/cuda, ApiHip in backends/hip,
// gpusim's ApiSim in tests/gpusim), in the style of alpaka's ApiCudaRt /
// ApiHipRt. The mapping's shape is the VendorApi concept (vendor_api.hpp);
// every policy lives here, once:
//   - the device: every entry point runs on the backend's device and leaves
//     the calling thread's current device as it found it (DeviceScope), so two
//     backends on two devices can be used from one thread, and a backend from
//     any thread;
//   - streams are non-blocking, plain events have timing disabled;
//   - errors: only the runtime's out-of-memory code is OutOfMemory; a sticky
//     error loses the device (DeviceLost, now and for every later call);
//     anything else is a BackendError with the native code. Kernel launches
//     report their own status, never a stale error left on the thread;
//   - small batches travel as kernel parameters (no upload); larger ones go
//     through a ring of pinned staging slots that grows instead of blocking;
//   - memory a queued kernel may still read (staging slots, a registered pool
//     table) is released only after an event says that work is done.
#pragma once

#include <fmt/format.h>

#include <algorithm>
#include <atomic>
#include <cstring>
#include <memory>
#include <mutex>
#include <string>
#include <unordered_map>
#include <unordered_set>
#include <vector>

#include "gpu_kernels.hpp"
#include "kvport/platform/allocation_tracker.hpp"
#include "kvport/platform/backend.hpp"
#include "kvport/platform/error.hpp"
#include "kvport/platform/log.hpp"
#include "vendor_api.hpp"

namespace kvport::gpu {

/// "<vendor>: no device: <reason>" when the runtime has no usable device,
/// else an empty string.
template <VendorApi Api>
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

/// Staging slots the ring grows to before a thread waits for the oldest one.
inline constexpr std::size_t kMaxStagingSlots = 64;
/// Smallest staging slot: 64 KiB holds 16,384 block ids.
inline constexpr std::size_t kMinStagingBytes = 64 * 1024;

// Evaluates a vendor call and throws the classified kvport exception naming it.
#define KVPORT_GPU_CHECK(call) check((call), #call)
// The same for destructors and noexcept paths: logs and yields false.
#define KVPORT_GPU_CHECK_NOTHROW(call) check_nothrow((call), #call, __FILE__, __LINE__)

template <VendorApi Api>
class GpuBackend final : public Backend {
 public:
  using Status = typename Api::Status;
  using Stream_t = typename Api::Stream;
  using Event_t = typename Api::Event;

  /// Selects `device`. Throws InvalidArgument for an ordinal outside
  /// [0, device count), BackendError when the runtime has no usable device
  /// (the message carries the vendor's reason).
  explicit GpuBackend(int device)
      : Backend(Api::name),
        device_(device),
        tracker_(Api::name, MemorySpace::of(Api::memory_kind, device)) {
    int count = 0;
    if (Api::get_device_count(&count) == Api::success && count > 0 &&
        (device < 0 || device >= count)) {
      throw InvalidArgument(
          fmt::format("{}: device ordinal {} out of range ({} devices)", Api::name, device, count));
    }
    const std::string reason = probe<Api>(device);
    if (!reason.empty()) throw BackendError(Api::name, "device probe", -1, reason);
    const DeviceScope scope = enter();
    KVPORT_GPU_CHECK(Api::stream_create(&default_stream_, Api::stream_non_blocking));
  }

  ~GpuBackend() override {
    const DeviceScope scope(*this, DeviceScope::unchecked);
    KVPORT_GPU_CHECK_NOTHROW(Api::stream_synchronize(default_stream_));
    for (const std::unique_ptr<Slot>& s : slots_) {
      if (s->pending) KVPORT_GPU_CHECK_NOTHROW(Api::event_synchronize(s->done));
      release_buffers(*s);
      KVPORT_GPU_CHECK_NOTHROW(Api::event_destroy(s->done));
    }
    for (const auto& [handle, stream] : streams_) {
      if (!stream.wrapped) KVPORT_GPU_CHECK_NOTHROW(Api::stream_destroy(stream.native));
    }
    for (void* event : events_)
      KVPORT_GPU_CHECK_NOTHROW(Api::event_destroy(as_event(event)));
    KVPORT_GPU_CHECK_NOTHROW(Api::stream_destroy(default_stream_));
    for (const auto& [base, bytes] : tracker_.live()) {
      log::warn(fmt::format("{}: backend destroyed with a live allocation [{:#x}, +{}); freeing it",
                            Api::name, base, bytes));
      (void)tracker_.remove(DevicePtr(base));  // out of the process-wide map before the free
      KVPORT_GPU_CHECK_NOTHROW(Api::free(reinterpret_cast<void*>(base)));
    }
    for (const auto& [base, bytes] : host_tracker_.live()) {
      log::warn(
          fmt::format("{}: backend destroyed with a live pinned host allocation [{:#x}, +{}); "
                      "freeing it",
                      Api::name, base, bytes));
      KVPORT_GPU_CHECK_NOTHROW(Api::host_free(reinterpret_cast<void*>(base)));
    }
  }

  GpuBackend(const GpuBackend&) = delete;
  GpuBackend& operator=(const GpuBackend&) = delete;

 private:
  // ---- errors ------------------------------------------------------------------

  struct LostInfo {
    std::string call;
    long code = 0;
    std::string what;
  };

  void mark_lost(Status status, const char* call) const noexcept {
    std::lock_guard lock(lost_mutex_);
    if (lost_.load(std::memory_order_relaxed)) return;
    try {
      lost_info_ = LostInfo{call, static_cast<long>(status), Api::error_string(status)};
    } catch (...) {  // the flag below still tells every later call
    }
    lost_.store(true, std::memory_order_release);
  }

  [[noreturn]] void throw_lost() const {
    std::lock_guard lock(lost_mutex_);
    throw DeviceLost(Api::name, lost_info_.call, lost_info_.code, lost_info_.what);
  }

  // Classifies a failed status: DeviceLost for a sticky error, else BackendError.
  [[noreturn]] void fail(Status status, const char* call) const {
    Api::clear_error();
    if (Api::is_device_lost(status)) {
      mark_lost(status, call);
      throw DeviceLost(Api::name, call, static_cast<long>(status), Api::error_string(status));
    }
    throw BackendError(Api::name, call, static_cast<long>(status), Api::error_string(status));
  }

  void check(Status status, const char* call) const {
    if (status != Api::success) fail(status, call);
  }

  bool check_nothrow(Status status, const char* call, const char* file, int line) const noexcept {
    if (status == Api::success) return true;
    Api::clear_error();
    if (Api::is_device_lost(status)) {
      if (lost_.load(std::memory_order_acquire)) return false;  // reported when it was lost
      mark_lost(status, call);
    }
    detail::log_vendor_failure(Api::name, call, static_cast<long>(status),
                               Api::error_string(status), file, line);
    return false;
  }

  // ---- the current device --------------------------------------------------------

  // Makes the backend's device current on this thread for its lifetime and
  // restores the caller's device afterwards. `checked` scopes (every throwing
  // entry point, through enter()) first fail with DeviceLost on a lost device
  // and throw when the device cannot be made current; `unchecked` ones (frees,
  // destructors) never throw and carry on.
  class DeviceScope {
   public:
    enum Mode { checked, unchecked };

    DeviceScope(const GpuBackend& backend, Mode mode) : backend_(backend) {
      if (mode == checked && backend.lost_.load(std::memory_order_acquire)) backend.throw_lost();
      Status status = Api::get_device(&previous_);
      if (status != Api::success) {
        Api::clear_error();
        previous_ = backend.device_;  // nothing to restore
      }
      if (previous_ == backend.device_) {
        if (mode == checked && status != Api::success) backend.fail(status, "Api::get_device");
        return;
      }
      status = Api::set_device(backend.device_);
      switched_ = status == Api::success;
      if (!switched_ && mode == checked) backend.fail(status, "Api::set_device");
      if (!switched_) Api::clear_error();
    }
    ~DeviceScope() {
      if (switched_) backend_.KVPORT_GPU_CHECK_NOTHROW(Api::set_device(previous_));
    }
    DeviceScope(const DeviceScope&) = delete;
    DeviceScope& operator=(const DeviceScope&) = delete;

   private:
    const GpuBackend& backend_;
    int previous_ = 0;
    bool switched_ = false;
  };

  // Every throwing entry point starts here.
  [[nodiscard]] DeviceScope enter() const { return DeviceScope(*this, DeviceScope::checked); }

  // ---- handles -------------------------------------------------------------------

  static Event_t as_event(void* native) { return static_cast<Event_t>(native); }

  // Streams are named by a serial, never reused, rather than by the vendor's
  // handle, which the runtime hands out again after a destroy: a stale
  // StreamView of a destroyed stream must not reach its successor. The
  // handle Backend sees is the serial; 1 is the default stream.
  static constexpr std::uintptr_t kDefaultStreamSerial = 1;
  static void* stream_handle(std::uintptr_t serial) { return reinterpret_cast<void*>(serial); }

  // A live stream and its serial.
  struct StreamRef {
    Stream_t native;
    std::uint64_t serial;
  };

  StreamRef stream_ref(void* handle) const {
    if (handle == stream_handle(kDefaultStreamSerial)) {
      return {default_stream_, kDefaultStreamSerial};
    }
    std::lock_guard lock(handles_mutex_);
    const auto it = streams_.find(handle);
    if (it == streams_.end()) {
      throw InvalidArgument(fmt::format("{}: stream {} is not a live stream", Api::name, handle));
    }
    return {it->second.native, reinterpret_cast<std::uintptr_t>(handle)};
  }

  Stream_t stream_of(void* native) const { return stream_ref(native).native; }

  Event_t event_of(void* native) const {
    std::lock_guard lock(handles_mutex_);
    if (events_.count(native) == 0) {
      throw InvalidArgument(fmt::format("{}: event {} is not a live event", Api::name, native));
    }
    return as_event(native);
  }

  // ---- staging: descriptor uploads through pinned memory ---------------------------

  struct Slot {
    void* host = nullptr;    // pinned
    void* device = nullptr;  // what the kernel reads
    std::size_t capacity = 0;
    Event_t done{};        // recorded after the kernel that read `device`
    bool pending = false;  // `done` recorded and maybe not reached yet
    bool in_use = false;   // owned by one call between acquire and release
    std::uint64_t last_use = 0;
  };

  void release_buffers(Slot& s) const noexcept {
    if (s.host != nullptr) KVPORT_GPU_CHECK_NOTHROW(Api::host_free(s.host));
    if (s.device != nullptr) KVPORT_GPU_CHECK_NOTHROW(Api::free(s.device));
    s.host = s.device = nullptr;
    s.capacity = 0;
  }

  // A slot that no queued work reads any more, with room for `bytes`, owned
  // by the caller until release_slot. Never blocks while a finished slot
  // exists: the ring grows instead (up to kMaxStagingSlots, or beyond when
  // every slot is owned by another call); only a full ring of slots in flight
  // makes the caller wait for the oldest, outside the lock.
  Slot& acquire_slot(std::size_t bytes) {
    Slot* chosen = nullptr;
    bool must_wait = false;
    {
      std::lock_guard lock(staging_mutex_);
      Slot* oldest = nullptr;
      for (const std::unique_ptr<Slot>& s : slots_) {
        if (s->in_use) continue;
        if (s->pending) {
          const Status query = Api::event_query(s->done);
          if (query == Api::not_ready) {
            if (oldest == nullptr || s->last_use < oldest->last_use) oldest = s.get();
            continue;
          }
          if (query != Api::success) fail(query, "Api::event_query (staging slot)");
          s->pending = false;
        }
        if (chosen == nullptr || (chosen->capacity < bytes && s->capacity >= bytes)) {
          chosen = s.get();
        }
      }
      if (chosen == nullptr && (slots_.size() < kMaxStagingSlots || oldest == nullptr)) {
        auto slot = std::make_unique<Slot>();
        KVPORT_GPU_CHECK(Api::event_create(&slot->done, Api::event_disable_timing));
        slots_.push_back(std::move(slot));
        chosen = slots_.back().get();
      } else if (chosen == nullptr) {
        chosen = oldest;
        must_wait = true;
      }
      chosen->in_use = true;
    }
    try {
      if (must_wait) {
        KVPORT_GPU_CHECK(Api::event_synchronize(chosen->done));
        chosen->pending = false;
      }
      if (chosen->capacity < bytes) {
        std::size_t capacity = std::max(chosen->capacity, kMinStagingBytes);
        while (capacity < bytes)
          capacity *= 2;
        release_buffers(*chosen);
        KVPORT_GPU_CHECK(Api::host_alloc(&chosen->host, capacity));
        KVPORT_GPU_CHECK(Api::malloc(&chosen->device, capacity));
        chosen->capacity = capacity;
      }
    } catch (...) {
      release_buffers(*chosen);
      release_slot(*chosen, false);
      throw;
    }
    return *chosen;
  }

  void release_slot(Slot& s, bool pending) {
    std::lock_guard lock(staging_mutex_);
    s.pending = pending;
    s.in_use = false;
    s.last_use = ++staging_clock_;
  }

  // Copies `bytes` of descriptors into a staging slot, uploads them on
  // `stream`, runs `launch(device_copy)`, and guards the slot with an event.
  template <class Launch>
  void upload_and_launch(const void* data, std::size_t bytes, Stream_t stream, Launch launch) {
    Slot& s = acquire_slot(bytes);
    std::memcpy(s.host, data, bytes);
    const Status uploaded = Api::memcpy_async(s.device, s.host, bytes, stream);
    if (uploaded != Api::success) {
      release_slot(s, false);
      fail(uploaded, "Api::memcpy_async (descriptor upload)");
    }
    const Status launched = launch(s.device);
    // Record even when the launch failed: the upload is in flight either way.
    const Status recorded = Api::event_record(s.done, stream);
    if (recorded != Api::success) {
      // Nothing guards the slot: drain the stream before anyone reuses it.
      KVPORT_GPU_CHECK_NOTHROW(Api::stream_synchronize(stream));
      release_slot(s, false);
      fail(recorded, "Api::event_record (staging slot)");
    }
    release_slot(s, true);
    check(launched, "kernel launch");
  }

  // ---- Backend -----------------------------------------------------------------

  int do_device_count() const override {
    int count = 0;
    KVPORT_GPU_CHECK(Api::get_device_count(&count));
    return count;
  }

  bool do_device_lost() const noexcept override { return lost_.load(std::memory_order_acquire); }
  MemoryKind do_memory_kind() const noexcept override { return Api::memory_kind; }

  MemInfo do_mem_info() const override {
    const DeviceScope scope = enter();
    std::size_t free_bytes = 0, total = 0;
    KVPORT_GPU_CHECK(Api::mem_get_info(&free_bytes, &total));
    return MemInfo{free_bytes, total};
  }

  // Only the runtime's out-of-memory code is OutOfMemory: a scheduler evicts
  // and retries on it, which would be wrong on a lost or broken context.
  [[noreturn]] void fail_allocation(Status status, const char* call, std::size_t bytes) const {
    Api::clear_error();
    if (!Api::is_out_of_memory(status)) fail(status, call);
    std::size_t free_bytes = 0, total = 0;
    if (Api::mem_get_info(&free_bytes, &total) != Api::success) Api::clear_error();
    throw OutOfMemory(Api::name, bytes, free_bytes);
  }

  DevicePtr do_alloc(std::size_t bytes) override {
    const DeviceScope scope = enter();
    void* p = nullptr;
    const Status status = Api::malloc(&p, bytes);
    if (status != Api::success) fail_allocation(status, "Api::malloc", bytes);
    try {
      tracker_.add(DevicePtr::from(p), bytes);
    } catch (...) {
      KVPORT_GPU_CHECK_NOTHROW(Api::free(p));
      throw;
    }
    return DevicePtr::from(p);
  }

  // True once the allocation is forgotten: a vendor failure (a lost device)
  // is logged, not reported as "not a live allocation".
  bool do_free(DevicePtr ptr) noexcept override {
    if (!tracker_.remove(ptr)) return false;
    const DeviceScope scope(*this, DeviceScope::unchecked);
    KVPORT_GPU_CHECK_NOTHROW(Api::free(ptr.get()));
    return true;
  }

  void* do_alloc_host(std::size_t bytes) override {
    const DeviceScope scope = enter();
    void* p = nullptr;
    const Status status = Api::host_alloc(&p, bytes);
    if (status != Api::success) fail_allocation(status, "Api::host_alloc", bytes);
    try {
      host_tracker_.add(DevicePtr::from(p), bytes);
    } catch (...) {
      KVPORT_GPU_CHECK_NOTHROW(Api::host_free(p));
      throw;
    }
    return p;
  }

  bool do_free_host(void* ptr) noexcept override {
    if (!host_tracker_.remove(DevicePtr::from(ptr))) return false;
    const DeviceScope scope(*this, DeviceScope::unchecked);
    KVPORT_GPU_CHECK_NOTHROW(Api::host_free(ptr));
    return true;
  }

  void* do_create_stream() override {
    const DeviceScope scope = enter();
    Stream_t s{};
    KVPORT_GPU_CHECK(Api::stream_create(&s, Api::stream_non_blocking));
    std::lock_guard lock(handles_mutex_);
    void* handle = stream_handle(++last_stream_serial_);
    streams_.emplace(handle, StreamEntry{s, false});
    return handle;
  }

  void do_destroy_stream(void* handle) noexcept override {
    StreamEntry s{};
    {
      std::lock_guard lock(handles_mutex_);
      const auto it = streams_.find(handle);
      if (it == streams_.end()) return;
      s = it->second;
      streams_.erase(it);
    }
    // A wrapped stream is the engine's: forgetting the serial is all.
    if (s.wrapped) return;
    const DeviceScope scope(*this, DeviceScope::unchecked);
    // Work still queued completes first; the runtime releases the stream then.
    KVPORT_GPU_CHECK_NOTHROW(Api::stream_destroy(s.native));
  }

  void* do_default_stream() override { return stream_handle(kDefaultStreamSerial); }

  // An engine's stream gets a serial like kvport's own, so every call finds
  // it through stream_ref; nothing is asked of the runtime (a stream of
  // another device fails at its first use, as any call with it would).
  void* do_wrap_stream(void* vendor) override {
    if (vendor == nullptr && !Api::wraps_null_stream) {
      throw InvalidArgument(fmt::format(
          "{}: wrap_stream: a null stream handle, and this runtime has no null default stream",
          Api::name));
    }
    if (lost_.load(std::memory_order_acquire)) throw_lost();
    std::lock_guard lock(handles_mutex_);
    void* handle = stream_handle(++last_stream_serial_);
    streams_.emplace(handle, StreamEntry{static_cast<Stream_t>(vendor), true});
    return handle;
  }

  void* do_vendor_stream(void* handle) const override {
    return static_cast<void*>(stream_ref(handle).native);
  }

  void do_adopt_memory(DevicePtr base, std::size_t bytes) override {
    tracker_.add_adopted(base, bytes);
  }

  void do_release_adopted(DevicePtr base) noexcept override { (void)tracker_.remove_adopted(base); }

  // Host-side only (no vendor call): a lost device still knows its handles,
  // so a caller can skip dead streams and hear DeviceLost from live ones.
  bool do_stream_alive(void* handle) const noexcept override {
    if (handle == stream_handle(kDefaultStreamSerial)) return true;
    std::lock_guard lock(handles_mutex_);
    return streams_.contains(handle);
  }

  void do_synchronize(void* stream) override {
    const Stream_t s = stream_of(stream);
    const DeviceScope scope = enter();
    KVPORT_GPU_CHECK(Api::stream_synchronize(s));
  }

  void* new_event(unsigned flags) {
    const DeviceScope scope = enter();
    Event_t e{};
    KVPORT_GPU_CHECK(Api::event_create(&e, flags));
    std::lock_guard lock(handles_mutex_);
    events_.insert(static_cast<void*>(e));
    return static_cast<void*>(e);
  }

  void* do_create_event() override { return new_event(Api::event_disable_timing); }
  void* do_create_timing_event() override { return new_event(Api::event_default); }

  double do_elapsed_seconds(void* start, void* end) override {
    const Event_t a = event_of(start), b = event_of(end);
    const DeviceScope scope = enter();
    KVPORT_GPU_CHECK(Api::event_synchronize(a));
    KVPORT_GPU_CHECK(Api::event_synchronize(b));
    float ms = 0.0f;
    KVPORT_GPU_CHECK(Api::event_elapsed_ms(&ms, a, b));
    return static_cast<double>(ms) / 1000.0;
  }

  void do_destroy_event(void* native) noexcept override {
    {
      std::lock_guard lock(handles_mutex_);
      if (events_.erase(native) == 0) return;
    }
    const DeviceScope scope(*this, DeviceScope::unchecked);
    KVPORT_GPU_CHECK_NOTHROW(Api::event_destroy(as_event(native)));
  }

  void do_record_event(void* event, void* stream) override {
    const Event_t e = event_of(event);
    const Stream_t s = stream_of(stream);
    const DeviceScope scope = enter();
    KVPORT_GPU_CHECK(Api::event_record(e, s));
  }

  void do_wait_event(void* stream, void* event) override {
    const Stream_t s = stream_of(stream);
    const Event_t e = event_of(event);
    const DeviceScope scope = enter();
    KVPORT_GPU_CHECK(Api::stream_wait_event(s, e));
  }

  void do_synchronize_event(void* event) override {
    const Event_t e = event_of(event);
    const DeviceScope scope = enter();
    KVPORT_GPU_CHECK(Api::event_synchronize(e));
  }

  bool do_query_event(void* event) override {
    const Event_t e = event_of(event);
    const DeviceScope scope = enter();
    const Status status = Api::event_query(e);
    if (status == Api::not_ready) return false;
    check(status, "Api::event_query");
    return true;
  }

  void do_memset_async(DevicePtr ptr, std::uint8_t value, std::size_t bytes,
                       void* stream) override {
    tracker_.check(ptr, bytes, "memset_async");
    const Stream_t s = stream_of(stream);
    if (bytes == 0) return;
    const DeviceScope scope = enter();
    KVPORT_GPU_CHECK(Api::memset_async(ptr.get(), value, bytes, s));
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
    const DeviceScope scope = enter();
    if (descriptors.size() <= kMaxInlineFills) {
      KVPORT_GPU_CHECK(
          Api::launch_fill_by_value(descriptors.data(), descriptors.size(), chunks, value, s));
      return;
    }
    upload_and_launch(descriptors.data(), descriptors.size() * sizeof(FillDescriptor), s,
                      [&](void* table) {
                        return Api::launch_fill_table(static_cast<const FillDescriptor*>(table),
                                                      descriptors.size(), chunks, value, s);
                      });
  }

  void do_copy_h2d_async(DevicePtr dst, const void* src, std::size_t bytes, void* stream) override {
    tracker_.check(dst, bytes, "copy_h2d_async");
    const Stream_t s = stream_of(stream);
    if (bytes == 0) return;
    const DeviceScope scope = enter();
    KVPORT_GPU_CHECK(Api::memcpy_async(dst.get(), src, bytes, s));
  }

  void do_copy_d2h_async(void* dst, DevicePtr src, std::size_t bytes, void* stream) override {
    tracker_.check(src, bytes, "copy_d2h_async");
    const Stream_t s = stream_of(stream);
    if (bytes == 0) return;
    const DeviceScope scope = enter();
    KVPORT_GPU_CHECK(Api::memcpy_async(dst, src.get(), bytes, s));
  }

  void do_copy_d2d_async(DevicePtr dst, DevicePtr src, std::size_t bytes, void* stream) override {
    tracker_.check(src, bytes, "copy_d2d_async (source)");
    tracker_.check(dst, bytes, "copy_d2d_async (destination)");
    const Stream_t s = stream_of(stream);
    if (bytes == 0) return;
    const DeviceScope scope = enter();
    KVPORT_GPU_CHECK(Api::memcpy_async(dst.get(), src.get(), bytes, s));
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
    const DeviceScope scope = enter();
    if (descriptors.size() <= kMaxInlineCopies) {
      KVPORT_GPU_CHECK(
          Api::launch_copy_by_value(descriptors.data(), descriptors.size(), chunks, s));
      return;
    }
    upload_and_launch(descriptors.data(), descriptors.size() * sizeof(CopyDescriptor), s,
                      [&](void* table) {
                        return Api::launch_copy_table(static_cast<const CopyDescriptor*>(table),
                                                      descriptors.size(), chunks, s);
                      });
  }

  void do_copy_host_batch_async(std::span<const HostCopyRegion> regions,
                                HostCopyDirection direction, void* stream) override {
    const bool to_device = direction == HostCopyDirection::host_to_device;
    const char* op = to_device ? "copy_batch_h2d_async" : "copy_batch_d2h_async";
    const Stream_t s = stream_of(stream);
    std::vector<void*> dsts;
    std::vector<const void*> srcs;
    std::vector<std::size_t> sizes;
    dsts.reserve(regions.size());
    srcs.reserve(regions.size());
    sizes.reserve(regions.size());
    {
      auto lock = tracker_.read_lock();
      for (const HostCopyRegion& r : regions) {
        tracker_.check_locked(r.device, r.bytes, op);
        if (r.bytes == 0) continue;
        dsts.push_back(to_device ? r.device.get() : r.host);
        srcs.push_back(to_device ? static_cast<const void*>(r.host) : r.device.get());
        sizes.push_back(r.bytes);
      }
    }
    if (sizes.empty()) return;
    const DeviceScope scope = enter();
    KVPORT_GPU_CHECK(
        Api::memcpy_batch_async(dsts.data(), srcs.data(), sizes.data(), sizes.size(), s));
  }

  void do_inject_async_fault(void* stream) override {
    const Stream_t s = stream_of(stream);
    const DeviceScope scope = enter();
    KVPORT_GPU_CHECK(Api::launch_fault(s));
  }

  // ---- block pools: the table lives on the device --------------------------------

  struct DevicePools {
    std::vector<AllocationTracker::Use> pools;  // each pool's extent and allocation serial
    void* table = nullptr;                      // PoolDescriptor[pools.size()] in device memory
    std::uint64_t chunks_per_block = 0;
    // The tracker generation the pools were last checked at: while no
    // allocation has been freed since, they cannot have become invalid.
    std::atomic<std::uint64_t> checked_generation{0};
    // One event per stream that ran a fill over `table`, recorded after its
    // last fill: the table is freed only after every one of them.
    struct LastUse {
      std::uint64_t stream_serial;
      Event_t event;
    };
    std::mutex last_use_mutex;
    std::vector<LastUse> last_use;
  };

  // Re-checks the pools against the live allocations, but only when an
  // allocation was freed since the last check (the common case costs one
  // shared lock and a compare, not 2 x layers range lookups).
  void check_pools(DevicePools& d) const {
    auto lock = tracker_.read_lock();
    const std::uint64_t generation = tracker_.generation_locked();
    if (generation == d.checked_generation.load(std::memory_order_acquire)) return;
    for (const AllocationTracker::Use& use : d.pools)
      tracker_.recheck_locked(use);
    d.checked_generation.store(generation, std::memory_order_release);
  }

  void note_last_use(DevicePools& d, const StreamRef& stream) {
    std::lock_guard lock(d.last_use_mutex);
    typename DevicePools::LastUse* use = nullptr;
    for (auto& u : d.last_use) {
      if (u.stream_serial == stream.serial) {
        use = &u;  // the stream is in order: a later record covers the earlier work
        break;
      }
    }
    for (auto it = d.last_use.begin(); use == nullptr && it != d.last_use.end(); ++it) {
      if (Api::event_query(it->event) == Api::success) {
        use = &*it;  // that stream's fills are done: reuse its event
        use->stream_serial = stream.serial;
      } else {
        Api::clear_error();
      }
    }
    if (use == nullptr) {
      Event_t e{};
      KVPORT_GPU_CHECK(Api::event_create(&e, Api::event_disable_timing));
      d.last_use.push_back({stream.serial, e});
      use = &d.last_use.back();
    }
    KVPORT_GPU_CHECK(Api::event_record(use->event, stream.native));
  }

  void* do_register_block_pools(std::span<const PoolGeometry> pools,
                                std::size_t num_blocks) override {
    auto d = std::make_unique<DevicePools>();
    std::vector<PoolDescriptor> descriptors;
    descriptors.reserve(pools.size());
    {
      auto lock = tracker_.read_lock();
      for (const PoolGeometry& p : pools) {
        const std::size_t extent = p.extent(num_blocks).value();  // checked at registration
        const std::uint64_t serial = tracker_.check_locked(p.base, extent, "register_block_pools");
        d->pools.push_back(AllocationTracker::Use{p.base, extent,
                                                  "fill_blocks_async (a registered pool)", serial});
        descriptors.push_back(
            PoolDescriptor{p.base.address(), p.bytes, p.stride, d->chunks_per_block});
        d->chunks_per_block += chunks_for(p.bytes);
      }
      d->checked_generation.store(tracker_.generation_locked(), std::memory_order_relaxed);
    }
    const std::size_t bytes = descriptors.size() * sizeof(PoolDescriptor);
    const DeviceScope scope = enter();
    KVPORT_GPU_CHECK(Api::malloc(&d->table, bytes));
    // One-time upload, then wait: the host vector dies with this call.
    Status status = Api::memcpy_async(d->table, descriptors.data(), bytes, default_stream_);
    if (status == Api::success) status = Api::stream_synchronize(default_stream_);
    if (status != Api::success) {
      KVPORT_GPU_CHECK_NOTHROW(Api::free(d->table));
      fail(status, "Api::memcpy_async (pool table upload)");
    }
    return d.release();
  }

  void do_unregister_block_pools(void* native) noexcept override {
    std::unique_ptr<DevicePools> d(static_cast<DevicePools*>(native));
    const DeviceScope scope(*this, DeviceScope::unchecked);
    // Fills that read the table may still be queued: wait for the last one on
    // every stream that ran one, rather than rely on the free synchronizing
    // the device (a stream-ordered free would not).
    for (const auto& use : d->last_use) {
      KVPORT_GPU_CHECK_NOTHROW(Api::event_synchronize(use.event));
      KVPORT_GPU_CHECK_NOTHROW(Api::event_destroy(use.event));
    }
    KVPORT_GPU_CHECK_NOTHROW(Api::free(d->table));
  }

  void do_fill_blocks_async(void* native, std::span<const std::uint32_t> ids, std::uint8_t value,
                            void* stream) override {
    auto& d = *static_cast<DevicePools*>(native);
    const StreamRef s = stream_ref(stream);
    check_pools(d);
    const DeviceScope scope = enter();
    const auto* table = static_cast<const PoolDescriptor*>(d.table);
    if (ids.size() <= kMaxInlineIds) {
      KVPORT_GPU_CHECK(Api::launch_fill_blocks_by_value(table, d.pools.size(), d.chunks_per_block,
                                                        ids.data(), ids.size(), value, s.native));
    } else {
      upload_and_launch(ids.data(), ids.size_bytes(), s.native, [&](void* uploaded) {
        return Api::launch_fill_blocks_table(table, d.pools.size(), d.chunks_per_block,
                                             static_cast<const std::uint32_t*>(uploaded),
                                             ids.size(), value, s.native);
      });
    }
    note_last_use(d, s);
  }

  const int device_;
  AllocationTracker tracker_;
  AllocationTracker host_tracker_{std::string(Api::name) + " (pinned host memory)"};
  Stream_t default_stream_{};

  mutable std::mutex handles_mutex_;
  // A stream kvport created, or an engine's it only wrapped (never destroyed).
  struct StreamEntry {
    Stream_t native{};
    bool wrapped = false;
  };
  std::unordered_map<void*, StreamEntry> streams_;  // handle (serial) -> vendor stream
  std::uintptr_t last_stream_serial_ = kDefaultStreamSerial;
  std::unordered_set<void*> events_;

  std::mutex staging_mutex_;
  std::vector<std::unique_ptr<Slot>> slots_;
  std::uint64_t staging_clock_ = 0;

  mutable std::mutex lost_mutex_;
  mutable std::atomic<bool> lost_{false};
  mutable LostInfo lost_info_;
};

#undef KVPORT_GPU_CHECK
#undef KVPORT_GPU_CHECK_NOTHROW

}  // namespace kvport::gpu
