// SPDX-License-Identifier: Apache-2.0
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
#include "disagg_worker_base.hpp"
#include "kvport/backends/host_backend.hpp"
#include "kvport/core/paged_kv_cache.hpp"
#include "kvport/core/prefix_cache.hpp"
#include "kvport/platform/div_ceil.hpp"
#include "kvport/platform/error.hpp"
#include "kvport/platform/log.hpp"
#include "kvport/transfer/agent.hpp"
#include "kvport/transfer/disagg.hpp"
#include "kvport/transfer/kv_content.hpp"

namespace kvport::cli::disagg {

using nlohmann::json;
using Clock = std::chrono::steady_clock;

namespace {

class Worker : public WorkerBase<Worker> {
 public:
  Worker(const WorkerSpec& spec, std::ostream& out)
      : WorkerBase(spec, out),
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
    return serve();
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

  std::size_t blocks_for(std::size_t tokens) const {
    return div_ceil(tokens, cache_.config().block_size);
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

  friend class WorkerBase<Worker>;

  void baseline(const json& j) { WorkerBase::baseline(j, *agent_, scratch_peer()); }

  void abort_pull(std::uint64_t req) {
    if (decode_) decode_->abort(req);
  }
  bool pulls_hold_blocks() const { return decode_ && decode_->held_blocks() > 0; }
  bool busy_nodes() const {
    return (decode_ && decode_->pending_requests() > 0) ||
           (prefill_ && prefill_->active_leases() > 0);
  }

  // Computes  // Computes a request here ("recompute"): fills its blocks, caches the full
  // ones, releases them.
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
    emit_recomputed(req, n);
    return true;
  }

  void cache_full_blocks(const std::vector<BlockId>& blocks, const std::vector<TokenId>& tokens) {
    const auto hashes = hash_full_blocks(tokens, cache_.config().block_size);
    for (std::size_t i = 0; i < hashes.size() && i < blocks.size(); ++i) {
      if (!prefix_.is_cached(blocks[i])) prefix_.insert(hashes[i], blocks[i]);
    }
  }

  // Prefill: the request's blocks (cached prefix reused), filled, leased.
  bool try_prefill(const Waiting& w) {
    if (!prefill_) {
      emit(event::prefill_failed, {{"req", w.req}, {"why", "not a prefill worker"}});
      return true;
    }
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

  void poll_nodes() {
    if (prefill_) {
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
    json fields = raw_sample(*agent_, scratch_peer(), r.bytes, r.blocks.size());
    fields.update({{"req", r.request_id},
                   {"ok", true},
                   {"recomputed", false},
                   {"blocks", r.blocks.size()},
                   {"bytes", r.bytes},
                   {"transfer_s", r.transfer_seconds},
                   {"latency_s", r.latency_seconds},
                   {"wrong_bytes", check.bytes_wrong}});
    emit(event::done, std::move(fields));
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
      LeaseStats l;
      l.add(prefill_->counters());
      l.active = prefill_->active_leases();
      l.held_blocks = prefill_->held_blocks();
      j["leases"] = l.to_json();
    }
    if (decode_) {
      const auto& c = decode_->counters();
      DecodeStats d;
      d.add_pulls(c);
      d.pending = decode_->pending_requests();
      d.held_blocks = decode_->held_blocks();
      d.quarantined_blocks = decode_->quarantined_blocks();
      d.completed = c.requests_completed;
      d.failed = c.requests_failed;
      d.blocks_registered = c.blocks_registered;
      j["decode"] = d.to_json();
    }
    emit(j);
  }

  std::unique_ptr<Backend> backend_;
  PagedKvCache cache_;
  PrefixCache prefix_;
  Stream stream_;
  std::optional<transfer::Agent> agent_;
  std::optional<transfer::PrefillNode> prefill_;
  std::optional<transfer::DecodeNode> decode_;
  std::map<std::uint32_t, std::vector<transfer::PeerId>> decode_peers_;
  std::size_t reported_losses_ = 0;
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
