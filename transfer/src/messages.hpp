// SPDX-License-Identifier: Apache-2.0
// The agent's messages on a connection: the envelope every message starts
// with (magic "KVPT", version, type), and the notification's body. The
// handshake's messages (hello, accept, reject) are in handshake.hpp; the
// byte codec under both is wire_codec.hpp.
#pragma once

#include <cstdint>
#include <span>
#include <vector>

#include "kvport/transfer/agent.hpp"
#include "wire_codec.hpp"

namespace kvport::transfer {

/// The agent's message types (the envelope's type byte).
enum class MsgType : std::uint8_t {
  hello = 1,      ///< connecting side: who it is, its layout, pools and keys
  accept = 2,     ///< listening side: the same, about itself
  reject = 3,     ///< listening side: why not, and its layout
  notify = 4,     ///< a Notification
  heartbeat = 5,  ///< nothing (keeps the peer from timing us out)
  bye = 6,        ///< the agent is closing
};

/// A writer with the envelope of a `type` message written.
wire::Writer open_message(MsgType type);

/// Reads the envelope; returns the type. Throws InvalidArgument for a bad
/// magic, another version or an unknown type.
MsgType read_envelope(wire::Reader& r);

/// A notify message. Throws InvalidArgument when `blocks` and `payload` are
/// over kMaxNotificationBytes together.
std::vector<std::uint8_t> notify_message(std::uint64_t request_id, std::uint32_t kind,
                                         std::span<const BlockId> blocks,
                                         std::span<const std::uint8_t> payload);
/// A notify message's body (after the envelope), for `peer`. Throws
/// InvalidArgument naming the field for a truncated, over-long or oversized
/// body.
Notification parse_notify(wire::Reader& r, PeerId peer);

}  // namespace kvport::transfer
