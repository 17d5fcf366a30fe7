// SPDX-License-Identifier: Apache-2.0
// kvport.PagedKvCache (kvport._kvport), and the borrowed caches of a hybrid
// cache's group pools.
#include <dlpack/dlpack.h>
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <cstdint>
#include <optional>
#include <span>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

#include "convert.hpp"
#include "hybrid_state.hpp"
#include "kvport/core/block_table.hpp"
#include "kvport/core/dtype.hpp"
#include "kvport/core/kv_cache_config.hpp"
#include "kvport/core/paged_kv_cache.hpp"
#include "kvport/core/prefix_cache.hpp"
#include "kvport/platform/error.hpp"
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

py::array_t<std::uint8_t> bytes_array(std::vector<std::uint8_t>&& bytes) {
  auto* owned = new std::vector<std::uint8_t>(std::move(bytes));
  py::capsule free_when_done(owned,
                             [](void* p) { delete static_cast<std::vector<std::uint8_t>*>(p); });
  return py::array_t<std::uint8_t>({static_cast<py::ssize_t>(owned->size())}, owned->data(),
                                   free_when_done);
}

}  // namespace

void bind_cache(py::module_& m) {
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
          [](const PyCache& c, IdArg b) { c.owned_cache("inc_ref").inc_ref(block_id(b)); },
          py::arg("block"))
      .def(
          "dec_ref",
          [](const PyCache& c, IdArg b) { return c.owned_cache("dec_ref").dec_ref(block_id(b)); },
          py::arg("block"))
      .def(
          "free_block",
          [](const PyCache& c, IdArg b) {
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
          "ref_count", [](const PyCache& c, IdArg b) { return c.cache().ref_count(block_id(b)); },
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
           [](const PyCache& c, IndexArg l) { return dtype_name(c.cache().dtype_for_layer(l)); })
      .def("k_pool_ptr",
           [](const PyCache& c, IndexArg l) { return c.cache().k_pool_ptr(l).address(); })
      .def("v_pool_ptr",
           [](const PyCache& c, IndexArg l) { return c.cache().v_pool_ptr(l).address(); })
      .def("k_cache_ptr", [](const PyCache& c, IndexArg l,
                             IdArg b) { return c.cache().k_cache_ptr(l, block_id(b)).address(); })
      .def("v_cache_ptr", [](const PyCache& c, IndexArg l,
                             IdArg b) { return c.cache().v_cache_ptr(l, block_id(b)).address(); })
      .def("k_block_stride",
           [](const PyCache& c, IndexArg l) { return c.cache().k_block_stride(l); })
      .def("v_block_stride",
           [](const PyCache& c, IndexArg l) { return c.cache().v_block_stride(l); })
      .def("k_block_bytes", [](const PyCache& c, IndexArg l) { return c.cache().k_block_bytes(l); })
      .def("v_block_bytes", [](const PyCache& c, IndexArg l) { return c.cache().v_block_bytes(l); })
      .def(
          "k_pool",
          [](const PyCache& c, IndexArg l, bool raw) { return make_view(c.state(), true, l, raw); },
          py::arg("layer"), py::kw_only(), py::arg("raw") = false)
      .def(
          "v_pool",
          [](const PyCache& c, IndexArg l, bool raw) {
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
            if (numpy_imported() && py::isinstance<py::array>(pairs)) {
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
          [](const PyCache& c, IndexArg layer, IdArg block) {
            require_numpy("read_block");
            auto host = c.cache().read_block(layer, block_id(block), c.stream());
            return py::make_tuple(bytes_array(std::move(host.k)), bytes_array(std::move(host.v)));
          },
          py::arg("layer"), py::arg("block"),
          "(k, v): copies of the block's K and V bytes of `layer`, as uint8 arrays (v empty "
          "for K-only layers).")
      .def(
          "write_block",
          [](const PyCache& c, IndexArg layer, IdArg block, const py::object& k,
             const py::object& v) {
            const KvCacheDtype dtype = c.cache().dtype_for_layer(layer);
            const BlockBytes kb(k, "k", dtype);
            // None: no V bytes (K-only layers).
            const std::optional<BlockBytes> vb =
                v.is_none() ? std::nullopt : std::make_optional<BlockBytes>(v, "v", dtype);
            c.cache().write_block(layer, block_id(block), kb.span(),
                                  vb ? vb->span() : std::span<const std::uint8_t>(), c.stream());
          },
          py::arg("layer"), py::arg("block"), py::arg("k"), py::arg("v") = py::none(),
          "k, v: exactly k_block_bytes(layer) / v_block_bytes(layer) bytes: a C-contiguous "
          "buffer of bytes (bytes, bytearray, memoryview, a uint8 array) or of elements of the "
          "layer's dtype (a float16 array for f16); v None (or empty) for K-only layers, whose "
          "v_block_bytes is 0. Anything else (a str, a list, an object array) is a TypeError.")
      .def("synchronize", [](const PyCache& c) { c.cache().synchronize(); })
      .def("check_invariants", [](const PyCache& c) { return c.cache().check_invariants(); })
      .def(
          "as_groups",
          [](const PyCache& c) {
            const std::shared_ptr<CacheState>& cs = c.state();
            if (cs->borrowed())
              throw InvalidArgument(
                  "PagedKvCache.as_groups: this cache is a hybrid cache's group pool; its groups "
                  "are the hybrid cache's");
            return PyHybridCache::lent(cs, cs->backend, cs->device,
                                       kvport::HybridKvCache::over(*cs->cache));
          },
          "This cache as the one-group HybridKvCache over it, without a prefix cache: "
          "HybridBlockTables over it allocate and free its blocks and cache nothing.");
}

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
