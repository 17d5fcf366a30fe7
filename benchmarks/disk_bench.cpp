// SPDX-License-Identifier: Apache-2.0
// The disk tier's block I/O against the file system's limit, in the same run:
// DiskStore writes (put) and reads (get_prefix) of 1, 16 and 256 blocks in
// scattered slots of a full store, each beside fio doing direct sequential
// I/O of the same bytes, in the same block size, at the same queue depth, on
// the same file system (ratio = ours / fio); reads also beside fio's random
// reads of the store's own data file, the same bytes (ratio_vs_fio_random:
// what scattered slots of that file allow). Blocks are llama-3-8b's (2 MiB)
// and llama-3-70b's (5 MiB) images, 16 tokens of bf16.
//
//   build/host/bin/kvport_disk_bench                     # 512 slots a model
//   KVPORT_DISK_BENCH_DIR=/mnt/nvme/x KVPORT_DISK_BENCH_SLOTS=1024 build/host/bin/kvport_disk_bench
//
// The store lives in a fresh directory under KVPORT_DISK_BENCH_DIR (default:
// the system's temporary directory), removed at the end.
#include <benchmark/benchmark.h>
#include <stdlib.h>
#include <sys/statfs.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <map>
#include <memory>
#include <nlohmann/json.hpp>
#include <random>
#include <string>
#include <vector>

#include "kvport/core/kv_cache_config.hpp"
#include "kvport/disk/disk_store.hpp"

namespace {

using kvport::BlockHash;
using kvport::KvCacheConfig;
using kvport::disk::DiskStore;
using kvport::disk::DiskStoreOptions;
namespace fs = std::filesystem;

constexpr std::size_t kQueueDepth = 16;

KvCacheConfig model(int which) {
  KvCacheConfig c;
  c.num_layers = which == 0 ? 32 : 80;  // llama-3-8b, llama-3-70b
  c.block_size = 16;
  c.num_kv_heads = 8;
  c.head_dim_k = 128;
  c.head_dim_v = 128;
  return c;
}

std::size_t env_size(const char* name, std::size_t fallback) {
  const char* v = std::getenv(name);
  return v != nullptr && *v != '\0' ? std::strtoull(v, nullptr, 10) : fallback;
}

struct AlignedFree {
  void operator()(std::byte* p) const noexcept { std::free(p); }
};

// One full store per model, shared by the benchmarks, with its directory.
struct Bed {
  fs::path dir;
  std::unique_ptr<DiskStore> store;
  std::size_t block_bytes = 0;
  std::vector<BlockHash> stored;                   // what is in the store
  std::unique_ptr<std::byte, AlignedFree> images;  // 256 aligned block images
  std::uint64_t next = 1;
  std::mt19937_64 rng{42};

  BlockHash fresh() { return BlockHash{next++ * 0x9E3779B97F4A7C15ull, 0x5EED}; }
  std::byte* image(std::size_t k) const { return images.get() + k * block_bytes; }

  ~Bed() {
    store.reset();
    std::error_code ec;
    fs::remove_all(dir, ec);
  }
};

std::map<int, std::unique_ptr<Bed>>& beds() {
  static std::map<int, std::unique_ptr<Bed>> b;
  return b;
}

fs::path base_dir() {
  const char* d = std::getenv("KVPORT_DISK_BENCH_DIR");
  return d != nullptr && *d != '\0' ? fs::path(d) : fs::temp_directory_path();
}

Bed& bed(int which) {
  auto& b = beds()[which];
  if (b) return *b;
  b = std::make_unique<Bed>();
  std::string tmpl = (base_dir() / "kvport-disk-bench-XXXXXX").string();
  if (::mkdtemp(tmpl.data()) == nullptr) throw std::runtime_error("mkdtemp failed in " + tmpl);
  b->dir = tmpl;
  const KvCacheConfig c = model(which);
  b->block_bytes = c.bytes_per_block();
  DiskStoreOptions o;
  o.dir = b->dir / "tier";
  o.num_slots = env_size("KVPORT_DISK_BENCH_SLOTS", 512);
  o.block_bytes = b->block_bytes;
  o.layout = kvport::disk::layout_fields(c);
  o.queue_depth = kQueueDepth;
  b->store = DiskStore::open(o);
  b->images.reset(static_cast<std::byte*>(std::aligned_alloc(4096, 256 * b->block_bytes)));
  for (std::size_t i = 0; i < 256 * b->block_bytes; ++i) {
    b->images.get()[i] = static_cast<std::byte>(i * 2654435761u >> 24);
  }
  // Fill every slot (written once, as a store in use is).
  const std::size_t n = o.num_slots;
  for (std::size_t done = 0; done < n;) {
    const std::size_t k = std::min<std::size_t>(64, n - done);
    std::vector<BlockHash> h;
    std::vector<std::span<const std::byte>> im;
    for (std::size_t i = 0; i < k; ++i) {
      h.push_back(b->fresh());
      im.emplace_back(b->image(i % 256), b->block_bytes);
    }
    b->store->put(h, im);
    b->stored.insert(b->stored.end(), h.begin(), h.end());
    done += k;
  }
  return *b;
}

std::string file_system(const fs::path& p) {
  struct statfs s {};
  if (::statfs(p.c_str(), &s) != 0) return "?";
  switch (static_cast<unsigned long>(s.f_type)) {
    case 0xEF53:
      return "ext4";
    case 0x58465342:
      return "xfs";
    case 0x01021994:
      return "tmpfs";
    case 0x9123683E:
      return "btrfs";
    default:
      return "other";
  }
}

// Runs fio `cmd` (JSON output) and returns its first job's bandwidth in
// `direction` ("read" or "write"), bytes/s; 0 when fio is missing or fails.
double run_fio(const std::string& cmd, const char* direction) {
  FILE* p = ::popen(cmd.c_str(), "r");
  if (p == nullptr) return 0;
  std::string out;
  char buf[4096];
  while (std::fgets(buf, sizeof buf, p) != nullptr)
    out += buf;
  if (::pclose(p) != 0) return 0;
  try {
    const auto j = nlohmann::json::parse(out.substr(out.find('{')));
    return j.at("jobs").at(0).at(direction).at("bw_bytes").get<double>();
  } catch (...) {
    return 0;
  }
}

// fio's bandwidth (bytes/s) for direct sequential I/O of `bytes` in blocks of
// `bs` at the store's queue depth, in `dir`; 0 when fio is missing or fails.
double fio_bandwidth(const fs::path& dir, bool write, std::size_t bs, std::size_t bytes,
                     std::size_t loops, bool end_fsync = false) {
  const fs::path file = dir / "fio.dat";
  const std::string cmd =
      "fio --name=limit --filename=" + file.string() + " --rw=" + (write ? "write" : "read") +
      " --bs=" + std::to_string(bs) + " --size=" + std::to_string(bytes) +
      " --loops=" + std::to_string(loops) +
      " --direct=1 --ioengine=io_uring --iodepth=" + std::to_string(kQueueDepth) +
      (write ? " --overwrite=1" : "") + (end_fsync ? " --end_fsync=1" : "") +
      " --output-format=json 2>/dev/null";
  const double bw = run_fio(cmd, write ? "write" : "read");
  std::error_code ec;
  if (!write) fs::remove(file, ec);
  return bw;
}

// fio's bandwidth (bytes/s) for direct random reads of `bytes` in blocks of
// `bs` (bs-aligned offsets) over the store's own data file, read-only, at
// the store's queue depth: the limit for what a read does (scattered slots of
// that file). 0 when fio is missing or fails.
double fio_random_read_bandwidth(const fs::path& file, std::size_t bs, std::size_t bytes) {
  std::error_code ec;
  const std::uintmax_t size = fs::file_size(file, ec);
  if (ec || size < bs) return 0;
  const std::string cmd =
      "fio --name=limit --filename=" + file.string() +
      " --readonly --rw=randread --bs=" + std::to_string(bs) +
      " --size=" + std::to_string(size / bs * bs) + " --io_size=" + std::to_string(bytes) +
      " --direct=1 --ioengine=io_uring --iodepth=" + std::to_string(kQueueDepth) +
      " --output-format=json 2>/dev/null";
  return run_fio(cmd, "read");
}

void report(benchmark::State& state, Bed& b, bool write, std::size_t n, double bytes,
            double seconds) {
  const double ours = seconds > 0 ? bytes / seconds : 0;
  // fio repeats its pass so that it moves at least 256 blocks' worth.
  const std::size_t loops = std::max<std::size_t>(1, 256 / n);
  if (write) (void)fio_bandwidth(b.dir, true, b.block_bytes, n * b.block_bytes, 1);  // lay out
  const double fio = fio_bandwidth(b.dir, write, b.block_bytes, n * b.block_bytes, loops);
  state.counters["ours_GBps"] = ours / 1e9;
  state.counters["fio_GBps"] = fio / 1e9;
  state.counters["ratio_vs_fio"] = fio > 0 ? ours / fio : 0;
  if (write) {
    // A put is durable when it returns (data and index synced): the limit
    // for that is fio's writes with one fsync at the end, one per pass.
    const double durable = fio_bandwidth(b.dir, true, b.block_bytes, n * b.block_bytes, 1, true);
    state.counters["fio_durable_GBps"] = durable / 1e9;
    state.counters["ratio_vs_fio_durable"] = durable > 0 ? ours / durable : 0;
    std::error_code ec;
    fs::remove(b.dir / "fio.dat", ec);
  } else if (b.block_bytes % 4096 == 0) {
    // Reads are scattered over the store's file: fio's random reads of the
    // same file, as many bytes (at least 256 blocks' worth), are their limit.
    const double random = fio_random_read_bandwidth(b.dir / "tier" / "blocks.dat", b.block_bytes,
                                                    std::max<std::size_t>(n, 256) * b.block_bytes);
    state.counters["fio_random_GBps"] = random / 1e9;
    state.counters["ratio_vs_fio_random"] = random > 0 ? ours / random : 0;
  }
  state.SetLabel(file_system(b.dir) + ", " + b.store->io_description() +
                 (fio > 0 ? "" : "; fio missing or failed (apt-get install fio)"));
}

void BM_DiskWrite(benchmark::State& state) {
  Bed& b = bed(static_cast<int>(state.range(0)));
  const auto n = static_cast<std::size_t>(state.range(1));
  double bytes = 0;
  double seconds = 0;
  double data_ns = 0;
  double index_ns = 0;
  for (auto _ : state) {
    // Free n scattered slots (random stored blocks), then write n new blocks
    // into them: the store's write path with its syncs and index records.
    state.PauseTiming();
    std::vector<BlockHash> h;
    std::vector<std::span<const std::byte>> im;
    for (std::size_t i = 0; i < n; ++i) {
      const std::size_t victim = b.rng() % b.stored.size();
      b.store->erase(b.stored[victim]);
      b.stored[victim] = b.stored.back();
      b.stored.pop_back();
      h.push_back(b.fresh());
      im.emplace_back(b.image(i), b.block_bytes);
    }
    b.store->flush();
    state.ResumeTiming();
    const auto w0 = b.store->counters().write_ns;
    const auto i0 = b.store->counters().index_ns;
    const auto t0 = std::chrono::steady_clock::now();
    const std::size_t put = b.store->put(h, im);
    seconds += std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    data_ns += static_cast<double>(b.store->counters().write_ns - w0);
    index_ns += static_cast<double>(b.store->counters().index_ns - i0);
    if (put != n) state.SkipWithError("a put was not published");
    bytes += static_cast<double>(put * b.block_bytes);
    b.stored.insert(b.stored.end(), h.begin(), h.begin() + static_cast<std::ptrdiff_t>(put));
  }
  state.SetBytesProcessed(static_cast<std::int64_t>(bytes));
  // Where a put's time goes: data writes and their sync, the index append and its sync.
  const double iters =
      static_cast<double>(std::max<benchmark::IterationCount>(1, state.iterations()));
  state.counters["data_ms_per_put"] = data_ns / 1e6 / iters;
  state.counters["index_ms_per_put"] = index_ns / 1e6 / iters;
  report(state, b, true, n, bytes, seconds);
}

void BM_DiskRead(benchmark::State& state) {
  Bed& b = bed(static_cast<int>(state.range(0)));
  const auto n = static_cast<std::size_t>(state.range(1));
  std::unique_ptr<std::byte, AlignedFree> out(
      static_cast<std::byte*>(std::aligned_alloc(4096, n * b.block_bytes)));
  std::memset(out.get(), 0, n * b.block_bytes);  // no page faults in the timed reads
  std::vector<std::span<std::byte>> views;
  for (std::size_t i = 0; i < n; ++i)
    views.emplace_back(out.get() + i * b.block_bytes, b.block_bytes);
  double bytes = 0;
  double seconds = 0;
  for (auto _ : state) {
    state.PauseTiming();
    std::vector<BlockHash> h;
    for (std::size_t i = 0; i < n; ++i)
      h.push_back(b.stored[b.rng() % b.stored.size()]);
    state.ResumeTiming();
    const auto t0 = std::chrono::steady_clock::now();
    const std::size_t got = b.store->get_prefix(h, views);
    seconds += std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    if (got != n) state.SkipWithError("a stored block was not read back");
    bytes += static_cast<double>(got * b.block_bytes);
  }
  state.SetBytesProcessed(static_cast<std::int64_t>(bytes));
  report(state, b, false, n, bytes, seconds);
}

void args(benchmark::internal::Benchmark* bm) {
  bm->ArgNames({"model", "blocks"});
  for (int m : {0, 1}) {
    for (int n : {1, 16, 256})
      bm->Args({m, n});
  }
  bm->UseRealTime()->Unit(benchmark::kMillisecond);
}

BENCHMARK(BM_DiskWrite)->Apply(args);
BENCHMARK(BM_DiskRead)->Apply(args);

}  // namespace

int main(int argc, char** argv) {
  benchmark::Initialize(&argc, argv);
  if (benchmark::ReportUnrecognizedArguments(argc, argv)) return 1;
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
  beds().clear();  // the stores and their directories
  return 0;
}
