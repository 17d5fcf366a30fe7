// SPDX-License-Identifier: Apache-2.0
// The attention exactness loop (tests/unit/core/attention_exactness_test.cpp,
// tests/unit/disk/disk_attention_test.cpp): random engine steps over a
// HybridKvCache, each checked by PagedAttentionModel (paged_attention.hpp).
#pragma once

#include <memory>
#include <random>
#include <string>
#include <vector>

#include "kvport/core/host_tier.hpp"
#include "kvport/core/hybrid_block_table.hpp"
#include "kvport/core/hybrid_host_tier.hpp"
#include "kvport/core/hybrid_kv_cache.hpp"
#include "kvport/testing/paged_attention.hpp"

namespace kvport::testing {

inline constexpr std::size_t kAttentionBlockSize = 4;

// Window W = 8, full attention, chunked local C = 8, and (with a pool per
// group) MLA: its pages (a 16-value latent, no V) differ from the others',
// so a shared pool holds the first three.
inline HybridKvCacheConfig attention_model(bool shared) {
  HybridKvCacheConfig c;
  c.block_size = kAttentionBlockSize;
  constexpr std::size_t d = PagedAttentionModel::kDim;
  c.layers = {LayerSpec::sliding_window(8, 1, d, d), LayerSpec::full_attention(1, d, d),
              LayerSpec::chunked_local(8, 1, d, d)};
  if (!shared) c.layers.push_back(LayerSpec::mla(8, 8));
  return c;
}

struct AttentionLoopCounts {
  std::size_t steps = 0;
  std::size_t hits = 0;
  std::size_t forks = 0;
  std::size_t speculative = 0;
  std::size_t preemptions = 0;
  std::size_t checked = 0;
};

// Runs `steps` random engine steps over `cache` (with `tier` under its
// groups: offloads and polls too, so blocks go to the host and come back);
// returns "" or the first difference.
inline std::string run_attention_loop(HybridKvCache& cache, StreamView stream, std::uint32_t seed,
                                      std::size_t steps, AttentionLoopCounts& counts,
                                      HybridHostTier* tier = nullptr) {
  PagedAttentionModel m(cache, stream);
  std::mt19937 rng(seed);
  std::vector<std::unique_ptr<HybridBlockTable>> live;
  std::vector<std::vector<TokenId>> preempted;
  // Four prompt families over a small vocabulary: shared prefixes.
  auto prompt = [&] {
    const std::size_t family = rng() % 4;
    std::vector<TokenId> p(6 + family * 5);
    for (std::size_t i = 0; i < p.size(); ++i)
      p[i] = static_cast<TokenId>((i * (family + 1)) % 5);
    for (std::size_t i = rng() % 4; i > 0; --i)
      p.push_back(static_cast<TokenId>(rng() % 5));
    return p;
  };
  // Starts a request for `p` (a prefix hit, then prefill); false when it
  // does not fit (nothing held).
  auto start = [&](const std::vector<TokenId>& p) {
    auto t = std::make_unique<HybridBlockTable>(cache);
    const std::size_t hit = t->reuse_cached_prefix(p, stream);
    if (!t->can_append(p.size() - hit)) return false;
    t->append_tokens(std::span<const TokenId>(p).subspan(hit), stream);
    m.write_new(*t, p.size() - hit);
    counts.hits += hit > 0 ? 1 : 0;
    live.push_back(std::move(t));
    return true;
  };
  for (std::size_t step = 0; step < steps; ++step) {
    const auto op = static_cast<std::uint32_t>(rng() % 10);
    if (live.empty() || op < 2) {
      if (!preempted.empty() && rng() % 2 == 0) {  // recompute a preempted request
        if (start(preempted.back())) preempted.pop_back();
      } else {
        (void)start(prompt());
      }
    } else if (op < 3 && live.size() < 8) {  // fork; the child decodes (copy-on-write)
      HybridBlockTable& parent = *live[rng() % live.size()];
      if (parent.can_append(1)) {
        auto child = std::make_unique<HybridBlockTable>(parent.fork(stream));
        const TokenId t = static_cast<TokenId>(rng() % 5);
        if (child->can_append(1)) {  // its copy of the shared last block may not fit
          child->append_tokens({&t, 1}, stream);
          m.write_new(*child, 1);
          live.push_back(std::move(child));
          ++counts.forks;
        }
      }
    } else if (op < 5) {  // a speculative step: draft, verify, accept some
      HybridBlockTable& t = *live[rng() % live.size()];
      const std::size_t k = 1 + rng() % 4;
      if (t.can_append_draft(k + 1)) {
        std::vector<TokenId> drafts(k);
        for (TokenId& d : drafts)
          d = static_cast<TokenId>(rng() % 5);
        t.append_draft(drafts, stream);
        m.write_new(t, k);  // the verifier writes the drafts' KV
        const std::size_t accepted = rng() % (k + 1);
        t.commit(accepted);
        t.truncate(t.num_committed());
        // The verifier's own token, different from the first rejected draft.
        const TokenId bonus =
            accepted < k ? static_cast<TokenId>((drafts[accepted] + 1) % 5) : TokenId{3};
        t.append_tokens({&bonus, 1}, stream);
        m.write_new(t, 1);
        ++counts.speculative;
      }
    } else if (op < 6) {  // preempt: release, recompute later
      const std::size_t i = rng() % live.size();
      preempted.emplace_back(live[i]->tokens().begin(), live[i]->tokens().end());
      live.erase(live.begin() + static_cast<std::ptrdiff_t>(i));
      ++counts.preemptions;
    } else if (op < 7) {  // finish
      live.erase(live.begin() + static_cast<std::ptrdiff_t>(rng() % live.size()));
    } else if (op == 9 && tier != nullptr) {  // write cached blocks back to the host
      for (std::size_t g = 0; g < tier->num_groups(); ++g)
        if (HostTier* t = tier->group_tier(g)) (void)t->offload(rng() % 4);
      tier->poll();
    } else {  // decode one token in every request that fits
      for (auto& t : live) {
        if (t->num_tokens() > 60 || !t->can_append(1)) continue;
        const TokenId tok = static_cast<TokenId>(rng() % 5);
        t->append_tokens({&tok, 1}, stream);
        m.write_new(*t, 1);
      }
      if (tier != nullptr) tier->poll();
    }
    for (const auto& t : live) {
      for (std::size_t g = 0; g < cache.num_groups(); ++g) {
        std::string error;
        const std::optional<std::vector<float>> paged = m.paged(*t, g, error);
        if (!paged) return "step " + std::to_string(step) + ": " + error;
        if (*paged != m.dense(*t, g))
          return "step " + std::to_string(step) + ": group " + std::to_string(g) +
                 "'s attention differs from the dense recomputation";
        ++counts.checked;
      }
    }
    ++counts.steps;
  }
  return "";
}

}  // namespace kvport::testing
