#include "kvport/core/block_hash.hpp"

#define XXH_STATIC_LINKING_ONLY  // XXH3_state_t on the stack
#include <fmt/format.h>
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
  std::array<std::uint64_t, 4> head = header(parent, extra_key);
  XXH3_state_t state;
  XXH3_128bits_reset(&state);
  if constexpr (std::endian::native == std::endian::little) {
    XXH3_128bits_update(&state, head.data(), sizeof(head));
    XXH3_128bits_update(&state, tokens.data(), tokens.size_bytes());
  } else {
    for (std::uint64_t& w : head)
      w = to_little_endian(w);
    XXH3_128bits_update(&state, head.data(), sizeof(head));
    for (TokenId t : tokens) {
      const TokenId le = to_little_endian(t);
      XXH3_128bits_update(&state, &le, sizeof(le));
    }
  }
  const XXH128_hash_t h = XXH3_128bits_digest(&state);
  return BlockHash{h.low64, h.high64};
}

std::vector<BlockHash> hash_full_blocks(std::span<const TokenId> tokens, std::size_t block_size,
                                        std::uint64_t extra_key) {
  if (block_size == 0) throw InvalidArgument("hash_full_blocks: block_size must be > 0");
  const std::size_t n = tokens.size() / block_size;
  std::vector<BlockHash> hashes;
  hashes.reserve(n);
  std::optional<BlockHash> parent;
  for (std::size_t i = 0; i < n; ++i) {
    parent = hash_block(parent, tokens.subspan(i * block_size, block_size), extra_key);
    hashes.push_back(*parent);
  }
  return hashes;
}

}  // namespace kvport
