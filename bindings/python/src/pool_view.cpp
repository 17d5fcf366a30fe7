// SPDX-License-Identifier: Apache-2.0
#include "pool_view.hpp"

#include <sstream>
#include <utility>

#include "convert.hpp"
#include "kvport/platform/error.hpp"

namespace kvport::python {
namespace {

struct Export {
  DLManagedTensor managed{};
  std::shared_ptr<const void> keep;
  std::vector<std::int64_t> shape;
  std::vector<std::int64_t> strides;
};

void export_deleter(DLManagedTensor* self) {
  delete static_cast<Export*>(self->manager_ctx);
}

void capsule_destructor(PyObject* capsule) {
  // Consumed capsules are renamed "used_dltensor"; only an unconsumed one
  // still owns its tensor.
  if (PyCapsule_IsValid(capsule, "dltensor") == 0) return;
  auto* managed = static_cast<DLManagedTensor*>(PyCapsule_GetPointer(capsule, "dltensor"));
  if (managed != nullptr && managed->deleter != nullptr) managed->deleter(managed);
}

std::string shape_text(const std::vector<std::int64_t>& shape) {
  std::string s = "(";
  for (std::size_t i = 0; i < shape.size(); ++i) {
    if (i != 0) s += ", ";
    s += std::to_string(shape[i]);
  }
  return s + (shape.size() == 1 ? ",)" : ")");
}

void synchronize(const PoolView& v) {
  v.owner.backend->synchronize(v.owner.backend->default_stream());
}

py::tuple device_tuple(const PoolView& v) {
  const DLDevice d = dl_device(v.owner);
  return py::make_tuple(static_cast<int>(d.device_type), d.device_id);
}

}  // namespace

DLDevice dl_device(const ViewOwner& owner) {
  const std::string& name = owner.backend->name();
  if (name == "cuda") return {kDLCUDA, owner.device};
  if (name == "hip") return {kDLROCM, owner.device};
  return {kDLCPU, 0};
}

py::capsule to_dlpack(const PoolView& view) {
  auto owned = std::make_unique<Export>();
  Export* e = owned.get();
  e->keep = view.owner.keep;
  e->shape = view.shape;
  e->strides = view.strides;
  DLTensor& t = e->managed.dl_tensor;
  t.data = reinterpret_cast<void*>(view.data);
  t.device = dl_device(view.owner);
  t.ndim = static_cast<std::int32_t>(e->shape.size());
  t.dtype = view.dl_dtype;
  t.shape = e->shape.data();
  t.strides = e->strides.data();
  t.byte_offset = 0;
  e->managed.manager_ctx = e;
  e->managed.deleter = export_deleter;
  PyObject* capsule = PyCapsule_New(&e->managed, "dltensor", capsule_destructor);
  if (capsule == nullptr) throw py::error_already_set();
  owned.release();
  return py::reinterpret_steal<py::capsule>(capsule);
}

PoolView layer_pool_view(const ViewOwner& owner, const PagedKvCache& cache, bool k,
                         std::size_t layer, bool raw, std::string what) {
  const KvCacheConfig& config = cache.config();
  PoolView v;
  v.owner = owner;
  v.what = std::move(what);
  // Validates the layer, and refuses V of K-only layers.
  const kvport::BlockPool& pool = cache.pool(layer, k ? kvport::KvPart::k : kvport::KvPart::v);
  const KvCacheDtype kv_dtype = pool.dtype;
  v.kv_dtype = dtype_name(kv_dtype);
  v.data = pool.base.address();
  const std::size_t block_stride = pool.stride;
  const BlockRegionLayout region = k ? config.k_layout(layer) : config.v_layout(layer);
  const std::size_t head_dim = k ? config.head_dim_k : config.head_dim_v;
  const auto n = static_cast<std::int64_t>(pool.num_blocks);

  std::size_t elem = 0;
  switch (kv_dtype) {
    case KvCacheDtype::f16:
      elem = 2;
      v.dl_dtype = raw ? DLDataType{kDLUInt, 16, 1} : DLDataType{kDLFloat, 16, 1};
      v.dtype = raw ? "uint16" : "float16";
      break;
    case KvCacheDtype::bf16:
      elem = 2;
      v.dl_dtype = raw ? DLDataType{kDLUInt, 16, 1} : DLDataType{kDLBfloat, 16, 1};
      v.dtype = raw ? "uint16" : "bfloat16";
      break;
    case KvCacheDtype::fp8_e4m3:
    case KvCacheDtype::fp8_e5m2:
      // DLPack 0.6 has no fp8 type code: the bytes, whatever `raw` says.
      elem = 1;
      v.dl_dtype = DLDataType{kDLUInt, 8, 1};
      v.dtype = "uint8";
      break;
    default:
      break;
  }
  if (elem != 0) {
    const auto hd = static_cast<std::int64_t>(head_dim);
    const auto heads = static_cast<std::int64_t>(config.num_kv_heads);
    v.shape = {n, static_cast<std::int64_t>(config.block_size), heads, hd};
    v.strides = {static_cast<std::int64_t>(block_stride / elem), heads * hd, hd, 1};
  } else {
    // Packed formats: each block's whole region as bytes (data, padding,
    // scales at scale_offset, padding).
    v.dl_dtype = DLDataType{kDLUInt, 8, 1};
    v.dtype = "uint8";
    v.shape = {n, static_cast<std::int64_t>(region.total_bytes)};
    v.strides = {static_cast<std::int64_t>(block_stride), 1};
    v.scale_offset = region.scale_offset;
    v.scale_bytes = region.scale_bytes;
  }
  return v;
}

py::array numpy_view(const PoolView& v) {
  const std::size_t itemsize = v.dl_dtype.bits / 8U;
  std::string format;
  if (v.dl_dtype.code == kDLFloat)
    format = "float" + std::to_string(v.dl_dtype.bits);
  else
    format = "uint" + std::to_string(v.dl_dtype.bits);  // bf16: uint16 words
  std::vector<py::ssize_t> shape(v.shape.begin(), v.shape.end());
  std::vector<py::ssize_t> strides;
  for (const std::int64_t s : v.strides)
    strides.push_back(static_cast<py::ssize_t>(s * static_cast<std::int64_t>(itemsize)));
  auto* keep = new std::shared_ptr<const void>(v.owner.keep);
  py::capsule base(keep, [](void* p) { delete static_cast<std::shared_ptr<const void>*>(p); });
  synchronize(v);
  return py::array(py::dtype(format), shape, strides, reinterpret_cast<void*>(v.data), base);
}

py::tuple to_tuple(const std::vector<std::int64_t>& values) {
  py::tuple t(values.size());
  for (std::size_t i = 0; i < values.size(); ++i)
    t[i] = py::int_(values[i]);
  return t;
}

void register_pool_view(py::module_& m) {
  py::class_<PoolView>(m, "PoolView",
                       "A zero-copy view of cache memory (a layer's K or V pool, an MLA "
                       "latent pool, a state tensor of every slot): pass it to "
                       "torch.from_dlpack or numpy.from_dlpack.")
      .def_property_readonly("shape", [](const PoolView& v) { return to_tuple(v.shape); })
      .def_property_readonly(
          "strides", [](const PoolView& v) { return to_tuple(v.strides); },
          "In elements, as DLPack gives them.")
      .def_readonly("dtype", &PoolView::dtype)
      .def_readonly("kv_dtype", &PoolView::kv_dtype)
      .def_property_readonly("data_ptr", [](const PoolView& v) { return v.data; })
      .def_readonly("scale_offset", &PoolView::scale_offset)
      .def_readonly("scale_bytes", &PoolView::scale_bytes)
      .def_property_readonly("device", &device_tuple)
      .def(
          "__dlpack__",
          [](const PoolView& v, const py::object& /*stream*/) {
            // Everything the cache queued is finished before the consumer
            // reads (every call of this module already waits; this covers
            // work queued through the C++ API on the default stream).
            synchronize(v);
            return to_dlpack(v);
          },
          py::arg("stream") = py::none())
      .def("__dlpack_device__", &device_tuple)
      .def(
          "as_words",
          [](const PoolView& v) {
            PoolView w = v;
            if (w.dl_dtype.code == kDLFloat || w.dl_dtype.code == kDLBfloat) {
              w.dl_dtype = DLDataType{kDLUInt, w.dl_dtype.bits, 1};
              w.dtype = "uint" + std::to_string(w.dl_dtype.bits);
            }
            return w;
          },
          "The same memory as unsigned words of the element size (uint16 for f16/bf16, "
          "uint32 for f32).")
      .def(
          "numpy",
          [](const PoolView& v) {
            if (dl_device(v.owner).device_type != kDLCPU)
              throw InvalidArgument(v.what +
                                    ": numpy() needs a host pool; use "
                                    "torch.from_dlpack for device pools");
            require_numpy("PoolView.numpy()");
            return numpy_view(v);
          },
          "A writable, zero-copy NumPy array over the pool (host backend); bf16 pools come "
          "as uint16 words (NumPy has no bfloat16).")
      .def(
          "__array__",
          [](const py::object& self, const py::object& dtype) {
            py::object arr = self.attr("numpy")();
            if (dtype.is_none()) return arr;
            return arr.attr("astype")(dtype);
          },
          py::arg("dtype") = py::none())
      .def("__repr__", [](const PoolView& v) {
        std::ostringstream s;
        s << "PoolView(" << v.what << ", kv_dtype='" << v.kv_dtype << "', dtype='" << v.dtype
          << "', shape=" << shape_text(v.shape) << ", strides=" << shape_text(v.strides);
        if (v.scale_bytes != 0)
          s << ", scale_offset=" << v.scale_offset << ", scale_bytes=" << v.scale_bytes;
        const DLDevice d = dl_device(v.owner);
        s << ", device="
          << (d.device_type == kDLCPU    ? "'cpu'"
              : d.device_type == kDLCUDA ? "'cuda:"
                                         : "'rocm:");
        if (d.device_type != kDLCPU) s << d.device_id << "'";
        s << ")";
        return s.str();
      });
}

}  // namespace kvport::python
