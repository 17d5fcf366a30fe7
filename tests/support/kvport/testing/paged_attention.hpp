// SPDX-License-Identifier: Apache-2.0
// A reference paged attention over kvport's pools on the host backend, fed
// by the batch view (batch_view.hpp), and the dense recomputation it must
// equal bit for bit (tests/unit/core/attention_exactness_test.cpp).
//
// The "model" is deterministic and has no weights to load: the K and V of
// the token at position p are a function of the group and of a hash of the
// sequence's tokens 0..p (as a transformer's KV depends on the whole prefix),
// rounded to bf16; the query is a function of the whole sequence. Attention
// is single-head over one bf16 layer per group, softmax in float, keys in
// position order: full attention over every position, a sliding window W
// over the last W. The paged path reads each key through the block-table
// row of its sequence (a null entry read is reported, never read from) and
// writes each new token's K and V at its slot-mapping slot; the dense path
// recomputes everything from the tokens. Any block served to the wrong
// sequence, any stale slot, any block a window released too early gives a
// different output.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "kvport/core/batch_view.hpp"
#include "kvport/core/hybrid_block_table.hpp"
#include "kvport/core/hybrid_kv_cache.hpp"

namespace kvport::testing {

class PagedAttentionModel {
 public:
  static constexpr std::size_t kDim = 8;     // head dim of the attention groups
  static constexpr std::int32_t kNull = -1;  // the rows' null block: never read

  explicit PagedAttentionModel(HybridKvCache& cache, StreamView stream)
      : cache_(cache), stream_(stream) {}

  /// The engine's forward pass for `t`'s last `n` positions (committed and
  /// draft): writes their K and V in every attention group at the slots the
  /// batch view gives.
  void write_new(const HybridBlockTable& t, std::size_t n) {
    const std::vector<TokenId> all = tokens_of(t);
    const std::vector<std::uint64_t> h = prefix_hashes(all);
    const BatchSequence seq{&t, n};
    for (std::size_t g = 0; g < cache_.num_groups(); ++g) {
      if (cache_.group(g).spec.has_state()) continue;
      std::vector<std::int64_t> slots(n);
      (void)build_slot_mapping({&seq, 1}, g, KernelBlocks{}, slots);
      for (std::size_t i = 0; i < n; ++i) {
        const std::size_t pos = all.size() - n + i;
        write_token(g, slots[i], kv(g, h[pos], false), kv(g, h[pos], true));  // V empty for MLA
      }
    }
  }

  /// Group g's attention output at `t`'s last position through the paged
  /// KV; nullopt (and `error`) when a row entry it needs is null.
  std::optional<std::vector<float>> paged(const HybridBlockTable& t, std::size_t g,
                                          std::string& error) const {
    const std::vector<TokenId> all = tokens_of(t);
    const std::size_t bs = cache_.block_size();
    const std::size_t width = div_up(all.size(), bs);
    std::vector<std::int32_t> row(width);
    const BatchSequence seq{&t, 1};
    build_block_table_rows({&seq, 1}, g, KernelBlocks{0, kNull}, width, row);
    std::vector<Kv> keys;
    PagedKvCache::HostBlock block;  // the block of the last key read
    std::int32_t read = kNull;
    for (std::size_t pos = first_key(g, all.size()); pos < all.size(); ++pos) {
      const std::int32_t b = row[pos / bs];
      if (b == kNull) {
        error = "position " + std::to_string(pos) + " of group " + std::to_string(g) +
                " is in a released block";
        return std::nullopt;
      }
      if (b != read) {
        block = cache_.group_cache(g).read_block(0, static_cast<BlockId>(b), stream_);
        read = b;
      }
      keys.push_back(token_of(g, block, pos % bs));
    }
    return attend(query(g, prefix_hashes(all).back()), keys, value_dim(g));
  }

  /// The same from the tokens alone.
  std::vector<float> dense(const HybridBlockTable& t, std::size_t g) const {
    const std::vector<TokenId> all = tokens_of(t);
    const std::vector<std::uint64_t> h = prefix_hashes(all);
    std::vector<Kv> keys;
    for (std::size_t pos = first_key(g, all.size()); pos < all.size(); ++pos)
      keys.push_back(Kv{kv(g, h[pos], false), kv(g, h[pos], true)});
    return attend(query(g, h.back()), keys, value_dim(g));
  }

 private:
  using Vec = std::vector<std::uint16_t>;  // bf16 bits
  struct Kv {
    Vec k;
    Vec v;
  };

  static std::size_t div_up(std::size_t a, std::size_t b) { return (a + b - 1) / b; }

  static std::vector<TokenId> tokens_of(const HybridBlockTable& t) {
    std::vector<TokenId> all(t.tokens().begin(), t.tokens().end());
    all.insert(all.end(), t.draft_tokens().begin(), t.draft_tokens().end());
    return all;
  }
  static std::uint64_t mix(std::uint64_t x) {
    x ^= x >> 33;
    x *= 0xff51afd7ed558ccdULL;
    x ^= x >> 33;
    x *= 0xc4ceb9fe1a85ec53ULL;
    return x ^ (x >> 33);
  }
  static std::vector<std::uint64_t> prefix_hashes(const std::vector<TokenId>& all) {
    std::vector<std::uint64_t> h(all.size());
    std::uint64_t x = 0x9e3779b97f4a7c15ULL;
    for (std::size_t i = 0; i < all.size(); ++i)
      h[i] = x = mix(x ^ (std::uint64_t{all[i]} + 0x632be59bd9b4e019ULL * (i + 1)));
    return h;
  }
  // A bf16 in [-1, 1) from a hash (its top 16 bits of a float).
  static std::uint16_t bf16_of(std::uint64_t x) {
    const float f = static_cast<float>(static_cast<double>(x >> 40) / double(1 << 23) - 1.0);
    std::uint32_t bits = 0;
    std::memcpy(&bits, &f, 4);
    return static_cast<std::uint16_t>(bits >> 16);
  }
  static float float_of(std::uint16_t b) {
    const std::uint32_t bits = std::uint32_t{b} << 16;
    float f = 0;
    std::memcpy(&f, &bits, 4);
    return f;
  }
  // Elements of a key (one head, bf16: the K region of one token) and of a
  // stored value (0 for MLA, which stores none).
  std::size_t key_dim(std::size_t g) const {
    return cache_.group_cache(g).k_block_bytes(0) / (cache_.block_size() * 2);
  }
  std::size_t stored_value_dim(std::size_t g) const {
    return cache_.group_cache(g).v_block_bytes(0) / (cache_.block_size() * 2);
  }
  // What attention takes as the value: the stored V, or MLA's latent.
  std::size_t value_dim(std::size_t g) const {
    const LayerSpec& spec = cache_.group(g).spec;
    return spec.kind == LayerKind::mla ? spec.kv_lora_rank : stored_value_dim(g);
  }
  Vec kv(std::size_t g, std::uint64_t prefix, bool v) const {
    Vec out(v ? stored_value_dim(g) : key_dim(g));
    for (std::size_t d = 0; d < out.size(); ++d)
      out[d] = bf16_of(mix(prefix ^ mix((g + 1) * 131 + d * 7 + (v ? 1000 : 0))));
    return out;
  }
  Vec query(std::size_t g, std::uint64_t prefix) const {
    Vec out(key_dim(g));
    for (std::size_t d = 0; d < out.size(); ++d)
      out[d] = bf16_of(mix(prefix ^ mix(99 * 131 + d * 7)));
    return out;
  }

  // The first key position a query at position n - 1 attends.
  std::size_t first_key(std::size_t g, std::size_t n) const {
    const LayerSpec& spec = cache_.group(g).spec;
    if (spec.kind == LayerKind::sliding_window && n > spec.window) return n - spec.window;
    if (spec.kind == LayerKind::chunked_local) return (n - 1) / spec.chunk * spec.chunk;
    return 0;
  }

  // softmax(q . k / sqrt(dim)) over the keys, times each key's value: its
  // stored V, or (no V stored: MLA) the first `vdim` values of its key.
  static std::vector<float> attend(const Vec& q, const std::vector<Kv>& keys, std::size_t vdim) {
    std::vector<float> scores(keys.size());
    float top = -INFINITY;
    for (std::size_t i = 0; i < keys.size(); ++i) {
      float s = 0;
      for (std::size_t d = 0; d < q.size(); ++d)
        s += float_of(q[d]) * float_of(keys[i].k[d]);
      scores[i] = s / std::sqrt(static_cast<float>(q.size()));
      top = std::max(top, scores[i]);
    }
    float sum = 0;
    for (float& s : scores)
      sum += (s = std::exp(s - top));
    std::vector<float> out(vdim, 0.0f);
    for (std::size_t i = 0; i < keys.size(); ++i) {
      const Vec& value = keys[i].v.empty() ? keys[i].k : keys[i].v;
      for (std::size_t d = 0; d < vdim; ++d)
        out[d] += scores[i] / sum * float_of(value[d]);
    }
    return out;
  }

  // One token's K and V in group g's single layer (block layout:
  // [block_size][1 head][dim] bf16, K and V regions apart; no V for MLA).
  void write_token(std::size_t g, std::int64_t slot, const Vec& k, const Vec& v) {
    PagedKvCache& pool = cache_.group_cache(g);
    const std::size_t bs = cache_.block_size();
    const auto block = static_cast<BlockId>(static_cast<std::size_t>(slot) / bs);
    const std::size_t offset = static_cast<std::size_t>(slot) % bs;
    PagedKvCache::HostBlock hb = pool.read_block(0, block, stream_);
    std::memcpy(hb.k.data() + offset * k.size() * 2, k.data(), k.size() * 2);
    if (!v.empty()) std::memcpy(hb.v.data() + offset * v.size() * 2, v.data(), v.size() * 2);
    pool.write_block(0, block, hb.k, hb.v, stream_);
  }
  Kv token_of(std::size_t g, const PagedKvCache::HostBlock& hb, std::size_t offset) const {
    Kv out{Vec(key_dim(g)), Vec(stored_value_dim(g))};
    std::memcpy(out.k.data(), hb.k.data() + offset * out.k.size() * 2, out.k.size() * 2);
    if (!out.v.empty())
      std::memcpy(out.v.data(), hb.v.data() + offset * out.v.size() * 2, out.v.size() * 2);
    return out;
  }

  HybridKvCache& cache_;
  StreamView stream_;
};

}  // namespace kvport::testing
