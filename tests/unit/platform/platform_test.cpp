// SPDX-License-Identifier: Apache-2.0
// The platform layer: DevicePtr arithmetic, pool extents, byte sizes, the exception
// hierarchy and the vendor TRY macros, the logging facade and the registry.
#include <fmt/format.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cstdint>
#include <cstdlib>
#include <limits>
#include <optional>
#include <string>
#include <thread>
#include <type_traits>
#include <utility>
#include <vector>

#include "kvport/platform/allocation_tracker.hpp"
#include "kvport/platform/block_pool.hpp"
#include "kvport/platform/byte_size.hpp"
#include "kvport/platform/device_ptr.hpp"
#include "kvport/platform/error.hpp"
#include "kvport/platform/log.hpp"
#include "kvport/platform/memory_space_registry.hpp"
#include "kvport/platform/registry.hpp"
#include "kvport/testing/support.hpp"

namespace kvport {
namespace {

using kvport::testing::message_of;
using kvport::testing::ScopedEnv;
using ::testing::AllOf;
using ::testing::HasSubstr;

constexpr std::uintptr_t kMaxAddress = std::numeric_limits<std::uintptr_t>::max();

// ---- DevicePtr -------------------------------------------------------------------

TEST(DevicePtr, DefaultIsNull) {
  constexpr DevicePtr p;
  static_assert(p.is_null());
  EXPECT_TRUE(p.is_null());
  EXPECT_FALSE(static_cast<bool>(p));
  EXPECT_EQ(p.address(), 0u);
  EXPECT_EQ(p.get(), nullptr);
}

TEST(DevicePtr, FromRawPointerRoundTrips) {
  int x = 0;
  const DevicePtr p = DevicePtr::from(&x);
  EXPECT_FALSE(p.is_null());
  EXPECT_TRUE(static_cast<bool>(p));
  EXPECT_EQ(p.get(), static_cast<void*>(&x));
  EXPECT_EQ(p.address(), reinterpret_cast<std::uintptr_t>(&x));
}

TEST(DevicePtr, OffsetAddsBytes) {
  const DevicePtr p(0x1000);
  EXPECT_EQ(p.offset(0), p);
  EXPECT_EQ(p.offset(0x234).address(), 0x1234u);
  EXPECT_EQ(p.offset(1).offset(2).address(), 0x1003u);
  // Up to the very last address is fine.
  EXPECT_EQ(DevicePtr(kMaxAddress - 10).offset(10).address(), kMaxAddress);
}

TEST(DevicePtr, OffsetThatWrapsThrows) {
  const DevicePtr p(kMaxAddress - 10);
  const std::string msg = message_of<InvalidArgument>([&] { (void)p.offset(11); });
  EXPECT_THAT(msg, AllOf(HasSubstr("DevicePtr::offset"), HasSubstr("overflows"), HasSubstr("11")));
  EXPECT_THROW((void)DevicePtr(1).offset(kMaxAddress), InvalidArgument);
}

TEST(DevicePtr, OffsetOfNullThrows) {
  const std::string msg = message_of<InvalidArgument>([] { (void)DevicePtr().offset(64); });
  EXPECT_THAT(msg, AllOf(HasSubstr("offset(64)"), HasSubstr("null")));
  // Even a zero offset: a null base is never a valid device address.
  EXPECT_THROW((void)DevicePtr().offset(0), InvalidArgument);
}

TEST(DevicePtr, DistanceFrom) {
  const DevicePtr base(0x4000);
  EXPECT_EQ(base.offset(300).distance_from(base), 300u);
  EXPECT_EQ(base.distance_from(base), 0u);
  EXPECT_EQ(DevicePtr(kMaxAddress).distance_from(DevicePtr()), kMaxAddress);
}

TEST(DevicePtr, DistanceFromAHigherBaseThrows) {
  const std::string msg =
      message_of<InvalidArgument>([] { (void)DevicePtr(0x1000).distance_from(DevicePtr(0x2000)); });
  EXPECT_THAT(msg, AllOf(HasSubstr("distance_from"), HasSubstr("0x1000"), HasSubstr("0x2000")));
}

TEST(DevicePtr, Comparison) {
  const DevicePtr a(0x100), b(0x200), a2(0x100);
  EXPECT_EQ(a, a2);
  EXPECT_NE(a, b);
  EXPECT_LT(a, b);
  EXPECT_LE(a, a2);
  EXPECT_GT(b, a);
  EXPECT_GE(b, a);
  EXPECT_LT(DevicePtr(), a);
  static_assert(DevicePtr(1) < DevicePtr(2));
}

// ---- pool extents ----------------------------------------------------------------

TEST(PoolExtent, LastBlockEndsTheExtent) {
  static_assert(pool_extent(1, 4096, 100) == 100u);
  static_assert(pool_extent(8, 256, 256) == 8u * 256);  // dense: n x region
  static_assert(pool_extent(8, 1024, 256) == 7u * 1024 + 256);
  static_assert(pool_extent(0, 1024, 256) == 0u);
  constexpr PoolGeometry p{DevicePtr(4096), 100, 128};
  static_assert(p.extent(3) == 2u * 128 + 100);
}

TEST(PoolExtent, OverflowIsNullopt) {
  constexpr std::size_t kMax = std::numeric_limits<std::size_t>::max();
  EXPECT_EQ(pool_extent(3, kMax / 2 + 1, 1), std::nullopt);  // (n - 1) * stride wraps
  EXPECT_EQ(pool_extent(2, kMax - 10, 11), std::nullopt);    // + region wraps
  EXPECT_EQ(pool_extent(2, kMax - 10, 10), kMax);            // exactly fits
}

// ---- byte sizes --------------------------------------------------------------------

TEST(ParseByteSize, UnitsAndSpacing) {
  constexpr std::size_t KiB = 1024, MiB = KiB * 1024, GiB = MiB * 1024, TiB = GiB * 1024;
  EXPECT_EQ(parse_byte_size("80GiB"), 80 * GiB);
  EXPECT_EQ(parse_byte_size("512 MiB"), 512 * MiB);
  EXPECT_EQ(parse_byte_size("1.5GB"), 1'500'000'000u);
  EXPECT_EQ(parse_byte_size("4096"), 4096u);
  EXPECT_EQ(parse_byte_size("0"), 0u);
  EXPECT_EQ(parse_byte_size("4096B"), 4096u);
  EXPECT_EQ(parse_byte_size("4096 b"), 4096u);
  EXPECT_EQ(parse_byte_size("1kb"), 1000u);
  EXPECT_EQ(parse_byte_size("1KiB"), KiB);
  EXPECT_EQ(parse_byte_size("3 MB"), 3'000'000u);
  EXPECT_EQ(parse_byte_size("2tb"), 2'000'000'000'000u);
  EXPECT_EQ(parse_byte_size("1TiB"), TiB);
  EXPECT_EQ(parse_byte_size("  16 kib  "), 16 * KiB);
  EXPECT_EQ(parse_byte_size("0.5KiB"), 512u);
  EXPECT_EQ(parse_byte_size(".25 KiB"), 256u);
  EXPECT_EQ(parse_byte_size("1.0"), 1u);  // a whole number written with a point
}

TEST(ParseByteSize, DecimalFractionsAreExact) {
  // Binary floating point would give 29 999 999 for "0.03GB".
  EXPECT_EQ(parse_byte_size("0.03GB"), 30'000'000u);
  EXPECT_EQ(parse_byte_size("0.29GB"), 290'000'000u);
  EXPECT_EQ(parse_byte_size("2.49GB"), 2'490'000'000u);
  EXPECT_EQ(parse_byte_size("0.001KB"), 1u);
  EXPECT_EQ(parse_byte_size("0.999KB"), 999u);
  for (int i = 0; i < 1000; ++i) {
    const std::string text = fmt::format("0.{:03d}KB", i);
    EXPECT_EQ(parse_byte_size(text), static_cast<std::size_t>(i)) << text;
  }
  // A part of a byte that the unit leaves over is dropped.
  EXPECT_EQ(parse_byte_size("0.0015KB"), 1u);
  EXPECT_EQ(parse_byte_size("1.1KiB"), 1126u);  // 1126.4
  // 2^-40 TiB is exactly one byte, however many digits it takes to write.
  EXPECT_EQ(parse_byte_size("0.0000000000009094947017729282379150390625TiB"), 1u);
}

TEST(ParseByteSize, LargestValues) {
  EXPECT_EQ(parse_byte_size("18446744073709551615"), std::numeric_limits<std::size_t>::max());
  EXPECT_EQ(parse_byte_size("16777215TiB"), std::size_t{16777215} << 40);
  EXPECT_THAT(message_of<InvalidArgument>([] { parse_byte_size("16777216TiB"); }),
              HasSubstr("too large"));
  EXPECT_THAT(message_of<InvalidArgument>([] { parse_byte_size("18446744073709551616"); }),
              HasSubstr("too large"));
}

struct BadSize {
  const char* text;
  const char* why;
};

class ParseByteSizeRejects : public ::testing::TestWithParam<BadSize> {};

TEST_P(ParseByteSizeRejects, NamesTheTextAndTheReason) {
  const BadSize& bad = GetParam();
  const std::string msg = message_of<InvalidArgument>([&] { parse_byte_size(bad.text); });
  EXPECT_THAT(msg, HasSubstr(fmt::format("invalid byte size '{}'", bad.text)));
  EXPECT_THAT(msg, HasSubstr(bad.why));
}

INSTANTIATE_TEST_SUITE_P(
    Inputs, ParseByteSizeRejects,
    ::testing::Values(BadSize{"", "empty"}, BadSize{"   ", "empty"}, BadSize{"-1", "negative"},
                      BadSize{" -5GiB", "negative"}, BadSize{"abc", "expected a number"},
                      BadSize{"GiB", "expected a number"}, BadSize{".", "expected a number"},
                      BadSize{"+1", "expected a number"}, BadSize{"10XB", "unknown unit 'xb'"},
                      BadSize{"1.5", "whole"}, BadSize{"1.5B", "whole"},
                      BadSize{"99999999999999999999", "too large"},
                      BadSize{"1e3", "unknown unit 'e3'"},
                      BadSize{"10 MiB extra", "trailing characters"},
                      BadSize{"1.2.3MiB", "unknown unit '.3mib'"}));

TEST(FormatBytes, PicksABinaryUnitWithTwoDecimals) {
  EXPECT_EQ(format_bytes(0), "0 B");
  EXPECT_EQ(format_bytes(1023), "1023 B");
  EXPECT_EQ(format_bytes(1024), "1.00 KiB");
  EXPECT_EQ(format_bytes(1536), "1.50 KiB");
  EXPECT_EQ(format_bytes(std::size_t{80} << 30), "80.00 GiB");
  EXPECT_EQ(format_bytes((std::size_t{3} << 40) / 2), "1.50 TiB");
  // Past the largest unit the number just grows.
  EXPECT_EQ(format_bytes(std::size_t{2048} << 40), "2048.00 TiB");
}

TEST(FormatBytes, RoundingUpMovesToTheNextUnit) {
  EXPECT_EQ(format_bytes((std::size_t{1} << 20) - 1), "1.00 MiB");  // not "1024.00 KiB"
  EXPECT_EQ(format_bytes((std::size_t{1} << 30) - 1), "1.00 GiB");
  EXPECT_EQ(format_bytes(1023 * 1024 + 1000), "1023.98 KiB");
}

TEST(FormatBytes, ParsesBack) {
  for (const std::size_t bytes : {std::size_t{0}, std::size_t{1536}, std::size_t{80} << 30}) {
    EXPECT_EQ(parse_byte_size(format_bytes(bytes)), bytes) << format_bytes(bytes);
  }
}

// ---- errors ------------------------------------------------------------------------

TEST(Errors, HierarchyDerivesFromKvportError) {
  static_assert(std::is_base_of_v<std::runtime_error, Error>);
  static_assert(std::is_base_of_v<Error, InvalidArgument>);
  static_assert(std::is_base_of_v<Error, CacheExhausted>);
  static_assert(std::is_base_of_v<Error, OutOfMemory>);
  static_assert(std::is_base_of_v<Error, BackendError>);
  // One catch clause handles every kvport failure.
  auto caught_as_error = [](auto thrower) {
    try {
      thrower();
    } catch (const Error&) {
      return true;
    } catch (...) {
    }
    return false;
  };
  EXPECT_TRUE(caught_as_error([] { throw InvalidArgument("x"); }));
  EXPECT_TRUE(caught_as_error([] { throw CacheExhausted(); }));
  EXPECT_TRUE(caught_as_error([] { throw OutOfMemory("host", 1, 0); }));
  EXPECT_TRUE(caught_as_error([] { throw BackendError("cuda", "f()", 1, "e"); }));
}

TEST(Errors, CacheExhaustedMessage) {
  EXPECT_STREQ(CacheExhausted().what(), "KV cache exhausted: no free blocks");
}

TEST(Errors, OutOfMemoryCarriesSizes) {
  const OutOfMemory e("host", 123456, 789);
  EXPECT_EQ(e.requested_bytes(), 123456u);
  EXPECT_EQ(e.free_bytes(), 789u);
  EXPECT_THAT(std::string(e.what()), AllOf(HasSubstr("host"), HasSubstr("out of memory"),
                                           HasSubstr("123456"), HasSubstr("789")));
}

TEST(Errors, BackendErrorCarriesCallAndNativeError) {
  const BackendError e("cuda", "cudaMalloc(&p, bytes)", 2, "out of memory");
  EXPECT_EQ(e.backend(), "cuda");
  EXPECT_EQ(e.call(), "cudaMalloc(&p, bytes)");
  EXPECT_EQ(e.native_code(), 2);
  EXPECT_EQ(e.native_string(), "out of memory");
  EXPECT_THAT(std::string(e.what()), AllOf(HasSubstr("cuda"), HasSubstr("cudaMalloc(&p, bytes)"),
                                           HasSubstr("2"), HasSubstr("out of memory")));
}

TEST(Errors, OutOfRangeIsAnInvalidArgument) {
  try {
    throw OutOfRange("PagedKvCache::inc_ref: block 9 out of range (num_blocks = 4)");
  } catch (const InvalidArgument& e) {  // a handler of the base catches it
    EXPECT_NE(dynamic_cast<const OutOfRange*>(&e), nullptr);
    EXPECT_THAT(std::string(e.what()), HasSubstr("block 9 out of range"));
  }
}

// ---- logging -----------------------------------------------------------------------

TEST(LogParseLevel, EveryName) {
  using log::Level;
  EXPECT_EQ(log::parse_level("trace"), Level::trace);
  EXPECT_EQ(log::parse_level("debug"), Level::debug);
  EXPECT_EQ(log::parse_level("info"), Level::info);
  EXPECT_EQ(log::parse_level("warn"), Level::warn);
  EXPECT_EQ(log::parse_level("warning"), Level::warn);
  EXPECT_EQ(log::parse_level("error"), Level::error);
  EXPECT_EQ(log::parse_level("critical"), Level::critical);
  EXPECT_EQ(log::parse_level("off"), Level::off);
  EXPECT_EQ(log::parse_level("DEBUG"), Level::debug);
  EXPECT_EQ(log::parse_level("Warning"), Level::warn);
}

TEST(LogParseLevel, UnknownNameThrowsNamingIt) {
  const std::string msg = message_of<InvalidArgument>([] { log::parse_level("verbose"); });
  EXPECT_THAT(msg, AllOf(HasSubstr("'verbose'"), HasSubstr("trace"), HasSubstr("off")));
  EXPECT_THROW(log::parse_level(""), InvalidArgument);
}

class LogLevels : public ::testing::Test {
 protected:
  void TearDown() override { log::set_level(saved_); }
  log::Level saved_ = log::level();
};

TEST_F(LogLevels, MessagesBelowTheLevelAreDropped) {
  log::set_level(log::Level::warn);
  EXPECT_EQ(log::level(), log::Level::warn);
  log::ScopedCapture capture;
  log::debug("d");
  log::info("i");
  log::warn("w");
  log::error("e");
  log::write(log::Level::critical, "c");
  EXPECT_EQ(capture.text(), "w\ne\nc\n");
}

TEST_F(LogLevels, TraceLetsEverythingThroughButOff) {
  log::set_level(log::Level::trace);
  EXPECT_TRUE(log::enabled(log::Level::trace));
  EXPECT_TRUE(log::enabled(log::Level::critical));
  EXPECT_FALSE(log::enabled(log::Level::off));
  log::ScopedCapture capture;
  log::write(log::Level::trace, "t");
  log::debug("d");
  log::write(log::Level::off, "never");
  EXPECT_EQ(capture.text(), "t\nd\n");
}

TEST_F(LogLevels, OffSilencesEverything) {
  log::set_level(log::Level::off);
  EXPECT_FALSE(log::enabled(log::Level::critical));
  log::ScopedCapture capture;
  log::error("e");
  log::write(log::Level::critical, "c");
  EXPECT_EQ(capture.text(), "");
}

TEST_F(LogLevels, SinkReceivesLevelAndMessage) {
  log::set_level(log::Level::info);
  std::vector<std::pair<log::Level, std::string>> got;
  log::Sink previous = log::set_sink(
      [&](log::Level lvl, std::string_view m) { got.emplace_back(lvl, std::string(m)); });
  log::warn("hello");
  log::debug("dropped");
  log::set_sink(std::move(previous));
  log::warn("after removal");
  ASSERT_EQ(got.size(), 1u);
  EXPECT_EQ(got[0].first, log::Level::warn);
  EXPECT_EQ(got[0].second, "hello");
}

TEST_F(LogLevels, NestedCaptureRestoresTheOuterOne) {
  log::set_level(log::Level::info);
  log::ScopedCapture outer;
  log::info("one");
  {
    log::ScopedCapture inner;
    log::info("two");
    EXPECT_EQ(inner.text(), "two\n");
  }
  log::info("three");
  EXPECT_EQ(outer.text(), "one\nthree\n");
}

// ---- registry ----------------------------------------------------------------------

TEST(Registry, HostIsCompiledFirstAndAvailable) {
  const std::vector<BackendInfo> backends = compiled_backends();
  ASSERT_FALSE(backends.empty());
  EXPECT_EQ(backends[0].name, "host");
  EXPECT_FALSE(backends[0].is_gpu);
  EXPECT_TRUE(backends[0].available);
  EXPECT_EQ(backends[0].unavailable_reason, "");
  for (const BackendInfo& info : backends) {
    // An unavailable backend always says why.
    EXPECT_EQ(info.available, info.unavailable_reason.empty()) << info.name;
  }
}

TEST(Registry, MakeHostBackend) {
  std::unique_ptr<Backend> backend = make_backend("host");
  ASSERT_NE(backend, nullptr);
  EXPECT_EQ(backend->name(), "host");
  EXPECT_EQ(backend->device_count(), 1);
  EXPECT_GT(backend->mem_info().total_bytes, 0u);
}

TEST(Registry, UnknownNameListsCompiledBackends) {
  const std::string msg = message_of<InvalidArgument>([] { make_backend("nope"); });
  EXPECT_THAT(msg, AllOf(HasSubstr("'nope'"), HasSubstr("compiled backends: host")));
}

// What default_backend picks without $KVPORT_BACKEND.
std::string expected_default_name() {
  for (const BackendInfo& info : compiled_backends()) {
    if (info.is_gpu && info.available) return info.name;
  }
  return "host";
}

TEST(Registry, DefaultBackendWithoutEnvironment) {
  ScopedEnv env("KVPORT_BACKEND", std::nullopt);
  EXPECT_EQ(default_backend()->name(), expected_default_name());
}

TEST(Registry, DefaultBackendWithEmptyEnvironmentIsAsUnset) {
  ScopedEnv env("KVPORT_BACKEND", "");
  EXPECT_EQ(default_backend()->name(), expected_default_name());
}

TEST(Registry, DefaultBackendHonoursEnvironment) {
  ScopedEnv env("KVPORT_BACKEND", "host");
  EXPECT_EQ(default_backend()->name(), "host");
}

TEST(Registry, DefaultBackendWithUnknownEnvironmentThrows) {
  ScopedEnv env("KVPORT_BACKEND", "nope");
  const std::string msg = message_of<InvalidArgument>([] { default_backend(); });
  EXPECT_THAT(msg, AllOf(HasSubstr("KVPORT_BACKEND"), HasSubstr("'nope'"), HasSubstr("host")));
}

// ---- AllocationTracker: adopted ranges ----------------------------------------------

TEST(AllocationTracker, AnAdoptedRangeIsCheckedButNeverFreedNorListed) {
  AllocationTracker t("test");
  const DevicePtr own(0x10000), engine(0x20000);
  t.add(own, 256);
  t.add_adopted(engine, 1024);
  EXPECT_NO_THROW(t.check(engine.offset(1000), 24, "op"));
  EXPECT_THROW(t.check(engine.offset(1000), 25, "op"), InvalidArgument);  // out of bounds
  EXPECT_FALSE(t.remove(engine).has_value());  // not the backend's to free
  EXPECT_EQ(t.live_count(), 1u);
  EXPECT_EQ(t.live_bytes(), 256u);
  EXPECT_EQ(t.adopted_count(), 1u);
  ASSERT_EQ(t.live().size(), 1u);
  EXPECT_EQ(t.live()[0].first, own.address());
  EXPECT_FALSE(t.remove_adopted(own));  // an allocation is not an adopted range
  EXPECT_EQ(t.live_count(), 1u);
}

TEST(AllocationTracker, ReleasingAnAdoptedRangeIsAUseAfterFreeForQueuedWork) {
  AllocationTracker t("test");
  const DevicePtr engine(0x20000);
  const std::uint64_t serial = t.add_adopted(engine, 1024);
  const std::uint64_t generation = t.generation_locked();
  EXPECT_TRUE(t.remove_adopted(engine));
  EXPECT_FALSE(t.remove_adopted(engine));
  EXPECT_NE(t.generation_locked(), generation);
  EXPECT_EQ(t.adopted_count(), 0u);
  EXPECT_THAT(kvport::testing::message_of<InvalidArgument>([&] {
                t.recheck_locked({engine, 16, "fill", serial});
              }),
              HasSubstr("use after free"));
  EXPECT_THAT(kvport::testing::message_of<InvalidArgument>([&] { t.check(engine, 16, "fill"); }),
              HasSubstr("use after free"));
}

TEST(AllocationTracker, AdoptedRangesMayNotOverlapAnything) {
  AllocationTracker t("test");
  t.add(DevicePtr(0x10000), 256);
  t.add_adopted(DevicePtr(0x20000), 1024);
  using kvport::testing::message_of;
  EXPECT_THAT(message_of<InvalidArgument>([&] { t.add_adopted(DevicePtr(0x100ff), 2); }),
              HasSubstr("overlaps a live allocation [0x10000, +256)"));
  EXPECT_THAT(message_of<InvalidArgument>([&] { t.add_adopted(DevicePtr(0x1ff00), 0x101); }),
              HasSubstr("overlaps an adopted range [0x20000, +1024)"));
  EXPECT_THAT(message_of<InvalidArgument>([&] { t.add_adopted(DevicePtr(0x203ff), 1); }),
              HasSubstr("overlaps an adopted range"));
  // Ranges that only touch are fine.
  EXPECT_NO_THROW(t.add_adopted(DevicePtr(0x10100), 0x100));
  EXPECT_NO_THROW(t.add_adopted(DevicePtr(0x20400), 16));
  EXPECT_EQ(t.adopted_count(), 3u);
}

// ---- MemorySpaceRegistry: adopted ranges are process-wide ------------------------------
// Made-up addresses in made-up device spaces (no backend uses cuda device 40+), so
// the host backends of other tests never meet them.

TEST(MemorySpaceRegistry, AnAdoptionMayNotOverlapAnotherTrackersRanges) {
  const MemorySpace space = MemorySpace::of(MemoryKind::cuda, 40);
  AllocationTracker a("cuda", space), b("cuda", space);
  a.add(DevicePtr(0x10000), 256);
  a.add_adopted(DevicePtr(0x20000), 1024);
  EXPECT_EQ(MemorySpaceRegistry::count(space), 2u);
  EXPECT_THAT(message_of<InvalidArgument>([&] { b.add_adopted(DevicePtr(0x100f0), 0x20); }),
              AllOf(HasSubstr("cuda: adopt_memory: [0x100f0, +32) overlaps a live allocation "
                              "[0x10000, +256) of another cuda backend object (cuda device 40)"),
                    HasSubstr("two caches cannot share memory")));
  EXPECT_THAT(message_of<InvalidArgument>([&] { b.add_adopted(DevicePtr(0x20000), 1024); }),
              HasSubstr("[0x20000, +1024) overlaps an adopted range [0x20000, +1024) of another"));
  EXPECT_EQ(b.adopted_count(), 0u);  // nothing recorded by the refusals
  EXPECT_EQ(MemorySpaceRegistry::count(space), 2u);
  // Neighbours that only touch, and the same addresses in another space, are fine.
  EXPECT_NO_THROW(b.add_adopted(DevicePtr(0x20400), 16));
  AllocationTracker other_device("cuda", MemorySpace::of(MemoryKind::cuda, 41));
  EXPECT_NO_THROW(other_device.add_adopted(DevicePtr(0x20000), 1024));
  // Releasing frees the range for the other tracker.
  EXPECT_TRUE(a.remove_adopted(DevicePtr(0x20000)));
  EXPECT_NO_THROW(b.add_adopted(DevicePtr(0x20000), 1024));
  EXPECT_TRUE(a.remove(DevicePtr(0x10000)).has_value());
  EXPECT_NO_THROW(b.add_adopted(DevicePtr(0x10000), 256));
  EXPECT_EQ(MemorySpaceRegistry::count(space), 3u);  // all b's now
}

TEST(MemorySpaceRegistry, ADestroyedTrackerForgetsItsRanges) {
  const MemorySpace space = MemorySpace::of(MemoryKind::rocm, 42);
  AllocationTracker survivor("rocm", space);
  {
    AllocationTracker doomed("rocm", space);
    doomed.add(DevicePtr(0x10000), 256);
    doomed.add_adopted(DevicePtr(0x20000), 256);
    EXPECT_THROW(survivor.add_adopted(DevicePtr(0x20000), 256), InvalidArgument);
  }
  EXPECT_EQ(MemorySpaceRegistry::count(space), 0u);
  EXPECT_NO_THROW(survivor.add_adopted(DevicePtr(0x10000), 256));
  EXPECT_NO_THROW(survivor.add_adopted(DevicePtr(0x20000), 256));
}

TEST(MemorySpaceRegistry, ATrackerWithoutASpaceKeepsItsRangesToItself) {
  const MemorySpace space = MemorySpace::of(MemoryKind::cuda, 43);
  AllocationTracker alone("test"), b("cuda", space);
  alone.add_adopted(DevicePtr(0x20000), 1024);
  EXPECT_NO_THROW(b.add_adopted(DevicePtr(0x20000), 1024));
  EXPECT_EQ(MemorySpaceRegistry::count(space), 1u);
}

TEST(MemorySpaceRegistry, HostMemoryIsOneSpaceWhateverTheDevice) {
  EXPECT_EQ(MemorySpace::of(MemoryKind::host, 3), MemorySpace::of(MemoryKind::host, 0));
  EXPECT_NE(MemorySpace::of(MemoryKind::cuda, 1), MemorySpace::of(MemoryKind::cuda, 0));
  EXPECT_EQ(to_string(MemorySpace::of(MemoryKind::host, 3)), "host memory");
  EXPECT_EQ(to_string(MemorySpace::of(MemoryKind::rocm, 2)), "rocm device 2");
}

// Memory freed by its owner while another tracker had adopted it, then handed
// out again: the stale adopted range is forgotten (logged), the allocation is
// what is protected, and a later adoption overlapping the allocation is
// refused even where the stale range was larger than the allocation.
TEST(MemorySpaceRegistry, AnAllocationOverStaleRangesReplacesThem) {
  const MemorySpace space = MemorySpace::of(MemoryKind::cuda, 45);
  AllocationTracker engine("cuda", space), cache("cuda", space), other("cuda", space);
  cache.add_adopted(DevicePtr(0x10000), 0x1000);
  cache.add_adopted(DevicePtr(0x11000), 0x1000);
  engine.add(DevicePtr(0x10800), 0x1000);  // over both: the vendor reused freed memory
  EXPECT_EQ(MemorySpaceRegistry::count(space), 1u);
  EXPECT_THAT(message_of<InvalidArgument>([&] { other.add_adopted(DevicePtr(0x10f00), 0x10); }),
              HasSubstr("overlaps a live allocation [0x10800, +4096)"));
  EXPECT_NO_THROW(other.add_adopted(DevicePtr(0x10000), 0x800));  // stale: no longer held
  EXPECT_TRUE(cache.remove_adopted(DevicePtr(0x10000)));          // its own map still knew it
  EXPECT_EQ(MemorySpaceRegistry::count(space), 2u);               // the allocation and other's
}

// Two threads race to adopt the same ranges through two trackers: every round
// exactly one wins (run under ThreadSanitizer by the tsan preset).
TEST(MemorySpaceRegistry, ConcurrentAdoptionsOfOneRangeHaveOneWinner) {
  const MemorySpace space = MemorySpace::of(MemoryKind::cuda, 44);
  AllocationTracker a("cuda", space), b("cuda", space);
  constexpr int kRounds = 500;
  int wins[2] = {0, 0};
  auto racer = [&](AllocationTracker& t, int& won) {
    for (int i = 0; i < kRounds; ++i) {
      try {
        t.add_adopted(DevicePtr(0x100000 + static_cast<std::uintptr_t>(i) * 0x1000), 0x800);
        ++won;
      } catch (const InvalidArgument&) {
      }
    }
  };
  std::thread ta([&] { racer(a, wins[0]); });
  std::thread tb([&] { racer(b, wins[1]); });
  ta.join();
  tb.join();
  EXPECT_EQ(wins[0] + wins[1], kRounds);
  EXPECT_EQ(a.adopted_count() + b.adopted_count(), static_cast<std::size_t>(kRounds));
  EXPECT_EQ(MemorySpaceRegistry::count(space), static_cast<std::size_t>(kRounds));
}

}  // namespace
}  // namespace kvport
