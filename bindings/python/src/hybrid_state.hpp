// SPDX-License-Identifier: Apache-2.0
// The owned state of the hybrid classes (a hybrid cache's backend and
// cache) and the Python-facing classes over it, HybridKvCache and
// HybridBlockTable, which bind_hybrid_cache.cpp and bind_hybrid_table.cpp
// bind.
//
// Lifetimes: a Python HybridKvCache holds a shared_ptr<HybridState> (backend +
// hybrid cache). Hybrid tables, group pools (borrowed PagedKvCache objects),
// views and every DLPack capsule exported from them hold it too, as a
// PagedKvCache's do (state.hpp).
#pragma once

#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <cstdint>
#include <memory>
#include <optional>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

#include "convert.hpp"
#include "events.hpp"
#include "fork_guard.hpp"
#include "kvport/core/hybrid_block_table.hpp"
#include "kvport/core/hybrid_kv_cache.hpp"
#include "kvport/core/kv_cache_plan.hpp"
#include "kvport/core/layer_spec.hpp"
#include "kvport/platform/error.hpp"
#include "kvport/platform/registry.hpp"
#include "parts.hpp"
#include "pool_view.hpp"

namespace kvport::python {

// ---- owned state ---------------------------------------------------------------

struct HybridState {
  /// A view's lender (PrefixCache.as_groups(): its PrefixState; PagedKvCache.as_groups():
  /// its CacheState), which owns the backend and the pools. Declared first:
  /// released last.
  std::shared_ptr<const void> lender;
  std::unique_ptr<Backend> owned_backend;
  Backend* backend = nullptr;  // owned_backend, or the lender's
  int device = 0;
  /// Every group's event sink while events are enabled (events.hpp).
  std::shared_ptr<events::Publisher> publisher;
  std::unique_ptr<HybridKvCache> owned_cache;  // destroyed first (see ~HybridState)
  /// owned_cache, or the one-group view of the lender (HybridKvCache::over).
  HybridKvCache* cache = nullptr;
  std::uint64_t generation = process_generation();  // fork_guard.hpp

  // The cache (its prefix caches announce their clears), the publisher, then
  // the backend; in a forked child none of them (they would wait on the
  // parent's threads).
  ~HybridState() {
    if (generation != process_generation()) {
      (void)owned_cache.release();
      new std::shared_ptr<events::Publisher>(std::move(publisher));  // leaked
      (void)owned_backend.release();
      return;
    }
    owned_cache.reset();
    publisher.reset();
  }
  bool borrowed() const noexcept { return lender != nullptr; }
  StreamView stream() const { return backend->default_stream(); }
  void sync() const { backend->synchronize(stream()); }
};

inline ViewOwner view_owner(const std::shared_ptr<HybridState>& state) {
  return ViewOwner{state, state->backend, state->device};
}

inline bool is_attention(LayerKind k) {
  return k == LayerKind::full_attention || k == LayerKind::sliding_window ||
         k == LayerKind::chunked_local;
}

class PyHybridCache {
 public:
  PyHybridCache(const std::vector<py::object>& layers, const py::object& blocks,
                std::optional<std::size_t> block_size, const std::string& backend, int device,
                std::size_t state_checkpoint_interval, std::optional<bool> trace) {
    HybridKvCacheConfig config;
    for (const py::object& l : layers)
      config.layers.push_back(l.cast<LayerSpec>());
    config.state_checkpoint_interval = state_checkpoint_interval;
    auto state = std::make_shared<HybridState>();
    state->owned_backend = make_backend(backend, device);
    state->backend = state->owned_backend.get();
    state->device = device;
    PagedKvCacheOptions options;
    options.trace = trace;
    if (py::isinstance<KvCachePlan>(blocks)) {
      const auto& plan = blocks.cast<const KvCachePlan&>();
      if (block_size && *block_size != plan.block_size)
        throw InvalidArgument("HybridKvCache: block_size " + std::to_string(*block_size) +
                              " differs from the plan's " + std::to_string(plan.block_size));
      config.block_size = plan.block_size;
      state->owned_cache =
          std::make_unique<HybridKvCache>(std::move(config), plan, *state->backend, options);
    } else {
      config.block_size = block_size.value_or(16);
      std::vector<std::size_t> counts;
      try {
        counts = blocks.cast<std::vector<std::size_t>>();
      } catch (const py::cast_error&) {
        throw InvalidArgument(
            "HybridKvCache: blocks_per_group must be a list of block counts (one per group) "
            "or a KvCachePlan, not " +
            std::string(py::str(py::type::handle_of(blocks).attr("__name__"))));
      }
      state->owned_cache =
          std::make_unique<HybridKvCache>(std::move(config), counts, *state->backend, options);
    }
    state->cache = state->owned_cache.get();
    state_ = std::move(state);
  }
  /// The one-group view `view` (HybridKvCache::over) of a cache that
  /// `lender` keeps alive with `backend` (PrefixCache.as_groups(),
  /// PagedKvCache.as_groups()).
  static PyHybridCache lent(std::shared_ptr<const void> lender, Backend* backend, int device,
                            HybridKvCache& view) {
    auto state = std::make_shared<HybridState>();
    state->lender = std::move(lender);
    state->backend = backend;
    state->device = device;
    state->cache = &view;
    return PyHybridCache(std::move(state));
  }

  const std::shared_ptr<HybridState>& state() const {
    if (!state_) throw InvalidArgument("HybridKvCache is closed");
    check_same_process(state_->generation, "this HybridKvCache");
    return state_;
  }
  HybridKvCache& cache() const { return *state()->cache; }
  bool closed() const noexcept { return !state_; }
  void close() noexcept { state_.reset(); }

  // Where model layer `layer` lives, which must be of a kind `ok` accepts.
  LayerLocation locate(std::size_t layer, bool (*ok)(LayerKind), const char* op,
                       const char* wants) const {
    const std::optional<LayerLocation> at = cache().locate(layer);
    const LayerKind kind = cache().config().layers[layer].kind;
    if (!at || !ok(kind))
      throw InvalidArgument(std::string(op) + "(" + std::to_string(layer) + "): layer " +
                            std::to_string(layer) + " is " + std::string(to_string(kind)) +
                            ", not " + wants);
    return *at;
  }

  PoolView attention_view(std::size_t layer, bool k, bool raw) const {
    const char* op = k ? "k_pool" : "v_pool";
    const LayerLocation at = locate(layer, &is_attention, op, "an attention layer");
    return layer_pool_view(view_owner(state()), cache().group_cache(at.group), k, at.index, raw,
                           std::string(op) + "(" + std::to_string(layer) + ")");
  }

  // [num_blocks, block_size, latent] (the pool's one "head" dropped).
  PoolView latent_view(std::size_t layer, bool raw) const {
    const LayerLocation at = locate(
        layer, [](LayerKind k) { return k == LayerKind::mla; }, "latent_pool", "an MLA layer");
    PoolView v = layer_pool_view(view_owner(state()), cache().group_cache(at.group), true, at.index,
                                 raw, "latent_pool(" + std::to_string(layer) + ")");
    if (cache().group(at.group).spec.mla_format == MlaFormat::fp8_ds_mla) v.kv_dtype = "fp8_ds_mla";
    if (v.shape.size() == 4) {
      v.shape = {v.shape[0], v.shape[1], v.shape[3]};
      v.strides = {v.strides[0], v.strides[1], 1};
    }
    return v;
  }

  // State tensor `tensor` (an index or a name) of every slot: [num_slots, *shape].
  PoolView state_view(std::size_t layer, const py::object& tensor, bool raw) const {
    const LayerLocation at = locate(
        layer, [](LayerKind k) { return k == LayerKind::state; }, "state_pool", "a state layer");
    const LayerSpec& spec = cache().config().layers[layer];
    std::size_t i = spec.state.size();
    if (py::isinstance<py::str>(tensor)) {
      const auto name = tensor.cast<std::string>();
      for (std::size_t j = 0; j < spec.state.size(); ++j)
        if (spec.state[j].name == name) i = j;
      if (i == spec.state.size())
        throw InvalidArgument("state_pool(" + std::to_string(layer) + "): no state tensor '" +
                              name + "' (" + spec.describe() + ")");
    } else {
      i = static_cast<std::size_t>(to_u32(int_from(tensor, "state tensor"), "state tensor"));
      if (i >= spec.state.size())
        throw InvalidArgument("state_pool(" + std::to_string(layer) + "): state tensor " +
                              std::to_string(i) + " out of range (" +
                              std::to_string(spec.state.size()) + " tensors)");
    }
    const StateTensor& t = spec.state[i];
    const kvport::BlockPool& pool = cache().group_cache(at.group).pool(at.index, kvport::KvPart::k);
    const std::size_t elem = state_dtype_bytes(t.dtype);
    const std::size_t stride = pool.stride;
    const std::size_t offset = spec.state_offset(i);
    // Offsets are multiples of 16 bytes and the slot stride is too: a slot's
    // tensors start at element boundaries.
    if (stride % elem != 0 || offset % elem != 0)
      throw Error("state_pool: slot stride " + std::to_string(stride) + " or offset " +
                  std::to_string(offset) + " is not a multiple of the element size");
    PoolView v;
    v.owner = view_owner(state());
    v.what = "state_pool(" + std::to_string(layer) + ", '" + t.name + "')";
    v.kv_dtype = state_dtype_name(t.dtype);
    v.data = pool.base.address() + offset;
    switch (t.dtype) {
      case StateDtype::f32:
        v.dl_dtype = raw ? DLDataType{kDLUInt, 32, 1} : DLDataType{kDLFloat, 32, 1};
        break;
      case StateDtype::f16:
        v.dl_dtype = raw ? DLDataType{kDLUInt, 16, 1} : DLDataType{kDLFloat, 16, 1};
        break;
      case StateDtype::bf16:
        v.dl_dtype = raw ? DLDataType{kDLUInt, 16, 1} : DLDataType{kDLBfloat, 16, 1};
        break;
    }
    v.dtype = v.dl_dtype.code == kDLBfloat  ? "bfloat16"
              : v.dl_dtype.code == kDLFloat ? "float" + std::to_string(v.dl_dtype.bits)
                                            : "uint" + std::to_string(v.dl_dtype.bits);
    v.shape = {static_cast<std::int64_t>(pool.num_blocks)};
    for (const std::size_t d : t.shape)
      v.shape.push_back(static_cast<std::int64_t>(d));
    v.strides.assign(v.shape.size(), 1);
    for (std::size_t d = v.shape.size() - 1; d > 1; --d)
      v.strides[d - 1] = v.strides[d] * v.shape[d];
    v.strides[0] = static_cast<std::int64_t>(stride / elem);
    return v;
  }

  // Every view of model layer `layer`: {"k", "v"} (attention), {"latent"}
  // (MLA), one per state tensor by name (state), {} (none).
  py::dict views(std::size_t layer, bool raw) const {
    py::dict out;
    const std::optional<LayerLocation> at = cache().locate(layer);
    if (!at) return out;
    const LayerSpec& spec = cache().config().layers[layer];
    switch (spec.kind) {
      case LayerKind::full_attention:
      case LayerKind::sliding_window:
      case LayerKind::chunked_local:
        out["k"] = attention_view(layer, true, raw);
        out["v"] = attention_view(layer, false, raw);
        break;
      case LayerKind::mla:
        out["latent"] = latent_view(layer, raw);
        break;
      case LayerKind::state:
        for (std::size_t i = 0; i < spec.state.size(); ++i)
          out[py::str(spec.state[i].name)] = state_view(layer, py::int_(i), raw);
        break;
      case LayerKind::none:
        break;
    }
    return out;
  }

  py::object group_pool(std::size_t g) const {
    const auto& s = state();
    return borrowed_cache(s, *s->backend, s->device, s->cache->group_cache(g));
  }

  std::string repr() const {
    if (!state_) return "HybridKvCache(closed)";
    const HybridKvCache& c = *state_->cache;
    std::ostringstream s;
    s << "HybridKvCache(backend='" << state_->backend->name() << "', num_layers=" << c.num_layers()
      << ", block_size=" << c.block_size() << ", groups=[";
    for (std::size_t g = 0; g < c.num_groups(); ++g)
      s << (g != 0 ? ", " : "") << c.group(g).layers.size() << " x " << c.group(g).spec.describe()
        << ": " << c.group_cache(g).num_blocks() << " blocks";
    s << "], total_bytes=" << c.total_bytes() << ")";
    return s.str();
  }

 private:
  explicit PyHybridCache(std::shared_ptr<HybridState> state) : state_(std::move(state)) {}

  std::shared_ptr<HybridState> state_;
};

class PyHybridTable {
 public:
  PyHybridTable(const PyHybridCache& cache, std::uint64_t extra_key)
      : cache_(cache.state()),
        table_(std::make_unique<HybridBlockTable>(*cache_->cache, extra_key)) {}
  PyHybridTable(std::shared_ptr<HybridState> cache, HybridBlockTable table)
      : cache_(std::move(cache)), table_(std::make_unique<HybridBlockTable>(std::move(table))) {}
  ~PyHybridTable() {
    if (cache_ && cache_->generation != process_generation()) (void)table_.release();
    table_.reset();
  }
  PyHybridTable(const PyHybridTable&) = delete;
  PyHybridTable& operator=(const PyHybridTable&) = delete;

  HybridBlockTable& table() const {
    if (!table_) throw InvalidArgument("HybridBlockTable is closed");
    check_same_process(cache_->generation, "this HybridBlockTable");
    return *table_;
  }
  StreamView stream() const { return cache_->stream(); }
  void sync() const { cache_->sync(); }
  std::unique_ptr<PyHybridTable> fork() const {
    HybridBlockTable child = table().fork(stream());
    sync();
    return std::make_unique<PyHybridTable>(cache_, std::move(child));
  }
  bool closed() const noexcept { return !table_; }
  void close() noexcept { table_.reset(); }
  std::string repr() const {
    if (!table_) return "HybridBlockTable(closed)";
    std::ostringstream s;
    s << "HybridBlockTable(num_tokens=" << table_->num_tokens() << ", live blocks per group=[";
    for (std::size_t g = 0; g < cache_->cache->num_groups(); ++g) {
      s << (g != 0 ? ", " : "");
      if (cache_->cache->group(g).spec.kind == LayerKind::state) {
        const std::optional<BlockId> slot = table_->state_slot(g);
        s << "slot " << (slot ? std::to_string(*slot) : std::string("none"));
      } else {
        s << table_->num_live_blocks(g);
      }
    }
    s << "])";
    return s.str();
  }

 private:
  std::shared_ptr<HybridState> cache_;  // declared first: destroyed last
  std::unique_ptr<HybridBlockTable> table_;
};

inline py::array_t<std::uint32_t> id_array(std::span<const BlockId> ids) {
  require_numpy("block_ids");
  py::array_t<std::uint32_t> out(static_cast<py::ssize_t>(ids.size()));
  std::copy(ids.begin(), ids.end(), out.mutable_data());
  return out;
}

}  // namespace kvport::python
