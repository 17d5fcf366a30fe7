// SPDX-License-Identifier: Apache-2.0
#include "convert.hpp"

#include <pybind11/numpy.h>

#include <limits>
#include <string_view>

#include "kvport/platform/error.hpp"

namespace kvport::python {

KvCacheDtype dtype_from(const py::handle& obj) {
  if (!py::isinstance<py::str>(obj)) {
    throw kvport::InvalidArgument("dtype must be a name (a str, e.g. \"bf16\"), not " +
                                  std::string(py::str(py::type::handle_of(obj).attr("__name__"))));
  }
  const auto name = py::cast<std::string>(obj);
  const auto dtype = kvport::parse_dtype(name);
  if (!dtype) {
    std::string known;
    for (const KvCacheDtype d : kvport::all_dtypes()) {
      if (!known.empty()) known += ", ";
      known += kvport::to_string(d);
    }
    throw kvport::InvalidArgument("unknown KV cache dtype '" + name + "' (known: " + known + ")");
  }
  return *dtype;
}

std::string dtype_name(KvCacheDtype dtype) {
  return std::string(kvport::to_string(dtype));
}

StateDtype state_dtype_from(const std::string& name) {
  const std::optional<StateDtype> d = parse_state_dtype(name);
  if (!d)
    throw kvport::InvalidArgument("unknown state dtype '" + name + "' (known: f32, f16, bf16)");
  return *d;
}

std::string state_dtype_name(StateDtype dtype) {
  return std::string(to_string(dtype));
}

KvCacheLayout layout_from(const std::string& name) {
  if (name == "layer_major") return KvCacheLayout::layer_major;
  if (name == "block_major") return KvCacheLayout::block_major;
  throw kvport::InvalidArgument("unknown KV cache layout '" + name +
                                "' (known: layer_major, block_major)");
}

std::string layout_name(KvCacheLayout layout) {
  return std::string(kvport::to_string(layout));
}

std::uint32_t to_u32(long long value, const char* what) {
  if (value < 0 || value > static_cast<long long>(std::numeric_limits<std::uint32_t>::max()))
    throw kvport::InvalidArgument(std::string(what) + " " + std::to_string(value) +
                                  " is outside [0, 2^32 - 1]");
  return static_cast<std::uint32_t>(value);
}

long long int_from(const py::handle& obj, const char* what) {
  if (!PyIndex_Check(obj.ptr()) || PyBool_Check(obj.ptr()))
    throw py::type_error(std::string(what) + " must be an int, not " +
                         std::string(py::str(obj.get_type().attr("__name__"))));
  int overflow = 0;
  const py::object index = py::reinterpret_steal<py::object>(PyNumber_Index(obj.ptr()));
  if (!index) throw py::error_already_set();
  const long long value = PyLong_AsLongLongAndOverflow(index.ptr(), &overflow);
  if (overflow != 0)
    throw kvport::InvalidArgument(std::string(what) + " " + std::string(py::str(obj)) +
                                  " is outside [0, 2^32 - 1]");
  if (value == -1 && PyErr_Occurred()) throw py::error_already_set();
  return value;
}

U32Batch u32_batch(const py::handle& obj, const char* what) {
  U32Batch batch;
  if (numpy_imported() && py::isinstance<py::array>(obj)) {
    auto arr = py::reinterpret_borrow<py::array>(obj);
    if (arr.ndim() > 1)
      throw kvport::InvalidArgument(std::string(what) + " must be 1-dimensional, not " +
                                    std::to_string(arr.ndim()) + "-dimensional");
    const char kind = arr.dtype().kind();
    if (arr.size() != 0 && kind != 'i' && kind != 'u')
      throw py::type_error(std::string(what) + " must hold integers, not dtype " +
                           std::string(py::str(arr.dtype())));
    if (arr.dtype().is(py::dtype::of<std::uint32_t>()) && (arr.flags() & py::array::c_style) != 0 &&
        reinterpret_cast<std::uintptr_t>(arr.data()) % alignof(std::uint32_t) == 0) {
      batch.keep = arr;
      batch.ids = {static_cast<const std::uint32_t*>(arr.data()),
                   static_cast<std::size_t>(arr.size())};
      return batch;
    }
    batch.storage.reserve(static_cast<std::size_t>(arr.size()));
    if (kind == 'u') {
      const auto wide =
          py::array_t<unsigned long long, py::array::c_style | py::array::forcecast>::ensure(arr);
      if (!wide) throw py::error_already_set();
      const unsigned long long* data = wide.data();
      for (py::ssize_t i = 0; i < wide.size(); ++i) {
        if (data[i] > std::numeric_limits<std::uint32_t>::max())
          throw kvport::InvalidArgument(std::string(what) + " " + std::to_string(data[i]) +
                                        " is outside [0, 2^32 - 1]");
        batch.storage.push_back(static_cast<std::uint32_t>(data[i]));
      }
    } else {
      const auto wide =
          py::array_t<long long, py::array::c_style | py::array::forcecast>::ensure(arr);
      if (!wide) throw py::error_already_set();
      const long long* data = wide.data();
      for (py::ssize_t i = 0; i < wide.size(); ++i)
        batch.storage.push_back(to_u32(data[i], what));
    }
  } else if (PyIndex_Check(obj.ptr())) {
    batch.storage.push_back(to_u32(int_from(obj, what), what));
  } else {
    if (py::isinstance<py::str>(obj) || py::isinstance<py::bytes>(obj) ||
        py::isinstance<py::bytearray>(obj) || !py::hasattr(obj, "__iter__")) {
      throw py::type_error(std::string(what) + " must be an int or an iterable of ints, not " +
                           std::string(py::str(py::type::handle_of(obj).attr("__name__"))));
    }
    for (const py::handle item : py::iter(obj))
      batch.storage.push_back(to_u32(int_from(item, what), what));
  }
  batch.ids = batch.storage;
  return batch;
}

std::size_t index_from(long long value) {
  if (value < 0) throw kvport::InvalidArgument("index " + std::to_string(value) + " is negative");
  return static_cast<std::size_t>(value);
}

bool numpy_imported() {
  PyObject* numpy = PyImport_GetModule(py::str("numpy").ptr());
  if (numpy == nullptr) {
    PyErr_Clear();
    return false;
  }
  const bool imported = numpy != Py_None;
  Py_DECREF(numpy);
  return imported;
}

void require_numpy(const char* what) {
  try {
    py::module_::import("numpy");
  } catch (py::error_already_set&) {
    PyErr_SetString(
        PyExc_ModuleNotFoundError,
        (std::string(what) + " returns a NumPy array and needs NumPy, which cannot be imported "
                             "(install python3-numpy or numpy)")
            .c_str());
    throw py::error_already_set();
  }
}

namespace {

std::string type_name(const py::handle& obj) {
  return py::str(py::type::handle_of(obj).attr("__name__"));
}

// A struct-module format of one number: an optional byte-order prefix, then
// one of the integer or float codes (no bool '?', object 'O', str 'w' or
// pointer 'P').
bool numeric_format(const char* format, bool* is_byte) {
  if (format == nullptr) format = "B";
  if (*format == '@' || *format == '=' || *format == '<' || *format == '>' || *format == '!')
    ++format;
  if (format[0] == '\0' || format[1] != '\0') return false;
  *is_byte = format[0] == 'B' || format[0] == 'b' || format[0] == 'c';
  return std::string_view("bBchHiIlLqQnNefd").find(format[0]) != std::string_view::npos;
}

}  // namespace

BlockBytes::BlockBytes(const py::handle& obj, const char* what, KvCacheDtype dtype) {
  const std::string name = std::string("write_block: ") + what;
  py::handle source = obj;
  if (!PyObject_CheckBuffer(obj.ptr())) {
    // A host tensor (torch's CPU tensors have no buffer, but __array__).
    if (!py::isinstance<py::str>(obj) && py::hasattr(obj, "__array__") && numpy_imported()) {
      keep_ = py::module_::import("numpy").attr("asarray")(obj);
      source = keep_;
    }
    if (!PyObject_CheckBuffer(source.ptr()))
      throw py::type_error(name +
                           " must be a buffer of the block's bytes (bytes, bytearray, "
                           "memoryview, a NumPy array or a host tensor), not " +
                           type_name(obj));
  }
  if (PyObject_GetBuffer(source.ptr(), &view_, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT) != 0) {
    PyErr_Clear();
    throw kvport::InvalidArgument(name + " must be a C-contiguous buffer (" + type_name(obj) +
                                  " is not)");
  }
  held_ = true;
  bool is_byte = false;
  if (!numeric_format(view_.format, &is_byte))
    throw py::type_error(name + " must hold bytes or numbers, not items of format '" +
                         std::string(view_.format != nullptr ? view_.format : "") + "' (" +
                         type_name(obj) + ")");
  const unsigned bits = kvport::bits_per_element(dtype);
  if (!is_byte && (kvport::has_scales(dtype) || static_cast<unsigned>(view_.itemsize) * 8 != bits))
    throw py::type_error(name + ": items of " + std::to_string(view_.itemsize) +
                         " bytes (format '" + std::string(view_.format) +
                         "') are not elements of " + std::string(kvport::to_string(dtype)) +
                         "; pass the block's bytes (e.g. array.view(numpy.uint8))");
  span_ = {static_cast<const std::uint8_t*>(view_.buf), static_cast<std::size_t>(view_.len)};
}

BlockBytes::~BlockBytes() {
  if (held_) PyBuffer_Release(&view_);
}

BlockId block_id(long long value) {
  return to_u32(value, "block id");
}

py::list id_list(std::span<const std::uint32_t> ids) {
  py::list out(ids.size());
  for (std::size_t i = 0; i < ids.size(); ++i)
    out[i] = py::int_(ids[i]);
  return out;
}

}  // namespace kvport::python
