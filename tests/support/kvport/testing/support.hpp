// SPDX-License-Identifier: Apache-2.0
// Helpers shared by every kvport test executable (unit tests and the backend
// conformance suite). Add a helper here only when more than one suite needs
// it; suite-specific helpers stay in that suite's *_test_util.hpp.
//
// Note: this header declares namespace kvport::testing. Code inside
// namespace kvport that means GoogleTest must therefore write ::testing::.
#pragma once

#include <gtest/gtest.h>

#include <cstdlib>
#include <exception>
#include <optional>
#include <string>
#include <utility>

#include "kvport/platform/error.hpp"

namespace kvport::testing {

/// Sets an environment variable for a scope, or unsets it when `value` is
/// std::nullopt, and restores the previous state (value, or absence) when it
/// goes out of scope. Guards nest: an inner guard restores what the outer one
/// set. `name` must outlive the guard (a string literal, typically).
///
/// POSIX setenv/unsetenv are not thread-safe: use it only while the test runs
/// no other threads that read the environment.
class ScopedEnv {
 public:
  ScopedEnv(const char* name, std::optional<std::string> value) : name_(name) {
    if (const char* old = std::getenv(name)) saved_ = std::string(old);
    set(value);
  }
  ~ScopedEnv() { set(saved_); }
  ScopedEnv(const ScopedEnv&) = delete;
  ScopedEnv& operator=(const ScopedEnv&) = delete;

 private:
  void set(const std::optional<std::string>& value) const {
    if (value) {
      ::setenv(name_, value->c_str(), 1);
    } else {
      ::unsetenv(name_);
    }
  }

  const char* name_;
  std::optional<std::string> saved_;
};

/// Runs `f` and returns the what() of the E it throws. Records a non-fatal
/// failure (ADD_FAILURE) and returns "" when `f` throws nothing or throws
/// something that is not an E; the test goes on, so check the message with
/// EXPECT_THAT(message_of<E>(...), HasSubstr(...)).
template <class E = kvport::Error, class F>
std::string message_of(F&& f) {
  try {
    std::forward<F>(f)();
  } catch (const E& e) {
    return e.what();
  } catch (const std::exception& e) {
    ADD_FAILURE() << "message_of: threw another exception type: " << e.what();
    return {};
  } catch (...) {
    ADD_FAILURE() << "message_of: threw something that is not a std::exception";
    return {};
  }
  ADD_FAILURE() << "message_of: did not throw";
  return {};
}

}  // namespace kvport::testing
