// SPDX-License-Identifier: Apache-2.0
// KV cache events in the Python module: the methods that turn a cache's
// events on and off (enable_events, disable_events, events_stats,
// events_endpoint, events_replay_endpoint, events_enabled, flush_events),
// defined once for PrefixCache (bind_prefix.cpp) and HybridKvCache
// (bind_hybrid_cache.cpp). The publisher (kvport::events::Publisher) lives in the
// cache's state (PrefixState, HybridState), released after the cache, so it
// outlives the sink registration however the Python objects go. It is held
// by a shared_ptr so that a flush_events waiting without the GIL keeps it
// alive through a disable_events of another thread.
#pragma once

#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <algorithm>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <utility>

#include "kvport/core/cache_events.hpp"
#include "kvport/events/publisher.hpp"
#include "kvport/platform/error.hpp"

namespace kvport::python {

namespace py = pybind11;

/// The Python keywords of enable_events, as PublisherOptions (None: the
/// publisher's default). Throws InvalidArgument for an unknown form or a
/// negative time or count.
struct EventsKeywords {
  std::string endpoint;
  std::string topic;
  std::optional<std::string> replay_endpoint;
  std::optional<std::int64_t> data_parallel_rank;
  std::string form;
  std::optional<std::size_t> max_batch_events;
  std::optional<double> batch_interval;  // seconds
  std::optional<std::size_t> buffer_events;
  std::optional<std::size_t> buffer_bytes;
  std::optional<int> send_high_water_mark;
  std::optional<std::size_t> replay_ring_batches;
  std::optional<double> linger;  // seconds
};
events::PublisherOptions publisher_options(const EventsKeywords& k);

/// What enable_events and disable_events do to one cache: where its
/// publisher lives, how a sink is installed (nullptr: uninstalled), how the
/// cached set is announced (a snapshot into the new publisher) and how a
/// clear is announced (disable_events, before the sink goes).
struct EventsTarget {
  std::shared_ptr<events::Publisher>* slot = nullptr;
  std::function<void(CacheEventSink*)> install;
  std::function<void(CacheEventSink&)> snapshot;
  std::function<void(CacheEventSink&)> announce_clear;
};

/// enable_events with a new publisher: installs it, announces the cached
/// set; on failure uninstalls it and nothing changed.
void enable_events(const EventsTarget& target, const EventsKeywords& keywords, const char* name);
/// Announces the clear, uninstalls the sink, destroys the publisher (GIL
/// released while it sends what it buffered). Nothing when not enabled.
void disable_events(const EventsTarget& target);
/// The publisher, or InvalidArgument naming `op` when events are not enabled.
const std::shared_ptr<events::Publisher>& enabled_publisher(const EventsTarget& target,
                                                            const char* op);

/// Adds the events methods to `cls`; `target(self)` says where they act.
template <class Py>
void def_events(py::class_<Py>& cls, EventsTarget (*target)(const Py&), const char* name) {
  cls.def(
         "enable_events",
         [target, name](
             const Py& self, std::string endpoint, std::string topic,
             std::optional<std::string> replay_endpoint,
             std::optional<std::int64_t> data_parallel_rank, std::string form,
             std::optional<std::size_t> max_batch_events, std::optional<double> batch_interval,
             std::optional<std::size_t> buffer_events, std::optional<std::size_t> buffer_bytes,
             std::optional<int> send_high_water_mark,
             std::optional<std::size_t> replay_ring_batches, std::optional<double> linger) {
           enable_events(
               target(self),
               EventsKeywords{std::move(endpoint), std::move(topic), std::move(replay_endpoint),
                              data_parallel_rank, std::move(form), max_batch_events, batch_interval,
                              buffer_events, buffer_bytes, send_high_water_mark,
                              replay_ring_batches, linger},
               name);
         },
         py::arg("endpoint") = "tcp://127.0.0.1:5557", py::arg("topic") = "",
         py::arg("replay_endpoint") = py::none(), py::arg("data_parallel_rank") = py::none(),
         py::arg("form") = "map", py::kw_only(), py::arg("max_batch_events") = py::none(),
         py::arg("batch_interval") = py::none(), py::arg("buffer_events") = py::none(),
         py::arg("buffer_bytes") = py::none(), py::arg("send_high_water_mark") = py::none(),
         py::arg("replay_ring_batches") = py::none(), py::arg("linger") = py::none(),
         "Publishes the cache's KV events in vLLM's wire format on a ZeroMQ PUB socket bound "
         "at `endpoint` (port 0: an ephemeral port, see events_endpoint), then announces the "
         "blocks cached already. form: 'map' or 'positional'. replay_endpoint: a ROUTER "
         "socket for replay and snapshot requests. batch_interval and linger in seconds; "
         "None: the publisher's default (docs/events.md). Raises InvalidArgument for a bad "
         "option, an endpoint ZeroMQ cannot parse or bind, or when events are enabled "
         "already.")
      .def(
          "disable_events", [target](const Py& self) { disable_events(target(self)); },
          "Announces AllBlocksCleared, stops publishing and destroys the publisher (which "
          "sends what it buffered first). Nothing when events are not enabled.")
      .def_property_readonly("events_enabled",
                             [target](const Py& self) { return *target(self).slot != nullptr; })
      .def(
          "events_stats",
          [target](const Py& self) {
            return enabled_publisher(target(self), "events_stats")->stats();
          },
          "The publisher's counters (EventPublisherStats). InvalidArgument when events are "
          "not enabled.")
      .def_property_readonly(
          "events_endpoint",
          [target](const Py& self) -> std::optional<std::string> {
            const auto& slot = *target(self).slot;
            if (!slot) return std::nullopt;
            return slot->endpoint();
          },
          "The PUB socket's bound endpoint (the real port); None when events are not enabled.")
      .def_property_readonly(
          "events_replay_endpoint",
          [target](const Py& self) -> std::optional<std::string> {
            const auto& slot = *target(self).slot;
            if (!slot || slot->replay_endpoint().empty()) return std::nullopt;
            return slot->replay_endpoint();
          },
          "The replay socket's bound endpoint; None without one.")
      .def(
          "flush_events",
          [target](const Py& self, double timeout) {
            if (!(timeout >= 0))
              throw InvalidArgument("flush_events: timeout must be >= 0 seconds");
            const std::shared_ptr<events::Publisher> p =
                enabled_publisher(target(self), "flush_events");
            const auto ms =
                static_cast<long long>(std::min(timeout, 1e9) * 1000);  // inf: ~31 years
            const py::gil_scoped_release release;
            return p->flush(std::chrono::milliseconds(ms));
          },
          py::arg("timeout") = 1.0,
          "Waits until every event announced before the call is published (sent, or refused "
          "and counted), at most `timeout` seconds; False when that took longer. "
          "InvalidArgument when events are not enabled.");
}

}  // namespace kvport::python
