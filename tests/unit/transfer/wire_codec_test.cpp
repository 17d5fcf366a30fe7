// SPDX-License-Identifier: Apache-2.0
// The transfer wire codec (transfer/src/wire_codec.hpp): byte order, every
// bound of the reader (fixed-width reads, counts, length-prefixed bytes, the
// end), the writer's limits, and that every error names its context and field.
#include "wire_codec.hpp"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <limits>

#include "transfer_test_util.hpp"

namespace kvport::transfer::wire {
namespace {

using test::message_of;
using ::testing::HasSubstr;

std::vector<std::uint8_t> sample() {
  Writer w("test");
  w.u8(0xAB);
  w.u16(0x1234);
  w.u32(0xDEADBEEF);
  w.u64(0x0102030405060708);
  w.str("hi", 8, "name");
  return w.take();
}

TEST(WireCodecTest, WritesLittleEndianAndReadsItBack) {
  const std::vector<std::uint8_t> b = sample();
  EXPECT_EQ(b, (std::vector<std::uint8_t>{0xAB, 0x34, 0x12, 0xEF, 0xBE, 0xAD, 0xDE, 8, 7,   6,  5,
                                          4,    3,    2,    1,    2,    0,    0,    0, 'h', 'i'}));
  Reader r(b, "test");
  EXPECT_EQ(r.u8("a"), 0xAB);
  EXPECT_EQ(r.u16("b"), 0x1234);
  EXPECT_EQ(r.u32("c"), 0xDEADBEEFu);
  EXPECT_EQ(r.u64("d"), 0x0102030405060708u);
  EXPECT_EQ(r.position(), 15u);
  EXPECT_EQ(r.str("name", 8), "hi");
  EXPECT_TRUE(r.at_end());
  EXPECT_EQ(r.remaining(), 0u);
  EXPECT_NO_THROW(r.expect_end("name"));
}

TEST(WireCodecTest, EveryTruncationNamesTheContextAndTheField) {
  const std::vector<std::uint8_t> full = sample();
  const char* fields[] = {"a", "b", "c", "d", "name"};
  // The field each prefix length stops in.
  auto field_at = [](std::size_t n) {
    if (n < 1) return 0;
    if (n < 3) return 1;
    if (n < 7) return 2;
    if (n < 15) return 3;
    return 4;
  };
  for (std::size_t n = 0; n < full.size(); ++n) {
    // Exactly n bytes, so a read past them is a heap overflow under asan.
    const std::vector<std::uint8_t> cut(full.begin(), full.begin() + static_cast<long>(n));
    const std::string what = message_of<InvalidArgument>([&] {
      Reader r(cut, "ctx");
      r.u8("a");
      r.u16("b");
      r.u32("c");
      r.u64("d");
      r.str("name", 8);
    });
    EXPECT_THAT(what, HasSubstr("ctx: truncated message reading '" +
                                std::string(fields[field_at(n)]) + "'"))
        << n;
  }
}

TEST(WireCodecTest, FixedWidthReadsStopAtTheEnd) {
  const std::vector<std::uint8_t> three = {1, 2, 3};
  Reader r(three, "ctx");
  EXPECT_THAT(message_of<InvalidArgument>([&] { r.u32("x"); }),
              HasSubstr("ctx: truncated message reading 'x' (4 bytes at offset 0, 3 left)"));
  EXPECT_EQ(r.position(), 0u);  // a failed read consumes nothing
  EXPECT_EQ(r.u16("y"), 0x0201);
  EXPECT_THAT(message_of<InvalidArgument>([&] { r.u16("z"); }),
              HasSubstr("'z' (2 bytes at offset 2, 1 left)"));
  EXPECT_EQ(r.raw(1, "w")[0], 3);
  EXPECT_THAT(message_of<InvalidArgument>([&] { r.u8("v"); }), HasSubstr("reading 'v'"));
  EXPECT_THAT(message_of<InvalidArgument>([&] { r.raw(1, "u"); }), HasSubstr("reading 'u'"));
}

TEST(WireCodecTest, CountsAreRefusedOverTheLimitOrTheBytesLeft) {
  Writer w("test");
  w.u32(10);
  for (int i = 0; i < 10; ++i)
    w.u32(0);
  const std::vector<std::uint8_t> b = w.take();
  {
    Reader r(b, "ctx");
    EXPECT_EQ(r.count("items", 10, 4), 10u);  // at the limit, exactly the bytes left
  }
  {
    Reader r(b, "ctx");
    EXPECT_THAT(message_of<InvalidArgument>([&] { r.count("items", 9, 4); }),
                HasSubstr("ctx: 'items' is 10, over the limit of 9"));
  }
  {
    Reader r(b, "ctx");  // 40 bytes left, 10 x 5 needed
    EXPECT_THAT(message_of<InvalidArgument>([&] { r.count("items", 10, 5); }),
                HasSubstr("ctx: 'items' is 10 but only 40 bytes are left (at least 5 each)"));
  }
  // A hostile count (2^32 - 1) is refused without allocating anything.
  Writer h("test");
  h.u32(std::numeric_limits<std::uint32_t>::max());
  const std::vector<std::uint8_t> hostile = h.take();
  Reader r(hostile, "ctx");
  EXPECT_THAT(message_of<InvalidArgument>(
                  [&] { r.count("items", std::numeric_limits<std::uint32_t>::max(), 1); }),
              HasSubstr("'items' is 4294967295 but only 0 bytes are left"));
  Reader r0(hostile, "ctx");  // min 0 bytes each: only the limit applies
  EXPECT_EQ(r0.count("items", std::numeric_limits<std::uint32_t>::max(), 0),
            std::numeric_limits<std::uint32_t>::max());
}

TEST(WireCodecTest, LengthPrefixedBytesAreBoundedByTheLimitAndTheSpan) {
  Writer w("test");
  const std::vector<std::uint8_t> payload = {9, 8, 7, 6};
  w.bytes(payload, 4, "key");
  const std::vector<std::uint8_t> b = w.take();
  {
    Reader r(b, "ctx");
    auto got = r.bytes("key", 4);  // exactly at the limit
    EXPECT_EQ(std::vector<std::uint8_t>(got.begin(), got.end()), payload);
    EXPECT_TRUE(r.at_end());
  }
  {
    Reader r(b, "ctx");
    EXPECT_THAT(message_of<InvalidArgument>([&] { r.bytes("key", 3); }),
                HasSubstr("ctx: 'key' has 4 bytes, over the limit of 3"));
  }
  {
    const std::vector<std::uint8_t> cut(b.begin(), b.end() - 1);
    Reader r(cut, "ctx");
    EXPECT_THAT(message_of<InvalidArgument>([&] { r.bytes("key", 4); }),
                HasSubstr("truncated message reading 'key' (4 bytes at offset 4, 3 left)"));
  }
  {
    Writer h("test");
    h.u32(std::numeric_limits<std::uint32_t>::max());
    const std::vector<std::uint8_t> hostile = h.take();
    Reader r(hostile, "ctx");
    EXPECT_THAT(message_of<InvalidArgument>(
                    [&] { r.str("name", std::numeric_limits<std::size_t>::max()); }),
                HasSubstr("truncated message reading 'name' (4294967295 bytes"));
  }
  {
    Writer e("test");
    e.str("", 0, "empty");
    const std::vector<std::uint8_t> empty = e.take();
    Reader r(empty, "ctx");
    EXPECT_EQ(r.str("empty", 0), "");
    EXPECT_TRUE(r.at_end());
  }
}

TEST(WireCodecTest, TrailingBytesAreNamed) {
  const std::vector<std::uint8_t> b = {1, 2, 3};
  Reader r(b, "ctx");
  r.u8("a");
  EXPECT_THAT(message_of<InvalidArgument>([&] { r.expect_end("a"); }),
              HasSubstr("ctx: 2 trailing bytes after 'a'"));
  EXPECT_THAT(message_of<InvalidArgument>([&] { r.fail("custom"); }), HasSubstr("ctx: custom"));
}

TEST(WireCodecTest, WriterRefusesWhatTheReaderWouldRefuse) {
  Writer w("enc");
  const std::vector<std::uint8_t> five(5, 0);
  EXPECT_THAT(message_of<InvalidArgument>([&] { w.bytes(five, 4, "key"); }),
              HasSubstr("enc: 'key' is 5, over the limit of 4"));
  EXPECT_THAT(message_of<InvalidArgument>([&] { w.str("abc", 2, "name"); }),
              HasSubstr("enc: 'name' is 3, over the limit of 2"));
  EXPECT_THAT(message_of<InvalidArgument>([&] { w.count(7, 6, "groups"); }),
              HasSubstr("enc: 'groups' is 7, over the limit of 6"));
  // A count over 32 bits cannot be written whatever the limit.
  EXPECT_THAT(message_of<InvalidArgument>([&] {
                w.count(std::size_t{1} << 32, std::numeric_limits<std::size_t>::max(), "n");
              }),
              HasSubstr("over the limit of 4294967295"));
  EXPECT_TRUE(w.data().empty());  // nothing was appended by a refused write
  w.count(6, 6, "groups");
  EXPECT_EQ(w.data(), (std::vector<std::uint8_t>{6, 0, 0, 0}));
}

}  // namespace
}  // namespace kvport::transfer::wire
