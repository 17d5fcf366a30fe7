// SPDX-License-Identifier: Apache-2.0
// The --layer-dtypes syntax.
#include "kvport/cli/layer_dtypes.hpp"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "kvport/platform/error.hpp"
#include "kvport/testing/support.hpp"

namespace kvport::cli {
namespace {

using D = KvCacheDtype;
using kvport::testing::message_of;
using ::testing::ElementsAre;
using ::testing::HasSubstr;

TEST(cli_layer_dtypes, OverridesApplyLeftToRight) {
  EXPECT_THAT(parse_layer_dtypes("first:bf16,last:bf16", 4, D::fp8_e4m3),
              ElementsAre(D::bf16, D::fp8_e4m3, D::fp8_e4m3, D::bf16));
  EXPECT_THAT(parse_layer_dtypes("0-2:f16, 1:nvfp4", 4, D::bf16),
              ElementsAre(D::f16, D::nvfp4, D::f16, D::bf16));
  EXPECT_THAT(parse_layer_dtypes("first-last:fp8", 3, D::bf16),
              ElementsAre(D::fp8_e4m3, D::fp8_e4m3, D::fp8_e4m3));
  EXPECT_THAT(parse_layer_dtypes("0:BF16", 1, D::fp8_e4m3), ElementsAre(D::bf16));
}

TEST(cli_layer_dtypes, FullList) {
  EXPECT_THAT(parse_layer_dtypes("bf16, fp8 ,turbo4", 3, D::bf16),
              ElementsAre(D::bf16, D::fp8_e4m3, D::turbo4));
}

TEST(cli_layer_dtypes, Errors) {
  auto error = [](std::string_view spec, std::size_t layers) {
    return message_of<InvalidArgument>([&] { parse_layer_dtypes(spec, layers, D::bf16); });
  };
  EXPECT_THAT(error("4:bf16", 4), HasSubstr("layer 4 in '4:bf16' is out of range"));
  EXPECT_THAT(error("bf16,bf16", 3), HasSubstr("one dtype per layer (3), got 2"));
  EXPECT_THAT(error("bf16,,bf16", 3), HasSubstr("empty entry for layer 1"));
  EXPECT_THAT(error("1:bf16,", 3), HasSubstr("has no ':'"));
  EXPECT_THAT(error("0:", 3), HasSubstr("expected LAYERS:DTYPE"));
  EXPECT_THAT(error("-1:bf16", 3), HasSubstr("bad layer"));
  EXPECT_THAT(error("2-1:bf16", 3), HasSubstr("reversed"));
  EXPECT_THAT(error("0:bf17", 3), HasSubstr("unknown dtype 'bf17'"));
  EXPECT_THAT(error("  ", 3), HasSubstr("empty value"));
}

}  // namespace
}  // namespace kvport::cli
