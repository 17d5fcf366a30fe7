// SPDX-License-Identifier: Apache-2.0
#include "kvport/core/block_table.hpp"

#include <utility>

#include "kvport/core/prefix_cache.hpp"

namespace kvport {
namespace {

HybridBlockTable copying_last_block(HybridBlockTable table) noexcept {
  table.set_copy_last_block(true);
  return table;
}

}  // namespace

BlockTable::BlockTable(HybridBlockTable table, PagedKvCache* cache, PrefixCache* prefix) noexcept
    : table_(std::move(table)), cache_(cache), prefix_(prefix) {}

BlockTable::BlockTable(PagedKvCache& cache)
    : BlockTable(HybridBlockTable(HybridKvCache::over(cache)), &cache, nullptr) {}

BlockTable::BlockTable(PrefixCache& prefix_cache, std::uint64_t extra_key)
    : BlockTable(copying_last_block(HybridBlockTable(HybridKvCache::over(prefix_cache), extra_key)),
                 &prefix_cache.kv_cache(), &prefix_cache) {}

std::size_t BlockTable::last_block_fill() const noexcept {
  const std::size_t blocks = num_blocks();
  if (blocks == 0) return 0;
  return num_tokens() - (blocks - 1) * block_size();
}

std::size_t BlockTable::blocks_needed(std::size_t num_tokens) const {
  return table_.group_needed(0, num_tokens);
}

const char* to_string(PrefixHitMode mode) noexcept {
  switch (mode) {
    case PrefixHitMode::compute_last_token:
      return "compute_last_token";
    case PrefixHitMode::full:
      return "full";
  }
  return "unknown";
}

std::size_t BlockTable::reuse_cached_prefix(std::span<const TokenId> prompt, StreamView stream) {
  return table_.reuse_cached_prefix(prompt, stream);
}

std::size_t BlockTable::reuse_cached_prefix(std::span<const TokenId> prompt) {
  Backend& backend = cache_->backend();
  const StreamView stream = backend.default_stream();
  const std::uint64_t copies = table_.copy_on_writes();
  const std::size_t hit = table_.reuse_cached_prefix(prompt, stream);
  if (table_.copy_on_writes() != copies) {  // the last block's copy: wait for it
    try {
      backend.synchronize(stream);
    } catch (...) {
      table_.release();  // strong guarantee: the table is empty again
      throw;
    }
  }
  return hit;
}

void BlockTable::append_tokens(std::span<const TokenId> tokens, StreamView stream) {
  table_.append_tokens(tokens, stream);
}

BlockTable BlockTable::fork() const {
  // No state group: the stream is not used.
  return BlockTable(table_.fork(cache_->backend().default_stream()), cache_, prefix_);
}

void BlockTable::release() noexcept {
  table_.release();
}

}  // namespace kvport
