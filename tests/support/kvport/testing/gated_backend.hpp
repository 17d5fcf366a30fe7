// SPDX-License-Identifier: Apache-2.0
// GatedBackend: a test-only Backend decorator over a host backend that can
// hold the device work of host-batch copies (copy_batch_d2h_async /
// copy_batch_h2d_async) on their streams until the test opens a gate. While
// the gate is closed, each such copy is preceded on its stream by a wait for
// the gate (host_enqueue_for_testing), so the copy, and everything queued
// after it on that stream (the event a caller records after it), has not run:
// query_event says "not done", deterministically, without a sleep.
//
// A synchronize (of a stream, or of an event) while gated copies are queued
// would never return; instead it counts as a "blocked synchronize": the
// decorator calls the test's on_blocked_synchronize hook first (to inspect
// what the caller holds at that moment: the caller is waiting, so nothing it
// guards may have been handed out yet), then opens the gate and waits. So a
// component that waits for a copy it needs is observed waiting, and one that
// does not wait reads or reuses memory the held copy has not touched yet,
// which the test's data patterns expose.
//
// Two test faults complete it: the next host-batch copy failing on its stream
// (fail_next_host_copy), and a record_event failing at the call
// (fail_record_event), which FaultInjectingBackend does not offer.
//
// Every other call forwards to the inner backend. Streams, events and pool
// sets are the decorator's own handles wrapping the inner backend's.
#pragma once

#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <set>
#include <span>
#include <string>
#include <utility>

#include "kvport/backends/host_backend.hpp"
#include "kvport/platform/backend.hpp"
#include "kvport/platform/error.hpp"

namespace kvport::testing {

/// Which host-batch copies a closed gate of a GatedBackend holds.
struct GateHolds {
  bool d2h = true;
  bool h2d = true;
};

class GatedBackend final : public Backend {
 public:
  using Holds = GateHolds;

  /// Decorates (and owns) `inner`, which must be a host backend.
  explicit GatedBackend(std::unique_ptr<Backend> inner)
      : Backend("gated(" + inner->name() + ")"),
        inner_(std::move(inner)),
        default_stream_{std::nullopt, inner_->default_stream()} {}

  ~GatedBackend() override { open_gate(); }

  Backend& inner() const noexcept { return *inner_; }

  /// Closes the gate: from now on the selected copies are held until
  /// open_gate() or a blocked synchronize.
  void close_gate(Holds holds = {}) {
    std::lock_guard lock(mutex_);
    if (gate_ != nullptr) return;
    gate_ = std::make_shared<Gate>();
    holds_ = holds;
  }

  /// Opens the gate: the held copies run (in stream order).
  void open_gate() {
    std::shared_ptr<Gate> gate;
    {
      std::lock_guard lock(mutex_);
      gate = std::move(gate_);
      gate_.reset();
    }
    if (gate != nullptr) gate->open();
    std::lock_guard lock(mutex_);
    held_since_close_ = 0;
    default_stream_.held = 0;
    for (GStream* stream : streams_)
      stream->held = 0;
  }

  bool gate_closed() const {
    std::lock_guard lock(mutex_);
    return gate_ != nullptr;
  }

  /// Copies held behind a closed gate since construction.
  std::uint64_t held_copies() const {
    std::lock_guard lock(mutex_);
    return held_copies_;
  }
  /// query_event calls that answered "not done".
  std::uint64_t queries_not_done() const {
    std::lock_guard lock(mutex_);
    return queries_not_done_;
  }
  /// Synchronizes that found held copies (and opened the gate).
  std::uint64_t blocked_synchronizes() const {
    std::lock_guard lock(mutex_);
    return blocked_synchronizes_;
  }

  /// Makes the `n`th record_event call from now (n >= 1) throw BackendError
  /// at the call, recording nothing.
  void fail_record_event(std::uint64_t n) {
    std::lock_guard lock(mutex_);
    record_fault_in_ = n;
  }
  /// Makes the next host-batch copy do nothing and fail on its stream: its
  /// next synchronize throws BackendError (a device error of asynchronous
  /// work).
  void fail_next_host_copy() {
    std::lock_guard lock(mutex_);
    fail_next_copy_ = true;
  }

  /// Called (on the synchronizing thread, before the gate opens) by each
  /// blocked synchronize.
  void set_on_blocked_synchronize(std::function<void()> hook) {
    std::lock_guard lock(mutex_);
    on_blocked_ = std::move(hook);
  }

 private:
  struct Gate {
    std::mutex mutex;
    std::condition_variable cv;
    bool is_open = false;
    void wait() {
      std::unique_lock lock(mutex);
      cv.wait(lock, [&] { return is_open; });
    }
    void open() {
      {
        std::lock_guard lock(mutex);
        is_open = true;
      }
      cv.notify_all();
    }
  };
  struct GStream {
    std::optional<Stream> owned;  // empty for the default stream
    StreamView inner;
    std::uint64_t held = 0;  // copies held on it since the gate closed (under mutex_)
  };
  struct GEvent {
    Event inner;
  };
  struct GPools {
    BlockPoolSet inner;
  };

  static GStream& s(void* native) { return *static_cast<GStream*>(native); }
  static GEvent& e(void* native) { return *static_cast<GEvent*>(native); }

  // Before a wait for `stream` (nullptr: for any stream, as for an event):
  // when copies are held there, calls the hook, then opens the gate.
  void before_wait(GStream* stream) {
    std::function<void()> hook;
    {
      std::lock_guard lock(mutex_);
      if (gate_ == nullptr) return;
      if (stream != nullptr ? stream->held == 0 : held_since_close_ == 0) return;
      ++blocked_synchronizes_;
      hook = on_blocked_;
    }
    if (hook) hook();
    open_gate();
  }

  int do_device_count() const override { return inner_->device_count(); }
  MemInfo do_mem_info() const override { return inner_->mem_info(); }
  bool do_device_lost() const noexcept override { return inner_->device_lost(); }
  MemoryKind do_memory_kind() const noexcept override { return inner_->memory_kind(); }
  DevicePtr do_alloc(std::size_t bytes) override { return inner_->alloc(bytes); }
  bool do_free(DevicePtr ptr) noexcept override { return inner_->free(ptr); }
  void* do_alloc_host(std::size_t bytes) override { return inner_->alloc_host(bytes); }
  bool do_free_host(void* ptr) noexcept override { return inner_->free_host(ptr); }
  void* do_create_stream() override {
    Stream stream = inner_->create_stream();
    const StreamView view = stream.view();
    auto* g = new GStream{std::move(stream), view};
    std::lock_guard lock(mutex_);
    streams_.insert(g);
    return g;
  }
  void do_destroy_stream(void* native) noexcept override {
    if (native == &default_stream_) return;
    before_wait(&s(native));  // the inner stream's destruction waits for its work
    {
      std::lock_guard lock(mutex_);
      streams_.erase(&s(native));
    }
    delete static_cast<GStream*>(native);
  }
  void* do_default_stream() override { return &default_stream_; }
  bool do_stream_alive(void* native) const noexcept override {
    if (native == &default_stream_) return true;
    std::lock_guard lock(mutex_);
    return streams_.contains(static_cast<GStream*>(native));
  }
  void do_synchronize(void* native) override {
    before_wait(&s(native));
    inner_->synchronize(s(native).inner);
  }
  void* do_create_event() override { return new GEvent{inner_->create_event()}; }
  void* do_create_timing_event() override { return new GEvent{inner_->create_timing_event()}; }
  double do_elapsed_seconds(void* start, void* end) override {
    before_wait(nullptr);
    return inner_->elapsed_seconds(e(start).inner, e(end).inner);
  }
  void do_destroy_event(void* native) noexcept override { delete static_cast<GEvent*>(native); }
  void do_record_event(void* event, void* stream) override {
    {
      std::lock_guard lock(mutex_);
      if (record_fault_in_ != 0 && --record_fault_in_ == 0)
        throw BackendError(name(), "record_event", -1, "injected by GatedBackend");
    }
    inner_->record_event(e(event).inner, s(stream).inner);
  }
  void do_wait_event(void* stream, void* event) override {
    inner_->wait_event(s(stream).inner, e(event).inner);
  }
  void do_synchronize_event(void* event) override {
    before_wait(nullptr);
    inner_->synchronize_event(e(event).inner);
  }
  bool do_query_event(void* event) override {
    const bool done = inner_->query_event(e(event).inner);
    if (!done) {
      std::lock_guard lock(mutex_);
      ++queries_not_done_;
    }
    return done;
  }
  void do_memset_async(DevicePtr ptr, std::uint8_t value, std::size_t bytes,
                       void* stream) override {
    inner_->memset_async(ptr, value, bytes, s(stream).inner);
  }
  void do_fill_async(std::span<const FillRegion> regions, std::uint8_t value,
                     void* stream) override {
    inner_->fill_async(regions, value, s(stream).inner);
  }
  void do_copy_h2d_async(DevicePtr dst, const void* src, std::size_t bytes, void* stream) override {
    inner_->copy_h2d_async(dst, src, bytes, s(stream).inner);
  }
  void do_copy_d2h_async(void* dst, DevicePtr src, std::size_t bytes, void* stream) override {
    inner_->copy_d2h_async(dst, src, bytes, s(stream).inner);
  }
  void do_copy_d2d_async(DevicePtr dst, DevicePtr src, std::size_t bytes, void* stream) override {
    inner_->copy_d2d_async(dst, src, bytes, s(stream).inner);
  }
  void do_copy_batch_async(std::span<const CopyRegion> regions, void* stream) override {
    inner_->copy_batch_async(regions, s(stream).inner);
  }
  void do_copy_host_batch_async(std::span<const HostCopyRegion> regions,
                                HostCopyDirection direction, void* stream) override {
    const StreamView inner = s(stream).inner;
    std::shared_ptr<Gate> gate;
    bool fail = false;
    {
      std::lock_guard lock(mutex_);
      fail = std::exchange(fail_next_copy_, false);
      const bool d2h = direction == HostCopyDirection::device_to_host;
      if (gate_ != nullptr && (d2h ? holds_.d2h : holds_.h2d)) {
        gate = gate_;
        ++held_copies_;
        ++held_since_close_;
        ++s(stream).held;
      }
    }
    if (gate != nullptr) host_enqueue_for_testing(*inner_, inner, [gate] { gate->wait(); });
    if (fail) {
      const std::string backend = name();
      host_enqueue_for_testing(*inner_, inner, [backend] {
        throw BackendError(backend, "copy_host_batch", -1, "injected by GatedBackend");
      });
      return;
    }
    if (direction == HostCopyDirection::host_to_device) {
      inner_->copy_batch_h2d_async(regions, inner);
    } else {
      inner_->copy_batch_d2h_async(regions, inner);
    }
  }
  void do_inject_async_fault(void* stream) override { inner_->inject_async_fault(s(stream).inner); }
  void* do_register_block_pools(std::span<const PoolGeometry> pools,
                                std::size_t num_blocks) override {
    return new GPools{inner_->register_block_pools(pools, num_blocks)};
  }
  void do_unregister_block_pools(void* native) noexcept override {
    delete static_cast<GPools*>(native);
  }
  void do_fill_blocks_async(void* pools, std::span<const std::uint32_t> block_ids,
                            std::uint8_t value, void* stream) override {
    inner_->fill_blocks_async(static_cast<GPools*>(pools)->inner, block_ids, value,
                              s(stream).inner);
  }

  std::unique_ptr<Backend> inner_;
  GStream default_stream_;
  mutable std::mutex mutex_;
  std::shared_ptr<Gate> gate_;
  Holds holds_;
  std::uint64_t held_copies_ = 0;
  std::uint64_t held_since_close_ = 0;
  std::uint64_t queries_not_done_ = 0;
  std::uint64_t blocked_synchronizes_ = 0;
  std::function<void()> on_blocked_;
  std::uint64_t record_fault_in_ = 0;
  bool fail_next_copy_ = false;
  std::set<GStream*> streams_;
};

}  // namespace kvport::testing
