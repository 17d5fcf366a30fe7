// SPDX-License-Identifier: Apache-2.0
#include "kvport/platform/allocation_tracker.hpp"

#include <fmt/format.h>

#include <iterator>

#include "kvport/platform/error.hpp"

namespace kvport {
namespace {
// How many freed ranges to remember, to say "use after free" rather than
// "bad pointer" when a stale pointer comes back.
constexpr std::size_t kFreedHistory = 4096;
}  // namespace

AllocationTracker::AllocationTracker(std::string backend, std::optional<MemorySpace> space)
    : backend_(std::move(backend)), space_(space) {}

AllocationTracker::~AllocationTracker() {
  if (!space_) return;
  for (const auto& entry : live_)
    MemorySpaceRegistry::remove(*space_, entry.first, this);
}

std::uint64_t AllocationTracker::add(DevicePtr base, std::size_t bytes) {
  std::unique_lock lock(mutex_);
  // Lock order everywhere: this tracker's mutex, then the registry's.
  if (space_) MemorySpaceRegistry::add_allocation(*space_, base.address(), bytes, this, backend_);
  const std::uint64_t serial = ++next_serial_;
  try {
    live_.emplace(base.address(), Allocation{bytes, serial});
  } catch (...) {
    if (space_) MemorySpaceRegistry::remove(*space_, base.address(), this);
    throw;
  }
  live_bytes_ += bytes;
  return serial;
}

std::optional<std::size_t> AllocationTracker::remove(DevicePtr base) noexcept {
  std::unique_lock lock(mutex_);
  auto it = live_.find(base.address());
  if (it == live_.end() || it->second.adopted) return std::nullopt;
  live_bytes_ -= it->second.bytes;
  if (space_) MemorySpaceRegistry::remove(*space_, it->first, this);
  return erase_locked(it);
}

std::size_t AllocationTracker::erase_locked(
    std::map<std::uintptr_t, Allocation>::iterator it) noexcept {
  const std::uintptr_t base = it->first;
  const std::size_t bytes = it->second.bytes;
  live_.erase(it);
  try {
    if (freed_.size() == kFreedHistory) freed_.pop_front();
    freed_.emplace_back(base, bytes);
  } catch (...) {  // the history only improves messages
  }
  ++generation_;
  return bytes;
}

std::uint64_t AllocationTracker::add_adopted(DevicePtr base, std::size_t bytes) {
  std::unique_lock lock(mutex_);
  const std::uintptr_t a = base.address();
  // The first entry that ends past `a` is the only one that can overlap
  // unless it starts past the end: entries never overlap each other.
  auto it = live_.upper_bound(a);
  if (it != live_.begin()) {
    auto prev = std::prev(it);
    if (prev->first + prev->second.bytes > a) it = prev;
  }
  if (it != live_.end() && it->first < a + bytes) {
    throw InvalidArgument(fmt::format("{}: adopt_memory: [{:#x}, +{}) overlaps {} [{:#x}, +{})",
                                      backend_, a, bytes,
                                      it->second.adopted ? "an adopted range" : "a live allocation",
                                      it->first, it->second.bytes));
  }
  // Another backend object's allocation or adoption of the same memory space.
  if (space_) MemorySpaceRegistry::add_adopted(*space_, a, bytes, this, backend_);
  const std::uint64_t serial = ++next_serial_;
  try {
    live_.emplace(a, Allocation{bytes, serial, true});
  } catch (...) {
    if (space_) MemorySpaceRegistry::remove(*space_, a, this);
    throw;
  }
  ++adopted_count_;
  return serial;
}

bool AllocationTracker::remove_adopted(DevicePtr base) noexcept {
  std::unique_lock lock(mutex_);
  auto it = live_.find(base.address());
  if (it == live_.end() || !it->second.adopted) return false;
  --adopted_count_;
  if (space_) MemorySpaceRegistry::remove(*space_, it->first, this);
  erase_locked(it);
  return true;
}

void AllocationTracker::check(DevicePtr p, std::size_t bytes, const char* op) const {
  std::shared_lock lock(mutex_);
  check_locked(p, bytes, op);
}

std::uint64_t AllocationTracker::check_locked(DevicePtr p, std::size_t bytes,
                                              const char* op) const {
  const std::uintptr_t a = p.address();
  auto it = live_.upper_bound(a);
  if (it != live_.begin()) {
    --it;
    const std::uintptr_t base = it->first;
    const std::size_t size = it->second.bytes;
    if (a < base + size) {
      if (bytes > base + size - a) {
        throw InvalidArgument(fmt::format(
            "{}: {}: out of bounds: [{:#x}, +{}) runs {} bytes past the end of allocation "
            "[{:#x}, +{})",
            backend_, op, a, bytes, bytes - (base + size - a), base, size));
      }
      return it->second.serial;
    }
  }
  for (auto f = freed_.rbegin(); f != freed_.rend(); ++f) {
    if (a >= f->first && a < f->first + f->second) {
      throw InvalidArgument(fmt::format(
          "{}: {}: use after free: {:#x} lies in allocation [{:#x}, +{}) which was freed", backend_,
          op, a, f->first, f->second));
    }
  }
  throw InvalidArgument(
      fmt::format("{}: {}: bad pointer: {:#x} is not inside any live allocation", backend_, op, a));
}

void AllocationTracker::recheck_locked(const Use& use) const {
  const std::uintptr_t a = use.ptr.address();
  auto it = live_.upper_bound(a);
  bool reused = false;
  if (it != live_.begin()) {
    --it;
    if (a < it->first + it->second.bytes) {
      if (it->second.serial == use.serial) return;
      reused = true;
    }
  }
  throw InvalidArgument(fmt::format(
      "{}: {}: use after free: [{:#x}, +{}) was freed after the operation was queued{}", backend_,
      use.what, a, use.bytes, reused ? " (the address now belongs to a newer allocation)" : ""));
}

std::size_t AllocationTracker::live_count() const {
  std::shared_lock lock(mutex_);
  return live_.size() - adopted_count_;
}

std::size_t AllocationTracker::adopted_count() const {
  std::shared_lock lock(mutex_);
  return adopted_count_;
}

std::size_t AllocationTracker::live_bytes() const {
  std::shared_lock lock(mutex_);
  return live_bytes_;
}

std::vector<std::pair<std::uintptr_t, std::size_t>> AllocationTracker::live() const {
  std::shared_lock lock(mutex_);
  std::vector<std::pair<std::uintptr_t, std::size_t>> out;
  out.reserve(live_.size());
  for (const auto& [base, a] : live_) {
    if (!a.adopted) out.emplace_back(base, a.bytes);
  }
  return out;
}

}  // namespace kvport
