// SPDX-License-Identifier: Apache-2.0
// The --layer-dtypes syntax: per-layer dtypes for mixed-precision KV caches.
#pragma once

#include <cstddef>
#include <string_view>
#include <vector>

#include "kvport/core/dtype.hpp"

namespace kvport::cli {

/// Parses a per-layer dtype spec for a model of `num_layers` layers whose
/// other layers use `base`. Two forms, never mixed:
///
///   overrides  "LAYERS:DTYPE[,LAYERS:DTYPE...]", applied left to right, where
///              LAYERS is an index ("31"), an inclusive range ("0-3"), or
///              "first" / "last"; e.g. "first:bf16,last:bf16" keeps the first
///              and last layer in bf16 under --dtype fp8.
///   full list  "DTYPE,DTYPE,..." with exactly num_layers entries.
///
/// Returns num_layers entries (a KvCacheConfig::layer_dtypes value). Throws
/// InvalidArgument naming the flag and the bad entry for an empty entry, an
/// unknown dtype, a layer out of range, a reversed range, a list of the wrong
/// length, or a mix of the two forms.
std::vector<KvCacheDtype> parse_layer_dtypes(std::string_view spec, std::size_t num_layers,
                                             KvCacheDtype base,
                                             std::string_view flag = "--layer-dtypes");

}  // namespace kvport::cli
