// SPDX-License-Identifier: Apache-2.0
// MemoryKind: where a backend's allocations live (Backend::memory_kind), in a
// header of its own so that the vendor API structs can name it without the
// Backend contract.
#pragma once

#include <cstdint>

namespace kvport {

/// Where a backend's allocations (alloc) live, for a transport that registers
/// them: host memory, or a CUDA or ROCm device's.
enum class MemoryKind : std::uint8_t { host, cuda, rocm };

}  // namespace kvport
