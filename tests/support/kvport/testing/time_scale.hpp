// SPDX-License-Identifier: Apache-2.0
// Test timeouts that stretch with the build: a sanitizer build runs several
// times slower, and a timeout tuned for the plain build (a 20 ms instance
// timeout, a 30 ms tail wait) then fires before the work it waits for is
// done. The sanitizer test presets set KVPORT_TEST_TIME_SCALE; tests scale
// the timeouts they set and wait for by it.
#pragma once

#include <chrono>
#include <cstdlib>

namespace kvport::testing {

/// KVPORT_TEST_TIME_SCALE (an integer in [1, 100]), 1 when unset or invalid.
inline long time_scale() {
  static const long scale = [] {
    const char* v = std::getenv("KVPORT_TEST_TIME_SCALE");
    if (v == nullptr) return 1L;
    char* end = nullptr;
    const long n = std::strtol(v, &end, 10);
    return end != v && *end == '\0' && n >= 1 && n <= 100 ? n : 1L;
  }();
  return scale;
}

/// `d` times time_scale().
template <class Rep, class Period>
std::chrono::duration<Rep, Period> scaled(std::chrono::duration<Rep, Period> d) {
  return d * static_cast<Rep>(time_scale());
}

}  // namespace kvport::testing
