// SPDX-License-Identifier: Apache-2.0
#include "kvport/core/block_hash.hpp"

#include <fmt/format.h>

// XXH3 compiled into this file (xxhash.h's documented inline mode): a block's
// message is under 600 bytes, where the call into libxxhash and its generic
// length dispatch cost as much as the hashing (replay profile,
// docs/performance.md). The hash values are the library's.
#define XXH_INLINE_ALL
#include <xxhash.h>

#include <array>
#include <bit>
#include <cstring>

#include "kvport/platform/error.hpp"

namespace kvport {
namespace {

// The header that chains a block to its parent: parent hash, extra key and a
// word that says whether there is a parent (so that "no parent" differs from a
// parent whose hash happens to be zero).
std::array<std::uint64_t, 4> header(const std::optional<BlockHash>& parent,
                                    std::uint64_t extra_key) {
  return {parent ? parent->low : 0, parent ? parent->high : 0, extra_key, parent ? 1u : 0u};
}

// Byte-reverses on big-endian hosts (std::byteswap is C++23).
template <typename Word>
Word to_little_endian(Word w) {
  if constexpr (std::endian::native == std::endian::big) {
    Word out = 0;
    for (std::size_t i = 0; i < sizeof(Word); ++i) {
      out = static_cast<Word>((out << 8) | (w & 0xFF));
      w = static_cast<Word>(w >> 8);
    }
    return out;
  }
  return w;
}

}  // namespace

std::string BlockHash::to_string() const {
  return fmt::format("{:016x}{:016x}", high, low);
}

BlockHash hash_block(std::optional<BlockHash> parent, std::span<const TokenId> tokens,
                     std::uint64_t extra_key) {
  // One contiguous little-endian message, hashed in one shot: for the block
  // sizes engines use (<= 128 tokens) it stays on the stack, and one-shot
  // XXH3 is several times faster than its streaming API on short inputs.
  constexpr std::size_t kStackTokens = 128;
  const std::array<std::uint64_t, 4> head = header(parent, extra_key);
  const std::size_t bytes = sizeof(head) + tokens.size_bytes();
  std::array<unsigned char, sizeof(head) + kStackTokens * sizeof(TokenId)> stack;
  std::vector<unsigned char> heap;
  unsigned char* message = stack.data();
  if (tokens.size() > kStackTokens) {
    heap.resize(bytes);
    message = heap.data();
  }
  if constexpr (std::endian::native == std::endian::little) {
    std::memcpy(message, head.data(), sizeof(head));
    if (!tokens.empty()) std::memcpy(message + sizeof(head), tokens.data(), tokens.size_bytes());
  } else {
    unsigned char* out = message;
    for (std::uint64_t w : head) {
      w = to_little_endian(w);
      std::memcpy(out, &w, sizeof(w));
      out += sizeof(w);
    }
    for (TokenId t : tokens) {
      t = to_little_endian(t);
      std::memcpy(out, &t, sizeof(t));
      out += sizeof(t);
    }
  }
  const XXH128_hash_t h = XXH3_128bits(message, bytes);
  return BlockHash{h.low64, h.high64};
}

std::vector<BlockHash> hash_full_blocks(std::span<const TokenId> tokens, std::size_t block_size,
                                        std::uint64_t extra_key) {
  if (block_size == 0) throw InvalidArgument("hash_full_blocks: block_size must be > 0");
  std::vector<BlockHash> hashes;
  hashes.reserve(tokens.size() / block_size);
  extend_chain_hashes(hashes, tokens, block_size, extra_key);
  return hashes;
}

void extend_chain_hashes(std::vector<BlockHash>& hashes, std::span<const TokenId> tokens,
                         std::size_t block_size, std::uint64_t extra_key) {
  if (block_size == 0) throw InvalidArgument("extend_chain_hashes: block_size must be > 0");
  const std::size_t full = tokens.size() / block_size;
  if (hashes.size() > full) {
    throw InvalidArgument(
        fmt::format("extend_chain_hashes: {} hashes for {} tokens, which hold {} full blocks of {}",
                    hashes.size(), tokens.size(), full, block_size));
  }
  hashes.reserve(full);
  std::optional<BlockHash> parent =
      hashes.empty() ? std::nullopt : std::optional<BlockHash>(hashes.back());
  for (std::size_t i = hashes.size(); i < full; ++i) {
    parent = hash_block(parent, tokens.subspan(i * block_size, block_size), extra_key);
    hashes.push_back(*parent);
  }
}

}  // namespace kvport
