// SPDX-License-Identifier: Apache-2.0
// Cache events (cache_events.hpp) from the caches that hold blocks: a
// recording sink rebuilds the cached set from PrefixCache's, HostTier's and
// the hybrid caches' events after random operation streams and compares it
// with each cache's own state (find / hash_of / is_on_host), parents and
// token ids included; snapshots describe the same set; errors change nothing
// and announce nothing; without a sink nothing is called; a failed host copy
// announces nothing.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <random>
#include <set>
#include <string>
#include <tuple>
#include <vector>

#include "core_test_util.hpp"
#include "kvport/core/block_table.hpp"
#include "kvport/core/cache_events.hpp"
#include "kvport/core/host_tier.hpp"
#include "kvport/core/hybrid_block_table.hpp"
#include "kvport/core/hybrid_host_tier.hpp"
#include "kvport/core/hybrid_kv_cache.hpp"
#include "kvport/core/prefix_cache.hpp"
#include "kvport/platform/error.hpp"
#include "kvport/platform/fault_injecting_backend.hpp"

namespace kvport {
namespace {

// Where a block is announced: medium and group.
using SourceKey = std::pair<Medium, std::optional<std::uint32_t>>;

struct Announced {
  std::optional<BlockHash> parent;
  std::vector<TokenId> tokens;
  std::uint64_t extra_key = 0;
};

// Rebuilds every source's cached set from the events and checks each event
// on arrival: a stored hash not already held, a removed hash held, a run's
// tokens (when present) hashing to its hashes chained from its parent, one
// source per key.
class RecordingSink final : public CacheEventSink {
 public:
  void stored(const EventSource& source, const BlockStoredView& v) noexcept override {
    ++stored_events;
    check_source(source);
    std::map<BlockHash, Announced, Less>& set = sets[key(source)];
    if (v.block_size == 0) error("block_size 0");
    if (!v.tokens.empty() && v.tokens.size() != v.hashes.size() * v.block_size) {
      error("tokens of the wrong length");
    }
    std::optional<BlockHash> parent = v.parent;
    if (v.hashes.empty()) error("a BlockStored without hashes");
    for (std::size_t i = 0; i < v.hashes.size(); ++i) {
      Announced a;
      a.parent = parent;
      a.extra_key = v.extra_key;
      if (!v.tokens.empty()) {
        const auto t = v.tokens.subspan(i * v.block_size, v.block_size);
        a.tokens.assign(t.begin(), t.end());
        if (hash_block(parent, t, v.extra_key) != v.hashes[i]) {
          error("block " + v.hashes[i].to_string() + ": its tokens and parent do not hash to it");
        }
      } else {
        ++without_tokens;
      }
      if (!set.emplace(v.hashes[i], std::move(a)).second) {
        error("stored twice without a removal: " + v.hashes[i].to_string());
      }
      if (parent && ordered_check && !set.contains(*parent) &&
          expected[key(source)].contains(*parent)) {
        error("a child announced before its parent");
      }
      parent = v.hashes[i];
    }
  }
  void removed(const EventSource& source, std::span<const BlockHash> hashes) noexcept override {
    ++removed_events;
    check_source(source);
    auto& set = sets[key(source)];
    if (hashes.empty()) error("a BlockRemoved without hashes");
    for (const BlockHash& h : hashes) {
      if (set.erase(h) == 0) error("removed but never stored: " + h.to_string());
    }
  }
  void cleared(const EventSource& source) noexcept override {
    ++cleared_events;
    check_source(source);
    sets[key(source)].clear();
  }

  struct Less {
    bool operator()(const BlockHash& a, const BlockHash& b) const {
      return std::tie(a.high, a.low) < std::tie(b.high, b.low);
    }
  };

  static SourceKey key(const EventSource& s) { return {s.medium, s.group_idx}; }
  std::set<BlockHash, Less> hashes(SourceKey k) const {
    std::set<BlockHash, Less> out;
    if (auto it = sets.find(k); it != sets.end())
      for (const auto& [h, a] : it->second)
        out.insert(h);
    return out;
  }
  const Announced* find(SourceKey k, const BlockHash& h) const {
    auto it = sets.find(k);
    if (it == sets.end()) return nullptr;
    auto a = it->second.find(h);
    return a == it->second.end() ? nullptr : &a->second;
  }
  std::uint64_t events() const { return stored_events + removed_events + cleared_events; }

  std::map<SourceKey, std::map<BlockHash, Announced, Less>> sets;
  std::map<SourceKey, EventSource> sources;
  std::vector<std::string> errors;
  std::uint64_t stored_events = 0;
  std::uint64_t removed_events = 0;
  std::uint64_t cleared_events = 0;
  std::uint64_t without_tokens = 0;
  // For a snapshot: a parent that the snapshot holds must come first. The
  // test fills `expected` with the set the snapshot describes.
  bool ordered_check = false;
  std::map<SourceKey, std::set<BlockHash, Less>> expected;

 private:
  void check_source(const EventSource& s) {
    auto [it, fresh] = sources.emplace(key(s), s);
    if (!fresh && !(it->second == s)) error("two sources with one medium and group");
  }
  void error(std::string what) noexcept {
    try {
      errors.push_back(std::move(what));
    } catch (...) {
    }
  }
};

// Counts and nothing else: for "no events" checks.
class CountingSink final : public CacheEventSink {
 public:
  void stored(const EventSource&, const BlockStoredView&) noexcept override { ++n; }
  void removed(const EventSource&, std::span<const BlockHash>) noexcept override { ++n; }
  void cleared(const EventSource&) noexcept override { ++n; }
  std::uint64_t n = 0;
};

const SourceKey kGpu{Medium::gpu, std::nullopt};
const SourceKey kCpu{Medium::cpu, std::nullopt};

using HashSet = std::set<BlockHash, RecordingSink::Less>;

// The device's cached set, from the cache itself.
HashSet device_set(const PrefixCache& pc) {
  HashSet out;
  for (BlockId b = 0; b < pc.kv_cache().num_blocks(); ++b) {
    if (const auto h = pc.hash_of(b)) {
      EXPECT_EQ(pc.find(*h), std::optional<BlockId>(b));
      out.insert(*h);
    }
  }
  return out;
}

HashSet host_set(const HostTier& tier) {
  HashSet out;
  for (const BlockHash& h : tier.host_lru_order()) {
    EXPECT_TRUE(tier.is_on_host(h));
    out.insert(h);
  }
  return out;
}

// A snapshot of `take` into a fresh sink: the same sets as `live`, each
// parent that is in the set before its children.
template <class Take>
void expect_snapshot_matches(const RecordingSink& live, const std::vector<SourceKey>& keys,
                             Take&& take) {
  RecordingSink snap;
  snap.ordered_check = true;
  for (const SourceKey& k : keys)
    snap.expected[k] = live.hashes(k);
  take(snap);
  EXPECT_TRUE(snap.errors.empty()) << snap.errors.front();
  for (const SourceKey& k : keys) {
    EXPECT_EQ(snap.hashes(k), live.hashes(k));
    for (const BlockHash& h : live.hashes(k)) {
      const Announced* a = live.find(k, h);
      const Announced* b = snap.find(k, h);
      ASSERT_NE(b, nullptr);
      EXPECT_EQ(a->parent, b->parent);
      EXPECT_EQ(a->tokens, b->tokens);
    }
  }
}

// ---- names --------------------------------------------------------------------------------

TEST(CacheEvents, MediumNamesRoundTrip) {
  EXPECT_EQ(to_string(Medium::gpu), "GPU");
  EXPECT_EQ(to_string(Medium::cpu), "CPU");
  EXPECT_EQ(to_string(Medium::disk), "DISK");
  for (Medium m : {Medium::gpu, Medium::cpu, Medium::disk})
    EXPECT_EQ(parse_medium(to_string(m)), std::optional<Medium>(m));
  EXPECT_EQ(parse_medium("gpu"), std::nullopt) << "vLLM's names are upper case";
  EXPECT_EQ(parse_medium(""), std::nullopt);
  EXPECT_EQ(parse_medium("GPU "), std::nullopt);
  EXPECT_EQ(to_string(static_cast<Medium>(200)), "UNKNOWN");
  EXPECT_EQ(event_hash(BlockHash{0x1234, 0x5678}), 0x1234u);
}

// ---- PrefixCache ------------------------------------------------------------------------

struct Device {
  explicit Device(std::size_t blocks = 8)
      : backend(test::host_backend()), cache(test::small_config(), blocks, *backend), pc(cache) {}
  std::unique_ptr<Backend> backend;
  PagedKvCache cache;
  PrefixCache pc;
};

TEST(CacheEvents, StoredViewCarriesTheOriginOrNothing) {
  const BlockHash h{1, 2};
  const BlockHash parent{3, 4};
  const std::vector<TokenId> toks{5, 6};
  BlockOrigin o;
  o.parent = parent;
  o.tokens = toks;
  o.extra_key = 9;
  const BlockStoredView with = stored_view({&h, 1}, 2, &o);
  EXPECT_EQ(with.hashes.size(), 1u);
  EXPECT_EQ(with.block_size, 2u);
  EXPECT_EQ(with.parent, std::optional<BlockHash>(parent));
  EXPECT_EQ(with.tokens.size(), 2u);
  EXPECT_EQ(with.extra_key, 9u);
  const BlockStoredView bare = stored_view({&h, 1}, 2);
  EXPECT_FALSE(bare.parent.has_value());
  EXPECT_TRUE(bare.tokens.empty());
  EXPECT_EQ(bare.extra_key, 0u);
}

TEST(PrefixCacheEvents, NoSinkNoCallsAndNoOriginMemory) {
  Device d;
  EXPECT_EQ(d.pc.event_sink(), nullptr);
  EXPECT_FALSE(d.pc.keeps_block_origins());
  {
    BlockTable t(d.pc);
    t.append_tokens(test::tokens(12, 1), d.cache.backend().default_stream());
  }
  EXPECT_EQ(d.pc.num_cached_blocks(), 3u);
  EXPECT_FALSE(d.pc.keeps_block_origins()) << "nothing is recorded without a sink";
  EXPECT_EQ(d.pc.memory_usage().origin_bytes, 0u);
  EXPECT_EQ(d.pc.block_origin(0), std::nullopt);
  // Installed, then uninstalled: nothing more is called.
  CountingSink sink;
  d.pc.set_event_sink(&sink);
  EXPECT_TRUE(d.pc.keeps_block_origins());
  EXPECT_EQ(d.pc.memory_usage().origin_bytes, 8 * (32 + 4 * sizeof(TokenId)));
  d.pc.set_event_sink(nullptr);
  {
    BlockTable t(d.pc);
    t.append_tokens(test::tokens(28, 100), d.cache.backend().default_stream());  // evicts
  }
  d.pc.evict(100);
  EXPECT_EQ(sink.n, 0u);
}

TEST(PrefixCacheEvents, BlockTableAnnouncesEachAppendAsOneRunWithParentAndTokens) {
  RecordingSink sink;  // outlives the cache, whose destructor clears
  Device d;
  d.pc.set_event_sink(&sink);
  EXPECT_EQ(d.pc.event_source(), EventSource{});
  const std::vector<TokenId> prompt = test::tokens(10, 7);  // 2 full blocks + 2
  BlockTable t(d.pc, /*extra_key=*/0);
  t.append_tokens(prompt, d.cache.backend().default_stream());
  ASSERT_EQ(sink.stored_events, 1u) << "both full blocks in one BlockStored";
  const std::vector<BlockHash> h = hash_full_blocks(prompt, 4);
  const Announced* a0 = sink.find(kGpu, h[0]);
  const Announced* a1 = sink.find(kGpu, h[1]);
  ASSERT_NE(a0, nullptr);
  ASSERT_NE(a1, nullptr);
  EXPECT_EQ(a0->parent, std::nullopt);
  EXPECT_EQ(a1->parent, std::optional<BlockHash>(h[0]));
  EXPECT_EQ(a1->tokens, std::vector<TokenId>(prompt.begin() + 4, prompt.begin() + 8));
  // The next block filled one token at a time: its own event, parent h[1].
  t.append_tokens(test::tokens(2, 500), d.cache.backend().default_stream());
  EXPECT_EQ(sink.stored_events, 2u);
  const std::vector<BlockHash> h2 = hash_full_blocks(t.tokens(), 4);
  ASSERT_NE(sink.find(kGpu, h2[2]), nullptr);
  EXPECT_EQ(sink.find(kGpu, h2[2])->parent, std::optional<BlockHash>(h[1]));
  // The origin is kept.
  const auto o = d.pc.block_origin(t.blocks()[2]);
  ASSERT_TRUE(o.has_value());
  EXPECT_EQ(o->parent, std::optional<BlockHash>(h[1]));
  EXPECT_TRUE(std::equal(o->tokens.begin(), o->tokens.end(), t.tokens().begin() + 8));
  EXPECT_TRUE(sink.errors.empty()) << sink.errors.front();
}

TEST(PrefixCacheEvents, ExtraKeyIsPassedOnAndTheHashesIncludeIt) {
  RecordingSink sink;  // outlives the cache, whose destructor clears
  Device d;
  d.pc.set_event_sink(&sink);
  BlockTable t(d.pc, /*extra_key=*/77);
  t.append_tokens(test::tokens(8, 1), d.cache.backend().default_stream());
  const std::vector<BlockHash> h = hash_full_blocks(test::tokens(8, 1), 4, 77);
  ASSERT_NE(sink.find(kGpu, h[1]), nullptr);
  EXPECT_EQ(sink.find(kGpu, h[1])->extra_key, 77u);
  EXPECT_TRUE(sink.errors.empty()) << sink.errors.front();  // the hashes checked with the key
}

TEST(PrefixCacheEvents, EvictionsAndDetachAreRemovalsAndDestructionClears) {
  RecordingSink sink;
  {
    Device d(4);
    d.pc.set_event_sink(&sink);
    {
      BlockTable t(d.pc);
      t.append_tokens(test::tokens(16, 1), d.cache.backend().default_stream());
    }
    EXPECT_EQ(sink.hashes(kGpu).size(), 4u);
    {
      BlockTable t(d.pc);  // evicts 2 at allocation: one removal each
      t.append_tokens(test::tokens(6, 900), d.cache.backend().default_stream());
      EXPECT_EQ(sink.removed_events, 2u);
      EXPECT_EQ(sink.hashes(kGpu), device_set(d.pc));
    }
    std::vector<std::pair<BlockId, BlockHash>> out;
    EXPECT_EQ(d.pc.detach_lru(2, out), 2u);
    EXPECT_EQ(sink.removed_events, 3u) << "a detach of several blocks is one removal";
    for (const auto& [b, h] : out) {
      EXPECT_EQ(sink.find(kGpu, h), nullptr) << "handed to a tier: off the GPU";
      d.pc.release(b);
    }
    EXPECT_EQ(d.pc.evict(10), 1u);
    EXPECT_EQ(sink.hashes(kGpu), device_set(d.pc));
    BlockTable keep(d.pc);
    keep.append_tokens(test::tokens(4, 3000), d.cache.backend().default_stream());
    EXPECT_EQ(sink.hashes(kGpu).size(), 1u);
    keep.release();
    EXPECT_EQ(sink.cleared_events, 0u);
  }
  EXPECT_EQ(sink.cleared_events, 1u) << "the destructor clears";
  EXPECT_TRUE(sink.hashes(kGpu).empty());
  EXPECT_TRUE(sink.errors.empty()) << sink.errors.front();
}

TEST(PrefixCacheEvents, ResetClearsOnlyWhenNoCachedBlockIsHeld) {
  RecordingSink sink;  // outlives the cache
  Device d;
  d.pc.set_event_sink(&sink);
  auto t = std::make_unique<BlockTable>(d.pc);
  t->append_tokens(test::tokens(12, 1), d.cache.backend().default_stream());
  const std::uint64_t events = sink.events();
  EXPECT_FALSE(d.pc.reset()) << "a sequence holds cached blocks";
  EXPECT_EQ(sink.events(), events);
  EXPECT_EQ(d.pc.num_cached_blocks(), 3u);
  t.reset();
  EXPECT_TRUE(d.pc.reset());
  EXPECT_EQ(sink.cleared_events, 1u);
  EXPECT_EQ(sink.removed_events, 0u) << "one cleared, no removals";
  EXPECT_EQ(d.pc.num_cached_blocks(), 0u);
  EXPECT_EQ(d.cache.num_free_blocks(), d.cache.num_blocks());
  EXPECT_TRUE(sink.hashes(kGpu).empty());
  EXPECT_TRUE(d.pc.reset()) << "an empty cache resets";
  EXPECT_EQ(sink.cleared_events, 2u);
  EXPECT_TRUE(d.pc.check_invariants().ok);
  EXPECT_TRUE(sink.errors.empty()) << sink.errors.front();
}

TEST(PrefixCacheEvents, InsertRunSkipsCachedBlocksAndSplitsTheRun) {
  RecordingSink sink;  // outlives the cache, whose destructor clears
  Device d;
  d.pc.set_event_sink(&sink);
  const std::vector<TokenId> toks = test::tokens(12, 40);
  const std::vector<BlockHash> h = hash_full_blocks(toks, 4);
  std::vector<BlockId> blocks;
  for (int i = 0; i < 3; ++i)
    blocks.push_back(d.pc.alloc_block());
  const BlockId other = d.pc.alloc_block();
  ASSERT_TRUE(d.pc.insert(h[1], other));  // the old API: announced without tokens
  EXPECT_EQ(sink.stored_events, 1u);
  EXPECT_EQ(sink.without_tokens, 1u);
  EXPECT_EQ(d.pc.insert_run(h, blocks, BlockOrigin{std::nullopt, toks, 0}), 2u);
  EXPECT_EQ(sink.stored_events, 3u) << "h[0] and h[2] are two runs";
  ASSERT_NE(sink.find(kGpu, h[2]), nullptr);
  EXPECT_EQ(sink.find(kGpu, h[2])->parent, std::optional<BlockHash>(h[1]));
  EXPECT_FALSE(d.pc.is_cached(blocks[1])) << "a private copy of cached content";
  // A run again: nothing new, nothing announced.
  EXPECT_EQ(d.pc.insert_run(h, blocks, BlockOrigin{std::nullopt, toks, 0}), 0u);
  EXPECT_EQ(sink.stored_events, 3u);
  EXPECT_FALSE(d.pc.insert(h[0], blocks[1]));
  EXPECT_EQ(sink.stored_events, 3u);
  EXPECT_TRUE(sink.errors.empty()) << sink.errors.front();
  d.pc.release_blocks(blocks);
  d.pc.release(other);
}

TEST(PrefixCacheEvents, ErrorsChangeNothingAndAnnounceNothing) {
  CountingSink sink;  // outlives the cache
  Device d;
  d.pc.set_event_sink(&sink);
  const std::vector<TokenId> toks = test::tokens(8, 40);
  const std::vector<BlockHash> h = hash_full_blocks(toks, 4);
  const BlockId a = d.pc.alloc_block();
  const BlockId b = d.pc.alloc_block();
  const std::vector<BlockId> two{a, b};
  const std::vector<BlockId> one{a};
  const std::vector<BlockId> bad{a, 1000};
  test::expect_invalid_argument(
      [&] {
        d.pc.insert_run(h, one, BlockOrigin{std::nullopt, toks, 0});
      },
      "1 blocks for 2");
  test::expect_invalid_argument(
      [&] {
        d.pc.insert_run(h, two,
                        BlockOrigin{std::nullopt, std::span<const TokenId>(toks).first(5), 0});
      },
      "5 tokens for 2 blocks");
  test::expect_invalid_argument(
      [&] {
        d.pc.insert_run(h, bad, BlockOrigin{std::nullopt, toks, 0});
      },
      "out of range");
  const BlockId freed = d.pc.alloc_block();
  d.pc.release(freed);
  const std::vector<BlockId> with_free{a, freed};
  test::expect_invalid_argument(
      [&] {
        d.pc.insert_run(h, with_free, BlockOrigin{std::nullopt, toks, 0});
      },
      "is free");
  test::expect_invalid_argument(
      [&] {
        d.pc.insert(h[0], a, BlockOrigin{std::nullopt, std::span<const TokenId>(toks), 0});
      },
      "8 tokens for one block of 4");
  test::expect_invalid_argument([&] { d.pc.insert(h[0], freed, BlockOrigin{}); }, "is free");
  test::expect_invalid_argument([&] { (void)d.pc.block_origin(1000); }, "out of range");
  EXPECT_EQ(d.pc.num_cached_blocks(), 0u);
  EXPECT_EQ(sink.n, 0u);
  EXPECT_EQ(d.pc.block_origin(a), std::nullopt);
  EXPECT_TRUE(d.pc.check_invariants().ok);
  d.pc.release_blocks(two);
}

TEST(PrefixCacheEvents, TokensPerBlockIsSetBeforeOriginsAreKept) {
  Device d;
  EXPECT_EQ(d.pc.tokens_per_block(), 4u);
  test::expect_invalid_argument([&] { d.pc.set_tokens_per_block(0); }, "0 tokens");
  d.pc.set_tokens_per_block(8);
  d.pc.keep_block_origins();
  test::expect_invalid_argument([&] { d.pc.set_tokens_per_block(4); }, "kept already");
  d.pc.set_tokens_per_block(8);  // the same count: fine
  EXPECT_EQ(d.pc.tokens_per_block(), 8u);
  EXPECT_EQ(d.pc.memory_usage().origin_bytes, 8 * (32 + 8 * sizeof(TokenId)));
  // A hybrid cache's state group: a slot per state, a block of tokens per checkpoint.
  auto backend = test::host_backend();
  HybridKvCacheConfig c;
  c.block_size = 4;
  c.layers = {LayerSpec::full_attention(1, 8, 8),
              LayerSpec::recurrent_state({StateTensor{"s", {16}, StateDtype::f32}})};
  const std::vector<std::size_t> blocks{4, 4};
  HybridKvCache hybrid(c, blocks, *backend);
  EXPECT_EQ(hybrid.prefix_cache(1).block_size(), 1u);
  EXPECT_EQ(hybrid.prefix_cache(1).tokens_per_block(), 4u);
  EXPECT_EQ(hybrid.prefix_cache(0).tokens_per_block(), 4u);
}

TEST(PrefixCacheEvents, SinkInstalledLateSnapshotGivesTheSetWithoutTokensForEarlierBlocks) {
  RecordingSink sink;  // outlives the cache
  Device d;
  {
    BlockTable t(d.pc);
    t.append_tokens(test::tokens(8, 1), d.cache.backend().default_stream());
  }
  d.pc.set_event_sink(&sink);
  d.pc.snapshot(sink);
  EXPECT_EQ(sink.hashes(kGpu), device_set(d.pc));
  EXPECT_EQ(sink.without_tokens, 2u) << "registered before origins were kept";
  {
    BlockTable t(d.pc);
    t.append_tokens(test::tokens(8, 1000), d.cache.backend().default_stream());
  }
  EXPECT_EQ(sink.without_tokens, 2u);
  EXPECT_TRUE(sink.errors.empty()) << sink.errors.front();
}

// Random streams of requests (shared prefixes, partial hits, forks),
// releases, evictions and detaches: the announced set is the cached set
// after every operation, and a snapshot rebuilds it.
TEST(PrefixCacheEvents, RandomStreamsRebuildTheCachedSetExactly) {
  for (std::uint32_t seed = 1; seed <= 6; ++seed) {
    SCOPED_TRACE("seed " + std::to_string(seed));
    RecordingSink sink;  // outlives the cache
    Device d(24);
    d.pc.set_event_sink(&sink);
    std::mt19937 rng(seed);
    std::vector<std::unique_ptr<BlockTable>> live;
    const StreamView stream = d.cache.backend().default_stream();
    for (int op = 0; op < 400; ++op) {
      const auto r = rng() % 10;
      if (r < 5) {
        // A prompt: one of 5 documents' first 1..6 blocks, plus a tail.
        const TokenId doc = static_cast<TokenId>(rng() % 5) * 1000;
        std::vector<TokenId> p = test::tokens((1 + rng() % 6) * 4, doc);
        const std::vector<TokenId> tail = test::tokens(rng() % 7, 50000 + op * 10);
        p.insert(p.end(), tail.begin(), tail.end());
        auto t = std::make_unique<BlockTable>(d.pc, rng() % 4 == 0 ? 9 : 0);
        const std::size_t hit = t->reuse_cached_prefix(p, stream);
        const std::span<const TokenId> rest = std::span<const TokenId>(p).subspan(hit);
        if (t->blocks_needed(rest.size()) <= d.pc.num_available_blocks()) {
          t->append_tokens(rest, stream);
          live.push_back(std::move(t));
        }
      } else if (r < 7 && !live.empty()) {
        live.erase(live.begin() + static_cast<std::ptrdiff_t>(rng() % live.size()));
      } else if (r == 7 && !live.empty()) {
        BlockTable& t = *live[rng() % live.size()];
        auto child = std::make_unique<BlockTable>(t.fork());
        if (child->blocks_needed(5) <= d.pc.num_available_blocks()) {
          child->append_tokens(test::tokens(5, 70000 + op * 10), stream);
          live.push_back(std::move(child));
        }
      } else if (r == 8) {
        d.pc.evict(rng() % 3);
      } else {
        std::vector<std::pair<BlockId, BlockHash>> out;
        d.pc.detach_lru(rng() % 3, out);
        for (const auto& [b, h] : out)
          d.pc.release(b);
      }
      ASSERT_EQ(sink.hashes(kGpu), device_set(d.pc)) << "after op " << op;
      ASSERT_TRUE(sink.errors.empty()) << sink.errors.front();
    }
    EXPECT_EQ(sink.without_tokens, 0u);
    EXPECT_GT(sink.removed_events, 0u);
    // Every announced block's origin is the cache's.
    for (BlockId b = 0; b < d.cache.num_blocks(); ++b) {
      const auto h = d.pc.hash_of(b);
      if (!h) continue;
      const Announced* a = sink.find(kGpu, *h);
      const auto o = d.pc.block_origin(b);
      ASSERT_TRUE(a != nullptr && o.has_value());
      EXPECT_EQ(a->parent, o->parent);
      EXPECT_TRUE(
          std::equal(a->tokens.begin(), a->tokens.end(), o->tokens.begin(), o->tokens.end()));
    }
    expect_snapshot_matches(sink, {kGpu}, [&](RecordingSink& s) { d.pc.snapshot(s); });
    live.clear();
    EXPECT_TRUE(d.pc.check_invariants().ok);
  }
}

// ---- HostTier -------------------------------------------------------------------------------

HostTierOptions tier_options(TierPolicy policy, TierInclusion inclusion, std::size_t host_blocks) {
  HostTierOptions o;
  o.num_host_blocks = host_blocks;
  o.policy = policy;
  o.inclusion = inclusion;
  o.offload_batch = 2;
  return o;
}

// A device of `blocks` blocks over a fault-injecting backend, its prefix
// cache and a host tier, with one recording sink on both.
struct TierWorld {
  TierWorld(std::size_t blocks, HostTierOptions o)
      : fb(test::host_backend()), cache(test::small_config(), blocks, fb), pc(cache) {
    tier.emplace(pc, o);
    pc.set_event_sink(&sink);
    tier->set_event_sink(&sink);
  }
  ~TierWorld() {
    tier.reset();
    pc.set_event_sink(nullptr);
  }
  void expect_exact() {
    ASSERT_TRUE(sink.errors.empty()) << sink.errors.front();
    EXPECT_EQ(sink.hashes(kGpu), device_set(pc));
    EXPECT_EQ(sink.hashes(kCpu), host_set(*tier));
  }
  // Caches a 2-block sequence from `first` and releases it.
  std::vector<BlockHash> cache_sequence(TokenId first) {
    BlockTable t(pc);
    t.append_tokens(test::tokens(8, first), cache.backend().default_stream());
    return hash_full_blocks(t.tokens(), 4);
  }

  FaultInjectingBackend fb;
  PagedKvCache cache;
  PrefixCache pc;
  std::optional<HostTier> tier;
  RecordingSink sink;
};

TEST(HostTierEvents, StoredOnlyOnceTheCopyCompletedWithTheDeviceOrigin) {
  TierWorld w(4, tier_options(TierPolicy::write_back, TierInclusion::exclusive, 4));
  EXPECT_EQ(w.tier->event_source().medium, Medium::cpu);
  EXPECT_EQ(w.tier->origin_bytes_per_slot(), 32u + 4 * sizeof(TokenId));
  const std::vector<BlockHash> h1 = w.cache_sequence(1);
  EXPECT_EQ(w.tier->offload(2), 2u);
  EXPECT_TRUE(w.sink.hashes(kCpu).empty()) << "in flight: not announced";
  EXPECT_TRUE(w.sink.hashes(kGpu).empty()) << "off the device at the detach";
  w.tier->synchronize();
  ASSERT_EQ(w.sink.hashes(kCpu).size(), 2u);
  const Announced* a = w.sink.find(kCpu, h1[1]);
  ASSERT_NE(a, nullptr);
  EXPECT_EQ(a->parent, std::optional<BlockHash>(h1[0]));
  EXPECT_EQ(a->tokens, test::tokens(4, 5));
  w.expect_exact();
  // An exclusive onload: stored on the GPU (with its tokens), removed from the CPU.
  const std::uint64_t no_tokens = w.sink.without_tokens;
  const PrefixMatch m = w.pc.lookup_hashes(h1);
  EXPECT_EQ(m.lower_tier_blocks, 2u);
  EXPECT_EQ(w.sink.without_tokens, no_tokens) << "onloaded blocks keep their tokens";
  w.expect_exact();
  EXPECT_TRUE(w.sink.hashes(kCpu).empty());
  ASSERT_NE(w.sink.find(kGpu, h1[1]), nullptr);
  EXPECT_EQ(w.sink.find(kGpu, h1[1])->parent, std::optional<BlockHash>(h1[0]));
  w.pc.release_blocks(m.blocks);
  expect_snapshot_matches(w.sink, {kGpu, kCpu}, [&](RecordingSink& s) {
    w.pc.snapshot(s);
    w.tier->snapshot(s);
  });
  w.tier.reset();
  EXPECT_EQ(w.sink.cleared_events, 1u) << "the tier's destructor clears the CPU";
  EXPECT_TRUE(w.sink.errors.empty()) << w.sink.errors.front();
}

TEST(HostTierEvents, ATierWithoutASinkAnnouncesNothingButKeepsTokensForTheDevice) {
  RecordingSink sink;  // outlives the caches
  FaultInjectingBackend fb(test::host_backend());
  PagedKvCache cache(test::small_config(), 4, fb);
  PrefixCache pc(cache);
  HostTier tier(pc, tier_options(TierPolicy::write_back, TierInclusion::exclusive, 4));
  pc.set_event_sink(&sink);  // the device only, installed after the tier
  std::vector<BlockHash> h;
  {
    BlockTable t(pc);
    t.append_tokens(test::tokens(8, 1), cache.backend().default_stream());
    h = hash_full_blocks(t.tokens(), 4);
  }
  tier.offload(2);
  tier.synchronize();
  EXPECT_TRUE(tier.is_on_host(h[0]));
  EXPECT_TRUE(sink.hashes(kCpu).empty()) << "no sink on the tier: no CPU events";
  const PrefixMatch m = pc.lookup_hashes(h);
  ASSERT_EQ(m.lower_tier_blocks, 2u);
  EXPECT_EQ(sink.without_tokens, 0u) << "the onloaded blocks are announced with their tokens";
  EXPECT_EQ(sink.hashes(kGpu), device_set(pc));
  pc.release_blocks(m.blocks);
  EXPECT_TRUE(sink.errors.empty()) << sink.errors.front();
  pc.set_event_sink(nullptr);
}

TEST(HostTierEvents, AFailedWriteBackAnnouncesNothingOnTheHost) {
  for (const FaultMode mode : {FaultMode::synchronous, FaultMode::deferred}) {
    SCOPED_TRACE(mode == FaultMode::synchronous ? "synchronous" : "deferred");
    TierWorld w(4, tier_options(TierPolicy::write_back, TierInclusion::exclusive, 4));
    w.cache_sequence(1);
    w.fb.set_plan(FaultKind::copy, {.nth = 1, .mode = mode});
    EXPECT_EQ(w.tier->offload(2), 2u);
    w.tier->synchronize();
    EXPECT_EQ(w.fb.counts(FaultKind::copy).faults, 1u);
    EXPECT_EQ(w.tier->counters().aborted_transfers, 1u);
    EXPECT_TRUE(w.sink.hashes(kCpu).empty());
    EXPECT_EQ(w.sink.stored_events, 1u) << "only the device's run";
    w.expect_exact();
    w.fb.clear_plans();
  }
}

TEST(HostTierEvents, AFailedOnloadAnnouncesNothingAndLeavesTheHostCopy) {
  for (const FaultMode mode : {FaultMode::synchronous, FaultMode::deferred}) {
    SCOPED_TRACE(mode == FaultMode::synchronous ? "synchronous" : "deferred");
    TierWorld w(4, tier_options(TierPolicy::write_back, TierInclusion::exclusive, 4));
    const std::vector<BlockHash> h1 = w.cache_sequence(1);
    w.tier->offload(2);
    w.tier->synchronize();
    const std::uint64_t stored = w.sink.stored_events;
    const std::uint64_t removed = w.sink.removed_events;
    w.fb.set_plan(FaultKind::copy, {.nth = 1, .mode = mode});
    const PrefixMatch m = w.pc.lookup_hashes(h1);
    EXPECT_TRUE(m.blocks.empty());
    EXPECT_EQ(w.fb.counts(FaultKind::copy).faults, 1u);
    EXPECT_EQ(w.sink.stored_events, stored) << "a failed onload registers nothing";
    EXPECT_EQ(w.sink.removed_events, removed) << "and the host keeps its blocks";
    w.expect_exact();
    w.fb.clear_plans();
  }
}

// Random streams over the tier in every policy and inclusion, with copy
// faults now and then: the device's and the host's announced sets are their
// cached sets after every operation (in flight blocks are in neither).
TEST(HostTierEvents, RandomStreamsRebuildBothTiersExactly) {
  for (const TierPolicy policy : {TierPolicy::write_back, TierPolicy::write_through}) {
    for (const TierInclusion inclusion : {TierInclusion::exclusive, TierInclusion::inclusive}) {
      for (std::uint32_t seed = 1; seed <= 3; ++seed) {
        SCOPED_TRACE(std::string(to_string(policy)) + " " + to_string(inclusion) + " seed " +
                     std::to_string(seed));
        TierWorld w(16, tier_options(policy, inclusion, 12));
        std::mt19937 rng(seed);
        std::vector<std::unique_ptr<BlockTable>> live;
        const StreamView stream = w.cache.backend().default_stream();
        for (int op = 0; op < 300; ++op) {
          const auto r = rng() % 12;
          if (r == 0) {
            w.fb.set_plan(FaultKind::copy,
                          {.nth = 1 + rng() % 2,
                           .mode = rng() % 2 ? FaultMode::synchronous : FaultMode::deferred});
          } else if (r < 6) {
            const TokenId doc = static_cast<TokenId>(rng() % 6) * 1000;
            const std::vector<TokenId> p = test::tokens((1 + rng() % 4) * 4 + rng() % 3, doc);
            auto t = std::make_unique<BlockTable>(w.pc);
            try {  // a device copy (copy-on-write) may fail too: strong guarantee
              const std::size_t hit = t->reuse_cached_prefix(p, stream);
              const auto rest = std::span<const TokenId>(p).subspan(hit);
              if (t->blocks_needed(rest.size()) <= w.pc.num_available_blocks()) {
                t->append_tokens(rest, stream);
                live.push_back(std::move(t));
              }
            } catch (const BackendError&) {
            }
          } else if (r < 8 && !live.empty()) {
            live.erase(live.begin() + static_cast<std::ptrdiff_t>(rng() % live.size()));
          } else if (r == 8) {
            w.tier->offload(rng() % 4);
          } else if (r == 9) {
            w.tier->poll();
          } else if (r == 10) {
            w.tier->synchronize();
          } else {
            w.pc.evict(rng() % 2);
          }
          ASSERT_TRUE(w.sink.errors.empty()) << "op " << op << ": " << w.sink.errors.front();
          ASSERT_EQ(w.sink.hashes(kGpu), device_set(w.pc)) << "op " << op;
          ASSERT_EQ(w.sink.hashes(kCpu), host_set(*w.tier)) << "op " << op;
        }
        w.fb.clear_plans();
        live.clear();
        w.tier->synchronize();
        w.expect_exact();
        EXPECT_EQ(w.sink.without_tokens, 0u);
        expect_snapshot_matches(w.sink, {kGpu, kCpu}, [&](RecordingSink& s) {
          w.pc.snapshot(s);
          w.tier->snapshot(s);
        });
        EXPECT_TRUE(w.tier->check_invariants().ok);
      }
    }
  }
}

// ---- hybrid -------------------------------------------------------------------------------

constexpr std::size_t kBs = test::kHybridBlockSize;

SourceKey group_key(Medium m, std::uint32_t g) {
  return {m, g};
}

HashSet group_device_set(const HybridKvCache& c, std::size_t g) {
  return device_set(c.prefix_cache(g));
}

TEST(HybridEvents, EveryGroupIsAnnouncedWithItsIndexKindAndWindow) {
  auto backend = test::host_backend();
  const std::vector<std::size_t> blocks{12, 12, 8};
  RecordingSink sink;  // outlives the cache
  HybridKvCache cache(test::three_group_config(), blocks, *backend);
  cache.set_event_sink(&sink);
  EXPECT_EQ(cache.prefix_cache(0).event_source().spec_kind,
            std::optional<std::string>("full_attention"));
  const EventSource w = cache.group_event_source(1, Medium::gpu);
  EXPECT_EQ(w.group_idx, std::optional<std::uint32_t>(1));
  EXPECT_EQ(w.spec_kind, std::optional<std::string>("sliding_window"));
  EXPECT_EQ(w.sliding_window, std::optional<std::uint32_t>(8));
  const EventSource s = cache.group_event_source(2, Medium::cpu);
  EXPECT_EQ(s.spec_kind, std::optional<std::string>("mamba"));
  EXPECT_EQ(s.sliding_window, std::nullopt);
  EXPECT_EQ(s.medium, Medium::cpu);
  test::expect_invalid_argument([&] { (void)cache.group_event_source(3, Medium::gpu); },
                                "out of range");
  const StreamView stream = backend->default_stream();
  {
    HybridBlockTable t(cache);
    t.append_tokens(test::tokens(8, 1), stream);    // 2 full blocks
    t.append_tokens(test::tokens(5, 100), stream);  // a checkpoint at 8 tokens, block 2 full
    const std::vector<BlockHash> h = hash_full_blocks(t.tokens(), kBs);
    EXPECT_EQ(sink.hashes(group_key(Medium::gpu, 0)).size(), 3u);
    // The checkpoint at 8 tokens is announced as block 1, with its tokens.
    const Announced* cp = sink.find(group_key(Medium::gpu, 2), h[1]);
    ASSERT_NE(cp, nullptr);
    EXPECT_EQ(cp->parent, std::optional<BlockHash>(h[0]));
    EXPECT_EQ(cp->tokens, test::tokens(4, 5));
  }
  for (std::size_t g = 0; g < 3; ++g)
    EXPECT_EQ(sink.hashes(group_key(Medium::gpu, static_cast<std::uint32_t>(g))),
              group_device_set(cache, g));
  EXPECT_EQ(sink.sources.at(group_key(Medium::gpu, 1)), w);
  EXPECT_TRUE(sink.errors.empty()) << sink.errors.front();
}

TEST(HybridEvents, RandomStreamsWithAHostTierRebuildEveryGroupExactly) {
  for (std::uint32_t seed = 1; seed <= 4; ++seed) {
    SCOPED_TRACE("seed " + std::to_string(seed));
    auto fb = std::make_unique<FaultInjectingBackend>(test::host_backend());
    const std::vector<std::size_t> blocks{14, 14, 8};
    RecordingSink sink;
    {
      HybridKvCache cache(test::three_group_config(), blocks, *fb);
      HybridHostTierOptions o;
      o.slots_per_group = {10, 10, 6};
      o.offload_batch = 2;
      HybridHostTier tier(cache, o);
      cache.set_event_sink(&sink);
      tier.set_event_sink(&sink);
      std::mt19937 rng(seed);
      std::vector<std::unique_ptr<HybridBlockTable>> live;
      const StreamView stream = fb->default_stream();
      auto check = [&](int op) {
        ASSERT_TRUE(sink.errors.empty()) << "op " << op << ": " << sink.errors.front();
        for (std::uint32_t g = 0; g < 3; ++g) {
          ASSERT_EQ(sink.hashes(group_key(Medium::gpu, g)), group_device_set(cache, g))
              << "group " << g << " op " << op;
          ASSERT_EQ(sink.hashes(group_key(Medium::cpu, g)), host_set(*tier.group_tier(g)))
              << "group " << g << " op " << op;
        }
      };
      for (int op = 0; op < 250; ++op) {
        const auto r = rng() % 10;
        if (r == 0) {
          fb->set_plan(FaultKind::copy,
                       {.nth = 1 + rng() % 3,
                        .mode = rng() % 2 ? FaultMode::synchronous : FaultMode::deferred});
        } else if (r < 6) {
          const TokenId doc = static_cast<TokenId>(rng() % 5) * 1000;
          const std::vector<TokenId> p = test::tokens((1 + rng() % 4) * 4 + rng() % 3, doc);
          auto t = std::make_unique<HybridBlockTable>(cache);
          std::size_t hit = 0;
          try {
            hit = t->reuse_cached_prefix(p, stream);
          } catch (const BackendError&) {
            continue;
          }
          const auto rest = std::span<const TokenId>(p).subspan(hit);
          // Two appends (the state checkpoints come at the second).
          const std::size_t half = rest.size() / 2;
          bool ok = true;
          try {  // a device copy may fail too: strong guarantee
            for (const auto part : {rest.first(half), rest.subspan(half)}) {
              if (!t->can_append(part.size())) {
                ok = false;
                break;
              }
              t->append_tokens(part, stream);
            }
          } catch (const BackendError&) {
            ok = false;
          }
          if (ok) live.push_back(std::move(t));
        } else if (r < 8 && !live.empty()) {
          live.erase(live.begin() + static_cast<std::ptrdiff_t>(rng() % live.size()));
        } else if (r == 8) {
          tier.poll();
        } else {
          tier.synchronize();
        }
        check(op);
        if (::testing::Test::HasFatalFailure()) return;
      }
      fb->clear_plans();
      live.clear();
      tier.synchronize();
      check(-1);
      EXPECT_EQ(sink.without_tokens, 0u);
      std::vector<SourceKey> keys;
      for (std::uint32_t g = 0; g < 3; ++g) {
        keys.push_back(group_key(Medium::gpu, g));
        keys.push_back(group_key(Medium::cpu, g));
      }
      expect_snapshot_matches(sink, keys, [&](RecordingSink& s) {
        cache.snapshot(s);
        tier.snapshot(s);
      });
      EXPECT_GT(sink.hashes(group_key(Medium::gpu, 2)).size() +
                    sink.hashes(group_key(Medium::cpu, 2)).size(),
                0u)
          << "state checkpoints were announced";
    }
    EXPECT_EQ(sink.cleared_events, 6u) << "every group's tier and prefix cache cleared";
    for (const auto& [k, set] : sink.sets)
      EXPECT_TRUE(set.empty());
  }
}

}  // namespace
}  // namespace kvport
