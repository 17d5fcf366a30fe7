// SPDX-License-Identifier: Apache-2.0
// The agent over UCX, two agents in one process on 127.0.0.1: handshake and
// its rejections, byte-exact reads and writes in both layouts, mixed dtypes
// and head slicing, notifications, cancel, empty transfers, the staging path,
// bad addresses and refused connections, a hybrid model's groups at the
// handshake. Every wait is bounded.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <chrono>
#include <cstring>
#include <numeric>
#include <thread>

#include "agent_pair.hpp"
#include "kvport/backends/host_backend.hpp"
#include "kvport/core/host_tier.hpp"
#include "kvport/core/paged_kv_cache.hpp"
#include "kvport/core/prefix_cache.hpp"
#include "kvport/testing/support.hpp"
#include "kvport/transfer/agent.hpp"
#include "kvport/transfer/kv_content.hpp"

namespace kvport::transfer {
namespace {

using namespace std::chrono_literals;
using kvport::testing::message_of;
using ::testing::HasSubstr;

// A hybrid model's layers: full attention (0, 2, 4; the cache below is that
// group's pool of 3 layers) and a 128-token sliding window (1, 3).
std::vector<LayerSpec> hybrid_specs() {
  const LayerSpec full = LayerSpec::full_attention(4, 64, 64);
  const LayerSpec window = LayerSpec::sliding_window(128, 4, 64, 64);
  return {full, window, full, window, full};
}

TEST(Agent, DirectionAndMemoryKindNames) {
  EXPECT_EQ(to_string(Direction::read), "read");
  EXPECT_EQ(to_string(Direction::write), "write");
  EXPECT_EQ(to_string(MemoryKind::host), "host");
  EXPECT_EQ(to_string(MemoryKind::cuda), "cuda");
  EXPECT_EQ(to_string(MemoryKind::rocm), "rocm");
  // The host backend's pools are host memory: registered directly.
  Side a(config(KvCacheLayout::layer_major), 2);
  EXPECT_EQ(a.backend->memory_kind(), MemoryKind::host);
  EXPECT_EQ(a.agent->memory_path(), MemoryPath::direct);
}

TEST(Agent, HandshakeExchangesLayouts) {
  Side a(config(KvCacheLayout::layer_major), 8, named("decode"));
  Side b(config(KvCacheLayout::block_major), 16, named("prefill"));
  auto [to_b, to_a] = link(a, b);
  ASSERT_NE(to_a, 0u);
  auto info = a.agent->peer(to_b);
  ASSERT_TRUE(info.has_value());
  EXPECT_EQ(info->name, "prefill");
  EXPECT_EQ(info->layout, b.layout());
  EXPECT_TRUE(info->connected);
  EXPECT_EQ(b.agent->peer(to_a)->name, "decode");
  EXPECT_FALSE(a.agent->peer(999).has_value());
  EXPECT_THAT(a.agent->transport_description(), HasSubstr("ucx"));
  std::printf("%s\n", a.agent->peer_transport(to_b).c_str());
  EXPECT_FALSE(a.agent->peer_transport(to_b).empty());
  EXPECT_TRUE(a.agent->peer_transport(999).empty());
  EXPECT_EQ(a.agent->memory_path(), MemoryPath::direct);
}

void expect_read_is_byte_exact(KvCacheLayout dst_layout, KvCacheLayout src_layout,
                               KvCacheDtype dtype = KvCacheDtype::bf16) {
  Side dst(config(dst_layout, 4, dtype), 12, named("decode"));
  Side src(config(src_layout, 4, dtype), 12, named("prefill"));
  auto [to_src, to_dst] = link(dst, src);
  (void)to_dst;
  // Scattered, non-consecutive ids on both sides.
  auto src_all = src.alloc(10);
  std::vector<BlockId> src_blocks{src_all[7], src_all[2], src_all[3], src_all[9]};
  auto t = tokens(4 * 16 - 5);
  write_kv_content(src.cache, src.layout(), src_blocks, t, src.stream);
  src.agent->publish(src_blocks);
  auto dst_blocks = dst.alloc(6);
  dst_blocks = {dst_blocks[5], dst_blocks[0], dst_blocks[1], dst_blocks[4]};
  const TransferId id = dst.agent->post(to_src, Direction::read, dst_blocks, src_blocks);
  ASSERT_EQ(dst.agent->wait(id, 10s), TransferState::done) << dst.agent->why(id);
  EXPECT_GT(dst.agent->bytes(id), 0u);
  auto check = verify_kv_content(dst.cache, dst.layout(), dst_blocks, t, dst.stream);
  EXPECT_TRUE(check.ok()) << check.bytes_wrong << " of " << check.bytes_checked;
  EXPECT_EQ(dst.agent->counters().transfers_done, 1u);
  EXPECT_EQ(dst.agent->counters().bytes_read, dst.agent->bytes(id));
  dst.agent->release(id);
  EXPECT_THROW(dst.agent->poll(id), InvalidArgument);
}

TEST(Agent, ReadIsByteExactLayerMajor) {
  expect_read_is_byte_exact(KvCacheLayout::layer_major, KvCacheLayout::layer_major);
}
TEST(Agent, ReadIsByteExactBlockMajor) {
  expect_read_is_byte_exact(KvCacheLayout::block_major, KvCacheLayout::block_major);
}
TEST(Agent, ReadIsByteExactAcrossLayouts) {
  expect_read_is_byte_exact(KvCacheLayout::layer_major, KvCacheLayout::block_major);
}
TEST(Agent, ReadIsByteExactWithScales) {
  expect_read_is_byte_exact(KvCacheLayout::layer_major, KvCacheLayout::layer_major,
                            KvCacheDtype::nvfp4);
}

TEST(Agent, MixedDtypesAndWrite) {
  auto c = config(KvCacheLayout::layer_major);
  c.layer_dtypes = {KvCacheDtype::bf16, KvCacheDtype::fp8_e4m3, KvCacheDtype::turbo4};
  Side src(c, 8, named("prefill"));
  Side dst(c, 8, named("decode"));
  auto [to_dst, to_src] = link(src, dst);
  (void)to_src;
  auto src_blocks = src.alloc(3);
  auto dst_blocks = dst.alloc(5);  // the last 3 receive
  dst_blocks.erase(dst_blocks.begin(), dst_blocks.begin() + 2);
  auto t = tokens(3 * 16, 9);
  write_kv_content(src.cache, src.layout(), src_blocks, t, src.stream);
  const TransferId id = src.agent->post(to_dst, Direction::write, src_blocks, dst_blocks);
  ASSERT_EQ(src.agent->wait(id, 10s), TransferState::done) << src.agent->why(id);
  // A writer tells the receiver, which reads the blocks only after that.
  src.agent->notify(to_dst, 1, 0, dst_blocks);
  ASSERT_TRUE(dst.agent->wait_event(5s));
  EXPECT_EQ(dst.agent->take_notifications().at(0).blocks, dst_blocks);
  EXPECT_TRUE(verify_kv_content(dst.cache, dst.layout(), dst_blocks, t, dst.stream).ok());
  EXPECT_EQ(src.agent->counters().bytes_written, src.agent->bytes(id));
}

void expect_head_sliced(std::uint32_t src_tp, std::uint32_t dst_tp) {
  // Model: 4 KV heads. Each rank holds 4 / tp of them.
  std::vector<std::unique_ptr<Side>> srcs, dsts;
  for (std::uint32_t r = 0; r < src_tp; ++r) {
    srcs.push_back(
        std::make_unique<Side>(config(KvCacheLayout::layer_major, 4 / src_tp, KvCacheDtype::turbo4),
                               8, named("prefill", r, src_tp)));
  }
  for (std::uint32_t r = 0; r < dst_tp; ++r) {
    dsts.push_back(
        std::make_unique<Side>(config(KvCacheLayout::layer_major, 4 / dst_tp, KvCacheDtype::turbo4),
                               8, named("decode", r, dst_tp)));
  }
  auto t = tokens(2 * 16, 5);
  std::vector<std::vector<BlockId>> src_blocks;
  std::vector<std::string> addresses;
  for (auto& s : srcs) {
    src_blocks.push_back(s->alloc(2));
    write_kv_content(s->cache, s->layout(), src_blocks.back(), t, s->stream);
    addresses.push_back(s->agent->listen("127.0.0.1:0"));
  }
  for (auto& d : dsts) {
    auto blocks = d->alloc(2);
    for (std::size_t r = 0; r < srcs.size(); ++r) {
      const PeerId peer = d->agent->connect(addresses[r], 5s);
      if (!head_overlap(d->layout(), srcs[r]->layout())) continue;
      const TransferId id = d->agent->post(peer, Direction::read, blocks, src_blocks[r]);
      ASSERT_EQ(d->agent->wait(id, 10s), TransferState::done) << d->agent->why(id);
    }
    EXPECT_TRUE(verify_kv_content(d->cache, d->layout(), blocks, t, d->stream).ok());
  }
}

TEST(Agent, TensorParallelTwoToOne) {
  expect_head_sliced(2, 1);
}
TEST(Agent, TensorParallelOneToTwo) {
  expect_head_sliced(1, 2);
}

TEST(Agent, IncompatiblePeerIsRejectedNamingTheField) {
  auto other = config(KvCacheLayout::layer_major);
  other.num_layers = 2;
  Side a(config(KvCacheLayout::layer_major), 4, named("a"));
  Side b(other, 4, named("b"));
  const std::string address = b.agent->listen("127.0.0.1:0");
  try {
    a.agent->connect(address, 5s);
    FAIL() << "connected to an incompatible peer";
  } catch (const TransferError& e) {
    EXPECT_THAT(e.what(), HasSubstr("num_layers"));
    EXPECT_THAT(e.what(), HasSubstr(address));
  }
  EXPECT_TRUE(a.agent->peers().empty());
  EXPECT_EQ(a.agent->counters().handshakes_rejected, 1u);
  for (int i = 0; i < 200 && b.agent->counters().handshakes_rejected == 0; ++i)
    std::this_thread::sleep_for(5ms);
  EXPECT_EQ(b.agent->counters().handshakes_rejected, 1u);
  EXPECT_TRUE(b.agent->peers().empty());
}

TEST(Agent, DifferentTpNeedsLayerMajor) {
  Side a(config(KvCacheLayout::block_major, 4), 4, named("a"));
  Side b(config(KvCacheLayout::layer_major, 2), 4, named("b", 0, 2));
  const std::string address = b.agent->listen("127.0.0.1:0");
  EXPECT_THROW(
      {
        try {
          a.agent->connect(address, 5s);
        } catch (const TransferError& e) {
          EXPECT_THAT(e.what(), HasSubstr("layer-major"));
          throw;
        }
      },
      TransferError);
}

TEST(Agent, BadAddressesAreOneLineErrors) {
  Side a(config(KvCacheLayout::layer_major), 4);
  for (const char* bad :
       {"", "127.0.0.1", "127.0.0.1:", ":80", "127.0.0.1:http", "127.0.0.1:70000"}) {
    EXPECT_THROW(a.agent->connect(bad, 1s), InvalidArgument) << bad;
    EXPECT_THROW(a.agent->listen(bad), InvalidArgument) << bad;
  }
  EXPECT_THROW(a.agent->connect("no-such-host.invalid:1234", 1s), TransferError);
}

TEST(Agent, RefusedConnectionFailsFast) {
  Side a(config(KvCacheLayout::layer_major), 4);
  // A port nobody listens on: listen, learn the port, close the listener.
  std::string address;
  {
    Side b(config(KvCacheLayout::layer_major), 4);
    address = b.agent->listen("127.0.0.1:0");
  }
  const auto start = std::chrono::steady_clock::now();
  EXPECT_THROW(a.agent->connect(address, 5s), TransferError);
  EXPECT_LT(std::chrono::steady_clock::now() - start, 5500ms);
  EXPECT_TRUE(a.agent->peers().empty());
}

TEST(Agent, NotificationsArriveInOrder) {
  Side a(config(KvCacheLayout::layer_major), 4, named("a"));
  Side b(config(KvCacheLayout::layer_major), 4, named("b"));
  auto [to_b, to_a] = link(a, b);
  const std::vector<BlockId> blocks{3, 1, 2};
  const std::vector<std::uint8_t> payload{1, 2, 3, 4};
  for (std::uint64_t r = 1; r <= 5; ++r)
    a.agent->notify(to_b, r, 7, blocks, payload);
  std::vector<Notification> got;
  for (int i = 0; i < 500 && got.size() < 5; ++i) {
    b.agent->wait_event(10ms);
    for (auto& n : b.agent->take_notifications())
      got.push_back(std::move(n));
  }
  ASSERT_EQ(got.size(), 5u);
  for (std::uint64_t r = 1; r <= 5; ++r) {
    EXPECT_EQ(got[r - 1].request_id, r);
    EXPECT_EQ(got[r - 1].peer, to_a);
    EXPECT_EQ(got[r - 1].kind, 7u);
    EXPECT_EQ(got[r - 1].blocks, blocks);
    EXPECT_EQ(got[r - 1].payload, payload);
  }
  EXPECT_THROW(a.agent->notify(999, 1, 1, blocks), InvalidArgument);
  std::vector<BlockId> huge(kMaxNotificationBytes / sizeof(BlockId) + 1);
  EXPECT_THROW(a.agent->notify(to_b, 1, 1, huge), InvalidArgument);
}

TEST(Agent, ZeroBlocksIsDoneAtOnce) {
  Side a(config(KvCacheLayout::layer_major), 4);
  Side b(config(KvCacheLayout::layer_major), 4);
  auto [to_b, to_a] = link(a, b);
  (void)to_a;
  const TransferId id = a.agent->post(to_b, Direction::read, {}, {});
  EXPECT_EQ(a.agent->poll(id), TransferState::done);
  EXPECT_EQ(a.agent->bytes(id), 0u);
}

TEST(Agent, PostRejectsBadInputBeforeMovingAnything) {
  Side a(config(KvCacheLayout::layer_major), 4);
  Side b(config(KvCacheLayout::layer_major), 4);
  auto [to_b, to_a] = link(a, b);
  (void)to_a;
  auto mine = a.alloc(2);
  EXPECT_THROW(a.agent->post(to_b, Direction::read, mine, std::vector<BlockId>{0}),
               InvalidArgument);  // lengths
  EXPECT_THROW(
      a.agent->post(to_b, Direction::read, std::vector<BlockId>{9}, std::vector<BlockId>{0}),
      InvalidArgument);  // out of range here
  EXPECT_THROW(
      a.agent->post(to_b, Direction::read, std::vector<BlockId>{3}, std::vector<BlockId>{0}),
      InvalidArgument);  // free here
  EXPECT_THROW(
      a.agent->post(to_b, Direction::read, std::vector<BlockId>{mine[0]}, std::vector<BlockId>{4}),
      InvalidArgument);  // out of range there
  EXPECT_THROW(a.agent->post(12345, Direction::read, mine, mine), InvalidArgument);  // unknown peer
  EXPECT_EQ(a.agent->counters().transfers_posted, 0u);
  EXPECT_THROW(a.agent->poll(77), InvalidArgument);
  EXPECT_THROW(a.agent->cancel(77), InvalidArgument);
  EXPECT_THROW(a.agent->release(77), InvalidArgument);
}

TEST(Agent, CancelEndsCancelledAndNothingLandsAfter) {
  Side a(config(KvCacheLayout::layer_major), 8);
  Side b(config(KvCacheLayout::layer_major), 8);
  auto [to_b, to_a] = link(a, b);
  (void)to_a;
  auto src = b.alloc(4);
  auto dst = a.alloc(4);
  const TransferId id = a.agent->post(to_b, Direction::read, dst, src);
  a.agent->cancel(id);
  const TransferState st = a.agent->wait(id, 10s);
  // Over shared memory the read may have finished before the cancel.
  EXPECT_TRUE(st == TransferState::cancelled || st == TransferState::done) << to_string(st);
  EXPECT_NO_THROW(a.agent->release(id));
}

TEST(Agent, ClosedPeerFailsLaterPostsAndIsReported) {
  Side a(config(KvCacheLayout::layer_major), 4);
  auto b = std::make_unique<Side>(config(KvCacheLayout::layer_major), 4);
  auto [to_b, to_a] = link(a, *b);
  (void)to_a;
  b.reset();  // says goodbye
  std::vector<PeerId> lost;
  for (int i = 0; i < 300 && lost.empty(); ++i) {
    a.agent->wait_event(10ms);
    lost = a.agent->take_lost_peers();
  }
  ASSERT_EQ(lost, std::vector<PeerId>{to_b});
  EXPECT_FALSE(a.agent->peer(to_b)->connected);
  auto mine = a.alloc(1);
  EXPECT_THROW(a.agent->post(to_b, Direction::read, mine, mine), InvalidArgument);
}

TEST(Agent, StagedPathIsByteExact) {
  AgentOptions staged = named("decode");
  staged.memory_path = MemoryPath::staged;
  Side dst(config(KvCacheLayout::layer_major), 8, staged);
  AgentOptions staged_src = named("prefill");
  staged_src.memory_path = MemoryPath::staged;
  Side src(config(KvCacheLayout::block_major), 8, staged_src);
  EXPECT_EQ(dst.agent->memory_path(), MemoryPath::staged);
  auto [to_src, to_dst] = link(dst, src);
  (void)to_dst;
  auto src_blocks = src.alloc(3);
  auto t = tokens(3 * 16, 3);
  write_kv_content(src.cache, src.layout(), src_blocks, t, src.stream);
  // Not published yet: the mirror does not hold the blocks.
  auto dst_blocks = dst.alloc(3);
  TransferId id = dst.agent->post(to_src, Direction::read, dst_blocks, src_blocks);
  ASSERT_EQ(dst.agent->wait(id, 10s), TransferState::done);
  EXPECT_FALSE(verify_kv_content(dst.cache, dst.layout(), dst_blocks, t, dst.stream).ok());
  src.agent->publish(src_blocks);
  id = dst.agent->post(to_src, Direction::read, dst_blocks, src_blocks);
  ASSERT_EQ(dst.agent->wait(id, 10s), TransferState::done);
  EXPECT_TRUE(verify_kv_content(dst.cache, dst.layout(), dst_blocks, t, dst.stream).ok());
}

// K-only layers (head_dim_v 0, as MLA): the handshake carries them, reads and
// writes move K alone, direct and staged; a peer with V is refused.
TEST(Agent, KOnlyLayersMoveByteExact) {
  auto k_only = [](KvCacheLayout layout) {
    KvCacheConfig c = config(layout);
    c.head_dim_v = 0;
    return c;
  };
  for (MemoryPath path : {MemoryPath::direct, MemoryPath::staged}) {
    SCOPED_TRACE(path == MemoryPath::direct ? "direct" : "staged");
    AgentOptions o = named("decode");
    o.memory_path = path;
    Side dst(k_only(KvCacheLayout::layer_major), 8, o);
    o.name = "prefill";
    Side src(k_only(KvCacheLayout::block_major), 8, o);
    auto [to_src, to_dst] = link(dst, src);
    (void)to_dst;
    EXPECT_FALSE(dst.agent->peer(to_src)->layout.has_v());
    auto src_blocks = src.alloc(4);
    src_blocks = {src_blocks[3], src_blocks[1], src_blocks[2]};
    auto t = tokens(3 * 16 - 2, 5);
    write_kv_content(src.cache, src.layout(), src_blocks, t, src.stream);
    src.agent->publish(src_blocks);
    auto dst_blocks = dst.alloc(3);
    const TransferId id = dst.agent->post(to_src, Direction::read, dst_blocks, src_blocks);
    ASSERT_EQ(dst.agent->wait(id, 10s), TransferState::done) << dst.agent->why(id);
    EXPECT_EQ(dst.agent->bytes(id), 3 * dst.cache.config().bytes_per_block());
    auto check = verify_kv_content(dst.cache, dst.layout(), dst_blocks, t, dst.stream);
    EXPECT_TRUE(check.ok()) << check.bytes_wrong << " of " << check.bytes_checked;
  }
  Side mla(k_only(KvCacheLayout::layer_major), 4, named("mla"));
  Side gqa(config(KvCacheLayout::layer_major), 4, named("gqa"));
  const std::string address = gqa.agent->listen("127.0.0.1:0");
  try {
    mla.agent->connect(address, 5s);
    ADD_FAILURE() << "a K-only agent connected to one with V";
  } catch (const TransferError& e) {
    EXPECT_THAT(e.what(), HasSubstr("head_dim_v differs"));
  }
}

TEST(Agent, ScratchReadMeasuresOneContiguousTransfer) {
  AgentOptions o;
  o.scratch_bytes = 4u << 20;
  Side a(config(KvCacheLayout::layer_major), 4, o);
  Side b(config(KvCacheLayout::layer_major), 4, o);
  auto [to_b, to_a] = link(a, b);
  (void)to_a;
  EXPECT_GT(a.agent->read_scratch(to_b, 4u << 20), 0.0);
  EXPECT_THROW(a.agent->read_scratch(to_b, (4u << 20) + 1), InvalidArgument);
  EXPECT_THROW(a.agent->read_scratch(to_b, 0), InvalidArgument);
}

TEST(Agent, RegisteredHostRangesMoveAsOneTransfer) {
  // A host tier's slots on one side, a plain pinned range on the other.
  auto src_backend = make_host_backend(HostBackendOptions{64u << 20});
  PagedKvCache src_cache(config(KvCacheLayout::layer_major), 4, *src_backend);
  PrefixCache prefix(src_cache);
  HostTierOptions tier_options;
  tier_options.num_host_blocks = 4;
  HostTier tier(prefix, tier_options, src_backend->default_stream());
  std::span<std::byte> slots = tier.slot_memory();
  ASSERT_EQ(slots.size(), 4 * tier.slot_bytes());
  for (std::size_t i = 0; i < slots.size(); ++i)
    slots[i] = static_cast<std::byte>(i * 7 + 1);
  AgentOptions src_options;
  src_options.host_regions = {slots};
  Agent src(src_cache, src_options);

  auto dst_backend = make_host_backend(HostBackendOptions{64u << 20});
  PagedKvCache dst_cache(config(KvCacheLayout::layer_major), 4, *dst_backend);
  std::vector<std::byte> landing(slots.size());
  AgentOptions dst_options;
  dst_options.host_regions = {std::span<std::byte>(landing)};
  Agent dst(dst_cache, dst_options);
  const PeerId peer = dst.connect(src.listen("127.0.0.1:0"), 5s);

  const auto local = reinterpret_cast<std::uint64_t>(landing.data());
  const auto remote = reinterpret_cast<std::uint64_t>(slots.data());
  const std::uint64_t half = slots.size() / 2;
  const std::vector<RangeCopy> ranges{{local, remote + half, half}, {local + half, remote, half}};
  const TransferId id = dst.post_ranges(peer, Direction::read, ranges);
  ASSERT_EQ(dst.wait(id, 10s), TransferState::done) << dst.why(id);
  EXPECT_EQ(dst.bytes(id), slots.size());
  EXPECT_EQ(std::memcmp(landing.data(), slots.data() + half, half), 0);
  EXPECT_EQ(std::memcmp(landing.data() + half, slots.data(), half), 0);

  // Ranges outside registered memory, on either side, move nothing.
  std::vector<std::byte> unregistered(64);
  const auto stray = reinterpret_cast<std::uint64_t>(unregistered.data());
  EXPECT_THROW(dst.post_ranges(peer, Direction::read, std::vector<RangeCopy>{{stray, remote, 64}}),
               InvalidArgument);
  EXPECT_THROW(dst.post_ranges(peer, Direction::read,
                               std::vector<RangeCopy>{{local, remote + slots.size() - 8, 64}}),
               InvalidArgument);
  EXPECT_THROW(dst.post_ranges(peer, Direction::read, std::vector<RangeCopy>{{local, remote, 0}}),
               InvalidArgument);
  EXPECT_THROW(dst.post_ranges(peer, Direction::read,
                               std::vector<RangeCopy>{{local, ~std::uint64_t{0} - 8, 64}}),
               InvalidArgument);
  EXPECT_THROW(dst.post_ranges(999, Direction::read, ranges), InvalidArgument);
}

TEST(Agent, BadOptionsAreRejected) {
  auto backend = make_host_backend(HostBackendOptions{16u << 20});
  PagedKvCache cache(config(KvCacheLayout::layer_major), 4, *backend);
  AgentOptions o;
  o.tp_size = 0;
  EXPECT_THROW(Agent(cache, o), InvalidArgument);
  o = {};
  o.tp_rank = 2;
  o.tp_size = 2;
  EXPECT_THROW(Agent(cache, o), InvalidArgument);
  o = {};
  o.peer_timeout = 0ms;
  EXPECT_THROW(Agent(cache, o), InvalidArgument);
  o = {};
  o.host_regions = {std::span<std::byte>()};
  EXPECT_THROW(Agent(cache, o), InvalidArgument);
  o = {};
  o.name = std::string(64 * 1024 + 1, 'n');
  EXPECT_THAT(message_of<InvalidArgument>([&] { Agent(cache, o); }),
              HasSubstr("name is 65537 bytes, over the limit of 65536"));
  o = {};
  o.groups = layout_groups(group_layers(hybrid_specs(), 16), 16);
  o.groups[1].spec.window = 0;  // a spec no peer would accept
  EXPECT_THAT(message_of<InvalidArgument>([&] { Agent(cache, o); }),
              HasSubstr("Agent: groups: PoolLayout decode: group 1 (sliding_window)"));
}

TEST(Agent, TheHandshakeCarriesAndComparesEveryGroup) {
  const std::vector<LayoutGroup> groups = layout_groups(group_layers(hybrid_specs(), 16), 16);
  AgentOptions with = named("hybrid");
  with.groups = groups;
  Side a(config(KvCacheLayout::layer_major), 4, with);
  Side b(config(KvCacheLayout::layer_major), 4, with);
  auto [to_b, to_a] = link(a, b);
  ASSERT_NE(to_a, 0u);
  EXPECT_EQ(a.agent->peer(to_b)->layout.groups, groups);  // carried, both ways
  EXPECT_EQ(b.agent->peer(to_a)->layout.groups, groups);

  AgentOptions other = with;
  other.groups[1].spec.window = 4096;
  Side c(config(KvCacheLayout::layer_major), 4, other);
  const std::string address = c.agent->listen("127.0.0.1:0");
  try {
    a.agent->connect(address, 5s);
    FAIL() << "connected to a peer with another window";
  } catch (const TransferError& e) {
    EXPECT_THAT(e.what(),
                HasSubstr("group 1 (sliding_window): window differs: 128 here, 4096 on the peer"));
  }
  // A cache without groups is the whole model: one full-attention group.
  Side plain(config(KvCacheLayout::layer_major), 4, named("plain"));
  const std::string plain_address = plain.agent->listen("127.0.0.1:0");
  try {
    a.agent->connect(plain_address, 5s);
    FAIL() << "a hybrid model connected to a plain one";
  } catch (const TransferError& e) {
    EXPECT_THAT(e.what(), HasSubstr("group count differs: 2 here, 1 on the peer"));
  }
  // ... and a peer that lists that one group is compatible with it.
  AgentOptions implied = named("implied");
  implied.groups = model_groups(plain.layout());
  Side d(config(KvCacheLayout::layer_major), 4, implied);
  const PeerId to_plain = d.agent->connect(plain_address, 5s);
  EXPECT_TRUE(d.agent->peer(to_plain)->connected);
}

}  // namespace
}  // namespace kvport::transfer
