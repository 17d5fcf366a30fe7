// SPDX-License-Identifier: Apache-2.0
// The JSON fields that describe a cache shape, shared by every subcommand's
// --json output so that `plan` and `demo` spell them the same way.
#pragma once

#include <nlohmann/json.hpp>
#include <string>

#include "cache_options.hpp"

namespace kvport::cli {

/// Sets "model" {name, source, num_layers, num_kv_heads, head_dim_k,
/// head_dim_v}, "dtype", "block_size" and "layout" on `j`.
inline void add_shape_fields(nlohmann::ordered_json& j, const CacheShapeOptions::Resolved& shape) {
  const ModelSpec& model = shape.model;
  j["model"] = {{"name", model.name},
                {"source", model.source},
                {"num_layers", model.num_layers},
                {"num_kv_heads", model.num_kv_heads},
                {"head_dim_k", model.head_dim_k},
                {"head_dim_v", model.head_dim_v}};
  j["dtype"] = std::string(to_string(shape.config.dtype));
  j["block_size"] = shape.config.block_size;
  j["layout"] = std::string(to_string(shape.config.layout));
}

}  // namespace kvport::cli
