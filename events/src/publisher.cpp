// SPDX-License-Identifier: Apache-2.0
#include "kvport/events/publisher.hpp"

#include <pthread.h>
#include <sys/eventfd.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <cerrno>
#include <condition_variable>
#include <cstring>
#include <deque>
#include <functional>
#include <mutex>
#include <new>
#include <span>
#include <string>
#include <system_error>
#include <thread>
#include <vector>

#include <absl/container/flat_hash_map.h>

#include <zmq.hpp>
#include <zmq_addon.hpp>

#include "kvport/platform/error.hpp"

namespace kvport::events {
namespace {

// Bytes an event holds in the buffer, for PublisherOptions::buffer_bytes.
constexpr std::size_t event_overhead = 64;

// "tcp://host:0" binds an ephemeral port in ZeroMQ as "tcp://host:*".
std::string zmq_endpoint(std::string e) {
  if (e.starts_with("tcp://") && e.ends_with(":0")) e.replace(e.size() - 1, 1, "*");
  return e;
}

std::string last_endpoint(zmq::socket_t& s) {
  return s.get(zmq::sockopt::last_endpoint);
}

// ZeroMQ takes a tcp port modulo 65536 (tcp://127.0.0.1:99999 binds 34463):
// a port that is not a number in [0, 65535] (or "*") is refused here.
void check_tcp_port(const std::string& endpoint, const char* what) {
  if (endpoint.rfind("tcp://", 0) != 0) return;
  const std::size_t colon = endpoint.rfind(':');
  const std::string port = colon == std::string::npos ? "" : endpoint.substr(colon + 1);
  if (port == "*") return;
  const bool digits =
      !port.empty() && port.size() <= 5 &&
      std::all_of(port.begin(), port.end(), [](char c) { return c >= '0' && c <= '9'; });
  if (!digits || std::stoul(port) > 65535) {
    throw InvalidArgument(std::string("events publisher: the ") + what + " endpoint '" + endpoint +
                          "' has no port in [0, 65535] (0: any free port)");
  }
}

void bind_or_throw(zmq::socket_t& s, const std::string& endpoint, const char* what) {
  check_tcp_port(endpoint, what);
  try {
    s.bind(zmq_endpoint(endpoint));
  } catch (const zmq::error_t& e) {
    throw InvalidArgument(std::string("events publisher: cannot bind the ") + what + " endpoint '" +
                          endpoint + "': " + e.what());
  }
}

// ---- the hand-off: a chain of chunks, one writer, one reader ------------------------
// The hot path appends each event (a header, its hashes, tokens and lora
// name) to the last chunk and publishes it with one release store of the
// accepted count; the publisher thread reads the events up to the count it
// acquired, in order, and gives each chunk it has left behind back to a free
// list. Producers exclude one another with a mutex that only they take (the
// publisher thread never does), none with single_producer. The publisher
// thread is woken by an eventfd only when a batch fills while it sleeps (or
// half the buffer while it polls: see run()), and on flush and stop.

struct EventHeader {
  // store, remove, clear: events. loss: events were dropped here (the thread
  // skips a sequence number). resync: the cached set is replaced here by the
  // one `parent` points to (Publisher::resync). next_chunk: read on in the next chunk.
  enum Kind : std::uint8_t { store, remove, clear, next_chunk, loss, resync };
  std::uint8_t kind = store;
  std::uint8_t has_parent = 0;
  std::uint16_t source = 0;
  std::uint32_t block_size = 0;
  std::uint32_t n_hashes = 0;
  std::uint32_t n_tokens = 0;
  std::uint32_t lora_len = 0;  // lora_len - 1 bytes of name follow; 0: none
  std::uint32_t unused = 0;
  std::uint64_t parent = 0;
};
static_assert(sizeof(EventHeader) == 32);

constexpr std::size_t round8(std::size_t n) noexcept {
  return (n + 7) & ~std::size_t{7};
}

// Bytes an event takes in a chunk.
constexpr std::size_t raw_size(std::size_t hashes, std::size_t tokens, std::size_t lora) noexcept {
  return sizeof(EventHeader) + 8 * hashes + round8(4 * tokens) + round8(lora);
}

// Bytes an event counts against PublisherOptions::buffer_bytes.
constexpr std::size_t accounted_bytes(std::size_t hashes, std::size_t tokens) noexcept {
  return event_overhead + 8 * hashes + 4 * tokens;
}

constexpr std::size_t chunk_bytes = 256 << 10;
constexpr std::size_t free_chunks_kept = 64;

struct alignas(64) Chunk {  // a line of its own: the producer reads it per event
  explicit Chunk(std::size_t cap)
      : capacity(cap), data(static_cast<std::byte*>(::operator new (cap, std::align_val_t{64}))) {}
  ~Chunk() { ::operator delete (data, std::align_val_t{64}); }
  Chunk(const Chunk&) = delete;
  Chunk& operator=(const Chunk&) = delete;
  const std::size_t capacity;
  std::byte* const data;
  Chunk* next = nullptr;  // set by the producer when it moves on
};

// Asks for a cache line in a writable state (x86's PREFETCHW, a no-op on the
// CPUs without it).
void prefetch_for_write(const void* p) noexcept {
#if defined(__x86_64__) || defined(__i386__)
  asm volatile("prefetchw %0" : : "m"(*static_cast<const char*>(p)));
#else
  __builtin_prefetch(p, 1, 3);
#endif
}

// One event read back from a chunk.
struct EventRef {
  EventHeader h;
  std::span<const std::uint64_t> hashes;
  std::span<const TokenId> tokens;
  std::optional<std::string_view> lora;
};

EventRef read_event(const std::byte* p) noexcept {
  EventRef e;
  std::memcpy(&e.h, p, sizeof e.h);
  p += sizeof(EventHeader);
  e.hashes = {reinterpret_cast<const std::uint64_t*>(p), e.h.n_hashes};
  p += 8 * std::size_t{e.h.n_hashes};
  e.tokens = {reinterpret_cast<const TokenId*>(p), e.h.n_tokens};
  p += round8(4 * std::size_t{e.h.n_tokens});
  if (e.h.lora_len != 0)
    e.lora = std::string_view(reinterpret_cast<const char*>(p), e.h.lora_len - 1);
  return e;
}

// ---- the cached set, kept from the published events for snapshots --------------------
// Keyed by where a block is (medium and group: the key a subscriber's set
// has) and its hash; a block keeps its parent, tokens (up to 16 inline), lora
// name and the source it was stored from (spec kind and window).
struct BlockKey {
  std::uint64_t where = 0;  // medium << 40 | has_group << 32 | group
  std::uint64_t hash = 0;
  friend bool operator==(const BlockKey&, const BlockKey&) = default;
  template <class H>
  friend H AbslHashValue(H h, const BlockKey& k) {
    return H::combine(std::move(h), k.where, k.hash);
  }
};
std::uint64_t where_of(Medium medium, std::optional<std::uint32_t> group) noexcept {
  return std::uint64_t{static_cast<std::uint8_t>(medium)} << 40 |
         (group ? std::uint64_t{1} << 32 | *group : 0);
}
Medium medium_of(std::uint64_t where) noexcept {
  return static_cast<Medium>(where >> 40);
}
std::optional<std::uint32_t> group_of(std::uint64_t where) noexcept {
  if ((where >> 32 & 1) == 0) return std::nullopt;
  return static_cast<std::uint32_t>(where);
}

struct BlockRecord {
  static constexpr std::size_t inline_tokens = 16;
  std::uint64_t ordinal = 0;  // when it was stored: snapshots keep that order
  std::uint64_t parent = 0;
  bool has_parent = false;
  std::uint16_t source = 0;
  std::uint32_t block_size = 0;
  std::uint32_t n_tokens = 0;
  std::array<TokenId, inline_tokens> tokens{};
  std::vector<TokenId> more_tokens;  // all of them, when more than inline_tokens
  std::optional<std::string> lora_name;

  std::span<const TokenId> token_span() const noexcept {
    if (n_tokens > inline_tokens) return more_tokens;
    return std::span(tokens).first(n_tokens);
  }
  void set_tokens(std::span<const TokenId> t) {
    n_tokens = static_cast<std::uint32_t>(t.size());
    if (t.size() > inline_tokens) {
      more_tokens.assign(t.begin(), t.end());
    } else {
      more_tokens.clear();
      std::copy(t.begin(), t.end(), tokens.begin());
    }
  }
};

// The index maps a block to its record in a pool (small slots, so that the
// index stays in cache); a removed block's record goes back to a free list
// and is reused in place by the next stored one.
class CachedSet {
 public:
  void stored(const EventSource& src, const EventRef& e) {
    const std::uint64_t where = where_of(src.medium, src.group_idx);
    for (std::size_t i = 0; i < e.hashes.size(); ++i) {
      const auto [it, inserted] = index_.try_emplace(BlockKey{where, e.hashes[i]}, 0u);
      if (inserted) {
        try {
          it->second = allocate();
        } catch (...) {
          index_.erase(it);
          throw;
        }
      }
      BlockRecord& rec = pool_[it->second];
      rec.ordinal = next_ordinal_++;
      rec.has_parent = i != 0 || e.h.has_parent;
      rec.parent = i == 0 ? e.h.parent : e.hashes[i - 1];
      rec.source = e.h.source;
      rec.block_size = e.h.block_size;
      const std::size_t begin = i * e.h.block_size;
      if (begin < e.tokens.size()) {
        const std::size_t end = std::min(e.tokens.size(), begin + e.h.block_size);
        rec.set_tokens(e.tokens.subspan(begin, end - begin));
      } else {
        rec.set_tokens({});
      }
      if (e.lora) {
        rec.lora_name.emplace(*e.lora);
      } else {
        rec.lora_name.reset();
      }
    }
  }
  // Asks for the index slot of a block an event names soon.
  void prefetch(const EventSource& src, std::uint64_t hash) const {
    index_.prefetch(BlockKey{where_of(src.medium, src.group_idx), hash});
  }
  void removed(const EventSource& src, std::span<const std::uint64_t> hashes) {
    const std::uint64_t where = where_of(src.medium, src.group_idx);
    for (std::uint64_t h : hashes) {
      const auto it = index_.find(BlockKey{where, h});
      if (it == index_.end()) continue;
      free_.push_back(it->second);  // reserved: see allocate()
      index_.erase(it);
    }
  }
  void cleared(const EventSource& src) {
    // A cleared event carries its source's medium, and its group when any.
    const std::optional<std::uint32_t> group = src.group_idx;
    absl::erase_if(index_, [&](const auto& kv) {
      const bool hit =
          medium_of(kv.first.where) == src.medium && (!group || group_of(kv.first.where) == group);
      if (hit) free_.push_back(kv.second);
      return hit;
    });
  }

  // The set as BlockStored events, oldest first.
  template <class SourceAt>
  std::vector<CacheEvent> as_events(SourceAt&& source_at) const {
    std::vector<std::pair<const BlockKey*, const BlockRecord*>> order;
    order.reserve(index_.size());
    for (const auto& kv : index_)
      order.emplace_back(&kv.first, &pool_[kv.second]);
    std::sort(order.begin(), order.end(),
              [](const auto& a, const auto& b) { return a.second->ordinal < b.second->ordinal; });
    std::vector<CacheEvent> out;
    out.reserve(order.size());
    for (const auto& [key, rec] : order) {
      const BlockRecord& r = *rec;
      const EventSource& src = source_at(r.source);
      BlockStored s;
      s.block_hashes = {key->hash};
      if (r.has_parent) s.parent_block_hash = r.parent;
      const auto t = r.token_span();
      s.token_ids.assign(t.begin(), t.end());
      s.block_size = r.block_size;
      s.medium = to_string(medium_of(key->where));
      s.lora_name = r.lora_name;
      s.group_idx = group_of(key->where);
      s.kv_cache_spec_kind = src.spec_kind;
      s.kv_cache_spec_sliding_window = src.sliding_window;
      out.emplace_back(std::move(s));
    }
    return out;
  }

 private:
  // A free record, or a new one; free_ keeps room for every record, so that
  // giving one back never allocates.
  std::uint32_t allocate() {
    if (!free_.empty()) {
      const std::uint32_t r = free_.back();
      free_.pop_back();
      return r;
    }
    free_.reserve(pool_.size() + 1);
    pool_.emplace_back();
    return static_cast<std::uint32_t>(pool_.size() - 1);
  }

  absl::flat_hash_map<BlockKey, std::uint32_t> index_;
  std::vector<BlockRecord> pool_;
  std::vector<std::uint32_t> free_;
  std::uint64_t next_ordinal_ = 0;
};

double wall_seconds() {
  return std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch()).count();
}

std::int64_t steady_ns() noexcept {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(
             std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

zmq::const_buffer as_buffer(const std::array<std::byte, 8>& a) {
  return zmq::buffer(a.data(), a.size());
}

// The group's kind, which every event of a group source carries (a router
// that indexes groups by kind applies removals and clears by it too).
std::optional<std::string_view> kind_of(const EventSource& src) noexcept {
  if (!src.spec_kind) return std::nullopt;
  return std::string_view(*src.spec_kind);
}

// A payload shared by the ring and the answers that send it.
using Shared = std::shared_ptr<const std::string>;

// A zero-copy message of `body`: ZeroMQ holds a reference until it is sent.
zmq::message_t shared_message(const Shared& body) {
  auto hint = std::make_unique<Shared>(body);
  zmq::message_t m(
      const_cast<char*>(body->data()), body->size(),
      [](void*, void* h) { delete static_cast<Shared*>(h); }, hint.get());
  (void)hint.release();
  return m;
}

// One request being answered on the replay socket.
struct Answer {
  enum class Kind : std::uint8_t { replay, snapshot, terminator };
  Kind kind = Kind::terminator;
  std::vector<std::string> prefix;  // the routing frames: identity [, ""]
  std::uint64_t cursor = 0;         // replay: the next seq to send
  std::uint64_t end = 0;            // replay: sends seq < end (published when asked)
  std::int64_t last_progress_ns = 0;
};

// Answer frames sent per turn of the publisher thread, over all answers,
// between which live batches go out.
constexpr std::size_t answer_frames_per_turn = 64;

// Estimated encoded bytes of an event (for max_batch_bytes): keys and
// scalars, 9 per hash, up to 5 per token, the lora name.
constexpr std::size_t encoded_bound(std::size_t hashes, std::size_t tokens,
                                    std::size_t lora) noexcept {
  return 256 + 9 * hashes + 5 * tokens + lora;
}

}  // namespace

struct Publisher::Impl {
  PublisherOptions opt;
  zmq::context_t ctx{1};
  zmq::socket_t pub{ctx, zmq::socket_type::pub};
  std::optional<zmq::socket_t> router;
  std::string bound;
  std::string replay_bound;
  int wake_fd = -1;               // eventfd: the publisher thread's wake-up
  std::uint64_t half_buffer = 1;  // max(1, buffer_events / 2)
  // Every group of members below that one side writes starts a cache line
  // of its own, so that the other side's reads do not miss on its writes.

  // ---- the producers' side (under producer_mu) ----
  // Only producers take it (the publisher thread never does), so it stays in
  // the producing core's cache; single_producer skips it.
  alignas(64) std::mutex producer_mu;
  bool stop = false;
  Chunk* tail = nullptr;  // the chunk being written
  std::size_t tail_used = 0;
  std::uint64_t produced = 0;  // == accepted, the producers' copy
  std::uint64_t produced_bytes = 0;
  std::uint16_t last_source = 0;
  std::size_t n_sources = 0;
  bool loss_marked = false;  // the last item appended is a loss marker
  // A drop whose loss marker could not be appended (out of memory): the
  // marker is appended before the next item that is, so the loss still
  // makes a sequence gap exactly there.
  bool loss_owed = false;
  // Published with release: every event before it is readable.
  std::atomic<std::uint64_t> accepted{0};
  // When the first event not yet taken arrived (steady clock, ns).
  std::atomic<std::int64_t> first_pending_ns{0};

  // Interned sources, stable for the publisher's life: page p holds sources
  // [256 p, 256 p + 256); producers append, the thread reads those its events name.
  static constexpr std::size_t source_page = 256;
  static constexpr std::size_t max_sources = 65'536;
  alignas(64) std::array<std::unique_ptr<EventSource[]>, max_sources / source_page> source_pages;
  const EventSource& source_at(std::size_t i) const noexcept {
    return source_pages[i / source_page][i % source_page];
  }
  EventSource& source_at(std::size_t i) noexcept {
    return source_pages[i / source_page][i % source_page];
  }

  // ---- written by the publisher thread, read by the producers ----
  alignas(64) std::atomic<std::uint64_t> taken{0};  // events read by the thread
  std::atomic<std::uint64_t> taken_bytes{0};        // their accounted bytes
  // The thread is about to sleep (or sleeps): `sleeping` wakes on a full batch,
  // `sleeping_busy` (events come faster than the thread wakes) only when the
  // buffer is half full; flush and stop always wake it.
  enum Waiting : std::uint8_t { awake, sleeping, sleeping_busy };
  std::atomic<std::uint8_t> waiting{awake};

  // ---- the publisher thread's own ----
  alignas(64) Chunk* head = nullptr;  // the chunk being read
  std::size_t head_used = 0;
  std::vector<const std::byte*> batch_events;  // one batch's, reused
  std::string payload;
  // The replay ring: batches shared with the answers that still send them
  // (zero-copy messages), bounded by replay_ring_batches and _bytes.
  std::deque<std::pair<std::uint64_t, Shared>> ring;
  std::size_t ring_bytes = 0;
  // Answers being sent, a few frames a turn, as each client's pipe has room.
  std::deque<Answer> answers;
  // The last snapshot built (payload, its S, when): served again to clients
  // that ask before snapshot_interval has passed, while it stays usable.
  Shared snapshot_payload;
  std::uint64_t snapshot_seq = 0;
  std::int64_t snapshot_built_ns = 0;
  bool snapshot_ever_built = false;
  // Requests' token bucket (max_requests_per_second).
  double request_tokens = 0;
  std::int64_t request_tokens_ns = 0;
  CachedSet cached;
  // The cached set misses what was dropped since the last resync marker: no
  // snapshot is served (it would not be exact).
  bool stale = false;
  // A sequence number was skipped and no batch has been sent since: the
  // take ends with an empty batch, so that every subscriber sees the gap now.
  bool gap_unseen = false;

  std::atomic<std::uint64_t> lost{0}, sent{0}, send_failures{0}, replays{0}, snapshots{0},
      bad_requests{0}, next_seq{0}, loss_gaps{0}, resyncs{0}, snapshots_unavailable{0},
      requests_refused{0}, answers_abandoned{0}, events_unsent{0}, batches_not_kept{0};
  // Events of the last batches sent (at most a subscriber queue's worth),
  // the thread's until it is joined.
  std::deque<std::uint32_t> recent_batches;
  std::uint64_t recent_events = 0;
  std::optional<CloseReport> closed;  // close() ran
  // Markers (loss, resync) among the accepted items: not events.
  std::atomic<std::uint64_t> markers{0};
  // Set on every drop (with a replay socket), cleared by resync(): the
  // caches should re-announce their sets (Publisher::needs_resync).
  std::atomic<bool> resync_wanted{false};
  bool keeps_set = false;  // a replay socket: the cached set is kept (const once running)
  std::atomic<bool> stop_flag{false};
  std::atomic<bool> flush_asked{false};

  // Published (taken and sent or failed), for flush().
  std::mutex flush_mu;
  std::condition_variable flush_cv;
  std::uint64_t published = 0;

  // Chunks the thread has left, for the producers to reuse.
  alignas(64) std::mutex free_mu;
  std::vector<Chunk*> free_chunks;

  alignas(64) std::atomic<std::uint64_t> dropped{0};  // by the producers, mostly
  std::thread thread;

  ~Impl() {
    for (Chunk* c = head; c != nullptr;) {
      Chunk* next = c->next;
      delete c;
      c = next;
    }
    for (Chunk* c : free_chunks)
      delete c;
    if (wake_fd >= 0) ::close(wake_fd);
  }

  void drop() noexcept { dropped.fetch_add(1, std::memory_order_relaxed); }
  // An event is dropped, under the producer lock: unless the last item is a
  // loss marker already, one is appended (past the buffer's bounds: at most
  // one per accepted event, plus one), so that the thread skips a sequence
  // number exactly there and every subscriber sees a gap. Out of memory the
  // marker is owed, and appended before the next item (pay_loss_locked).
  void lose_locked() noexcept {
    drop();
    if (keeps_set) resync_wanted.store(true, std::memory_order_relaxed);
    if (loss_marked || stop) return;
    loss_owed = true;
    (void)pay_loss_locked();
  }
  // Appends the loss marker owed (if any), under the producer lock; false
  // when it is still owed (out of memory): the caller then appends nothing.
  bool pay_loss_locked() noexcept {
    if (!loss_owed) return true;
    EventHeader h;
    h.kind = EventHeader::loss;
    if (!append_locked(h, 0, 0, [](std::byte*) {})) return false;
    loss_owed = false;
    loss_marked = true;
    markers.fetch_add(1, std::memory_order_relaxed);
    return true;
  }
  void lose() noexcept {
    lock();
    lose_locked();
    unlock();
  }
  bool surely_full() const noexcept {
    return accepted.load(std::memory_order_relaxed) - taken.load(std::memory_order_relaxed) >=
           opt.buffer_events;
  }

  void lock() noexcept {
    if (!opt.single_producer) producer_mu.lock();  // else the caller serializes the calls
  }
  void unlock() noexcept {
    if (!opt.single_producer) producer_mu.unlock();
  }

  void signal() noexcept {
    const std::uint64_t one = 1;
    [[maybe_unused]] const ssize_t n = ::write(wake_fd, &one, sizeof one);
  }
  // `pending` events wait: at a full batch or half a buffer, wake the thread
  // if it sleeps for it. Either it sees the events or this sees it waiting:
  // this side's seq_cst read-modify-write of `accepted` (after the release
  // store that published the events) and load of `waiting` pair with the
  // thread's seq_cst store of `waiting` and load of `accepted` (one total
  // order over the four). Atomics rather than fences, which ThreadSanitizer
  // cannot follow; only at a batch boundary, not per event.
  void filled(std::uint64_t pending) noexcept {
    const bool half = pending == half_buffer;
    if (pending != opt.max_batch_events && !half) return;
    (void)accepted.fetch_add(0, std::memory_order_seq_cst);
    const std::uint8_t w = waiting.load(std::memory_order_seq_cst);
    if (w == sleeping || (w == sleeping_busy && half)) signal();
  }

  // The source's index, interned on first use; -1 when the table is full (or
  // out of memory). Under producer_mu. (An int, not an optional: returned
  // through the stack, the optional's two bytes stalled the caller's load.)
  int intern(const EventSource& s) noexcept {
    if (n_sources != 0 && source_at(last_source) == s) return last_source;
    for (std::size_t i = n_sources; i-- > 0;) {
      if (source_at(i) == s) {
        last_source = static_cast<std::uint16_t>(i);
        return last_source;
      }
    }
    if (n_sources == max_sources) return -1;
    try {
      auto& page = source_pages[n_sources / source_page];
      if (!page) page = std::make_unique<EventSource[]>(source_page);
      source_at(n_sources) = s;
    } catch (...) {
      return -1;
    }
    last_source = static_cast<std::uint16_t>(n_sources++);
    return last_source;
  }

  // A chunk of at least `need` bytes: a free one or a new one. Throws
  // std::bad_alloc.
  Chunk* new_chunk(std::size_t need) {
    if (need <= chunk_bytes) {
      std::lock_guard lk(free_mu);
      if (!free_chunks.empty()) {
        Chunk* c = free_chunks.back();
        free_chunks.pop_back();
        c->next = nullptr;
        return c;
      }
    }
    return new Chunk(std::max(chunk_bytes, round8(need)));
  }
  void recycle(Chunk* c) noexcept {
    if (c->capacity == chunk_bytes) {
      std::lock_guard lk(free_mu);
      if (free_chunks.size() < free_chunks_kept) {
        try {
          free_chunks.push_back(c);
          return;
        } catch (...) {
        }
      }
    }
    delete c;
  }

  // Appends one event: `write` fills its `raw` bytes after the header. Drops
  // (counted, and marked for the thread) when stopped, full, out of sources
  // or out of memory.
  template <class Write>
  void push(EventHeader h, std::size_t lora, const EventSource& source, Write&& write) noexcept {
    const std::size_t bytes = accounted_bytes(h.n_hashes, h.n_tokens);
    lock();
    const std::uint64_t pending = produced - taken.load(std::memory_order_acquire);
    if (stop || pending >= opt.buffer_events ||
        produced_bytes - taken_bytes.load(std::memory_order_acquire) + bytes > opt.buffer_bytes) {
      lose_locked();
      unlock();
      return;
    }
    const int src = intern(source);
    if (src < 0) {
      lose_locked();
      unlock();
      return;
    }
    h.source = static_cast<std::uint16_t>(src);
    if (!pay_loss_locked() || !append_locked(h, lora, bytes, write)) {
      lose_locked();
      unlock();
      return;
    }
    loss_marked = false;
    unlock();
    filled(pending + 1);
  }

  // Appends one item (an event or a marker) after every bound was checked,
  // under the producer lock; false when out of memory (nothing appended).
  template <class Write>
  bool append_locked(const EventHeader& h, std::size_t lora, std::size_t bytes,
                     Write&& write) noexcept {
    const std::size_t raw = raw_size(h.n_hashes, h.n_tokens, lora);
    const std::uint64_t pending = produced - taken.load(std::memory_order_acquire);
    if (tail_used + raw + sizeof(EventHeader) > tail->capacity) {
      Chunk* c = nullptr;
      try {
        c = new_chunk(raw + sizeof(EventHeader));
      } catch (...) {
        return false;
      }
      EventHeader end;
      end.kind = EventHeader::next_chunk;
      std::memcpy(tail->data + tail_used, &end, sizeof end);
      tail->next = c;
      tail = c;
      tail_used = 0;
    }
    std::byte* p = tail->data + tail_used;
    // Ask for the next lines ahead of the stores: the thread read them last
    // (a recycled chunk), and the next lock's exchange waits for every store
    // before it to complete.
    prefetch_for_write(p + raw + 128);
    prefetch_for_write(p + raw + 192);
    ::new (static_cast<void*>(p)) EventHeader(h);  // field by field, no copy through memory
    write(p + sizeof h);
    tail_used += raw;
    produced_bytes += bytes;
    if (pending == 0) first_pending_ns.store(steady_ns(), std::memory_order_relaxed);
    accepted.store(++produced, std::memory_order_release);
    return true;
  }

  // ---- the publisher thread ----

  // Sends `body` (the reused payload buffer) and, with a replay socket, keeps
  // an exact copy in the ring (the buffer itself grew past its size).
  void send(std::uint64_t seq, std::string_view body, std::size_t n_events) {
    const auto seq_frame = encode_seq(seq);
    bool ok = false;
    try {
      ok = pub.send(zmq::buffer(opt.topic), zmq::send_flags::sndmore | zmq::send_flags::dontwait)
               .has_value();
      // After the first frame ZeroMQ takes the whole message (the high water
      // mark is checked at a message's start).
      if (ok) {
        pub.send(as_buffer(seq_frame), zmq::send_flags::sndmore);
        pub.send(zmq::buffer(body), zmq::send_flags::none);
      }
    } catch (const zmq::error_t&) {
      ok = false;
    }
    (ok ? sent : send_failures).fetch_add(1, std::memory_order_relaxed);
    next_seq.store(seq + 1, std::memory_order_relaxed);
    if (!ok) {
      events_unsent.fetch_add(n_events, std::memory_order_relaxed);
    } else {
      // The last batches sent, as many as a subscriber's queue holds: what
      // an exit's linger may still discard (close()). Out of memory, the
      // events stay counted for good (over-reported, never hidden).
      recent_events += n_events;
      try {
        recent_batches.push_back(static_cast<std::uint32_t>(n_events));
      } catch (...) {
      }
      if (recent_batches.size() > static_cast<std::size_t>(send_hwm())) {
        recent_events -= recent_batches.front();
        recent_batches.pop_front();
      }
    }
    // From here the batch is published (sent or refused, its sequence used):
    // a failure to keep it for replay must not reach publish_or_skip, which
    // would count its events as dropped and skip another sequence number.
    if (router) keep_for_replay(seq, body);
  }

  // Keeps a copy of a published batch in the replay ring. Out of memory it
  // is not kept (counted): the ring is emptied too, so that it stays
  // contiguous; a replay from before then gets a miss (its first seq later
  // than asked), and the last snapshot is no longer served (its
  // batches after it are gone).
  void keep_for_replay(std::uint64_t seq, std::string_view body) noexcept {
    try {
      ring.emplace_back(seq, std::make_shared<const std::string>(body));
    } catch (...) {
      ring.clear();
      ring_bytes = 0;
      batches_not_kept.fetch_add(1, std::memory_order_relaxed);
      return;
    }
    ring_bytes += body.size();
    while (!ring.empty() &&
           (ring.size() > opt.replay_ring_batches || ring_bytes > opt.replay_ring_bytes)) {
      ring_bytes -= ring.front().second->size();
      ring.pop_front();
    }
  }

  // Encodes (and, with a replay socket, applies to the cached set) the events
  // of batch_events as one batch and sends it.
  void publish_batch() {
    // Written from payload[0], never cleared: it is zeroed only where it grows.
    BatchWriter w(payload, 0, opt.form, wall_seconds(), batch_events.size());
    constexpr std::size_t ahead = 8;  // the cached set's slots asked for this many events ahead
    for (std::size_t i = 0; i < batch_events.size(); ++i) {
      if (router && i + ahead < batch_events.size()) {
        const EventRef next = read_event(batch_events[i + ahead]);
        if (!next.hashes.empty()) cached.prefetch(source_at(next.h.source), next.hashes[0]);
      }
      const EventRef e = read_event(batch_events[i]);
      const EventSource& src = source_at(e.h.source);
      switch (e.h.kind) {
        case EventHeader::store: {
          StoredEventView v;
          v.block_hashes = e.hashes;
          if (e.h.has_parent) v.parent_block_hash = e.h.parent;
          v.token_ids = e.tokens;
          v.block_size = e.h.block_size;
          v.medium = to_string(src.medium);
          v.lora_name = e.lora;
          v.group_idx = src.group_idx;
          if (src.spec_kind) v.kv_cache_spec_kind = *src.spec_kind;
          v.kv_cache_spec_sliding_window = src.sliding_window;
          w.stored(v);
          if (router) cached.stored(src, e);
          break;
        }
        case EventHeader::remove:
          w.removed(e.hashes, to_string(src.medium), src.group_idx, kind_of(src));
          if (router) cached.removed(src, e.hashes);
          break;
        default:
          w.cleared(to_string(src.medium), src.group_idx, kind_of(src));
          if (router) cached.cleared(src);
          break;
      }
    }
    send(next_seq.load(std::memory_order_relaxed), w.finish_view(opt.data_parallel_rank),
         batch_events.size());
  }

  // A sequence number is skipped for events that were dropped (or lost to an
  // allocation): every subscriber sees the gap, and the replay never has it.
  // The cached set misses them from here until a resync marker.
  void skip_seq() noexcept {
    next_seq.store(next_seq.load(std::memory_order_relaxed) + 1, std::memory_order_relaxed);
    loss_gaps.fetch_add(1, std::memory_order_relaxed);
    stale = true;
    gap_unseen = true;
    snapshot_payload.reset();  // exact at its S, but a replay from S meets this gap
  }

  // Publishes batch_events (possibly none: an empty batch that shows a gap).
  void publish_or_skip() noexcept {
    try {
      publish_batch();
      gap_unseen = false;
    } catch (...) {  // out of memory: these events are lost, counted, and a gap
      dropped.fetch_add(batch_events.size(), std::memory_order_relaxed);
      lost.fetch_add(batch_events.size(), std::memory_order_relaxed);
      if (keeps_set) resync_wanted.store(true, std::memory_order_relaxed);
      skip_seq();
    }
  }

  // Reads `n` accepted items, publishing the events in batches of at most
  // max_batch_events (a marker ends a batch: the loss's gap, or the resync,
  // lies exactly between the events before and after it), and hands the
  // chunks it leaves back.
  void take(std::uint64_t n) {
    std::uint64_t done = 0;
    while (done < n) {
      Chunk* const first = head;
      std::uint64_t bytes = 0;
      std::uint64_t items = 0;
      std::optional<EventHeader> marker;
      std::size_t batch_bytes = 0;
      batch_events.clear();
      while (done + items < n && batch_events.size() < opt.max_batch_events) {
        EventHeader h;
        std::memcpy(&h, head->data + head_used, sizeof h);
        if (h.kind == EventHeader::next_chunk) {
          head = head->next;
          head_used = 0;
          std::memcpy(&h, head->data, sizeof h);
        }
        const std::byte* const p = head->data + head_used;
        const std::size_t lora = h.lora_len == 0 ? 0 : h.lora_len - 1;
        const std::size_t encoded = encoded_bound(h.n_hashes, h.n_tokens, lora);
        // A batch ends before the event that would take it past
        // max_batch_bytes (an event alone larger than that is sent alone).
        if (!batch_events.empty() && h.kind <= EventHeader::clear &&
            batch_bytes + encoded > opt.max_batch_bytes)
          break;
        batch_bytes += encoded;
        head_used += raw_size(h.n_hashes, h.n_tokens, lora);
        ++items;
        if (h.kind == EventHeader::loss || h.kind == EventHeader::resync) {
          marker = h;
          break;
        }
        batch_events.push_back(p);  // reserved: never throws
        bytes += accounted_bytes(h.n_hashes, h.n_tokens);
      }
      if (!batch_events.empty()) publish_or_skip();
      if (marker && marker->kind == EventHeader::loss) {
        skip_seq();
      } else if (marker) {
        std::unique_ptr<CachedSet> fresh(reinterpret_cast<CachedSet*>(marker->parent));
        cached = std::move(*fresh);
        stale = false;
        resyncs.fetch_add(1, std::memory_order_relaxed);
      }
      for (Chunk* c = first; c != head;) {
        Chunk* next = c->next;
        recycle(c);
        c = next;
      }
      done += items;
      taken_bytes.store(taken_bytes.load(std::memory_order_relaxed) + bytes,
                        std::memory_order_release);
      taken.store(taken.load(std::memory_order_relaxed) + items, std::memory_order_release);
    }
    if (gap_unseen) {
      batch_events.clear();
      publish_or_skip();
    }
    std::lock_guard lk(flush_mu);
    published += n;
    flush_cv.notify_all();
  }

  enum class SendResult : std::uint8_t { sent, blocked, gone };

  // Sends one answer frame [prefix..., seq, body] to the answer's client
  // without waiting: `blocked` when its pipe is at the high water mark
  // (ZMQ_ROUTER_MANDATORY: nothing was sent), `gone` when the client is.
  SendResult send_answer(const Answer& a, std::uint64_t seq, const Shared& body) noexcept {
    try {
      if (!router->send(zmq::buffer(a.prefix[0]),
                        zmq::send_flags::sndmore | zmq::send_flags::dontwait))
        return SendResult::blocked;
      // After the first frame ZeroMQ takes the whole message.
      for (std::size_t k = 1; k < a.prefix.size(); ++k)
        router->send(zmq::buffer(a.prefix[k]), zmq::send_flags::sndmore);
      const auto seq_frame = encode_seq(seq);
      router->send(as_buffer(seq_frame), zmq::send_flags::sndmore);
      if (body && !body->empty()) {
        router->send(shared_message(body), zmq::send_flags::none);
      } else {
        router->send(zmq::message_t(), zmq::send_flags::none);
      }
      return SendResult::sent;
    } catch (...) {  // EHOSTUNREACH (the client left), out of memory
      return SendResult::gone;
    }
  }

  // A snapshot exact now, built at most once per snapshot_interval; nullptr
  // while the set is stale or the interval has not passed (the answer
  // waits). A built one is served again while a replay from its S is
  // possible (the ring still holds every batch from S on).
  const Shared* snapshot_now(std::int64_t now) {
    if (snapshot_payload && (snapshot_seq == next_seq.load(std::memory_order_relaxed) ||
                             (!ring.empty() && ring.front().first <= snapshot_seq)))
      return &snapshot_payload;
    if (snapshot_ever_built &&
        now - snapshot_built_ns <
            std::chrono::duration_cast<std::chrono::nanoseconds>(opt.snapshot_interval).count())
      return nullptr;
    EventBatch snap;
    snap.seq = next_seq.load(std::memory_order_relaxed);
    snap.ts = wall_seconds();
    snap.data_parallel_rank = opt.data_parallel_rank;
    snap.events =
        cached.as_events([this](std::size_t i) -> const EventSource& { return source_at(i); });
    snapshot_payload = std::make_shared<const std::string>(encode_batch(snap, opt.form));
    snapshot_seq = snap.seq;
    snapshot_built_ns = steady_ns();
    snapshot_ever_built = true;
    return &snapshot_payload;
  }

  // Sends what the answers have to send, a few frames a turn (so that live
  // batches keep going out between them), each as far as its client's pipe
  // has room; drops answers whose client left or made no progress for
  // answer_timeout.
  void serve_answers() {
    static const Shared none;
    std::size_t budget = answer_frames_per_turn;
    const std::int64_t now = steady_ns();
    const std::int64_t give_up =
        std::chrono::duration_cast<std::chrono::nanoseconds>(opt.answer_timeout).count();
    for (auto it = answers.begin(); it != answers.end();) {
      Answer& a = *it;
      bool done = false;
      SendResult r = SendResult::sent;
      while (budget > 0 && !done && r == SendResult::sent) {
        if (a.kind == Answer::Kind::replay) {
          const auto next = std::lower_bound(
              ring.begin(), ring.end(), a.cursor,
              [](const auto& entry, std::uint64_t seq) { return entry.first < seq; });
          if (next == ring.end() || next->first >= a.end) {
            r = send_answer(a, end_of_replay_seq, none);
            done = r == SendResult::sent;
          } else if ((r = send_answer(a, next->first, next->second)) == SendResult::sent) {
            a.cursor = next->first + 1;
          }
        } else if (a.kind == Answer::Kind::snapshot) {
          if (stale) {  // not exact: the terminator alone (the client asks again)
            snapshots_unavailable.fetch_add(1, std::memory_order_relaxed);
            a.kind = Answer::Kind::terminator;
            continue;
          }
          const Shared* snap = nullptr;
          try {
            snap = snapshot_now(now);
          } catch (...) {  // out of memory: the answer waits (abandoned at answer_timeout)
          }
          if (snap == nullptr) break;  // waits for snapshot_interval
          if ((r = send_answer(a, snapshot_seq, *snap)) == SendResult::sent) {
            snapshots.fetch_add(1, std::memory_order_relaxed);
            a.kind = Answer::Kind::terminator;
          }
        } else {
          r = send_answer(a, end_of_replay_seq, none);
          done = r == SendResult::sent;
        }
        if (r == SendResult::sent) {
          --budget;
          a.last_progress_ns = now;
        }
      }
      if (done) {
        it = answers.erase(it);
      } else if (r == SendResult::gone || now - a.last_progress_ns > give_up) {
        answers_abandoned.fetch_add(1, std::memory_order_relaxed);
        it = answers.erase(it);
      } else {
        ++it;
      }
    }
  }

  // A request may be answered now (max_requests_per_second, a bucket of
  // one second's worth).
  bool take_request_token(std::int64_t now) noexcept {
    const double rate = static_cast<double>(opt.max_requests_per_second);
    request_tokens =
        std::min(rate, request_tokens + rate * 1e-9 * static_cast<double>(now - request_tokens_ns));
    request_tokens_ns = now;
    if (request_tokens < 1) return false;
    request_tokens -= 1;
    return true;
  }

  // Receives the requests queued on the replay socket (at most 64 a turn),
  // each of at most 4 frames (the rest of a longer one is discarded as it
  // is read), and queues their answers: refused (not answered, counted)
  // past max_requests_per_second or max_pending_answers.
  void take_requests() {
    for (int served = 0; served < 64; ++served) {
      std::vector<zmq::message_t> frames;
      bool too_long = false;
      try {
        zmq::message_t part;
        if (!router->recv(part, zmq::recv_flags::dontwait)) return;
        while (true) {
          const bool more = part.more();
          if (frames.size() < 4) {
            frames.push_back(std::move(part));
          } else {
            too_long = true;
          }
          if (!more) break;
          part = zmq::message_t();
          (void)router->recv(part, zmq::recv_flags::none);  // the rest is there already
        }
      } catch (const zmq::error_t&) {
        bad_requests.fetch_add(1, std::memory_order_relaxed);
        return;
      }
      if (too_long || frames.size() < 2 || frames.size() > 3 ||
          (frames.size() == 3 && frames[1].size() != 0)) {
        bad_requests.fetch_add(1, std::memory_order_relaxed);  // not answered: no return address
        continue;
      }
      const std::int64_t now = steady_ns();
      if (answers.size() >= opt.max_pending_answers || !take_request_token(now)) {
        requests_refused.fetch_add(1, std::memory_order_relaxed);
        continue;
      }
      Answer a;
      a.last_progress_ns = now;
      try {
        for (std::size_t k = 0; k + 1 < frames.size(); ++k)
          a.prefix.emplace_back(frames[k].data<char>(), frames[k].size());
      } catch (...) {  // out of memory
        requests_refused.fetch_add(1, std::memory_order_relaxed);
        continue;
      }
      const zmq::message_t& req = frames.back();
      const std::string_view body(req.data<char>(), req.size());
      if (body == snapshot_request) {
        a.kind = Answer::Kind::snapshot;
      } else if (auto start = decode_seq(std::as_bytes(std::span(body.data(), body.size())))) {
        // Counted first: a client that has the answer sees it counted.
        replays.fetch_add(1, std::memory_order_relaxed);
        a.kind = Answer::Kind::replay;
        a.cursor = *start;
        a.end = next_seq.load(std::memory_order_relaxed);  // what was published when asked
      } else {
        bad_requests.fetch_add(1, std::memory_order_relaxed);
        a.kind = Answer::Kind::terminator;  // neither form: the terminator alone
      }
      try {
        answers.push_back(std::move(a));
      } catch (...) {
        requests_refused.fetch_add(1, std::memory_order_relaxed);
      }
    }
  }

  void serve_requests() {
    take_requests();
    serve_answers();
  }

  // ZMQ_SNDHWM in messages for a byte bound: send_queue_bytes of batches of
  // at most max_batch_bytes, and at most send_high_water_mark.
  int send_hwm() const noexcept {
    const std::size_t by_bytes =
        std::max<std::size_t>(1, opt.send_queue_bytes / opt.max_batch_bytes);
    return static_cast<int>(std::min<std::size_t>(
        {by_bytes, static_cast<std::size_t>(opt.send_high_water_mark), INT32_MAX}));
  }

  // Events accepted and not yet taken.
  std::uint64_t pending() const noexcept {
    return accepted.load(std::memory_order_acquire) - taken.load(std::memory_order_relaxed);
  }
  bool interval_passed(std::int64_t now_ns) const noexcept {
    return now_ns - first_pending_ns.load(std::memory_order_relaxed) >=
           std::chrono::duration_cast<std::chrono::nanoseconds>(opt.batch_interval).count();
  }

  void run() {
    pthread_setname_np(pthread_self(), "kvport-events");
    const auto slice =
        std::clamp(std::chrono::duration_cast<std::chrono::milliseconds>(opt.batch_interval),
                   std::chrono::milliseconds(1), std::chrono::milliseconds(10));
    const auto interval_ns =
        std::chrono::duration_cast<std::chrono::nanoseconds>(opt.batch_interval).count();
    // Busy: the last take was of a full batch or more, so events come faster
    // than a wake-up per batch is worth; the thread then polls every
    // millisecond instead of being woken per batch (the producers then wake it
    // only at half a buffer), which spares them a system call per batch.
    constexpr std::chrono::microseconds busy_sleep{100};
    const bool may_be_busy = opt.batch_interval >= 2 * busy_sleep;
    bool busy = false;
    while (true) {
      // Sleep until a batch fills (busy: a millisecond passes or half the
      // buffer fills), the interval of the first pending event passes, a
      // flush or stop asks, a replay request arrives, or a slice passes.
      waiting.store(busy ? sleeping_busy : sleeping, std::memory_order_seq_cst);
      std::uint64_t n =
          accepted.load(std::memory_order_seq_cst) - taken.load(std::memory_order_relaxed);
      const bool asked =
          flush_asked.load(std::memory_order_relaxed) || stop_flag.load(std::memory_order_relaxed);
      bool woken = false;
      if (busy && !asked && n < half_buffer) {
        // A short sleep, not woken per batch (flush and stop wait for it).
        std::this_thread::sleep_for(busy_sleep);
      } else if (!asked && n < opt.max_batch_events && !(n > 0 && interval_passed(steady_ns()))) {
        std::int64_t timeout_ms = slice.count();
        if (n > 0) {
          const std::int64_t left =
              first_pending_ns.load(std::memory_order_relaxed) + interval_ns - steady_ns();
          timeout_ms = std::clamp<std::int64_t>((left + 999'999) / 1'000'000, 0, timeout_ms);
        }
        // Answers wait for their clients' pipes: tried again each millisecond.
        if (!answers.empty()) timeout_ms = std::min<std::int64_t>(timeout_ms, 1);
        zmq::pollitem_t items[2] = {{nullptr, wake_fd, ZMQ_POLLIN, 0},
                                    {router ? router->handle() : nullptr, 0, ZMQ_POLLIN, 0}};
        try {
          zmq::poll(items, router ? 2 : 1, std::chrono::milliseconds(timeout_ms));
        } catch (const zmq::error_t&) {
        }
        woken = (items[0].revents & ZMQ_POLLIN) != 0;
      }
      waiting.store(awake, std::memory_order_relaxed);
      if (woken) {
        std::uint64_t wakes = 0;
        [[maybe_unused]] const ssize_t r = ::read(wake_fd, &wakes, sizeof wakes);
      }
      if (router) serve_requests();

      const bool stopping = stop_flag.load(std::memory_order_acquire);
      const bool flushing = flush_asked.exchange(false, std::memory_order_acq_rel);
      n = pending();
      if (n > 0 &&
          (stopping || flushing || n >= opt.max_batch_events || interval_passed(steady_ns()))) {
        take(n);
        busy = may_be_busy && n >= opt.max_batch_events;
      } else if (n == 0) {
        busy = false;
      }
      if (stopping) {
        if (router) serve_requests();
        return;
      }
    }
  }
};

Publisher::Publisher(PublisherOptions options) : impl_(std::make_unique<Impl>()) {
  Impl& m = *impl_;
  if (options.buffer_events == 0 || options.buffer_bytes == 0)
    throw InvalidArgument("events publisher: buffer_events and buffer_bytes must be > 0");
  if (options.max_batch_events == 0)
    throw InvalidArgument("events publisher: max_batch_events must be > 0");
  if (options.batch_interval.count() < 0)
    throw InvalidArgument("events publisher: batch_interval must be >= 0");
  if (options.endpoint.empty()) throw InvalidArgument("events publisher: the endpoint is empty");
  if (!options.replay_endpoint.empty() && options.replay_ring_batches == 0)
    throw InvalidArgument(
        "events publisher: replay_ring_batches must be > 0 with a replay endpoint");
  if (options.send_high_water_mark < 0)
    throw InvalidArgument("events publisher: send_high_water_mark must be >= 0");
  if (options.data_parallel_rank &&
      (*options.data_parallel_rank < 0 || *options.data_parallel_rank > INT32_MAX))
    throw InvalidArgument("events publisher: data_parallel_rank " +
                          std::to_string(*options.data_parallel_rank) +
                          " is outside [0, 2^31 - 1] (Dynamo reads the rank as an i32)");
  if (options.max_batch_bytes == 0 || options.send_queue_bytes == 0)
    throw InvalidArgument("events publisher: max_batch_bytes and send_queue_bytes must be > 0");
  if (!options.replay_endpoint.empty() &&
      (options.replay_ring_bytes == 0 || options.max_requests_per_second == 0 ||
       options.max_pending_answers == 0 || options.answer_timeout.count() <= 0 ||
       options.snapshot_interval.count() < 0))
    throw InvalidArgument(
        "events publisher: with a replay endpoint, replay_ring_bytes, max_requests_per_second, "
        "max_pending_answers and answer_timeout must be > 0 and snapshot_interval >= 0");
  m.opt = std::move(options);
  const int linger = static_cast<int>(std::min<std::int64_t>(m.opt.linger.count(), INT32_MAX));
  m.pub.set(zmq::sockopt::linger, linger);
  // Each subscriber's queue holds at most send_queue_bytes: that many
  // batches of max_batch_bytes (ZeroMQ counts messages, not bytes).
  m.pub.set(zmq::sockopt::sndhwm, m.send_hwm());
  // A full subscriber makes send() fail (counted) instead of dropping silently.
  m.pub.set(zmq::sockopt::xpub_nodrop, 1);
  bind_or_throw(m.pub, m.opt.endpoint, "PUB");
  m.bound = last_endpoint(m.pub);
  if (!m.opt.replay_endpoint.empty()) {
    m.keeps_set = true;
    m.router.emplace(m.ctx, zmq::socket_type::router);
    m.router->set(zmq::sockopt::linger, linger);
    // Answers are sent as each client's pipe has room (ROUTER_MANDATORY
    // makes a full pipe refuse a message instead of dropping it), so a
    // client that never reads holds at most send_queue_bytes of batches
    // (the ring's, shared) and one snapshot, and an answer is never cut.
    m.router->set(zmq::sockopt::router_mandatory, 1);
    m.router->set(zmq::sockopt::sndhwm, std::max(m.send_hwm(), 4));
    m.router->set(zmq::sockopt::rcvhwm, 64);
    // A request is a few bytes: a larger frame disconnects its sender.
    m.router->set(zmq::sockopt::maxmsgsize, std::int64_t{256});
    m.request_tokens = static_cast<double>(m.opt.max_requests_per_second);
    m.request_tokens_ns = steady_ns();
    bind_or_throw(*m.router, m.opt.replay_endpoint, "replay");
    m.replay_bound = last_endpoint(*m.router);
  }
  m.wake_fd = ::eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
  if (m.wake_fd < 0) throw std::system_error(errno, std::generic_category(), "eventfd");
  m.batch_events.reserve(m.opt.max_batch_events);
  m.half_buffer = std::max<std::uint64_t>(1, m.opt.buffer_events / 2);
  m.tail = m.head = new Chunk(chunk_bytes);
  m.thread = std::thread([&m] { m.run(); });
}

Publisher::~Publisher() {
  if (!impl_->closed) (void)close(impl_->opt.linger);
}

CloseReport Publisher::close(std::chrono::milliseconds timeout) noexcept {
  Impl& m = *impl_;
  if (m.closed) return *m.closed;
  const auto start = std::chrono::steady_clock::now();
  CloseReport r;
  try {
    r.flushed = flush(timeout);
  } catch (...) {  // a lock or wait that failed: the stop below publishes it all
  }
  m.lock();
  m.stop = true;  // no producer accepts from here on
  m.unlock();
  m.stop_flag.store(true, std::memory_order_release);
  m.signal();
  if (m.thread.joinable()) m.thread.join();  // publishes what is still buffered
  const auto left = std::max(std::chrono::milliseconds(0),
                             timeout - std::chrono::duration_cast<std::chrono::milliseconds>(
                                           std::chrono::steady_clock::now() - start));
  const int linger = static_cast<int>(std::min<std::int64_t>(left.count(), INT32_MAX));
  try {
    m.pub.set(zmq::sockopt::linger, linger);
    if (m.router) m.router->set(zmq::sockopt::linger, 0);  // answers in flight: not waited for
  } catch (const zmq::error_t&) {  // the option stays as bound: options.linger
  }
  // Taken before the close: ZeroMQ starts the linger timer when its reaper
  // processes the close, which may be before any later timestamp.
  const auto before_close = std::chrono::steady_clock::now();
  m.pub.close();
  if (m.router) m.router->close();
  m.ctx.close();  // returns once every queued message is sent, or at the linger
  // Returned clearly before the linger could have run out: ZeroMQ had nothing
  // left to discard. The slack makes a return near the linger count as
  // possibly discarded (over-reporting a loss is safe, hiding one is not).
  const auto linger_d = std::chrono::milliseconds(linger);
  const auto slack =
      std::max<std::chrono::steady_clock::duration>(std::chrono::milliseconds(10), linger_d / 10);
  r.drained =
      m.sent.load() == 0 || std::chrono::steady_clock::now() - before_close + slack < linger_d;
  const PublisherStats st = stats();
  r.events_dropped = st.events_dropped;
  r.events_unsent = st.events_unsent;
  r.events_maybe_discarded = r.drained ? 0 : m.recent_events;
  m.closed = r;
  return r;
}

void Publisher::stored(const EventSource& source, const BlockStoredView& blocks) noexcept {
  Impl& m = *impl_;
  const auto store_one = [&m, &source](const BlockStoredView& v) noexcept {
    if (m.surely_full()) return m.lose();
    EventHeader h;
    h.kind = EventHeader::store;
    h.block_size = v.block_size;
    h.n_hashes = static_cast<std::uint32_t>(v.hashes.size());
    h.n_tokens = static_cast<std::uint32_t>(v.tokens.size());
    if (v.parent) {
      h.has_parent = 1;
      h.parent = event_hash(*v.parent);
    }
    const std::size_t lora = v.lora_name ? v.lora_name->size() : 0;
    if (v.lora_name) h.lora_len = static_cast<std::uint32_t>(lora + 1);
    m.push(h, lora, source, [&](std::byte* p) {
      for (const BlockHash& bh : v.hashes) {
        const std::uint64_t x = event_hash(bh);
        std::memcpy(p, &x, 8);
        p += 8;
      }
      if (!v.tokens.empty()) std::memcpy(p, v.tokens.data(), 4 * v.tokens.size());
      p += round8(4 * v.tokens.size());
      if (lora != 0) std::memcpy(p, v.lora_name->data(), lora);
    });
  };
  // An event whose encoding could pass max_batch_bytes is split into chained
  // events (each piece's parent the previous piece's last hash, its tokens
  // the matching slice), so that every batch stays within the bound: a
  // router applies the pieces as it would the whole. Only a single block
  // larger than the bound still goes alone.
  const std::size_t n = blocks.hashes.size();
  const std::size_t lora = blocks.lora_name ? blocks.lora_name->size() : 0;
  const bool sliceable =
      blocks.tokens.empty() ||
      (blocks.block_size != 0 && blocks.tokens.size() == n * std::size_t{blocks.block_size});
  if (n > 1 && sliceable && encoded_bound(n, blocks.tokens.size(), lora) > m.opt.max_batch_bytes) {
    const std::size_t tokens_per_block = blocks.tokens.empty() ? 0 : blocks.block_size;
    const std::size_t fixed = encoded_bound(0, 0, lora);
    const std::size_t per_block = encoded_bound(1, tokens_per_block, 0) - encoded_bound(0, 0, 0);
    const std::size_t per_piece =
        m.opt.max_batch_bytes > fixed
            ? std::max<std::size_t>(1, (m.opt.max_batch_bytes - fixed) / per_block)
            : 1;
    for (std::size_t i = 0; i < n; i += per_piece) {
      const std::size_t k = std::min(per_piece, n - i);
      BlockStoredView piece = blocks;
      piece.hashes = blocks.hashes.subspan(i, k);
      if (i != 0) piece.parent = blocks.hashes[i - 1];
      if (tokens_per_block != 0)
        piece.tokens = blocks.tokens.subspan(i * tokens_per_block, k * tokens_per_block);
      store_one(piece);
    }
    return;
  }
  store_one(blocks);
}

void Publisher::removed(const EventSource& source, std::span<const BlockHash> hashes) noexcept {
  Impl& m = *impl_;
  const auto remove_one = [&m, &source](std::span<const BlockHash> some) noexcept {
    if (m.surely_full()) return m.lose();
    EventHeader h;
    h.kind = EventHeader::remove;
    h.n_hashes = static_cast<std::uint32_t>(some.size());
    m.push(h, 0, source, [&](std::byte* p) {
      for (const BlockHash& bh : some) {
        const std::uint64_t v = event_hash(bh);
        std::memcpy(p, &v, 8);
        p += 8;
      }
    });
  };
  // As stored(): split so that every batch stays within max_batch_bytes.
  if (hashes.size() > 1 && encoded_bound(hashes.size(), 0, 0) > m.opt.max_batch_bytes) {
    const std::size_t fixed = encoded_bound(0, 0, 0);
    const std::size_t per_piece =
        m.opt.max_batch_bytes > fixed
            ? std::max<std::size_t>(
                  1, (m.opt.max_batch_bytes - fixed) / (encoded_bound(1, 0, 0) - fixed))
            : 1;
    for (std::size_t i = 0; i < hashes.size(); i += per_piece)
      remove_one(hashes.subspan(i, std::min(per_piece, hashes.size() - i)));
    return;
  }
  remove_one(hashes);
}

void Publisher::cleared(const EventSource& source) noexcept {
  Impl& m = *impl_;
  if (m.surely_full()) return m.lose();
  EventHeader h;
  h.kind = EventHeader::clear;
  m.push(h, 0, source, [](std::byte*) {});
}

bool Publisher::flush(std::chrono::milliseconds timeout) {
  Impl& m = *impl_;
  const std::uint64_t target = m.accepted.load(std::memory_order_acquire);
  m.flush_asked.store(true, std::memory_order_seq_cst);
  m.signal();
  std::unique_lock lk(m.flush_mu);
  return m.flush_cv.wait_for(lk, timeout, [&] { return m.published >= target; });
}

bool Publisher::needs_resync() const noexcept {
  return impl_->resync_wanted.load(std::memory_order_relaxed);
}

bool Publisher::resync(const std::function<void(CacheEventSink&)>& announce) {
  Impl& m = *impl_;
  if (!m.keeps_set) return true;  // no snapshots: nothing to rebuild
  // Collects the caches' snapshots into a fresh set, under the producer lock
  // (sources are interned as a producer does).
  class Collector final : public CacheEventSink {
   public:
    Collector(Impl& m, CachedSet& set) : m_(m), set_(set) {}
    void stored(const EventSource& source, const BlockStoredView& v) noexcept override {
      const int src = m_.intern(source);
      if (src < 0) {
        failed = true;
        return;
      }
      try {
        hashes_.clear();
        for (const BlockHash& h : v.hashes)
          hashes_.push_back(event_hash(h));
        EventRef e;
        e.h.source = static_cast<std::uint16_t>(src);
        e.h.block_size = v.block_size;
        e.h.has_parent = v.parent ? 1 : 0;
        e.h.parent = v.parent ? event_hash(*v.parent) : 0;
        e.hashes = hashes_;
        e.tokens = v.tokens;
        e.lora = v.lora_name;
        set_.stored(source, e);
      } catch (...) {
        failed = true;
      }
    }
    void removed(const EventSource& source, std::span<const BlockHash> hs) noexcept override {
      try {
        hashes_.clear();
        for (const BlockHash& h : hs)
          hashes_.push_back(event_hash(h));
        set_.removed(source, hashes_);
      } catch (...) {
        failed = true;
      }
    }
    void cleared(const EventSource& source) noexcept override {
      try {
        set_.cleared(source);
      } catch (...) {
        failed = true;
      }
    }
    bool failed = false;

   private:
    Impl& m_;
    CachedSet& set_;
    std::vector<std::uint64_t> hashes_;
  };
  auto fresh = std::make_unique<CachedSet>();
  Collector collector(m, *fresh);
  m.lock();
  struct Unlock {
    Impl& m;
    ~Unlock() { m.unlock(); }
  } unlock{m};
  if (m.stop) return false;
  // Cleared first: a drop while the caches announce sets it again.
  m.resync_wanted.store(false, std::memory_order_relaxed);
  try {
    announce(collector);
  } catch (...) {
    m.resync_wanted.store(true, std::memory_order_relaxed);
    throw;
  }
  EventHeader h;
  h.kind = EventHeader::resync;
  h.parent = reinterpret_cast<std::uintptr_t>(fresh.get());
  if (collector.failed || !m.pay_loss_locked() || !m.append_locked(h, 0, 0, [](std::byte*) {})) {
    m.resync_wanted.store(true, std::memory_order_relaxed);
    return false;
  }
  (void)fresh.release();  // the thread owns it from the marker on
  m.markers.fetch_add(1, std::memory_order_relaxed);
  m.loss_marked = false;
  return true;
}

const std::string& Publisher::endpoint() const noexcept {
  return impl_->bound;
}
const std::string& Publisher::replay_endpoint() const noexcept {
  return impl_->replay_bound;
}

PublisherStats Publisher::stats() const noexcept {
  const Impl& m = *impl_;
  PublisherStats s;
  s.events_accepted = m.accepted.load() - m.markers.load() - m.lost.load();
  s.events_dropped = m.dropped.load();
  s.batches_sent = m.sent.load();
  s.send_failures = m.send_failures.load();
  s.replay_requests = m.replays.load();
  s.snapshots = m.snapshots.load();
  s.bad_requests = m.bad_requests.load();
  s.next_seq = m.next_seq.load();
  s.loss_gaps = m.loss_gaps.load();
  s.resyncs = m.resyncs.load();
  s.snapshots_unavailable = m.snapshots_unavailable.load();
  s.requests_refused = m.requests_refused.load();
  s.events_unsent = m.events_unsent.load();
  s.answers_abandoned = m.answers_abandoned.load();
  s.batches_not_kept = m.batches_not_kept.load();
  return s;
}

}  // namespace kvport::events
