// SPDX-License-Identifier: Apache-2.0
// Helpers for running `kvport` in-process and checking its output.
#pragma once

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <unistd.h>
#include <algorithm>
#include <filesystem>
#include <fstream>
#include <initializer_list>
#include <nlohmann/json.hpp>
#include <sstream>
#include <string>
#include <string_view>
#include <vector>

#include "kvport/cli/cli.hpp"
#include "kvport/testing/support.hpp"

namespace kvport::cli::testing {

using kvport::testing::ScopedEnv;

struct CliResult {
  int code = -1;
  std::string out;
  std::string err;

  nlohmann::json json() const { return nlohmann::json::parse(out); }
};

/// Runs `kvport <args...>` in-process.
inline CliResult run_cli(std::vector<std::string> args) {
  std::vector<const char*> argv{"kvport"};
  for (const std::string& arg : args)
    argv.push_back(arg.c_str());
  std::ostringstream out, err;
  CliResult result;
  result.code = run(static_cast<int>(argv.size()), argv.data(), out, err);
  result.out = out.str();
  result.err = err.str();
  return result;
}

/// The contract for bad input: exit code 2, nothing on stdout, exactly one
/// line on stderr that starts with "kvport: error: " and contains `needle`.
inline void expect_bad_input(const CliResult& r, std::string_view needle) {
  EXPECT_EQ(r.code, kExitError) << "stderr: " << r.err;
  EXPECT_EQ(r.out, "");
  EXPECT_TRUE(r.err.starts_with("kvport: error: ")) << r.err;
  EXPECT_EQ(std::count(r.err.begin(), r.err.end(), '\n'), 1) << r.err;
  EXPECT_TRUE(r.err.ends_with("\n")) << r.err;
  EXPECT_THAT(r.err, ::testing::HasSubstr(std::string(needle)));
}

/// A file in a fresh temporary folder of its own, removed with the object.
class TempFile {
 public:
  TempFile(std::string_view name, std::string_view contents) {
    static int counter = 0;
    const auto* info = ::testing::UnitTest::GetInstance()->current_test_info();
    dir_ = std::filesystem::temp_directory_path() /
           (std::string("kvport_cli_") + info->test_suite_name() + "_" + info->name() + "_" +
            std::to_string(::getpid()) + "_" + std::to_string(counter++));
    std::filesystem::create_directories(dir_);
    path_ = dir_ / name;
    std::ofstream(path_, std::ios::binary) << contents;
  }
  ~TempFile() {
    std::error_code ec;
    std::filesystem::remove_all(dir_, ec);
  }
  TempFile(const TempFile&) = delete;
  TempFile& operator=(const TempFile&) = delete;

  std::string path() const { return path_.string(); }
  std::string dir() const { return dir_.string(); }

 private:
  std::filesystem::path dir_;
  std::filesystem::path path_;
};

}  // namespace kvport::cli::testing
