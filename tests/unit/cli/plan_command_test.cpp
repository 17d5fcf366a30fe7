// SPDX-License-Identifier: Apache-2.0
// `kvport plan`: values computed by hand from the byte formulas of dtype.hpp.
#include "cli_test_util.hpp"

namespace kvport::cli::testing {
namespace {

using ::testing::HasSubstr;
using ::testing::Not;

// llama-3-8b, bf16, block 16: per layer K = V = 16 tokens x 8 heads x 128 x 2 B
// = 32768 B; per block 32 x (32768 + 32768) = 2 MiB; 80 GiB / 2 MiB = 40960.
TEST(cli_plan, JsonForLlama3_8bBf16In80GiB) {
  const CliResult r = run_cli({"plan", "--model", "llama-3-8b", "--memory", "80GiB", "--json"});
  ASSERT_EQ(r.code, 0) << r.err;
  EXPECT_EQ(r.err, "");
  const auto j = r.json();
  EXPECT_EQ(j["bytes_per_block"], 2097152u);
  EXPECT_EQ(j["num_blocks"], 40960u);
  EXPECT_EQ(j["token_capacity"], 655360u);
  EXPECT_EQ(j["memory_bytes"], 85899345920u);
  EXPECT_EQ(j["cache_bytes"], 85899345920u);
  EXPECT_EQ(j["block_size"], 16u);
  EXPECT_EQ(j["dtype"], "bf16");
  EXPECT_EQ(j["layout"], "layer_major");
  EXPECT_EQ(j["capped_by_block_ids"], false);
  EXPECT_EQ(j["backend"], nullptr);  // a fixed budget needs no backend
  EXPECT_EQ(j["model"]["name"], "llama-3-8b");
  EXPECT_EQ(j["model"]["source"], "preset");
  EXPECT_EQ(j["model"]["num_layers"], 32u);
  EXPECT_EQ(j["model"]["num_kv_heads"], 8u);
  EXPECT_EQ(j["model"]["head_dim_k"], 128u);
  EXPECT_EQ(j["k_data_bytes"], 32u * 32768u);
  EXPECT_EQ(j["k_scale_bytes"], 0u);
  ASSERT_EQ(j["layers"].size(), 32u);
  for (std::size_t i = 0; i < 32; ++i) {
    const auto& layer = j["layers"][i];
    EXPECT_EQ(layer["layer"], i);
    EXPECT_EQ(layer["dtype"], "bf16");
    EXPECT_EQ(layer["k_bytes"], 32768u);
    EXPECT_EQ(layer["v_bytes"], 32768u);
    EXPECT_EQ(layer["k_data_bytes"], 32768u);
    EXPECT_EQ(layer["v_scale_bytes"], 0u);
  }
}

TEST(cli_plan, TextTableCollapsesIdenticalLayers) {
  const CliResult r = run_cli({"plan", "--model", "llama-3-8b", "--memory", "80GiB"});
  ASSERT_EQ(r.code, 0) << r.err;
  EXPECT_THAT(r.out, HasSubstr("llama-3-8b (preset): 32 layers, 8 KV heads, head dim 128"));
  EXPECT_THAT(r.out, HasSubstr("0-31"));
  EXPECT_THAT(r.out, Not(HasSubstr("\n1  ")));  // no row per layer
  EXPECT_THAT(r.out, HasSubstr("Bytes per block 2097152 (2.00 MiB"));
  EXPECT_THAT(r.out, HasSubstr("Blocks          40960\n"));
  EXPECT_THAT(r.out, HasSubstr("Token capacity  655360 (40960 blocks x 16 tokens)"));
}

TEST(cli_plan, PresetsFromTheIssue) {
  struct Case {
    const char* name;
    std::size_t layers, kv_heads, head_dim;
  };
  for (const Case& c : {Case{"llama-3-8b", 32, 8, 128}, Case{"llama-3-70b", 80, 8, 128},
                        Case{"qwen2.5-7b", 28, 4, 128}, Case{"mistral-7b", 32, 8, 128}}) {
    SCOPED_TRACE(c.name);
    const CliResult r = run_cli({"plan", "--model", c.name, "--memory", "1GiB", "--json"});
    ASSERT_EQ(r.code, 0) << r.err;
    const auto j = r.json();
    EXPECT_EQ(j["model"]["num_layers"], c.layers);
    EXPECT_EQ(j["model"]["num_kv_heads"], c.kv_heads);
    EXPECT_EQ(j["model"]["head_dim_k"], c.head_dim);
    const std::size_t per_block = c.layers * 2 * 16 * c.kv_heads * c.head_dim * 2;
    EXPECT_EQ(j["bytes_per_block"], per_block);
    EXPECT_EQ(j["num_blocks"], (std::size_t{1} << 30) / per_block);
  }
}

TEST(cli_plan, PresetNamesAreCaseInsensitive) {
  const CliResult r = run_cli({"plan", "--model", "Llama-3-70B", "--memory", "1GiB", "--json"});
  ASSERT_EQ(r.code, 0) << r.err;
  EXPECT_EQ(r.json()["model"]["name"], "llama-3-70b");
}

// 4 layers x 2 heads x 64 dims, block 32: K = V = 32 x 2 x 64 x 2 = 8192 B; per
// block 4 x 16384 = 65536 B; 1 MiB holds 16 blocks = 512 tokens.
TEST(cli_plan, ModelFromFlags) {
  const CliResult r = run_cli({"plan", "--layers", "4", "--kv-heads", "2", "--head-dim", "64",
                               "--block-size", "32", "--memory", "1MiB", "--json"});
  ASSERT_EQ(r.code, 0) << r.err;
  const auto j = r.json();
  EXPECT_EQ(j["model"]["source"], "flags");
  EXPECT_EQ(j["bytes_per_block"], 65536u);
  EXPECT_EQ(j["num_blocks"], 16u);
  EXPECT_EQ(j["token_capacity"], 512u);
  EXPECT_EQ(j["layers"][3]["k_bytes"], 8192u);
}

TEST(cli_plan, FlagsOverrideThePreset) {
  // K head dim 192: K = 16 x 8 x 192 x 2 = 49152 B, V stays 32768 B.
  const CliResult r = run_cli(
      {"plan", "--model", "llama-3-8b", "--head-dim-k", "192", "--memory", "80GiB", "--json"});
  ASSERT_EQ(r.code, 0) << r.err;
  const auto j = r.json();
  EXPECT_EQ(j["model"]["source"], "preset+flags");
  EXPECT_EQ(j["model"]["head_dim_k"], 192u);
  EXPECT_EQ(j["model"]["head_dim_v"], 128u);
  EXPECT_EQ(j["layers"][0]["k_bytes"], 49152u);
  EXPECT_EQ(j["layers"][0]["v_bytes"], 32768u);
  EXPECT_EQ(j["bytes_per_block"], 2621440u);

  const CliResult layers =
      run_cli({"plan", "--model", "llama-3-8b", "--layers", "2", "--memory", "1GiB", "--json"});
  ASSERT_EQ(layers.code, 0) << layers.err;
  EXPECT_EQ(layers.json()["bytes_per_block"], 2u * 65536u);
}

// fp8 everywhere but the first and last layer: 2 x 65536 + 30 x 32768 =
// 1114112 B per block; 80 GiB holds 77101 blocks.
TEST(cli_plan, MixedPrecisionOverrides) {
  const CliResult r = run_cli({"plan", "--model", "llama-3-8b", "--dtype", "fp8", "--layer-dtypes",
                               "first:bf16,last:bf16", "--memory", "80GiB", "--json"});
  ASSERT_EQ(r.code, 0) << r.err;
  const auto j = r.json();
  EXPECT_EQ(j["dtype"], "fp8_e4m3");
  EXPECT_EQ(j["bytes_per_block"], 1114112u);
  EXPECT_EQ(j["num_blocks"], 77101u);
  EXPECT_EQ(j["token_capacity"], 77101u * 16u);
  EXPECT_EQ(j["layers"][0]["dtype"], "bf16");
  EXPECT_EQ(j["layers"][0]["k_bytes"], 32768u);
  EXPECT_EQ(j["layers"][1]["dtype"], "fp8_e4m3");
  EXPECT_EQ(j["layers"][1]["k_bytes"], 16384u);
  EXPECT_EQ(j["layers"][31]["dtype"], "bf16");

  const CliResult text = run_cli({"plan", "--model", "llama-3-8b", "--dtype", "fp8",
                                  "--layer-dtypes", "first:bf16,last:bf16", "--memory", "80GiB"});
  ASSERT_EQ(text.code, 0) << text.err;
  EXPECT_THAT(text.out, HasSubstr("\n0       bf16"));
  EXPECT_THAT(text.out, HasSubstr("\n1-30    fp8_e4m3"));
  EXPECT_THAT(text.out, HasSubstr("\n31      bf16"));
  EXPECT_THAT(text.out, HasSubstr("fp8_e4m3 (2 layers overridden)"));
}

// nvfp4, 16 tokens x 1 head x 16 dims = 256 elements: 128 data bytes + 16
// scale bytes = 144 B; bf16: 512 B. Per block 2 x 512 + 2 x 144 = 1312 B.
TEST(cli_plan, FullListOfLayerDtypesWithScales) {
  const CliResult r = run_cli({"plan", "--layers", "2", "--kv-heads", "1", "--head-dim", "16",
                               "--layer-dtypes", "bf16,nvfp4", "--memory", "1MiB", "--json"});
  ASSERT_EQ(r.code, 0) << r.err;
  const auto j = r.json();
  EXPECT_EQ(j["layers"][1]["dtype"], "nvfp4");
  EXPECT_EQ(j["layers"][1]["k_data_bytes"], 128u);
  EXPECT_EQ(j["layers"][1]["k_scale_bytes"], 16u);
  EXPECT_EQ(j["layers"][1]["k_bytes"], 144u);
  EXPECT_EQ(j["layers"][0]["k_bytes"], 512u);
  EXPECT_EQ(j["bytes_per_block"], 1312u);
  EXPECT_EQ(j["num_blocks"], 799u);
  EXPECT_EQ(j["k_scale_bytes"], 16u);
}

TEST(cli_plan, BlockMajorLayoutHasTheSameCapacity) {
  const CliResult r = run_cli(
      {"plan", "--model", "mistral-7b", "--layout", "block-major", "--memory", "80GiB", "--json"});
  ASSERT_EQ(r.code, 0) << r.err;
  EXPECT_EQ(r.json()["layout"], "block_major");
  EXPECT_EQ(r.json()["num_blocks"], 40960u);
}

TEST(cli_plan, HfConfig) {
  // Qwen2.5-7B's shape: head_dim = hidden_size / num_attention_heads = 128.
  const TempFile config("config.json", R"({
    "model_type": "qwen2", "num_hidden_layers": 28, "num_attention_heads": 28,
    "num_key_value_heads": 4, "hidden_size": 3584, "torch_dtype": "bfloat16"})");
  const CliResult r =
      run_cli({"plan", "--hf-config", config.path(), "--memory", "80GiB", "--json"});
  ASSERT_EQ(r.code, 0) << r.err;
  const auto j = r.json();
  EXPECT_EQ(j["model"]["name"], "qwen2");
  EXPECT_EQ(j["model"]["source"], "hf-config");
  EXPECT_EQ(j["model"]["num_layers"], 28u);
  EXPECT_EQ(j["model"]["num_kv_heads"], 4u);
  EXPECT_EQ(j["model"]["head_dim_k"], 128u);
  EXPECT_EQ(j["bytes_per_block"], 917504u);  // 28 x 2 x 16 x 4 x 128 x 2

  const CliResult overridden = run_cli(
      {"plan", "--hf-config", config.path(), "--layers", "1", "--memory", "80GiB", "--json"});
  ASSERT_EQ(overridden.code, 0) << overridden.err;
  EXPECT_EQ(overridden.json()["model"]["source"], "hf-config+flags");
  EXPECT_EQ(overridden.json()["bytes_per_block"], 917504u / 28u);
}

TEST(cli_plan, HfConfigMissingFieldsCanComeFromFlags) {
  const TempFile config("config.json", R"({"num_attention_heads": 8, "hidden_size": 512})");
  const CliResult r = run_cli(
      {"plan", "--hf-config", config.path(), "--layers", "2", "--memory", "1MiB", "--json"});
  ASSERT_EQ(r.code, 0) << r.err;
  const auto j = r.json();
  EXPECT_EQ(j["model"]["num_kv_heads"], 8u);  // defaults to num_attention_heads
  EXPECT_EQ(j["model"]["head_dim_k"], 64u);
}

TEST(cli_plan, MemoryDeviceUsesFreeMemoryTimesUtilization) {
  const ScopedEnv env("KVPORT_HOST_MEMORY", "1GiB");
  const CliResult r = run_cli({"plan", "--model", "llama-3-8b", "--memory", "device", "--backend",
                               "host", "--utilization", "0.5", "--json"});
  ASSERT_EQ(r.code, 0) << r.err;
  const auto j = r.json();
  EXPECT_EQ(j["backend"], "host");
  EXPECT_EQ(j["memory_bytes"], 536870912u);
  EXPECT_EQ(j["num_blocks"], 256u);
  EXPECT_THAT(j["memory_origin"].get<std::string>(), HasSubstr("0.5 x 1.00 GiB free on host"));

  // Default: --memory device with --utilization 0.9.
  const CliResult d = run_cli({"plan", "--model", "llama-3-8b", "--backend", "host", "--json"});
  ASSERT_EQ(d.code, 0) << d.err;
  EXPECT_EQ(d.json()["memory_bytes"], 966367641u);  // floor(0.9 x 2^30)
  EXPECT_EQ(d.json()["num_blocks"], 460u);
}

TEST(cli_plan, CapsAtTheBlockIdLimit) {
  // 1 layer, 1 head, 16 dims, fp8, 1 token per block: 16 + 16 B per block.
  const CliResult r =
      run_cli({"plan", "--layers", "1", "--kv-heads", "1", "--head-dim", "16", "--dtype", "fp8",
               "--block-size", "1", "--memory", "1TiB", "--json"});
  ASSERT_EQ(r.code, 0) << r.err;
  const auto j = r.json();
  EXPECT_EQ(j["bytes_per_block"], 32u);
  EXPECT_EQ(j["num_blocks"], 4294967295u);
  EXPECT_EQ(j["capped_by_block_ids"], true);
}

}  // namespace
}  // namespace kvport::cli::testing
