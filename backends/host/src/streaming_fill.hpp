// SPDX-License-Identifier: Apache-2.0
// Streaming (non-temporal) fills of block regions, and the batch size from
// which the host backend uses them. Internal to the host backend.
#pragma once

#include <cstddef>
#include <cstdint>

namespace kvport::host {

/// Sets `n` bytes at `p` to `value` with streaming stores (the unaligned head
/// and tail with memset). Call streaming_fence() after the last one.
using StreamingFill = void (*)(unsigned char* p, std::uint8_t value, std::size_t n);

/// The best streaming fill this CPU has (AVX-512, else AVX2), or null where
/// there is none (then every fill is a plain memset).
StreamingFill streaming_fill() noexcept;

/// Orders the streaming stores before what the stream does next.
void streaming_fence() noexcept;

/// Batch size (bytes) from which fill_blocks_async streams; see the rule in
/// streaming_fill.cpp. KVPORT_HOST_STREAMING_THRESHOLD (a byte size)
/// overrides it. Throws InvalidArgument for a bad value.
std::size_t streaming_threshold();

}  // namespace kvport::host
