// SPDX-License-Identifier: Apache-2.0
// Block transfer over UCX: one Agent::post of a list of blocks
// read from (Transfer/read) or written to (Transfer/write) a peer agent,
// against the raw UCX figure of the same bytes and the memory limit, in the
// same iterations. Blocks: llama-3-8b (full attention, 2 MiB each) and
// gpt-oss-120b's sliding-window group (its 18 sliding layers, 576 KiB each).
//
//   ours    Agent::post(read or write) of `batch` blocks + wait: the
//           planner's merged regions (2 x layers per run of consecutive ids
//           in layer-major, one per run in block-major), one transfer, on the
//           transport's bulk path (KVPORT_UCX_BULK: the direct copy by
//           default, docs/transfer.md)
//   raw     Agent::read_scratch: ONE contiguous UCX read of the same bytes
//           between two registered scratch buffers (Transport::post_baseline:
//           UCX's own rendezvous read, never the direct copy; the baseline
//           `kvport disagg` reports). A READ for the write cases too: the
//           agent has no raw write
//   memcpy  std::memcpy of the same bytes between two host buffers (what a
//           copy through this machine's memory costs)
//
// Both agents live in this process, on 127.0.0.1, so the transport picks
// what it picks between processes on one host (see docs/performance.md).
// Block ids: the
// first `batch` ids (consecutive) or `batch` ids drawn at random from a
// 192-block cache (scattered), on both sides. Counters: bytes and regions per
// transfer; GBps (ours), raw_GBps, memcpy_GBps; ratio (ours over raw) and
// ratio_memcpy (ours over memcpy), from the summed times of the same
// iterations, each of which runs the three in turn (the first untimed).
#include <benchmark/benchmark.h>
#include <fmt/format.h>

#include <algorithm>
#include <chrono>
#include <cstring>
#include <memory>
#include <numeric>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "kvport/backends/host_backend.hpp"
#include "kvport/core/paged_kv_cache.hpp"
#include "kvport/platform/log.hpp"
#include "kvport/sim/model_presets.hpp"
#include "kvport/transfer/agent.hpp"

namespace {

using namespace kvport;
using namespace kvport::transfer;
using Clock = std::chrono::steady_clock;

constexpr std::size_t kCacheBlocks = 192;

struct Side {
  std::unique_ptr<Backend> backend = make_host_backend();
  PagedKvCache cache;
  std::unique_ptr<Agent> agent;
  Side(const KvCacheConfig& c, std::size_t scratch) : cache(c, kCacheBlocks, *backend) {
    AgentOptions o;
    o.scratch_bytes = scratch;
    agent = std::make_unique<Agent>(cache, o);
    for (std::size_t i = 0; i < kCacheBlocks; ++i)
      cache.alloc_block();
  }
};

double seconds_since(Clock::time_point t) {
  return std::chrono::duration<double>(Clock::now() - t).count();
}

void BM_Transfer(benchmark::State& state, Direction direction, KvCacheConfig config,
                 KvCacheLayout layout, bool scattered) {
  const auto batch = static_cast<std::size_t>(state.range(0));
  config.layout = layout;
  const std::size_t bytes = batch * config.bytes_per_block();
  Side dst(config, bytes);
  Side src(config, bytes);
  const PeerId peer = dst.agent->connect(src.agent->listen("127.0.0.1:0"));
  std::vector<BlockId> ids(kCacheBlocks);
  std::iota(ids.begin(), ids.end(), 0);
  std::vector<BlockId> local(ids.begin(), ids.begin() + static_cast<std::ptrdiff_t>(batch));
  std::vector<BlockId> remote = local;
  if (scattered) {
    std::mt19937 rng(42);
    std::shuffle(ids.begin(), ids.end(), rng);
    local.assign(ids.begin(), ids.begin() + static_cast<std::ptrdiff_t>(batch));
    std::shuffle(ids.begin(), ids.end(), rng);
    remote.assign(ids.begin(), ids.begin() + static_cast<std::ptrdiff_t>(batch));
  }
  std::vector<std::uint8_t> a(bytes, 1), b(bytes, 2);

  std::uint64_t regions = 0;
  auto ours = [&] {
    const auto before = dst.agent->counters().regions_posted;
    const auto t = Clock::now();
    const TransferId id = dst.agent->post(peer, direction, local, remote);
    regions += dst.agent->counters().regions_posted - before;
    if (dst.agent->wait(id, std::chrono::seconds(60)) != TransferState::done) {
      throw std::runtime_error("transfer failed: " + dst.agent->why(id));
    }
    const double s = seconds_since(t);
    dst.agent->release(id);
    return s;
  };
  auto raw = [&] { return dst.agent->read_scratch(peer, bytes); };
  auto copy = [&] {
    const auto t = Clock::now();
    std::memcpy(b.data(), a.data(), bytes);
    benchmark::ClobberMemory();
    return seconds_since(t);
  };
  ours();  // untimed: first touch, registration caches
  raw();
  copy();
  regions = 0;
  double ours_s = 0, raw_s = 0, copy_s = 0;
  std::uint64_t transfers = 0;
  for (auto _ : state) {
    const double o = ours();
    const double r = raw();
    const double c = copy();
    ours_s += o;
    raw_s += r;
    copy_s += c;
    ++transfers;
    state.SetIterationTime(o);
  }
  const double gb = static_cast<double>(bytes) * static_cast<double>(transfers) / 1e9;
  state.SetBytesProcessed(static_cast<std::int64_t>(bytes * transfers));
  state.counters["bytes"] = static_cast<double>(bytes);
  state.counters["regions"] = static_cast<double>(regions) / static_cast<double>(transfers);
  state.counters["GBps"] = gb / ours_s;
  state.counters["raw_GBps"] = gb / raw_s;
  state.counters["memcpy_GBps"] = gb / copy_s;
  state.counters["ratio"] = raw_s / ours_s;
  state.counters["ratio_memcpy"] = copy_s / ours_s;
}

void register_all() {
  log::set_level(log::Level::warn);
  // llama-3-8b: full attention, 32 layers x 8 KV heads x 128, 2 MiB a
  // block. gpt-oss-120b's sliding-window group: its 18 sliding layers (8 KV
  // heads x 64), 576 KiB a block, one of the two groups of its hybrid cache.
  const KvCacheConfig llama = sim::preset_config(*sim::find_model_preset("llama-3-8b"));
  KvCacheConfig swa = llama;
  swa.num_layers = 18;
  swa.num_kv_heads = 8;
  swa.head_dim_k = swa.head_dim_v = 64;
  const std::pair<const char*, KvCacheConfig> models[] = {{"llama-3-8b", llama},
                                                          {"gpt-oss-120b-swa-group", swa}};
  for (Direction direction : {Direction::read, Direction::write}) {
    for (const auto& [model, config] : models) {
      for (auto layout : {KvCacheLayout::layer_major, KvCacheLayout::block_major}) {
        for (bool scattered : {false, true}) {
          const std::string name =
              fmt::format("Transfer/{}/{}/{}/{}", to_string(direction), model, to_string(layout),
                          scattered ? "scattered" : "consecutive");
          benchmark::RegisterBenchmark(name.c_str(), BM_Transfer, direction, config, layout,
                                       scattered)
              ->Arg(16)
              ->Arg(64)
              ->UseManualTime()
              ->Unit(benchmark::kMillisecond);
        }
      }
    }
  }
}

const int registered = (register_all(), 0);

}  // namespace
