// SPDX-License-Identifier: Apache-2.0
// PrefixHitMode: how much of a fully cached prompt a sequence table may hit.
#pragma once

namespace kvport {

/// How much of a fully cached prompt BlockTable::reuse_cached_prefix may hit.
enum class PrefixHitMode {
  /// The default, for engines: the hit leaves at least the prompt's last token
  /// to compute, since the model must run on at least one token to give the
  /// logits of the next one (vLLM caps its hit at num_tokens - 1 for the same
  /// reason). Only a block-aligned prompt whose every block is cached is
  /// affected: its hit becomes n - 1 tokens, and the last block, which the
  /// recomputed token writes into, is taken as a private copy of the cached
  /// block (copy-on-write), never the shared cached block itself.
  compute_last_token,
  /// Every cached full block is hit, up to the whole prompt, and shared. For
  /// callers that move or inspect KV without computing anything (nothing may
  /// write into a hit block).
  full,
};

/// "compute_last_token" or "full" ("unknown" outside the enum).
const char* to_string(PrefixHitMode mode) noexcept;

}  // namespace kvport
