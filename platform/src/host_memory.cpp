// SPDX-License-Identifier: Apache-2.0
#include "kvport/platform/host_memory.hpp"

#include <unistd.h>

namespace kvport {

std::size_t host_physical_memory() noexcept {
  const long pages = ::sysconf(_SC_PHYS_PAGES);
  const long page_size = ::sysconf(_SC_PAGE_SIZE);
  if (pages <= 0 || page_size <= 0) return 0;
  return static_cast<std::size_t>(pages) * static_cast<std::size_t>(page_size);
}

}  // namespace kvport
