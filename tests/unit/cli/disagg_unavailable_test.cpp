// SPDX-License-Identifier: Apache-2.0
// `kvport disagg` in a build without block transfer: whatever it is given, it
// refuses in one line that says it was not built (exit 2 through run()).
#include <gtest/gtest.h>

#include <CLI/CLI.hpp>
#include <sstream>
#include <string>

#include "cli_test_util.hpp"
#include "command.hpp"
#include "kvport/platform/error.hpp"

namespace kvport::cli {
namespace {

TEST(DisaggUnavailable, AnyArgumentsAreTakenAndTheRunSaysItWasNotBuilt) {
  CLI::App app{"test", "disagg"};
  const auto command = make_disagg_unavailable_command();
  command->add_options(app);
  app.parse("--trace t.jsonl --capacity-blocks 8 --kill prefill", false);
  std::ostringstream out, err;
  try {
    (void)command->execute(out, err);
    FAIL() << "execute did not throw";
  } catch (const InvalidArgument& e) {
    const std::string what = e.what();
    EXPECT_EQ(what.rfind("disagg: not built: ", 0), 0u) << what;
    EXPECT_NE(what.find("KVPORT_WITH_TRANSFER"), std::string::npos) << what;
    EXPECT_EQ(what.find('\n'), std::string::npos) << what;
  }
  EXPECT_EQ(out.str(), "");
}

#ifndef KVPORT_HAVE_TRANSFER
TEST(DisaggUnavailable, TheCommandTableHasIt) {
  testing::expect_bad_input(testing::run_cli({"disagg", "--trace", "t.jsonl"}),
                            "disagg: not built");
}
#endif

}  // namespace
}  // namespace kvport::cli
