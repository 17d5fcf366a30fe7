// SPDX-License-Identifier: Apache-2.0
// `kvport demo`: the simulated serving loop on the host backend.
#include "cli_test_util.hpp"

namespace kvport::cli::testing {
namespace {

using ::testing::HasSubstr;

// 64 MiB of llama-3-8b bf16 = 32 blocks of 2 MiB: small enough that 40
// requests exhaust it and force preemptions.
const std::vector<std::string> kSmallDemo = {"demo",   "--memory", "64MiB",     "--requests", "40",
                                             "--seed", "3",        "--backend", "host"};

std::vector<std::string> with(std::vector<std::string> args,
                              std::initializer_list<std::string> more) {
  args.insert(args.end(), more);
  return args;
}

TEST(cli_demo, JsonReportsAConsistentRun) {
  const CliResult r = run_cli(with(kSmallDemo, {"--json"}));
  ASSERT_EQ(r.code, 0) << r.err << r.out;
  EXPECT_EQ(r.err, "");
  const auto j = r.json();
  EXPECT_EQ(j["model"]["name"], "llama-3-8b");
  EXPECT_EQ(j["backend"], "host");
  EXPECT_EQ(j["num_blocks"], 32u);
  EXPECT_EQ(j["bytes_per_block"], 2097152u);
  EXPECT_EQ(j["requests"], 40u);
  EXPECT_EQ(j["completed"], 40u);
  EXPECT_EQ(j["invariants_ok"], true);
  EXPECT_EQ(j["ok"], true);
  EXPECT_TRUE(j["discrepancies"].empty()) << j["discrepancies"].dump();
  EXPECT_THAT(j["invariants"].get<std::string>(), HasSubstr("ok"));

  // The cache ran out and the scheduler recovered by preempting.
  EXPECT_GT(j["alloc_failures"].get<std::uint64_t>(), 0u);
  EXPECT_GT(j["preemptions"].get<std::uint64_t>(), 0u);
  EXPECT_EQ(j["counters"]["exhaustion_events"], j["alloc_failures"]);
  // Shared system prompts were shared.
  EXPECT_GT(j["inc_refs"].get<std::uint64_t>(), 0u);
  EXPECT_GT(j["shared_prompts"].get<std::uint64_t>(), 0u);

  EXPECT_EQ(j["block_ops"].get<std::uint64_t>(), j["allocs"].get<std::uint64_t>() +
                                                     j["inc_refs"].get<std::uint64_t>() +
                                                     j["dec_refs"].get<std::uint64_t>());
  EXPECT_EQ(j["counters"]["allocs"], j["allocs"]);
  EXPECT_EQ(j["counters"]["frees"], j["allocs"]);  // every block came back
  EXPECT_EQ(j["counters"]["ignored_double_frees"], 0u);
  EXPECT_EQ(j["peak_blocks_in_use"], 32u);
  EXPECT_EQ(j["counters"]["peak_blocks_in_use"], 32u);
  // ONE zero_blocks call, hence one backend fill, per batch.
  EXPECT_EQ(j["zero_batches"], j["backend_fill_calls"]);
  EXPECT_GE(j["zeroed_blocks"].get<std::uint64_t>(), j["allocs"].get<std::uint64_t>());
  EXPECT_GT(j["ops_per_s"].get<double>(), 0.0);
}

TEST(cli_demo, SameSeedSameRun) {
  auto strip_timing = [](nlohmann::json j) {
    j.erase("loop_s");
    j.erase("elapsed_s");
    j.erase("ops_per_s");
    return j;
  };
  const CliResult a = run_cli(with(kSmallDemo, {"--json"}));
  const CliResult b = run_cli(with(kSmallDemo, {"--json"}));
  ASSERT_EQ(a.code, 0) << a.err;
  ASSERT_EQ(b.code, 0) << b.err;
  EXPECT_EQ(strip_timing(a.json()), strip_timing(b.json()));

  const CliResult c = run_cli({"demo", "--memory", "64MiB", "--requests", "40", "--seed", "4",
                               "--backend", "host", "--json"});
  ASSERT_EQ(c.code, 0) << c.err;
  EXPECT_NE(strip_timing(a.json()), strip_timing(c.json()));
}

TEST(cli_demo, TextReport) {
  const CliResult r = run_cli(kSmallDemo);
  ASSERT_EQ(r.code, 0) << r.err;
  EXPECT_THAT(r.out, HasSubstr("kvport demo: llama-3-8b (preset) on the host backend"));
  EXPECT_THAT(r.out, HasSubstr("Served          40 of 40 requests"));
  EXPECT_THAT(r.out, HasSubstr("ops/s"));
  EXPECT_THAT(r.out, HasSubstr("Peak usage      32 of 32 blocks (100.0%)"));
  EXPECT_THAT(r.out, HasSubstr("Invariants      ok"));
  EXPECT_THAT(r.out, HasSubstr("Result          OK"));
}

TEST(cli_demo, OtherShapesAndLayouts) {
  for (const char* layout : {"layer_major", "block_major"}) {
    SCOPED_TRACE(layout);
    const CliResult r = run_cli({"demo",
                                 "--model",
                                 "qwen2.5-0.5b",
                                 "--dtype",
                                 "nvfp4",
                                 "--layer-dtypes",
                                 "first:bf16",
                                 "--layout",
                                 layout,
                                 "--memory",
                                 "8MiB",
                                 "--requests",
                                 "60",
                                 "--max-running",
                                 "8",
                                 "--shared-prompts",
                                 "0",
                                 "--backend",
                                 "host",
                                 "--json"});
    ASSERT_EQ(r.code, 0) << r.err;
    const auto j = r.json();
    EXPECT_EQ(j["completed"], 60u);
    EXPECT_EQ(j["shared_prompts"], 0u);
    EXPECT_EQ(j["inc_refs"], 0u);
    EXPECT_EQ(j["ok"], true);
  }
}

TEST(cli_demo, TinyCacheStillCompletes) {
  // One block of 16 tokens: each request is capped to fit it alone.
  const CliResult r =
      run_cli({"demo", "--layers", "1", "--kv-heads", "1", "--head-dim", "16", "--memory", "1KiB",
               "--requests", "20", "--backend", "host", "--json"});
  ASSERT_EQ(r.code, 0) << r.err;
  const auto j = r.json();
  EXPECT_EQ(j["num_blocks"], 1u);
  EXPECT_EQ(j["completed"], 20u);
  EXPECT_EQ(j["ok"], true);
}

TEST(cli_demo, DefaultsRun) {
  const CliResult r = run_cli({"demo", "--backend", "host", "--json"});
  ASSERT_EQ(r.code, 0) << r.err;
  const auto j = r.json();
  EXPECT_EQ(j["model"]["name"], "llama-3-8b");
  EXPECT_EQ(j["memory_bytes"], 512u << 20);
  EXPECT_EQ(j["num_blocks"], 256u);
  EXPECT_EQ(j["requests"], 100u);
  EXPECT_EQ(j["completed"], 100u);
  EXPECT_GT(j["preemptions"].get<std::uint64_t>(), 0u);
  EXPECT_EQ(j["ok"], true);
}

TEST(cli_demo, BackendOutOfMemoryIsAnError) {
  const ScopedEnv env("KVPORT_HOST_MEMORY", "16MiB");
  expect_bad_input(run_cli({"demo", "--memory", "64MiB", "--backend", "host"}), "host");
}

}  // namespace
}  // namespace kvport::cli::testing
