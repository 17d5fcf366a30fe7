// SPDX-License-Identifier: Apache-2.0
// Parsing JSON text from an untrusted file, hardened once for every reader
// (the trace reader, mooncake_trace.hpp; the CLI's config.json reader).
#pragma once

#include <cstddef>
#include <functional>
#include <nlohmann/json_fwd.hpp>
#include <string>
#include <string_view>

namespace kvport::sim {

/// How a reader names its input in messages, and what it lets through.
struct JsonInputOptions {
  /// Starts every message: "trace.jsonl:3: ", "HF config 'x.json': ".
  std::string_view prefix;
  /// Names a text that is not JSON: "malformed JSON", "not valid JSON".
  std::string_view malformed = "malformed JSON";
  /// The deepest nesting of arrays and objects accepted (> 0).
  std::size_t max_depth = 16;
  /// Which object keys to keep, by depth (1: the top level) and name; the
  /// others are parsed (so still checked to be JSON) but dropped, so large
  /// fields cost no memory. Empty: keep every key.
  std::function<bool(int depth, const std::string& key)> keep_key;
  /// The most elements (array) or members (object) one container that is
  /// kept may hold; a longer one is an error. 0: no limit. The DOM costs tens
  /// of bytes per value, so a kept array of a few bytes per element (a config
  /// with 5 million layer types in 16 MiB) would cost 30x the text.
  std::size_t max_kept_elements = 0;
};

/// The most bytes of a parser's message quoted in an InvalidArgument.
inline constexpr std::size_t kMaxJsonErrorBytes = 200;

/// Parses `text` as one JSON text. Throws InvalidArgument, one line each:
///   PREFIX MALFORMED: NUL byte at offset N (not a JSON text file)
///       - nlohmann's lexer would end the input at the NUL, so that
///         "{...}\0garbage" would parse;
///   PREFIX JSON nested deeper than D levels - the parser is iterative, but
///       the DOM it builds costs memory per level;
///   PREFIX a JSON array or object of more than N kept elements (N:
///       max_kept_elements), naming the key that holds it;
///   PREFIX MALFORMED: <the parser's message> - without its exception id and
///       "at line 1, " (a one-line text), cut to kMaxJsonErrorBytes without
///       splitting a UTF-8 sequence; invalid UTF-8 in a string is reported
///       here too.
/// Its size is the caller's to bound before reading it. Costs one pass of the
/// parser, O(text).
nlohmann::json parse_json_input(std::string_view text, const JsonInputOptions& options);

}  // namespace kvport::sim
