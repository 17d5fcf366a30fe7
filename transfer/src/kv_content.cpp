// SPDX-License-Identifier: Apache-2.0
#include "kvport/transfer/kv_content.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <bit>
#include <cstring>
#include <vector>

#include "kvport/core/block_regions.hpp"
#include "kvport/core/dtype.hpp"
#include "kvport/core/host_tier.hpp"
#include "kvport/platform/error.hpp"
#include "kvport/platform/host_buffer.hpp"

namespace kvport::transfer {

namespace {

// ---- the content function ----------------------------------------------------------------
//
// Each (token id, layer, kv, global head, position) vector gets a 64-bit seed
// from splitmix64's finalizer; its data bytes are then the little-endian bytes
// of word(seed, w) for w = 0, 1, ..., and its scale bytes those of
// word(~seed, w). word() is a multiply-xorshift of seed + w * golden: cheap,
// branch-free, and vectorized by the compiler over a vector's words. The
// content is only compared, never decoded, so the seed carries the
// distinctness and word() only has to spread it.

constexpr std::uint64_t kGolden = 0x9E3779B97F4A7C15ULL;

constexpr std::uint64_t mix64(std::uint64_t x) noexcept {  // splitmix64's finalizer
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ULL;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBULL;
  return x ^ (x >> 31);
}

std::uint64_t vector_seed(TokenId token, std::uint32_t layer, int kv, std::uint64_t global_head,
                          std::uint64_t position) noexcept {
  std::uint64_t h = mix64(std::uint64_t{token} + kGolden);
  h = mix64(h ^ ((std::uint64_t{layer} << 1) | static_cast<std::uint64_t>(kv)));
  h = mix64(h ^ (global_head * kGolden));
  return mix64(h + position);
}

inline std::uint64_t word(std::uint64_t seed, std::uint64_t w) noexcept {
  std::uint64_t x = seed + w * kGolden;
  x = (x ^ (x >> 32)) * 0xD6E8FEB86659FD93ULL;
  return x ^ (x >> 32);
}

// Writes `bytes` content bytes of `seed` at `dst`.
inline void fill_vector(std::uint8_t* dst, std::size_t bytes, std::uint64_t seed) noexcept {
  const std::size_t words = bytes / 8;
  if constexpr (std::endian::native == std::endian::little) {
    for (std::size_t w = 0; w < words; ++w) {
      const std::uint64_t v = word(seed, w);
      std::memcpy(dst + 8 * w, &v, 8);
    }
  } else {
    for (std::size_t w = 0; w < words; ++w) {
      const std::uint64_t v = word(seed, w);
      for (std::size_t b = 0; b < 8; ++b)
        dst[8 * w + b] = static_cast<std::uint8_t>(v >> (8 * b));
    }
  }
  if (const std::size_t tail = bytes % 8; tail != 0) {
    const std::uint64_t v = word(seed, words);
    for (std::size_t b = 0; b < tail; ++b)
      dst[8 * words + b] = static_cast<std::uint8_t>(v >> (8 * b));
  }
}

// The shape of one layer's K (or V) region of one block.
struct RegionShape {
  BlockRegionLayout layout;
  std::size_t vector_bytes;  // data bytes of one (head, token) vector
  std::size_t scale_vector_bytes;
};

// Everything a fill or check needs, computed once per call.
struct ContentPlan {
  std::uint32_t num_layers;
  std::uint32_t block_size;
  std::uint32_t num_heads;
  std::uint64_t first_global_head;
  std::vector<RegionShape> regions;  // [2 * layer + kv]
  std::size_t block_bytes;           // one block, every layer: the staging slot
};

ContentPlan make_plan(const PoolLayout& layout, const PagedKvCache& cache) {
  ContentPlan p{};
  p.num_layers = layout.num_layers;
  p.block_size = layout.block_size;
  p.num_heads = layout.num_kv_heads;
  p.first_global_head = std::uint64_t{layout.tp_rank} * layout.num_kv_heads;
  p.block_bytes = HostTier::slot_bytes_for(cache);
  const KvCacheConfig& c = cache.config();
  p.regions.reserve(2 * std::size_t{p.num_layers});
  for (std::uint32_t layer = 0; layer < p.num_layers; ++layer) {
    for (const BlockRegionLayout& r : {c.k_layout(layer), c.v_layout(layer)}) {
      const std::size_t vectors = std::size_t{p.block_size} * p.num_heads;
      p.regions.push_back({r, r.data_bytes / vectors, r.scale_bytes / vectors});
    }
  }
  return p;
}

// Writes one block's region (layer, kv) at `dst`: data and scales
// head-major, padding zero. Block `index` of the call holds positions
// [index * block_size, ...).
void fill_region(const ContentPlan& p, std::span<const TokenId> tokens, std::size_t index,
                 std::uint32_t layer, int kv, std::uint8_t* dst) {
  const RegionShape& s = p.regions[2 * std::size_t{layer} + static_cast<std::size_t>(kv)];
  const std::uint64_t first_position = std::uint64_t{index} * p.block_size;
  std::uint8_t* data = dst;
  std::uint8_t* scales = dst + s.layout.scale_offset;
  for (std::uint32_t h = 0; h < p.num_heads; ++h) {
    const std::uint64_t global_head = p.first_global_head + h;
    for (std::uint32_t t = 0; t < p.block_size; ++t) {
      const std::uint64_t pos = first_position + t;
      const TokenId token = pos < tokens.size() ? tokens[pos] : TokenId{0};
      const std::uint64_t seed = vector_seed(token, layer, kv, global_head, pos);
      fill_vector(data, s.vector_bytes, seed);
      data += s.vector_bytes;
      if (s.scale_vector_bytes != 0) {
        fill_vector(scales, s.scale_vector_bytes, ~seed);
        scales += s.scale_vector_bytes;
      }
    }
  }
  std::memset(dst + s.layout.data_bytes, 0, s.layout.data_padding);
  std::memset(dst + s.layout.scale_offset + s.layout.scale_bytes, 0, s.layout.scale_padding);
}

// Bytes of [a, a + n) that differ from [b, b + n).
std::uint64_t count_wrong(const std::uint8_t* a, const std::uint8_t* b, std::size_t n) noexcept {
  if (std::memcmp(a, b, n) == 0) return 0;
  std::uint64_t wrong = 0;
  for (std::size_t i = 0; i < n; ++i)
    wrong += a[i] != b[i] ? 1 : 0;
  return wrong;
}

// The checks both calls share; `op` names the caller.
void check_args(const PagedKvCache& cache, const PoolLayout& layout,
                std::span<const BlockId> blocks, std::span<const TokenId> tokens,
                std::size_t first_block, const char* op) {
  const PoolLayout actual = pool_layout(cache, layout.tp_rank < layout.tp_size ? layout.tp_rank : 0,
                                        layout.tp_size == 0 ? 1 : layout.tp_size);
  if (actual != layout) {
    std::string why;
    if (layout.tp_size == 0 || layout.tp_rank >= layout.tp_size) {
      why = fmt::format("tp_rank {} with tp_size {}", layout.tp_rank, layout.tp_size);
    } else if (auto diff = incompatibility(layout, actual)) {
      why = *diff;
    } else if (layout.num_kv_heads != actual.num_kv_heads) {
      why = fmt::format("num_kv_heads: {} in the layout, {} in the cache", layout.num_kv_heads,
                        actual.num_kv_heads);
    } else if (layout.layout != actual.layout) {
      why = fmt::format("layout: {} in the layout, {} in the cache", to_string(layout.layout),
                        to_string(actual.layout));
    } else {
      why = fmt::format("num_blocks: {} in the layout, {} in the cache", layout.num_blocks,
                        actual.num_blocks);
    }
    throw InvalidArgument(fmt::format("{}: the layout does not describe the cache ({})", op, why));
  }
  if (first_block > (std::uint64_t{1} << 32) ||
      (std::uint64_t{first_block} + blocks.size()) * layout.block_size < tokens.size()) {
    throw InvalidArgument(
        fmt::format("{}: {} tokens do not fit {} blocks of {} tokens from block {}", op,
                    tokens.size(), blocks.size(), layout.block_size, first_block));
  }
  std::vector<bool> seen(cache.num_blocks());
  for (std::size_t i = 0; i < blocks.size(); ++i) {
    if (blocks[i] >= cache.num_blocks()) {
      throw InvalidArgument(fmt::format("{}: block id {} (entry {}) is out of range ({} blocks)",
                                        op, blocks[i], i, cache.num_blocks()));
    }
    if (seen[blocks[i]])
      throw InvalidArgument(fmt::format("{}: block id {} appears twice", op, blocks[i]));
    seen[blocks[i]] = true;
  }
}

// The host staging of `blocks` (one slot of block_bytes each, HostTier's slot
// layout) and the copy regions between it and the cache.
std::vector<HostCopyRegion> staging_regions(const PagedKvCache& cache,
                                            std::span<const BlockId> blocks, std::uint8_t* staging,
                                            std::size_t block_bytes) {
  std::vector<HostCopyRegion> regions;
  append_host_copy_regions(cache.memory_pools(), blocks, reinterpret_cast<std::byte*>(staging),
                           block_bytes, regions);
  return regions;
}

}  // namespace

namespace {

// At most this much host staging per batched copy: a long sequence is
// written and checked in chunks of whole blocks (at least one).
constexpr std::size_t kStagingChunkBytes = std::size_t{64} << 20;

std::size_t chunk_blocks(const ContentPlan& plan) {
  return std::max<std::size_t>(1, kStagingChunkBytes / plan.block_bytes);
}

// One batched copy between the staging and the blocks, waited for. Part of a
// failed batch may be queued: it finishes before the staging buffer can be
// freed, and the copy's own error is the one reported.
void copy_and_wait(Backend& backend, const std::vector<HostCopyRegion>& regions,
                   HostCopyDirection direction, StreamView stream) {
  try {
    if (direction == HostCopyDirection::host_to_device) {
      backend.copy_batch_h2d_async(regions, stream);
    } else {
      backend.copy_batch_d2h_async(regions, stream);
    }
  } catch (...) {
    try {
      backend.synchronize(stream);
    } catch (...) {
    }
    throw;
  }
  backend.synchronize(stream);
}

void write_chunk(PagedKvCache& cache, const ContentPlan& plan, std::span<const BlockId> blocks,
                 std::span<const TokenId> tokens, StreamView stream, std::size_t first_block) {
  HostBuffer staging(cache.backend(), blocks.size() * plan.block_bytes);
  std::uint8_t* base = staging.bytes().data();
  for (std::size_t i = 0; i < blocks.size(); ++i) {
    std::uint8_t* slot = base + i * plan.block_bytes;
    for (std::uint32_t layer = 0; layer < plan.num_layers; ++layer) {
      for (int kv = 0; kv < 2; ++kv) {
        fill_region(plan, tokens, first_block + i, layer, kv, slot);
        slot +=
            plan.regions[2 * std::size_t{layer} + static_cast<std::size_t>(kv)].layout.total_bytes;
      }
    }
  }
  copy_and_wait(cache.backend(), staging_regions(cache, blocks, base, plan.block_bytes),
                HostCopyDirection::host_to_device, stream);
}

void verify_chunk(PagedKvCache& cache, const ContentPlan& plan, std::span<const BlockId> blocks,
                  std::span<const TokenId> tokens, StreamView stream, std::size_t first_block,
                  ContentCheck& check) {
  HostBuffer staging(cache.backend(), blocks.size() * plan.block_bytes);
  std::uint8_t* base = staging.bytes().data();
  copy_and_wait(cache.backend(), staging_regions(cache, blocks, base, plan.block_bytes),
                HostCopyDirection::device_to_host, stream);
  std::size_t max_region = 0;
  for (const RegionShape& s : plan.regions)
    max_region = std::max(max_region, s.layout.total_bytes);
  std::vector<std::uint8_t> expected(max_region);
  for (std::size_t i = 0; i < blocks.size(); ++i) {
    const std::uint8_t* slot = base + i * plan.block_bytes;
    for (std::uint32_t layer = 0; layer < plan.num_layers; ++layer) {
      for (int kv = 0; kv < 2; ++kv) {
        const BlockRegionLayout& r =
            plan.regions[2 * std::size_t{layer} + static_cast<std::size_t>(kv)].layout;
        fill_region(plan, tokens, first_block + i, layer, kv, expected.data());
        check.bytes_wrong += count_wrong(slot, expected.data(), r.data_bytes);
        check.bytes_wrong +=
            count_wrong(slot + r.scale_offset, expected.data() + r.scale_offset, r.scale_bytes);
        check.bytes_checked += r.data_bytes + r.scale_bytes;
        slot += r.total_bytes;
      }
    }
  }
}

}  // namespace

void write_kv_content(PagedKvCache& cache, const PoolLayout& layout,
                      std::span<const BlockId> blocks, std::span<const TokenId> tokens,
                      StreamView stream, std::size_t first_block) {
  check_args(cache, layout, blocks, tokens, first_block, "write_kv_content");
  if (blocks.empty()) return;
  const ContentPlan plan = make_plan(layout, cache);
  const std::size_t step = chunk_blocks(plan);
  for (std::size_t i = 0; i < blocks.size(); i += step) {
    write_chunk(cache, plan, blocks.subspan(i, std::min(step, blocks.size() - i)), tokens, stream,
                first_block + i);
  }
}

ContentCheck verify_kv_content(PagedKvCache& cache, const PoolLayout& layout,
                               std::span<const BlockId> blocks, std::span<const TokenId> tokens,
                               StreamView stream, std::size_t first_block) {
  check_args(cache, layout, blocks, tokens, first_block, "verify_kv_content");
  ContentCheck check;
  if (blocks.empty()) return check;
  const ContentPlan plan = make_plan(layout, cache);
  const std::size_t step = chunk_blocks(plan);
  for (std::size_t i = 0; i < blocks.size(); i += step) {
    verify_chunk(cache, plan, blocks.subspan(i, std::min(step, blocks.size() - i)), tokens, stream,
                 first_block + i, check);
  }
  return check;
}

}  // namespace kvport::transfer
