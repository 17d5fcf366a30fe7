// SPDX-License-Identifier: Apache-2.0
// kvport.PrefixMatch, PrefixCache and BlockTable (kvport._kvport).
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
#include "events.hpp"
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

}  // namespace

void bind_prefix(py::module_& m) {
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

  py::class_<PyPrefixCache> prefix_cache(
      m, "PrefixCache",
      "Automatic prefix caching with LRU eviction over a PagedKvCache. A context manager.");
  prefix_cache.def(py::init<const PyCache&>(), py::arg("cache"))
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
          "release", [](const PyPrefixCache& p, IdArg b) { p.prefix().release(block_id(b)); },
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
           [](const PyPrefixCache& p, IdArg b) { return p.prefix().is_cached(block_id(b)); })
      .def("is_evictable",
           [](const PyPrefixCache& p, IdArg b) { return p.prefix().is_evictable(block_id(b)); })
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
      .def(
          "as_groups",
          [](const PyPrefixCache& p) {
            const std::shared_ptr<PrefixState>& ps = p.state();
            return PyHybridCache::lent(ps, ps->cache->backend, ps->cache->device,
                                       kvport::HybridKvCache::over(*ps->prefix));
          },
          "This prefix cache as the one-group HybridKvCache over it (a model of one "
          "full-attention group is the one-group case of groups; BlockTable is a "
          "HybridBlockTable over it): HybridBlockTables over it share this prefix cache's "
          "blocks and hits. Its events are this prefix cache's (enable_events refuses the "
          "view).")
      .def("check_invariants",
           [](const PyPrefixCache& p) { return p.prefix().check_invariants(); });
  // KV events: medium "GPU", no group.
  def_events<PyPrefixCache>(
      prefix_cache,
      [](const PyPrefixCache& self) {
        PrefixState& state = *self.state();
        kvport::PrefixCache& prefix = *state.prefix;
        return EventsTarget{
            &state.publisher,
            [&prefix](CacheEventSink* sink) { prefix.set_event_sink(sink, prefix.event_source()); },
            [&prefix](CacheEventSink& sink) { prefix.snapshot(sink); },
            [&prefix](CacheEventSink& sink) { sink.cleared(prefix.event_source()); }};
      },
      "PrefixCache");

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
            require_numpy("BlockTable.block_ids");
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
}

}  // namespace kvport::python
