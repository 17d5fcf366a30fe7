// SPDX-License-Identifier: Apache-2.0
// A checker for HybridKvCache + HybridBlockTable under random operation
// streams (the fuzzer's hybrid mode and tests/unit/core/hybrid_model_test.cpp).
//
// The reference it compares with is the definition of each rule, computed
// from the sequences' tokens and the groups' prefix caches:
//  - a lookup hits the largest p valid for every group (brute force over p);
//  - a sequence's block list in each group has kNullBlock exactly before
//    first_needed_block(tokens held), live blocks after, one per block of
//    tokens, each full live block registered under the sequence's hash when
//    its group cached it;
//  - every group's blocks in use are exactly the distinct live blocks (and
//    state slots) the sequences hold;
//  - check_invariants() of every group holds after every operation;
//  - an append the table refuses (CacheExhausted) changed nothing.
//
// With a HybridHostTier under the groups (the fuzzer's hybrid tier mode and
// the HybridTierDriver tests) the driver also plays the engine's forward
// pass: after every append it writes each newly full block of every block
// group, and each sequence's working state, with bytes derived from the
// block's chained hash and the group. Every hit is then checked byte for
// byte (each live block of the hit and the state slot copied from the
// checkpoint), the hit counters and the tier's counters must agree with the
// lookup, a hit shorter than the definition's (device or host) is allowed
// only when counted as a short hit (fail closed), and check() adds the
// tiers' invariants. Over a FaultInjectingBackend a fault operation arms the
// failure of the Nth copy (at the call or deferred to the stream) or
// synchronize that the driver's cache calls make from then on (lookups,
// appends, forks, releases, evictions, offloads, polls, synchronizes; never
// the driver's own writes and reads): no call may throw except a
// BackendError that the armed fault caused (a table's own copy: the table
// must be as it was), the invariants must hold right after it, and every
// later hit must still hold the right bytes. A deferred fault that lands on
// the driver's own (compute) stream stops the operation stream (an engine
// cannot go on with a failed compute stream, and nothing can tell which
// bytes it left), after the invariants are checked.
#pragma once

#include <algorithm>
#include <cstdint>
#include <optional>
#include <set>
#include <span>
#include <string>
#include <vector>

#include "kvport/core/hybrid_block_table.hpp"
#include "kvport/core/hybrid_host_tier.hpp"
#include "kvport/core/hybrid_kv_cache.hpp"
#include "kvport/platform/div_ceil.hpp"
#include "kvport/platform/error.hpp"
#include "kvport/platform/fault_injecting_backend.hpp"
#include "kvport/testing/armed_fault.hpp"

namespace kvport::testing {

enum class HybridOpKind : std::uint8_t {
  start,    ///< a new sequence: prompt family a, tail length b; lookup, then prefill
  decode,   ///< sequence a appends b % 5 + 1 tokens
  fork,     ///< sequence a forks
  release,  ///< sequence a ends
  evict,    ///< group a evicts b % 4 + 1 cached blocks
  /// Sequence a takes a speculative step: b % 4 + 1 draft tokens
  /// (append_draft; a state group's slot for each written as the verifier
  /// would), (b / 4) % (drafts + 1) of them committed, the rest truncated.
  speculate,
  // With a HybridHostTier only (else nothing); kNumPlainHybridOps leaves them out.
  offload,      ///< group a's tier offloads b % 5 blocks
  poll,         ///< HybridHostTier::poll
  synchronize,  ///< HybridHostTier::synchronize
  /// With a FaultInjectingBackend only (else nothing): arms a fault, the
  /// (1 + b % 16)th call of one kind (a % 3: copy at the call, copy deferred
  /// to the stream, synchronize) that the driver's cache calls make from now.
  fault,
  count,
};

/// The kinds that act without a host tier (start .. speculate): what a
/// decoder of the plain hybrid mode draws from.
inline constexpr std::uint8_t kNumPlainHybridOps = 6;

inline const char* to_string(HybridOpKind k) {
  constexpr const char* kNames[] = {"start",       "decode",    "fork",    "release",
                                    "evict",       "speculate", "offload", "poll",
                                    "synchronize", "fault",     "count"};
  return kNames[static_cast<std::size_t>(k)];
}

struct HybridOp {
  HybridOpKind kind;
  std::uint32_t a;
  std::uint32_t b;
};

/// The definition of the hybrid hit: the largest p <= max_blocks valid for
/// every group, from `cached[g][i]`.
inline std::size_t reference_hit(const HybridKvCache& cache, std::size_t max_blocks,
                                 const std::vector<std::vector<bool>>& cached) {
  const std::size_t bs = cache.block_size();
  for (std::size_t p = max_blocks + 1; p-- > 0;) {
    if (p == 0) return 0;
    bool ok = true;
    for (std::size_t g = 0; g < cache.num_groups() && ok; ++g) {
      const GroupHitRule rule = hit_rule_of(cache.group(g).spec);
      if (rule.kind == LayerKind::state) {
        ok = cached[g][p - 1];
        continue;
      }
      for (std::size_t i = first_needed_block(rule, bs, p * bs); i < p && ok; ++i)
        ok = cached[g][i];
    }
    if (ok) return p;
  }
  return 0;
}

class HybridDriver {
 private:
  // Runs one of the driver's cache calls under the armed fault.
  template <class F>
  decltype(auto) cache_call(F&& fn) {
    return fault_.call(std::forward<F>(fn), [this] { faulted_ = true; });
  }

 public:
  /// `tier`: the HybridHostTier installed over `cache`'s groups (or null);
  /// `faults`: the FaultInjectingBackend `cache` lives on (or null; with a
  /// tier only). See the file comment.
  HybridDriver(HybridKvCache& cache, StreamView stream, HybridHostTier* tier = nullptr,
               FaultInjectingBackend* faults = nullptr)
      : cache_(cache), stream_(stream), tier_(tier), fault_(tier != nullptr ? faults : nullptr) {
    // Four prompt families over a 3-token vocabulary: long shared prefixes.
    for (std::uint32_t f = 0; f < 4; ++f) {
      std::vector<TokenId> t(f * 7 % 29);
      for (std::size_t i = 0; i < t.size(); ++i)
        t[i] = static_cast<TokenId>((i * (f + 1) + f) % 3);
      families_.push_back(std::move(t));
    }
  }

  /// Applies `op`; returns "" or a description of the first difference.
  std::string apply(const HybridOp& op) {
    if (stopped_) return "";
    last_ = op;
    faulted_ = false;
    std::string diff;
    try {
      diff = apply_op(op);
      if (diff.empty() && faulted_) diff = after_fault();
    } catch (const std::exception& e) {
      diff = std::string("a call threw: ") + e.what();
    }
    if (!diff.empty()) return fail(diff);
    if (++applied_ % full_check_every_ != 0 && !faulted_) return "";
    if (std::string d = check(); !d.empty()) return fail(d);
    return "";
  }

  /// apply() runs check() (the rules over every sequence and group, and the
  /// invariants) after every k-th operation (1, the default: after each one);
  /// each operation's own checks (a refused append changed nothing) always.
  /// A caller with k > 1 calls check() at the end as well. 0 is taken as 1.
  void set_full_check_every(std::size_t k) { full_check_every_ = k == 0 ? 1 : k; }

  std::size_t hits() const noexcept { return hits_; }
  /// Speculative steps taken (drafts appended) and draft tokens committed.
  std::size_t speculative_steps() const noexcept { return speculated_; }
  std::size_t committed_drafts() const noexcept { return committed_drafts_; }
  std::size_t refused_appends() const noexcept { return refused_; }
  /// Hits that came (partly) from a host tier, and the blocks of every hit
  /// read back and found right.
  std::size_t host_hits() const noexcept { return host_hits_; }
  std::size_t checked_blocks() const noexcept { return checked_blocks_; }
  /// Faults injected so far, those that made a call throw, and whether a
  /// deferred one on the compute stream stopped the operation stream.
  std::uint64_t faults_injected() const noexcept { return fault_.injected(); }
  std::uint64_t faults_thrown() const noexcept { return faults_thrown_; }
  bool stopped() const noexcept { return stopped_; }
  /// Releases every sequence (under the armed fault, if any: a release may
  /// reach a tier) and disarms.
  void release_all() {
    cache_call([&] { seqs_.clear(); });
    fault_.disarm();
  }

 private:
  std::string apply_op(const HybridOp& op) {
    switch (op.kind) {
      case HybridOpKind::start:
        return start(op.a, op.b);
      case HybridOpKind::decode:
        if (!seqs_.empty()) return decode(seqs_[op.a % seqs_.size()], op.b % 5 + 1);
        break;
      case HybridOpKind::fork:
        if (!seqs_.empty() && seqs_.size() < 8) {
          try {
            seqs_.push_back(cache_call([&] { return seqs_[op.a % seqs_.size()].fork(stream_); }));
          } catch (const CacheExhausted&) {  // no state slot: nothing changed
          } catch (const BackendError&) {    // the state copy: nothing changed
            if (!faulted_) throw;
            ++faults_thrown_;
          }
        }
        break;
      case HybridOpKind::release:
        if (!seqs_.empty()) cache_call([&] { seqs_.erase(seqs_.begin() + op.a % seqs_.size()); });
        break;
      case HybridOpKind::evict:
        (void)cache_call(
            [&] { return cache_.prefix_cache(op.a % cache_.num_groups()).evict(op.b % 4 + 1); });
        break;
      case HybridOpKind::speculate:
        if (!seqs_.empty()) return speculate(seqs_[op.a % seqs_.size()], op.b);
        break;
      case HybridOpKind::offload:
        if (tier_ != nullptr) {
          if (HostTier* t = tier_->group_tier(op.a % tier_->num_groups()))
            (void)cache_call([&] { return t->offload(op.b % 5); });
        }
        break;
      case HybridOpKind::poll:
        if (tier_ != nullptr) cache_call([&] { tier_->poll(); });
        break;
      case HybridOpKind::synchronize:
        if (tier_ != nullptr) cache_call([&] { tier_->synchronize(); });
        break;
      case HybridOpKind::fault:
        fault_.arm(op.a, op.b);
        break;
      case HybridOpKind::count:
        break;
    }
    return "";
  }

  // After an operation in which a fault was injected: a deferred one on the
  // compute stream shows at its synchronize (then the stream stops), and
  // every tier's invariants hold at once.
  std::string after_fault() {
    (void)compute_stream_failed();
    const InvariantReport r = tier_->check_invariants();
    if (!r.ok) return "invariants right after the fault: " + r.to_string();
    return "";
  }

  // After a cache call in which a fault was injected: whether it was a
  // deferred one on the compute stream (its synchronize throws it); then
  // the operation stream stops.
  bool compute_stream_failed() {
    if (!faulted_ || stopped_) return stopped_;
    try {
      cache_.backend().synchronize(stream_);
    } catch (const BackendError&) {
      stopped_ = true;
    }
    return stopped_;
  }

  std::string fail(const std::string& what) const {
    return std::string("after ") + to_string(last_.kind) + "(" + std::to_string(last_.a) + ", " +
           std::to_string(last_.b) + "): " + what;
  }

  // ---- content (with a tier) ----

  // The bytes of the block (or state) at chained hash `h` in group `g`.
  static std::vector<std::uint8_t> bytes_for(const BlockHash& h, std::size_t g, std::size_t layer,
                                             bool v, std::size_t n) {
    std::vector<std::uint8_t> out(n);
    for (std::size_t i = 0; i < n; ++i)
      out[i] = static_cast<std::uint8_t>((h.low >> (8 * (i % 8))) ^ (h.high >> (8 * (layer % 8))) ^
                                         (v ? 0x5A : 0xA5) ^ (17 * g) ^ i);
    return out;
  }
  void write(std::size_t g, BlockId b, const BlockHash& h) {
    PagedKvCache& pool = cache_.group_cache(g);
    for (std::size_t layer = 0; layer < pool.num_layers(); ++layer)
      pool.write_block(layer, b, bytes_for(h, g, layer, false, pool.k_block_bytes(layer)),
                       bytes_for(h, g, layer, true, pool.v_block_bytes(layer)), stream_);
  }
  bool holds(std::size_t g, BlockId b, const BlockHash& h) {
    const PagedKvCache& pool = cache_.group_cache(g);
    for (std::size_t layer = 0; layer < pool.num_layers(); ++layer) {
      const PagedKvCache::HostBlock hb = pool.read_block(layer, b, stream_);
      if (hb.k != bytes_for(h, g, layer, false, hb.k.size()) ||
          hb.v != bytes_for(h, g, layer, true, hb.v.size()))
        return false;
    }
    ++checked_blocks_;
    return true;
  }

  // The engine's forward pass after `t` grew from `old_tokens`: the blocks
  // that became full, and the working state (at the last full block).
  void compute(const HybridBlockTable& t, std::size_t old_tokens) {
    const std::size_t bs = cache_.block_size();
    const std::size_t full = t.num_tokens() / bs;
    if (full == 0) return;
    const std::vector<BlockHash> h = hash_full_blocks(t.tokens(), bs);
    for (std::size_t g = 0; g < cache_.num_groups(); ++g) {
      if (cache_.group(g).spec.has_state()) {
        if (const auto slot = t.state_slot(g)) write(g, *slot, h[full - 1]);
        continue;
      }
      const std::span<const BlockId> blocks = t.blocks(g);
      for (std::size_t i = old_tokens / bs; i < full && i < blocks.size(); ++i)
        if (blocks[i] != kNullBlock) write(g, blocks[i], h[i]);
    }
  }

  // The verifier's pass over `t`'s drafts: the state after each, as
  // compute() writes the working state (the bytes of the last full block).
  void write_draft_states(const HybridBlockTable& t, std::size_t committed) {
    const std::size_t bs = cache_.block_size();
    std::vector<TokenId> all(t.tokens().begin(), t.tokens().end());
    all.insert(all.end(), t.draft_tokens().begin(), t.draft_tokens().end());
    const std::vector<BlockHash> h = hash_full_blocks(all, bs);
    for (std::size_t g = 0; g < cache_.num_groups(); ++g) {
      const std::span<const BlockId> slots = t.draft_state_slots(g);
      for (std::size_t i = 0; i < slots.size(); ++i) {
        const std::size_t full = (committed + i + 1) / bs;
        if (full > 0) write(g, slots[i], h[full - 1]);
      }
    }
  }

  // A hit of `got` tokens of `prompt` holds what was computed for it.
  std::string check_hit_bytes(const HybridBlockTable& t, std::span<const TokenId> prompt,
                              std::size_t got) {
    const std::size_t bs = cache_.block_size();
    const std::size_t n = got / bs;
    if (n == 0) return "";
    const std::vector<BlockHash> h = hash_full_blocks(prompt.subspan(0, n * bs), bs);
    for (std::size_t g = 0; g < cache_.num_groups(); ++g) {
      if (cache_.group(g).spec.has_state()) {
        const auto slot = t.state_slot(g);
        if (!slot) return "group " + std::to_string(g) + ": a hit without a state slot";
        if (!holds(g, *slot, h[n - 1]))
          return "group " + std::to_string(g) + ": the hit's state holds wrong bytes";
        continue;
      }
      const std::span<const BlockId> blocks = t.blocks(g);
      for (std::size_t i = 0; i < blocks.size() && i < n; ++i) {
        if (blocks[i] != kNullBlock && !holds(g, blocks[i], h[i]))
          return "group " + std::to_string(g) + ": block " + std::to_string(i) +
                 " of the hit holds wrong bytes";
      }
    }
    return "";
  }

  std::string start(std::uint32_t family, std::uint32_t tail) {
    std::vector<TokenId> prompt = families_[family % families_.size()];
    for (std::uint32_t i = 0; i < tail % 9; ++i)
      prompt.push_back(static_cast<TokenId>((tail >> (i % 8)) % 3));
    HybridBlockTable t(cache_);
    if (tail % 2 == 1) t.set_prefix_hit_mode(PrefixHitMode::full);
    const std::size_t bs = cache_.block_size();
    const std::size_t max_blocks = t.prefix_hit_mode() == PrefixHitMode::full
                                       ? prompt.size() / bs
                                       : (prompt.empty() ? 0 : (prompt.size() - 1) / bs);
    const std::vector<BlockHash> h = hash_full_blocks(prompt, bs);
    std::vector<std::vector<bool>> cached(cache_.num_groups(), std::vector<bool>(max_blocks));
    // With a tier a block counts when the device or the group's tier holds
    // it. `also` adds what is cached now to `cached` (the bound after the
    // lookup, below).
    auto probe = [&](bool also) {
      for (std::size_t g = 0; g < cache_.num_groups(); ++g) {
        const PrefixCacheTier* lower = cache_.prefix_cache(g).tier();
        for (std::size_t i = 0; i < max_blocks; ++i) {
          const bool now = cache_.prefix_cache(g).find(h[i]).has_value() ||
                           (lower != nullptr && lower->holds(h[i]));
          cached[g][i] = (also && cached[g][i]) || now;
        }
      }
    };
    probe(false);
    const std::size_t want = reference_hit(cache_, max_blocks, cached) * bs;
    const HybridHitCounters before = cache_.hit_counters();
    const HostTierCounters tier_before =
        tier_ != nullptr ? tier_->total_counters() : HostTierCounters{};
    const bool slot_short = state_slot_short();
    std::size_t got = 0;
    try {
      got = cache_call([&] { return t.reuse_cached_prefix(prompt, stream_); });
    } catch (const BackendError& e) {
      // The state copy failed at the call: no hit, nothing taken.
      if (!faulted_) return std::string("reuse_cached_prefix threw: ") + e.what();
      ++faults_thrown_;
      if (t.num_tokens() != 0) return "a failed lookup left tokens in the table";
      return "";
    } catch (const std::exception& e) {
      return std::string("reuse_cached_prefix threw: ") + e.what();
    }
    if (compute_stream_failed()) return "";  // the state copy's deferred fault
    const HybridHitCounters& after = cache_.hit_counters();
    if (after.lookups != before.lookups + 1 ||
        after.lookup_tokens != before.lookup_tokens + prompt.size() ||
        after.hit_tokens != before.hit_tokens + got)
      return "the hit counters do not count the lookup";
    if (tier_ == nullptr) {
      // With a state group and no slot for the copy the hit is 0 by design.
      if (got != want && got != 0) {
        return "hit " + std::to_string(got) + " tokens, the reference says " + std::to_string(want);
      }
      if (got == 0 && want != 0 && !slot_short) {
        return "hit 0 tokens with slots free, the reference says " + std::to_string(want);
      }
    } else {
      // Fail closed: a hit shorter than the probe's is decided again and
      // counted as such; otherwise the definition's, or 0 for want of a
      // state slot.
      // A hit decided again (a block failed to come in; counted as a short
      // hit) may also come out longer than the first probe's: copies that
      // completed during the lookup made more blocks visible. Its bound is
      // the definition over what was cached before or is cached after the
      // lookup (every block of a hit is on the device when it returns).
      const std::uint64_t shorts = after.short_hits - before.short_hits;
      if (shorts > 1) return "one lookup counted " + std::to_string(shorts) + " short hits";
      std::size_t bound = want;
      if (got > want) {
        probe(true);
        bound = reference_hit(cache_, max_blocks, cached) * bs;
      }
      if (got > bound)
        return "hit " + std::to_string(got) + " tokens, more than the reference's " +
               std::to_string(bound) + " (" + std::to_string(want) + " before the lookup)";
      if (got > want && shorts == 0)
        return "hit " + std::to_string(got) + " tokens, more than the reference's " +
               std::to_string(want) + ", and not decided again";
      if (shorts == 0 && got < want && !(got == 0 && (slot_short || state_slot_short())))
        return "hit " + std::to_string(got) + " tokens, the reference says " +
               std::to_string(want) + " and no short hit was counted";
      if (shorts == 1 &&
          after.short_hit_tokens - before.short_hit_tokens != (got < want ? want - got : 0))
        return "a short hit of " + std::to_string(got) + " tokens for " + std::to_string(want) +
               " counted " + std::to_string(after.short_hit_tokens - before.short_hit_tokens) +
               " lost tokens";
      const HostTierCounters tier_after = tier_->total_counters();
      const std::uint64_t onloads = tier_after.onloads - tier_before.onloads;
      const std::uint64_t lower = after.lower_tier_blocks - before.lower_tier_blocks;
      if (lower > onloads || (got == 0 && lower != 0) ||
          (shorts == 0 && got > 0 && lower != onloads))
        return "the hit counts " + std::to_string(lower) + " blocks from the host, the tiers " +
               std::to_string(onloads) + " onloads";
      if (std::string d = check_hit_bytes(t, prompt, got); !d.empty()) return d;
      host_hits_ += lower > 0 ? 1 : 0;
    }
    hits_ += got > 0 ? 1 : 0;
    // Prefill in chunks that end at block boundaries (an engine's chunked
    // prefill in vLLM's "align" mode), so that states are checkpointed there.
    for (std::size_t at = got; at < prompt.size();) {
      const std::size_t n = std::min(prompt.size() - at, bs - at % bs);
      if (std::string d = append_checked(t, std::span<const TokenId>(prompt).subspan(at, n));
          !d.empty())
        return d;
      // Refused, failed, or the compute stream stopped: the sequence is dropped.
      if (t.num_tokens() != at + n || stopped_) return "";
      at += n;
    }
    if (seqs_.size() < 8) seqs_.push_back(std::move(t));
    return "";
  }

  bool state_slot_short() const {
    for (std::size_t g = 0; g < cache_.num_groups(); ++g) {
      if (cache_.group(g).spec.has_state() && cache_.prefix_cache(g).num_available_blocks() <= 1)
        return true;
    }
    return false;
  }

  std::string decode(HybridBlockTable& t, std::size_t n) {
    std::vector<TokenId> tokens(n);
    for (std::size_t i = 0; i < n; ++i)
      tokens[i] = static_cast<TokenId>(1000 + next_unique_++);
    return append_checked(t, tokens);
  }

  // A speculative step: drafts appended (as an append is checked: a refusal
  // or a failed copy leaves the table as it was), nothing holding them cached
  // while they are pending, then some committed and the rest truncated.
  std::string speculate(HybridBlockTable& t, std::uint32_t b) {
    const std::size_t k = b % 4 + 1;
    const std::size_t accept = (b / 4) % (k + 1);
    // Half the steps draft from the prompts' 3-token vocabulary, so that
    // later prompts can hit what they committed (and a state checkpoint a
    // commit kept); the others draft tokens no prompt has.
    std::vector<TokenId> drafts(k);
    for (std::size_t i = 0; i < k; ++i)
      drafts[i] = (b & 0x100) != 0 ? static_cast<TokenId>((b >> (9 + i)) % 3)
                                   : static_cast<TokenId>(1000 + next_unique_++);
    const std::size_t committed = t.num_committed();
    if (std::string d = append_checked(t, drafts, /*draft=*/true); !d.empty()) return d;
    // Refused, failed, or the compute stream stopped: no speculative step.
    if (t.num_draft_tokens() == 0 || stopped_) return "";
    if (t.num_draft_tokens() != k) return "append_draft holds the wrong number of drafts";
    if (const InvariantReport r = t.check_invariants(); !r.ok)
      return "with draft tokens pending: " + r.to_string();
    // The verifier writes the state after each draft (with a tier, where
    // bytes are checked): a commit may keep one as a checkpoint.
    if (tier_ != nullptr) write_draft_states(t, committed);
    cache_call([&] { t.commit(accept); });
    cache_call([&] { t.truncate(t.num_committed()); });
    if (t.num_tokens() != committed + accept || t.num_draft_tokens() != 0)
      return "commit and truncate left " + std::to_string(t.num_tokens()) + " tokens for " +
             std::to_string(committed + accept);
    ++speculated_;
    committed_drafts_ += accept;
    if (tier_ != nullptr) compute(t, committed);
    return "";
  }

  // Appends (append_tokens, or append_draft with `draft`); a refusal or a
  // failed copy must leave the table (and for a refusal the groups) as they
  // were.
  std::string append_checked(HybridBlockTable& t, std::span<const TokenId> tokens,
                             bool draft = false) {
    const char* call = draft ? "append_draft" : "append_tokens";
    const bool can = draft ? t.can_append_draft(tokens.size()) : t.can_append(tokens.size());
    const std::vector<TokenId> before(t.tokens().begin(), t.tokens().end());
    const std::size_t held = t.num_tokens();
    auto unchanged = [&] {
      return t.num_tokens() == held &&
             std::equal(before.begin(), before.end(), t.tokens().begin(), t.tokens().end());
    };
    std::vector<std::size_t> in_use;
    for (std::size_t g = 0; g < cache_.num_groups(); ++g)
      in_use.push_back(cache_.blocks_in_use(g));
    try {
      cache_call([&] {
        if (draft) {
          t.append_draft(tokens, stream_);
        } else {
          t.append_tokens(tokens, stream_);
        }
      });
      if (!can) return std::string("can_append said no, ") + call + " succeeded";
      if (compute_stream_failed()) return "";
      if (tier_ != nullptr && !draft) compute(t, before.size());
    } catch (const BackendError& e) {
      // A copy of the table's own failed at the call: the table as it was.
      if (!faulted_) throw;
      ++faults_thrown_;
      if (!unchanged()) return std::string("a failed ") + call + " changed the tokens: " + e.what();
    } catch (const CacheExhausted&) {
      if (can) return std::string("can_append said yes, ") + call + " threw CacheExhausted";
      ++refused_;
      if (!unchanged()) return std::string("a refused ") + call + " changed the tokens";
      for (std::size_t g = 0; g < cache_.num_groups(); ++g) {
        if (cache_.blocks_in_use(g) != in_use[g])
          return std::string("a refused ") + call + " changed group " + std::to_string(g) +
                 "'s blocks";
      }
    }
    return "";
  }

 public:
  /// The full check of apply(): "" or the first difference.
  std::string check() {
    const std::size_t bs = cache_.block_size();
    std::vector<std::set<BlockId>> held(cache_.num_groups());
    for (const HybridBlockTable& t : seqs_) {
      const std::size_t n = t.num_tokens();
      const std::vector<BlockHash> h = hash_full_blocks(t.tokens(), bs);
      for (std::size_t g = 0; g < cache_.num_groups(); ++g) {
        const LayerSpec& spec = cache_.group(g).spec;
        if (spec.has_state()) {
          if (n > 0 && !t.state_slot(g)) return "a sequence with tokens has no state slot";
          if (t.state_slot(g)) held[g].insert(*t.state_slot(g));
          continue;
        }
        const std::span<const BlockId> blocks = t.blocks(g);
        if (const InvariantReport r = t.check_invariants(); !r.ok)
          return "a sequence's own checks: " + r.to_string();
        if (blocks.size() != div_ceil(n, bs))
          return "group " + std::to_string(g) + " holds " + std::to_string(blocks.size()) +
                 " entries for " + std::to_string(n) + " tokens";
        // Released by the freeing rules (at an append, or by a hit): never
        // past the rule at n tokens, which only grows with n.
        const std::size_t limit = first_needed_block(hit_rule_of(spec), bs, n);
        for (std::size_t i = 0; i < blocks.size(); ++i) {
          if (blocks[i] == kNullBlock) {
            if (i >= limit)
              return "group " + std::to_string(g) + " block " + std::to_string(i) +
                     " is null but still in the span";
            continue;
          }
          held[g].insert(blocks[i]);
          if (i < h.size()) {
            const std::optional<BlockHash> cached = cache_.prefix_cache(g).hash_of(blocks[i]);
            if (cached && !(*cached == h[i]))
              return "group " + std::to_string(g) + " block " + std::to_string(i) +
                     " is cached under another hash";
          }
        }
      }
    }
    for (std::size_t g = 0; g < cache_.num_groups(); ++g) {
      // A tier holds device blocks of its copies in flight or queued (some
      // of them also a sequence's).
      const HostTier* tier = tier_ != nullptr ? tier_->group_tier(g) : nullptr;
      const std::size_t in_flight = tier != nullptr ? tier->num_held_device_blocks() : 0;
      if (cache_.blocks_in_use(g) < held[g].size() ||
          cache_.blocks_in_use(g) > held[g].size() + in_flight)
        return "group " + std::to_string(g) + " has " + std::to_string(cache_.blocks_in_use(g)) +
               " blocks in use, the sequences hold " + std::to_string(held[g].size()) +
               (tier != nullptr ? " and its tier " + std::to_string(in_flight) : std::string());
    }
    const InvariantReport r =
        tier_ != nullptr ? tier_->check_invariants() : cache_.check_invariants();
    if (!r.ok) return r.to_string();
    if (tier_ != nullptr) {
      HostTierCounters sum;
      for (std::size_t g = 0; g < tier_->num_groups(); ++g)
        sum += tier_->counters(g);
      const HostTierCounters total = tier_->total_counters();
      if (total.offloads != sum.offloads || total.onloads != sum.onloads ||
          total.offload_bytes != sum.offload_bytes || total.onload_bytes != sum.onload_bytes ||
          total.host_evictions != sum.host_evictions)
        return "the tiers' total counters are not the sum of the groups'";
      if (cache_.hit_counters().lower_tier_blocks > total.onloads)
        return "more hit blocks from the host than the tiers onloaded";
    }
    return "";
  }

 private:
  HybridKvCache& cache_;
  StreamView stream_;
  HybridHostTier* tier_;
  ArmedFault fault_;
  bool faulted_ = false;  // a fault was injected in this apply()
  bool stopped_ = false;  // a deferred fault on the compute stream
  std::uint64_t faults_thrown_ = 0;
  std::size_t host_hits_ = 0;
  std::size_t checked_blocks_ = 0;
  HybridOp last_{HybridOpKind::count, 0, 0};
  std::vector<std::vector<TokenId>> families_;
  std::vector<HybridBlockTable> seqs_;
  std::size_t hits_ = 0;
  std::size_t refused_ = 0;
  std::size_t speculated_ = 0;
  std::size_t committed_drafts_ = 0;
  std::uint32_t next_unique_ = 0;
  std::size_t full_check_every_ = 1;
  std::uint64_t applied_ = 0;
};

}  // namespace kvport::testing
