// SPDX-License-Identifier: Apache-2.0
// find_hybrid_hit (hybrid_kv_cache.hpp): a template so that the caller's
// probe (a prefix-cache lookup, a memo, a test's set) inlines.
#pragma once

#include <cstddef>
#include <limits>
#include <vector>

namespace kvport {

template <typename Cached>
std::size_t find_hybrid_hit(std::span<const GroupHitRule> rules, std::size_t block_size,
                            std::size_t max_blocks, Cached&& cached) {
  constexpr std::size_t kUnknown = std::numeric_limits<std::size_t>::max();
  auto is_full = [](LayerKind k) { return k == LayerKind::full_attention || k == LayerKind::mla; };
  // A full group's chain length from block 0, probed once (up to the first
  // candidate; the candidate only shrinks).
  // On the stack for the usual few groups (this runs on every lookup).
  constexpr std::size_t kInline = 8;
  std::size_t inline_chain[kInline];
  std::vector<std::size_t> heap_chain;
  std::size_t* chain = inline_chain;
  if (rules.size() > kInline) {
    heap_chain.resize(rules.size());
    chain = heap_chain.data();
  }
  for (std::size_t g = 0; g < rules.size(); ++g)
    chain[g] = kUnknown;
  std::size_t cand = max_blocks;

  auto largest_valid = [&](std::size_t g, std::size_t limit) -> std::size_t {
    const GroupHitRule& r = rules[g];
    if (is_full(r.kind)) {
      if (chain[g] == kUnknown) {
        std::size_t i = 0;
        while (i < limit && cached(g, i))
          ++i;
        chain[g] = i;
      }
      return chain[g] < limit ? chain[g] : limit;
    }
    if (r.kind == LayerKind::state) {
      std::size_t p = limit;
      while (p > 0 && !cached(g, p - 1))
        --p;
      return p;
    }
    if (r.kind == LayerKind::none) return limit;
    // Window and chunked: blocks [first(p), p) must all be cached. Scanning
    // right to left, a miss at block m rules out every p > m whose span
    // reaches m, so the next candidate is m.
    std::size_t p = limit;
    while (p > 0) {
      const std::size_t first = first_needed_block(r, block_size, p * block_size);
      std::size_t i = p;
      while (i > first && cached(g, i - 1))
        --i;
      if (i == first) return p;
      p = i - 1;
    }
    return 0;
  };

  // Full attention first: its chain bounds every other group.
  for (std::size_t g = 0; g < rules.size(); ++g) {
    if (is_full(rules[g].kind)) cand = largest_valid(g, cand);
  }
  for (bool changed = true; changed;) {
    changed = false;
    for (std::size_t g = 0; g < rules.size(); ++g) {
      const std::size_t p = largest_valid(g, cand);
      if (p < cand) {
        cand = p;
        changed = true;
      }
    }
  }
  return cand;
}

}  // namespace kvport
