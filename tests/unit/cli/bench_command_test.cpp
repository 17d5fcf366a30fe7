// SPDX-License-Identifier: Apache-2.0
// `kvport bench`: the zeroing comparison on the host backend, shrunk with
// --batches / --repetitions so that it runs in well under a second.
#include <cstdint>
#include <set>
#include <string>
#include <vector>

#include "cli_test_util.hpp"

namespace kvport::cli::testing {
namespace {

using ::testing::HasSubstr;

// Layers of the bench's model shapes (kvport::sim::zeroing_shapes()).
std::uint64_t layers_of(const std::string& model) {
  if (model == "llama-3-8b" || model == "llama-3-8b-mixed") return 32;
  if (model == "llama-3-70b") return 80;
  ADD_FAILURE() << "unexpected model " << model;
  return 0;
}

TEST(cli_bench, QuickJsonOnHostReportsEveryCaseWithItsCallsAndRatios) {
  // --quick's models, layouts and id patterns, with small batches.
  const CliResult r = run_cli({"bench", "--backend", "host", "--quick", "--json", "--batches",
                               "4,1", "--repetitions", "1"});
  ASSERT_EQ(r.code, kExitOk) << r.err << r.out;
  EXPECT_EQ(r.err, "");
  const nlohmann::json j = r.json();
  ASSERT_TRUE(j.is_array());
  // 2 models x 2 layouts x 2 batches x 2 id patterns.
  ASSERT_EQ(j.size(), 16u);

  std::set<std::string> models, layouts, ids;
  std::set<std::uint64_t> batches;
  for (const nlohmann::json& c : j) {
    SCOPED_TRACE(c.dump());
    for (const char* field :
         {"model", "layout", "batch", "ids", "bytes", "num_blocks", "reference", "batched", "limit",
          "batched_over_limit", "batched_over_reference", "block_ids"}) {
      ASSERT_TRUE(c.contains(field)) << field;
    }
    for (const char* strategy : {"reference", "batched", "limit"}) {
      ASSERT_TRUE(c[strategy].contains("bytes_per_s")) << strategy;
      ASSERT_TRUE(c[strategy].contains("calls")) << strategy;
      EXPECT_GT(c[strategy]["bytes_per_s"].get<double>(), 0.0) << strategy;
    }
    const std::string model = c["model"].get<std::string>();
    const auto batch = c["batch"].get<std::uint64_t>();
    models.insert(model);
    layouts.insert(c["layout"].get<std::string>());
    ids.insert(c["ids"].get<std::string>());
    batches.insert(batch);
    EXPECT_EQ(c["backend"], "host");

    // The ids zeroed, for a peer to zero the same ones (benchmarks/peer): the
    // cache holds 2 x the largest batch; contiguous ids are 0..batch-1,
    // scattered ones every other block, each once.
    EXPECT_EQ(c["num_blocks"].get<std::uint64_t>(), 8u);
    const auto block_ids = c["block_ids"].get<std::vector<std::uint64_t>>();
    ASSERT_EQ(block_ids.size(), batch);
    const std::set<std::uint64_t> distinct(block_ids.begin(), block_ids.end());
    EXPECT_EQ(distinct.size(), batch);
    for (std::uint64_t i = 0; i < batch; ++i) {
      if (c["ids"] == "contiguous") {
        EXPECT_EQ(block_ids[i], i);
      } else {
        EXPECT_TRUE(distinct.contains(2 * i)) << 2 * i;
      }
    }

    // llama-3 blocks: layers x 2 (K + V) x 16 tokens x 8 heads x 128 x 2 bytes.
    EXPECT_EQ(c["bytes"].get<std::uint64_t>(), batch * layers_of(model) * 2 * 16 * 8 * 128 * 2);
    // (b) and (c): one backend call per batch; (a): 2 x layers x blocks.
    EXPECT_EQ(c["batched"]["calls"].get<std::uint64_t>(), 1u);
    EXPECT_EQ(c["limit"]["calls"].get<std::uint64_t>(), 1u);
    EXPECT_EQ(c["reference"]["calls"].get<std::uint64_t>(), 2 * layers_of(model) * batch);

    const double reference = c["reference"]["bytes_per_s"].get<double>();
    const double batched = c["batched"]["bytes_per_s"].get<double>();
    const double limit = c["limit"]["bytes_per_s"].get<double>();
    EXPECT_GT(c["batched_over_limit"].get<double>(), 0.0);
    EXPECT_GT(c["batched_over_reference"].get<double>(), 0.0);
    EXPECT_DOUBLE_EQ(c["batched_over_limit"].get<double>(), batched / limit);
    EXPECT_DOUBLE_EQ(c["batched_over_reference"].get<double>(), batched / reference);
  }
  EXPECT_EQ(models, (std::set<std::string>{"llama-3-8b", "llama-3-70b"}));
  EXPECT_EQ(layouts, (std::set<std::string>{"layer_major", "block_major"}));
  EXPECT_EQ(ids, (std::set<std::string>{"contiguous", "scattered"}));
  EXPECT_EQ(batches, (std::set<std::uint64_t>{1, 4}));
}

TEST(cli_bench, TextTableHasOneRowPerCaseAndTheCallCheck) {
  const CliResult r = run_cli({"bench", "--backend", "host", "--model", "LLAMA-3-8B-mixed",
                               "--layout", "block-major", "--batches", "2", "--repetitions", "1"});
  ASSERT_EQ(r.code, kExitOk) << r.err << r.out;
  EXPECT_EQ(r.err, "");
  EXPECT_THAT(r.out, HasSubstr("kvport bench: block zeroing on the host backend (subset: 2 cases, "
                               "1 repetition each)"));
  EXPECT_THAT(r.out, ::testing::ContainsRegex(
                         "llama-3-8b-mixed +block_major +contiguous +2 .* 128 +1 +1 .*x\n"));
  EXPECT_THAT(r.out, ::testing::ContainsRegex(
                         "llama-3-8b-mixed +block_major +scattered +2 .* 128 +1 +1 .*x\n"));
  EXPECT_THAT(r.out, HasSubstr("Calls    ok: (b) and (c) 1 backend call per batch"));
  EXPECT_THAT(r.out, HasSubstr("Time     2 cases in "));
}

TEST(cli_bench, UnknownBackendIsBadInput) {
  expect_bad_input(run_cli({"bench", "--backend", "tpu", "--quick"}), "unknown backend 'tpu'");
}

TEST(cli_bench, BadSelectionIsBadInput) {
  expect_bad_input(run_cli({"bench", "--model", "gpt-5"}),
                   "--model: unknown bench model 'gpt-5' (known: llama-3-8b, llama-3-70b, "
                   "llama-3-8b-mixed)");
  expect_bad_input(run_cli({"bench", "--batches", "1,0"}),
                   "--batches: expected a positive integer, got '0'");
  expect_bad_input(run_cli({"bench", "--batches", "16,"}),
                   "--batches: expected a positive integer");
  expect_bad_input(run_cli({"bench", "--batches", "99999999999"}),
                   "--batches: at most 1048576 blocks, got '99999999999'");
  expect_bad_input(run_cli({"bench", "--layout", "diagonal"}), "--layout");
  expect_bad_input(run_cli({"bench", "--repetitions", "-1"}),
                   "--repetitions: expected a positive integer, got '-1'");
  expect_bad_input(run_cli({"bench", "--quick", "--bogus"}), "--bogus");
}

}  // namespace
}  // namespace kvport::cli::testing
