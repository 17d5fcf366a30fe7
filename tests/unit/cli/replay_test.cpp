// SPDX-License-Identifier: Apache-2.0
// `kvport replay`: Mooncake trace replay over the prefix cache.
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <set>
#include <sstream>

#include "cli_test_util.hpp"
#include "kvport/platform/error.hpp"
#include "kvport/sim/mooncake_trace.hpp"
#include "kvport/testing/sim_support.hpp"

#ifndef KVPORT_TEST_DATA_DIR
#error "KVPORT_TEST_DATA_DIR must name tests/data"
#endif

namespace kvport::cli::testing {
namespace {

using sim::kMaxTraceLineBytes;

using ::testing::HasSubstr;

const std::string kSmallTrace = std::string(KVPORT_TEST_DATA_DIR) + "/mooncake_small.jsonl";

CliResult replay(const std::string& trace, std::initializer_list<std::string> more) {
  std::vector<std::string> args{"replay", "--trace", trace};
  args.insert(args.end(), more);
  return run_cli(args);
}

using kvport::testing::mooncake_line;
constexpr auto line = &mooncake_line;  // one trace line

nlohmann::json without_timing(nlohmann::json j) {
  for (const char* key : {"wall_s", "requests_per_s", "operations_per_s"})
    j.erase(key);
  return j;
}

std::uint64_t u(const nlohmann::json& j, const char* key) {
  return j.at(key).get<std::uint64_t>();
}

// ---- the report ----------------------------------------------------------------------------

TEST(cli_replay, JsonReportOnTheSmallTraceIsConsistent) {
  const CliResult r = replay(kSmallTrace, {"--capacity-blocks", "4096", "--json"});
  ASSERT_EQ(r.code, 0) << r.err << r.out;
  EXPECT_EQ(r.err, "");
  const auto j = r.json();
  for (
      const char* key :
      {"requests",        "completed",     "rejected",    "prompt_blocks",      "hit_blocks",
       "hit_rate",        "prompt_tokens", "hit_tokens",  "token_hit_rate",     "last_block_copies",
       "prefix_hit_mode", "evictions",     "preemptions", "peak_blocks_in_use", "lookups",
       "allocations",     "releases",      "operations",  "operations_per_s",   "requests_per_s",
       "wall_s",          "simulated_ms",  "steps",       "invariants_ok",      "ok"}) {
    EXPECT_TRUE(j.contains(key)) << key;
  }
  EXPECT_EQ(u(j, "requests"), 200u);
  EXPECT_EQ(u(j, "completed") + u(j, "rejected"), 200u);
  EXPECT_EQ(u(j, "rejected"), 0u);
  EXPECT_EQ(j["block_size"], 16u);
  EXPECT_EQ(j["trace_block_tokens"], 512u);
  EXPECT_EQ(j["concurrency"], 64u);

  // The trace shares document prefixes and conversation histories.
  EXPECT_GT(u(j, "hit_blocks"), 0u);
  EXPECT_LE(u(j, "hit_blocks"), u(j, "prompt_blocks"));
  EXPECT_DOUBLE_EQ(j["hit_rate"].get<double>(), static_cast<double>(u(j, "hit_blocks")) /
                                                    static_cast<double>(u(j, "prompt_blocks")));
  // A fully cached prompt hits one token less than its blocks (the default,
  // compute_last_token): one token per last-block copy.
  EXPECT_EQ(j["prefix_hit_mode"], "compute_last_token");
  EXPECT_EQ(u(j, "hit_tokens"), u(j, "hit_blocks") * 16 - u(j, "last_block_copies"));
  EXPECT_LE(u(j, "prompt_blocks") * 16, u(j, "prompt_tokens"));
  EXPECT_DOUBLE_EQ(
      j["token_hit_rate"].get<double>(),
      static_cast<double>(u(j, "hit_tokens")) / static_cast<double>(u(j, "prompt_tokens")));
  EXPECT_EQ(u(j, "operations"), u(j, "lookups") + u(j, "allocations") + u(j, "releases"));
  EXPECT_GE(u(j, "lookups"), u(j, "completed"));
  EXPECT_GT(u(j, "peak_blocks_in_use"), 0u);
  EXPECT_LE(u(j, "peak_blocks_in_use"), 4096u);
  // Running requests, as the groups' replay reports them: at most
  // --concurrency, the mean over the steps at most the peak.
  EXPECT_GE(u(j, "peak_running"), 1u);
  EXPECT_LE(u(j, "peak_running"), 64u);
  EXPECT_GT(j["mean_running"].get<double>(), 0.0);
  EXPECT_LE(j["mean_running"].get<double>(), j["peak_running"].get<double>());
  EXPECT_GT(j["simulated_ms"].get<double>(), 0.0);
  EXPECT_GT(j["requests_per_s"].get<double>(), 0.0);
  EXPECT_GT(j["operations_per_s"].get<double>(), 0.0);
  // Every prompt token was either found in the cache or prefilled.
  EXPECT_EQ(u(j, "prompt_tokens") - u(j, "hit_tokens") + u(j, "recomputed_tokens"),
            u(j, "prefill_tokens"));
  EXPECT_EQ(j["invariants_ok"], true);
  EXPECT_EQ(j["ok"], true);
  EXPECT_EQ(j["stopped_at_step"], 0u);
}

TEST(cli_replay, EventsArePublishedAndChangeNothingElse) {
  const CliResult plain = replay(kSmallTrace, {"--capacity-blocks", "512", "--json"});
  const CliResult r =
      replay(kSmallTrace, {"--capacity-blocks", "512", "--json", "--events", "tcp://127.0.0.1:0",
                           "--events-replay", "tcp://127.0.0.1:0"});
  ASSERT_EQ(plain.code, 0) << plain.err;
  ASSERT_EQ(r.code, 0) << r.err << r.out;
  nlohmann::json j = r.json();
  const nlohmann::json events = j.at("events");
  EXPECT_THAT(events.at("endpoint").get<std::string>(), HasSubstr("tcp://127.0.0.1:"));
  EXPECT_NE(events.at("endpoint").get<std::string>(), "tcp://127.0.0.1:0");  // the bound port
  // Every registration and eviction, then the clear at the end: at least
  // one stored event per cached block at the end.
  EXPECT_GE(u(events, "accepted"), u(j, "cached_blocks_at_end"));
  EXPECT_GT(u(events, "batches_sent"), 0u);
  EXPECT_EQ(u(events, "dropped"), 0u);
  j.erase("events");
  EXPECT_EQ(without_timing(j), without_timing(plain.json()));
}

TEST(cli_replay, BadEventFlagsAreOneLineAndExit2) {
  for (const auto& args : std::vector<std::vector<std::string>>{
           {"--events", "bogus://x"},
           {"--events", "tcp://127.0.0.1:99999"},
           {"--events-replay", "tcp://127.0.0.1:0"},
           {"--events-replay", "tcp://127.0.0.1:0", "--memory", "10GiB", "--model", "gpt-oss-120b"},
           {"--events", "bogus://x", "--memory", "10GiB", "--model", "gpt-oss-120b"}}) {
    std::vector<std::string> all{"replay", "--trace", kSmallTrace, "--capacity-blocks", "64"};
    if (args.size() > 2) all.erase(all.begin() + 3, all.begin() + 5);  // --memory replaces it
    all.insert(all.end(), args.begin(), args.end());
    const CliResult r = run_cli(all);
    EXPECT_EQ(r.code, 2) << args[0] << " " << args[1] << ": " << r.out;
    EXPECT_THAT(r.err, HasSubstr("--events")) << r.err;
    EXPECT_EQ(std::count(r.err.begin(), r.err.end(), '\n'), 1) << r.err;
    EXPECT_EQ(r.out, "");
  }
}

TEST(cli_replay, SameTraceSameReport) {
  for (const char* capacity : {"4096", "700"}) {
    const CliResult a =
        replay(kSmallTrace, {"--capacity-blocks", capacity, "--concurrency", "8", "--json"});
    const CliResult b =
        replay(kSmallTrace, {"--capacity-blocks", capacity, "--concurrency", "8", "--json"});
    ASSERT_EQ(a.code, 0) << a.err;
    ASSERT_EQ(b.code, 0) << b.err;
    EXPECT_EQ(without_timing(a.json()), without_timing(b.json())) << capacity;
  }
}

TEST(cli_replay, TextReport) {
  const CliResult r = replay(kSmallTrace, {"--capacity-blocks", "4096"});
  ASSERT_EQ(r.code, 0) << r.err;
  EXPECT_EQ(r.err, "");
  EXPECT_THAT(r.out, HasSubstr("kvport replay: 200 requests from " + kSmallTrace));
  EXPECT_THAT(r.out, HasSubstr("block hit rate"));
  EXPECT_THAT(r.out, HasSubstr("evictions"));
  EXPECT_THAT(r.out, HasSubstr("preemptions"));
  EXPECT_THAT(r.out, HasSubstr("running requests"));
  EXPECT_THAT(r.out, HasSubstr("Invariants  ok"));
  EXPECT_THAT(r.out, HasSubstr("Result      OK"));
}

TEST(cli_replay, PeriodicInvariantChecksPass) {
  const CliResult r = replay(kSmallTrace, {"--capacity-blocks", "700", "--check-every", "1",
                                           "--concurrency", "16", "--json"});
  ASSERT_EQ(r.code, 0) << r.err;
  const auto j = r.json();
  EXPECT_EQ(j["invariants_ok"], true);
  EXPECT_GT(u(j, "evictions"), 0u);
}

// ---- the simulation model ------------------------------------------------------------------

TEST(cli_replay, OneAtATimeARepeatedPromptHitsAllItsFullBlocks) {
  // Both arrive at once; with --concurrency 1 the second runs after the first
  // and finds every full block of the same prompt cached.
  const TempFile trace("trace.jsonl", line(0, 1000, 20, "[7, 8]") + line(0, 1000, 20, "[7, 8]"));
  const CliResult r =
      replay(trace.path(), {"--capacity-blocks", "1024", "--concurrency", "1", "--json"});
  ASSERT_EQ(r.code, 0) << r.err;
  const auto j = r.json();
  EXPECT_EQ(u(j, "completed"), 2u);
  EXPECT_EQ(u(j, "prompt_blocks"), 2 * (1000 / 16));
  EXPECT_EQ(u(j, "hit_blocks"), 1000 / 16);
  EXPECT_EQ(u(j, "hit_tokens"), (1000 / 16) * 16);
  EXPECT_EQ(u(j, "evictions"), 0u);
  EXPECT_EQ(u(j, "preemptions"), 0u);
  // One ran after the other: a prefill step and 20 decode steps each; the
  // second is admitted in the step the first finishes in.
  EXPECT_EQ(u(j, "steps"), 41u);
  EXPECT_DOUBLE_EQ(j["simulated_ms"].get<double>(), 410.0);
  EXPECT_EQ(j["peak_blocks_in_use"], (1000 + 20 + 15) / 16);
}

TEST(cli_replay, DifferentIdsShareNothingAndMissingIdsAreUniqueTokens) {
  // Request 2 shares the first trace block (512 tokens = 32 blocks) only.
  // Requests 3 and 4 have one id for 1000 tokens: past it the tokens are
  // their own, so they share 32 blocks too.
  const TempFile trace("trace.jsonl", line(0, 1000, 4, "[1, 2]") + line(100, 1000, 4, "[1, 3]") +
                                          line(200, 1000, 4, "[5]") + line(300, 1000, 4, "[5]"));
  const CliResult r = replay(trace.path(), {"--capacity-blocks", "1024", "--json"});
  ASSERT_EQ(r.code, 0) << r.err;
  const auto j = r.json();
  EXPECT_EQ(u(j, "hit_blocks"), 32u + 32u);
}

TEST(cli_replay, TraceBlockTokensSetsHowManyTokensAnIdCovers) {
  const TempFile trace("trace.jsonl",
                       line(0, 64, 4, "[1, 2, 3, 4]") + line(100, 64, 4, "[1, 2, 9, 9]"));
  const CliResult r =
      replay(trace.path(), {"--capacity-blocks", "64", "--trace-block-tokens", "16", "--json"});
  ASSERT_EQ(r.code, 0) << r.err;
  EXPECT_EQ(u(r.json(), "hit_blocks"), 2u);
}

TEST(cli_replay, EvictsOnlyUnderPressure) {
  const CliResult large = replay(kSmallTrace, {"--capacity-blocks", "100000", "--json"});
  ASSERT_EQ(large.code, 0) << large.err;
  EXPECT_EQ(u(large.json(), "evictions"), 0u);
  EXPECT_EQ(u(large.json(), "preemptions"), 0u);

  const CliResult small = replay(kSmallTrace, {"--capacity-blocks", "1000", "--json"});
  ASSERT_EQ(small.code, 0) << small.err;
  const auto j = small.json();
  EXPECT_GT(u(j, "evictions"), 0u);
  EXPECT_EQ(j["invariants_ok"], true);
  // Evicting loses hits the large cache had.
  EXPECT_LT(u(j, "hit_blocks"), u(large.json(), "hit_blocks"));
}

TEST(cli_replay, PreemptsTheNewestRequestWhenDecodeRunsOutOfBlocks) {
  // Two prompts of 4 blocks fit in 10 blocks; their outputs do not fit side
  // by side (7 blocks each), so the second one admitted is preempted and
  // recomputes later.
  const TempFile trace("trace.jsonl", line(0, 64, 40, "[1]") + line(0, 64, 40, "[2]"));
  const CliResult r = replay(trace.path(), {"--capacity-blocks", "10", "--json"});
  ASSERT_EQ(r.code, 0) << r.err;
  const auto j = r.json();
  EXPECT_EQ(u(j, "completed"), 2u);
  EXPECT_GE(u(j, "preemptions"), 1u);
  EXPECT_GT(u(j, "recomputed_tokens"), 0u);
  EXPECT_EQ(u(j, "generated_tokens"), 80u);
  EXPECT_EQ(u(j, "peak_blocks_in_use"), 10u);
  EXPECT_EQ(j["invariants_ok"], true);
}

TEST(cli_replay, RejectsARequestThatCannotRunAloneInTheCache) {
  // 10 blocks of 16 tokens: 150 + 10 tokens fit, 150 + 20 do not.
  const TempFile trace("trace.jsonl", line(0, 150, 10, "[1]") + line(5, 150, 20, "[2]") +
                                          line(10, 2000, 1, "[3, 4, 5, 6]"));
  const CliResult r = replay(trace.path(), {"--capacity-blocks", "10", "--json"});
  ASSERT_EQ(r.code, 0) << r.err;
  const auto j = r.json();
  EXPECT_EQ(u(j, "requests"), 3u);
  EXPECT_EQ(u(j, "completed"), 1u);
  EXPECT_EQ(u(j, "rejected"), 2u);
  EXPECT_EQ(u(j, "prompt_tokens"), 150u);  // rejected requests are not admitted
}

TEST(cli_replay, ZeroOutputCompletesAtAdmissionAndIdleTimeIsSkipped) {
  const TempFile trace("trace.jsonl", line(0, 32, 0, "[1]") + line(100000, 32, 0, "[1]"));
  const CliResult r = replay(trace.path(), {"--capacity-blocks", "8", "--json"});
  ASSERT_EQ(r.code, 0) << r.err;
  const auto j = r.json();
  EXPECT_EQ(u(j, "completed"), 2u);
  EXPECT_EQ(u(j, "steps"), 2u);
  EXPECT_DOUBLE_EQ(j["simulated_ms"].get<double>(), 100010.0);
  // The second prompt is fully cached: both blocks hit, the last as a copy,
  // and its last token is computed again.
  EXPECT_EQ(u(j, "hit_blocks"), 2u);
  EXPECT_EQ(u(j, "hit_tokens"), 31u);
  EXPECT_EQ(u(j, "last_block_copies"), 1u);
}

TEST(cli_replay, RequestsRunInTimestampOrderStably) {
  // Out of order in the file; --concurrency 1 runs the earliest first, and the
  // two at t=50 in file order: the third line waits one step for the first.
  // (The other way round, the first would wait 3 steps for the third.)
  const TempFile trace("trace.jsonl",
                       line(50, 32, 1, "[2]") + line(0, 32, 1, "[1]") + line(50, 32, 3, "[2]"));
  const CliResult r =
      replay(trace.path(), {"--capacity-blocks", "64", "--concurrency", "1", "--json"});
  ASSERT_EQ(r.code, 0) << r.err;
  const auto j = r.json();
  EXPECT_EQ(u(j, "hit_blocks"), 2u);
  EXPECT_DOUBLE_EQ(j["max_queue_ms"].get<double>(), 10.0);
}

// The second request's prompt is fully cached by the first. By default its
// last token is left to compute (a private copy of the last block); with
// --full-prefix-hits every block is shared and nothing is prefilled.
TEST(cli_replay, FullyCachedPromptHitModes) {
  const TempFile trace("trace.jsonl", line(0, 32, 1, "[1]") + line(100, 32, 1, "[1]"));
  for (const bool full : {false, true}) {
    SCOPED_TRACE(full ? "full" : "default");
    const CliResult r =
        full ? replay(trace.path(), {"--capacity-blocks", "8", "--json", "--full-prefix-hits"})
             : replay(trace.path(), {"--capacity-blocks", "8", "--json"});
    ASSERT_EQ(r.code, 0) << r.err;
    const auto j = r.json();
    EXPECT_EQ(j["prefix_hit_mode"], full ? "full" : "compute_last_token");
    EXPECT_EQ(u(j, "hit_blocks"), 2u);
    EXPECT_EQ(u(j, "hit_tokens"), full ? 32u : 31u);
    EXPECT_EQ(u(j, "last_block_copies"), full ? 0u : 1u);
    EXPECT_EQ(u(j, "prefill_tokens"), full ? 32u : 33u);  // 32 for the first request
    // 3 for the first (2 + a decode block); the second: a decode block (+ the copy).
    EXPECT_EQ(u(j, "allocations"), full ? 4u : 5u);
    EXPECT_EQ(j["invariants_ok"], true);
  }
  const CliResult text = replay(trace.path(), {"--capacity-blocks", "8", "--full-prefix-hits"});
  ASSERT_EQ(text.code, 0) << text.err;
  EXPECT_THAT(text.out, HasSubstr("prefix hits: full"));
}

// Regressions: the last requests all rejected used to end in "requests lost
// (a bug)"; a step that preempted every running request used to be taken
// for a request that can never run.
TEST(cli_replay, AllRejectedAndFullPreemptionRunToTheEnd) {
  const std::string& trace = kSmallTrace;
  const CliResult tiny = replay(trace, {"--capacity-blocks", "8", "--json"});
  ASSERT_EQ(tiny.code, 0) << tiny.err;
  EXPECT_EQ(u(tiny.json(), "rejected"), 200u);
  const CliResult tight = replay(trace, {"--capacity-blocks", "300", "--block-size", "32",
                                         "--concurrency", "8", "--step-ms", "5", "--json"});
  ASSERT_EQ(tight.code, 0) << tight.err;
  const auto j = tight.json();
  EXPECT_EQ(u(j, "completed") + u(j, "rejected"), 200u);
  EXPECT_GT(u(j, "preemptions"), 0u);
  EXPECT_EQ(j["invariants_ok"], true);
}

TEST(cli_replay, BlankLinesCrlfAndExtraFieldsAreAccepted) {
  const TempFile trace("trace.jsonl",
                       "\n" + line(0, 100, 2, "[1]") + "   \r\n" +
                           R"({"timestamp": 1.5, "input_length": 100, "output_length": 2, )"
                           R"("hash_ids": [1], "session": "x", "extra": {"a": [1]}})"
                           "\r\n");
  const CliResult r = replay(trace.path(), {"--capacity-blocks", "64", "--json"});
  ASSERT_EQ(r.code, 0) << r.err;
  EXPECT_EQ(u(r.json(), "requests"), 2u);
  EXPECT_EQ(u(r.json(), "hit_blocks"), 6u);
}

TEST(cli_replay, ProgressBarOnlyWhenAsked) {
  const CliResult quiet = replay(kSmallTrace, {"--capacity-blocks", "4096", "--json"});
  ASSERT_EQ(quiet.code, 0) << quiet.err;
  EXPECT_EQ(quiet.err, "");

  const CliResult forced =
      replay(kSmallTrace, {"--capacity-blocks", "4096", "--json", "--progress"});
  ASSERT_EQ(forced.code, 0) << forced.err;
  EXPECT_THAT(forced.err, HasSubstr("100% 200/200 requests"));
  EXPECT_TRUE(forced.err.ends_with("\n"));
  EXPECT_EQ(without_timing(forced.json()), without_timing(quiet.json()));  // stdout: JSON only

  const CliResult off =
      replay(kSmallTrace, {"--capacity-blocks", "4096", "--json", "--progress", "--no-progress"});
  ASSERT_EQ(off.code, 0) << off.err;
  EXPECT_EQ(off.err, "");

  const CliResult on = replay(kSmallTrace, {"--capacity-blocks", "4096", "--no-progress",
                                            "--progress"});  // the last one wins
  ASSERT_EQ(on.code, 0) << on.err;
  EXPECT_THAT(on.err, HasSubstr("100% 200/200 requests"));
  EXPECT_THAT(on.out, HasSubstr("Result      OK"));
}

// ---- bad input -------------------------------------------------------------------------------

struct BadLine {
  const char* name;
  std::string contents;
  const char* message;
};

TEST(cli_replay, BadLinesNameTheFileAndLine) {
  const std::string good = line(0, 100, 5, "[1]");
  const std::vector<BadLine> cases = {
      {"malformed",
       good + R"({"timestamp": 1, "input_length": )"
              "\n",
       ":2: malformed JSON: "},
      {"not_object", good + "\n" + "[1, 2]\n", ":3: expected a JSON object, got [1,2]"},
      {"missing_timestamp",
       R"({"input_length": 1, "output_length": 1, "hash_ids": []})"
       "\n",
       ":1: missing field 'timestamp'"},
      {"missing_output",
       good + R"({"timestamp": 1, "input_length": 1, "hash_ids": []})"
              "\n",
       ":2: missing field 'output_length'"},
      {"missing_hash_ids",
       R"({"timestamp": 1, "input_length": 1, "output_length": 1})"
       "\n",
       ":1: missing field 'hash_ids'"},
      {"string_length", line(0, 1, 1, "[]").replace(line(0, 1, 1, "[]").find("1,"), 1, "\"1\""),
       ":1: 'input_length' must be a non-negative integer, got \"1\""},
      {"negative_length",
       R"({"timestamp": 0, "input_length": 5, "output_length": -3, "hash_ids": []})"
       "\n",
       ":1: 'output_length' must be a non-negative integer, got -3"},
      {"fractional_length",
       R"({"timestamp": 0, "input_length": 5.5, "output_length": 3, "hash_ids": []})"
       "\n",
       ":1: 'input_length' must be a non-negative integer, got 5.5"},
      {"zero_input", line(0, 0, 3, "[]"), ":1: 'input_length' must be at least 1"},
      {"huge_input", line(0, 99999999999, 3, "[]"),
       ":1: 'input_length' 99999999999 exceeds the limit of 16777216 tokens per request"},
      {"huge_total", line(0, 16777216, 1, "[]"),
       ":1: input_length + output_length = 16777217 exceeds the limit"},
      {"beyond_u64",
       R"({"timestamp": 0, "input_length": 99999999999999999999999, "output_length": 3, "hash_ids": []})"
       "\n",
       ":1: 'input_length' must be a non-negative integer"},
      {"hash_ids_not_array", line(0, 5, 3, "7"),
       ":1: 'hash_ids' must be an array of non-negative integers, got 7"},
      {"hash_id_negative", good + good + line(0, 5, 3, "[1, -2]"),
       ":3: 'hash_ids'[1] must be a non-negative integer, got -2"},
      {"hash_id_fraction", line(0, 5, 3, "[0.5]"), ":1: 'hash_ids'[0] must be a non-negative"},
      {"hash_id_string", line(0, 5, 3, "[\"a\"]"), ":1: 'hash_ids'[0] must be a non-negative"},
      {"negative_timestamp", line(-1, 5, 3, "[]"), ":1: 'timestamp' must be >= 0, got -1"},
      {"string_timestamp",
       R"({"timestamp": "10", "input_length": 5, "output_length": 3, "hash_ids": []})"
       "\n",
       ":1: 'timestamp' must be a number of milliseconds, got \"10\""},
      {"null_timestamp",
       R"({"timestamp": null, "input_length": 5, "output_length": 3, "hash_ids": []})"
       "\n",
       ":1: 'timestamp' must be a number of milliseconds, got null"},
      {"overflowing_timestamp",
       R"({"timestamp": 1e400, "input_length": 5, "output_length": 3, "hash_ids": []})"
       "\n",
       ":1: malformed JSON: "},
      {"blank_lines_count", good + "\n\n" + "{oops}\n", ":4: malformed JSON"},
      {"long_line", good + good + std::string(kMaxTraceLineBytes + 1, ' ') + "\n",
       ":3: line longer than 1048576 bytes"},
      {"long_last_line", good + std::string(kMaxTraceLineBytes + 1, 'x'),
       ":2: line longer than 1048576 bytes"},
      {"control_bytes", good + "\x1b[31m\n", ":2: malformed JSON"},
      {"long_token", good + R"({"timestamp": ")" + std::string(500000, 'a') + "\x01\"}\n",
       ":2: malformed JSON"},
      {"deep_nesting",
       good + R"({"timestamp": 0, "x": )" + std::string(100000, '[') + std::string(100000, ']') +
           "}\n",
       ":2: JSON nested deeper than 16 levels"},
  };
  for (const BadLine& c : cases) {
    SCOPED_TRACE(c.name);
    const TempFile trace("trace.jsonl", c.contents);
    const CliResult r = replay(trace.path(), {"--capacity-blocks", "64", "--json"});
    expect_bad_input(r, trace.path() + c.message);
    EXPECT_EQ(r.err.find('\x1b'), std::string::npos);  // quoted input cannot drive the terminal
    EXPECT_LT(r.err.size(), 600u);                     // quoted input is cut short
  }
}

TEST(cli_replay, BadFilesAndFlags) {
  const TempFile trace("trace.jsonl", line(0, 100, 5, "[1]"));
  expect_bad_input(replay(trace.dir() + "/missing.jsonl", {"--capacity-blocks", "8"}),
                   "cannot read trace '" + trace.dir() + "/missing.jsonl': no such file");
  expect_bad_input(replay(trace.dir(), {"--capacity-blocks", "8"}), "is a directory");
  {
    const TempFile empty("empty.jsonl", "");
    expect_bad_input(replay(empty.path(), {"--capacity-blocks", "8"}),
                     "trace '" + empty.path() + "': no requests");
  }
  {
    const TempFile blank("blank.jsonl", "\n  \n\t\n");
    expect_bad_input(replay(blank.path(), {"--capacity-blocks", "8"}), "no requests");
  }
  expect_bad_input(run_cli({"replay", "--capacity-blocks", "8"}), "--trace: missing");
  expect_bad_input(run_cli({"replay", "--trace", "", "--capacity-blocks", "8"}),
                   "--trace: empty path");
  expect_bad_input(replay(trace.path(), {}), "--capacity-blocks: missing");
  expect_bad_input(replay(trace.path(), {"--capacity-blocks", "0"}),
                   "--capacity-blocks: expected a positive integer, got '0'");
  expect_bad_input(replay(trace.path(), {"--capacity-blocks", "-3"}), "--capacity-blocks");
  expect_bad_input(replay(trace.path(), {"--capacity-blocks", "99999999999"}),
                   "--capacity-blocks: must be in [1, 4194304], got 99999999999");
  expect_bad_input(replay(trace.path(), {"--capacity-blocks", "8", "--block-size", "0"}),
                   "--block-size: expected a positive integer, got '0'");
  expect_bad_input(replay(trace.path(), {"--capacity-blocks", "8", "--block-size", "100000"}),
                   "--block-size: must be in [1, 65536]");
  expect_bad_input(replay(trace.path(), {"--capacity-blocks", "4194304", "--block-size", "1024"}),
                   "is more than 268435456 tokens of cache");
  expect_bad_input(replay(trace.path(), {"--capacity-blocks", "8", "--trace-block-tokens", "0"}),
                   "--trace-block-tokens: expected a positive integer, got '0'");
  expect_bad_input(replay(trace.path(), {"--capacity-blocks", "8", "--concurrency", "0"}),
                   "--concurrency: expected a positive integer");
  expect_bad_input(replay(trace.path(), {"--capacity-blocks", "8", "--step-ms", "1.5"}),
                   "--step-ms: expected a positive integer");
  expect_bad_input(replay(trace.path(), {"--capacity-blocks", "8", "--check-every", "x"}),
                   "--check-every");
}

// ---- the host tier ----------------------------------------------------------------

// The tier's invariants are checked every 50 steps (and at the end): a check
// walks every host slot, and every 5 steps made this test 80% checks (121 s
// under the asan preset in CI).
TEST(cli_replay, HostTierOnTheSmallTrace) {
  const CliResult device_only =
      replay(kSmallTrace, {"--capacity-blocks", "700", "--concurrency", "16", "--json"});
  ASSERT_EQ(device_only.code, 0) << device_only.err;
  const auto d = device_only.json();
  EXPECT_FALSE(d.contains("host_tier_blocks"));  // the tier's fields only with a tier
  EXPECT_GT(u(d, "evictions"), 0u);

  std::uint64_t write_back_hits = 0;
  for (const char* policy : {"write-back", "write-through"}) {
    for (const char* inclusion : {"exclusive", "inclusive"}) {
      SCOPED_TRACE(std::string(policy) + " " + inclusion);
      const CliResult r =
          replay(kSmallTrace, {"--capacity-blocks", "700", "--concurrency", "16",
                               "--host-tier-blocks", "4096", "--tier-policy", policy,
                               "--tier-inclusion", inclusion, "--check-every", "50", "--json"});
      ASSERT_EQ(r.code, 0) << r.err << r.out;
      EXPECT_EQ(r.err, "");
      const auto j = r.json();
      for (const char* key : {"host_tier_blocks",     "tier_policy",
                              "tier_inclusion",       "model",
                              "model_block_bytes",    "host_link_gbps",
                              "device_hit_blocks",    "host_hit_blocks",
                              "device_hit_rate",      "host_hit_rate",
                              "combined_hit_rate",    "offloaded_blocks",
                              "onloaded_blocks",      "modeled_offload_bytes",
                              "modeled_onload_bytes", "modeled_offload_s",
                              "modeled_onload_s",     "modeled_transfer_s",
                              "modeled_host_bytes",   "host_blocks_at_end",
                              "tier_counters"}) {
        EXPECT_TRUE(j.contains(key)) << key;
      }
      EXPECT_EQ(j["tier_policy"], policy);
      EXPECT_EQ(j["tier_inclusion"], inclusion);
      EXPECT_EQ(j["model"], "llama-3-8b");
      EXPECT_EQ(u(j, "model_block_bytes"), 2u << 20);
      EXPECT_DOUBLE_EQ(j["host_link_gbps"].get<double>(), 50.0);
      EXPECT_EQ(j["invariants_ok"], true);
      EXPECT_EQ(j["ok"], true);
      EXPECT_EQ(u(j, "requests"), 200u);
      EXPECT_EQ(u(j, "prompt_blocks"), u(d, "prompt_blocks"));
      // The host holds what the device evicted: more hits, some of them on the host.
      EXPECT_GT(u(j, "host_hit_blocks"), 0u);
      EXPECT_EQ(u(j, "device_hit_blocks") + u(j, "host_hit_blocks"), u(j, "hit_blocks"));
      EXPECT_GE(u(j, "hit_blocks"), u(d, "hit_blocks"));
      EXPECT_DOUBLE_EQ(j["combined_hit_rate"].get<double>(), j["hit_rate"].get<double>());
      EXPECT_GT(u(j, "offloaded_blocks"), 0u);
      EXPECT_GE(u(j, "onloaded_blocks"), u(j, "host_hit_blocks"));
      EXPECT_DOUBLE_EQ(j["modeled_onload_bytes"].get<double>(),
                       static_cast<double>(u(j, "onloaded_blocks")) * (2 << 20));
      EXPECT_DOUBLE_EQ(
          j["modeled_transfer_s"].get<double>(),
          (j["modeled_offload_bytes"].get<double>() + j["modeled_onload_bytes"].get<double>()) /
              50e9);
      EXPECT_EQ(u(j["tier_counters"], "onloads"), u(j, "onloaded_blocks"));
      EXPECT_EQ(u(j["tier_counters"], "aborted_transfers"), 0u);
      if (std::string(policy) == "write-back" && std::string(inclusion) == "exclusive")
        write_back_hits = u(j, "hit_blocks");
    }
  }
  EXPECT_GT(write_back_hits, u(d, "hit_blocks"));
}

TEST(cli_replay, HostTierSameTraceSameReport) {
  // Copies complete on the host backend's worker threads; the replay waits for
  // them at fixed points, so every policy gives the same run every time.
  for (const char* policy : {"write-back", "write-through"}) {
    for (const char* inclusion : {"exclusive", "inclusive"}) {
      SCOPED_TRACE(std::string(policy) + " " + inclusion);
      std::set<std::string> reports;
      for (int run = 0; run < 2; ++run) {
        const CliResult r =
            replay(kSmallTrace, {"--capacity-blocks", "700", "--host-tier-blocks", "2048",
                                 "--tier-policy", policy, "--tier-inclusion", inclusion, "--json"});
        ASSERT_EQ(r.code, 0) << r.err;
        reports.insert(without_timing(r.json()).dump());
      }
      EXPECT_EQ(reports.size(), 1u);
    }
  }
}

TEST(cli_replay, HostTierTextReport) {
  const CliResult r = replay(kSmallTrace, {"--capacity-blocks", "700", "--concurrency", "16",
                                           "--host-tier-blocks", "4096", "--host-link-gbps", "64"});
  ASSERT_EQ(r.code, 0) << r.err;
  EXPECT_THAT(r.out, HasSubstr("host tier: 4096 blocks, write-back, exclusive; transfers modeled "
                               "for llama-3-8b (2.00 MiB a block"));
  EXPECT_THAT(r.out, HasSubstr("over 64 GB/s\n"));
  for (const char* row : {"block hit rate (combined)", "  device hits", "  host hits", "offloaded",
                          "onloaded", "transfer time", "host evictions"}) {
    EXPECT_THAT(r.out, HasSubstr(row));
  }
  EXPECT_THAT(r.out, HasSubstr("Result      OK"));
  const CliResult d = replay(kSmallTrace, {"--capacity-blocks", "700", "--host-tier-blocks", "8"});
  ASSERT_EQ(d.code, 0) << d.err;
  EXPECT_THAT(d.out,
              HasSubstr("over 50 GB/s (PCIe Gen5 x16 effective; 64 GB/s raw per direction)"));
}

TEST(cli_replay, HostTierBadInput) {
  const TempFile trace("trace.jsonl", line(0, 100, 5, "[1]"));
  auto bad = [&](std::initializer_list<std::string> flags, const std::string& message) {
    std::vector<std::string> args{"replay", "--trace", trace.path(), "--capacity-blocks", "8"};
    args.insert(args.end(), flags);
    SCOPED_TRACE(message);
    expect_bad_input(run_cli(args), message);
  };
  bad({"--host-tier-blocks", "0"}, "--host-tier-blocks: expected a positive integer, got '0'");
  bad({"--host-tier-blocks", "-4"}, "--host-tier-blocks: expected a positive integer");
  bad({"--host-tier-blocks", "4294967295"},
      "--host-tier-blocks: must be in [0, 4294967294] (0: no host tier), got 4294967295");
  // 4 G host blocks take 144 bytes each to simulate: more than a test machine has.
  if (static_cast<double>(::sysconf(_SC_PHYS_PAGES)) *
          static_cast<double>(::sysconf(_SC_PAGE_SIZE)) <
      4294967294.0 * 144.0) {
    bad({"--host-tier-blocks", "4294967294"}, "--host-tier-blocks: 4294967294 host blocks need");
  }
  bad({"--host-tier-blocks", "8", "--tier-policy", "write-around"},
      "--tier-policy: unknown policy 'write-around' (expected write-back or write-through)");
  bad({"--host-tier-blocks", "8", "--tier-inclusion", "both"},
      "--tier-inclusion: unknown mode 'both' (expected exclusive or inclusive)");
  bad({"--host-tier-blocks", "8", "--host-link-gbps", "0"},
      "--host-link-gbps: expected a positive number, e.g. 50, got '0'");
  bad({"--host-tier-blocks", "8", "--host-link-gbps", "fast"}, "--host-link-gbps");
  bad({"--host-tier-blocks", "8", "--host-link-gbps", "inf"}, "--host-link-gbps");
  bad({"--host-tier-blocks", "8", "--model", "gpt-9"}, "--model: unknown model 'gpt-9'");
  bad({"--tier-policy", "write-back"}, "--tier-policy: needs --host-tier-blocks");
  bad({"--host-link-gbps", "64"}, "--host-link-gbps: needs --host-tier-blocks");
}

// ---- the disk tier ---------------------------------------------------------------------

TEST(cli_replay, DiskTierSplitsTheHitsThreeWaysAndARerunStartsWarm) {
  const TempFile holder("unused", "");
  const std::string dir = holder.dir() + "/tier";
  const std::initializer_list<std::string> flags = {"--capacity-blocks",
                                                    "200",
                                                    "--host-tier-blocks",
                                                    "100",
                                                    "--disk-tier-blocks",
                                                    "1000",
                                                    "--disk-dir",
                                                    dir,
                                                    "--json"};
  const CliResult r = replay(kSmallTrace, flags);
  ASSERT_EQ(r.code, 0) << r.err;
  const nlohmann::json j = r.json();
  const nlohmann::json& d = j.at("disk_tier");
  EXPECT_EQ(u(d, "blocks"), 1000u);
  EXPECT_GT(u(d, "hit_blocks"), 0u);
  EXPECT_EQ(u(d, "hit_blocks"), u(j, "lower_hit_blocks"));
  EXPECT_EQ(u(j, "device_hit_blocks") + u(j, "host_hit_blocks") + u(d, "hit_blocks"),
            u(j, "hit_blocks"));
  EXPECT_EQ(u(d, "writes"), u(j.at("tier_counters"), "lower_tier_writes"));
  EXPECT_GE(u(d, "reads"), u(d, "hit_blocks"));
  EXPECT_EQ(u(d, "write_bytes"), 64 * u(d, "writes"));  // the replay's 64-byte blocks
  EXPECT_EQ(u(d, "recovered_at_open"), 0u);
  EXPECT_EQ(u(d, "checksum_failures") + u(d, "read_failures") + u(d, "write_failures"), 0u);
  EXPECT_FALSE(d.at("io").get<std::string>().empty());
  EXPECT_TRUE(j.at("ok").get<bool>());
  // The directory stays: the same run again starts with the blocks it left.
  const CliResult again = replay(kSmallTrace, flags);
  ASSERT_EQ(again.code, 0) << again.err;
  const nlohmann::json j2 = again.json();
  EXPECT_EQ(u(j2.at("disk_tier"), "recovered_at_open"), u(d, "blocks_at_end"));
  EXPECT_GE(u(j2, "hit_blocks"), u(j, "hit_blocks"));
  // The text report names the level and the I/O path.
  const CliResult text = replay(
      kSmallTrace, {"--capacity-blocks", "200", "--host-tier-blocks", "100", "--disk-tier-blocks",
                    "1000", "--disk-dir", dir, "--disk-min-hits", "2", "--disk-io", "sync"});
  ASSERT_EQ(text.code, 0) << text.err;
  EXPECT_THAT(text.out, HasSubstr("disk tier: 1000 blocks in " + dir + ", pread/pwrite"));
  EXPECT_THAT(text.out, HasSubstr("written once hit 2 times"));
  for (const char* row : {"  disk hits", "disk written", "disk read", "not admitted"})
    EXPECT_THAT(text.out, HasSubstr(row));
}

TEST(cli_replay, DiskTierAdmissionWritesFewerBlocks) {
  const TempFile holder("unused", "");
  auto run = [&](const char* sub, const char* min_hits) {
    const CliResult r =
        replay(kSmallTrace,
               {"--capacity-blocks", "200", "--host-tier-blocks", "100", "--disk-tier-blocks",
                "1000", "--disk-dir", holder.dir() + sub, "--disk-min-hits", min_hits, "--json"});
    EXPECT_EQ(r.code, 0) << r.err;
    return r.json().at("disk_tier");
  };
  const nlohmann::json all = run("/a", "0");
  const nlohmann::json hit_once = run("/b", "1");
  EXPECT_LT(u(hit_once, "writes"), u(all, "writes"));
  EXPECT_GT(u(hit_once, "not_admitted"), 0u);
  EXPECT_EQ(u(all, "not_admitted"), 0u);
}

TEST(cli_replay, HostFreeWatermarkMovesTheWritesOutOfTheLookups) {
  const TempFile holder("unused", "");
  auto run = [&](const char* sub, std::vector<std::string> extra) {
    std::vector<std::string> flags{"--capacity-blocks",
                                   "200",
                                   "--host-tier-blocks",
                                   "100",
                                   "--disk-tier-blocks",
                                   "1000",
                                   "--disk-dir",
                                   holder.dir() + sub,
                                   "--json"};
    flags.insert(flags.end(), extra.begin(), extra.end());
    std::vector<std::string> args{"replay", "--trace", kSmallTrace};
    args.insert(args.end(), flags.begin(), flags.end());
    const CliResult r = run_cli(args);
    EXPECT_EQ(r.code, 0) << r.err;
    return r.json();
  };
  const nlohmann::json off = run("/a", {});
  const nlohmann::json on = run("/b", {"--host-free-watermark", "25"});
  const nlohmann::json& c_off = off.at("tier_counters");
  const nlohmann::json& c_on = on.at("tier_counters");
  EXPECT_EQ(u(off.at("disk_tier"), "host_free_watermark"), 0u);
  EXPECT_EQ(u(on.at("disk_tier"), "host_free_watermark"), 25u);
  EXPECT_EQ(u(c_off, "poll_spills"), 0u);
  EXPECT_GT(u(c_off, "lookup_spills"), 0u) << "without it, lookups write before they read";
  EXPECT_GT(u(c_on, "poll_spills"), 0u);
  EXPECT_LT(u(c_on, "lookup_spills"), u(c_off, "lookup_spills"));
  EXPECT_GT(u(on.at("disk_tier"), "hit_blocks"), 0u);
  EXPECT_TRUE(on.at("ok").get<bool>());
}

TEST(cli_replay, DiskTierBadInput) {
  const TempFile trace("trace.jsonl", line(0, 100, 5, "[1]"));
  const std::string dir = trace.dir() + "/tier";
  auto bad = [&](std::initializer_list<std::string> flags, const std::string& message) {
    std::vector<std::string> args{"replay", "--trace", trace.path(), "--capacity-blocks", "8"};
    args.insert(args.end(), flags);
    SCOPED_TRACE(message);
    expect_bad_input(run_cli(args), message);
  };
  bad({"--host-tier-blocks", "8", "--disk-tier-blocks", "0", "--disk-dir", dir},
      "--disk-tier-blocks: expected a positive integer, got '0'");
  bad({"--disk-tier-blocks", "8", "--disk-dir", dir},
      "--disk-tier-blocks: needs --host-tier-blocks (the disk tier is under the host tier)");
  bad({"--host-tier-blocks", "8", "--disk-tier-blocks", "8"},
      "--disk-dir: required with --disk-tier-blocks");
  bad({"--host-tier-blocks", "8", "--disk-dir", dir}, "--disk-dir: needs --disk-tier-blocks");
  bad({"--host-tier-blocks", "8", "--disk-min-hits", "2"},
      "--disk-min-hits: needs --disk-tier-blocks");
  bad({"--host-tier-blocks", "8", "--host-free-watermark", "2"},
      "--host-free-watermark: needs --disk-tier-blocks");
  bad({"--host-tier-blocks", "8", "--disk-tier-blocks", "8", "--disk-dir", dir,
       "--host-free-watermark", "5"},
      "--host-free-watermark: at most half the host tier's blocks (4), got 5");
  bad({"--host-tier-blocks", "8", "--disk-tier-blocks", "8", "--disk-dir", dir, "--disk-io", "aio"},
      "--disk-io: unknown engine 'aio' (expected automatic, io_uring or sync)");
  bad({"--host-tier-blocks", "8", "--disk-tier-blocks", "8", "--disk-dir", dir, "--disk-min-hits",
       "-1"},
      "--disk-min-hits");
  bad({"--host-tier-blocks", "8", "--disk-tier-blocks", "8", "--disk-dir",
       "/proc/kvport-disk-tier"},
      "--disk-dir /proc/kvport-disk-tier: ");
  // A file system without the space: 2^32 - 2 slots of 4 KiB is 16 TiB.
  bad({"--host-tier-blocks", "8", "--disk-tier-blocks", "4294967294", "--disk-dir", dir + "-big"},
      "cannot allocate 4294967294 slots of 4096 bytes");
  // A directory made for another block size (32 tokens: 128-byte blocks).
  const CliResult made =
      run_cli({"replay", "--trace", trace.path(), "--capacity-blocks", "8", "--host-tier-blocks",
               "8", "--disk-tier-blocks", "8", "--disk-dir", dir});
  ASSERT_EQ(made.code, 0) << made.err;
  bad({"--block-size", "32", "--host-tier-blocks", "8", "--disk-tier-blocks", "8", "--disk-dir",
       dir},
      "made for another layout");
  bad({"--host-tier-blocks", "8", "--disk-tier-blocks", "16", "--disk-dir", dir}, "num_slots");
  expect_bad_input(
      run_cli({"replay", "--trace", trace.path(), "--memory", "4GiB", "--host-tier-blocks", "8",
               "--disk-tier-blocks", "8", "--disk-dir", dir}),
      "--disk-tier-blocks: not with --memory yet");
}

// A 100 MB trace is streamed, never read whole: a first line of 100 MB fails
// after the first MiB, and 100 MB of junk after a good line fails at line 2.
TEST(cli_replay, HundredMegabyteFilesFailFast) {
  constexpr std::uintmax_t k100MB = std::uintmax_t{100} << 20;
  {
    const TempFile big("zeros.jsonl", "");
    std::filesystem::resize_file(big.path(), k100MB);  // sparse: 100 MB of NUL bytes
    expect_bad_input(replay(big.path(), {"--capacity-blocks", "64"}),
                     ":1: line longer than 1048576 bytes");
  }
  {
    const TempFile big("junk.jsonl", line(0, 100, 5, "[1]"));
    {
      std::ofstream out(big.path(), std::ios::app | std::ios::binary);
      const std::string chunk(std::size_t{1} << 20, '{');
      for (int i = 0; i < 100; ++i)
        out << chunk;
    }
    ASSERT_GE(std::filesystem::file_size(big.path()), k100MB);
    expect_bad_input(replay(big.path(), {"--capacity-blocks", "64"}),
                     ":2: line longer than 1048576 bytes");
  }
}

}  // namespace
}  // namespace kvport::cli::testing
