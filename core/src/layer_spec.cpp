// SPDX-License-Identifier: Apache-2.0
#include "kvport/core/layer_spec.hpp"

#include <fmt/format.h>

#include <limits>
#include <utility>

#include "kvport/platform/div_ceil.hpp"
#include "kvport/platform/error.hpp"
#include "kvport/platform/size_math.hpp"

namespace kvport {
namespace {

// fp8_ds_mla keeps one fp32 scale per this many latent values.
constexpr std::size_t kDsMlaScaleGroup = 128;

std::size_t checked_mul(std::size_t a, std::size_t b, std::string_view what) {
  if (mul_overflows(a, b)) {
    throw InvalidArgument(fmt::format("LayerSpec: {} overflows size_t ({} x {})", what, a, b));
  }
  return a * b;
}

std::size_t checked_add(std::size_t a, std::size_t b, std::string_view what) {
  if (add_overflows(a, b)) {
    throw InvalidArgument(fmt::format("LayerSpec: {} overflows size_t ({} + {})", what, a, b));
  }
  return a + b;
}

std::size_t align_up(std::size_t bytes, std::string_view what) {
  return checked_mul(div_ceil(bytes, kRegionAlignment), kRegionAlignment, what);
}

void require(bool ok, std::string_view kind, std::string_view field) {
  if (!ok) throw InvalidArgument(fmt::format("LayerSpec({}): {} must be > 0", kind, field));
}

bool is_attention(LayerKind kind) {
  return kind == LayerKind::full_attention || kind == LayerKind::sliding_window ||
         kind == LayerKind::chunked_local;
}

std::size_t ds_mla_token_bytes(std::size_t rank, std::size_t rope) {
  const std::size_t scales = checked_mul(rank / kDsMlaScaleGroup, 4, "fp8_ds_mla scales");
  return checked_add(checked_add(rank, scales, "fp8_ds_mla bytes"),
                     checked_mul(rope, 2, "fp8_ds_mla rope bytes"), "fp8_ds_mla bytes");
}

std::string shape_text(const std::vector<std::size_t>& shape) {
  std::string out;
  for (std::size_t i = 0; i < shape.size(); ++i) {
    if (i > 0) out += 'x';
    out += std::to_string(shape[i]);
  }
  return out;
}

}  // namespace

std::string_view to_string(LayerKind kind) noexcept {
  switch (kind) {
    case LayerKind::full_attention:
      return "full_attention";
    case LayerKind::mla:
      return "mla_attention";
    case LayerKind::sliding_window:
      return "sliding_window";
    case LayerKind::chunked_local:
      return "chunked_local";
    case LayerKind::state:
      return "mamba";
    case LayerKind::none:
      return "none";
  }
  return "unknown";
}

std::optional<LayerKind> parse_layer_kind(std::string_view name) noexcept {
  for (LayerKind k : {LayerKind::full_attention, LayerKind::mla, LayerKind::sliding_window,
                      LayerKind::chunked_local, LayerKind::state, LayerKind::none}) {
    if (name == to_string(k)) return k;
  }
  if (name == "mla") return LayerKind::mla;
  if (name == "state") return LayerKind::state;
  return std::nullopt;
}

std::string_view to_string(StateDtype dtype) noexcept {
  switch (dtype) {
    case StateDtype::f32:
      return "f32";
    case StateDtype::f16:
      return "f16";
    case StateDtype::bf16:
      return "bf16";
  }
  return "unknown";
}

std::optional<StateDtype> parse_state_dtype(std::string_view name) noexcept {
  if (name == "f32" || name == "float32" || name == "fp32") return StateDtype::f32;
  if (name == "f16" || name == "float16" || name == "fp16") return StateDtype::f16;
  if (name == "bf16" || name == "bfloat16") return StateDtype::bf16;
  return std::nullopt;
}

std::size_t state_dtype_bytes(StateDtype dtype) noexcept {
  return dtype == StateDtype::f32 ? 4 : 2;
}

std::size_t StateTensor::num_elements() const {
  if (shape.empty()) {
    throw InvalidArgument(fmt::format("StateTensor '{}': the shape is empty", name));
  }
  std::size_t n = 1;
  for (std::size_t i = 0; i < shape.size(); ++i) {
    if (shape[i] == 0) {
      throw InvalidArgument(
          fmt::format("StateTensor '{}': dimension {} is 0 (shape {}); every dimension must be > 0",
                      name, i, shape_text(shape)));
    }
    n = checked_mul(n, shape[i], "state tensor elements");
  }
  return n;
}

std::size_t StateTensor::bytes() const {
  return checked_mul(num_elements(), state_dtype_bytes(dtype), "state tensor bytes");
}

std::string_view to_string(MlaFormat format) noexcept {
  switch (format) {
    case MlaFormat::plain:
      return "plain";
    case MlaFormat::fp8_ds_mla:
      return "fp8_ds_mla";
  }
  return "unknown";
}

LayerSpec LayerSpec::full_attention(std::size_t num_kv_heads, std::size_t head_dim_k,
                                    std::size_t head_dim_v, KvCacheDtype dtype) {
  LayerSpec s;
  s.kind = LayerKind::full_attention;
  s.num_kv_heads = num_kv_heads;
  s.head_dim_k = head_dim_k;
  s.head_dim_v = head_dim_v;
  s.dtype = dtype;
  return s;
}

LayerSpec LayerSpec::sliding_window(std::size_t window, std::size_t num_kv_heads,
                                    std::size_t head_dim_k, std::size_t head_dim_v,
                                    KvCacheDtype dtype) {
  LayerSpec s = full_attention(num_kv_heads, head_dim_k, head_dim_v, dtype);
  s.kind = LayerKind::sliding_window;
  s.window = window;
  return s;
}

LayerSpec LayerSpec::chunked_local(std::size_t chunk, std::size_t num_kv_heads,
                                   std::size_t head_dim_k, std::size_t head_dim_v,
                                   KvCacheDtype dtype) {
  LayerSpec s = full_attention(num_kv_heads, head_dim_k, head_dim_v, dtype);
  s.kind = LayerKind::chunked_local;
  s.chunk = chunk;
  return s;
}

LayerSpec LayerSpec::mla(std::size_t kv_lora_rank, std::size_t rope_dim, KvCacheDtype dtype,
                         MlaFormat format) {
  LayerSpec s;
  s.kind = LayerKind::mla;
  s.kv_lora_rank = kv_lora_rank;
  s.rope_dim = rope_dim;
  s.mla_format = format;
  // The fp8_ds_mla format fixes its element types; keep one canonical dtype
  // so that equal layers compare equal.
  s.dtype = format == MlaFormat::fp8_ds_mla ? KvCacheDtype::fp8_e4m3 : dtype;
  return s;
}

LayerSpec LayerSpec::recurrent_state(std::vector<StateTensor> tensors) {
  LayerSpec s;
  s.kind = LayerKind::state;
  s.state = std::move(tensors);
  return s;
}

LayerSpec LayerSpec::no_kv() {
  LayerSpec s;
  s.kind = LayerKind::none;
  return s;
}

bool LayerSpec::has_blocks() const noexcept {
  return is_attention(kind) || kind == LayerKind::mla;
}

void LayerSpec::validate(std::size_t block_size) const {
  const std::string_view k = to_string(kind);
  if (block_size == 0) throw InvalidArgument("LayerSpec: block_size must be > 0");
  switch (kind) {
    case LayerKind::full_attention:
    case LayerKind::sliding_window:
    case LayerKind::chunked_local:
      require(num_kv_heads > 0, k, "num_kv_heads");
      require(head_dim_k > 0, k, "head_dim_k");
      require(head_dim_v > 0, k, "head_dim_v");
      if (kind == LayerKind::sliding_window) require(window > 0, k, "window");
      if (kind == LayerKind::chunked_local) {
        require(chunk > 0, k, "chunk");
        if (chunk % block_size != 0) {
          throw InvalidArgument(fmt::format(
              "LayerSpec(chunked_local): chunk {} is not a multiple of the block size {} (chunk "
              "boundaries must fall on block boundaries)",
              chunk, block_size));
        }
      }
      break;
    case LayerKind::mla:
      require(kv_lora_rank > 0, k, "kv_lora_rank");
      if (mla_format == MlaFormat::fp8_ds_mla && kv_lora_rank % kDsMlaScaleGroup != 0) {
        throw InvalidArgument(fmt::format(
            "LayerSpec(mla_attention): fp8_ds_mla needs kv_lora_rank to be a multiple of {} (one "
            "scale per {} values), got {}",
            kDsMlaScaleGroup, kDsMlaScaleGroup, kv_lora_rank));
      }
      (void)checked_add(kv_lora_rank, rope_dim, "kv_lora_rank + rope_dim");
      break;
    case LayerKind::state:
      if (state.empty()) {
        throw InvalidArgument("LayerSpec(mamba): a state layer needs at least one state tensor");
      }
      // The names address the tensors (state_offset by name in the bindings,
      // the engine's views): two of one name would make one unreachable.
      for (std::size_t i = 1; i < state.size(); ++i) {
        for (std::size_t j = 0; j < i; ++j) {
          if (state[i].name == state[j].name) {
            throw InvalidArgument(fmt::format(
                "LayerSpec(mamba): state tensors {} and {} are both named '{}' (names must be "
                "unique)",
                j, i, state[i].name));
          }
        }
      }
      break;
    case LayerKind::none:
      return;
  }
  if (has_blocks()) {
    (void)block_bytes(block_size);  // dtype groups and overflow
  } else {
    (void)state_bytes();
  }
}

KvCacheConfig LayerSpec::pool_config(std::size_t num_layers, std::size_t block_size,
                                     KvCacheLayout layout) const {
  KvCacheConfig c;
  c.num_layers = num_layers;
  c.block_size = block_size;
  c.layout = layout;
  c.dtype = dtype;
  switch (kind) {
    case LayerKind::full_attention:
    case LayerKind::sliding_window:
    case LayerKind::chunked_local:
      c.num_kv_heads = num_kv_heads;
      c.head_dim_k = head_dim_k;
      c.head_dim_v = head_dim_v;
      return c;
    case LayerKind::mla:
      c.num_kv_heads = 1;
      c.head_dim_v = 0;
      if (mla_format == MlaFormat::fp8_ds_mla) {
        c.dtype = KvCacheDtype::fp8_e4m3;
        c.head_dim_k = ds_mla_token_bytes(kv_lora_rank, rope_dim);
      } else {
        c.head_dim_k = checked_add(kv_lora_rank, rope_dim, "kv_lora_rank + rope_dim");
      }
      return c;
    case LayerKind::state:
      c.block_size = 1;
      c.num_kv_heads = 1;
      c.dtype = KvCacheDtype::fp8_e4m3;
      c.head_dim_k = state_bytes();
      c.head_dim_v = 0;
      return c;
    case LayerKind::none:
      break;
  }
  throw InvalidArgument("LayerSpec::pool_config: a layer without KV has no pool");
}

std::size_t LayerSpec::block_bytes(std::size_t block_size) const {
  switch (kind) {
    case LayerKind::full_attention:
    case LayerKind::sliding_window:
    case LayerKind::chunked_local:
      return checked_add(
          block_region_layout(dtype, block_size, num_kv_heads, head_dim_k, "head_dim_k")
              .total_bytes,
          block_region_layout(dtype, block_size, num_kv_heads, head_dim_v, "head_dim_v")
              .total_bytes,
          "block bytes");
    case LayerKind::mla: {
      const KvCacheConfig c = pool_config(1, block_size);
      return block_region_layout(c.dtype, block_size, 1, c.head_dim_k, "kv_lora_rank + rope_dim")
          .total_bytes;
    }
    case LayerKind::state:
    case LayerKind::none:
      return 0;
  }
  return 0;
}

std::size_t LayerSpec::token_bytes(std::size_t block_size) const {
  if (!has_blocks()) return 0;
  auto unpadded = [&](std::size_t heads, std::size_t dim, KvCacheDtype d, const char* what) {
    const BlockRegionLayout l = block_region_layout(d, block_size, heads, dim, what);
    return l.data_bytes + l.scale_bytes;
  };
  std::size_t per_block = 0;
  if (kind == LayerKind::mla) {
    const KvCacheConfig c = pool_config(1, block_size);
    per_block = unpadded(1, c.head_dim_k, c.dtype, "kv_lora_rank + rope_dim");
  } else {
    per_block = checked_add(unpadded(num_kv_heads, head_dim_k, dtype, "head_dim_k"),
                            unpadded(num_kv_heads, head_dim_v, dtype, "head_dim_v"), "bytes");
  }
  return div_ceil(per_block, block_size);
}

std::size_t LayerSpec::state_bytes() const {
  if (kind != LayerKind::state) return 0;
  std::size_t total = 0;
  for (const StateTensor& t : state)
    total = checked_add(total, align_up(t.bytes(), "state bytes"), "state bytes");
  return total;
}

std::size_t LayerSpec::state_offset(std::size_t i) const {
  if (kind != LayerKind::state || i >= state.size()) {
    throw OutOfRange(
        fmt::format("LayerSpec::state_offset: no state tensor {} ({} tensors)", i, state.size()));
  }
  std::size_t offset = 0;
  for (std::size_t j = 0; j < i; ++j)
    offset += align_up(state[j].bytes(), "state bytes");
  return offset;
}

std::string LayerSpec::describe() const {
  const std::string heads = head_dim_k == head_dim_v
                                ? fmt::format("{}x{}", num_kv_heads, head_dim_k)
                                : fmt::format("{}x{}/{}", num_kv_heads, head_dim_k, head_dim_v);
  switch (kind) {
    case LayerKind::full_attention:
      return fmt::format("full_attention {} {}", heads, to_string(dtype));
    case LayerKind::sliding_window:
      return fmt::format("sliding_window({}) {} {}", window, heads, to_string(dtype));
    case LayerKind::chunked_local:
      return fmt::format("chunked_local({}) {} {}", chunk, heads, to_string(dtype));
    case LayerKind::mla:
      if (mla_format == MlaFormat::fp8_ds_mla)
        return fmt::format("mla({}+{}) fp8_ds_mla", kv_lora_rank, rope_dim);
      return fmt::format("mla({}+{}) {}", kv_lora_rank, rope_dim, to_string(dtype));
    case LayerKind::state: {
      std::string out = "state(";
      for (std::size_t i = 0; i < state.size(); ++i) {
        if (i > 0) out += ", ";
        out += fmt::format("{} {} {}", state[i].name, shape_text(state[i].shape),
                           to_string(state[i].dtype));
      }
      return out + ")";
    }
    case LayerKind::none:
      return "none";
  }
  return "unknown";
}

LayerSpec LayerSpec::as_full_attention() const {
  if (kind != LayerKind::sliding_window && kind != LayerKind::chunked_local) return *this;
  return full_attention(num_kv_heads, head_dim_k, head_dim_v, dtype);
}

bool LayerSpec::same_group_as(const LayerSpec& o) const noexcept {
  if (kind != o.kind) return false;
  switch (kind) {
    case LayerKind::full_attention:
    case LayerKind::sliding_window:
    case LayerKind::chunked_local:
      return num_kv_heads == o.num_kv_heads && head_dim_k == o.head_dim_k &&
             head_dim_v == o.head_dim_v && window == o.window && chunk == o.chunk;
    case LayerKind::mla:
      return kv_lora_rank == o.kv_lora_rank && rope_dim == o.rope_dim && mla_format == o.mla_format;
    case LayerKind::state:
      return state == o.state;
    case LayerKind::none:
      return true;
  }
  return false;
}

std::vector<KvCacheGroup> group_layers(std::span<const LayerSpec> layers, std::size_t block_size,
                                       std::size_t max_layers_per_group) {
  if (layers.empty()) throw InvalidArgument("group_layers: the model has no layers");
  std::vector<KvCacheGroup> groups;
  for (std::size_t i = 0; i < layers.size(); ++i) {
    const LayerSpec& spec = layers[i];
    try {
      spec.validate(block_size);
    } catch (const InvalidArgument& e) {
      throw InvalidArgument(fmt::format("layer {}: {}", i, e.what()));
    }
    if (spec.kind == LayerKind::none) continue;
    KvCacheGroup* group = nullptr;
    for (KvCacheGroup& g : groups) {
      if (g.spec.same_group_as(spec) &&
          (max_layers_per_group == 0 || g.layers.size() < max_layers_per_group)) {
        group = &g;
        break;
      }
    }
    if (group == nullptr) {
      groups.push_back(KvCacheGroup{spec, {}, {}});
      group = &groups.back();
    }
    group->layers.push_back(i);
    group->layer_dtypes.push_back(spec.dtype);
  }
  if (groups.empty()) {
    throw InvalidArgument("group_layers: no layer keeps KV or state (every layer is 'none')");
  }
  return groups;
}

KvCacheConfig group_pool_config(const KvCacheGroup& group, std::size_t block_size,
                                KvCacheLayout layout) {
  KvCacheConfig c = group.spec.pool_config(group.layers.size(), block_size, layout);
  const bool per_layer_dtype =
      group.spec.kind != LayerKind::state &&
      !(group.spec.kind == LayerKind::mla && group.spec.mla_format == MlaFormat::fp8_ds_mla);
  if (per_layer_dtype) {
    bool uniform = true;
    for (KvCacheDtype d : group.layer_dtypes)
      uniform = uniform && d == group.spec.dtype;
    if (!uniform) c.layer_dtypes = group.layer_dtypes;
  }
  return c;
}

std::vector<LayerSpec> layer_specs_of(const KvCacheConfig& config) {
  std::vector<LayerSpec> out;
  out.reserve(config.num_layers);
  for (std::size_t i = 0; i < config.num_layers; ++i) {
    out.push_back(LayerSpec::full_attention(config.num_kv_heads, config.head_dim_k,
                                            config.head_dim_v, config.dtype_for_layer(i)));
  }
  return out;
}

}  // namespace kvport
