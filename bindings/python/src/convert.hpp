// SPDX-License-Identifier: Apache-2.0
// Conversions between Python values and kvport's C++ types that more than
// one source of the module uses: dtype and layout names (and state tensors'), 32-bit ids (block
// and token batches, with NumPy arrays used in place), id lists.
#pragma once

#include <pybind11/pybind11.h>

#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "kvport/core/block_table.hpp"
#include "kvport/core/dtype.hpp"
#include "kvport/core/kv_cache_config.hpp"
#include "kvport/core/layer_spec.hpp"

namespace kvport::python {

namespace py = pybind11;

/// A dtype name (a str: kvport.dtypes()); InvalidArgument listing the known
/// ones otherwise.
KvCacheDtype dtype_from(const py::handle& obj);
std::string dtype_name(KvCacheDtype dtype);

/// A state tensor's dtype name (f32, f16, bf16); InvalidArgument otherwise.
StateDtype state_dtype_from(const std::string& name);
std::string state_dtype_name(StateDtype dtype);

/// "layer_major" or "block_major".
KvCacheLayout layout_from(const std::string& name);
std::string layout_name(KvCacheLayout layout);

/// InvalidArgument naming `what` outside [0, 2^32 - 1].
std::uint32_t to_u32(long long value, const char* what);

/// A Python int (or an object with __index__, e.g. a NumPy integer) as a long
/// long. A bool is not an id: TypeError naming `what`, as for any other
/// non-int; InvalidArgument when it does not fit.
long long int_from(const py::handle& obj, const char* what);

/// An id or index argument of a bound function (a block id, a layer, a
/// group): the one rule for ids, scalar or batch (int_from: an int, never a
/// bool). block_id() / index_from() range-check it.
struct IdArg {
  long long value = 0;
};

/// A layer or group index argument: as IdArg, and InvalidArgument when
/// negative; the callee range-checks the top.
struct IndexArg {
  std::size_t value = 0;
  operator std::size_t() const noexcept { return value; }  // NOLINT(google-explicit-constructor)
};

/// A batch of 32-bit ids (blocks or tokens): a C-contiguous uint32 NumPy
/// array is used in place (no copy); any other int array, list, tuple or
/// iterable is range-checked into `storage`.
struct U32Batch {
  py::object keep;  // the array viewed in place
  std::vector<std::uint32_t> storage;
  std::span<const std::uint32_t> ids;
};

U32Batch u32_batch(const py::handle& obj, const char* what);

/// IndexArg's check: InvalidArgument when negative.
std::size_t index_from(long long value);

BlockId block_id(long long value);

/// Whether NumPy is imported: an ndarray exists only then, so the batch
/// arguments test for one without importing NumPy, and plain sequences work
/// where NumPy is not installed.
bool numpy_imported();

/// For a function whose result is a NumPy array: ModuleNotFoundError naming
/// `what` where NumPy cannot be imported.
void require_numpy(const char* what);

/// A C-contiguous host buffer that write_block copies into a block (its
/// Py_buffer released on destruction).
class BlockBytes {
 public:
  /// `obj`'s bytes for `what` ("k" or "v") of a layer of `dtype`: a buffer (bytes, bytearray,
  /// memoryview, a NumPy array, array.array, ...) of bytes (format B, b or c) or of numbers whose
  /// item is one element of `dtype`, or a host tensor exposing __array__
  /// (through NumPy). TypeError for anything else (a str, a list, an object
  /// array, bools), InvalidArgument for a non-contiguous buffer. The size
  /// (exactly the block's bytes) is PagedKvCache::write_block's check.
  BlockBytes(const py::handle& obj, const char* what, KvCacheDtype dtype);
  ~BlockBytes();
  BlockBytes(const BlockBytes&) = delete;
  BlockBytes& operator=(const BlockBytes&) = delete;
  std::span<const std::uint8_t> span() const noexcept { return span_; }

 private:
  py::object keep_;
  Py_buffer view_{};
  bool held_ = false;
  std::span<const std::uint8_t> span_;
};

inline BlockId block_id(IdArg arg) {
  return block_id(arg.value);
}

py::list id_list(std::span<const std::uint32_t> ids);

}  // namespace kvport::python

namespace pybind11::detail {

// IdArg from Python: int_from (a TypeError for a bool or a non-int, which
// ends overload resolution with the clear message rather than pybind11's list).
template <>
struct type_caster<kvport::python::IdArg> {
  PYBIND11_TYPE_CASTER(kvport::python::IdArg, const_name("int"));
  bool load(handle src, bool /*convert*/) {
    value.value = kvport::python::int_from(src, "id");
    return true;
  }
  static handle cast(kvport::python::IdArg src, return_value_policy, handle) {
    return PyLong_FromLongLong(src.value);
  }
};

template <>
struct type_caster<kvport::python::IndexArg> {
  PYBIND11_TYPE_CASTER(kvport::python::IndexArg, const_name("int"));
  bool load(handle src, bool /*convert*/) {
    value.value = kvport::python::index_from(kvport::python::int_from(src, "index"));
    return true;
  }
  static handle cast(kvport::python::IndexArg src, return_value_policy, handle) {
    return PyLong_FromSize_t(src.value);
  }
};

}  // namespace pybind11::detail
