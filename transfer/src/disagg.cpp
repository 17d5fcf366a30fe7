// SPDX-License-Identifier: Apache-2.0
// PrefillNode and DecodeNode: leases, pulls, confirmations and the failure
// rules (blocks are freed only when no transfer can touch them).
#include "kvport/transfer/disagg.hpp"

#include <algorithm>
#include <optional>
#include <set>
#include <unordered_map>

#include <fmt/format.h>

#include "kvport/platform/div_ceil.hpp"
#include "kvport/platform/error.hpp"
#include "kvport/platform/log.hpp"
#include "wire_codec.hpp"

namespace kvport::transfer {

std::string_view to_string(LeaseEnd end) noexcept {
  switch (end) {
    case LeaseEnd::pulled:
      return "pulled";
    case LeaseEnd::refused:
      return "refused";
    case LeaseEnd::expired:
      return "expired";
    case LeaseEnd::peer_lost:
      return "peer_lost";
    case LeaseEnd::aborted:
      return "aborted";
  }
  return "unknown";
}

namespace {

using Clock = std::chrono::steady_clock;

// The protocol's payloads (docs/transfer.md), through the one wire codec.
// Decoding throws InvalidArgument naming the field; poll() turns that into a
// dropped, counted notification at its boundary.
constexpr std::string_view kLeaseContext = "lease notification";
constexpr std::string_view kAnswerContext = "lease answer";
constexpr std::uint32_t kMaxTokens = kMaxNotificationBytes / sizeof(TokenId);

// lease: the lease id, the prefill group, the lease's ttl (ms), the tokens,
// and, for an extent other than the whole sequence, the extension: a u16
// version (1), the u32 first block, a u8 of flags (bit 0: a state slot).
struct LeaseOffer {
  std::uint64_t lease = 0;
  std::uint32_t group = 0;
  std::uint32_t ttl_ms = 0;
  std::vector<TokenId> tokens;
  LeaseExtent extent;
};

constexpr std::uint16_t kExtentVersion = 1;
constexpr std::uint8_t kExtentState = 1;

std::vector<std::uint8_t> encode_offer(std::uint64_t lease, std::uint32_t group,
                                       std::uint32_t ttl_ms, std::span<const TokenId> tokens,
                                       const LeaseExtent& extent) {
  wire::Writer w(kLeaseContext);
  w.u64(lease);
  w.u32(group);
  w.u32(ttl_ms);
  w.count(tokens.size(), kMaxTokens, "token count");
  for (TokenId t : tokens)
    w.u32(t);
  if (extent != LeaseExtent{}) {
    w.u16(kExtentVersion);
    w.u32(extent.first_block);
    w.u8(extent.state ? kExtentState : 0);
  }
  return w.take();
}

LeaseOffer decode_offer(std::span<const std::uint8_t> payload) {
  wire::Reader r(payload, kLeaseContext);
  LeaseOffer o;
  o.lease = r.u64("lease id");
  o.group = r.u32("group");
  o.ttl_ms = r.u32("ttl");
  const std::uint32_t count = r.count("token count", kMaxTokens, sizeof(TokenId));
  if (count == 0) r.fail("no tokens");
  o.tokens.reserve(count);
  for (std::uint32_t i = 0; i < count; ++i)
    o.tokens.push_back(static_cast<TokenId>(r.u32("token")));
  if (!r.at_end()) {
    const std::uint16_t version = r.u16("extent version");
    if (version != kExtentVersion) r.fail(fmt::format("unknown extent version {}", version));
    o.extent.first_block = r.u32("first block");
    const std::uint8_t flags = r.u8("extent flags");
    if ((flags & ~kExtentState) != 0) r.fail(fmt::format("unknown extent flags {:#x}", flags));
    o.extent.state = (flags & kExtentState) != 0;
    if (o.extent.state && o.extent.first_block != 0) r.fail("a state extent with a first block");
    r.expect_end("the extent");
  }
  return o;
}

// The lease id a pulled/confirm/revoked/refused message carries.
std::vector<std::uint8_t> lease_id_payload(std::uint64_t lease) {
  wire::Writer w(kAnswerContext);
  w.u64(lease);
  return w.take();
}

// Later bytes are ignored (as every build has done), so that an answer may
// grow fields.
std::uint64_t lease_id_of(const Notification& n) {
  wire::Reader r(n.payload, kAnswerContext);
  return r.u64("lease id");
}

}  // namespace

// ---- prefill ---------------------------------------------------------------------

struct PrefillNode::State {
  struct Lease {
    std::uint64_t id = 0;
    std::uint64_t request_id = 0;
    std::vector<BlockId> blocks;
    std::set<PeerId> waiting;  // decode peers that have not answered
    Clock::time_point deadline;
  };

  Agent& agent;
  PrefixCache& cache;
  PrefillOptions options;
  std::uint64_t next_lease = 0;
  std::unordered_map<std::uint64_t, Lease> leases;              // by lease id
  std::unordered_map<std::uint64_t, std::uint64_t> by_request;  // request -> lease id
  std::size_t held = 0;
  PrefillCounters counters;
  std::vector<LeaseResult> ended;
  std::vector<PeerId> lost;

  State(Agent& a, PrefixCache& c, PrefillOptions o) : agent(a), cache(c), options(o) {}

  void end(std::uint64_t lease_id, LeaseEnd how) {
    auto it = leases.find(lease_id);
    if (it == leases.end()) return;
    Lease& lease = it->second;
    cache.release_blocks(lease.blocks);  // tail first: the head stays cached longest
    held -= lease.blocks.size();
    switch (how) {
      case LeaseEnd::pulled:
        ++counters.leases_pulled;
        break;
      case LeaseEnd::refused:
        ++counters.leases_refused;
        break;
      case LeaseEnd::expired:
        ++counters.leases_expired;
        break;
      case LeaseEnd::peer_lost:
        ++counters.leases_lost;
        break;
      case LeaseEnd::aborted:
        ++counters.leases_aborted;
        break;
    }
    ended.push_back({lease.request_id, how});
    by_request.erase(lease.request_id);
    leases.erase(it);
  }

  void reply(PeerId peer, std::uint64_t request_id, DisaggKind kind, std::uint64_t lease) {
    try {
      agent.notify(peer, request_id, static_cast<std::uint32_t>(kind), {}, lease_id_payload(lease));
    } catch (const InvalidArgument&) {
      // The peer is gone: nothing to tell.
    }
  }
};

PrefillNode::PrefillNode(Agent& agent, PrefixCache& cache, PrefillOptions options)
    : state_(std::make_unique<State>(agent, cache, options)) {
  if (options.lease_ttl.count() <= 0) throw InvalidArgument("PrefillNode: lease_ttl must be > 0");
}

PrefillNode::~PrefillNode() {
  std::vector<std::uint64_t> ids;
  for (const auto& [id, lease] : state_->leases)
    ids.push_back(id);
  for (std::uint64_t id : ids) {
    try {
      state_->end(id, LeaseEnd::aborted);
    } catch (const std::exception& e) {
      log::error(fmt::format("PrefillNode: releasing lease {} failed: {}", id, e.what()));
    }
  }
}

void PrefillNode::offer(std::uint64_t request_id, std::uint32_t group,
                        std::span<const BlockId> blocks, std::span<const TokenId> tokens,
                        std::span<const PeerId> decode_peers, LeaseExtent extent) {
  State& s = *state_;
  if (decode_peers.empty()) throw InvalidArgument("offer: no decode peers");
  if (s.by_request.contains(request_id)) {
    throw InvalidArgument(fmt::format("offer: request {} already has a lease", request_id));
  }
  const std::size_t bs = s.cache.block_size();
  if (tokens.empty() || tokens.size() > kMaxTokens) {
    throw InvalidArgument(fmt::format("offer: {} tokens (1 to {})", tokens.size(), kMaxTokens));
  }
  if (extent.state) {
    if (extent.first_block != 0 || blocks.size() != 1) {
      throw InvalidArgument(
          fmt::format("offer: a state extent is one slot at block 0, not {} at block {}",
                      blocks.size(), extent.first_block));
    }
  } else {
    const std::size_t total = div_ceil(tokens.size(), bs);
    if (extent.first_block >= total || blocks.size() != total - extent.first_block) {
      throw InvalidArgument(
          fmt::format("offer: {} blocks from block {} for {} tokens (block size {})", blocks.size(),
                      extent.first_block, tokens.size(), bs));
    }
  }
  // Only the decode ranks that hold some of this rank's heads pull from it.
  std::vector<PeerId> peers;
  for (PeerId p : decode_peers) {
    auto info = s.agent.peer(p);
    if (!info || !info->connected)
      throw InvalidArgument(fmt::format("offer: peer {} is not connected", p));
    if (head_overlap(s.agent.layout(), info->layout)) peers.push_back(p);
  }
  if (peers.empty()) throw InvalidArgument("offer: no decode peer holds any of this rank's heads");
  decode_peers = peers;
  State::Lease lease;
  lease.id = ++s.next_lease;
  lease.request_id = request_id;
  lease.blocks.assign(blocks.begin(), blocks.end());
  lease.waiting.insert(decode_peers.begin(), decode_peers.end());
  lease.deadline = Clock::now() + s.options.lease_ttl;
  const std::vector<std::uint8_t> payload = encode_offer(
      lease.id, group, static_cast<std::uint32_t>(s.options.lease_ttl.count()), tokens, extent);
  // Record first: a peer lost between two notifies still ends the lease.
  const std::uint64_t id = lease.id;
  s.held += lease.blocks.size();
  s.by_request[request_id] = id;
  s.leases.emplace(id, std::move(lease));
  ++s.counters.leases_offered;
  for (PeerId p : decode_peers) {
    try {
      s.agent.notify(p, request_id, static_cast<std::uint32_t>(DisaggKind::lease), blocks, payload);
    } catch (const InvalidArgument&) {
      // Lost meanwhile: poll() sees the loss and ends the lease.
    }
  }
}

std::vector<LeaseResult> PrefillNode::poll() {
  State& s = *state_;
  for (const Notification& n : s.agent.take_notifications()) {
    const auto kind = static_cast<DisaggKind>(n.kind);
    std::optional<std::uint64_t> lease_id;
    try {
      lease_id = lease_id_of(n);
    } catch (const InvalidArgument&) {
      // malformed: counted below, like any notification not ours to answer
    }
    if (!lease_id || (kind != DisaggKind::pulled && kind != DisaggKind::refused)) {
      ++s.counters.late_notifications;  // not ours to answer
      continue;
    }
    auto it = s.leases.find(*lease_id);
    if (it == s.leases.end() || !it->second.waiting.contains(n.peer)) {
      // The lease ended (expired, aborted, refused by another rank): the
      // blocks may belong to someone else now.
      ++s.counters.late_notifications;
      if (kind == DisaggKind::pulled) s.reply(n.peer, n.request_id, DisaggKind::revoked, *lease_id);
      continue;
    }
    State::Lease& lease = it->second;
    if (kind == DisaggKind::refused) {
      // Tell the other ranks; their pulls are void.
      for (PeerId p : lease.waiting) {
        if (p != n.peer) s.reply(p, lease.request_id, DisaggKind::revoked, lease.id);
      }
      s.end(lease.id, LeaseEnd::refused);
      continue;
    }
    s.reply(n.peer, lease.request_id, DisaggKind::confirm, lease.id);
    lease.waiting.erase(n.peer);
    if (lease.waiting.empty()) s.end(lease.id, LeaseEnd::pulled);
  }
  for (PeerId lost : s.agent.take_lost_peers()) {
    ++s.counters.peers_lost;
    s.lost.push_back(lost);
    std::vector<std::uint64_t> victims;
    for (const auto& [id, lease] : s.leases) {
      if (lease.waiting.contains(lost)) victims.push_back(id);
    }
    for (std::uint64_t id : victims) {
      for (PeerId p : s.leases.at(id).waiting) {
        if (p != lost) s.reply(p, s.leases.at(id).request_id, DisaggKind::revoked, id);
      }
      s.end(id, LeaseEnd::peer_lost);
    }
  }
  const auto now = Clock::now();
  std::vector<std::uint64_t> expired;
  for (const auto& [id, lease] : s.leases) {
    if (now >= lease.deadline) expired.push_back(id);
  }
  for (std::uint64_t id : expired) {
    for (PeerId p : s.leases.at(id).waiting)
      s.reply(p, s.leases.at(id).request_id, DisaggKind::revoked, id);
    s.end(id, LeaseEnd::expired);
  }
  return std::exchange(s.ended, {});
}

bool PrefillNode::abort(std::uint64_t request_id) {
  State& s = *state_;
  auto it = s.by_request.find(request_id);
  if (it == s.by_request.end()) return false;
  s.end(it->second, LeaseEnd::aborted);
  s.ended.pop_back();  // the caller knows
  return true;
}

const std::vector<PeerId>& PrefillNode::lost_peers() const noexcept {
  return state_->lost;
}
std::size_t PrefillNode::active_leases() const noexcept {
  return state_->leases.size();
}
std::size_t PrefillNode::held_blocks() const noexcept {
  return state_->held;
}
const PrefillCounters& PrefillNode::counters() const noexcept {
  return state_->counters;
}

// ---- decode ----------------------------------------------------------------------

struct DecodeNode::State {
  enum class Phase { assembling, pulling, confirming, draining };

  struct Part {
    PeerId peer = 0;
    std::uint64_t lease = 0;
    std::vector<BlockId> remote_blocks;
    std::optional<TransferId> transfer;
    bool final = false;
    bool abandoned = false;  // pending, but the agent gave up on it
    bool confirmed = false;
  };

  // The blocks of a failed request whose abandoned transfers the transport
  // may still write: held until those transfers are final.
  struct Quarantine {
    std::vector<TransferId> transfers;
    std::vector<BlockId> blocks;
  };

  struct Request {
    std::uint64_t request_id = 0;
    std::uint32_t group = 0;
    Phase phase = Phase::assembling;
    std::vector<TokenId> tokens;
    LeaseExtent extent;
    std::size_t num_blocks = 0;
    std::set<std::uint32_t> expected_ranks;
    std::map<std::uint32_t, Part> parts;  // by prefill rank
    std::vector<BlockId> blocks;          // ours
    Clock::time_point first_seen;
    Clock::time_point pulled_at;
    Clock::time_point first_post;
    Clock::time_point last_final;
    std::uint64_t bytes = 0;
    bool failed = false;
    bool aborted = false;
    std::string why;
  };

  Agent& agent;
  PrefixCache& cache;
  DecodeOptions options;
  std::map<std::uint64_t, Request> requests;  // by request id
  std::size_t held = 0;
  std::vector<Quarantine> quarantine;
  std::size_t quarantined = 0;
  DecodeCounters counters;
  std::vector<DecodeResult> results;
  std::vector<PeerId> lost;

  State(Agent& a, PrefixCache& c, DecodeOptions o) : agent(a), cache(c), options(o) {}

  void tell(PeerId peer, std::uint64_t request_id, DisaggKind kind, std::uint64_t lease) {
    try {
      agent.notify(peer, request_id, static_cast<std::uint32_t>(kind), {}, lease_id_payload(lease));
    } catch (const InvalidArgument&) {
    }
  }

  // The prefill ranks whose heads overlap ours, for a group of `tp` ranks.
  std::set<std::uint32_t> ranks_for(const PoolLayout& theirs) const {
    const PoolLayout& mine = agent.layout();
    std::set<std::uint32_t> out;
    PoolLayout probe = theirs;
    for (std::uint32_t r = 0; r < theirs.tp_size; ++r) {
      probe.tp_rank = r;
      if (head_overlap(mine, probe)) out.insert(r);
    }
    return out;
  }

  void on_lease(const Notification& n) {
    LeaseOffer offer;
    try {
      offer = decode_offer(n.payload);
    } catch (const InvalidArgument& e) {
      ++counters.late_notifications;  // malformed: ignore
      log::warn(fmt::format("DecodeNode: dropped a lease from peer {}: {}", n.peer, e.what()));
      return;
    }
    auto info = agent.peer(n.peer);
    if (!info) {
      ++counters.late_notifications;
      return;
    }
    const std::size_t bs = cache.block_size();
    const std::size_t total = div_ceil(offer.tokens.size(), bs);
    const bool shape_ok = offer.extent.state
                              ? n.blocks.size() == 1
                              : offer.extent.first_block < total &&
                                    n.blocks.size() == total - offer.extent.first_block;
    if (!shape_ok) {
      ++counters.late_notifications;  // malformed: ignore (the lease expires)
      log::warn(fmt::format(
          "DecodeNode: dropped a lease from peer {}: {} blocks from block {} for {} tokens", n.peer,
          n.blocks.size(), offer.extent.first_block, offer.tokens.size()));
      return;
    }
    auto [it, fresh] = requests.try_emplace(n.request_id);
    Request& r = it->second;
    if (fresh) {
      r.request_id = n.request_id;
      r.group = offer.group;
      r.tokens = std::move(offer.tokens);
      r.extent = offer.extent;
      r.num_blocks = n.blocks.size();
      r.expected_ranks = ranks_for(info->layout);
      r.first_seen = Clock::now();
    } else if (r.phase != Phase::assembling || r.group != offer.group || r.tokens != offer.tokens ||
               r.extent != offer.extent || r.num_blocks != n.blocks.size() ||
               r.parts.contains(info->layout.tp_rank)) {
      // A second offer of a request we already handle, or parts that
      // disagree: refuse this part.
      tell(n.peer, n.request_id, DisaggKind::refused, offer.lease);
      return;
    }
    ++counters.lease_parts;
    if (!r.expected_ranks.contains(info->layout.tp_rank)) {
      tell(n.peer, n.request_id, DisaggKind::refused, offer.lease);  // holds none of our heads
      return;
    }
    Part part;
    part.peer = n.peer;
    part.lease = offer.lease;
    part.remote_blocks = n.blocks;
    r.parts.emplace(info->layout.tp_rank, std::move(part));
  }

  // All parts here: allocate (all or nothing) and post one read per part.
  void start_pull(Request& r) {
    std::vector<BlockId> blocks;
    for (std::size_t i = 0; i < r.num_blocks; ++i) {
      auto b = cache.try_alloc_block();
      if (!b) {
        cache.release_blocks(blocks);
        return;  // retried at the next poll, until assemble_timeout
      }
      blocks.push_back(*b);
    }
    r.blocks = std::move(blocks);
    held += r.blocks.size();
    r.phase = Phase::pulling;
    r.first_post = Clock::time_point::max();
    r.last_final = Clock::time_point::min();
    for (auto& [rank, part] : r.parts) {
      try {
        part.transfer = agent.post(part.peer, Direction::read, r.blocks, part.remote_blocks);
        ++counters.transfers;
      } catch (const std::exception& e) {
        // Nothing was posted (a lost peer, or the transport refused it).
        part.final = true;
        fail(r, fmt::format("post to prefill rank {} failed: {}", rank, e.what()));
      }
    }
  }

  void fail(Request& r, std::string why) {
    if (r.failed) return;
    r.failed = true;
    r.why = std::move(why);
  }

  bool all_final(const Request& r) const {
    return std::all_of(r.parts.begin(), r.parts.end(),
                       [](const auto& p) { return p.second.final || !p.second.transfer; });
  }
  // Every transfer final or abandoned: nothing more can make the request
  // succeed.
  bool all_settled(const Request& r) const {
    return std::all_of(r.parts.begin(), r.parts.end(), [](const auto& p) {
      return p.second.final || p.second.abandoned || !p.second.transfer;
    });
  }

  // Ends a request: frees its blocks (only called when every transfer is
  // final or abandoned; the blocks of abandoned ones are quarantined until
  // they are final), refuses the parts that were not confirmed, reports.
  void finish(std::map<std::uint64_t, Request>::iterator it) {
    Request& r = it->second;
    const bool ok = !r.failed && !r.aborted;
    std::vector<TransferId> in_flight;
    for (auto& [rank, part] : r.parts) {
      if (part.transfer && !part.final) in_flight.push_back(*part.transfer);
    }
    if (!ok) {
      for (auto& [rank, part] : r.parts) {
        if (!part.confirmed) tell(part.peer, r.request_id, DisaggKind::refused, part.lease);
      }
      if (in_flight.empty()) {
        cache.release_blocks(r.blocks);
      } else {
        counters.transfers_abandoned += in_flight.size();
        counters.blocks_quarantined += r.blocks.size();
        quarantined += r.blocks.size();
        r.why +=
            fmt::format("; its {} blocks are quarantined until the transfer ends", r.blocks.size());
        log::warn(fmt::format("DecodeNode: request {} failed: {}", r.request_id, r.why));
        quarantine.push_back({std::move(in_flight), r.blocks});
      }
    }
    for (auto& [rank, part] : r.parts) {
      if (part.transfer && part.final) agent.release(*part.transfer);
    }
    held -= r.blocks.size();
    if (!r.aborted) {
      DecodeResult res;
      res.request_id = r.request_id;
      res.group = r.group;
      res.ok = ok;
      res.why = r.why;
      res.tokens = std::move(r.tokens);
      res.extent = r.extent;
      res.bytes = r.bytes;
      if (r.first_post != Clock::time_point::max() && r.last_final > r.first_post) {
        res.transfer_seconds = std::chrono::duration<double>(r.last_final - r.first_post).count();
      }
      res.latency_seconds = std::chrono::duration<double>(Clock::now() - r.first_seen).count();
      if (ok) {
        res.blocks = std::move(r.blocks);
        ++counters.requests_completed;
      } else {
        ++counters.requests_failed;
      }
      results.push_back(std::move(res));
    }
    requests.erase(it);
  }

  void register_blocks(const Request& r) {
    if (!options.register_blocks || r.extent.state) return;
    const auto hashes = hash_full_blocks(r.tokens, cache.block_size());
    for (std::size_t i = 0; i < r.blocks.size(); ++i) {
      const std::size_t at = r.extent.first_block + i;
      if (at >= hashes.size()) break;
      if (cache.insert(hashes[at], r.blocks[i])) ++counters.blocks_registered;
    }
  }

  void step(std::map<std::uint64_t, Request>::iterator it, Clock::time_point now) {
    Request& r = it->second;
    if (r.phase == Phase::assembling) {
      if (r.aborted || r.failed) {  // nothing allocated, nothing in flight
        finish(it);
        return;
      }
      const bool complete = r.parts.size() == r.expected_ranks.size();
      if (complete) start_pull(r);
      if (r.phase == Phase::assembling && now - r.first_seen > options.assemble_timeout) {
        if (complete) ++counters.no_room;
        fail(r, complete ? "no room: not enough free blocks" : "lease parts missing");
        finish(it);
        return;
      }
      if (r.phase == Phase::assembling) return;
    }
    if (r.phase == Phase::pulling || r.phase == Phase::draining) {
      for (auto& [rank, part] : r.parts) {
        if (!part.transfer || part.final) continue;
        const TransferState st = agent.poll(*part.transfer);
        if (!is_final(st)) {
          // Given up on (deadline, lost peer, abort) while the transport may
          // still write the blocks: the request fails now, the blocks wait
          // in quarantine.
          // (An aborted request reports nothing: it keeps its blocks until
          // the transfer is final, as before.)
          if (part.abandoned || r.aborted) continue;
          const std::optional<TransferState> end = agent.abandoned(*part.transfer);
          if (!end) continue;
          part.abandoned = true;
          if (*end == TransferState::timed_out) ++counters.transfers_timed_out;
          std::string why = fmt::format("transfer from prefill rank {} abandoned ({}): {}", rank,
                                        to_string(*end), agent.why(*part.transfer));
          if (r.failed)
            r.why += "; " + why;  // the report says why the blocks are held
          else
            fail(r, std::move(why));
          continue;
        }
        part.final = true;
        const Agent::Times times = agent.times(*part.transfer);
        r.first_post = std::min(r.first_post, times.posted);
        r.last_final = std::max(r.last_final, times.finished);
        if (st == TransferState::done) {
          r.bytes += agent.bytes(*part.transfer);
        } else {
          if (st == TransferState::timed_out && !part.abandoned) ++counters.transfers_timed_out;
          fail(r, fmt::format("transfer from prefill rank {} {}: {}", rank, to_string(st),
                              agent.why(*part.transfer)));
        }
      }
      if (!all_settled(r)) return;
      if (r.failed || r.aborted || !all_final(r)) {
        finish(it);
        return;
      }
      counters.bytes_pulled += r.bytes;
      r.phase = Phase::confirming;
      r.pulled_at = now;
      for (auto& [rank, part] : r.parts)
        tell(part.peer, r.request_id, DisaggKind::pulled, part.lease);
      return;
    }
    if (r.phase == Phase::confirming) {
      if (r.failed || r.aborted) {
        finish(it);
        return;
      }
      const bool confirmed = std::all_of(r.parts.begin(), r.parts.end(),
                                         [](const auto& p) { return p.second.confirmed; });
      if (confirmed) {
        register_blocks(r);
        finish(it);
        return;
      }
      if (now - r.pulled_at > options.confirm_timeout) {
        fail(r, "no confirmation from the prefill side");
        finish(it);
      }
    }
  }

  void on_answer(const Notification& n) {
    std::optional<std::uint64_t> lease;
    try {
      lease = lease_id_of(n);
    } catch (const InvalidArgument&) {
      // malformed: counted as a notification not ours
    }
    auto it = requests.find(n.request_id);
    if (!lease || it == requests.end()) {
      ++counters.late_notifications;
      return;
    }
    Request& r = it->second;
    for (auto& [rank, part] : r.parts) {
      if (part.peer != n.peer || part.lease != *lease) continue;
      if (static_cast<DisaggKind>(n.kind) == DisaggKind::confirm) {
        if (r.phase == Phase::confirming)
          part.confirmed = true;
        else
          ++counters.late_notifications;
      } else {
        ++counters.revoked;
        part.confirmed = true;  // nothing more to tell this rank
        fail(r, fmt::format("prefill rank {} revoked the lease", rank));
      }
      return;
    }
    ++counters.late_notifications;
  }

  // Frees the quarantined blocks whose transfers are all final (each waits
  // up to `wait`).
  void release_quarantine(std::chrono::milliseconds wait) {
    std::size_t kept = 0;
    for (std::size_t i = 0; i < quarantine.size(); ++i) {
      Quarantine& q = quarantine[i];
      const bool ended = std::all_of(q.transfers.begin(), q.transfers.end(), [&](TransferId id) {
        return is_final(wait.count() > 0 ? agent.wait(id, wait) : agent.poll(id));
      });
      if (!ended) {
        if (kept != i) quarantine[kept] = std::move(q);
        ++kept;
        continue;
      }
      for (TransferId id : q.transfers)
        agent.release(id);
      cache.release_blocks(q.blocks);
      quarantined -= q.blocks.size();
    }
    quarantine.resize(kept);
  }

  // A prefill rank that has not confirmed is gone: the request fails in
  // whatever phase it is (a pull from it may even finish, but nobody can
  // confirm the lease any more). Its blocks are freed once no transfer is
  // in flight (step() waits for that).
  void on_lost(PeerId gone) {
    for (auto& [id, r] : requests) {
      for (auto& [rank, part] : r.parts) {
        if (part.peer == gone && !part.confirmed) {
          fail(r, fmt::format("prefill rank {} was lost", rank));
        }
      }
    }
  }
};

DecodeNode::DecodeNode(Agent& agent, PrefixCache& cache, DecodeOptions options)
    : state_(std::make_unique<State>(agent, cache, options)) {}

DecodeNode::~DecodeNode() {
  State& s = *state_;
  for (auto& [id, r] : s.requests)
    r.aborted = true;
  for (auto& [id, r] : s.requests) {
    for (auto& [rank, part] : r.parts) {
      if (part.transfer && !part.final) s.agent.cancel(*part.transfer);
    }
  }
  // Wait for in-flight transfers (the agent bounds them by its timeouts).
  for (auto& [id, r] : s.requests) {
    for (auto& [rank, part] : r.parts) {
      if (part.transfer && !part.final) {
        s.agent.wait(*part.transfer, std::chrono::seconds(60));
        part.final = is_final(s.agent.poll(*part.transfer));
      }
    }
  }
  while (!s.requests.empty()) {
    auto it = s.requests.begin();
    if (!s.all_final(it->second)) {
      // Still in flight after the wait: leak the blocks rather than free
      // memory a transfer may write.
      log::error(fmt::format(
          "DecodeNode: request {} still has a transfer in flight; its blocks are kept", it->first));
      s.requests.erase(it);
      continue;
    }
    try {
      s.finish(it);
    } catch (const std::exception& e) {
      log::error(fmt::format("DecodeNode: releasing request {} failed: {}", it->first, e.what()));
      s.requests.erase(it);
    }
  }
  try {
    s.release_quarantine(std::chrono::seconds(60));
  } catch (const std::exception& e) {
    log::error(fmt::format("DecodeNode: releasing the quarantine failed: {}", e.what()));
  }
  if (s.quarantined > 0) {
    log::error(fmt::format(
        "DecodeNode: {} quarantined blocks still have a transfer in flight; they are kept",
        s.quarantined));
  }
}

std::vector<DecodeResult> DecodeNode::poll() {
  State& s = *state_;
  for (const Notification& n : s.agent.take_notifications()) {
    switch (static_cast<DisaggKind>(n.kind)) {
      case DisaggKind::lease:
        s.on_lease(n);
        break;
      case DisaggKind::confirm:
      case DisaggKind::revoked:
        s.on_answer(n);
        break;
      default:
        ++s.counters.late_notifications;
        break;
    }
  }
  const auto take_lost = [&s] {
    for (PeerId lost : s.agent.take_lost_peers()) {
      ++s.counters.peers_lost;
      s.lost.push_back(lost);
      s.on_lost(lost);
    }
  };
  take_lost();
  const auto now = Clock::now();
  for (auto it = s.requests.begin(); it != s.requests.end();) {
    auto next = std::next(it);
    s.step(it, now);
    it = next;
  }
  // The agent's thread may have lost a peer while the requests were stepped,
  // failing a transfer one of them just read: the loss is counted in this
  // poll too, so that no request is reported failed by a loss not counted yet.
  take_lost();
  s.release_quarantine(std::chrono::milliseconds(0));
  return std::exchange(s.results, {});
}

bool DecodeNode::abort(std::uint64_t request_id) {
  State& s = *state_;
  auto it = s.requests.find(request_id);
  if (it == s.requests.end()) return false;
  State::Request& r = it->second;
  r.aborted = true;
  for (auto& [rank, part] : r.parts) {
    if (part.transfer && !part.final) s.agent.cancel(*part.transfer);
  }
  if (r.phase != State::Phase::assembling) r.phase = State::Phase::draining;
  s.step(it, std::chrono::steady_clock::now());
  return true;
}

const std::vector<PeerId>& DecodeNode::lost_peers() const noexcept {
  return state_->lost;
}
std::size_t DecodeNode::pending_requests() const noexcept {
  return state_->requests.size();
}
bool DecodeNode::tracks(std::uint64_t request_id) const noexcept {
  return state_->requests.contains(request_id);
}
std::vector<std::uint64_t> DecodeNode::pending_request_ids() const {
  std::vector<std::uint64_t> out;
  out.reserve(state_->requests.size());
  for (const auto& [id, r] : state_->requests)
    out.push_back(id);
  return out;
}
std::size_t DecodeNode::held_blocks() const noexcept {
  return state_->held;
}
std::size_t DecodeNode::quarantined_blocks() const noexcept {
  return state_->quarantined;
}
const DecodeCounters& DecodeNode::counters() const noexcept {
  return state_->counters;
}

}  // namespace kvport::transfer
