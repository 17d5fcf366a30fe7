// Replay of a Mooncake request trace over a PrefixCache: the simulation
// behind `kvport replay`, as a library so that benchmarks can call it.
//
// A trace is JSON Lines, one request per line (the Mooncake format):
//   {"timestamp": 27482, "input_length": 6955, "output_length": 52,
//    "hash_ids": [46, 47, 48, 49, 50, 51, 52, 53, 54, 55, 56, 57, 2353, 2354]}
// `timestamp` is the arrival time in ms, the lengths are tokens, and hash_ids
// has one id per `trace_block_tokens` (512 in Mooncake) tokens of the prompt:
// equal ids at equal positions mean equal content. Each id becomes
// deterministic pseudo token ids (trace_token), so requests whose ids agree
// share a prompt prefix, block for block.
//
// The simulation is a discrete-event, single-threaded serving loop; the same
// trace and options always give the same result (apart from the wall-clock
// fields). docs/cli.md (`kvport replay`) describes the model in full.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <iosfwd>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "kvport/core/block_hash.hpp"
#include "kvport/core/paged_kv_cache.hpp"
#include "kvport/platform/backend.hpp"

namespace kvport::cli {

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
/// "NAME:LINE: <what>" (malformed JSON, not an object, a missing field, a
/// wrong type, a negative or fractional length, input_length 0, a request
/// longer than kMaxRequestTokens, hash_ids not an array of integers in
/// [0, 2^64), a negative or non-numeric timestamp, a line longer than
/// kMaxTraceLineBytes).
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

/// The token at `offset` (< trace_block_tokens) of every trace block whose
/// hash id is `hash_id`: a SplitMix64 mix of both, in [0, 2^31).
TokenId trace_token(std::uint64_t hash_id, std::size_t offset) noexcept;

/// The token at `position` of request number `request_index` (its index in
/// the trace, in file order) that no other request has: prompt tokens beyond
/// the last hash id, and every generated token. In [0, 2^31).
TokenId unique_token(std::size_t request_index, std::size_t position) noexcept;

/// Writes the first `count` tokens of the sequence of request number
/// `request_index` to `out` (replacing its contents): the prompt (trace
/// tokens, then unique tokens where hash_ids runs out) and, past
/// input_length, its generated tokens. `trace_block_tokens` > 0.
void sequence_tokens(const TraceRequest& request, std::size_t request_index,
                     std::size_t trace_block_tokens, std::size_t count, std::vector<TokenId>& out);

struct ReplayOptions {
  std::size_t capacity_blocks = 0;       ///< blocks of the KV cache, in [1, kMaxCapacityBlocks]
  std::size_t block_size = 16;           ///< tokens per block, in [1, kMaxBlockSize]
  std::size_t trace_block_tokens = 512;  ///< tokens per hash id (> 0)
  std::size_t concurrency = 64;          ///< most requests running at once (> 0)
  std::uint64_t step_ms = 10;            ///< simulated time of one decode step (> 0)
  /// Run PrefixCache::check_invariants() every this many steps (0: only at
  /// the end). Each check is O(capacity_blocks).
  std::size_t check_every = 0;
  /// Called after each request finishes (completed or rejected) with the
  /// number finished so far and the total. May be empty.
  std::function<void(std::size_t done, std::size_t total)> progress;

  /// 2^22 blocks: the simulation keeps about 100 bytes of bookkeeping per
  /// block (refcount, free list, LRU entry, hash map entry).
  static constexpr std::size_t kMaxCapacityBlocks = std::size_t{1} << 22;
  static constexpr std::size_t kMaxBlockSize = std::size_t{1} << 16;
  /// capacity_blocks * block_size at most 2^28 tokens (1 GiB of pools at 4
  /// bytes per token in the minimal cache).
  static constexpr std::size_t kMaxCapacityTokens = std::size_t{1} << 28;

  /// Throws InvalidArgument naming the option (as its --flag) that is out of
  /// range.
  void validate() const;
};

struct ReplayResult {
  std::size_t requests = 0;   ///< in the trace
  std::size_t completed = 0;  ///< generated all their output tokens
  /// Could not run even alone in an empty cache: blocks for input_length +
  /// output_length tokens > capacity_blocks. Never admitted.
  std::size_t rejected = 0;
  std::size_t preemptions = 0;
  std::uint64_t steps = 0;    ///< decode steps simulated
  double simulated_ms = 0.0;  ///< last finish - first arrival, simulated time

  // Prefix reuse, counted once per request, at its first admission.
  std::uint64_t prompt_blocks = 0;  ///< full blocks of the prompts
  std::uint64_t hit_blocks = 0;     ///< of those, found in the cache
  std::uint64_t prompt_tokens = 0;  ///< input_length of the admitted requests
  std::uint64_t hit_tokens = 0;     ///< hit_blocks * block_size

  /// Tokens prefilled (appended at admission), recomputation included.
  std::uint64_t prefill_tokens = 0;
  /// Of those, tokens a preempted request prefilled again on re-admission.
  std::uint64_t recomputed_tokens = 0;
  std::uint64_t generated_tokens = 0;

  // Block operations.
  std::uint64_t lookups = 0;        ///< prefix lookups (admission attempts, re-admissions included)
  std::uint64_t allocations = 0;    ///< blocks allocated (PagedKvCache allocs, after evictions)
  std::uint64_t releases = 0;       ///< block references given back by sequences
  std::uint64_t evictions = 0;      ///< cached blocks evicted to make room
  std::uint64_t cache_inserts = 0;  ///< full blocks registered in the prefix cache
  std::size_t peak_blocks_in_use = 0;  ///< most blocks running requests held at once
  std::size_t cached_blocks_at_end = 0;

  // Queueing delay, arrival to first admission, of admitted requests (ms).
  double mean_queue_ms = 0.0;
  double max_queue_ms = 0.0;

  double wall_s = 0.0;  ///< host time of the simulation (not of reading the trace)

  /// PrefixCache::check_invariants() at the end, or at the first periodic
  /// check that failed (then the run stopped there: stopped_at_step != 0).
  InvariantReport invariants;
  std::uint64_t stopped_at_step = 0;

  double hit_rate() const noexcept { return ratio(hit_blocks, prompt_blocks); }
  double token_hit_rate() const noexcept { return ratio(hit_tokens, prompt_tokens); }
  /// lookups + allocations + releases.
  std::uint64_t operations() const noexcept { return lookups + allocations + releases; }
  double operations_per_s() const noexcept { return per_s(operations()); }
  double requests_per_s() const noexcept { return per_s(requests); }
  bool ok() const noexcept { return invariants.ok && stopped_at_step == 0; }

 private:
  static double ratio(std::uint64_t a, std::uint64_t b) noexcept {
    return b == 0 ? 0.0 : static_cast<double>(a) / static_cast<double>(b);
  }
  double per_s(std::uint64_t n) const noexcept {
    return wall_s > 0.0 ? static_cast<double>(n) / wall_s : 0.0;
  }
};

/// Replays `requests` (in trace order; the simulation sorts them by
/// timestamp, stably) on a fresh PagedKvCache of options.capacity_blocks
/// blocks on `backend` (1 layer, 1 KV head, head dim 1, f16: its contents do
/// not matter, only the block bookkeeping), with a PrefixCache over it.
/// Throws InvalidArgument for bad options or no requests, and whatever the
/// cache's construction throws (OutOfMemory). The requests must satisfy what
/// the reader checks (input_length >= 1, lengths <= kMaxRequestTokens).
ReplayResult run_replay(std::span<const TraceRequest> requests, const ReplayOptions& options,
                        Backend& backend);
/// As above, on a host backend of its own.
ReplayResult run_replay(std::span<const TraceRequest> requests, const ReplayOptions& options);

}  // namespace kvport::cli
