// SPDX-License-Identifier: Apache-2.0
// libFuzzer target: bytes decode into a KV-cache configuration and a sequence
// of operations (alloc, try_alloc, inc_ref, dec_ref, free, return_evicted,
// zero, poison, fork, append, prefix lookup, evict, release), applied to the
// real PagedKvCache + PrefixCache + BlockTables and to the plain reference
// model of kvport/testing/kv_model.hpp. After every operation what it touched
// must agree (the blocks the model changed, the table, the free list, the
// counters); every full_check_every() operations (16) and at the end of the input the
// whole state must agree and both invariant checks must hold; otherwise the
// target aborts with the difference, and libFuzzer saves the input.
//
// Input layout: byte 0 picks the number of blocks (4..67), byte 1 the layout;
// then 5 bytes per operation: kind, a (16 bits), b (16 bits).
//
// Tier mode, when bits 1..3 of byte 1 are 011 (byte 1 % 16 is 6 or 7): a
// PrefixCache with a small HostTier (kvport/testing/tier_model.hpp). Byte 0
// picks the device blocks (6..25), byte 2 the host blocks (1..8) and the
// offload batch (1..4), byte 3 the policy (bit 0: write-through), the
// inclusion (bit 1: inclusive), the free watermark (bits 2..3) and the fault
// mode (bit 4); then 5 bytes per operation as above (requests that onload,
// lookups, releases, offloads, evictions, polls, synchronizes; in fault mode
// also faults). A write-back exclusive tier without a watermark is compared
// with the two-tier reference model (what each operation touched, all of it
// every full_check_every() operations (16) and at the end); every setting checks
// both tiers' invariants as often, that no lookup returns stale bytes, and
// that nothing leaks.
//
// Fault mode: the cache lives on a FaultInjectingBackend over the host
// backend, and a fault operation arms the failure of the Nth copy (at the
// call or deferred to the stream) or synchronize that the tier's calls make
// from then on: write-backs at allocation and offload, onloads in lookups,
// write-throughs at poll. The tier must fail closed: no call throws, the
// invariants hold right after the fault, every block a later lookup returns
// holds its hash's bytes, and nothing leaks. The model runs until the first
// fault (it cannot know what a rollback undid).
//
// Hybrid mode, when bits 1..3 of byte 1 are 101: a HybridKvCache of up to
// four layers of any kind (kvport/testing/hybrid_model.hpp), so several KV
// cache groups; byte 0 the blocks per group, byte 2 the block size and the
// state checkpoint interval, bytes 3..7 the layers; then 5 bytes per
// operation (start, decode, fork, release, evict, speculate), checked against the
// rules' definitions every full_check_every() operations (16) and at the end.
//
// Hybrid tier mode, when bits 1..3 of byte 1 are 111 (byte 1 % 16 is 14 or
// 15) and the input has at least 10 bytes: the hybrid mode's cache (bytes 0,
// 2..7; 4..19 blocks a group) with a HybridHostTier under its groups. Byte 8:
// policy (bit 0: write-through), inclusion (bit 1: inclusive), free
// watermark (bits 2..3), fault mode (bit 4), offload batch (bits 5..6, 1..4);
// byte 9: two bits a group, its host slots in units of 1 + (byte 0 / 16) % 4
// (0: no tier; group 0 gets one unit when no group has any); then 5 bytes per
// operation (the hybrid ones, and offload, poll, synchronize; in fault mode
// also faults). The driver writes every block's bytes from its hash as an
// engine's forward pass would, and checks every hit byte for byte, the hit
// and tier counters (a hit shorter than the rule's only as a counted short
// hit), both tiers' invariants, and at the end that nothing leaked (device
// blocks, pinned memory, and in fault mode the decorator's allocations and
// stream errors). In fault mode a copy (at the call or deferred) or
// synchronize inside the driver's cache calls fails; the tiers must fail
// closed (kvport/testing/hybrid_model.hpp).
//
// At exit (libFuzzer's -runs / -max_total_time end) the target prints one
// line: "kvport fuzz: N inputs, M operations (...)".
#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <memory>
#include <string>
#include <vector>

#include "kvport/backends/host_backend.hpp"
#include "kvport/core/hybrid_host_tier.hpp"
#include "kvport/core/kv_cache_config.hpp"
#include "kvport/platform/fault_injecting_backend.hpp"
#include "kvport/platform/log.hpp"
#include "kvport/testing/hybrid_model.hpp"
#include "kvport/testing/kv_model.hpp"
#include "kvport/testing/tier_model.hpp"

namespace {

using kvport::testing::KvDriver;
using kvport::testing::KvOp;
using kvport::testing::KvOpKind;

constexpr std::size_t kMaxOps = 512;

// Between full comparisons with the models, each operation checks what it
// touched; a full one every full_check_every() operations (16) and at the end of each
// input. (A full comparison after every operation made the target several
// times slower: docs/reliability.md.)
// KVPORT_FUZZ_FULL_CHECK_EVERY=k overrides it (1: a full comparison after
// every operation, as before; for measuring what the checks cost).
std::size_t full_check_every() {
  static const std::size_t k = [] {
    const char* env = std::getenv("KVPORT_FUZZ_FULL_CHECK_EVERY");
    if (env == nullptr || *env == '\0') return std::size_t{16};
    char* end = nullptr;
    const unsigned long long v = std::strtoull(env, &end, 10);
    if (*end != '\0' || v == 0 || v > 1000000) {
      std::fprintf(stderr, "KVPORT_FUZZ_FULL_CHECK_EVERY: '%s' is not a count in 1..1000000\n",
                   env);
      std::exit(2);
    }
    return static_cast<std::size_t>(v);
  }();
  return k;
}

struct Fixture {
  std::unique_ptr<kvport::Backend> backend =
      kvport::make_host_backend(kvport::HostBackendOptions{std::size_t{64} << 20});
  kvport::Stream stream = backend->create_stream();
  // Fault mode's backend: no plan is set between a tier's calls.
  kvport::FaultInjectingBackend faults{*backend};
  kvport::Stream fault_stream = faults.create_stream();
};

// What the run did, printed at exit.
struct Stats {
  std::uint64_t inputs = 0;
  std::uint64_t kv_ops = 0;
  std::uint64_t tier_ops = 0;
  std::uint64_t fault_mode_ops = 0;
  std::uint64_t faults_injected = 0;
  std::uint64_t hybrid_ops = 0;
  std::uint64_t hybrid_tier_ops = 0;
  std::uint64_t hybrid_tier_fault_ops = 0;
  std::uint64_t hybrid_tier_host_hits = 0;
  ~Stats() {
    std::fprintf(stderr,
                 "kvport fuzz: %llu inputs, %llu operations (kv %llu, tier %llu of which %llu in "
                 "fault mode, hybrid %llu, hybrid tier %llu of which %llu in fault mode, with "
                 "%llu hits from the host; %llu faults injected)\n",
                 static_cast<unsigned long long>(inputs),
                 static_cast<unsigned long long>(kv_ops + tier_ops + hybrid_ops + hybrid_tier_ops),
                 static_cast<unsigned long long>(kv_ops), static_cast<unsigned long long>(tier_ops),
                 static_cast<unsigned long long>(fault_mode_ops),
                 static_cast<unsigned long long>(hybrid_ops),
                 static_cast<unsigned long long>(hybrid_tier_ops),
                 static_cast<unsigned long long>(hybrid_tier_fault_ops),
                 static_cast<unsigned long long>(hybrid_tier_host_hits),
                 static_cast<unsigned long long>(faults_injected));
  }
};
Stats stats;

Fixture& fixture() {
  static Fixture f;
  return f;
}

kvport::KvCacheConfig config(kvport::KvCacheLayout layout) {
  kvport::KvCacheConfig c;
  c.num_layers = 2;
  c.block_size = 4;
  c.num_kv_heads = 1;
  c.head_dim_k = 8;
  c.head_dim_v = 8;
  c.dtype = kvport::KvCacheDtype::f16;
  c.layout = layout;
  return c;
}

std::uint16_t u16(const std::uint8_t* p) {
  return static_cast<std::uint16_t>(p[0] | (p[1] << 8));
}

bool is_tier_input(const std::uint8_t* data, std::size_t size) {
  return size >= 4 && (data[1] >> 1) % 8 == 3;
}

void fuzz_tier(const std::uint8_t* data, std::size_t size) {
  using kvport::testing::TierDriver;
  using kvport::testing::TierOp;
  using kvport::testing::TierOpKind;
  Fixture& f = fixture();
  const std::size_t num_blocks = 6 + data[0] % 20;
  const kvport::KvCacheLayout layout =
      data[1] % 2 == 0 ? kvport::KvCacheLayout::layer_major : kvport::KvCacheLayout::block_major;
  kvport::HostTierOptions options;
  options.num_host_blocks = 1 + data[2] % 8;
  options.offload_batch = 1 + (data[2] >> 3) % 4;
  options.policy =
      (data[3] & 1) != 0 ? kvport::TierPolicy::write_through : kvport::TierPolicy::write_back;
  options.inclusion =
      (data[3] & 2) != 0 ? kvport::TierInclusion::inclusive : kvport::TierInclusion::exclusive;
  options.free_watermark = (data[3] >> 2) % 4;
  const bool fault_mode = (data[3] & 16) != 0;
  kvport::Backend& backend = fault_mode ? static_cast<kvport::Backend&>(f.faults) : *f.backend;
  const kvport::StreamView stream = fault_mode ? f.fault_stream.view() : f.stream.view();
  // Without fault mode, a fault operation would arm nothing: not decoded.
  const auto kinds = static_cast<std::uint8_t>(fault_mode ? TierOpKind::count : TierOpKind::fault);
  kvport::PagedKvCache cache(config(layout), num_blocks, backend);
  const kvport::CallCounts before = f.backend->call_counts();
  {
    TierDriver driver(cache, stream, options, /*with_model=*/true,
                      fault_mode ? &f.faults : nullptr);
    driver.set_full_check_every(full_check_every());
    const std::size_t ops = std::min((size - 4) / 5, kMaxOps);
    for (std::size_t i = 0; i < ops; ++i) {
      const std::uint8_t* p = data + 4 + 5 * i;
      const TierOp op{static_cast<TierOpKind>(p[0] % kinds), u16(p + 1), u16(p + 3)};
      const std::string diff = driver.apply(op);
      if (!diff.empty()) {
        std::fprintf(stderr, "kvport fuzz (tier%s): op %zu: %s\n", fault_mode ? ", faults" : "", i,
                     diff.c_str());
        std::abort();
      }
    }
    const std::string diff = driver.compare();
    if (!diff.empty()) {
      std::fprintf(stderr, "kvport fuzz (tier%s): at the end: %s\n", fault_mode ? ", faults" : "",
                   diff.c_str());
      std::abort();
    }
    stats.tier_ops += ops;
    if (fault_mode) {
      stats.fault_mode_ops += ops;
      stats.faults_injected += driver.faults_injected();
    }
  }
  if (cache.num_free_blocks() != num_blocks || !cache.check_invariants().ok) {
    std::fprintf(stderr, "kvport fuzz (tier): leaked blocks: %s\n",
                 cache.check_invariants().to_string().c_str());
    std::abort();
  }
  const kvport::CallCounts after = f.backend->call_counts();
  if (after.host_alloc - before.host_alloc != after.host_free - before.host_free) {
    std::fprintf(stderr, "kvport fuzz (tier): pinned host memory leaked\n");
    std::abort();
  }
}

// After the cache of a fault-mode input is gone: nothing allocated through
// the decorator is left, and no error is left pending on its streams.
void check_fault_fixture() {
  Fixture& f = fixture();
  if (f.faults.live_allocations() != 0) {
    std::fprintf(stderr, "kvport fuzz (tier, faults): %zu device allocations leaked\n",
                 f.faults.live_allocations());
    std::abort();
  }
  try {
    f.fault_stream.synchronize();
    f.faults.synchronize(f.faults.default_stream());
  } catch (const std::exception& e) {
    std::fprintf(stderr, "kvport fuzz (tier, faults): an error was left on a stream: %s\n",
                 e.what());
    std::abort();
  }
}

bool is_hybrid_input(const std::uint8_t* data, std::size_t size) {
  return size >= 8 && (data[1] >> 1) % 8 == 5;
}

bool is_hybrid_tier_input(const std::uint8_t* data, std::size_t size) {
  return size >= 10 && (data[1] >> 1) % 8 == 7;
}

// The hybrid cache of bytes 0, 2..7 (hybrid and hybrid tier modes); false
// when every layer is 'none'.
bool hybrid_config(const std::uint8_t* data, kvport::HybridKvCacheConfig& c,
                   std::vector<kvport::KvCacheGroup>& groups) {
  using kvport::LayerSpec;
  c.block_size = 1 + data[2] % 4;
  c.state_checkpoint_interval = (data[2] >> 2) % 4;
  for (std::size_t i = 0; i < 4; ++i) {
    const std::uint8_t choice = static_cast<std::uint8_t>((data[3] >> (2 * i)) % 4);
    const std::uint8_t param = data[4 + i];
    switch (choice == 0 ? param % 6 : choice) {
      case 0:
        c.layers.push_back(LayerSpec::no_kv());
        break;
      case 1:
        c.layers.push_back(LayerSpec::full_attention(1 + i, 8, 8));
        break;
      case 2:
        c.layers.push_back(LayerSpec::sliding_window(1 + param % 8, 1 + i, 8, 8));
        break;
      case 3:
        c.layers.push_back(LayerSpec::chunked_local(c.block_size * (1 + param % 2), 1 + i, 8, 8));
        break;
      case 4:
        c.layers.push_back(LayerSpec::mla(4 * (1 + i), 4));
        break;
      default:
        c.layers.push_back(LayerSpec::recurrent_state(
            {kvport::StateTensor{"s", {1 + i}, kvport::StateDtype::f32}}));
        break;
    }
  }
  try {
    groups = kvport::group_layers(c.layers, c.block_size);
  } catch (const kvport::InvalidArgument&) {
    return false;  // every layer 'none'
  }
  return true;
}

void fuzz_hybrid(const std::uint8_t* data, std::size_t size) {
  Fixture& f = fixture();
  kvport::HybridKvCacheConfig c;
  std::vector<kvport::KvCacheGroup> groups;
  if (!hybrid_config(data, c, groups)) return;
  const std::vector<std::size_t> counts(groups.size(), 4 + data[0] % 32);
  kvport::HybridKvCache cache(c, counts, *f.backend);
  {
    kvport::testing::HybridDriver driver(cache, f.stream);
    driver.set_full_check_every(full_check_every());
    const std::size_t ops = std::min((size - 8) / 5, kMaxOps);
    for (std::size_t i = 0; i < ops; ++i) {
      const std::uint8_t* p = data + 8 + 5 * i;
      const kvport::testing::HybridOp op{
          static_cast<kvport::testing::HybridOpKind>(p[0] % kvport::testing::kNumPlainHybridOps),
          u16(p + 1), u16(p + 3)};
      const std::string diff = driver.apply(op);
      if (!diff.empty()) {
        std::fprintf(stderr, "kvport fuzz (hybrid): op %zu: %s\n", i, diff.c_str());
        std::abort();
      }
    }
    if (const std::string diff = driver.check(); !diff.empty()) {
      std::fprintf(stderr, "kvport fuzz (hybrid): at the end: %s\n", diff.c_str());
      std::abort();
    }
    stats.hybrid_ops += ops;
    driver.release_all();
    cache.synchronize();
  }
  for (std::size_t g = 0; g < cache.num_groups(); ++g) {
    if (cache.blocks_in_use(g) != 0 || !cache.check_invariants().ok) {
      std::fprintf(stderr, "kvport fuzz (hybrid): leaked blocks: %s\n",
                   cache.check_invariants().to_string().c_str());
      std::abort();
    }
  }
}

void fuzz_hybrid_tier(const std::uint8_t* data, std::size_t size) {
  using kvport::testing::HybridOpKind;
  Fixture& f = fixture();
  kvport::HybridKvCacheConfig c;
  std::vector<kvport::KvCacheGroup> groups;
  if (!hybrid_config(data, c, groups)) return;
  const std::size_t ng = groups.size();
  // Smaller device pools than the hybrid mode's, so that blocks go to the host.
  const std::vector<std::size_t> counts(ng, 4 + data[0] % 16);
  kvport::HybridHostTierOptions o;
  o.policy =
      (data[8] & 1) != 0 ? kvport::TierPolicy::write_through : kvport::TierPolicy::write_back;
  o.inclusion =
      (data[8] & 2) != 0 ? kvport::TierInclusion::inclusive : kvport::TierInclusion::exclusive;
  o.free_watermark = (data[8] >> 2) % 4;
  // Fault mode: bit 4 of byte 8 (a FaultInjectingBackend under the cache).
  const bool fault_mode = (data[8] & 16) != 0;
  o.offload_batch = 1 + (data[8] >> 5) % 4;
  // Two bits a group: no host tier (0) or 1..3 times (1 + data[0] / 16 % 4) slots.
  const std::size_t unit = 1 + (data[0] >> 4) % 4;
  for (std::size_t g = 0; g < ng; ++g)
    o.slots_per_group.push_back(((data[9] >> (2 * g)) & 3) * unit);
  if (std::all_of(o.slots_per_group.begin(), o.slots_per_group.end(),
                  [](std::size_t n) { return n == 0; }))
    o.slots_per_group[0] = unit;
  kvport::Backend& backend = fault_mode ? static_cast<kvport::Backend&>(f.faults) : *f.backend;
  const kvport::StreamView stream = fault_mode ? f.fault_stream.view() : f.stream.view();
  const auto kinds =
      static_cast<std::uint8_t>(fault_mode ? HybridOpKind::count : HybridOpKind::fault);
  const kvport::CallCounts before = f.backend->call_counts();
  {
    kvport::HybridKvCache cache(c, counts, backend);
    {
      kvport::HybridHostTier tier(cache, o, stream);
      kvport::testing::HybridDriver driver(cache, stream, &tier, fault_mode ? &f.faults : nullptr);
      driver.set_full_check_every(full_check_every());
      const std::size_t ops = std::min((size - 10) / 5, kMaxOps);
      for (std::size_t i = 0; i < ops; ++i) {
        const std::uint8_t* p = data + 10 + 5 * i;
        const kvport::testing::HybridOp op{static_cast<HybridOpKind>(p[0] % kinds), u16(p + 1),
                                           u16(p + 3)};
        const std::string diff = driver.apply(op);
        if (!diff.empty()) {
          std::fprintf(stderr, "kvport fuzz (hybrid tier%s): op %zu: %s\n",
                       fault_mode ? ", faults" : "", i, diff.c_str());
          std::abort();
        }
      }
      if (const std::string diff = driver.check(); !diff.empty()) {
        std::fprintf(stderr, "kvport fuzz (hybrid tier%s): at the end: %s\n",
                     fault_mode ? ", faults" : "", diff.c_str());
        std::abort();
      }
      stats.hybrid_tier_ops += ops;
      stats.hybrid_tier_host_hits += driver.host_hits();
      if (fault_mode) {
        stats.hybrid_tier_fault_ops += ops;
        stats.faults_injected += driver.faults_injected();
      }
      driver.release_all();
      tier.poll();  // queues the last write-throughs
      tier.synchronize();
      const kvport::InvariantReport r = tier.check_invariants();
      for (std::size_t g = 0; g < ng; ++g) {
        if (cache.blocks_in_use(g) != 0 || !r.ok) {
          std::fprintf(stderr, "kvport fuzz (hybrid tier): leaked blocks in group %zu: %s\n", g,
                       r.to_string().c_str());
          std::abort();
        }
      }
    }
    // The tier gone (uninstalled), the device is as if it had never been.
    cache.synchronize();
    for (std::size_t g = 0; g < ng; ++g) {
      if (cache.blocks_in_use(g) != 0 || !cache.check_invariants().ok) {
        std::fprintf(stderr, "kvport fuzz (hybrid tier): the tier left blocks in group %zu: %s\n",
                     g, cache.check_invariants().to_string().c_str());
        std::abort();
      }
    }
  }
  const kvport::CallCounts after = f.backend->call_counts();
  if (after.host_alloc - before.host_alloc != after.host_free - before.host_free) {
    std::fprintf(stderr, "kvport fuzz (hybrid tier): pinned host memory leaked\n");
    std::abort();
  }
}

void fuzz_kv(const std::uint8_t* data, std::size_t size) {
  Fixture& f = fixture();
  const std::size_t num_blocks = 4 + data[0] % 64;
  const kvport::KvCacheLayout layout =
      data[1] % 2 == 0 ? kvport::KvCacheLayout::layer_major : kvport::KvCacheLayout::block_major;
  kvport::PagedKvCache cache(config(layout), num_blocks, *f.backend);
  {
    KvDriver driver(cache, f.stream);
    driver.set_full_check_every(full_check_every());
    const std::size_t ops = std::min((size - 2) / 5, kMaxOps);
    for (std::size_t i = 0; i < ops; ++i) {
      const std::uint8_t* p = data + 2 + 5 * i;
      const KvOp op{static_cast<KvOpKind>(p[0] % static_cast<std::uint8_t>(KvOpKind::count)),
                    u16(p + 1), u16(p + 3)};
      const std::string diff = driver.apply(op);
      if (!diff.empty()) {
        std::fprintf(stderr, "kvport fuzz: op %zu: %s\n", i, diff.c_str());
        std::abort();
      }
    }
    if (const std::string diff = driver.compare(); !diff.empty()) {
      std::fprintf(stderr, "kvport fuzz: at the end: %s\n", diff.c_str());
      std::abort();
    }
    stats.kv_ops += ops;
    f.backend->synchronize(f.stream);
  }
  // Every table and handle was released: nothing may stay referenced.
  if (cache.num_free_blocks() != num_blocks || !cache.check_invariants().ok) {
    std::fprintf(stderr, "kvport fuzz: leaked blocks: %s\n",
                 cache.check_invariants().to_string().c_str());
    std::abort();
  }
}

}  // namespace

extern "C" int LLVMFuzzerInitialize(int*, char***) {
  kvport::log::set_level(kvport::log::Level::off);  // deliberate double frees
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  if (size < 2) return 0;
  ++stats.inputs;
  if (is_tier_input(data, size)) {
    fuzz_tier(data, size);
    if ((data[3] & 16) != 0) check_fault_fixture();
  } else if (is_hybrid_input(data, size)) {
    fuzz_hybrid(data, size);
  } else if (is_hybrid_tier_input(data, size)) {
    fuzz_hybrid_tier(data, size);
    if ((data[8] & 16) != 0) check_fault_fixture();
  } else {
    fuzz_kv(data, size);
  }
  return 0;
}
