// SPDX-License-Identifier: Apache-2.0
// MemorySpaceRegistry: every range of memory the process's backend objects
// hold (allocations and adopted ranges), per memory space, so that no two
// backend objects hand the same bytes to two caches. For backend authors:
// AllocationTracker reports to it; nothing else needs to.
#pragma once

#include <compare>
#include <cstddef>
#include <cstdint>
#include <string>

#include "kvport/platform/memory_kind.hpp"

namespace kvport {

/// One address space whose bytes a backend hands out: host memory (one for
/// the whole process, whatever backend reports it), or one device of one
/// vendor. Build it with of(): host memory has no device.
struct MemorySpace {
  MemoryKind kind = MemoryKind::host;
  int device = 0;  ///< the device ordinal; always 0 for host memory

  /// The space of `kind` memory on `device` (ignored for host memory).
  static constexpr MemorySpace of(MemoryKind kind, int device) noexcept {
    return MemorySpace{kind, kind == MemoryKind::host ? 0 : device};
  }
  friend constexpr auto operator<=>(const MemorySpace&, const MemorySpace&) = default;
};

/// "host memory", "cuda device 1", "rocm device 0". O(1); throws
/// std::bad_alloc only.
std::string to_string(MemorySpace space);

/// The process-wide map of the ranges every participating backend object
/// holds, one per memory space. Thread-safe (one mutex; every call is one
/// lookup or insertion, O(log n) in the space's ranges). It lives until the
/// process ends, so a backend destroyed at static destruction can still
/// report to it.
class MemorySpaceRegistry {
 public:
  /// Which kind of range an owner holds.
  enum class RangeKind : std::uint8_t { allocation, adopted };

  /// Records an allocation `owner` made (the vendor's allocator gave it out,
  /// so nothing live overlaps it). Should it overlap ranges still recorded
  /// (memory freed by its owner while adopted), each is logged (error level)
  /// and forgotten, and the allocation recorded: recorded ranges never
  /// overlap. `owner_name` ("host", "cuda") is for messages. Throws
  /// std::bad_alloc only.
  static void add_allocation(MemorySpace space, std::uintptr_t base, std::size_t bytes,
                             const void* owner, const std::string& owner_name);

  /// Records a range `owner` adopts, unless it overlaps a range of ANOTHER
  /// owner in the same space (an allocation or an adoption of another
  /// backend object): then throws InvalidArgument naming both ranges, both
  /// owners and the space, and records nothing. Ranges of `owner` itself are
  /// the owner's to check (AllocationTracker does). `bytes` > 0 and the range
  /// does not wrap (Backend::adopt_memory checked both).
  static void add_adopted(MemorySpace space, std::uintptr_t base, std::size_t bytes,
                          const void* owner, const std::string& owner_name);

  /// Forgets `owner`'s range that starts at `base`; no change when there is
  /// none. Never throws.
  static void remove(MemorySpace space, std::uintptr_t base, const void* owner) noexcept;

  /// Ranges recorded in `space` (every owner), for tests.
  static std::size_t count(MemorySpace space);
};

}  // namespace kvport
