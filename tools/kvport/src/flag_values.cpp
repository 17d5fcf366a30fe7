// SPDX-License-Identifier: Apache-2.0
#include "kvport/cli/flag_values.hpp"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <cctype>
#include <charconv>
#include <cmath>
#include <string>
#include <vector>

#include "kvport/platform/error.hpp"
#include "text.hpp"

namespace kvport::cli {
namespace {

using text::lower;
using text::trim;

std::size_t parse_integer(std::string_view text, std::string_view flag, bool allow_zero) {
  const std::string_view value = trim(text);
  const char* expected = allow_zero ? "a non-negative integer" : "a positive integer";
  const bool digits_only = !value.empty() && std::all_of(value.begin(), value.end(), [](char c) {
    return std::isdigit(static_cast<unsigned char>(c)) != 0;
  });
  if (!digits_only) {
    throw InvalidArgument(fmt::format("{}: expected {}, got '{}'", flag, expected, text));
  }
  std::size_t result = 0;
  const auto [end, ec] = std::from_chars(value.data(), value.data() + value.size(), result);
  if (ec == std::errc::result_out_of_range) {
    throw InvalidArgument(fmt::format("{}: '{}' is too large", flag, text));
  }
  if (ec != std::errc() || end != value.data() + value.size()) {
    throw InvalidArgument(fmt::format("{}: expected {}, got '{}'", flag, expected, text));
  }
  if (result == 0 && !allow_zero) {
    throw InvalidArgument(fmt::format("{}: expected {}, got '{}'", flag, expected, text));
  }
  return result;
}

}  // namespace

std::size_t parse_positive_count(std::string_view text, std::string_view flag) {
  return parse_integer(text, flag, false);
}

std::size_t parse_count(std::string_view text, std::string_view flag) {
  return parse_integer(text, flag, true);
}

std::uint64_t parse_count_in(std::string_view text, std::string_view flag, std::uint64_t min,
                             std::uint64_t max) {
  const auto out_of_range = [&] {
    return InvalidArgument(
        fmt::format("{}: expected an integer in [{}, {}], got '{}'", flag, min, max, text));
  };
  std::size_t value = 0;
  try {
    value = parse_integer(text, flag, true);
  } catch (const InvalidArgument&) {
    throw out_of_range();
  }
  if (value < min || value > max) throw out_of_range();
  return value;
}

double parse_fraction(std::string_view text, std::string_view flag) {
  const std::string value(trim(text));
  double result = 0.0;
  std::size_t used = 0;
  bool parsed = false;
  try {
    result = std::stod(value, &used);
    parsed = used == value.size();
  } catch (const std::exception&) {
    parsed = false;
  }
  if (!parsed || !std::isfinite(result) || result <= 0.0 || result > 1.0) {
    throw InvalidArgument(
        fmt::format("{}: expected a fraction in (0, 1], e.g. 0.9, got '{}'", flag, text));
  }
  return result;
}

KvCacheDtype parse_dtype_value(std::string_view text, std::string_view flag) {
  if (const auto dtype = parse_dtype(lower(trim(text)))) return *dtype;
  std::vector<std::string_view> names;
  for (KvCacheDtype d : all_dtypes())
    names.push_back(to_string(d));
  throw InvalidArgument(
      fmt::format("{}: unknown dtype '{}' (known: {}; aliases fp16, bfloat16, fp8)", flag, text,
                  fmt::join(names, ", ")));
}

KvCacheLayout parse_layout_value(std::string_view text, std::string_view flag) {
  std::string value = lower(trim(text));
  std::replace(value.begin(), value.end(), '-', '_');
  if (value == "layer_major") return KvCacheLayout::layer_major;
  if (value == "block_major") return KvCacheLayout::block_major;
  throw InvalidArgument(
      fmt::format("{}: unknown layout '{}' (known: layer_major, block_major)", flag, text));
}

}  // namespace kvport::cli
