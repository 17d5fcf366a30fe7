// SPDX-License-Identifier: Apache-2.0
// Test helpers shared by the sim/ and CLI tests: one Mooncake trace line, and
// the small cache configuration the simulations run on.
#pragma once

#include <cstddef>
#include <sstream>
#include <string>

#include "kvport/core/kv_cache_config.hpp"

namespace kvport::testing {

/// One line of a Mooncake trace (JSON Lines), newline included; `hash_ids` is
/// the JSON array as text, e.g. "[1, 2]".
inline std::string mooncake_line(double timestamp, std::size_t input, std::size_t output,
                                 const std::string& hash_ids) {
  std::ostringstream s;
  s << R"({"timestamp": )" << timestamp << R"(, "input_length": )" << input
    << R"(, "output_length": )" << output << R"(, "hash_ids": )" << hash_ids << "}\n";
  return s.str();
}

/// 2 layers, 1 KV head, head dim 16, 16-token blocks: pools of a few KiB.
inline KvCacheConfig tiny_sim_config() {
  KvCacheConfig c;
  c.num_layers = 2;
  c.num_kv_heads = 1;
  c.head_dim_k = c.head_dim_v = 16;
  c.block_size = 16;
  return c;
}

}  // namespace kvport::testing
