// SPDX-License-Identifier: Apache-2.0
#include "handles.hpp"

#include <mutex>
#include <string>
#include <unordered_map>

#include "status.hpp"

namespace kvport::capi {
namespace {

constexpr unsigned kKindBits = 3;

struct Entry {
  Kind kind;
  Object* object;
};

struct Table {
  std::mutex mutex;
  std::unordered_map<std::uintptr_t, Entry> live;
  std::uintptr_t next_serial = 1;
};

// Never destroyed: handles still live at exit (and calls from other threads'
// destructors) must not find a destroyed table.
Table& table() {
  static Table* t = new Table;
  return *t;
}

const char* kind_name(Kind kind) noexcept {
  switch (kind) {
    case Kind::backend:
      return "kvport_backend";
    case Kind::stream:
      return "kvport_stream";
    case Kind::cache:
      return "kvport_cache";
    case Kind::prefix_cache:
      return "kvport_prefix_cache";
    case Kind::block_table:
      return "kvport_block_table";
    case Kind::hybrid_cache:
      return "kvport_hybrid_cache";
    case Kind::hybrid_block_table:
      return "kvport_hybrid_block_table";
  }
  return "handle";
}

[[noreturn]] void throw_invalid(const void* handle, Kind kind, const char* why) {
  throw StatusError(KVPORT_ERR_INVALID_HANDLE,
                    std::string(kind_name(kind)) + " handle " +
                        std::to_string(reinterpret_cast<std::uintptr_t>(handle)) + ": " + why);
}

// Caller holds the mutex.
Entry& find_locked(Table& t, const void* handle, Kind kind) {
  if (handle == nullptr)
    throw StatusError(KVPORT_ERR_INVALID_HANDLE, std::string(kind_name(kind)) + " handle is null");
  const auto it = t.live.find(reinterpret_cast<std::uintptr_t>(handle));
  if (it == t.live.end())
    throw_invalid(handle, kind, "not a live handle (destroyed, or never created)");
  if (it->second.kind != kind)
    throw_invalid(handle, kind, (std::string("is a ") + kind_name(it->second.kind)).c_str());
  return it->second;
}

}  // namespace

std::uintptr_t publish(std::unique_ptr<Object> object, Kind kind, Object* parent) {
  Table& t = table();
  const std::lock_guard lock(t.mutex);
  const std::uintptr_t token = (t.next_serial << kKindBits) | static_cast<std::uintptr_t>(kind);
  t.live.emplace(token, Entry{kind, object.get()});  // may throw: nothing changed
  ++t.next_serial;
  object->parent = parent;
  if (parent != nullptr) ++parent->children;
  object.release();
  return token;
}

std::uintptr_t lend(std::unique_ptr<Object> object, Kind kind, Object* lender) {
  Table& t = table();
  const std::lock_guard lock(t.mutex);
  const std::uintptr_t token = (t.next_serial << kKindBits) | static_cast<std::uintptr_t>(kind);
  lender->lent_handles.reserve(lender->lent_handles.size() + 1);  // may throw: nothing changed
  t.live.emplace(token, Entry{kind, object.get()});               // may throw: nothing changed
  ++t.next_serial;
  lender->lent_handles.push_back(token);  // reserved: no throw
  object->parent = lender;
  object->lent = true;
  object.release();
  return token;
}

Object* lookup(const void* handle, Kind kind) {
  Table& t = table();
  const std::lock_guard lock(t.mutex);
  return find_locked(t, handle, kind).object;
}

void retire(const void* handle, Kind kind) {
  Table& t = table();
  std::unique_ptr<Object> object;
  std::vector<std::unique_ptr<Object>> lent;
  {
    const std::lock_guard lock(t.mutex);
    Entry& entry = find_locked(t, handle, kind);
    if (entry.object->lent)
      throw StatusError(KVPORT_ERR_INVALID_ARGUMENT,
                        std::string(kind_name(kind)) +
                            " is borrowed (a hybrid cache's group pool, or the groups of a "
                            "prefix cache or cache): it is destroyed with the handle it came "
                            "from, not on its own");
    if (entry.object->children != 0)
      throw StatusError(KVPORT_ERR_HANDLE_IN_USE,
                        std::string(kind_name(kind)) + " still has " +
                            std::to_string(entry.object->children) +
                            " live child handle(s) (streams, caches, prefix caches or block "
                            "tables created over it): destroy those first");
    lent.reserve(entry.object->lent_handles.size());  // may throw: nothing changed
    object.reset(entry.object);
    for (const std::uintptr_t token : object->lent_handles) {
      const auto it = t.live.find(token);
      if (it == t.live.end()) continue;
      lent.emplace_back(it->second.object);  // reserved: no throw
      t.live.erase(it);
    }
    t.live.erase(reinterpret_cast<std::uintptr_t>(handle));
  }
  // Lent objects point into their lender: they go first. The parent stays
  // alive until its count drops below, so the child's destructor may still
  // use it.
  lent.clear();
  Object* parent = object->parent;
  object.reset();
  if (parent != nullptr) {
    const std::lock_guard lock(t.mutex);
    --parent->children;
  }
}

}  // namespace kvport::capi
