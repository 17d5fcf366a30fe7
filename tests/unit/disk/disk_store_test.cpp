// SPDX-License-Identifier: Apache-2.0
// DiskStore: blocks read back as written, across restarts; an incompatible or
// busy directory refused in one line; the LRU; and failing closed: corrupted
// pages and records, torn and truncated files, a file deleted under the
// process, and a fault injected at every I/O step are dropped and counted,
// never served.
#include <gtest/gtest.h>
#include <sched.h>
#include <sys/mount.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <csignal>
#include <fstream>
#include <memory>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "disk_test_util.hpp"
#include "kvport/core/kv_cache_config.hpp"
#include "kvport/disk/disk_store.hpp"
#include "kvport/platform/error.hpp"

namespace kvport::disk {
namespace {

using test::chain;
using test::get_checked;
using test::image_of;
using test::put_images;
using test::TempDir;
using namespace std::chrono_literals;

constexpr std::size_t kBlockBytes = 3000;  // not a multiple of 4096: slots are padded
constexpr std::size_t kStride = 4096;

std::vector<LayoutField> layout() {
  return {{"block_size", "4"}, {"dtype", "bf16"}};
}

class DiskStoreTest : public ::testing::Test {
 protected:
  DiskStoreOptions options(std::size_t slots = 16) const {
    DiskStoreOptions o;
    o.dir = dir_.path() / "tier";
    o.num_slots = slots;
    o.block_bytes = kBlockBytes;
    o.layout = layout();
    o.queue_depth = 4;
    return o;
  }

  // Puts the blocks of `hashes` with their derived images.
  static std::size_t put(DiskStore& s, const std::vector<BlockHash>& hashes) {
    return put_images(s, hashes, kBlockBytes);
  }

  // get_prefix into fresh buffers; checks every returned block's bytes.
  static std::size_t get(DiskStore& s, const std::vector<BlockHash>& hashes) {
    return get_checked(s, hashes, kBlockBytes);
  }

  static void expect_consistent(const DiskStore& s) {
    const std::vector<std::string> bad = s.check_invariants();
    EXPECT_TRUE(bad.empty()) << bad.front();
  }

  // Flips one byte of a file of the store.
  void corrupt(const char* file, std::uint64_t offset) const {
    std::fstream f(dir_.path() / "tier" / file, std::ios::in | std::ios::out | std::ios::binary);
    ASSERT_TRUE(f.good());
    f.seekg(static_cast<std::streamoff>(offset));
    char c = 0;
    f.get(c);
    f.seekp(static_cast<std::streamoff>(offset));
    f.put(static_cast<char>(c ^ 0x5A));
  }

  TempDir dir_;
};

TEST_F(DiskStoreTest, BlocksReadBackAsWrittenAndThePrefixStopsAtTheFirstMissing) {
  auto s = DiskStore::open(options());
  const auto a = chain(1, 6);
  EXPECT_EQ(put(*s, {a[0], a[1], a[2], a[4]}), 4u);
  EXPECT_EQ(s->size(), 4u);
  EXPECT_EQ(s->match_prefix(a), 3u);
  EXPECT_EQ(get(*s, a), 3u);  // a[3] is missing: a[4] is not part of the prefix
  EXPECT_EQ(s->counters().reads, 3u);
  EXPECT_EQ(s->counters().writes, 4u);
  EXPECT_EQ(s->counters().write_bytes, 4 * kBlockBytes);
  EXPECT_EQ(put(*s, {a[0]}), 0u);
  EXPECT_EQ(s->counters().already_stored, 1u);
  EXPECT_GT(s->counters().write_ns, 0u);
  EXPECT_GT(s->counters().index_ns, 0u);
  expect_consistent(*s);
  // The data file is preallocated at its full size; each slot padded to 4096.
  EXPECT_EQ(std::filesystem::file_size(dir_.path() / "tier" / "blocks.dat"), 16 * kStride);
}

TEST_F(DiskStoreTest, ARestartOnTheSameDirectoryFindsItsBlocks) {
  const auto a = chain(2, 10);
  {
    auto s = DiskStore::open(options());
    ASSERT_EQ(put(*s, a), 10u);
    EXPECT_TRUE(s->erase(a[9]));
    EXPECT_FALSE(s->erase(a[9]));
  }
  auto s = DiskStore::open(options());
  EXPECT_EQ(s->counters().recovered, 9u);
  EXPECT_EQ(s->counters().dropped_at_open, 0u);
  EXPECT_EQ(get(*s, a), 9u);
  EXPECT_FALSE(s->contains(a[9]));          // the erasure was durable too
  EXPECT_EQ(s->lru_order().front(), a[0]);  // the order of the records
  expect_consistent(*s);
}

TEST_F(DiskStoreTest, AnIncompatibleOrBusyDirectoryIsRefusedNamingTheReason) {
  { auto s = DiskStore::open(options()); }
  auto other = options();
  other.layout[1].value = "fp8_e4m3";
  try {
    (void)DiskStore::open(other);
    FAIL() << "opened a directory of another layout";
  } catch (const InvalidArgument& e) {
    EXPECT_NE(std::string(e.what()).find("'dtype' is 'bf16' in the directory, 'fp8_e4m3' here"),
              std::string::npos)
        << e.what();
  }
  other = options(32);
  try {
    (void)DiskStore::open(other);
    FAIL() << "opened a directory of another size";
  } catch (const InvalidArgument& e) {
    EXPECT_NE(std::string(e.what()).find("'num_slots' is 16"), std::string::npos) << e.what();
  }
  other = options();
  other.block_bytes = 5000;
  EXPECT_THROW((void)DiskStore::open(other), InvalidArgument);

  // One writer at a time; readers share, but not with a writer.
  auto writer = DiskStore::open(options());
  try {
    (void)DiskStore::open(options());
    FAIL() << "two writers";
  } catch (const InvalidArgument& e) {
    EXPECT_NE(std::string(e.what()).find("in use by another process"), std::string::npos);
  }
  auto ro = options();
  ro.read_only = true;
  EXPECT_THROW((void)DiskStore::open(ro), InvalidArgument);
  writer.reset();
  auto r1 = DiskStore::open(ro);
  auto r2 = DiskStore::open(ro);
  EXPECT_THROW((void)DiskStore::open(options()), InvalidArgument);
  EXPECT_EQ(put(*r1, chain(3, 1)), 0u);
  EXPECT_EQ(r1->counters().dropped_puts, 1u);
}

TEST_F(DiskStoreTest, BadOptionsAndDirectoriesAreOneLineErrors) {
  auto o = options();
  o.num_slots = 0;
  EXPECT_THROW((void)DiskStore::open(o), InvalidArgument);
  o = options();
  o.block_bytes = 0;
  EXPECT_THROW((void)DiskStore::open(o), InvalidArgument);
  o = options();
  o.queue_depth = 0;
  EXPECT_THROW((void)DiskStore::open(o), InvalidArgument);
  o = options();
  o.io_timeout = 0ms;
  EXPECT_THROW((void)DiskStore::open(o), InvalidArgument);
  o = options();
  o.read_only = true;  // nothing there yet
  EXPECT_THROW((void)DiskStore::open(o), InvalidArgument);
  o = options();
  o.dir = "/proc/kvport-disk-tier";  // cannot be created
  EXPECT_THROW((void)DiskStore::open(o), InvalidArgument);
  o = options();
  { std::ofstream f(dir_.path() / "file"); }
  o.dir = dir_.path() / "file";
  EXPECT_THROW((void)DiskStore::open(o), InvalidArgument);
  // A description that is not JSON.
  o = options();
  { auto s = DiskStore::open(o); }
  {
    std::ofstream f(dir_.path() / "tier" / "kvport-disk.json", std::ios::trunc);
    f << "{not json";
  }
  EXPECT_THROW((void)DiskStore::open(o), InvalidArgument);
  // Mis-sized arguments (a fresh directory: one whose description is gone
  // is not a store, and its files are not removed for a new one).
  std::filesystem::remove_all(dir_.path() / "tier");
  auto s = DiskStore::open(o);
  const auto a = chain(4, 2);
  std::vector<std::byte> small(10);
  std::vector<std::span<const std::byte>> one{std::span<const std::byte>(small)};
  EXPECT_THROW((void)s->put(a, one), InvalidArgument);
  EXPECT_THROW((void)s->put(std::span(a).first(1), one), InvalidArgument);
  std::vector<std::span<std::byte>> none;
  EXPECT_THROW((void)s->get_prefix(a, none), InvalidArgument);
}

TEST_F(DiskStoreTest, ABatchLargerThanTheStoreKeepsItsFirstBlocks) {
  auto s = DiskStore::open(options(4));
  const auto a = chain(14, 6);
  EXPECT_EQ(put(*s, a), 4u);  // slots being written in a batch are not evicted by it
  EXPECT_EQ(s->counters().dropped_puts, 2u);
  EXPECT_EQ(get(*s, a), 4u);
  expect_consistent(*s);
}

TEST_F(DiskStoreTest, TheLeastRecentlyUsedBlockGivesItsSlot) {
  auto s = DiskStore::open(options(4));
  const auto a = chain(5, 5);
  ASSERT_EQ(put(*s, {a[0], a[1], a[2], a[3]}), 4u);
  EXPECT_EQ(get(*s, {a[0]}), 1u);  // a[0] becomes the most recent
  ASSERT_EQ(put(*s, {a[4]}), 1u);
  EXPECT_FALSE(s->contains(a[1]));
  EXPECT_EQ(s->counters().evictions, 1u);
  EXPECT_EQ(s->lru_order(), (std::vector<BlockHash>{a[2], a[3], a[0], a[4]}));
  expect_consistent(*s);
  // And after a restart the reused slot holds the new block only.
  s.reset();
  s = DiskStore::open(options(4));
  EXPECT_EQ(s->size(), 4u);
  EXPECT_EQ(get(*s, {a[4]}), 1u);
  EXPECT_FALSE(s->contains(a[1]));
}

TEST_F(DiskStoreTest, ACorruptedDataPageIsDroppedAndCountedNeverServed) {
  const auto a = chain(6, 3);
  {
    auto s = DiskStore::open(options());
    ASSERT_EQ(put(*s, a), 3u);
  }
  corrupt("blocks.dat", 1 * kStride + 100);  // slot 1: a[1]
  auto s = DiskStore::open(options());
  EXPECT_EQ(get(*s, a), 1u);
  EXPECT_EQ(s->counters().checksum_failures, 1u);
  EXPECT_FALSE(s->contains(a[1]));
  EXPECT_TRUE(s->contains(a[2]));
  expect_consistent(*s);
  s.reset();
  s = DiskStore::open(options());  // the drop was recorded
  EXPECT_FALSE(s->contains(a[1]));
  EXPECT_EQ(s->counters().recovered, 2u);
}

TEST_F(DiskStoreTest, CorruptedAndTornRecordsAreDroppedAtOpen) {
  const auto a = chain(7, 4);
  {
    auto s = DiskStore::open(options());
    ASSERT_EQ(put(*s, a), 4u);
  }
  corrupt("index.log", 64 * 1 + 30);  // a[1]'s record
  const auto index = dir_.path() / "tier" / "index.log";
  std::filesystem::resize_file(index, std::filesystem::file_size(index) - 10);  // a[3]'s torn
  auto s = DiskStore::open(options());
  EXPECT_EQ(s->counters().dropped_at_open, 2u);
  EXPECT_EQ(s->counters().recovered, 2u);
  EXPECT_TRUE(s->contains(a[0]));
  EXPECT_FALSE(s->contains(a[1]));
  EXPECT_TRUE(s->contains(a[2]));
  EXPECT_FALSE(s->contains(a[3]));
  // Appends go on from the last whole record.
  ASSERT_EQ(put(*s, {a[1], a[3]}), 2u);
  s.reset();
  s = DiskStore::open(options());
  EXPECT_EQ(s->counters().dropped_at_open, 1u);  // the corrupted record stays, dropped again
  EXPECT_EQ(get(*s, a), 4u);
}

TEST_F(DiskStoreTest, ATruncatedDataFileServesNothingPastItsEnd) {
  const auto a = chain(8, 4);
  {
    auto s = DiskStore::open(options());
    ASSERT_EQ(put(*s, a), 4u);
  }
  std::filesystem::resize_file(dir_.path() / "tier" / "blocks.dat", 2 * kStride);
  {
    auto ro = options();
    ro.read_only = true;
    auto r = DiskStore::open(ro);
    EXPECT_EQ(r->counters().dropped_at_open, 2u);
    EXPECT_EQ(get(*r, a), 2u);
  }
  // A writer preallocates the file again: the lost slots read as zeros and
  // fail their checksums.
  auto s = DiskStore::open(options());
  EXPECT_EQ(get(*s, a), 2u);
  EXPECT_EQ(s->counters().checksum_failures, 2u);  // both lost blocks, each dropped
  EXPECT_EQ(s->size(), 2u);
  expect_consistent(*s);
}

TEST_F(DiskStoreTest, AFileTruncatedUnderTheProcessIsAShorterHit) {
  auto s = DiskStore::open(options());
  const auto a = chain(9, 4);
  ASSERT_EQ(put(*s, a), 4u);
  ASSERT_EQ(::truncate((dir_.path() / "tier" / "blocks.dat").c_str(), 0), 0);
  EXPECT_EQ(get(*s, a), 0u);
  EXPECT_EQ(s->counters().read_failures, 4u);
  EXPECT_EQ(s->size(), 0u);
  expect_consistent(*s);
}

TEST_F(DiskStoreTest, AFileDeletedUnderTheProcessDetachesTheStore) {
  auto s = DiskStore::open(options());
  const auto a = chain(10, 3);
  ASSERT_EQ(put(*s, a), 3u);
  std::filesystem::remove(dir_.path() / "tier" / "blocks.dat");
  EXPECT_EQ(get(*s, a), 0u);
  EXPECT_TRUE(s->detached());
  EXPECT_EQ(s->counters().dropped_detached, 3u);
  EXPECT_EQ(s->size(), 0u);
  EXPECT_EQ(put(*s, chain(11, 2)), 0u);
  EXPECT_EQ(s->counters().dropped_puts, 2u);
  expect_consistent(*s);
}

TEST_F(DiskStoreTest, AdmissionWritesOnlyBlocksHitEnoughTimes) {
  auto o = options();
  o.min_hits = 2;
  auto s = DiskStore::open(o);
  const auto a = chain(12, 3);
  EXPECT_EQ(put(*s, a), 0u);
  EXPECT_EQ(s->counters().not_admitted, 3u);
  s->note_hits(a);
  s->note_hits(std::span(a).first(2));
  EXPECT_EQ(put(*s, a), 2u);
  EXPECT_TRUE(s->contains(a[0]));
  EXPECT_FALSE(s->contains(a[2]));
}

TEST_F(DiskStoreTest, AnIndexOfMostlySupersededRecordsIsCompactedAtOpen) {
  // 140 puts of 4 blocks, all but the last erased again: 1,116 records for
  // 4 live blocks, below the running bound (4 x 64 + 1024) and above the
  // one at open (2 x 4 + 1024).
  const auto a = chain(13, 560);
  {
    auto s = DiskStore::open(options(64));
    for (std::size_t i = 0; i < a.size(); i += 4) {
      std::vector<BlockHash> some(a.begin() + static_cast<std::ptrdiff_t>(i),
                                  a.begin() + static_cast<std::ptrdiff_t>(i + 4));
      put(*s, some);
      if (i + 4 < a.size()) {
        for (const BlockHash& h : some)
          s->erase(h);
      }
    }
    EXPECT_EQ(s->size(), 4u);
    EXPECT_EQ(s->counters().journal_compactions, 0u);
  }
  auto s = DiskStore::open(options(64));
  EXPECT_EQ(s->counters().journal_compactions, 1u);
  EXPECT_EQ(std::filesystem::file_size(dir_.path() / "tier" / "index.log"), 4u * 64);
  EXPECT_EQ(get(*s, {a[556], a[557], a[558], a[559]}), 4u);
  s.reset();
  s = DiskStore::open(options(64));
  EXPECT_EQ(s->counters().journal_compactions, 0u);
  EXPECT_EQ(s->size(), 4u);
}

TEST_F(DiskStoreTest, ATouchedBlockIsTheLastToBeEvicted) {
  auto s = DiskStore::open(options(4));
  const auto a = chain(21, 4);
  ASSERT_EQ(put(*s, a), 4u);
  s->touch(std::vector<BlockHash>{a[0], chain(99, 1)[0]});  // an absent hash is ignored
  EXPECT_EQ(s->lru_order(), (std::vector<BlockHash>{a[1], a[2], a[3], a[0]}));
  ASSERT_EQ(put(*s, chain(22, 1)), 1u);  // evicts a[1], not a[0]
  EXPECT_TRUE(s->contains(a[0]));
  EXPECT_FALSE(s->contains(a[1]));
  expect_consistent(*s);
}

TEST_F(DiskStoreTest, TheIndexIsCompactedWhileTheStoreRuns) {
  std::vector<BlockHash> last;
  {
    auto s = DiskStore::open(options(4));
    // Each put of 4 new blocks evicts the 4 before: 4 records a put, past
    // 4 x 4 + 1024 records the index is rewritten with the 4 live ones.
    for (std::uint32_t k = 0; k < 300; ++k) {
      last = chain(5000 + k, 4);
      ASSERT_EQ(put(*s, last), 4u);
    }
    EXPECT_GE(s->counters().journal_compactions, 1u);
    EXPECT_LE(std::filesystem::file_size(dir_.path() / "tier" / "index.log"),
              std::uintmax_t{(4 * 4 + 1024 + 4) * 64});
    EXPECT_EQ(get(*s, last), 4u);
    expect_consistent(*s);
  }
  auto s = DiskStore::open(options(4));
  EXPECT_EQ(s->counters().recovered, 4u);
  EXPECT_EQ(s->counters().dropped_at_open, 0u);
  EXPECT_EQ(s->lru_order(), last);
  EXPECT_EQ(get(*s, last), 4u);
}

TEST(LayoutFields, NameTheGeometryAndDifferWithADtype) {
  KvCacheConfig c;
  c.num_layers = 4;
  c.block_size = 16;
  c.num_kv_heads = 8;
  c.head_dim_k = 128;
  c.head_dim_v = 128;
  const std::vector<LayoutField> f = layout_fields(c);
  auto value = [&](const std::vector<LayoutField>& fs, const std::string& name) {
    for (const LayoutField& x : fs) {
      if (x.name == name) return x.value;
    }
    return std::string("(none)");
  };
  EXPECT_EQ(value(f, "block_size"), "16");
  EXPECT_EQ(value(f, "bytes_per_block"), std::to_string(c.bytes_per_block()));
  EXPECT_EQ(value(f, "hash"), "xxh3-128 chained, unseeded");
  c.layer_dtypes = {KvCacheDtype::bf16, KvCacheDtype::fp8_e4m3, KvCacheDtype::fp8_e4m3,
                    KvCacheDtype::bf16};
  const std::vector<LayoutField> g = layout_fields(c);
  EXPECT_NE(value(f, "layer_dtypes"), value(g, "layer_dtypes"));
  c.layout = KvCacheLayout::block_major;  // the image is the same in either layout
  EXPECT_EQ(layout_fields(c), g);
  c.block_size = 0;
  EXPECT_THROW((void)layout_fields(c), InvalidArgument);
}

// ---- faults at every I/O step ---------------------------------------------------------------

class DiskStoreFaultTest : public DiskStoreTest {
 protected:
  std::unique_ptr<DiskStore> open_with_faults() {
    auto o = options();
    o.wrap_io = [this](std::string_view file,
                       std::unique_ptr<FileIo> io) -> std::unique_ptr<FileIo> {
      auto f = std::make_unique<FaultInjectingFileIo>(std::move(io));
      (file == "data" ? data_ : index_) = f.get();
      return f;
    };
    return DiskStore::open(o);
  }
  FaultInjectingFileIo* data_ = nullptr;
  FaultInjectingFileIo* index_ = nullptr;
};

TEST_F(DiskStoreFaultTest, AFailedDataWriteIsNotPublished) {
  for (IoStep step : {IoStep::submit, IoStep::complete, IoStep::short_io}) {
    auto s = open_with_faults();
    data_->plan(IoFault{step, IoOp::write, ENOSPC, 1, 1});  // the second block
    const auto a = chain(20 + static_cast<std::uint32_t>(step), 3);
    EXPECT_EQ(put(*s, a), 2u);
    EXPECT_FALSE(s->contains(a[1]));
    EXPECT_EQ(s->counters().write_failures, 1u);
    EXPECT_EQ(get(*s, a), 1u);
    expect_consistent(*s);
    // The store goes on: the block is written the next time.
    EXPECT_EQ(put(*s, {a[1]}), 1u);
    EXPECT_EQ(get(*s, a), 3u);
  }
}

TEST_F(DiskStoreFaultTest, AFailedSyncOrIndexAppendPublishesNothingOfTheWave) {
  const auto a = chain(30, 3);
  {
    auto s = open_with_faults();
    data_->plan(IoFault{IoStep::sync, std::nullopt, EIO, 0, 1});
    EXPECT_EQ(put(*s, a), 0u);
    EXPECT_EQ(s->counters().write_failures, 3u);
    index_->plan(IoFault{IoStep::complete, IoOp::write, EIO, 0, 1});
    EXPECT_EQ(put(*s, a), 0u);
    index_->plan(IoFault{IoStep::sync, std::nullopt, EIO, 0, 1});
    EXPECT_EQ(put(*s, a), 0u);
    EXPECT_EQ(s->size(), 0u);
    expect_consistent(*s);
    EXPECT_EQ(put(*s, a), 3u);
  }
  auto s = DiskStore::open(options());
  EXPECT_EQ(get(*s, a), 3u);
}

TEST_F(DiskStoreFaultTest, AFailedReadEndsTheHitThereAndDropsTheBlock) {
  auto s = open_with_faults();
  const auto a = chain(40, 4);
  ASSERT_EQ(put(*s, a), 4u);
  data_->plan(IoFault{IoStep::complete, IoOp::read, EIO, 2, 1});
  EXPECT_EQ(get(*s, a), 2u);
  EXPECT_EQ(s->counters().read_failures, 1u);
  EXPECT_FALSE(s->contains(a[2]));
  EXPECT_TRUE(s->contains(a[3]));
  data_->plan(IoFault{IoStep::short_io, IoOp::read, 0, 0, 1});
  EXPECT_EQ(get(*s, a), 0u);
  EXPECT_FALSE(s->contains(a[0]));
  expect_consistent(*s);
}

TEST_F(DiskStoreFaultTest, AReadPastItsDeadlineIsAShorterHitAndTheBlockStays) {
  auto s = open_with_faults();
  const auto a = chain(50, 3);
  ASSERT_EQ(put(*s, a), 3u);
  data_->plan(IoFault{IoStep::timeout, IoOp::read, 0, 1, 1});
  EXPECT_EQ(get(*s, a), 1u);
  EXPECT_EQ(s->counters().timeouts, 1u);
  EXPECT_TRUE(s->contains(a[1]));
  EXPECT_EQ(get(*s, a), 3u);
}

TEST_F(DiskStoreFaultTest, NoSpaceForTheDataFileIsRefusedAtOpen) {
  auto o = options();
  o.wrap_io = [](std::string_view file, std::unique_ptr<FileIo> io) -> std::unique_ptr<FileIo> {
    auto f = std::make_unique<FaultInjectingFileIo>(std::move(io));
    if (file == "data") f->plan(IoFault{IoStep::allocate, std::nullopt, ENOSPC, 0, 1});
    return f;
  };
  try {
    (void)DiskStore::open(o);
    FAIL() << "opened without space";
  } catch (const InvalidArgument& e) {
    EXPECT_NE(std::string(e.what()).find("cannot allocate 16 slots"), std::string::npos)
        << e.what();
    EXPECT_NE(std::string(e.what()).find("No space left"), std::string::npos) << e.what();
  }
}

// An I/O whose completion comes after its deadline: the slot and the staging
// buffer are held until the kernel is done (a FileIo that reports the first
// write orphaned and completes it at the next reap).
class OrphaningFileIo final : public FileIo {
 public:
  explicit OrphaningFileIo(std::unique_ptr<FileIo> inner) : inner_(std::move(inner)) {}
  bool orphan_next_write = false;

 private:
  void do_run(std::span<const IoRequest> r, std::span<IoResult> out, std::chrono::milliseconds d,
              const IoHooks& hooks) override {
    const IoCompletion& on_complete = hooks.on_complete;
    inner_->run(r, out, d, {}, hooks.prepare);
    for (std::size_t i = 0; i < r.size(); ++i) {
      if (orphan_next_write && r[i].op == IoOp::write) {
        out[i] = IoResult{ETIMEDOUT, 0, true};
        pending_.push_back(r[i].tag);
        orphan_next_write = false;
      }
      on_complete(i);
    }
  }
  int do_sync() override { return inner_->sync(); }
  int do_allocate(std::uint64_t b) override { return inner_->allocate(b); }
  int do_reserve(std::uint64_t o, std::uint64_t b) override { return inner_->reserve(o, b); }
  std::optional<std::uint64_t> do_size() override { return inner_->size(); }
  bool do_linked() override { return inner_->linked(); }
  std::vector<std::uint64_t> do_reap_orphans(bool) override { return std::exchange(pending_, {}); }
  std::size_t do_orphans() const noexcept override { return pending_.size(); }
  std::string do_describe() const override { return inner_->describe(); }
  bool do_direct() const noexcept override { return inner_->direct(); }
  bool do_preallocated() const noexcept override { return inner_->preallocated(); }
  bool do_read_only() const noexcept override { return inner_->read_only(); }
  std::unique_ptr<FileIo> inner_;
  std::vector<std::uint64_t> pending_;
};

TEST_F(DiskStoreTest, AWriteOrphanedAtItsDeadlineQuarantinesItsSlotUntilItEnds) {
  OrphaningFileIo* io = nullptr;
  auto o = options(4);
  o.wrap_io = [&](std::string_view file, std::unique_ptr<FileIo> inner) -> std::unique_ptr<FileIo> {
    if (file != "data") return inner;
    auto f = std::make_unique<OrphaningFileIo>(std::move(inner));
    io = f.get();
    return f;
  };
  auto s = DiskStore::open(o);
  const auto a = chain(60, 6);
  io->orphan_next_write = true;
  EXPECT_EQ(put(*s, {a[0], a[1]}), 1u);
  EXPECT_EQ(s->quarantined_slots(), 1u);
  EXPECT_EQ(s->counters().timeouts, 1u);
  expect_consistent(*s);
  // The next call reaps the orphan first: slot and buffer are free again.
  EXPECT_EQ(put(*s, {a[2], a[3]}), 2u);
  EXPECT_EQ(s->quarantined_slots(), 0u);
  expect_consistent(*s);
  EXPECT_EQ(put(*s, {a[4], a[5]}), 2u);
  EXPECT_EQ(s->size(), 4u);
}

// ---- a full file system ----------------------------------------------------------------------

// The scenario of DiskFull, run in a child process inside a mount namespace
// of its own (so the tmpfs goes with it, whatever happens); exit 0 when
// every check held, else the number of the first that did not, 77 when a
// size-limited file system cannot be made here.
int disk_full_scenario(const std::filesystem::path& root) {
  if (::unshare(CLONE_NEWNS) != 0) return 77;
  if (::mount("none", "/", nullptr, MS_REC | MS_PRIVATE, nullptr) != 0) return 77;
  if (::mount("tmpfs", root.c_str(), "tmpfs", 0, "size=1m") != 0) return 77;
  DiskStoreOptions o;
  o.dir = root / "tier";
  o.block_bytes = kBlockBytes;
  o.layout = layout();
  o.queue_depth = 4;
  o.num_slots = 1024;  // 4 MiB of slots on a 1 MiB file system
  try {
    (void)DiskStore::open(o);
    return 1;
  } catch (const InvalidArgument& e) {
    if (std::string(e.what()).find("No space left") == std::string::npos) return 2;
  }
  o.num_slots = 64;  // 256 KiB
  std::filesystem::remove_all(o.dir);
  auto s = DiskStore::open(o);
  const auto a = chain(70, 8);
  const auto put_all = [&](const std::vector<BlockHash>& hs) {
    std::vector<std::vector<std::byte>> images;
    std::vector<std::span<const std::byte>> views;
    for (const BlockHash& h : hs)
      images.push_back(image_of(h, kBlockBytes));
    for (const auto& im : images)
      views.emplace_back(im);
    return s->put(hs, views);
  };
  if (put_all(a) != 8) return 3;
  // Fill what is left, then ask for a page more of index records.
  {
    std::ofstream filler(root / "filler", std::ios::binary);
    const std::vector<char> chunk(4096, 'x');
    for (int i = 0; i < 1024 && filler.write(chunk.data(), chunk.size()); ++i) {
    }
  }
  const auto b = chain(71, 64);
  if (put_all(b) != 0) return 4;  // the records found no space: nothing published
  if (s->counters().write_failures == 0) return 5;
  if (!s->check_invariants().empty()) return 6;
  // Space again: the store goes on.
  std::filesystem::remove(root / "filler");
  if (put_all(b) != 64) return 7;
  std::vector<std::vector<std::byte>> out(64, std::vector<std::byte>(kBlockBytes));
  std::vector<std::span<std::byte>> views;
  for (auto& x : out)
    views.emplace_back(x);
  if (s->get_prefix(b, views) != 64) return 8;
  for (std::size_t i = 0; i < 64; ++i) {
    if (out[i] != image_of(b[i], kBlockBytes)) return 9;
  }
  return 0;
}

TEST(DiskFull, NoSpaceForRecordsPublishesNothingAndTheStoreGoesOnOnceThereIs) {
  TempDir mount_point;  // the child mounts over it; removed here once it is gone
  const pid_t child = ::fork();
  ASSERT_GE(child, 0);
  if (child == 0) {
    int code = 10;
    try {
      code = disk_full_scenario(mount_point.path());
    } catch (...) {
      code = 11;
    }
    ::_exit(code);
  }
  int status = 0;
  ASSERT_EQ(::waitpid(child, &status, 0), child);
  ASSERT_TRUE(WIFEXITED(status)) << "the scenario died: " << status;
  if (WEXITSTATUS(status) == 77) {
    GTEST_SKIP() << "cannot make a size-limited tmpfs here (needs root: a mount namespace)";
  }
  EXPECT_EQ(WEXITSTATUS(status), 0)
      << "check " << WEXITSTATUS(status) << " of disk_full_scenario did not hold";
}

// ---- crashes ---------------------------------------------------------------------------------

// A child process puts blocks in a loop (evicting as it goes) and is killed
// with SIGKILL at a random moment; every block a restarted store then
// returns must have its bytes. Several kills, each within 2 seconds.
TEST_F(DiskStoreTest, SigkillDuringWritesLeavesNoWrongBlock) {
  std::mt19937 rng(12345);
  std::size_t served = 0;
  for (int round = 0; round < 6; ++round) {
    ASSERT_TRUE(test::sigkill_after(
        [&] {
          auto s = DiskStore::open(options(64));
          for (std::uint32_t k = 0;; ++k)
            put(*s, chain(1000 + round * 100000 + k, 8));
        },
        std::chrono::milliseconds(20 + rng() % 120)));
    auto s = DiskStore::open(options(64));
    EXPECT_EQ(s->counters().checksum_failures, 0u);
    // Every block the index says is there reads back whole, or is dropped;
    // none is served with other bytes (get() checks each one).
    for (std::uint32_t k = 0; k < 4000; ++k) {
      const auto hashes = chain(1000 + round * 100000 + k, 8);
      if (s->match_prefix(hashes) == 0) continue;
      served += get(*s, hashes);
    }
    expect_consistent(*s);
  }
  EXPECT_GT(served, 0u) << "no block survived any kill";
}

}  // namespace
}  // namespace kvport::disk
