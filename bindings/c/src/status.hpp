// SPDX-License-Identifier: Apache-2.0
// The error boundary of the C ABI: every exported call runs its body through
// guard(), which turns each C++ exception into its kvport_status and keeps the
// message as the calling thread's last error.
#pragma once

#include <new>
#include <stdexcept>
#include <string>

#include "kvport/kvport.h"
#include "kvport/platform/error.hpp"

namespace kvport::capi {

/// A failure the binding itself detects (a bad handle, a destroy with live
/// children). Out-of-range ids are core's to detect (kvport::OutOfRange). Not a kvport::Error, so
/// that guard() can tell it apart from the core's exceptions.
class StatusError : public std::runtime_error {
 public:
  StatusError(kvport_status status, const std::string& message)
      : std::runtime_error(message), status_(status) {}
  kvport_status status() const noexcept { return status_; }

 private:
  kvport_status status_;
};

/// Records `message` as this thread's last error and returns `status`.
kvport_status fail(kvport_status status, const char* message) noexcept;

/// Maps the exception in flight (call from a catch block only).
kvport_status fail_current_exception() noexcept;

/// Runs `body`; KVPORT_OK, or the status of the exception it threw.
template <class F>
kvport_status guard(F&& body) noexcept {
  try {
    body();
    return KVPORT_OK;
  } catch (...) {
    return fail_current_exception();
  }
}

/// Throws InvalidArgument naming `what` when `p` is null.
template <class T>
T* require(T* p, const char* what) {
  if (p == nullptr) throw InvalidArgument(std::string(what) + " is null");
  return p;
}

}  // namespace kvport::capi
