// SplitMix64: a tiny deterministic generator for the simulators and their
// benchmarks.
#pragma once

#include <cstdint>

namespace kvport::cli {

/// SplitMix64 (Steele, Lea and Flood): the same sequence on every platform
/// and standard library (std::uniform_int_distribution is not), so a seed
/// names one run.
class SplitMix64 {
 public:
  explicit SplitMix64(std::uint64_t seed) noexcept : state_(seed) {}

  std::uint64_t next() noexcept {
    std::uint64_t z = (state_ += 0x9E37'79B9'7F4A'7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58'476D'1CE4'E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D0'49BB'1331'11EBull;
    return z ^ (z >> 31);
  }

  /// Uniform in [lo, hi], lo <= hi (the modulo bias is irrelevant here).
  std::uint64_t uniform(std::uint64_t lo, std::uint64_t hi) noexcept {
    return lo + next() % (hi - lo + 1);
  }

 private:
  std::uint64_t state_;
};

}  // namespace kvport::cli
