// SPDX-License-Identifier: Apache-2.0
// A `kvport disagg` worker for a hybrid (or MLA) model: one prefill or decode
// rank owning a host-backend HybridKvCache (one pool and prefix cache per KV
// cache group) with one Agent per group, running a HybridPrefillNode or a
// HybridDecodeNode. Same ops and events as the single-cache worker
// (disagg.hpp), with per-group addresses and per-group numbers.
#include <algorithm>
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
#include "kvport/core/hybrid_kv_cache.hpp"
#include "kvport/platform/div_ceil.hpp"
#include "kvport/platform/error.hpp"
#include "kvport/platform/log.hpp"
#include "kvport/transfer/agent.hpp"
#include "kvport/transfer/hybrid_disagg.hpp"

namespace kvport::cli::disagg {

using nlohmann::json;
using Clock = std::chrono::steady_clock;

namespace {

std::vector<std::string> split_commas(const std::string& s) {
  std::vector<std::string> out;
  std::size_t start = 0;
  while (true) {
    const std::size_t comma = s.find(',', start);
    out.push_back(s.substr(start, comma - start));
    if (comma == std::string::npos) break;
    start = comma + 1;
  }
  return out;
}

// An agent's name without the ".g<group>" suffix hybrid_agent_options adds:
// the worker's name, as the coordinator knows it.
std::string worker_of(const std::string& agent_name) {
  const std::size_t dot = agent_name.rfind(".g");
  return dot == std::string::npos ? agent_name : agent_name.substr(0, dot);
}

HybridKvCacheConfig rank_cache_config(const WorkerSpec& spec) {
  HybridKvCacheConfig c;
  c.layers = transfer::rank_layer_specs(spec.model_layers, spec.tp);
  c.block_size = spec.config.block_size;
  c.layout = spec.config.layout;
  return c;
}

std::vector<std::size_t> group_capacities(const WorkerSpec& spec) {
  std::vector<std::size_t> out;
  for (const KvCacheGroup& g : group_layers(rank_cache_config(spec).layers, spec.config.block_size))
    out.push_back(g.spec.has_state() ? spec.state_slots : spec.capacity_blocks);
  return out;
}

class HybridWorker : public WorkerBase<HybridWorker> {
 public:
  HybridWorker(const WorkerSpec& spec, std::ostream& out)
      : WorkerBase(spec, out),
        backend_(make_host_backend()),
        cache_(rank_cache_config(spec), group_capacities(spec), *backend_),
        stream_(backend_->create_stream()) {
    transfer::AgentOptions base;
    base.name = worker_name(spec.role, spec.instance, spec.rank);
    base.peer_timeout = spec.peer_timeout;
    options_ = transfer::hybrid_agent_options(cache_, spec.rank, spec.tp, base);
    options_[0].scratch_bytes = spec.scratch_bytes;  // the raw baseline, group 0's agent
    for (std::size_t g = 0; g < options_.size(); ++g) {
      agents_.push_back(std::make_unique<transfer::Agent>(cache_.group_cache(g), options_[g]));
      ptrs_.push_back(agents_.back().get());
      layouts_.push_back(transfer::group_content_layout(cache_, g, options_[g]));
    }
    if (spec.role == Role::prefill) {
      transfer::PrefillOptions po;
      po.lease_ttl = spec.lease_ttl;
      prefill_.emplace(cache_, ptrs_, spec.rank, spec.tp, po);
    } else {
      transfer::DecodeOptions d;
      d.assemble_timeout = spec.lease_ttl;
      d.confirm_timeout = spec.lease_ttl;
      decode_.emplace(cache_, ptrs_, d);
    }
  }

  int run() {
    for (std::size_t g = 0; g < groups(); ++g) {  // touch the pools once, as an engine does
      std::vector<BlockId> all(cache_.group_cache(g).num_blocks());
      std::iota(all.begin(), all.end(), BlockId{0});
      cache_.group_cache(g).zero_blocks(all, stream_);
    }
    backend_->synchronize(stream_);
    std::string addresses;
    try {
      for (auto& a : agents_) {
        if (!addresses.empty()) addresses += ',';
        addresses += a->listen(spec_.bind + ":0");
      }
    } catch (const Error& e) {
      emit(event::fatal, {{"why", e.what()}, {"listen", true}});
      return 2;
    }
    emit(event::ready,
         {{"address", addresses},
          {"transport", agents_[0]->transport_description()},
          {"memory_path", std::string(transfer::to_string(agents_[0]->memory_path()))}});
    return serve();
  }

 private:
  std::size_t groups() const { return agents_.size(); }

  friend class WorkerBase<HybridWorker>;

  bool busy_nodes() const {
    return (decode_ && decode_->pending_requests() > 0) ||
           (prefill_ && prefill_->active_leases() > 0);
  }
  void abort_pull(std::uint64_t req) {
    if (decode_) decode_->abort(req);
  }
  bool pulls_hold_blocks() const {
    for (std::size_t g = 0; decode_ && g < groups(); ++g)
      if (decode_->held_blocks(g) > 0) return true;
    return false;
  }

  // "decode": per instance, per rank, the rank's comma-separated group addresses.
  void connect(const json& j) {
    const auto& instances = j.at("decode");
    for (std::size_t i = 0; i < instances.size(); ++i) {
      auto& peers = decode_peers_[static_cast<std::uint32_t>(i)];
      peers.resize(groups());
      for (const auto& address : instances[i]) {
        const auto parts = split_commas(address.get<std::string>());
        if (parts.size() != groups()) {
          throw InvalidArgument(fmt::format("decode rank address '{}': {} groups, {} here",
                                            address.get<std::string>(), parts.size(), groups()));
        }
        for (std::size_t g = 0; g < groups(); ++g)
          peers[g].push_back(agents_[g]->connect(parts[g]));
      }
    }
    std::string lanes;
    if (!decode_peers_.empty() && !decode_peers_.begin()->second[0].empty())
      lanes = agents_[0]->peer_transport(decode_peers_.begin()->second[0].front());
    emit(event::connected, {{"lanes", lanes}});
  }

  std::optional<transfer::PeerId> scratch_peer() const {
    const std::string want = worker_name(Role::prefill, 0, 0);
    for (transfer::PeerId p : agents_[0]->peers()) {
      auto info = agents_[0]->peer(p);
      if (info && info->connected && worker_of(info->name) == want) return p;
    }
    return std::nullopt;
  }

  void baseline(const json& j) { WorkerBase::baseline(j, *agents_[0], scratch_peer()); }

  // Every group's blocks of `tokens`' lease extent (groups this rank offers
  // only, when `offered_only`), filled; nullopt (nothing held) without room.
  std::optional<std::vector<std::vector<BlockId>>> fill(std::uint64_t req,
                                                        const std::vector<TokenId>& tokens,
                                                        bool offered_only) {
    std::vector<std::vector<BlockId>> blocks(groups());
    std::vector<transfer::LeaseExtent> extents(groups());
    const std::size_t bs = cache_.block_size();
    for (std::size_t g = 0; g < groups(); ++g) {
      if (offered_only && !prefill_->offers(req, g)) continue;
      extents[g] = transfer::lease_extent(cache_.group(g), bs, tokens.size());
      const std::size_t n =
          extents[g].state ? 1 : div_ceil(tokens.size(), bs) - extents[g].first_block;
      for (std::size_t i = 0; i < n; ++i) {
        auto b = cache_.prefix_cache(g).try_alloc_block();
        if (!b) {
          for (std::size_t h = 0; h <= g; ++h)
            cache_.prefix_cache(h).release_blocks(blocks[h]);
          return std::nullopt;
        }
        blocks[g].push_back(*b);
      }
    }
    for (std::size_t g = 0; g < groups(); ++g) {
      if (blocks[g].empty()) continue;
      transfer::write_group_content(cache_, g, layouts_[g], blocks[g], tokens, extents[g], stream_);
      agents_[g]->publish(blocks[g]);
    }
    return blocks;
  }

  void release(const std::vector<std::vector<BlockId>>& blocks) {
    for (std::size_t g = 0; g < blocks.size(); ++g)
      cache_.prefix_cache(g).release_blocks(blocks[g]);
  }

  bool try_prefill(const Waiting& w) {
    if (!prefill_) {
      emit(event::prefill_failed, {{"req", w.req}, {"why", "not a prefill worker"}});
      return true;
    }
    auto peers = decode_peers_.find(w.decode);
    if (peers == decode_peers_.end())
      throw InvalidArgument(fmt::format("unknown decode instance {}", w.decode));
    auto blocks = fill(w.req, w.tokens, true);
    if (!blocks) return false;
    std::vector<std::vector<transfer::PeerId>> live(groups());
    for (std::size_t g = 0; g < groups(); ++g) {
      for (transfer::PeerId p : peers->second[g]) {
        auto info = agents_[g]->peer(p);
        if (info && info->connected) live[g].push_back(p);
      }
    }
    try {
      for (std::size_t g = 0; g < groups(); ++g) {
        if (prefill_->offers(w.req, g) && live[g].empty())
          throw InvalidArgument("every decode rank of the instance is lost");
      }
      prefill_->offer(w.req, spec_.instance, *blocks, w.tokens, live);
    } catch (const InvalidArgument& e) {
      release(*blocks);
      emit(event::prefill_failed, {{"req", w.req}, {"why", e.what()}});
    }
    return true;
  }

  bool try_recompute(std::uint64_t req, const std::vector<TokenId>& tokens) {
    if (done_.contains(req)) return true;
    auto blocks = fill(req, tokens, false);
    if (!blocks) return false;
    std::size_t n = 0;
    for (const auto& b : *blocks)
      n += b.size();
    release(*blocks);
    emit_recomputed(req, n);
    return true;
  }

  void poll_nodes() {
    if (prefill_) {
      for (const auto& l : prefill_->poll()) {
        emit(event::lease_end,
             {{"req", l.request_id}, {"end", std::string(transfer::to_string(l.end))}});
      }
      for (std::size_t g = 0; g < groups(); ++g)
        report_losses(g, prefill_->group_node(g).lost_peers());
    }
    if (decode_) {
      // Losses first: verifying a large result takes a while, and a loss
      // is timed from the kill to its report.
      auto results = decode_->poll();
      for (std::size_t g = 0; g < groups(); ++g)
        report_losses(g, decode_->group_node(g).lost_peers());
      for (auto& r : results)
        finish_decode(r);
    }
  }

  void finish_decode(transfer::HybridDecodeResult& r) {
    if (done_.contains(r.request_id)) {
      for (std::size_t g = 0; g < r.groups.size(); ++g)
        cache_.prefix_cache(g).release_blocks(r.groups[g].blocks);
      return;
    }
    if (!r.ok) {
      log::warn(fmt::format("disagg: request {} falls back to recompute: {}", r.request_id, r.why));
      recompute(r.request_id, r.tokens);
      return;
    }
    json per_group = json::array();
    std::uint64_t wrong = 0;
    std::size_t blocks = 0;
    for (std::size_t g = 0; g < r.groups.size(); ++g) {
      transfer::HybridGroupResult& gr = r.groups[g];
      const auto check = transfer::verify_group_content(cache_, g, layouts_[g], gr.blocks, r.tokens,
                                                        gr.extent, stream_);
      // Every byte of the group is checked: none counts as all wrong.
      const std::uint64_t w = check.bytes_checked == 0 ? gr.bytes : check.bytes_wrong;
      wrong += w;
      blocks += gr.blocks.size();
      per_group.push_back({{"kind", std::string(to_string(cache_.group(g).spec.kind))},
                           {"bytes", gr.bytes},
                           {"wrong_bytes", w},
                           {"checked_bytes", check.bytes_checked},
                           {"blocks", gr.blocks.size()},
                           {"first_block", gr.extent.first_block}});
      cache_.prefix_cache(g).release_blocks(gr.blocks);
    }
    done_.insert(r.request_id);
    json fields = raw_sample(*agents_[0], scratch_peer(), r.bytes, blocks);
    fields.update({{"req", r.request_id},
                   {"ok", true},
                   {"recomputed", false},
                   {"blocks", blocks},
                   {"bytes", r.bytes},
                   {"transfer_s", r.transfer_seconds},
                   {"latency_s", r.latency_seconds},
                   {"wrong_bytes", wrong},
                   {"groups", per_group}});
    emit(event::done, std::move(fields));
  }

  // One event per worker lost (each group's agent loses it: reported once).
  void report_losses(std::size_t g, const std::vector<transfer::PeerId>& lost) {
    std::size_t& seen = reported_[g];
    for (; seen < lost.size(); ++seen) {
      auto info = agents_[g]->peer(lost[seen]);
      const std::string name = info ? worker_of(info->name) : std::string("?");
      if (lost_names_.insert(name).second) emit(event::peer_lost, {{"peer", name}});
    }
  }

  void report_stats() {
    json per_group = json::array();
    std::size_t in_use = 0, cached = 0, leaked = 0;
    bool invariants_ok = true;
    for (std::size_t g = 0; g < groups(); ++g) {
      PagedKvCache& pool = cache_.group_cache(g);
      PrefixCache& prefix = cache_.prefix_cache(g);
      const std::size_t u = pool.num_blocks_in_use();
      const std::size_t c = prefix.num_cached_blocks();
      prefix.evict(pool.num_blocks());
      const bool ok = prefix.check_invariants().ok;
      in_use += u;
      cached += c;
      leaked += pool.num_blocks_in_use();
      invariants_ok = invariants_ok && ok;
      per_group.push_back({{"kind", std::string(to_string(cache_.group(g).spec.kind))},
                           {"in_use", u},
                           {"cached", c},
                           {"leaked_blocks", pool.num_blocks_in_use()},
                           {"invariants_ok", ok}});
    }
    transfer::AgentCounters a;
    for (auto& agent : agents_) {
      const auto c = agent->counters();
      a.transfers_posted += c.transfers_posted;
      a.transfers_done += c.transfers_done;
      a.transfers_cancelled += c.transfers_cancelled;
      a.transfers_failed += c.transfers_failed;
      a.malformed_messages += c.malformed_messages;
      a.peers_lost += c.peers_lost;
    }
    json j = event_message(event::stats);
    j.update({{"role", std::string(to_string(spec_.role))},
              {"in_use", in_use},
              {"cached", cached},
              {"leaked_blocks", leaked},
              {"invariants_ok", invariants_ok},
              {"transfers_posted", a.transfers_posted},
              {"transfers_done", a.transfers_done},
              {"transfers_cancelled", a.transfers_cancelled},
              {"transfers_failed", a.transfers_failed},
              {"malformed_messages", a.malformed_messages},
              {"peers_lost", a.peers_lost},
              {"groups", per_group}});
    if (prefill_) {
      LeaseStats l;
      l.active = prefill_->active_leases();
      for (std::size_t g = 0; g < groups(); ++g) {
        l.add(prefill_->group_node(g).counters());
        l.held_blocks += prefill_->held_blocks(g);
      }
      j["leases"] = l.to_json();
    }
    if (decode_) {
      const auto& c = decode_->counters();
      DecodeStats d;
      d.pending = decode_->pending_requests();
      for (std::size_t g = 0; g < groups(); ++g) {
        d.add_pulls(decode_->group_node(g).counters());
        d.held_blocks += decode_->held_blocks(g);
        d.quarantined_blocks += decode_->group_node(g).quarantined_blocks();
      }
      d.completed = c.requests_completed;
      d.failed = c.requests_failed;
      d.late_results = c.late_results;
      d.blocks_registered = c.blocks_registered;
      j["decode"] = d.to_json();
    }
    emit(j);
  }

  std::unique_ptr<Backend> backend_;
  HybridKvCache cache_;
  Stream stream_;
  std::vector<transfer::AgentOptions> options_;
  std::vector<std::unique_ptr<transfer::Agent>> agents_;
  std::vector<transfer::Agent*> ptrs_;
  std::vector<transfer::PoolLayout> layouts_;
  std::optional<transfer::HybridPrefillNode> prefill_;
  std::optional<transfer::HybridDecodeNode> decode_;
  // decode instance -> per group, that group's agent's peer ids of its ranks
  std::map<std::uint32_t, std::vector<std::vector<transfer::PeerId>>> decode_peers_;
  std::map<std::size_t, std::size_t> reported_;
  std::set<std::string> lost_names_;
};

}  // namespace

int run_hybrid_worker(const WorkerSpec& spec, std::ostream& out) {
  try {
    HybridWorker worker(spec, out);
    return worker.run();
  } catch (const std::exception& e) {
    json j = event_message(event::fatal);
    j[field::why] = e.what();
    out << j.dump() << '\n' << std::flush;
    return 1;
  }
}

}  // namespace kvport::cli::disagg
