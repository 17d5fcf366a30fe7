// SPDX-License-Identifier: Apache-2.0
// The module's owned state (a cache's backend and pools, a prefix cache's)
// and the Python-facing classes over it (PagedKvCache, PrefixCache,
// BlockTable), which several of the module's sources bind or return.
//
// Lifetimes: a Python PagedKvCache holds a shared_ptr<CacheState> (backend +
// cache). Prefix caches, block tables, pool views and every DLPack capsule
// exported from a view hold the same shared_ptr, so the pools stay allocated
// while anything can still reach them; close() (or leaving a `with` block)
// only detaches the Python object.
#pragma once

#include <pybind11/pybind11.h>

#include <memory>
#include <optional>
#include <sstream>
#include <string>
#include <utility>

#include "convert.hpp"
#include "fork_guard.hpp"
#include "kvport/core/block_table.hpp"
#include "kvport/core/kv_cache_config.hpp"
#include "kvport/core/paged_kv_cache.hpp"
#include "kvport/core/prefix_cache.hpp"
#include "kvport/events/publisher.hpp"
#include "kvport/platform/error.hpp"
#include "kvport/platform/registry.hpp"
#include "pool_view.hpp"

namespace kvport::python {

namespace py = pybind11;

// A cache's backend and pools: its own, or a hybrid cache's group pool
// (borrowed: `lender` keeps the hybrid cache alive, whose blocks belong to its
// hybrid tables, so allocation and prefix caches over it are refused).
struct CacheState {
  std::shared_ptr<const void> lender;  // declared first: released last
  std::unique_ptr<kvport::Backend> owned_backend;
  std::unique_ptr<kvport::PagedKvCache> owned_cache;  // destroyed first (see ~CacheState)
  kvport::Backend* backend = nullptr;
  kvport::PagedKvCache* cache = nullptr;
  int device = 0;
  /// The engine's stream the cache's work goes to (PagedKvCache.use_stream;
  /// bind_adopt.cpp); empty: the backend's default stream.
  kvport::WrappedStream engine_stream;
  /// The engine's tensors an adopted cache's pools are (bind_adopt.cpp):
  /// released after the cache, with the GIL taken.
  std::shared_ptr<void> engine_memory;
  std::uint64_t generation = process_generation();  // fork_guard.hpp

  ~CacheState() {
    if (generation != process_generation()) {
      // A forked child: destroying them would wait on the parent's threads.
      (void)owned_cache.release();  // NOLINT(bugprone-unused-return-value)
      (void)owned_backend.release();
      // The wrap's registration lives in the leaked backend: leaked with it.
      if (engine_stream) (void)new kvport::WrappedStream(std::move(engine_stream));
      return;
    }
    owned_cache.reset();
  }
  bool borrowed() const noexcept { return lender != nullptr; }
  kvport::StreamView stream() const {
    return engine_stream ? engine_stream.view() : backend->default_stream();
  }
};

inline ViewOwner view_owner(const std::shared_ptr<CacheState>& state) {
  return ViewOwner{state, state->backend, state->device};
}

struct PrefixState {
  std::shared_ptr<CacheState> cache;
  /// The prefix cache's event sink while events are enabled (events.hpp).
  std::shared_ptr<kvport::events::Publisher> publisher;
  std::unique_ptr<kvport::PrefixCache> prefix;

  // The prefix cache first (it announces a clear to the publisher, which
  // then sends what it buffered), then the publisher, then the pools.
  ~PrefixState() {
    if (cache && cache->generation != process_generation()) {
      // A forked child: the publisher's thread is the parent's.
      (void)prefix.release();
      new std::shared_ptr<kvport::events::Publisher>(std::move(publisher));  // leaked
      return;
    }
    prefix.reset();
    publisher.reset();
  }
};

// Block-major layout: the one pool, each block's bytes of every layer (layer 0
// K, layer 0 V, layer 1 K, ...).
class PyCache {
 public:
  PyCache(const KvCacheConfig& config, std::size_t num_blocks, const std::string& backend,
          int device, std::optional<bool> trace) {
    auto state = std::make_shared<CacheState>();
    state->owned_backend = kvport::make_backend(backend, device);
    state->backend = state->owned_backend.get();
    state->device = device;
    kvport::PagedKvCacheOptions options;
    options.trace = trace;
    state->owned_cache =
        std::make_unique<kvport::PagedKvCache>(config, num_blocks, *state->backend, options);
    state->cache = state->owned_cache.get();
    state_ = std::move(state);
  }
  explicit PyCache(std::shared_ptr<CacheState> state) : state_(std::move(state)) {}

  const std::shared_ptr<CacheState>& state() const {
    if (!state_) throw kvport::InvalidArgument("PagedKvCache is closed");
    check_same_process(state_->generation, "this PagedKvCache");
    return state_;
  }
  kvport::PagedKvCache& cache() const { return *state()->cache; }
  // The cache for calls that allocate or release blocks: not a hybrid
  // cache's group pool.
  kvport::PagedKvCache& owned_cache(const char* op) const {
    refuse_borrowed(*state(), op);
    return *state()->cache;
  }
  static void refuse_borrowed(const CacheState& state, const char* op) {
    if (state.borrowed())
      throw kvport::InvalidArgument(std::string(op) +
                                    ": this PagedKvCache is a hybrid cache's group pool "
                                    "(borrowed): its blocks are allocated and released by "
                                    "HybridBlockTable");
  }
  kvport::StreamView stream() const { return state()->stream(); }
  void sync() const { state()->backend->synchronize(stream()); }
  bool closed() const noexcept { return !state_; }
  void close() noexcept { state_.reset(); }

  std::string repr() const {
    if (!state_) return "PagedKvCache(closed)";
    const auto& c = *state_->cache;
    std::ostringstream s;
    s << "PagedKvCache(" << (state_->borrowed() ? "borrowed, " : "") << "backend='"
      << state_->backend->name() << "', device=" << state_->device
      << ", num_blocks=" << c.num_blocks() << ", free=" << c.num_free_blocks()
      << ", num_layers=" << c.num_layers() << ", dtype='" << dtype_name(c.config().dtype) << "'"
      << (c.config().layer_dtypes.empty() ? "" : " (mixed)") << ", layout='"
      << layout_name(c.config().layout) << "', total_bytes=" << c.total_bytes() << ")";
    return s.str();
  }

 private:
  std::shared_ptr<CacheState> state_;
};

class PyPrefixCache {
 public:
  explicit PyPrefixCache(const PyCache& cache) {
    auto state = std::make_shared<PrefixState>();
    state->cache = cache.state();
    PyCache::refuse_borrowed(*state->cache, "PrefixCache");
    state->prefix = std::make_unique<kvport::PrefixCache>(*state->cache->cache);
    state_ = std::move(state);
  }
  const std::shared_ptr<PrefixState>& state() const {
    if (!state_) throw kvport::InvalidArgument("PrefixCache is closed");
    check_same_process(state_->cache->generation, "this PrefixCache");
    return state_;
  }
  kvport::PrefixCache& prefix() const { return *state()->prefix; }
  bool closed() const noexcept { return !state_; }
  void close() noexcept { state_.reset(); }
  std::string repr() const {
    if (!state_) return "PrefixCache(closed)";
    const auto& p = *state_->prefix;
    std::ostringstream s;
    s << "PrefixCache(block_size=" << p.block_size() << ", cached=" << p.num_cached_blocks()
      << ", evictable=" << p.num_evictable_blocks() << ", available=" << p.num_available_blocks()
      << ", hits=" << p.counters().hits << ", misses=" << p.counters().misses << ")";
    return s.str();
  }

 private:
  std::shared_ptr<PrefixState> state_;
};

class PyBlockTable {
 public:
  PyBlockTable(const py::object& owner, std::uint64_t extra_key) {
    if (py::isinstance<PyPrefixCache>(owner)) {
      prefix_ = owner.cast<const PyPrefixCache&>().state();
      cache_ = prefix_->cache;
      table_ = std::make_unique<kvport::BlockTable>(*prefix_->prefix, extra_key);
    } else if (py::isinstance<PyCache>(owner)) {
      if (extra_key != 0)
        throw kvport::InvalidArgument("BlockTable: extra_key needs a PrefixCache");
      cache_ = owner.cast<const PyCache&>().state();
      PyCache::refuse_borrowed(*cache_, "BlockTable");
      table_ = std::make_unique<kvport::BlockTable>(*cache_->cache);
    } else {
      throw kvport::InvalidArgument("BlockTable: owner must be a PagedKvCache or a PrefixCache");
    }
  }
  PyBlockTable(std::shared_ptr<CacheState> cache, std::shared_ptr<PrefixState> prefix,
               kvport::BlockTable table)
      : cache_(std::move(cache)),
        prefix_(std::move(prefix)),
        table_(std::make_unique<kvport::BlockTable>(std::move(table))) {}
  ~PyBlockTable() {
    if (cache_ && cache_->generation != process_generation()) (void)table_.release();
    table_.reset();
  }
  PyBlockTable(const PyBlockTable&) = delete;
  PyBlockTable& operator=(const PyBlockTable&) = delete;

  kvport::BlockTable& table() const {
    if (!table_) throw kvport::InvalidArgument("BlockTable is closed");
    check_same_process(cache_->generation, "this BlockTable");
    return *table_;
  }
  kvport::StreamView stream() const { return cache_->stream(); }
  void sync() const { cache_->backend->synchronize(stream()); }
  std::unique_ptr<PyBlockTable> fork() const {
    return std::make_unique<PyBlockTable>(cache_, prefix_, table().fork());
  }
  bool closed() const noexcept { return !table_; }
  void close() noexcept { table_.reset(); }
  std::string repr() const {
    if (!table_) return "BlockTable(closed)";
    std::ostringstream s;
    s << "BlockTable(num_tokens=" << table_->num_tokens() << ", blocks=[";
    const auto blocks = table_->blocks();
    for (std::size_t i = 0; i < blocks.size(); ++i) {
      if (i == 8) {
        s << ", ... " << blocks.size() - 8 << " more";
        break;
      }
      s << (i != 0 ? ", " : "") << blocks[i];
    }
    s << "]" << (prefix_ ? ", prefix_cache" : "") << ")";
    return s.str();
  }

 private:
  std::shared_ptr<CacheState> cache_;  // declared first: destroyed last
  std::shared_ptr<PrefixState> prefix_;
  std::unique_ptr<kvport::BlockTable> table_;
};

}  // namespace kvport::python
