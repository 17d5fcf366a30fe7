// SPDX-License-Identifier: Apache-2.0
#include "kvport/cli/layer_dtypes.hpp"

#include <fmt/format.h>

#include <cctype>
#include <string>

#include "kvport/cli/flag_values.hpp"
#include "kvport/platform/error.hpp"
#include "text.hpp"

namespace kvport::cli {
namespace {

using text::lower;
using text::trim;

std::vector<std::string_view> split(std::string_view text, char separator) {
  std::vector<std::string_view> parts;
  std::size_t start = 0;
  for (;;) {
    const std::size_t end = text.find(separator, start);
    parts.push_back(trim(text.substr(start, end - start)));
    if (end == std::string_view::npos) return parts;
    start = end + 1;
  }
}

// One layer reference of an override: an index, "first" or "last".
std::size_t parse_layer(std::string_view text, std::size_t num_layers, std::string_view flag,
                        std::string_view entry) {
  std::size_t layer = 0;
  if (text == "first") {
    layer = 0;
  } else if (text == "last") {
    layer = num_layers - 1;
  } else {
    try {
      layer = parse_count(text, flag);
    } catch (const InvalidArgument&) {
      throw InvalidArgument(
          fmt::format("{}: bad layer '{}' in '{}' (use an index, a range like 0-3, first or last)",
                      flag, text, entry));
    }
  }
  if (layer >= num_layers) {
    throw InvalidArgument(
        fmt::format("{}: layer {} in '{}' is out of range (the model has {} layers)", flag, layer,
                    entry, num_layers));
  }
  return layer;
}

}  // namespace

std::vector<KvCacheDtype> parse_layer_dtypes(std::string_view spec, std::size_t num_layers,
                                             KvCacheDtype base, std::string_view flag) {
  if (num_layers == 0) throw InvalidArgument(fmt::format("{}: the model has no layers", flag));
  if (trim(spec).empty()) throw InvalidArgument(fmt::format("{}: empty value", flag));
  const std::vector<std::string_view> entries = split(spec, ',');
  const bool overrides = spec.find(':') != std::string_view::npos;

  std::vector<KvCacheDtype> dtypes(num_layers, base);
  if (!overrides) {
    if (entries.size() != num_layers) {
      throw InvalidArgument(fmt::format(
          "{}: a full list needs one dtype per layer ({}), got {} (or use LAYERS:DTYPE overrides)",
          flag, num_layers, entries.size()));
    }
    for (std::size_t i = 0; i < num_layers; ++i) {
      if (entries[i].empty()) {
        throw InvalidArgument(fmt::format("{}: empty entry for layer {}", flag, i));
      }
      dtypes[i] = parse_dtype_value(entries[i], flag);
    }
    return dtypes;
  }

  for (const std::string_view entry : entries) {
    const std::size_t colon = entry.find(':');
    if (colon == std::string_view::npos) {
      throw InvalidArgument(fmt::format(
          "{}: entry '{}' has no ':' (use LAYERS:DTYPE overrides or a full list, not both)", flag,
          entry));
    }
    const std::string_view layers = trim(entry.substr(0, colon));
    const std::string_view dtype_text = trim(entry.substr(colon + 1));
    if (layers.empty() || dtype_text.empty()) {
      throw InvalidArgument(fmt::format("{}: bad entry '{}' (expected LAYERS:DTYPE)", flag, entry));
    }
    const KvCacheDtype dtype = parse_dtype_value(dtype_text, flag);
    std::size_t first = 0, last = 0;
    if (const std::size_t dash = layers.find('-'); dash != std::string_view::npos) {
      first = parse_layer(trim(layers.substr(0, dash)), num_layers, flag, entry);
      last = parse_layer(trim(layers.substr(dash + 1)), num_layers, flag, entry);
      if (first > last) {
        throw InvalidArgument(fmt::format("{}: range in '{}' is reversed", flag, entry));
      }
    } else {
      first = last = parse_layer(layers, num_layers, flag, entry);
    }
    for (std::size_t layer = first; layer <= last; ++layer)
      dtypes[layer] = dtype;
  }
  return dtypes;
}

}  // namespace kvport::cli
