// SPDX-License-Identifier: Apache-2.0
// The KV events of the C ABI, decoded: a prefix cache and a hybrid cache
// publish through kvport_*_enable_events, a libzmq SUB socket on 127.0.0.1
// receives the messages and kvport::events::decode_batch decodes them; the
// hashes are checked against kvport::hash_block (their low 64 bits), with
// the parents, tokens, block size, medium, rank and groups. A plain program
// (CHECK, a failure count, exit status 1), as kvport_c_test.c.
#include <zmq.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <optional>
#include <span>
#include <string>
#include <variant>
#include <vector>

#include "kvport/core/block_hash.hpp"
#include "kvport/core/cache_events.hpp"
#include "kvport/events/wire.hpp"
#include "kvport/kvport.h"

namespace {

int g_failures = 0;
int g_checks = 0;

#define CHECK(cond)                                                                 \
  do {                                                                              \
    ++g_checks;                                                                     \
    if (!(cond)) {                                                                  \
      std::fprintf(stderr, "%s:%d: CHECK failed: %s\n", __FILE__, __LINE__, #cond); \
      ++g_failures;                                                                 \
    }                                                                               \
  } while (0)

#define OK(call)                                                                     \
  do {                                                                               \
    ++g_checks;                                                                      \
    const kvport_status s_ = (call);                                                 \
    if (s_ != KVPORT_OK) {                                                           \
      std::fprintf(stderr, "%s:%d: %s returned %s: %s\n", __FILE__, __LINE__, #call, \
                   kvport_status_name(s_), kvport_last_error());                     \
      ++g_failures;                                                                  \
    }                                                                                \
  } while (0)

struct Message {
  std::string topic;
  std::uint64_t seq = 0;
  kvport::EventBatch batch;
};

std::string receive_frame(void* sub, bool& more) {
  zmq_msg_t msg;
  zmq_msg_init(&msg);
  std::string out;
  if (zmq_msg_recv(&msg, sub, 0) >= 0)
    out.assign(static_cast<const char*>(zmq_msg_data(&msg)), zmq_msg_size(&msg));
  more = zmq_msg_more(&msg) != 0;
  zmq_msg_close(&msg);
  return out;
}

// How long a receive waits for a message that was flushed and must come:
// ZeroMQ's I/O threads may take their time on a loaded machine or under a
// sanitizer. Joining and draining use the short default.
constexpr long kExpectMs = 5000;

// The next message within `timeout_ms`, decoded; nullopt on a timeout.
std::optional<Message> receive(void* sub, long timeout_ms = 200) {
  zmq_pollitem_t item{sub, 0, ZMQ_POLLIN, 0};
  if (zmq_poll(&item, 1, timeout_ms) <= 0) return std::nullopt;
  Message m;
  bool more = false;
  m.topic = receive_frame(sub, more);
  CHECK(more);
  const std::string seq = receive_frame(sub, more);
  CHECK(more);
  const std::string payload = receive_frame(sub, more);
  CHECK(!more);
  const auto parsed = kvport::events::decode_seq(std::as_bytes(std::span(seq)));
  CHECK(parsed.has_value());
  m.seq = parsed.value_or(0);
  kvport::events::DecodeResult r = kvport::events::decode_batch(payload, m.seq);
  if (!r.ok()) std::fprintf(stderr, "decode_batch: %s\n", r.error.c_str());
  CHECK(r.ok() && r.unknown_events == 0);
  if (r.batch) m.batch = *r.batch;
  return m;
}

std::vector<std::uint32_t> iota(std::uint32_t first, std::size_t n) {
  std::vector<std::uint32_t> v(n);
  for (std::size_t i = 0; i < n; ++i)
    v[i] = first + static_cast<std::uint32_t>(i);
  return v;
}

// kvport's chained hashes of the full blocks of `tokens`, after `parent`.
std::vector<kvport::BlockHash> chain(std::optional<kvport::BlockHash> parent,
                                     const std::vector<std::uint32_t>& tokens,
                                     std::size_t block_size) {
  std::vector<kvport::BlockHash> out;
  for (std::size_t at = 0; at + block_size <= tokens.size(); at += block_size) {
    parent = kvport::hash_block(parent, std::span(tokens).subspan(at, block_size), 0);
    out.push_back(*parent);
  }
  return out;
}

std::vector<std::uint64_t> low64(const std::vector<kvport::BlockHash>& hashes) {
  std::vector<std::uint64_t> out;
  for (const auto& h : hashes)
    out.push_back(kvport::event_hash(h));
  return out;
}

// Events of type T in the message.
template <class T>
std::vector<T> events_of(const Message& m) {
  std::vector<T> out;
  for (const kvport::CacheEvent& e : m.batch.events)
    if (const T* t = std::get_if<T>(&e)) out.push_back(*t);
  return out;
}

void* subscriber(void* context, const char* endpoint) {
  void* sub = zmq_socket(context, ZMQ_SUB);
  const int linger = 0;
  CHECK(sub != nullptr);
  CHECK(zmq_setsockopt(sub, ZMQ_SUBSCRIBE, "", 0) == 0);
  CHECK(zmq_setsockopt(sub, ZMQ_LINGER, &linger, sizeof linger) == 0);
  CHECK(zmq_connect(sub, endpoint) == 0);
  return sub;
}

void test_prefix_cache(kvport_backend* backend, void* context) {
  kvport_config config;
  kvport_config_init(&config);
  config.num_layers = 1;
  config.block_size = 4;
  config.num_kv_heads = 1;
  config.head_dim_k = config.head_dim_v = 8;
  kvport_cache* cache = nullptr;
  kvport_prefix_cache* prefix = nullptr;
  OK(kvport_cache_create(&config, 128, backend, &cache));
  OK(kvport_prefix_cache_create(cache, &prefix));

  kvport_events_options options;
  OK(kvport_events_options_init(&options));
  options.endpoint = "tcp://127.0.0.1:0";
  options.has_data_parallel_rank = true;
  options.data_parallel_rank = 5;
  options.batch_interval_us = 1000;
  OK(kvport_prefix_cache_enable_events(prefix, &options));
  char endpoint[128] = {};
  OK(kvport_prefix_cache_events_endpoint(prefix, KVPORT_EVENTS_SOCKET_PUB, endpoint,
                                         sizeof endpoint, nullptr));
  void* sub = subscriber(context, endpoint);

  // Join (ZeroMQ's slow joiner): one new block a round until a message comes.
  std::optional<Message> joined;
  for (std::uint32_t round = 0; round < 100 && !joined; ++round) {
    const std::vector<std::uint32_t> t = iota(10'000 + 4 * round, 4);
    kvport_block_table* probe = nullptr;
    OK(kvport_block_table_create_prefixed(prefix, 0, &probe));
    OK(kvport_block_table_append_tokens(probe, t.data(), t.size(), nullptr));
    OK(kvport_block_table_destroy(probe));
    OK(kvport_prefix_cache_flush_events(prefix, 2000, nullptr));
    joined = receive(sub);
  }
  CHECK(joined.has_value());
  if (!joined) return;

  // Three blocks in one append, then a fourth: its parent is the third.
  const std::vector<std::uint32_t> tokens = iota(100, 16);
  const std::vector<kvport::BlockHash> hashes = chain(std::nullopt, tokens, 4);
  kvport_block_table* table = nullptr;
  OK(kvport_block_table_create_prefixed(prefix, 0, &table));
  OK(kvport_block_table_append_tokens(table, tokens.data(), 12, nullptr));
  OK(kvport_prefix_cache_flush_events(prefix, 2000, nullptr));
  std::optional<Message> m = receive(sub, kExpectMs);
  CHECK(m.has_value());
  if (m) {
    CHECK(m->seq == joined->seq + 1 && m->topic.empty());
    CHECK(m->batch.data_parallel_rank == std::optional<std::int64_t>(5) && m->batch.ts > 1.5e9);
    const auto stored = events_of<kvport::BlockStored>(*m);
    CHECK(stored.size() == 1 && m->batch.events.size() == 1);
    if (!stored.empty()) {
      const kvport::BlockStored& s = stored[0];
      CHECK(s.block_hashes == low64({hashes[0], hashes[1], hashes[2]}));
      CHECK(!s.parent_block_hash.has_value());
      CHECK(s.token_ids == std::vector<kvport::TokenId>(tokens.begin(), tokens.begin() + 12));
      CHECK(s.block_size == 4 && s.medium == "GPU" && !s.group_idx && !s.kv_cache_spec_kind);
    }
  }
  OK(kvport_block_table_append_tokens(table, tokens.data() + 12, 4, nullptr));
  OK(kvport_prefix_cache_flush_events(prefix, 2000, nullptr));
  m = receive(sub, kExpectMs);
  CHECK(m.has_value());
  if (m) {
    const auto stored = events_of<kvport::BlockStored>(*m);
    CHECK(stored.size() == 1);
    if (!stored.empty()) {
      CHECK(stored[0].block_hashes == low64({hashes[3]}));
      CHECK(stored[0].parent_block_hash == kvport::event_hash(hashes[2]));
      CHECK(stored[0].token_ids == std::vector<kvport::TokenId>(tokens.begin() + 12, tokens.end()));
    }
  }
  OK(kvport_block_table_destroy(table));

  // Evicting everything: BlockRemoved of the four, among the others.
  std::size_t evicted = 0;
  OK(kvport_prefix_cache_evict(prefix, 1000, &evicted));
  CHECK(evicted >= 4);
  OK(kvport_prefix_cache_flush_events(prefix, 2000, nullptr));
  std::vector<std::uint64_t> removed;
  while (removed.size() < evicted) {
    m = receive(sub, kExpectMs);
    CHECK(m.has_value());
    if (!m) break;
    for (const auto& r : events_of<kvport::BlockRemoved>(*m)) {
      CHECK(r.medium == "GPU");
      removed.insert(removed.end(), r.block_hashes.begin(), r.block_hashes.end());
    }
  }
  for (const std::uint64_t h : low64(hashes))
    CHECK(std::find(removed.begin(), removed.end(), h) != removed.end());

  // Disable: the clear arrives before the publisher goes.
  OK(kvport_prefix_cache_disable_events(prefix));
  m = receive(sub, kExpectMs);
  CHECK(m.has_value());
  if (m) {
    const auto cleared = events_of<kvport::AllBlocksCleared>(*m);
    CHECK(cleared.size() == 1 && cleared[0].medium == std::optional<std::string>("GPU"));
  }
  CHECK(zmq_close(sub) == 0);
  OK(kvport_prefix_cache_destroy(prefix));
  OK(kvport_cache_destroy(cache));
}

kvport_layer_spec attention(std::int32_t kind) {
  kvport_layer_spec s;
  kvport_layer_spec_init(&s);
  s.kind = kind;
  s.num_kv_heads = 1;
  s.head_dim_k = s.head_dim_v = 8;
  s.window = kind == KVPORT_LAYER_SLIDING_WINDOW ? 8 : 0;
  return s;
}

void test_hybrid_cache(kvport_backend* backend, void* context) {
  const kvport_layer_spec layers[2] = {attention(KVPORT_LAYER_SLIDING_WINDOW),
                                       attention(KVPORT_LAYER_FULL_ATTENTION)};
  const std::size_t counts[2] = {32, 32};
  kvport_hybrid_cache* cache = nullptr;
  OK(kvport_hybrid_cache_create(backend, layers, 2, 4, 1, counts, 2, &cache));
  kvport_events_options options;
  OK(kvport_events_options_init(&options));
  options.endpoint = "tcp://127.0.0.1:0";
  options.form = KVPORT_EVENT_FORM_POSITIONAL;
  options.batch_interval_us = 1000;
  OK(kvport_hybrid_cache_enable_events(cache, &options));
  char endpoint[128] = {};
  OK(kvport_hybrid_cache_events_endpoint(cache, KVPORT_EVENTS_SOCKET_PUB, endpoint, sizeof endpoint,
                                         nullptr));
  void* sub = subscriber(context, endpoint);

  // Each round stores one block in both groups; wait until the round with
  // tokens `first` arrives in full (both groups' events are in one batch).
  std::vector<kvport::BlockStored> groups(2);
  bool seen[2] = {false, false};
  for (std::uint32_t round = 0; round < 100 && !(seen[0] && seen[1]); ++round) {
    const std::vector<std::uint32_t> t = iota(4 * round, 4);
    kvport_hybrid_block_table* table = nullptr;
    OK(kvport_hybrid_block_table_create(cache, 0, &table));
    OK(kvport_hybrid_block_table_append_tokens(table, t.data(), t.size(), nullptr));
    OK(kvport_hybrid_block_table_destroy(table));
    OK(kvport_hybrid_cache_flush_events(cache, 2000, nullptr));
    while (std::optional<Message> m = receive(sub)) {
      for (const auto& s : events_of<kvport::BlockStored>(*m)) {
        if (s.group_idx && *s.group_idx < 2 && s.token_ids == t) {
          groups[*s.group_idx] = s;
          seen[*s.group_idx] = true;
        }
      }
    }
  }
  CHECK(seen[0] && seen[1]);
  if (seen[0] && seen[1]) {
    CHECK(groups[0].kv_cache_spec_kind == std::optional<std::string>("sliding_window"));
    CHECK(groups[0].kv_cache_spec_sliding_window == std::optional<std::uint32_t>(8));
    CHECK(groups[1].kv_cache_spec_kind == std::optional<std::string>("full_attention"));
    CHECK(!groups[1].kv_cache_spec_sliding_window);
    const std::vector<std::uint32_t> t(groups[1].token_ids.begin(), groups[1].token_ids.end());
    CHECK(groups[1].block_hashes == low64(chain(std::nullopt, t, 4)));
    CHECK(groups[0].block_hashes == groups[1].block_hashes);
  }
  CHECK(zmq_close(sub) == 0);
  OK(kvport_hybrid_cache_destroy(cache));  // with events on
}

}  // namespace

int main() {
  kvport_backend* backend = nullptr;
  if (kvport_backend_create("host", &backend) != KVPORT_OK) {
    std::fprintf(stderr, "cannot create the host backend: %s\n", kvport_last_error());
    return 1;
  }
  void* context = zmq_ctx_new();
  test_prefix_cache(backend, context);
  test_hybrid_cache(backend, context);
  CHECK(zmq_ctx_term(context) == 0);
  OK(kvport_backend_destroy(backend));
  if (g_failures != 0) {
    std::fprintf(stderr, "kvport_c_events_test: %d of %d checks FAILED\n", g_failures, g_checks);
    return 1;
  }
  std::printf("kvport_c_events_test: all %d checks passed\n", g_checks);
  return 0;
}
