// SPDX-License-Identifier: Apache-2.0
#include "kvport/sim/trace_tokens.hpp"

#include <algorithm>

#include "kvport/sim/split_mix.hpp"

namespace kvport::sim {
namespace {

// Seeds of the two token families, so that a hash id and a request index of
// the same value do not give the same tokens.
constexpr std::uint64_t kTraceSeed = kGoldenGamma;
constexpr std::uint64_t kUniqueSeed = 0xD1B5'4A32'D192'ED03ull;

constexpr TokenId token_of(std::uint64_t base, std::size_t offset) noexcept {
  return static_cast<TokenId>(mix64(base + offset) >> 33);  // [0, 2^31)
}

}  // namespace

TokenId trace_token(std::uint64_t hash_id, std::size_t offset) noexcept {
  return token_of(mix64(hash_id ^ kTraceSeed), offset);
}

TokenId unique_token(std::size_t request_index, std::size_t position) noexcept {
  return token_of(mix64(static_cast<std::uint64_t>(request_index) ^ kUniqueSeed), position);
}

void sequence_tokens(const TraceRequest& request, std::size_t request_index,
                     std::size_t trace_block_tokens, std::size_t count, std::vector<TokenId>& out) {
  out.resize(count);
  const std::size_t prompt = std::min(count, request.input_length);
  std::size_t pos = 0;
  // Whole trace blocks first: one mixed base per hash id.
  for (std::size_t b = 0; b < request.hash_ids.size() && pos < prompt; ++b) {
    const std::uint64_t base = mix64(request.hash_ids[b] ^ kTraceSeed);
    const std::size_t end = std::min(prompt, pos + trace_block_tokens);
    for (std::size_t offset = 0; pos < end; ++pos, ++offset)
      out[pos] = token_of(base, offset);
  }
  const std::uint64_t base = mix64(static_cast<std::uint64_t>(request_index) ^ kUniqueSeed);
  for (; pos < count; ++pos)
    out[pos] = token_of(base, pos);
}

}  // namespace kvport::sim
