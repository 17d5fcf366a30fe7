// SPDX-License-Identifier: Apache-2.0
#include "kvport/sim/zeroing.hpp"

#include <algorithm>
#include <numeric>
#include <random>
#include <stdexcept>
#include <string_view>

#include "kvport/platform/error.hpp"
#include "kvport/sim/model_presets.hpp"

namespace kvport::sim {
namespace {

KvCacheConfig preset(std::string_view name) {
  const std::optional<ModelPreset> found = find_model_preset(name);
  if (!found) throw std::logic_error("zeroing_shapes: a model preset is missing");
  return preset_config(*found);
}

}  // namespace

std::vector<ZeroingShape> zeroing_shapes() {
  KvCacheConfig mixed = preset("llama-3-8b");
  mixed.dtype = KvCacheDtype::fp8_e4m3;
  mixed.layer_dtypes.assign(mixed.num_layers, KvCacheDtype::fp8_e4m3);
  mixed.layer_dtypes.front() = mixed.layer_dtypes.back() = KvCacheDtype::bf16;
  return {{"llama-3-8b", preset("llama-3-8b")},
          {"llama-3-70b", preset("llama-3-70b")},
          {"llama-3-8b-mixed", mixed}};
}

const char* to_string(IdPattern ids) noexcept {
  return ids == IdPattern::contiguous ? "contiguous" : "scattered";
}

ZeroingBench::ZeroingBench(Backend& backend, const ZeroingShape& shape, KvCacheLayout layout,
                           std::size_t max_batch)
    : backend_(backend),
      model_(shape.name),
      layout_(layout),
      stream_(backend.create_stream()),
      start_(backend.create_timing_event()),
      stop_(backend.create_timing_event()) {
  if (max_batch == 0) throw InvalidArgument("ZeroingBench: max_batch must be > 0");
  KvCacheConfig config = shape.config;
  config.layout = layout;
  bytes_per_block_ = config.bytes_per_block();
  cache_ =
      std::make_unique<PagedKvCache>(config, 2 * max_batch, backend, PagedKvCacheOptions{false});
  limit_buffer_ = DeviceBuffer(backend, bytes_per_batch(max_batch));
  // First touch, outside every measurement.
  std::vector<BlockId> all(2 * max_batch);
  std::iota(all.begin(), all.end(), BlockId{0});
  cache_->zero_blocks(all, stream_);
  backend.memset_async(limit_buffer_.ptr(), 0, limit_buffer_.size(), stream_);
  stream_.synchronize();
}

std::vector<BlockId> ZeroingBench::ids(std::size_t batch, IdPattern pattern,
                                       std::uint32_t seed) const {
  if (2 * batch > cache_->num_blocks()) {
    throw InvalidArgument("ZeroingBench::ids: batch larger than the bench was built for");
  }
  std::vector<BlockId> out(batch);
  if (pattern == IdPattern::contiguous) {
    std::iota(out.begin(), out.end(), BlockId{0});
    return out;
  }
  for (std::size_t i = 0; i < batch; ++i)
    out[i] = static_cast<BlockId>(2 * i);
  std::mt19937 rng(seed);
  std::shuffle(out.begin(), out.end(), rng);
  return out;
}

template <class Work>
StrategyResult ZeroingBench::timed(std::size_t bytes, Work&& work) {
  const CallCounts before = backend_.call_counts();
  start_.record(stream_);
  work();
  stop_.record(stream_);
  StrategyResult r;
  r.seconds = backend_.elapsed_seconds(start_, stop_);
  stream_.synchronize();
  r.calls = static_cast<double>(backend_.call_counts().device_ops() - before.device_ops());
  r.bytes_per_s = r.seconds > 0 ? static_cast<double>(bytes) / r.seconds : 0;
  return r;
}

StrategyResult ZeroingBench::run_reference(const std::vector<BlockId>& ids) {
  PagedKvCache& c = *cache_;
  return timed(bytes_per_batch(ids.size()), [&] {
    // One memset per block, layer and part, as the reference zeroes.
    for (BlockId id : ids) {
      for (std::size_t layer = 0; layer < c.num_layers(); ++layer) {
        for (KvPart part : kKvParts) {
          if (part == KvPart::v && !c.config().has_v()) continue;
          const DeviceRegion r = c.pool(layer, part).region(id);
          backend_.memset_async(r.ptr, 0, r.bytes, stream_);
        }
      }
    }
  });
}

StrategyResult ZeroingBench::run_batched(const std::vector<BlockId>& ids) {
  return timed(bytes_per_batch(ids.size()), [&] { cache_->zero_blocks(ids, stream_); });
}

StrategyResult ZeroingBench::run_limit(std::size_t bytes) {
  if (bytes > limit_buffer_.size()) {
    throw InvalidArgument("ZeroingBench::run_limit: more bytes than the bench was built for");
  }
  return timed(bytes, [&] { backend_.memset_async(limit_buffer_.ptr(), 0, bytes, stream_); });
}

ZeroingResult ZeroingBench::measure(std::size_t batch, IdPattern pattern, int repetitions) {
  if (repetitions <= 0) throw InvalidArgument("ZeroingBench::measure: repetitions must be > 0");
  ZeroingResult result;
  result.block_ids = ids(batch, pattern);
  result.num_blocks = cache_->num_blocks();
  const std::vector<BlockId>& block_ids = result.block_ids;
  result.model = model_;
  result.layout = layout_;
  result.batch = batch;
  result.ids = pattern;
  result.bytes = bytes_per_batch(batch);
  StrategyResult* sums[] = {&result.reference, &result.batched, &result.limit};
  auto add = [](StrategyResult& sum, const StrategyResult& r) {
    sum.seconds += r.seconds;
    sum.calls += r.calls;
  };
  for (int rep = 0; rep < repetitions; ++rep) {
    // Rotate the order so that no strategy always runs on a warm cache.
    for (int k = 0; k < 3; ++k) {
      switch ((rep + k) % 3) {
        case 0:
          add(result.reference, run_reference(block_ids));
          break;
        case 1:
          add(result.batched, run_batched(block_ids));
          break;
        case 2:
          add(result.limit, run_limit(result.bytes));
          break;
      }
    }
  }
  for (StrategyResult* s : sums) {
    s->seconds /= repetitions;
    s->calls /= repetitions;
    s->bytes_per_s = s->seconds > 0 ? static_cast<double>(result.bytes) / s->seconds : 0;
  }
  return result;
}

}  // namespace kvport::sim
