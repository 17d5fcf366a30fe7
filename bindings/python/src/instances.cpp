// SPDX-License-Identifier: Apache-2.0
// Instances of kvport's classes are made by calling the class, never by
// `Class.__new__(Class)` alone: pybind11 would hand such an object, whose C++
// value was never constructed, to the first method called on it (it allocates
// the value's memory lazily and leaves it uninitialised), which reads garbage
// or crashes. guard_construction() makes that a TypeError for every class of
// the module.
//
// How: the classes get a metaclass of their own (a subclass of pybind11's,
// same layout) whose call, i.e. `Class(...)`, marks the class being
// constructed on this thread; the classes' tp_new refuses any other caller.
// Objects the module returns from C++ are made by pybind11 directly, without
// tp_new, and are unaffected.
#include <pybind11/pybind11.h>

#include <string>
#include <unordered_map>

#include "parts.hpp"

namespace kvport::python {

namespace {

thread_local PyTypeObject* constructing = nullptr;
ternaryfunc base_call = nullptr;
// The tp_new each guarded class had (pybind11's), by class.
std::unordered_map<PyTypeObject*, newfunc>& original_new() {
  static auto* map = new std::unordered_map<PyTypeObject*, newfunc>();  // leaked: outlives atexit
  return *map;
}

PyObject* guarded_call(PyObject* type, PyObject* args, PyObject* kwargs) {
  PyTypeObject* const previous = constructing;
  constructing = reinterpret_cast<PyTypeObject*>(type);
  PyObject* result = base_call(type, args, kwargs);
  constructing = previous;
  return result;
}

PyObject* guarded_new(PyTypeObject* type, PyObject* args, PyObject* kwargs) {
  if (constructing != type) {
    // "kvport._kvport.X" is kvport.X to the user.
    std::string name = type->tp_name;
    if (name.rfind("kvport._kvport.", 0) == 0) name = "kvport." + name.substr(15);
    PyErr_Format(PyExc_TypeError,
                 "%s.__new__(%s) alone makes an object that is not initialised: create one by "
                 "calling %s(...)",
                 name.c_str(), name.c_str(), name.c_str());
    return nullptr;
  }
  constructing = nullptr;  // one tp_new per call: a nested __new__ in __init__ is refused too
  // A Python subclass inherits guarded_new: pybind11's tp_new of the nearest
  // guarded base.
  for (PyTypeObject* t = type; t != nullptr; t = t->tp_base) {
    const auto it = original_new().find(t);
    if (it != original_new().end()) return it->second(type, args, kwargs);
  }
  PyErr_SetString(PyExc_SystemError, "kvport: no tp_new for a guarded class");
  return nullptr;
}

// Each class's own `__new__` (Python would otherwise find pybind11's base
// __new__, which skips guarded_new): `Class.__new__(subtype, ...)`.
PyObject* new_method(PyObject* /*self*/, PyObject* args, PyObject* kwargs) {
  if (PyTuple_GET_SIZE(args) < 1 || !PyType_Check(PyTuple_GET_ITEM(args, 0))) {
    PyErr_SetString(PyExc_TypeError, "__new__(cls, ...): cls must be a type");
    return nullptr;
  }
  auto* const subtype = reinterpret_cast<PyTypeObject*>(PyTuple_GET_ITEM(args, 0));
  const py::object rest =
      py::reinterpret_steal<py::object>(PyTuple_GetSlice(args, 1, PyTuple_GET_SIZE(args)));
  if (!rest) return nullptr;
  return guarded_new(subtype, rest.ptr(), kwargs);
}

PyMethodDef new_def = {"__new__",
                       reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(new_method)),
                       METH_VARARGS | METH_KEYWORDS,
                       "Refused unless called by Class(...): see the class's constructor."};

}  // namespace

void guard_construction(py::module_& m) {
  auto* const pybind_meta =
      reinterpret_cast<PyObject*>(py::detail::get_internals().default_metaclass);
  const py::object meta =
      py::reinterpret_borrow<py::object>(reinterpret_cast<PyObject*>(&PyType_Type))(
          "kvport_type", py::make_tuple(py::handle(pybind_meta)),
          py::dict(py::arg("__module__") = "kvport"));
  auto* const meta_type = reinterpret_cast<PyTypeObject*>(meta.ptr());
  base_call = meta_type->tp_call;
  meta_type->tp_call = guarded_call;
  for (const auto item : m.attr("__dict__").cast<py::dict>()) {
    const py::handle cls = item.second;
    if (!PyType_Check(cls.ptr()) ||
        Py_TYPE(cls.ptr()) != reinterpret_cast<PyTypeObject*>(pybind_meta))
      continue;
    auto* const type = reinterpret_cast<PyTypeObject*>(cls.ptr());
    original_new().emplace(type, type->tp_new);
    type->tp_new = guarded_new;
    // Into the class's dict directly (setattr would replace tp_new by a slot
    // that calls __new__), then the type caches are told.
    const py::object fn =
        py::reinterpret_steal<py::object>(PyCFunction_NewEx(&new_def, cls.ptr(), nullptr));
    if (!fn || PyDict_SetItemString(type->tp_dict, "__new__", fn.ptr()) != 0)
      throw py::error_already_set();
    PyType_Modified(type);
    // Python's own __class__ assignment: checks the layouts match and keeps the
    // references right.
    cls.attr("__class__") = meta;
  }
  m.attr("_kvport_type") = meta;
}

}  // namespace kvport::python
