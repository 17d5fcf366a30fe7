// SPDX-License-Identifier: Apache-2.0
// Integer division rounded up (blocks for a number of tokens, chunks for a
// number of bytes), at the bottom layer so that every layer can use it.
#pragma once

#include <cstddef>

namespace kvport {

/// ceil(a / b) for b > 0, without the overflow of (a + b - 1) / b.
constexpr std::size_t div_ceil(std::size_t a, std::size_t b) noexcept {
  return a / b + (a % b != 0);
}

/// `a` rounded up to a multiple of `b` (b > 0). The caller keeps the result
/// in range (a + b - 1 fits in size_t).
constexpr std::size_t round_up(std::size_t a, std::size_t b) noexcept {
  return div_ceil(a, b) * b;
}

}  // namespace kvport
