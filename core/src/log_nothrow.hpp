// SPDX-License-Identifier: Apache-2.0
// Logging from rollback and noexcept paths (private to core).
#pragma once

#include <fmt/format.h>

#include <utility>

#include "kvport/platform/log.hpp"

namespace kvport::detail {

/// Logs an error; a failure to format or log it is dropped (rollback and
/// noexcept paths must go on).
template <class... Args>
void log_error_nothrow(fmt::format_string<Args...> format, Args&&... args) noexcept {
  try {
    log::error(fmt::format(format, std::forward<Args>(args)...));
  } catch (...) {
  }
}

}  // namespace kvport::detail
