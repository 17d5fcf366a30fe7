// SPDX-License-Identifier: Apache-2.0
// kvport's exception types in Python, and the one translator from C++ errors
// (kvport._kvport).
#include <pybind11/pybind11.h>

#include <exception>
#include <string>

#include "kvport/platform/error.hpp"
#include "parts.hpp"

namespace kvport::python {

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
  static py::handle error, invalid, out_of_range, exhausted, oom, backend_error, device_lost;
  error = make("Error", PyExc_RuntimeError, "Base of every kvport error (kvport::Error).");
  invalid = make("InvalidArgument", py::make_tuple(error, py::handle(PyExc_ValueError)),
                 "A value outside the contract: a bad config field, a null pointer, ...");
  out_of_range =
      make("OutOfRange", invalid,
           "An index past its range: a block id, a layer, a group (an InvalidArgument).");
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
    } catch (const kvport::OutOfRange& e) {  // before InvalidArgument, its base
      PyErr_SetString(out_of_range.ptr(), e.what());
    } catch (const kvport::InvalidArgument& e) {
      PyErr_SetString(invalid.ptr(), e.what());
    } catch (const kvport::Error& e) {
      PyErr_SetString(error.ptr(), e.what());
    }
  });
}

}  // namespace kvport::python
