// SPDX-License-Identifier: Apache-2.0
// docs/formats.md's hybrid table, row by row, against LayerSpec: a row whose
// numbers drift from the code (or a model whose spec is not here) fails.
#include <gtest/gtest.h>

#include <fstream>
#include <map>
#include <sstream>
#include <string>
#include <vector>

#include "kvport/core/layer_spec.hpp"

namespace kvport {
namespace {

std::string trim(const std::string& s) {
  const auto b = s.find_first_not_of(' ');
  const auto e = s.find_last_not_of(' ');
  return b == std::string::npos ? "" : s.substr(b, e - b + 1);
}

std::vector<std::string> cells(const std::string& line) {
  std::vector<std::string> out;
  std::stringstream in(line);
  std::string cell;
  std::getline(in, cell, '|');  // before the first bar
  while (std::getline(in, cell, '|'))
    out.push_back(trim(cell));
  if (!out.empty() && out.back().empty()) out.pop_back();
  return out;
}

// The spec of each row's group, written from the models' public values.
std::map<std::string, LayerSpec> specs() {
  std::map<std::string, LayerSpec> m;
  m["deepseek-v3/mla(512+64) bf16"] = LayerSpec::mla(512, 64);
  m["deepseek-v3/mla(512+64) fp8_ds_mla"] =
      LayerSpec::mla(512, 64, KvCacheDtype::bf16, MlaFormat::fp8_ds_mla);
  m["gpt-oss-120b/sliding_window(128) 8x64 bf16"] = LayerSpec::sliding_window(128, 8, 64, 64);
  m["gpt-oss-120b/full_attention 8x64 bf16"] = LayerSpec::full_attention(8, 64, 64);
  m["gemma-3-27b/sliding_window(1024) 16x128 bf16"] = LayerSpec::sliding_window(1024, 16, 128, 128);
  m["gemma-3-27b/full_attention 16x128 bf16"] = LayerSpec::full_attention(16, 128, 128);
  m["llama-4-scout/chunked_local(8192) 8x128 bf16"] = LayerSpec::chunked_local(8192, 8, 128, 128);
  m["llama-4-scout/full_attention 8x128 bf16"] = LayerSpec::full_attention(8, 128, 128);
  m["qwen3-next-80b-a3b/full_attention 2x256 bf16"] = LayerSpec::full_attention(2, 256, 256);
  m["qwen3-next-80b-a3b/state(recurrent 32x128x128 bf16, conv 8192x3 bf16)"] =
      LayerSpec::recurrent_state({StateTensor{"recurrent", {32, 128, 128}, StateDtype::bf16},
                                  StateTensor{"conv", {8192, 3}, StateDtype::bf16}});
  m["nemotron-h (one Mamba layer)/state(ssm 128x64x128 f32, conv 10240x3 f32)"] =
      LayerSpec::recurrent_state({StateTensor{"ssm", {128, 64, 128}, StateDtype::f32},
                                  StateTensor{"conv", {10240, 3}, StateDtype::f32}});
  return m;
}

TEST(FormatsDoc, HybridTableMatchesTheCode) {
  std::ifstream in(KVPORT_DOCS_DIR "/formats.md");
  ASSERT_TRUE(in) << "cannot open " << KVPORT_DOCS_DIR "/formats.md";
  const std::map<std::string, LayerSpec> known = specs();
  bool inside = false;
  std::size_t rows = 0;
  for (std::string line; std::getline(in, line);) {
    if (line.find("<!-- hybrid-bytes") != std::string::npos) inside = true;
    if (line.find("<!-- end hybrid-bytes") != std::string::npos) inside = false;
    if (!inside || line.rfind("| ", 0) != 0 || line.find("---") != std::string::npos) continue;
    const std::vector<std::string> c = cells(line);
    ASSERT_EQ(c.size(), 6u) << line;
    if (c[0] == "model") continue;  // the header
    const auto it = known.find(c[0] + "/" + c[1]);
    ASSERT_NE(it, known.end()) << "no spec for the row: " << line;
    const LayerSpec& spec = it->second;
    const std::size_t layers = std::stoul(c[2]);
    EXPECT_EQ(std::stoul(c[3]), spec.token_bytes(16)) << line;
    EXPECT_EQ(std::stoul(c[4]), spec.state_bytes()) << line;
    const std::size_t per_block = spec.has_state() ? spec.state_bytes() : spec.block_bytes(16);
    EXPECT_EQ(std::stoul(c[5]), per_block * layers) << line;
    // And the group's pool config agrees.
    EXPECT_EQ(spec.pool_config(layers, 16).bytes_per_block(), per_block * layers) << line;
    ++rows;
  }
  EXPECT_EQ(rows, known.size());
}

}  // namespace
}  // namespace kvport
