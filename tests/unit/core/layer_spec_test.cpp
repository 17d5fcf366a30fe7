// SPDX-License-Identifier: Apache-2.0
// LayerSpec byte math, grouping and the planner (kv_cache_plan.hpp), with the
// bytes of real models written out as independent arithmetic.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <vector>

#include "kvport/core/kv_cache_plan.hpp"
#include "kvport/core/layer_spec.hpp"
#include "kvport/core/paged_kv_cache.hpp"
#include "kvport/platform/div_ceil.hpp"
#include "kvport/platform/error.hpp"

namespace kvport {
namespace {

using ::testing::HasSubstr;

template <typename F>
std::string error_of(F&& f) {
  try {
    f();
  } catch (const InvalidArgument& e) {
    return e.what();
  }
  return "no error";
}

// gpt-oss-120b: 36 layers alternating window 128 (layer 0) and full, 8 x 64.
std::vector<LayerSpec> gpt_oss() {
  std::vector<LayerSpec> layers;
  for (std::size_t i = 0; i < 36; ++i) {
    layers.push_back(i % 2 == 0 ? LayerSpec::sliding_window(128, 8, 64, 64)
                                : LayerSpec::full_attention(8, 64, 64));
  }
  return layers;
}

// Gemma 3 27B: 62 layers, layer i global when (i + 1) % 6 == 0, 16 x 128.
std::vector<LayerSpec> gemma3() {
  std::vector<LayerSpec> layers;
  for (std::size_t i = 0; i < 62; ++i) {
    layers.push_back((i + 1) % 6 == 0 ? LayerSpec::full_attention(16, 128, 128)
                                      : LayerSpec::sliding_window(1024, 16, 128, 128));
  }
  return layers;
}

// Llama 4 Scout: 48 layers, every 4th global, the others chunked 8192, 8 x 128.
std::vector<LayerSpec> llama4_scout() {
  std::vector<LayerSpec> layers;
  for (std::size_t i = 0; i < 48; ++i) {
    layers.push_back((i + 1) % 4 == 0 ? LayerSpec::full_attention(8, 128, 128)
                                      : LayerSpec::chunked_local(8192, 8, 128, 128));
  }
  return layers;
}

TEST(LayerSpec, AttentionBytesMatchTheKvCacheConfig) {
  const LayerSpec s = LayerSpec::full_attention(8, 128, 128, KvCacheDtype::bf16);
  EXPECT_EQ(s.token_bytes(16), 2u * 8 * 128 * 2);  // K + V, 2 bytes each
  EXPECT_EQ(s.block_bytes(16), 16u * 2 * 8 * 128 * 2);
  KvCacheConfig c = s.pool_config(32, 16);
  EXPECT_EQ(c.bytes_per_block(), 32 * s.block_bytes(16));
  EXPECT_TRUE(s.has_blocks());
  EXPECT_FALSE(s.has_state());
}

TEST(LayerSpec, MlaBytesAreDeepSeeksLatent) {
  const LayerSpec bf16 = LayerSpec::mla(512, 64);
  EXPECT_EQ(bf16.token_bytes(16), 1152u);  // 576 values x 2 bytes
  EXPECT_EQ(bf16.token_bytes(16) * 61, 70272u);
  EXPECT_EQ(bf16.block_bytes(64), 64u * 1152);
  const LayerSpec ds = LayerSpec::mla(512, 64, KvCacheDtype::bf16, MlaFormat::fp8_ds_mla);
  EXPECT_EQ(ds.token_bytes(16), 512u + 4 * 4 + 64 * 2);  // 656
  EXPECT_EQ(ds.block_bytes(16), 16u * 656);
  EXPECT_EQ(ds.dtype, KvCacheDtype::fp8_e4m3);
  const KvCacheConfig c = bf16.pool_config(61, 16);
  EXPECT_EQ(c.head_dim_v, 0u);
  EXPECT_EQ(c.head_dim_k, 576u);
  EXPECT_EQ(c.num_kv_heads, 1u);
  EXPECT_THAT(error_of([] {
                LayerSpec::mla(500, 64, KvCacheDtype::bf16, MlaFormat::fp8_ds_mla).validate(16);
              }),
              HasSubstr("multiple of 128"));
}

TEST(LayerSpec, StateBytesPadEachTensor) {
  // Nemotron-H's Mamba2 layer: SSM [128, 64, 128] fp32 (4 MiB) and conv
  // [128 * 64 + 2 * 8 * 128, 3] fp32.
  const LayerSpec s = LayerSpec::recurrent_state(
      {StateTensor{"ssm", {128, 64, 128}, StateDtype::f32},
       StateTensor{"conv", {128 * 64 + 2 * 8 * 128, 3}, StateDtype::f32}});
  EXPECT_EQ(s.state[0].bytes(), 4u << 20);
  EXPECT_EQ(s.state[1].bytes(), (8192u + 2048) * 3 * 4);
  EXPECT_EQ(s.state_bytes(), (4u << 20) + 122880);
  EXPECT_EQ(s.state_offset(1), 4u << 20);
  EXPECT_EQ(s.token_bytes(16), 0u);
  EXPECT_EQ(s.block_bytes(16), 0u);
  // An odd tensor is padded to 16 bytes before the next.
  const LayerSpec odd = LayerSpec::recurrent_state(
      {StateTensor{"a", {3}, StateDtype::f16}, StateTensor{"b", {2}, StateDtype::f32}});
  EXPECT_EQ(odd.state_offset(1), 16u);
  EXPECT_EQ(odd.state_bytes(), 32u);
  const KvCacheConfig c = odd.pool_config(4, 16);
  EXPECT_EQ(c.block_size, 1u);
  EXPECT_EQ(c.head_dim_k, 32u);
  EXPECT_EQ(c.head_dim_v, 0u);
  EXPECT_THAT(error_of([&] { (void)odd.state_offset(2); }), HasSubstr("no state tensor 2"));
}

TEST(LayerSpec, ValidateNamesTheField) {
  EXPECT_THAT(error_of([] { LayerSpec::full_attention(0, 64, 64).validate(16); }),
              HasSubstr("num_kv_heads"));
  EXPECT_THAT(error_of([] { LayerSpec::sliding_window(0, 8, 64, 64).validate(16); }),
              HasSubstr("window"));
  EXPECT_THAT(error_of([] { LayerSpec::chunked_local(100, 8, 64, 64).validate(16); }),
              HasSubstr("not a multiple of the block size"));
  EXPECT_THAT(error_of([] { LayerSpec::mla(0, 64).validate(16); }), HasSubstr("kv_lora_rank"));
  EXPECT_THAT(error_of([] { LayerSpec::recurrent_state({}).validate(16); }),
              HasSubstr("at least one state tensor"));
  EXPECT_THAT(
      error_of([] {
        LayerSpec::recurrent_state({StateTensor{"x", {4, 0}, StateDtype::f32}}).validate(16);
      }),
      HasSubstr("StateTensor 'x': dimension 1 is 0 (shape 4x0)"));
  EXPECT_THAT(error_of([] {
                LayerSpec::recurrent_state({StateTensor{"conv", {4, 3}, StateDtype::f32},
                                            StateTensor{"ssm", {2}, StateDtype::f32},
                                            StateTensor{"conv", {8}, StateDtype::bf16}})
                    .validate(16);
              }),
              HasSubstr("state tensors 0 and 2 are both named 'conv'"));
  EXPECT_NO_THROW(LayerSpec::recurrent_state({StateTensor{"conv", {4, 3}, StateDtype::f32},
                                              StateTensor{"ssm", {2}, StateDtype::f32}})
                      .validate(16));
  EXPECT_THAT(error_of([] {
                LayerSpec::recurrent_state({StateTensor{"x", {}, StateDtype::f32}}).validate(16);
              }),
              HasSubstr("shape is empty"));
  EXPECT_THAT(
      error_of([] {
        LayerSpec::recurrent_state(
            {StateTensor{"x", {std::size_t{1} << 40, std::size_t{1} << 40}, StateDtype::f32}})
            .validate(16);
      }),
      HasSubstr("overflows"));
  EXPECT_THAT(
      error_of([] { LayerSpec::full_attention(8, 60, 64, KvCacheDtype::nvfp4).validate(16); }),
      HasSubstr("head_dim_k"));
  EXPECT_THAT(error_of([] { LayerSpec::no_kv().pool_config(1, 16); }), HasSubstr("no pool"));
  EXPECT_NO_THROW(LayerSpec::no_kv().validate(16));
}

TEST(LayerSpec, NamesAndParsing) {
  EXPECT_EQ(to_string(LayerKind::mla), "mla_attention");
  EXPECT_EQ(to_string(LayerKind::state), "mamba");
  EXPECT_EQ(parse_layer_kind("sliding_window"), LayerKind::sliding_window);
  EXPECT_EQ(parse_layer_kind("state"), LayerKind::state);
  EXPECT_EQ(parse_layer_kind("bogus"), std::nullopt);
  EXPECT_EQ(parse_state_dtype("float32"), StateDtype::f32);
  EXPECT_EQ(parse_state_dtype("bfloat16"), StateDtype::bf16);
  EXPECT_EQ(parse_state_dtype("int8"), std::nullopt);
  EXPECT_EQ(state_dtype_bytes(StateDtype::f16), 2u);
  EXPECT_EQ(LayerSpec::sliding_window(128, 8, 64, 64).describe(), "sliding_window(128) 8x64 bf16");
  EXPECT_EQ(LayerSpec::mla(512, 64).describe(), "mla(512+64) bf16");
  EXPECT_EQ(LayerSpec::recurrent_state({StateTensor{"ssm", {2, 3}, StateDtype::f32}}).describe(),
            "state(ssm 2x3 f32)");
}

TEST(GroupLayers, GroupsFollowTheSpecsAndSkipLayersWithoutKv) {
  const std::vector<KvCacheGroup> g = group_layers(gpt_oss(), 16);
  ASSERT_EQ(g.size(), 2u);
  EXPECT_EQ(g[0].spec.kind, LayerKind::sliding_window);
  EXPECT_EQ(g[0].layers.size(), 18u);
  EXPECT_EQ(g[0].layers.front(), 0u);
  EXPECT_EQ(g[1].layers.front(), 1u);

  std::vector<LayerSpec> mixed = {LayerSpec::full_attention(8, 128, 128, KvCacheDtype::bf16),
                                  LayerSpec::no_kv(),
                                  LayerSpec::full_attention(8, 128, 128, KvCacheDtype::fp8_e4m3),
                                  LayerSpec::full_attention(4, 128, 128)};
  const std::vector<KvCacheGroup> m = group_layers(mixed, 16);
  ASSERT_EQ(m.size(), 2u);  // per-layer dtypes share a pool; other heads do not
  EXPECT_EQ(m[0].layers, (std::vector<std::size_t>{0, 2}));
  const KvCacheConfig c = group_pool_config(m[0], 16);
  EXPECT_EQ(c.layer_dtypes,
            (std::vector<KvCacheDtype>{KvCacheDtype::bf16, KvCacheDtype::fp8_e4m3}));
  EXPECT_EQ(m[1].layers, (std::vector<std::size_t>{3}));

  EXPECT_THAT(error_of([] { (void)group_layers({}, 16); }), HasSubstr("no layers"));
  const std::vector<LayerSpec> none = {LayerSpec::no_kv()};
  EXPECT_THAT(error_of([&] { (void)group_layers(none, 16); }), HasSubstr("every layer is 'none'"));
  const std::vector<LayerSpec> bad = {LayerSpec::full_attention(8, 64, 64),
                                      LayerSpec::sliding_window(0, 8, 64, 64)};
  EXPECT_THAT(error_of([&] { (void)group_layers(bad, 16); }), HasSubstr("layer 1:"));
}

TEST(LayerSpecsOf, TodaysConfigIsOneFullGroup) {
  KvCacheConfig c;
  c.num_layers = 4;
  c.num_kv_heads = 8;
  c.head_dim_k = c.head_dim_v = 128;
  c.layer_dtypes = {KvCacheDtype::bf16, KvCacheDtype::fp8_e4m3, KvCacheDtype::bf16,
                    KvCacheDtype::bf16};
  const std::vector<KvCacheGroup> g = group_layers(layer_specs_of(c), c.block_size);
  ASSERT_EQ(g.size(), 1u);
  const KvCacheConfig back = group_pool_config(g[0], c.block_size);
  EXPECT_EQ(back.bytes_per_block(), c.bytes_per_block());
  EXPECT_EQ(back.layer_dtypes, c.layer_dtypes);
}

TEST(PeakBlocks, FollowTheFreeingRules) {
  const LayerSpec full = LayerSpec::full_attention(8, 64, 64);
  const LayerSpec w = LayerSpec::sliding_window(128, 8, 64, 64);
  const LayerSpec c = LayerSpec::chunked_local(8192, 8, 64, 64);
  EXPECT_EQ(peak_blocks_per_request(full, 16, 32768, 1), 2048u);
  // Window 128, decode: tokens [n - 127, n] over blocks of 16: 9 blocks.
  EXPECT_EQ(peak_blocks_per_request(w, 16, 32768, 1), 9u);
  EXPECT_EQ(peak_blocks_per_request(w, 16, 64, 1), 4u);  // capped at the context
  EXPECT_EQ(peak_blocks_per_request(w, 16, 32768, 512), div_ceil(128u - 2 + 512, 16) + 1);
  EXPECT_EQ(peak_blocks_per_request(c, 16, 32768, 1), 512u);
  EXPECT_EQ(peak_blocks_per_request(LayerSpec::sliding_window(1, 8, 64, 64), 16, 100, 1), 1u);
  const LayerSpec s = LayerSpec::recurrent_state({StateTensor{"x", {4}, StateDtype::f32}});
  EXPECT_EQ(peak_blocks_per_request(s, 16, 100, 1, 3), 4u);
  EXPECT_THAT(error_of([&] { (void)peak_blocks_per_request(full, 0, 1, 1); }),
              HasSubstr("block_size"));
  EXPECT_THAT(error_of([&] { (void)peak_blocks_per_request(full, 16, 0, 1); }),
              HasSubstr("context"));
  EXPECT_THAT(error_of([&] { (void)peak_blocks_per_request(full, 16, 1, 0); }),
              HasSubstr("step_tokens"));
}

double ratio_at_32k(const std::vector<LayerSpec>& layers) {
  KvCachePlanRequest r;
  r.budget_bytes = std::size_t{80} << 30;
  r.max_context_tokens = 32768;
  return plan_kv_cache(group_layers(layers, 16), 16, r).ratio_to_all_full();
}

TEST(PlanKvCache, HybridsHoldAFractionOfAllFull) {
  // gpt-oss: (18 x 32768 + 18 x 144) / (36 x 32768) = 0.50220
  EXPECT_NEAR(ratio_at_32k(gpt_oss()), (18.0 * 32768 + 18.0 * 144) / (36.0 * 32768), 1e-9);
  EXPECT_LE(ratio_at_32k(gpt_oss()), 0.51);
  // Gemma 3: (10 x 32768 + 52 x 65 x 16) / (62 x 32768) = 0.18794
  EXPECT_NEAR(ratio_at_32k(gemma3()), (10.0 * 32768 + 52.0 * 1040) / (62.0 * 32768), 1e-9);
  EXPECT_LE(ratio_at_32k(gemma3()), 0.20);
  // Llama 4 Scout: (12 x 32768 + 36 x 8192) / (48 x 32768) = 0.4375
  EXPECT_NEAR(ratio_at_32k(llama4_scout()), 0.4375, 1e-9);
}

TEST(PlanKvCache, SplitsTheBudgetByPeakNeed) {
  KvCachePlanRequest r;
  r.budget_bytes = std::size_t{8} << 30;
  r.max_context_tokens = 32768;
  const KvCachePlan plan = plan_kv_cache(group_layers(gpt_oss(), 16), 16, r);
  ASSERT_EQ(plan.groups.size(), 2u);
  EXPECT_LE(plan.total_bytes, r.budget_bytes);
  EXPECT_EQ(plan.groups[0].peak_blocks_per_request, 9u);
  EXPECT_EQ(plan.groups[1].peak_blocks_per_request, 2048u);
  // Both groups run out at the same concurrency (up to rounding).
  const std::size_t a = plan.groups[0].num_blocks / 9;
  const std::size_t b = plan.groups[1].num_blocks / 2048;
  EXPECT_EQ(plan.max_concurrent_requests, std::min(a, b));
  EXPECT_LE(a > b ? a - b : b - a, 1u);
  // All-full would hold 2 x the full group's peak per request.
  EXPECT_EQ(plan.all_full_peak_bytes_per_request, 2 * 2048 * plan.groups[1].bytes_per_block);
  // Equal pages: a shared pool pads nothing.
  EXPECT_EQ(plan.shared_pool_peak_bytes_per_request, plan.peak_bytes_per_request);
  // A cache built from the plan fits: each group's blocks are
  // compute_num_blocks of its share.
  for (const GroupPlan& g : plan.groups)
    EXPECT_EQ(g.bytes_per_token, 18u * 2048);
}

TEST(PlanKvCache, OneFullGroupIsComputeNumBlocks) {
  KvCacheConfig c;
  c.num_layers = 32;
  c.num_kv_heads = 8;
  c.head_dim_k = c.head_dim_v = 128;
  KvCachePlanRequest r;
  r.budget_bytes = (std::size_t{10} << 30) + 12345;
  r.max_context_tokens = 8192;
  const KvCachePlan plan = plan_kv_cache(group_layers(layer_specs_of(c), 16), 16, r);
  ASSERT_EQ(plan.groups.size(), 1u);
  EXPECT_EQ(plan.groups[0].num_blocks, PagedKvCache::compute_num_blocks(c, r.budget_bytes));
  EXPECT_DOUBLE_EQ(plan.ratio_to_all_full(), 1.0);
  EXPECT_EQ(plan.max_concurrent_requests, plan.groups[0].num_blocks / 512);
}

TEST(PlanKvCache, ErrorsNameTheProblem) {
  const std::vector<KvCacheGroup> g = group_layers(gpt_oss(), 16);
  KvCachePlanRequest r;
  r.budget_bytes = std::size_t{1} << 30;
  r.max_context_tokens = 32768;
  EXPECT_THAT(error_of([&] { (void)plan_kv_cache({}, 16, r); }), HasSubstr("no KV cache group"));
  EXPECT_THAT(error_of([&] { (void)plan_kv_cache(g, 0, r); }), HasSubstr("block_size"));
  KvCachePlanRequest zero = r;
  zero.budget_bytes = 0;
  EXPECT_THAT(error_of([&] { (void)plan_kv_cache(g, 16, zero); }), HasSubstr("budget is 0"));
  zero = r;
  zero.max_context_tokens = 0;
  EXPECT_THAT(error_of([&] { (void)plan_kv_cache(g, 16, zero); }), HasSubstr("max_context"));
  KvCachePlanRequest tiny = r;
  tiny.budget_bytes = 1000;
  EXPECT_THAT(error_of([&] { (void)plan_kv_cache(g, 16, tiny); }),
              HasSubstr("less than one block"));
  KvCachePlanRequest many = r;
  many.max_requests = 1000;
  EXPECT_THAT(error_of([&] { (void)plan_kv_cache(g, 16, many); }),
              HasSubstr("1000 requests of 32768 tokens"));
}

}  // namespace
}  // namespace kvport
