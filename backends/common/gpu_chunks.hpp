// SPDX-License-Identifier: Apache-2.0
// How the batched kernels split work: which bytes chunk c of a launch covers.
// Shared by the kernels (gpu_kernels.inc) and by the CPU simulation of the GPU
// backend that the conformance suite runs without a GPU, so the mapping the
// devices execute is the mapping CI tests.
#pragma once

#include <cstdint>

#include "gpu_kernels.hpp"

#if defined(__CUDACC__) || defined(__HIPCC__)
#define KVPORT_HOST_DEVICE __host__ __device__
#else
#define KVPORT_HOST_DEVICE
#endif

namespace kvport::gpu {

/// Bytes [address, address + bytes) that one chunk fills.
struct FillSpan {
  std::uint64_t address;
  std::uint64_t bytes;
};

struct CopySpan {
  std::uint64_t dst;
  std::uint64_t src;
  std::uint64_t bytes;
};

/// Index of the last entry whose first_chunk <= chunk (entries are sorted by
/// first_chunk, the first one is 0).
template <class Descriptor>
KVPORT_HOST_DEVICE inline std::uint64_t find_entry(const Descriptor* d, std::uint64_t count,
                                                   std::uint64_t chunk) {
  std::uint64_t lo = 0, hi = count;
  while (hi - lo > 1) {
    const std::uint64_t mid = lo + (hi - lo) / 2;
    if (d[mid].first_chunk <= chunk) {
      lo = mid;
    } else {
      hi = mid;
    }
  }
  return lo;
}

KVPORT_HOST_DEVICE inline std::uint64_t chunk_length(std::uint64_t bytes, std::uint64_t offset) {
  const std::uint64_t left = bytes - offset;
  return left < kChunkBytes ? left : kChunkBytes;
}

KVPORT_HOST_DEVICE inline FillSpan fill_chunk(const FillDescriptor* d, std::uint64_t count,
                                              std::uint64_t chunk) {
  const FillDescriptor r = d[find_entry(d, count, chunk)];
  const std::uint64_t offset = (chunk - r.first_chunk) * kChunkBytes;
  return FillSpan{r.address + offset, chunk_length(r.bytes, offset)};
}

KVPORT_HOST_DEVICE inline CopySpan copy_chunk(const CopyDescriptor* d, std::uint64_t count,
                                              std::uint64_t chunk) {
  const CopyDescriptor r = d[find_entry(d, count, chunk)];
  const std::uint64_t offset = (chunk - r.first_chunk) * kChunkBytes;
  return CopySpan{r.dst + offset, r.src + offset, chunk_length(r.bytes, offset)};
}

/// Chunk c of a cache-aware fill: id ids[c / chunks_per_block], and within
/// that block the pool region found by binary search.
KVPORT_HOST_DEVICE inline FillSpan block_chunk(const PoolDescriptor* pools, std::uint64_t num_pools,
                                               std::uint64_t chunks_per_block,
                                               const std::uint32_t* ids, std::uint64_t chunk) {
  const std::uint64_t id = ids[chunk / chunks_per_block];
  const std::uint64_t within = chunk % chunks_per_block;
  const PoolDescriptor pool = pools[find_entry(pools, num_pools, within)];
  const std::uint64_t offset = (within - pool.first_chunk) * kChunkBytes;
  return FillSpan{pool.base + id * pool.stride + offset, chunk_length(pool.bytes, offset)};
}

/// 16 bytes moved as one vector store on the device.
struct alignas(16) Bytes16 {
  std::uint32_t word[4];
};

/// Lane `lane` of `lanes` cooperating threads sets its share of [p, p + n):
/// single bytes up to 16-byte alignment, 16-byte stores, then the tail.
KVPORT_HOST_DEVICE inline void fill_bytes(unsigned char* p, std::uint64_t n, unsigned char value,
                                          std::uint64_t lane, std::uint64_t lanes) {
  const std::uint64_t misalign = reinterpret_cast<std::uintptr_t>(p) % 16;
  std::uint64_t head = misalign == 0 ? 0 : 16 - misalign;
  if (head > n) head = n;
  for (std::uint64_t i = lane; i < head; i += lanes)
    p[i] = value;
  const std::uint32_t w = 0x01010101u * value;
  const Bytes16 pattern{{w, w, w, w}};
  Bytes16* q = reinterpret_cast<Bytes16*>(p + head);
  const std::uint64_t vectors = (n - head) / 16;
  for (std::uint64_t i = lane; i < vectors; i += lanes)
    q[i] = pattern;
  for (std::uint64_t i = head + vectors * 16 + lane; i < n; i += lanes)
    p[i] = value;
}

/// The same for a copy; 16-byte stores when source and destination are
/// equally misaligned, single bytes otherwise.
KVPORT_HOST_DEVICE inline void copy_bytes(unsigned char* dst, const unsigned char* src,
                                          std::uint64_t n, std::uint64_t lane,
                                          std::uint64_t lanes) {
  const std::uint64_t misalign = reinterpret_cast<std::uintptr_t>(dst) % 16;
  if (misalign != reinterpret_cast<std::uintptr_t>(src) % 16) {
    for (std::uint64_t i = lane; i < n; i += lanes)
      dst[i] = src[i];
    return;
  }
  std::uint64_t head = misalign == 0 ? 0 : 16 - misalign;
  if (head > n) head = n;
  for (std::uint64_t i = lane; i < head; i += lanes)
    dst[i] = src[i];
  const std::uint64_t vectors = (n - head) / 16;
  Bytes16* qd = reinterpret_cast<Bytes16*>(dst + head);
  const Bytes16* qs = reinterpret_cast<const Bytes16*>(src + head);
  for (std::uint64_t i = lane; i < vectors; i += lanes)
    qd[i] = qs[i];
  for (std::uint64_t i = head + vectors * 16 + lane; i < n; i += lanes)
    dst[i] = src[i];
}

}  // namespace kvport::gpu
