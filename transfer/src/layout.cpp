// SPDX-License-Identifier: Apache-2.0
#include "kvport/transfer/layout.hpp"

#include <fmt/format.h>
#include <fmt/ranges.h>
#include <xxhash.h>

#include <algorithm>
#include <array>
#include <bitset>
#include <limits>
#include <string_view>

#include "kvport/core/dtype.hpp"
#include "kvport/platform/error.hpp"
#include "wire_codec.hpp"

namespace kvport::transfer {

namespace {

// ---- wire format (docs/transfer.md) ----------------------------------------------------
//
//   offset size  field
//        0    4  magic "KVPL"
//        4    2  version (1: no group list; 2: a group list follows)
//        6    4  num_layers
//       10    4  block_size
//       14    4  num_kv_heads
//       18    4  head_dim_k
//       22    4  head_dim_v
//       26    1  layout (KvCacheLayout)
//       27    4  tp_rank
//       31    4  tp_size
//       35    8  num_blocks
//       43    L  layer dtypes, one byte each (KvCacheDtype)
//   version 2 only, then:
//            4  group count, then per group (write_group): kind, block_size,
//               heads, head dims, dtype, window, chunk, MLA rank/rope/format,
//               the state tensors (name, shape, dtype), the layers with their
//               dtypes.
//
// Every integer is little-endian (wire_codec.hpp). Version 1 is exactly
// 43 + num_layers bytes.
constexpr std::array<std::uint8_t, 4> kMagic = {'K', 'V', 'P', 'L'};
constexpr std::uint16_t kVersionPool = 1;
constexpr std::uint16_t kVersionGroups = 2;
constexpr std::size_t kHeaderBytes = 43;
constexpr std::uint32_t kMaxLayers = 4096;
constexpr std::string_view kDecode = "PoolLayout decode";
constexpr std::string_view kEncode = "PoolLayout encode";

std::uint32_t to_u32(std::size_t v, std::string_view field) {
  if (v > std::numeric_limits<std::uint32_t>::max())
    throw InvalidArgument(fmt::format("pool_layout: {} = {} does not fit 32 bits", field, v));
  return static_cast<std::uint32_t>(v);
}

// a + b and a * b on addresses a peer sent; a wrap is the peer's bug or an
// attack, never a region.
std::uint64_t add_checked(std::uint64_t a, std::uint64_t b) {
  std::uint64_t r = 0;
  if (__builtin_add_overflow(a, b, &r))
    throw InvalidArgument("plan_block_regions: a pool address overflows 64 bits");
  return r;
}
std::uint64_t mul_checked(std::uint64_t a, std::uint64_t b) {
  std::uint64_t r = 0;
  if (__builtin_mul_overflow(a, b, &r))
    throw InvalidArgument("plan_block_regions: a pool address overflows 64 bits");
  return r;
}

// Why `l` is not a usable layout on its own ("here" / "on the peer" in
// `where`), or nullopt.
std::optional<std::string> self_problem(const PoolLayout& l, std::string_view where) {
  if (l.tp_size == 0) return fmt::format("tp_size is 0 {}", where);
  if (l.tp_rank >= l.tp_size)
    return fmt::format("tp_rank {} is not below tp_size {} {}", l.tp_rank, l.tp_size, where);
  if (l.layer_dtypes.size() != l.num_layers) {
    return fmt::format("layer_dtypes has {} entries for {} layers {}", l.layer_dtypes.size(),
                       l.num_layers, where);
  }
  for (std::size_t g = 0; g < l.groups.size(); ++g) {
    if (l.groups[g].layer_dtypes.size() != l.groups[g].layers.size()) {
      return fmt::format("group {} has {} layer dtypes for {} layers {}", g,
                         l.groups[g].layer_dtypes.size(), l.groups[g].layers.size(), where);
    }
  }
  return std::nullopt;
}

// ---- groups on the wire ----------------------------------------------------------------

// A group's context in messages: "group 1 (sliding_window)".
std::string group_name(std::size_t g, LayerKind kind) {
  return fmt::format("group {} ({})", g, to_string(kind));
}

void write_group(wire::Writer& w, const LayoutGroup& group, std::size_t g) {
  const LayerSpec& s = group.spec;
  const std::string where = group_name(g, s.kind);
  auto u32 = [&](std::size_t v, std::string_view field) {
    w.u32(to_u32(v, fmt::format("{} {}", where, field)));
  };
  if (group.layer_dtypes.size() != group.layers.size()) {
    throw InvalidArgument(fmt::format("{}: {}: {} layer dtypes for {} layers", kEncode, where,
                                      group.layer_dtypes.size(), group.layers.size()));
  }
  w.u8(static_cast<std::uint8_t>(s.kind));
  w.u32(group.block_size);
  u32(s.num_kv_heads, "num_kv_heads");
  u32(s.head_dim_k, "head_dim_k");
  u32(s.head_dim_v, "head_dim_v");
  w.u8(static_cast<std::uint8_t>(s.dtype));
  u32(s.window, "window");
  u32(s.chunk, "chunk");
  u32(s.kv_lora_rank, "kv_lora_rank");
  u32(s.rope_dim, "rope_dim");
  w.u8(static_cast<std::uint8_t>(s.mla_format));
  w.count(s.state.size(), kMaxStateTensors, "state tensor count");
  for (const StateTensor& t : s.state) {
    w.str(t.name, kMaxStateTensorName, "state tensor name");
    w.count(t.shape.size(), kMaxStateRank, "state tensor rank");
    for (std::size_t d : t.shape)
      w.u64(d);
    w.u8(static_cast<std::uint8_t>(t.dtype));
  }
  w.count(group.layers.size(), kMaxLayers, "group layer count");
  for (std::size_t i = 0; i < group.layers.size(); ++i) {
    w.u32(group.layers[i]);
    w.u8(static_cast<std::uint8_t>(group.layer_dtypes[i]));
  }
}

// An enum byte, refused past `last`.
template <typename E>
E enum_of(wire::Reader& r, std::string_view field, E last) {
  const std::uint8_t v = r.u8(field);
  if (v > static_cast<std::uint8_t>(last)) r.fail(fmt::format("unknown {} {}", field, v));
  return static_cast<E>(v);
}

KvCacheDtype dtype_of(wire::Reader& r, std::string_view field) {
  const std::uint8_t d = r.u8(field);
  if (d >= all_dtypes().size()) r.fail(fmt::format("unknown {} {}", field, d));
  return static_cast<KvCacheDtype>(d);
}

// Reads group `g`; `seen` marks the model layers earlier groups hold.
LayoutGroup read_group(wire::Reader& r, std::size_t g, std::bitset<kMaxLayers>& seen) {
  LayoutGroup group;
  LayerSpec& s = group.spec;
  s.kind = enum_of(r, "group kind", LayerKind::none);
  const std::string where = group_name(g, s.kind);
  if (s.kind == LayerKind::none) r.fail(fmt::format("{}: a group of layers without KV", where));
  group.block_size = r.u32("group block_size");
  s.num_kv_heads = r.u32("group num_kv_heads");
  s.head_dim_k = r.u32("group head_dim_k");
  s.head_dim_v = r.u32("group head_dim_v");
  s.dtype = dtype_of(r, "group dtype");
  s.window = r.u32("group window");
  s.chunk = r.u32("group chunk");
  s.kv_lora_rank = r.u32("group kv_lora_rank");
  s.rope_dim = r.u32("group rope_dim");
  s.mla_format = enum_of(r, "group mla_format", MlaFormat::fp8_ds_mla);
  // Smallest tensor: an empty name, rank 0, a dtype byte.
  const std::uint32_t tensors = r.count("state tensor count", kMaxStateTensors, 4 + 4 + 1);
  s.state.reserve(tensors);
  for (std::uint32_t t = 0; t < tensors; ++t) {
    StateTensor tensor;
    tensor.name = r.str("state tensor name", kMaxStateTensorName);
    const std::uint32_t rank = r.count("state tensor rank", kMaxStateRank, 8);
    for (std::uint32_t d = 0; d < rank; ++d) {
      const std::uint64_t dim = r.u64("state tensor dim");
      if (dim > std::numeric_limits<std::size_t>::max())
        r.fail(fmt::format("{}: state tensor dim {} does not fit", where, dim));
      tensor.shape.push_back(static_cast<std::size_t>(dim));
    }
    tensor.dtype = enum_of(r, "state tensor dtype", StateDtype::bf16);
    s.state.push_back(std::move(tensor));
  }
  const std::uint32_t layers = r.count("group layer count", kMaxLayers, 4 + 1);
  if (layers == 0) r.fail(fmt::format("{}: no layers", where));
  group.layers.reserve(layers);
  group.layer_dtypes.reserve(layers);
  for (std::uint32_t i = 0; i < layers; ++i) {
    const std::uint32_t layer = r.u32("group layer");
    if (layer >= kMaxLayers) {
      r.fail(fmt::format("{}: layer {} exceeds the limit of {} layers", where, layer, kMaxLayers));
    }
    if (!group.layers.empty() && layer <= group.layers.back())
      r.fail(
          fmt::format("{}: layers out of order ({} after {})", where, layer, group.layers.back()));
    if (seen.test(layer)) r.fail(fmt::format("{}: layer {} is in an earlier group", where, layer));
    seen.set(layer);
    group.layers.push_back(layer);
    group.layer_dtypes.push_back(dtype_of(r, "group layer dtype"));
  }
  if (group.block_size == 0) r.fail(fmt::format("{}: block_size is 0", where));
  try {
    s.validate(group.block_size);
  } catch (const InvalidArgument& e) {
    r.fail(fmt::format("{}: {}", where, e.what()));
  }
  return group;
}

// The first field in which two groups differ, or nullopt.
std::optional<std::string> group_difference(const LayoutGroup& a, const LayoutGroup& b,
                                            std::size_t g) {
  const LayerSpec& x = a.spec;
  const LayerSpec& y = b.spec;
  const std::string where = group_name(g, x.kind);
  auto differs = [&](std::string_view field, const auto& here, const auto& peer) {
    return fmt::format("{}: {} differs: {} here, {} on the peer", where, field, here, peer);
  };
  if (x.kind != y.kind) return differs("kind", to_string(x.kind), to_string(y.kind));
  if (a.block_size != b.block_size) return differs("block_size", a.block_size, b.block_size);
  if (x.num_kv_heads != y.num_kv_heads)
    return differs("num_kv_heads", x.num_kv_heads, y.num_kv_heads);
  if (x.head_dim_k != y.head_dim_k) return differs("head_dim_k", x.head_dim_k, y.head_dim_k);
  if (x.head_dim_v != y.head_dim_v) return differs("head_dim_v", x.head_dim_v, y.head_dim_v);
  if (x.dtype != y.dtype) return differs("dtype", to_string(x.dtype), to_string(y.dtype));
  if (x.window != y.window) return differs("window", x.window, y.window);
  if (x.chunk != y.chunk) return differs("chunk", x.chunk, y.chunk);
  if (x.kv_lora_rank != y.kv_lora_rank)
    return differs("kv_lora_rank", x.kv_lora_rank, y.kv_lora_rank);
  if (x.rope_dim != y.rope_dim) return differs("rope_dim", x.rope_dim, y.rope_dim);
  if (x.mla_format != y.mla_format)
    return differs("mla_format", to_string(x.mla_format), to_string(y.mla_format));
  if (x.state.size() != y.state.size())
    return differs("state tensor count", x.state.size(), y.state.size());
  for (std::size_t t = 0; t < x.state.size(); ++t) {
    const StateTensor& p = x.state[t];
    const StateTensor& q = y.state[t];
    const std::string field = fmt::format("state tensor {}", t);
    if (p.name != q.name) return differs(field + " name", p.name, q.name);
    if (p.shape != q.shape)
      return differs(field + " shape", fmt::format("[{}]", fmt::join(p.shape, ", ")),
                     fmt::format("[{}]", fmt::join(q.shape, ", ")));
    if (p.dtype != q.dtype)
      return differs(field + " dtype", to_string(p.dtype), to_string(q.dtype));
  }
  if (a.layers.size() != b.layers.size())
    return differs("layer count", a.layers.size(), b.layers.size());
  for (std::size_t i = 0; i < a.layers.size(); ++i) {
    if (a.layers[i] != b.layers[i])
      return differs(fmt::format("layer {}", i), a.layers[i], b.layers[i]);
  }
  for (std::size_t i = 0; i < a.layer_dtypes.size() && i < b.layer_dtypes.size(); ++i) {
    if (a.layer_dtypes[i] != b.layer_dtypes[i]) {
      return differs(fmt::format("layer {} dtype", a.layers[i]), to_string(a.layer_dtypes[i]),
                     to_string(b.layer_dtypes[i]));
    }
  }
  return std::nullopt;
}

}  // namespace

KvCacheConfig PoolLayout::to_config() const {
  KvCacheConfig c;
  c.num_layers = num_layers;
  c.block_size = block_size;
  c.num_kv_heads = num_kv_heads;
  c.head_dim_k = head_dim_k;
  c.head_dim_v = head_dim_v;
  c.dtype = layer_dtypes.empty() ? KvCacheDtype::bf16 : layer_dtypes.front();
  c.layer_dtypes = layer_dtypes;
  c.layout = layout;
  return c;
}

std::vector<LayoutGroup> layout_groups(std::span<const KvCacheGroup> groups,
                                       std::size_t block_size) {
  std::vector<LayoutGroup> out;
  out.reserve(groups.size());
  for (std::size_t g = 0; g < groups.size(); ++g) {
    const KvCacheGroup& in = groups[g];
    const std::string where = group_name(g, in.spec.kind);
    if (in.layer_dtypes.size() != in.layers.size()) {
      throw InvalidArgument(fmt::format("layout_groups: {}: {} layer dtypes for {} layers", where,
                                        in.layer_dtypes.size(), in.layers.size()));
    }
    LayoutGroup lg;
    lg.spec = in.spec;
    lg.block_size = to_u32(block_size, where + " block_size");
    for (std::size_t layer : in.layers)
      lg.layers.push_back(to_u32(layer, where + " layer"));
    lg.layer_dtypes = in.layer_dtypes;
    out.push_back(std::move(lg));
  }
  return out;
}

std::vector<LayoutGroup> model_groups(const PoolLayout& layout) {
  if (!layout.groups.empty()) return layout.groups;
  LayoutGroup g;
  g.spec.kind = LayerKind::full_attention;
  g.spec.num_kv_heads = layout.total_kv_heads();
  g.spec.head_dim_k = layout.head_dim_k;
  g.spec.head_dim_v = layout.head_dim_v;
  g.spec.dtype = layout.layer_dtypes.empty() ? KvCacheDtype::bf16 : layout.layer_dtypes.front();
  g.block_size = layout.block_size;
  for (std::uint32_t l = 0; l < layout.num_layers; ++l)
    g.layers.push_back(l);
  g.layer_dtypes = layout.layer_dtypes;
  return {std::move(g)};
}

PoolLayout pool_layout(const PagedKvCache& cache, std::uint32_t tp_rank, std::uint32_t tp_size) {
  if (tp_size == 0) throw InvalidArgument("pool_layout: tp_size must be > 0");
  if (tp_rank >= tp_size) {
    throw InvalidArgument(
        fmt::format("pool_layout: tp_rank {} must be below tp_size {}", tp_rank, tp_size));
  }
  const KvCacheConfig& c = cache.config();
  PoolLayout l;
  l.num_layers = to_u32(c.num_layers, "num_layers");
  l.block_size = to_u32(c.block_size, "block_size");
  l.num_kv_heads = to_u32(c.num_kv_heads, "num_kv_heads");
  l.head_dim_k = to_u32(c.head_dim_k, "head_dim_k");
  l.head_dim_v = to_u32(c.head_dim_v, "head_dim_v");
  l.layer_dtypes.reserve(c.num_layers);
  for (std::size_t layer = 0; layer < c.num_layers; ++layer)
    l.layer_dtypes.push_back(c.dtype_for_layer(layer));
  l.layout = c.layout;
  l.tp_rank = tp_rank;
  l.tp_size = tp_size;
  l.num_blocks = cache.num_blocks();
  return l;
}

std::vector<std::uint8_t> encode(const PoolLayout& layout) {
  if (layout.layer_dtypes.size() != layout.num_layers) {
    throw InvalidArgument(fmt::format("encode: layer_dtypes has {} entries for {} layers",
                                      layout.layer_dtypes.size(), layout.num_layers));
  }
  wire::Writer w(kEncode);
  for (std::uint8_t c : kMagic)  // (raw() of the array trips GCC 12's -Wstringop-overflow)
    w.u8(c);
  w.u16(layout.groups.empty() ? kVersionPool : kVersionGroups);
  w.u32(layout.num_layers);
  w.u32(layout.block_size);
  w.u32(layout.num_kv_heads);
  w.u32(layout.head_dim_k);
  w.u32(layout.head_dim_v);
  w.u8(static_cast<std::uint8_t>(layout.layout));
  w.u32(layout.tp_rank);
  w.u32(layout.tp_size);
  w.u64(layout.num_blocks);
  for (KvCacheDtype d : layout.layer_dtypes)
    w.u8(static_cast<std::uint8_t>(d));
  if (!layout.groups.empty()) {
    w.count(layout.groups.size(), kMaxLayoutGroups, "group count");
    for (std::size_t g = 0; g < layout.groups.size(); ++g)
      write_group(w, layout.groups[g], g);
  }
  return w.take();
}

PoolLayout decode_pool_layout(std::span<const std::uint8_t> bytes) {
  if (bytes.size() < kMagic.size() || !std::equal(kMagic.begin(), kMagic.end(), bytes.begin())) {
    throw InvalidArgument(fmt::format(
        "PoolLayout decode: bad magic (not a pool layout message; {} bytes)", bytes.size()));
  }
  wire::Reader r(bytes, kDecode);
  r.raw(kMagic.size(), "magic");
  const std::uint16_t version = r.u16("version");
  if (version != kVersionPool && version != kVersionGroups) {
    r.fail(fmt::format("unsupported version {} (this build reads versions {} and {})", version,
                       kVersionPool, kVersionGroups));
  }
  PoolLayout l;
  l.num_layers = r.u32("num_layers");
  l.block_size = r.u32("block_size");
  l.num_kv_heads = r.u32("num_kv_heads");
  l.head_dim_k = r.u32("head_dim_k");
  l.head_dim_v = r.u32("head_dim_v");
  const std::uint8_t layout = r.u8("layout");
  l.tp_rank = r.u32("tp_rank");
  l.tp_size = r.u32("tp_size");
  l.num_blocks = r.u64("num_blocks");

  auto zero = [&](std::string_view field) { r.fail(fmt::format("{} is 0", field)); };
  if (l.num_layers == 0) zero("num_layers");
  if (l.num_layers > kMaxLayers) {
    r.fail(fmt::format("num_layers {} exceeds the limit of {}", l.num_layers, kMaxLayers));
  }
  if (l.block_size == 0) zero("block_size");
  if (l.num_kv_heads == 0) zero("num_kv_heads");
  if (l.head_dim_k == 0) zero("head_dim_k");  // head_dim_v 0: K-only layers
  if (l.tp_size == 0) zero("tp_size");
  if (l.num_blocks == 0) zero("num_blocks");
  if (layout > static_cast<std::uint8_t>(KvCacheLayout::block_major))
    r.fail(fmt::format("unknown layout {}", layout));
  l.layout = static_cast<KvCacheLayout>(layout);
  if (l.tp_rank >= l.tp_size)
    r.fail(fmt::format("tp_rank {} is not below tp_size {}", l.tp_rank, l.tp_size));

  // Version 1 is exactly the header and the dtypes; version 2 at least that.
  const std::size_t expected = kHeaderBytes + l.num_layers;
  if (bytes.size() < expected || (version == kVersionPool && bytes.size() != expected)) {
    r.fail(fmt::format("{} message: {} bytes, {} expected for {} layers",
                       bytes.size() < expected ? "truncated" : "overlong", bytes.size(), expected,
                       l.num_layers));
  }
  l.layer_dtypes.reserve(l.num_layers);
  for (std::uint32_t layer = 0; layer < l.num_layers; ++layer) {
    const std::uint8_t d = r.u8("layer dtype");
    if (d >= all_dtypes().size()) r.fail(fmt::format("layer {} has unknown dtype {}", layer, d));
    l.layer_dtypes.push_back(static_cast<KvCacheDtype>(d));
  }
  if (version == kVersionGroups) {
    // Smallest group: the fixed fields (4 x u8, 8 x u32), no tensor, one layer.
    constexpr std::size_t kMinGroupBytes = 4 + 8 * 4 + 4 + 4 + 5;
    const std::uint32_t count = r.count("group count", kMaxLayoutGroups, kMinGroupBytes);
    if (count == 0) r.fail("version 2 with no groups");
    std::bitset<kMaxLayers> seen;
    l.groups.reserve(count);
    for (std::uint32_t g = 0; g < count; ++g)
      l.groups.push_back(read_group(r, g, seen));
    r.expect_end("the last group");
  }
  try {
    l.to_config().validate();  // element groups, byte-size overflow
  } catch (const InvalidArgument& e) {
    r.fail(e.what());
  }
  return l;
}

std::uint64_t compatibility_hash(const PoolLayout& layout) {
  // A canonical encoding of exactly the fields peers must share; the version
  // byte keeps hashes of a later rule set apart.
  wire::Writer w("compatibility_hash");
  w.u8(1);
  w.u32(layout.num_layers);
  w.u32(layout.block_size);
  w.u32(layout.head_dim_k);
  w.u32(layout.head_dim_v);
  w.u64(layout.total_kv_heads());
  w.u32(static_cast<std::uint32_t>(layout.layer_dtypes.size()));
  for (KvCacheDtype d : layout.layer_dtypes)
    w.u8(static_cast<std::uint8_t>(d));
  if (!layout.groups.empty()) {
    w.u32(static_cast<std::uint32_t>(layout.groups.size()));
    for (std::size_t g = 0; g < layout.groups.size(); ++g)
      write_group(w, layout.groups[g], g);
  }
  return XXH3_64bits(w.data().data(), w.data().size());
}

std::optional<std::string> incompatibility(const PoolLayout& local, const PoolLayout& remote) {
  if (auto p = self_problem(local, "here")) return p;
  if (auto p = self_problem(remote, "on the peer")) return p;
  auto differs = [](std::string_view field, auto here, auto peer) {
    return fmt::format("{} differs: {} here, {} on the peer", field, here, peer);
  };
  if (local.num_layers != remote.num_layers)
    return differs("num_layers", local.num_layers, remote.num_layers);
  if (local.block_size != remote.block_size)
    return differs("block_size", local.block_size, remote.block_size);
  if (local.head_dim_k != remote.head_dim_k)
    return differs("head_dim_k", local.head_dim_k, remote.head_dim_k);
  if (local.head_dim_v != remote.head_dim_v)
    return differs("head_dim_v", local.head_dim_v, remote.head_dim_v);
  if (local.total_kv_heads() != remote.total_kv_heads()) {
    return fmt::format(
        "total kv heads differ: {} here ({} x tp_size {}), {} on the peer ({} x tp_size {})",
        local.total_kv_heads(), local.num_kv_heads, local.tp_size, remote.total_kv_heads(),
        remote.num_kv_heads, remote.tp_size);
  }
  for (std::size_t layer = 0; layer < local.layer_dtypes.size(); ++layer) {
    if (local.layer_dtypes[layer] != remote.layer_dtypes[layer]) {
      return fmt::format("layer {} dtype differs: {} here, {} on the peer", layer,
                         to_string(local.layer_dtypes[layer]),
                         to_string(remote.layer_dtypes[layer]));
    }
  }
  const std::vector<LayoutGroup> mine = model_groups(local);
  const std::vector<LayoutGroup> theirs = model_groups(remote);
  if (mine.size() != theirs.size()) return differs("group count", mine.size(), theirs.size());
  for (std::size_t g = 0; g < mine.size(); ++g) {
    if (auto d = group_difference(mine[g], theirs[g], g)) return d;
  }
  // total_kv_heads is num_kv_heads * tp_size, so each side's TP size divides
  // it by construction; checked anyway against a peer's future encodings.
  if (local.total_kv_heads() % local.tp_size != 0 ||
      remote.total_kv_heads() % remote.tp_size != 0) {
    return fmt::format("tp_size {} here / {} on the peer does not divide the {} total kv heads",
                       local.tp_size, remote.tp_size, local.total_kv_heads());
  }
  if (local.tp_size != remote.tp_size &&
      (local.layout != KvCacheLayout::layer_major || remote.layout != KvCacheLayout::layer_major)) {
    return fmt::format(
        "tensor-parallel head slicing needs the layer-major layout on both sides: tp_size {} "
        "({}) here, tp_size {} ({}) on the peer",
        local.tp_size, to_string(local.layout), remote.tp_size, to_string(remote.layout));
  }
  return std::nullopt;
}

PoolAddresses pool_addresses(const PagedKvCache& cache) {
  PoolAddresses a;
  const std::size_t n = cache.num_layers();
  a.k_base.reserve(n);
  a.v_base.reserve(n);
  a.k_stride.reserve(n);
  a.v_stride.reserve(n);
  const bool has_v = cache.config().has_v();
  for (std::size_t layer = 0; layer < n; ++layer) {
    const BlockPool& k = cache.pool(layer, KvPart::k);
    a.k_base.push_back(k.base.address());
    a.k_stride.push_back(k.stride);
    // K-only layers: no V pool, 0 in the vectors (the planner never reads them).
    a.v_base.push_back(has_v ? cache.pool(layer, KvPart::v).base.address() : 0);
    a.v_stride.push_back(has_v ? cache.pool(layer, KvPart::v).stride : 0);
  }
  return a;
}

std::optional<HeadRange> head_overlap(const PoolLayout& local, const PoolLayout& remote) {
  const std::uint64_t l0 = std::uint64_t{local.tp_rank} * local.num_kv_heads;
  const std::uint64_t r0 = std::uint64_t{remote.tp_rank} * remote.num_kv_heads;
  const std::uint64_t first = std::max(l0, r0);
  const std::uint64_t end = std::min(l0 + local.num_kv_heads, r0 + remote.num_kv_heads);
  if (end <= first) return std::nullopt;
  return HeadRange{first, end - first};
}

namespace {

void check_addresses(const PoolAddresses& a, std::uint32_t num_layers, std::string_view side) {
  auto check = [&](const std::vector<std::uint64_t>& v, std::string_view name) {
    if (v.size() != num_layers) {
      throw InvalidArgument(
          fmt::format("plan_block_regions: {} pool addresses have {} {} entries for {} layers",
                      side, v.size(), name, num_layers));
    }
  };
  check(a.k_base, "k_base");
  check(a.v_base, "v_base");
  check(a.k_stride, "k_stride");
  check(a.v_stride, "v_stride");
}

void check_ids(std::span<const BlockId> ids, std::uint64_t num_blocks, std::string_view side) {
  for (std::size_t i = 0; i < ids.size(); ++i) {
    if (ids[i] >= num_blocks) {
      throw InvalidArgument(
          fmt::format("plan_block_regions: {} block id {} (entry {}) is out of range ({} blocks)",
                      side, ids[i], i, num_blocks));
    }
  }
}

// One K or V pool of one layer on one side, and where a region of it starts.
struct PoolSide {
  std::uint64_t base;
  std::uint64_t stride;
  std::uint64_t block_address(BlockId id) const {
    return add_checked(base, mul_checked(id, stride));
  }
};

// The byte ranges one block's K (or V) region contributes: offsets inside the
// region on each side and a length. One range (the whole region) with equal
// TP sizes; a data range and, for dtypes with scales, a scale range otherwise.
struct Slice {
  std::uint64_t local_offset;
  std::uint64_t remote_offset;
  std::uint64_t bytes;
};

// Appends `r`, merged into the previous region when it continues it on both
// sides.
void emit(std::vector<TransferRegion>& out, TransferRegion r) {
  if (!out.empty()) {
    TransferRegion& last = out.back();
    if (last.local + last.bytes == r.local && last.remote + last.bytes == r.remote) {
      last.bytes += r.bytes;
      return;
    }
  }
  out.push_back(r);
}

}  // namespace

std::vector<TransferRegion> plan_block_regions(const PoolLayout& local,
                                           const PoolAddresses& local_pools,
                                           std::span<const BlockId> local_blocks,
                                           const PoolLayout& remote,
                                           const PoolAddresses& remote_pools,
                                           std::span<const BlockId> remote_blocks) {
  // ---- validate everything first -------------------------------------------------------
  if (auto why = incompatibility(local, remote))
    throw InvalidArgument(fmt::format("plan_block_regions: incompatible layouts: {}", *why));
  if (local_blocks.size() != remote_blocks.size()) {
    throw InvalidArgument(fmt::format(
        "plan_block_regions: {} local block ids but {} remote ones (one remote id per local id)",
        local_blocks.size(), remote_blocks.size()));
  }
  check_addresses(local_pools, local.num_layers, "local");
  check_addresses(remote_pools, remote.num_layers, "remote");
  check_ids(local_blocks, local.num_blocks, "local");
  check_ids(remote_blocks, remote.num_blocks, "remote");
  const std::optional<HeadRange> heads = head_overlap(local, remote);
  if (!heads) {
    throw InvalidArgument(fmt::format(
        "plan_block_regions: no common heads: global heads [{}, {}) here, [{}, {}) on the peer",
        std::uint64_t{local.tp_rank} * local.num_kv_heads,
        std::uint64_t{local.tp_rank + 1} * local.num_kv_heads,
        std::uint64_t{remote.tp_rank} * remote.num_kv_heads,
        std::uint64_t{remote.tp_rank + 1} * remote.num_kv_heads));
  }
  if (local_blocks.empty()) return {};
  const bool sliced = local.tp_size != remote.tp_size;

  // ---- per layer, K and V: the slices of one block's region ----------------------------
  // One plan per layer and part (K alone for K-only layers), in that order;
  // at most two slices each: data, scales.
  struct LayerPlan {
    PoolSide local, remote;
    std::array<Slice, 2> slices;
    std::size_t count;
  };
  std::vector<LayerPlan> plans;
  plans.reserve(2 * std::size_t{local.num_layers});
  for (std::uint32_t layer = 0; layer < local.num_layers; ++layer) {
    for (KvPart part : kKvParts) {
      if (part == KvPart::v && !local.has_v()) continue;  // K-only (the peer too: compatible)
      const bool k = part == KvPart::k;
      const std::uint32_t head_dim = k ? local.head_dim_k : local.head_dim_v;
      const char* what = k ? "head_dim_k" : "head_dim_v";
      const KvCacheDtype dtype = local.layer_dtypes[layer];
      const BlockRegionLayout lr =
          block_region_layout(dtype, local.block_size, local.num_kv_heads, head_dim, what);
      const BlockRegionLayout rr =
          block_region_layout(dtype, remote.block_size, remote.num_kv_heads, head_dim, what);
      LayerPlan p{};
      const PoolAddresses::Pool lp = local_pools.at(layer, part);
      const PoolAddresses::Pool rp = remote_pools.at(layer, part);
      p.local = PoolSide{lp.base, lp.stride};
      p.remote = PoolSide{rp.base, rp.stride};
      if (!sliced) {
        p.slices[0] = Slice{0, 0, lr.total_bytes};
        p.count = 1;
      } else {
        // Head-major regions: a head's data (and scales) are one contiguous
        // range, at the same per-head size on both sides.
        const std::uint64_t data_per_head = lr.data_bytes / local.num_kv_heads;
        const std::uint64_t scale_per_head = lr.scale_bytes / local.num_kv_heads;
        const std::uint64_t lh = heads->first - std::uint64_t{local.tp_rank} * local.num_kv_heads;
        const std::uint64_t rh = heads->first - std::uint64_t{remote.tp_rank} * remote.num_kv_heads;
        p.slices[0] = Slice{lh * data_per_head, rh * data_per_head, heads->count * data_per_head};
        p.count = 1;
        if (scale_per_head != 0) {
          p.slices[1] = Slice{lr.scale_offset + lh * scale_per_head,
                              rr.scale_offset + rh * scale_per_head, heads->count * scale_per_head};
          p.count = 2;
        }
      }
      plans.push_back(p);
    }
  }

  // ---- emit: in the order that makes the local side contiguous -------------------------
  // Block-major: a block's layers are consecutive in memory, so (block, layer,
  // K, V) order merges a run of consecutive blocks into one region when the
  // peer is block-major too. Layer-major: a pool's consecutive blocks are
  // consecutive, so (layer, K/V, block) order merges a run of ids into one
  // region per pool. Any order is correct: merging only joins regions that
  // are adjacent on both sides.
  std::vector<TransferRegion> out;
  auto emit_block = [&](const LayerPlan& p, std::size_t i) {
    const std::uint64_t l = p.local.block_address(local_blocks[i]);
    const std::uint64_t r = p.remote.block_address(remote_blocks[i]);
    for (std::size_t s = 0; s < p.count; ++s) {
      const Slice& slice = p.slices[s];
      if (slice.bytes == 0) continue;
      emit(out, TransferRegion{add_checked(l, slice.local_offset), add_checked(r, slice.remote_offset),
                           slice.bytes});
    }
  };
  if (local.layout == KvCacheLayout::block_major) {
    out.reserve(local_blocks.size());
    for (std::size_t i = 0; i < local_blocks.size(); ++i)
      for (const LayerPlan& p : plans)
        emit_block(p, i);
  } else {
    out.reserve(plans.size());
    for (const LayerPlan& p : plans)
      for (std::size_t i = 0; i < local_blocks.size(); ++i)
        emit_block(p, i);
  }
  // Every region's end must fit too, or a consumer adding bytes would wrap.
  for (const TransferRegion& r : out) {
    (void)add_checked(r.local, r.bytes);
    (void)add_checked(r.remote, r.bytes);
  }
  return out;
}

std::uint64_t total_bytes(std::span<const TransferRegion> regions) noexcept {
  std::uint64_t total = 0;
  for (const TransferRegion& r : regions)
    total += r.bytes;
  return total;
}

}  // namespace kvport::transfer
