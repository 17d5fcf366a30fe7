// SPDX-License-Identifier: Apache-2.0
// kvport::cli::run: help, exit codes and the one-line error contract for every
// class of bad input.
#include "cli_test_util.hpp"

namespace kvport::cli::testing {
namespace {

using ::testing::HasSubstr;

TEST(cli_help, TopLevelHelpListsTheSubcommands) {
  for (const char* flag : {"--help", "-h"}) {
    const CliResult r = run_cli({flag});
    EXPECT_EQ(r.code, 0);
    EXPECT_EQ(r.err, "");
    EXPECT_THAT(r.out, HasSubstr("plan"));
    EXPECT_THAT(r.out, HasSubstr("demo"));
  }
}

TEST(cli_help, SubcommandHelpShowsItsOptions) {
  const CliResult plan = run_cli({"plan", "--help"});
  EXPECT_EQ(plan.code, 0);
  EXPECT_THAT(plan.out, HasSubstr("--layer-dtypes"));
  EXPECT_THAT(plan.out, HasSubstr("--hf-config"));
  EXPECT_THAT(plan.out, HasSubstr("--memory"));

  const CliResult demo = run_cli({"demo", "--help"});
  EXPECT_EQ(demo.code, 0);
  EXPECT_THAT(demo.out, HasSubstr("--requests"));
  EXPECT_THAT(demo.out, HasSubstr("--seed"));
}

TEST(cli_help, Version) {
  const CliResult r = run_cli({"--version"});
  EXPECT_EQ(r.code, 0);
  EXPECT_THAT(r.out, HasSubstr("kvport "));
}

TEST(cli_bad_input, MissingOrUnknownSubcommand) {
  expect_bad_input(run_cli({}), "missing subcommand");
  expect_bad_input(run_cli({"frobnicate"}), "frobnicate");
}

TEST(cli_bad_input, UnknownFlagsAndMissingValues) {
  expect_bad_input(run_cli({"plan", "--model", "llama-3-8b", "--bogus"}), "--bogus");
  expect_bad_input(run_cli({"demo", "--frobnicate=3"}), "--frobnicate");
  expect_bad_input(run_cli({"plan", "--model"}), "--model");
  expect_bad_input(run_cli({"plan", "--model", "llama-3-8b", "extra"}), "extra");
  expect_bad_input(run_cli({"--log-level", "loud", "plan"}), "loud");
}

TEST(cli_bad_input, BadMemorySizes) {
  const std::vector<std::pair<std::string, std::string>> cases = {
      {"-5GiB", "negative"},           {"0", "must be > 0"},
      {"0GiB", "must be > 0"},         {"lots", "lots"},
      {"12XB", "unknown unit"},        {"", "empty"},
      {"99999999999TiB", "too large"}, {"18446744073709551616", "too large"},
  };
  for (const auto& [memory, needle] : cases) {
    SCOPED_TRACE(memory);
    const CliResult r = run_cli({"plan", "--model", "llama-3-8b", "--memory", memory});
    expect_bad_input(r, "--memory");
    EXPECT_THAT(r.err, HasSubstr(needle));
  }
  expect_bad_input(run_cli({"plan", "--model", "llama-3-8b", "--memory", "1MiB"}),
                   "smaller than one block");
}

TEST(cli_bad_input, BadCounts) {
  const std::vector<std::pair<std::string, std::string>> cases = {
      {"-1", "expected a positive integer"},
      {"0", "expected a positive integer"},
      {"abc", "expected a positive integer, got 'abc'"},
      {"3.5", "expected a positive integer"},
      {"12abc", "expected a positive integer"},
      {"99999999999999999999999", "too large"},
  };
  for (const auto& [value, needle] : cases) {
    SCOPED_TRACE(value);
    for (const char* flag : {"--layers", "--kv-heads", "--head-dim", "--block-size"}) {
      const CliResult r =
          run_cli({"plan", "--model", "llama-3-8b", "--memory", "1GiB", flag, value});
      expect_bad_input(r, flag);
      EXPECT_THAT(r.err, HasSubstr(needle));
    }
    expect_bad_input(run_cli({"demo", "--requests", value}), "--requests");
    expect_bad_input(run_cli({"demo", "--max-running", value}), "--max-running");
  }
  expect_bad_input(run_cli({"demo", "--seed", "-1"}), "--seed");
}

TEST(cli_bad_input, OverflowingModelShape) {
  // Each number fits, the bytes of one block do not.
  const CliResult r = run_cli({"plan", "--layers", "4000000000", "--kv-heads", "4000000000",
                               "--head-dim", "4000000000", "--memory", "1GiB"});
  expect_bad_input(r, "overflow");
}

TEST(cli_bad_input, UnknownNames) {
  expect_bad_input(run_cli({"plan", "--model", "gpt-5", "--memory", "1GiB"}),
                   "unknown model preset 'gpt-5' (known: ");
  expect_bad_input(run_cli({"plan", "--model", "llama-3-8b", "--dtype", "fp7", "--memory", "1GiB"}),
                   "--dtype: unknown dtype 'fp7'");
  expect_bad_input(run_cli({"plan", "--model", "llama-3-8b", "--backend", "tpu"}),
                   "unknown backend 'tpu'");
  expect_bad_input(run_cli({"demo", "--backend", "tpu"}), "unknown backend 'tpu'");
  expect_bad_input(run_cli({"plan", "--model", "llama-3-8b", "--layout", "diagonal"}),
                   "--layout: unknown layout 'diagonal'");
  expect_bad_input(run_cli({"demo", "--dtype", "int3"}), "unknown dtype 'int3'");
}

TEST(cli_bad_input, BadLayerDtypes) {
  const std::vector<std::pair<std::string, std::string>> cases = {
      {"0:fp7", "unknown dtype 'fp7'"},
      {"32:bf16", "layer 32 in '32:bf16' is out of range (the model has 32 layers)"},
      {"bf16,bf16", "one dtype per layer (32), got 2"},
      {"0:bf16,f16", "has no ':'"},
      {"5-2:bf16", "reversed"},
      {"x:bf16", "bad layer 'x'"},
      {":bf16", "expected LAYERS:DTYPE"},
      {"", "empty"},
  };
  for (const auto& [spec, needle] : cases) {
    SCOPED_TRACE(spec);
    const CliResult r =
        run_cli({"plan", "--model", "llama-3-8b", "--memory", "1GiB", "--layer-dtypes", spec});
    expect_bad_input(r, "--layer-dtypes");
    EXPECT_THAT(r.err, HasSubstr(needle));
  }
}

TEST(cli_bad_input, DtypeThatDoesNotDivideTheHeadDim) {
  // nvfp4 packs scale groups of 16 elements.
  expect_bad_input(run_cli({"plan", "--layers", "2", "--kv-heads", "1", "--head-dim", "8",
                            "--dtype", "nvfp4", "--memory", "1GiB"}),
                   "head_dim");
}

TEST(cli_bad_input, BadUtilization) {
  for (const char* value : {"0", "1.5", "-0.5", "abc", "nan", "0.9x"}) {
    SCOPED_TRACE(value);
    expect_bad_input(
        run_cli({"plan", "--model", "llama-3-8b", "--backend", "host", "--utilization", value}),
        "--utilization: expected a fraction in (0, 1]");
  }
}

TEST(cli_bad_input, ConflictingModelInfo) {
  const TempFile config("config.json", R"({"num_hidden_layers": 2, "num_attention_heads": 2,
                                            "head_dim": 64})");
  expect_bad_input(
      run_cli({"plan", "--model", "llama-3-8b", "--hf-config", config.path(), "--memory", "1GiB"}),
      "--model and --hf-config");
  expect_bad_input(run_cli({"plan", "--model", "llama-3-8b", "--head-dim", "64", "--head-dim-k",
                            "128", "--memory", "1GiB"}),
                   "--head-dim");
  expect_bad_input(
      run_cli({"plan", "--model", "llama-3-8b", "--memory", "1GiB", "--utilization", "0.5"}),
      "--utilization applies to --memory device only");
}

TEST(cli_bad_input, MissingModelInfo) {
  expect_bad_input(run_cli({"plan", "--memory", "1GiB"}), "no model given");
  expect_bad_input(run_cli({"plan", "--layers", "4", "--memory", "1GiB"}),
                   "missing KV heads (--kv-heads), head dim (--head-dim)");
  expect_bad_input(run_cli({"plan", "--layers", "4", "--kv-heads", "2", "--head-dim-k", "64",
                            "--memory", "1GiB"}),
                   "missing V head dim (--head-dim-v)");
  const TempFile config("config.json", R"({"num_attention_heads": 8, "hidden_size": 512})");
  expect_bad_input(run_cli({"plan", "--hf-config", config.path(), "--memory", "1GiB"}),
                   "missing number of layers (--layers)");
}

TEST(cli_bad_input, HfConfigProblems) {
  expect_bad_input(run_cli({"plan", "--hf-config", "/nonexistent/kvport/config.json"}),
                   "cannot read HF config '/nonexistent/kvport/config.json': no such file");

  const TempFile malformed("config.json", "{\"num_hidden_layers\": 32,\n  oops }");
  expect_bad_input(run_cli({"plan", "--hf-config", malformed.path(), "--memory", "1GiB"}),
                   "not valid JSON");
  expect_bad_input(run_cli({"plan", "--hf-config", malformed.dir(), "--memory", "1GiB"}),
                   "is a directory");

  const TempFile empty("config.json", "");
  expect_bad_input(run_cli({"plan", "--hf-config", empty.path(), "--memory", "1GiB"}),
                   "not valid JSON");

  const TempFile array("config.json", "[1, 2, 3]");
  expect_bad_input(run_cli({"plan", "--hf-config", array.path(), "--memory", "1GiB"}),
                   "expected a JSON object, got array");

  const std::vector<std::pair<std::string, std::string>> wrong_types = {
      {R"({"num_hidden_layers": "32"})",
       "'num_hidden_layers' must be a positive integer, got \"32\""},
      {R"({"num_hidden_layers": -4})", "'num_hidden_layers' must be a positive integer, got -4"},
      {R"({"num_hidden_layers": 0})", "'num_hidden_layers' must be a positive integer, got 0"},
      {R"({"num_hidden_layers": 32.5})", "'num_hidden_layers' must be a positive integer"},
      {R"({"num_hidden_layers": 32, "num_key_value_heads": [8]})", "'num_key_value_heads'"},
      {R"({"num_hidden_layers": 32, "num_attention_heads": 32, "head_dim": true})", "'head_dim'"},
      {R"({"num_hidden_layers": 2, "num_attention_heads": 3, "hidden_size": 100})",
       "hidden_size 100 is not a multiple of num_attention_heads 3"},
  };
  for (const auto& [text, needle] : wrong_types) {
    SCOPED_TRACE(text);
    const TempFile config("config.json", text);
    expect_bad_input(run_cli({"plan", "--hf-config", config.path(), "--memory", "1GiB"}), needle);
  }
}

TEST(cli_bad_input, EmptyHfConfigPath) {
  expect_bad_input(run_cli({"plan", "--hf-config", ""}), "--hf-config");
}

}  // namespace
}  // namespace kvport::cli::testing
