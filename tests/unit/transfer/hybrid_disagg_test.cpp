// SPDX-License-Identifier: Apache-2.0
// The disaggregation protocol for hybrid models in one process: one agent per
// KV cache group, one lease per request across the groups. Every group's
// bytes are verified on the decode side, replicated groups (MLA, state) come
// from one prefill rank, window groups move only the blocks in the window,
// the pulled blocks hit a later HybridBlockTable lookup, and a failure in one
// group leaves nothing registered and nothing leaked in any group.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "agent_pair.hpp"
#include "kvport/core/hybrid_block_table.hpp"
#include "kvport/core/hybrid_kv_cache.hpp"
#include "kvport/platform/div_ceil.hpp"
#include "kvport/transfer/hybrid_disagg.hpp"

namespace kvport::transfer {
namespace {

using ::testing::HasSubstr;

constexpr std::size_t kBs = 16;

std::vector<LayerSpec> gpt_oss_like() {  // sliding window + full attention
  std::vector<LayerSpec> l;
  for (int i = 0; i < 2; ++i) {
    l.push_back(LayerSpec::sliding_window(32, 4, 64, 64));
    l.push_back(LayerSpec::full_attention(4, 64, 64));
  }
  return l;
}

std::vector<LayerSpec> mamba_hybrid() {  // state + full attention
  const LayerSpec state = LayerSpec::recurrent_state(
      {StateTensor{"conv", {8, 3}, StateDtype::f32}, StateTensor{"ssm", {4, 16}, StateDtype::f32}});
  return {state, LayerSpec::full_attention(4, 64, 64), state, LayerSpec::no_kv()};
}

std::vector<LayerSpec> mla_model() {
  return {LayerSpec::mla(64, 16), LayerSpec::mla(64, 16)};
}

// One rank: a hybrid cache of this rank's heads and one agent per group.
struct Rank {
  std::unique_ptr<Backend> backend = make_host_backend(HostBackendOptions{64u << 20});
  std::unique_ptr<HybridKvCache> cache;
  Stream stream;
  std::vector<AgentOptions> options;
  std::vector<std::unique_ptr<Agent>> agents;
  std::vector<Agent*> ptrs;
  std::vector<std::string> addresses;

  Rank(const std::vector<LayerSpec>& model, std::uint32_t rank, std::uint32_t size,
       std::string name, std::vector<std::size_t> blocks = {})
      : stream(backend->create_stream()) {
    HybridKvCacheConfig c;
    c.layers = rank_layer_specs(model, size);
    c.block_size = kBs;
    const std::size_t groups = group_layers(c.layers, kBs).size();
    if (blocks.empty()) blocks.assign(groups, 16);
    cache = std::make_unique<HybridKvCache>(c, blocks, *backend);
    AgentOptions base;
    base.name = std::move(name);
    base.peer_timeout = 1000ms;
    options = hybrid_agent_options(*cache, rank, size, base);
    for (const AgentOptions& o : options) {
      agents.push_back(std::make_unique<Agent>(cache->group_cache(agents.size()), o));
      ptrs.push_back(agents.back().get());
    }
  }
  std::size_t groups() const { return agents.size(); }
  PoolLayout layout(std::size_t g) const { return group_content_layout(*cache, g, options[g]); }
  void listen() {
    for (auto& a : agents)
      addresses.push_back(a->listen("127.0.0.1:0"));
  }
  // Allocates and fills every group's blocks of the lease for `t`.
  std::vector<std::vector<BlockId>> prefill(const std::vector<TokenId>& t) {
    std::vector<std::vector<BlockId>> out(groups());
    for (std::size_t g = 0; g < groups(); ++g) {
      const LeaseExtent e = lease_extent(cache->group(g), kBs, t.size());
      const std::size_t n = e.state ? 1 : div_ceil(t.size(), kBs) - e.first_block;
      for (std::size_t i = 0; i < n; ++i)
        out[g].push_back(cache->prefix_cache(g).alloc_block());
      write_group_content(*cache, g, layout(g), out[g], t, e, stream);
      agents[g]->publish(out[g]);
    }
    return out;
  }
  bool clean() const {
    bool ok = cache->check_invariants().ok;
    for (std::size_t g = 0; g < groups(); ++g)
      ok = ok && cache->blocks_in_use(g) == 0;
    return ok;
  }
};

// P prefill ranks, D decode ranks, every group of every prefill rank
// connected to the same group of every decode rank.
struct Cluster {
  std::vector<std::unique_ptr<Rank>> prefill, decode;
  // peers[p][g]: prefill rank p's ids of every decode rank's group-g agent.
  std::vector<std::vector<std::vector<PeerId>>> peers;

  Cluster(const std::vector<LayerSpec>& model, std::uint32_t p, std::uint32_t d,
          std::vector<std::size_t> decode_blocks = {}) {
    for (std::uint32_t r = 0; r < p; ++r)
      prefill.push_back(std::make_unique<Rank>(model, r, p, "prefill" + std::to_string(r)));
    for (std::uint32_t r = 0; r < d; ++r) {
      decode.push_back(
          std::make_unique<Rank>(model, r, d, "decode" + std::to_string(r), decode_blocks));
      decode.back()->listen();
    }
    peers.resize(p);
    for (std::uint32_t pr = 0; pr < p; ++pr) {
      peers[pr].resize(prefill[pr]->groups());
      for (std::size_t g = 0; g < prefill[pr]->groups(); ++g) {
        for (auto& dr : decode)
          peers[pr][g].push_back(prefill[pr]->agents[g]->connect(dr->addresses[g], 5s));
      }
    }
    for (auto& dr : decode) {
      for (auto& a : dr->agents) {
        eventually([&] { return a->peers().size() == p; });
      }
    }
  }
};

struct Outcome {
  std::vector<std::vector<HybridDecodeResult>> decoded;  // per decode rank
  std::vector<std::vector<LeaseResult>> leased;          // per prefill rank
};

Outcome drive(std::vector<std::unique_ptr<HybridPrefillNode>>& pn,
              std::vector<std::unique_ptr<HybridDecodeNode>>& dn,
              const std::vector<std::size_t>& expect_leases,
              std::chrono::milliseconds limit = 5000ms) {
  Outcome o;
  o.decoded.resize(dn.size());
  o.leased.resize(pn.size());
  eventually(
      [&] {
        bool done = true;
        for (std::size_t i = 0; i < dn.size(); ++i) {
          for (auto& r : dn[i]->poll())
            o.decoded[i].push_back(std::move(r));
          done = done && !o.decoded[i].empty();
        }
        for (std::size_t i = 0; i < pn.size(); ++i) {
          for (auto& l : pn[i]->poll())
            o.leased[i].push_back(l);
          done = done && o.leased[i].size() == expect_leases[i];
        }
        return done;
      },
      limit);
  return o;
}

void run_pull(const std::vector<LayerSpec>& model, std::uint32_t p, std::uint32_t d,
              std::size_t num_tokens, std::uint64_t request) {
  SCOPED_TRACE("TP " + std::to_string(p) + " -> " + std::to_string(d) + ", " +
               std::to_string(num_tokens) + " tokens");
  Cluster c(model, p, d);
  const std::size_t groups = c.prefill[0]->groups();
  const auto t = tokens(num_tokens, 5);
  std::vector<std::unique_ptr<HybridPrefillNode>> pn;
  std::vector<std::unique_ptr<HybridDecodeNode>> dn;
  std::vector<std::size_t> expect(p, 0);
  for (std::uint32_t r = 0; r < p; ++r)
    pn.push_back(
        std::make_unique<HybridPrefillNode>(*c.prefill[r]->cache, c.prefill[r]->ptrs, r, p));
  for (std::uint32_t r = 0; r < d; ++r)
    dn.push_back(std::make_unique<HybridDecodeNode>(*c.decode[r]->cache, c.decode[r]->ptrs));
  for (std::uint32_t r = 0; r < p; ++r) {
    auto blocks = c.prefill[r]->prefill(t);
    if (pn[r]->offer(request, 0, blocks, t, c.peers[r])) expect[r] = 1;
  }
  Outcome o = drive(pn, dn, expect);
  for (std::uint32_t r = 0; r < p; ++r) {
    ASSERT_EQ(o.leased[r].size(), expect[r]);
    if (expect[r]) {
      EXPECT_EQ(o.leased[r][0].end, LeaseEnd::pulled);
    }
    for (std::size_t g = 0; g < groups; ++g) {
      const bool replicated = replicated_group(c.prefill[r]->cache->group(g));
      // A replicated group is offered by the request's replica rank only.
      EXPECT_EQ(pn[r]->group_node(g).counters().leases_offered,
                !replicated || replica_rank(request, p) == r ? 1u : 0u)
          << "rank " << r << " group " << g;
      EXPECT_EQ(pn[r]->held_blocks(g), 0u);
    }
  }
  for (std::uint32_t r = 0; r < d; ++r) {
    Rank& dr = *c.decode[r];
    ASSERT_EQ(o.decoded[r].size(), 1u);
    HybridDecodeResult& res = o.decoded[r][0];
    ASSERT_TRUE(res.ok) << res.why;
    EXPECT_EQ(res.request_id, request);
    EXPECT_EQ(res.tokens, t);
    ASSERT_EQ(res.groups.size(), groups);
    std::uint64_t bytes = 0;
    for (std::size_t g = 0; g < groups; ++g) {
      SCOPED_TRACE("decode rank " + std::to_string(r) + " group " + std::to_string(g));
      const KvCacheGroup& grp = dr.cache->group(g);
      const HybridGroupResult& gr = res.groups[g];
      EXPECT_EQ(gr.extent, lease_extent(grp, kBs, t.size()));
      const ContentCheck check =
          verify_group_content(*dr.cache, g, dr.layout(g), gr.blocks, t, gr.extent, dr.stream);
      EXPECT_TRUE(check.ok()) << check.bytes_wrong << " of " << check.bytes_checked << " wrong";
      EXPECT_GT(gr.bytes, 0u);
      bytes += gr.bytes;
      const DecodeCounters& dc = dn[r]->group_node(g).counters();
      if (replicated_group(grp)) {
        EXPECT_EQ(dc.lease_parts, 1u);  // from one prefill rank only
        EXPECT_EQ(dc.transfers, 1u);
      } else {
        // Every prefill rank whose heads overlap ours.
        EXPECT_EQ(dc.transfers, p > d ? p / d : 1u);
      }
      if (grp.spec.has_state()) {
        EXPECT_EQ(gr.blocks.size(), 1u);
        EXPECT_EQ(gr.registered, t.size() % kBs == 0 ? 1u : 0u);
      } else {
        EXPECT_EQ(gr.blocks.size(), div_ceil(t.size(), kBs) - gr.extent.first_block);
        EXPECT_EQ(gr.registered, t.size() / kBs - gr.extent.first_block);
      }
      EXPECT_EQ(dn[r]->held_blocks(g), 0u);
    }
    EXPECT_EQ(res.bytes, bytes);
    // Decoding goes on from the pulled KV: a table adopts the blocks.
    std::vector<std::vector<BlockId>> pulled;
    std::vector<std::size_t> firsts;
    for (std::size_t g = 0; g < groups; ++g) {
      pulled.push_back(res.groups[g].blocks);
      firsts.push_back(res.groups[g].extent.first_block);
    }
    HybridBlockTable adopted = HybridBlockTable::adopt(*dr.cache, t, pulled, firsts, dr.stream);
    EXPECT_EQ(adopted.num_tokens(), t.size());
    for (std::size_t g = 0; g < groups; ++g) {
      if (dr.cache->group(g).spec.has_state()) {
        ASSERT_TRUE(adopted.state_slot(g).has_value());
        // A cached checkpoint is copied into a working slot.
        EXPECT_EQ(*adopted.state_slot(g) != pulled[g][0], res.groups[g].registered == 1);
        dr.cache->synchronize();
        const std::vector<BlockId> slot{*adopted.state_slot(g)};
        EXPECT_TRUE(verify_group_content(*dr.cache, g, dr.layout(g), slot, t, LeaseExtent{0, true},
                                         dr.stream)
                        .ok());
      } else {
        EXPECT_EQ(adopted.num_live_blocks(g), pulled[g].size());
        EXPECT_EQ(adopted.blocks(g).size(), div_ceil(t.size(), kBs));
      }
    }
    adopted.append_tokens(tokens(kBs + 3, 9), dr.stream);
    EXPECT_EQ(adopted.num_tokens(), t.size() + kBs + 3);
    EXPECT_TRUE(dr.cache->check_invariants().ok);
    adopted.release();
    // What was pulled is a prefix hit for every group.
    HybridBlockTable table(*dr.cache);
    table.set_prefix_hit_mode(PrefixHitMode::full);
    // A state group hits at a block boundary only, where its state was cached.
    bool has_state = false;
    for (std::size_t g = 0; g < groups; ++g)
      has_state = has_state || dr.cache->group(g).spec.has_state();
    const std::size_t hit = has_state && t.size() % kBs != 0 ? 0 : (t.size() / kBs) * kBs;
    EXPECT_EQ(table.reuse_cached_prefix(t, dr.stream), hit);
    table.release();
    EXPECT_TRUE(dr.clean());
  }
  for (auto& pr : c.prefill)
    EXPECT_TRUE(pr->clean());
}

TEST(HybridDisagg, WindowAndFullGroupsAcrossTp) {
  run_pull(gpt_oss_like(), 1, 1, 6 * kBs, 7);
  run_pull(gpt_oss_like(), 2, 1, 6 * kBs, 8);
  run_pull(gpt_oss_like(), 1, 2, 6 * kBs + 5, 9);
}

TEST(HybridDisagg, WindowGroupMovesOnlyTheWindow) {
  const auto groups = group_layers(gpt_oss_like(), kBs);
  ASSERT_EQ(groups[0].spec.kind, LayerKind::sliding_window);
  // W = 32, 96 tokens: the next token (96) needs tokens 65.., blocks 4 and 5.
  EXPECT_EQ(lease_extent(groups[0], kBs, 96), (LeaseExtent{4, false}));
  // 101 tokens: the window at the last boundary (96) is used.
  EXPECT_EQ(lease_extent(groups[0], kBs, 101), (LeaseExtent{4, false}));
  EXPECT_EQ(lease_extent(groups[0], kBs, 10), (LeaseExtent{0, false}));
  EXPECT_EQ(lease_extent(groups[1], kBs, 96), (LeaseExtent{0, false}));
  // Chunked: the chunk of the last boundary; never an empty lease.
  KvCacheGroup chunked{LayerSpec::chunked_local(32, 4, 64, 64), {0}, {KvCacheDtype::bf16}};
  EXPECT_EQ(lease_extent(chunked, kBs, 80), (LeaseExtent{4, false}));
  EXPECT_EQ(lease_extent(chunked, kBs, 64), (LeaseExtent{3, false}));
  EXPECT_THROW(lease_extent(groups[0], kBs, 0), InvalidArgument);
}

TEST(HybridDisagg, MambaStateFromOneRank) {
  run_pull(mamba_hybrid(), 1, 1, 4 * kBs, 3);
  run_pull(mamba_hybrid(), 2, 1, 4 * kBs, 3);  // replica rank 1
  run_pull(mamba_hybrid(), 1, 2, 4 * kBs + 3, 4);
}

TEST(HybridDisagg, MlaLatentsFromOneRank) {
  run_pull(mla_model(), 1, 1, 3 * kBs, 1);
  run_pull(mla_model(), 2, 1, 3 * kBs, 2);
  run_pull(mla_model(), 1, 2, 3 * kBs, 5);
}

TEST(HybridDisagg, RankWithNothingToOfferReportsNothing) {
  // MLA only, TP 2: rank 1 is not request 4's replica rank.
  Cluster c(mla_model(), 2, 1);
  HybridPrefillNode rank1(*c.prefill[1]->cache, c.prefill[1]->ptrs, 1, 2);
  EXPECT_FALSE(rank1.offers(4, 0));
  const auto t = tokens(2 * kBs);
  auto blocks = c.prefill[1]->prefill(t);
  EXPECT_FALSE(rank1.offer(4, 0, blocks, t, c.peers[1]));
  EXPECT_EQ(rank1.active_leases(), 0u);
  EXPECT_TRUE(rank1.poll().empty());
  EXPECT_TRUE(c.prefill[1]->clean());  // released at once
}

// The state group has no room on the decode side: the full-attention group's
// pull completes, but the request fails and nothing stays anywhere.
TEST(HybridDisagg, OneGroupWithoutRoomFailsTheWholeRequest) {
  // group 0: state (1 slot), group 1: full attention.
  Cluster c(mamba_hybrid(), 1, 1, {1, 16});
  Rank& dr = *c.decode[0];
  const BlockId hog = dr.cache->prefix_cache(0).alloc_block();
  DecodeOptions dopt;
  dopt.assemble_timeout = 200ms;
  std::vector<std::unique_ptr<HybridPrefillNode>> pn;
  std::vector<std::unique_ptr<HybridDecodeNode>> dn;
  pn.push_back(std::make_unique<HybridPrefillNode>(*c.prefill[0]->cache, c.prefill[0]->ptrs, 0, 1));
  dn.push_back(std::make_unique<HybridDecodeNode>(*dr.cache, dr.ptrs, dopt));
  const auto t = tokens(3 * kBs);
  ASSERT_TRUE(pn[0]->offer(11, 0, c.prefill[0]->prefill(t), t, c.peers[0]));
  Outcome o = drive(pn, dn, {1});
  ASSERT_EQ(o.decoded[0].size(), 1u);
  EXPECT_FALSE(o.decoded[0][0].ok);
  EXPECT_THAT(o.decoded[0][0].why, HasSubstr("group 0 (mamba)"));
  EXPECT_THAT(o.decoded[0][0].why, HasSubstr("no room"));
  EXPECT_TRUE(o.decoded[0][0].groups.empty());
  ASSERT_EQ(o.leased[0].size(), 1u);
  EXPECT_EQ(o.leased[0][0].end, LeaseEnd::refused);
  EXPECT_EQ(dn[0]->counters().requests_failed, 1u);
  EXPECT_EQ(dn[0]->counters().blocks_registered, 0u);
  // The attention group's blocks came and went: nothing cached, nothing held.
  EXPECT_EQ(dn[0]->group_node(1).counters().transfers, 1u);
  for (std::size_t g = 0; g < dr.groups(); ++g) {
    EXPECT_EQ(dr.cache->prefix_cache(g).num_cached_blocks(), 0u) << g;
    EXPECT_EQ(dn[0]->held_blocks(g), 0u);
  }
  EXPECT_EQ(dn[0]->pending_requests(), 0u);
  dr.cache->prefix_cache(0).release(hog);
  EXPECT_TRUE(dr.clean());
  EXPECT_TRUE(eventually([&] {
    pn[0]->poll();
    return pn[0]->held_blocks(0) == 0 && pn[0]->held_blocks(1) == 0;
  }));
  EXPECT_TRUE(c.prefill[0]->clean());
}

TEST(HybridDisagg, PrefillAbortFailsEveryGroup) {
  Cluster c(gpt_oss_like(), 1, 1);
  std::vector<std::unique_ptr<HybridPrefillNode>> pn;
  std::vector<std::unique_ptr<HybridDecodeNode>> dn;
  pn.push_back(std::make_unique<HybridPrefillNode>(*c.prefill[0]->cache, c.prefill[0]->ptrs, 0, 1));
  dn.push_back(std::make_unique<HybridDecodeNode>(*c.decode[0]->cache, c.decode[0]->ptrs));
  const auto t = tokens(5 * kBs);
  ASSERT_TRUE(pn[0]->offer(21, 0, c.prefill[0]->prefill(t), t, c.peers[0]));
  EXPECT_TRUE(pn[0]->abort(21));
  EXPECT_FALSE(pn[0]->abort(21));
  EXPECT_TRUE(c.prefill[0]->clean());  // released at once
  Outcome o = drive(pn, dn, {0});
  ASSERT_EQ(o.decoded[0].size(), 1u);
  EXPECT_FALSE(o.decoded[0][0].ok);
  EXPECT_THAT(o.decoded[0][0].why, HasSubstr("revoked"));
  for (std::size_t g = 0; g < 2; ++g)
    EXPECT_EQ(c.decode[0]->cache->prefix_cache(g).num_cached_blocks(), 0u);
  EXPECT_TRUE(eventually([&] {
    dn[0]->poll();
    return dn[0]->pending_requests() == 0;
  }));
  EXPECT_TRUE(c.decode[0]->clean());
}

TEST(HybridDisagg, DecodeAbortRefusesEveryGroup) {
  Cluster c(mamba_hybrid(), 1, 1);
  HybridPrefillNode pn(*c.prefill[0]->cache, c.prefill[0]->ptrs, 0, 1);
  // The decode side has no room until the abort: no group can pull first
  // (on a loaded machine both pulls could otherwise finish, and be
  // confirmed, before the abort).
  DecodeOptions dopt;
  dopt.assemble_timeout = std::chrono::minutes(5);
  HybridDecodeNode dn(*c.decode[0]->cache, c.decode[0]->ptrs, dopt);
  std::vector<std::vector<BlockId>> held(c.decode[0]->groups());
  for (std::size_t g = 0; g < held.size(); ++g) {
    while (const std::optional<BlockId> b = c.decode[0]->cache->prefix_cache(g).try_alloc_block())
      held[g].push_back(*b);
  }
  const auto t = tokens(2 * kBs);
  ASSERT_TRUE(pn.offer(31, 0, c.prefill[0]->prefill(t), t, c.peers[0]));
  ASSERT_TRUE(eventually([&] {
    dn.poll();
    return dn.pending_requests() == 1;
  }));
  EXPECT_TRUE(dn.abort(31));
  EXPECT_FALSE(dn.abort(99));
  std::vector<LeaseResult> leases;
  ASSERT_TRUE(eventually([&] {
    EXPECT_TRUE(dn.poll().empty());  // no result for an aborted request
    for (auto& l : pn.poll())
      leases.push_back(l);
    return !leases.empty() && dn.pending_requests() == 0;
  }));
  EXPECT_EQ(leases[0].end, LeaseEnd::refused);
  for (std::size_t g = 0; g < held.size(); ++g)
    c.decode[0]->cache->prefix_cache(g).release_blocks(held[g]);
  EXPECT_TRUE(c.decode[0]->clean());
  for (std::size_t g = 0; g < 2; ++g)
    EXPECT_EQ(c.decode[0]->cache->prefix_cache(g).num_cached_blocks(), 0u);
  EXPECT_TRUE(c.prefill[0]->clean());
}

// Only one group's lease ever arrives (a prefill side that offered group 0
// alone): the decode side gives up after assemble_timeout and frees it.
TEST(HybridDisagg, MissingGroupLeaseFailsAfterTimeout) {
  Cluster c(gpt_oss_like(), 1, 1);
  Rank& pr = *c.prefill[0];
  PrefillNode full_only(*pr.agents[1], pr.cache->prefix_cache(1));  // full attention alone
  DecodeOptions dopt;
  dopt.assemble_timeout = 200ms;
  HybridDecodeNode dn(*c.decode[0]->cache, c.decode[0]->ptrs, dopt);
  const auto t = tokens(3 * kBs);
  auto blocks = pr.prefill(t);
  pr.cache->prefix_cache(0).release_blocks(blocks[0]);
  full_only.offer(41, 0, blocks[1], t, c.peers[0][1]);
  std::vector<HybridDecodeResult> results;
  ASSERT_TRUE(eventually([&] {
    for (auto& r : dn.poll())
      results.push_back(std::move(r));
    full_only.poll();
    return !results.empty();
  }));
  EXPECT_FALSE(results[0].ok);
  EXPECT_THAT(results[0].why, HasSubstr("group 0 (sliding_window): no lease part"));
  EXPECT_TRUE(c.decode[0]->clean());
  EXPECT_EQ(c.decode[0]->cache->prefix_cache(1).num_cached_blocks(), 0u);
}

TEST(HybridDisagg, BadOffersKeepTheCallersReferences) {
  Cluster c(gpt_oss_like(), 1, 1);
  Rank& pr = *c.prefill[0];
  HybridPrefillNode pn(*pr.cache, pr.ptrs, 0, 1);
  const auto t = tokens(6 * kBs);
  auto blocks = pr.prefill(t);
  auto wrong = blocks;
  wrong[0].push_back(wrong[1][0]);  // one block too many in the window group
  EXPECT_THROW(pn.offer(1, 0, wrong, t, c.peers[0]), InvalidArgument);
  std::vector<std::vector<PeerId>> no_peers(2);
  EXPECT_THROW(pn.offer(1, 0, blocks, t, no_peers), InvalidArgument);
  EXPECT_THROW(pn.offer(1, 0, std::span(blocks).first(1), t, c.peers[0]), InvalidArgument);
  // A peer list of the wrong group's agent: group 0 is offered, group 1's
  // offer throws, group 0's lease is undone.
  auto crossed = c.peers[0];
  crossed[1] = {PeerId{999}};
  EXPECT_THROW(pn.offer(1, 0, blocks, t, crossed), InvalidArgument);
  EXPECT_EQ(pn.active_leases(), 0u);
  EXPECT_EQ(pn.held_blocks(0), 0u);
  for (std::size_t g = 0; g < 2; ++g)
    EXPECT_EQ(pr.cache->blocks_in_use(g), blocks[g].size());
  ASSERT_TRUE(pn.offer(1, 0, blocks, t, c.peers[0]));
  EXPECT_THROW(pn.offer(1, 0, blocks, t, c.peers[0]), InvalidArgument);  // already leased
  EXPECT_TRUE(pn.abort(1));
  EXPECT_TRUE(pr.clean());
  EXPECT_THROW(pn.group_node(2), InvalidArgument);
}

TEST(HybridDisagg, ConstructionErrors) {
  Rank r(gpt_oss_like(), 0, 1, "x");
  std::vector<Agent*> one{r.ptrs[0]};
  EXPECT_THROW(HybridPrefillNode(*r.cache, one, 0, 1), InvalidArgument);
  EXPECT_THROW(HybridDecodeNode(*r.cache, one), InvalidArgument);
  std::vector<Agent*> null{r.ptrs[0], nullptr};
  EXPECT_THROW(HybridDecodeNode(*r.cache, null), InvalidArgument);
  EXPECT_THROW(HybridPrefillNode(*r.cache, r.ptrs, 1, 1), InvalidArgument);
  EXPECT_THROW(hybrid_agent_options(*r.cache, 2, 2), InvalidArgument);
  EXPECT_THROW(hybrid_agent_options(*r.cache, 0, 0), InvalidArgument);
  EXPECT_THROW(replica_rank(1, 0), InvalidArgument);
  EXPECT_EQ(replica_rank(5, 2), 1u);
  EXPECT_THROW(rank_layer_specs(gpt_oss_like(), 3), InvalidArgument);  // 4 heads over 3
  EXPECT_THROW(rank_layer_specs(gpt_oss_like(), 0), InvalidArgument);
  const auto per_rank = rank_layer_specs(mamba_hybrid(), 2);
  EXPECT_EQ(per_rank[1].num_kv_heads, 2u);
  EXPECT_EQ(per_rank[0], mamba_hybrid()[0]);
}

TEST(HybridDisagg, AgentsOfReplicatedGroupsAreOneRankAndCarryTheModel) {
  Rank r(mamba_hybrid(), 1, 2, "x");
  ASSERT_EQ(r.options.size(), 2u);
  EXPECT_EQ(r.options[0].tp_size, 1u);  // state
  EXPECT_EQ(r.options[0].tp_rank, 0u);
  EXPECT_EQ(r.options[1].tp_size, 2u);  // attention
  EXPECT_EQ(r.options[1].tp_rank, 1u);
  EXPECT_EQ(r.options[1].name, "x.g1");
  // The whole model's heads, the same on every group's agent.
  EXPECT_EQ(r.options[0].groups, r.options[1].groups);
  EXPECT_EQ(r.options[1].groups[1].spec.num_kv_heads, 4u);
  EXPECT_EQ(r.agents[1]->layout().num_kv_heads, 2u);
}

// A lease payload as PrefillNode encodes it (docs/transfer.md): lease id,
// group, ttl, token count and tokens, then the extent extension.
std::vector<std::uint8_t> lease_payload(const std::vector<TokenId>& t,
                                        std::vector<std::uint8_t> extension) {
  std::vector<std::uint8_t> out;
  auto put = [&](std::uint64_t v, int n) {
    for (int i = 0; i < n; ++i)
      out.push_back(static_cast<std::uint8_t>(v >> (8 * i)));
  };
  put(77, 8);  // lease id
  put(0, 4);   // group
  put(5000, 4);
  put(t.size(), 4);
  for (TokenId x : t)
    put(x, 4);
  out.insert(out.end(), extension.begin(), extension.end());
  return out;
}

// Extents the decode side cannot take are dropped and counted, never pulled.
TEST(HybridDisagg, MalformedExtentsAreDropped) {
  Cluster c(gpt_oss_like(), 1, 1);
  Rank& pr = *c.prefill[0];
  DecodeNode decode(*c.decode[0]->agents[0], c.decode[0]->cache->prefix_cache(0));
  const auto t = tokens(6 * kBs);
  const std::vector<BlockId> two{0, 1};
  const PeerId to = c.peers[0][0][0];
  const auto kind = static_cast<std::uint32_t>(DisaggKind::lease);
  const std::vector<std::vector<std::uint8_t>> bad{
      {9, 0, 4, 0, 0, 0, 0},     // unknown extension version
      {1, 0, 4, 0, 0, 0, 2},     // unknown flag
      {1, 0, 4, 0, 0, 0, 1},     // a state extent with a first block
      {1, 0, 4, 0, 0},           // truncated
      {1, 0, 4, 0, 0, 0, 0, 0},  // trailing byte
      {1, 0, 3, 0, 0, 0, 0},     // 2 blocks from block 3 of 6: not the tail
      {1, 0, 6, 0, 0, 0, 0},     // first block past the end
  };
  for (std::size_t i = 0; i < bad.size(); ++i)
    pr.agents[0]->notify(to, 100 + i, kind, two, lease_payload(t, bad[i]));
  // A good one last: notifications are ordered, so the bad ones were seen.
  pr.agents[0]->notify(to, 200, kind, two, lease_payload(t, {1, 0, 4, 0, 0, 0, 0}));
  ASSERT_TRUE(eventually([&] {
    decode.poll();
    return decode.tracks(200);
  }));
  EXPECT_EQ(decode.counters().late_notifications, bad.size());
  EXPECT_EQ(decode.pending_request_ids(), (std::vector<std::uint64_t>{200}));
  EXPECT_TRUE(decode.abort(200));
}

TEST(HybridDisagg, OffersOutsideTheExtentAreRefused) {
  Cluster c(gpt_oss_like(), 1, 1);
  Rank& pr = *c.prefill[0];
  PrefillNode node(*pr.agents[1], pr.cache->prefix_cache(1));
  const auto t = tokens(3 * kBs);
  auto blocks = pr.prefill(t);  // group 1: 3 blocks from 0
  EXPECT_THROW(node.offer(1, 0, blocks[1], t, c.peers[0][1], LeaseExtent{1, false}),
               InvalidArgument);
  EXPECT_THROW(node.offer(1, 0, blocks[1], t, c.peers[0][1], LeaseExtent{3, false}),
               InvalidArgument);
  EXPECT_THROW(node.offer(1, 0, blocks[1], t, c.peers[0][1], LeaseExtent{0, true}),
               InvalidArgument);
  EXPECT_THROW(
      node.offer(1, 0, std::span(blocks[1]).first(1), t, c.peers[0][1], LeaseExtent{1, true}),
      InvalidArgument);
  node.offer(1, 0, std::span(blocks[1]).subspan(1), t, c.peers[0][1], LeaseExtent{1, false});
  pr.cache->prefix_cache(1).release(blocks[1][0]);
  EXPECT_EQ(node.held_blocks(), 2u);
  EXPECT_TRUE(node.abort(1));
  pr.cache->prefix_cache(0).release_blocks(blocks[0]);
  EXPECT_TRUE(pr.clean());
}

TEST(HybridDisagg, AdoptRefusesBlocksThatDoNotMatch) {
  Rank r(mamba_hybrid(), 0, 1, "x", {1, 16});  // group 0: state, 1 slot; group 1: full
  const auto t = tokens(2 * kBs + 1);
  auto blocks = r.prefill(t);  // 1 slot, 3 blocks
  const std::vector<std::size_t> firsts{0, 0};
  auto adopt = [&](std::vector<std::vector<BlockId>> b, std::vector<std::size_t> f) {
    return HybridBlockTable::adopt(*r.cache, t, b, f, r.stream);
  };
  EXPECT_THROW(adopt({blocks[0]}, {0}), InvalidArgument);
  EXPECT_THROW(adopt({blocks[0], {blocks[1][0], blocks[1][1]}}, firsts), InvalidArgument);
  EXPECT_THROW(adopt({blocks[0], {blocks[1][1], blocks[1][2]}}, {0, 1}), InvalidArgument);
  EXPECT_THROW(adopt({{}, blocks[1]}, firsts), InvalidArgument);
  EXPECT_THROW(adopt({blocks[0], {blocks[1][0], blocks[1][1], 999}}, firsts), InvalidArgument);
  EXPECT_THROW(HybridBlockTable::adopt(*r.cache, {}, blocks, firsts, r.stream), InvalidArgument);
  {  // An uncached slot becomes the working slot.
    HybridBlockTable table = adopt(blocks, firsts);
    EXPECT_EQ(table.state_slot(0), blocks[0][0]);
    EXPECT_EQ(table.num_tokens(), t.size());
  }
  EXPECT_TRUE(r.clean());
  // A cached checkpoint needs a working slot: none is free (1 slot).
  const auto t2 = tokens(2 * kBs, 3);
  blocks = r.prefill(t2);
  ASSERT_TRUE(r.cache->prefix_cache(0).insert(hash_full_blocks(t2, kBs)[1], blocks[0][0]));
  EXPECT_THROW(HybridBlockTable::adopt(*r.cache, t2, blocks, firsts, r.stream), CacheExhausted);
  for (std::size_t g = 0; g < 2; ++g)
    EXPECT_EQ(r.cache->blocks_in_use(g), blocks[g].size());  // nothing taken
  for (std::size_t g = 0; g < 2; ++g)
    r.cache->prefix_cache(g).release_blocks(blocks[g]);
  EXPECT_TRUE(r.clean());
}

TEST(HybridDisagg, StateContentDependsOnEveryToken) {
  auto a = tokens(40);
  auto b = a;
  b[3] += 1;
  EXPECT_NE(state_content_token(a), state_content_token(b));
  EXPECT_EQ(state_content_token(a), state_content_token(tokens(40)));
}

}  // namespace
}  // namespace kvport::transfer
