// SPDX-License-Identifier: Apache-2.0
// The objects behind the C handles, and the process-wide table that maps a
// handle to its live object.
//
// A handle is a token, (serial << 3) | kind, never an address: serials are
// never reused, so a destroyed handle stays invalid forever (no ABA when an
// address is reused), and a handle of another kind is told apart by its
// kind. Each object counts its live children (streams and caches of a
// backend, prefix caches and block tables of a cache, block tables of a
// prefix cache, hybrid block tables of a hybrid cache); destroying an object
// with children is refused. An object may also lend handles to parts of
// itself (a hybrid cache's group pools as kvport_cache handles): those are
// not children, cannot be destroyed on their own, and are retired with their
// lender.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <optional>
#include <vector>

#include "kvport/core/block_table.hpp"
#include "kvport/core/hybrid_block_table.hpp"
#include "kvport/core/hybrid_kv_cache.hpp"
#include "kvport/core/paged_kv_cache.hpp"
#include "kvport/core/prefix_cache.hpp"
#include "kvport/events/publisher.hpp"
#include "kvport/kvport.h"
#include "kvport/platform/backend.hpp"

namespace kvport::capi {

// The kind lives in the token's low 3 bits: at most 7 kinds.
enum class Kind : std::uintptr_t {
  backend = 1,
  stream = 2,
  cache = 3,
  prefix_cache = 4,
  block_table = 5,
  hybrid_cache = 6,
  hybrid_block_table = 7,
};

/// Base of every handle's object.
struct Object {
  virtual ~Object() = default;
  /// Live children; guarded by the handle table's mutex.
  std::size_t children = 0;
  /// The object this one is a child of (its `children` counts this one), or
  /// null for a backend. For a lent object: its lender (not counted).
  Object* parent = nullptr;
  /// True for an object lent by its parent (see lend()).
  bool lent = false;
  /// Handles this object lent out; retired with it. Guarded by the mutex.
  std::vector<std::uintptr_t> lent_handles;
};

struct BackendObject final : Object {
  static constexpr Kind kKind = Kind::backend;
  explicit BackendObject(std::unique_ptr<Backend> b) : backend(std::move(b)) {}
  std::unique_ptr<Backend> backend;
};

struct StreamObject final : Object {
  static constexpr Kind kKind = Kind::stream;
  explicit StreamObject(Stream s) : stream(std::move(s)) {}
  /// A registration of an engine's stream (kvport_stream_wrap).
  explicit StreamObject(WrappedStream w) : wrapped(std::move(w)) {}
  /// The stream kvport created, or none for a wrap.
  std::optional<Stream> stream;
  /// The engine's stream, registered; never destroyed by kvport.
  WrappedStream wrapped;
  Backend* backend = nullptr;

  StreamView view() const noexcept { return stream ? stream->view() : wrapped.view(); }
};

struct CacheObject final : Object {
  static constexpr Kind kKind = Kind::cache;
  /// `owned`, or a hybrid cache's group pool (a lent handle).
  PagedKvCache* cache = nullptr;
  std::unique_ptr<PagedKvCache> owned;
  /// The config's per-layer dtypes as C values, for kvport_cache_config.
  std::vector<std::int32_t> layer_dtypes;
  /// kvport_cache_as_groups' lent handle, made on first use.
  kvport_hybrid_cache* groups = nullptr;
};

struct PrefixCacheObject final : Object {
  static constexpr Kind kKind = Kind::prefix_cache;
  /// The prefix cache's event sink while events are enabled (events.cpp).
  std::unique_ptr<events::Publisher> publisher;
  std::unique_ptr<PrefixCache> prefix;
  /// kvport_prefix_cache_as_groups' lent handle, made on first use.
  kvport_hybrid_cache* groups = nullptr;
  /// The prefix cache first: its destructor announces a clear to the
  /// publisher, which then sends what it buffered.
  ~PrefixCacheObject() override {
    prefix.reset();
    publisher.reset();
  }
};

struct BlockTableObject final : Object {
  static constexpr Kind kKind = Kind::block_table;
  std::unique_ptr<BlockTable> table;
};

struct HybridCacheObject final : Object {
  static constexpr Kind kKind = Kind::hybrid_cache;
  /// Every group's event sink while events are enabled (events.cpp).
  std::unique_ptr<events::Publisher> publisher;
  /// `owned`, or the one-group view of a prefix cache or cache
  /// (kvport_prefix_cache_as_groups, kvport_cache_as_groups: a lent handle).
  HybridKvCache* cache = nullptr;
  std::unique_ptr<HybridKvCache> owned;
  /// The cache first (its prefix caches announce their clears), then the
  /// publisher.
  ~HybridCacheObject() override {
    owned.reset();
    publisher.reset();
  }
  /// Per group: its state tensors as C structs (names point into the
  /// cache's specs), for kvport_hybrid_cache_group_spec.
  std::vector<std::vector<kvport_state_tensor>> state_tensors;
  /// Per group: its pool's lent kvport_cache handle, made on first use.
  std::vector<kvport_cache*> group_handles;
};

struct HybridBlockTableObject final : Object {
  static constexpr Kind kKind = Kind::hybrid_block_table;
  std::unique_ptr<HybridBlockTable> table;
};

/// Registers `object` as a child of `parent` (may be null) and returns its
/// handle. Strong guarantee: on failure (std::bad_alloc) nothing changed and
/// the object is destroyed.
std::uintptr_t publish(std::unique_ptr<Object> object, Kind kind, Object* parent);

/// The live object of `handle`, which must be of `kind`. Throws StatusError
/// (KVPORT_ERR_INVALID_HANDLE) for a null, unknown or destroyed handle or one
/// of another kind.
Object* lookup(const void* handle, Kind kind);

/// Registers `object` as lent by `lender` and returns its handle: not a
/// child (the lender's `children` is unchanged), retired with the lender,
/// refused by retire(). Strong guarantee as publish.
std::uintptr_t lend(std::unique_ptr<Object> object, Kind kind, Object* lender);

/// Removes `handle` from the table and destroys its object (after the objects
/// it lent, which leave the table with it), then drops it from its parent's
/// children. Throws StatusError: KVPORT_ERR_INVALID_HANDLE as lookup,
/// KVPORT_ERR_HANDLE_IN_USE (nothing changed) while it has children,
/// KVPORT_ERR_INVALID_ARGUMENT for a lent handle. Destructors run outside the
/// table's lock.
void retire(const void* handle, Kind kind);

template <class T>
T& get(const void* handle) {
  return static_cast<T&>(*lookup(handle, T::kKind));
}

template <class Handle, class T>
Handle* make_handle(std::unique_ptr<T> object, Object* parent) {
  return reinterpret_cast<Handle*>(publish(std::move(object), T::kKind, parent));
}

template <class Handle, class T>
Handle* make_lent_handle(std::unique_ptr<T> object, Object* lender) {
  return reinterpret_cast<Handle*>(lend(std::move(object), T::kKind, lender));
}

}  // namespace kvport::capi
