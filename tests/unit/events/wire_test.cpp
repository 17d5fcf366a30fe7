// SPDX-License-Identifier: Apache-2.0
// The wire codec: every field round trips in both forms, the decoder reads
// vLLM's shapes (map batch, trailing fields, unknown types) and refuses
// malformed input with an error, never a crash.
#include "kvport/events/wire.hpp"

#include <gtest/gtest.h>

#include <climits>
#include <random>

namespace kvport::events {
namespace {

EventBatch full_batch() {
  EventBatch b;
  b.seq = 7;
  b.ts = 1234.5;
  b.data_parallel_rank = 3;
  BlockStored s;
  s.block_hashes = {1, 0xffffffffffffffffull, 0x8000000000000000ull};
  s.parent_block_hash = 42;
  s.token_ids = {0, 1, 2, 3, 4, 0xffffffffu};
  s.block_size = 2;
  s.medium = "CPU";
  s.lora_name = "adapter";
  s.group_idx = 1;
  s.kv_cache_spec_kind = "sliding_window";
  s.kv_cache_spec_sliding_window = 4096;
  b.events.emplace_back(s);
  BlockStored bare;
  bare.block_hashes = {9};
  bare.token_ids = {5, 6};
  bare.block_size = 2;
  b.events.emplace_back(bare);
  b.events.emplace_back(BlockRemoved{{1, 2}, "GPU", std::nullopt});
  b.events.emplace_back(BlockRemoved{{3}, "DISK", 2u});
  b.events.emplace_back(AllBlocksCleared{});
  b.events.emplace_back(AllBlocksCleared{"CPU", std::nullopt});
  b.events.emplace_back(AllBlocksCleared{std::nullopt, 5u});
  return b;
}

class WireForms : public ::testing::TestWithParam<EventForm> {};

TEST_P(WireForms, EveryFieldRoundTrips) {
  const EventBatch b = full_batch();
  const std::string payload = encode_batch(b, GetParam());
  const DecodeResult r = decode_batch(payload, 7);
  ASSERT_TRUE(r.ok()) << r.error;
  EXPECT_EQ(*r.batch, b);
  EXPECT_EQ(r.unknown_events, 0u);
}

TEST_P(WireForms, NilRankAndEmptyEvents) {
  EventBatch b;
  b.ts = 0.25;
  const DecodeResult r = decode_batch(encode_batch(b, GetParam()));
  ASSERT_TRUE(r.ok()) << r.error;
  EXPECT_EQ(*r.batch, b);
}

// BatchWriter writes what encode_batch writes, byte for byte.
std::string written(const EventBatch& b, EventForm form) {
  std::string out = "prefix";  // appended to, not replaced
  BatchWriter w(out, form, b.ts, b.events.size());
  for (const CacheEvent& ev : b.events) {
    if (const auto* s = std::get_if<BlockStored>(&ev)) {
      StoredEventView v;
      v.block_hashes = s->block_hashes;
      v.parent_block_hash = s->parent_block_hash;
      v.token_ids = s->token_ids;
      v.block_size = s->block_size;
      v.medium = s->medium;
      if (s->lora_name) v.lora_name = *s->lora_name;
      v.group_idx = s->group_idx;
      if (s->kv_cache_spec_kind) v.kv_cache_spec_kind = *s->kv_cache_spec_kind;
      v.kv_cache_spec_sliding_window = s->kv_cache_spec_sliding_window;
      w.stored(v);
    } else if (const auto* r = std::get_if<BlockRemoved>(&ev)) {
      w.removed(r->block_hashes, r->medium, r->group_idx);
    } else {
      const auto& c = std::get<AllBlocksCleared>(ev);
      w.cleared(c.medium ? std::optional<std::string_view>(*c.medium) : std::nullopt, c.group_idx);
    }
  }
  w.finish(b.data_parallel_rank);
  return out.substr(6);
}

TEST_P(WireForms, BatchWriterWritesTheBytesOfEncodeBatch) {
  EXPECT_EQ(written(full_batch(), GetParam()), encode_batch(full_batch(), GetParam()));
  // Every integer and length at and around msgpack's size boundaries.
  const std::uint64_t edges[] = {0,          1,         127,   128,         255,
                                 256,        65535,     65536, 0xffffffffu, 0x100000000ull,
                                 ~0ull >> 1, ~0ull - 1, ~0ull, 31,          32};
  std::mt19937_64 rng(11);
  auto pick = [&] { return rng() % 3 ? edges[rng() % std::size(edges)] : rng(); };
  for (int round = 0; round < 300; ++round) {
    EventBatch b;
    b.ts = static_cast<double>(rng() % 100000) / 7.0;
    if (rng() % 2) b.data_parallel_rank = static_cast<std::int64_t>(pick()) - 40;
    const std::size_t n = rng() % 3 == 0 ? 16 + rng() % 4 : rng() % 6;
    for (std::size_t k = 0; k < n; ++k) {
      const std::size_t len = rng() % 4 == 0 ? edges[rng() % 3 + 1] / 4 + rng() % 40 : rng() % 20;
      const std::string text(rng() % 4 == 0 ? 30 + rng() % 300 : rng() % 8, 'x');
      switch (rng() % 4) {
        case 0: {
          BlockRemoved r;
          for (std::size_t i = 0; i < len; ++i)
            r.block_hashes.push_back(pick());
          r.medium = text;
          if (rng() % 2) r.group_idx = static_cast<std::uint32_t>(pick());
          b.events.emplace_back(r);
          break;
        }
        case 1: {
          AllBlocksCleared c;
          if (rng() % 2) c.medium = text;
          if (rng() % 2) c.group_idx = static_cast<std::uint32_t>(pick());
          b.events.emplace_back(c);
          break;
        }
        default: {
          BlockStored s;
          for (std::size_t i = 0; i < len; ++i)
            s.block_hashes.push_back(pick());
          if (rng() % 2) s.parent_block_hash = pick();
          for (std::size_t i = 0; i < len * 3; ++i)
            s.token_ids.push_back(static_cast<TokenId>(pick()));
          s.block_size = static_cast<std::uint32_t>(pick());
          s.medium = text;
          if (rng() % 2) s.lora_name = text + "l";
          if (rng() % 2) s.group_idx = static_cast<std::uint32_t>(pick());
          if (rng() % 2) s.kv_cache_spec_kind = std::string(rng() % 40, 'k');
          if (rng() % 2) s.kv_cache_spec_sliding_window = static_cast<std::uint32_t>(pick());
          b.events.emplace_back(s);
        }
      }
    }
    ASSERT_EQ(written(b, GetParam()), encode_batch(b, GetParam())) << "round " << round;
  }
  // One buffer reused for batch after batch (finish_view: nothing trimmed or
  // zeroed), every rank size among them.
  const std::int64_t ranks[] = {0,         -1,     -32,    -33,          -128,
                                -129,      -32768, -32769, -(1ll << 31), -(1ll << 31) - 1,
                                INT64_MIN, 127,    128,    65536,        INT64_MAX};
  std::string buffer = "stale bytes that the batches overwrite";
  for (std::size_t k = 0; k < std::size(ranks) * 2; ++k) {
    EventBatch b = full_batch();
    b.data_parallel_rank = ranks[k % std::size(ranks)];
    if (k % 3 == 0) b.events.resize(1);  // shorter than the last: scratch left past it
    BatchWriter w(buffer, 0, GetParam(), b.ts, b.events.size());
    const std::string whole = written(b, GetParam());  // the appending writer, for its events
    std::string_view view;
    {
      // The same events through the reused buffer.
      for (const CacheEvent& ev : b.events) {
        if (const auto* s = std::get_if<BlockStored>(&ev)) {
          StoredEventView v;
          v.block_hashes = s->block_hashes;
          v.parent_block_hash = s->parent_block_hash;
          v.token_ids = s->token_ids;
          v.block_size = s->block_size;
          v.medium = s->medium;
          if (s->lora_name) v.lora_name = *s->lora_name;
          v.group_idx = s->group_idx;
          if (s->kv_cache_spec_kind) v.kv_cache_spec_kind = *s->kv_cache_spec_kind;
          v.kv_cache_spec_sliding_window = s->kv_cache_spec_sliding_window;
          w.stored(v);
        } else if (const auto* r = std::get_if<BlockRemoved>(&ev)) {
          w.removed(r->block_hashes, r->medium, r->group_idx);
        } else {
          const auto& c = std::get<AllBlocksCleared>(ev);
          w.cleared(c.medium ? std::optional<std::string_view>(*c.medium) : std::nullopt,
                    c.group_idx);
        }
      }
      view = w.finish_view(b.data_parallel_rank);
    }
    EXPECT_EQ(view, encode_batch(b, GetParam())) << "rank " << ranks[k % std::size(ranks)];
    EXPECT_EQ(whole, encode_batch(b, GetParam()));
    EXPECT_EQ(view.data(), buffer.data());
  }
  // Arrays and a string of 65,536 elements (msgpack's 32-bit lengths).
  EventBatch big;
  BlockStored s;
  s.block_hashes.assign(65536, 300);
  s.token_ids.assign(70000, 70000);
  s.lora_name = std::string(65536, 'a');
  big.events.emplace_back(s);
  EXPECT_EQ(written(big, GetParam()), encode_batch(big, GetParam()));
}

INSTANTIATE_TEST_SUITE_P(Both, WireForms, ::testing::Values(EventForm::map, EventForm::positional));

// Hand-built msgpack helpers for vLLM's shapes.
std::string str(std::string_view s) {
  std::string out(1, static_cast<char>(0xa0 | s.size()));
  return out + std::string(s);
}
std::string arr(int n) {
  return std::string(1, static_cast<char>(0x90 | n));
}
std::string map(int n) {
  return std::string(1, static_cast<char>(0x80 | n));
}
const std::string nil(1, static_cast<char>(0xc0));
const std::string zero(1, '\0');

TEST(Wire, MapFormKeysInAnyOrderWithExtrasAndTypeLast) {
  // {"block_hashes":[5], "future_field":[1,[2]], "token_ids":[1,2], "block_size":2,
  //  "medium":nil, "type":"BlockStored"} as the batch map {"events": [...], "ts": 1}
  std::string ev = map(6) + str("block_hashes") + arr(1) + "\x05" + str("future_field") + arr(2) +
                   "\x01" + arr(1) + "\x02" + str("token_ids") + arr(2) + "\x01\x02" +
                   str("block_size") + "\x02" + str("medium") + nil + str("type") +
                   str("BlockStored");
  std::string batch = map(2) + str("events") + arr(1) + ev + str("ts") + "\x01";
  const DecodeResult r = decode_batch(batch);
  ASSERT_TRUE(r.ok()) << r.error;
  ASSERT_EQ(r.batch->events.size(), 1u);
  const auto& s = std::get<BlockStored>(r.batch->events[0]);
  EXPECT_EQ(s.block_hashes, std::vector<std::uint64_t>{5});
  EXPECT_EQ(s.token_ids, (std::vector<TokenId>{1, 2}));
  EXPECT_EQ(s.medium, "GPU");  // nil medium (older vLLM) reads as GPU
  EXPECT_FALSE(r.batch->data_parallel_rank);
  EXPECT_EQ(r.batch->ts, 1.0);
}

TEST(Wire, OldPositionalWithoutLaterFieldsAndWithExtraTrailing) {
  // vLLM's early positional BlockStored: tag, hashes, parent, tokens, size, lora_id
  std::string early =
      arr(6) + str("BlockStored") + arr(1) + "\x07" + nil + arr(1) + "\x03" + "\x01" + nil;
  std::string later = arr(5) + str("BlockRemoved") + arr(1) + "\x07" + str("GPU") + nil + "\x09";
  std::string batch = arr(3) + zero + arr(2) + early + later + nil;
  const DecodeResult r = decode_batch(batch);
  ASSERT_TRUE(r.ok()) << r.error;
  ASSERT_EQ(r.batch->events.size(), 2u);
  EXPECT_EQ(std::get<BlockStored>(r.batch->events[0]).medium, "GPU");
  EXPECT_EQ(std::get<BlockRemoved>(r.batch->events[1]).block_hashes, std::vector<std::uint64_t>{7});
}

TEST(Wire, UnknownEventTypesAreSkippedAndCounted) {
  std::string batch = arr(3) + zero + arr(3) + map(2) + str("type") + str("KVFuture") + str("x") +
                      arr(1) + "\x01" + arr(2) + str("Other") + "\x05" + map(1) + str("type") +
                      str("AllBlocksCleared") + "\x01";
  const DecodeResult r = decode_batch(batch);
  ASSERT_TRUE(r.ok()) << r.error;
  EXPECT_EQ(r.unknown_events, 2u);
  ASSERT_EQ(r.batch->events.size(), 1u);
  EXPECT_TRUE(std::holds_alternative<AllBlocksCleared>(r.batch->events[0]));
  EXPECT_EQ(r.batch->data_parallel_rank, 1);
}

TEST(Wire, MalformedInputGivesAnError) {
  const std::string good = encode_batch(full_batch());
  struct Case {
    std::string name, bytes, expect;
  };
  const std::vector<Case> cases = {
      {"empty", "", "truncated"},
      {"scalar batch", "\x05", "expected an array or a map"},
      {"truncated", good.substr(0, good.size() / 2), "truncated"},
      {"trailing", good + zero, "trailing"},
      {"huge array", "\xdd\xff\xff\xff\xff", "exceeds"},
      {"huge str", arr(3) + zero + arr(1) + "\xdb\xff\xff\xff\xf0", "truncated"},
      {"events not a list", arr(3) + zero + str("x") + nil, "events: expected an array"},
      {"hash a string",
       arr(3) + zero + arr(1) + arr(4) + str("BlockRemoved") + arr(1) + str("h") + str("GPU") +
           nil + nil,
       "block_hashes: expected an integer"},
      {"no type", arr(3) + zero + arr(1) + map(1) + str("a") + "\x01" + nil, "without"},
      {"stored missing tokens",
       arr(3) + zero + arr(1) + map(2) + str("type") + str("BlockStored") + str("block_hashes") +
           arr(0) + nil,
       "BlockStored without"},
      {"token out of range",
       arr(3) + zero + arr(1) + arr(5) + str("BlockStored") + arr(0) + nil + arr(1) +
           std::string("\xcf\x01\x00\x00\x00\x00\x00\x00\x00", 9) + "\x01" + nil,
       "out of range"},
      {"short batch", arr(1) + zero, "needs ts and events"},
      {"invalid byte", arr(3) + zero + arr(1) + "\xc1" + nil, "0xc1"},
      {"deep nesting",
       arr(3) + zero + arr(1) + map(2) + str("type") + str("X") + str("k") +
           std::string(40, '\x91') + zero + nil,
       "nested deeper"},
  };
  for (const Case& c : cases) {
    const DecodeResult r = decode_batch(c.bytes);
    EXPECT_FALSE(r.ok()) << c.name;
    EXPECT_NE(r.error.find(c.expect), std::string::npos) << c.name << ": " << r.error;
  }
}

// Mutated encodings (bit flips, truncations, inserted and overwritten bytes)
// decode or fail cleanly; run under the address/undefined sanitizer preset
// this is the decoder's fuzz smoke test.
TEST(Wire, RandomMutationsNeverCrash) {
  std::mt19937_64 rng(20261202);
  const std::string base[] = {encode_batch(full_batch(), EventForm::map),
                              encode_batch(full_batch(), EventForm::positional)};
  std::size_t ok = 0, failed = 0;
  for (int iter = 0; iter < 20000; ++iter) {
    std::string m = base[iter % 2];
    const int edits = 1 + static_cast<int>(rng() % 4);
    for (int e = 0; e < edits && !m.empty(); ++e) {
      const std::size_t at = rng() % m.size();
      switch (rng() % 4) {
        case 0:
          m[at] = static_cast<char>(m[at] ^ (1 << (rng() % 8)));
          break;
        case 1:
          m.resize(at);
          break;
        case 2:
          m.insert(at, 1, static_cast<char>(rng()));
          break;
        default:
          m[at] = static_cast<char>(0xc0 + rng() % 32);
          break;
      }
    }
    const DecodeResult r = decode_batch(m);
    if (r.ok()) {
      ++ok;
      EXPECT_TRUE(r.error.empty());
    } else {
      ++failed;
      EXPECT_FALSE(r.error.empty());
    }
  }
  EXPECT_GT(failed, 0u);
  EXPECT_GT(ok + failed, 0u);
}

TEST(Wire, SequenceFrames) {
  const auto f = encode_seq(0x0102030405060708ull);
  EXPECT_EQ(static_cast<int>(f[0]), 1);
  EXPECT_EQ(static_cast<int>(f[7]), 8);
  EXPECT_EQ(decode_seq(f), 0x0102030405060708ull);
  const auto end = encode_seq(end_of_replay_seq);
  for (std::byte b : end)
    EXPECT_EQ(static_cast<int>(b), 0xff);
  EXPECT_FALSE(decode_seq(std::span(f).first(7)));
}

}  // namespace
}  // namespace kvport::events
