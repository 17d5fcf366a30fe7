// SPDX-License-Identifier: Apache-2.0
// The host backend's streams and events: a stream is a worker thread
// draining a FIFO queue; an event is its latest record, a Completion the
// stream signals when it reaches it. Internal to the host backend.
#pragma once

#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <exception>
#include <functional>
#include <memory>
#include <mutex>
#include <thread>

namespace kvport::host {

// ---- one stream: a worker thread draining a FIFO queue -------------------------

class HostStream {
 public:
  using Op = std::function<void()>;

  HostStream();
  /// Runs everything queued, joins the worker, and logs an error nobody
  /// synchronized.
  ~HostStream();

  HostStream(const HostStream&) = delete;
  HostStream& operator=(const HostStream&) = delete;

  void enqueue(Op op);

  /// Waits for everything queued so far; rethrows and clears the first error.
  void synchronize();

 private:
  void run();

  std::mutex mutex_;
  std::condition_variable wake_worker_;
  std::condition_variable idle_;
  std::deque<Op> queue_;
  std::uint64_t enqueued_ = 0;
  std::uint64_t completed_ = 0;
  bool stopping_ = false;
  std::exception_ptr first_error_;
  std::thread worker_;  // last: starts after every other member exists
};

// ---- events ------------------------------------------------------------------------

/// One `record`: signalled when its stream reaches it.
class Completion {
 public:
  void signal() {
    {
      std::lock_guard lock(mutex_);
      done_ = true;
      when_ = std::chrono::steady_clock::now();
    }
    cv_.notify_all();
  }
  void wait() {
    std::unique_lock lock(mutex_);
    cv_.wait(lock, [&] { return done_; });
  }
  /// Whether the stream reached the record, without waiting.
  bool done() {
    std::lock_guard lock(mutex_);
    return done_;
  }
  /// When the stream reached the record; waits for it.
  std::chrono::steady_clock::time_point when() {
    std::unique_lock lock(mutex_);
    cv_.wait(lock, [&] { return done_; });
    return when_;
  }

 private:
  std::mutex mutex_;
  std::condition_variable cv_;
  bool done_ = false;
  std::chrono::steady_clock::time_point when_;
};

/// An event is its latest record. A wait captures that record when the wait
/// is made (CUDA's semantics): re-recording the event later, on another
/// stream, neither releases nor extends a wait already queued.
struct HostEvent {
  std::mutex mutex;
  std::shared_ptr<Completion> latest;  // null: never recorded

  std::shared_ptr<Completion> current() {
    std::lock_guard lock(mutex);
    return latest;
  }
};

}  // namespace kvport::host
