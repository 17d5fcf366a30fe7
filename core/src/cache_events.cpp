// SPDX-License-Identifier: Apache-2.0
#include "kvport/core/cache_events.hpp"

namespace kvport {

std::string_view to_string(Medium medium) noexcept {
  switch (medium) {
    case Medium::gpu:
      return "GPU";
    case Medium::cpu:
      return "CPU";
    case Medium::disk:
      return "DISK";
  }
  return "UNKNOWN";
}

std::optional<Medium> parse_medium(std::string_view name) noexcept {
  for (Medium m : {Medium::gpu, Medium::cpu, Medium::disk}) {
    if (to_string(m) == name) return m;
  }
  return std::nullopt;
}

}  // namespace kvport
