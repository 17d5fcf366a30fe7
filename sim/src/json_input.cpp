#include "kvport/sim/json_input.hpp"

#include <fmt/format.h>

#include <nlohmann/json.hpp>

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
  const json::parser_callback_t filter = [&](int depth, json::parse_event_t event, json& parsed) {
    switch (event) {
      case json::parse_event_t::object_start:
      case json::parse_event_t::array_start:
        if (depth >= static_cast<int>(options.max_depth)) {
          throw InvalidArgument(fmt::format("{}JSON nested deeper than {} levels", options.prefix,
                                            options.max_depth));
        }
        return true;
      case json::parse_event_t::key:
        return !options.keep_key || options.keep_key(depth, parsed.get_ref<const std::string&>());
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
