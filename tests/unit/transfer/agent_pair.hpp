// SPDX-License-Identifier: Apache-2.0
// Test helpers for agents in one process: a host-backend cache with its
// agent (Side), connecting two of them on 127.0.0.1, token sequences.
#pragma once

#include <chrono>
#include <memory>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "kvport/backends/host_backend.hpp"
#include "kvport/core/block_hash.hpp"
#include "kvport/core/paged_kv_cache.hpp"
#include "kvport/transfer/agent.hpp"

namespace kvport::transfer {

using namespace std::chrono_literals;

/// Polls `pred` every millisecond until it holds or `limit` passes; returns
/// its last value.
template <typename Pred>
bool eventually(Pred pred, std::chrono::milliseconds limit = 5000ms) {
  const auto end = std::chrono::steady_clock::now() + limit;
  while (std::chrono::steady_clock::now() < end) {
    if (pred()) return true;
    std::this_thread::sleep_for(1ms);
  }
  return pred();
}

inline KvCacheConfig config(KvCacheLayout layout, std::size_t heads = 4,
                            KvCacheDtype dtype = KvCacheDtype::bf16) {
  KvCacheConfig c;
  c.num_layers = 3;
  c.block_size = 16;
  c.num_kv_heads = heads;
  c.head_dim_k = 64;
  c.head_dim_v = 64;
  c.dtype = dtype;
  c.layout = layout;
  return c;
}

inline std::vector<TokenId> tokens(std::size_t n, TokenId seed = 1) {
  std::vector<TokenId> t(n);
  for (std::size_t i = 0; i < n; ++i)
    t[i] = static_cast<TokenId>(seed * 7919 + i * 31);
  return t;
}

// One side: a host backend, a cache and its agent.
struct Side {
  std::unique_ptr<Backend> backend = make_host_backend(HostBackendOptions{64u << 20});
  PagedKvCache cache;
  Stream stream;
  std::unique_ptr<Agent> agent;

  Side(const KvCacheConfig& c, std::size_t blocks, AgentOptions o = {})
      : cache(c, blocks, *backend), stream(backend->create_stream()) {
    o.peer_timeout = o.peer_timeout == 2000ms ? 1000ms : o.peer_timeout;
    agent = std::make_unique<Agent>(cache, o);
  }
  std::vector<BlockId> alloc(std::size_t n) {
    std::vector<BlockId> out;
    for (std::size_t i = 0; i < n; ++i)
      out.push_back(cache.alloc_block());
    return out;
  }
  PoolLayout layout() const { return agent->layout(); }
};

inline AgentOptions named(std::string name, std::uint32_t rank = 0, std::uint32_t size = 1) {
  AgentOptions o;
  o.name = std::move(name);
  o.tp_rank = rank;
  o.tp_size = size;
  return o;
}

// Connects a -> b; returns (a's id for b, b's id for a).
inline std::pair<PeerId, PeerId> link(Side& a, Side& b) {
  const std::string address = b.agent->listen("127.0.0.1:0");
  const PeerId to_b = a.agent->connect(address, 5s);
  PeerId to_a = 0;
  for (int i = 0; i < 500 && to_a == 0; ++i) {
    auto ids = b.agent->peers();
    if (!ids.empty())
      to_a = ids.back();
    else
      std::this_thread::sleep_for(2ms);
  }
  return {to_b, to_a};
}

}  // namespace kvport::transfer
