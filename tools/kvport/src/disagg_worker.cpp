// A `kvport disagg` worker: one prefill or decode rank. It owns a host-backend
// PagedKvCache with a prefix cache and an Agent, and runs a PrefillNode or a
// DecodeNode, driven by the coordinator's lines on stdin (disagg.hpp).
#include <poll.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <deque>
#include <map>
#include <numeric>
#include <optional>
#include <ostream>
#include <set>
#include <string>
#include <vector>

#include <fmt/format.h>

#include "disagg.hpp"
#include "disagg_line_input.hpp"
#include "kvport/backends/host_backend.hpp"
#include "kvport/core/paged_kv_cache.hpp"
#include "kvport/core/prefix_cache.hpp"
#include "kvport/platform/error.hpp"
#include "kvport/platform/log.hpp"
#include "kvport/transfer/agent.hpp"
#include "kvport/transfer/disagg.hpp"
#include "kvport/transfer/kv_content.hpp"

namespace kvport::cli::disagg {

using nlohmann::json;
using Clock = std::chrono::steady_clock;

namespace {

class Worker {
 public:
  Worker(const WorkerSpec& spec, std::ostream& out)
      : spec_(spec),
        out_(out),
        backend_(make_host_backend()),
        cache_(rank_config(spec), spec.capacity_blocks, *backend_),
        prefix_(cache_),
        stream_(backend_->create_stream()) {
    transfer::AgentOptions o;
    o.name = worker_name(spec.role, spec.instance, spec.rank);
    o.tp_rank = spec.rank;
    o.tp_size = spec.tp;
    o.peer_timeout = spec.peer_timeout;
    o.scratch_bytes = spec.scratch_bytes;
    agent_.emplace(cache_, o);
    if (spec.role == Role::prefill) {
      transfer::PrefillOptions po;
      po.lease_ttl = spec.lease_ttl;
      prefill_.emplace(*agent_, prefix_, po);
    } else {
      transfer::DecodeOptions d;
      d.assemble_timeout = spec.lease_ttl;
      d.confirm_timeout = spec.lease_ttl;
      decode_.emplace(*agent_, prefix_, d);
    }
  }

  int run() {
    // Touch the pools once, as an engine zeroes its KV cache at start: the
    // first pulls then do not pay the pools' page faults.
    {
      std::vector<BlockId> all(cache_.num_blocks());
      std::iota(all.begin(), all.end(), BlockId{0});
      cache_.zero_blocks(all, stream_);
      backend_->synchronize(stream_);
    }
    std::string address;
    try {
      address = agent_->listen(spec_.bind.find(':') != std::string::npos ? "[" + spec_.bind + "]:0"
                                                                         : spec_.bind + ":0");
    } catch (const Error& e) {
      emit(event::fatal, {{"why", e.what()}, {"listen", true}});
      return 2;
    }
    emit(event::ready, {{"address", address},
                        {"transport", agent_->transport_description()},
                        {"memory_path", std::string(transfer::to_string(agent_->memory_path()))}});
    LineInput input(STDIN_FILENO);
    while (true) {
      const bool busy = !waiting_.empty() || !recomputes_.empty() ||
                        (decode_ && decode_->pending_requests() > 0) ||
                        (prefill_ && prefill_->active_leases() > 0);
      for (const std::string& line :
           input.read(busy ? std::chrono::milliseconds(1) : std::chrono::milliseconds(5))) {
        handle(line);
      }
      if (input.eof()) return 3;  // the coordinator is gone
      step();
      if (finishing_ && idle()) {
        report_stats();
        return 0;
      }
      if (finishing_ && Clock::now() > finish_deadline_) {
        report_stats();
        return 0;
      }
    }
  }

 private:
  static KvCacheConfig rank_config(const WorkerSpec& spec) {
    KvCacheConfig c = spec.config;
    if (spec.tp == 0 || c.num_kv_heads % spec.tp != 0) {
      throw InvalidArgument(fmt::format("{} KV heads do not split over tensor-parallel size {}",
                                        c.num_kv_heads, spec.tp));
    }
    c.num_kv_heads /= spec.tp;
    return c;
  }

  void emit(const json& j) { out_ << j.dump() << '\n' << std::flush; }
  void emit(std::string_view name, json fields) {
    fields[field::event] = name;
    emit(fields);
  }

  static std::vector<TokenId> tokens_of(const json& j) {
    return j.at("tokens").get<std::vector<TokenId>>();
  }

  std::size_t blocks_for(std::size_t tokens) const {
    return (tokens + cache_.config().block_size - 1) / cache_.config().block_size;
  }

  void handle(const std::string& line) {
    json j;
    try {
      j = json::parse(line);
      const std::string op = j.at(field::op).get<std::string>();
      if (op == op::connect) {
        connect(j);
      } else if (op == op::baseline) {
        baseline(j);
      } else if (op == op::prefill) {
        waiting_.push_back({j.at("req").get<std::uint64_t>(), j.at("decode").get<std::uint32_t>(),
                            tokens_of(j), Clock::now()});
      } else if (op == op::recompute) {
        recompute(j.at("req").get<std::uint64_t>(), tokens_of(j));
      } else if (op == op::finish) {
        finishing_ = true;
        finish_deadline_ = Clock::now() + spec_.lease_ttl + spec_.peer_timeout * 2;
      } else {
        throw InvalidArgument("unknown op " + op);
      }
    } catch (const std::exception& e) {
      emit(event::fatal, {{"why", std::string("bad command: ") + e.what()}});
    }
  }

  void connect(const json& j) {
    const auto& instances = j.at("decode");
    for (std::size_t i = 0; i < instances.size(); ++i) {
      for (const auto& address : instances[i]) {
        decode_peers_[static_cast<std::uint32_t>(i)].push_back(
            agent_->connect(address.get<std::string>()));
      }
    }
    // What UCX chose for the data of the first connection (its lanes).
    std::string lanes;
    if (!decode_peers_.empty() && !decode_peers_.begin()->second.empty()) {
      lanes = agent_->peer_transport(decode_peers_.begin()->second.front());
    }
    emit(event::connected, {{"lanes", lanes}});
  }

  void baseline(const json& j) {
    const auto bytes = j.at("bytes").get<std::size_t>();
    const auto repeat = j.at("repeat").get<int>();
    json seconds = json::array();
    std::string why = "no connection to prefill0.0";
    if (auto p = scratch_peer()) {
      why.clear();
      try {
        for (int i = 0; i < repeat; ++i)
          seconds.push_back(agent_->read_scratch(*p, bytes));
      } catch (const Error& e) {
        why = e.what();
        seconds.clear();
      }
    }
    emit(event::baseline, {{"bytes", bytes}, {"seconds", seconds}, {"why", why}});
  }

  // Computes a request here ("recompute"): fills its blocks, caches the full
  // ones, releases them.
  // Computes a request here ("recompute"): fills its blocks, caches the full
  // ones, releases them. Without room now (blocks held by pulls under way),
  // it waits in recomputes_ and is retried by step().
  void recompute(std::uint64_t req, std::vector<TokenId> tokens) {
    if (done_.contains(req)) return;
    if (decode_) decode_->abort(req);  // a pull still under way is dropped
    if (!try_recompute(req, tokens))
      recomputes_.push_back({req, 0, std::move(tokens), Clock::now()});
  }

  // False when there is no room yet.
  bool try_recompute(std::uint64_t req, const std::vector<TokenId>& tokens) {
    if (done_.contains(req)) return true;
    std::vector<BlockId> blocks;
    const std::size_t n = blocks_for(tokens.size());
    for (std::size_t i = 0; i < n; ++i) {
      auto b = prefix_.try_alloc_block();
      if (!b) {
        prefix_.release_blocks(blocks);
        return false;
      }
      blocks.push_back(*b);
    }
    transfer::write_kv_content(cache_, agent_->layout(), blocks, tokens, stream_);
    cache_full_blocks(blocks, tokens);
    prefix_.release_blocks(blocks);
    done_.insert(req);
    emit(event::done, {{"req", req},
                       {"ok", false},
                       {"recomputed", true},
                       {"blocks", n},
                       {"bytes", 0},
                       {"transfer_s", 0},
                       {"latency_s", 0},
                       {"wrong_bytes", 0}});
    return true;
  }

  // Retries the recomputes waiting for room; one that waited two lease TTLs
  // with no pull holding blocks fails (reported, not computed).
  void retry_recomputes() {
    while (!recomputes_.empty()) {
      Waiting& w = recomputes_.front();
      if (!try_recompute(w.req, w.tokens)) {
        // Blocks held by pulls under way come back when those end: keep
        // waiting while there are any.
        const bool pulls_hold_blocks = decode_ && decode_->held_blocks() > 0;
        if (pulls_hold_blocks || Clock::now() - w.since <= spec_.lease_ttl * 2) return;
        done_.insert(w.req);
        emit(event::done, {{"req", w.req},
                           {"ok", false},
                           {"recomputed", false},
                           {"why", "no room to recompute"}});
      }
      recomputes_.pop_front();
    }
  }

  void cache_full_blocks(const std::vector<BlockId>& blocks, const std::vector<TokenId>& tokens) {
    const auto hashes = hash_full_blocks(tokens, cache_.config().block_size);
    for (std::size_t i = 0; i < hashes.size() && i < blocks.size(); ++i) {
      if (!prefix_.is_cached(blocks[i])) prefix_.insert(hashes[i], blocks[i]);
    }
  }

  struct Waiting {
    std::uint64_t req;
    std::uint32_t decode;
    std::vector<TokenId> tokens;
    Clock::time_point since;
  };

  // Prefill: the request's blocks (cached prefix reused), filled, leased.
  bool try_prefill(const Waiting& w) {
    auto peers = decode_peers_.find(w.decode);
    if (peers == decode_peers_.end())
      throw InvalidArgument(fmt::format("unknown decode instance {}", w.decode));
    const std::size_t n = blocks_for(w.tokens.size());
    std::vector<BlockId> blocks = prefix_.lookup(w.tokens).blocks;
    const std::size_t hits = blocks.size();
    while (blocks.size() < n) {
      auto b = prefix_.try_alloc_block();
      if (!b) {
        prefix_.release_blocks(blocks);
        return false;
      }
      blocks.push_back(*b);
    }
    std::span<const BlockId> fresh(blocks.begin() + static_cast<std::ptrdiff_t>(hits),
                                   blocks.end());
    transfer::write_kv_content(cache_, agent_->layout(), fresh, w.tokens, stream_, hits);
    cache_full_blocks(blocks, w.tokens);
    agent_->publish(fresh);
    std::vector<transfer::PeerId> live;
    for (transfer::PeerId p : peers->second) {
      auto info = agent_->peer(p);
      if (info && info->connected) live.push_back(p);
    }
    try {
      if (live.empty()) throw InvalidArgument("every decode rank of the instance is lost");
      prefill_->offer(w.req, spec_.instance, blocks, w.tokens, live);
    } catch (const InvalidArgument& e) {
      prefix_.release_blocks(blocks);
      emit(event::prefill_failed, {{"req", w.req}, {"why", e.what()}});
    }
    return true;
  }

  void step() {
    retry_recomputes();
    if (prefill_) {
      while (!waiting_.empty()) {
        const Waiting& w = waiting_.front();
        if (!try_prefill(w)) {
          if (Clock::now() - w.since > spec_.lease_ttl * 2) {
            emit(event::prefill_failed, {{"req", w.req}, {"why", "no room"}});
            waiting_.pop_front();
            continue;
          }
          break;
        }
        waiting_.pop_front();
      }
      for (const auto& l : prefill_->poll()) {
        emit(event::lease_end,
             {{"req", l.request_id}, {"end", std::string(transfer::to_string(l.end))}});
      }
      report_losses(prefill_->lost_peers());
    }
    if (decode_) {
      for (auto& r : decode_->poll())
        finish_decode(r);
      report_losses(decode_->lost_peers());
    }
  }

  void finish_decode(transfer::DecodeResult& r) {
    if (done_.contains(r.request_id)) {
      prefix_.release_blocks(r.blocks);
      return;
    }
    if (!r.ok) {
      log::warn(fmt::format("disagg: request {} falls back to recompute: {}", r.request_id, r.why));
      recompute(r.request_id, r.tokens);
      return;
    }
    const auto check =
        transfer::verify_kv_content(cache_, agent_->layout(), r.blocks, r.tokens, stream_);
    prefix_.release_blocks(r.blocks);
    done_.insert(r.request_id);
    // The raw baseline under the same load: one contiguous read of the same
    // bytes (up to the scratch size) right after this pull.
    std::uint64_t raw_bytes = 0;
    double raw_seconds = 0;
    if (spec_.scratch_bytes > 0 && r.blocks.size() >= 16) {
      if (auto peer = scratch_peer()) {
        raw_bytes = std::min<std::uint64_t>(r.bytes, spec_.scratch_bytes);
        try {
          raw_seconds = agent_->read_scratch(*peer, raw_bytes);
        } catch (const Error& e) {
          log::warn(fmt::format("disagg: raw read failed: {}", e.what()));
          raw_bytes = 0;
        }
      }
    }
    emit(event::done, {{"raw_bytes", raw_bytes},
                       {"raw_s", raw_seconds},
                       {"req", r.request_id},
                       {"ok", true},
                       {"recomputed", false},
                       {"blocks", r.blocks.size()},
                       {"bytes", r.bytes},
                       {"transfer_s", r.transfer_seconds},
                       {"latency_s", r.latency_seconds},
                       {"wrong_bytes", check.bytes_wrong}});
  }

  // One event per peer lost since the last call, naming it.
  void report_losses(const std::vector<transfer::PeerId>& lost) {
    for (; reported_losses_ < lost.size(); ++reported_losses_) {
      auto info = agent_->peer(lost[reported_losses_]);
      emit(event::peer_lost, {{"peer", info ? info->name : std::string("?")}});
    }
  }

  // The peer whose scratch the raw reads use: prefill 0.0 (which has one).
  std::optional<transfer::PeerId> scratch_peer() const {
    for (transfer::PeerId p : agent_->peers()) {
      auto info = agent_->peer(p);
      if (info && info->connected && info->name == worker_name(Role::prefill, 0, 0)) return p;
    }
    return std::nullopt;
  }

  bool idle() const {
    if (!waiting_.empty() || !recomputes_.empty()) return false;
    if (prefill_ && prefill_->active_leases() > 0) return false;
    if (decode_ && decode_->pending_requests() > 0) return false;
    return true;
  }

  void report_stats() {
    const std::size_t in_use_before = cache_.num_blocks_in_use();
    const std::size_t cached = prefix_.num_cached_blocks();
    prefix_.evict(cache_.num_blocks());
    const auto invariants = prefix_.check_invariants();
    const auto a = agent_->counters();
    json j = event_message(event::stats);
    j.update({{"role", std::string(to_string(spec_.role))},
              {"in_use", in_use_before},
              {"cached", cached},
              {"leaked_blocks", cache_.num_blocks_in_use()},
              {"invariants_ok", invariants.ok},
              {"transfers_posted", a.transfers_posted},
              {"transfers_done", a.transfers_done},
              {"transfers_cancelled", a.transfers_cancelled},
              {"transfers_failed", a.transfers_failed},
              {"malformed_messages", a.malformed_messages},
              {"peers_lost", a.peers_lost}});
    if (prefill_) {
      const auto& c = prefill_->counters();
      j["leases"] = {{"active", prefill_->active_leases()},
                     {"held_blocks", prefill_->held_blocks()},
                     {"offered", c.leases_offered},
                     {"pulled", c.leases_pulled},
                     {"refused", c.leases_refused},
                     {"expired", c.leases_expired},
                     {"lost", c.leases_lost},
                     {"aborted", c.leases_aborted},
                     {"late_notifications", c.late_notifications}};
    }
    if (decode_) {
      const auto& c = decode_->counters();
      j["decode"] = {{"pending", decode_->pending_requests()},
                     {"held_blocks", decode_->held_blocks()},
                     {"completed", c.requests_completed},
                     {"failed", c.requests_failed},
                     {"revoked", c.revoked},
                     {"late_notifications", c.late_notifications},
                     {"no_room", c.no_room},
                     {"blocks_registered", c.blocks_registered},
                     {"transfers_timed_out", c.transfers_timed_out},
                     {"transfers_abandoned", c.transfers_abandoned},
                     {"blocks_quarantined", c.blocks_quarantined},
                     {"quarantined_blocks", decode_->quarantined_blocks()}};
    }
    emit(j);
  }

  WorkerSpec spec_;
  std::ostream& out_;
  std::unique_ptr<Backend> backend_;
  PagedKvCache cache_;
  PrefixCache prefix_;
  Stream stream_;
  std::optional<transfer::Agent> agent_;
  std::optional<transfer::PrefillNode> prefill_;
  std::optional<transfer::DecodeNode> decode_;
  std::map<std::uint32_t, std::vector<transfer::PeerId>> decode_peers_;
  std::deque<Waiting> waiting_;
  std::deque<Waiting> recomputes_;
  std::set<std::uint64_t> done_;
  std::size_t reported_losses_ = 0;
  bool finishing_ = false;
  Clock::time_point finish_deadline_;
};

}  // namespace

int run_worker(const WorkerSpec& spec, std::ostream& out) {
  if (!spec.model_layers.empty()) return run_hybrid_worker(spec, out);
  try {
    Worker worker(spec, out);
    return worker.run();
  } catch (const std::exception& e) {
    json j = event_message(event::fatal);
    j[field::why] = e.what();
    out << j.dump() << '\n' << std::flush;
    return 1;
  }
}

}  // namespace kvport::cli::disagg
