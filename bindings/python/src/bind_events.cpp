// SPDX-License-Identifier: Apache-2.0
// KV cache events in the Python module: kvport.EventPublisherStats, the
// options of enable_events and what enable_events and disable_events do
// (events.hpp; the methods are added to PrefixCache and HybridKvCache by
// def_events).
#include <pybind11/pybind11.h>

#include <chrono>
#include <cmath>
#include <memory>
#include <sstream>
#include <string>
#include <utility>

#include "events.hpp"
#include "kvport/events/publisher.hpp"
#include "kvport/platform/error.hpp"
#include "parts.hpp"

namespace kvport::python {

namespace {

template <class Duration>
Duration seconds_option(double seconds, const char* what) {
  if (!(seconds >= 0) || !std::isfinite(seconds))
    throw InvalidArgument(std::string("enable_events: ") + what +
                          " must be a finite number of seconds >= 0");
  return std::chrono::duration_cast<Duration>(std::chrono::duration<double>(seconds));
}

}  // namespace

events::PublisherOptions publisher_options(const EventsKeywords& k) {
  events::PublisherOptions o;
  o.endpoint = k.endpoint;
  o.topic = k.topic;
  if (k.replay_endpoint) o.replay_endpoint = *k.replay_endpoint;
  o.data_parallel_rank = k.data_parallel_rank;
  if (k.form == "map")
    o.form = events::EventForm::map;
  else if (k.form == "positional")
    o.form = events::EventForm::positional;
  else
    throw InvalidArgument("enable_events: unknown form '" + k.form + "' (known: map, positional)");
  if (k.max_batch_events) o.max_batch_events = *k.max_batch_events;
  if (k.batch_interval)
    o.batch_interval =
        seconds_option<std::chrono::microseconds>(*k.batch_interval, "batch_interval");
  if (k.buffer_events) o.buffer_events = *k.buffer_events;
  if (k.buffer_bytes) o.buffer_bytes = *k.buffer_bytes;
  if (k.send_high_water_mark) o.send_high_water_mark = *k.send_high_water_mark;
  if (k.replay_ring_batches) o.replay_ring_batches = *k.replay_ring_batches;
  if (k.linger) o.linger = seconds_option<std::chrono::milliseconds>(*k.linger, "linger");
  return o;
}

void enable_events(const EventsTarget& target, const EventsKeywords& keywords, const char* name) {
  if (*target.slot)
    throw InvalidArgument(std::string(name) +
                          ".enable_events: events are enabled already (disable_events first to "
                          "change the options)");
  auto publisher = std::make_shared<events::Publisher>(publisher_options(keywords));
  try {
    target.install(publisher.get());
    target.snapshot(*publisher);
  } catch (...) {
    target.install(nullptr);
    throw;
  }
  *target.slot = std::move(publisher);
}

void disable_events(const EventsTarget& target) {
  std::shared_ptr<events::Publisher> publisher = std::move(*target.slot);
  if (!publisher) return;
  target.announce_clear(*publisher);
  target.install(nullptr);
  // The destructor sends what is buffered and waits for ZeroMQ (up to the
  // linger): not with the GIL held.
  const py::gil_scoped_release release;
  publisher.reset();
}

const std::shared_ptr<events::Publisher>& enabled_publisher(const EventsTarget& target,
                                                            const char* op) {
  if (!*target.slot) throw InvalidArgument(std::string(op) + ": events are not enabled");
  return *target.slot;
}

void bind_events(py::module_& m) {
  py::class_<events::PublisherStats>(m, "EventPublisherStats",
                                     "A KV event publisher's counters (events_stats()).")
      .def_readonly("events_accepted", &events::PublisherStats::events_accepted)
      .def_readonly("events_dropped", &events::PublisherStats::events_dropped,
                    "Events the buffer had no room for (or no memory).")
      .def_readonly("batches_sent", &events::PublisherStats::batches_sent)
      .def_readonly("send_failures", &events::PublisherStats::send_failures,
                    "Batches ZeroMQ refused (high water mark); their sequence numbers are gaps.")
      .def_readonly("replay_requests", &events::PublisherStats::replay_requests)
      .def_readonly("snapshots", &events::PublisherStats::snapshots)
      .def_readonly("bad_requests", &events::PublisherStats::bad_requests)
      .def_readonly("next_seq", &events::PublisherStats::next_seq,
                    "The sequence number the next batch will carry.")
      .def("__repr__", [](const events::PublisherStats& s) {
        std::ostringstream o;
        o << "EventPublisherStats(events_accepted=" << s.events_accepted
          << ", events_dropped=" << s.events_dropped << ", batches_sent=" << s.batches_sent
          << ", send_failures=" << s.send_failures << ", next_seq=" << s.next_seq << ")";
        return o.str();
      });
}

}  // namespace kvport::python
