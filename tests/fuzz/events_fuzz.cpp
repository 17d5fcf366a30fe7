// SPDX-License-Identifier: Apache-2.0
// libFuzzer target over the events wire decoder: any input decodes or fails
// with an error (never a crash, a read past the input, or UB under
// address+undefined), and whatever decodes re-encodes, in both forms, to a
// payload that decodes to the same batch.
#include <bit>
#include <cstddef>
#include <cstdint>
#include <cstdlib>

#include "kvport/events/wire.hpp"

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  using namespace kvport::events;
  const DecodeResult r = decode_batch(std::span(reinterpret_cast<const std::byte*>(data), size), 1);
  if (r.ok() != r.error.empty()) std::abort();
  if (!r.ok()) return 0;
  for (EventForm form : {EventForm::map, EventForm::positional}) {
    const DecodeResult again = decode_batch(encode_batch(*r.batch, form), 1);
    if (!again.ok() || again.unknown_events != 0) std::abort();
    // ts may be NaN: compare its bits, then the rest.
    if (std::bit_cast<std::uint64_t>(again.batch->ts) != std::bit_cast<std::uint64_t>(r.batch->ts))
      std::abort();
    kvport::EventBatch a = *again.batch, b = *r.batch;
    a.ts = b.ts = 0;
    if (!(a == b)) std::abort();
  }
  return 0;
}
