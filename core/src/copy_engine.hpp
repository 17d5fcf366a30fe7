// SPDX-License-Identifier: Apache-2.0
// A batched copy engine with a deadline and a quarantine, the second room of
// a HostTier (core/src/host_tier.cpp): batches of host<->device regions on a
// stream of its own, each ordered after the compute stream's work so far; a
// wait bounded by a deadline; and copies that missed it moved into quarantine
// with their stream and event (and what the caller holds for them) until
// they can no longer write, while the engine goes on with a new stream. It
// knows nothing of slots or blocks: what a batch holds is the caller's
// Payload, handed back when its quarantine ends.
#pragma once

#include <algorithm>
#include <chrono>
#include <cstddef>
#include <exception>
#include <optional>
#include <span>
#include <thread>
#include <utility>
#include <vector>

#include "kvport/platform/backend.hpp"
#include "kvport/platform/error.hpp"
#include "log_nothrow.hpp"

namespace kvport::detail {

template <typename Payload>
class CopyEngine {
 public:
  /// Copies that missed their deadline, with the stream they were queued on
  /// and the event recorded after them.
  struct Quarantined {
    Stream stream;
    Event done;
    Payload payload;
  };

  /// A stream and two events of `backend` (what creating them throws);
  /// `timeout` 0: no deadline. `who` names the owner in log lines.
  CopyEngine(Backend& backend, StreamView compute_stream, std::chrono::milliseconds timeout,
             const char* who)
      : backend_(&backend),
        compute_stream_(compute_stream),
        timeout_(timeout),
        who_(who),
        stream_(backend.create_stream()),
        compute_done_(backend.create_event()),
        copies_done_(backend.create_event()) {}

  /// Queues one batch, ordered after the compute stream's work so far, and
  /// records the batch's end. When it throws, no copy of the batch is still
  /// running: it waited for the stream (a copy call that queues one copy per
  /// region returns at the first failing one, and a failed record leaves the
  /// whole copy queued), so the caller may roll the batch back. When that
  /// wait reports an error, which may be an earlier batch's still in flight,
  /// on_stream_error(error) runs first, so that those are rolled back too.
  template <typename OnStreamError>
  void queue(std::span<const HostCopyRegion> regions, HostCopyDirection direction,
             OnStreamError&& on_stream_error) {
    backend_->record_event(compute_done_, compute_stream_);
    backend_->wait_event(stream_, compute_done_);
    try {
      if (direction == HostCopyDirection::device_to_host) {
        backend_->copy_batch_d2h_async(regions, stream_);
      } else {
        backend_->copy_batch_h2d_async(regions, stream_);
      }
      backend_->record_event(copies_done_, stream_);
    } catch (...) {
      try {
        backend_->synchronize(stream_);
      } catch (const Error& e) {
        on_stream_error(e);
      }
      throw;
    }
  }

  /// Whether the batches queued ended, without waiting; true when the query
  /// itself fails (synchronize() then reports it).
  bool ended() {
    try {
      return backend_->query_event(copies_done_);
    } catch (const Error& e) {
      log_error_nothrow("{}: query_event failed: {}", who_, e.what());
      return true;
    }
  }

  /// Waits for the batches queued until the deadline: true when they ended
  /// (or failed: synchronize() reports it), false when the deadline passed
  /// first. Without a deadline true at once (synchronize() waits).
  bool wait_until_done() {
    if (timeout_.count() == 0) return true;
    const auto deadline = std::chrono::steady_clock::now() + timeout_;
    // Spin briefly (a batch of blocks takes microseconds to milliseconds),
    // then sleep in growing steps up to 200 us.
    auto pause = std::chrono::microseconds(0);
    for (;;) {
      if (ended()) return true;
      if (std::chrono::steady_clock::now() >= deadline) return false;
      if (pause.count() == 0) {
        std::this_thread::yield();
        pause = std::chrono::microseconds(1);
      } else {
        std::this_thread::sleep_for(pause);
        pause = std::min(pause * 2, std::chrono::microseconds(200));
      }
    }
  }

  /// The stream's synchronize: throws the error of a failed copy.
  void synchronize() { backend_->synchronize(stream_); }

  /// Moves the stream and its last batch into quarantine with `payload` and
  /// goes on with a new stream. Throws (nothing moved) when no new stream or
  /// event can be made: the caller then waits for the old one instead.
  void quarantine(Payload payload) {
    Stream stream = backend_->create_stream();
    Event event = backend_->create_event();
    quarantine_.reserve(quarantine_.size() + 1);
    quarantine_.push_back(Quarantined{std::move(stream_), std::move(copies_done_),
                                      std::move(payload)});  // reserved: no throw
    stream_ = std::move(stream);
    copies_done_ = std::move(event);
  }

  /// Ends every quarantine whose copies can no longer write (all of them,
  /// waiting, when `wait`): its stream is synchronized (an error is logged:
  /// the contents are not trusted either way), then on_released(payload).
  template <typename OnReleased>
  void release_quarantine(bool wait, OnReleased&& on_released) noexcept {
    std::size_t kept = 0;
    for (std::size_t i = 0; i < quarantine_.size(); ++i) {
      Quarantined& q = quarantine_[i];
      bool done = wait;
      if (!done) {
        try {
          done = backend_->query_event(q.done);
        } catch (const Error&) {
          done = true;  // the synchronize below reports it
        }
      }
      if (!done) {
        if (kept != i) quarantine_[kept] = std::move(q);
        ++kept;
        continue;
      }
      try {
        backend_->synchronize(q.stream);
      } catch (const Error& e) {
        log_error_nothrow("{}: a quarantined copy failed: {}", who_, e.what());
      }
      on_released(q.payload);
    }
    quarantine_.erase(quarantine_.begin() + static_cast<std::ptrdiff_t>(kept), quarantine_.end());
  }

  const std::vector<Quarantined>& quarantined() const noexcept { return quarantine_; }

 private:
  Backend* backend_;
  StreamView compute_stream_;
  std::chrono::milliseconds timeout_;
  const char* who_;
  Stream stream_;
  Event compute_done_;  // the compute stream's work before a batch
  Event copies_done_;   // after the last batch queued
  std::vector<Quarantined> quarantine_;
};

}  // namespace kvport::detail
