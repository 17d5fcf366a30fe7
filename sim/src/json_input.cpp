// SPDX-License-Identifier: Apache-2.0
#include "kvport/sim/json_input.hpp"

#include <fmt/format.h>

#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "kvport/platform/error.hpp"

namespace kvport::sim {
namespace {

using nlohmann::json;

// nlohmann's messages start with "[json.exception.parse_error.101] parse
// error at line 1, " - the id says nothing, and neither does line 1 of a
// one-line text.
std::string parser_message(const json::exception& e) {
  std::string text = e.what();
  if (const auto close = text.find("] ");
      text.starts_with("[json.exception.") && close != std::string::npos) {
    text.erase(0, close + 2);
  }
  constexpr std::string_view kLineOne = "parse error at line 1, ";
  if (text.starts_with(kLineOne)) text.erase(0, kLineOne.size());
  // "last read: '...'" quotes the token, which may be most of the text.
  if (text.size() > kMaxJsonErrorBytes) {
    std::size_t cut = kMaxJsonErrorBytes;
    while (cut > 0 && (static_cast<unsigned char>(text[cut]) & 0xC0) == 0x80)
      --cut;  // not inside a UTF-8 sequence
    text = text.substr(0, cut) + "...";
  }
  return text;
}

}  // namespace

json parse_json_input(std::string_view text, const JsonInputOptions& options) {
  if (const std::size_t nul = text.find('\0'); nul != std::string_view::npos) {
    throw InvalidArgument(fmt::format("{}{}: NUL byte at offset {} (not a JSON text file)",
                                      options.prefix, options.malformed, nul));
  }
  // What is kept of each open container, by level (the root value is at
  // level 1; the parser reports the events of a level-L container's elements
  // and keys at depth L, its own start at depth L - 1). The end events of a
  // discarded container are not reported, so a level's entry is reset at
  // each start rather than popped at its end.
  struct Level {
    bool kept = true;      // the container is in the DOM
    bool array = false;    // else an object
    bool key_kept = true;  // an object's current member is kept
    std::size_t elements = 0;
    std::string key;            // the member of an ancestor object that holds it
    std::string key_of_member;  // an object's current member
  };
  std::vector<Level> levels(options.max_depth + 2);
  levels[0].array = true;  // the root value is always kept
  const auto count = [&](std::size_t level) {
    Level& l = levels[level];
    if (options.max_kept_elements == 0 || !l.kept) return;
    if (++l.elements > options.max_kept_elements) {
      const std::string where =
          l.key.empty() ? std::string() : fmt::format(" ('{}')", l.key.substr(0, 64));
      throw InvalidArgument(fmt::format("{}a JSON {} of more than {} elements{}", options.prefix,
                                        l.array ? "array" : "object", options.max_kept_elements,
                                        where));
    }
  };
  const json::parser_callback_t filter = [&](int depth, json::parse_event_t event, json& parsed) {
    const auto level = static_cast<std::size_t>(depth);
    switch (event) {
      case json::parse_event_t::object_start:
      case json::parse_event_t::array_start: {
        if (depth >= static_cast<int>(options.max_depth)) {
          throw InvalidArgument(fmt::format("{}JSON nested deeper than {} levels", options.prefix,
                                            options.max_depth));
        }
        const Level& parent = levels[level];
        Level& opened = levels[level + 1];
        opened.kept = parent.kept && (parent.array || parent.key_kept);
        opened.array = event == json::parse_event_t::array_start;
        opened.key_kept = true;
        opened.elements = 0;
        opened.key = parent.array ? parent.key : parent.key_of_member;
        if (parent.array) count(level);
        return true;
      }
      case json::parse_event_t::key: {
        const std::string& key = parsed.get_ref<const std::string&>();
        Level& l = levels[level];
        l.key_kept = !options.keep_key || options.keep_key(depth, key);
        if (l.key_kept) {
          l.key_of_member = key;
          count(level);
        }
        return l.key_kept;
      }
      case json::parse_event_t::value:
        if (levels[level].array) count(level);
        return true;
      default:
        return true;
    }
  };
  try {
    return json::parse(text, filter);
  } catch (const json::exception& e) {
    throw InvalidArgument(
        fmt::format("{}{}: {}", options.prefix, options.malformed, parser_message(e)));
  }
}

}  // namespace kvport::sim
