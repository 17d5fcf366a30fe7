// SPDX-License-Identifier: Apache-2.0
// What both `kvport disagg` workers (the single-cache one, disagg_worker.cpp,
// and the hybrid one, disagg_hybrid_worker.cpp) share: the loop over the
// coordinator's ops on stdin, the queues of requests waiting for room, the
// events a worker writes, the raw UCX baseline and the decode side's
// counters in "stats". A worker derives from WorkerBase<itself> and
// provides connect(json), try_prefill(Waiting), try_recompute(req, tokens),
// abort_pull(req), pulls_hold_blocks(), poll_nodes(), busy_nodes() and
// report_stats().
#pragma once

#include <unistd.h>

#include <chrono>
#include <cstdint>
#include <deque>
#include <optional>
#include <ostream>
#include <set>
#include <string>
#include <string_view>
#include <vector>

#include <nlohmann/json.hpp>

#include "disagg.hpp"
#include "disagg_line_input.hpp"
#include "kvport/core/block_hash.hpp"
#include "kvport/platform/error.hpp"
#include "kvport/platform/log.hpp"
#include "kvport/transfer/agent.hpp"
#include "kvport/transfer/disagg.hpp"

namespace kvport::cli::disagg {

/// The decode side's counters in a worker's "stats" event ("decode"), summed
/// over a hybrid worker's groups by the caller.
struct DecodeStats {
  std::size_t pending = 0;
  std::size_t held_blocks = 0;
  std::size_t quarantined_blocks = 0;
  std::uint64_t completed = 0;
  std::uint64_t failed = 0;
  std::uint64_t revoked = 0;
  std::uint64_t late_notifications = 0;
  std::optional<std::uint64_t> late_results;  // the hybrid node's own
  std::uint64_t no_room = 0;
  std::uint64_t blocks_registered = 0;
  std::uint64_t transfers_timed_out = 0;
  std::uint64_t transfers_abandoned = 0;
  std::uint64_t blocks_quarantined = 0;

  /// Adds one DecodeNode's pull counters (not completed/failed/registered:
  /// a hybrid worker counts those per request, not per group).
  void add_pulls(const transfer::DecodeCounters& c) {
    revoked += c.revoked;
    late_notifications += c.late_notifications;
    no_room += c.no_room;
    transfers_timed_out += c.transfers_timed_out;
    transfers_abandoned += c.transfers_abandoned;
    blocks_quarantined += c.blocks_quarantined;
  }

  nlohmann::json to_json() const {
    nlohmann::json j = {{"pending", pending},
                        {"held_blocks", held_blocks},
                        {"completed", completed},
                        {"failed", failed},
                        {"revoked", revoked},
                        {"late_notifications", late_notifications},
                        {"no_room", no_room},
                        {"blocks_registered", blocks_registered},
                        {"transfers_timed_out", transfers_timed_out},
                        {"transfers_abandoned", transfers_abandoned},
                        {"blocks_quarantined", blocks_quarantined},
                        {"quarantined_blocks", quarantined_blocks}};
    if (late_results) j["late_results"] = *late_results;
    return j;
  }
};

/// The prefill side's lease counters in "stats" ("leases").
struct LeaseStats {
  std::size_t active = 0;
  std::size_t held_blocks = 0;
  std::uint64_t offered = 0, pulled = 0, refused = 0, expired = 0, lost = 0, aborted = 0,
                late_notifications = 0;

  void add(const transfer::PrefillCounters& c) {
    offered += c.leases_offered;
    pulled += c.leases_pulled;
    refused += c.leases_refused;
    expired += c.leases_expired;
    lost += c.leases_lost;
    aborted += c.leases_aborted;
    late_notifications += c.late_notifications;
  }

  nlohmann::json to_json() const {
    return {{"active", active},
            {"held_blocks", held_blocks},
            {"offered", offered},
            {"pulled", pulled},
            {"refused", refused},
            {"expired", expired},
            {"lost", lost},
            {"aborted", aborted},
            {"late_notifications", late_notifications}};
  }
};

template <class Derived>
class WorkerBase {
 public:
  using Clock = std::chrono::steady_clock;
  using json = nlohmann::json;

  /// A request waiting for room: to prefill (for decode instance `decode`)
  /// or to recompute.
  struct Waiting {
    std::uint64_t req;
    std::uint32_t decode;
    std::vector<TokenId> tokens;
    Clock::time_point since;
  };

 protected:
  WorkerBase(const WorkerSpec& spec, std::ostream& out) : spec_(spec), out_(out) {}

  Derived& self() { return static_cast<Derived&>(*this); }
  const Derived& self() const { return static_cast<const Derived&>(*this); }

  void emit(const json& j) { out_ << j.dump() << '\n' << std::flush; }
  void emit(std::string_view name, json fields) {
    fields[field::event] = name;
    emit(fields);
  }

  /// The coordinator's ops until "finish" (then stats, exit 0) or the end of
  /// stdin (exit 3: the coordinator is gone).
  int serve() {
    LineInput input(STDIN_FILENO);
    while (true) {
      for (const std::string& line :
           input.read(busy() ? std::chrono::milliseconds(1) : std::chrono::milliseconds(5))) {
        handle(line);
      }
      if (input.eof()) return 3;
      step();
      if (finishing_ && (!busy() || Clock::now() > finish_deadline_)) {
        self().report_stats();
        return 0;
      }
    }
  }

  bool busy() const { return !waiting_.empty() || !recomputes_.empty() || self().busy_nodes(); }

  void handle(const std::string& line) {
    try {
      const json j = json::parse(line);
      const std::string op = j.at(field::op).template get<std::string>();
      if (op == op::connect) {
        self().connect(j);
      } else if (op == op::baseline) {
        self().baseline(j);
      } else if (op == op::prefill) {
        waiting_.push_back({j.at("req").template get<std::uint64_t>(),
                            j.at("decode").template get<std::uint32_t>(), tokens_of(j),
                            Clock::now()});
      } else if (op == op::recompute) {
        recompute(j.at("req").template get<std::uint64_t>(), tokens_of(j));
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

  /// "baseline": `repeat` raw reads of `bytes` from prefill 0.0's scratch
  /// over `agent` (nullopt peer: not connected).
  void baseline(const json& j, transfer::Agent& agent, std::optional<transfer::PeerId> peer) {
    const auto bytes = j.at("bytes").template get<std::size_t>();
    const auto repeat = j.at("repeat").template get<int>();
    json seconds = json::array();
    std::string why = "no connection to prefill0.0";
    if (peer) {
      why.clear();
      try {
        for (int i = 0; i < repeat; ++i)
          seconds.push_back(agent.read_scratch(*peer, bytes));
      } catch (const Error& e) {
        why = e.what();
        seconds.clear();
      }
    }
    emit(event::baseline, {{"bytes", bytes}, {"seconds", seconds}, {"why", why}});
  }

  /// The raw baseline under the same load, right after a pull of `bytes` in
  /// `blocks` blocks: one contiguous read of the same bytes (up to the
  /// scratch size) from prefill 0.0's scratch. {"raw_bytes", "raw_s"}: 0 and
  /// 0 for a small pull, no scratch, no connection or a failed read.
  json raw_sample(transfer::Agent& agent, std::optional<transfer::PeerId> peer, std::uint64_t bytes,
                  std::size_t blocks) {
    std::uint64_t raw_bytes = 0;
    double raw_seconds = 0;
    if (spec_.scratch_bytes > 0 && blocks >= 16 && peer) {
      raw_bytes = std::min<std::uint64_t>(bytes, spec_.scratch_bytes);
      try {
        raw_seconds = agent.read_scratch(*peer, raw_bytes);
      } catch (const Error& e) {
        log::warn(fmt::format("disagg: raw read failed: {}", e.what()));
        raw_bytes = 0;
      }
    }
    return {{"raw_bytes", raw_bytes}, {"raw_s", raw_seconds}};
  }

  /// Computes a request here ("recompute"). Without room now (blocks held by
  /// pulls under way) it waits in recomputes_ and is retried by step().
  void recompute(std::uint64_t req, std::vector<TokenId> tokens) {
    if (done_.contains(req)) return;
    self().abort_pull(req);  // a pull still under way is dropped
    if (!self().try_recompute(req, tokens))
      recomputes_.push_back({req, 0, std::move(tokens), Clock::now()});
  }

  /// A recomputed request's "done" (`blocks` blocks filled here).
  void emit_recomputed(std::uint64_t req, std::size_t blocks) {
    done_.insert(req);
    emit(event::done, {{"req", req},
                       {"ok", false},
                       {"recomputed", true},
                       {"blocks", blocks},
                       {"bytes", 0},
                       {"transfer_s", 0},
                       {"latency_s", 0},
                       {"wrong_bytes", 0}});
  }

  /// Retries the recomputes waiting for room; one that waited two lease TTLs
  /// with no pull holding blocks fails (reported, not computed).
  void retry_recomputes() {
    while (!recomputes_.empty()) {
      Waiting& w = recomputes_.front();
      if (!self().try_recompute(w.req, w.tokens)) {
        // Blocks held by pulls under way come back when those end: keep
        // waiting while there are any.
        if (self().pulls_hold_blocks() || Clock::now() - w.since <= spec_.lease_ttl * 2) return;
        done_.insert(w.req);
        emit(event::done, {{"req", w.req},
                           {"ok", false},
                           {"recomputed", false},
                           {"why", "no room to recompute"}});
      }
      recomputes_.pop_front();
    }
  }

  /// One turn: recomputes, the prefills waiting for room (one that found
  /// none for two lease TTLs fails), then the nodes' progress.
  void step() {
    retry_recomputes();
    while (!waiting_.empty()) {
      const Waiting& w = waiting_.front();
      if (!self().try_prefill(w)) {
        if (Clock::now() - w.since <= spec_.lease_ttl * 2) break;
        emit(event::prefill_failed, {{"req", w.req}, {"why", "no room"}});
      }
      waiting_.pop_front();
    }
    self().poll_nodes();
  }

  static std::vector<TokenId> tokens_of(const json& j) {
    return j.at("tokens").template get<std::vector<TokenId>>();
  }

  WorkerSpec spec_;
  std::ostream& out_;
  std::deque<Waiting> waiting_;
  std::deque<Waiting> recomputes_;
  std::set<std::uint64_t> done_;
  bool finishing_ = false;
  Clock::time_point finish_deadline_;
};

}  // namespace kvport::cli::disagg
