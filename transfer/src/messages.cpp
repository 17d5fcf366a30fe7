// SPDX-License-Identifier: Apache-2.0
#include "messages.hpp"

#include <fmt/format.h>

#include "kvport/platform/error.hpp"

namespace kvport::transfer {

namespace {

constexpr std::uint32_t kMagic = 0x5450564b;  // "KVPT"
constexpr std::uint8_t kVersion = 1;

}  // namespace

wire::Writer open_message(MsgType type) {
  wire::Writer w("message encode");
  w.u32(kMagic);
  w.u8(kVersion);
  w.u8(static_cast<std::uint8_t>(type));
  return w;
}

MsgType read_envelope(wire::Reader& r) {
  if (r.u32("magic") != kMagic) r.fail("bad magic");
  const std::uint8_t version = r.u8("version");
  if (version != kVersion)
    r.fail(fmt::format("unsupported version {} (this build speaks {})", version, kVersion));
  const std::uint8_t type = r.u8("type");
  if (type < static_cast<std::uint8_t>(MsgType::hello) ||
      type > static_cast<std::uint8_t>(MsgType::bye)) {
    r.fail(fmt::format("unknown message type {}", type));
  }
  return static_cast<MsgType>(type);
}

std::vector<std::uint8_t> notify_message(std::uint64_t request_id, std::uint32_t kind,
                                         std::span<const BlockId> blocks,
                                         std::span<const std::uint8_t> payload) {
  if (blocks.size() * sizeof(BlockId) + payload.size() > kMaxNotificationBytes) {
    throw InvalidArgument(fmt::format("notify: {} blocks and {} payload bytes exceed {} bytes",
                                      blocks.size(), payload.size(), kMaxNotificationBytes));
  }
  wire::Writer w = open_message(MsgType::notify);
  w.u64(request_id);
  w.u32(kind);
  w.count(blocks.size(), kMaxNotificationBytes / sizeof(BlockId), "block count");
  for (BlockId b : blocks)
    w.u32(b);
  w.bytes(payload, kMaxNotificationBytes, "payload");
  return w.take();
}

Notification parse_notify(wire::Reader& r, PeerId peer) {
  Notification n;
  n.peer = peer;
  n.request_id = r.u64("request_id");
  n.kind = r.u32("kind");
  const std::uint32_t count =
      r.count("block count", kMaxNotificationBytes / sizeof(BlockId), sizeof(BlockId));
  n.blocks.reserve(count);
  for (std::uint32_t i = 0; i < count; ++i)
    n.blocks.push_back(r.u32("block"));
  auto payload = r.bytes("payload", kMaxNotificationBytes);
  n.payload.assign(payload.begin(), payload.end());
  r.expect_end("payload");
  return n;
}

}  // namespace kvport::transfer
