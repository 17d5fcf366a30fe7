// SPDX-License-Identifier: Apache-2.0
#include "kvport/core/batch_view.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <iterator>
#include <limits>

#include "kvport/platform/div_ceil.hpp"
#include "kvport/platform/error.hpp"

namespace kvport {

namespace {

constexpr std::size_t kInt32Max =
    static_cast<std::size_t>(std::numeric_limits<std::int32_t>::max());

// What every builder checks first: the group's block lists and the kernel's
// geometry. `k`: kernel blocks per cache block.
struct Geometry {
  std::size_t block_size = 0;
  std::size_t kernel_block_size = 0;
  std::size_t k = 1;
  std::size_t num_blocks = 0;  // the group's pool
};

Geometry check_batch(std::span<const BatchSequence> batch, std::size_t group,
                     const KernelBlocks& kernel, const char* who) {
  if (batch.empty()) throw InvalidArgument(fmt::format("{}: the batch is empty", who));
  const HybridKvCache* cache = nullptr;
  for (std::size_t i = 0; i < batch.size(); ++i) {
    const BatchSequence& s = batch[i];
    if (s.table == nullptr)
      throw InvalidArgument(fmt::format("{}: sequence {} has no table", who, i));
    if (cache == nullptr) cache = &s.table->cache();
    if (&s.table->cache() != cache) {
      throw InvalidArgument(
          fmt::format("{}: sequence {} is a table of another cache than sequence 0's", who, i));
    }
    if (s.num_new_tokens == 0 || s.num_new_tokens > s.table->num_tokens()) {
      throw InvalidArgument(
          fmt::format("{}: sequence {} computes {} new tokens of the {} it holds (1 to {})", who, i,
                      s.num_new_tokens, s.table->num_tokens(), s.table->num_tokens()));
    }
  }
  const KvCacheGroup& g = cache->group(group);  // OutOfRange
  if (g.spec.has_state()) {
    throw InvalidArgument(
        fmt::format("{}: group {} ({}) keeps a state, not blocks", who, group, g.spec.describe()));
  }
  Geometry geo;
  geo.block_size = cache->block_size();
  geo.kernel_block_size = kernel.kernel_block_size == 0 ? geo.block_size : kernel.kernel_block_size;
  if (geo.block_size % geo.kernel_block_size != 0) {
    throw InvalidArgument(
        fmt::format("{}: a kernel block of {} tokens does not divide the cache's blocks of {}", who,
                    geo.kernel_block_size, geo.block_size));
  }
  geo.k = geo.block_size / geo.kernel_block_size;
  geo.num_blocks = cache->group_cache(group).num_blocks();
  if (geo.num_blocks * geo.k > kInt32Max) {  // one past the largest kernel block id
    throw InvalidArgument(
        fmt::format("{}: group {}'s {} blocks of {} kernel blocks each do not fit int32 ids", who,
                    group, geo.num_blocks, geo.k));
  }
  return geo;
}

// Kernel blocks of `table` in `group`.
std::size_t kernel_blocks_of(const HybridBlockTable& table, const Geometry& geo) {
  return div_ceil(table.num_tokens(), geo.kernel_block_size);
}

// Writes `table`'s kernel block ids in `group` (position order) to `out`.
template <class Out>
void expand(const HybridBlockTable& table, std::size_t group, const Geometry& geo,
            std::int32_t null_block, Out out) {
  const std::span<const BlockId> blocks = table.blocks(group);
  const std::size_t n = kernel_blocks_of(table, geo);
  if (geo.k == 1) {  // the common case: one kernel block per block, a select the
                     // compiler vectorizes
    std::transform(blocks.begin(), blocks.begin() + static_cast<std::ptrdiff_t>(n), out,
                   [null_block](BlockId b) {
                     return b == kNullBlock ? null_block : static_cast<std::int32_t>(b);
                   });
    return;
  }
  for (std::size_t j = 0; j < n;) {
    const BlockId b = blocks[j / geo.k];
    const std::size_t first = std::size_t{b} * geo.k;
    for (std::size_t part = j % geo.k; part < geo.k && j < n; ++part, ++j)
      *out++ = b == kNullBlock ? null_block : static_cast<std::int32_t>(first + part);
  }
}

// The KV slot of position `pos` in `block`: block * block_size + offset,
// which is kernel block * kernel_block_size + offset in the kernel's blocks.
std::size_t token_slot(BlockId block, std::size_t pos, const Geometry& geo) {
  return std::size_t{block} * geo.block_size + pos % geo.block_size;
}

// `size` entries are rows of `row_width`, one for each of `sequences` at
// least.
void check_row_shape(std::size_t sequences, std::size_t row_width, std::size_t size,
                     const char* who) {
  if (row_width == 0 || size % row_width != 0 || size / row_width < sequences) {
    throw InvalidArgument(fmt::format("{}: {} entries are not rows of width {} for {} sequences",
                                      who, size, row_width, sequences));
  }
}

}  // namespace

std::size_t vllm_row_width(std::size_t max_model_len, std::size_t kernel_block_size) {
  if (max_model_len == 0 || kernel_block_size == 0) {
    throw InvalidArgument(fmt::format(
        "vllm_row_width: max_model_len ({}) and kernel_block_size ({}) must be positive",
        max_model_len, kernel_block_size));
  }
  const std::size_t align = std::max<std::size_t>(1, 128 / kernel_block_size);
  return div_ceil(div_ceil(max_model_len, kernel_block_size), align) * align;
}

void build_block_table_rows(std::span<const BatchSequence> batch, std::size_t group,
                            const KernelBlocks& kernel, std::size_t row_width,
                            std::span<std::int32_t> rows) {
  constexpr const char* kWho = "build_block_table_rows";
  const Geometry geo = check_batch(batch, group, kernel, kWho);
  check_row_shape(batch.size(), row_width, rows.size(), kWho);
  for (std::size_t i = 0; i < batch.size(); ++i) {
    const std::size_t n = kernel_blocks_of(*batch[i].table, geo);
    if (n > row_width) {
      throw InvalidArgument(
          fmt::format("{}: sequence {} holds {} kernel blocks ({} tokens), more than a row of {}",
                      kWho, i, n, batch[i].table->num_tokens(), row_width));
    }
  }
  // Each row written once: its ids, then null_block to its end; then the
  // rows past the batch.
  for (std::size_t i = 0; i < batch.size(); ++i) {
    const auto row = rows.begin() + static_cast<std::ptrdiff_t>(i * row_width);
    const std::size_t n = kernel_blocks_of(*batch[i].table, geo);
    expand(*batch[i].table, group, geo, kernel.null_block, row);
    std::fill(row + static_cast<std::ptrdiff_t>(n), row + static_cast<std::ptrdiff_t>(row_width),
              kernel.null_block);
  }
  std::fill(rows.begin() + static_cast<std::ptrdiff_t>(batch.size() * row_width), rows.end(),
            kernel.null_block);
}

std::size_t build_slot_mapping(std::span<const BatchSequence> batch, std::size_t group,
                               const KernelBlocks& kernel, std::span<std::int64_t> slots) {
  constexpr const char* kWho = "build_slot_mapping";
  const Geometry geo = check_batch(batch, group, kernel, kWho);
  std::size_t total = 0;
  for (std::size_t i = 0; i < batch.size(); ++i) {
    const HybridBlockTable& t = *batch[i].table;
    const std::span<const BlockId> blocks = t.blocks(group);
    for (std::size_t pos = t.num_tokens() - batch[i].num_new_tokens; pos < t.num_tokens(); ++pos) {
      if (blocks[pos / geo.block_size] == kNullBlock) {
        throw InvalidArgument(fmt::format(
            "{}: sequence {}'s new token at position {} is in a block its group released", kWho, i,
            pos));
      }
    }
    total += batch[i].num_new_tokens;
  }
  if (slots.size() < total) {
    throw InvalidArgument(fmt::format("{}: {} slots for {} new tokens", kWho, slots.size(), total));
  }
  std::size_t at = 0;
  for (const BatchSequence& s : batch) {
    const std::span<const BlockId> blocks = s.table->blocks(group);
    for (std::size_t pos = s.table->num_tokens() - s.num_new_tokens; pos < s.table->num_tokens();
         ++pos) {
      slots[at++] = static_cast<std::int64_t>(token_slot(blocks[pos / geo.block_size], pos, geo));
    }
  }
  std::fill(slots.begin() + static_cast<std::ptrdiff_t>(at), slots.end(), std::int64_t{-1});
  return total;
}

void build_token_locations(std::span<const BatchSequence> batch, std::size_t group,
                           const KernelBlocks& kernel, std::size_t row_width,
                           std::span<std::int32_t> locations) {
  constexpr const char* kWho = "build_token_locations";
  const Geometry geo = check_batch(batch, group, kernel, kWho);
  check_row_shape(batch.size(), row_width, locations.size(), kWho);
  for (std::size_t i = 0; i < batch.size(); ++i) {
    if (batch[i].table->num_tokens() > row_width) {
      throw InvalidArgument(fmt::format("{}: sequence {} holds {} tokens, more than a row of {}",
                                        kWho, i, batch[i].table->num_tokens(), row_width));
    }
  }
  if (geo.num_blocks * geo.block_size > kInt32Max) {
    throw InvalidArgument(fmt::format("{}: group {}'s {} token slots do not fit int32", kWho, group,
                                      geo.num_blocks * geo.block_size));
  }
  std::fill(locations.begin(), locations.end(), kernel.null_block);
  for (std::size_t i = 0; i < batch.size(); ++i) {
    const HybridBlockTable& t = *batch[i].table;
    const std::span<const BlockId> blocks = t.blocks(group);
    const auto row = locations.begin() + static_cast<std::ptrdiff_t>(i * row_width);
    for (std::size_t pos = 0; pos < t.num_tokens(); ++pos) {
      const BlockId b = blocks[pos / geo.block_size];
      if (b == kNullBlock) continue;
      row[static_cast<std::ptrdiff_t>(pos)] = static_cast<std::int32_t>(token_slot(b, pos, geo));
    }
  }
}

FlashInferPages build_flashinfer_pages(std::span<const BatchSequence> batch, std::size_t group,
                                       const KernelBlocks& kernel) {
  const Geometry geo = check_batch(batch, group, kernel, "build_flashinfer_pages");
  FlashInferPages out;
  out.page_size = geo.kernel_block_size;
  std::size_t pages = 0;
  for (const BatchSequence& s : batch)
    pages += kernel_blocks_of(*s.table, geo);
  if (pages > kInt32Max) {
    throw InvalidArgument(
        fmt::format("build_flashinfer_pages: {} pages do not fit int32 indptr", pages));
  }
  out.indptr.reserve(batch.size() + 1);
  out.indices.reserve(pages);
  out.last_page_len.reserve(batch.size());
  out.kv_len.reserve(batch.size());
  out.indptr.push_back(0);
  for (const BatchSequence& s : batch) {
    const std::size_t n = s.table->num_tokens();
    expand(*s.table, group, geo, kernel.null_block, std::back_inserter(out.indices));
    out.indptr.push_back(static_cast<std::int32_t>(out.indices.size()));
    out.last_page_len.push_back(static_cast<std::int32_t>(
        n - (div_ceil(n, geo.kernel_block_size) - 1) * geo.kernel_block_size));
    out.kv_len.push_back(static_cast<std::int32_t>(n));
  }
  return out;
}

}  // namespace kvport
