// SPDX-License-Identifier: Apache-2.0
// A CacheEventSink that publishes a cache's events in vLLM's wire format over
// ZeroMQ (wire.hpp), so that llm-d's and Dynamo's routers follow a kvport
// cache unchanged. docs/events.md ("Publisher") describes threading,
// dropping, replay and snapshot.
#pragma once

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>

#include "kvport/core/cache_events.hpp"
#include "kvport/events/wire.hpp"

namespace kvport::events {

/// What a Publisher binds and how it batches.
struct PublisherOptions {
  /// The PUB socket's endpoint, e.g. "tcp://127.0.0.1:5557"; port 0 (or
  /// "*") binds an ephemeral port, reported by Publisher::endpoint().
  std::string endpoint = "tcp://127.0.0.1:5557";
  /// The first frame of every message (vLLM's default: empty).
  std::string topic;
  /// The batch's third element (nil when absent); in [0, 2^31 - 1], since
  /// Dynamo reads it as an i32 (the constructor throws otherwise).
  std::optional<std::int64_t> data_parallel_rank;
  /// A batch is sent when this many events are buffered (up to 100 us
  /// later while events come faster than a batch per wake-up: the thread
  /// then polls instead of being woken per batch) ...
  std::size_t max_batch_events = 256;
  /// ... or this long after the first of them arrived.
  std::chrono::microseconds batch_interval{10'000};
  /// The hot path's buffer: events accepted but not yet taken by the
  /// publisher thread. Beyond either bound an event is dropped (counted).
  std::size_t buffer_events = 65'536;
  /// Bytes of hashes and tokens in the buffer (8 per hash, 4 per token).
  std::size_t buffer_bytes = 64u << 20;
  /// The caller promises that no two sink calls overlap: they come from one
  /// thread, or from threads that serialize them (a lock of their own held
  /// around the calls). The hot path then takes no lock at all (one atomic
  /// exchange less per event: about 4% of `kvport replay`'s time). Calls that
  /// do overlap with it set are a data race.
  bool single_producer = false;
  /// Map-tagged events (vLLM since mid-2026) or the older positional arrays.
  EventForm form = EventForm::map;
  /// ZMQ_SNDHWM of the PUB socket, in messages, at most: past it a send is
  /// refused (counted as a send failure), never waited for. The PUB socket
  /// sets ZMQ_XPUB_NODROP, so one subscriber whose queue is full refuses the
  /// send for every subscriber: the batch is a counted gap for all of them.
  /// The byte bound below usually sets a lower mark.
  int send_high_water_mark = 100'000;
  /// A batch ends before an event that would take its payload past this
  /// many bytes (estimated: 256 + 9 per hash + 5 per token per event). A
  /// larger BlockStored is split into chained events (each piece's parent
  /// the previous piece's last hash, its tokens the matching slice; each
  /// piece counts as an event), a larger BlockRemoved into several, so
  /// that every batch stays within this; only a single block larger than
  /// this (a huge block_size), or a store whose tokens are not block_size
  /// per hash, goes alone, as large as it is. > 0.
  std::size_t max_batch_bytes = 128u << 10;
  /// Sets the high water mark of one subscriber's (PUB) or one replay
  /// client's (ROUTER) queue in ZeroMQ: send_queue_bytes / max_batch_bytes
  /// messages (512 by default; at least 1, at least 4 on the replay socket;
  /// at most send_high_water_mark on PUB). The mark counts messages, not
  /// bytes: a subscriber that never reads holds that many batches, each of
  /// at most max_batch_bytes of estimated payload (long events are split,
  /// above), so about send_queue_bytes, plus ZeroMQ's per-message overhead
  /// and the kernel's socket buffers. The exception is an event that cannot
  /// be split (one block past max_batch_bytes, or tokens not block_size per
  /// hash): its batch is as large as it, up to 256 + 9 per hash + 5 per
  /// token plus its lora name, about 1.25 x buffer_bytes at most (its
  /// hashes and tokens fit the buffer, 8 and 4 bytes each); a stream of
  /// those makes the bound the mark times that size. > 0.
  std::size_t send_queue_bytes = 64u << 20;
  /// The ROUTER socket for replay and snapshot requests; none when empty.
  std::string replay_endpoint;
  /// Batches the replay ring keeps (vLLM: 10,000) ...
  std::size_t replay_ring_batches = 10'000;
  /// ... and bytes of their payloads it keeps at most (the oldest go first).
  std::size_t replay_ring_bytes = 64u << 20;
  /// Replay and snapshot requests answered per second at most (a bucket of
  /// one second's worth); the others are refused: not answered, counted
  /// (PublisherStats::requests_refused). Their answers are sent a few
  /// frames per turn of the thread, between live batches, each as fast as
  /// its client reads.
  std::size_t max_requests_per_second = 100;
  /// Answers in progress at most; a request beyond is refused.
  std::size_t max_pending_answers = 16;
  /// An answer whose client has not taken a frame for this long is dropped
  /// (PublisherStats::answers_abandoned).
  std::chrono::milliseconds answer_timeout{5'000};
  /// A snapshot is built (O(cached blocks), on the publisher thread, which
  /// sends nothing meanwhile) at most once per this; requests in between
  /// get the last one while it is usable (the ring still holds every batch
  /// after it), or wait.
  std::chrono::milliseconds snapshot_interval{1'000};
  /// How long the destructor waits for sends still queued in ZeroMQ.
  std::chrono::milliseconds linger{1'000};
};

/// Counters, read with Publisher::stats() at any time.
struct PublisherStats {
  std::uint64_t events_accepted = 0;
  std::uint64_t events_dropped = 0;  ///< buffer full (or out of memory)
  std::uint64_t batches_sent = 0;
  std::uint64_t send_failures = 0;  ///< batches ZeroMQ refused (high water mark)
  std::uint64_t replay_requests = 0;
  std::uint64_t snapshots = 0;
  /// Replay-socket requests of neither form (a body that is neither a start
  /// sequence nor the snapshot request: answered with the terminator alone;
  /// a wrong frame count: not answered).
  std::uint64_t bad_requests = 0;
  std::uint64_t next_seq = 0;  ///< sequence the next batch will carry
  /// Sequence numbers skipped for dropped events: each run of drops (and
  /// each batch lost to an allocation failure) skips one, so that every
  /// subscriber sees a gap exactly where events are missing.
  std::uint64_t loss_gaps = 0;
  /// Resyncs applied by the publisher thread (Publisher::resync).
  std::uint64_t resyncs = 0;
  /// Snapshot requests answered with the terminator alone because the
  /// publisher's set was not exact (a loss since the last resync).
  std::uint64_t snapshots_unavailable = 0;
  /// Replay-socket requests not answered: over max_requests_per_second or
  /// max_pending_answers.
  std::uint64_t requests_refused = 0;
  /// Answers dropped: the client left, or took nothing for answer_timeout.
  std::uint64_t answers_abandoned = 0;
  /// Events in the batches ZeroMQ refused (send_failures).
  std::uint64_t events_unsent = 0;
  /// Batches published but not kept for replay (out of memory): the ring is
  /// emptied then, so a replay from before gets a miss; nothing was lost live.
  std::uint64_t batches_not_kept = 0;
};

/// What Publisher::close could not deliver.
struct CloseReport {
  /// Every event accepted before close() was published within its timeout.
  bool flushed = false;
  /// ZeroMQ sent every queued message before the linger ran out (or nothing
  /// was ever sent): the context ended, counted from before the socket's
  /// close, with at least max(10 ms, linger / 10) of the linger left. A
  /// return nearer the linger counts as not drained (a loss over-reported,
  /// never hidden).
  bool drained = false;
  /// Events never published: the buffer was full (PublisherStats).
  std::uint64_t events_dropped = 0;
  /// Events in batches ZeroMQ refused at a subscriber's high water mark.
  std::uint64_t events_unsent = 0;
  /// Not drained: the events of the last batches sent, as many as one
  /// subscriber's queue holds (send_queue_bytes), which the linger may
  /// have discarded for a slow subscriber: an upper bound (ZeroMQ does not
  /// say how many it discarded). 0 when drained.
  std::uint64_t events_maybe_discarded = 0;
  /// Every event some subscriber may not have received, at most.
  std::uint64_t not_delivered() const noexcept {
    return events_dropped + events_unsent + events_maybe_discarded;
  }
};

/// The request frame that asks the replay socket for a snapshot (any other
/// 8-byte frame is a replay start sequence).
inline constexpr std::string_view snapshot_request = "kvport.snapshot";

/// Publishes the events it is given. The sink calls (stored, removed,
/// cleared) may come from one or several threads; each copies the event into
/// a bounded buffer (a chain of chunks the publisher thread reads, published
/// with one release store; a mutex among the producers only, none with
/// single_producer) and returns: they never block on the network, never
/// throw, and drop (counted) when the buffer is full. A thread of its own
/// (woken per full batch, or polling every 100 us while events come fast)
/// batches, encodes, assigns sequence numbers (from 0, +1
/// per batch, also for a batch whose send failed, and +1 more where events
/// were dropped, so a subscriber sees every loss as a gap), sends three
/// frames [topic, seq as 8 bytes big-endian, payload] on a PUB socket and
/// answers the replay socket (rate-limited, a few frames a turn between live
/// batches, as fast as each client reads).
///
/// Replay (as vLLM): a DEALER client sends one frame, a start sequence as 8
/// bytes big-endian, and receives [seq, payload] for every kept batch with
/// start <= seq < the next sequence when asked, then [-1 as 8 bytes (all
/// 0xff), ""] (a REQ client gets the first of them only). A
/// start older than the ring gets what is kept: the first seq returned is
/// then later than asked (a miss). Snapshot (kvport): the frame
/// "kvport.snapshot" gets [S, payload] then the terminator, where payload is
/// one batch of BlockStored events (one per cached block, parents before
/// children within a chain) holding exactly the blocks cached after every
/// batch with seq < S. The publisher keeps that set itself, from the events
/// it publishes (it never calls into the cache), when replay_endpoint is set.
class Publisher final : public CacheEventSink {
 public:
  /// Binds the sockets and starts the thread. Throws InvalidArgument on a
  /// bad option (an endpoint ZeroMQ refuses or cannot bind, zero buffer or
  /// batch size, zero ring with a replay endpoint, a data_parallel_rank
  /// outside [0, 2^31 - 1]).
  explicit Publisher(PublisherOptions options);
  /// close(options.linger) unless close() ran.
  ~Publisher() override;

  /// The bounded exit flush: publishes what is buffered (flush), stops the
  /// thread and closes the sockets, waiting for ZeroMQ to send what is
  /// queued, all within `timeout`; reports what may not have been
  /// delivered. The sink calls drop (counted) from then on; stats() still
  /// works; a second call returns the first report. Costs up to `timeout`
  /// when a subscriber is slow. Does not throw.
  CloseReport close(std::chrono::milliseconds timeout) noexcept;
  Publisher(const Publisher&) = delete;
  Publisher& operator=(const Publisher&) = delete;

  void stored(const EventSource& source, const BlockStoredView& blocks) noexcept override;
  void removed(const EventSource& source, std::span<const BlockHash> hashes) noexcept override;
  void cleared(const EventSource& source) noexcept override;

  /// Waits until every event accepted before the call has been published
  /// (sent or failed); false if that took longer than `timeout`.
  bool flush(std::chrono::milliseconds timeout);

  /// True when events were dropped (with a replay endpoint) since the last
  /// resync(): the publisher's cached set, which snapshots are served from,
  /// misses them, and snapshot requests are answered without one until the
  /// caches re-announce their sets through resync(). One relaxed load: cheap
  /// enough to test after every cache operation. Always false without a
  /// replay endpoint (no set is kept).
  bool needs_resync() const noexcept;
  /// Rebuilds the cached set from the caches: calls `announce(sink)`, which
  /// must make every cache this publisher is the sink of announce its whole
  /// set to `sink` (PrefixCache::snapshot(sink), HostTier::snapshot(sink),
  /// ...; never this publisher itself: the calls hold the producers' lock),
  /// then hands the set to the publisher thread at this point of the stream:
  /// snapshots are exact again from the batches after it. Call it where the
  /// caches are quiescent (on their thread, between operations); the
  /// producers' sink calls wait meanwhile. Costs O(cached blocks) on the
  /// caller's thread and memory for a second copy of the set until the
  /// thread takes it. Returns false (needs_resync() stays true) when the
  /// publisher is being destroyed, is out of memory or out of sources. Throws
  /// what `announce` throws (nothing changed). Without a replay endpoint it
  /// does nothing and returns true.
  bool resync(const std::function<void(CacheEventSink&)>& announce);

  /// The PUB socket's bound endpoint (ZMQ_LAST_ENDPOINT: the real port).
  const std::string& endpoint() const noexcept;
  /// The replay socket's bound endpoint; empty without one.
  const std::string& replay_endpoint() const noexcept;

  PublisherStats stats() const noexcept;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace kvport::events
