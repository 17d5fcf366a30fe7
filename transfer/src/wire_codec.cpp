// SPDX-License-Identifier: Apache-2.0
#include "wire_codec.hpp"

#include <fmt/format.h>

#include <limits>

#include "kvport/platform/error.hpp"

namespace kvport::transfer::wire {

namespace {

[[noreturn]] void throw_for(std::string_view context, std::string_view message) {
  throw InvalidArgument(fmt::format("{}: {}", context, message));
}

void check_limit(std::string_view context, std::size_t n, std::size_t max, std::string_view field) {
  // A u32 on the wire: a limit above it could not be written anyway.
  const std::size_t cap = std::min<std::size_t>(max, std::numeric_limits<std::uint32_t>::max());
  if (n > cap) throw_for(context, fmt::format("'{}' is {}, over the limit of {}", field, n, cap));
}

}  // namespace

void Writer::count(std::size_t n, std::size_t max, std::string_view field) {
  check_limit(context_, n, max, field);
  u32(static_cast<std::uint32_t>(n));
}

void Writer::bytes(std::span<const std::uint8_t> b, std::size_t max, std::string_view field) {
  check_limit(context_, b.size(), max, field);
  u32(static_cast<std::uint32_t>(b.size()));
  raw(b);
}

void Writer::str(std::string_view s, std::size_t max, std::string_view field) {
  bytes({reinterpret_cast<const std::uint8_t*>(s.data()), s.size()}, max, field);
}

void Reader::need(std::size_t n, std::string_view field) const {
  if (remaining() < n) {
    fail(fmt::format("truncated message reading '{}' ({} bytes at offset {}, {} left)", field, n,
                     pos_, remaining()));
  }
}

std::span<const std::uint8_t> Reader::raw(std::size_t n, std::string_view field) {
  need(n, field);
  auto out = b_.subspan(pos_, n);
  pos_ += n;
  return out;
}

std::uint32_t Reader::count(std::string_view field, std::uint32_t max, std::size_t min_bytes_each) {
  const std::uint32_t n = u32(field);
  if (n > max) fail(fmt::format("'{}' is {}, over the limit of {}", field, n, max));
  // n <= 2^32 and min_bytes_each is a small constant: no overflow in 64 bits.
  if (min_bytes_each != 0 && std::uint64_t{n} * min_bytes_each > remaining()) {
    fail(fmt::format("'{}' is {} but only {} bytes are left (at least {} each)", field, n,
                     remaining(), min_bytes_each));
  }
  return n;
}

std::span<const std::uint8_t> Reader::bytes(std::string_view field, std::size_t max) {
  const std::uint32_t n = u32(field);
  if (n > max) fail(fmt::format("'{}' has {} bytes, over the limit of {}", field, n, max));
  if (n > remaining()) {
    fail(fmt::format("truncated message reading '{}' ({} bytes at offset {}, {} left)", field, n,
                     pos_, remaining()));
  }
  return raw(n, field);
}

std::string Reader::str(std::string_view field, std::size_t max) {
  auto s = bytes(field, max);
  return {reinterpret_cast<const char*>(s.data()), s.size()};
}

void Reader::expect_end(std::string_view after) const {
  if (!at_end()) fail(fmt::format("{} trailing bytes after '{}'", remaining(), after));
}

void Reader::fail(std::string_view message) const {
  throw_for(context_, message);
}

}  // namespace kvport::transfer::wire
