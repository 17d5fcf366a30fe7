// SPDX-License-Identifier: Apache-2.0
#include "kvport/platform/byte_size.hpp"

#include <fmt/format.h>

#include <array>
#include <cctype>
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

#include "kvport/platform/error.hpp"

namespace kvport {
namespace {

struct Unit {
  std::string_view name;
  std::uint64_t factor;
};

constexpr std::array kUnits{
    Unit{"", 1},
    Unit{"b", 1},
    Unit{"kb", 1'000},
    Unit{"mb", 1'000'000},
    Unit{"gb", 1'000'000'000},
    Unit{"tb", 1'000'000'000'000},
    Unit{"kib", std::uint64_t{1} << 10},
    Unit{"mib", std::uint64_t{1} << 20},
    Unit{"gib", std::uint64_t{1} << 30},
    Unit{"tib", std::uint64_t{1} << 40},
};

[[noreturn]] void bad(std::string_view text, std::string_view why) {
  throw InvalidArgument(fmt::format("invalid byte size '{}': {}", text, why));
}

bool is_space(char c) {
  return std::isspace(static_cast<unsigned char>(c)) != 0;
}
bool is_digit(char c) {
  return std::isdigit(static_cast<unsigned char>(c)) != 0;
}

}  // namespace

std::size_t parse_byte_size(std::string_view text) {
  std::size_t i = 0;
  while (i < text.size() && is_space(text[i]))
    ++i;
  if (i == text.size()) bad(text, "empty");
  if (text[i] == '-') bad(text, "negative");
  // The number is kept as its decimal digits and multiplied by the unit
  // exactly: binary floating point would turn "0.03GB" into 29 999 999 bytes.
  std::vector<std::uint8_t> digits;
  std::size_t fraction_digits = 0;
  bool seen_point = false;
  for (; i < text.size(); ++i) {
    const char c = text[i];
    if (c == '.' && !seen_point) {
      seen_point = true;
      continue;
    }
    if (!is_digit(c)) break;
    digits.push_back(static_cast<std::uint8_t>(c - '0'));
    if (seen_point) ++fraction_digits;
  }
  if (digits.empty()) bad(text, "expected a number, e.g. 80GiB");
  while (i < text.size() && is_space(text[i]))
    ++i;
  std::string unit;
  for (; i < text.size() && !is_space(text[i]); ++i) {
    unit.push_back(static_cast<char>(std::tolower(static_cast<unsigned char>(text[i]))));
  }
  while (i < text.size() && is_space(text[i]))
    ++i;
  if (i != text.size()) bad(text, "trailing characters");

  const Unit* found = nullptr;
  for (const Unit& u : kUnits) {
    if (u.name == unit) found = &u;
  }
  if (found == nullptr) {
    bad(text, fmt::format("unknown unit '{}' (use B, KB, MB, GB, TB, KiB, MiB, GiB or TiB)", unit));
  }
  if (found->factor == 1) {
    for (std::size_t d = digits.size() - fraction_digits; d < digits.size(); ++d) {
      if (digits[d] != 0) bad(text, "a byte count must be whole");
    }
  }

  // digits *= factor, least significant digit first; the carry stays below
  // the factor, so `d * factor + carry` cannot overflow.
  std::uint64_t carry = 0;
  for (std::size_t d = digits.size(); d-- > 0;) {
    const std::uint64_t cur = digits[d] * found->factor + carry;
    digits[d] = static_cast<std::uint8_t>(cur % 10);
    carry = cur / 10;
  }
  // The whole part is `carry` followed by the integral digits; the fraction
  // digits left over are the part of a byte that is dropped (floor).
  constexpr std::uint64_t kMax = std::numeric_limits<std::size_t>::max();
  std::uint64_t value = carry;
  for (std::size_t d = 0; d < digits.size() - fraction_digits; ++d) {
    if (value > (kMax - digits[d]) / 10) bad(text, "too large");
    value = value * 10 + digits[d];
  }
  return static_cast<std::size_t>(value);
}

std::string format_bytes(std::size_t bytes) {
  static constexpr std::array<std::string_view, 5> kNames{"B", "KiB", "MiB", "GiB", "TiB"};
  double value = static_cast<double>(bytes);
  std::size_t unit = 0;
  while (value >= 1024.0 && unit + 1 < kNames.size()) {
    value /= 1024.0;
    ++unit;
  }
  // 1048575 bytes is 1023.999 KiB, which two decimals would print as
  // "1024.00 KiB": move to the next unit when rounding reaches it.
  if (unit > 0 && unit + 1 < kNames.size() && std::round(value * 100.0) >= 1024.0 * 100.0) {
    value /= 1024.0;
    ++unit;
  }
  if (unit == 0) return fmt::format("{} B", bytes);
  return fmt::format("{:.2f} {}", value, kNames[unit]);
}

}  // namespace kvport
