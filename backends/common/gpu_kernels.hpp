// SPDX-License-Identifier: Apache-2.0
// Descriptor layouts and launcher declarations shared by the CUDA and HIP
// backends. The kernels themselves are written once, in gpu_kernels.inc.
#pragma once

#include <cstddef>
#include <cstdint>

namespace kvport::gpu {

/// Work is split into chunks of this many bytes; one thread block per chunk,
/// so a few huge regions still spread over every SM.
inline constexpr std::uint64_t kChunkBytes = 64 * 1024;
inline constexpr unsigned kThreadsPerBlock = 256;
/// Grid size cap; kernels stride over chunks beyond it.
inline constexpr std::uint64_t kMaxGridBlocks = 1u << 20;

/// Small batches travel as kernel parameters (by value) instead of through a
/// staged descriptor upload: zeroing a few blocks is then ONE launch with no
/// host-to-device copy and no staging slot. The limits keep every kernel's
/// parameters under 4 KiB, the classic limit that both vendors accept
/// (CUDA 12.1+ allows 32 KiB on Volta and later, but the parameter block is
/// copied with every launch, so large tables are cheaper uploaded).
inline constexpr std::size_t kMaxInlineIds = 960;     // 3840 bytes of block ids
inline constexpr std::size_t kMaxInlineFills = 160;   // 3840 bytes of FillDescriptor
inline constexpr std::size_t kMaxInlineCopies = 120;  // 3840 bytes of CopyDescriptor

/// One fill region. `first_chunk` is the prefix sum of earlier regions' chunk
/// counts, so a thread block finds its region by binary search.
struct FillDescriptor {
  std::uint64_t address;
  std::uint64_t bytes;
  std::uint64_t first_chunk;
};

struct CopyDescriptor {
  std::uint64_t dst;
  std::uint64_t src;
  std::uint64_t bytes;
  std::uint64_t first_chunk;
};

/// A block pool resident on the device for the cache-aware fill: block b's
/// region is [base + b * stride, + bytes). `first_chunk` is the prefix sum of
/// chunk counts of earlier pool regions within one block id.
struct PoolDescriptor {
  std::uint64_t base;
  std::uint64_t bytes;
  std::uint64_t stride;
  std::uint64_t first_chunk;
};

inline constexpr std::uint64_t chunks_for(std::uint64_t bytes) {
  return (bytes + kChunkBytes - 1) / kChunkBytes;
}

}  // namespace kvport::gpu

// Each vendor's kernels live in their own namespace (cuda_kernels,
// hip_kernels): both objects link into one binary, and one kernel name in two
// objects is a duplicate-symbol error. Launchers return the vendor's status
// code of the launch itself as an int (cudaError_t / hipError_t); `stream` is
// the native stream. *_table launchers read descriptors (or block ids) from
// device memory; *_by_value launchers copy `count` host descriptors (at most
// the kMaxInline* limit) into the kernel's parameters.
#define KVPORT_DECLARE_GPU_LAUNCHERS(ns)                                                          \
  namespace kvport::ns {                                                                          \
  int launch_fill_table(const gpu::FillDescriptor* descriptors, std::uint64_t count,              \
                        std::uint64_t total_chunks, std::uint8_t value, void* stream);            \
  int launch_fill_by_value(const gpu::FillDescriptor* descriptors, std::uint64_t count,           \
                           std::uint64_t total_chunks, std::uint8_t value, void* stream);         \
  int launch_copy_table(const gpu::CopyDescriptor* descriptors, std::uint64_t count,              \
                        std::uint64_t total_chunks, void* stream);                                \
  int launch_copy_by_value(const gpu::CopyDescriptor* descriptors, std::uint64_t count,           \
                           std::uint64_t total_chunks, void* stream);                             \
  int launch_fill_blocks_table(const gpu::PoolDescriptor* pools, std::uint64_t num_pools,         \
                               std::uint64_t chunks_per_block, const std::uint32_t* block_ids,    \
                               std::uint64_t num_ids, std::uint8_t value, void* stream);          \
  int launch_fill_blocks_by_value(const gpu::PoolDescriptor* pools, std::uint64_t num_pools,      \
                                  std::uint64_t chunks_per_block, const std::uint32_t* block_ids, \
                                  std::uint64_t num_ids, std::uint8_t value, void* stream);       \
  int launch_fault(void* stream);                                                                 \
  }

KVPORT_DECLARE_GPU_LAUNCHERS(cuda_kernels)
KVPORT_DECLARE_GPU_LAUNCHERS(hip_kernels)
