// Hybrid models in the Python module: LayerSpec and StateTensor, the planner
// (plan_kv_cache), HybridKvCache (one pool and prefix cache per KV cache
// group, with DLPack views per model layer) and HybridBlockTable.
//
// Lifetimes: a Python HybridKvCache holds a shared_ptr<HybridState> (backend +
// hybrid cache). Hybrid tables, group pools (borrowed PagedKvCache objects),
// views and every DLPack capsule exported from them hold it too, as a
// PagedKvCache's do (module.cpp).
#include <pybind11/numpy.h>
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
#include "events.hpp"
#include "fork_guard.hpp"
#include "kvport/core/hybrid_block_table.hpp"
#include "kvport/core/hybrid_kv_cache.hpp"
#include "kvport/core/kv_cache_plan.hpp"
#include "kvport/core/layer_spec.hpp"
#include "kvport/platform/error.hpp"
#include "kvport/platform/registry.hpp"
#include "parts.hpp"
#include "pool_view.hpp"

namespace kvport::python {
namespace {

// ---- conversions ---------------------------------------------------------------

StateDtype state_dtype_from(const std::string& name) {
  const std::optional<StateDtype> d = parse_state_dtype(name);
  if (!d) throw InvalidArgument("unknown state dtype '" + name + "' (known: f32, f16, bf16)");
  return *d;
}

std::string state_dtype_name(StateDtype d) {
  return std::string(to_string(d));
}

MlaFormat mla_format_from(const std::string& name) {
  if (name == "plain") return MlaFormat::plain;
  if (name == "fp8_ds_mla") return MlaFormat::fp8_ds_mla;
  throw InvalidArgument("unknown MLA format '" + name + "' (known: plain, fp8_ds_mla)");
}

// A StateTensor, or a (name, shape[, dtype]) tuple.
StateTensor state_tensor_from(const py::handle& obj) {
  if (py::isinstance<StateTensor>(obj)) return obj.cast<StateTensor>();
  if (py::isinstance<py::tuple>(obj) || py::isinstance<py::list>(obj)) {
    const auto items = py::reinterpret_borrow<py::sequence>(obj);
    if (items.size() == 2 || items.size() == 3) {
      StateTensor t;
      t.name = items[0].cast<std::string>();
      t.shape = items[1].cast<std::vector<std::size_t>>();
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

// ---- owned state ---------------------------------------------------------------

struct HybridState {
  std::unique_ptr<Backend> backend;
  int device = 0;
  /// Every group's event sink while events are enabled (events.hpp).
  std::shared_ptr<events::Publisher> publisher;
  std::unique_ptr<HybridKvCache> cache;             // destroyed first (see ~HybridState)
  std::uint64_t generation = process_generation();  // fork_guard.hpp

  // The cache (its prefix caches announce their clears), the publisher, then
  // the backend; in a forked child none of them (they would wait on the
  // parent's threads).
  ~HybridState() {
    if (generation != process_generation()) {
      (void)cache.release();
      new std::shared_ptr<events::Publisher>(std::move(publisher));  // leaked
      (void)backend.release();
      return;
    }
    cache.reset();
    publisher.reset();
  }
  StreamView stream() const { return backend->default_stream(); }
  void sync() const { backend->synchronize(stream()); }
};

ViewOwner view_owner(const std::shared_ptr<HybridState>& state) {
  return ViewOwner{state, state->backend.get(), state->device};
}

bool is_attention(LayerKind k) {
  return k == LayerKind::full_attention || k == LayerKind::sliding_window ||
         k == LayerKind::chunked_local;
}

class PyHybridCache {
 public:
  PyHybridCache(const std::vector<py::object>& layers, const py::object& blocks,
                std::optional<std::size_t> block_size, const std::string& backend, int device,
                std::size_t state_checkpoint_interval, std::optional<bool> trace) {
    HybridKvCacheConfig config;
    for (const py::object& l : layers)
      config.layers.push_back(l.cast<LayerSpec>());
    config.state_checkpoint_interval = state_checkpoint_interval;
    auto state = std::make_shared<HybridState>();
    state->backend = make_backend(backend, device);
    state->device = device;
    PagedKvCacheOptions options;
    options.trace = trace;
    if (py::isinstance<KvCachePlan>(blocks)) {
      const auto& plan = blocks.cast<const KvCachePlan&>();
      if (block_size && *block_size != plan.block_size)
        throw InvalidArgument("HybridKvCache: block_size " + std::to_string(*block_size) +
                              " differs from the plan's " + std::to_string(plan.block_size));
      config.block_size = plan.block_size;
      state->cache =
          std::make_unique<HybridKvCache>(std::move(config), plan, *state->backend, options);
    } else {
      config.block_size = block_size.value_or(16);
      std::vector<std::size_t> counts;
      try {
        counts = blocks.cast<std::vector<std::size_t>>();
      } catch (const py::cast_error&) {
        throw InvalidArgument(
            "HybridKvCache: blocks_per_group must be a list of block counts (one per group) "
            "or a KvCachePlan, not " +
            std::string(py::str(py::type::handle_of(blocks).attr("__name__"))));
      }
      state->cache =
          std::make_unique<HybridKvCache>(std::move(config), counts, *state->backend, options);
    }
    state_ = std::move(state);
  }

  const std::shared_ptr<HybridState>& state() const {
    if (!state_) throw InvalidArgument("HybridKvCache is closed");
    check_same_process(state_->generation, "this HybridKvCache");
    return state_;
  }
  HybridKvCache& cache() const { return *state()->cache; }
  bool closed() const noexcept { return !state_; }
  void close() noexcept { state_.reset(); }

  // Where model layer `layer` lives, which must be of a kind `ok` accepts.
  LayerLocation locate(std::size_t layer, bool (*ok)(LayerKind), const char* op,
                       const char* wants) const {
    const std::optional<LayerLocation> at = cache().locate(layer);
    const LayerKind kind = cache().config().layers[layer].kind;
    if (!at || !ok(kind))
      throw InvalidArgument(std::string(op) + "(" + std::to_string(layer) + "): layer " +
                            std::to_string(layer) + " is " + std::string(to_string(kind)) +
                            ", not " + wants);
    return *at;
  }

  PoolView attention_view(std::size_t layer, bool k, bool raw) const {
    const char* op = k ? "k_pool" : "v_pool";
    const LayerLocation at = locate(layer, &is_attention, op, "an attention layer");
    return layer_pool_view(view_owner(state()), cache().group_cache(at.group), k, at.index, raw,
                           std::string(op) + "(" + std::to_string(layer) + ")");
  }

  // [num_blocks, block_size, latent] (the pool's one "head" dropped).
  PoolView latent_view(std::size_t layer, bool raw) const {
    const LayerLocation at = locate(
        layer, [](LayerKind k) { return k == LayerKind::mla; }, "latent_pool", "an MLA layer");
    PoolView v = layer_pool_view(view_owner(state()), cache().group_cache(at.group), true, at.index,
                                 raw, "latent_pool(" + std::to_string(layer) + ")");
    if (cache().group(at.group).spec.mla_format == MlaFormat::fp8_ds_mla) v.kv_dtype = "fp8_ds_mla";
    if (v.shape.size() == 4) {
      v.shape = {v.shape[0], v.shape[1], v.shape[3]};
      v.strides = {v.strides[0], v.strides[1], 1};
    }
    return v;
  }

  // State tensor `tensor` (an index or a name) of every slot: [num_slots, *shape].
  PoolView state_view(std::size_t layer, const py::object& tensor, bool raw) const {
    const LayerLocation at = locate(
        layer, [](LayerKind k) { return k == LayerKind::state; }, "state_pool", "a state layer");
    const LayerSpec& spec = cache().config().layers[layer];
    std::size_t i = spec.state.size();
    if (py::isinstance<py::str>(tensor)) {
      const auto name = tensor.cast<std::string>();
      for (std::size_t j = 0; j < spec.state.size(); ++j)
        if (spec.state[j].name == name) i = j;
      if (i == spec.state.size())
        throw InvalidArgument("state_pool(" + std::to_string(layer) + "): no state tensor '" +
                              name + "' (" + spec.describe() + ")");
    } else {
      i = static_cast<std::size_t>(to_u32(int_from(tensor, "state tensor"), "state tensor"));
      if (i >= spec.state.size())
        throw InvalidArgument("state_pool(" + std::to_string(layer) + "): state tensor " +
                              std::to_string(i) + " out of range (" +
                              std::to_string(spec.state.size()) + " tensors)");
    }
    const StateTensor& t = spec.state[i];
    const kvport::BlockPool& pool = cache().group_cache(at.group).pool(at.index, kvport::KvPart::k);
    const std::size_t elem = state_dtype_bytes(t.dtype);
    const std::size_t stride = pool.stride;
    const std::size_t offset = spec.state_offset(i);
    // Offsets are multiples of 16 bytes and the slot stride is too: a slot's
    // tensors start at element boundaries.
    if (stride % elem != 0 || offset % elem != 0)
      throw Error("state_pool: slot stride " + std::to_string(stride) + " or offset " +
                  std::to_string(offset) + " is not a multiple of the element size");
    PoolView v;
    v.owner = view_owner(state());
    v.what = "state_pool(" + std::to_string(layer) + ", '" + t.name + "')";
    v.kv_dtype = state_dtype_name(t.dtype);
    v.data = pool.base.address() + offset;
    switch (t.dtype) {
      case StateDtype::f32:
        v.dl_dtype = raw ? DLDataType{kDLUInt, 32, 1} : DLDataType{kDLFloat, 32, 1};
        break;
      case StateDtype::f16:
        v.dl_dtype = raw ? DLDataType{kDLUInt, 16, 1} : DLDataType{kDLFloat, 16, 1};
        break;
      case StateDtype::bf16:
        v.dl_dtype = raw ? DLDataType{kDLUInt, 16, 1} : DLDataType{kDLBfloat, 16, 1};
        break;
    }
    v.dtype = v.dl_dtype.code == kDLBfloat  ? "bfloat16"
              : v.dl_dtype.code == kDLFloat ? "float" + std::to_string(v.dl_dtype.bits)
                                            : "uint" + std::to_string(v.dl_dtype.bits);
    v.shape = {static_cast<std::int64_t>(pool.num_blocks)};
    for (const std::size_t d : t.shape)
      v.shape.push_back(static_cast<std::int64_t>(d));
    v.strides.assign(v.shape.size(), 1);
    for (std::size_t d = v.shape.size() - 1; d > 1; --d)
      v.strides[d - 1] = v.strides[d] * v.shape[d];
    v.strides[0] = static_cast<std::int64_t>(stride / elem);
    return v;
  }

  // Every view of model layer `layer`: {"k", "v"} (attention), {"latent"}
  // (MLA), one per state tensor by name (state), {} (none).
  py::dict views(std::size_t layer, bool raw) const {
    py::dict out;
    const std::optional<LayerLocation> at = cache().locate(layer);
    if (!at) return out;
    const LayerSpec& spec = cache().config().layers[layer];
    switch (spec.kind) {
      case LayerKind::full_attention:
      case LayerKind::sliding_window:
      case LayerKind::chunked_local:
        out["k"] = attention_view(layer, true, raw);
        out["v"] = attention_view(layer, false, raw);
        break;
      case LayerKind::mla:
        out["latent"] = latent_view(layer, raw);
        break;
      case LayerKind::state:
        for (std::size_t i = 0; i < spec.state.size(); ++i)
          out[py::str(spec.state[i].name)] = state_view(layer, py::int_(i), raw);
        break;
      case LayerKind::none:
        break;
    }
    return out;
  }

  py::object group_pool(std::size_t g) const {
    const auto& s = state();
    return borrowed_cache(s, *s->backend, s->device, s->cache->group_cache(g));
  }

  std::string repr() const {
    if (!state_) return "HybridKvCache(closed)";
    const HybridKvCache& c = *state_->cache;
    std::ostringstream s;
    s << "HybridKvCache(backend='" << state_->backend->name() << "', num_layers=" << c.num_layers()
      << ", block_size=" << c.block_size() << ", groups=[";
    for (std::size_t g = 0; g < c.num_groups(); ++g)
      s << (g != 0 ? ", " : "") << c.group(g).layers.size() << " x " << c.group(g).spec.describe()
        << ": " << c.group_cache(g).num_blocks() << " blocks";
    s << "], total_bytes=" << c.total_bytes() << ")";
    return s.str();
  }

 private:
  std::shared_ptr<HybridState> state_;
};

class PyHybridTable {
 public:
  PyHybridTable(const PyHybridCache& cache, std::uint64_t extra_key)
      : cache_(cache.state()),
        table_(std::make_unique<HybridBlockTable>(*cache_->cache, extra_key)) {}
  PyHybridTable(std::shared_ptr<HybridState> cache, HybridBlockTable table)
      : cache_(std::move(cache)), table_(std::make_unique<HybridBlockTable>(std::move(table))) {}
  ~PyHybridTable() {
    if (cache_ && cache_->generation != process_generation()) (void)table_.release();
    table_.reset();
  }
  PyHybridTable(const PyHybridTable&) = delete;
  PyHybridTable& operator=(const PyHybridTable&) = delete;

  HybridBlockTable& table() const {
    if (!table_) throw InvalidArgument("HybridBlockTable is closed");
    check_same_process(cache_->generation, "this HybridBlockTable");
    return *table_;
  }
  StreamView stream() const { return cache_->stream(); }
  void sync() const { cache_->sync(); }
  std::unique_ptr<PyHybridTable> fork() const {
    HybridBlockTable child = table().fork(stream());
    sync();
    return std::make_unique<PyHybridTable>(cache_, std::move(child));
  }
  bool closed() const noexcept { return !table_; }
  void close() noexcept { table_.reset(); }
  std::string repr() const {
    if (!table_) return "HybridBlockTable(closed)";
    std::ostringstream s;
    s << "HybridBlockTable(num_tokens=" << table_->num_tokens() << ", live blocks per group=[";
    for (std::size_t g = 0; g < cache_->cache->num_groups(); ++g) {
      s << (g != 0 ? ", " : "");
      if (cache_->cache->group(g).spec.kind == LayerKind::state) {
        const std::optional<BlockId> slot = table_->state_slot(g);
        s << "slot " << (slot ? std::to_string(*slot) : std::string("none"));
      } else {
        s << table_->num_live_blocks(g);
      }
    }
    s << "])";
    return s.str();
  }

 private:
  std::shared_ptr<HybridState> cache_;  // declared first: destroyed last
  std::unique_ptr<HybridBlockTable> table_;
};

py::array_t<std::uint32_t> id_array(std::span<const BlockId> ids) {
  require_numpy("block_ids");
  py::array_t<std::uint32_t> out(static_cast<py::ssize_t>(ids.size()));
  std::copy(ids.begin(), ids.end(), out.mutable_data());
  return out;
}

}  // namespace

void register_hybrid(py::module_& m) {
  m.attr("NULL_BLOCK") = py::int_(kNullBlock);

  // ---- StateTensor and LayerSpec ----------------------------------------------------
  py::class_<StateTensor>(m, "StateTensor",
                          "One tensor of a layer's per-request state, e.g. Mamba2's SSM state "
                          "[heads, head_dim, state_size] in f32.")
      .def(py::init([](std::string name, std::vector<std::size_t> shape, const std::string& dtype) {
             return StateTensor{std::move(name), std::move(shape), state_dtype_from(dtype)};
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
            return LayerSpec::recurrent_state(std::move(out));
          },
          py::arg("tensors"),
          "A fixed per-request state: StateTensor objects or (name, shape[, dtype]) tuples.")
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

  // ---- the planner --------------------------------------------------------------------
  py::class_<GroupPlan>(m, "GroupPlan", "One group's share of a plan.")
      .def_readonly("spec", &GroupPlan::spec)
      .def_readonly("num_layers", &GroupPlan::num_layers)
      .def_readonly("bytes_per_block", &GroupPlan::bytes_per_block)
      .def_readonly("bytes_per_token", &GroupPlan::bytes_per_token)
      .def_readonly("bytes_per_request", &GroupPlan::bytes_per_request)
      .def_readonly("peak_blocks_per_request", &GroupPlan::peak_blocks_per_request)
      .def_readonly("num_blocks", &GroupPlan::num_blocks)
      .def_readonly("bytes", &GroupPlan::bytes)
      .def("__repr__", [](const GroupPlan& g) {
        std::ostringstream s;
        s << "GroupPlan(" << g.spec.describe() << " x " << g.num_layers
          << ", num_blocks=" << g.num_blocks
          << ", peak_blocks_per_request=" << g.peak_blocks_per_request << ", bytes=" << g.bytes
          << ")";
        return s.str();
      });
  py::class_<KvCachePlan>(m, "KvCachePlan",
                          "How a memory budget is split between a model's groups; pass it to "
                          "HybridKvCache as blocks_per_group.")
      .def_readonly("block_size", &KvCachePlan::block_size)
      .def_readonly("groups", &KvCachePlan::groups)
      .def_readonly("total_bytes", &KvCachePlan::total_bytes)
      .def_readonly("max_concurrent_requests", &KvCachePlan::max_concurrent_requests)
      .def_readonly("peak_bytes_per_request", &KvCachePlan::peak_bytes_per_request)
      .def_readonly("all_full_peak_bytes_per_request",
                    &KvCachePlan::all_full_peak_bytes_per_request)
      .def_readonly("shared_pool_peak_bytes_per_request",
                    &KvCachePlan::shared_pool_peak_bytes_per_request)
      .def_property_readonly("ratio_to_all_full", &KvCachePlan::ratio_to_all_full)
      .def_property_readonly("blocks_per_group",
                             [](const KvCachePlan& p) {
                               std::vector<std::size_t> out;
                               for (const GroupPlan& g : p.groups)
                                 out.push_back(g.num_blocks);
                               return out;
                             })
      .def("__repr__", [](const KvCachePlan& p) {
        std::ostringstream s;
        s << "KvCachePlan(block_size=" << p.block_size << ", groups=" << p.groups.size()
          << ", total_bytes=" << p.total_bytes
          << ", max_concurrent_requests=" << p.max_concurrent_requests
          << ", ratio_to_all_full=" << p.ratio_to_all_full() << ")";
        return s.str();
      });
  m.def(
      "plan_kv_cache",
      [](const std::vector<LayerSpec>& layers, std::size_t block_size, std::size_t budget_bytes,
         std::size_t max_context_tokens, std::size_t max_requests, std::size_t step_tokens,
         std::size_t state_checkpoints) {
        KvCachePlanRequest r;
        r.budget_bytes = budget_bytes;
        r.max_context_tokens = max_context_tokens;
        r.max_requests = max_requests;
        r.step_tokens = step_tokens;
        r.state_checkpoints = state_checkpoints;
        return plan_kv_cache(group_layers(layers, block_size), block_size, r);
      },
      py::arg("layers"), py::arg("block_size"), py::arg("budget_bytes"),
      py::arg("max_context_tokens"), py::kw_only(), py::arg("max_requests") = 0,
      py::arg("step_tokens") = 1, py::arg("state_checkpoints") = 1,
      "Splits budget_bytes between the groups of `layers` in the ratio of their peak need per "
      "request of max_context_tokens (layer-major pools).");

  // ---- HybridKvCache --------------------------------------------------------------------
  py::class_<HybridHitCounters>(m, "HybridHitCounters")
      .def_readonly("lookups", &HybridHitCounters::lookups)
      .def_readonly("lookup_tokens", &HybridHitCounters::lookup_tokens)
      .def_readonly("hit_tokens", &HybridHitCounters::hit_tokens)
      .def_readonly("state_checkpoints", &HybridHitCounters::state_checkpoints)
      .def_property_readonly("hit_rate", &HybridHitCounters::hit_rate)
      .def("__repr__", [](const HybridHitCounters& c) {
        std::ostringstream s;
        s << "HybridHitCounters(lookups=" << c.lookups << ", lookup_tokens=" << c.lookup_tokens
          << ", hit_tokens=" << c.hit_tokens << ", state_checkpoints=" << c.state_checkpoints
          << ")";
        return s.str();
      });

  py::class_<PyHybridCache> hybrid_cache(m, "HybridKvCache",
                                         "A model's KV cache as KV cache groups: one block pool "
                                         "and one prefix cache per group. A context manager.");
  hybrid_cache
      .def(py::init<const std::vector<py::object>&, const py::object&, std::optional<std::size_t>,
                    const std::string&, int, std::size_t, std::optional<bool>>(),
           py::arg("layers"), py::arg("blocks_per_group"), py::kw_only(),
           py::arg("block_size") = py::none(), py::arg("backend") = "host", py::arg("device") = 0,
           py::arg("state_checkpoint_interval") = 1, py::arg("trace") = py::none(),
           "layers: one LayerSpec per model layer. blocks_per_group: one count per group (in "
           "group order) or a KvCachePlan of the same layers. block_size: 16, or the plan's.")
      .def("__enter__", [](const py::object& self) { return self; })
      .def("__exit__", [](PyHybridCache& c, const py::args&) { c.close(); })
      .def("close", &PyHybridCache::close,
           "Detaches this object; the pools are freed once no table, group pool or view uses "
           "them.")
      .def_property_readonly("closed", &PyHybridCache::closed)
      .def("__repr__", &PyHybridCache::repr)
      .def_property_readonly("num_layers",
                             [](const PyHybridCache& c) { return c.cache().num_layers(); })
      .def_property_readonly("num_groups",
                             [](const PyHybridCache& c) { return c.cache().num_groups(); })
      .def_property_readonly("block_size",
                             [](const PyHybridCache& c) { return c.cache().block_size(); })
      .def_property_readonly(
          "state_checkpoint_interval",
          [](const PyHybridCache& c) { return c.cache().config().state_checkpoint_interval; })
      .def_property_readonly("total_bytes",
                             [](const PyHybridCache& c) { return c.cache().total_bytes(); })
      .def_property_readonly("backend",
                             [](const PyHybridCache& c) { return c.state()->backend->name(); })
      .def_property_readonly("layers",
                             [](const PyHybridCache& c) { return c.cache().config().layers; })
      .def_property_readonly("groups",
                             [](const PyHybridCache& c) {
                               std::vector<KvCacheGroup> out;
                               for (std::size_t g = 0; g < c.cache().num_groups(); ++g)
                                 out.push_back(c.cache().group(g));
                               return out;
                             })
      .def(
          "group", [](const PyHybridCache& c, IndexArg g) { return c.cache().group(g); },
          py::arg("group"))
      .def(
          "locate",
          [](const PyHybridCache& c, IndexArg layer) -> std::optional<py::tuple> {
            const std::optional<LayerLocation> at = c.cache().locate(layer);
            if (!at) return std::nullopt;
            return py::make_tuple(at->group, at->index);
          },
          py::arg("layer"),
          "(group, index inside the group's pool) of model layer `layer`; None for a layer "
          "without KV.")
      .def("group_pool", &PyHybridCache::group_pool, py::arg("group"),
           "The group's pool as a PagedKvCache (borrowed): config, pointers, strides, k_pool / "
           "v_pool views, read_block / write_block. Allocation on it raises InvalidArgument: "
           "its blocks belong to the HybridBlockTables.")
      .def(
          "blocks_in_use",
          [](const PyHybridCache& c, IndexArg g) { return c.cache().blocks_in_use(g); },
          py::arg("group"), "Blocks (slots) the group holds for sequences.")
      .def(
          "k_pool",
          [](const PyHybridCache& c, IndexArg layer, bool raw) {
            return c.attention_view(layer, true, raw);
          },
          py::arg("layer"), py::kw_only(), py::arg("raw") = false,
          "Model layer `layer`'s K pool (an attention layer), as PagedKvCache.k_pool.")
      .def(
          "v_pool",
          [](const PyHybridCache& c, IndexArg layer, bool raw) {
            return c.attention_view(layer, false, raw);
          },
          py::arg("layer"), py::kw_only(), py::arg("raw") = false)
      .def("latent_pool", &PyHybridCache::latent_view, py::arg("layer"), py::kw_only(),
           py::arg("raw") = false,
           "An MLA layer's latents: [num_blocks, block_size, kv_lora_rank + rope_dim] of the "
           "dtype (fp8_ds_mla: [num_blocks, block_size, 656] uint8).")
      .def("state_pool", &PyHybridCache::state_view, py::arg("layer"), py::arg("tensor"),
           py::kw_only(), py::arg("raw") = false,
           "A state layer's tensor (by name or index) of every slot: [num_slots, *shape], at "
           "its offset inside the slot, with the slot stride. Slots are "
           "HybridBlockTable.state_slot values.")
      .def("views", &PyHybridCache::views, py::arg("layer"), py::kw_only(), py::arg("raw") = false,
           "Every view of model layer `layer`: {'k', 'v'}, {'latent'}, one per state tensor "
           "name, or {} for a layer without KV.")
      .def_property_readonly("hit_counters",
                             [](const PyHybridCache& c) { return c.cache().hit_counters(); })
      .def("check_invariants", [](const PyHybridCache& c) { return c.cache().check_invariants(); })
      .def("group_invariants",
           [](const PyHybridCache& c) { return c.cache().check_group_invariants(); })
      .def("synchronize", [](const PyHybridCache& c) { c.cache().synchronize(); });
  // KV events: every group, with its group_idx and spec kind, medium "GPU".
  def_events<PyHybridCache>(
      hybrid_cache,
      [](const PyHybridCache& self) {
        HybridState& state = *self.state();
        HybridKvCache& cache = *state.cache;
        return EventsTarget{&state.publisher,
                            [&cache](CacheEventSink* sink) { cache.set_event_sink(sink); },
                            [&cache](CacheEventSink& sink) { cache.snapshot(sink); },
                            [&cache](CacheEventSink& sink) {
                              for (std::size_t g = 0; g < cache.num_groups(); ++g)
                                sink.cleared(cache.group_event_source(g, Medium::gpu));
                            }};
      },
      "HybridKvCache");

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
      .def_property_readonly("tokens",
                             [](const PyHybridTable& t) { return id_list(t.table().tokens()); })
      .def_property_readonly("num_tokens",
                             [](const PyHybridTable& t) { return t.table().num_tokens(); })
      .def_property_readonly("empty", [](const PyHybridTable& t) { return t.table().empty(); })
      .def_property_readonly("copy_on_writes",
                             [](const PyHybridTable& t) { return t.table().copy_on_writes(); })
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
