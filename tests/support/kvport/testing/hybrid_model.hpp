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
#pragma once

#include <algorithm>
#include <cstdint>
#include <set>
#include <string>
#include <vector>

#include "kvport/core/hybrid_block_table.hpp"
#include "kvport/core/hybrid_kv_cache.hpp"
#include "kvport/platform/error.hpp"

namespace kvport::testing {

enum class HybridOpKind : std::uint8_t {
  start,    ///< a new sequence: prompt family a, tail length b; lookup, then prefill
  decode,   ///< sequence a appends b % 5 + 1 tokens
  fork,     ///< sequence a forks
  release,  ///< sequence a ends
  evict,    ///< group a evicts b % 4 + 1 cached blocks
  count,
};

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
 public:
  HybridDriver(HybridKvCache& cache, StreamView stream) : cache_(cache), stream_(stream) {
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
    std::string diff;
    switch (op.kind) {
      case HybridOpKind::start:
        diff = start(op.a, op.b);
        break;
      case HybridOpKind::decode:
        if (!seqs_.empty()) diff = decode(seqs_[op.a % seqs_.size()], op.b % 5 + 1);
        break;
      case HybridOpKind::fork:
        if (!seqs_.empty() && seqs_.size() < 8) {
          try {
            seqs_.push_back(seqs_[op.a % seqs_.size()].fork(stream_));
          } catch (const CacheExhausted&) {  // no state slot: nothing changed
          }
        }
        break;
      case HybridOpKind::release:
        if (!seqs_.empty()) seqs_.erase(seqs_.begin() + op.a % seqs_.size());
        break;
      case HybridOpKind::evict:
        (void)cache_.prefix_cache(op.a % cache_.num_groups()).evict(op.b % 4 + 1);
        break;
      case HybridOpKind::count:
        break;
    }
    if (!diff.empty()) return diff;
    if (++applied_ % full_check_every_ != 0) return "";
    return check();
  }

  /// apply() runs check() (the rules over every sequence and group, and the
  /// invariants) after every k-th operation (1, the default: after each one);
  /// each operation's own checks (a refused append changed nothing) always.
  /// A caller with k > 1 calls check() at the end as well. 0 is taken as 1.
  void set_full_check_every(std::size_t k) { full_check_every_ = k == 0 ? 1 : k; }

  std::size_t hits() const noexcept { return hits_; }
  std::size_t refused_appends() const noexcept { return refused_; }
  void release_all() { seqs_.clear(); }

 private:
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
    for (std::size_t g = 0; g < cache_.num_groups(); ++g) {
      for (std::size_t i = 0; i < max_blocks; ++i)
        cached[g][i] = cache_.prefix_cache(g).find(h[i]).has_value();
    }
    const std::size_t want = reference_hit(cache_, max_blocks, cached) * bs;
    std::size_t got = 0;
    try {
      got = t.reuse_cached_prefix(prompt, stream_);
    } catch (const std::exception& e) {
      return std::string("reuse_cached_prefix threw: ") + e.what();
    }
    // With a state group and no slot for the copy the hit is 0 by design.
    if (got != want && got != 0) {
      return "hit " + std::to_string(got) + " tokens, the reference says " + std::to_string(want);
    }
    if (got == 0 && want != 0 && !state_slot_short()) {
      return "hit 0 tokens with slots free, the reference says " + std::to_string(want);
    }
    hits_ += got > 0 ? 1 : 0;
    // Prefill in chunks that end at block boundaries (an engine's chunked
    // prefill in vLLM's "align" mode), so that states are checkpointed there.
    for (std::size_t at = got; at < prompt.size();) {
      const std::size_t n = std::min(prompt.size() - at, bs - at % bs);
      if (std::string d = append_checked(t, std::span<const TokenId>(prompt).subspan(at, n));
          !d.empty())
        return d;
      if (t.num_tokens() != at + n) return "";  // refused: the sequence is dropped
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

  // Appends; a refusal must leave the table and the groups as they were.
  std::string append_checked(HybridBlockTable& t, std::span<const TokenId> tokens) {
    const bool can = t.can_append(tokens.size());
    const std::vector<TokenId> before(t.tokens().begin(), t.tokens().end());
    std::vector<std::size_t> in_use;
    for (std::size_t g = 0; g < cache_.num_groups(); ++g)
      in_use.push_back(cache_.blocks_in_use(g));
    try {
      t.append_tokens(tokens, stream_);
      if (!can) return "can_append said no, append_tokens succeeded";
    } catch (const CacheExhausted&) {
      if (can) return "can_append said yes, append_tokens threw CacheExhausted";
      ++refused_;
      if (!std::equal(before.begin(), before.end(), t.tokens().begin(), t.tokens().end()))
        return "a refused append changed the tokens";
      for (std::size_t g = 0; g < cache_.num_groups(); ++g) {
        if (cache_.blocks_in_use(g) != in_use[g])
          return "a refused append changed group " + std::to_string(g) + "'s blocks";
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
        if (blocks.size() != (n + bs - 1) / bs)
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
      if (cache_.blocks_in_use(g) != held[g].size())
        return "group " + std::to_string(g) + " has " + std::to_string(cache_.blocks_in_use(g)) +
               " blocks in use, the sequences hold " + std::to_string(held[g].size());
    }
    const InvariantReport r = cache_.check_invariants();
    if (!r.ok) return r.to_string();
    return "";
  }

 private:
  HybridKvCache& cache_;
  StreamView stream_;
  std::vector<std::vector<TokenId>> families_;
  std::vector<HybridBlockTable> seqs_;
  std::size_t hits_ = 0;
  std::size_t refused_ = 0;
  std::uint32_t next_unique_ = 0;
  std::size_t full_check_every_ = 1;
  std::uint64_t applied_ = 0;
};

}  // namespace kvport::testing
