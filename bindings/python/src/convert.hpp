// Conversions between Python values and kvport's C++ types that more than
// one source of the module uses: dtype and layout names, 32-bit ids (block
// and token batches, with NumPy arrays used in place), id lists.
#pragma once

#include <pybind11/pybind11.h>

#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "kvport/core/block_table.hpp"
#include "kvport/core/dtype.hpp"
#include "kvport/core/kv_cache_config.hpp"

namespace kvport::python {

namespace py = pybind11;

/// A dtype name (a str: kvport.dtypes()); InvalidArgument listing the known
/// ones otherwise.
KvCacheDtype dtype_from(const py::handle& obj);
std::string dtype_name(KvCacheDtype dtype);

/// "layer_major" or "block_major".
KvCacheLayout layout_from(const std::string& name);
std::string layout_name(KvCacheLayout layout);

/// InvalidArgument naming `what` outside [0, 2^32 - 1].
std::uint32_t to_u32(long long value, const char* what);

/// A Python int (not a bool) as a long long; InvalidArgument naming `what`.
long long int_from(const py::handle& obj, const char* what);

/// A batch of 32-bit ids (blocks or tokens): a C-contiguous uint32 NumPy
/// array is used in place (no copy); any other int array, list, tuple or
/// iterable is range-checked into `storage`.
struct U32Batch {
  py::object keep;  // the array viewed in place
  std::vector<std::uint32_t> storage;
  std::span<const std::uint32_t> ids;
};

U32Batch u32_batch(const py::handle& obj, const char* what);

BlockId block_id(long long value);

py::list id_list(std::span<const std::uint32_t> ids);

}  // namespace kvport::python
