// SPDX-License-Identifier: Apache-2.0
// The UCX transport on its own, two transports in one process: the bulk
// data paths a same-host connection uses (process_vm_readv/writev, the
// default; rendezvous active messages with KVPORT_UCX_BULK=am; RMA with
// KVPORT_UCX_BULK=rma), byte-exact reads and writes of several ranges, done
// exactly once; a range outside the peer's registered memory refused by the
// rendezvous path without a byte moved, and a read ended by closing its
// connection before the peer answered (nothing lands after); an unmapped
// range failing the direct copy; post_baseline staying on UCX. Every wait is
// bounded.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <chrono>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "kvport/transfer/transport.hpp"

namespace kvport::transfer {
namespace {

using ::testing::HasSubstr;
using Clock = std::chrono::steady_clock;

// One transport and a registered buffer of `bytes`, filled with `seed`.
struct End {
  TransportEvents events;
  std::unique_ptr<Transport> transport;
  std::vector<std::uint8_t> buffer;
  std::vector<std::uint8_t> key;
  explicit End(std::size_t bytes, std::uint8_t seed) : buffer(bytes) {
    for (std::size_t i = 0; i < bytes; ++i)
      buffer[i] = static_cast<std::uint8_t>(seed + i * 7 + (i >> 12));
    transport = make_ucx_transport(events);
    key = transport->register_memory(base(), bytes, MemoryKind::host);
  }
  std::uint64_t base() const { return reinterpret_cast<std::uint64_t>(buffer.data()); }
};

// `reader` connected to `peer` as the agent connects a same-host data peer.
struct Pair {
  End reader{1 << 22, 1};
  End peer{1 << 22, 101};
  ConnId conn = 0;
  std::uint64_t key = 0;
  Pair() {
    conn = reader.transport->connect_to(peer.transport->local_address(), false);
    key = reader.transport->import_remote_key(conn, peer.key);
  }
  // Progresses both until `pred` or 10 s.
  template <class Pred>
  bool until(Pred pred) {
    const auto deadline = Clock::now() + std::chrono::seconds(10);
    while (!pred() && Clock::now() < deadline) {
      reader.transport->progress();
      peer.transport->progress();
    }
    return pred();
  }
  // Progresses both for 300 ms.
  void settle() {
    const auto end = Clock::now() + std::chrono::milliseconds(300);
    while (Clock::now() < end) {
      reader.transport->progress();
      peer.transport->progress();
    }
  }
};

struct Outcome {
  int calls = 0;
  bool ok = false;
  std::string why;
};

std::function<void(bool, const std::string&)> record(Outcome& o) {
  return [&o](bool ok, const std::string& why) {
    ++o.calls;
    o.ok = ok;
    o.why = why;
  };
}

// Three ranges of different sizes, in different places of both buffers.
std::vector<RmaOp> ranges(const End& local, const End& remote) {
  return {{local.base() + 0, remote.base() + 4096, 1 << 20},
          {local.base() + (2 << 20), remote.base() + (3 << 20), 65536},
          {local.base() + (3 << 20), remote.base() + 0, 777}};
}

void expect_moved(const std::vector<RmaOp>& ops, const End& to, const End& from, bool to_is_local) {
  for (const RmaOp& op : ops) {
    const std::uint64_t dst = to_is_local ? op.local : op.remote;
    const std::uint64_t src = to_is_local ? op.remote : op.local;
    EXPECT_EQ(std::memcmp(to.buffer.data() + (dst - to.base()),
                          from.buffer.data() + (src - from.base()), op.bytes),
              0);
  }
}

// The bulk path's settings: KVPORT_UCX_BULK, and KVPORT_UCX_BULK_MIN_BYTES
// (null: the default).
struct Bulk {
  const char* path;
  const char* min_bytes;
};

void set_bulk(const Bulk& b) {
  ::setenv("KVPORT_UCX_BULK", b.path, 1);
  if (b.min_bytes != nullptr) ::setenv("KVPORT_UCX_BULK_MIN_BYTES", b.min_bytes, 1);
}

void unset_bulk() {
  ::unsetenv("KVPORT_UCX_BULK");
  ::unsetenv("KVPORT_UCX_BULK_MIN_BYTES");
}

class UcxTransportBulk : public ::testing::TestWithParam<Bulk> {
 protected:
  void SetUp() override { set_bulk(GetParam()); }
  void TearDown() override { unset_bulk(); }
};

TEST_P(UcxTransportBulk, DescriptionNamesTheBulkPath) {
  Pair p;
  const std::string path = GetParam().path;
  EXPECT_THAT(p.reader.transport->description(),
              HasSubstr(path == "rma"   ? "RMA gets and puts"
                        : path == "cma" ? "process_vm_readv/writev"
                                        : "rendezvous active messages"));
}

TEST_P(UcxTransportBulk, ReadOfSeveralRangesIsByteExactAndDoneOnce) {
  Pair p;
  const auto ops = ranges(p.reader, p.peer);
  const std::vector<std::uint64_t> keys(ops.size(), p.key);
  Outcome o;
  p.reader.transport->post(p.conn, Direction::read, ops, keys, record(o));
  ASSERT_TRUE(p.until([&] { return o.calls > 0; }));
  EXPECT_TRUE(o.ok) << o.why;
  expect_moved(ops, p.reader, p.peer, true);
  p.settle();  // a second callback would show now
  EXPECT_EQ(o.calls, 1);
}

TEST_P(UcxTransportBulk, WriteOfSeveralRangesIsByteExactAndDoneOnce) {
  Pair p;
  const auto ops = ranges(p.reader, p.peer);
  const std::vector<std::uint64_t> keys(ops.size(), p.key);
  Outcome o;
  p.reader.transport->post(p.conn, Direction::write, ops, keys, record(o));
  ASSERT_TRUE(p.until([&] { return o.calls > 0; }));
  EXPECT_TRUE(o.ok) << o.why;
  expect_moved(ops, p.peer, p.reader, false);
  p.settle();
  EXPECT_EQ(o.calls, 1);
}

// The direct copy; every range as a rendezvous message; ranges under 256 KiB
// as RMA and the rest as rendezvous; every range RMA.
INSTANTIATE_TEST_SUITE_P(Paths, UcxTransportBulk,
                         ::testing::Values(Bulk{"cma", nullptr}, Bulk{"am", "0"},
                                           Bulk{"am", "262144"}, Bulk{"rma", nullptr}));

// The rendezvous path checks every range against the memory its owner
// registered (the RMA path has the memory key's bounds for that).
class UcxTransportAm : public ::testing::Test {
 protected:
  void SetUp() override { set_bulk({"am", "0"}); }
  void TearDown() override { unset_bulk(); }
};

TEST_F(UcxTransportAm, ReadOutsideThePeersMemoryFailsAndMovesNothing) {
  Pair p;
  std::vector<std::uint8_t> outside(4096, 0xEE);
  const std::vector<std::uint8_t> before = p.reader.buffer;
  const std::vector<RmaOp> ops = {
      {p.reader.base(), p.peer.base() + 4096, 4096},
      {p.reader.base() + 8192, reinterpret_cast<std::uint64_t>(outside.data()), 4096}};
  const std::vector<std::uint64_t> keys(ops.size(), p.key);
  Outcome o;
  p.reader.transport->post(p.conn, Direction::read, ops, keys, record(o));
  ASSERT_TRUE(p.until([&] { return o.calls > 0; }));
  EXPECT_FALSE(o.ok);
  EXPECT_FALSE(o.why.empty());
  EXPECT_EQ(o.calls, 1);
  EXPECT_TRUE(std::equal(before.begin() + 8192, before.begin() + 8192 + 4096,
                         p.reader.buffer.begin() + 8192));
}

TEST_F(UcxTransportAm, WriteOutsideThePeersMemoryFailsAndMovesNothing) {
  Pair p;
  std::vector<std::uint8_t> outside(4096, 0xEE);
  const std::vector<RmaOp> ops = {
      {p.reader.base(), reinterpret_cast<std::uint64_t>(outside.data()), 4096}};
  const std::vector<std::uint64_t> keys(ops.size(), p.key);
  Outcome o;
  p.reader.transport->post(p.conn, Direction::write, ops, keys, record(o));
  ASSERT_TRUE(p.until([&] { return o.calls > 0; }));
  EXPECT_FALSE(o.ok);
  EXPECT_EQ(o.calls, 1);
  EXPECT_EQ(outside, std::vector<std::uint8_t>(4096, 0xEE));
}

TEST_F(UcxTransportAm, CloseBeforeThePeerAnswersEndsTheReadAndNothingLandsAfter) {
  Pair p;
  // Let the connection's wireup finish first, so only the read is pending.
  Outcome warm;
  const std::vector<RmaOp> one = {{p.reader.base(), p.peer.base(), 64}};
  p.reader.transport->post(p.conn, Direction::read, one, std::vector<std::uint64_t>{p.key},
                           record(warm));
  ASSERT_TRUE(p.until([&] { return warm.calls > 0; }));
  ASSERT_TRUE(warm.ok) << warm.why;
  std::memset(p.reader.buffer.data(), 0, p.reader.buffer.size());

  const auto ops = ranges(p.reader, p.peer);
  const std::vector<std::uint64_t> keys(ops.size(), p.key);
  Outcome o;
  bool closed = false;
  p.reader.transport->post(p.conn, Direction::read, ops, keys, record(o));
  p.reader.transport->close(p.conn, true, [&] { closed = true; });  // the peer never progressed
  const auto deadline = Clock::now() + std::chrono::seconds(10);
  while ((!closed || o.calls == 0) && Clock::now() < deadline)
    p.reader.transport->progress();
  ASSERT_EQ(o.calls, 1);
  EXPECT_FALSE(o.ok);
  ASSERT_TRUE(closed);
  // The peer now serves the read it was asked for: it finds no one to take it.
  p.settle();
  EXPECT_EQ(o.calls, 1);
  EXPECT_EQ(p.reader.buffer, std::vector<std::uint8_t>(p.reader.buffer.size(), 0));
}

class UcxTransportCma : public ::testing::Test {
 protected:
  void SetUp() override { set_bulk({"cma", nullptr}); }
  void TearDown() override { unset_bulk(); }
};

TEST_F(UcxTransportCma, AnUnmappedRangeFailsTheTransferOnce) {
  Pair p;
  const std::vector<RmaOp> ops = {{p.reader.base(), p.peer.base(), 4096},
                                  {p.reader.base() + 4096, 4096, 4096}};  // page 1: unmapped
  const std::vector<std::uint64_t> keys(ops.size(), p.key);
  Outcome o;
  p.reader.transport->post(p.conn, Direction::read, ops, keys, record(o));
  ASSERT_TRUE(p.until([&] { return o.calls > 0; }));
  EXPECT_FALSE(o.ok);
  EXPECT_THAT(o.why, HasSubstr("copying the peer's memory failed"));
  p.settle();
  EXPECT_EQ(o.calls, 1);
}

// The raw baseline is UCX's: the rendezvous path, which refuses memory its
// owner did not register, where the direct copy (trusting the agent's
// checks) reads any mapped address.
TEST_F(UcxTransportCma, PostBaselineStaysOnUcx) {
  Pair p;
  std::vector<std::uint8_t> unregistered(4096, 0x5A);
  const std::vector<RmaOp> ops = {
      {p.reader.base(), reinterpret_cast<std::uint64_t>(unregistered.data()), 4096}};
  const std::vector<std::uint64_t> keys(ops.size(), p.key);
  Outcome direct;
  p.reader.transport->post(p.conn, Direction::read, ops, keys, record(direct));
  ASSERT_TRUE(p.until([&] { return direct.calls > 0; }));
  EXPECT_TRUE(direct.ok) << direct.why;
  EXPECT_EQ(p.reader.buffer[0], 0x5A);
  Outcome baseline;
  p.reader.transport->post_baseline(p.conn, Direction::read, ops, keys, record(baseline));
  ASSERT_TRUE(p.until([&] { return baseline.calls > 0; }));
  EXPECT_FALSE(baseline.ok);
  EXPECT_EQ(baseline.calls, 1);
  // And a registered range moves through it byte-exact.
  const auto good = ranges(p.reader, p.peer);
  Outcome moved;
  p.reader.transport->post_baseline(p.conn, Direction::read, good,
                                    std::vector<std::uint64_t>(good.size(), p.key), record(moved));
  ASSERT_TRUE(p.until([&] { return moved.calls > 0; }));
  EXPECT_TRUE(moved.ok) << moved.why;
  expect_moved(good, p.reader, p.peer, true);
}

// A peer address whose nonce does not read back (another process with that
// id, another pid namespace): no direct copies on that connection, UCX's
// rendezvous path instead (which refuses unregistered memory).
TEST_F(UcxTransportCma, AnAddressWhoseNonceDoesNotReadBackGoesThroughUcx) {
  End reader{1 << 16, 1};
  End peer{1 << 16, 2};
  std::vector<std::uint8_t> address = peer.transport->local_address();
  ASSERT_GT(address.size(), 24u);
  address[address.size() - 16] ^= 0xFF;  // the nonce's first byte
  const ConnId conn = reader.transport->connect_to(address, false);
  const std::uint64_t key = reader.transport->import_remote_key(conn, peer.key);
  std::vector<std::uint8_t> unregistered(4096, 0x5A);
  const std::vector<RmaOp> ops = {
      {reader.base(), reinterpret_cast<std::uint64_t>(unregistered.data()), 4096}};
  Outcome o;
  reader.transport->post(conn, Direction::read, ops, std::vector<std::uint64_t>{key}, record(o));
  const auto deadline = Clock::now() + std::chrono::seconds(10);
  while (o.calls == 0 && Clock::now() < deadline) {
    reader.transport->progress();
    peer.transport->progress();
  }
  ASSERT_EQ(o.calls, 1);
  EXPECT_FALSE(o.ok);
  EXPECT_NE(reader.buffer[0], 0x5A);
}

// Ranges larger than one system call's share (4 MiB): each call resumes
// where the previous one stopped, inside a range too, and the transfer ends
// once.
TEST_F(UcxTransportCma, ALargeTransferIsCopiedInPiecesAndIsByteExact) {
  End reader{40 << 20, 1};
  End peer{40 << 20, 77};
  const ConnId conn = reader.transport->connect_to(peer.transport->local_address(), false);
  const std::uint64_t key = reader.transport->import_remote_key(conn, peer.key);
  const std::vector<RmaOp> ops = {{reader.base(), peer.base() + (20 << 20), 20 << 20},
                                  {reader.base() + (20 << 20), peer.base() + 12345, 19 << 20},
                                  {reader.base() + (39 << 20), peer.base() + (39 << 20), 1}};
  Outcome o;
  reader.transport->post(conn, Direction::read, ops, std::vector<std::uint64_t>(3, key), record(o));
  EXPECT_EQ(o.calls, 0);  // post returns before the copy
  const auto deadline = Clock::now() + std::chrono::seconds(10);
  while (o.calls == 0 && Clock::now() < deadline) {
    reader.transport->progress();
    peer.transport->progress();
  }
  ASSERT_EQ(o.calls, 1);
  EXPECT_TRUE(o.ok) << o.why;
  expect_moved(ops, reader, peer, true);
}

}  // namespace
}  // namespace kvport::transfer
