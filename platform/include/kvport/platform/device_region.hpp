// SPDX-License-Identifier: Apache-2.0
// DeviceRegion: one contiguous range of a backend's memory.
#pragma once

#include <cstddef>

#include "kvport/platform/device_ptr.hpp"

namespace kvport {

/// `bytes` bytes from `ptr`. A plain value, like DevicePtr: a backend checks
/// it against its live allocations when it is used.
struct DeviceRegion {
  DevicePtr ptr;
  std::size_t bytes = 0;

  friend constexpr bool operator==(const DeviceRegion&, const DeviceRegion&) noexcept = default;
};

}  // namespace kvport
