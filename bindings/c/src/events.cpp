// SPDX-License-Identifier: Apache-2.0
// The KV cache events of kvport.h: a prefix cache's or a hybrid cache's
// events published by a kvport::events::Publisher that its handle's object
// owns (handles.hpp orders the destruction: the cache, then the publisher).
#include <algorithm>
#include <chrono>
#include <cstdint>
#include <memory>
#include <string>
#include <utility>

#include "arguments.hpp"
#include "handles.hpp"
#include "kvport/events/publisher.hpp"
#include "kvport/kvport.h"
#include "status.hpp"

using namespace kvport;
using namespace kvport::capi;

namespace {

std::string string_or_empty(const char* s) {
  return s == nullptr ? std::string() : std::string(s);
}

events::PublisherOptions to_publisher_options(const kvport_events_options* o) {
  require(o, "options");
  require(o->endpoint, "options.endpoint");
  events::PublisherOptions out;
  out.endpoint = o->endpoint;
  out.topic = string_or_empty(o->topic);
  out.replay_endpoint = string_or_empty(o->replay_endpoint);
  if (o->has_data_parallel_rank) out.data_parallel_rank = o->data_parallel_rank;
  if (o->form != KVPORT_EVENT_FORM_MAP && o->form != KVPORT_EVENT_FORM_POSITIONAL)
    throw InvalidArgument("options.form: " + std::to_string(o->form) +
                          " is not a kvport_event_form");
  out.form = o->form == KVPORT_EVENT_FORM_POSITIONAL ? events::EventForm::positional
                                                     : events::EventForm::map;
  if (o->send_high_water_mark < 0)
    throw InvalidArgument("options.send_high_water_mark: " +
                          std::to_string(o->send_high_water_mark) + " is negative");
  // 0: the publisher's default, which `out` holds already.
  if (o->max_batch_events != 0) out.max_batch_events = o->max_batch_events;
  if (o->batch_interval_us != 0)
    out.batch_interval = std::chrono::microseconds(
        static_cast<std::chrono::microseconds::rep>(std::min<std::uint64_t>(
            o->batch_interval_us, std::uint64_t{1} << 40)));  // ~12 days: no overflow
  if (o->buffer_events != 0) out.buffer_events = o->buffer_events;
  if (o->buffer_bytes != 0) out.buffer_bytes = o->buffer_bytes;
  if (o->send_high_water_mark != 0) out.send_high_water_mark = o->send_high_water_mark;
  if (o->replay_ring_batches != 0) out.replay_ring_batches = o->replay_ring_batches;
  if (o->linger_ms != 0) out.linger = std::chrono::milliseconds(o->linger_ms);
  return out;
}

void refuse_enabled(const std::unique_ptr<events::Publisher>& publisher, const char* op) {
  if (publisher)
    throw InvalidArgument(std::string(op) +
                          ": events are enabled already (disable them first to change the "
                          "options)");
}

events::Publisher& enabled(const std::unique_ptr<events::Publisher>& publisher, const char* op) {
  if (!publisher) throw InvalidArgument(std::string(op) + ": events are not enabled on this cache");
  return *publisher;
}

void write_stats(const events::Publisher& p, kvport_events_stats* out) {
  require(out, "out");
  const events::PublisherStats s = p.stats();
  out->events_accepted = s.events_accepted;
  out->events_dropped = s.events_dropped;
  out->batches_sent = s.batches_sent;
  out->send_failures = s.send_failures;
  out->replay_requests = s.replay_requests;
  out->snapshots = s.snapshots;
  out->bad_requests = s.bad_requests;
  out->next_seq = s.next_seq;
}

void write_endpoint(const events::Publisher& p, std::int32_t socket, char* text,
                    std::size_t text_size, std::size_t* text_needed, const char* op) {
  if (socket != KVPORT_EVENTS_SOCKET_PUB && socket != KVPORT_EVENTS_SOCKET_REPLAY)
    throw InvalidArgument(std::string(op) + ": " + std::to_string(socket) +
                          " is not a kvport_events_socket");
  write_text(socket == KVPORT_EVENTS_SOCKET_PUB ? p.endpoint() : p.replay_endpoint(), text,
             text_size, text_needed);
}

void flush(events::Publisher& p, std::uint32_t timeout_ms, bool* out_flushed) {
  const bool flushed = p.flush(std::chrono::milliseconds(timeout_ms));
  if (out_flushed != nullptr) *out_flushed = flushed;
}

// Installs `publisher` with `install(sink)` and announces what is cached
// with `snapshot(sink)`; on failure uninstalls it again (install(nullptr)
// does not throw) and the publisher is destroyed: nothing changed.
template <class Install, class Snapshot>
void enable(std::unique_ptr<events::Publisher>& slot, std::unique_ptr<events::Publisher> publisher,
            Install install, Snapshot snapshot) {
  try {
    install(publisher.get());
    snapshot(*publisher);
  } catch (...) {
    install(nullptr);
    throw;
  }
  slot = std::move(publisher);
}

}  // namespace

kvport_status kvport_events_options_init(kvport_events_options* options) {
  return guard([&] {
    require(options, "options");
    *options = kvport_events_options{};
    options->endpoint = "tcp://127.0.0.1:5557";
    options->form = KVPORT_EVENT_FORM_MAP;
  });
}

// ---- prefix caches -------------------------------------------------------------------------

kvport_status kvport_prefix_cache_enable_events(kvport_prefix_cache* prefix_cache,
                                                const kvport_events_options* options) {
  return guard([&] {
    PrefixCacheObject& object = get<PrefixCacheObject>(prefix_cache);
    refuse_enabled(object.publisher, "kvport_prefix_cache_enable_events");
    auto publisher = std::make_unique<events::Publisher>(to_publisher_options(options));
    PrefixCache& prefix = *object.prefix;
    enable(
        object.publisher, std::move(publisher),
        [&](CacheEventSink* sink) { prefix.set_event_sink(sink, prefix.event_source()); },
        [&](CacheEventSink& sink) { prefix.snapshot(sink); });
  });
}

kvport_status kvport_prefix_cache_disable_events(kvport_prefix_cache* prefix_cache) {
  return guard([&] {
    PrefixCacheObject& object = get<PrefixCacheObject>(prefix_cache);
    if (!object.publisher) return;
    PrefixCache& prefix = *object.prefix;
    object.publisher->cleared(prefix.event_source());
    prefix.set_event_sink(nullptr, prefix.event_source());
    object.publisher.reset();
  });
}

kvport_status kvport_prefix_cache_events_stats(const kvport_prefix_cache* prefix_cache,
                                               kvport_events_stats* out) {
  return guard([&] {
    const PrefixCacheObject& object = get<PrefixCacheObject>(prefix_cache);
    write_stats(enabled(object.publisher, "kvport_prefix_cache_events_stats"), out);
  });
}

kvport_status kvport_prefix_cache_events_endpoint(const kvport_prefix_cache* prefix_cache,
                                                  int32_t socket, char* text, size_t text_size,
                                                  size_t* text_needed) {
  return guard([&] {
    const char* op = "kvport_prefix_cache_events_endpoint";
    const PrefixCacheObject& object = get<PrefixCacheObject>(prefix_cache);
    write_endpoint(enabled(object.publisher, op), socket, text, text_size, text_needed, op);
  });
}

kvport_status kvport_prefix_cache_flush_events(kvport_prefix_cache* prefix_cache,
                                               uint32_t timeout_ms, bool* out_flushed) {
  return guard([&] {
    PrefixCacheObject& object = get<PrefixCacheObject>(prefix_cache);
    flush(enabled(object.publisher, "kvport_prefix_cache_flush_events"), timeout_ms, out_flushed);
  });
}

// ---- hybrid caches -------------------------------------------------------------------------

kvport_status kvport_hybrid_cache_enable_events(kvport_hybrid_cache* cache,
                                                const kvport_events_options* options) {
  return guard([&] {
    HybridCacheObject& object = get<HybridCacheObject>(cache);
    if (object.lent) {
      throw InvalidArgument(
          "kvport_hybrid_cache_enable_events: this is the one-group view of a prefix cache "
          "(kvport_prefix_cache_as_groups), whose events are the prefix cache's: use "
          "kvport_prefix_cache_enable_events");
    }
    refuse_enabled(object.publisher, "kvport_hybrid_cache_enable_events");
    auto publisher = std::make_unique<events::Publisher>(to_publisher_options(options));
    HybridKvCache& hybrid = *object.cache;
    enable(
        object.publisher, std::move(publisher),
        [&](CacheEventSink* sink) { hybrid.set_event_sink(sink); },
        [&](CacheEventSink& sink) { hybrid.snapshot(sink); });
  });
}

kvport_status kvport_hybrid_cache_disable_events(kvport_hybrid_cache* cache) {
  return guard([&] {
    HybridCacheObject& object = get<HybridCacheObject>(cache);
    if (!object.publisher) return;
    HybridKvCache& hybrid = *object.cache;
    for (std::size_t g = 0; g < hybrid.num_groups(); ++g)
      object.publisher->cleared(hybrid.group_event_source(g, Medium::gpu));
    hybrid.set_event_sink(nullptr);
    object.publisher.reset();
  });
}

kvport_status kvport_hybrid_cache_events_stats(const kvport_hybrid_cache* cache,
                                               kvport_events_stats* out) {
  return guard([&] {
    const HybridCacheObject& object = get<HybridCacheObject>(cache);
    write_stats(enabled(object.publisher, "kvport_hybrid_cache_events_stats"), out);
  });
}

kvport_status kvport_hybrid_cache_events_endpoint(const kvport_hybrid_cache* cache, int32_t socket,
                                                  char* text, size_t text_size,
                                                  size_t* text_needed) {
  return guard([&] {
    const char* op = "kvport_hybrid_cache_events_endpoint";
    const HybridCacheObject& object = get<HybridCacheObject>(cache);
    write_endpoint(enabled(object.publisher, op), socket, text, text_size, text_needed, op);
  });
}

kvport_status kvport_hybrid_cache_flush_events(kvport_hybrid_cache* cache, uint32_t timeout_ms,
                                               bool* out_flushed) {
  return guard([&] {
    HybridCacheObject& object = get<HybridCacheObject>(cache);
    flush(enabled(object.publisher, "kvport_hybrid_cache_flush_events"), timeout_ms, out_flushed);
  });
}
