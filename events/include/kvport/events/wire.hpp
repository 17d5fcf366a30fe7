// SPDX-License-Identifier: Apache-2.0
// vLLM's KV event wire format: the msgpack batch `[ts, events,
// data_parallel_rank]` a publisher sends as the third frame of each message,
// and the 8-byte big-endian sequence number of the second frame. Encoding and
// decoding only; sockets are in publisher.hpp. docs/events.md ("Wire format")
// lists every field and the differences from vLLM.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <string_view>

#include "kvport/core/cache_events.hpp"

namespace kvport::events {

/// How an event is written: a map tagged {"type": "<class name>", ...} (vLLM
/// since mid-2026) or the older positional array ["<class name>", fields...]
/// in vLLM's field order (docs/events.md lists it).
enum class EventForm : std::uint8_t { map, positional };

/// Appends the msgpack encoding of `batch` (its ts, events and
/// data_parallel_rank; `batch.seq` travels in its own frame and is not
/// written) to `out`. The outer batch is always the 3-element array vLLM
/// sends. Throws only std::bad_alloc.
void encode_batch(const EventBatch& batch, EventForm form, std::string& out);

/// encode_batch into a new string.
std::string encode_batch(const EventBatch& batch, EventForm form = EventForm::map);

/// Appends one event's encoding (as it appears in a batch's event list).
void encode_event(const CacheEvent& event, EventForm form, std::string& out);

/// One BlockStored as views (what the publisher's thread has: hashes already
/// as the 64-bit event hashes, its source's fields as strings).
struct StoredEventView {
  std::span<const std::uint64_t> block_hashes;
  std::optional<std::uint64_t> parent_block_hash;
  std::span<const TokenId> token_ids;
  std::uint32_t block_size = 0;
  std::string_view medium = "GPU";
  std::optional<std::string_view> lora_name;
  std::optional<std::uint32_t> group_idx;
  std::optional<std::string_view> kv_cache_spec_kind;
  std::optional<std::uint32_t> kv_cache_spec_sliding_window;
};

/// Writes one batch event by event from views, without the owning events:
/// exactly the bytes encode_batch writes for the same batch (a test checks
/// it), except the kv_cache_spec_kind of a removal or clear, which the owning
/// values (core's BlockRemoved, AllBlocksCleared) have no field for and the
/// decoder skips as an unknown key or trailing element. The publisher's thread encodes with it.
/// Construct with the number of events that follow, call one of stored/removed/cleared per event,
/// then finish(); the bytes are appended to `out` (which holds scratch bytes past them until
/// finish()). Throws only std::bad_alloc (`out` may then hold a partial batch).
///
/// To reuse one buffer without zeroing it again for every batch: construct
/// with `at` (the batch is written from out[at], whatever `out` holds past it
/// is overwritten or left as scratch) and end with finish_view(), which leaves
/// `out`'s size as it is and returns the batch's bytes.
class BatchWriter {
 public:
  BatchWriter(std::string& out, EventForm form, double ts, std::size_t events);
  BatchWriter(std::string& out, std::size_t at, EventForm form, double ts, std::size_t events);
  void stored(const StoredEventView& e);
  /// A BlockRemoved; `kv_cache_spec_kind` (kvport, beyond vLLM's fields: the
  /// group's kind, so that a router that indexes groups by kind applies the
  /// removal to the right one) is written only when set, as a 5th key (map)
  /// or 5th element (positional).
  void removed(std::span<const std::uint64_t> block_hashes, std::string_view medium,
               std::optional<std::uint32_t> group_idx,
               std::optional<std::string_view> kv_cache_spec_kind = std::nullopt);
  /// An AllBlocksCleared; medium, group and kind written only when set.
  void cleared(std::optional<std::string_view> medium, std::optional<std::uint32_t> group_idx,
               std::optional<std::string_view> kv_cache_spec_kind = std::nullopt);
  /// The batch's third element (nil when absent).
  void finish(std::optional<std::int64_t> data_parallel_rank);
  /// finish() without trimming `out`: the batch is out[at, at + size).
  std::string_view finish_view(std::optional<std::int64_t> data_parallel_rank);

 private:
  std::string& out_;
  EventForm form_;
  std::size_t at_ = 0;   // where the batch starts
  std::size_t end_ = 0;  // where the next event goes (out_ may be longer until finish)
};

/// What decode_batch returns: the batch, or why there is none.
struct DecodeResult {
  /// Set when the payload decoded; its `seq` is the `seq` passed in.
  std::optional<EventBatch> batch;
  /// Events of an unknown type (a tag other than the three) skipped, as
  /// vLLM's consumers skip them; the rest of the batch is kept.
  std::size_t unknown_events = 0;
  /// Empty on success; otherwise what was wrong and where ("event 3:
  /// block_hashes: expected an array, got a string").
  std::string error;

  bool ok() const noexcept { return batch.has_value(); }
};

/// Decodes a batch payload: the outer batch as a 3-element array or as a map
/// {"ts", "events", "data_parallel_rank"}; each event as a tagged map or a
/// positional array (both forms may be mixed). Unknown map keys and extra
/// trailing positional fields are ignored; missing optional fields read as
/// absent. Never throws (std::bad_alloc aside) and never reads past
/// `payload`: wrong types, truncation, trailing bytes, lengths larger than
/// the remaining input, nesting deeper than 32 and integers out of range
/// give an error.
DecodeResult decode_batch(std::span<const std::byte> payload, std::uint64_t seq = 0);
/// decode_batch over the bytes of a string.
DecodeResult decode_batch(std::string_view payload, std::uint64_t seq = 0);

/// The sequence frame: `seq` as 8 bytes big-endian.
std::array<std::byte, 8> encode_seq(std::uint64_t seq) noexcept;
/// The replay terminator's sequence frame: -1 as a signed 8-byte big-endian
/// integer (all bytes 0xff), as vLLM sends it.
inline constexpr std::uint64_t end_of_replay_seq = ~std::uint64_t{0};
/// Parses a sequence frame; nullopt unless it is exactly 8 bytes.
std::optional<std::uint64_t> decode_seq(std::span<const std::byte> frame) noexcept;

}  // namespace kvport::events
