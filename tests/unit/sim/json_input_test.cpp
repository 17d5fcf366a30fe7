// SPDX-License-Identifier: Apache-2.0
// parse_json_input: the one hardened JSON parse of the trace and config
// readers.
#include "kvport/sim/json_input.hpp"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <nlohmann/json.hpp>
#include <string>

#include "kvport/platform/error.hpp"
#include "kvport/testing/support.hpp"

namespace kvport::sim {
namespace {

using namespace std::string_literals;
using kvport::testing::message_of;
using ::testing::EndsWith;
using ::testing::HasSubstr;
using ::testing::StartsWith;

JsonInputOptions options(std::size_t depth = 4) {
  JsonInputOptions o;
  o.prefix = "in:7: ";
  o.malformed = "bad JSON";
  o.max_depth = depth;
  return o;
}

std::string error_of(std::string_view text, const JsonInputOptions& o = options()) {
  return message_of<InvalidArgument>([&] { (void)parse_json_input(text, o); });
}

TEST(sim_json_input, ParsesAndKeepsOnlyTheKeysAsked) {
  JsonInputOptions o = options();
  o.keep_key = [](int depth, const std::string& key) { return depth != 1 || key != "big"; };
  const nlohmann::json j = parse_json_input(R"({"a": 1, "big": [1, 2, 3], "c": {"big": 2}})", o);
  EXPECT_EQ(j.at("a"), 1);
  EXPECT_FALSE(j.contains("big"));
  EXPECT_EQ(j.at("c").at("big"), 2);  // only the top level's key is dropped
  EXPECT_EQ(parse_json_input("[[[1]]]", options()).dump(), "[[[1]]]");
}

TEST(sim_json_input, RefusesNulBytesDepthAndMalformedText) {
  EXPECT_EQ(error_of("{}\0garbage"s),
            "in:7: bad JSON: NUL byte at offset 2 (not a JSON text file)");
  EXPECT_NO_THROW((void)parse_json_input("[[[[1]]]]", options()));  // 4 levels: the limit
  EXPECT_EQ(error_of("[[[[[1]]]]]"), "in:7: JSON nested deeper than 4 levels");
  EXPECT_EQ(error_of(R"({"a": {"b": {"c": {"d": {"e": 1}}}}})"),
            "in:7: JSON nested deeper than 4 levels");
  EXPECT_THAT(error_of("{\"a\": }"), StartsWith("in:7: bad JSON: column 7: syntax error"));
  EXPECT_THAT(error_of("{\n\"a\": }"), StartsWith("in:7: bad JSON: parse error at line 2"));
  EXPECT_THAT(error_of("\"\xc3\x28\""), StartsWith("in:7: bad JSON: "));  // invalid UTF-8
}

TEST(sim_json_input, KeptContainersHaveAtMostTheElementsAllowed) {
  JsonInputOptions o = options();
  o.max_kept_elements = 3;
  o.keep_key = [](int depth, const std::string& key) { return depth != 1 || key != "big"; };
  // At the limit; a dropped key's array is not counted, however long.
  const nlohmann::json j = parse_json_input(
      R"({"a": [1, 2, [3]], "big": [1, 2, 3, 4, 5, 6, 7], "c": {"x": 1, "y": 2}})", o);
  EXPECT_EQ(j.at("a").size(), 3u);
  EXPECT_FALSE(j.contains("big"));
  EXPECT_EQ(error_of(R"({"a": [1, 2, 3, 4]})", o),
            "in:7: a JSON array of more than 3 elements ('a')");
  EXPECT_EQ(error_of(R"({"a": [[], {}, "x", null]})", o),
            "in:7: a JSON array of more than 3 elements ('a')");
  EXPECT_EQ(error_of(R"({"c": {"w": 1, "x": 1, "y": 2, "z": 3}})", o),
            "in:7: a JSON object of more than 3 elements ('c')");
  EXPECT_EQ(error_of(R"({"a": [[1, 2, 3, 4]]})", o),
            "in:7: a JSON array of more than 3 elements ('a')");
  EXPECT_EQ(error_of("[1, 2, 3, 4]", o), "in:7: a JSON array of more than 3 elements");
  // A dropped member of the top level may hold anything.
  EXPECT_NO_THROW((void)parse_json_input(R"({"big": {"a": 1, "b": 2, "c": 3, "d": 4}})", o));
}

TEST(sim_json_input, LongParserMessagesAreCutOnAUtf8Boundary) {
  // An unterminated string of 2-byte characters: the parser quotes it all.
  std::string text = "\"";
  for (int i = 0; i < 500; ++i)
    text += "\xc3\xa9";
  const std::string message = error_of(text);
  EXPECT_THAT(message, EndsWith("..."));
  const std::string quoted = message.substr(std::string("in:7: bad JSON: ").size());
  EXPECT_LE(quoted.size(), kMaxJsonErrorBytes + 3);
  // No cut inside a sequence: the byte before "..." ends a character.
  const auto last = static_cast<unsigned char>(quoted[quoted.size() - 4]);
  EXPECT_TRUE(last < 0x80 || last == 0xA9) << int(last);
  EXPECT_THAT(message, HasSubstr("\xc3\xa9"));
}

}  // namespace
}  // namespace kvport::sim
