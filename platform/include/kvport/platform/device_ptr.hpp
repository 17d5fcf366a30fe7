// SPDX-License-Identifier: Apache-2.0
// DevicePtr: a device address with checked offset arithmetic.
#pragma once

#include <compare>
#include <cstddef>
#include <cstdint>

namespace kvport {

/// An address in a backend's memory. It is a plain value (no ownership, no
/// size): backends check it against their live allocations when it is used.
/// Arithmetic is checked: an offset that wraps the address space throws
/// `InvalidArgument` instead of producing a bogus pointer.
class DevicePtr {
 public:
  constexpr DevicePtr() noexcept = default;
  constexpr explicit DevicePtr(std::uintptr_t address) noexcept : address_(address) {}

  /// Builds a DevicePtr from a raw pointer a vendor runtime returned.
  static DevicePtr from(const void* p) noexcept {
    return DevicePtr(reinterpret_cast<std::uintptr_t>(p));
  }

  constexpr std::uintptr_t address() const noexcept { return address_; }
  constexpr bool is_null() const noexcept { return address_ == 0; }
  constexpr explicit operator bool() const noexcept { return address_ != 0; }

  /// The raw pointer, for handing to a vendor API or a kernel.
  void* get() const noexcept { return reinterpret_cast<void*>(address_); }

  /// `*this + bytes`. Throws InvalidArgument when the pointer is null or the
  /// sum overflows.
  DevicePtr offset(std::size_t bytes) const;

  /// Bytes from `base` to this pointer. Throws InvalidArgument when this
  /// pointer lies below `base`.
  std::size_t distance_from(DevicePtr base) const;

  friend constexpr auto operator<=>(DevicePtr, DevicePtr) noexcept = default;

 private:
  std::uintptr_t address_ = 0;
};

}  // namespace kvport
