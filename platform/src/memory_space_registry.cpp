// SPDX-License-Identifier: Apache-2.0
#include "kvport/platform/memory_space_registry.hpp"

#include <fmt/format.h>

#include <iterator>
#include <map>
#include <mutex>
#include <utility>

#include "kvport/platform/error.hpp"
#include "kvport/platform/log.hpp"

namespace kvport {
namespace {

struct Range {
  std::size_t bytes = 0;
  MemorySpaceRegistry::RangeKind kind = MemorySpaceRegistry::RangeKind::allocation;
  std::string owner_name;
};

// Keyed by (base, owner): one owner never holds two ranges at one base (its
// tracker is keyed by base), and two owners' entries at one base can only
// come from memory freed while adopted, which add_allocation logs.
using Ranges = std::map<std::pair<std::uintptr_t, const void*>, Range>;

struct Registry {
  std::mutex mutex;
  std::map<MemorySpace, Ranges> spaces;
};

// Never destroyed: a backend held in a static (the default backend) reports
// its last frees at static destruction, after a function-local registry would
// be gone.
Registry& registry() {
  static Registry* r = new Registry;  // NOLINT(cppcoreguidelines-owning-memory)
  return *r;
}

const char* kind_text(MemorySpaceRegistry::RangeKind kind) {
  return kind == MemorySpaceRegistry::RangeKind::adopted ? "an adopted range" : "a live allocation";
}

// The recorded range that overlaps [a, a + bytes), if any. Ranges do not
// overlap each other, so only the last one that starts before the end can.
Ranges::const_iterator find_overlap(const Ranges& ranges, std::uintptr_t a, std::size_t bytes) {
  auto it = ranges.lower_bound({a + bytes, nullptr});
  if (it == ranges.begin()) return ranges.end();
  --it;
  return it->first.first + it->second.bytes > a ? it : ranges.end();
}

}  // namespace

std::string to_string(MemorySpace space) {
  switch (space.kind) {
    case MemoryKind::host:
      return "host memory";
    case MemoryKind::cuda:
      return fmt::format("cuda device {}", space.device);
    case MemoryKind::rocm:
      return fmt::format("rocm device {}", space.device);
  }
  return "unknown memory";
}

void MemorySpaceRegistry::add_allocation(MemorySpace space, std::uintptr_t base, std::size_t bytes,
                                         const void* owner, const std::string& owner_name) {
  Registry& r = registry();
  std::lock_guard lock(r.mutex);
  Ranges& ranges = r.spaces[space];
  // A recorded range the allocator just handed out again is stale (its
  // memory was freed while adopted): logged and forgotten, so that recorded
  // ranges never overlap (find_overlap relies on it) and the live
  // allocation is the one protected. Its owner's remove() then finds nothing.
  for (auto hit = find_overlap(ranges, base, bytes); hit != ranges.end();
       hit = find_overlap(ranges, base, bytes)) {
    log::error(fmt::format(
        "{}: alloc: [{:#x}, +{}) overlaps {} [{:#x}, +{}) of {} ({}): that memory was freed by "
        "its owner while still adopted; the stale range is forgotten",
        owner_name, base, bytes, kind_text(hit->second.kind), hit->first.first, hit->second.bytes,
        hit->second.owner_name, to_string(space)));
    ranges.erase(hit);
  }
  ranges.insert_or_assign({base, owner}, Range{bytes, RangeKind::allocation, owner_name});
}

void MemorySpaceRegistry::add_adopted(MemorySpace space, std::uintptr_t base, std::size_t bytes,
                                      const void* owner, const std::string& owner_name) {
  Registry& r = registry();
  std::lock_guard lock(r.mutex);
  Ranges& ranges = r.spaces[space];
  const auto hit = find_overlap(ranges, base, bytes);
  if (hit != ranges.end() && hit->first.second != owner) {
    throw InvalidArgument(fmt::format(
        "{}: adopt_memory: [{:#x}, +{}) overlaps {} [{:#x}, +{}) of another {} backend object "
        "({}): two caches cannot share memory, whichever backend objects they use",
        owner_name, base, bytes, kind_text(hit->second.kind), hit->first.first, hit->second.bytes,
        hit->second.owner_name, to_string(space)));
  }
  ranges.insert_or_assign({base, owner}, Range{bytes, RangeKind::adopted, owner_name});
}

void MemorySpaceRegistry::remove(MemorySpace space, std::uintptr_t base,
                                 const void* owner) noexcept {
  Registry& r = registry();
  std::lock_guard lock(r.mutex);
  const auto s = r.spaces.find(space);
  if (s != r.spaces.end()) s->second.erase({base, owner});
}

std::size_t MemorySpaceRegistry::count(MemorySpace space) {
  Registry& r = registry();
  std::lock_guard lock(r.mutex);
  const auto s = r.spaces.find(space);
  return s == r.spaces.end() ? 0 : s->second.size();
}

}  // namespace kvport
