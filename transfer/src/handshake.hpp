// SPDX-License-Identifier: Apache-2.0
// The handshake's messages: hello (the connecting side) and accept (the
// listening side) carry who an agent is, its layout (with every KV cache
// group), where its pools are, its registered regions with their keys and
// its transport address; reject carries why and the rejecting side's layout.
// Encoding and parsing only: what the agent does with them is in
// handshake.cpp's half of Agent::State (agent_state.hpp).
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "kvport/transfer/layout.hpp"
#include "messages.hpp"
#include "wire_codec.hpp"

namespace kvport::transfer {

/// A packed UCX memory key or worker address is a few hundred bytes; names
/// and reasons are one line.
inline constexpr std::size_t kMaxKeyBytes = 64 * 1024;
inline constexpr std::uint32_t kMaxRegions = 65536;
/// An encoded layout (4096 layers, the group list).
inline constexpr std::size_t kMaxLayoutBytes = 16u << 20;

/// A registered range and the key a peer uses for it.
struct Region {
  std::uint64_t base = 0;
  std::uint64_t bytes = 0;
  std::vector<std::uint8_t> key;
};

/// What a hello/accept message carries.
struct Hello {
  std::uint64_t uuid = 0;
  std::string name;
  PoolLayout layout;
  PoolAddresses pools;  ///< what the peer addresses (the mirror's, with staging)
  std::vector<Region> regions;
  std::uint64_t scratch_base = 0;
  std::uint64_t scratch_bytes = 0;
  std::vector<std::uint8_t> address;  ///< the transport's, for one-sided operations
  std::string host;                   ///< this boot of this machine (host_identity())
  std::uint32_t pid = 0;
};

/// This boot of this machine: the hostname and the kernel's boot id. Two
/// agents with the same identity share a host (and its process ids).
std::string host_identity();

/// A hello or accept message (`type`) about `self`; the compatibility hash
/// of its layout goes with it. Throws InvalidArgument when a field is over
/// its limit (a name or key over kMaxKeyBytes, more than kMaxRegions).
std::vector<std::uint8_t> hello_message(MsgType type, const Hello& self);
/// A hello/accept body (after the envelope). Throws InvalidArgument naming
/// the field for a truncated, over-long or out-of-range body, a layout that
/// does not decode, a hash that is not the layout's, or a key that is empty
/// or over kMaxKeyBytes (UCX unpacks keys without bounds checks of its own).
Hello parse_hello(wire::Reader& r);

/// A reject message: one line on why, and the rejecting side's layout (so
/// that the other side can name the difference in its own terms).
std::vector<std::uint8_t> reject_message(std::string_view why, const PoolLayout& layout);
/// A reject body: the reason, and the layout when it decodes (nullopt when
/// it does not: the reason still stands).
struct Rejection {
  std::string why;
  std::optional<PoolLayout> layout;
};
/// Throws InvalidArgument naming the field for a truncated body.
Rejection parse_reject(wire::Reader& r);

}  // namespace kvport::transfer
