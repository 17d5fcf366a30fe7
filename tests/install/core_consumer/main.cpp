// SPDX-License-Identifier: Apache-2.0
// Uses only the core of the installed package: a host backend, a cache, a
// poisoned block read back, a block registered in a prefix cache and found
// again.
#include <kvport/backends/host_backend.hpp>
#include <kvport/core/paged_kv_cache.hpp>
#include <kvport/core/prefix_cache.hpp>
#include <kvport/platform/error.hpp>

#include <algorithm>
#include <cstdio>
#include <vector>

int main() {
  auto backend = kvport::make_host_backend();
  kvport::KvCacheConfig config;
  config.num_layers = 2;
  config.num_kv_heads = 2;
  config.head_dim_k = config.head_dim_v = 64;
  kvport::PagedKvCache cache(config, 8, *backend);
  const kvport::BlockId block = cache.alloc_block();
  cache.poison_block(block, backend->default_stream());
  const auto host = cache.read_block(1, block, backend->default_stream());
  const bool poisoned = std::all_of(host.k.begin(), host.k.end(), [](auto b) { return b == 0xFF; });
  bool out_of_range = false;
  try {
    cache.inc_ref(8);
  } catch (const kvport::OutOfRange&) {
    out_of_range = true;
  }
  kvport::PrefixCache prefix(cache);
  const std::vector<kvport::TokenId> tokens(config.block_size, 7);
  prefix.insert(kvport::hash_block(std::nullopt, tokens), block);
  const bool ok = poisoned && out_of_range && cache.check_invariants().ok;
  std::printf("core_consumer: block %u poisoned=%d out_of_range=%d invariants=%s\n", block,
              poisoned, out_of_range, cache.check_invariants().to_string().c_str());
  return ok ? 0 : 1;
}
