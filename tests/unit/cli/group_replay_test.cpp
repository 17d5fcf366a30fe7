// SPDX-License-Identifier: Apache-2.0
// `kvport replay --memory`: the trace over a model's KV cache groups beside
// the same model as all full attention, and its bad input.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <string>

#include "cli_test_util.hpp"

namespace kvport::cli {
namespace {

using testing::CliResult;
using testing::expect_bad_input;
using ::testing::HasSubstr;
using testing::run_cli;

const std::string kSmallTrace = std::string(KVPORT_TEST_DATA_DIR) + "/mooncake_small.jsonl";
const std::string kConfigs = std::string(KVPORT_TEST_DATA_DIR) + "/hf_configs";

CliResult group_replay(std::initializer_list<std::string> more) {
  std::vector<std::string> args{"replay", "--trace", kSmallTrace};
  args.insert(args.end(), more);
  return run_cli(args);
}

TEST(cli_group_replay, GptOssGroupsBesideAllFull) {
  // 2 GiB of gpt-oss-120b KV: about 1,800 tokens per request of all-full
  // bytes, so the small trace's 2-4k-token requests contend for memory.
  const CliResult r = group_replay({"--memory", "2GiB", "--model", "gpt-oss-120b", "--json"});
  ASSERT_EQ(r.code, 0) << r.err << r.out;
  const nlohmann::json j = r.json();
  EXPECT_EQ(j.at("mode"), "groups");
  EXPECT_EQ(j.at("model"), "gpt-oss-120b");
  const nlohmann::json& g = j.at("groups");
  const nlohmann::json& f = j.at("all_full");
  ASSERT_EQ(g.at("group_usage").size(), 2u);
  ASSERT_EQ(f.at("group_usage").size(), 1u);
  EXPECT_EQ(g.at("group_usage")[0].at("kind"), "sliding_window");
  EXPECT_EQ(g.at("group_usage")[1].at("kind"), "full_attention");
  EXPECT_EQ(g.at("requests"), 200);
  EXPECT_EQ(g.at("completed").get<int>() + g.at("rejected").get<int>(), 200);
  EXPECT_TRUE(g.at("invariants_ok").get<bool>());
  EXPECT_TRUE(f.at("invariants_ok").get<bool>());
  EXPECT_LE(g.at("pool_bytes").get<std::size_t>(), std::size_t{2} << 30);
  // The window group frees its blocks: more requests run at once.
  EXPECT_GT(g.at("peak_running").get<std::size_t>(), f.at("peak_running").get<std::size_t>());
  EXPECT_GT(j.at("concurrency_ratio").get<double>(), 1.0);
  EXPECT_TRUE(j.at("ok").get<bool>());
}

TEST(cli_group_replay, SharedPoolByDefaultSeparatePoolsOnRequest) {
  // gpt-oss's window and full groups have one page size: one pool by
  // default, the planned context reported (the trace's longest request).
  const CliResult shared = group_replay({"--memory", "2GiB", "--model", "gpt-oss-120b", "--json"});
  ASSERT_EQ(shared.code, 0) << shared.err << shared.out;
  const nlohmann::json s = shared.json();
  EXPECT_TRUE(s.at("shared_pool").get<bool>());
  EXPECT_GT(s.at("shared_pool_blocks").get<std::size_t>(), 0u);
  EXPECT_EQ(s.at("max_context_tokens"), 0);  // not given
  EXPECT_GT(s.at("planned_context_tokens").get<std::size_t>(), 8000u);
  // Every group of a shared pool reports the pool's blocks as its own.
  for (const nlohmann::json& g : s.at("groups").at("group_usage"))
    EXPECT_EQ(g.at("num_blocks"), s.at("shared_pool_blocks"));

  const CliResult separate =
      group_replay({"--memory", "2GiB", "--model", "gpt-oss-120b", "--json", "--separate-pools"});
  ASSERT_EQ(separate.code, 0) << separate.err << separate.out;
  const nlohmann::json p = separate.json();
  EXPECT_FALSE(p.at("shared_pool").get<bool>());
  EXPECT_EQ(p.at("shared_pool_blocks"), 0);
  EXPECT_EQ(p.at("planned_context_tokens"), s.at("planned_context_tokens"));
  EXPECT_TRUE(p.at("ok").get<bool>());
  // The same trace and memory: the shared pool hits at least as often.
  EXPECT_GE(s.at("groups").at("hit_tokens").get<std::size_t>(),
            p.at("groups").at("hit_tokens").get<std::size_t>());

  const CliResult text = group_replay({"--memory", "2GiB", "--model", "gpt-oss-120b"});
  ASSERT_EQ(text.code, 0) << text.err;
  EXPECT_THAT(text.out, HasSubstr("the attention groups share one pool of"));
  const CliResult text_separate =
      group_replay({"--memory", "2GiB", "--model", "gpt-oss-120b", "--separate-pools"});
  ASSERT_EQ(text_separate.code, 0) << text_separate.err;
  EXPECT_THAT(text_separate.out, HasSubstr("a pool per group"));
}

// The report's "groups" and "all_full" without their wall time.
nlohmann::json without_timing(nlohmann::json j) {
  for (const char* run : {"groups", "all_full"})
    j.at(run).erase("wall_s");
  return j;
}

TEST(cli_group_replay, EventsArePublishedAndChangeNothingElse) {
  const std::initializer_list<std::string> base = {
      "--memory", "2GiB", "--model", "gpt-oss-120b", "--host-tier-blocks", "20000", "--json"};
  const CliResult plain = group_replay(base);
  std::vector<std::string> args{"replay", "--trace", kSmallTrace};
  args.insert(args.end(), base);
  for (const char* a : {"--events", "tcp://127.0.0.1:0", "--events-replay", "tcp://127.0.0.1:0"})
    args.emplace_back(a);
  const CliResult r = run_cli(args);
  ASSERT_EQ(plain.code, 0) << plain.err;
  ASSERT_EQ(r.code, 0) << r.err << r.out;
  nlohmann::json j = r.json();
  const nlohmann::json events = j.at("events");
  EXPECT_THAT(events.at("endpoint").get<std::string>(), HasSubstr("tcp://127.0.0.1:"));
  EXPECT_NE(events.at("endpoint").get<std::string>(), "tcp://127.0.0.1:0");  // the bound port
  // At least one event per batch, and a cleared per group and medium at the end.
  EXPECT_GE(events.at("accepted").get<std::uint64_t>(),
            events.at("batches_sent").get<std::uint64_t>());
  EXPECT_GE(events.at("accepted").get<std::uint64_t>(), 4u);
  EXPECT_GT(events.at("batches_sent").get<std::uint64_t>(), 0u);
  EXPECT_EQ(events.at("dropped").get<std::uint64_t>(), 0u);
  j.erase("events");
  EXPECT_EQ(without_timing(j), without_timing(plain.json()));
  // The text report says so too.
  args.pop_back();
  args.pop_back();
  args.erase(std::find(args.begin(), args.end(), "--json"));
  const CliResult text = run_cli(args);
  ASSERT_EQ(text.code, 0) << text.err;
  EXPECT_THAT(text.out, HasSubstr("Events        "));
  EXPECT_THAT(text.out, HasSubstr(" published on tcp://127.0.0.1:"));
}

TEST(cli_group_replay, TextReportAndAMambaHybridFromItsConfig) {
  const CliResult r = group_replay(
      {"--memory", "8GiB", "--hf-config", kConfigs + "/nemotron-h-8b.json", "--context", "8192"});
  ASSERT_EQ(r.code, 0) << r.err << r.out;
  EXPECT_THAT(r.out, HasSubstr("KV cache groups:"));
  EXPECT_THAT(r.out, HasSubstr("state("));
  EXPECT_THAT(r.out, HasSubstr("all full attention"));
  EXPECT_THAT(r.out, HasSubstr("Result        OK"));
}

TEST(cli_group_replay, HostTierPerGroupAndPerTier) {
  // gpt-oss with 2 GiB: every group's evicted blocks go to the host.
  const CliResult r = group_replay(
      {"--memory", "2GiB", "--model", "gpt-oss-120b", "--host-tier-blocks", "20000", "--json"});
  ASSERT_EQ(r.code, 0) << r.err << r.out;
  const nlohmann::json j = r.json();
  EXPECT_EQ(j.at("host_tier_blocks"), 20000);
  EXPECT_EQ(j.at("tier_policy"), "write-back");
  EXPECT_EQ(j.at("tier_inclusion"), "exclusive");
  for (const char* run : {"groups", "all_full"}) {
    SCOPED_TRACE(run);
    const nlohmann::json& g = j.at(run);
    EXPECT_TRUE(g.at("invariants_ok").get<bool>());
    // 20,000 blocks of the model: 20,000 x 1,179,648 bytes in either run.
    EXPECT_LE(g.at("host_bytes").get<std::size_t>(), std::size_t{20000} * 1179648);
    EXPECT_GT(g.at("host_bytes").get<std::size_t>(), std::size_t{19990} * 1179648);
    EXPECT_GT(g.at("host_hit_tokens").get<std::size_t>(), 0u);
    EXPECT_LE(g.at("host_hit_tokens").get<std::size_t>(), g.at("hit_tokens").get<std::size_t>());
    for (const nlohmann::json& u : g.at("group_usage")) {
      EXPECT_EQ(u.at("host_slots").get<std::size_t>(), 20000u);  // the same tokens in each
      EXPECT_GT(u.at("tier_counters").at("offloads").get<std::size_t>(), 0u);
      EXPECT_LE(u.at("host_hit_blocks").get<std::size_t>(), u.at("hit_blocks").get<std::size_t>());
    }
  }
  // With the host tier the groups hit more than without it.
  const CliResult bare = group_replay({"--memory", "2GiB", "--model", "gpt-oss-120b", "--json"});
  ASSERT_EQ(bare.code, 0) << bare.err;
  EXPECT_GT(j.at("groups").at("hit_tokens").get<std::size_t>(),
            bare.json().at("groups").at("hit_tokens").get<std::size_t>());
  EXPECT_FALSE(bare.json().at("groups").contains("host_bytes"));

  // The text report names the host columns and rows.
  const CliResult text =
      group_replay({"--memory", "2GiB", "--model", "gpt-oss-120b", "--host-tier-blocks", "20000"});
  ASSERT_EQ(text.code, 0) << text.err;
  EXPECT_THAT(text.out, HasSubstr("host tier: 20000 blocks of the model"));
  EXPECT_THAT(text.out, HasSubstr("from host"));
  EXPECT_THAT(text.out, HasSubstr("hits using the host"));
}

TEST(cli_group_replay, PlainModelIsOneGroup) {
  const CliResult r = group_replay({"--memory", "4GiB", "--model", "llama-3-8b", "--json"});
  ASSERT_EQ(r.code, 0) << r.err;
  const nlohmann::json j = r.json();
  EXPECT_EQ(j.at("groups").at("group_usage").size(), 1u);
  // Nothing to free: the same run both ways.
  EXPECT_EQ(j.at("groups").at("peak_running"), j.at("all_full").at("peak_running"));
  EXPECT_EQ(j.at("groups").at("hit_tokens"), j.at("all_full").at("hit_tokens"));
}

TEST(cli_group_replay, BadInputIsOneLine) {
  expect_bad_input(group_replay({"--memory", "4GiB", "--capacity-blocks", "10"}),
                   "--capacity-blocks: not with --memory");
  expect_bad_input(group_replay({"--memory", "4GiB", "--host-link-gbps", "10"}),
                   "--host-link-gbps: not with --memory");
  expect_bad_input(group_replay({"--memory", "4GiB", "--host-tier-blocks", "0"}),
                   "--host-tier-blocks");
  expect_bad_input(group_replay({"--memory", "4GiB", "--tier-policy", "write-back"}),
                   "--tier-policy: needs --host-tier-blocks");
  expect_bad_input(
      group_replay({"--memory", "4GiB", "--host-tier-blocks", "10", "--tier-inclusion", "some"}),
      "--tier-inclusion: unknown mode 'some'");
  expect_bad_input(group_replay({"--memory", "4GiB", "--model", "gpt-oss-120b",
                                 "--host-tier-blocks", "99999999999999"}),
                   "--host-tier-blocks: ");
  expect_bad_input(group_replay({"--capacity-blocks", "10", "--context", "100"}),
                   "--context: needs --memory");
  expect_bad_input(group_replay({"--memory", "lots"}), "--memory:");
  expect_bad_input(group_replay({"--memory", "0"}), "--memory:");
  expect_bad_input(group_replay({"--memory", "4GiB", "--model", "no-such-model"}),
                   "unknown model preset");
  expect_bad_input(group_replay({"--memory", "4GiB", "--prefill-chunk", "0"}), "--prefill-chunk");
  expect_bad_input(group_replay({"--memory", "1KiB", "--model", "gpt-oss-120b"}),
                   "less than one block");
  expect_bad_input(
      group_replay({"--memory", "4GiB", "--model", "llama-3-8b", "--hf-config", "x.json"}),
      "both give the model");
}

}  // namespace
}  // namespace kvport::cli
