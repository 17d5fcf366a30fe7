// Stream (owning) and StreamView (non-owning) handles on a backend's queues.
#pragma once

#include <cstddef>
#include <utility>

namespace kvport {

class Backend;
class Stream;

/// A cheap, copyable, non-owning handle on a stream of one backend. It cannot
/// be built from a bare 0 or nullptr: get one from `Stream::view()` or
/// `Backend::default_stream()`. Backends reject a view that belongs to another
/// backend or names a destroyed stream.
class StreamView {
 public:
  StreamView(std::nullptr_t) = delete;
  StreamView(int) = delete;

  /// The backend this stream belongs to.
  Backend* backend() const noexcept { return backend_; }
  /// The backend's native handle (cudaStream_t, hipStream_t, host queue).
  void* native() const noexcept { return native_; }

  friend bool operator==(StreamView a, StreamView b) noexcept {
    return a.backend_ == b.backend_ && a.native_ == b.native_;
  }

 private:
  friend class Backend;
  friend class Stream;
  StreamView(Backend* backend, void* native) noexcept : backend_(backend), native_(native) {}

  Backend* backend_;
  void* native_;
};

/// An owning stream: destroyed with its handle. Move-only. Must not outlive
/// the backend that created it. Destruction waits for queued work (as
/// cudaStreamDestroy lets queued work finish) and never throws.
class Stream {
 public:
  Stream(Stream&& other) noexcept
      : backend_(std::exchange(other.backend_, nullptr)),
        native_(std::exchange(other.native_, nullptr)) {}
  Stream& operator=(Stream&& other) noexcept;
  Stream(const Stream&) = delete;
  Stream& operator=(const Stream&) = delete;
  ~Stream();

  /// A non-owning view for passing to backend calls.
  StreamView view() const noexcept;
  operator StreamView() const noexcept { return view(); }  // NOLINT: a view is the point

  /// Blocks until all work queued on this stream finished; rethrows the first
  /// asynchronous error recorded on it since the last synchronize.
  void synchronize() const;

 private:
  friend class Backend;
  Stream(Backend* backend, void* native) noexcept : backend_(backend), native_(native) {}
  void reset() noexcept;

  Backend* backend_;
  void* native_;
};

/// An owning event: a marker recorded on one stream that another stream (or
/// the host) can wait for. Move-only; must not outlive its backend. Waiting on
/// an event that was never recorded does not block (CUDA's semantics).
class Event {
 public:
  Event(Event&& other) noexcept
      : backend_(std::exchange(other.backend_, nullptr)),
        native_(std::exchange(other.native_, nullptr)) {}
  Event& operator=(Event&& other) noexcept;
  Event(const Event&) = delete;
  Event& operator=(const Event&) = delete;
  ~Event();

  /// Captures all work queued on `stream` so far.
  void record(StreamView stream);
  /// Makes later work on `stream` wait until the last `record` completed.
  void wait(StreamView stream) const;
  /// Blocks the host until the last `record` completed.
  void synchronize() const;
  /// Whether the last `record` completed (true if never recorded), without
  /// waiting (Backend::query_event).
  bool query() const;

  Backend* backend() const noexcept { return backend_; }
  void* native() const noexcept { return native_; }

 private:
  friend class Backend;
  Event(Backend* backend, void* native) noexcept : backend_(backend), native_(native) {}
  void reset() noexcept;

  Backend* backend_;
  void* native_;
};

}  // namespace kvport
