// SPDX-License-Identifier: Apache-2.0
// Reading Mooncake request traces, streamed: the input of `kvport replay`.
//
// A trace is JSON Lines, one request per line (the Mooncake format):
//   {"timestamp": 27482, "input_length": 6955, "output_length": 52,
//    "hash_ids": [46, 47, 48, 49, 50, 51, 52, 53, 54, 55, 56, 57, 2353, 2354]}
// `timestamp` is the arrival time in ms, the lengths are tokens, and hash_ids
// has one id per `trace_block_tokens` (512 in Mooncake) tokens of the prompt:
// equal ids at equal positions mean equal content (trace_tokens.hpp turns
// them into token ids).
#pragma once

#include <cstddef>
#include <cstdint>
#include <iosfwd>
#include <memory>
#include <optional>
#include <string>
#include <vector>

namespace kvport::sim {

/// The longest trace line the reader accepts (bytes, without the newline).
/// A longer line is an error naming it: a trace is never read whole, and one
/// runaway line must not be either.
inline constexpr std::size_t kMaxTraceLineBytes = std::size_t{1} << 20;

/// The most tokens one request may have (input_length + output_length):
/// 16 Mi tokens, 64 MiB of token ids. Longer requests are rejected when the
/// trace is read, before anything is allocated for them.
inline constexpr std::size_t kMaxRequestTokens = std::size_t{1} << 24;

/// One request of a trace.
struct TraceRequest {
  double timestamp_ms = 0.0;      ///< arrival, >= 0
  std::size_t input_length = 0;   ///< prompt tokens, >= 1
  std::size_t output_length = 0;  ///< tokens to generate, >= 0
  std::vector<std::uint64_t> hash_ids;
  std::size_t line = 0;  ///< 1-based line of the trace it came from
};

/// Reads a Mooncake trace one line at a time, in chunks of 64 KiB, so that a
/// trace of any size is never held in memory as text. Blank lines (only
/// whitespace) are skipped; fields other than the four above are ignored.
///
/// Every error is an InvalidArgument of one line; an error in a line reads
/// "NAME:LINE: <what>" (malformed JSON - a NUL byte, invalid UTF-8 or nesting
/// deeper than 16 levels included, through the one hardened parse of
/// json_input.hpp -, not an object, a missing field, a wrong type, a negative
/// or fractional length, input_length 0, a request longer than
/// kMaxRequestTokens, hash_ids not an array of integers in [0, 2^64), a
/// negative or non-numeric timestamp, a line longer than kMaxTraceLineBytes).
class MooncakeTraceReader {
 public:
  /// Opens the file at `path`. Throws InvalidArgument "cannot read trace
  /// 'PATH': ..." when it is missing, a directory or unreadable. A FIFO is
  /// read to its end.
  explicit MooncakeTraceReader(const std::string& path);
  /// Reads `in` (tests, generated traces); `name` stands for the file in
  /// messages. `in` must outlive the reader.
  MooncakeTraceReader(std::istream& in, std::string name);
  ~MooncakeTraceReader();
  MooncakeTraceReader(const MooncakeTraceReader&) = delete;
  MooncakeTraceReader& operator=(const MooncakeTraceReader&) = delete;

  /// The next request, or nullopt at the end of the trace.
  std::optional<TraceRequest> next();

  /// The name used in messages (the path, or the name given).
  const std::string& name() const noexcept;

 private:
  struct Source;
  bool next_line(std::string& line);

  std::unique_ptr<Source> source_;
  std::string name_;
  std::size_t line_number_ = 0;
};

/// Every request of the trace at `path`, in file order. Throws
/// InvalidArgument as the reader does, and "trace 'PATH': no requests" for a
/// trace without any.
std::vector<TraceRequest> read_mooncake_trace(const std::string& path);
/// As above, from a stream; `name` stands for the file in messages.
std::vector<TraceRequest> read_mooncake_trace(std::istream& in, const std::string& name);

}  // namespace kvport::sim
