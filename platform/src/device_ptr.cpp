// SPDX-License-Identifier: Apache-2.0
#include "kvport/platform/device_ptr.hpp"

#include <fmt/format.h>

#include <limits>

#include "kvport/platform/error.hpp"

namespace kvport {

DevicePtr DevicePtr::offset(std::size_t bytes) const {
  if (address_ == 0)
    throw InvalidArgument(fmt::format("DevicePtr::offset({}) on a null pointer", bytes));
  if (bytes > std::numeric_limits<std::uintptr_t>::max() - address_) {
    throw InvalidArgument(
        fmt::format("DevicePtr::offset: {:#x} + {} overflows the address space", address_, bytes));
  }
  return DevicePtr(address_ + bytes);
}

std::size_t DevicePtr::distance_from(DevicePtr base) const {
  if (address_ < base.address_) {
    throw InvalidArgument(fmt::format("DevicePtr::distance_from: {:#x} lies below base {:#x}",
                                      address_, base.address_));
  }
  return address_ - base.address_;
}

}  // namespace kvport
