// libFuzzer target: bytes decode into a KV-cache configuration and a sequence
// of operations (alloc, try_alloc, inc_ref, dec_ref, free, return_evicted,
// zero, poison, fork, append, prefix lookup, evict, release), applied to the
// real PagedKvCache + PrefixCache + BlockTables and to the plain reference
// model of kvport/testing/kv_model.hpp. After every operation the two must
// agree and both invariant checks must hold; otherwise the target aborts with
// the difference, and libFuzzer saves the input.
//
// Input layout: byte 0 picks the number of blocks (4..67), byte 1 the layout;
// then 5 bytes per operation: kind, a (16 bits), b (16 bits).
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <memory>

#include "kvport/backends/host_backend.hpp"
#include "kvport/core/kv_cache_config.hpp"
#include "kvport/platform/log.hpp"
#include "kvport/testing/kv_model.hpp"

namespace {

using kvport::testing::KvDriver;
using kvport::testing::KvOp;
using kvport::testing::KvOpKind;

constexpr std::size_t kMaxOps = 512;

struct Fixture {
  std::unique_ptr<kvport::Backend> backend =
      kvport::make_host_backend(kvport::HostBackendOptions{std::size_t{64} << 20});
  kvport::Stream stream = backend->create_stream();
};

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

}  // namespace

extern "C" int LLVMFuzzerInitialize(int*, char***) {
  kvport::log::set_level(kvport::log::Level::off);  // deliberate double frees
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  if (size < 2) return 0;
  Fixture& f = fixture();
  const std::size_t num_blocks = 4 + data[0] % 64;
  const kvport::KvCacheLayout layout =
      data[1] % 2 == 0 ? kvport::KvCacheLayout::layer_major : kvport::KvCacheLayout::block_major;
  kvport::PagedKvCache cache(config(layout), num_blocks, *f.backend);
  {
    KvDriver driver(cache, f.stream);
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
    f.backend->synchronize(f.stream);
  }
  // Every table and handle was released: nothing may stay referenced.
  if (cache.num_free_blocks() != num_blocks || !cache.check_invariants().ok) {
    std::fprintf(stderr, "kvport fuzz: leaked blocks: %s\n",
                 cache.check_invariants().to_string().c_str());
    std::abort();
  }
  return 0;
}
