// SPDX-License-Identifier: Apache-2.0
// The host's physical memory, for sizing checks.
#pragma once

#include <cstddef>

namespace kvport {

/// Physical RAM of this machine in bytes (sysconf); 0 when it cannot be
/// determined.
std::size_t host_physical_memory() noexcept;

}  // namespace kvport
