// SPDX-License-Identifier: Apache-2.0
// PoolLayout: what one side of a block transfer tells the other about its KV
// pools at the handshake, the compatibility check that names the field that
// differs, and the region planner that turns two block lists into the byte
// ranges to move (head slicing for tensor parallelism included).
#pragma once

#include <cstddef>
#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "kvport/core/block_pool.hpp"
#include "kvport/core/kv_cache_config.hpp"
#include "kvport/core/layer_spec.hpp"
#include "kvport/core/paged_kv_cache.hpp"

namespace kvport::transfer {

/// One KV cache group of the model (core's KvCacheGroup, as the handshake
/// carries it): the layer spec its layers share (the model's: every KV head,
/// not one rank's share), its block size, which model layers, their dtypes.
struct LayoutGroup {
  LayerSpec spec;
  std::uint32_t block_size = 0;
  std::vector<std::uint32_t> layers;       ///< model layer indices, ascending
  std::vector<KvCacheDtype> layer_dtypes;  ///< one per layer

  friend bool operator==(const LayoutGroup&, const LayoutGroup&) = default;
};

/// The groups of `groups` (group_layers / HybridKvCache::group) at
/// `block_size`. Throws InvalidArgument naming the group and field when a
/// size does not fit 32 bits or a group's layer_dtypes does not match its
/// layers.
std::vector<LayoutGroup> layout_groups(std::span<const KvCacheGroup> groups,
                                       std::size_t block_size);

/// One side's pool layout, as exchanged at the handshake.
///
/// Head slicing (tensor parallelism): a rank of a TP group of `tp_size` holds
/// `num_kv_heads` heads, global heads [tp_rank * num_kv_heads,
/// (tp_rank + 1) * num_kv_heads). Inside one block's K (or V) region of one
/// layer, the data bytes are head-major ([head][token][head_dim], packed) and
/// the scale bytes (nvfp4, turboN) are head-major too ([head][token][...]), so
/// one head's share of a region is one contiguous data range plus one
/// contiguous scale range.
struct PoolLayout {
  std::uint32_t num_layers = 0;
  std::uint32_t block_size = 0;    ///< tokens per block
  std::uint32_t num_kv_heads = 0;  ///< heads this rank holds
  std::uint32_t head_dim_k = 0;
  /// 0: K-only layers (MLA's latent, state slots): no V pools, and nothing
  /// of V moves. Only a K-only peer is compatible with a K-only side.
  std::uint32_t head_dim_v = 0;
  std::vector<KvCacheDtype> layer_dtypes;  ///< always num_layers entries
  KvCacheLayout layout = KvCacheLayout::layer_major;
  std::uint32_t tp_rank = 0;
  std::uint32_t tp_size = 1;
  std::uint64_t num_blocks = 0;
  /// The model's KV cache groups (hybrid models: a HybridKvCache's).
  /// Empty: the pool is the whole model, one full-attention group implied
  /// by the fields above (model_groups()); that is what version 1 carries.
  std::vector<LayoutGroup> groups;

  /// Whether the layers have a V part (head_dim_v > 0).
  bool has_v() const noexcept { return head_dim_v != 0; }
  /// num_kv_heads * tp_size: the model's KV heads.
  std::uint64_t total_kv_heads() const noexcept { return std::uint64_t{num_kv_heads} * tp_size; }
  /// The KvCacheConfig this layout describes (layer_dtypes filled in).
  KvCacheConfig to_config() const;

  friend bool operator==(const PoolLayout&, const PoolLayout&) = default;
};

/// The layout of `cache` as rank `tp_rank` of a TP group of `tp_size`.
/// Throws InvalidArgument when tp_size is 0, tp_rank >= tp_size, or a field
/// does not fit 32 bits.
PoolLayout pool_layout(const PagedKvCache& cache, std::uint32_t tp_rank = 0,
                       std::uint32_t tp_size = 1);

/// The groups `layout` describes: `groups`, or (empty) the one implied
/// full-attention group of every layer (spec: total_kv_heads(), the head
/// dims, layer 0's dtype; block_size; layers 0..num_layers-1; layer_dtypes).
std::vector<LayoutGroup> model_groups(const PoolLayout& layout);

/// Limits of the group list (a decoder refuses more before allocating).
inline constexpr std::uint32_t kMaxLayoutGroups = 256;
inline constexpr std::uint32_t kMaxStateTensors = 64;
inline constexpr std::uint32_t kMaxStateRank = 8;
inline constexpr std::size_t kMaxStateTensorName = 256;

/// A versioned little-endian encoding (for the handshake message; the
/// layout in docs/transfer.md): magic "KVPL", a u16 version, the fields, one
/// dtype byte per layer; without groups that is version 1, 43 + num_layers
/// bytes (what every earlier build sends and reads), with groups version 2,
/// the same and then the group list. Throws InvalidArgument when
/// layer_dtypes.size() != num_layers or a group is over the limits above.
std::vector<std::uint8_t> encode(const PoolLayout& layout);
/// Decodes `encode`'s bytes (version 1 or 2). Throws InvalidArgument naming
/// what is wrong for a short, long, wrong-magic, wrong-version or
/// out-of-range (unknown dtype/layout/kind, zero sizes other than head_dim_v
/// (0: K-only layers) or num_blocks, tp_rank >= tp_size, more than 4096
/// layers, a head_dim that is not a multiple of a layer dtype's group, a group
/// whose spec does not validate, a model layer in two groups or out of order,
/// counts over the limits) input; truncation errors name the field being
/// read. Never reads past `bytes` and allocates for a count only after
/// checking it against its limit and the bytes left. A decoded layout passes
/// KvCacheConfig::validate, and each group LayerSpec::validate.
PoolLayout decode_pool_layout(std::span<const std::uint8_t> bytes);

/// XXH3-64 of the fields two sides must agree on to exchange blocks: layers,
/// per-layer dtypes, block size, head dims, total KV heads, and the groups
/// when the layout lists them (without, the hash is what version 1's builds
/// compute). Not tp_rank,
/// tp_size, num_blocks or the in-block layout (KvCacheLayout): those may
/// differ between compatible peers.
std::uint64_t compatibility_hash(const PoolLayout& layout);

/// nullopt when blocks can move between `local` and `remote`, otherwise one
/// line naming the first field that differs and both values, in the order
/// num_layers, block_size, head_dim_k, head_dim_v, total kv heads, layer
/// dtypes, e.g.
/// "num_layers differs: 32 here, 16 on the peer" or "layer 3 dtype differs:
/// bf16 here, fp8_e4m3 on the peer". Also rejected: different TP sizes unless
/// both sides are layer-major ("tensor-parallel head slicing needs the
/// layer-major layout on both sides"), a TP size that does not divide the
/// total heads, and a side that is malformed on its own (tp_size 0, tp_rank
/// >= tp_size, layer_dtypes.size() != num_layers; named "here" or "on the
/// peer"). Then the groups (model_groups(), so that a layout without groups
/// matches one listing its implied group): the count, then for the first
/// group that differs the first field, in the order kind, block_size,
/// num_kv_heads, head_dim_k, head_dim_v, dtype, window, chunk, kv_lora_rank,
/// rope_dim, mla_format, state tensors (count, then name, shape, dtype),
/// layers, layer dtypes, e.g. "group 1 (sliding_window): window differs: 128
/// here, 4096 on the peer".
std::optional<std::string> incompatibility(const PoolLayout& local, const PoolLayout& remote);

/// Where one side's pools are: per layer, the address of block 0's K (V)
/// bytes and the distance between consecutive blocks (the base and stride of
/// PagedKvCache::pool(layer, part)). Addresses are integers: they may be the
/// peer's. Four vectors, as the handshake message carries them; for K-only
/// layers the V entries are 0 (there is no V pool).
struct PoolAddresses {
  std::vector<std::uint64_t> k_base, v_base;
  std::vector<std::uint64_t> k_stride, v_stride;

  /// One pool's address and stride.
  struct Pool {
    std::uint64_t base = 0;
    std::uint64_t stride = 0;
  };
  /// Layer `layer`'s `part` pool. Throws std::out_of_range past the vectors.
  Pool at(std::size_t layer, KvPart part) const {
    return part == KvPart::k ? Pool{k_base.at(layer), k_stride.at(layer)}
                             : Pool{v_base.at(layer), v_stride.at(layer)};
  }

  friend bool operator==(const PoolAddresses&, const PoolAddresses&) = default;
};

/// The addresses of `cache`'s pools (PagedKvCache::pool of every layer and
/// part; V entries 0 for K-only layers).
PoolAddresses pool_addresses(const PagedKvCache& cache);

/// One contiguous copy between the two sides of a transfer: `bytes` bytes at
/// address `local` in this process and `remote` in the peer's (the agent
/// reads remote into local). Platform's CopyRegion is the other kind: a
/// device-to-device copy inside one backend.
struct TransferRegion {
  std::uint64_t local = 0;
  std::uint64_t remote = 0;
  std::uint64_t bytes = 0;
  friend bool operator==(const TransferRegion&, const TransferRegion&) = default;
};

/// The global heads both ranks hold: [first, first + count), or nullopt when
/// their slices do not overlap.
struct HeadRange {
  std::uint64_t first = 0;
  std::uint64_t count = 0;
  friend bool operator==(const HeadRange&, const HeadRange&) = default;
};
std::optional<HeadRange> head_overlap(const PoolLayout& local, const PoolLayout& remote);

/// The byte ranges that move the heads both sides hold of local_blocks[i] <->
/// remote_blocks[i], every layer, K and V (data and scales; K alone for K-only
/// layers, whose V addresses are not read). With equal TP sizes whole regions
/// move (padding included); with head slicing only the overlapping heads' data
/// and scale ranges. Regions adjacent on both sides are merged (consecutive ids
/// in layer-major pools, whole blocks in block-major), so a run of consecutive
/// ids costs 2 x layers regions (layers for K-only layers; 1 in block-major on
/// both sides). Order: (block, layer, K, V) when `local` is block-major,
/// (layer, K/V, block) otherwise; within a head-sliced region the data range
/// comes before the scale range. Cost: O(layers x blocks), no sorting. Throws
/// InvalidArgument, before returning anything, when the layouts are
/// incompatible, the lists differ in length, an id is out of range for its
/// side, an address list does not have num_layers entries, the heads do not
/// overlap, or an address computation wraps 64 bits.
std::vector<TransferRegion> plan_block_regions(const PoolLayout& local,
                                           const PoolAddresses& local_pools,
                                           std::span<const BlockId> local_blocks,
                                           const PoolLayout& remote,
                                           const PoolAddresses& remote_pools,
                                           std::span<const BlockId> remote_blocks);

/// Total bytes of `regions`.
std::uint64_t total_bytes(std::span<const TransferRegion> regions) noexcept;

}  // namespace kvport::transfer
