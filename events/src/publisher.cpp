#include "kvport/events/publisher.hpp"

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <deque>
#include <mutex>
#include <span>
#include <string>
#include <thread>
#include <unordered_map>
#include <vector>

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

// The cached set, kept from the published events for snapshots.
struct BlockKey {
  std::string medium;
  std::optional<std::uint32_t> group;
  std::uint64_t hash = 0;
  friend bool operator==(const BlockKey&, const BlockKey&) = default;
};
struct BlockKeyHash {
  std::size_t operator()(const BlockKey& k) const noexcept {
    return std::hash<std::uint64_t>{}(k.hash) ^ (std::hash<std::string>{}(k.medium) << 1) ^
           (k.group ? *k.group + 0x9e3779b9u : 0u);
  }
};
struct BlockRecord {
  std::uint64_t ordinal = 0;  // when it was stored: snapshots keep that order
  std::optional<std::uint64_t> parent;
  std::vector<TokenId> tokens;
  std::uint32_t block_size = 0;
  std::optional<std::string> lora_name;
  std::optional<std::string> spec_kind;
  std::optional<std::uint32_t> window;
};

class CachedSet {
 public:
  void apply(const CacheEvent& ev) {
    if (const auto* s = std::get_if<BlockStored>(&ev)) {
      for (std::size_t i = 0; i < s->block_hashes.size(); ++i) {
        BlockRecord rec;
        rec.ordinal = next_ordinal_++;
        rec.parent = i == 0 ? s->parent_block_hash : std::optional(s->block_hashes[i - 1]);
        const std::size_t begin = i * s->block_size;
        if (begin < s->token_ids.size()) {
          const std::size_t end = std::min(s->token_ids.size(), begin + s->block_size);
          rec.tokens.assign(s->token_ids.begin() + static_cast<std::ptrdiff_t>(begin),
                            s->token_ids.begin() + static_cast<std::ptrdiff_t>(end));
        }
        rec.block_size = s->block_size;
        rec.lora_name = s->lora_name;
        rec.spec_kind = s->kv_cache_spec_kind;
        rec.window = s->kv_cache_spec_sliding_window;
        blocks_.insert_or_assign(BlockKey{s->medium, s->group_idx, s->block_hashes[i]},
                                 std::move(rec));
      }
    } else if (const auto* r = std::get_if<BlockRemoved>(&ev)) {
      for (std::uint64_t h : r->block_hashes)
        blocks_.erase(BlockKey{r->medium, r->group_idx, h});
    } else if (const auto* c = std::get_if<AllBlocksCleared>(&ev)) {
      if (!c->medium && !c->group_idx) {
        blocks_.clear();
        return;
      }
      std::erase_if(blocks_, [&](const auto& kv) {
        return (!c->medium || kv.first.medium == *c->medium) &&
               (!c->group_idx || kv.first.group == c->group_idx);
      });
    }
  }

  std::vector<CacheEvent> as_events() const {
    std::vector<const std::pair<const BlockKey, BlockRecord>*> order;
    order.reserve(blocks_.size());
    for (const auto& kv : blocks_)
      order.push_back(&kv);
    std::sort(order.begin(), order.end(),
              [](auto* a, auto* b) { return a->second.ordinal < b->second.ordinal; });
    std::vector<CacheEvent> out;
    out.reserve(order.size());
    for (const auto* kv : order) {
      BlockStored s;
      s.block_hashes = {kv->first.hash};
      s.parent_block_hash = kv->second.parent;
      s.token_ids = kv->second.tokens;
      s.block_size = kv->second.block_size;
      s.medium = kv->first.medium;
      s.lora_name = kv->second.lora_name;
      s.group_idx = kv->first.group;
      s.kv_cache_spec_kind = kv->second.spec_kind;
      s.kv_cache_spec_sliding_window = kv->second.window;
      out.emplace_back(std::move(s));
    }
    return out;
  }

 private:
  std::unordered_map<BlockKey, BlockRecord, BlockKeyHash> blocks_;
  std::uint64_t next_ordinal_ = 0;
};

double wall_seconds() {
  return std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch()).count();
}

zmq::const_buffer as_buffer(const std::array<std::byte, 8>& a) {
  return zmq::buffer(a.data(), a.size());
}

}  // namespace

struct Publisher::Impl {
  PublisherOptions opt;
  zmq::context_t ctx{1};
  zmq::socket_t pub{ctx, zmq::socket_type::pub};
  std::optional<zmq::socket_t> router;

  bool surely_full() const noexcept {
    return pending_count.load(std::memory_order_relaxed) >= opt.buffer_events;
  }
  void drop() noexcept { dropped.fetch_add(1, std::memory_order_relaxed); }
  std::string bound;
  std::string replay_bound;

  // The hot path's side.
  std::mutex mu;
  std::condition_variable cv;
  // The events accepted and not yet taken, flat: one record an event, its
  // hashes and tokens in two arenas, its source interned. The publisher
  // thread swaps the whole buffer for an empty one that keeps its capacity,
  // so once the arenas have grown the hot path allocates nothing (the owning
  // events are built on the publisher thread).
  struct Record {
    enum class Kind : std::uint8_t { store, remove, clear } kind;
    bool has_parent = false;
    std::uint16_t source = 0;
    std::uint32_t block_size = 0;
    std::uint32_t hashes_at = 0, n_hashes = 0;
    std::uint32_t tokens_at = 0, n_tokens = 0;
    std::int32_t lora = -1;  // index into loras, -1: none
    std::uint64_t parent = 0;
  };
  struct Buffer {
    std::vector<Record> records;
    std::vector<std::uint64_t> hashes;
    std::vector<TokenId> tokens;
    std::vector<EventSource> sources;
    std::vector<std::string> loras;
    void clear() noexcept {
      records.clear();
      hashes.clear();
      tokens.clear();
      sources.clear();
      loras.clear();
    }
    std::uint16_t source_index(const EventSource& s) {
      for (std::size_t i = sources.size(); i-- > 0;)
        if (sources[i] == s) return static_cast<std::uint16_t>(i);
      sources.push_back(s);
      return static_cast<std::uint16_t>(sources.size() - 1);
    }
    // The owning events, in order.
    std::vector<CacheEvent> to_events() const {
      std::vector<CacheEvent> out;
      out.reserve(records.size());
      for (const Record& r : records) {
        const EventSource& src = sources[r.source];
        const auto hs = std::span<const std::uint64_t>(hashes).subspan(r.hashes_at, r.n_hashes);
        switch (r.kind) {
          case Record::Kind::store: {
            BlockStored e;
            e.block_hashes.assign(hs.begin(), hs.end());
            if (r.has_parent) e.parent_block_hash = r.parent;
            const auto ts = std::span<const TokenId>(tokens).subspan(r.tokens_at, r.n_tokens);
            e.token_ids.assign(ts.begin(), ts.end());
            e.block_size = r.block_size;
            e.medium = to_string(src.medium);
            if (r.lora >= 0) e.lora_name = loras[static_cast<std::size_t>(r.lora)];
            e.group_idx = src.group_idx;
            e.kv_cache_spec_kind = src.spec_kind;
            e.kv_cache_spec_sliding_window = src.sliding_window;
            out.emplace_back(std::move(e));
            break;
          }
          case Record::Kind::remove: {
            BlockRemoved e;
            e.block_hashes.assign(hs.begin(), hs.end());
            e.medium = to_string(src.medium);
            e.group_idx = src.group_idx;
            out.emplace_back(std::move(e));
            break;
          }
          case Record::Kind::clear: {
            AllBlocksCleared e;
            e.medium.emplace(to_string(src.medium));
            e.group_idx = src.group_idx;
            out.emplace_back(std::move(e));
            break;
          }
        }
      }
      return out;
    }
  };
  Buffer pending;
  Buffer spare;  // the publisher thread's, swapped with pending
  std::size_t pending_bytes = 0;
  // pending.size(), readable without the lock: a full buffer drops before
  // the event is copied.
  std::atomic<std::size_t> pending_count{0};
  std::chrono::steady_clock::time_point first_pending{};
  bool stop = false;
  bool flush_asked = false;

  // Published (taken and sent or failed), for flush().
  std::mutex flush_mu;
  std::condition_variable flush_cv;
  std::uint64_t published = 0;

  std::atomic<std::uint64_t> accepted{0}, dropped{0}, sent{0}, send_failures{0}, replays{0},
      snapshots{0}, bad_requests{0}, next_seq{0};

  // The publisher thread's own state.
  std::deque<std::pair<std::uint64_t, std::string>> ring;
  CachedSet cached;
  std::thread thread;

  // Appends one event under the lock: `fill` writes its record and arenas
  // (it may throw std::bad_alloc while the arenas grow: the event is then
  // dropped and the buffer left as it was).
  template <class Fill>
  void push(std::size_t bytes, Fill&& fill) noexcept {
    std::unique_lock lk(mu);
    if (stop || pending.records.size() >= opt.buffer_events ||
        pending_bytes + bytes > opt.buffer_bytes) {
      lk.unlock();
      dropped.fetch_add(1, std::memory_order_relaxed);
      return;
    }
    const std::size_t h = pending.hashes.size(), t = pending.tokens.size(),
                      src = pending.sources.size(), l = pending.loras.size();
    try {
      Record r{};
      fill(r);
      r.hashes_at = static_cast<std::uint32_t>(h);
      r.tokens_at = static_cast<std::uint32_t>(t);
      pending.records.push_back(r);
    } catch (...) {
      pending.hashes.resize(h);
      pending.tokens.resize(t);
      pending.sources.resize(src, EventSource{});
      pending.loras.resize(l);
      lk.unlock();
      dropped.fetch_add(1, std::memory_order_relaxed);
      return;
    }
    if (pending.records.size() == 1) first_pending = std::chrono::steady_clock::now();
    pending_bytes += bytes;
    pending_count.store(pending.records.size(), std::memory_order_relaxed);
    accepted.fetch_add(1, std::memory_order_relaxed);
    const bool full = pending.records.size() == opt.max_batch_events;  // wake once per batch
    lk.unlock();
    if (full) cv.notify_one();
  }

  void publish(std::vector<CacheEvent>&& events) {
    EventBatch batch;
    batch.ts = wall_seconds();
    batch.data_parallel_rank = opt.data_parallel_rank;
    batch.events = std::move(events);
    batch.seq = next_seq.load(std::memory_order_relaxed);
    if (router) {
      for (const CacheEvent& e : batch.events)
        cached.apply(e);
    }
    std::string payload;
    encode_batch(batch, opt.form, payload);
    const auto seq_frame = encode_seq(batch.seq);
    bool ok = false;
    try {
      ok = pub.send(zmq::buffer(opt.topic), zmq::send_flags::sndmore | zmq::send_flags::dontwait)
               .has_value();
      // After the first frame ZeroMQ takes the whole message (the high water
      // mark is checked at a message's start).
      if (ok) {
        pub.send(as_buffer(seq_frame), zmq::send_flags::sndmore);
        pub.send(zmq::buffer(payload), zmq::send_flags::none);
      }
    } catch (const zmq::error_t&) {
      ok = false;
    }
    (ok ? sent : send_failures).fetch_add(1, std::memory_order_relaxed);
    next_seq.store(batch.seq + 1, std::memory_order_relaxed);
    if (router) {
      ring.emplace_back(batch.seq, std::move(payload));
      while (ring.size() > opt.replay_ring_batches)
        ring.pop_front();
    }
  }

  void reply(const std::vector<zmq::message_t>& request, std::span<const std::byte> seq,
             std::string_view payload) {
    // Echo the routing prefix: [identity] or [identity, ""] (REQ, or a
    // DEALER that sends the empty delimiter as vLLM's clients do).
    for (std::size_t k = 0; k + 1 < request.size(); ++k) {
      router->send(zmq::buffer(request[k].data(), request[k].size()),
                   zmq::send_flags::sndmore | zmq::send_flags::dontwait);
    }
    router->send(zmq::buffer(seq.data(), seq.size()),
                 zmq::send_flags::sndmore | zmq::send_flags::dontwait);
    router->send(zmq::buffer(payload), zmq::send_flags::dontwait);
  }

  void serve_requests() {
    for (int served = 0; served < 64; ++served) {
      std::vector<zmq::message_t> frames;
      try {
        if (!zmq::recv_multipart(*router, std::back_inserter(frames), zmq::recv_flags::dontwait))
          return;
        if (frames.size() < 2 || frames.size() > 3 ||
            (frames.size() == 3 && frames[1].size() != 0)) {
          bad_requests.fetch_add(1, std::memory_order_relaxed);
          continue;
        }
        const zmq::message_t& req = frames.back();
        const std::string_view body(req.data<char>(), req.size());
        const auto end = encode_seq(end_of_replay_seq);
        if (body == snapshot_request) {
          EventBatch snap;
          snap.seq = next_seq.load(std::memory_order_relaxed);
          snap.ts = wall_seconds();
          snap.data_parallel_rank = opt.data_parallel_rank;
          snap.events = cached.as_events();
          const std::string payload = encode_batch(snap, opt.form);
          reply(frames, encode_seq(snap.seq), payload);
          reply(frames, end, "");
          snapshots.fetch_add(1, std::memory_order_relaxed);
        } else if (auto start = decode_seq(std::as_bytes(std::span(body.data(), body.size())))) {
          for (const auto& [seq, payload] : ring) {
            if (seq >= *start) reply(frames, encode_seq(seq), payload);
          }
          reply(frames, end, "");
          replays.fetch_add(1, std::memory_order_relaxed);
        } else {
          bad_requests.fetch_add(1, std::memory_order_relaxed);
          reply(frames, end, "");
        }
      } catch (const zmq::error_t&) {
        bad_requests.fetch_add(1, std::memory_order_relaxed);
      }
    }
  }

  void run() {
    const auto slice =
        std::clamp(std::chrono::duration_cast<std::chrono::milliseconds>(opt.batch_interval),
                   std::chrono::milliseconds(1), std::chrono::milliseconds(10));
    while (true) {
      if (router) {
        zmq::pollitem_t item{router->handle(), 0, ZMQ_POLLIN, 0};
        try {
          zmq::poll(&item, 1, slice);
        } catch (const zmq::error_t&) {
        }
        serve_requests();
      }
      bool stopping = false;
      bool took = false;
      {
        std::unique_lock lk(mu);
        auto due = [&] {
          return stop || flush_asked || pending.records.size() >= opt.max_batch_events ||
                 (!pending.records.empty() &&
                  std::chrono::steady_clock::now() - first_pending >= opt.batch_interval);
        };
        if (!router && !due()) cv.wait_for(lk, slice, due);
        if (due()) {
          std::swap(spare, pending);
          took = true;
          pending_bytes = 0;
          pending_count.store(0, std::memory_order_relaxed);
          flush_asked = false;
        }
        stopping = stop;
      }
      std::vector<CacheEvent> taken;
      if (took) {
        try {
          taken = spare.to_events();
        } catch (...) {  // out of memory: these events are lost, counted
          dropped.fetch_add(spare.records.size(), std::memory_order_relaxed);
          accepted.fetch_sub(spare.records.size(), std::memory_order_relaxed);
        }
        spare.clear();  // keeps its capacity for the next swap
      }
      const std::size_t n = taken.size();
      for (std::size_t begin = 0; begin < n; begin += opt.max_batch_events) {
        const std::size_t end = std::min(n, begin + opt.max_batch_events);
        std::vector<CacheEvent> chunk;
        if (begin == 0 && end == n) {
          chunk = std::move(taken);
        } else {
          chunk.assign(std::make_move_iterator(taken.begin() + static_cast<std::ptrdiff_t>(begin)),
                       std::make_move_iterator(taken.begin() + static_cast<std::ptrdiff_t>(end)));
        }
        publish(std::move(chunk));
      }
      if (n > 0) {
        std::lock_guard lk(flush_mu);
        published += n;
        flush_cv.notify_all();
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
  m.opt = std::move(options);
  const int linger = static_cast<int>(std::min<std::int64_t>(m.opt.linger.count(), INT32_MAX));
  m.pub.set(zmq::sockopt::linger, linger);
  m.pub.set(zmq::sockopt::sndhwm, m.opt.send_high_water_mark);
  // A full subscriber makes send() fail (counted) instead of dropping silently.
  m.pub.set(zmq::sockopt::xpub_nodrop, 1);
  bind_or_throw(m.pub, m.opt.endpoint, "PUB");
  m.bound = last_endpoint(m.pub);
  if (!m.opt.replay_endpoint.empty()) {
    m.router.emplace(m.ctx, zmq::socket_type::router);
    m.router->set(zmq::sockopt::linger, linger);
    bind_or_throw(*m.router, m.opt.replay_endpoint, "replay");
    m.replay_bound = last_endpoint(*m.router);
  }
  m.thread = std::thread([&m] { m.run(); });
}

Publisher::~Publisher() {
  {
    std::lock_guard lk(impl_->mu);
    impl_->stop = true;
  }
  impl_->cv.notify_one();
  if (impl_->thread.joinable()) impl_->thread.join();
  impl_->pub.close();
  if (impl_->router) impl_->router->close();
  impl_->ctx.close();  // waits up to `linger` for queued messages
}

void Publisher::stored(const EventSource& source, const BlockStoredView& blocks) noexcept {
  if (impl_->surely_full()) return impl_->drop();
  const std::size_t bytes = event_overhead + 8 * blocks.hashes.size() + 4 * blocks.tokens.size();
  impl_->push(bytes, [&](Impl::Record& r) {
    Impl::Buffer& b = impl_->pending;
    r.kind = Impl::Record::Kind::store;
    r.source = b.source_index(source);
    for (const BlockHash& h : blocks.hashes)
      b.hashes.push_back(event_hash(h));
    b.tokens.insert(b.tokens.end(), blocks.tokens.begin(), blocks.tokens.end());
    r.n_hashes = static_cast<std::uint32_t>(blocks.hashes.size());
    r.n_tokens = static_cast<std::uint32_t>(blocks.tokens.size());
    r.block_size = blocks.block_size;
    if (blocks.parent) {
      r.has_parent = true;
      r.parent = event_hash(*blocks.parent);
    }
    if (blocks.lora_name) {
      b.loras.emplace_back(*blocks.lora_name);
      r.lora = static_cast<std::int32_t>(b.loras.size() - 1);
    }
  });
}

void Publisher::removed(const EventSource& source, std::span<const BlockHash> hashes) noexcept {
  if (impl_->surely_full()) return impl_->drop();
  impl_->push(event_overhead + 8 * hashes.size(), [&](Impl::Record& r) {
    Impl::Buffer& b = impl_->pending;
    r.kind = Impl::Record::Kind::remove;
    r.source = b.source_index(source);
    for (const BlockHash& h : hashes)
      b.hashes.push_back(event_hash(h));
    r.n_hashes = static_cast<std::uint32_t>(hashes.size());
  });
}

void Publisher::cleared(const EventSource& source) noexcept {
  if (impl_->surely_full()) return impl_->drop();
  impl_->push(event_overhead, [&](Impl::Record& r) {
    r.kind = Impl::Record::Kind::clear;
    r.source = impl_->pending.source_index(source);
  });
}

bool Publisher::flush(std::chrono::milliseconds timeout) {
  const std::uint64_t target = impl_->accepted.load();
  {
    std::lock_guard lk(impl_->mu);
    impl_->flush_asked = true;
  }
  impl_->cv.notify_one();
  std::unique_lock lk(impl_->flush_mu);
  return impl_->flush_cv.wait_for(lk, timeout, [&] { return impl_->published >= target; });
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
  s.events_accepted = m.accepted.load();
  s.events_dropped = m.dropped.load();
  s.batches_sent = m.sent.load();
  s.send_failures = m.send_failures.load();
  s.replay_requests = m.replays.load();
  s.snapshots = m.snapshots.load();
  s.bad_requests = m.bad_requests.load();
  s.next_seq = m.next_seq.load();
  return s;
}

}  // namespace kvport::events
