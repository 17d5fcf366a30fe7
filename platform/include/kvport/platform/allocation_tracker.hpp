// SPDX-License-Identifier: Apache-2.0
// AllocationTracker: the live allocations of one backend, so that every
// operation's range is checked before it reaches the device. For backend
// authors: the host backend and the GPU backends use it. A tracker given a
// memory space also reports its ranges to the process-wide
// MemorySpaceRegistry, so that no two backend objects adopt the same bytes.
#pragma once

#include <cstddef>
#include <cstdint>
#include <deque>
#include <map>
#include <mutex>
#include <optional>
#include <shared_mutex>
#include <string>
#include <utility>
#include <vector>

#include "kvport/platform/device_ptr.hpp"
#include "kvport/platform/memory_space_registry.hpp"

namespace kvport {

class AllocationTracker {
 public:
  /// One range an operation touches, and the serial of the allocation it lay
  /// in when the operation was checked.
  struct Use {
    DevicePtr ptr;
    std::size_t bytes = 0;
    const char* what = "";  ///< the operation, e.g. "copy_d2d_async (source)"
    std::uint64_t serial = 0;
  };

  /// `backend` prefixes every error message ("host", "cuda", ...). Without a
  /// `space` the tracker keeps its ranges to itself (pinned host memory, tests
  /// with made-up addresses); with one, every allocation and adopted range is
  /// also recorded in the MemorySpaceRegistry for `space`, and adoptions are
  /// checked against every other tracker of that space.
  explicit AllocationTracker(std::string backend, std::optional<MemorySpace> space = std::nullopt);
  /// Forgets whatever is still recorded in the MemorySpaceRegistry. Never
  /// throws.
  ~AllocationTracker();
  AllocationTracker(const AllocationTracker&) = delete;
  AllocationTracker& operator=(const AllocationTracker&) = delete;

  /// Records a new allocation of `bytes` at `base`; returns its serial (unique
  /// for the tracker's lifetime, so a reused address is told apart).
  std::uint64_t add(DevicePtr base, std::size_t bytes);

  /// Forgets the allocation that starts at `base` and returns its size;
  /// nullopt (and no change) when `base` is not the start of a live
  /// allocation (an adopted range is not one: its memory is not the
  /// backend's to free). Waits for every read lock. Never throws.
  std::optional<std::size_t> remove(DevicePtr base) noexcept;

  /// Records memory the backend did not allocate (Backend::adopt_memory):
  /// checked like an allocation, never returned by remove() or live(), so a
  /// backend neither frees it on request nor at its destruction. Throws
  /// InvalidArgument when [base, base + bytes) overlaps a live allocation or
  /// another adopted range of this tracker or, with a memory space, of any
  /// other tracker of that space (another backend object's); the message
  /// names both ranges. Cost: O(log n) under this tracker's lock and the
  /// registry's.
  std::uint64_t add_adopted(DevicePtr base, std::size_t bytes);

  /// Forgets the adopted range that starts at `base`; false (and no change)
  /// when there is none. Work checked against it before fails its recheck as
  /// a use after free. Never throws.
  bool remove_adopted(DevicePtr base) noexcept;

  /// Throws InvalidArgument unless [p, p + bytes) lies inside ONE live
  /// allocation. The message names the backend and `op` and says "bad
  /// pointer", "out of bounds" or "use after free" (for a pointer inside one of
  /// the last 4096 freed allocations).
  void check(DevicePtr p, std::size_t bytes, const char* op) const;

  /// Checking many ranges under one lock, and work that must not overlap a
  /// free: hold `read_lock()` and use the *_locked calls.
  std::shared_lock<std::shared_mutex> read_lock() const { return std::shared_lock(mutex_); }

  /// As check(); returns the serial of the allocation the range lies in.
  std::uint64_t check_locked(DevicePtr p, std::size_t bytes, const char* op) const;

  /// For work queued earlier: throws InvalidArgument ("use after free") unless
  /// `use` still lies in the same allocation (same serial) it was checked in.
  void recheck_locked(const Use& use) const;

  /// Counts successful removes. Work checked at generation g need not be
  /// rechecked while the generation is still g. Read it under the same lock
  /// as the check, or a remove in between goes unnoticed.
  std::uint64_t generation_locked() const noexcept { return generation_; }

  /// Live allocations (adopted ranges not counted).
  std::size_t live_count() const;
  /// Requested bytes of all live allocations (adopted ranges not counted).
  std::size_t live_bytes() const;
  /// Adopted ranges now registered.
  std::size_t adopted_count() const;
  /// A snapshot of (base address, requested bytes) of every live allocation
  /// (adopted ranges left out: nobody here may free them).
  std::vector<std::pair<std::uintptr_t, std::size_t>> live() const;

 private:
  struct Allocation {
    std::size_t bytes;
    std::uint64_t serial;
    bool adopted = false;
  };

  // Forgets the entry at `base`; the caller checked it exists. Under the lock.
  std::size_t erase_locked(std::map<std::uintptr_t, Allocation>::iterator it) noexcept;

  std::string backend_;
  std::optional<MemorySpace> space_;  // set: the ranges are in the MemorySpaceRegistry too
  mutable std::shared_mutex mutex_;
  std::map<std::uintptr_t, Allocation> live_;
  std::deque<std::pair<std::uintptr_t, std::size_t>> freed_;
  std::size_t live_bytes_ = 0;
  std::size_t adopted_count_ = 0;
  std::uint64_t next_serial_ = 0;
  std::uint64_t generation_ = 0;
};

}  // namespace kvport
