// SPDX-License-Identifier: Apache-2.0
// Parsing of single flag values (counts, fractions, dtypes, layouts) with
// error messages that name the flag and the offending text.
//
// The command-line options take their values as text and parse them here
// rather than through CLI11's converters, so that "-1", "0", "1e3", "99999999999999999999"
// and "12abc" all get the same kind of one-line message.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string_view>

#include "kvport/core/dtype.hpp"
#include "kvport/core/kv_cache_config.hpp"

namespace kvport::cli {

/// Parses a decimal integer > 0 (digits only, optional surrounding spaces).
/// Throws InvalidArgument "<flag>: expected a positive integer, got '<text>'"
/// for an empty, negative, zero, non-numeric or trailing-garbage value, and
/// "<flag>: '<text>' is too large" when it does not fit in size_t.
std::size_t parse_positive_count(std::string_view text, std::string_view flag);

/// Parses a decimal integer >= 0 (as parse_positive_count, 0 allowed).
std::size_t parse_count(std::string_view text, std::string_view flag);

/// Parses a decimal integer in [min, max] (digits only, as parse_count).
/// Throws InvalidArgument "<flag>: expected an integer in [<min>, <max>],
/// got '<text>'" for anything else, a negative or too large value included,
/// so that no flag wraps around or overflows a later time or size sum.
std::uint64_t parse_count_in(std::string_view text, std::string_view flag, std::uint64_t min,
                             std::uint64_t max);

/// Parses a fraction in (0, 1], e.g. "0.9". Throws InvalidArgument naming the
/// flag otherwise.
double parse_fraction(std::string_view text, std::string_view flag);

/// Parses a dtype name (see kvport::parse_dtype, case-insensitive). Throws
/// InvalidArgument naming `flag`, the bad name and the known dtypes.
KvCacheDtype parse_dtype_value(std::string_view text, std::string_view flag);

/// Parses "layer_major" / "block_major" (also with '-'). Throws InvalidArgument.
KvCacheLayout parse_layout_value(std::string_view text, std::string_view flag);

}  // namespace kvport::cli
