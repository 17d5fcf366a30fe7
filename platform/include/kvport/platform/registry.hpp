// SPDX-License-Identifier: Apache-2.0
// The compile-time list of backends and how an engine picks one.
#pragma once

#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "kvport/platform/backend.hpp"

namespace kvport {

/// One compiled backend plugin.
struct BackendInfo {
  std::string name;  ///< "host", "cuda", "hip"
  bool is_gpu = false;
  /// Whether a device is usable right now; when not, `unavailable_reason`
  /// says why ("cuda: no device: CUDA driver version is insufficient ...").
  bool available = false;
  std::string unavailable_reason;
};

/// Every backend compiled into this build, host first, probed for a device.
std::vector<BackendInfo> compiled_backends();

/// Builds the backend called `name`. Throws InvalidArgument naming the
/// compiled backends when `name` is unknown, BackendError when it has no
/// device.
std::unique_ptr<Backend> make_backend(std::string_view name);

/// Builds the backend called `name` on device ordinal `device`. Throws as
/// make_backend, and InvalidArgument when `device` is negative or not below
/// the backend's device count (the host backend has one device, 0).
std::unique_ptr<Backend> make_backend(std::string_view name, int device);

/// `$KVPORT_BACKEND` when set (errors as make_backend), else the first
/// compiled GPU backend that finds a device, else host.
std::unique_ptr<Backend> default_backend();

}  // namespace kvport
