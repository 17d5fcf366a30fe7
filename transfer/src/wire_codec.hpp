// SPDX-License-Identifier: Apache-2.0
// The one byte codec of transfer/'s wire formats (the agent's messages, the
// pool layout, the disaggregation protocol's notification payloads):
// little-endian fixed-width integers and length-prefixed byte strings.
//
// One error convention: every failure throws InvalidArgument, one line,
// prefixed with the reader's (writer's) context and naming the field, e.g.
// "PoolLayout decode: truncated message reading 'num_layers' (4 bytes at
// offset 6, 2 left)". A reader never reads past its span, and a count a
// peer sent is checked against its limit and against the bytes left before
// anything is allocated for it.
//
// The codec knows no message: a protocol's envelope (magic, version, type)
// is the protocol's (handshake.hpp, layout.cpp).
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <string_view>
#include <vector>

namespace kvport::transfer::wire {

/// Appends little-endian values to a byte vector.
class Writer {
 public:
  /// `context` prefixes errors (e.g. "hello", "PoolLayout encode").
  explicit Writer(std::string_view context) : context_(context) {}

  void u8(std::uint8_t v) { bytes_.push_back(v); }
  void u16(std::uint16_t v) { put(v, 2); }
  void u32(std::uint32_t v) { put(v, 4); }
  void u64(std::uint64_t v) { put(v, 8); }
  /// Raw bytes, no length (a magic, a fixed-size field).
  void raw(std::span<const std::uint8_t> b) { bytes_.insert(bytes_.end(), b.begin(), b.end()); }
  /// A u32 element count. Throws InvalidArgument when n > max (the reader
  /// would refuse it).
  void count(std::size_t n, std::size_t max, std::string_view field);
  /// A u32 length, then the bytes. Throws InvalidArgument when b.size() > max.
  void bytes(std::span<const std::uint8_t> b, std::size_t max, std::string_view field);
  /// bytes() of a string's characters.
  void str(std::string_view s, std::size_t max, std::string_view field);

  const std::vector<std::uint8_t>& data() const noexcept { return bytes_; }
  std::vector<std::uint8_t> take() noexcept { return std::move(bytes_); }

 private:
  void put(std::uint64_t v, int n) {
    for (int i = 0; i < n; ++i)
      bytes_.push_back(static_cast<std::uint8_t>(v >> (8 * i)));
  }
  std::string_view context_;
  std::vector<std::uint8_t> bytes_;
};

/// Reads little-endian values from a span, each bounds-checked and named.
class Reader {
 public:
  /// `context` prefixes errors; the span must outlive the reader (and the
  /// views bytes() returns).
  Reader(std::span<const std::uint8_t> b, std::string_view context) : b_(b), context_(context) {}

  std::uint8_t u8(std::string_view field) { return static_cast<std::uint8_t>(get(1, field)); }
  std::uint16_t u16(std::string_view field) { return static_cast<std::uint16_t>(get(2, field)); }
  std::uint32_t u32(std::string_view field) { return static_cast<std::uint32_t>(get(4, field)); }
  std::uint64_t u64(std::string_view field) { return get(8, field); }
  /// The next `n` bytes as they are (a magic, a fixed-size field).
  std::span<const std::uint8_t> raw(std::size_t n, std::string_view field);
  /// A u32 element count, refused (before the caller allocates) when it
  /// exceeds `max` or when `count * min_bytes_each` exceeds the bytes left.
  std::uint32_t count(std::string_view field, std::uint32_t max, std::size_t min_bytes_each);
  /// A u32 length and that many bytes (a view into the span); refused when
  /// the length exceeds `max` or the bytes left.
  std::span<const std::uint8_t> bytes(std::string_view field, std::size_t max);
  /// bytes() as a string.
  std::string str(std::string_view field, std::size_t max);

  std::size_t position() const noexcept { return pos_; }
  std::size_t remaining() const noexcept { return b_.size() - pos_; }
  bool at_end() const noexcept { return pos_ == b_.size(); }
  /// Throws when bytes are left ("N trailing bytes after 'what'").
  void expect_end(std::string_view after) const;
  /// Throws InvalidArgument("<context>: <message>").
  [[noreturn]] void fail(std::string_view message) const;

 private:
  void need(std::size_t n, std::string_view field) const;
  std::uint64_t get(std::size_t n, std::string_view field) {
    need(n, field);
    std::uint64_t v = 0;
    for (std::size_t i = 0; i < n; ++i)
      v |= std::uint64_t{b_[pos_ + i]} << (8 * i);
    pos_ += n;
    return v;
  }
  std::span<const std::uint8_t> b_;
  std::size_t pos_ = 0;
  std::string_view context_;
};

}  // namespace kvport::transfer::wire
