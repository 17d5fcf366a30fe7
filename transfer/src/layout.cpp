#include "kvport/transfer/layout.hpp"

#include <fmt/format.h>
#include <xxhash.h>

#include <algorithm>
#include <array>
#include <limits>
#include <string_view>

#include "kvport/core/dtype.hpp"
#include "kvport/platform/error.hpp"

namespace kvport::transfer {

namespace {

// ---- wire format -----------------------------------------------------------------------
//
//   offset size  field
//        0    4  magic "KVPL"
//        4    2  version (1)
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
//
// Every integer is little-endian. The message is exactly 43 + num_layers bytes.
constexpr std::array<std::uint8_t, 4> kMagic = {'K', 'V', 'P', 'L'};
constexpr std::uint16_t kVersion = 1;
constexpr std::size_t kHeaderBytes = 43;
constexpr std::uint32_t kMaxLayers = 4096;

class Writer {
 public:
  explicit Writer(std::vector<std::uint8_t>& out) : out_(&out) {}
  void u8(std::uint8_t v) { out_->push_back(v); }
  void u16(std::uint16_t v) { put(v, 2); }
  void u32(std::uint32_t v) { put(v, 4); }
  void u64(std::uint64_t v) { put(v, 8); }

 private:
  void put(std::uint64_t v, int bytes) {
    for (int i = 0; i < bytes; ++i)
      out_->push_back(static_cast<std::uint8_t>(v >> (8 * i)));
  }
  std::vector<std::uint8_t>* out_;
};

// Reads little-endian integers from a span; every read is bounds-checked and
// a short read throws naming the field.
class Reader {
 public:
  explicit Reader(std::span<const std::uint8_t> bytes) : bytes_(bytes) {}
  std::uint8_t u8(const char* field) { return static_cast<std::uint8_t>(get(1, field)); }
  std::uint16_t u16(const char* field) { return static_cast<std::uint16_t>(get(2, field)); }
  std::uint32_t u32(const char* field) { return static_cast<std::uint32_t>(get(4, field)); }
  std::uint64_t u64(const char* field) { return get(8, field); }
  std::size_t position() const noexcept { return pos_; }

 private:
  std::uint64_t get(std::size_t n, const char* field) {
    if (bytes_.size() - pos_ < n) {
      throw InvalidArgument(fmt::format(
          "PoolLayout decode: truncated message ({} bytes) while reading {} at offset {}",
          bytes_.size(), field, pos_));
    }
    std::uint64_t v = 0;
    for (std::size_t i = 0; i < n; ++i)
      v |= std::uint64_t{bytes_[pos_ + i]} << (8 * i);
    pos_ += n;
    return v;
  }
  std::span<const std::uint8_t> bytes_;
  std::size_t pos_ = 0;
};

std::uint32_t to_u32(std::size_t v, const char* field) {
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
  std::vector<std::uint8_t> out;
  out.reserve(kHeaderBytes + layout.layer_dtypes.size());
  out.insert(out.end(), kMagic.begin(), kMagic.end());
  Writer w(out);
  w.u16(kVersion);
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
  return out;
}

PoolLayout decode_pool_layout(std::span<const std::uint8_t> bytes) {
  if (bytes.size() < kMagic.size() || !std::equal(kMagic.begin(), kMagic.end(), bytes.begin())) {
    throw InvalidArgument(fmt::format(
        "PoolLayout decode: bad magic (not a pool layout message; {} bytes)", bytes.size()));
  }
  Reader r(bytes.subspan(kMagic.size()));
  const std::uint16_t version = r.u16("version");
  if (version != kVersion) {
    throw InvalidArgument(
        fmt::format("PoolLayout decode: unsupported version {} (this build reads version {})",
                    version, kVersion));
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

  auto zero = [](const char* field) {
    throw InvalidArgument(fmt::format("PoolLayout decode: {} is 0", field));
  };
  if (l.num_layers == 0) zero("num_layers");
  if (l.num_layers > kMaxLayers) {
    throw InvalidArgument(fmt::format("PoolLayout decode: num_layers {} exceeds the limit of {}",
                                      l.num_layers, kMaxLayers));
  }
  if (l.block_size == 0) zero("block_size");
  if (l.num_kv_heads == 0) zero("num_kv_heads");
  if (l.head_dim_k == 0) zero("head_dim_k");  // head_dim_v 0: K-only layers
  if (l.tp_size == 0) zero("tp_size");
  if (l.num_blocks == 0) zero("num_blocks");
  if (layout > static_cast<std::uint8_t>(KvCacheLayout::block_major))
    throw InvalidArgument(fmt::format("PoolLayout decode: unknown layout {}", layout));
  l.layout = static_cast<KvCacheLayout>(layout);
  if (l.tp_rank >= l.tp_size) {
    throw InvalidArgument(
        fmt::format("PoolLayout decode: tp_rank {} is not below tp_size {}", l.tp_rank, l.tp_size));
  }

  const std::size_t expected = kHeaderBytes + l.num_layers;
  if (bytes.size() != expected) {
    throw InvalidArgument(fmt::format(
        "PoolLayout decode: {} message: {} bytes, {} expected for {} layers",
        bytes.size() < expected ? "truncated" : "overlong", bytes.size(), expected, l.num_layers));
  }
  const std::size_t num_dtypes = all_dtypes().size();
  l.layer_dtypes.reserve(l.num_layers);
  for (std::uint32_t layer = 0; layer < l.num_layers; ++layer) {
    const std::uint8_t d = bytes[kHeaderBytes + layer];
    if (d >= num_dtypes) {
      throw InvalidArgument(
          fmt::format("PoolLayout decode: layer {} has unknown dtype {}", layer, d));
    }
    l.layer_dtypes.push_back(static_cast<KvCacheDtype>(d));
  }
  try {
    l.to_config().validate();  // element groups, byte-size overflow
  } catch (const InvalidArgument& e) {
    throw InvalidArgument(fmt::format("PoolLayout decode: {}", e.what()));
  }
  return l;
}

std::uint64_t compatibility_hash(const PoolLayout& layout) {
  // A canonical encoding of exactly the fields peers must share; the version
  // byte keeps hashes of a later rule set apart.
  std::vector<std::uint8_t> buf;
  buf.reserve(32 + layout.layer_dtypes.size());
  Writer w(buf);
  w.u8(1);
  w.u32(layout.num_layers);
  w.u32(layout.block_size);
  w.u32(layout.head_dim_k);
  w.u32(layout.head_dim_v);
  w.u64(layout.total_kv_heads());
  w.u32(static_cast<std::uint32_t>(layout.layer_dtypes.size()));
  for (KvCacheDtype d : layout.layer_dtypes)
    w.u8(static_cast<std::uint8_t>(d));
  return XXH3_64bits(buf.data(), buf.size());
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
void emit(std::vector<CopyRegion>& out, CopyRegion r) {
  if (!out.empty()) {
    CopyRegion& last = out.back();
    if (last.local + last.bytes == r.local && last.remote + last.bytes == r.remote) {
      last.bytes += r.bytes;
      return;
    }
  }
  out.push_back(r);
}

}  // namespace

std::vector<CopyRegion> plan_block_regions(const PoolLayout& local,
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
  std::vector<CopyRegion> out;
  auto emit_block = [&](const LayerPlan& p, std::size_t i) {
    const std::uint64_t l = p.local.block_address(local_blocks[i]);
    const std::uint64_t r = p.remote.block_address(remote_blocks[i]);
    for (std::size_t s = 0; s < p.count; ++s) {
      const Slice& slice = p.slices[s];
      if (slice.bytes == 0) continue;
      emit(out, CopyRegion{add_checked(l, slice.local_offset), add_checked(r, slice.remote_offset),
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
  for (const CopyRegion& r : out) {
    (void)add_checked(r.local, r.bytes);
    (void)add_checked(r.remote, r.bytes);
  }
  return out;
}

std::uint64_t total_bytes(std::span<const CopyRegion> regions) noexcept {
  std::uint64_t total = 0;
  for (const CopyRegion& r : regions)
    total += r.bytes;
  return total;
}

}  // namespace kvport::transfer
