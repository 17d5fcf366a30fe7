// SPDX-License-Identifier: Apache-2.0
// Helpers shared by the core unit tests: configs with hand-computed sizes, a
// host backend of known capacity, log capture with levels, host patterns.
#pragma once

#include <gtest/gtest.h>

#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <functional>
#include <memory>
#include <numeric>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "kvport/backends/host_backend.hpp"
#include "kvport/core/block_hash.hpp"
#include "kvport/core/hybrid_kv_cache.hpp"
#include "kvport/core/kv_cache_config.hpp"
#include "kvport/core/paged_kv_cache.hpp"
#include "kvport/platform/error.hpp"
#include "kvport/platform/log.hpp"
#include "kvport/testing/support.hpp"

namespace kvport::test {

using kvport::testing::ScopedEnv;

inline constexpr std::size_t kMiB = std::size_t{1} << 20;

/// A host backend whose capacity does not depend on KVPORT_HOST_MEMORY or RAM.
inline std::unique_ptr<Backend> host_backend(std::size_t capacity = 256 * kMiB) {
  return make_host_backend(HostBackendOptions{capacity});
}

/// llama-3-8b's KV shape: 32 layers, 8 KV heads, head_dim 128, bf16, block 16.
/// K (and V) of one block of one layer: 16 * 8 * 128 * 2 = 32768 bytes.
inline KvCacheConfig llama3_8b_config() {
  KvCacheConfig c;
  c.num_layers = 32;
  c.block_size = 16;
  c.num_kv_heads = 8;
  c.head_dim_k = 128;
  c.head_dim_v = 128;
  c.dtype = KvCacheDtype::bf16;
  return c;
}

/// A small config: 3 layers, block 4, 2 heads, head_dim 8, bf16.
/// K (and V) of one block of one layer: 4 * 2 * 8 * 2 = 128 bytes.
inline KvCacheConfig small_config(KvCacheLayout layout = KvCacheLayout::layer_major) {
  KvCacheConfig c;
  c.num_layers = 3;
  c.block_size = 4;
  c.num_kv_heads = 2;
  c.head_dim_k = 8;
  c.head_dim_v = 8;
  c.dtype = KvCacheDtype::bf16;
  c.layout = layout;
  return c;
}

/// A mixed-precision config with head_dim_k != head_dim_v:
/// 3 layers, block 4, 2 heads, head_dim_k 32, head_dim_v 16,
/// layer dtypes {bf16, turbo3, fp8_e4m3}. Sizes (by hand, E = 4*2*hd):
///   layer 0 bf16:   K = 2*256 = 512          V = 2*128 = 256
///   layer 1 turbo3: K = 96 data + 0 pad + 16 scales + 0 pad = 112
///                   V = 48 data + 0 pad + 16 scales + 0 pad = 64
///   layer 2 fp8:    K = 256                  V = 128
/// bytes_per_block = 768 + 176 + 384 = 1328.
inline KvCacheConfig mixed_config(KvCacheLayout layout = KvCacheLayout::layer_major) {
  KvCacheConfig c;
  c.num_layers = 3;
  c.block_size = 4;
  c.num_kv_heads = 2;
  c.head_dim_k = 32;
  c.head_dim_v = 16;
  c.dtype = KvCacheDtype::bf16;
  c.layer_dtypes = {KvCacheDtype::bf16, KvCacheDtype::turbo3, KvCacheDtype::fp8_e4m3};
  c.layout = layout;
  return c;
}
inline constexpr std::size_t kMixedK[] = {512, 112, 256};
inline constexpr std::size_t kMixedV[] = {256, 64, 128};
inline constexpr std::size_t kMixedBytesPerBlock = 1328;

/// Expects `fn` to throw InvalidArgument whose message contains `needle`.
template <class Fn>
void expect_invalid_argument(Fn&& fn, std::string_view needle) {
  const std::string message = kvport::testing::message_of<InvalidArgument>(std::forward<Fn>(fn));
  EXPECT_NE(message.find(needle), std::string::npos)
      << "expected InvalidArgument mentioning '" << needle << "', got message '" << message << "'";
}

/// Captures log messages with their level; restores the previous sink and
/// log level on destruction. Sets the level to `level` so that captured
/// messages do not depend on KVPORT_LOG_LEVEL.
class LogRecorder {
 public:
  struct Message {
    log::Level level;
    std::string text;
  };

  explicit LogRecorder(log::Level level = log::Level::info) : saved_level_(log::level()) {
    log::set_level(level);
    previous_ = log::set_sink([this](log::Level lvl, std::string_view text) {
      messages_.push_back(Message{lvl, std::string(text)});
    });
  }
  ~LogRecorder() {
    log::set_sink(std::move(previous_));
    log::set_level(saved_level_);
  }
  LogRecorder(const LogRecorder&) = delete;
  LogRecorder& operator=(const LogRecorder&) = delete;

  const std::vector<Message>& messages() const { return messages_; }

  /// Messages at `level` containing `needle`.
  std::vector<std::string> find(log::Level level, std::string_view needle) const {
    std::vector<std::string> out;
    for (const Message& m : messages_) {
      if (m.level == level && m.text.find(needle) != std::string::npos) out.push_back(m.text);
    }
    return out;
  }

 private:
  log::Level saved_level_;
  log::Sink previous_;
  std::vector<Message> messages_;
};

/// Silences kvport's log for a scope (model tests provoke thousands of
/// deliberate double frees).
class QuietLog {
 public:
  QuietLog() : saved_(log::level()) { log::set_level(log::Level::off); }
  ~QuietLog() { log::set_level(saved_); }
  QuietLog(const QuietLog&) = delete;
  QuietLog& operator=(const QuietLog&) = delete;

 private:
  log::Level saved_;
};

/// A byte pattern unique to (block, layer, K/V, offset), never 0x00 or 0xFF,
/// so that zeroing or poisoning the wrong bytes shows up.
inline std::uint8_t pattern_byte(std::size_t block, std::size_t layer, bool is_v,
                                 std::size_t offset) {
  const std::size_t h = block * 131 + layer * 31 + (is_v ? 17 : 0) + offset * 7;
  return static_cast<std::uint8_t>(1 + h % 253);
}

inline std::vector<std::uint8_t> pattern(std::size_t bytes, std::size_t block, std::size_t layer,
                                         bool is_v) {
  std::vector<std::uint8_t> out(bytes);
  for (std::size_t i = 0; i < bytes; ++i)
    out[i] = pattern_byte(block, layer, is_v, i);
  return out;
}

/// Writes pattern(…, tag, layer, K/V) into every layer's K and V of `block`
/// (PagedKvCache::write_block, which synchronizes).
inline void write_pattern_block(PagedKvCache& cache, BlockId block, std::size_t tag,
                                StreamView stream) {
  for (std::size_t layer = 0; layer < cache.num_layers(); ++layer) {
    cache.write_block(layer, block, pattern(cache.k_block_bytes(layer), tag, layer, false),
                      pattern(cache.v_block_bytes(layer), tag, layer, true), stream);
  }
}

/// Whether every layer's K and V of `block` hold the pattern of `tag`.
inline bool holds_pattern_block(const PagedKvCache& cache, BlockId block, std::size_t tag,
                                StreamView stream) {
  for (std::size_t layer = 0; layer < cache.num_layers(); ++layer) {
    const PagedKvCache::HostBlock b = cache.read_block(layer, block, stream);
    if (b.k != pattern(cache.k_block_bytes(layer), tag, layer, false)) return false;
    if (b.v != pattern(cache.v_block_bytes(layer), tag, layer, true)) return false;
  }
  return true;
}

/// Expects `tier` (a HostTier, HybridHostTier or anything with
/// check_invariants() returning an InvariantReport) to be consistent.
#define EXPECT_TIER_INVARIANTS(tier)                      \
  do {                                                    \
    const InvariantReport r_ = (tier).check_invariants(); \
    EXPECT_TRUE(r_.ok) << r_.to_string();                 \
  } while (0)

/// `n` consecutive token ids from `first`.
inline std::vector<TokenId> tokens(std::size_t n, TokenId first = 1) {
  std::vector<TokenId> t(n);
  std::iota(t.begin(), t.end(), first);
  return t;
}

/// The host-tier tests' sequence `k`: the chained hashes of `blocks` full
/// blocks of 4 tokens from 1000 * k (small_config's block size).
inline std::vector<BlockHash> seq_hashes(std::size_t k, std::size_t blocks = 2) {
  return hash_full_blocks(tokens(4 * blocks, static_cast<TokenId>(1000 * k)), 4);
}

/// The pattern tag of block `i` of sequence `k` (write_pattern_block).
inline std::size_t tag_of(std::size_t k, std::size_t i) {
  return 10 * k + i;
}

/// Tokens per block of three_group_config().
inline constexpr std::size_t kHybridBlockSize = 4;

/// A hybrid model of three KV cache groups at kHybridBlockSize tokens a
/// block: group 0 full attention, group 1 a window of 8 tokens (2 blocks),
/// group 2 a recurrent state, checkpointed at every block.
inline HybridKvCacheConfig three_group_config() {
  HybridKvCacheConfig c;
  c.block_size = kHybridBlockSize;
  c.layers = {LayerSpec::full_attention(1, 8, 8), LayerSpec::sliding_window(8, 1, 8, 8),
              LayerSpec::recurrent_state({StateTensor{"s", {16}, StateDtype::f32}})};
  c.state_checkpoint_interval = 1;
  return c;
}

/// Memory an engine allocated for a cache's pools (host memory, as NumPy
/// arrays or CPU tensors of an engine on the host backend), for the adopting
/// PagedKvCache constructor. Freed at destruction: declare it before the
/// caches that adopt it.
class EngineMemory {
 public:
  EngineMemory() = default;
  EngineMemory(const EngineMemory&) = delete;
  EngineMemory& operator=(const EngineMemory&) = delete;

  /// One new buffer per pool of `config` with `num_blocks` blocks, of exactly
  /// PagedKvCache::adopted_pool_bytes, 256-byte aligned.
  std::vector<AdoptedPool> pools_for(const KvCacheConfig& config, std::size_t num_blocks) {
    std::vector<AdoptedPool> pools;
    for (std::size_t bytes : PagedKvCache::adopted_pool_bytes(config, num_blocks)) {
      void* p = std::aligned_alloc(256, (bytes + 255) / 256 * 256);
      if (p == nullptr) throw std::bad_alloc();
      buffers_.emplace_back(p);
      pools.push_back(AdoptedPool{DevicePtr::from(p), bytes});
    }
    return pools;
  }

 private:
  struct Free {
    void operator()(void* p) const noexcept { std::free(p); }
  };
  std::vector<std::unique_ptr<void, Free>> buffers_;
};

/// A cache over pools `backend` allocates (engine == nullptr) or over the
/// engine's memory (adopted): the same operations must behave the same.
inline PagedKvCache make_cache(KvCacheConfig config, std::size_t num_blocks, Backend& backend,
                               EngineMemory* engine, PagedKvCacheOptions options = {}) {
  if (engine == nullptr) return PagedKvCache(std::move(config), num_blocks, backend, options);
  const std::vector<AdoptedPool> pools = engine->pools_for(config, num_blocks);
  return PagedKvCache(std::move(config), num_blocks, backend, pools, options);
}

}  // namespace kvport::test
