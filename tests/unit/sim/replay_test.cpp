// SPDX-License-Identifier: Apache-2.0
// The Mooncake trace reader, token synthesis and the prefix-cache replay
// workload, called as a library (the `kvport replay` report is tested in
// tests/unit/cli/replay_test.cpp).
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <unistd.h>

#include <algorithm>
#include <limits>
#include <set>
#include <sstream>
#include <string>
#include <vector>

#include "kvport/backends/host_backend.hpp"
#include "kvport/core/cache_events.hpp"
#include "kvport/platform/error.hpp"
#include "kvport/sim/mooncake_trace.hpp"
#include "kvport/sim/replay.hpp"
#include "kvport/sim/trace_tokens.hpp"
#include "kvport/testing/sim_support.hpp"

namespace kvport::sim {
namespace {

using ::testing::HasSubstr;

using kvport::testing::mooncake_line;
constexpr auto line = &mooncake_line;  // one trace line

TEST(sim_replay, ReaderYieldsRequestsWithLineNumbers) {
  std::istringstream in(line(5, 100, 2, "[1, 2]") + "\n" + line(3.5, 7, 0, "[]"));
  MooncakeTraceReader reader(in, "mem");
  const auto a = reader.next();
  ASSERT_TRUE(a);
  EXPECT_EQ(a->line, 1u);
  EXPECT_EQ(a->input_length, 100u);
  EXPECT_EQ(a->output_length, 2u);
  EXPECT_EQ(a->hash_ids, (std::vector<std::uint64_t>{1, 2}));
  const auto b = reader.next();
  ASSERT_TRUE(b);
  EXPECT_EQ(b->line, 3u);
  EXPECT_DOUBLE_EQ(b->timestamp_ms, 3.5);
  EXPECT_FALSE(reader.next());
  EXPECT_FALSE(reader.next());

  std::istringstream bad(line(0, 1, 1, "[]") + "{\n");
  EXPECT_THROW(
      {
        try {
          (void)read_mooncake_trace(bad, "mem");
        } catch (const InvalidArgument& e) {
          EXPECT_THAT(e.what(), HasSubstr("mem:2: malformed JSON"));
          throw;
        }
      },
      InvalidArgument);
}

TEST(sim_replay, ReaderHardensEachLineLikeTheConfigReader) {
  // The same parse as --hf-config files (json_input.hpp): a NUL byte and deep
  // nesting are errors naming the line.
  const std::string nul =
      "{\"timestamp\": 0, \"input_length\": 1, \"output_length\": 1, "
      "\"hash_ids\": []}" +
      std::string(1, '\0') + "junk\n";
  std::istringstream with_nul(line(0, 1, 1, "[]") + nul);
  EXPECT_THROW(
      {
        try {
          (void)read_mooncake_trace(with_nul, "mem");
        } catch (const InvalidArgument& e) {
          EXPECT_STREQ(e.what(),
                       "mem:2: malformed JSON: NUL byte at offset 71 (not a JSON text file)");
          throw;
        }
      },
      InvalidArgument);
  std::istringstream deep(
      line(0, 1, 1, "[]")
          .insert(1, "\"x\": " + std::string(16, '[') + std::string(16, ']') + ", "));
  EXPECT_THROW(
      {
        try {
          (void)read_mooncake_trace(deep, "mem");
        } catch (const InvalidArgument& e) {
          EXPECT_STREQ(e.what(), "mem:1: JSON nested deeper than 16 levels");
          throw;
        }
      },
      InvalidArgument);
}

TEST(sim_replay, EqualIdsGiveEqualTokens) {
  TraceRequest a;
  a.input_length = 1000;
  a.hash_ids = {7, 8};
  TraceRequest b = a;
  b.hash_ids = {7, 9};
  std::vector<TokenId> ta, tb, ta2;
  sequence_tokens(a, 0, 512, 1010, ta);
  sequence_tokens(b, 1, 512, 1000, tb);
  sequence_tokens(a, 5, 512, 1000, ta2);
  ASSERT_EQ(ta.size(), 1010u);
  EXPECT_TRUE(std::equal(ta.begin(), ta.begin() + 512, tb.begin()));
  EXPECT_FALSE(std::equal(ta.begin() + 512, ta.begin() + 1000, tb.begin() + 512));
  EXPECT_TRUE(std::equal(ta2.begin(), ta2.end(), ta.begin()));  // the index does not matter
  EXPECT_EQ(ta[3], trace_token(7, 3));
  EXPECT_EQ(ta[515], trace_token(8, 3));
  EXPECT_EQ(ta[1005], unique_token(0, 1005));  // generated tokens are the request's own
  EXPECT_NE(unique_token(0, 1005), unique_token(1, 1005));

  std::set<TokenId> distinct;
  for (TokenId t : ta) {
    EXPECT_LT(t, 1u << 31);
    distinct.insert(t);
  }
  EXPECT_GT(distinct.size(), 1000u);  // no visible pattern or collisions
}

TEST(sim_replay, RunReplayOnGeneratedRequests) {
  std::vector<TraceRequest> requests;
  for (std::size_t i = 0; i < 50; ++i) {
    TraceRequest r;
    r.timestamp_ms = static_cast<double>(i * 7 % 13);
    r.input_length = 100 + i;
    r.output_length = 3;
    r.hash_ids = {i % 3};
    requests.push_back(r);
  }
  ReplayOptions options;
  options.capacity_blocks = 1024;  // no eviction
  options.trace_block_tokens = 64;
  std::size_t calls = 0;
  options.progress = [&](std::size_t done, std::size_t total) {
    ++calls;
    EXPECT_EQ(done, calls);
    EXPECT_EQ(total, 50u);
  };
  const auto backend = make_host_backend();
  const ReplayResult result = run_replay(requests, options, *backend);
  EXPECT_EQ(calls, 50u);
  EXPECT_TRUE(result.ok()) << result.invariants.to_string();
  EXPECT_EQ(result.completed, 50u);
  EXPECT_EQ(result.hit_blocks, 47u * 4u);  // each id's 4 blocks hit after its first request
  EXPECT_EQ(result.operations(), result.lookups + result.allocations + result.releases);

  options.capacity_blocks = 0;
  EXPECT_THROW((void)run_replay(requests, options, *backend), InvalidArgument);
  options.capacity_blocks = 1024;
  EXPECT_THROW((void)run_replay({}, options, *backend), InvalidArgument);
  requests[3].input_length = 0;
  EXPECT_THROW((void)run_replay(requests, options, *backend), InvalidArgument);
}

// run_replay is the one replay workload over its cache seen as one group: its
// result has the group fields replay_model's has (model_replay.hpp), and
// they agree with the one-group counters.
TEST(sim_replay, OneGroupRunFillsTheGroupFields) {
  std::vector<TraceRequest> requests;
  for (std::size_t i = 0; i < 40; ++i) {
    TraceRequest r;
    r.timestamp_ms = static_cast<double>(i * 3);
    r.input_length = 200 + 50 * i;
    r.output_length = 30;
    r.hash_ids = {i % 4, 100 + i};
    requests.push_back(r);
  }
  ReplayOptions options;
  options.capacity_blocks = 96;  // tight: some requests wait, some are rejected
  options.trace_block_tokens = 128;
  options.concurrency = 8;
  const auto backend = make_host_backend();
  const ReplayResult r = run_replay(requests, options, *backend);
  ASSERT_TRUE(r.ok()) << r.invariants.to_string();
  ASSERT_EQ(r.groups.size(), 1u);
  const GroupUsage& g = r.groups[0];
  EXPECT_EQ(g.spec.kind, LayerKind::full_attention);
  EXPECT_EQ(g.num_blocks, options.capacity_blocks);
  EXPECT_GT(g.bytes_per_block, 0u);
  EXPECT_EQ(g.bytes_per_block, r.model_block_bytes);
  // Sampled at the end of each step: at most the peak taken at every change.
  EXPECT_GT(g.peak_blocks_in_use, 0u);
  EXPECT_LE(g.peak_blocks_in_use, r.peak_blocks_in_use);
  EXPECT_LE(r.peak_blocks_in_use, options.capacity_blocks);
  EXPECT_GE(g.block_steps, g.peak_blocks_in_use);
  EXPECT_GE(r.peak_running, 1u);
  EXPECT_LE(r.peak_running, options.concurrency);
  EXPECT_GT(r.mean_running, 0.0);
  EXPECT_LE(r.mean_running, static_cast<double>(r.peak_running));
  EXPECT_EQ(g.hit_blocks, r.hit_blocks);
  // One entry per request: the hit of its first admission, -1 when rejected.
  ASSERT_EQ(r.request_hit_tokens.size(), requests.size());
  std::uint64_t hits = 0;
  std::size_t never = 0;
  for (const std::int64_t h : r.request_hit_tokens) {
    if (h < 0) {
      ++never;
      continue;
    }
    hits += static_cast<std::uint64_t>(h);
  }
  EXPECT_EQ(hits, r.hit_tokens);
  EXPECT_EQ(never, r.rejected);
  EXPECT_GT(r.rejected, 0u);  // the longest prompts do not fit 96 blocks
  EXPECT_GT(r.hit_tokens, 0u);
  EXPECT_EQ(r.planned_context_tokens, 0u);  // no plan: the minimal cache
}

// Hands over the requests of `chosen` at their timestamps, at most `batch` a
// call (so that later ones wait for a later step), and records the callbacks.
class ListFeed final : public ArrivalFeed {
 public:
  ListFeed(const std::vector<TraceRequest>& requests, std::vector<std::size_t> chosen)
      : requests_(requests), chosen_(std::move(chosen)) {}

  std::optional<double> arrivals(const ReplayProgress& progress,
                                 std::vector<Arrival>& out) override {
    ++calls;
    EXPECT_LE(progress.running + progress.waiting, requests_.size());
    while (next_ < chosen_.size() && at(next_) <= progress.now_ms) {
      out.push_back({chosen_[next_], at(next_)});
      ++next_;
    }
    if (next_ == chosen_.size()) return std::nullopt;
    return at(next_);
  }
  std::optional<double> wait_next(const ReplayProgress& /*progress*/) override {
    ++waits;
    if (next_ == chosen_.size()) return std::nullopt;
    return at(next_);
  }
  void finished(std::size_t index, double /*at_ms*/, bool rejected) override {
    (rejected ? rejected_ids : completed_ids).push_back(index);
  }
  void admitted(std::size_t index, std::size_t hit_blocks, std::size_t hit_tokens,
                std::size_t prefill_tokens) override {
    admitted_ids.push_back(index);
    hit_blocks_sum += hit_blocks;
    hit_tokens_sum += hit_tokens;
    EXPECT_EQ(hit_tokens + prefill_tokens, requests_[index].input_length);
  }

  std::size_t calls = 0;
  std::size_t waits = 0;
  std::vector<std::size_t> completed_ids, rejected_ids, admitted_ids;
  std::size_t hit_tokens_sum = 0;
  std::size_t hit_blocks_sum = 0;

 private:
  // The timestamp of the i-th chosen request (0 for an index of no request).
  double at(std::size_t i) const {
    return chosen_[i] < requests_.size() ? requests_[chosen_[i]].timestamp_ms : 0.0;
  }

  const std::vector<TraceRequest>& requests_;
  std::vector<std::size_t> chosen_;
  std::size_t next_ = 0;
};

// A feed that hands over every other request runs exactly the replay of
// those requests alone: a `kvport cluster` instance is the replay of what its
// router sends it.
TEST(sim_replay, FeedRunsTheRequestsItHandsOver) {
  std::vector<TraceRequest> requests;
  for (std::size_t i = 0; i < 60; ++i) {
    TraceRequest r;
    r.timestamp_ms = static_cast<double>(i * 37);
    r.input_length = 100 + 3 * i;
    r.output_length = 5 + i % 4;
    r.hash_ids = {i % 4, 10 + i % 2};
    r.line = i + 1;
    requests.push_back(r);
  }
  requests[10].input_length = 5000;  // more than the cache: rejected at arrival
  std::vector<std::size_t> chosen;
  std::vector<TraceRequest> alone;
  for (std::size_t i = 0; i < requests.size(); i += 2) {
    chosen.push_back(i);
    alone.push_back(requests[i]);
  }
  ReplayOptions options;
  options.capacity_blocks = 96;  // evicts
  options.trace_block_tokens = 64;
  options.concurrency = 4;
  options.check_every = 1;
  const auto backend = make_host_backend();
  const ReplayResult expected = run_replay(alone, options, *backend);

  ListFeed feed(requests, chosen);
  options.feed = &feed;
  const ReplayResult fed = run_replay(requests, options, *backend);
  EXPECT_TRUE(fed.ok()) << fed.invariants.to_string();
  EXPECT_EQ(fed.requests, chosen.size());
  EXPECT_EQ(fed.completed, expected.completed);
  EXPECT_EQ(fed.rejected, 1u);
  EXPECT_EQ(fed.rejected, expected.rejected);
  EXPECT_EQ(fed.steps, expected.steps);
  EXPECT_EQ(fed.prompt_blocks, expected.prompt_blocks);
  EXPECT_EQ(fed.hit_blocks, expected.hit_blocks);
  EXPECT_GT(fed.hit_blocks, 0u);
  EXPECT_EQ(fed.evictions, expected.evictions);
  EXPECT_EQ(fed.preemptions, expected.preemptions);
  EXPECT_DOUBLE_EQ(fed.simulated_ms, expected.simulated_ms);
  EXPECT_EQ(feed.completed_ids.size(), fed.completed);
  EXPECT_EQ(feed.rejected_ids, std::vector<std::size_t>{10});
  EXPECT_EQ(feed.hit_tokens_sum, fed.hit_tokens);
  EXPECT_EQ(feed.hit_blocks_sum, fed.hit_blocks);
  EXPECT_GT(feed.waits, 0u);  // idle between arrivals

  // A feed that hands nothing over: an empty run.
  ListFeed none(requests, {});
  options.feed = &none;
  const ReplayResult empty = run_replay(requests, options, *backend);
  EXPECT_EQ(empty.requests, 0u);
  EXPECT_EQ(empty.steps, 0u);
  EXPECT_TRUE(empty.ok());

  // A feed that hands a request over twice, or one out of range: refused.
  ListFeed twice(requests, {2, 2});
  options.feed = &twice;
  EXPECT_THROW((void)run_replay(requests, options, *backend), InvalidArgument);
  ListFeed outside(requests, {0, 1000});
  options.feed = &outside;
  EXPECT_THROW((void)run_replay(requests, options, *backend), InvalidArgument);
}

// Requests cycling over `ids` distinct 4-block prefixes (64-token ids, 16-token
// blocks), one at a time: an LRU device cache smaller than the cycle hits
// nothing; a host tier that holds the cycle hits every prefix after the first
// round.
std::vector<TraceRequest> cycling_requests(std::size_t count, std::uint64_t ids) {
  std::vector<TraceRequest> requests;
  for (std::size_t i = 0; i < count; ++i) {
    TraceRequest r;
    r.timestamp_ms = static_cast<double>(i * 100);
    r.input_length = 64 + 10;
    r.output_length = 3;
    r.hash_ids = {i % ids};
    r.line = i + 1;
    requests.push_back(r);
  }
  return requests;
}

ReplayOptions cycling_options(std::size_t device, std::size_t host) {
  ReplayOptions options;
  options.capacity_blocks = device;
  options.trace_block_tokens = 64;
  options.host_tier_blocks = host;
  options.check_every = 1;
  return options;
}

// Rebuilds each medium's cached set from a replay's events: what the prefix
// cache and the tier announce must be what they hold.
class SetSink final : public CacheEventSink {
 public:
  void stored(const EventSource& s, const BlockStoredView& b) noexcept override {
    for (const BlockHash& h : b.hashes)
      sets[static_cast<int>(s.medium)].insert(h.low);
    tokens_seen += b.tokens.size();
  }
  void removed(const EventSource& s, std::span<const BlockHash> hashes) noexcept override {
    for (const BlockHash& h : hashes)
      if (sets[static_cast<int>(s.medium)].erase(h.low) == 0) ++unknown_removals;
  }
  void cleared(const EventSource& s) noexcept override {
    // The end of the run: what each medium held just before.
    at_clear[static_cast<int>(s.medium)] = sets[static_cast<int>(s.medium)].size();
    sets[static_cast<int>(s.medium)].clear();
    ++clears;
  }
  std::set<std::uint64_t> sets[3];
  std::size_t at_clear[3] = {0, 0, 0};
  std::size_t unknown_removals = 0;
  std::size_t tokens_seen = 0;
  std::size_t clears = 0;
};

TEST(sim_replay, EventsDescribeWhatTheCacheAndTheTierHold) {
  const std::vector<TraceRequest> requests = cycling_requests(200, 40);
  const auto backend = make_host_backend();
  ReplayOptions options = cycling_options(32, 64);
  const ReplayResult without = run_replay(requests, options, *backend);
  SetSink sink;
  options.event_sink = &sink;
  const ReplayResult r = run_replay(requests, options, *backend);
  ASSERT_TRUE(r.ok()) << r.invariants.to_string();
  // Events change nothing the replay does.
  EXPECT_EQ(r.hit_blocks, without.hit_blocks);
  EXPECT_EQ(r.host_hit_blocks, without.host_hit_blocks);
  EXPECT_EQ(sink.clears, 2u);  // the tier's, then the prefix cache's
  EXPECT_EQ(sink.unknown_removals, 0u);
  EXPECT_EQ(sink.at_clear[static_cast<int>(Medium::gpu)], r.cached_blocks_at_end);
  EXPECT_EQ(sink.at_clear[static_cast<int>(Medium::cpu)], r.host_blocks_at_end);
  EXPECT_GT(r.host_blocks_at_end, 0u);
  EXPECT_GT(sink.tokens_seen, 0u);  // stored blocks carry their tokens
}

// The step hook sees the replay's caches between two steps: a consumer that
// lost its set mid-run (as a publisher that dropped events) rebuilds it there
// from their snapshots, and ends with exactly what they hold.
TEST(sim_replay, StepHookSeesTheCachesAndASetRebuiltThereStaysExact) {
  const std::vector<TraceRequest> requests = cycling_requests(200, 40);
  const auto backend = make_host_backend();
  ReplayOptions options = cycling_options(32, 64);
  SetSink sink;
  options.event_sink = &sink;
  std::size_t steps = 0, rebuilt = 0, without_caches = 0;
  options.on_step = [&](const ReplayProgress& p) {
    ++steps;
    if (p.prefix == nullptr || p.tier == nullptr) {
      ++without_caches;
      return;
    }
    if (steps % 50 == 7) {  // everything forgotten, as after a drop, and rebuilt
      for (auto& set : sink.sets)
        set.clear();
      p.prefix->snapshot(sink);
      p.tier->snapshot(sink);
      ++rebuilt;
    }
  };
  const ReplayResult r = run_replay(requests, options, *backend);
  ASSERT_TRUE(r.ok()) << r.invariants.to_string();
  EXPECT_EQ(without_caches, 0u);
  EXPECT_GT(rebuilt, 1u);
  EXPECT_EQ(sink.unknown_removals, 0u);
  EXPECT_EQ(sink.at_clear[static_cast<int>(Medium::gpu)], r.cached_blocks_at_end);
  EXPECT_EQ(sink.at_clear[static_cast<int>(Medium::cpu)], r.host_blocks_at_end);
  EXPECT_GT(r.host_blocks_at_end, 0u);
}

TEST(sim_replay, HostTierHitsWhatTheDeviceEvicted) {
  const std::vector<TraceRequest> requests = cycling_requests(200, 40);
  const auto backend = make_host_backend();
  const ReplayResult device_only = run_replay(requests, cycling_options(32, 0), *backend);
  ASSERT_TRUE(device_only.ok()) << device_only.invariants.to_string();
  EXPECT_EQ(device_only.host_hit_blocks, 0u);
  EXPECT_EQ(device_only.device_hit_blocks, device_only.hit_blocks);
  EXPECT_EQ(device_only.offloaded_blocks(), 0u);
  EXPECT_EQ(device_only.modeled_transfer_s(), 0.0);

  for (const TierPolicy policy : {TierPolicy::write_back, TierPolicy::write_through}) {
    for (const TierInclusion inclusion : {TierInclusion::exclusive, TierInclusion::inclusive}) {
      SCOPED_TRACE(std::string(to_string(policy)) + " " + to_string(inclusion));
      ReplayOptions options = cycling_options(32, 256);
      options.tier_policy = policy;
      options.tier_inclusion = inclusion;
      const ReplayResult r = run_replay(requests, options, *backend);
      ASSERT_TRUE(r.ok()) << r.invariants.to_string();
      EXPECT_EQ(r.completed, 200u);
      EXPECT_EQ(r.prompt_blocks, 200u * 4u);
      EXPECT_GT(r.host_hit_blocks, 0u);
      EXPECT_EQ(r.device_hit_blocks + r.host_hit_blocks, r.hit_blocks);
      EXPECT_GE(r.hit_blocks, device_only.hit_blocks);
      // Every prefix after the first round: the host holds all 160 blocks.
      EXPECT_EQ(r.hit_blocks, 160u * 4u);
      EXPECT_EQ(r.host_tier_blocks, 256u);
      EXPECT_EQ(r.tier.host_hits, r.tier.onloads);
      EXPECT_GE(r.onloaded_blocks(), r.host_hit_blocks);
      EXPECT_GT(r.offloaded_blocks(), 0u);
      // The modeled bytes: llama-3-8b, bf16, 16 tokens a block = 2 MiB.
      EXPECT_EQ(r.model_block_bytes, std::size_t{2} << 20);
      EXPECT_DOUBLE_EQ(r.modeled_onload_bytes(),
                       static_cast<double>(r.onloaded_blocks()) * (2 << 20));
      EXPECT_DOUBLE_EQ(r.modeled_transfer_s(),
                       (r.modeled_offload_bytes() + r.modeled_onload_bytes()) / 50e9);
      EXPECT_EQ(r.tier.aborted_transfers, 0u);
      if (policy == TierPolicy::write_through) {
        EXPECT_GT(r.tier.already_on_host, 0u);
      }
    }
  }
}

TEST(sim_replay, HostTierOptionsAreValidatedByFlag) {
  const std::vector<TraceRequest> requests = cycling_requests(4, 2);
  const auto backend = make_host_backend();
  auto expect_invalid = [&](const ReplayOptions& options, const std::string& message) {
    try {
      (void)run_replay(requests, options, *backend);
      ADD_FAILURE() << "no error; expected " << message;
    } catch (const InvalidArgument& e) {
      EXPECT_THAT(e.what(), HasSubstr(message));
    }
  };
  ReplayOptions options = cycling_options(32, ReplayOptions::kMaxHostTierBlocks + 1);
  expect_invalid(options, "--host-tier-blocks: must be in [0, 4294967294]");
  options.host_tier_blocks = ReplayOptions::kMaxHostTierBlocks;  // 4 G blocks: 300+ GiB to simulate
  if (static_cast<double>(::sysconf(_SC_PHYS_PAGES)) *
          static_cast<double>(::sysconf(_SC_PAGE_SIZE)) <
      static_cast<double>(options.host_tier_blocks) * 144.0) {
    expect_invalid(options, "more than this machine has");
  }
  options.host_tier_blocks = 8;
  options.host_link_gbps = 0.0;
  expect_invalid(options, "--host-link-gbps: must be a positive number");
  options.host_link_gbps = std::numeric_limits<double>::infinity();
  expect_invalid(options, "--host-link-gbps");
  options.host_link_gbps = 64.0;
  options.model = "no-such-model";
  expect_invalid(options, "--model: unknown model 'no-such-model' (known: deepseek-v3");
  // A hybrid model has no one block shape to model the transfers on.
  options.model = "gpt-oss-120b";
  expect_invalid(options, "model preset 'gpt-oss-120b' is a hybrid model");
  options.model = "qwen2.5-0.5b";
  const ReplayResult r = run_replay(requests, options, *backend);
  EXPECT_TRUE(r.ok()) << r.invariants.to_string();
  EXPECT_EQ(r.model_block_bytes, 24u * 2u * 64u * 2u * 2u * 16u);  // layers, heads, dim, K+V, bf16
  EXPECT_EQ(r.host_link_gbps, 64.0);
}

}  // namespace
}  // namespace kvport::sim
