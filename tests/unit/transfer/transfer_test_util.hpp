// SPDX-License-Identifier: Apache-2.0
// Helpers shared by the transfer unit tests: layouts and caches of a known
// shape on a host backend, and a "transfer" that copies planned regions with
// memcpy (host backend addresses are host pointers).
#pragma once

#include <gtest/gtest.h>

#include <cstdint>
#include <cstring>
#include <memory>
#include <numeric>
#include <vector>

#include "kvport/backends/host_backend.hpp"
#include "kvport/core/kv_cache_config.hpp"
#include "kvport/core/paged_kv_cache.hpp"
#include "kvport/platform/error.hpp"
#include "kvport/testing/support.hpp"
#include "kvport/transfer/kv_content.hpp"
#include "kvport/transfer/layout.hpp"

namespace kvport::transfer::test {

using kvport::testing::message_of;

inline constexpr std::size_t kMiB = std::size_t{1} << 20;

/// A host backend whose capacity does not depend on KVPORT_HOST_MEMORY or RAM.
inline std::unique_ptr<Backend> host_backend(std::size_t capacity = 1024 * kMiB) {
  return make_host_backend(HostBackendOptions{capacity});
}

/// A KV-cache shape: `layers` layers of `dtype`, block 4, head_dim 32 (K) /
/// 16 (V), so that K and V regions differ in size.
inline KvCacheConfig shape(std::size_t heads, KvCacheDtype dtype = KvCacheDtype::bf16,
                           KvCacheLayout layout = KvCacheLayout::layer_major,
                           std::size_t layers = 3) {
  KvCacheConfig c;
  c.num_layers = layers;
  c.block_size = 4;
  c.num_kv_heads = heads;
  c.head_dim_k = 32;
  c.head_dim_v = 16;
  c.dtype = dtype;
  c.layout = layout;
  return c;
}

/// A mixed-precision shape with scales and padding in some layers:
/// {bf16, nvfp4, turbo3, fp8_e4m3, turbo4}.
inline KvCacheConfig mixed_shape(std::size_t heads,
                                 KvCacheLayout layout = KvCacheLayout::layer_major) {
  KvCacheConfig c = shape(heads, KvCacheDtype::bf16, layout, 5);
  c.layer_dtypes = {KvCacheDtype::bf16, KvCacheDtype::nvfp4, KvCacheDtype::turbo3,
                    KvCacheDtype::fp8_e4m3, KvCacheDtype::turbo4};
  return c;
}

/// A PoolLayout by hand (every layer `dtype`).
inline PoolLayout make_layout(std::uint32_t layers, std::uint32_t heads,
                              KvCacheDtype dtype = KvCacheDtype::bf16,
                              KvCacheLayout layout = KvCacheLayout::layer_major,
                              std::uint32_t tp_rank = 0, std::uint32_t tp_size = 1,
                              std::uint64_t num_blocks = 64) {
  PoolLayout l;
  l.num_layers = layers;
  l.block_size = 16;
  l.num_kv_heads = heads;
  l.head_dim_k = 128;
  l.head_dim_v = 128;
  l.layer_dtypes.assign(layers, dtype);
  l.layout = layout;
  l.tp_rank = tp_rank;
  l.tp_size = tp_size;
  l.num_blocks = num_blocks;
  return l;
}

/// Tokens 1000, 1001, ... (n of them).
inline std::vector<TokenId> tokens_of(std::size_t n, TokenId first = 1000) {
  std::vector<TokenId> t(n);
  std::iota(t.begin(), t.end(), first);
  return t;
}

/// Copies remote -> local for every planned region with memcpy: a transfer
/// between two caches of one host backend, as a NIC would do it.
inline void copy_to_local(std::span<const TransferRegion> regions) {
  for (const TransferRegion& r : regions) {
    std::memcpy(reinterpret_cast<void*>(static_cast<std::uintptr_t>(r.local)),
                reinterpret_cast<const void*>(static_cast<std::uintptr_t>(r.remote)), r.bytes);
  }
}

/// A byte of `cache` (host backend) by address.
inline std::uint8_t* byte_at(DevicePtr p, std::size_t offset = 0) {
  return static_cast<std::uint8_t*>(p.get()) + offset;
}

}  // namespace kvport::transfer::test
