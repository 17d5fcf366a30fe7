// SPDX-License-Identifier: Apache-2.0
// The seams an engine plugs into, in Python: a PagedKvCache over the
// engine's tensors (PagedKvCache.adopt, through DLPack or the array
// interfaces) and device work on the engine's stream (use_stream, with
// torch.cuda.Stream, CuPy streams or an int handle).
#include <dlpack/dlpack.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <cstdint>
#include <memory>
#include <optional>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

#include "convert.hpp"
#include "kvport/core/paged_kv_cache.hpp"
#include "kvport/platform/error.hpp"
#include "kvport/platform/registry.hpp"
#include "parts.hpp"
#include "pool_view.hpp"
#include "state.hpp"

namespace kvport::python {

namespace {

// The engine's tensors, held as long as the cache's state. The state may be
// released from a DLPack deleter on a thread without the GIL: take it.
struct HeldObjects {
  std::vector<py::object> objects;
  ~HeldObjects() {
    if (Py_IsInitialized() == 0) {
      for (py::object& o : objects)
        o.release();  // the interpreter is gone: nothing to decref into
      return;
    }
    py::gil_scoped_acquire gil;
    objects.clear();
  }
};

// What a tensor or array says about its memory.
struct Described {
  std::uintptr_t data = 0;
  std::vector<std::int64_t> shape;
  bool contiguous = true;
  DLDataType dtype{};
  DLDevice device{kDLCPU, 0};
  std::string source;  // "__dlpack__", "__cuda_array_interface__", "__array_interface__"
};

std::size_t element_bytes(DLDataType t) {
  return (static_cast<std::size_t>(t.bits) * t.lanes + 7) / 8;
}

std::int64_t element_count(const std::vector<std::int64_t>& shape) {
  std::int64_t n = 1;
  for (std::int64_t d : shape)
    n *= d;
  return n;
}

bool c_contiguous(const std::vector<std::int64_t>& shape, const std::int64_t* strides) {
  if (strides == nullptr) return true;
  std::int64_t expected = 1;
  for (std::size_t i = shape.size(); i-- > 0;) {
    if (shape[i] != 1 && strides[i] != expected) return false;
    expected *= shape[i];
  }
  return true;
}

// A NumPy typestr ("<f2", "|u1", "<V2" for bf16 through ml_dtypes...) as
// DLPack; kinds DLPack has no code for (bool, void) keep only their size.
DLDataType from_typestr(const std::string& typestr, const std::string& what) {
  if (typestr.size() < 3) throw InvalidArgument(what + ": bad typestr '" + typestr + "'");
  const char kind = typestr[1];
  const auto bytes = static_cast<std::uint8_t>(std::stoi(typestr.substr(2)));
  const auto bits = static_cast<std::uint8_t>(8 * bytes);
  switch (kind) {
    case 'u':
      return {kDLUInt, bits, 1};
    case 'i':
      return {kDLInt, bits, 1};
    case 'f':
      return {kDLFloat, bits, 1};
    default:
      return {kDLOpaqueHandle, bits, 1};  // 'V' and the like: only the size is known
  }
}

Described from_dlpack(const py::object& obj, const std::string& what) {
  py::object capsule = obj.attr("__dlpack__")();
  if (PyCapsule_IsValid(capsule.ptr(), "dltensor") == 0)
    throw InvalidArgument(what + ": __dlpack__ did not return a 'dltensor' capsule");
  const auto* managed =
      static_cast<const DLManagedTensor*>(PyCapsule_GetPointer(capsule.ptr(), "dltensor"));
  const DLTensor& t = managed->dl_tensor;
  Described d;
  d.source = "__dlpack__";
  d.data = reinterpret_cast<std::uintptr_t>(t.data) + t.byte_offset;
  d.shape.assign(t.shape, t.shape + t.ndim);
  d.contiguous = c_contiguous(d.shape, t.strides);
  d.dtype = t.dtype;
  d.device = t.device;
  // The capsule is not consumed: its destructor lets the producer's reference
  // go; the object itself keeps the memory (held with the cache).
  return d;
}

Described from_interface(const py::dict& iface, DLDevice device, const std::string& source,
                         const std::string& what) {
  Described d;
  d.source = source;
  d.device = device;
  const py::tuple data = iface["data"];
  d.data = data[0].cast<std::uintptr_t>();
  if (data[1].cast<bool>()) throw InvalidArgument(what + ": the array is read-only");
  for (const py::handle n : py::tuple(iface["shape"]))
    d.shape.push_back(n.cast<std::int64_t>());
  d.dtype = from_typestr(iface["typestr"].cast<std::string>(), what);
  if (iface.contains("strides") && !iface["strides"].is_none()) {
    std::vector<std::int64_t> strides;
    for (const py::handle s : py::tuple(iface["strides"]))
      strides.push_back(s.cast<std::int64_t>() / static_cast<std::int64_t>(element_bytes(d.dtype)));
    d.contiguous = c_contiguous(d.shape, strides.data());
  }
  return d;
}

Described describe(const py::object& obj, const std::string& what) {
  if (py::hasattr(obj, "__dlpack__")) return from_dlpack(obj, what);
  if (py::hasattr(obj, "__cuda_array_interface__")) {
    // The CUDA device of the pointer is not in the interface: the backend's
    // (checked by the caller against the backend kind only).
    return from_interface(obj.attr("__cuda_array_interface__"), DLDevice{kDLCUDA, -1},
                          "__cuda_array_interface__", what);
  }
  if (py::hasattr(obj, "__array_interface__"))
    return from_interface(obj.attr("__array_interface__"), DLDevice{kDLCPU, 0},
                          "__array_interface__", what);
  throw InvalidArgument(what + ": " + py::repr(obj.get_type()).cast<std::string>() +
                        " is not a tensor or an array (no __dlpack__, "
                        "__cuda_array_interface__ or __array_interface__)");
}

std::string device_text(DLDevice d) {
  switch (d.device_type) {
    case kDLCPU:
      return "cpu";
    case kDLCUDA:
      return d.device_id < 0 ? "cuda" : "cuda:" + std::to_string(d.device_id);
    case kDLROCM:
      return "rocm:" + std::to_string(d.device_id);
    case kDLCUDAHost:
      return "cuda_host (pinned)";
    default:
      return "device type " + std::to_string(static_cast<int>(d.device_type));
  }
}

std::string shape_text(const std::vector<std::int64_t>& shape) {
  std::ostringstream s;
  s << "(";
  for (std::size_t i = 0; i < shape.size(); ++i)
    s << (i ? ", " : "") << shape[i];
  s << (shape.size() == 1 ? ",)" : ")");
  return s.str();
}

// The element types a pool of `kv` accepts: raw bytes always; the 16-bit
// float the pool views export for f16 / bf16 (or its raw uint16 words).
bool accepts(KvCacheDtype kv, DLDataType t) {
  if (t.lanes != 1) return false;
  if (t.bits == 8 && (t.code == kDLUInt || t.code == kDLInt)) return true;
  if (t.bits != 16) return false;
  if (t.code == kDLUInt || t.code == kDLInt)
    return kv == KvCacheDtype::f16 || kv == KvCacheDtype::bf16;
  if (kv == KvCacheDtype::f16) return t.code == kDLFloat;
  if (kv == KvCacheDtype::bf16) return t.code == kDLBfloat || t.code == kDLOpaqueHandle;
  return false;
}

std::string pool_label(const KvCacheConfig& config, std::size_t index) {
  if (config.layout == KvCacheLayout::block_major)
    return "pool " + std::to_string(index) + " (block-major)";
  const std::size_t per_layer = config.has_v() ? 2 : 1;
  return "pool " + std::to_string(index) + " (layer " + std::to_string(index / per_layer) +
         (index % per_layer == 0 ? " K)" : " V)");
}

// The dtype the pool's bytes hold: the layer's in layer-major layout; the
// config's in block-major (raw bytes only when layers differ).
std::optional<KvCacheDtype> pool_dtype(const KvCacheConfig& config, std::size_t index) {
  if (config.layout == KvCacheLayout::block_major) {
    if (!config.layer_dtypes.empty()) return std::nullopt;
    return config.dtype;
  }
  return config.dtype_for_layer(index / (config.has_v() ? 2 : 1));
}

DLDevice backend_device(const Backend& backend, int device) {
  ViewOwner owner;
  owner.backend = const_cast<Backend*>(&backend);
  owner.device = device;
  return dl_device(owner);
}

// Checks one engine tensor against pool `index`'s geometry.
AdoptedPool check_pool(const KvCacheConfig& config, std::size_t num_blocks, std::size_t index,
                       std::size_t need, const Described& d, DLDevice expected) {
  const std::string what = "PagedKvCache.adopt: " + pool_label(config, index);
  const bool device_ok = d.device.device_type == expected.device_type &&
                         (d.device.device_id < 0 || d.device.device_id == expected.device_id);
  if (!device_ok)
    throw InvalidArgument(what + ": the tensor is on " + device_text(d.device) +
                          ", the backend's memory is " + device_text(expected));
  if (!d.contiguous) throw InvalidArgument(what + ": the tensor is not C-contiguous");
  const std::optional<KvCacheDtype> kv = pool_dtype(config, index);
  const bool raw = d.dtype.lanes == 1 && d.dtype.bits == 8 &&
                   (d.dtype.code == kDLUInt || d.dtype.code == kDLInt);
  if (kv ? !accepts(*kv, d.dtype) : !raw) {
    throw InvalidArgument(what + ": element type (code " + std::to_string(d.dtype.code) + ", " +
                          std::to_string(d.dtype.bits) + " bits) does not hold " +
                          (kv ? std::string(dtype_name(*kv)) : std::string("mixed dtypes")) +
                          " (use uint8, or the pool view's dtype)");
  }
  const std::size_t bytes =
      static_cast<std::size_t>(element_count(d.shape)) * element_bytes(d.dtype);
  if (d.shape.empty() || d.shape[0] != static_cast<std::int64_t>(num_blocks) || bytes != need) {
    throw InvalidArgument(what + ": shape " + shape_text(d.shape) + " holds " +
                          std::to_string(bytes) + " bytes; needs " + std::to_string(num_blocks) +
                          " blocks first and " + std::to_string(need) + " bytes (" +
                          std::to_string(need / num_blocks) + " per block)");
  }
  return AdoptedPool{DevicePtr(d.data), bytes};
}

// torch.cuda.Stream / torch.cuda.ExternalStream (.cuda_stream), CuPy streams
// (.ptr), or an int.
std::uintptr_t stream_handle_of(const py::object& obj) {
  if (py::isinstance<py::bool_>(obj))
    throw InvalidArgument("stream: a bool is not a stream handle");
  if (py::isinstance<py::int_>(obj)) return obj.cast<std::uintptr_t>();
  for (const char* attr : {"cuda_stream", "ptr", "handle"}) {
    if (py::hasattr(obj, attr)) {
      const py::object v = obj.attr(attr);
      if (py::isinstance<py::int_>(v) && !py::isinstance<py::bool_>(v))
        return v.cast<std::uintptr_t>();
    }
  }
  throw InvalidArgument("stream: " + py::repr(obj.get_type()).cast<std::string>() +
                        " is not a stream (an int handle, a torch.cuda.Stream or an object with "
                        "an int .cuda_stream / .ptr)");
}

}  // namespace

void bind_adopt(py::module_& m) {
  auto cls = py::reinterpret_borrow<py::class_<PyCache>>(m.attr("PagedKvCache"));
  cls.def_static(
         "adopted_pool_bytes",
         [](const KvCacheConfig& config, std::size_t num_blocks) {
           return kvport::PagedKvCache::adopted_pool_bytes(config, num_blocks);
         },
         py::arg("config"), py::arg("num_blocks"),
         "Bytes each pool of PagedKvCache.adopt must hold, in its order (layer 0 K, layer 0 V, "
         "layer 1 K, ...; one pool in block-major layout).")
      .def_static(
          "adopt",
          [](const KvCacheConfig& config, std::size_t num_blocks, const py::object& pools,
             const std::string& backend, int device, std::optional<bool> trace) {
            std::vector<py::object> objects;
            if (py::isinstance<py::list>(pools) || py::isinstance<py::tuple>(pools)) {
              for (const py::handle p : pools)
                objects.push_back(py::reinterpret_borrow<py::object>(p));
            } else {
              objects.push_back(pools);  // one tensor: the block-major pool
            }
            auto state = std::make_shared<CacheState>();
            state->owned_backend = kvport::make_backend(backend, device);
            state->backend = state->owned_backend.get();
            state->device = device;
            const std::vector<std::size_t> need =
                kvport::PagedKvCache::adopted_pool_bytes(config, num_blocks);
            if (objects.size() != need.size()) {
              throw InvalidArgument("PagedKvCache.adopt: " + std::to_string(objects.size()) +
                                    " pools given, the config needs " +
                                    std::to_string(need.size()) +
                                    " (adopted_pool_bytes lists them)");
            }
            const DLDevice expected = backend_device(*state->backend, device);
            std::vector<AdoptedPool> adopted;
            for (std::size_t i = 0; i < objects.size(); ++i) {
              const Described d =
                  describe(objects[i], "PagedKvCache.adopt: " + pool_label(config, i));
              adopted.push_back(check_pool(config, num_blocks, i, need[i], d, expected));
            }
            auto held = std::make_shared<HeldObjects>();
            held->objects = std::move(objects);
            kvport::PagedKvCacheOptions options;
            options.trace = trace;
            state->owned_cache = std::make_unique<kvport::PagedKvCache>(
                config, num_blocks, *state->backend, adopted, options);
            state->cache = state->owned_cache.get();
            state->engine_memory = std::move(held);
            return PyCache(std::move(state));
          },
          py::arg("config"), py::arg("num_blocks"), py::arg("pools"), py::arg("backend") = "host",
          py::kw_only(), py::arg("device") = 0, py::arg("trace") = py::none(),
          "A cache over the engine's tensors or arrays (anything with __dlpack__, "
          "__cuda_array_interface__ or __array_interface__), one per pool in the order of "
          "adopted_pool_bytes (a single one in block-major layout): C-contiguous, on the "
          "backend's device, num_blocks rows first and exactly the pool's bytes, of uint8 or "
          "the pool view's dtype. kvport never frees them; they are kept alive as long as the "
          "cache (and every view, prefix cache or table of it).")
      .def_property_readonly(
          "adopted", [](const PyCache& c) { return c.cache().adopted(); },
          "Whether the pools are the engine's (PagedKvCache.adopt).")
      .def(
          "use_stream",
          [](const PyCache& c, const py::object& stream) {
            const std::shared_ptr<CacheState>& state = c.state();
            if (state->borrowed())
              throw InvalidArgument(
                  "use_stream: a hybrid cache's group pool uses its cache's stream");
            // Work already queued on the old stream is finished first.
            state->cache->synchronize();
            if (stream.is_none()) {
              state->engine_stream = kvport::WrappedStream();
              return;
            }
            void* handle = reinterpret_cast<void*>(stream_handle_of(stream));
            state->engine_stream = state->backend->wrap_stream(handle);
          },
          py::arg("stream"),
          "Queues this cache's device work on the engine's stream from now on: a "
          "torch.cuda.Stream, a CuPy stream, an int handle (a cudaStream_t; on the host "
          "backend what stream_handle gave), or None for the backend's default stream again. "
          "Work is ordered with the engine's own on that stream; calls still wait for it "
          "before they return. The stream is never destroyed by kvport and must stay alive "
          "while in use.")
      .def_property_readonly(
          "stream_handle",
          [](const PyCache& c) {
            return reinterpret_cast<std::uintptr_t>(c.state()->backend->vendor_stream(c.stream()));
          },
          "The vendor handle (cudaStream_t as an int; the host backend's queue) of the stream "
          "this cache's work goes to.");
  m.def(
      "stream_handle", [](const py::object& stream) { return stream_handle_of(stream); },
      py::arg("stream"),
      "The int handle of a torch.cuda.Stream, a CuPy stream or an int, as use_stream reads it.");
}

}  // namespace kvport::python
