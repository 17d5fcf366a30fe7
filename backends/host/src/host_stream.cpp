// SPDX-License-Identifier: Apache-2.0
#include "host_stream.hpp"

#include <fmt/format.h>

#include <utility>

#include "kvport/platform/log.hpp"

namespace kvport::host {

HostStream::HostStream() : worker_([this] { run(); }) {}

HostStream::~HostStream() {
  {
    std::lock_guard lock(mutex_);
    stopping_ = true;
  }
  wake_worker_.notify_one();
  worker_.join();
  if (first_error_) {
    try {
      std::rethrow_exception(first_error_);
    } catch (const std::exception& e) {
      log::error(fmt::format("host: stream destroyed with an unsynchronized error: {}", e.what()));
    } catch (...) {
      log::error("host: stream destroyed with an unsynchronized unknown error");
    }
  }
}

void HostStream::enqueue(Op op) {
  {
    std::lock_guard lock(mutex_);
    queue_.push_back(std::move(op));
    ++enqueued_;
  }
  wake_worker_.notify_one();
}

void HostStream::synchronize() {
  std::unique_lock lock(mutex_);
  const std::uint64_t target = enqueued_;
  idle_.wait(lock, [&] { return completed_ >= target; });
  if (first_error_) std::rethrow_exception(std::exchange(first_error_, nullptr));
}

void HostStream::run() {
  std::unique_lock lock(mutex_);
  for (;;) {
    wake_worker_.wait(lock, [&] { return stopping_ || !queue_.empty(); });
    if (queue_.empty()) return;  // stopping, and everything queued has run
    Op op = std::move(queue_.front());
    queue_.pop_front();
    lock.unlock();
    std::exception_ptr error;
    try {
      op();
    } catch (...) {
      error = std::current_exception();
    }
    op = nullptr;  // release captures outside the lock
    lock.lock();
    if (error && !first_error_) {
      first_error_ = error;
    } else if (error) {
      try {
        std::rethrow_exception(error);
      } catch (const std::exception& e) {
        log::error(fmt::format("host: further asynchronous error on a stream: {}", e.what()));
      } catch (...) {
      }
    }
    ++completed_;
    idle_.notify_all();
  }
}

}  // namespace kvport::host
