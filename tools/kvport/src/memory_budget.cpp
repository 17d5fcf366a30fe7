// SPDX-License-Identifier: Apache-2.0
#include "kvport/cli/memory_budget.hpp"

#include <fmt/format.h>

#include <cmath>

#include "kvport/platform/byte_size.hpp"
#include "kvport/platform/error.hpp"
#include "text.hpp"

namespace kvport::cli {

MemoryBudgetSpec parse_memory_budget(std::string_view text, std::string_view flag) {
  if (text::lower(text::trim(text)) == "device") return MemoryBudgetSpec{true, 0};
  std::size_t bytes = 0;
  try {
    bytes = parse_byte_size(text);
  } catch (const InvalidArgument& e) {
    throw InvalidArgument(fmt::format("{}: {} (or 'device')", flag, e.what()));
  }
  // parse_byte_size accepts "0" (and fractions that round down to 0 bytes);
  // a budget of nothing is never what the user meant.
  if (bytes == 0) {
    throw InvalidArgument(fmt::format("{}: invalid byte size '{}': must be > 0", flag, text));
  }
  return MemoryBudgetSpec{false, bytes};
}

MemoryBudget resolve_memory_budget(const MemoryBudgetSpec& spec, std::string_view text,
                                   double utilization, const Backend* backend) {
  if (!spec.device) {
    return MemoryBudget{spec.bytes, fmt::format("--memory {}", text::trim(text))};
  }
  if (backend == nullptr) throw InvalidArgument("--memory device: no backend selected");
  const MemInfo info = backend->mem_info();
  const auto bytes = static_cast<std::size_t>(std::floor(static_cast<long double>(info.free_bytes) *
                                                         static_cast<long double>(utilization)));
  if (info.free_bytes == 0) {
    throw InvalidArgument(
        fmt::format("--memory device: backend '{}' reports no free memory", backend->name()));
  }
  if (bytes == 0) {
    throw InvalidArgument(
        fmt::format("--memory device: --utilization {} of {} free on {} is a budget of 0 bytes",
                    utilization, format_bytes(info.free_bytes), backend->name()));
  }
  return MemoryBudget{bytes, fmt::format("device: {} x {} free on {}", utilization,
                                         format_bytes(info.free_bytes), backend->name())};
}

}  // namespace kvport::cli
