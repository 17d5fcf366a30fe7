// SPDX-License-Identifier: Apache-2.0
// Content hashes of full KV-cache blocks, chained from the first block of a
// sequence, for prefix caching.
#pragma once

#include <cstddef>
#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <vector>

namespace kvport {

/// A token id as the engine's tokenizer produced it.
using TokenId = std::uint32_t;

/// XXH3-128 of one full block: its parent's hash (absent for a sequence's
/// first block), an extra key (a LoRA adapter or other id that changes the KV
/// contents; 0 for none) and the block's token ids. Two blocks with the same
/// hash are treated as holding the same KV data, so the hash is 128 bits: at
/// 2^32 cached blocks the chance of any collision is about 2^-65.
struct BlockHash {
  std::uint64_t low = 0;
  std::uint64_t high = 0;

  friend bool operator==(const BlockHash&, const BlockHash&) = default;
  /// 32 lowercase hex digits, high half first.
  std::string to_string() const;
};

/// For hash maps: the low 64 bits are already uniformly distributed.
struct BlockHashHasher {
  std::size_t operator()(const BlockHash& h) const noexcept {
    return static_cast<std::size_t>(h.low);
  }
};

/// The hash of one block whose tokens are `tokens`, chained on `parent`.
/// Deterministic across runs, processes and machines of either endianness
/// (token ids are hashed as little-endian 32-bit words).
BlockHash hash_block(std::optional<BlockHash> parent, std::span<const TokenId> tokens,
                     std::uint64_t extra_key = 0);

/// The chained hashes of every full block of `tokens` (tokens.size() /
/// block_size of them; a trailing partial block has none). Throws
/// InvalidArgument for block_size == 0.
std::vector<BlockHash> hash_full_blocks(std::span<const TokenId> tokens, std::size_t block_size,
                                        std::uint64_t extra_key = 0);

/// Extends `hashes`, the chained hashes of the first hashes.size() full
/// blocks of `tokens`, to every full block of `tokens` (the one way a
/// sequence table hashes its newly full blocks; hash_full_blocks is it from
/// empty). Allocates only past hashes.capacity(): reserve
/// tokens.size() / block_size first and it does not throw. Throws
/// InvalidArgument, changing nothing, for block_size == 0 or more hashes
/// than tokens.size() / block_size.
void extend_chain_hashes(std::vector<BlockHash>& hashes, std::span<const TokenId> tokens,
                         std::size_t block_size, std::uint64_t extra_key = 0);

}  // namespace kvport
