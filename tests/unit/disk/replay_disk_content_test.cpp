// SPDX-License-Identifier: Apache-2.0
// `kvport replay` with a disk tier (sim::run_replay over a DiskTier): every
// block it leaves on disk holds content a reader can verify against the hash
// it is stored under (the block's hash repeated), so a check of the disk
// after a crash proves something about the bytes, not only the checksums.
#include <gtest/gtest.h>

#include <cstddef>
#include <cstdint>
#include <memory>
#include <vector>

#include "disk_test_util.hpp"
#include "kvport/backends/host_backend.hpp"
#include "kvport/disk/disk_tier.hpp"
#include "kvport/sim/replay.hpp"

namespace kvport::disk {
namespace {

// Whether every byte of `image` is the replay's content of `hash`: the hash,
// low then high, little-endian, repeated.
bool holds_hash(std::span<const std::byte> image, const BlockHash& hash) {
  for (std::size_t j = 0; j < image.size(); ++j) {
    const std::uint64_t word = j % 16 < 8 ? hash.low : hash.high;
    if (std::to_integer<std::uint8_t>(image[j]) != static_cast<std::uint8_t>(word >> (8 * (j % 8))))
      return false;
  }
  return true;
}

TEST(ReplayDiskContent, EveryBlockTheReplayLeavesOnDiskHoldsItsHash) {
  test::TempDir dir;
  // 200 requests cycling over 40 prefixes of one 64-token block each (plus
  // 10 tokens and 3 generated): a 16-block device and an 8-block host push
  // most of them down to the disk, and hits read them back up.
  std::vector<sim::TraceRequest> requests;
  for (std::size_t i = 0; i < 200; ++i) {
    sim::TraceRequest r;
    r.timestamp_ms = static_cast<double>(i * 100);
    r.input_length = 64 + 10;
    r.output_length = 3;
    r.hash_ids = {i % 40};
    r.line = i + 1;
    requests.push_back(r);
  }
  sim::ReplayOptions options;
  options.capacity_blocks = 16;
  options.trace_block_tokens = 64;
  options.host_tier_blocks = 8;
  std::unique_ptr<DiskTier> tier;
  options.lower_tier = [&](const KvCacheConfig& config, std::size_t block_bytes) {
    DiskStoreOptions o;
    o.dir = dir.path() / "tier";
    o.num_slots = 256;
    o.block_bytes = block_bytes;
    o.layout = layout_fields(config);
    o.queue_depth = 4;
    tier = DiskTier::open(o);
    return static_cast<LowerTierStore*>(tier.get());
  };
  const std::unique_ptr<Backend> backend = make_host_backend();
  const sim::ReplayResult result = sim::run_replay(requests, options, *backend);
  ASSERT_TRUE(tier);
  EXPECT_GT(result.lower_hit_blocks, 0u) << "no block came back from the disk";
  DiskStore& store = tier->store();
  const std::vector<BlockHash> stored = store.lru_order();
  ASSERT_GT(stored.size(), 0u);
  std::vector<std::byte> image(store.block_bytes());
  const std::vector<std::span<std::byte>> out{std::span<std::byte>(image)};
  std::size_t wrong = 0;
  for (const BlockHash& h : stored) {
    ASSERT_EQ(store.get_prefix({&h, 1}, out), 1u);
    if (!holds_hash(image, h)) ++wrong;
  }
  EXPECT_EQ(wrong, 0u) << "of " << stored.size() << " blocks on disk";
  EXPECT_EQ(store.counters().checksum_failures, 0u);
}

}  // namespace
}  // namespace kvport::disk
