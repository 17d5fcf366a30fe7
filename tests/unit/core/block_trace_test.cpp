// SPDX-License-Identifier: Apache-2.0
// BlockTrace: per-block refcount histories with the caller's file and line,
// enabled by PagedKvCacheOptions::trace or KVPORT_KV_TRACE.
//
// The `const int line = (call, __LINE__);` idiom keeps a call and the line it
// is on in one statement, so the expected line is the call's own line.
#include "kvport/core/block_trace.hpp"

#include <fmt/format.h>
#include <gtest/gtest.h>

#include <cstddef>
#include <cstdlib>
#include <limits>
#include <optional>
#include <source_location>
#include <string>
#include <string_view>

#include "core_test_util.hpp"
#include "kvport/core/paged_kv_cache.hpp"
#include "kvport/platform/error.hpp"

namespace kvport {
namespace {

using test::expect_invalid_argument;

PagedKvCacheOptions traced(std::size_t depth = BlockTrace::kDefaultDepth) {
  PagedKvCacheOptions options;
  options.trace = true;
  options.trace_depth = depth;
  return options;
}

// clang 15 (Debian 12's) evaluates std::source_location::current() in a
// default argument where the function is declared, not where it is called:
// every trace entry then names kvport's header. The tests of the caller's file
// and line skip there, saying so; GCC (the host preset's compiler) runs them.
std::uint_least32_t line_here(std::source_location where = std::source_location::current()) {
  return where.line();
}
#define KVPORT_SKIP_WITHOUT_CALLER_LOCATIONS()                                                  \
  if (line_here() != static_cast<std::uint_least32_t>(__LINE__))                                \
  GTEST_SKIP() << "this compiler evaluates std::source_location::current() in a default "       \
                  "argument where the function is declared, not at the call (clang 15): trace " \
                  "entries name kvport's header instead of the caller"

void expect_entry(const BlockTraceEntry& e, BlockOp op, std::uint32_t refcount, int line) {
  EXPECT_EQ(e.op, op) << to_string(e.op) << " vs " << to_string(op);
  EXPECT_EQ(e.refcount_after, refcount) << to_string(op);
  EXPECT_EQ(e.where.line(), static_cast<std::uint_least32_t>(line)) << to_string(op);
  EXPECT_TRUE(std::string_view(e.where.file_name()).ends_with("block_trace_test.cpp"))
      << e.where.file_name();
  EXPECT_NE(std::string_view(e.where.function_name()).find("TestBody"), std::string_view::npos)
      << e.where.function_name();
}

/// "alloc -> 1 at /path/block_trace_test.cpp:42": what dump() prints for an entry.
std::string dump_line(std::string_view op, std::uint32_t refcount, int line) {
  return fmt::format("{} -> {} at {}:{}", op, refcount, __FILE__, line);
}

class BlockTraceTest : public ::testing::Test {
 protected:
  std::unique_ptr<Backend> backend_ = test::host_backend();
};

TEST_F(BlockTraceTest, HistoryRecordsOperationRefcountAndCallerLine) {
  KVPORT_SKIP_WITHOUT_CALLER_LOCATIONS();
  PagedKvCache cache(test::small_config(), 4, *backend_, traced());
  ASSERT_TRUE(cache.trace().is_on());
  test::QuietLog quiet;  // the deliberate double free below logs an error
  BlockId b = 0;
  const int alloc_line = (b = cache.alloc_block(), __LINE__);
  const int inc_line = (cache.inc_ref(b), __LINE__);
  const int dec_line = (cache.dec_ref(b), __LINE__);
  const int free_line = (cache.free_block(b), __LINE__);
  const int ignored_line = (cache.dec_ref(b), __LINE__);

  const auto history = cache.trace().history(b);
  ASSERT_EQ(history.size(), 5u);
  expect_entry(history[0], BlockOp::alloc, 1, alloc_line);
  expect_entry(history[1], BlockOp::inc, 2, inc_line);
  expect_entry(history[2], BlockOp::dec, 1, dec_line);
  expect_entry(history[3], BlockOp::dec, 0, free_line);
  expect_entry(history[4], BlockOp::ignored_dec, 0, ignored_line);

  // Other blocks have their own (empty) histories.
  EXPECT_TRUE(cache.trace().history(1).empty());
}

TEST_F(BlockTraceTest, TryAllocAndEvictReturnAreRecorded) {
  KVPORT_SKIP_WITHOUT_CALLER_LOCATIONS();
  PagedKvCache cache(test::small_config(), 4, *backend_, traced());
  test::QuietLog quiet;
  BlockId b = 0;
  const int try_line = (b = *cache.try_alloc_block(), __LINE__);
  const int inc_line = (cache.inc_ref(b), __LINE__);
  const int evict_line = (cache.return_evicted_block(b), __LINE__);
  const int table_line = (cache.free_blocks(std::vector<BlockId>{b}), __LINE__);
  const int late_evict_line = (cache.return_evicted_block(b), __LINE__);

  const auto history = cache.trace().history(b);
  ASSERT_EQ(history.size(), 5u);
  expect_entry(history[0], BlockOp::try_alloc, 1, try_line);
  expect_entry(history[1], BlockOp::inc, 2, inc_line);
  expect_entry(history[2], BlockOp::evict_return, 1, evict_line);
  expect_entry(history[3], BlockOp::dec, 0, table_line);
  expect_entry(history[4], BlockOp::ignored_dec, 0, late_evict_line);
}

TEST_F(BlockTraceTest, RingKeepsOnlyTheLastDepthEntries) {
  KVPORT_SKIP_WITHOUT_CALLER_LOCATIONS();
  PagedKvCache cache(test::small_config(), 4, *backend_, traced(4));
  EXPECT_EQ(cache.trace().depth(), 4u);
  const BlockId b = cache.alloc_block();
  int inc_line = 0;
  for (int i = 0; i < 9; ++i)
    inc_line = (cache.inc_ref(b), __LINE__);  // refcount 2..10

  const auto history = cache.trace().history(b);
  ASSERT_EQ(history.size(), 4u);  // alloc and the first five incs were dropped
  for (std::size_t i = 0; i < 4; ++i) {
    expect_entry(history[i], BlockOp::inc, static_cast<std::uint32_t>(7 + i), inc_line);
  }

  // Partly filled rings are returned oldest first too.
  const BlockId other = cache.alloc_block();
  cache.inc_ref(other);
  const auto short_history = cache.trace().history(other);
  ASSERT_EQ(short_history.size(), 2u);
  EXPECT_EQ(short_history[0].op, BlockOp::alloc);
  EXPECT_EQ(short_history[1].op, BlockOp::inc);
}

TEST_F(BlockTraceTest, RingWrapsManyTimesInOrder) {
  PagedKvCache cache(test::small_config(), 2, *backend_, traced(3));
  const BlockId b = cache.alloc_block();
  for (int i = 0; i < 100; ++i) {
    cache.inc_ref(b);
    cache.dec_ref(b);
  }
  const auto history = cache.trace().history(b);
  ASSERT_EQ(history.size(), 3u);
  // ... inc -> 2, dec -> 1, inc -> 2, dec -> 1: the last three are dec, inc, dec.
  EXPECT_EQ(history[0].op, BlockOp::dec);
  EXPECT_EQ(history[0].refcount_after, 1u);
  EXPECT_EQ(history[1].op, BlockOp::inc);
  EXPECT_EQ(history[1].refcount_after, 2u);
  EXPECT_EQ(history[2].op, BlockOp::dec);
  EXPECT_EQ(history[2].refcount_after, 1u);
}

TEST_F(BlockTraceTest, DefaultDepth) {
  PagedKvCache cache(test::small_config(), 2, *backend_, traced());
  EXPECT_EQ(cache.trace().depth(), BlockTrace::kDefaultDepth);
  const BlockId b = cache.alloc_block();
  for (std::size_t i = 0; i < 2 * BlockTrace::kDefaultDepth; ++i)
    cache.inc_ref(b);
  EXPECT_EQ(cache.trace().history(b).size(), BlockTrace::kDefaultDepth);
}

TEST_F(BlockTraceTest, DumpPrintsOneLinePerEntry) {
  KVPORT_SKIP_WITHOUT_CALLER_LOCATIONS();
  PagedKvCache cache(test::small_config(), 4, *backend_, traced());
  BlockId b = 0;
  const int alloc_line = (b = cache.alloc_block(), __LINE__);
  const int inc_line = (cache.inc_ref(b), __LINE__);
  const int dec_line = (cache.dec_ref(b), __LINE__);

  const std::string dump = cache.trace().dump(b);
  EXPECT_NE(dump.find(dump_line("alloc", 1, alloc_line)), std::string::npos) << dump;
  EXPECT_NE(dump.find(dump_line("inc", 2, inc_line)), std::string::npos) << dump;
  EXPECT_NE(dump.find(dump_line("dec", 1, dec_line)), std::string::npos) << dump;
  EXPECT_EQ(std::count(dump.begin(), dump.end(), '\n'), 3);
  // Oldest first.
  EXPECT_LT(dump.find("alloc ->"), dump.find("inc ->"));
  EXPECT_LT(dump.find("inc ->"), dump.find("dec ->"));

  // A block nothing happened to says so rather than printing nothing.
  EXPECT_NE(cache.trace().dump(3).find("no operations recorded"), std::string::npos);
}

TEST_F(BlockTraceTest, OffRecordsNothing) {
  PagedKvCacheOptions options;
  options.trace = false;
  PagedKvCache cache(test::small_config(), 4, *backend_, options);
  EXPECT_FALSE(cache.trace().is_on());
  const BlockId b = cache.alloc_block();
  cache.inc_ref(b);
  EXPECT_TRUE(cache.trace().history(b).empty());
  EXPECT_NE(cache.trace().dump(b).find("KVPORT_KV_TRACE=1"), std::string::npos);
}

TEST_F(BlockTraceTest, EnvironmentVariableTurnsTracingOn) {
  const auto trace_on = [&] {
    PagedKvCache cache(test::small_config(), 2, *backend_);  // options.trace unset
    return cache.trace().is_on();
  };
  {
    test::ScopedEnv env("KVPORT_KV_TRACE", std::nullopt);
    EXPECT_FALSE(BlockTrace::enabled_by_env());
    EXPECT_FALSE(trace_on());
  }
  for (const char* on : {"1", "true", "on", "yes"}) {
    test::ScopedEnv env("KVPORT_KV_TRACE", on);
    EXPECT_TRUE(BlockTrace::enabled_by_env()) << on;
    EXPECT_TRUE(trace_on()) << on;
  }
  for (const char* off : {"0", "", "false", "off", "no"}) {
    test::ScopedEnv env("KVPORT_KV_TRACE", off);
    EXPECT_FALSE(BlockTrace::enabled_by_env()) << "'" << off << "'";
    EXPECT_FALSE(trace_on()) << "'" << off << "'";
  }
}

TEST_F(BlockTraceTest, ExplicitOptionOverridesTheEnvironment) {
  {
    test::ScopedEnv env("KVPORT_KV_TRACE", "1");
    PagedKvCacheOptions options;
    options.trace = false;
    PagedKvCache cache(test::small_config(), 2, *backend_, options);
    EXPECT_FALSE(cache.trace().is_on());
  }
  {
    test::ScopedEnv env("KVPORT_KV_TRACE", std::nullopt);
    PagedKvCache cache(test::small_config(), 2, *backend_, traced());
    EXPECT_TRUE(cache.trace().is_on());
  }
}

TEST_F(BlockTraceTest, ScopedEnvRestoresThePreviousValue) {
  test::ScopedEnv outer("KVPORT_KV_TRACE", "outer");
  { test::ScopedEnv inner("KVPORT_KV_TRACE", "1"); }
  ASSERT_NE(std::getenv("KVPORT_KV_TRACE"), nullptr);
  EXPECT_STREQ(std::getenv("KVPORT_KV_TRACE"), "outer");
}

TEST_F(BlockTraceTest, DoubleFreeLogContainsTheHistory) {
  KVPORT_SKIP_WITHOUT_CALLER_LOCATIONS();
  PagedKvCache cache(test::small_config(), 4, *backend_, traced());
  BlockId b = 0;
  const int alloc_line = (b = cache.alloc_block(), __LINE__);
  const int free_line = (cache.dec_ref(b), __LINE__);
  test::LogRecorder log;
  const int bad_line = (cache.dec_ref(b), __LINE__);

  const auto errors = log.find(log::Level::error, "with 0 refs");
  ASSERT_EQ(errors.size(), 1u);
  const std::string& m = errors[0];
  EXPECT_NE(m.find(fmt::format("block {}", b)), std::string::npos) << m;
  EXPECT_NE(m.find("history"), std::string::npos) << m;
  EXPECT_NE(m.find(dump_line("alloc", 1, alloc_line)), std::string::npos) << m;
  EXPECT_NE(m.find(dump_line("dec", 0, free_line)), std::string::npos) << m;
  // The faulty caller itself is named.
  EXPECT_NE(m.find(fmt::format("{}:{}", __FILE__, bad_line)), std::string::npos) << m;
  EXPECT_EQ(m.find("set KVPORT_KV_TRACE=1"), std::string::npos) << m;
}

TEST_F(BlockTraceTest, EvictReturnAtZeroWarningContainsTheHistory) {
  KVPORT_SKIP_WITHOUT_CALLER_LOCATIONS();
  PagedKvCache cache(test::small_config(), 4, *backend_, traced());
  BlockId b = 0;
  const int alloc_line = (b = cache.alloc_block(), __LINE__);
  cache.free_block(b);
  test::LogRecorder log;
  cache.return_evicted_block(b);
  const auto warnings = log.find(log::Level::warn, "return_evicted_block");
  ASSERT_EQ(warnings.size(), 1u);
  EXPECT_NE(warnings[0].find(dump_line("alloc", 1, alloc_line)), std::string::npos) << warnings[0];
}

TEST_F(BlockTraceTest, IncRefOnFreeBlockErrorContainsTheHistory) {
  KVPORT_SKIP_WITHOUT_CALLER_LOCATIONS();
  PagedKvCache cache(test::small_config(), 4, *backend_, traced());
  BlockId b = 0;
  const int alloc_line = (b = cache.alloc_block(), __LINE__);
  cache.free_block(b);
  expect_invalid_argument([&] { cache.inc_ref(b); }, dump_line("alloc", 1, alloc_line));
}

TEST(BlockTraceDirect, RecordsIntoTheRightBlock) {
  BlockTrace trace(3, true, 2);
  ASSERT_TRUE(trace.is_on());
  const auto here = std::source_location::current();
  trace.record(0, BlockOp::alloc, 1, here);
  trace.record(2, BlockOp::inc, 5, here);
  trace.record(2, BlockOp::dec, 4, here);
  trace.record(2, BlockOp::dec, 3, here);
  trace.record(3, BlockOp::alloc, 1, here);  // out of range: ignored
  ASSERT_EQ(trace.history(0).size(), 1u);
  EXPECT_EQ(trace.history(0)[0].refcount_after, 1u);
  EXPECT_TRUE(trace.history(1).empty());
  const auto h2 = trace.history(2);
  ASSERT_EQ(h2.size(), 2u);
  EXPECT_EQ(h2[0].refcount_after, 4u);
  EXPECT_EQ(h2[1].refcount_after, 3u);
  EXPECT_TRUE(trace.history(3).empty());
}

TEST(BlockTraceDirect, DisabledOrZeroDepthIsOff) {
  const auto here = std::source_location::current();
  BlockTrace off(4, false);
  off.record(0, BlockOp::alloc, 1, here);
  EXPECT_FALSE(off.is_on());
  EXPECT_TRUE(off.history(0).empty());

  BlockTrace zero_depth(4, true, 0);
  zero_depth.record(0, BlockOp::alloc, 1, here);
  EXPECT_FALSE(zero_depth.is_on());
  EXPECT_TRUE(zero_depth.history(0).empty());
}

TEST(BlockTraceDirect, DepthThatOverflowsThrows) {
  // 4 blocks x 2^62 entries wraps size_t to 0: it must not silently build an
  // empty ring that record() would then write past.
  expect_invalid_argument([] { BlockTrace(4, true, std::size_t{1} << 62); }, "depth");
  expect_invalid_argument([] { BlockTrace(3, true, std::numeric_limits<std::size_t>::max() / 2); },
                          "depth");
  // Off, the depth is irrelevant.
  EXPECT_NO_THROW(BlockTrace(4, false, std::size_t{1} << 62));
}

TEST_F(BlockTraceTest, OverflowingTraceDepthFailsConstructionWithoutLeaking) {
  const std::size_t capacity = backend_->mem_info().total_bytes;
  expect_invalid_argument(
      [&] { PagedKvCache(test::small_config(), 4, *backend_, traced(std::size_t{1} << 62)); },
      "depth");
  EXPECT_EQ(backend_->mem_info().free_bytes, capacity);
  EXPECT_EQ(backend_->call_counts().alloc, backend_->call_counts().free);
  // 3 x (SIZE_MAX / 2) would otherwise surface as std::length_error from the
  // ring's vector, after the pools were allocated.
  expect_invalid_argument(
      [&] {
        PagedKvCache(test::small_config(), 3, *backend_,
                     traced(std::numeric_limits<std::size_t>::max() / 2));
      },
      "depth");
  EXPECT_EQ(backend_->mem_info().free_bytes, capacity);
  EXPECT_EQ(backend_->call_counts().alloc, backend_->call_counts().free);
}

TEST(BlockTraceDirect, OpNames) {
  EXPECT_STREQ(to_string(BlockOp::alloc), "alloc");
  EXPECT_STREQ(to_string(BlockOp::try_alloc), "try_alloc");
  EXPECT_STREQ(to_string(BlockOp::inc), "inc");
  EXPECT_STREQ(to_string(BlockOp::dec), "dec");
  EXPECT_STREQ(to_string(BlockOp::evict_return), "evict_return");
  EXPECT_STREQ(to_string(BlockOp::ignored_dec), "ignored_dec");
}

}  // namespace
}  // namespace kvport
