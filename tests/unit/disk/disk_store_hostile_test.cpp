// SPDX-License-Identifier: Apache-2.0
// DiskStore in a directory it cannot trust (issue 31): links and FIFOs planted
// under the store's names, a directory of someone else's files, a description
// that is not one, an index far larger than the store could have written, a
// refused open, an index that cannot be written. The store reads and writes
// only regular files of its own, deletes nothing it did not make, leaves
// nothing behind when it refuses (but the empty lock file, which another
// open may hold), and never gives up a good block for one it
// cannot record.
#include <gtest/gtest.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <csignal>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "disk_test_util.hpp"
#include "kvport/disk/disk_store.hpp"
#include "kvport/platform/error.hpp"
#include "kvport/testing/sanitizers.hpp"
#include "kvport/testing/time_scale.hpp"

namespace kvport::disk {
namespace {

namespace fs = std::filesystem;
using test::chain;
using test::get_checked;
using test::image_of;
using test::put_images;
using test::TempDir;

constexpr std::size_t kBlockBytes = 3000;

class HostileDirTest : public ::testing::Test {
 protected:
  fs::path tier() const { return dir_.path() / "tier"; }

  DiskStoreOptions options(std::size_t slots = 16) const {
    DiskStoreOptions o;
    o.dir = tier();
    o.num_slots = slots;
    o.block_bytes = kBlockBytes;
    o.layout = {{"block_size", "4"}, {"dtype", "bf16"}};
    o.queue_depth = 4;
    return o;
  }

  static std::size_t put(DiskStore& s, const std::vector<BlockHash>& hashes) {
    return put_images(s, hashes, kBlockBytes);
  }

  // get_prefix into fresh buffers; checks every returned block's bytes.
  static std::size_t get(DiskStore& s, const std::vector<BlockHash>& hashes) {
    return get_checked(s, hashes, kBlockBytes);
  }

  // A file outside the store that must survive whatever the store does.
  fs::path victim(const std::string& name = "victim") const {
    const fs::path p = dir_.path() / name;
    std::ofstream(p, std::ios::binary) << kPrecious;
    return p;
  }
  static std::string text_of(const fs::path& p) {
    std::ifstream in(p, std::ios::binary);
    return {std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
  }

  // The message of the InvalidArgument that opening `o` throws ("" when it
  // opens, "other: ..." for any other exception).
  static std::string refusal(const DiskStoreOptions& o) {
    try {
      (void)DiskStore::open(o);
    } catch (const InvalidArgument& e) {
      return e.what();
    } catch (const std::exception& e) {
      return std::string("other: ") + e.what();
    }
    return "";
  }

  // The names in `dir`, sorted.
  static std::vector<std::string> entries_of(const fs::path& dir) {
    std::vector<std::string> names;
    for (const auto& e : fs::directory_iterator(dir))
      names.push_back(e.path().filename().string());
    std::sort(names.begin(), names.end());
    return names;
  }

  static constexpr const char* kPrecious = "precious bytes of a file kvport did not make\n";
  TempDir dir_;
};

bool contains(const std::string& text, const std::string& part) {
  return text.find(part) != std::string::npos;
}

// ---- links ------------------------------------------------------------------------------

TEST_F(HostileDirTest, AStoreFileThatIsASymbolicLinkIsRefusedAndItsTargetUntouched) {
  for (const char* name : {"blocks.dat", "index.log", "kvport-disk.json", "kvport-disk.lock"}) {
    SCOPED_TRACE(name);
    fs::remove_all(tier());
    {
      auto s = DiskStore::open(options());
      ASSERT_EQ(put(*s, chain(1, 2)), 2u);
    }
    const fs::path target = victim();
    fs::remove(tier() / name);
    fs::create_symlink(target, tier() / name);
    const std::string why = refusal(options());
    EXPECT_TRUE(contains(why, (tier() / name).string()) && contains(why, "symbolic link")) << why;
    EXPECT_EQ(text_of(target), kPrecious) << "the store wrote through the link";
    // A reader neither.
    auto ro = options();
    ro.read_only = true;
    EXPECT_TRUE(contains(refusal(ro), "symbolic link")) << name;
    EXPECT_EQ(text_of(target), kPrecious);
  }
}

TEST_F(HostileDirTest, AStoreFileWithAnotherNameIsNotWrittenThrough) {
  for (const char* name : {"blocks.dat", "index.log"}) {
    SCOPED_TRACE(name);
    fs::remove_all(tier());
    { auto s = DiskStore::open(options()); }
    const fs::path target = victim();
    fs::remove(tier() / name);
    fs::create_hard_link(target, tier() / name);  // a regular file, with two names
    const std::string why = refusal(options());
    EXPECT_TRUE(contains(why, (tier() / name).string()) && contains(why, "hard links")) << why;
    EXPECT_EQ(text_of(target), kPrecious) << "the store wrote through the hard link";
    fs::remove(tier() / name);
  }
}

TEST_F(HostileDirTest, ALinkPlantedAsTheTemporaryFileIsReplacedNotWrittenThrough) {
  // The description's temporary, in a directory being made a store.
  fs::create_directories(tier());
  const fs::path target = victim();
  fs::create_symlink(target, tier() / "kvport-disk.json.tmp");
  {
    auto s = DiskStore::open(options());
    EXPECT_EQ(put(*s, chain(2, 2)), 2u);
  }
  EXPECT_EQ(text_of(target), kPrecious);
  // The index's temporary, at a compaction at open (1,100 unreadable
  // records: more than 2 x 2 live + 1024).
  {
    std::ofstream index(tier() / "index.log", std::ios::binary | std::ios::app);
    const std::string zeros(1100 * 64, '\0');
    index << zeros;
  }
  fs::create_symlink(target, tier() / "index.log.tmp");
  auto s = DiskStore::open(options());
  EXPECT_EQ(s->counters().journal_compactions, 1u);
  EXPECT_EQ(get(*s, chain(2, 2)), 2u);
  EXPECT_EQ(text_of(target), kPrecious);
  EXPECT_TRUE(fs::is_regular_file(fs::symlink_status(tier() / "index.log")));
  EXPECT_EQ(fs::file_size(tier() / "index.log"), 2u * 64);
}

// ---- FIFOs ------------------------------------------------------------------------------

// Runs `check` (exit 0 when it held) in a child process stopped by SIGALRM
// after 30 s (times KVPORT_TEST_TIME_SCALE): an open that blocks on a FIFO
// fails the test instead of hanging it.
::testing::AssertionResult in_child(const std::function<int()>& check) {
  const auto limit = kvport::testing::scaled(std::chrono::seconds(30));
  const pid_t child = ::fork();
  if (child < 0) return ::testing::AssertionFailure() << "fork failed";
  if (child == 0) {
    ::alarm(static_cast<unsigned>(limit.count()));
    int code = 10;
    try {
      code = check();
    } catch (...) {
      code = 11;
    }
    ::_exit(code);
  }
  int status = 0;
  if (::waitpid(child, &status, 0) != child) return ::testing::AssertionFailure() << "waitpid";
  if (WIFSIGNALED(status) && WTERMSIG(status) == SIGALRM) {
    return ::testing::AssertionFailure()
           << "the open blocked (killed after " << limit.count() << " s)";
  }
  if (!WIFEXITED(status) || WEXITSTATUS(status) != 0) {
    return ::testing::AssertionFailure() << "check failed: status " << status;
  }
  return ::testing::AssertionSuccess();
}

TEST_F(HostileDirTest, AStoreFileThatIsAFifoIsRefusedWithoutBlocking) {
  for (const char* name : {"kvport-disk.json", "blocks.dat", "index.log", "kvport-disk.lock"}) {
    SCOPED_TRACE(name);
    fs::remove_all(tier());
    { auto s = DiskStore::open(options()); }
    fs::remove(tier() / name);
    ASSERT_EQ(::mkfifo((tier() / name).c_str(), 0644), 0);
    for (bool read_only : {false, true}) {
      auto o = options();
      o.read_only = read_only;
      EXPECT_TRUE(in_child([&] {
        const std::string why = refusal(o);
        if (!contains(why, (tier() / name).string()) || !contains(why, "is a FIFO")) {
          std::fprintf(stderr, "refusal: '%s'\n", why.c_str());
          return 1;
        }
        return 0;
      })) << (read_only ? "reader" : "writer");
    }
  }
}

// ---- someone else's directory -------------------------------------------------------------

TEST_F(HostileDirTest, ANonEmptyDirectoryThatIsNotAStoreIsRefusedAndNothingInItChanges) {
  fs::create_directories(tier());
  std::ofstream(tier() / "index.log") << kPrecious;
  std::ofstream(tier() / "blocks.dat") << kPrecious;
  const std::string why = refusal(options());
  EXPECT_TRUE(contains(why, "not a kvport disk store") && contains(why, "'blocks.dat'")) << why;
  EXPECT_EQ(text_of(tier() / "index.log"), kPrecious);
  EXPECT_EQ(text_of(tier() / "blocks.dat"), kPrecious);
  std::size_t entries = 0;
  for ([[maybe_unused]] const auto& e : fs::directory_iterator(tier()))
    ++entries;
  EXPECT_EQ(entries, 2u) << "the refused open left a file there";
  // Any file at all: a directory of notes is not made a store either.
  fs::remove_all(tier());
  fs::create_directories(tier());
  std::ofstream(tier() / "notes.txt") << kPrecious;
  EXPECT_TRUE(contains(refusal(options()), "'notes.txt'"));
  // An empty existing directory becomes one.
  fs::remove(tier() / "notes.txt");
  auto s = DiskStore::open(options());
  EXPECT_EQ(put(*s, chain(3, 1)), 1u);
}

TEST_F(HostileDirTest, ARefusedOpenLeavesNothingBehindSoTheCorrectedRerunOpens) {
  // No space for the data file: the open is refused, and what it made is
  // gone again, but for the (empty) lock file: another open may hold it, so
  // it is never removed. The directory holding it stays.
  auto o = options(16);
  o.wrap_io = [](std::string_view file, std::unique_ptr<FileIo> io) -> std::unique_ptr<FileIo> {
    auto f = std::make_unique<FaultInjectingFileIo>(std::move(io));
    if (file == "data") f->plan(IoFault{IoStep::allocate, std::nullopt, ENOSPC, 0, 1});
    return f;
  };
  EXPECT_TRUE(contains(refusal(o), "No space left")) << refusal(o);
  const std::vector<std::string> lock_only{"kvport-disk.lock"};
  EXPECT_EQ(entries_of(tier()), lock_only);
  EXPECT_EQ(fs::file_size(tier() / "kvport-disk.lock"), 0u);
  // In a directory that was there (empty), it leaves the lock file alone.
  fs::remove_all(tier());
  fs::create_directories(tier());
  EXPECT_TRUE(contains(refusal(o), "No space left"));
  EXPECT_EQ(entries_of(tier()), lock_only);
  EXPECT_EQ(fs::file_size(tier() / "kvport-disk.lock"), 0u);
  // The rerun with fewer slots is not told "made for another layout".
  auto s = DiskStore::open(options(8));
  EXPECT_EQ(put(*s, chain(4, 2)), 2u);
  // A refused open of an existing store (its data file cut short: it must
  // grow, and cannot) removes none of its files and gives back what it
  // allocated.
  s.reset();
  constexpr std::uint64_t kTwoSlots = 2 * 4096;  // the 2 blocks' slots
  fs::resize_file(tier() / "blocks.dat", kTwoSlots);
  o.num_slots = 8;
  EXPECT_TRUE(contains(refusal(o), "No space left"));
  EXPECT_EQ(fs::file_size(tier() / "blocks.dat"), kTwoSlots);
  s = DiskStore::open(options(8));
  EXPECT_EQ(get(*s, chain(4, 2)), 2u);
}

// An existing store whose data file has its full size opens although it
// cannot be preallocated (a full file system): sparse, and it says so.
TEST_F(HostileDirTest, AFullSizeStoreThatCannotBePreallocatedOpensSparse) {
  {
    auto s = DiskStore::open(options());
    ASSERT_EQ(put(*s, chain(7, 2)), 2u);
  }
  auto o = options();
  o.wrap_io = [](std::string_view file, std::unique_ptr<FileIo> io) -> std::unique_ptr<FileIo> {
    auto f = std::make_unique<FaultInjectingFileIo>(std::move(io));
    if (file == "data") f->plan(IoFault{IoStep::allocate, std::nullopt, ENOSPC, 0, 1});
    return f;
  };
  std::unique_ptr<DiskStore> s;
  ASSERT_NO_THROW(s = DiskStore::open(o));
  EXPECT_TRUE(
      contains(s->io_description(), "; sparse (preallocation failed: No space left on device)"))
      << s->io_description();
  EXPECT_EQ(get(*s, chain(7, 2)), 2u);
  EXPECT_EQ(put(*s, chain(8, 1)), 1u);
  // The next open that can allocate says preallocated again.
  s.reset();
  s = DiskStore::open(options());
  EXPECT_TRUE(contains(s->io_description(), "; preallocated")) << s->io_description();
  EXPECT_EQ(get(*s, chain(8, 1)), 1u);
}

// A refused open never removes the lock file, which another open may hold:
// removing it would let a third open lock a new one (two writers).
TEST_F(HostileDirTest, ARefusedOpenLeavesTheLockFileItsHolderHolds) {
  auto holder = DiskStore::open(options());
  ASSERT_EQ(put(*holder, chain(6, 2)), 2u);
  struct stat before {};
  ASSERT_EQ(::stat((tier() / "kvport-disk.lock").c_str(), &before), 0);
  EXPECT_TRUE(contains(refusal(options()), "in use by another process"));
  struct stat after {};
  ASSERT_EQ(::stat((tier() / "kvport-disk.lock").c_str(), &after), 0);
  EXPECT_EQ(after.st_ino, before.st_ino) << "the lock file was made anew";
  // The holder still holds it: a third open (writer or reader) is refused.
  EXPECT_TRUE(contains(refusal(options()), "in use by another process"));
  auto ro = options();
  ro.read_only = true;
  EXPECT_TRUE(contains(refusal(ro), "in use by another process"));
  EXPECT_EQ(get(*holder, chain(6, 2)), 2u);
}

// Two opens of a new directory at once (both find no lock file, both open
// it with O_CREAT): the loser's refusal must not unlink the lock the winner
// holds. Whichever wins, a third open is refused while it holds the store.
TEST_F(HostileDirTest, TwoOpensOfANewDirectoryAtOnceLeaveOneWriter) {
  for (int round = 0; round < 50; ++round) {
    SCOPED_TRACE(round);
    fs::remove_all(tier());
    std::atomic<int> ready{0};
    std::unique_ptr<DiskStore> won[2];
    std::string why[2];
    auto opener = [&](int i) {
      ready.fetch_add(1);
      while (ready.load() < 2) {
      }
      try {
        won[i] = DiskStore::open(options());
      } catch (const std::exception& e) {
        why[i] = e.what();
      }
    };
    std::thread a(opener, 0);
    std::thread b(opener, 1);
    a.join();
    b.join();
    ASSERT_EQ((won[0] ? 1 : 0) + (won[1] ? 1 : 0), 1) << why[0] << " / " << why[1];
    EXPECT_TRUE(contains(why[won[0] ? 1 : 0], "in use by another process")) << why[won[0] ? 1 : 0];
    const std::string third = refusal(options());
    ASSERT_TRUE(contains(third, "in use by another process")) << "two writers: " << third;
  }
}

// ---- a description that is not one ------------------------------------------------------

TEST_F(HostileDirTest, ADescriptionWhoseLayoutEntriesAreNotObjectsNamesTheField) {
  { auto s = DiskStore::open(options()); }
  std::string text = text_of(tier() / "kvport-disk.json");
  const std::size_t at = text.find("\"layout\"");
  ASSERT_NE(at, std::string::npos);
  const std::size_t end = text.find(']', at);
  text.replace(at, end - at + 1, "\"layout\": [5, \"x\"]");
  std::ofstream(tier() / "kvport-disk.json", std::ios::trunc) << text;
  const std::string why = refusal(options());
  EXPECT_TRUE(contains(why, "field 'layout' entry 0 is 5")) << why;
}

TEST_F(HostileDirTest, AWarmOpenDescribesTheDataFileAsTheColdOneDid) {
  std::string cold;
  {
    auto s = DiskStore::open(options());
    cold = s->io_description();
  }
  auto s = DiskStore::open(options());
  EXPECT_EQ(s->io_description(), cold);
}

// ---- an index far larger than the store could have written -------------------------------

TEST_F(HostileDirTest, AHugeIndexIsStreamedInBoundedMemoryAndCompacted) {
  if (kvport::testing::kAddressSanitizer || kvport::testing::kThreadSanitizer)
    GTEST_SKIP() << "an address-space limit cannot be set under a sanitizer";
  { auto s = DiskStore::open(options()); }
  // 512 MiB of records (sparse: zeros, none valid) for 16 slots.
  constexpr std::uint64_t kIndexBytes = std::uint64_t{1} << 29;
  fs::resize_file(tier() / "index.log", kIndexBytes);
  // The open runs in a child whose address space may grow by 128 MiB at
  // most: reading the index whole cannot fit, streaming it does.
  EXPECT_TRUE(in_child([&] {
    std::ifstream statm("/proc/self/statm");
    std::uint64_t pages = 0;
    statm >> pages;
    const rlimit limit{pages * static_cast<std::uint64_t>(::sysconf(_SC_PAGESIZE)) + (128 << 20),
                       RLIM_INFINITY};
    if (::setrlimit(RLIMIT_AS, &limit) != 0) return 2;
    std::unique_ptr<DiskStore> s;
    try {
      s = DiskStore::open(options());
    } catch (const std::bad_alloc&) {
      return 3;
    }
    if (s->counters().dropped_at_open != kIndexBytes / 64) return 4;
    if (s->counters().journal_compactions != 1) return 5;
    if (fs::file_size(tier() / "index.log") != 0) return 6;
    return put(*s, chain(5, 2)) == 2 ? 0 : 7;
  }));
}

// ---- an index that cannot be written ------------------------------------------------------

class IndexFailureTest : public HostileDirTest {
 protected:
  // A full store of 4 good blocks, its index file wrapped for faults.
  std::unique_ptr<DiskStore> full_store() {
    auto o = options(4);
    o.wrap_io = [this](std::string_view file,
                       std::unique_ptr<FileIo> io) -> std::unique_ptr<FileIo> {
      if (file != "index") return io;
      auto f = std::make_unique<FaultInjectingFileIo>(std::move(io));
      index_ = f.get();
      return f;
    };
    auto s = DiskStore::open(o);
    EXPECT_EQ(put(*s, good_), 4u);
    return s;
  }
  const std::vector<BlockHash> good_ = chain(6, 4);
  FaultInjectingFileIo* index_ = nullptr;
};

TEST_F(IndexFailureTest, NoRoomForRecordsRefusesPutsWithoutEvictingAGoodBlock) {
  auto s = full_store();
  // A file system with room for the data (preallocated) but not the index.
  index_->plan(IoFault{IoStep::allocate, std::nullopt, ENOSPC, 0, 1000});
  index_->plan(IoFault{IoStep::complete, IoOp::write, ENOSPC, 0, 1000});
  for (std::uint32_t k = 0; k < 5; ++k)
    EXPECT_EQ(put(*s, chain(100 + k, 1)), 0u);
  EXPECT_EQ(s->counters().evictions, 0u);
  EXPECT_EQ(s->counters().index_failures, 5u);
  EXPECT_EQ(s->counters().write_failures, 5u);
  EXPECT_EQ(s->counters().writes, 4u) << "a put wrote data it could not record";
  EXPECT_TRUE(s->index_failing());
  EXPECT_NE(s->io_description().find("index cannot be written"), std::string::npos);
  EXPECT_EQ(get(*s, good_), 4u);  // what is durable is still served
  EXPECT_TRUE(s->check_invariants().empty());
  // Room again: the store goes on.
  index_->clear();
  EXPECT_EQ(put(*s, chain(200, 1)), 1u);
  EXPECT_FALSE(s->index_failing());
  EXPECT_EQ(s->counters().evictions, 1u);
}

TEST_F(IndexFailureTest, AFailingAppendStopsEvictionUntilAnAppendSucceeds) {
  auto s = full_store();
  // Room is reserved, but every append fails (EIO): the first put's slot
  // was taken before the failure could be known; after it, none is: puts of
  // 2 and 3 blocks take the one free slot and evict nothing more.
  index_->plan(IoFault{IoStep::complete, IoOp::write, EIO, 0, 1000});
  for (std::uint32_t k = 0; k < 3; ++k)
    EXPECT_EQ(put(*s, chain(300 + k, k + 1)), 0u);
  EXPECT_EQ(s->counters().evictions, 1u);
  EXPECT_EQ(s->counters().dropped_puts, 1u + 2u);  // no slot to take without evicting
  EXPECT_TRUE(s->index_failing());
  EXPECT_EQ(s->counters().index_failures, 3u);
  const std::vector<BlockHash> kept(good_.begin() + 1, good_.end());
  for (const BlockHash& h : kept)
    EXPECT_TRUE(s->contains(h));
  EXPECT_EQ(get(*s, kept), 3u);
  EXPECT_TRUE(s->check_invariants().empty());
  index_->clear();
  EXPECT_EQ(put(*s, chain(400, 1)), 1u);  // into the free slot: a successful append
  EXPECT_FALSE(s->index_failing());
  EXPECT_EQ(put(*s, chain(401, 1)), 1u);  // evicting again
  EXPECT_EQ(s->counters().evictions, 2u);
}

}  // namespace
}  // namespace kvport::disk
