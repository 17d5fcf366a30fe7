// SPDX-License-Identifier: Apache-2.0
// The module functions (dtypes, backends, region layouts), KvCacheConfig and
// the counters and reports (kvport._kvport).
#include <dlpack/dlpack.h>
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <cstdint>
#include <cstdlib>
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
#include "kvport/platform/log.hpp"
#include "kvport/platform/registry.hpp"
#include "parts.hpp"
#include "pool_view.hpp"
#include "state.hpp"

namespace kvport::python {

namespace {

using kvport::BlockId;
using kvport::KvCacheConfig;
using kvport::KvCacheDtype;
using kvport::KvCacheLayout;

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

const char* level_name(kvport::log::Level level) {
  switch (level) {
    case kvport::log::Level::trace:
      return "trace";
    case kvport::log::Level::debug:
      return "debug";
    case kvport::log::Level::info:
      return "info";
    case kvport::log::Level::warn:
      return "warn";
    case kvport::log::Level::error:
      return "error";
    case kvport::log::Level::critical:
      return "critical";
    case kvport::log::Level::off:
      return "off";
  }
  return "off";
}

}  // namespace

void bind_config(py::module_& m) {
  // ---- logging --------------------------------------------------------------------
  // A library is quiet unless asked: kvport's info lines (one per cache
  // created) are off in Python unless KVPORT_LOG_LEVEL or set_log_level asks.
  if (const char* env = std::getenv("KVPORT_LOG_LEVEL"); env == nullptr || *env == '\0')
    kvport::log::set_level(kvport::log::Level::warn);
  m.def(
      "set_log_level",
      [](const std::string& level) { kvport::log::set_level(kvport::log::parse_level(level)); },
      py::arg("level"),
      "Sets the level of kvport's log (to stderr): trace, debug, info, warn, error, critical "
      "or off. Python's default is warn (KVPORT_LOG_LEVEL, when set, decides at import).");
  m.def(
      "log_level", [] { return std::string(level_name(kvport::log::level())); },
      "The level of kvport's log (set_log_level).");
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
      .def("dtype_for_layer", [](const KvCacheConfig& c,
                                 IndexArg layer) { return dtype_name(c.dtype_for_layer(layer)); })
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
}

}  // namespace kvport::python
