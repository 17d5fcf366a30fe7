// SPDX-License-Identifier: Apache-2.0
// `kvport disagg`'s flags: every bad value is refused with one line and exit
// 2 before any worker starts (these tests start none), repeated flags take
// their last value as in every other command, and the protocol's names are
// spelled once (disagg.hpp).
#include <gtest/gtest.h>

#include <fstream>
#include <string>
#include <string_view>
#include <vector>

#include "cli_test_util.hpp"
#include "disagg.hpp"
#include "disagg_report.hpp"
#include "kvport/cli/flag_values.hpp"
#include "kvport/platform/error.hpp"

namespace kvport::cli {
namespace {

using testing::expect_bad_input;
using testing::run_cli;

const std::string kTrace = std::string(KVPORT_TEST_DATA_DIR) + "/mooncake_small.jsonl";

// A small model and a trace: what a run needs, before `extra`.
testing::CliResult disagg(std::vector<std::string> extra) {
  std::vector<std::string> args{"disagg", "--trace",           kTrace, "--layers",
                                "2",      "--kv-heads",        "2",    "--head-dim",
                                "64",     "--capacity-blocks", "64"};
  args.insert(args.end(), extra.begin(), extra.end());
  return run_cli(args);
}

TEST(DisaggFlags, NegativeCountsAreRefusedNotWrapped) {
  expect_bad_input(disagg({"--requests", "-1"}),
                   "--requests: expected a positive integer, got '-1'");
  expect_bad_input(disagg({"--kill", "prefill", "--after", "-1"}),
                   "--after: expected a non-negative integer, got '-1'");
  expect_bad_input(disagg({"--capacity-blocks", "-5"}),
                   "--capacity-blocks: expected a positive integer, got '-5'");
  expect_bad_input(disagg({"--prefill", "-1"}), "--prefill: expected an integer in [1, 16]");
  expect_bad_input(disagg({"--tp-decode", "0"}), "--tp-decode: expected an integer in [1, 8]");
}

TEST(DisaggFlags, TimesOutOfRangeAreRefused) {
  expect_bad_input(disagg({"--timeout-s", "10000000000"}),
                   "--timeout-s: expected an integer in [1, 604800], got '10000000000'");
  expect_bad_input(disagg({"--peer-timeout-ms", "10000000000000"}),
                   "--peer-timeout-ms: expected an integer in [1, 3600000]");
  expect_bad_input(disagg({"--lease-ttl-ms", "0"}), "--lease-ttl-ms: expected an integer in [1,");
  expect_bad_input(disagg({"--timeout-s", "1e3"}), "--timeout-s: expected an integer");
  expect_bad_input(disagg({"--peer-timeout-ms", "99999999999999999999999"}),
                   "--peer-timeout-ms: expected an integer in [1, 3600000]");
}

TEST(DisaggFlags, ARepeatedFlagTakesItsLastValue) {
  // The last --capacity-blocks is the one checked ...
  expect_bad_input(disagg({"--capacity-blocks", "600", "--capacity-blocks", "-5"}), "got '-5'");
  // ... and an earlier bad value is overridden: the run gets as far as the
  // next check (an address that is not this machine's).
  expect_bad_input(disagg({"--prefill", "99", "--prefill", "1", "--bind", "192.0.2.1"}),
                   "--bind 192.0.2.1: not an address of this machine's interfaces");
  expect_bad_input(disagg({"--bind", "::1", "--bind", "192.0.2.1"}), "--bind 192.0.2.1:");
}

TEST(DisaggFlags, BindMustBeALocalIpv4Address) {
  expect_bad_input(disagg({"--bind", "::1"}), "--bind ::1: IPv6 is not supported");
  expect_bad_input(disagg({"--bind", "fe80::1"}), "IPv6 is not supported");
  expect_bad_input(disagg({"--bind", "127.0.0.2"}),
                   "--bind 127.0.0.2: not an address of this machine's interfaces");
  expect_bad_input(disagg({"--bind", "255.255.255.255"}), "not an address of this machine's");
  expect_bad_input(disagg({"--bind", "localhost"}), "--bind: 'localhost' is not an IPv4 address");
  expect_bad_input(disagg({"--bind", ""}), "is not an IPv4 address");
}

TEST(DisaggFlags, WorkersThatDoNotFitHostMemoryAreRefused) {
  // 32 processes of 30000 blocks of 2 MiB: terabytes, more than any host here.
  expect_bad_input(run_cli({"disagg", "--trace", kTrace, "--model", "llama-3-8b",
                            "--capacity-blocks", "30000", "--prefill", "16", "--decode", "16"}),
                   "more than this machine has");
}

TEST(DisaggFlags, KillOptionsNeedKill) {
  expect_bad_input(disagg({"--after", "3"}), "--after needs --kill");
  expect_bad_input(disagg({"--kill-signal", "stop"}), "--kill-signal needs --kill");
  expect_bad_input(disagg({"--kill", "decode", "--kill-signal", "term"}),
                   "--kill-signal: expected kill or stop, got 'term'");
  expect_bad_input(disagg({"--kill", "router"}), "--kill: expected prefill or decode");
}

TEST(FlagValues, CountInRange) {
  EXPECT_EQ(parse_count_in("5", "--x", 1, 8), 5u);
  EXPECT_EQ(parse_count_in(" 8 ", "--x", 1, 8), 8u);
  EXPECT_THROW(parse_count_in("9", "--x", 1, 8), InvalidArgument);
  EXPECT_THROW(parse_count_in("0", "--x", 1, 8), InvalidArgument);
  EXPECT_THROW(parse_count_in("-1", "--x", 0, 8), InvalidArgument);
  EXPECT_THROW(parse_count_in("", "--x", 0, 8), InvalidArgument);
  EXPECT_THROW(parse_count_in("3x", "--x", 0, 8), InvalidArgument);
  EXPECT_THROW(parse_count_in("18446744073709551616", "--x", 0, 8), InvalidArgument);
}

TEST(DisaggProtocol, RolesAndNamesRoundTrip) {
  using disagg::Role;
  for (Role r : {Role::prefill, Role::decode})
    EXPECT_EQ(disagg::parse_role(disagg::to_string(r)), r);
  EXPECT_FALSE(disagg::parse_role("router").has_value());
  EXPECT_EQ(disagg::worker_name(Role::decode, 1, 0), "decode1.0");
  EXPECT_EQ(disagg::op_message(disagg::op::finish).dump(), R"({"op":"finish"})");
  EXPECT_EQ(disagg::event_message(disagg::event::peer_lost).dump(), R"({"event":"peer_lost"})");
}

TEST(DisaggProtocol, WorkerSpecRoundTripsAndNamesABadField) {
  disagg::WorkerSpec s;
  s.role = disagg::Role::decode;
  s.instance = 2;
  s.rank = 1;
  s.tp = 2;
  s.config.num_layers = 2;
  s.config.num_kv_heads = 4;
  s.config.head_dim_k = s.config.head_dim_v = 64;
  s.config.block_size = 16;
  s.capacity_blocks = 10;
  const disagg::WorkerSpec back = disagg::WorkerSpec::from_json(s.to_json());
  EXPECT_EQ(back.role, disagg::Role::decode);
  EXPECT_EQ(back.instance, 2u);
  EXPECT_EQ(back.rank, 1u);
  EXPECT_EQ(back.capacity_blocks, 10u);
  nlohmann::json bad = s.to_json();
  bad["role"] = "router";
  EXPECT_THROW(disagg::WorkerSpec::from_json(bad), InvalidArgument);
  bad = s.to_json();
  bad.erase("capacity_blocks");
  EXPECT_THROW(disagg::WorkerSpec::from_json(bad), InvalidArgument);
}

TEST(DisaggProtocol, HybridWorkerSpecCarriesEveryLayerKind) {
  disagg::WorkerSpec s;
  s.config.block_size = 16;
  s.capacity_blocks = 10;
  s.state_slots = 3;
  s.model_layers = {LayerSpec::full_attention(8, 64, 64, KvCacheDtype::fp8_e4m3),
                    LayerSpec::sliding_window(128, 8, 64, 64),
                    LayerSpec::chunked_local(64, 4, 128, 128),
                    LayerSpec::mla(512, 64, KvCacheDtype::fp8_e4m3, MlaFormat::fp8_ds_mla),
                    LayerSpec::recurrent_state({StateTensor{"conv", {16, 3}, StateDtype::bf16},
                                                StateTensor{"ssm", {4, 8, 16}, StateDtype::f32}}),
                    LayerSpec::no_kv()};
  const disagg::WorkerSpec back = disagg::WorkerSpec::from_json(s.to_json());
  EXPECT_EQ(back.model_layers, s.model_layers);
  EXPECT_EQ(back.state_slots, 3u);
  // A spec without layers (what a full-attention run sends) reads back empty.
  disagg::WorkerSpec plain;
  plain.config.block_size = 16;
  EXPECT_TRUE(disagg::WorkerSpec::from_json(plain.to_json()).model_layers.empty());
  nlohmann::json bad = disagg::layer_spec_json(s.model_layers[1]);
  bad["kind"] = "retention";
  EXPECT_THROW(disagg::layer_spec_from_json(bad, 16), InvalidArgument);
  bad = disagg::layer_spec_json(s.model_layers[1]);
  bad["window"] = 0;  // validated
  EXPECT_THROW(disagg::layer_spec_from_json(bad, 16), InvalidArgument);
  bad = disagg::layer_spec_json(s.model_layers[4]);
  bad["state"][0]["dtype"] = "f64";
  EXPECT_THROW(disagg::layer_spec_from_json(bad, 16), InvalidArgument);
  bad = disagg::layer_spec_json(s.model_layers[3]);
  bad["mla_format"] = "zip";
  EXPECT_THROW(disagg::layer_spec_from_json(bad, 16), InvalidArgument);
  bad.erase("rope_dim");
  EXPECT_THROW(disagg::layer_spec_from_json(bad, 16), InvalidArgument);
}

TEST(DisaggFlags, HybridModelsSplitOnlyTheirAttentionHeads) {
  // gpt-oss-120b: 8 KV heads in every attention layer.
  expect_bad_input(run_cli({"disagg", "--trace", kTrace, "--model", "gpt-oss-120b",
                            "--capacity-blocks", "64", "--tp-decode", "3"}),
                   "tensor-parallel size 3");
  // Every group's pool counts toward the host-memory check.
  expect_bad_input(run_cli({"disagg", "--trace", kTrace, "--model", "gpt-oss-120b",
                            "--capacity-blocks", "30000", "--prefill", "16", "--decode", "16"}),
                   "more than this machine has");
}

TEST(DisaggReport, AWorkerLostByAPeerFailsTheRunUnlessItWasTheVictim) {
  disagg::RunOptions o;
  o.config.num_layers = 2;
  o.config.num_kv_heads = 2;
  o.config.head_dim_k = o.config.head_dim_v = 64;
  o.config.block_size = 16;
  disagg::Stats s;
  s.requests = s.completed = 1;
  disagg::WorkerRecord survivor;
  survivor.stats = nlohmann::json{{"leaked_blocks", 0}, {"invariants_ok", true}};
  survivor.end = disagg::WorkerEnd::finished;
  disagg::WorkerRecord lost;
  lost.role = disagg::Role::decode;
  lost.end = disagg::WorkerEnd::lost;
  lost.lost_reported_by = "prefill0.0";
  s.workers = {survivor, lost};
  s.workers_lost = 1;
  EXPECT_FALSE(disagg::checks_pass(o, s));
  const auto j = disagg::report_json(o, s);
  EXPECT_EQ(j["workers"][1]["end"], "lost");
  EXPECT_EQ(j["workers"][1]["lost_reported_by"], "prefill0.0");
  EXPECT_FALSE(j["ok"].get<bool>());
  // The same loss as the --kill-signal stop victim is the expected one.
  s.workers_lost = 0;
  o.kill = disagg::Role::decode;
  o.kill_stops = true;
  s.kill = disagg::KillRecord{"decode0.0", true, 3, 1, 100};
  EXPECT_TRUE(disagg::checks_pass(o, s));
  // Detected later than the bound (+500 ms): failed.
  s.kill->loss_detected_ms_max = static_cast<double>(o.peer_timeout.count()) + 501;
  EXPECT_FALSE(disagg::checks_pass(o, s));
}

}  // namespace
}  // namespace kvport::cli

namespace kvport::cli {
namespace {

// The message table in disagg.hpp's comment lists every op and event the
// constants define (and the constants are the only spelling the code uses),
// so the description cannot drift from the protocol unnoticed.
TEST(DisaggProtocol, TheMessageTableListsEveryOpAndEvent) {
  const std::string path = std::string(KVPORT_TEST_DATA_DIR) + "/../../tools/kvport/src/disagg.hpp";
  std::ifstream in(path);
  ASSERT_TRUE(in) << path;
  std::vector<std::string> rows;
  for (std::string line; std::getline(in, line);) {
    if (line.starts_with("//   ") && line.size() > 5 && line[5] != ' ') {
      rows.push_back(line.substr(5, line.find(' ', 5) - 5));
    }
  }
  namespace op = disagg::op;
  namespace ev = disagg::event;
  const std::vector<std::string_view> names{
      op::connect, op::baseline,  op::prefill,  op::recompute, op::finish,
      ev::ready,   ev::connected, ev::baseline, ev::lease_end, ev::prefill_failed,
      ev::done,    ev::peer_lost, ev::stats,    ev::fatal};
  std::vector<std::string> expected(names.begin(), names.end());
  EXPECT_EQ(rows, expected);
}

}  // namespace
}  // namespace kvport::cli
