// SPDX-License-Identifier: Apache-2.0
// The whole stack: a PagedKvCache (host backend) with its PrefixCache, a
// HostTier and a DiskTier under it. Blocks go device -> host -> disk and
// come back with their bytes; a restart on the same directory finds them
// (warm restart); a page corrupted between runs is a shorter hit, never
// served; the disk tier announces every block that comes and goes; and SIGKILL
// while the stack writes back under load leaves no wrong byte in any block a
// restarted stack returns.
#include <gtest/gtest.h>

#include <chrono>
#include <fstream>
#include <map>
#include <memory>
#include <optional>
#include <random>
#include <set>
#include <string>
#include <vector>

#include "../core/core_test_util.hpp"
#include "disk_test_util.hpp"
#include "kvport/core/block_table.hpp"
#include "kvport/core/host_tier.hpp"
#include "kvport/core/prefix_cache.hpp"
#include "kvport/disk/disk_tier.hpp"

namespace kvport::disk {
namespace {

using kvport::test::host_backend;
using kvport::test::small_config;
using kvport::test::tokens;
using test::TempDir;

// One process's stack: a device of `device` blocks, a host tier of `host`
// slots, a disk tier of `disk` slots in `dir`.
struct Stack {
  Stack(const std::filesystem::path& dir, std::size_t device, std::size_t host, std::size_t disk)
      : cache(small_config(KvCacheLayout::layer_major), device, *backend), prefix(cache) {
    HostTierOptions o;
    o.num_host_blocks = host;
    o.offload_batch = 2;
    tier.emplace(prefix, o);
    DiskStoreOptions d;
    d.dir = dir;
    d.num_slots = disk;
    d.block_bytes = tier->slot_bytes();
    d.layout = layout_fields(cache.config());
    d.queue_depth = 4;
    store = DiskTier::open(d);
    tier->set_lower_tier(store.get());
  }
  ~Stack() {
    tier.reset();  // before the store it points to
  }

  // Caches the 2-block sequence of 8 tokens from `first`, block i holding
  // the pattern of tag first + i, and releases it.
  void cache_sequence(TokenId first) {
    BlockTable t(prefix);
    const std::vector<TokenId> prompt = tokens(8, first);
    t.reuse_cached_prefix(prompt, stream);
    t.append_tokens(std::span<const TokenId>(prompt).subspan(t.num_tokens()), stream);
    for (std::size_t i = 0; i < t.num_blocks(); ++i)
      kvport::test::write_pattern_block(cache, t.blocks()[i], first + i, stream);
    tier->poll();
  }

  // Caches the sequences from 100 to 900 (a step of 100) and waits for the
  // host's copies: with a device of 4 blocks and a host of 4, the oldest 5
  // end on disk.
  void cache_nine() {
    for (TokenId first = 100; first < 1000; first += 100)
      cache_sequence(first);
    tier->synchronize();
  }

  // Looks the sequence up; returns how many blocks came back, and counts
  // those whose bytes are not the sequence's in `wrong`.
  std::size_t check_sequence(TokenId first, std::size_t& wrong) {
    PrefixMatch m = prefix.lookup(tokens(9, first));
    for (std::size_t i = 0; i < m.blocks.size(); ++i)
      if (!kvport::test::holds_pattern_block(cache, m.blocks[i], first + i, stream)) ++wrong;
    prefix.release_blocks(m.blocks);
    return m.blocks.size();
  }

  std::unique_ptr<Backend> backend = host_backend();
  Stream stream = backend->create_stream();
  PagedKvCache cache;
  PrefixCache prefix;
  std::optional<HostTier> tier;
  std::unique_ptr<DiskTier> store;
};

TEST(DiskTierStack, BlocksGoDownToDiskAndComeBackWithTheirBytes) {
  TempDir dir;
  Stack s(dir.path() / "tier", 4, 4, 32);
  s.cache_nine();
  // Device 4 blocks, host 4: of 9 sequences the oldest 5 are on disk.
  EXPECT_EQ(s.store->store().size(), 10u);
  EXPECT_EQ(s.tier->counters().lower_tier_writes, 10u);
  EXPECT_TRUE(s.store->store().check_invariants().empty());
  std::size_t wrong = 0;
  for (TokenId first = 100; first < 1000; first += 100)
    EXPECT_EQ(s.check_sequence(first, wrong), 2u) << first;
  EXPECT_EQ(wrong, 0u);
  EXPECT_GE(s.tier->counters().lower_tier_hits, 10u);
  EXPECT_EQ(s.tier->counters().lower_tier_shortfalls, 0u);
  EXPECT_TIER_INVARIANTS(*s.tier);
  EXPECT_TRUE(s.store->store().check_invariants().empty());
}

TEST(DiskTierStack, ARestartOnTheSameDirectoryFindsTheBlocksItLeft) {
  TempDir dir;
  std::vector<TokenId> on_disk;
  {
    Stack s(dir.path() / "tier", 4, 4, 32);
    s.cache_nine();
    for (TokenId first = 100; first < 1000; first += 100)
      if (s.store->contains(hash_full_blocks(tokens(8, first), 4)[0])) on_disk.push_back(first);
  }
  ASSERT_EQ(on_disk.size(), 5u);
  Stack s(dir.path() / "tier", 4, 4, 32);
  EXPECT_EQ(s.store->store().counters().recovered, 10u);
  std::size_t wrong = 0;
  for (TokenId first : on_disk)
    EXPECT_EQ(s.check_sequence(first, wrong), 2u) << first;
  EXPECT_EQ(wrong, 0u);
  EXPECT_TIER_INVARIANTS(*s.tier);
}

TEST(DiskTierStack, APageCorruptedBetweenRunsIsAShorterHitNeverServed) {
  TempDir dir;
  {
    Stack s(dir.path() / "tier", 4, 4, 32);
    s.cache_nine();
  }
  {  // flip a byte in every slot's image
    std::fstream f(dir.path() / "tier" / "blocks.dat",
                   std::ios::in | std::ios::out | std::ios::binary);
    ASSERT_TRUE(f.good());
    for (std::uint64_t slot = 0; slot < 32; ++slot) {
      f.seekg(static_cast<std::streamoff>(slot * 4096 + 5));
      char c = 0;
      f.get(c);
      f.seekp(static_cast<std::streamoff>(slot * 4096 + 5));
      f.put(static_cast<char>(c ^ 0x5A));
    }
  }
  Stack s(dir.path() / "tier", 4, 4, 32);
  std::size_t wrong = 0;
  std::size_t hits = 0;
  for (TokenId first = 100; first < 600; first += 100)
    hits += s.check_sequence(first, wrong);
  EXPECT_EQ(hits, 0u);
  EXPECT_EQ(wrong, 0u);
  EXPECT_GE(s.store->store().counters().checksum_failures, 5u);
  EXPECT_GE(s.tier->counters().lower_tier_shortfalls, 5u);
  EXPECT_TIER_INVARIANTS(*s.tier);
}

// Records what the disk tier announces, as a router would: the blocks held
// at its source, and what each was announced with.
class Recorder final : public CacheEventSink {
 public:
  struct Announced {
    std::optional<BlockHash> parent;
    std::vector<TokenId> tokens;
    std::uint64_t extra_key = 0;
    std::uint32_t block_size = 0;
  };
  void stored(const EventSource& source, const BlockStoredView& v) noexcept override {
    sources.insert(source.medium == Medium::disk ? "disk" : "other");
    for (const BlockHash& h : v.hashes) {
      if (!held.insert({h.high, h.low}).second) ++errors;
      announced[{h.high, h.low}] =
          Announced{v.parent, {v.tokens.begin(), v.tokens.end()}, v.extra_key, v.block_size};
    }
  }
  void removed(const EventSource& /*source*/, std::span<const BlockHash> hashes) noexcept override {
    for (const BlockHash& h : hashes)
      if (held.erase({h.high, h.low}) != 1) ++errors;
  }
  void cleared(const EventSource& /*source*/) noexcept override { held.clear(); }
  static std::pair<std::uint64_t, std::uint64_t> key(const BlockHash& h) { return {h.high, h.low}; }
  std::set<std::pair<std::uint64_t, std::uint64_t>> held;
  std::map<std::pair<std::uint64_t, std::uint64_t>, Announced> announced;
  std::set<std::string> sources;
  int errors = 0;
};

TEST(DiskTierAdapter, TheDiskTierAnnouncesItsOwnBlocksComeAndGo) {
  TempDir dir;
  DiskStoreOptions o;
  o.dir = dir.path() / "tier";
  o.num_slots = 4;
  o.block_bytes = 100;
  o.layout = {{"k", "v"}};
  DiskTier tier(DiskStore::open(o));
  Recorder rec;
  tier.set_event_sink(&rec, EventSource{Medium::disk, std::nullopt, std::nullopt, std::nullopt}, 2);
  std::vector<BlockHash> hashes = test::chain(7, 6);
  std::vector<std::vector<std::byte>> images;
  std::vector<std::span<const std::byte>> views;
  for (const BlockHash& h : hashes)
    images.push_back(test::image_of(h, 100));
  for (const auto& im : images)
    views.emplace_back(im);
  // What each block was registered with: its parent, two tokens, an extra key.
  std::vector<TokenId> toks(2 * hashes.size());
  std::vector<BlockOrigin> origins(hashes.size());
  for (std::size_t i = 0; i < hashes.size(); ++i) {
    toks[2 * i] = static_cast<TokenId>(10 * i);
    toks[2 * i + 1] = static_cast<TokenId>(10 * i + 1);
    if (i > 0) origins[i].parent = hashes[i - 1];
    origins[i].tokens = std::span<const TokenId>(toks).subspan(2 * i, 2);
    origins[i].extra_key = 77;
  }
  // Origins that do not match the hashes: nothing kept, nothing announced.
  EXPECT_EQ(tier.put(hashes, views, std::span<const BlockOrigin>(origins).first(2)), 0u);
  EXPECT_TRUE(rec.held.empty());
  EXPECT_EQ(tier.put(hashes, views, origins), 4u);  // 6 blocks, 4 slots: the first 4 are kept
  ASSERT_EQ(rec.held.size(), 4u);
  EXPECT_EQ(rec.sources, std::set<std::string>{"disk"});
  const Recorder::Announced& second = rec.announced[Recorder::key(hashes[1])];
  EXPECT_EQ(second.parent, std::optional<BlockHash>(hashes[0]));
  EXPECT_EQ(second.tokens, (std::vector<TokenId>{10, 11}));
  EXPECT_EQ(second.extra_key, 77u);
  EXPECT_EQ(second.block_size, 2u);
  EXPECT_FALSE(rec.announced[Recorder::key(hashes[0])].parent.has_value());
  tier.erase(std::span<const BlockHash>(hashes).subspan(1, 1));
  EXPECT_FALSE(tier.contains(hashes[1]));
  EXPECT_EQ(rec.held.size(), 3u);
  // Two more blocks, bare: one goes into the free slot, one evicts the oldest.
  EXPECT_EQ(tier.put(std::span<const BlockHash>(hashes).subspan(4, 2),
                     std::span<const std::span<const std::byte>>(views).subspan(4, 2), {}),
            2u);
  EXPECT_EQ(rec.held.size(), 4u);
  EXPECT_FALSE(rec.held.contains(Recorder::key(hashes[0])));  // evicted: removed
  EXPECT_TRUE(rec.announced[Recorder::key(hashes[5])].tokens.empty());
  EXPECT_EQ(rec.errors, 0);
  // A snapshot lists the same blocks, bare.
  Recorder snap;
  tier.snapshot(snap);
  EXPECT_EQ(snap.held, rec.held);
  EXPECT_FALSE(snap.announced[Recorder::key(hashes[3])].parent.has_value());
  EXPECT_EQ(tier.stored_hashes().size(), 4u);
  // No sink: nothing more is announced.
  tier.set_event_sink(nullptr, EventSource{Medium::disk, std::nullopt, std::nullopt, std::nullopt},
                      2);
  tier.erase(std::span<const BlockHash>(hashes).subspan(2, 1));
  EXPECT_EQ(rec.held.size(), 4u);
  // Bad sizes: nothing kept, nothing thrown.
  std::vector<std::span<const std::byte>> short_views(hashes.size());
  EXPECT_EQ(tier.put(hashes, short_views, {}), 0u);
  std::vector<std::span<std::byte>> none;
  EXPECT_EQ(tier.get_prefix(hashes, none), 0u);
  EXPECT_THROW(DiskTier(std::unique_ptr<DiskStore>()), InvalidArgument);
}

// A child process runs the stack under load (caching sequences, looking
// some up again, so blocks move device -> host -> disk and back) and is
// SIGKILLed at a random moment; a restarted stack then looks up every
// sequence the child could have made: every block returned must hold its
// sequence's bytes. Several kills, each within about 0.3 s.
TEST(DiskTierStack, SigkillUnderLoadLeavesNoWrongByteInAnyHit) {
  TempDir dir;
  std::mt19937 rng(4242);
  std::size_t served = 0;
  std::size_t wrong = 0;
  for (int round = 0; round < 5; ++round) {
    ASSERT_TRUE(test::sigkill_after(
        [&] {
          Stack s(dir.path() / "tier", 8, 8, 64);
          for (TokenId k = 0;; ++k) {
            const auto first = static_cast<TokenId>(100000 * (round + 1) + 10 * (k % 4000));
            s.cache_sequence(first);
            if (k % 3 == 0) {
              std::size_t ignored = 0;
              s.check_sequence(static_cast<TokenId>(first - 10 * (k % 7)), ignored);
            }
          }
        },
        std::chrono::milliseconds(30 + rng() % 250)));
    Stack s(dir.path() / "tier", 8, 8, 64);
    // Every round's sequences (this one's and the earlier ones' left on disk).
    for (int r = 0; r <= round; ++r) {
      for (TokenId k = 0; k < 4000; ++k) {
        const auto first = static_cast<TokenId>(100000 * (r + 1) + 10 * k);
        if (!s.store->contains(hash_full_blocks(tokens(8, first), 4)[0])) continue;
        served += s.check_sequence(first, wrong);
      }
    }
    EXPECT_TIER_INVARIANTS(*s.tier);
    EXPECT_TRUE(s.store->store().check_invariants().empty());
  }
  EXPECT_EQ(wrong, 0u);
  EXPECT_GT(served, 0u) << "no block survived any kill";
}

}  // namespace
}  // namespace kvport::disk
