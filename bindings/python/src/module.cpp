// kvport._kvport: the Python module over kvport's C++ API (pybind11).
// docs/bindings/python.md is the user's guide; kvport/__init__.py re-exports
// everything here.
//
// Lifetimes: a Python PagedKvCache holds a shared_ptr<CacheState> (backend +
// cache). Prefix caches, block tables, pool views and every DLPack capsule
// exported from a view hold the same shared_ptr, so the pools stay allocated
// while anything can still reach them; close() (or leaving a `with` block)
// only detaches the Python object. The DLPack deleter drops a shared_ptr and
// needs no GIL, so a consumer may call it from any thread. Hybrid caches
// (hybrid.cpp) follow the same rule with their own state.
//
// Parts in sources of their own: convert.cpp (Python values to kvport
// types), pool_view.cpp (PoolView and DLPack), hybrid.cpp (layer specs, the
// planner, hybrid caches and tables).
#include <dlpack/dlpack.h>
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <cstdint>
#include <limits>
#include <memory>
#include <optional>
#include <span>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

#include "convert.hpp"
#include "kvport/core/block_table.hpp"
#include "kvport/core/dtype.hpp"
#include "kvport/core/kv_cache_config.hpp"
#include "kvport/core/paged_kv_cache.hpp"
#include "kvport/core/prefix_cache.hpp"
#include "kvport/platform/error.hpp"
#include "kvport/platform/registry.hpp"
#include "parts.hpp"
#include "pool_view.hpp"

namespace py = pybind11;

namespace {

using kvport::BlockId;
using kvport::KvCacheConfig;
using kvport::KvCacheDtype;
using kvport::KvCacheLayout;
using kvport::python::block_id;
using kvport::python::dtype_from;
using kvport::python::dtype_name;
using kvport::python::id_list;
using kvport::python::layer_pool_view;
using kvport::python::layout_from;
using kvport::python::layout_name;
using kvport::python::PoolView;
using kvport::python::u32_batch;
using kvport::python::U32Batch;
using kvport::python::ViewOwner;

// ---- owned state ------------------------------------------------------------------

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

  ~CacheState() { owned_cache.reset(); }
  bool borrowed() const noexcept { return lender != nullptr; }
  kvport::StreamView stream() const { return backend->default_stream(); }
};

ViewOwner view_owner(const std::shared_ptr<CacheState>& state) {
  return ViewOwner{state, state->backend, state->device};
}

struct PrefixState {
  std::shared_ptr<CacheState> cache;
  std::unique_ptr<kvport::PrefixCache> prefix;

  ~PrefixState() { prefix.reset(); }
};

// Block-major layout: the one pool, each block's bytes of every layer (layer 0
// K, layer 0 V, layer 1 K, ...).
PoolView make_block_view(const std::shared_ptr<CacheState>& state) {
  const kvport::PagedKvCache& cache = *state->cache;
  if (cache.config().layout != KvCacheLayout::block_major)
    throw kvport::InvalidArgument(
        "block_pool: the cache's layout is layer_major (one pool per layer's K and V: use "
        "k_pool / v_pool)");
  PoolView v;
  v.owner = view_owner(state);
  v.what = "block_pool";
  // The one memory pool: each region a whole block.
  const kvport::BlockPool& pool = cache.memory_pools().front();
  v.kv_dtype = dtype_name(pool.dtype);
  v.data = pool.base.address();
  v.dl_dtype = DLDataType{kDLUInt, 8, 1};
  v.dtype = "uint8";
  const auto stride = static_cast<std::int64_t>(pool.stride);
  v.shape = {static_cast<std::int64_t>(pool.num_blocks), stride};
  v.strides = {stride, 1};
  return v;
}

PoolView make_view(const std::shared_ptr<CacheState>& state, bool k, std::size_t layer, bool raw) {
  return layer_pool_view(view_owner(state), *state->cache, k, layer, raw,
                         std::string(k ? "k_pool(" : "v_pool(") + std::to_string(layer) + ")");
}

// ---- the Python-facing classes ----------------------------------------------------

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
  ~PyBlockTable() { table_.reset(); }
  PyBlockTable(const PyBlockTable&) = delete;
  PyBlockTable& operator=(const PyBlockTable&) = delete;

  kvport::BlockTable& table() const {
    if (!table_) throw kvport::InvalidArgument("BlockTable is closed");
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

std::string config_repr(const KvCacheConfig& c) {
  std::ostringstream s;
  s << "KvCacheConfig(num_layers=" << c.num_layers << ", block_size=" << c.block_size
    << ", num_kv_heads=" << c.num_kv_heads << ", head_dim_k=" << c.head_dim_k
    << ", head_dim_v=" << c.head_dim_v << ", dtype='" << dtype_name(c.dtype) << "'";
  if (!c.layer_dtypes.empty()) {
    s << ", layer_dtypes=[";
    for (std::size_t i = 0; i < c.layer_dtypes.size(); ++i)
      s << (i != 0 ? ", '" : "'") << dtype_name(c.layer_dtypes[i]) << "'";
    s << "]";
  }
  s << ", layout='" << layout_name(c.layout) << "')";
  return s.str();
}

bool config_equal(const KvCacheConfig& a, const KvCacheConfig& b) {
  return a.num_layers == b.num_layers && a.block_size == b.block_size &&
         a.num_kv_heads == b.num_kv_heads && a.head_dim_k == b.head_dim_k &&
         a.head_dim_v == b.head_dim_v && a.dtype == b.dtype && a.layer_dtypes == b.layer_dtypes &&
         a.layout == b.layout;
}

py::array_t<std::uint8_t> bytes_array(std::vector<std::uint8_t>&& bytes) {
  auto* owned = new std::vector<std::uint8_t>(std::move(bytes));
  py::capsule free_when_done(owned,
                             [](void* p) { delete static_cast<std::vector<std::uint8_t>*>(p); });
  return py::array_t<std::uint8_t>({static_cast<py::ssize_t>(owned->size())}, owned->data(),
                                   free_when_done);
}

// Host bytes of a buffer (bytes, bytearray, any C-contiguous NumPy array).
py::array contiguous_bytes(const py::object& obj) {
  // Through a memoryview for bytes and bytearray: NumPy takes a bytes object
  // for a 0-d string scalar, and b"" for one of 1 byte.
  const bool raw = py::isinstance<py::bytes>(obj) || py::isinstance<py::bytearray>(obj);
  auto arr = py::array::ensure(raw ? py::object(py::memoryview(obj)) : obj, py::array::c_style);
  if (!arr) throw kvport::InvalidArgument("write_block: k and v must be buffers (bytes, arrays)");
  return arr;
}

std::span<const std::uint8_t> byte_span(const py::array& arr) {
  return {static_cast<const std::uint8_t*>(arr.data()), static_cast<std::size_t>(arr.nbytes())};
}

void register_exceptions(py::module_& m) {
  auto make = [&m](const char* name, py::handle bases, const char* doc) {
    const std::string full = std::string("kvport.") + name;
    py::object bases_tuple = py::isinstance<py::tuple>(bases)
                                 ? py::reinterpret_borrow<py::object>(bases)
                                 : py::object(py::make_tuple(bases));
    PyObject* type = PyErr_NewExceptionWithDoc(full.c_str(), doc, bases_tuple.ptr(), nullptr);
    if (type == nullptr) throw py::error_already_set();
    m.attr(name) = py::handle(type);  // the module takes its own reference
    return py::handle(type);
  };
  // Leaked on purpose: the translator may run until the interpreter exits.
  static py::handle error, invalid, exhausted, oom, backend_error, device_lost;
  error = make("Error", PyExc_RuntimeError, "Base of every kvport error (kvport::Error).");
  invalid = make("InvalidArgument", py::make_tuple(error, py::handle(PyExc_ValueError)),
                 "A value outside the contract: a bad config field, block id, layer, ...");
  exhausted = make("CacheExhausted", error,
                   "No free (or evictable) block left; preempt or evict and retry.");
  oom = make("OutOfMemory", py::make_tuple(error, py::handle(PyExc_MemoryError)),
             "The backend could not allocate the pools.");
  backend_error = make("BackendError", error, "A vendor runtime call failed.");
  device_lost = make("DeviceLost", backend_error,
                     "The device context is gone (sticky error): restart the process.");

  py::register_exception_translator([](std::exception_ptr p) {
    try {
      if (p) std::rethrow_exception(p);
    } catch (const kvport::DeviceLost& e) {
      PyErr_SetString(device_lost.ptr(), e.what());
    } catch (const kvport::BackendError& e) {
      PyErr_SetString(backend_error.ptr(), e.what());
    } catch (const kvport::OutOfMemory& e) {
      PyErr_SetString(oom.ptr(), e.what());
    } catch (const kvport::CacheExhausted& e) {
      PyErr_SetString(exhausted.ptr(), e.what());
    } catch (const kvport::InvalidArgument& e) {
      PyErr_SetString(invalid.ptr(), e.what());
    } catch (const kvport::Error& e) {
      PyErr_SetString(error.ptr(), e.what());
    }
  });
}

}  // namespace

namespace kvport::python {

py::object borrowed_cache(std::shared_ptr<const void> lender, Backend& backend, int device,
                          PagedKvCache& pool) {
  auto state = std::make_shared<CacheState>();
  state->lender = std::move(lender);
  state->backend = &backend;
  state->cache = &pool;
  state->device = device;
  return py::cast(PyCache(std::move(state)));
}

}  // namespace kvport::python

PYBIND11_MODULE(_kvport, m) {
  m.doc() = "kvport: a paged KV-cache runtime (docs/bindings/python.md)";
  register_exceptions(m);

  // ---- module functions ---------------------------------------------------------
  m.def(
      "dtypes",
      [] {
        std::vector<std::string> names;
        for (const KvCacheDtype d : kvport::all_dtypes())
          names.push_back(dtype_name(d));
        return names;
      },
      "Names of every KV cache dtype.");
  m.def(
      "compiled_backends",
      [] {
        py::list out;
        for (const auto& b : kvport::compiled_backends()) {
          py::dict d;
          d["name"] = b.name;
          d["is_gpu"] = b.is_gpu;
          d["available"] = b.available;
          d["unavailable_reason"] = b.unavailable_reason;
          out.append(d);
        }
        return out;
      },
      "Every backend compiled in (host first), probed: a list of dicts with name, is_gpu, "
      "available, unavailable_reason.");

  py::class_<kvport::BlockRegionLayout>(m, "BlockRegionLayout",
                                        "Byte layout of one block's K (or V) region of a layer.")
      .def_readonly("data_bytes", &kvport::BlockRegionLayout::data_bytes)
      .def_readonly("data_padding", &kvport::BlockRegionLayout::data_padding)
      .def_readonly("scale_offset", &kvport::BlockRegionLayout::scale_offset)
      .def_readonly("scale_bytes", &kvport::BlockRegionLayout::scale_bytes)
      .def_readonly("scale_padding", &kvport::BlockRegionLayout::scale_padding)
      .def_readonly("total_bytes", &kvport::BlockRegionLayout::total_bytes)
      .def("__eq__", [](const kvport::BlockRegionLayout& a,
                        const kvport::BlockRegionLayout& b) { return a == b; })
      .def("__repr__", [](const kvport::BlockRegionLayout& r) {
        std::ostringstream s;
        s << "BlockRegionLayout(data_bytes=" << r.data_bytes << ", data_padding=" << r.data_padding
          << ", scale_offset=" << r.scale_offset << ", scale_bytes=" << r.scale_bytes
          << ", scale_padding=" << r.scale_padding << ", total_bytes=" << r.total_bytes << ")";
        return s.str();
      });
  m.def(
      "block_region_layout",
      [](const py::object& dtype, std::size_t block_size, std::size_t num_kv_heads,
         std::size_t head_dim) {
        return kvport::block_region_layout(dtype_from(dtype), block_size, num_kv_heads, head_dim);
      },
      py::arg("dtype"), py::arg("block_size"), py::arg("num_kv_heads"), py::arg("head_dim"),
      "The layout of one K or V block region (docs/formats.md).");

  // ---- KvCacheConfig ------------------------------------------------------------
  py::class_<KvCacheConfig>(m, "KvCacheConfig",
                            "The shape of a paged KV cache. Fields are attributes; dtypes and "
                            "layout are strings (kvport.dtypes()).")
      .def(py::init([](std::size_t num_layers, std::size_t num_kv_heads,
                       std::optional<std::size_t> head_dim, std::size_t block_size,
                       const py::object& dtype, std::optional<std::size_t> head_dim_k,
                       std::optional<std::size_t> head_dim_v,
                       const std::optional<std::vector<py::object>>& layer_dtypes,
                       const std::string& layout) {
             KvCacheConfig c;
             c.num_layers = num_layers;
             c.num_kv_heads = num_kv_heads;
             c.block_size = block_size;
             c.head_dim_k = head_dim_k.value_or(head_dim.value_or(0));
             c.head_dim_v = head_dim_v.value_or(head_dim.value_or(c.head_dim_k));
             c.dtype = dtype_from(dtype);
             if (layer_dtypes)
               for (const auto& d : *layer_dtypes)
                 c.layer_dtypes.push_back(dtype_from(d));
             c.layout = layout_from(layout);
             c.validate();
             return c;
           }),
           py::arg("num_layers"), py::arg("num_kv_heads"), py::arg("head_dim") = py::none(),
           py::kw_only(), py::arg("block_size") = 16, py::arg("dtype") = "bf16",
           py::arg("head_dim_k") = py::none(), py::arg("head_dim_v") = py::none(),
           py::arg("layer_dtypes") = py::none(), py::arg("layout") = "layer_major",
           "head_dim sets head_dim_k and head_dim_v; either may be given instead. "
           "head_dim_v=0: K-only layers (MLA's latent), no V pools. Validated "
           "(kvport.InvalidArgument names the field).")
      .def_readwrite("num_layers", &KvCacheConfig::num_layers)
      .def_readwrite("block_size", &KvCacheConfig::block_size)
      .def_readwrite("num_kv_heads", &KvCacheConfig::num_kv_heads)
      .def_readwrite("head_dim_k", &KvCacheConfig::head_dim_k)
      .def_readwrite("head_dim_v", &KvCacheConfig::head_dim_v)
      .def_property(
          "dtype", [](const KvCacheConfig& c) { return dtype_name(c.dtype); },
          [](KvCacheConfig& c, const py::object& d) { c.dtype = dtype_from(d); })
      .def_property(
          "layer_dtypes",
          [](const KvCacheConfig& c) {
            std::vector<std::string> out;
            for (const KvCacheDtype d : c.layer_dtypes)
              out.push_back(dtype_name(d));
            return out;
          },
          [](KvCacheConfig& c, const std::vector<py::object>& ds) {
            std::vector<KvCacheDtype> out;
            for (const auto& d : ds)
              out.push_back(dtype_from(d));
            c.layer_dtypes = std::move(out);
          })
      .def_property(
          "layout", [](const KvCacheConfig& c) { return layout_name(c.layout); },
          [](KvCacheConfig& c, const std::string& l) { c.layout = layout_from(l); })
      .def_property_readonly("has_v", &KvCacheConfig::has_v,
                             "False for K-only layers (head_dim_v == 0: no V pools).")
      .def("validate", &KvCacheConfig::validate)
      .def("dtype_for_layer",
           [](const KvCacheConfig& c, std::size_t layer) {
             return dtype_name(c.dtype_for_layer(layer));
           })
      .def("k_layout", &KvCacheConfig::k_layout, py::arg("layer"))
      .def("v_layout", &KvCacheConfig::v_layout, py::arg("layer"))
      .def("k_block_bytes", &KvCacheConfig::k_block_bytes, py::arg("layer"))
      .def("v_block_bytes", &KvCacheConfig::v_block_bytes, py::arg("layer"))
      .def("bytes_per_block", &KvCacheConfig::bytes_per_block)
      .def("copy", [](const KvCacheConfig& c) { return c; })
      .def("__copy__", [](const KvCacheConfig& c) { return c; })
      .def("__deepcopy__", [](const KvCacheConfig& c, const py::object&) { return c; })
      .def("__eq__",
           [](const KvCacheConfig& a, const py::object& b) -> py::object {
             if (!py::isinstance<KvCacheConfig>(b))
               return py::reinterpret_borrow<py::object>(Py_NotImplemented);
             return py::bool_(config_equal(a, b.cast<const KvCacheConfig&>()));
           })
      .def_property_readonly_static("__hash__", [](const py::object&) { return py::none(); })
      .def("__repr__", &config_repr);

  // ---- counters and reports -----------------------------------------------------
  py::class_<kvport::KvCacheCounters>(m, "KvCacheCounters")
      .def_readonly("allocs", &kvport::KvCacheCounters::allocs)
      .def_readonly("frees", &kvport::KvCacheCounters::frees)
      .def_readonly("ignored_double_frees", &kvport::KvCacheCounters::ignored_double_frees)
      .def_readonly("exhaustion_events", &kvport::KvCacheCounters::exhaustion_events)
      .def_readonly("peak_blocks_in_use", &kvport::KvCacheCounters::peak_blocks_in_use)
      .def("__repr__", [](const kvport::KvCacheCounters& c) {
        std::ostringstream s;
        s << "KvCacheCounters(allocs=" << c.allocs << ", frees=" << c.frees
          << ", ignored_double_frees=" << c.ignored_double_frees
          << ", exhaustion_events=" << c.exhaustion_events
          << ", peak_blocks_in_use=" << c.peak_blocks_in_use << ")";
        return s.str();
      });
  py::class_<kvport::PrefixCacheCounters>(m, "PrefixCacheCounters")
      .def_readonly("lookups", &kvport::PrefixCacheCounters::lookups)
      .def_readonly("hits", &kvport::PrefixCacheCounters::hits)
      .def_readonly("misses", &kvport::PrefixCacheCounters::misses)
      .def_readonly("inserts", &kvport::PrefixCacheCounters::inserts)
      .def_readonly("evictions", &kvport::PrefixCacheCounters::evictions)
      .def_readonly("ignored_releases", &kvport::PrefixCacheCounters::ignored_releases)
      .def_property_readonly("hit_rate", &kvport::PrefixCacheCounters::hit_rate)
      .def("__repr__", [](const kvport::PrefixCacheCounters& c) {
        std::ostringstream s;
        s << "PrefixCacheCounters(lookups=" << c.lookups << ", hits=" << c.hits
          << ", misses=" << c.misses << ", inserts=" << c.inserts << ", evictions=" << c.evictions
          << ", ignored_releases=" << c.ignored_releases << ")";
        return s.str();
      });
  py::class_<kvport::InvariantReport>(m, "InvariantReport")
      .def_readonly("ok", &kvport::InvariantReport::ok)
      .def_readonly("blocks_checked", &kvport::InvariantReport::blocks_checked)
      .def_readonly("free_blocks", &kvport::InvariantReport::free_blocks)
      .def_readonly("blocks_in_use", &kvport::InvariantReport::blocks_in_use)
      .def_readonly("evictable_blocks", &kvport::InvariantReport::evictable_blocks)
      .def_readonly("cached_blocks", &kvport::InvariantReport::cached_blocks)
      .def_readonly("violations", &kvport::InvariantReport::violations)
      .def("__bool__", [](const kvport::InvariantReport& r) { return r.ok; })
      .def("__str__", &kvport::InvariantReport::to_string)
      .def("__repr__", [](const kvport::InvariantReport& r) {
        return "InvariantReport(" + r.to_string() + ")";
      });

  // ---- pool views -----------------------------------------------------------------
  kvport::python::register_pool_view(m);

  // ---- PagedKvCache ---------------------------------------------------------------
  py::class_<PyCache>(m, "PagedKvCache",
                      "Per-layer K/V block pools, refcounts and a LIFO free list. A context "
                      "manager: leaving the block closes it.")
      .def(py::init<const KvCacheConfig&, std::size_t, const std::string&, int,
                    std::optional<bool>>(),
           py::arg("config"), py::arg("num_blocks"), py::arg("backend") = "host", py::kw_only(),
           py::arg("device") = 0, py::arg("trace") = py::none())
      .def_static("compute_num_blocks", &kvport::PagedKvCache::compute_num_blocks,
                  py::arg("config"), py::arg("available_bytes"))
      .def("__enter__", [](const py::object& self) { return self; })
      .def("__exit__", [](PyCache& c, const py::args&) { c.close(); })
      .def("close", &PyCache::close,
           "Detaches this object; the pools are freed once no prefix cache, table or tensor "
           "view still uses them.")
      .def_property_readonly("closed", &PyCache::closed)
      .def("__repr__", &PyCache::repr)
      // allocation and refcounts
      .def("alloc_block",
           [](const PyCache& c) { return c.owned_cache("alloc_block").alloc_block(); })
      .def("try_alloc_block",
           [](const PyCache& c) -> std::optional<BlockId> {
             return c.owned_cache("try_alloc_block").try_alloc_block();
           })
      .def(
          "inc_ref",
          [](const PyCache& c, long long b) { c.owned_cache("inc_ref").inc_ref(block_id(b)); },
          py::arg("block"))
      .def(
          "dec_ref",
          [](const PyCache& c, long long b) {
            return c.owned_cache("dec_ref").dec_ref(block_id(b));
          },
          py::arg("block"))
      .def(
          "free_block",
          [](const PyCache& c, long long b) {
            return c.owned_cache("free_block").free_block(block_id(b));
          },
          py::arg("block"))
      .def(
          "free_blocks",
          [](const PyCache& c, const py::object& blocks) {
            const U32Batch batch = u32_batch(blocks, "block id");
            c.owned_cache("free_blocks").free_blocks(batch.ids);
          },
          py::arg("blocks"))
      .def(
          "ref_count",
          [](const PyCache& c, long long b) { return c.cache().ref_count(block_id(b)); },
          py::arg("block"))
      .def_property_readonly("num_free_blocks",
                             [](const PyCache& c) { return c.cache().num_free_blocks(); })
      .def_property_readonly("num_blocks", [](const PyCache& c) { return c.cache().num_blocks(); })
      .def_property_readonly("num_blocks_in_use",
                             [](const PyCache& c) { return c.cache().num_blocks_in_use(); })
      .def_property_readonly("num_layers", [](const PyCache& c) { return c.cache().num_layers(); })
      .def_property_readonly("total_bytes",
                             [](const PyCache& c) { return c.cache().total_bytes(); })
      .def_property_readonly("config", [](const PyCache& c) { return c.cache().config(); })
      .def_property_readonly("backend", [](const PyCache& c) { return c.state()->backend->name(); })
      .def_property_readonly("device", [](const PyCache& c) { return c.state()->device; })
      .def_property_readonly("counters", [](const PyCache& c) { return c.cache().counters(); })
      .def_property_readonly("last_fill_regions",
                             [](const PyCache& c) { return c.cache().last_fill_regions(); })
      // pointers and strides
      .def("dtype_for_layer",
           [](const PyCache& c, std::size_t l) { return dtype_name(c.cache().dtype_for_layer(l)); })
      .def("k_pool_ptr",
           [](const PyCache& c, std::size_t l) { return c.cache().k_pool_ptr(l).address(); })
      .def("v_pool_ptr",
           [](const PyCache& c, std::size_t l) { return c.cache().v_pool_ptr(l).address(); })
      .def("k_cache_ptr",
           [](const PyCache& c, std::size_t l, long long b) {
             return c.cache().k_cache_ptr(l, block_id(b)).address();
           })
      .def("v_cache_ptr",
           [](const PyCache& c, std::size_t l, long long b) {
             return c.cache().v_cache_ptr(l, block_id(b)).address();
           })
      .def("k_block_stride",
           [](const PyCache& c, std::size_t l) { return c.cache().k_block_stride(l); })
      .def("v_block_stride",
           [](const PyCache& c, std::size_t l) { return c.cache().v_block_stride(l); })
      .def("k_block_bytes",
           [](const PyCache& c, std::size_t l) { return c.cache().k_block_bytes(l); })
      .def("v_block_bytes",
           [](const PyCache& c, std::size_t l) { return c.cache().v_block_bytes(l); })
      .def(
          "k_pool",
          [](const PyCache& c, std::size_t l, bool raw) {
            return make_view(c.state(), true, l, raw);
          },
          py::arg("layer"), py::kw_only(), py::arg("raw") = false)
      .def(
          "v_pool",
          [](const PyCache& c, std::size_t l, bool raw) {
            return make_view(c.state(), false, l, raw);
          },
          py::arg("layer"), py::kw_only(), py::arg("raw") = false)
      .def(
          "block_pool", [](const PyCache& c) { return make_block_view(c.state()); },
          "Block-major layout only: [num_blocks, bytes_per_block] uint8, each row one block's "
          "K and V of every layer (layer 0 K, layer 0 V, layer 1 K, ...).")
      // device work: queued on the backend's default stream, then waited for
      .def(
          "zero_blocks",
          [](const PyCache& c, const py::object& blocks) {
            const U32Batch batch = u32_batch(blocks, "block id");
            c.cache().zero_blocks(batch.ids, c.stream());
            c.sync();
          },
          py::arg("blocks"))
      .def(
          "poison_blocks",
          [](const PyCache& c, const py::object& blocks) {
            const U32Batch batch = u32_batch(blocks, "block id");
            c.cache().poison_blocks(batch.ids, c.stream());
            c.sync();
          },
          py::arg("blocks"))
      .def(
          "copy_blocks",
          [](const PyCache& c, const py::object& pairs) {
            std::vector<kvport::BlockCopy> copies;
            if (py::isinstance<py::array>(pairs)) {
              auto arr = py::reinterpret_borrow<py::array>(pairs);
              if (arr.ndim() != 2 || arr.shape(1) != 2)
                throw kvport::InvalidArgument("copy_blocks: an array of pairs must be N x 2");
              const U32Batch flat = u32_batch(arr.attr("reshape")(-1), "block id");
              for (std::size_t i = 0; i + 1 < flat.ids.size(); i += 2)
                copies.push_back({flat.ids[i], flat.ids[i + 1]});
            } else {
              for (const py::handle pair : py::iter(pairs)) {
                const U32Batch two = u32_batch(pair, "block id");
                if (two.ids.size() != 2)
                  throw kvport::InvalidArgument("copy_blocks: each copy is a (src, dst) pair");
                copies.push_back({two.ids[0], two.ids[1]});
              }
            }
            c.cache().copy_blocks(copies, c.stream());
            c.sync();
          },
          py::arg("copies"), "copies: (src, dst) pairs, or an N x 2 integer array.")
      .def(
          "read_block",
          [](const PyCache& c, std::size_t layer, long long block) {
            auto host = c.cache().read_block(layer, block_id(block), c.stream());
            return py::make_tuple(bytes_array(std::move(host.k)), bytes_array(std::move(host.v)));
          },
          py::arg("layer"), py::arg("block"),
          "(k, v): copies of the block's K and V bytes of `layer`, as uint8 arrays (v empty "
          "for K-only layers).")
      .def(
          "write_block",
          [](const PyCache& c, std::size_t layer, long long block, const py::object& k,
             const py::object& v) {
            const py::array kb = contiguous_bytes(k);
            // None: no V bytes (K-only layers).
            const py::array vb = v.is_none() ? py::array_t<std::uint8_t>(0) : contiguous_bytes(v);
            c.cache().write_block(layer, block_id(block), byte_span(kb), byte_span(vb), c.stream());
          },
          py::arg("layer"), py::arg("block"), py::arg("k"), py::arg("v") = py::none(),
          "k, v: exactly k_block_bytes(layer) / v_block_bytes(layer) bytes (any buffer); v "
          "None (or empty) for K-only layers, whose v_block_bytes is 0.")
      .def("synchronize", [](const PyCache& c) { c.cache().synchronize(); })
      .def("check_invariants", [](const PyCache& c) { return c.cache().check_invariants(); });

  // ---- PrefixCache ----------------------------------------------------------------
  py::class_<kvport::PrefixMatch>(m, "PrefixMatch")
      .def_property_readonly("blocks",
                             [](const kvport::PrefixMatch& p) { return id_list(p.blocks); })
      .def_property_readonly("hashes",
                             [](const kvport::PrefixMatch& p) {
                               std::vector<std::string> out;
                               for (const auto& h : p.hashes)
                                 out.push_back(h.to_string());
                               return out;
                             })
      .def_readonly("num_tokens", &kvport::PrefixMatch::num_tokens)
      .def_readonly("lower_tier_blocks", &kvport::PrefixMatch::lower_tier_blocks)
      .def("__repr__", [](const kvport::PrefixMatch& p) {
        std::ostringstream s;
        s << "PrefixMatch(num_tokens=" << p.num_tokens << ", blocks=[";
        for (std::size_t i = 0; i < p.blocks.size(); ++i)
          s << (i != 0 ? ", " : "") << p.blocks[i];
        s << "])";
        return s.str();
      });

  py::class_<PyPrefixCache>(m, "PrefixCache",
                            "Automatic prefix caching with LRU eviction over a PagedKvCache. A "
                            "context manager.")
      .def(py::init<const PyCache&>(), py::arg("cache"))
      .def("__enter__", [](const py::object& self) { return self; })
      .def("__exit__", [](PyPrefixCache& p, const py::args&) { p.close(); })
      .def("close", &PyPrefixCache::close)
      .def_property_readonly("closed", &PyPrefixCache::closed)
      .def("__repr__", &PyPrefixCache::repr)
      .def(
          "lookup",
          [](const PyPrefixCache& p, const py::object& tokens, std::uint64_t extra_key) {
            const U32Batch t = u32_batch(tokens, "token id");
            return p.prefix().lookup(t.ids, extra_key);
          },
          py::arg("tokens"), py::arg("extra_key") = 0,
          "The longest cached prefix; the caller owns one reference on each block (release "
          "them with release_blocks).")
      .def("alloc_block", [](const PyPrefixCache& p) { return p.prefix().alloc_block(); })
      .def("try_alloc_block",
           [](const PyPrefixCache& p) -> std::optional<BlockId> {
             return p.prefix().try_alloc_block();
           })
      .def(
          "release", [](const PyPrefixCache& p, long long b) { p.prefix().release(block_id(b)); },
          py::arg("block"))
      .def(
          "release_blocks",
          [](const PyPrefixCache& p, const py::object& blocks) {
            const U32Batch batch = u32_batch(blocks, "block id");
            p.prefix().release_blocks(batch.ids);
          },
          py::arg("blocks"))
      .def(
          "evict", [](const PyPrefixCache& p, std::size_t n) { return p.prefix().evict(n); },
          py::arg("max_blocks"))
      .def("is_cached",
           [](const PyPrefixCache& p, long long b) { return p.prefix().is_cached(block_id(b)); })
      .def("is_evictable",
           [](const PyPrefixCache& p, long long b) { return p.prefix().is_evictable(block_id(b)); })
      .def("lru_order", [](const PyPrefixCache& p) { return id_list(p.prefix().lru_order()); })
      .def_property_readonly("num_cached_blocks",
                             [](const PyPrefixCache& p) { return p.prefix().num_cached_blocks(); })
      .def_property_readonly(
          "num_evictable_blocks",
          [](const PyPrefixCache& p) { return p.prefix().num_evictable_blocks(); })
      .def_property_readonly(
          "num_available_blocks",
          [](const PyPrefixCache& p) { return p.prefix().num_available_blocks(); })
      .def_property_readonly("block_size",
                             [](const PyPrefixCache& p) { return p.prefix().block_size(); })
      .def_property_readonly("counters",
                             [](const PyPrefixCache& p) { return p.prefix().counters(); })
      .def_property_readonly("kv_cache",
                             [](const PyPrefixCache& p) { return PyCache(p.state()->cache); })
      .def("check_invariants",
           [](const PyPrefixCache& p) { return p.prefix().check_invariants(); });

  // ---- BlockTable -----------------------------------------------------------------
  py::class_<PyBlockTable>(m, "BlockTable",
                           "One sequence's blocks, over a PagedKvCache or a PrefixCache; "
                           "fork() and copy-on-write. A context manager: leaving the block "
                           "releases every block.")
      .def(py::init<const py::object&, std::uint64_t>(), py::arg("owner"), py::arg("extra_key") = 0)
      .def("__enter__", [](const py::object& self) { return self; })
      .def("__exit__", [](PyBlockTable& t, const py::args&) { t.close(); })
      .def("close", &PyBlockTable::close, "Releases every block; the table is unusable after.")
      .def_property_readonly("closed", &PyBlockTable::closed)
      .def("__repr__", &PyBlockTable::repr)
      .def(
          "append_tokens",
          [](const PyBlockTable& t, const py::object& tokens) {
            const U32Batch batch = u32_batch(tokens, "token id");
            t.table().append_tokens(batch.ids, t.stream());
            t.sync();
          },
          py::arg("tokens"))
      .def(
          "reuse_cached_prefix",
          [](const PyBlockTable& t, const py::object& prompt) {
            const U32Batch batch = u32_batch(prompt, "token id");
            return t.table().reuse_cached_prefix(batch.ids);
          },
          py::arg("prompt"))
      .def(
          "blocks_needed",
          [](const PyBlockTable& t, std::size_t n) { return t.table().blocks_needed(n); },
          py::arg("num_tokens"))
      .def("fork", &PyBlockTable::fork)
      .def("release", [](const PyBlockTable& t) { t.table().release(); })
      .def_property_readonly("blocks",
                             [](const PyBlockTable& t) { return id_list(t.table().blocks()); })
      .def_property_readonly(
          "block_ids",
          [](const PyBlockTable& t) {
            const auto b = t.table().blocks();
            py::array_t<std::uint32_t> out(static_cast<py::ssize_t>(b.size()));
            std::copy(b.begin(), b.end(), out.mutable_data());
            return out;
          },
          "The block ids as a uint32 NumPy array (a copy).")
      .def_property_readonly("tokens",
                             [](const PyBlockTable& t) { return id_list(t.table().tokens()); })
      .def_property_readonly("num_blocks",
                             [](const PyBlockTable& t) { return t.table().num_blocks(); })
      .def_property_readonly("num_tokens",
                             [](const PyBlockTable& t) { return t.table().num_tokens(); })
      .def_property_readonly("empty", [](const PyBlockTable& t) { return t.table().empty(); })
      .def_property_readonly("last_block_fill",
                             [](const PyBlockTable& t) { return t.table().last_block_fill(); })
      .def_property_readonly("block_size",
                             [](const PyBlockTable& t) { return t.table().block_size(); })
      .def_property_readonly("copy_on_writes",
                             [](const PyBlockTable& t) { return t.table().copy_on_writes(); })
      .def_property(
          "prefix_hit_mode",
          [](const PyBlockTable& t) {
            return std::string(kvport::to_string(t.table().prefix_hit_mode()));
          },
          [](const PyBlockTable& t, const std::string& mode) {
            if (mode == "full")
              t.table().set_prefix_hit_mode(kvport::PrefixHitMode::full);
            else if (mode == "compute_last_token")
              t.table().set_prefix_hit_mode(kvport::PrefixHitMode::compute_last_token);
            else
              throw kvport::InvalidArgument("unknown prefix_hit_mode '" + mode +
                                            "' (known: compute_last_token, full)");
          });

  // ---- hybrid models (hybrid.cpp) -------------------------------------------------
  kvport::python::register_hybrid(m);
}
