// SPDX-License-Identifier: Apache-2.0
// The host tier's copies: offload (device -> host) and onload
// (host -> device) of a batch of scattered blocks between a PagedKvCache and
// page-first host slots, the way HostTier copies them, against the limit in
// the same run.
//
//   ours   the regions of every block of the batch (HostTier::
//          append_block_regions: each layer's K then V, coalesced; one region
//          per block in block_major, 2 x layers in layer_major) built into
//          consecutive host slots, then ONE copy_batch_d2h_async /
//          copy_batch_h2d_async call
//   limit  one contiguous copy_d2h_async / copy_h2d_async of the same bytes
//          between a device buffer and the same host slots: the practical
//          limit of the link (on the host backend, of memcpy)
//
// Host slots come from Backend::alloc_host (pinned on GPUs). Block ids are
// `batch` distinct ids drawn at random (a fixed seed) from the whole cache:
// 1024 blocks for llama-3-8b (2 MiB each: 2 GiB of pools), 512 for
// llama-3-70b (5 MiB each: 2.5 GiB of pools), so pools stay under 3 GiB.
// With the limit's device buffer and the host slots (each the size of the
// largest batch), the 70B bench holds 5 GiB while it is alive; one bench is
// alive at a time.
//
// The benchmark's time is the device time (timing events) of one iteration
// of both strategies (manual time), as in zeroing_bench.cpp; ours includes
// building the regions (host work between its timing events: what the tier
// pays per batch). Both run once untimed first, then in every iteration,
// alternating which goes first. Counters: bytes and regions per batch;
// bytes_per_second and GBps (ours), limit_GBps, ratio (ours over limit, from
// the summed times of the same iterations); seconds and limit_seconds per
// batch; the host seconds per batch ours spends building its regions
// (build_seconds) and inside the batch call (call_seconds: the backend's
// checks and queueing); and calls_per_batch, the backend calls ours makes per
// batch: it must be 1, a copy_host_batch call, or the case fails with an
// error.
//
// Runs on every compiled backend that has a device (host always).
#include <benchmark/benchmark.h>
#include <fmt/format.h>

#include <algorithm>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <numeric>
#include <optional>
#include <random>
#include <stdexcept>
#include <string>
#include <vector>

#include "kvport/core/host_tier.hpp"
#include "kvport/core/paged_kv_cache.hpp"
#include "kvport/platform/backend.hpp"
#include "kvport/platform/device_buffer.hpp"
#include "kvport/platform/error.hpp"
#include "kvport/platform/log.hpp"
#include "kvport/platform/registry.hpp"
#include "kvport/sim/model_presets.hpp"

namespace kvport::bench {
namespace {

constexpr std::size_t kMaxBatch = 256;
constexpr std::uint32_t kSeed = 12;
using Clock = std::chrono::steady_clock;

struct TierShape {
  std::string name;
  KvCacheConfig config;
  std::size_t num_blocks;
};

std::vector<TierShape> tier_shapes() {
  auto preset = [](const char* name) {
    const std::optional<sim::ModelPreset> found = sim::find_model_preset(name);
    if (!found) throw std::logic_error("host_tier_bench: a model preset is missing");
    return sim::preset_config(*found);  // bf16, 16 tokens per block
  };
  return {{"llama-3-8b", preset("llama-3-8b"), 1024}, {"llama-3-70b", preset("llama-3-70b"), 512}};
}

enum class Direction { offload, onload };

const char* to_string(Direction d) {
  return d == Direction::offload ? "offload" : "onload";
}

struct HostMemory {
  Backend* backend = nullptr;
  void operator()(std::byte* p) const noexcept { backend->free_host(p); }
};

// One cache of a shape and layout, host slots for kMaxBatch blocks and the
// limit's device buffer of the same size, all touched once before any
// measurement (no first-touch page faults in a timed copy).
class TierBench {
 public:
  TierBench(Backend& backend, const TierShape& shape, KvCacheLayout layout)
      : backend_(backend),
        stream_(backend.create_stream()),
        start_(backend.create_timing_event()),
        stop_(backend.create_timing_event()) {
    KvCacheConfig config = shape.config;
    config.layout = layout;
    cache_ = std::make_unique<PagedKvCache>(config, shape.num_blocks, backend,
                                            PagedKvCacheOptions{false});
    slot_bytes_ = HostTier::slot_bytes_for(*cache_);
    const std::size_t bytes = kMaxBatch * slot_bytes_;
    host_.reset(static_cast<std::byte*>(backend.alloc_host(bytes)));
    host_.get_deleter().backend = &backend;
    limit_ = DeviceBuffer(backend, bytes);
    std::vector<BlockId> all(cache_->num_blocks());
    std::iota(all.begin(), all.end(), BlockId{0});
    cache_->zero_blocks(all, stream_);
    backend.memset_async(limit_.ptr(), 0, bytes, stream_);
    std::memset(host_.get(), 0, bytes);
    stream_.synchronize();
    regions_.reserve(kMaxBatch * cache_->memory_pools().size());
  }

  // `batch` distinct ids, drawn at random from the whole cache.
  std::vector<BlockId> ids(std::size_t batch) const {
    std::vector<BlockId> all(cache_->num_blocks());
    std::iota(all.begin(), all.end(), BlockId{0});
    std::mt19937 rng(kSeed);
    std::shuffle(all.begin(), all.end(), rng);
    all.resize(batch);
    return all;
  }

  std::size_t slot_bytes() const { return slot_bytes_; }
  std::size_t regions() const { return regions_.size(); }
  // Host seconds ours spent building regions and in the batch call (its
  // checks and queueing), summed since the last reset.
  double build_seconds() const { return build_s_; }
  double call_seconds() const { return call_s_; }
  void reset_host_seconds() { build_s_ = call_s_ = 0; }

  // Device seconds of ours: the regions built, one batch call.
  double run_ours(const std::vector<BlockId>& ids, Direction d) {
    return timed([&] {
      const auto t0 = Clock::now();
      regions_.clear();
      for (std::size_t i = 0; i < ids.size(); ++i)
        HostTier::append_block_regions(*cache_, ids[i], host_.get() + i * slot_bytes_, regions_);
      const auto t1 = Clock::now();
      if (d == Direction::offload) {
        backend_.copy_batch_d2h_async(regions_, stream_);
      } else {
        backend_.copy_batch_h2d_async(regions_, stream_);
      }
      const auto t2 = Clock::now();
      build_s_ += std::chrono::duration<double>(t1 - t0).count();
      call_s_ += std::chrono::duration<double>(t2 - t1).count();
    });
  }

  // Device seconds of one contiguous copy of `bytes`.
  double run_limit(std::size_t bytes, Direction d) {
    return timed([&] {
      if (d == Direction::offload) {
        backend_.copy_d2h_async(host_.get(), limit_.ptr(), bytes, stream_);
      } else {
        backend_.copy_h2d_async(limit_.ptr(), host_.get(), bytes, stream_);
      }
    });
  }

 private:
  template <class Work>
  double timed(Work&& work) {
    start_.record(stream_);
    work();
    stop_.record(stream_);
    const double seconds = backend_.elapsed_seconds(start_, stop_);
    stream_.synchronize();
    return seconds;
  }

  Backend& backend_;
  Stream stream_;
  Event start_, stop_;
  std::unique_ptr<PagedKvCache> cache_;
  std::size_t slot_bytes_ = 0;
  std::unique_ptr<std::byte, HostMemory> host_;
  DeviceBuffer limit_;
  std::vector<HostCopyRegion> regions_;
  double build_s_ = 0, call_s_ = 0;
};

// One bench alive at a time (the 70B one holds 5 GiB). Benchmarks are
// registered grouped by (backend, shape, layout), so each is built once.
struct Current {
  std::string key;
  std::unique_ptr<Backend> backend;
  std::unique_ptr<TierBench> bench;
};

Current& current() {
  static Current c;
  return c;
}

TierBench& bench_for(const std::string& backend, const TierShape& shape, KvCacheLayout layout) {
  Current& c = current();
  const std::string key = fmt::format("{}/{}/{}", backend, shape.name, to_string(layout));
  if (c.key != key) {
    c.bench.reset();
    c.key.clear();
    if (!c.backend || c.backend->name() != backend) c.backend = make_backend(backend);
    c.bench = std::make_unique<TierBench>(*c.backend, shape, layout);
    c.key = key;
  }
  return *c.bench;
}

void host_tier(benchmark::State& state, std::string backend, TierShape shape, KvCacheLayout layout,
               Direction direction) {
  const auto batch = static_cast<std::size_t>(state.range(0));
  TierBench* bench = nullptr;
  try {
    bench = &bench_for(backend, shape, layout);
  } catch (const Error& e) {
    state.SkipWithError(fmt::format("setting up: {}", e.what()).c_str());
    return;
  }
  Backend& b = *current().backend;
  const std::vector<BlockId> ids = bench->ids(batch);
  const std::size_t bytes = batch * bench->slot_bytes();
  // One untimed run of each first: the 256-block cases may run a single
  // iteration, and its first copy would pay for the caches and TLB entries
  // the previous case left behind.
  bench->run_ours(ids, direction);
  bench->run_limit(bytes, direction);
  bench->reset_host_seconds();
  double ours_s = 0, limit_s = 0;
  std::uint64_t ours_calls = 0, ours_batch_calls = 0;
  bool ours_first = true;
  for (auto _ : state) {
    double o = 0, l = 0;
    if (!ours_first) l = bench->run_limit(bytes, direction);
    const CallCounts before = b.call_counts();
    o = bench->run_ours(ids, direction);
    const CallCounts after = b.call_counts();
    if (ours_first) l = bench->run_limit(bytes, direction);
    ours_first = !ours_first;
    ours_calls += after.device_ops() - before.device_ops();
    ours_batch_calls += after.copy_host_batch - before.copy_host_batch;
    state.SetIterationTime(o + l);
    ours_s += o;
    limit_s += l;
  }
  const double n = static_cast<double>(state.iterations());
  const double total = static_cast<double>(bytes) * n;
  // No SetBytesProcessed: over the manual time (both strategies) it would be
  // neither one's throughput.
  state.counters["bytes"] = static_cast<double>(bytes);
  state.counters["regions"] = static_cast<double>(bench->regions());
  state.counters["bytes_per_second"] = total / ours_s;
  state.counters["GBps"] = total / ours_s / 1e9;
  state.counters["limit_GBps"] = total / limit_s / 1e9;
  state.counters["ratio"] = limit_s / ours_s;
  state.counters["seconds"] = ours_s / n;
  state.counters["limit_seconds"] = limit_s / n;
  state.counters["build_seconds"] = bench->build_seconds() / n;
  state.counters["call_seconds"] = bench->call_seconds() / n;
  state.counters["calls_per_batch"] = static_cast<double>(ours_calls) / n;
  if (ours_calls != ours_batch_calls ||
      ours_batch_calls != static_cast<std::uint64_t>(state.iterations())) {
    state.SkipWithError(fmt::format("{} backend calls ({} copy_host_batch) in {} batches: "
                                    "expected exactly one copy_host_batch call per batch",
                                    ours_calls, ours_batch_calls, state.iterations())
                            .c_str());
  }
}

// Registered before main() runs, for every backend with a device. The
// library's info lines ("KV cache on host: ...") would drown the table.
const bool registered = [] {
  if (std::getenv("KVPORT_LOG_LEVEL") == nullptr) log::set_level(log::Level::warn);
  for (const BackendInfo& info : compiled_backends()) {
    if (!info.available) continue;
    for (const TierShape& shape : tier_shapes()) {
      for (KvCacheLayout layout : {KvCacheLayout::layer_major, KvCacheLayout::block_major}) {
        for (Direction direction : {Direction::offload, Direction::onload}) {
          const std::string name = fmt::format("HostTier/{}/{}/{}/{}", info.name,
                                               to_string(direction), shape.name, to_string(layout));
          benchmark::RegisterBenchmark(name.c_str(), host_tier, info.name, shape, layout, direction)
              ->Arg(1)
              ->Arg(16)
              ->Arg(256)
              ->UseManualTime()
              ->Unit(benchmark::kMicrosecond);
        }
      }
    }
  }
  return true;
}();

}  // namespace
}  // namespace kvport::bench
