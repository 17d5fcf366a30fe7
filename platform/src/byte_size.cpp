#include "kvport/platform/byte_size.hpp"

#include <fmt/format.h>

#include <array>
#include <cctype>
#include <cmath>
#include <limits>

#include "kvport/platform/error.hpp"

namespace kvport {
namespace {

struct Unit {
  std::string_view name;
  double factor;
};

constexpr std::array kUnits{
    Unit{"", 1.0},         Unit{"b", 1.0},          Unit{"kb", 1e3},
    Unit{"mb", 1e6},       Unit{"gb", 1e9},         Unit{"tb", 1e12},
    Unit{"kib", 1024.0},   Unit{"mib", 1048576.0},  Unit{"gib", 1073741824.0},
    Unit{"tib", 1099511627776.0},
};

[[noreturn]] void bad(std::string_view text, std::string_view why) {
  throw InvalidArgument(fmt::format("invalid byte size '{}': {}", text, why));
}

}  // namespace

std::size_t parse_byte_size(std::string_view text) {
  std::size_t i = 0;
  while (i < text.size() && std::isspace(static_cast<unsigned char>(text[i]))) ++i;
  if (i == text.size()) bad(text, "empty");
  if (text[i] == '-') bad(text, "negative");
  // Digits with at most one decimal point.
  std::uint64_t integral = 0;
  double fraction = 0.0, scale = 0.1;
  bool any_digit = false, seen_point = false;
  for (; i < text.size(); ++i) {
    const char c = text[i];
    if (c == '.' && !seen_point) {
      seen_point = true;
      continue;
    }
    if (!std::isdigit(static_cast<unsigned char>(c))) break;
    any_digit = true;
    const unsigned d = static_cast<unsigned>(c - '0');
    if (!seen_point) {
      if (integral > (std::numeric_limits<std::uint64_t>::max() - d) / 10) bad(text, "too large");
      integral = integral * 10 + d;
    } else {
      fraction += d * scale;
      scale /= 10;
    }
  }
  if (!any_digit) bad(text, "expected a number, e.g. 80GiB");
  while (i < text.size() && std::isspace(static_cast<unsigned char>(text[i]))) ++i;
  std::string unit;
  for (; i < text.size(); ++i) {
    const char c = text[i];
    if (std::isspace(static_cast<unsigned char>(c))) break;
    unit.push_back(static_cast<char>(std::tolower(static_cast<unsigned char>(c))));
  }
  while (i < text.size() && std::isspace(static_cast<unsigned char>(text[i]))) ++i;
  if (i != text.size()) bad(text, "trailing characters");
  for (const Unit& u : kUnits) {
    if (u.name != unit) continue;
    if (u.factor == 1.0) {
      if (fraction != 0.0) bad(text, "a byte count must be whole");
      if (integral > std::numeric_limits<std::size_t>::max()) bad(text, "too large");
      return static_cast<std::size_t>(integral);
    }
    const long double value =
        (static_cast<long double>(integral) + fraction) * static_cast<long double>(u.factor);
    if (value >= static_cast<long double>(std::numeric_limits<std::size_t>::max())) {
      bad(text, "too large");
    }
    return static_cast<std::size_t>(std::floor(value));
  }
  bad(text, fmt::format("unknown unit '{}' (use B, KB, MB, GB, TB, KiB, MiB, GiB or TiB)", unit));
}

std::string format_bytes(std::size_t bytes) {
  static constexpr std::array<std::string_view, 5> kNames{"B", "KiB", "MiB", "GiB", "TiB"};
  double value = static_cast<double>(bytes);
  std::size_t unit = 0;
  while (value >= 1024.0 && unit + 1 < kNames.size()) {
    value /= 1024.0;
    ++unit;
  }
  if (unit == 0) return fmt::format("{} B", bytes);
  return fmt::format("{:.2f} {}", value, kNames[unit]);
}

}  // namespace kvport
