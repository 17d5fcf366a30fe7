// SPDX-License-Identifier: Apache-2.0
// The handshake: hello / accept / reject messages, and Agent::State's half
// that acts on them (adopting a peer, rejecting one either way).
#include "handshake.hpp"

#include <unistd.h>

#include <cstdio>

#include <fmt/format.h>

#include "agent_state.hpp"
#include "kvport/platform/log.hpp"

namespace kvport::transfer {

namespace {

// "the peer's memory keys or address are unusable here: ..."
std::string unusable(const Error& e) {
  return fmt::format("the peer's memory keys or address are unusable here: {}", e.what());
}

}  // namespace

std::string host_identity() {
  char name[256] = {};
  ::gethostname(name, sizeof name - 1);
  std::string boot;
  if (FILE* f = std::fopen("/proc/sys/kernel/random/boot_id", "r")) {
    char buf[64] = {};
    if (std::fgets(buf, sizeof buf, f) != nullptr) boot = buf;
    std::fclose(f);
  }
  return std::string(name) + "/" + boot;
}

// ---- messages --------------------------------------------------------------------

std::vector<std::uint8_t> hello_message(MsgType type, const Hello& self) {
  wire::Writer w = open_message(type);
  w.u64(self.uuid);
  w.str(self.name, kMaxKeyBytes, "name");
  w.bytes(encode(self.layout), kMaxLayoutBytes, "layout");
  w.u64(compatibility_hash(self.layout));
  for (std::size_t l = 0; l < self.layout.num_layers; ++l) {
    const PoolAddresses::Pool k = self.pools.at(l, KvPart::k);
    const PoolAddresses::Pool v = self.pools.at(l, KvPart::v);
    w.u64(k.base);
    w.u64(v.base);
    w.u64(k.stride);
    w.u64(v.stride);
  }
  w.count(self.regions.size(), kMaxRegions, "region count");
  for (const Region& r : self.regions) {
    w.u64(r.base);
    w.u64(r.bytes);
    w.bytes(r.key, kMaxKeyBytes, "memory key");
  }
  w.u64(self.scratch_base);
  w.u64(self.scratch_bytes);
  w.bytes(self.address, kMaxKeyBytes, "address");
  w.str(self.host, kMaxKeyBytes, "host");
  w.u32(self.pid);
  return w.take();
}

Hello parse_hello(wire::Reader& r) {
  Hello h;
  h.uuid = r.u64("uuid");
  h.name = r.str("name", kMaxKeyBytes);
  h.layout = decode_pool_layout(r.bytes("layout", kMaxLayoutBytes));
  const std::uint64_t hash = r.u64("compatibility hash");
  if (hash != compatibility_hash(h.layout)) r.fail("compatibility hash mismatch");
  // decode_pool_layout bounds num_layers (4096): 32 bytes each follow.
  if (std::uint64_t{h.layout.num_layers} * 32 > r.remaining())
    r.fail(fmt::format("truncated message reading 'pools' ({} layers)", h.layout.num_layers));
  for (std::size_t l = 0; l < h.layout.num_layers; ++l) {
    h.pools.k_base.push_back(r.u64("k_base"));
    h.pools.v_base.push_back(r.u64("v_base"));
    h.pools.k_stride.push_back(r.u64("k_stride"));
    h.pools.v_stride.push_back(r.u64("v_stride"));
  }
  // A region: base, bytes, a key of at least one byte.
  const std::uint32_t count = r.count("region count", kMaxRegions, 8 + 8 + 4 + 1);
  h.regions.reserve(count);
  for (std::uint32_t i = 0; i < count; ++i) {
    Region region;
    region.base = r.u64("region base");
    region.bytes = r.u64("region bytes");
    // UCX unpacks keys and addresses without bounds checks of its own.
    auto key = r.bytes("memory key", kMaxKeyBytes);
    if (key.empty()) r.fail("an empty memory key");
    region.key.assign(key.begin(), key.end());
    h.regions.push_back(std::move(region));
  }
  h.scratch_base = r.u64("scratch base");
  h.scratch_bytes = r.u64("scratch bytes");
  auto address = r.bytes("address", kMaxKeyBytes);
  h.address.assign(address.begin(), address.end());
  h.host = r.str("host", kMaxKeyBytes);
  h.pid = r.u32("pid");
  r.expect_end("pid");
  return h;
}

std::vector<std::uint8_t> reject_message(std::string_view why, const PoolLayout& layout) {
  wire::Writer w = open_message(MsgType::reject);
  w.str(why.substr(0, kMaxKeyBytes), kMaxKeyBytes, "reason");
  w.bytes(encode(layout), kMaxLayoutBytes, "layout");
  return w.take();
}

Rejection parse_reject(wire::Reader& r) {
  Rejection out;
  out.why = r.str("reason", kMaxKeyBytes);
  try {
    out.layout = decode_pool_layout(r.bytes("layout", kMaxLayoutBytes));
  } catch (const InvalidArgument&) {
    // The reason stands on its own.
  }
  return out;
}

// ---- the agent's side ----------------------------------------------------------------

Hello Agent::State::self() const {
  Hello h;
  h.uuid = uuid;
  h.name = options.name;
  h.layout = agent.layout_;
  h.pools = wire_pools;
  h.regions = regions;
  h.scratch_base = scratch_base;
  h.scratch_bytes = options.scratch_bytes;
  h.address = address;
  h.host = host;
  h.pid = static_cast<std::uint32_t>(::getpid());
  return h;
}

std::vector<std::uint8_t> Agent::State::hello_bytes(MsgType type) const {
  return hello_message(type, self());
}

void Agent::State::adopt(Peer& p, Hello h) {
  try {
    // Same host: no peer error handling on the data connection, so that
    // UCX may use CMA and shared memory; a lost peer's transfers then end
    // when its process is gone (reap_dead_peers) or the flush completes.
    p.same_host = !h.host.empty() && h.host == host;
    p.data = h.address.empty() ? p.conn : transport->connect_to(h.address, !p.same_host);
    by_conn[p.data] = p.id;
    for (const Region& region : h.regions) {
      RemoteRegion rr{region.base, region.bytes, transport->import_remote_key(p.data, region.key)};
      if (h.scratch_bytes > 0 && region.base == h.scratch_base) p.scratch = rr;
      p.regions.push_back(rr);
    }
  } catch (...) {
    if (p.data != 0 && p.data != p.conn) transport->close(p.data, false, nullptr);
    p.data = 0;
    p.regions.clear();
    p.scratch.reset();
    throw;
  }
  p.hello = std::move(h);
  p.status = PeerStatus::connected;
  p.last_heard = Clock::now();
}

void Agent::State::reject_incoming(Peer& p, const std::string& why) {
  ++counters.handshakes_rejected;
  send(p, reject_message(why, agent.layout_));
  p.status = PeerStatus::rejected;
  p.why = why;
  transport->close(p.conn, false, nullptr);  // the reject goes out first
}

void Agent::State::reject_outgoing(Peer& p, const std::string& why) {
  ++counters.handshakes_rejected;
  p.status = PeerStatus::rejected;
  p.why = why;
  transport->close(p.conn, true, nullptr);
}

void Agent::State::on_hello(Peer& p, wire::Reader& r) {
  if (p.status != PeerStatus::handshaking || p.outgoing) r.fail("unexpected hello");
  Hello h = parse_hello(r);
  if (auto why = incompatibility(agent.layout_, h.layout)) {
    log::warn(fmt::format("transfer: {} rejected peer '{}': {}", options.name, h.name, *why));
    reject_incoming(p, *why);
    return;
  }
  try {
    adopt(p, std::move(h));
  } catch (const Error& e) {
    reject_incoming(p, unusable(e));
    return;
  }
  send(p, hello_bytes(MsgType::accept));
}

void Agent::State::on_accept_message(Peer& p, wire::Reader& r) {
  if (p.status != PeerStatus::handshaking || !p.outgoing) r.fail("unexpected accept");
  Hello h = parse_hello(r);
  if (auto why = incompatibility(agent.layout_, h.layout)) {
    reject_outgoing(p, *why);
    return;
  }
  try {
    adopt(p, std::move(h));
  } catch (const Error& e) {
    reject_outgoing(p, unusable(e));
  }
}

void Agent::State::on_reject_message(Peer& p, wire::Reader& r) {
  if (p.status != PeerStatus::handshaking || !p.outgoing) r.fail("unexpected reject");
  Rejection rejection = parse_reject(r);
  std::string why = std::move(rejection.why);
  // Name the difference in our terms ("here" is us) when their layout says it.
  if (rejection.layout) {
    if (auto mine = incompatibility(agent.layout_, *rejection.layout)) why = *mine;
  }
  reject_outgoing(p, why);
}

}  // namespace kvport::transfer
