// SPDX-License-Identifier: Apache-2.0
// HybridPrefillNode and HybridDecodeNode: one PrefillNode / DecodeNode per
// KV cache group, one lease per request across the groups (all or nothing).
#include "kvport/transfer/hybrid_disagg.hpp"

#include <algorithm>
#include <optional>
#include <set>
#include <unordered_map>

#include <fmt/format.h>

#include "kvport/core/block_hash.hpp"
#include "kvport/platform/div_ceil.hpp"
#include "kvport/platform/error.hpp"
#include "kvport/platform/log.hpp"

namespace kvport::transfer {

namespace {

using Clock = std::chrono::steady_clock;

bool head_sliced(LayerKind kind) noexcept {
  return kind == LayerKind::full_attention || kind == LayerKind::sliding_window ||
         kind == LayerKind::chunked_local;
}

std::string group_name(const HybridKvCache& cache, std::size_t g) {
  return fmt::format("group {} ({})", g, to_string(cache.group(g).spec.kind));
}

void check_agents(const HybridKvCache& cache, std::span<Agent* const> agents,
                  std::string_view who) {
  if (agents.size() != cache.num_groups()) {
    throw InvalidArgument(
        fmt::format("{}: {} agents for {} groups", who, agents.size(), cache.num_groups()));
  }
  for (std::size_t g = 0; g < agents.size(); ++g) {
    if (agents[g] == nullptr) throw InvalidArgument(fmt::format("{}: agent {} is null", who, g));
  }
}

}  // namespace

bool replicated_group(const KvCacheGroup& group) noexcept {
  return group.spec.kind == LayerKind::mla || group.spec.kind == LayerKind::state;
}

std::uint32_t replica_rank(std::uint64_t request_id, std::uint32_t prefill_tp_size) {
  if (prefill_tp_size == 0) throw InvalidArgument("replica_rank: prefill_tp_size must be > 0");
  return static_cast<std::uint32_t>(request_id % prefill_tp_size);
}

LeaseExtent lease_extent(const KvCacheGroup& group, std::size_t block_size,
                         std::size_t num_tokens) {
  if (num_tokens == 0) throw InvalidArgument("lease_extent: no tokens");
  if (block_size == 0) throw InvalidArgument("lease_extent: block_size must be > 0");
  if (group.spec.has_state()) return LeaseExtent{0, true};
  const std::size_t total = div_ceil(num_tokens, block_size);
  const std::size_t at = (num_tokens / block_size) * block_size;
  // At least the last block moves (a lease is never empty).
  const std::size_t first =
      std::min(first_needed_block(hit_rule_of(group.spec), block_size, at), total - 1);
  if (first > UINT32_MAX) throw InvalidArgument("lease_extent: first block over 32 bits");
  return LeaseExtent{static_cast<std::uint32_t>(first), false};
}

std::vector<LayerSpec> rank_layer_specs(std::span<const LayerSpec> model_layers,
                                        std::uint32_t tp_size) {
  if (tp_size == 0) throw InvalidArgument("rank_layer_specs: tp_size must be > 0");
  std::vector<LayerSpec> out(model_layers.begin(), model_layers.end());
  for (std::size_t i = 0; i < out.size(); ++i) {
    if (!head_sliced(out[i].kind)) continue;
    if (out[i].num_kv_heads % tp_size != 0) {
      throw InvalidArgument(fmt::format("rank_layer_specs: layer {}: {} KV heads over {} ranks", i,
                                        out[i].num_kv_heads, tp_size));
    }
    out[i].num_kv_heads /= tp_size;
  }
  return out;
}

std::vector<AgentOptions> hybrid_agent_options(const HybridKvCache& cache, std::uint32_t tp_rank,
                                               std::uint32_t tp_size, const AgentOptions& base) {
  if (tp_size == 0 || tp_rank >= tp_size) {
    throw InvalidArgument(
        fmt::format("hybrid_agent_options: tp_rank {} of tp_size {}", tp_rank, tp_size));
  }
  std::vector<KvCacheGroup> model;
  for (std::size_t g = 0; g < cache.num_groups(); ++g) {
    KvCacheGroup grp = cache.group(g);
    if (head_sliced(grp.spec.kind)) grp.spec.num_kv_heads *= tp_size;
    model.push_back(std::move(grp));
  }
  const std::vector<LayoutGroup> groups = layout_groups(model, cache.block_size());
  std::vector<AgentOptions> out;
  for (std::size_t g = 0; g < cache.num_groups(); ++g) {
    AgentOptions o = base;
    o.name = fmt::format("{}.g{}", base.name, g);
    const bool replicated = replicated_group(cache.group(g));
    o.tp_rank = replicated ? 0 : tp_rank;
    o.tp_size = replicated ? 1 : tp_size;
    o.groups = groups;
    out.push_back(std::move(o));
  }
  return out;
}

PoolLayout group_content_layout(const HybridKvCache& cache, std::size_t g,
                                const AgentOptions& options) {
  return pool_layout(cache.group_cache(g), options.tp_rank, options.tp_size);
}

TokenId state_content_token(std::span<const TokenId> tokens) noexcept {
  std::uint64_t h = 0xcbf29ce484222325ull;  // FNV-1a over every token
  for (TokenId t : tokens) {
    for (int i = 0; i < 4; ++i) {
      h ^= (t >> (8 * i)) & 0xffu;
      h *= 0x100000001b3ull;
    }
  }
  return static_cast<TokenId>(h ^ (h >> 32));
}

namespace {

void check_state_slot(std::span<const BlockId> blocks, std::string_view who) {
  if (blocks.size() != 1) {
    throw InvalidArgument(
        fmt::format("{}: a state extent is one slot, not {}", who, blocks.size()));
  }
}

}  // namespace

void write_group_content(const HybridKvCache& cache, std::size_t g, const PoolLayout& layout,
                         std::span<const BlockId> blocks, std::span<const TokenId> tokens,
                         const LeaseExtent& extent, StreamView stream) {
  PagedKvCache& pool = cache.group_cache(g);
  if (extent.state) {
    check_state_slot(blocks, "write_group_content");
    const TokenId t = state_content_token(tokens);
    write_kv_content(pool, layout, blocks, std::span<const TokenId>(&t, 1), stream);
    return;
  }
  write_kv_content(pool, layout, blocks, tokens, stream, extent.first_block);
}

ContentCheck verify_group_content(const HybridKvCache& cache, std::size_t g,
                                  const PoolLayout& layout, std::span<const BlockId> blocks,
                                  std::span<const TokenId> tokens, const LeaseExtent& extent,
                                  StreamView stream) {
  PagedKvCache& pool = cache.group_cache(g);
  if (extent.state) {
    check_state_slot(blocks, "verify_group_content");
    const TokenId t = state_content_token(tokens);
    return verify_kv_content(pool, layout, blocks, std::span<const TokenId>(&t, 1), stream);
  }
  return verify_kv_content(pool, layout, blocks, tokens, stream, extent.first_block);
}

// ---- prefill ---------------------------------------------------------------------

struct HybridPrefillNode::State {
  struct Request {
    std::set<std::size_t> waiting;  // groups whose lease has not ended
    std::optional<LeaseEnd> end;    // the first end that was not `pulled`
  };

  HybridKvCache& cache;
  std::uint32_t tp_rank = 0;
  std::uint32_t tp_size = 1;
  std::vector<std::unique_ptr<PrefillNode>> nodes;
  std::unordered_map<std::uint64_t, Request> requests;
  std::vector<LeaseResult> ended;

  State(HybridKvCache& c, std::uint32_t r, std::uint32_t s) : cache(c), tp_rank(r), tp_size(s) {}
};

HybridPrefillNode::HybridPrefillNode(HybridKvCache& cache, std::span<Agent* const> agents,
                                     std::uint32_t tp_rank, std::uint32_t tp_size,
                                     PrefillOptions options) {
  check_agents(cache, agents, "HybridPrefillNode");
  if (tp_size == 0 || tp_rank >= tp_size) {
    throw InvalidArgument(
        fmt::format("HybridPrefillNode: tp_rank {} of tp_size {}", tp_rank, tp_size));
  }
  state_ = std::make_unique<State>(cache, tp_rank, tp_size);
  for (std::size_t g = 0; g < agents.size(); ++g) {
    state_->nodes.push_back(
        std::make_unique<PrefillNode>(*agents[g], cache.prefix_cache(g), options));
  }
}

HybridPrefillNode::~HybridPrefillNode() = default;

bool HybridPrefillNode::offers(std::uint64_t request_id, std::size_t g) const {
  const State& s = *state_;
  if (!replicated_group(s.cache.group(g))) return true;
  return replica_rank(request_id, s.tp_size) == s.tp_rank;
}

bool HybridPrefillNode::offer(std::uint64_t request_id, std::uint32_t tp_group,
                              std::span<const std::vector<BlockId>> blocks,
                              std::span<const TokenId> tokens,
                              std::span<const std::vector<PeerId>> decode_peers) {
  State& s = *state_;
  const std::size_t groups = s.nodes.size();
  if (blocks.size() != groups || decode_peers.size() != groups) {
    throw InvalidArgument(fmt::format("offer: {} block lists and {} peer lists for {} groups",
                                      blocks.size(), decode_peers.size(), groups));
  }
  if (s.requests.contains(request_id)) {
    throw InvalidArgument(fmt::format("offer: request {} already has a lease", request_id));
  }
  if (tokens.empty()) throw InvalidArgument("offer: no tokens");
  // The checks PrefillNode::offer makes that need no peer, for every group
  // first: most errors leave nothing offered.
  std::vector<LeaseExtent> extents(groups);
  for (std::size_t g = 0; g < groups; ++g) {
    if (!offers(request_id, g)) continue;
    extents[g] = lease_extent(s.cache.group(g), s.cache.block_size(), tokens.size());
    const std::size_t want =
        extents[g].state ? 1
                         : div_ceil(tokens.size(), s.cache.block_size()) - extents[g].first_block;
    if (blocks[g].size() != want) {
      throw InvalidArgument(fmt::format("offer: {}: {} blocks, the extent needs {}",
                                        group_name(s.cache, g), blocks[g].size(), want));
    }
    if (decode_peers[g].empty()) {
      throw InvalidArgument(fmt::format("offer: {}: no decode peers", group_name(s.cache, g)));
    }
  }
  std::vector<std::size_t> offered;
  for (std::size_t g = 0; g < groups; ++g) {
    if (!offers(request_id, g)) continue;
    try {
      s.nodes[g]->offer(request_id, tp_group, blocks[g], tokens, decode_peers[g], extents[g]);
    } catch (const InvalidArgument& e) {
      // Undo the groups offered: the caller keeps its references (one more
      // reference each, then the lease's is released by the abort).
      for (std::size_t done : offered) {
        for (BlockId b : blocks[done])
          s.cache.group_cache(done).inc_ref(b);
        s.nodes[done]->abort(request_id);
      }
      throw InvalidArgument(fmt::format("offer: {}: {}", group_name(s.cache, g), e.what()));
    }
    offered.push_back(g);
  }
  for (std::size_t g = 0; g < groups; ++g) {
    if (!offers(request_id, g) && !blocks[g].empty())
      s.cache.prefix_cache(g).release_blocks(blocks[g]);
  }
  if (offered.empty()) return false;
  State::Request& r = s.requests[request_id];
  r.waiting.insert(offered.begin(), offered.end());
  return true;
}

std::vector<LeaseResult> HybridPrefillNode::poll() {
  State& s = *state_;
  for (std::size_t g = 0; g < s.nodes.size(); ++g) {
    for (const LeaseResult& lr : s.nodes[g]->poll()) {
      auto it = s.requests.find(lr.request_id);
      if (it == s.requests.end() || !it->second.waiting.contains(g)) continue;
      State::Request& r = it->second;
      r.waiting.erase(g);
      if (lr.end != LeaseEnd::pulled && !r.end) {
        r.end = lr.end;
        // All or nothing: the other groups' leases are void now.
        for (std::size_t other : r.waiting)
          s.nodes[other]->abort(lr.request_id);
        r.waiting.clear();
      }
      if (r.waiting.empty()) {
        s.ended.push_back({lr.request_id, r.end.value_or(LeaseEnd::pulled)});
        s.requests.erase(it);
      }
    }
  }
  return std::exchange(s.ended, {});
}

bool HybridPrefillNode::abort(std::uint64_t request_id) {
  State& s = *state_;
  auto it = s.requests.find(request_id);
  if (it == s.requests.end()) return false;
  for (std::size_t g : it->second.waiting)
    s.nodes[g]->abort(request_id);
  s.requests.erase(it);
  return true;
}

std::size_t HybridPrefillNode::num_groups() const noexcept {
  return state_->nodes.size();
}
std::size_t HybridPrefillNode::active_leases() const noexcept {
  return state_->requests.size();
}
std::size_t HybridPrefillNode::held_blocks(std::size_t g) const {
  return group_node(g).held_blocks();
}
const PrefillNode& HybridPrefillNode::group_node(std::size_t g) const {
  if (g >= state_->nodes.size()) {
    throw InvalidArgument(fmt::format("group_node: group {} of {}", g, state_->nodes.size()));
  }
  return *state_->nodes[g];
}

// ---- decode ----------------------------------------------------------------------

struct HybridDecodeNode::State {
  struct Pending {
    std::vector<std::optional<DecodeResult>> results;  // per group
    Clock::time_point first;                           // the first group result
  };

  HybridKvCache& cache;
  DecodeOptions options;
  std::vector<std::unique_ptr<DecodeNode>> nodes;
  std::map<std::uint64_t, Pending> pending;
  // Requests that failed or were aborted: later group results are freed and
  // later lease parts refused, until the time kept.
  std::map<std::uint64_t, Clock::time_point> dead;
  HybridDecodeCounters counters;
  std::vector<HybridDecodeResult> results;

  State(HybridKvCache& c, DecodeOptions o) : cache(c), options(o) {}

  Clock::duration dead_for() const {
    return 2 * (options.assemble_timeout + options.confirm_timeout);
  }

  void release(std::size_t g, DecodeResult& r) {
    if (r.ok && !r.blocks.empty()) cache.prefix_cache(g).release_blocks(r.blocks);
    r.blocks.clear();
  }

  // Ends `id` in every group: frees what was collected, drops the rest.
  void kill(std::uint64_t id, Clock::time_point now) {
    auto it = pending.find(id);
    if (it != pending.end()) {
      for (std::size_t g = 0; g < it->second.results.size(); ++g) {
        if (it->second.results[g]) release(g, *it->second.results[g]);
      }
      pending.erase(it);
    }
    for (auto& node : nodes)
      node->abort(id);
    dead[id] = now + dead_for();
  }

  void fail(std::uint64_t id, std::string why, Clock::time_point now) {
    HybridDecodeResult res;
    res.request_id = id;
    res.ok = false;
    res.why = std::move(why);
    auto it = pending.find(id);
    if (it != pending.end()) {
      for (auto& r : it->second.results) {
        if (!r) continue;
        res.tp_group = r->group;
        if (res.tokens.empty()) res.tokens = r->tokens;
        res.latency_seconds = std::max(res.latency_seconds, r->latency_seconds);
      }
    }
    kill(id, now);
    ++counters.requests_failed;
    results.push_back(std::move(res));
  }

  void complete(std::map<std::uint64_t, Pending>::iterator it) {
    Pending& p = it->second;
    HybridDecodeResult res;
    res.request_id = it->first;
    res.ok = true;
    res.tp_group = p.results[0]->group;
    res.tokens = p.results[0]->tokens;
    const std::size_t bs = cache.block_size();
    const std::vector<BlockHash> hashes = hash_full_blocks(res.tokens, bs);
    const std::size_t n = res.tokens.size();
    for (std::size_t g = 0; g < p.results.size(); ++g) {
      DecodeResult& r = *p.results[g];
      HybridGroupResult out;
      out.extent = r.extent;
      out.bytes = r.bytes;
      PrefixCache& prefix = cache.prefix_cache(g);
      if (r.extent.state) {
        // A checkpoint: the state after whole blocks only.
        if (n % bs == 0 && r.blocks.size() == 1 && prefix.insert(hashes[n / bs - 1], r.blocks[0]))
          ++out.registered;
      } else {
        for (std::size_t i = 0; i < r.blocks.size(); ++i) {
          const std::size_t at = r.extent.first_block + i;
          if (at >= hashes.size()) break;
          if (prefix.insert(hashes[at], r.blocks[i])) ++out.registered;
        }
      }
      counters.blocks_registered += out.registered;
      out.blocks = std::move(r.blocks);
      res.bytes += out.bytes;
      res.latency_seconds = std::max(res.latency_seconds, r.latency_seconds);
      res.transfer_seconds = std::max(res.transfer_seconds, r.transfer_seconds);
      res.groups.push_back(std::move(out));
    }
    ++counters.requests_completed;
    results.push_back(std::move(res));
    pending.erase(it);
  }
};

HybridDecodeNode::HybridDecodeNode(HybridKvCache& cache, std::span<Agent* const> agents,
                                   DecodeOptions options) {
  check_agents(cache, agents, "HybridDecodeNode");
  options.register_blocks = false;
  state_ = std::make_unique<State>(cache, options);
  for (std::size_t g = 0; g < agents.size(); ++g) {
    state_->nodes.push_back(
        std::make_unique<DecodeNode>(*agents[g], cache.prefix_cache(g), options));
  }
}

HybridDecodeNode::~HybridDecodeNode() {
  State& s = *state_;
  for (auto& [id, p] : s.pending) {
    for (std::size_t g = 0; g < p.results.size(); ++g) {
      if (!p.results[g]) continue;
      try {
        s.release(g, *p.results[g]);
      } catch (const std::exception& e) {
        log::error(fmt::format("HybridDecodeNode: releasing request {} failed: {}", id, e.what()));
      }
    }
  }
  s.pending.clear();
  // The group nodes (in state_) wait for their transfers and free the rest.
}

std::vector<HybridDecodeResult> HybridDecodeNode::poll() {
  State& s = *state_;
  const auto now = Clock::now();
  for (auto it = s.dead.begin(); it != s.dead.end();) {
    if (now >= it->second) {
      it = s.dead.erase(it);
      continue;
    }
    for (auto& node : s.nodes)
      node->abort(it->first);  // a lease part that came late: refused
    ++it;
  }
  for (std::size_t g = 0; g < s.nodes.size(); ++g) {
    for (DecodeResult& r : s.nodes[g]->poll()) {
      const std::uint64_t id = r.request_id;
      if (s.dead.contains(id)) {
        ++s.counters.late_results;
        s.release(g, r);
        continue;
      }
      auto [it, fresh] = s.pending.try_emplace(id);
      if (fresh) {
        it->second.results.resize(s.nodes.size());
        it->second.first = now;
      }
      const bool ok = r.ok;
      std::string why = ok ? std::string() : fmt::format("{}: {}", group_name(s.cache, g), r.why);
      it->second.results[g] = std::move(r);
      if (!ok) s.fail(id, std::move(why), now);
    }
  }
  for (auto it = s.pending.begin(); it != s.pending.end();) {
    auto next = std::next(it);
    const auto& results = it->second.results;
    const bool all =
        std::all_of(results.begin(), results.end(), [](const auto& r) { return r.has_value(); });
    if (all) {
      s.complete(it);
    } else if (now - it->second.first > s.options.assemble_timeout) {
      for (std::size_t g = 0; g < results.size(); ++g) {
        if (!results[g] && !s.nodes[g]->tracks(it->first)) {
          s.fail(it->first, fmt::format("{}: no lease part", group_name(s.cache, g)), now);
          break;
        }
      }
    }
    it = next;
  }
  return std::exchange(s.results, {});
}

bool HybridDecodeNode::abort(std::uint64_t request_id) {
  State& s = *state_;
  bool known = s.pending.contains(request_id);
  for (auto& node : s.nodes)
    known = node->tracks(request_id) || known;
  if (!known) return false;
  s.kill(request_id, Clock::now());
  return true;
}

std::size_t HybridDecodeNode::num_groups() const noexcept {
  return state_->nodes.size();
}

std::size_t HybridDecodeNode::pending_requests() const {
  std::set<std::uint64_t> ids;
  for (const auto& [id, p] : state_->pending)
    ids.insert(id);
  for (const auto& node : state_->nodes) {
    for (std::uint64_t id : node->pending_request_ids())
      ids.insert(id);
  }
  return ids.size();
}

std::size_t HybridDecodeNode::held_blocks(std::size_t g) const {
  std::size_t n = group_node(g).held_blocks();
  for (const auto& [id, p] : state_->pending) {
    if (p.results[g]) n += p.results[g]->blocks.size();
  }
  return n;
}

const DecodeNode& HybridDecodeNode::group_node(std::size_t g) const {
  if (g >= state_->nodes.size()) {
    throw InvalidArgument(fmt::format("group_node: group {} of {}", g, state_->nodes.size()));
  }
  return *state_->nodes[g];
}

const HybridDecodeCounters& HybridDecodeNode::counters() const noexcept {
  return state_->counters;
}

}  // namespace kvport::transfer
