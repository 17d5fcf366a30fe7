// SPDX-License-Identifier: Apache-2.0
// Small string helpers shared by the command-line parsers.
#pragma once

#include <algorithm>
#include <cctype>
#include <cerrno>
#include <cstddef>
#include <string>
#include <string_view>
#include <system_error>

namespace kvport::cli::text {

/// `s` without leading and trailing whitespace.
inline std::string_view trim(std::string_view s) noexcept {
  while (!s.empty() && std::isspace(static_cast<unsigned char>(s.front())))
    s.remove_prefix(1);
  while (!s.empty() && std::isspace(static_cast<unsigned char>(s.back())))
    s.remove_suffix(1);
  return s;
}

/// ASCII lower case.
inline std::string lower(std::string_view s) {
  std::string out(s);
  std::transform(out.begin(), out.end(), out.begin(),
                 [](unsigned char c) { return static_cast<char>(std::tolower(c)); });
  return out;
}

namespace detail {

// The length of the well-formed UTF-8 sequence at the start of `s` (1 to 4),
// or 0 when it is not one: a stray continuation byte, an overlong form, a
// surrogate, a code point above U+10FFFF or a sequence cut short.
inline std::size_t utf8_sequence_length(std::string_view s) noexcept {
  const auto byte = [&](std::size_t i) { return static_cast<unsigned char>(s[i]); };
  const unsigned char lead = byte(0);
  if (lead < 0x80) return 1;
  std::size_t length = 0;
  unsigned char low = 0x80, high = 0xBF;  // the range of the second byte
  if (lead >= 0xC2 && lead <= 0xDF) {
    length = 2;
  } else if (lead >= 0xE0 && lead <= 0xEF) {
    length = 3;
    if (lead == 0xE0) low = 0xA0;   // overlong
    if (lead == 0xED) high = 0x9F;  // surrogates
  } else if (lead >= 0xF0 && lead <= 0xF4) {
    length = 4;
    if (lead == 0xF0) low = 0x90;   // overlong
    if (lead == 0xF4) high = 0x8F;  // above U+10FFFF
  } else {
    return 0;
  }
  if (s.size() < length || byte(1) < low || byte(1) > high) return 0;
  for (std::size_t i = 2; i < length; ++i) {
    if (byte(i) < 0x80 || byte(i) > 0xBF) return 0;
  }
  return length;
}

}  // namespace detail

/// The longest error line kvport prints, in bytes of the message after
/// "kvport: error: ". Messages quote user input (a preset name, a config
/// file's offending token), which may be megabytes long.
inline constexpr std::size_t kMaxErrorLineBytes = 1000;

/// `s` as one printable line. Every run of line breaks and tabs becomes "; "
/// (trailing ones are dropped): error messages from libraries (CLI11, JSON)
/// can span lines, and kvport promises one error line. Other control bytes
/// (NUL, ESC, DEL, C1, ...) and bytes that are not well-formed UTF-8 are written
/// as "\xNN", so that user input quoted in a message can neither break the
/// line nor drive the terminal. Longer than `max_bytes`, the text is cut at a
/// character boundary and ends in "...".
inline std::string one_line(std::string_view s, std::size_t max_bytes = kMaxErrorLineBytes) {
  static constexpr char kHex[] = "0123456789abcdef";
  std::string out;
  bool pending = false;
  for (std::size_t i = 0; i < s.size();) {
    const char c = s[i];
    if (c == '\n' || c == '\r' || c == '\t') {
      pending = true;
      ++i;
      continue;
    }
    std::string piece;
    const auto u = static_cast<unsigned char>(c);
    const std::size_t length = detail::utf8_sequence_length(s.substr(i));
    // C1 controls (U+0080..U+009F, "\xc2\x80".."\xc2\x9f") are escaped too.
    const bool c1 = length == 2 && u == 0xC2 && static_cast<unsigned char>(s[i + 1]) < 0xA0;
    if (u < 0x20 || u == 0x7F || length == 0 || c1) {
      piece = {'\\', 'x', kHex[u >> 4], kHex[u & 0xF]};
      i += 1;
    } else {
      piece = std::string(s.substr(i, length));
      i += length;
    }
    if (pending && !out.empty()) piece = "; " + piece;
    pending = false;
    if (out.size() + piece.size() > max_bytes) {
      out += "...";
      break;
    }
    out += piece;
  }
  return out;
}

}  // namespace kvport::cli::text
