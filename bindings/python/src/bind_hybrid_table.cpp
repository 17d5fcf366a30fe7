// SPDX-License-Identifier: Apache-2.0
// GroupNeed and HybridBlockTable (kvport._kvport).
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <cstdint>
#include <string>

#include "hybrid_state.hpp"
#include "parts.hpp"

namespace kvport::python {

void bind_hybrid_table(py::module_& m) {
  // ---- HybridBlockTable -----------------------------------------------------------------
  py::class_<HybridBlockTable::GroupNeed>(m, "GroupNeed", "One group's need for an append.")
      .def_readonly("fresh", &HybridBlockTable::GroupNeed::fresh)
      .def_readonly("released", &HybridBlockTable::GroupNeed::released)
      .def("__repr__", [](const HybridBlockTable::GroupNeed& n) {
        return "GroupNeed(fresh=" + std::to_string(n.fresh) +
               ", released=" + std::to_string(n.released) + ")";
      });

  py::class_<PyHybridTable>(m, "HybridBlockTable",
                            "One sequence over every group of a HybridKvCache. A context "
                            "manager: leaving the block releases every block and slot.")
      .def(py::init<const PyHybridCache&, std::uint64_t>(), py::arg("cache"),
           py::arg("extra_key") = 0)
      .def("__enter__", [](const py::object& self) { return self; })
      .def("__exit__", [](PyHybridTable& t, const py::args&) { t.close(); })
      .def("close", &PyHybridTable::close)
      .def_property_readonly("closed", &PyHybridTable::closed)
      .def("__repr__", &PyHybridTable::repr)
      .def(
          "reuse_cached_prefix",
          [](const PyHybridTable& t, const py::object& prompt) {
            const U32Batch batch = u32_batch(prompt, "token id");
            const std::size_t hit = t.table().reuse_cached_prefix(batch.ids, t.stream());
            t.sync();
            return hit;
          },
          py::arg("prompt"),
          "Starts the empty table from the longest cached prefix valid for every group; "
          "returns the tokens it covers.")
      .def(
          "append_tokens",
          [](const PyHybridTable& t, const py::object& tokens) {
            const U32Batch batch = u32_batch(tokens, "token id");
            t.table().append_tokens(batch.ids, t.stream());
            t.sync();
          },
          py::arg("tokens"), "All or nothing across groups (CacheExhausted names the group).")
      .def(
          "append_draft",
          [](const PyHybridTable& t, const py::object& tokens) {
            const U32Batch batch = u32_batch(tokens, "token id");
            t.table().append_draft(batch.ids, t.stream());
            t.sync();
          },
          py::arg("tokens"),
          "Speculative decoding: KV slots for draft tokens (and a state slot per draft in a "
          "state group), never hashed, registered or announced until committed; the freeing "
          "rules see the committed length only. All or nothing (CacheExhausted).")
      .def(
          "can_append_draft",
          [](const PyHybridTable& t, std::size_t n) { return t.table().can_append_draft(n); },
          py::arg("num_tokens"), "Whether append_draft(num_tokens tokens) would fit.")
      .def(
          "draft_state_slots",
          [](const PyHybridTable& t, IndexArg g) {
            return id_list(t.table().draft_state_slots(g));
          },
          py::arg("group"),
          "State group g's slots for the state after each draft token (the verifier writes "
          "them); [] for other groups.")
      .def(
          "commit", [](const PyHybridTable& t, std::size_t n) { t.table().commit(n); },
          py::arg("num_tokens"),
          "Commits the first num_tokens draft tokens (accepted): their full blocks are registered "
          "and announced; a state group's state after the last of them becomes the working "
          "state.")
      .def(
          "truncate", [](const PyHybridTable& t, std::size_t n) { t.table().truncate(n); },
          py::arg("num_tokens"),
          "Keeps the first num_tokens tokens (at least the committed ones): drops the draft "
          "tokens past it and frees the blocks only they used.")
      .def_property_readonly("num_committed",
                             [](const PyHybridTable& t) { return t.table().num_committed(); })
      .def_property_readonly("num_draft_tokens",
                             [](const PyHybridTable& t) { return t.table().num_draft_tokens(); })
      .def_property_readonly(
          "draft_tokens", [](const PyHybridTable& t) { return id_list(t.table().draft_tokens()); })
      .def(
          "check_invariants", [](const PyHybridTable& t) { return t.table().check_invariants(); },
          "No block holding a draft token (or not yet full of committed tokens) is cached; one "
          "entry per block of num_tokens in each attention group.")
      .def(
          "can_append",
          [](const PyHybridTable& t, std::size_t n) { return t.table().can_append(n); },
          py::arg("num_tokens"))
      .def(
          "blocks_needed",
          [](const PyHybridTable& t, std::size_t n) { return t.table().blocks_needed(n); },
          py::arg("num_tokens"), "One GroupNeed per group.")
      .def("fork", &PyHybridTable::fork,
           "A table sharing every live block; each working state is copied into a new slot.")
      .def("release", [](const PyHybridTable& t) { t.table().release(); })
      .def(
          "blocks", [](const PyHybridTable& t, IndexArg g) { return id_list(t.table().blocks(g)); },
          py::arg("group"), "Group g's block ids, NULL_BLOCK where released ([] for state).")
      .def(
          "block_ids",
          [](const PyHybridTable& t, IndexArg g) { return id_array(t.table().blocks(g)); },
          py::arg("group"), "blocks(g) as a uint32 NumPy array (a copy).")
      .def(
          "num_live_blocks",
          [](const PyHybridTable& t, IndexArg g) { return t.table().num_live_blocks(g); },
          py::arg("group"))
      .def(
          "state_slot", [](const PyHybridTable& t, IndexArg g) { return t.table().state_slot(g); },
          py::arg("group"), "Group g's working state slot, or None.")
      .def_property_readonly(
          "tokens", [](const PyHybridTable& t) { return id_list(t.table().tokens()); },
          "The committed tokens (draft_tokens follow them).")
      .def_property_readonly(
          "num_tokens", [](const PyHybridTable& t) { return t.table().num_tokens(); },
          "Every token the table holds KV slots for: committed and draft.")
      .def_property_readonly("empty", [](const PyHybridTable& t) { return t.table().empty(); })
      .def_property_readonly("copy_on_writes",
                             [](const PyHybridTable& t) { return t.table().copy_on_writes(); })
      .def_property(
          "keep_shared_windows",
          [](const PyHybridTable& t) { return t.table().keeps_shared_windows(); },
          [](const PyHybridTable& t, bool keep) { t.table().set_keep_shared_windows(keep); },
          "Keep the sliding-window blocks before the end of the cached prefix the lookup found "
          "while the sequence runs (off by default; HybridBlockTable::set_keep_shared_windows).")
      .def_property(
          "copy_last_block", [](const PyHybridTable& t) { return t.table().copies_last_block(); },
          [](const PyHybridTable& t, bool copy) { t.table().set_copy_last_block(copy); },
          "With compute_last_token: a block-aligned prompt whose blocks are all cached hits n - 1 "
          "tokens, every group's last block a private copy (BlockTable's rule); not with a state "
          "group, a lower tier under several groups, nor without a block for a copy (off by "
          "default; "
          "HybridBlockTable::set_copy_last_block).")
      .def(
          "keep_hit_point", [](const PyHybridTable& t) { t.table().keep_hit_point(); },
          "Keep the sliding-window blocks before the table's end (call after prefill: the next "
          "turn hits there) until release.")
      .def(
          "num_kept_blocks",
          [](const PyHybridTable& t, IndexArg g) { return t.table().num_kept_blocks(g); },
          py::arg("group"), "The extra references the kept windows hold in group g.")
      .def_property(
          "prefix_hit_mode",
          [](const PyHybridTable& t) {
            return std::string(to_string(t.table().prefix_hit_mode()));
          },
          [](const PyHybridTable& t, const std::string& mode) {
            if (mode == "full")
              t.table().set_prefix_hit_mode(PrefixHitMode::full);
            else if (mode == "compute_last_token")
              t.table().set_prefix_hit_mode(PrefixHitMode::compute_last_token);
            else
              throw InvalidArgument("unknown prefix_hit_mode '" + mode +
                                    "' (known: compute_last_token, full)");
          });
}

}  // namespace kvport::python
