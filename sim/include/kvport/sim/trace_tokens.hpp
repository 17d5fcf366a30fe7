// SPDX-License-Identifier: Apache-2.0
// Token synthesis for trace replay: deterministic pseudo token ids from a
// trace's hash ids, so that requests whose ids agree share a prompt prefix,
// block for block, and every other token is unique to its request.
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

#include "kvport/core/block_hash.hpp"
#include "kvport/sim/mooncake_trace.hpp"

namespace kvport::sim {

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

}  // namespace kvport::sim
