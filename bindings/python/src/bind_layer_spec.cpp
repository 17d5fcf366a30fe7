// SPDX-License-Identifier: Apache-2.0
// StateTensor, LayerSpec, KvCacheGroup and group_layers (kvport._kvport).
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <cstddef>
#include <optional>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

#include "convert.hpp"
#include "kvport/core/block_id.hpp"
#include "kvport/core/kv_cache_plan.hpp"
#include "kvport/core/layer_spec.hpp"
#include "kvport/platform/error.hpp"
#include "parts.hpp"

namespace kvport::python {

namespace {

MlaFormat mla_format_from(const std::string& name) {
  if (name == "plain") return MlaFormat::plain;
  if (name == "fp8_ds_mla") return MlaFormat::fp8_ds_mla;
  throw InvalidArgument("unknown MLA format '" + name + "' (known: plain, fp8_ds_mla)");
}

// A state tensor's shape from Python ints: a negative or zero dimension is
// refused here, naming the tensor and the dimension (a negative one would
// otherwise fail pybind11's size_t conversion with no name at all).
std::vector<std::size_t> state_shape_from(const std::string& name, const py::handle& obj) {
  if (py::isinstance<py::str>(obj) || !py::isinstance<py::sequence>(obj)) {
    throw InvalidArgument("StateTensor '" + name + "': the shape is a sequence of ints, not " +
                          std::string(py::str(py::type::handle_of(obj).attr("__name__"))));
  }
  const auto dims = py::reinterpret_borrow<py::sequence>(obj);
  std::vector<std::size_t> shape;
  shape.reserve(dims.size());
  for (std::size_t i = 0; i < dims.size(); ++i) {
    const py::object d = dims[i];
    if (py::isinstance<py::bool_>(d) || !py::isinstance<py::int_>(d)) {
      throw InvalidArgument("StateTensor '" + name + "': dimension " + std::to_string(i) + " is " +
                            std::string(py::repr(d)) + ", not an int");
    }
    const long long v = d.cast<long long>();
    if (v <= 0) {
      throw InvalidArgument("StateTensor '" + name + "': dimension " + std::to_string(i) + " is " +
                            std::to_string(v) + "; every dimension must be > 0");
    }
    shape.push_back(static_cast<std::size_t>(v));
  }
  return shape;
}

// A StateTensor, or a (name, shape[, dtype]) tuple.
StateTensor state_tensor_from(const py::handle& obj) {
  if (py::isinstance<StateTensor>(obj)) return obj.cast<StateTensor>();
  if (py::isinstance<py::tuple>(obj) || py::isinstance<py::list>(obj)) {
    const auto items = py::reinterpret_borrow<py::sequence>(obj);
    if (items.size() == 2 || items.size() == 3) {
      StateTensor t;
      t.name = items[0].cast<std::string>();
      t.shape = state_shape_from(t.name, items[1]);
      t.dtype =
          items.size() == 3 ? state_dtype_from(items[2].cast<std::string>()) : StateDtype::f32;
      return t;
    }
  }
  throw InvalidArgument(
      "a state tensor is a kvport.StateTensor or a (name, shape[, dtype]) tuple, not " +
      std::string(py::str(py::type::handle_of(obj).attr("__name__"))));
}

std::string spec_repr(const LayerSpec& s) {
  return "LayerSpec(" + s.describe() + ")";
}

}  // namespace

void bind_layer_spec(py::module_& m) {
  m.attr("NULL_BLOCK") = py::int_(kNullBlock);

  // ---- StateTensor and LayerSpec ----------------------------------------------------
  py::class_<StateTensor>(m, "StateTensor",
                          "One tensor of a layer's per-request state, e.g. Mamba2's SSM state "
                          "[heads, head_dim, state_size] in f32.")
      .def(py::init([](std::string name, const py::object& shape, const std::string& dtype) {
             std::vector<std::size_t> dims = state_shape_from(name, shape);
             return StateTensor{std::move(name), std::move(dims), state_dtype_from(dtype)};
           }),
           py::arg("name"), py::arg("shape"), py::arg("dtype") = "f32")
      .def_readonly("name", &StateTensor::name)
      .def_readonly("shape", &StateTensor::shape)
      .def_property_readonly("dtype",
                             [](const StateTensor& t) { return state_dtype_name(t.dtype); })
      .def_property_readonly("num_elements", &StateTensor::num_elements)
      .def_property_readonly("bytes", &StateTensor::bytes, "Unpadded bytes.")
      .def("__eq__", [](const StateTensor& a, const StateTensor& b) { return a == b; })
      .def_property_readonly_static("__hash__", [](const py::object&) { return py::none(); })
      .def("__repr__", [](const StateTensor& t) {
        std::ostringstream s;
        s << "StateTensor('" << t.name << "', [";
        for (std::size_t i = 0; i < t.shape.size(); ++i)
          s << (i != 0 ? ", " : "") << t.shape[i];
        s << "], '" << state_dtype_name(t.dtype) << "')";
        return s.str();
      });

  py::class_<LayerSpec>(m, "LayerSpec",
                        "What one model layer keeps in the KV cache. Build one with the static "
                        "constructors; fields are read-only (docs/hybrid-models.md).")
      .def_static(
          "full_attention",
          [](std::size_t heads, std::size_t head_dim_k, std::optional<std::size_t> head_dim_v,
             const py::object& dtype) {
            return LayerSpec::full_attention(heads, head_dim_k, head_dim_v.value_or(head_dim_k),
                                             dtype_from(dtype));
          },
          py::arg("num_kv_heads"), py::arg("head_dim_k"), py::arg("head_dim_v") = py::none(),
          py::arg("dtype") = "bf16", "K and V of every token (head_dim_v defaults to head_dim_k).")
      .def_static(
          "sliding_window",
          [](std::size_t window, std::size_t heads, std::size_t head_dim_k,
             std::optional<std::size_t> head_dim_v, const py::object& dtype) {
            return LayerSpec::sliding_window(window, heads, head_dim_k,
                                             head_dim_v.value_or(head_dim_k), dtype_from(dtype));
          },
          py::arg("window"), py::arg("num_kv_heads"), py::arg("head_dim_k"),
          py::arg("head_dim_v") = py::none(), py::arg("dtype") = "bf16",
          "K and V of the last `window` tokens (the token itself included).")
      .def_static(
          "chunked_local",
          [](std::size_t chunk, std::size_t heads, std::size_t head_dim_k,
             std::optional<std::size_t> head_dim_v, const py::object& dtype) {
            return LayerSpec::chunked_local(chunk, heads, head_dim_k,
                                            head_dim_v.value_or(head_dim_k), dtype_from(dtype));
          },
          py::arg("chunk"), py::arg("num_kv_heads"), py::arg("head_dim_k"),
          py::arg("head_dim_v") = py::none(), py::arg("dtype") = "bf16",
          "K and V of the current chunk of `chunk` tokens (a multiple of the block size).")
      .def_static(
          "mla",
          [](std::size_t rank, std::size_t rope, const py::object& dtype,
             const std::string& format) {
            return LayerSpec::mla(rank, rope, dtype_from(dtype), mla_format_from(format));
          },
          py::arg("kv_lora_rank"), py::arg("rope_dim"), py::arg("dtype") = "bf16",
          py::arg("format") = "plain",
          "One latent of kv_lora_rank + rope_dim values per token, no V (DeepSeek-V3: 512, 64). "
          "format 'fp8_ds_mla': vLLM's 656-byte fp8 latent.")
      .def_static(
          "state",
          [](const py::iterable& tensors) {
            std::vector<StateTensor> out;
            for (const py::handle t : tensors)
              out.push_back(state_tensor_from(t));
            LayerSpec spec = LayerSpec::recurrent_state(std::move(out));
            spec.validate(1);  // a state's checks do not depend on the block size
            return spec;
          },
          py::arg("tensors"),
          "A fixed per-request state: StateTensor objects or (name, shape[, dtype]) tuples. "
          "Raises InvalidArgument for no tensor, a dimension <= 0 (naming the tensor and the "
          "dimension) or two tensors of one name (naming it).")
      .def_static("none", &LayerSpec::no_kv, "A layer without KV (MLP only).")
      .def_property_readonly(
          "kind", [](const LayerSpec& s) { return std::string(to_string(s.kind)); },
          "'full_attention', 'mla_attention', 'sliding_window', 'chunked_local', 'mamba' "
          "(state) or 'none'.")
      .def_readonly("num_kv_heads", &LayerSpec::num_kv_heads)
      .def_readonly("head_dim_k", &LayerSpec::head_dim_k)
      .def_readonly("head_dim_v", &LayerSpec::head_dim_v)
      .def_property_readonly("dtype", [](const LayerSpec& s) { return dtype_name(s.dtype); })
      .def_readonly("window", &LayerSpec::window)
      .def_readonly("chunk", &LayerSpec::chunk)
      .def_readonly("kv_lora_rank", &LayerSpec::kv_lora_rank)
      .def_readonly("rope_dim", &LayerSpec::rope_dim)
      .def_property_readonly(
          "mla_format", [](const LayerSpec& s) { return std::string(to_string(s.mla_format)); })
      .def_readonly("state_tensors", &LayerSpec::state,
                    "The StateTensor list of a state layer (LayerSpec.state() builds one).")
      .def_property_readonly("has_blocks", &LayerSpec::has_blocks)
      .def_property_readonly("has_state", &LayerSpec::has_state)
      .def("validate", &LayerSpec::validate, py::arg("block_size"))
      .def("describe", &LayerSpec::describe)
      .def("block_bytes", &LayerSpec::block_bytes, py::arg("block_size"),
           "Bytes of one block of one layer (K + V, scales, padding; 0 for state and none).")
      .def("token_bytes", &LayerSpec::token_bytes, py::arg("block_size"))
      .def("state_bytes", &LayerSpec::state_bytes,
           "One request's state in one layer, each tensor padded to 16 bytes.")
      .def("state_offset", &LayerSpec::state_offset, py::arg("index"),
           "Where state tensor `index` starts in a state slot.")
      .def(
          "pool_config",
          [](const LayerSpec& s, std::size_t num_layers, std::size_t block_size,
             const std::string& layout) {
            return s.pool_config(num_layers, block_size, layout_from(layout));
          },
          py::arg("num_layers"), py::arg("block_size"), py::arg("layout") = "layer_major",
          "The KvCacheConfig of a pool of num_layers layers of this spec.")
      .def("same_group_as", &LayerSpec::same_group_as, py::arg("other"))
      .def("__eq__", [](const LayerSpec& a, const LayerSpec& b) { return a == b; })
      .def_property_readonly_static("__hash__", [](const py::object&) { return py::none(); })
      .def("__repr__", &spec_repr);

  py::class_<KvCacheGroup>(m, "KvCacheGroup", "The layers of one spec, which share one pool.")
      .def_readonly("spec", &KvCacheGroup::spec)
      .def_readonly("layers", &KvCacheGroup::layers, "Model layer indices, ascending.")
      .def_property_readonly("layer_dtypes",
                             [](const KvCacheGroup& g) {
                               std::vector<std::string> out;
                               for (const KvCacheDtype d : g.layer_dtypes)
                                 out.push_back(dtype_name(d));
                               return out;
                             })
      .def("__repr__", [](const KvCacheGroup& g) {
        return "KvCacheGroup(" + g.spec.describe() + ", " + std::to_string(g.layers.size()) +
               (g.layers.size() == 1 ? " layer)" : " layers)");
      });

  m.def(
      "group_layers",
      [](const std::vector<LayerSpec>& layers, std::size_t block_size) {
        return group_layers(layers, block_size);
      },
      py::arg("layers"), py::arg("block_size"),
      "The KV cache groups of `layers`, in order of each group's first layer (none layers "
      "belong to no group).");
}

}  // namespace kvport::python
