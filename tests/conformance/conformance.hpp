// SPDX-License-Identifier: Apache-2.0
// The fixture of the backend conformance suite, shared by its test files (one
// per topic; one executable, kvport_conformance). See conformance.cpp for the
// backends it runs on.
//
// Every check reads the device memory back to the host and compares it with a
// host-side model of what the bytes must be.
#pragma once

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cstddef>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "kvport/platform/backend.hpp"
#include "kvport/platform/registry.hpp"
#include "kvport/testing/sanitizers.hpp"

namespace kvport::conformance {

using Bytes = std::vector<std::uint8_t>;

inline constexpr std::size_t kKiB = 1024;
inline constexpr std::size_t kMiB = 1024 * kKiB;
inline constexpr std::size_t kGiB = 1024 * kMiB;

/// Device memory of the suite's gpusim backend: more than 4 GiB, so that the
/// offsets-beyond-4-GiB test runs there too. The simulated device memory is
/// std::aligned_alloc: pages never touched cost nothing.
inline constexpr std::size_t kGpusimCapacity = 8 * kGiB;

/// Whether this build runs under ThreadSanitizer (the tsan preset), which
/// makes gpusim's lane-by-lane kernels some 25 times slower.
using kvport::testing::kThreadSanitizer;

/// Every backend the suite is instantiated for: the compiled ones, then the
/// test-only ones (gpusim, fault_host).
std::vector<std::string> backend_names();

/// The registry's entry for `name`; a test-only backend is always available.
BackendInfo info_of(const std::string& name);

/// A new backend called `name` (compiled or test-only).
std::unique_ptr<Backend> make_any_backend(const std::string& name);

/// The backend called `name` on device ordinal `device` (make_backend(name,
/// device) for a compiled backend).
std::unique_ptr<Backend> make_any_backend_on(const std::string& name, int device);

/// `n` pseudo-random bytes, the same for the same seed.
Bytes random_bytes(std::size_t n, std::uint64_t seed);

/// Success when `got` equals `expected`; otherwise says where the first wrong
/// byte is, how many are wrong, and the values around it (never dumps whole
/// buffers).
::testing::AssertionResult same_bytes(const Bytes& got, const Bytes& expected);

class Conformance : public ::testing::TestWithParam<std::string> {
 protected:
  void SetUp() override;
  void TearDown() override;

  Backend& b() { return *backend_; }
  StreamView stream() { return backend_->default_stream(); }

  /// An allocation freed at the end of the test. Thread-safe.
  DevicePtr alloc(std::size_t bytes);

  /// A device buffer holding `content`.
  DevicePtr upload(const Bytes& content);

  /// `bytes` bytes at `p`, copied back on `s` (default: the default stream).
  Bytes download(DevicePtr p, std::size_t bytes);
  Bytes download(DevicePtr p, std::size_t bytes, StreamView s);

  /// Regions of odd sizes at odd offsets, with gaps between them that must
  /// stay untouched, given to fill_async in random order: one call.
  void check_batched_fill(std::size_t count, std::size_t max_size, std::uint32_t seed);

  BackendInfo info_;
  std::unique_ptr<Backend> backend_;

 private:
  std::mutex owned_mutex_;
  std::vector<DevicePtr> owned_;
};

}  // namespace kvport::conformance
