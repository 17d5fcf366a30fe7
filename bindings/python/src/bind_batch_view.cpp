// SPDX-License-Identifier: Apache-2.0
// Batch metadata for attention kernels (kvport._kvport): vLLM's rows and slot
// mapping, FlashInfer's pages, as NumPy arrays (batch_view.hpp).
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "hybrid_state.hpp"
#include "kvport/core/batch_view.hpp"
#include "parts.hpp"

namespace kvport::python {

namespace {

// The batch: one table and one new-token count per sequence.
std::vector<BatchSequence> batch_of(const std::vector<const PyHybridTable*>& tables,
                                    const std::vector<std::size_t>& new_tokens) {
  if (tables.size() != new_tokens.size()) {
    throw InvalidArgument("batch metadata: " + std::to_string(tables.size()) + " tables but " +
                          std::to_string(new_tokens.size()) + " new-token counts");
  }
  std::vector<BatchSequence> batch;
  batch.reserve(tables.size());
  for (std::size_t i = 0; i < tables.size(); ++i) {
    if (tables[i] == nullptr) throw InvalidArgument("batch metadata: a table is None");
    batch.push_back(BatchSequence{&tables[i]->table(), new_tokens[i]});
  }
  return batch;
}

// The int32 [num_rows, row_width] array a row builder (block-table rows or
// token locations) writes.
py::array_t<std::int32_t> rows_of(BatchRowBuilder build,
                                  const std::vector<const PyHybridTable*>& tables,
                                  const std::vector<std::size_t>& new_tokens, std::size_t group,
                                  std::size_t row_width, std::optional<std::size_t> num_rows,
                                  std::size_t kernel_block_size, std::int32_t null_block) {
  const std::vector<BatchSequence> batch = batch_of(tables, new_tokens);
  const std::size_t rows = num_rows.value_or(batch.size());
  py::array_t<std::int32_t> out(
      {static_cast<py::ssize_t>(rows), static_cast<py::ssize_t>(row_width)});
  build(batch, group, KernelBlocks{kernel_block_size, null_block}, row_width,
        {out.mutable_data(), rows * row_width});
  return out;
}

template <class T>
py::array_t<T> int_array(const std::vector<T>& v) {
  py::array_t<T> out(static_cast<py::ssize_t>(v.size()));
  std::copy(v.begin(), v.end(), out.mutable_data());
  return out;
}

}  // namespace

void bind_batch_view(py::module_& m) {
  m.def("vllm_row_width", &vllm_row_width, py::arg("max_model_len"), py::arg("kernel_block_size"),
        "cdiv(max_model_len, kernel_block_size) rounded up to a multiple of 128 // "
        "kernel_block_size (vLLM v1's block-table row width).");
  m.def(
      "build_block_table_rows",
      [](const std::vector<const PyHybridTable*>& tables,
         const std::vector<std::size_t>& new_tokens, std::size_t group, std::size_t row_width,
         std::optional<std::size_t> num_rows, std::size_t kernel_block_size,
         std::int32_t null_block) {
        return rows_of(&build_block_table_rows, tables, new_tokens, group, row_width, num_rows,
                       kernel_block_size, null_block);
      },
      py::arg("tables"), py::arg("num_new_tokens"), py::arg("group"), py::kw_only(),
      py::arg("row_width"), py::arg("num_rows") = py::none(), py::arg("kernel_block_size") = 0,
      py::arg("null_block") = 0,
      "Group g's block-table rows (int32 [num_rows, row_width], vLLM v1): each sequence's kernel "
      "block ids left-aligned, null_block for released entries, padding and rows past the batch.");
  m.def(
      "build_token_locations",
      [](const std::vector<const PyHybridTable*>& tables,
         const std::vector<std::size_t>& new_tokens, std::size_t group, std::size_t row_width,
         std::optional<std::size_t> num_rows, std::size_t kernel_block_size,
         std::int32_t null_block) {
        return rows_of(&build_token_locations, tables, new_tokens, group, row_width, num_rows,
                       kernel_block_size, null_block);
      },
      py::arg("tables"), py::arg("num_new_tokens"), py::arg("group"), py::kw_only(),
      py::arg("row_width"), py::arg("num_rows") = py::none(), py::arg("kernel_block_size") = 0,
      py::arg("null_block") = 0,
      "SGLang's req_to_token (int32 [num_rows, row_width]): every position's KV slot, null_block "
      "for released positions, past each sequence and in rows past the batch.");
  m.def(
      "build_slot_mapping",
      [](const std::vector<const PyHybridTable*>& tables,
         const std::vector<std::size_t>& new_tokens, std::size_t group,
         std::optional<std::size_t> num_slots, std::size_t kernel_block_size) {
        const std::vector<BatchSequence> batch = batch_of(tables, new_tokens);
        std::size_t total = 0;
        for (std::size_t n : new_tokens)
          total += n;
        const std::size_t size = num_slots.value_or(total);
        py::array_t<std::int64_t> out(static_cast<py::ssize_t>(size));
        (void)build_slot_mapping(batch, group, KernelBlocks{kernel_block_size, 0},
                                 {out.mutable_data(), size});
        return out;
      },
      py::arg("tables"), py::arg("num_new_tokens"), py::arg("group"), py::kw_only(),
      py::arg("num_slots") = py::none(), py::arg("kernel_block_size") = 0,
      "Each new token's slot (int64: kernel block * kernel_block_size + offset), -1 padding up "
      "to num_slots.");
  m.def(
      "build_flashinfer_pages",
      [](const std::vector<const PyHybridTable*>& tables,
         const std::vector<std::size_t>& new_tokens, std::size_t group,
         std::size_t kernel_block_size, std::int32_t null_block) {
        const FlashInferPages p = build_flashinfer_pages(
            batch_of(tables, new_tokens), group, KernelBlocks{kernel_block_size, null_block});
        py::dict out;
        out["indptr"] = int_array(p.indptr);
        out["indices"] = int_array(p.indices);
        out["last_page_len"] = int_array(p.last_page_len);
        out["kv_len"] = int_array(p.kv_len);
        out["page_size"] = p.page_size;
        return out;
      },
      py::arg("tables"), py::arg("num_new_tokens"), py::arg("group"), py::kw_only(),
      py::arg("kernel_block_size") = 0, py::arg("null_block") = 0,
      "FlashInfer's paged KV (int32 indptr [B+1], indices, last_page_len [B] in [1, page_size], "
      "kv_len [B]) and page_size.");
}

}  // namespace kvport::python
