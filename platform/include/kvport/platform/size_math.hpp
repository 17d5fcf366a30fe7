// SPDX-License-Identifier: Apache-2.0
// Overflow tests and saturating arithmetic on byte and block counts, at the
// bottom layer so that every layer shares one definition (each caller words
// its own error).
#pragma once

#include <cstddef>
#include <limits>

namespace kvport {

/// Whether a * b overflows size_t.
constexpr bool mul_overflows(std::size_t a, std::size_t b) noexcept {
  return a != 0 && b > std::numeric_limits<std::size_t>::max() / a;
}

/// Whether a + b overflows size_t.
constexpr bool add_overflows(std::size_t a, std::size_t b) noexcept {
  return b > std::numeric_limits<std::size_t>::max() - a;
}

/// a * b, or SIZE_MAX when it overflows (for reports and comparisons where
/// "more than anything" is the right answer).
constexpr std::size_t saturating_mul(std::size_t a, std::size_t b) noexcept {
  return mul_overflows(a, b) ? std::numeric_limits<std::size_t>::max() : a * b;
}

/// a + b, or SIZE_MAX when it overflows.
constexpr std::size_t saturating_add(std::size_t a, std::size_t b) noexcept {
  return add_overflows(a, b) ? std::numeric_limits<std::size_t>::max() : a + b;
}

}  // namespace kvport
