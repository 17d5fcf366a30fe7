// SPDX-License-Identifier: Apache-2.0
// A GoogleTest environment that prints, after the suite, how many faults the
// FaultInjectingBackends of the test binary injected: the figure
// docs/reliability.md quotes. Include it in exactly one source file of a
// test binary.
#pragma once

#include <gtest/gtest.h>

#include <cstdio>

#include "kvport/platform/fault_injecting_backend.hpp"

namespace kvport::testing {

class FaultReport : public ::testing::Environment {
 public:
  void TearDown() override {
    std::printf(
        "[kvport] faults injected in this run: %llu\n",
        static_cast<unsigned long long>(FaultInjectingBackend::faults_injected_in_process()));
  }
};

inline const ::testing::Environment* const kFaultReport =
    ::testing::AddGlobalTestEnvironment(new FaultReport);

}  // namespace kvport::testing
