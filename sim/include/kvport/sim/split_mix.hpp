// SPDX-License-Identifier: Apache-2.0
// SplitMix64 and its finalizer: the deterministic mixing behind the
// simulators' token synthesis and seeded workloads, written once.
#pragma once

#include <cstdint>

namespace kvport::sim {

/// SplitMix64's finalizer (Steele, Lea and Flood): a bijection of 64-bit
/// words that mixes every input bit into every output bit; the same on every
/// platform. Costs a few multiplies; never throws.
constexpr std::uint64_t mix64(std::uint64_t z) noexcept {
  z = (z ^ (z >> 30)) * 0xBF58'476D'1CE4'E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D0'49BB'1331'11EBull;
  return z ^ (z >> 31);
}

/// SplitMix64's increment, the golden-ratio constant 2^64 / phi.
inline constexpr std::uint64_t kGoldenGamma = 0x9E37'79B9'7F4A'7C15ull;

/// SplitMix64: a tiny generator that gives the same sequence on every
/// platform and standard library (std::uniform_int_distribution does not), so
/// a seed names one run.
class SplitMix64 {
 public:
  explicit SplitMix64(std::uint64_t seed) noexcept : state_(seed) {}

  /// The next 64-bit value.
  std::uint64_t next() noexcept { return mix64(state_ += kGoldenGamma); }

  /// Uniform in [lo, hi], lo <= hi (the modulo bias is irrelevant here).
  std::uint64_t uniform(std::uint64_t lo, std::uint64_t hi) noexcept {
    return lo + next() % (hi - lo + 1);
  }

 private:
  std::uint64_t state_;
};

}  // namespace kvport::sim
