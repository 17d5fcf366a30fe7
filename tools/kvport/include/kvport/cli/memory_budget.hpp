// SPDX-License-Identifier: Apache-2.0
// The --memory budget: a byte size, or a fraction of a backend's free memory.
#pragma once

#include <cstddef>
#include <string>
#include <string_view>

#include "kvport/platform/backend.hpp"

namespace kvport::cli {

/// A parsed --memory value.
struct MemoryBudgetSpec {
  bool device = false;    ///< "device": free device memory x utilization
  std::size_t bytes = 0;  ///< the byte size when !device (> 0)
};

/// Parses "device" or a byte size ("80GiB", "512 MiB", "1.5GB", "4096"; see
/// kvport::parse_byte_size). Throws InvalidArgument naming `flag` for an empty,
/// negative, zero, overflowing or malformed size.
MemoryBudgetSpec parse_memory_budget(std::string_view text, std::string_view flag = "--memory");

/// A resolved budget and where it came from, for reports.
struct MemoryBudget {
  std::size_t bytes = 0;
  /// "--memory 80GiB", or "device: 0.9 x 70.00 GiB free on cuda".
  std::string origin;
};

/// Turns a spec into bytes. For "device", asks `backend` for
/// mem_info().free_bytes and takes `utilization` (in (0, 1]) of it, rounded
/// down. Throws InvalidArgument when the result is 0 bytes.
MemoryBudget resolve_memory_budget(const MemoryBudgetSpec& spec, std::string_view text,
                                   double utilization, const Backend* backend);

}  // namespace kvport::cli
