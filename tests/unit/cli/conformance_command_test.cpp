// SPDX-License-Identifier: Apache-2.0
// `kvport conformance`: runs the real suite binary with a filter and reports
// pass / skip / fail per backend.
#include "cli_test_util.hpp"

namespace kvport::cli::testing {
namespace {

using ::testing::HasSubstr;

const std::string kSuite = KVPORT_CONFORMANCE_BINARY;

TEST(cli_conformance, HostPassesAFilteredRunAndReportsJson) {
  const CliResult r = run_cli(
      {"conformance", "--backend", "host", "--filter", "Memset*", "--suite", kSuite, "--json"});
  ASSERT_EQ(r.code, kExitOk) << r.err << r.out;
  const nlohmann::json j = r.json();
  ASSERT_EQ(j.at("backends").size(), 1u);
  const auto& host = j.at("backends").at(0);
  EXPECT_EQ(host.at("backend"), "host");
  EXPECT_EQ(host.at("passed"), 2);  // MemsetEveryByteValue..., MemsetSizesAndUnalignedOffsets
  EXPECT_EQ(host.at("failed"), 0);
  EXPECT_EQ(host.at("skipped"), 0);
}

TEST(cli_conformance, TextSummaryNamesEveryCompiledBackend) {
  const CliResult r = run_cli(
      {"conformance", "--filter", "ZeroSizeAllocationIsAnInvalidArgument", "--suite", kSuite});
  ASSERT_EQ(r.code, kExitOk) << r.err << r.out;
  EXPECT_THAT(r.out, HasSubstr("Backend"));
  EXPECT_THAT(r.out, ::testing::ContainsRegex("host +1 +0 +0"));
}

TEST(cli_conformance, UnknownBackendIsBadInput) {
  expect_bad_input(run_cli({"conformance", "--backend", "tpu", "--suite", kSuite}),
                   "unknown backend 'tpu' (the suite has: host, ");
}

TEST(cli_conformance, MissingSuiteBinaryIsBadInput) {
  expect_bad_input(run_cli({"conformance", "--suite", "/nonexistent/kvport_conformance"}),
                   "not found");
}

TEST(cli_conformance, FilterMatchingNothingIsBadInput) {
  expect_bad_input(
      run_cli({"conformance", "--backend", "host", "--filter", "NoSuchTest", "--suite", kSuite}),
      "no test matches");
}

}  // namespace
}  // namespace kvport::cli::testing
