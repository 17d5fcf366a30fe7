// SPDX-License-Identifier: Apache-2.0
// Subscriber: the ZeroMQ client that feeds a RouterIndex from the instances'
// event publishers (events::Publisher, or vLLM's). Per instance it holds a
// SUB socket on the PUB endpoint and, when the instance has a replay
// endpoint, a DEALER on its ROUTER replay/snapshot socket; it decodes every
// batch (events/wire.hpp), applies it to the index, and answers the index's
// needs (a gap: a replay request; a replay miss or a dropped instance: a
// snapshot request). docs/events.md ("Subscriber") gives the sequence of
// requests and the counters.
//
// ZeroMQ and msgpack stay inside this target (kvport::router_subscriber);
// kvport::router itself does not depend on them.
#pragma once

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>

#include "kvport/router/router_index.hpp"

namespace kvport::router {

/// Where one instance publishes.
struct InstanceEndpoints {
  /// The instance's PUB endpoint, e.g. "tcp://127.0.0.1:5557".
  std::string events;
  /// Its ROUTER replay/snapshot endpoint (PublisherOptions::replay_endpoint).
  /// Empty: none; a gap (or a snapshot need) of that instance then cannot be
  /// closed: it is counted (SubscriberStats::unserviceable_needs) and its
  /// batches stay held until a restart of its stream (seq 0).
  std::string replay;
};

/// Options of a Subscriber, checked by its constructor (InvalidArgument).
struct SubscriberOptions {
  /// SUB filter prefix: only messages whose first frame starts with it; ""
  /// takes all.
  std::string topic;
  /// A replay or snapshot answer not complete by then (> 0; each frame of
  /// the answer starts it again): a replay turns into a snapshot need
  /// (RouterIndex::replay_failed); a snapshot is asked again. Either way the
  /// DEALER socket is replaced, so that a late answer is never taken for the
  /// next request's.
  std::chrono::milliseconds request_timeout{2000};
  /// wait_for: when the batches it waits for have not all arrived this long
  /// (> 0) after the last progress, it asks the replay of the first missing
  /// one itself (a loss at a stream's tail shows no gap). Also: an answer
  /// silent this long after a frame, without its terminator, has ended.
  std::chrono::milliseconds tail_timeout{100};
  /// poll() calls index.expire(now) (instance_timeout of the index).
  bool expire_silent = true;
  /// A live or replayed batch frame larger than this (> 0) is never read:
  /// ZMQ_MAXMSGSIZE of the SUB socket (ZeroMQ ends the session with the
  /// publisher that sent it, a protocol error, and does not reconnect: the
  /// instance goes silent, is expired by instance_timeout, and must be
  /// removed and added again); counted as malformed and skipped if it
  /// arrives through the DEALER (reopen_dealer makes a new one).
  std::size_t max_message_bytes = 16u << 20;
  /// The same for a snapshot answer (one frame holding every cached block:
  /// about 210 bytes a block in map form): ZMQ_MAXMSGSIZE of the DEALER.
  std::size_t max_snapshot_bytes = 256u << 20;
  /// ZMQ_RCVHWM of each SUB and DEALER socket, in messages (> 0): past it
  /// ZeroMQ drops live messages (a gap the replay closes) and stops reading
  /// an answer until there is room. Memory queued per instance is at most
  /// about this many messages of max_message_bytes (ZeroMQ holds a multipart
  /// message until its last frame arrives: see docs/reliability.md).
  int receive_high_water_mark = 10'000;
  /// Work one poll() does after its wait, at most: messages (over all
  /// sockets) ...
  std::size_t max_poll_messages = 4'096;
  /// ... bytes received ...
  std::size_t max_poll_bytes = 64u << 20;
  /// ... and time spent receiving and applying (checked between messages).
  /// What is left stays queued for the next call (SubscriberStats::
  /// budget_stops); answers are taken before live messages, and the first
  /// socket rotates, so that one flooding publisher cannot starve the rest.
  std::chrono::milliseconds poll_work_budget{50};
};

/// What a Subscriber did, over all its instances. Monotonic.
struct SubscriberStats {
  /// Live messages received on the SUB sockets (malformed ones included).
  std::uint64_t messages = 0;
  /// Messages or answer frames skipped: wrong frame count, a sequence frame
  /// that is not 8 bytes, a payload that does not decode, a frame larger
  /// than max_message_bytes.
  std::uint64_t malformed = 0;
  /// Events of an unknown type skipped inside batches that decoded.
  std::uint64_t unknown_events = 0;
  /// Batches the index applied in sequence: live, replayed, and held ones
  /// it applied once their gap closed (or after a snapshot).
  std::uint64_t applied = 0;
  /// Batches dropped as already applied or held (index duplicates, and the
  /// copies of batches a snapshot already contained).
  std::uint64_t duplicates = 0;
  /// Batches the index held after a gap or while a snapshot was needed.
  std::uint64_t held = 0;
  /// Restarts of an instance's stream the index detected.
  std::uint64_t restarts = 0;
  /// Replay requests sent (for a gap, or by wait_for for a tail loss).
  std::uint64_t replay_requests = 0;
  /// Batches received in replay answers.
  std::uint64_t replayed_batches = 0;
  /// Replay answers that ended without the missing batch (the ring no
  /// longer had it): RouterIndex::replay_failed, then a snapshot.
  std::uint64_t replay_misses = 0;
  /// Snapshot requests sent (retries included).
  std::uint64_t snapshot_requests = 0;
  /// Snapshots applied to the index.
  std::uint64_t snapshots_applied = 0;
  /// Replay or snapshot answers not complete within request_timeout.
  std::uint64_t request_timeouts = 0;
  /// Answers that began, then stopped for tail_timeout without their
  /// terminator (the publisher's ROUTER dropped their tail at its high water
  /// mark): ended there; what is still missing is asked for again at once.
  std::uint64_t truncated_answers = 0;
  /// Needs (a gap, a snapshot) of instances without a replay endpoint, which
  /// nothing can close: counted once each time an instance's need changes.
  std::uint64_t unserviceable_needs = 0;
  /// Messages of more than 4 frames (also counted as malformed): their
  /// frames past the fourth were read and discarded, never held.
  std::uint64_t too_many_parts = 0;
  /// Times a poll() stopped receiving from a socket because its work budget
  /// (messages, bytes or time) was spent while a message was still queued
  /// there; the rest waits for the next call. A budget spent exactly by the
  /// last queued message is no stop.
  std::uint64_t budget_stops = 0;
};

/// Connects a RouterIndex to the instances' publishers. Single-threaded: the
/// caller's thread does everything (poll, wait_for, add/remove), as the
/// index is not thread-safe; no thread of its own besides ZeroMQ's I/O
/// thread. At most one replay or snapshot request per instance is in flight.
class Subscriber {
 public:
  /// `index` must outlive the subscriber. Throws InvalidArgument on bad
  /// options (a timeout, size, budget or high water mark <= 0).
  explicit Subscriber(RouterIndex& index, SubscriberOptions options = {});
  /// Closes every socket (linger 0): nothing is left running.
  ~Subscriber();
  Subscriber(const Subscriber&) = delete;
  Subscriber& operator=(const Subscriber&) = delete;

  /// index.add_instance(id, now), then connects a SUB to endpoints.events
  /// (and a DEALER to endpoints.replay when set). The stream is expected
  /// from seq 0: batches the SUB missed while it joined (ZeroMQ's slow
  /// joiner) are a gap that the replay closes. Throws InvalidArgument for a
  /// bad endpoint (empty, not one ZeroMQ can connect to, a tcp port outside
  /// 1..65535) or an id the index refuses (known, out of range); nothing is
  /// added then.
  void add_instance(InstanceId id, const InstanceEndpoints& endpoints, Clock::time_point now);
  /// Disconnects the instance's sockets (an answer in flight is dropped)
  /// and calls index.remove_instance(id). Throws InvalidArgument for an id
  /// not added here.
  void remove_instance(InstanceId id);

  /// Waits up to `timeout` (0: not at all; less when a request's deadline
  /// comes first; the whole `timeout` without instances) until a message is
  /// there on any socket, then receives what is queued within its budget
  /// (max_poll_messages, max_poll_bytes, poll_work_budget; answers first),
  /// applies it, and acts on index.needs() for every instance:
  /// sends replay and snapshot requests, applies their answers, times them
  /// out. Calls index.expire(now) when expire_silent. Returns the messages
  /// handled (live messages and answer frames).
  std::size_t poll(std::chrono::milliseconds timeout);

  /// Polls until instance `id` has applied every batch with seq < next_seq
  /// and needs nothing (true), or `timeout` passed (false). A loss at the
  /// tail of a stream shows no gap: when those batches have not all arrived
  /// within tail_timeout of the last progress, it asks the replay from the
  /// first missing seq itself (instances with a replay endpoint). Throws
  /// InvalidArgument for an id not added here. After a restart of the
  /// stream, `next_seq` is of the new stream, and batches the old one
  /// applied up to it count as applied: wait for the restart first
  /// (stats().restarts).
  bool wait_for(InstanceId id, std::uint64_t next_seq, std::chrono::milliseconds timeout);

  SubscriberStats stats() const noexcept;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace kvport::router
