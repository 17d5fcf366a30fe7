// SPDX-License-Identifier: Apache-2.0
// Which sanitizer this test build runs under (the asan and tsan presets), for
// GCC (__SANITIZE_ADDRESS__, __SANITIZE_THREAD__) and clang (__has_feature):
// tests that cannot run under one skip on these, saying why.
#pragma once

namespace kvport::testing {

#if defined(__SANITIZE_ADDRESS__)
inline constexpr bool kAddressSanitizer = true;
#elif defined(__has_feature)
#if __has_feature(address_sanitizer)
inline constexpr bool kAddressSanitizer = true;
#else
inline constexpr bool kAddressSanitizer = false;
#endif
#else
inline constexpr bool kAddressSanitizer = false;
#endif

#if defined(__SANITIZE_THREAD__)
inline constexpr bool kThreadSanitizer = true;
#elif defined(__has_feature)
#if __has_feature(thread_sanitizer)
inline constexpr bool kThreadSanitizer = true;
#else
inline constexpr bool kThreadSanitizer = false;
#endif
#else
inline constexpr bool kThreadSanitizer = false;
#endif

}  // namespace kvport::testing
