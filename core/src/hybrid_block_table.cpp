// SPDX-License-Identifier: Apache-2.0
#include "kvport/core/hybrid_block_table.hpp"

#include <absl/container/inlined_vector.h>
#include <fmt/format.h>

#include <algorithm>
#include <stdexcept>
#include <utility>

#include "kvport/core/block_hash.hpp"
#include "kvport/platform/div_ceil.hpp"
#include "kvport/platform/error.hpp"
#include "vector_growth.hpp"

namespace kvport {
namespace {

using detail::reserve_total;

bool is_full_kind(LayerKind k) {
  return k == LayerKind::full_attention || k == LayerKind::mla;
}

}  // namespace

struct HybridBlockTable::Plan {
  struct PerGroup {
    std::size_t release_to = 0;  // entries before it are released first
    std::size_t releasable = 0;  // of those, blocks that come back to the group
    std::size_t fresh = 0;       // new blocks (or 1 new working state slot)
    bool copy_on_write = false;  // the shared, partly filled last block is copied
    bool checkpoint = false;     // a state checkpoint is due (best-effort)
    std::size_t needed() const { return fresh + (copy_on_write ? 1 : 0); }
  };
  absl::InlinedVector<PerGroup, 4> groups;
};

HybridBlockTable::HybridBlockTable(HybridKvCache& cache, std::uint64_t extra_key)
    : cache_(&cache),
      extra_key_(extra_key),
      block_size_(cache.block_size()),
      groups_(cache.num_groups()) {}

HybridBlockTable::~HybridBlockTable() {
  release();
}

HybridBlockTable::HybridBlockTable(HybridBlockTable&& other) noexcept
    : cache_(other.cache_),
      extra_key_(other.extra_key_),
      block_size_(other.block_size_),
      groups_(std::exchange(other.groups_, std::vector<Group>(other.groups_.size()))),
      tokens_(std::exchange(other.tokens_, {})),
      draft_(std::exchange(other.draft_, {})),
      hashes_(std::exchange(other.hashes_, {})),
      prompt_(std::exchange(other.prompt_, {})),
      prompt_hashes_(std::exchange(other.prompt_hashes_, {})),
      checkpointed_at_(std::exchange(other.checkpointed_at_, 0)),
      keep_at_(std::exchange(other.keep_at_, 0)),
      keep_shared_(other.keep_shared_),
      copy_on_writes_(std::exchange(other.copy_on_writes_, 0)),
      hit_mode_(other.hit_mode_),
      copy_last_(other.copy_last_) {}

HybridBlockTable& HybridBlockTable::operator=(HybridBlockTable&& other) noexcept {
  if (this != &other) {
    release();
    cache_ = other.cache_;
    extra_key_ = other.extra_key_;
    block_size_ = other.block_size_;
    groups_ = std::exchange(other.groups_, std::vector<Group>(other.groups_.size()));
    tokens_ = std::exchange(other.tokens_, {});
    draft_ = std::exchange(other.draft_, {});
    hashes_ = std::exchange(other.hashes_, {});
    prompt_ = std::exchange(other.prompt_, {});
    prompt_hashes_ = std::exchange(other.prompt_hashes_, {});
    checkpointed_at_ = std::exchange(other.checkpointed_at_, 0);
    keep_at_ = std::exchange(other.keep_at_, 0);
    keep_shared_ = other.keep_shared_;
    copy_on_writes_ = std::exchange(other.copy_on_writes_, 0);
    hit_mode_ = other.hit_mode_;
    copy_last_ = other.copy_last_;
  }
  return *this;
}

std::span<const BlockId> HybridBlockTable::blocks(std::size_t g) const {
  (void)cache_->group(g);
  return groups_[g].blocks;
}

std::size_t HybridBlockTable::num_live_blocks(std::size_t g) const {
  (void)cache_->group(g);
  return groups_[g].blocks.size() - groups_[g].live_begin;
}

std::span<const BlockId> HybridBlockTable::draft_state_slots(std::size_t g) const {
  (void)cache_->group(g);
  return groups_[g].draft_states;
}

std::optional<BlockId> HybridBlockTable::state_slot(std::size_t g) const {
  (void)cache_->group(g);
  return groups_[g].state;
}

void HybridBlockTable::release_block(std::size_t g, BlockId block, bool demoted) noexcept {
  try {
    PrefixCache* prefix = prefix_at(g);
    if (prefix == nullptr) {
      (void)pool_at(g).free_block(block);
    } else if (demoted) {
      prefix->release_demoted(block);
    } else {
      prefix->release(block);
    }
  } catch (...) {  // only logging can throw; the release itself happened
  }
}

std::size_t HybridBlockTable::available_in(std::size_t g) const noexcept {
  const PrefixCache* prefix = prefix_at(g);
  return prefix != nullptr ? prefix->num_available_blocks() : pool_at(g).num_free_blocks();
}

BlockId HybridBlockTable::alloc_in(std::size_t g) {
  PrefixCache* prefix = prefix_at(g);
  return prefix != nullptr ? prefix->alloc_block() : pool_at(g).alloc_block();
}

void HybridBlockTable::release_taken(std::span<std::vector<BlockId>> taken) noexcept {
  for (std::size_t g = 0; g < taken.size(); ++g) {
    for (auto it = taken[g].rbegin(); it != taken[g].rend(); ++it)
      release_block(g, *it);
    taken[g].clear();
  }
}

void HybridBlockTable::reserve_hit(std::size_t blocks, std::size_t tokens) {
  try {
    for (std::size_t g = 0; g < groups_.size(); ++g) {
      if (cache_->group(g).spec.kind != LayerKind::state) groups_[g].blocks.reserve(blocks);
    }
    tokens_.reserve(tokens);
  } catch (...) {
    for (Group& grp : groups_)
      grp = Group{};
    throw;
  }
}

void HybridBlockTable::place_hit(std::size_t g, std::size_t first,
                                 std::span<const BlockId> blocks) noexcept {
  Group& grp = groups_[g];
  grp.blocks.assign(first, kNullBlock);  // reserved by the caller: no allocation
  grp.blocks.insert(grp.blocks.end(), blocks.begin(), blocks.end());
  grp.live_begin = first;
}

void HybridBlockTable::release_before(std::size_t g, std::size_t first) noexcept {
  Group& grp = groups_[g];
  // Oldest first: they are evicted in that order.
  for (std::size_t i = grp.live_begin; i < first; ++i) {
    const BlockId b = grp.blocks[i];
    if (b == kNullBlock) continue;
    // Demoted: evicted before blocks released otherwise (a window's block
    // serves only a hit that ends a window there; the table keeps those of
    // its hit points, keep_window).
    release_block(g, b, /*demoted=*/true);
    grp.blocks[i] = kNullBlock;
  }
  grp.live_begin = std::max(grp.live_begin, first);
}

void HybridBlockTable::release() noexcept {
  std::size_t end = 0;
  for (const Group& grp : groups_)
    end = std::max(end, grp.blocks.size());
  for (std::size_t i = end; i-- > 0;) {
    for (std::size_t g = 0; g < groups_.size(); ++g) {
      Group& grp = groups_[g];
      if (i >= grp.live_begin && i < grp.blocks.size() && grp.blocks[i] != kNullBlock)
        release_block(g, grp.blocks[i]);
    }
  }
  for (std::size_t g = 0; g < groups_.size(); ++g) {
    Group& grp = groups_[g];
    release_kept(g, grp.kept_end);
    release_kept(g, grp.kept_hit);
    for (auto it = grp.draft_states.rbegin(); it != grp.draft_states.rend(); ++it)
      release_block(g, *it);
    if (grp.state) release_block(g, *grp.state);
    grp = Group{};
  }
  tokens_.clear();
  draft_.clear();
  hashes_.clear();
  forget_prompt();
  checkpointed_at_ = 0;
  keep_at_ = 0;
}

HybridBlockTable::Plan HybridBlockTable::plan_append(std::size_t num_tokens, bool draft) const {
  Plan plan;
  plan.groups.resize(groups_.size());
  // Room is counted past every token held, drafts included; the freeing
  // rules see the committed tokens only (a rollback may need the rest).
  const std::size_t committed = tokens_.size();
  const std::size_t n = committed + draft_.size();
  for (std::size_t g = 0; g < groups_.size(); ++g) {
    const LayerSpec& spec = cache_->group(g).spec;
    const Group& grp = groups_[g];
    Plan::PerGroup& p = plan.groups[g];
    if (spec.has_state()) {
      // A new working slot; with drafts also one slot per draft token (the
      // state after it, which the verifier writes).
      p.fresh = ((!grp.state && num_tokens > 0) ? 1 : 0) + (draft ? num_tokens : 0);
      p.checkpoint = num_tokens > 0 && grp.state && checkpoint_due();
      continue;
    }
    const PagedKvCache& pool = pool_at(g);
    const PrefixCache* prefix = prefix_at(g);
    p.release_to =
        std::max(grp.live_begin, first_needed_block(hit_rule_of(spec), block_size_, committed));
    for (std::size_t i = grp.live_begin; i < p.release_to; ++i) {
      const BlockId b = grp.blocks[i];
      if (b == kNullBlock) continue;
      const bool cached = prefix != nullptr && prefix->is_cached(b);
      if (pool.ref_count(b) == (cached ? 2u : 1u)) ++p.releasable;
    }
    const std::size_t fill = grp.blocks.empty() ? 0 : n - (grp.blocks.size() - 1) * block_size_;
    const std::size_t room = grp.blocks.empty() ? 0 : block_size_ - fill;
    p.fresh = div_ceil(num_tokens > room ? num_tokens - room : 0, block_size_);
    p.copy_on_write = num_tokens > 0 && room > 0 && pool.ref_count(grp.blocks.back()) > 1;
  }
  return plan;
}

std::vector<HybridBlockTable::GroupNeed> HybridBlockTable::blocks_needed(
    std::size_t num_tokens) const {
  const Plan plan = plan_append(num_tokens);
  std::vector<GroupNeed> out;
  out.reserve(plan.groups.size());
  for (const Plan::PerGroup& p : plan.groups)
    out.push_back(GroupNeed{p.needed(), p.releasable});
  return out;
}

std::size_t HybridBlockTable::group_needed(std::size_t g, std::size_t num_tokens) const {
  return plan_append(num_tokens).groups[g].needed();
}

HybridBlockTable::PoolNeed HybridBlockTable::shared_need(const Plan& plan) const {
  PoolNeed need;
  if (cache_->shared_pool() == nullptr) return need;
  for (std::size_t g = 0; g < plan.groups.size(); ++g) {
    if (!cache_->in_shared_pool(g)) continue;
    need.needed += plan.groups[g].needed();
    need.releasable += plan.groups[g].releasable;
  }
  need.available = cache_->shared_pool()->num_available_blocks();
  return need;
}

std::size_t HybridBlockTable::short_group(const Plan& plan, const PoolNeed& shared) const {
  for (std::size_t g = 0; g < plan.groups.size(); ++g) {
    if (cache_->in_shared_pool(g)) {
      if (shared.needed > shared.available + shared.releasable) return g;
      continue;
    }
    const Plan::PerGroup& p = plan.groups[g];
    if (p.needed() > available_in(g) + p.releasable) return g;
  }
  return plan.groups.size();
}

bool HybridBlockTable::plan_fits(std::size_t num_tokens, bool draft) const {
  const Plan plan = plan_append(num_tokens, draft);
  return short_group(plan, shared_need(plan)) == plan.groups.size();
}

bool HybridBlockTable::can_append(std::size_t num_tokens) const {
  return plan_fits(num_tokens, /*draft=*/false);
}

bool HybridBlockTable::can_append_draft(std::size_t num_tokens) const {
  return plan_fits(num_tokens, /*draft=*/true);
}

bool HybridBlockTable::checkpoint_due() const noexcept {
  const std::size_t n = tokens_.size();
  const std::size_t interval = cache_->config().state_checkpoint_interval;
  return interval > 0 && n > 0 && n % (interval * block_size_) == 0 && checkpointed_at_ != n;
}

bool HybridBlockTable::fits_in_place(std::size_t num_tokens, bool draft) const {
  // Decode's hot path: the specs are read unchecked, and full attention
  // skips the freeing rule it does not have. Room past every token held; the
  // freeing rule on the committed ones.
  const std::size_t committed = tokens_.size();
  const std::size_t n = committed + draft_.size();
  const std::vector<KvCacheGroup>& specs = cache_->groups_;
  for (std::size_t g = 0; g < groups_.size(); ++g) {
    const Group& grp = groups_[g];
    const LayerSpec& spec = specs[g].spec;
    if (spec.kind == LayerKind::state) {
      if (draft || !grp.state || checkpoint_due()) return false;  // drafts take state slots
      continue;
    }
    const std::size_t held = grp.blocks.size();
    if (held == 0 || held * block_size_ - n < num_tokens) return false;
    if (!is_full_kind(spec.kind) &&
        first_needed_block(hit_rule_of(spec), block_size_, committed) > grp.live_begin)
      return false;
    if (pool_at(g).ref_count(grp.blocks.back()) != 1) return false;
  }
  return true;
}

void HybridBlockTable::append_tokens(std::span<const TokenId> tokens, StreamView stream) {
  require_no_drafts("append_tokens");
  append(tokens, stream, /*draft=*/false);
}

void HybridBlockTable::require_no_drafts(const char* call) const {
  if (!draft_.empty()) {
    throw InvalidArgument(fmt::format(
        "HybridBlockTable::{}: the table holds {} draft tokens; commit or truncate them first",
        call, draft_.size()));
  }
}

void HybridBlockTable::append_draft(std::span<const TokenId> tokens, StreamView stream) {
  append(tokens, stream, /*draft=*/true);
}

void HybridBlockTable::append(std::span<const TokenId> tokens, StreamView stream, bool draft) {
  if (tokens.empty()) return;
  // Decode's usual case: every group's last block has room, nothing to free,
  // copy or checkpoint.
  if (fits_in_place(tokens.size(), draft)) {
    if (draft) {
      draft_.insert(draft_.end(), tokens.begin(), tokens.end());
      return;
    }
    tokens_.insert(tokens_.end(), tokens.begin(), tokens.end());
    if (tokens_.size() % block_size_ == 0) {
      try {
        reserve_total(hashes_, tokens_.size() / block_size_);
      } catch (...) {
        tokens_.resize(tokens_.size() - tokens.size());
        throw;
      }
      register_full_blocks();
    }
    return;
  }
  const Plan plan = plan_append(tokens.size(), draft);
  const std::size_t ng = groups_.size();
  const PoolNeed pool_need = shared_need(plan);
  if (const std::size_t g = short_group(plan, pool_need); g < ng) {
    if (cache_->in_shared_pool(g)) {
      throw CacheExhausted(fmt::format(
          "KV cache exhausted: appending {} tokens needs {} blocks of the shared pool (group {}, "
          "{}, and the groups sharing it), {} are free or evictable and {} come back from the "
          "freeing rules",
          tokens.size(), pool_need.needed, g, cache_->group(g).spec.describe(), pool_need.available,
          pool_need.releasable));
    }
    const Plan::PerGroup& p = plan.groups[g];
    if (ng == 1 && p.releasable == 0) {  // one group: nothing to name
      throw CacheExhausted(fmt::format(
          "KV cache exhausted: appending {} tokens needs {} blocks, {} are free{}", tokens.size(),
          p.needed(), available_in(g), prefix_at(g) != nullptr ? " or evictable" : ""));
    }
    throw CacheExhausted(fmt::format(
        "KV cache exhausted: appending {} tokens needs {} blocks in group {} ({}), {} are free "
        "or evictable and {} come back from the freeing rules",
        tokens.size(), p.needed(), g, cache_->group(g).spec.describe(), available_in(g),
        p.releasable));
  }
  // Everything that can throw happens before the table changes (but see the
  // freeing rules below).
  const std::size_t n = tokens_.size();
  if (draft) {
    reserve_total(draft_, draft_.size() + tokens.size());
    for (std::size_t g = 0; g < ng; ++g) {
      if (cache_->group(g).spec.has_state())
        reserve_total(groups_[g].draft_states, groups_[g].draft_states.size() + tokens.size());
    }
  } else {
    reserve_total(tokens_, n + tokens.size());
    reserve_total(hashes_, (n + tokens.size()) / block_size_);
  }
  for (std::size_t g = 0; g < ng; ++g)
    reserve_total(groups_[g].blocks, groups_[g].blocks.size() + plan.groups[g].fresh);

  // Groups that only have room once their freeing rules ran release first:
  // those blocks are out of the sequence's span, whatever happens next.
  for (std::size_t g = 0; g < ng; ++g) {
    const Plan::PerGroup& p = plan.groups[g];
    if (cache_->in_shared_pool(g) ? pool_need.needed > pool_need.available
                                  : p.needed() > available_in(g))
      release_before(g, p.release_to);
  }

  absl::InlinedVector<absl::InlinedVector<BlockId, 4>, 4> fresh(ng);
  absl::InlinedVector<std::optional<BlockId>, 4> checkpoint(ng);
  auto give_back = [&]() noexcept {
    for (std::size_t g = 0; g < ng; ++g) {
      for (auto it = fresh[g].rbegin(); it != fresh[g].rend(); ++it)
        release_block(g, *it);
      if (checkpoint[g]) release_block(g, *checkpoint[g]);
    }
  };
  try {
    for (std::size_t g = 0; g < ng; ++g) {
      const Plan::PerGroup& p = plan.groups[g];
      PagedKvCache& pool = pool_at(g);
      fresh[g].reserve(p.needed());
      for (std::size_t i = 0; i < p.needed(); ++i)
        fresh[g].push_back(alloc_in(g));
      if (p.copy_on_write) {
        const BlockCopy c{groups_[g].blocks.back(), fresh[g].front()};
        pool.copy_blocks({&c, 1}, stream);
      }
      if (cache_->group(g).spec.has_state()) {
        PrefixCache& prefix = cache_->prefix_cache(g);
        // A new sequence's state starts at 0 (a draft's slot is the
        // verifier's to write).
        if (!groups_[g].state && !fresh[g].empty())
          pool.zero_blocks(std::span<const BlockId>(fresh[g]).first(1), stream);
        if (p.checkpoint && !prefix.find(hashes_[n / block_size_ - 1])) {
          checkpoint[g] = prefix.try_alloc_block();
          if (checkpoint[g]) {
            const BlockCopy c{*groups_[g].state, *checkpoint[g]};
            pool.copy_blocks({&c, 1}, stream);
          }
        }
      }
    }
  } catch (...) {
    give_back();
    throw;
  }

  // Commit: nothing below throws.
  for (std::size_t g = 0; g < ng; ++g) {
    const Plan::PerGroup& p = plan.groups[g];
    Group& grp = groups_[g];
    if (cache_->group(g).spec.has_state()) {
      auto next = fresh[g].begin();
      if (!grp.state && next != fresh[g].end()) grp.state = *next++;
      grp.draft_states.insert(grp.draft_states.end(), next, fresh[g].end());  // reserved
      if (checkpoint[g]) {
        (void)cache_checkpoint(g, n / block_size_ - 1, *checkpoint[g]);
        release_block(g, *checkpoint[g]);  // cached: evictable; else freed
      }
      continue;
    }
    release_before(g, p.release_to);
    auto next = fresh[g].begin();
    if (p.copy_on_write) {
      const BlockId shared = grp.blocks.back();
      grp.blocks.back() = *next++;
      release_block(g, shared);  // the other sharers keep it
      ++copy_on_writes_;
    }
    grp.blocks.insert(grp.blocks.end(), next, fresh[g].end());
  }
  for (std::size_t g = 0; g < ng; ++g) {
    if (plan.groups[g].checkpoint) {
      checkpointed_at_ = n;
      break;
    }
  }
  if (draft) {
    draft_.insert(draft_.end(), tokens.begin(), tokens.end());  // reserved
    return;
  }
  tokens_.insert(tokens_.end(), tokens.begin(), tokens.end());
  register_full_blocks();
  keep_shared_point();
}

bool HybridBlockTable::cache_checkpoint(std::size_t g, std::size_t k, BlockId slot) noexcept {
  // The checkpoint is the state after block k: announced as block k (its
  // hash, parent and tokens), as vLLM announces a mamba group's cached
  // blocks.
  BlockOrigin origin;
  if (k > 0) origin.parent = hashes_[k - 1];
  origin.tokens = std::span<const TokenId>(tokens_).subspan(k * block_size_, block_size_);
  origin.extra_key = extra_key_;
  try {
    (void)cache_->prefix_cache(g).insert(hashes_[k], slot, origin);
    ++cache_->hit_counters().state_checkpoints;
    return true;
  } catch (...) {  // out of memory for the index: no checkpoint
    return false;
  }
}

void HybridBlockTable::commit(std::size_t n) {
  if (n > draft_.size()) {
    throw InvalidArgument(
        fmt::format("HybridBlockTable::commit: {} tokens, but the table holds {} draft tokens", n,
                    draft_.size()));
  }
  if (n == 0) return;
  const std::size_t before = tokens_.size();
  const std::size_t committed = before + n;
  reserve_total(tokens_, committed);  // may throw: nothing changed
  reserve_total(hashes_, committed / block_size_);
  const auto end = draft_.begin() + static_cast<std::ptrdiff_t>(n);
  tokens_.insert(tokens_.end(), draft_.begin(), end);
  draft_.erase(draft_.begin(), end);
  register_full_blocks();
  commit_states(before, n);
  keep_shared_point();
}

void HybridBlockTable::commit_states(std::size_t before, std::size_t n) noexcept {
  const std::size_t interval = cache_->config().state_checkpoint_interval * block_size_;
  for (std::size_t g = 0; g < groups_.size(); ++g) {
    Group& grp = groups_[g];
    if (!cache_->group(g).spec.has_state()) continue;
    // The state after the n-th draft is the working state now.
    release_block(g, *grp.state);
    grp.state = grp.draft_states[n - 1];
    for (std::size_t i = 0; i + 1 < n; ++i) {
      const BlockId slot = grp.draft_states[i];
      const std::size_t at = before + i + 1;  // tokens the state is after
      // A checkpoint's position: the slot is the checkpoint, cached under
      // the hash of the block it ends (as append_tokens caches a copy).
      if (interval > 0 && at % interval == 0 && cache_->caches_prefixes() &&
          !cache_->prefix_cache(g).find(hashes_[at / block_size_ - 1]) &&
          cache_checkpoint(g, at / block_size_ - 1, slot)) {
        checkpointed_at_ = at;
      }
      release_block(g, slot);  // cached: evictable; else freed
    }
    grp.draft_states.erase(grp.draft_states.begin(),
                           grp.draft_states.begin() + static_cast<std::ptrdiff_t>(n));
  }
}

void HybridBlockTable::truncate(std::size_t n) {
  if (n < tokens_.size() || n > num_tokens()) {
    throw InvalidArgument(fmt::format(
        "HybridBlockTable::truncate: {} tokens is outside [{}, {}]: the table holds {} committed "
        "tokens, which are never taken back, and {} draft tokens",
        n, tokens_.size(), num_tokens(), tokens_.size(), draft_.size()));
  }
  draft_.resize(n - tokens_.size());
  // The blocks wholly past token n held draft tokens only: never registered,
  // so released they are freed. Last first. A state group's slots for the
  // dropped drafts likewise.
  const std::size_t keep = div_ceil(n, block_size_);
  for (std::size_t g = 0; g < groups_.size(); ++g) {
    Group& grp = groups_[g];
    while (grp.draft_states.size() > draft_.size()) {
      release_block(g, grp.draft_states.back());
      grp.draft_states.pop_back();
    }
    while (grp.blocks.size() > keep) {
      const BlockId b = grp.blocks.back();
      grp.blocks.pop_back();
      if (b != kNullBlock) release_block(g, b);
    }
  }
}

InvariantReport HybridBlockTable::check_invariants() const {
  InvariantReport report;
  const std::size_t want = div_ceil(num_tokens(), block_size_);
  const std::size_t full = tokens_.size() / block_size_;  // blocks full of committed tokens
  for (std::size_t g = 0; g < groups_.size(); ++g) {
    const Group& grp = groups_[g];
    if (cache_->group(g).spec.has_state()) {
      if (grp.draft_states.size() != draft_.size()) {
        report.add_violation(fmt::format("state group {} holds {} draft state slots for {} drafts",
                                         g, grp.draft_states.size(), draft_.size()));
      }
      const PrefixCache* prefix = prefix_at(g);
      for (BlockId slot : grp.draft_states) {
        if (prefix != nullptr && prefix->is_cached(slot)) {
          report.add_violation(
              fmt::format("state group {}: draft state slot {} is cached", g, slot));
        }
      }
      if (grp.state && prefix != nullptr && prefix->is_cached(*grp.state)) {
        report.add_violation(
            fmt::format("state group {}: the working slot {} is cached", g, *grp.state));
      }
      continue;
    }
    if (grp.blocks.size() != want && !(grp.blocks.empty() && num_tokens() == 0)) {
      report.add_violation(fmt::format("group {} holds {} block entries for {} tokens ({} wanted)",
                                       g, grp.blocks.size(), num_tokens(), want));
    }
    for (std::size_t i = 0; i < std::min(grp.live_begin, grp.blocks.size()); ++i) {
      if (grp.blocks[i] != kNullBlock) {
        report.add_violation(fmt::format(
            "group {}: entry {} is live before the first live entry {}", g, i, grp.live_begin));
      }
    }
    const PrefixCache* prefix = prefix_at(g);
    if (prefix == nullptr) continue;
    for (std::size_t i = full; i < grp.blocks.size(); ++i) {
      if (grp.blocks[i] != kNullBlock && prefix->is_cached(grp.blocks[i])) {
        report.add_violation(fmt::format(
            "group {}: block {} (entry {}) holds tokens past the {} committed full blocks but is "
            "cached: another request could hit it",
            g, grp.blocks[i], i, full));
      }
    }
  }
  return report;
}

void HybridBlockTable::keep_shared_point() noexcept {
  // Other requests that share this prompt's cached prefix hit where it ends
  // too: the window before that point stays held while this sequence runs.
  // It would otherwise slide out and, cached but released, be evicted while
  // the full-attention chain, held by every sequence that shares it, stays:
  // a chain no lookup can hit.
  if (keep_at_ == 0 || tokens_.size() / block_size_ < keep_at_) return;
  for (std::size_t g = 0; g < groups_.size(); ++g)
    keep_window(g, keep_at_, groups_[g].kept_hit);
  keep_at_ = 0;
}

void HybridBlockTable::remember_prompt(std::span<const TokenId> prompt) {
  std::vector<BlockHash> hashes = hash_full_blocks(prompt, block_size_, extra_key_);
  prompt_.assign(prompt.begin(), prompt.end());  // strong: on a throw prompt_ is unchanged
  prompt_hashes_ = std::move(hashes);
}

void HybridBlockTable::forget_prompt() noexcept {
  std::vector<TokenId>().swap(prompt_);
  std::vector<BlockHash>().swap(prompt_hashes_);
}

void HybridBlockTable::register_full_blocks() noexcept {
  if (!cache_->caches_prefixes()) return;  // nothing to register in
  const std::size_t full = tokens_.size() / block_size_;
  const std::size_t first = hashes_.size();
  if (first >= full) return;
  // Blocks the prompt's lookup hashed already, while the table's tokens are
  // the prompt's: their hashes are taken, not computed again (the blocks
  // before them are the prompt's too, so the chain is the same). The room
  // is reserved: push_back does not allocate.
  std::size_t known = first;
  for (; known < full && known < prompt_hashes_.size(); ++known) {
    const auto at = static_cast<std::ptrdiff_t>(known * block_size_);
    const auto end = at + static_cast<std::ptrdiff_t>(block_size_);
    if (!std::equal(tokens_.begin() + at, tokens_.begin() + end, prompt_.begin() + at)) break;
    hashes_.push_back(prompt_hashes_[known]);
  }
  // Used up, or the tokens differ: the rest is hashed.
  if (known == prompt_hashes_.size() || known < full) forget_prompt();
  try {
    // append_tokens reserved the capacity: this does not throw.
    extend_chain_hashes(hashes_, tokens_, block_size_, extra_key_);
  } catch (...) {
    return;  // cannot happen; the new blocks would stay unregistered
  }
  // Per group, each unbroken run of live blocks among the new full ones is
  // registered (and announced) at once.
  const std::span<const BlockHash> hashes(hashes_);
  const std::span<const TokenId> tokens(tokens_);
  for (std::size_t g = 0; g < groups_.size(); ++g) {
    const Group& grp = groups_[g];
    const std::size_t end = std::min(full, grp.blocks.size());
    for (std::size_t i = first; i < end;) {
      if (grp.blocks[i] == kNullBlock) {
        ++i;
        continue;
      }
      std::size_t j = i;
      while (j < end && grp.blocks[j] != kNullBlock)
        ++j;
      BlockOrigin origin;
      if (i > 0) origin.parent = hashes[i - 1];
      origin.tokens = tokens.subspan(i * block_size_, (j - i) * block_size_);
      origin.extra_key = extra_key_;
      try {
        (void)prefix_at(g)->insert_run(hashes.subspan(i, j - i),
                                       std::span<const BlockId>(grp.blocks).subspan(i, j - i),
                                       origin);
      } catch (...) {  // cannot happen (the run is valid); the blocks stay uncached
      }
      i = j;
    }
  }
}

std::size_t HybridBlockTable::reuse_cached_prefix(std::span<const TokenId> prompt,
                                                  StreamView stream) {
  if (!empty()) {
    throw InvalidArgument(fmt::format(
        "HybridBlockTable::reuse_cached_prefix: the table already holds {} tokens; a cached "
        "prefix can only start an empty table",
        num_tokens()));
  }
  if (!cache_->caches_prefixes()) return 0;  // a plain cache caches nothing
  HybridHitCounters& counters = cache_->hit_counters();
  ++counters.lookups;
  counters.lookup_tokens += prompt.size();
  remember_prompt(prompt);
  if (groups_.size() == 1 && is_full_kind(cache_->group(0).spec.kind))
    return reuse_one_group(prompt, stream);
  const std::size_t max_blocks = hit_mode_ == PrefixHitMode::full
                                     ? prompt.size() / block_size_
                                     : (prompt.empty() ? 0 : (prompt.size() - 1) / block_size_);
  if (copy_last_ && hit_mode_ == PrefixHitMode::compute_last_token && block_size_ > 1 &&
      !prompt.empty() && prompt.size() % block_size_ == 0) {
    if (const std::size_t hit = reuse_copying_last_block(prompt, prompt_hashes_, stream); hit != 0)
      return hit;
  }
  if (max_blocks == 0) return 0;
  std::vector<BlockHash> hashes(prompt_hashes_.begin(),
                                prompt_hashes_.begin() + static_cast<std::ptrdiff_t>(max_blocks));

  const std::size_t ng = groups_.size();
  absl::InlinedVector<GroupHitRule, 4> rules(ng);
  std::size_t anchor = ng;  // the first full-attention (or MLA) group
  bool tiered = false;      // some group has a lower tier
  for (std::size_t g = 0; g < ng; ++g) {
    rules[g] = hit_rule_of(cache_->group(g).spec);
    if (anchor == ng && is_full_kind(rules[g].kind)) anchor = g;
    if (cache_->prefix_cache(g).tier() != nullptr) tiered = true;
  }

  absl::InlinedVector<std::vector<BlockId>, 4> taken(ng);
  absl::InlinedVector<std::optional<BlockId>, 4> slots(ng);
  absl::InlinedVector<std::size_t, 4> first(ng, 0);
  absl::InlinedVector<std::size_t, 4> onloaded(ng, 0);
  auto give_back = [&]() noexcept {
    release_taken(taken);
    for (std::size_t g = 0; g < ng; ++g) {
      onloaded[g] = 0;
      if (slots[g]) release_block(g, *slots[g]);
      slots[g].reset();
    }
  };

  std::size_t chain_end = 0;  // where the anchor's cached chain ends (no tier)
  // Decides the hit. Without a lower tier, the anchor's lookup takes its
  // chain (one probe a block, as BlockTable's) and the other groups are
  // probed only where the rule needs them. With one, a block counts when the
  // device or the group's tier holds it, and nothing is taken or copied
  // until the hit is known (the anchor's chain on the host may run past it).
  auto decide = [&]() -> std::size_t {
    if (!tiered) {
      PrefixMatch anchor_match;
      if (anchor < ng) anchor_match = cache_->prefix_cache(anchor).lookup_hashes(hashes);
      const std::size_t anchor_chain = anchor_match.blocks.size();
      chain_end = anchor_chain;
      if (anchor < ng) taken[anchor] = std::move(anchor_match.blocks);
      auto cached = [&](std::size_t g, std::size_t i) {
        if (g == anchor) return i < anchor_chain;
        return cache_->prefix_cache(g).find(hashes[i]).has_value();
      };
      const std::size_t hit = find_hybrid_hit(rules, block_size_, max_blocks, cached);
      if (anchor < ng) {
        while (taken[anchor].size() > hit) {
          release_block(anchor, taken[anchor].back());
          taken[anchor].pop_back();
        }
      }
      return hit;
    }
    auto cached = [&](std::size_t g, std::size_t i) {
      const PrefixCache& prefix = cache_->prefix_cache(g);
      if (prefix.find(hashes[i])) return true;
      const PrefixCacheTier* tier = prefix.tier();
      return tier != nullptr && tier->holds(hashes[i]);
    };
    return find_hybrid_hit(rules, block_size_, max_blocks, cached);
  };

  // Takes every group's blocks of a hit of `hit` blocks (a lower tier copies
  // its blocks in as each lookup reaches them). False when some block the
  // decision counted could not be brought in; what was taken stays in
  // `taken` for give_back.
  auto take = [&](std::size_t hit) -> bool {
    for (std::size_t g = 0; g < ng; ++g) {
      // A state group needs the checkpoint cached under the hash of block
      // hit - 1; a block group the blocks [first, hit).
      first[g] = rules[g].kind == LayerKind::state
                     ? hit - 1
                     : std::min(hit, first_needed_block(rules[g], block_size_, hit * block_size_));
      if (g == anchor && !tiered) continue;  // taken by decide()
      PrefixCache& prefix = cache_->prefix_cache(g);
      const auto span = std::span<const BlockHash>(hashes).subspan(first[g], hit - first[g]);
      // Device runs and lower-tier runs alternate: one lookup per run.
      while (taken[g].size() < span.size()) {
        PrefixMatch m = prefix.lookup_hashes(span.subspan(taken[g].size()));
        if (m.blocks.empty()) break;
        onloaded[g] += m.lower_tier_blocks;
        taken[g].insert(taken[g].end(), m.blocks.begin(), m.blocks.end());
      }
      if (taken[g].size() != span.size()) {
        if (!tiered) {  // nothing can go between the probe and the lookup
          throw std::logic_error(
              "HybridBlockTable::reuse_cached_prefix: a block the hit rule found is gone");
        }
        return false;
      }
    }
    return true;
  };

  // With a lower tier, a block found by the probe may fail to come in (a
  // copy failed; an onload's allocations evicted a block not taken yet):
  // everything is given back and the hit decided again on what is there now
  // (fail closed: never a hit with a block missing). Each round changes what
  // is cached (blocks copied in stay on the device), so a few rounds settle;
  // after the last the hit is 0.
  constexpr int kMaxRounds = 3;
  std::size_t hit = 0;
  std::size_t first_hit = 0;
  bool complete = false;
  bool redone = false;
  try {
    for (int round = 0; round < kMaxRounds && !complete; ++round) {
      hit = decide();
      if (round == 0) first_hit = hit;
      if (hit == 0) break;
      complete = take(hit);
      if (!complete) {
        give_back();
        redone = true;
      }
    }
    if (!complete) hit = 0;
    if (hit != 0) {
      // State: the checkpoint's reference is held (taken[g]) while a slot is
      // found, so allocating cannot evict it.
      for (std::size_t g = 0; g < ng; ++g) {
        if (rules[g].kind != LayerKind::state) continue;
        slots[g] = cache_->prefix_cache(g).try_alloc_block();
        if (!slots[g]) {  // no slot to copy the state into: no hit
          hit = 0;
          break;
        }
        const BlockCopy c{taken[g].front(), *slots[g]};
        cache_->group_cache(g).copy_blocks({&c, 1}, stream);
      }
    }
  } catch (...) {
    give_back();
    throw;
  }
  if (redone) {
    ++counters.short_hits;
    if (first_hit > hit) counters.short_hit_tokens += (first_hit - hit) * block_size_;
  }
  // Where this prompt leaves what is cached: other requests sharing the
  // prefix hit there, so the window before it is kept (keep_window) once it
  // is computed, or now when the hit reached it.
  keep_at_ = keep_shared_ ? std::max(hit, chain_end) : 0;
  if (hit == 0) {
    give_back();
    return 0;
  }

  // Commit: nothing below throws (the vectors' memory is reserved first).
  try {
    reserve_hit(hit, prompt.size());
  } catch (...) {
    give_back();
    throw;
  }
  for (std::size_t g = 0; g < ng; ++g) {
    Group& grp = groups_[g];
    counters.lower_tier_blocks += onloaded[g];
    if (rules[g].kind == LayerKind::state) {
      for (BlockId b : taken[g])
        release_block(g, b);  // the checkpoint stays cached, evictable again
      grp.state = slots[g];
      continue;
    }
    place_hit(g, first[g], taken[g]);
  }
  tokens_.assign(prompt.begin(), prompt.begin() + static_cast<std::ptrdiff_t>(hit * block_size_));
  hashes.resize(hit);
  hashes_ = std::move(hashes);
  keep_shared_point();
  checkpointed_at_ = tokens_.size();  // the state there came from a checkpoint
  counters.hit_tokens += tokens_.size();
  return tokens_.size();
}

std::size_t HybridBlockTable::reuse_one_group(std::span<const TokenId> prompt, StreamView stream) {
  PrefixCache& prefix = *prefix_at(0);
  const bool compute_last = hit_mode_ == PrefixHitMode::compute_last_token;
  const bool copy_last = copy_last_ && compute_last;
  std::span<const BlockHash> hashes = prompt_hashes_;
  // compute_last_token without the copy: at most n - 1 tokens, whole blocks.
  if (compute_last && !copy_last && !prompt.empty())
    hashes = hashes.first(std::min(hashes.size(), (prompt.size() - 1) / block_size_));
  // One lookup: the cached chain (extended by a lower tier, which copies its
  // blocks in) is the hit.
  PrefixMatch match = prefix.lookup_hashes(hashes);
  const bool whole_prompt = copy_last && !match.blocks.empty() && match.num_tokens == prompt.size();
  std::optional<BlockId> copy;  // the private copy of the last block, if taken
  std::size_t hit = match.num_tokens;
  try {
    if (whole_prompt) {
      hit = prompt.size() - 1;
      if (block_size_ > 1) copy = prefix.try_alloc_block();
      if (copy) {
        const BlockCopy c{match.blocks.back(), *copy};
        pool_at(0).copy_blocks({&c, 1}, stream);
      } else {
        hit = prompt.size() - block_size_;  // stop before the last block
      }
    }
    reserve_hit(match.blocks.size(), hit);
  } catch (...) {
    if (copy) release_block(0, *copy);
    prefix.release_blocks(match.blocks);
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
    release_block(0, cached);
  }
  place_hit(0, 0, match.blocks);
  tokens_.assign(prompt.begin(), prompt.begin() + static_cast<std::ptrdiff_t>(hit));
  hashes_ = std::move(match.hashes);
  keep_at_ = 0;
  HybridHitCounters& counters = cache_->hit_counters();
  counters.lower_tier_blocks += match.lower_tier_blocks;
  counters.hit_tokens += hit;
  return hit;
}

std::size_t HybridBlockTable::reuse_copying_last_block(std::span<const TokenId> prompt,
                                                       std::span<const BlockHash> hashes,
                                                       StreamView stream) {
  const std::size_t ng = groups_.size();
  const std::size_t p = hashes.size();         // every block of the prompt
  const std::size_t next = prompt.size() - 1;  // the token the engine computes
  absl::InlinedVector<std::size_t, 4> first(ng, 0);
  for (std::size_t g = 0; g < ng; ++g) {
    const LayerSpec& spec = cache_->group(g).spec;
    if (spec.kind == LayerKind::state || cache_->prefix_cache(g).tier() != nullptr) return 0;
    first[g] = first_needed_block(hit_rule_of(spec), block_size_, next);
  }
  // Every block each group needs for the next token, cached on the device.
  for (std::size_t g = 0; g < ng; ++g) {
    const PrefixCache& prefix = cache_->prefix_cache(g);
    for (std::size_t i = first[g]; i < p; ++i)
      if (!prefix.find(hashes[i])) return 0;
  }
  absl::InlinedVector<std::vector<BlockId>, 4> taken(ng);
  absl::InlinedVector<std::optional<BlockId>, 4> copies(ng);
  auto give_back = [&]() noexcept {
    release_taken(taken);
    for (std::size_t g = 0; g < ng; ++g)
      if (copies[g]) release_block(g, *copies[g]);
  };
  try {
    for (std::size_t g = 0; g < ng; ++g) {
      PrefixMatch m = cache_->prefix_cache(g).lookup_hashes(hashes.subspan(first[g]));
      taken[g] = std::move(m.blocks);
      if (taken[g].size() != p - first[g]) {  // nothing can go between the probe and here
        give_back();
        return 0;
      }
    }
    // The copies: a fresh block in every group (taken blocks are held, so
    // these allocations cannot evict them), or the default rule.
    for (std::size_t g = 0; g < ng; ++g) {
      copies[g] = cache_->prefix_cache(g).try_alloc_block();
      if (!copies[g]) {
        give_back();
        return 0;
      }
    }
    for (std::size_t g = 0; g < ng; ++g) {
      const BlockCopy c{taken[g].back(), *copies[g]};
      cache_->group_cache(g).copy_blocks({&c, 1}, stream);
    }
    reserve_hit(p, prompt.size());
  } catch (...) {
    give_back();
    throw;
  }
  // Commit: nothing below throws. The cached last blocks' references go back
  // once their copies are queued (as BlockTable's copy-on-write does).
  for (std::size_t g = 0; g < ng; ++g) {
    release_block(g, taken[g].back());
    taken[g].back() = *copies[g];
    place_hit(g, first[g], taken[g]);
    ++copy_on_writes_;
  }
  tokens_.assign(prompt.begin(), prompt.end() - 1);
  hashes_.assign(hashes.begin(), hashes.end() - 1);  // the last block is partial again
  // Other requests hit where this prompt ends: its window is kept once the
  // table holds the last token again.
  keep_at_ = keep_shared_ ? p : 0;
  HybridHitCounters& counters = cache_->hit_counters();
  counters.hit_tokens += tokens_.size();
  return tokens_.size();
}

HybridBlockTable HybridBlockTable::adopt(HybridKvCache& cache, std::span<const TokenId> tokens,
                                         std::span<const std::vector<BlockId>> blocks,
                                         std::span<const std::size_t> first_blocks,
                                         StreamView stream, std::uint64_t extra_key) {
  const std::size_t ng = cache.num_groups();
  const std::size_t bs = cache.block_size();
  if (tokens.empty()) throw InvalidArgument("HybridBlockTable::adopt: no tokens");
  if (blocks.size() != ng || first_blocks.size() != ng) {
    throw InvalidArgument(
        fmt::format("HybridBlockTable::adopt: {} block lists and {} first blocks for {} groups",
                    blocks.size(), first_blocks.size(), ng));
  }
  const std::size_t n = tokens.size();
  const std::size_t total = div_ceil(n, bs);
  for (std::size_t g = 0; g < ng; ++g) {
    const LayerSpec& spec = cache.group(g).spec;
    const PagedKvCache& pool = cache.group_cache(g);
    const std::size_t want = spec.has_state() ? 1 : total - std::min(first_blocks[g], total);
    const std::size_t limit = spec.has_state() ? 0 : first_needed_block(hit_rule_of(spec), bs, n);
    if (first_blocks[g] > limit || blocks[g].size() != want) {
      throw InvalidArgument(fmt::format(
          "HybridBlockTable::adopt: group {}: {} blocks from block {} for {} tokens (needs {} "
          "from a block <= {})",
          g, blocks[g].size(), first_blocks[g], n, want, limit));
    }
    for (BlockId b : blocks[g]) {
      if (b >= pool.num_blocks() || pool.ref_count(b) == 0) {
        throw InvalidArgument(fmt::format(
            "HybridBlockTable::adopt: group {}: block {} is out of range or free", g, b));
      }
    }
  }
  HybridBlockTable t(cache, extra_key);
  std::vector<std::optional<BlockId>> fresh(ng);
  bool checkpoint = false;
  try {
    for (std::size_t g = 0; g < ng; ++g) {
      if (!cache.group(g).spec.has_state()) continue;
      const BlockId slot = blocks[g].front();
      if (!cache.prefix_cache(g).is_cached(slot)) continue;
      // A checkpoint stays immutable in the cache: the working state is a copy.
      fresh[g] = cache.prefix_cache(g).try_alloc_block();
      if (!fresh[g]) {
        throw CacheExhausted(fmt::format(
            "HybridBlockTable::adopt: group {}: no state slot for the working state", g));
      }
      const BlockCopy c{slot, *fresh[g]};
      cache.group_cache(g).copy_blocks({&c, 1}, stream);
      checkpoint = true;
    }
    t.tokens_.assign(tokens.begin(), tokens.end());
    t.hashes_ = hash_full_blocks(tokens, bs, extra_key);
    for (std::size_t g = 0; g < ng; ++g) {
      Group& grp = t.groups_[g];
      if (cache.group(g).spec.has_state()) continue;
      grp.blocks.reserve(total);
      grp.blocks.assign(first_blocks[g], kNullBlock);
      grp.blocks.insert(grp.blocks.end(), blocks[g].begin(), blocks[g].end());
      grp.live_begin = first_blocks[g];
    }
  } catch (...) {
    for (std::size_t g = 0; g < ng; ++g) {
      if (fresh[g]) cache.prefix_cache(g).release(*fresh[g]);
      t.groups_[g] = Group{};
    }
    t.tokens_.clear();
    throw;
  }
  // Commit (nothing below throws): the working slots.
  for (std::size_t g = 0; g < ng; ++g) {
    if (!cache.group(g).spec.has_state()) continue;
    if (fresh[g]) {
      t.release_block(g, blocks[g].front());  // the checkpoint stays cached, evictable
      t.groups_[g].state = fresh[g];
    } else {
      t.groups_[g].state = blocks[g].front();
    }
  }
  if (checkpoint) t.checkpointed_at_ = n;  // the state at n is cached already
  return t;
}

void HybridBlockTable::keep_window(std::size_t g, std::size_t end_block,
                                   std::vector<BlockId>& into) noexcept {
  Group& grp = groups_[g];
  release_kept(g, into);
  const LayerSpec& spec = cache_->group(g).spec;
  if (spec.kind != LayerKind::sliding_window) return;
  const std::size_t first = std::max(
      grp.live_begin, first_needed_block(hit_rule_of(spec), block_size_, end_block * block_size_));
  const std::size_t end = std::min(end_block, grp.blocks.size());
  if (first >= end) return;
  try {
    into.reserve(end - first);
    for (std::size_t i = first; i < end; ++i) {
      if (grp.blocks[i] == kNullBlock) continue;
      cache_->group_cache(g).inc_ref(grp.blocks[i]);
      into.push_back(grp.blocks[i]);
    }
  } catch (...) {  // out of memory or a refcount at its limit: keep nothing
    release_kept(g, into);
  }
}

void HybridBlockTable::release_kept(std::size_t g, std::vector<BlockId>& kept) noexcept {
  for (auto it = kept.rbegin(); it != kept.rend(); ++it)
    release_block(g, *it);
  kept.clear();
}

std::size_t HybridBlockTable::num_kept_blocks(std::size_t g) const {
  if (g >= groups_.size()) {
    throw OutOfRange(fmt::format(
        "HybridBlockTable::num_kept_blocks: group {} out of range ({} groups)", g, groups_.size()));
  }
  return groups_[g].kept_end.size() + groups_[g].kept_hit.size();
}

void HybridBlockTable::keep_hit_point() noexcept {
  const std::size_t full = tokens_.size() / block_size_;
  for (std::size_t g = 0; g < groups_.size(); ++g)
    keep_window(g, full, groups_[g].kept_end);
}

HybridBlockTable HybridBlockTable::fork(StreamView stream) const {
  require_no_drafts("fork");
  HybridBlockTable child(*cache_, extra_key_);
  child.hit_mode_ = hit_mode_;
  child.keep_shared_ = keep_shared_;
  child.copy_last_ = copy_last_;
  const std::size_t ng = groups_.size();
  // State copies first: they are what can fail.
  for (std::size_t g = 0; g < ng; ++g) {
    if (!groups_[g].state) continue;
    std::optional<BlockId> slot = cache_->prefix_cache(g).try_alloc_block();
    if (!slot) {
      throw CacheExhausted(fmt::format(
          "KV cache exhausted: fork needs a state slot in group {} ({}), none is free or evictable",
          g, cache_->group(g).spec.describe()));
    }
    child.groups_[g].state = slot;  // the child releases it if a later step throws
    const BlockCopy c{*groups_[g].state, *slot};
    cache_->group_cache(g).copy_blocks({&c, 1}, stream);
  }
  for (std::size_t g = 0; g < ng; ++g) {
    const Group& grp = groups_[g];
    Group& dst = child.groups_[g];
    dst.blocks.reserve(grp.blocks.size());
    for (std::size_t i = 0; i < grp.blocks.size(); ++i) {
      const BlockId b = grp.blocks[i];
      if (b != kNullBlock) cache_->group_cache(g).inc_ref(b);
      dst.blocks.push_back(b);  // reserved: cannot throw
    }
    dst.live_begin = grp.live_begin;
  }
  child.tokens_ = tokens_;
  child.hashes_ = hashes_;
  child.checkpointed_at_ = checkpointed_at_;
  return child;
}

}  // namespace kvport
