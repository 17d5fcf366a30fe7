// SPDX-License-Identifier: Apache-2.0
// PoolLayout's KV cache groups (hybrid models) at the handshake:
// version 2 carries every group's spec; a layout without groups stays
// version 1 and matches its implied full-attention group; incompatibility()
// names the first differing group and field; malformed and hostile group
// lists are refused naming the field, before anything is allocated for them.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <limits>

#include "kvport/transfer/layout.hpp"
#include "transfer_test_util.hpp"

namespace kvport::transfer {
namespace {

using test::make_layout;
using test::message_of;
using ::testing::HasSubstr;
using ::testing::StartsWith;

// A hybrid model of 6 layers: full attention (0, 3), sliding window (1, 4),
// an SSM state (2), a layer without KV (5).
std::vector<LayerSpec> hybrid_specs() {
  const LayerSpec full = LayerSpec::full_attention(8, 128, 128);
  const LayerSpec window = LayerSpec::sliding_window(4096, 8, 128, 128);
  const LayerSpec state =
      LayerSpec::recurrent_state({StateTensor{"ssm", {8, 64, 128}, StateDtype::f32},
                                  StateTensor{"conv", {1024, 3}, StateDtype::bf16}});
  return {full, window, state, full, window, LayerSpec::no_kv()};
}

PoolLayout hybrid_layout() {
  PoolLayout l = make_layout(2, 8);  // the pool of group 0 (two full-attention layers)
  const std::vector<KvCacheGroup> groups = group_layers(hybrid_specs(), l.block_size);
  l.groups = layout_groups(groups, l.block_size);
  return l;
}

void put_u32(std::vector<std::uint8_t>& b, std::size_t offset, std::uint32_t v) {
  for (std::size_t i = 0; i < 4; ++i)
    b[offset + i] = static_cast<std::uint8_t>(v >> (8 * i));
}

// Offsets in hybrid_layout()'s encoding: the group count follows the 43-byte
// header and the 2 layer dtypes; each group's fixed fields are 35 bytes.
constexpr std::size_t kGroupCount = 43 + 2;
constexpr std::size_t kGroup0 = kGroupCount + 4;
constexpr std::size_t kFixedGroupBytes = 35;

TEST(LayoutGroupsTest, LayoutGroupsCopyTheCoreGroups) {
  const std::vector<KvCacheGroup> core = group_layers(hybrid_specs(), 16);
  const std::vector<LayoutGroup> groups = layout_groups(core, 16);
  ASSERT_EQ(groups.size(), 3u);
  EXPECT_EQ(groups[0].spec.kind, LayerKind::full_attention);
  EXPECT_EQ(groups[1].spec.window, 4096u);
  EXPECT_EQ(groups[1].layers, (std::vector<std::uint32_t>{1, 4}));
  EXPECT_EQ(groups[2].spec.state.size(), 2u);
  EXPECT_EQ(groups[2].block_size, 16u);
  EXPECT_EQ(groups[2].layer_dtypes.size(), 1u);

  std::vector<KvCacheGroup> bad = core;
  bad[1].layer_dtypes.pop_back();
  EXPECT_THAT(message_of<InvalidArgument>([&] { layout_groups(bad, 16); }),
              HasSubstr("group 1 (sliding_window): 1 layer dtypes for 2 layers"));
  EXPECT_THAT(message_of<InvalidArgument>([&] { layout_groups(core, std::size_t{1} << 32); }),
              HasSubstr("block_size = 4294967296 does not fit 32 bits"));
}

TEST(LayoutGroupsTest, RoundTripsAsVersion2) {
  const PoolLayout l = hybrid_layout();
  const std::vector<std::uint8_t> b = encode(l);
  EXPECT_EQ(b[4], 2);  // version 2: a group list follows
  EXPECT_EQ(b[5], 0);
  EXPECT_EQ(b[kGroupCount], 3);
  EXPECT_EQ(decode_pool_layout(b), l);

  // Every kind's fields: chunked, MLA (fp8_ds_mla), a mixed-dtype group.
  PoolLayout more = make_layout(1, 1);
  const std::vector<LayerSpec> specs = {
      LayerSpec::chunked_local(64, 4, 64, 64, KvCacheDtype::fp8_e4m3),
      LayerSpec::mla(512, 64, KvCacheDtype::fp8_e4m3, MlaFormat::fp8_ds_mla),
      LayerSpec::full_attention(2, 64, 32, KvCacheDtype::nvfp4),
      LayerSpec::full_attention(2, 64, 32, KvCacheDtype::bf16)};
  more.groups = layout_groups(group_layers(specs, 16), 16);
  ASSERT_EQ(more.groups.size(), 3u);
  EXPECT_EQ(more.groups[2].layer_dtypes,
            (std::vector<KvCacheDtype>{KvCacheDtype::nvfp4, KvCacheDtype::bf16}));
  EXPECT_EQ(decode_pool_layout(encode(more)), more);
}

TEST(LayoutGroupsTest, ALayoutWithoutGroupsIsVersion1AndItsImpliedGroup) {
  const PoolLayout v1 = make_layout(4, 2, KvCacheDtype::bf16, KvCacheLayout::layer_major, 1, 4);
  const std::vector<std::uint8_t> b = encode(v1);
  EXPECT_EQ(b.size(), 43u + 4);  // byte for byte what earlier builds send
  EXPECT_EQ(b[4], 1);
  EXPECT_TRUE(decode_pool_layout(b).groups.empty());

  const std::vector<LayoutGroup> implied = model_groups(v1);
  ASSERT_EQ(implied.size(), 1u);
  EXPECT_EQ(implied[0].spec, LayerSpec::full_attention(8, 128, 128));  // every KV head: 2 x 4
  EXPECT_EQ(implied[0].block_size, 16u);
  EXPECT_EQ(implied[0].layers, (std::vector<std::uint32_t>{0, 1, 2, 3}));
  EXPECT_EQ(implied[0].layer_dtypes, v1.layer_dtypes);

  // A peer that lists the implied group explicitly (version 2) is compatible
  // with one that sends version 1, both ways.
  PoolLayout v2 = v1;
  v2.groups = implied;
  EXPECT_EQ(encode(v2)[4], 2);
  EXPECT_EQ(incompatibility(v1, v2), std::nullopt);
  EXPECT_EQ(incompatibility(v2, v1), std::nullopt);
  // A hybrid peer whose pool matches is not: its model has more groups.
  EXPECT_EQ(incompatibility(make_layout(2, 8), hybrid_layout()),
            "group count differs: 1 here, 3 on the peer");
}

TEST(LayoutGroupsTest, TheHashCoversTheGroups) {
  const PoolLayout a = hybrid_layout();
  PoolLayout b = a;
  b.groups[1].spec.window = 128;
  EXPECT_NE(compatibility_hash(a), compatibility_hash(b));
  PoolLayout none = a;
  none.groups.clear();
  EXPECT_NE(compatibility_hash(a), compatibility_hash(none));
  EXPECT_EQ(compatibility_hash(none), compatibility_hash(make_layout(2, 8)));
}

TEST(LayoutGroupsTest, IncompatibilityNamesTheFirstDifferingGroupAndField) {
  const PoolLayout a = hybrid_layout();
  EXPECT_EQ(incompatibility(a, a), std::nullopt);
  auto why = [&](auto edit) {
    PoolLayout b = a;
    edit(b);
    return incompatibility(a, b).value_or("(compatible)");
  };
  EXPECT_EQ(why([](PoolLayout& l) { l.groups.pop_back(); }),
            "group count differs: 3 here, 2 on the peer");
  EXPECT_EQ(why([](PoolLayout& l) { l.groups[1].spec.kind = LayerKind::chunked_local; }),
            "group 1 (sliding_window): kind differs: sliding_window here, chunked_local on the "
            "peer");
  EXPECT_EQ(why([](PoolLayout& l) { l.groups[1].block_size = 32; }),
            "group 1 (sliding_window): block_size differs: 16 here, 32 on the peer");
  EXPECT_EQ(why([](PoolLayout& l) { l.groups[0].spec.num_kv_heads = 4; }),
            "group 0 (full_attention): num_kv_heads differs: 8 here, 4 on the peer");
  EXPECT_EQ(why([](PoolLayout& l) { l.groups[0].spec.head_dim_k = 64; }),
            "group 0 (full_attention): head_dim_k differs: 128 here, 64 on the peer");
  EXPECT_EQ(why([](PoolLayout& l) { l.groups[0].spec.head_dim_v = 64; }),
            "group 0 (full_attention): head_dim_v differs: 128 here, 64 on the peer");
  EXPECT_EQ(why([](PoolLayout& l) { l.groups[1].spec.dtype = KvCacheDtype::f16; }),
            "group 1 (sliding_window): dtype differs: bf16 here, f16 on the peer");
  EXPECT_EQ(why([](PoolLayout& l) { l.groups[1].spec.window = 128; }),
            "group 1 (sliding_window): window differs: 4096 here, 128 on the peer");
  EXPECT_EQ(why([](PoolLayout& l) { l.groups[1].spec.chunk = 64; }),
            "group 1 (sliding_window): chunk differs: 0 here, 64 on the peer");
  EXPECT_EQ(why([](PoolLayout& l) { l.groups[0].spec.kv_lora_rank = 512; }),
            "group 0 (full_attention): kv_lora_rank differs: 0 here, 512 on the peer");
  EXPECT_EQ(why([](PoolLayout& l) { l.groups[0].spec.rope_dim = 64; }),
            "group 0 (full_attention): rope_dim differs: 0 here, 64 on the peer");
  EXPECT_EQ(why([](PoolLayout& l) { l.groups[0].spec.mla_format = MlaFormat::fp8_ds_mla; }),
            "group 0 (full_attention): mla_format differs: plain here, fp8_ds_mla on the peer");
  EXPECT_EQ(why([](PoolLayout& l) { l.groups[2].spec.state.pop_back(); }),
            "group 2 (mamba): state tensor count differs: 2 here, 1 on the peer");
  EXPECT_EQ(why([](PoolLayout& l) { l.groups[2].spec.state[1].name = "conv1d"; }),
            "group 2 (mamba): state tensor 1 name differs: conv here, conv1d on the peer");
  EXPECT_EQ(why([](PoolLayout& l) { l.groups[2].spec.state[0].shape[2] = 64; }),
            "group 2 (mamba): state tensor 0 shape differs: [8, 64, 128] here, [8, 64, 64] on "
            "the peer");
  EXPECT_EQ(why([](PoolLayout& l) { l.groups[2].spec.state[1].dtype = StateDtype::f32; }),
            "group 2 (mamba): state tensor 1 dtype differs: bf16 here, f32 on the peer");
  EXPECT_EQ(why([](PoolLayout& l) {
              l.groups[1].layers.push_back(5);
              l.groups[1].layer_dtypes.push_back(KvCacheDtype::bf16);
            }),
            "group 1 (sliding_window): layer count differs: 2 here, 3 on the peer");
  EXPECT_EQ(why([](PoolLayout& l) { l.groups[1].layers[1] = 5; }),
            "group 1 (sliding_window): layer 1 differs: 4 here, 5 on the peer");
  EXPECT_EQ(why([](PoolLayout& l) { l.groups[0].layer_dtypes[1] = KvCacheDtype::fp8_e4m3; }),
            "group 0 (full_attention): layer 3 dtype differs: bf16 here, fp8_e4m3 on the peer");
  // The first difference wins: group 0 before group 1, kind before window.
  EXPECT_THAT(why([](PoolLayout& l) {
                l.groups[1].spec.window = 128;
                l.groups[0].spec.head_dim_k = 64;
              }),
              StartsWith("group 0 (full_attention): head_dim_k"));
  // A side whose group is inconsistent on its own is named as such.
  EXPECT_EQ(why([](PoolLayout& l) { l.groups[1].layer_dtypes.pop_back(); }),
            "group 1 has 1 layer dtypes for 2 layers on the peer");
  // The pool's own fields come first.
  EXPECT_EQ(why([](PoolLayout& l) {
              l.block_size = 32;
              l.groups[1].spec.window = 128;
            }),
            "block_size differs: 16 here, 32 on the peer");
}

TEST(LayoutGroupsTest, EveryTruncationNamesTheFieldWithoutReadingPastTheSpan) {
  const std::vector<std::uint8_t> full = encode(hybrid_layout());
  for (std::size_t n = kGroupCount; n < full.size(); ++n) {
    // Exactly n bytes: a read past them is a heap overflow under asan.
    const std::vector<std::uint8_t> cut(full.begin(), full.begin() + static_cast<long>(n));
    const std::string what = message_of<InvalidArgument>([&] { decode_pool_layout(cut); });
    EXPECT_THAT(what, StartsWith("PoolLayout decode: ")) << n;
    // A count is refused for the bytes left before its elements are read.
    EXPECT_TRUE(what.find("truncated message reading '") != std::string::npos ||
                what.find("bytes are left") != std::string::npos)
        << n << ": " << what;
  }
  std::vector<std::uint8_t> cut(full.begin(), full.begin() + kGroupCount + 2);
  EXPECT_THAT(message_of<InvalidArgument>([&] { decode_pool_layout(cut); }),
              HasSubstr("truncated message reading 'group count'"));
  std::vector<std::uint8_t> longer = full;
  longer.push_back(0);
  EXPECT_THAT(message_of<InvalidArgument>([&] { decode_pool_layout(longer); }),
              HasSubstr("1 trailing bytes after 'the last group'"));
}

TEST(LayoutGroupsTest, HostileCountsAreRefusedBeforeAllocating) {
  const std::vector<std::uint8_t> full = encode(hybrid_layout());
  auto refused = [&](std::size_t offset, std::uint32_t value) {
    std::vector<std::uint8_t> b = full;
    put_u32(b, offset, value);
    return message_of<InvalidArgument>([&] { decode_pool_layout(b); });
  };
  constexpr std::uint32_t kHuge = std::numeric_limits<std::uint32_t>::max();
  EXPECT_THAT(refused(kGroupCount, kHuge),
              HasSubstr("'group count' is 4294967295, over the limit of 256"));
  EXPECT_THAT(refused(kGroupCount, 256), HasSubstr("'group count' is 256 but only"));
  EXPECT_THAT(refused(kGroupCount, 0), HasSubstr("version 2 with no groups"));
  // Group 0 (full attention): its state tensor count, then its layer count.
  const std::size_t tensors0 = kGroup0 + kFixedGroupBytes;
  EXPECT_THAT(refused(tensors0, kHuge),
              HasSubstr("'state tensor count' is 4294967295, over the limit of 64"));
  EXPECT_THAT(refused(tensors0, 64), HasSubstr("'state tensor count' is 64 but only"));
  const std::size_t layers0 = tensors0 + 4;
  EXPECT_THAT(refused(layers0, kHuge),
              HasSubstr("'group layer count' is 4294967295, over the limit of 4096"));
  EXPECT_THAT(refused(layers0, 4096), HasSubstr("'group layer count' is 4096 but only"));
  // Group 2 (state): its first tensor's name length and rank.
  const std::size_t group1 = layers0 + 4 + 2 * 5;
  const std::size_t group2 = group1 + kFixedGroupBytes + 4 + 4 + 2 * 5;
  const std::size_t name = group2 + kFixedGroupBytes + 4;
  EXPECT_THAT(refused(name, kHuge), HasSubstr("'state tensor name' has 4294967295 bytes, over "
                                              "the limit of 256"));
  const std::size_t rank = name + 4 + 3;  // "ssm"
  EXPECT_THAT(refused(rank, 9), HasSubstr("'state tensor rank' is 9, over the limit of 8"));
  EXPECT_THAT(refused(rank, 8), HasSubstr("'state tensor rank' is 8 but only"));
}

TEST(LayoutGroupsTest, OutOfRangeGroupFieldsAreNamed) {
  const std::vector<std::uint8_t> full = encode(hybrid_layout());
  auto with = [&](auto edit) {
    std::vector<std::uint8_t> b = full;
    edit(b);
    return message_of<InvalidArgument>([&] { decode_pool_layout(b); });
  };
  const std::size_t layers0 = kGroup0 + kFixedGroupBytes + 4;
  const std::size_t group1 = layers0 + 4 + 2 * 5;
  EXPECT_THAT(with([&](auto& b) { b[kGroup0] = 6; }), HasSubstr("unknown group kind 6"));
  EXPECT_THAT(with([&](auto& b) { b[kGroup0] = static_cast<std::uint8_t>(LayerKind::none); }),
              HasSubstr("group 0 (none): a group of layers without KV"));
  EXPECT_THAT(with([&](auto& b) { put_u32(b, kGroup0 + 1, 0); }),
              HasSubstr("group 0 (full_attention): block_size is 0"));
  EXPECT_THAT(with([&](auto& b) { b[kGroup0 + 17] = 200; }), HasSubstr("unknown group dtype 200"));
  EXPECT_THAT(with([&](auto& b) { b[kGroup0 + 34] = 2; }), HasSubstr("unknown group mla_format 2"));
  EXPECT_THAT(with([&](auto& b) { b[layers0 + 4 + 4] = 99; }),
              HasSubstr("unknown group layer dtype 99"));
  // Layers: in order, each in one group, under the layer limit.
  EXPECT_THAT(with([&](auto& b) { put_u32(b, layers0 + 4 + 5, 0); }),
              HasSubstr("group 0 (full_attention): layers out of order (0 after 0)"));
  EXPECT_THAT(with([&](auto& b) { put_u32(b, group1 + kFixedGroupBytes + 4 + 4, 0); }),
              HasSubstr("group 1 (sliding_window): layer 0 is in an earlier group"));
  EXPECT_THAT(with([&](auto& b) { put_u32(b, layers0 + 4 + 5, 4096); }),
              HasSubstr("layer 4096 exceeds the limit of 4096 layers"));
  EXPECT_THAT(with([&](auto& b) { put_u32(b, layers0, 0); }),
              HasSubstr("group 0 (full_attention): no layers"));
  // The spec itself must validate: a window of 0 tokens.
  EXPECT_THAT(with([&](auto& b) { put_u32(b, group1 + 18, 0); }),
              HasSubstr("group 1 (sliding_window): "));
}

TEST(LayoutGroupsTest, EverySingleByteCorruptionDecodesOrThrowsInvalidArgument) {
  const std::vector<std::uint8_t> full = encode(hybrid_layout());
  for (std::size_t i = kGroupCount; i < full.size(); ++i) {
    for (std::uint8_t v :
         {std::uint8_t{0}, std::uint8_t{1}, std::uint8_t{0x80}, std::uint8_t{0xFF}}) {
      std::vector<std::uint8_t> b = full;
      b[i] = v;
      try {
        const PoolLayout l = decode_pool_layout(b);
        for (const LayoutGroup& g : l.groups) {
          EXPECT_EQ(g.layers.size(), g.layer_dtypes.size());
          EXPECT_NO_THROW(g.spec.validate(g.block_size));
        }
      } catch (const InvalidArgument&) {
      }
    }
  }
}

TEST(LayoutGroupsTest, EncodeRefusesGroupsOverTheLimits) {
  PoolLayout l = hybrid_layout();
  l.groups[1].layer_dtypes.pop_back();
  EXPECT_THAT(message_of<InvalidArgument>([&] { encode(l); }),
              HasSubstr("group 1 (sliding_window): 1 layer dtypes for 2 layers"));
  l = hybrid_layout();
  l.groups[2].spec.state[0].name = std::string(kMaxStateTensorName + 1, 'x');
  EXPECT_THAT(message_of<InvalidArgument>([&] { encode(l); }),
              HasSubstr("'state tensor name' is 257, over the limit of 256"));
  l = hybrid_layout();
  l.groups.resize(kMaxLayoutGroups + 1, l.groups[0]);
  EXPECT_THAT(message_of<InvalidArgument>([&] { encode(l); }),
              HasSubstr("'group count' is 257, over the limit of 256"));
  l = hybrid_layout();
  l.groups[1].spec.window = std::size_t{1} << 32;
  EXPECT_THAT(message_of<InvalidArgument>([&] { encode(l); }),
              HasSubstr("group 1 (sliding_window) window = 4294967296 does not fit 32 bits"));
}

}  // namespace
}  // namespace kvport::transfer
