// SPDX-License-Identifier: Apache-2.0
#include "kvport/platform/error.hpp"

#include <fmt/format.h>

#include "kvport/platform/log.hpp"

namespace kvport {

OutOfMemory::OutOfMemory(std::string_view backend, std::size_t requested, std::size_t free)
    : Error(fmt::format("{}: out of memory: requested {} bytes, {} bytes free", backend, requested,
                        free)),
      requested_(requested),
      free_(free) {}

BackendError::BackendError(std::string_view backend, std::string_view call, long native_code,
                           std::string_view native_string)
    : Error(fmt::format("{}: {} failed: error {} ({})", backend, call, native_code, native_string)),
      backend_(backend),
      call_(call),
      native_code_(native_code),
      native_string_(native_string) {}

BackendError::BackendError(std::string message, std::string_view backend, std::string_view call,
                           long native_code, std::string_view native_string)
    : Error(std::move(message)),
      backend_(backend),
      call_(call),
      native_code_(native_code),
      native_string_(native_string) {}

DeviceLost::DeviceLost(std::string_view backend, std::string_view call, long native_code,
                       std::string_view native_string)
    : BackendError(fmt::format("{}: device lost: {} failed: error {} ({}); the device context is "
                               "unusable and every later call on this backend fails",
                               backend, call, native_code, native_string),
                   backend, call, native_code, native_string) {}

namespace detail {

void log_vendor_failure(std::string_view backend, std::string_view call, long code,
                        std::string_view what, const char* file, int line) noexcept {
  try {
    log::error(fmt::format("{}: {} failed: error {} ({}) at {}:{}", backend, call, code, what, file,
                           line));
  } catch (...) {  // formatting can only fail on allocation; nothing more to do
  }
}

}  // namespace detail
}  // namespace kvport
