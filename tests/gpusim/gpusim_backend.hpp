// gpusim: the GPU backend (GpuBackend<Api>, backends/common/gpu_backend.hpp)
// over a CPU simulation of the vendor API, for machines without a GPU.
//
// Everything host-side runs for real: allocation tracking and range checks,
// descriptor tables with their chunk prefix sums, pinned staging slots and the
// events guarding them, the device-resident pool table of the cache-aware
// fill. "Kernel launches" run the kernels' own chunk mapping and per-lane byte
// loops (backends/common/gpu_chunks.hpp) on the CPU, lane by lane. Work runs
// synchronously at launch, so it does not exercise device/host concurrency.
// Test-only: not in the backend registry.
#pragma once

#include <memory>

#include "kvport/platform/backend.hpp"

namespace kvport::testing {

/// A GpuBackend over the simulated API, with `capacity_bytes` of "device"
/// memory.
std::unique_ptr<Backend> make_gpusim_backend(std::size_t capacity_bytes = std::size_t{4} << 30);

}  // namespace kvport::testing
