// The objects behind the C handles, and the process-wide table that maps a
// handle to its live object.
//
// A handle is a token, (serial << 3) | kind, never an address: serials are
// never reused, so a destroyed handle stays invalid forever (no ABA when an
// address is reused), and a handle of another kind is told apart by its
// kind. Each object counts its live children (streams and caches of a
// backend, prefix caches and block tables of a cache, block tables of a
// prefix cache); destroying an object with children is refused.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <vector>

#include "kvport/core/block_table.hpp"
#include "kvport/core/paged_kv_cache.hpp"
#include "kvport/core/prefix_cache.hpp"
#include "kvport/platform/backend.hpp"

namespace kvport::capi {

enum class Kind : std::uintptr_t {
  backend = 1,
  stream = 2,
  cache = 3,
  prefix_cache = 4,
  block_table = 5,
};

/// Base of every handle's object.
struct Object {
  virtual ~Object() = default;
  /// Live children; guarded by the handle table's mutex.
  std::size_t children = 0;
  /// The object this one is a child of (its `children` counts this one), or
  /// null for a backend.
  Object* parent = nullptr;
};

struct BackendObject final : Object {
  static constexpr Kind kKind = Kind::backend;
  explicit BackendObject(std::unique_ptr<Backend> b) : backend(std::move(b)) {}
  std::unique_ptr<Backend> backend;
};

struct StreamObject final : Object {
  static constexpr Kind kKind = Kind::stream;
  explicit StreamObject(Stream s) : stream(std::move(s)) {}
  Stream stream;
  Backend* backend = nullptr;
};

struct CacheObject final : Object {
  static constexpr Kind kKind = Kind::cache;
  std::unique_ptr<PagedKvCache> cache;
  /// The config's per-layer dtypes as C values, for kvport_cache_config.
  std::vector<std::int32_t> layer_dtypes;
};

struct PrefixCacheObject final : Object {
  static constexpr Kind kKind = Kind::prefix_cache;
  std::unique_ptr<PrefixCache> prefix;
};

struct BlockTableObject final : Object {
  static constexpr Kind kKind = Kind::block_table;
  std::unique_ptr<BlockTable> table;
};

/// Registers `object` as a child of `parent` (may be null) and returns its
/// handle. Strong guarantee: on failure (std::bad_alloc) nothing changed and
/// the object is destroyed.
std::uintptr_t publish(std::unique_ptr<Object> object, Kind kind, Object* parent);

/// The live object of `handle`, which must be of `kind`. Throws StatusError
/// (KVPORT_ERR_INVALID_HANDLE) for a null, unknown or destroyed handle or one
/// of another kind.
Object* lookup(const void* handle, Kind kind);

/// Removes `handle` from the table and destroys its object, then drops it
/// from its parent's children. Throws StatusError: KVPORT_ERR_INVALID_HANDLE
/// as lookup, KVPORT_ERR_HANDLE_IN_USE (nothing changed) while it has
/// children. The object's destructor runs outside the table's lock.
void retire(const void* handle, Kind kind);

template <class T>
T& get(const void* handle) {
  return static_cast<T&>(*lookup(handle, T::kKind));
}

template <class Handle, class T>
Handle* make_handle(std::unique_ptr<T> object, Object* parent) {
  return reinterpret_cast<Handle*>(publish(std::move(object), T::kKind, parent));
}

}  // namespace kvport::capi
