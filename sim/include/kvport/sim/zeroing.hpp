// SPDX-License-Identifier: Apache-2.0
// Block-zeroing measurements shared by the Google Benchmark suite
// (benchmarks/zeroing_bench.cpp) and `kvport bench`: three strategies on the
// same cache, timed with device timing events in the same run.
//
//   reference  the reference implementation's way: one memset per layer for K
//              and one for V, for each block (2 x layers x blocks calls)
//   batched    PagedKvCache::zero_blocks: one backend call per batch
//   limit      one contiguous memset of the same number of bytes: the
//              practical limit of the device
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "kvport/core/paged_kv_cache.hpp"
#include "kvport/platform/backend.hpp"

namespace kvport::sim {

/// A model shape the zeroing benchmarks run on.
struct ZeroingShape {
  std::string name;  ///< "llama-3-8b", "llama-3-70b", "llama-3-8b-mixed"
  KvCacheConfig config;
};

/// llama-3-8b and llama-3-70b from the model presets (model_presets.hpp;
/// bf16, 16 tokens per block), and llama-3-8b-mixed (llama-3-8b with bf16
/// first and last layers, fp8_e4m3 elsewhere).
std::vector<ZeroingShape> zeroing_shapes();

enum class IdPattern { contiguous, scattered };
const char* to_string(IdPattern ids) noexcept;

/// One strategy's figures, averaged over the repetitions.
struct StrategyResult {
  double seconds = 0;  ///< device time per batch
  double bytes_per_s = 0;
  double calls = 0;  ///< backend contract calls per batch
};

struct ZeroingResult {
  std::string model;
  KvCacheLayout layout = KvCacheLayout::layer_major;
  std::size_t batch = 0;
  IdPattern ids = IdPattern::contiguous;
  std::size_t bytes = 0;           ///< bytes zeroed per batch (all layers, K + V)
  std::vector<BlockId> block_ids;  ///< the ids zeroed, in the order zeroed
  std::size_t num_blocks = 0;      ///< blocks in the bench's cache (2 x its max batch)
  StrategyResult reference, batched, limit;

  double batched_over_limit() const { return batched.bytes_per_s / limit.bytes_per_s; }
  double batched_over_reference() const { return batched.bytes_per_s / reference.bytes_per_s; }
};

/// One cache of a shape and layout on a backend, with room for batches of up
/// to `max_batch` scattered blocks (2 x max_batch blocks), and a buffer of the
/// same byte count for the limit strategy. Every byte is touched once at
/// construction, so no measurement pays first-touch page faults.
class ZeroingBench {
 public:
  ZeroingBench(Backend& backend, const ZeroingShape& shape, KvCacheLayout layout,
               std::size_t max_batch);

  /// `batch` block ids: 0..batch-1, or every other block in a shuffled order
  /// (no two ids adjacent, so nothing coalesces). Deterministic per seed.
  std::vector<BlockId> ids(std::size_t batch, IdPattern pattern, std::uint32_t seed = 1) const;

  /// Device seconds of one batch of each strategy (timing events around the
  /// work on one stream; includes the host time to issue the calls when the
  /// device would otherwise wait for them).
  StrategyResult run_reference(const std::vector<BlockId>& ids);
  StrategyResult run_batched(const std::vector<BlockId>& ids);
  StrategyResult run_limit(std::size_t bytes);

  /// All three strategies, `repetitions` times each in rotating order.
  ZeroingResult measure(std::size_t batch, IdPattern pattern, int repetitions);

  std::size_t bytes_per_batch(std::size_t batch) const { return batch * bytes_per_block_; }
  PagedKvCache& cache() { return *cache_; }
  Backend& backend() { return backend_; }

 private:
  template <class Work>
  StrategyResult timed(std::size_t bytes, Work&& work);

  Backend& backend_;
  std::string model_;
  KvCacheLayout layout_;
  std::size_t bytes_per_block_;
  std::unique_ptr<PagedKvCache> cache_;
  DeviceBuffer limit_buffer_;
  Stream stream_;
  Event start_, stop_;
};

}  // namespace kvport::sim
