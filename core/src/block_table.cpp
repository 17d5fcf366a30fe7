// SPDX-License-Identifier: Apache-2.0
#include "kvport/core/block_table.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <optional>
#include <utility>

#include "kvport/core/prefix_cache.hpp"
#include "kvport/platform/div_ceil.hpp"
#include "kvport/platform/error.hpp"
#include "kvport/platform/log.hpp"
#include "vector_growth.hpp"

namespace kvport {

using detail::reserve_total;

BlockTable::BlockTable(PagedKvCache* cache, PrefixCache* prefix, std::uint64_t extra_key)
    : cache_(cache),
      prefix_(prefix),
      extra_key_(extra_key),
      block_size_(cache->config().block_size) {}

BlockTable::BlockTable(PagedKvCache& cache) : BlockTable(&cache, nullptr, 0) {}

BlockTable::BlockTable(PrefixCache& prefix_cache, std::uint64_t extra_key)
    : BlockTable(&prefix_cache.kv_cache(), &prefix_cache, extra_key) {}

BlockTable::~BlockTable() {
  release();
}

BlockTable::BlockTable(BlockTable&& other) noexcept
    : cache_(other.cache_),
      prefix_(other.prefix_),
      extra_key_(other.extra_key_),
      block_size_(other.block_size_),
      blocks_(std::exchange(other.blocks_, {})),
      tokens_(std::exchange(other.tokens_, {})),
      hashes_(std::exchange(other.hashes_, {})),
      prompt_(std::exchange(other.prompt_, {})),
      prompt_hashes_(std::exchange(other.prompt_hashes_, {})),
      copy_on_writes_(std::exchange(other.copy_on_writes_, 0)),
      hit_mode_(other.hit_mode_) {}

BlockTable& BlockTable::operator=(BlockTable&& other) noexcept {
  if (this != &other) {
    release();
    cache_ = other.cache_;
    prefix_ = other.prefix_;
    extra_key_ = other.extra_key_;
    block_size_ = other.block_size_;
    blocks_ = std::exchange(other.blocks_, {});
    tokens_ = std::exchange(other.tokens_, {});
    hashes_ = std::exchange(other.hashes_, {});
    prompt_ = std::exchange(other.prompt_, {});
    prompt_hashes_ = std::exchange(other.prompt_hashes_, {});
    copy_on_writes_ = std::exchange(other.copy_on_writes_, 0);
    hit_mode_ = other.hit_mode_;
  }
  return *this;
}

std::size_t BlockTable::last_block_fill() const noexcept {
  if (blocks_.empty()) return 0;
  return tokens_.size() - (blocks_.size() - 1) * block_size_;
}

std::size_t BlockTable::available_blocks() const noexcept {
  return prefix_ != nullptr ? prefix_->num_available_blocks() : cache_->num_free_blocks();
}

BlockId BlockTable::alloc_one() {
  return prefix_ != nullptr ? prefix_->alloc_block() : cache_->alloc_block();
}

void BlockTable::release_one(BlockId block) noexcept {
  try {
    if (prefix_ != nullptr) {
      prefix_->release(block);
    } else {
      cache_->free_block(block);
    }
  } catch (...) {  // only logging can throw here; the release itself happened
  }
}

BlockTable::AppendPlan BlockTable::plan_append(std::size_t num_tokens) const {
  const std::size_t room = blocks_.empty() ? 0 : block_size_ - last_block_fill();
  const std::size_t beyond = num_tokens > room ? num_tokens - room : 0;
  AppendPlan plan;
  plan.fresh_blocks = div_ceil(beyond, block_size_);
  plan.copy_on_write = num_tokens > 0 && room > 0 && cache_->ref_count(blocks_.back()) > 1;
  return plan;
}

std::size_t BlockTable::blocks_needed(std::size_t num_tokens) const {
  return plan_append(num_tokens).blocks();
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
  return reuse_cached_prefix(prompt, stream, /*wait_for_copy=*/false);
}

std::size_t BlockTable::reuse_cached_prefix(std::span<const TokenId> prompt) {
  return reuse_cached_prefix(prompt, cache_->backend().default_stream(), /*wait_for_copy=*/true);
}

std::size_t BlockTable::reuse_cached_prefix(std::span<const TokenId> prompt, StreamView stream,
                                            bool wait_for_copy) {
  if (!blocks_.empty() || !tokens_.empty()) {
    throw InvalidArgument(fmt::format(
        "BlockTable::reuse_cached_prefix: the table already holds {} tokens; a cached prefix can "
        "only start an empty table",
        tokens_.size()));
  }
  if (prefix_ == nullptr) return 0;
  std::vector<BlockHash> prompt_hashes = hash_full_blocks(prompt, block_size_, extra_key_);
  PrefixMatch match = prefix_->lookup_hashes(prompt_hashes);
  // The whole prompt hit: the engine would have no token left to compute.
  const bool whole_prompt = hit_mode_ == PrefixHitMode::compute_last_token &&
                            match.num_tokens == prompt.size() && !match.blocks.empty();
  std::optional<BlockId> copy;  // the private copy of the last block, if taken
  std::size_t hit = match.num_tokens;
  try {
    if (whole_prompt) {
      hit = prompt.size() - 1;
      if (block_size_ > 1) copy = prefix_->try_alloc_block();
      if (copy) {
        const BlockCopy c{match.blocks.back(), *copy};
        cache_->copy_blocks({&c, 1}, stream);
        if (wait_for_copy) cache_->backend().synchronize(stream);
      } else {
        hit = prompt.size() - block_size_;  // stop before the last block
      }
    }
    tokens_.assign(prompt.begin(), prompt.begin() + static_cast<std::ptrdiff_t>(hit));
    prompt_.assign(prompt.begin(), prompt.end());
  } catch (...) {
    tokens_.clear();
    if (copy) release_one(*copy);
    prefix_->release_blocks(match.blocks);
    throw;
  }

  // Commit: nothing below allocates or throws.
  if (whole_prompt) {
    // The last block is no longer full in this table: its hash is not the
    // table's, and the table's reference on the cached block goes back (it
    // stays cached; the copy was queued before, in stream order).
    match.hashes.pop_back();
    const BlockId cached = match.blocks.back();
    if (copy) {
      match.blocks.back() = *copy;
      ++copy_on_writes_;
    } else {
      match.blocks.pop_back();
    }
    release_one(cached);
  }
  prompt_hashes_ = std::move(prompt_hashes);
  blocks_ = std::move(match.blocks);
  hashes_ = std::move(match.hashes);
  return hit;
}

void BlockTable::append_tokens(std::span<const TokenId> tokens, StreamView stream) {
  if (tokens.empty()) return;
  const AppendPlan plan = plan_append(tokens.size());
  const bool cow = plan.copy_on_write;
  const std::size_t fresh_blocks = plan.fresh_blocks;
  const std::size_t needed = plan.blocks();
  if (needed > available_blocks()) {
    throw CacheExhausted(fmt::format(
        "KV cache exhausted: appending {} tokens needs {} blocks, {} are free{}", tokens.size(),
        needed, available_blocks(), prefix_ != nullptr ? " or evictable" : ""));
  }

  // Everything that can throw happens before the table changes.
  reserve_total(blocks_, blocks_.size() + fresh_blocks);
  reserve_total(tokens_, tokens_.size() + tokens.size());
  if (prefix_ != nullptr) reserve_total(hashes_, (tokens_.size() + tokens.size()) / block_size_);
  std::vector<BlockId> fresh;
  fresh.reserve(needed);
  try {
    for (std::size_t i = 0; i < needed; ++i)
      fresh.push_back(alloc_one());
    if (cow) {
      const BlockCopy copy{blocks_.back(), fresh.front()};
      cache_->copy_blocks({&copy, 1}, stream);
    }
  } catch (...) {
    for (auto it = fresh.rbegin(); it != fresh.rend(); ++it)
      release_one(*it);
    throw;
  }

  // Commit: nothing below allocates or throws.
  auto next = fresh.begin();
  if (cow) {
    const BlockId shared = blocks_.back();
    blocks_.back() = *next++;
    release_one(shared);  // the other sharers keep it
    ++copy_on_writes_;
  }
  blocks_.insert(blocks_.end(), next, fresh.end());
  tokens_.insert(tokens_.end(), tokens.begin(), tokens.end());
  register_full_blocks();
}

void BlockTable::register_full_blocks() noexcept {
  if (prefix_ == nullptr) return;
  const std::size_t full = tokens_.size() / block_size_;
  const std::size_t first = hashes_.size();
  if (first >= full) return;
  try {
    // append_tokens reserved the capacity: this does not throw.
    extend_chain_hashes(hashes_, tokens_, block_size_, extra_key_);
  } catch (...) {
    return;  // cannot happen; the new blocks would stay unregistered
  }
  // One run: the blocks filled by this append, announced together.
  BlockOrigin origin;
  if (first > 0) origin.parent = hashes_[first - 1];
  origin.tokens =
      std::span<const TokenId>(tokens_).subspan(first * block_size_, (full - first) * block_size_);
  origin.extra_key = extra_key_;
  try {
    (void)prefix_->insert_run(std::span<const BlockHash>(hashes_).subspan(first),
                              std::span<const BlockId>(blocks_).subspan(first, full - first),
                              origin);
  } catch (...) {  // cannot happen (the run is valid); the blocks stay uncached
  }
}

BlockTable BlockTable::fork() const {
  BlockTable child(cache_, prefix_, extra_key_);
  child.hit_mode_ = hit_mode_;
  child.blocks_ = blocks_;
  child.tokens_ = tokens_;
  child.hashes_ = hashes_;
  std::size_t shared = 0;
  try {
    for (; shared < blocks_.size(); ++shared)
      cache_->inc_ref(blocks_[shared]);
  } catch (...) {
    child.blocks_.resize(shared);  // the child releases what it took
    throw;
  }
  return child;
}

void BlockTable::release() noexcept {
  for (auto it = blocks_.rbegin(); it != blocks_.rend(); ++it)
    release_one(*it);
  blocks_.clear();
  tokens_.clear();
  hashes_.clear();
  prompt_.clear();
  prompt_hashes_.clear();
}

}  // namespace kvport
