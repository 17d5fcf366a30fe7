// SPDX-License-Identifier: Apache-2.0
// Stream (owning) and StreamView (non-owning) handles on a backend's queues.
#pragma once

#include <cstddef>
#include <utility>

namespace kvport {

class Backend;
class Stream;

/// A cheap, copyable, non-owning handle on a stream of one backend. It cannot
/// be built from a bare 0 or nullptr: get one from `Stream::view()`,
/// `WrappedStream::view()` (an engine's own stream) or
/// `Backend::default_stream()`. Backends reject a view that belongs to another
/// backend or names a destroyed stream (or a wrap that was released).
class StreamView {
 public:
  StreamView(std::nullptr_t) = delete;
  StreamView(int) = delete;

  /// The backend this stream belongs to.
  Backend* backend() const noexcept { return backend_; }
  /// The backend's handle of the stream: an opaque key that every backend
  /// call looks up (on the GPU backends and the host backend a serial number
  /// that is never reused, so a stale view cannot reach a newer stream). It is
  /// NOT the vendor's stream: for the cudaStream_t / hipStream_t (or the host
  /// backend's queue) ask vendor_handle().
  void* native() const noexcept { return native_; }

  /// The vendor's handle of this stream, to launch the engine's own kernels
  /// on it: a cudaStream_t on CUDA, a hipStream_t on HIP, the queue address
  /// on the host backend (what Backend::wrap_stream takes back). A lookup
  /// under the backend's handle lock, no device call. Throws InvalidArgument
  /// for a moved-from view, a destroyed stream or a released wrap
  /// (Backend::vendor_stream).
  void* vendor_handle() const;

  friend bool operator==(StreamView a, StreamView b) noexcept {
    return a.backend_ == b.backend_ && a.native_ == b.native_;
  }

 private:
  friend class Backend;
  friend class Stream;
  friend class WrappedStream;
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

/// A registration of a stream kvport did not create (an engine's
/// cudaStream_t, hipStream_t, or a host-backend queue) under a handle of
/// kvport's own, so that every backend call accepts it as a StreamView: the
/// door through which kvport runs on its caller's stream, as RMM's
/// cuda_stream_view. Made by Backend::wrap_stream. Move-only. Destroying it
/// (or release()) only forgets the registration: it never destroys the
/// vendor stream and never waits for its work; views of it turn stale
/// (stream_alive false; other calls throw InvalidArgument). The vendor stream
/// must outlive the registration and the work kvport queued on it (a GPU
/// stream destroyed while kvport still holds the wrap is undefined behaviour
/// in the vendor runtime). A PagedKvCache skips a released wrap when its
/// destructor waits for the streams it used: synchronize the cache (or the
/// stream) before releasing a wrap it queued work on.
class WrappedStream {
 public:
  WrappedStream() noexcept = default;
  WrappedStream(WrappedStream&& other) noexcept
      : backend_(std::exchange(other.backend_, nullptr)),
        native_(std::exchange(other.native_, nullptr)) {}
  WrappedStream& operator=(WrappedStream&& other) noexcept;
  WrappedStream(const WrappedStream&) = delete;
  WrappedStream& operator=(const WrappedStream&) = delete;
  /// Forgets the registration (never destroys the stream). Never throws.
  ~WrappedStream();

  /// A view for passing to backend calls; a view of no backend when empty
  /// (moved from or released), which every call rejects.
  StreamView view() const noexcept;
  operator StreamView() const noexcept { return view(); }  // NOLINT: a view is the point

  /// The vendor handle this registration was made from (StreamView::vendor_handle).
  void* vendor_handle() const { return view().vendor_handle(); }

  /// Forgets the registration now; a no-op when empty. Never throws.
  void release() noexcept;

  /// Whether this holds a registration.
  explicit operator bool() const noexcept { return backend_ != nullptr; }

 private:
  friend class Backend;
  WrappedStream(Backend* backend, void* native) noexcept : backend_(backend), native_(native) {}

  Backend* backend_ = nullptr;
  void* native_ = nullptr;
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
