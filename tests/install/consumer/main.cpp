// SPDX-License-Identifier: Apache-2.0
// Uses the installed package the way an engine would: a host backend, a
// cache, a zeroed block read back, a transfer agent listening on 127.0.0.1
// for peers, and the cache's events published on 127.0.0.1 and followed by a
// router index.
#include <kvport/backends/host_backend.hpp>
#include <kvport/core/paged_kv_cache.hpp>
#include <kvport/core/prefix_cache.hpp>
#include <kvport/events/publisher.hpp>
#include <kvport/router/subscriber.hpp>
#ifdef CONSUMER_WITH_TRANSFER
#include <kvport/transfer/agent.hpp>
#endif

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <string>
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
#ifdef CONSUMER_WITH_TRANSFER
  kvport::transfer::Agent agent(cache);
  const std::string address = agent.listen("127.0.0.1:0");
  std::printf("consumer: agent listening on %s\n", address.c_str());
#else
  const std::string address = "127.0.0.1:0";  // no transfer component
#endif

  // One block registered in a prefix cache, announced, and indexed.
  kvport::events::PublisherOptions options;
  options.endpoint = "tcp://127.0.0.1:0";
  options.replay_endpoint = "tcp://127.0.0.1:0";
  kvport::events::Publisher publisher(options);
  kvport::PrefixCache prefix(cache);
  kvport::router::RouterIndex index(kvport::router::IndexOptions{});
  kvport::router::Subscriber subscriber(index);
  subscriber.add_instance(0, {publisher.endpoint(), publisher.replay_endpoint()},
                          kvport::router::Clock::now());
  prefix.set_event_sink(&publisher);
  const std::vector<kvport::TokenId> tokens(config.block_size, 7);
  const kvport::BlockHash hash = kvport::hash_block(std::nullopt, tokens);
  prefix.insert(hash, block);
  const bool indexed =
      publisher.flush(std::chrono::seconds(5)) &&
      subscriber.wait_for(0, publisher.stats().next_seq, std::chrono::seconds(5)) &&
      index.num_blocks() == 1;
  std::printf("consumer: event published to %s, indexed=%d\n", publisher.endpoint().c_str(),
              indexed);
  prefix.set_event_sink(nullptr);
  const bool ok =
      poisoned && indexed && cache.check_invariants().ok && address.rfind("127.0.0.1:", 0) == 0;
  std::printf("consumer: block %u poisoned=%d invariants=%s\n", block, poisoned,
              cache.check_invariants().to_string().c_str());
  return ok ? 0 : 1;
}
