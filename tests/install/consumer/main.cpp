// Uses the installed package the way an engine would: a host backend, a
// cache, a zeroed block read back, and a transfer agent listening on
// 127.0.0.1 for peers.
#include <kvport/backends/host_backend.hpp>
#include <kvport/core/paged_kv_cache.hpp>
#include <kvport/transfer/agent.hpp>

#include <algorithm>
#include <cstdio>
#include <string>

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
  kvport::transfer::Agent agent(cache);
  const std::string address = agent.listen("127.0.0.1:0");
  std::printf("consumer: agent listening on %s\n", address.c_str());
  const bool ok = poisoned && cache.check_invariants().ok && address.rfind("127.0.0.1:", 0) == 0;
  std::printf("consumer: block %u poisoned=%d invariants=%s\n", block, poisoned,
              cache.check_invariants().to_string().c_str());
  return ok ? 0 : 1;
}
