// SPDX-License-Identifier: Apache-2.0
// FileIo on both engines, direct and buffered: what is written reads back,
// short transfers and bad requests are reported, the file's state (size,
// link, preallocation) is seen; the fault-injecting decorator fails each
// step as planned.
#include <gtest/gtest.h>
#include <unistd.h>

#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <memory>
#include <string>
#include <tuple>
#include <vector>

#include "disk_test_util.hpp"
#include "kvport/disk/file_io.hpp"
#include "kvport/platform/error.hpp"

namespace kvport::disk {
namespace {

using test::TempDir;
using namespace std::chrono_literals;

struct Aligned {
  explicit Aligned(std::size_t n)
      : bytes(n), p(static_cast<std::byte*>(std::aligned_alloc(kDirectAlignment, n))) {}
  ~Aligned() { std::free(p); }
  Aligned(const Aligned&) = delete;
  Aligned& operator=(const Aligned&) = delete;
  std::size_t bytes;
  std::byte* p;
};

class FileIoTest : public ::testing::TestWithParam<std::tuple<IoEngine, bool>> {
 protected:
  void SetUp() override {
    if (std::get<0>(GetParam()) == IoEngine::io_uring && !io_uring_compiled()) {
      GTEST_SKIP() << "built without liburing";
    }
  }
  std::unique_ptr<FileIo> open(bool create = true, bool read_only = false) {
    FileIoOptions o;
    o.engine = std::get<0>(GetParam());
    o.direct = std::get<1>(GetParam());
    o.create = create;
    o.read_only = read_only;
    o.queue_depth = 4;  // fewer than the requests below: the batch runs in waves
    return open_file_io(dir_.path() / "f.dat", o);
  }
  TempDir dir_;
};

TEST_P(FileIoTest, WritesReadBackInOneBatchLargerThanTheQueue) {
  auto io = open();
  ASSERT_EQ(io->allocate(10 * 4096), 0);
  Aligned out(10 * 4096);
  Aligned in(10 * 4096);
  for (std::size_t i = 0; i < out.bytes; ++i)
    out.p[i] = static_cast<std::byte>(i * 7 + 3);
  std::vector<IoRequest> w, r;
  for (std::size_t k = 0; k < 10; ++k) {
    w.push_back(IoRequest{IoOp::write, k * 4096, out.p + k * 4096, 4096, k});
    r.push_back(IoRequest{IoOp::read, k * 4096, in.p + k * 4096, 4096, k});
  }
  std::vector<IoResult> res(10);
  io->run(w, res, 5000ms);
  for (const IoResult& x : res)
    EXPECT_EQ(x.error, 0);
  EXPECT_EQ(io->sync(), 0);
  std::vector<int> calls(10, 0);
  io->run(r, res, 0ms, [&](std::size_t i) {
    EXPECT_EQ(res[i].error, 0);  // final when reported
    ++calls[i];
  });
  EXPECT_EQ(calls, std::vector<int>(10, 1));
  for (const IoResult& x : res) {
    EXPECT_EQ(x.error, 0);
    EXPECT_EQ(x.bytes, 4096u);
    EXPECT_FALSE(x.orphaned);
  }
  EXPECT_EQ(std::memcmp(out.p, in.p, out.bytes), 0);
  EXPECT_EQ(io->orphans(), 0u);
}

TEST_P(FileIoTest, TwoRecycledBuffersServeABatchOfTen) {
  auto io = open();
  ASSERT_EQ(io->allocate(10 * 4096), 0);
  Aligned data(10 * 4096);
  for (std::size_t i = 0; i < data.bytes; ++i)
    data.p[i] = static_cast<std::byte>(i / 4096 + 1);
  std::vector<IoRequest> w;
  for (std::size_t k = 0; k < 10; ++k)
    w.push_back(IoRequest{IoOp::write, k * 4096, data.p + k * 4096, 4096, k});
  std::vector<IoResult> res(10);
  io->run(w, res, 5000ms);
  // Reads without buffers: two are handed out and given back as each completes.
  Aligned pool(2 * 4096);
  std::vector<std::byte*> free_bufs{pool.p, pool.p + 4096};
  std::vector<std::byte*> given(10, nullptr);
  std::vector<int> first_byte(10, -1);
  std::vector<IoRequest> r;
  for (std::size_t k = 0; k < 10; ++k)
    r.push_back(IoRequest{IoOp::read, k * 4096, nullptr, 4096, k});
  io->run(
      r, res, 5000ms,
      [&](std::size_t i) {
        if (given[i] == nullptr) return;  // failed without a buffer
        first_byte[i] = std::to_integer<int>(given[i][0]);
        free_bufs.push_back(given[i]);
      },
      [&](std::size_t i) -> std::byte* {
        if (free_bufs.empty()) return nullptr;
        given[i] = free_bufs.back();
        free_bufs.pop_back();
        return given[i];
      });
  for (std::size_t k = 0; k < 10; ++k) {
    EXPECT_EQ(res[k].error, 0);
    EXPECT_EQ(first_byte[k], static_cast<int>(k + 1));
  }
  // None to give at all: each request fails with ENOBUFS, none hangs.
  io->run(r, res, 5000ms, {}, [](std::size_t) -> std::byte* { return nullptr; });
  for (const IoResult& x : res)
    EXPECT_EQ(x.error, ENOBUFS);
}

TEST_P(FileIoTest, ReadPastTheEndIsShort) {
  auto io = open();
  ASSERT_EQ(io->allocate(4096), 0);
  Aligned buf(8192);
  const IoRequest req{IoOp::read, 0, buf.p, 8192, 0};
  IoResult res;
  io->run(std::span(&req, 1), std::span(&res, 1), 5000ms);
  EXPECT_EQ(res.error, EREMOTEIO);
  EXPECT_EQ(res.bytes, 4096u);
}

TEST_P(FileIoTest, SizeLinkAndPreallocation) {
  auto io = open();
  EXPECT_FALSE(io->preallocated());
  ASSERT_EQ(io->allocate(3 * 4096), 0);
  EXPECT_TRUE(io->preallocated());  // ext4 and tmpfs both fallocate
  EXPECT_EQ(io->size().value_or(0), 3u * 4096);
  EXPECT_TRUE(io->linked());
  std::filesystem::remove(dir_.path() / "f.dat");
  EXPECT_FALSE(io->linked());
}

TEST_P(FileIoTest, BadRequestsThrowBeforeAnyIo) {
  auto io = open();
  Aligned buf(4096);
  IoResult res;
  const IoRequest null_buffer{IoOp::read, 0, nullptr, 4096, 0};
  EXPECT_THROW(io->run(std::span(&null_buffer, 1), std::span(&res, 1), 0ms), InvalidArgument);
  const IoRequest zero{IoOp::read, 0, buf.p, 0, 0};
  EXPECT_THROW(io->run(std::span(&zero, 1), std::span(&res, 1), 0ms), InvalidArgument);
  const IoRequest ok{IoOp::read, 0, buf.p, 4096, 0};
  std::vector<IoResult> two(2);
  EXPECT_THROW(io->run(std::span(&ok, 1), two, 0ms), InvalidArgument);
  EXPECT_THROW(io->run(std::span(&ok, 1), std::span(&res, 1), -1ms), InvalidArgument);
  if (io->direct()) {
    const IoRequest misaligned{IoOp::write, 100, buf.p, 4096, 0};
    EXPECT_THROW(io->run(std::span(&misaligned, 1), std::span(&res, 1), 0ms), InvalidArgument);
  }
}

TEST_P(FileIoTest, ReadOnlyRefusesWritesAndAllocation) {
  { auto io = open(); }
  auto ro = open(false, true);
  EXPECT_TRUE(ro->read_only());
  Aligned buf(4096);
  const IoRequest w{IoOp::write, 0, buf.p, 4096, 0};
  IoResult res;
  EXPECT_THROW(ro->run(std::span(&w, 1), std::span(&res, 1), 0ms), InvalidArgument);
  EXPECT_THROW((void)ro->allocate(4096), InvalidArgument);
}

TEST_P(FileIoTest, DescribeNamesTheEngineAndTheCacheMode) {
  auto io = open();
  const std::string d = io->describe();
  const IoEngine e = std::get<0>(GetParam());
  if (e == IoEngine::io_uring) {
    EXPECT_NE(d.find("io_uring"), std::string::npos) << d;
  }
  if (e == IoEngine::sync) {
    EXPECT_NE(d.find("pread/pwrite"), std::string::npos) << d;
  }
  EXPECT_NE(d.find(io->direct() ? "O_DIRECT" : "buffered"), std::string::npos) << d;
  if (std::get<1>(GetParam()) && !io->direct()) {
    EXPECT_NE(d.find("O_DIRECT refused"), std::string::npos) << d;  // a file system without it
  }
  if (!std::get<1>(GetParam())) {
    EXPECT_FALSE(io->direct());
  }
}

INSTANTIATE_TEST_SUITE_P(Engines, FileIoTest,
                         ::testing::Combine(::testing::Values(IoEngine::io_uring, IoEngine::sync),
                                            ::testing::Bool()),
                         [](const auto& param_info) {
                           return std::string(to_string(std::get<0>(param_info.param))) +
                                  (std::get<1>(param_info.param) ? "_direct" : "_buffered");
                         });

TEST(FileIoOpen, MissingFileAndDirectoryAndBadOptionsAreNamed) {
  TempDir dir;
  FileIoOptions o;
  try {
    (void)open_file_io(dir.path() / "missing.dat", o);
    FAIL() << "opened a missing file";
  } catch (const InvalidArgument& e) {
    EXPECT_NE(std::string(e.what()).find("missing.dat"), std::string::npos) << e.what();
  }
  o.create = true;
  EXPECT_THROW((void)open_file_io(dir.path(), o), InvalidArgument);  // a directory
  o.queue_depth = 0;
  EXPECT_THROW((void)open_file_io(dir.path() / "x", o), InvalidArgument);
  o.queue_depth = 8;
  o.read_only = true;
  EXPECT_THROW((void)open_file_io(dir.path() / "x", o), InvalidArgument);  // create + read_only
}

TEST(FileIoOpen, EngineNamesRoundTrip) {
  for (IoEngine e : {IoEngine::automatic, IoEngine::io_uring, IoEngine::sync}) {
    EXPECT_EQ(parse_io_engine(to_string(e)), e);
  }
  EXPECT_FALSE(parse_io_engine("uring").has_value());
}

// ---- faults ----------------------------------------------------------------------------

class FaultInjectingFileIoTest : public ::testing::Test {
 protected:
  void SetUp() override {
    FileIoOptions o;
    o.create = true;
    o.engine = IoEngine::sync;
    auto inner = open_file_io(dir_.path() / "f.dat", o);
    io_ = std::make_unique<FaultInjectingFileIo>(std::move(inner));
    ASSERT_EQ(io_->allocate(4 * 4096), 0);
  }
  std::vector<IoResult> write_four() {
    std::vector<IoRequest> reqs;
    for (std::size_t k = 0; k < 4; ++k) {
      reqs.push_back(IoRequest{IoOp::write, k * 4096, buf_.p + k * 4096, 4096, k});
    }
    std::vector<IoResult> res(4);
    io_->run(reqs, res, 5000ms);
    return res;
  }
  TempDir dir_;
  Aligned buf_{4 * 4096};
  std::unique_ptr<FaultInjectingFileIo> io_;
};

TEST_F(FaultInjectingFileIoTest, EachRequestStepFailsAsPlanned) {
  io_->plan(IoFault{IoStep::submit, IoOp::write, ENOSPC, 1, 1});  // the second write
  io_->plan(IoFault{IoStep::complete, IoOp::write, EIO, 0, 1});   // then the first left
  io_->plan(IoFault{IoStep::short_io, std::nullopt, 0, 0, 1});
  io_->plan(IoFault{IoStep::timeout, IoOp::read, 0, 0, 1});  // a read: not matched here
  std::vector<IoRequest> reqs;
  for (std::size_t k = 0; k < 4; ++k) {
    reqs.push_back(IoRequest{IoOp::write, k * 4096, buf_.p + k * 4096, 4096, k});
  }
  std::vector<IoResult> res(4);
  std::vector<int> seen(4, -1);
  io_->run(reqs, res, 5000ms, [&](std::size_t i) { seen[i] = res[i].error; });
  EXPECT_EQ(seen, (std::vector<int>{EIO, ENOSPC, EREMOTEIO, 0}));  // injected before reported
  EXPECT_EQ(res[0].error, EIO);                                    // complete: issued, then failed
  EXPECT_EQ(res[1].error, ENOSPC);                                 // submit
  EXPECT_EQ(res[2].error, EREMOTEIO);
  EXPECT_EQ(res[2].bytes, 2048u);
  EXPECT_EQ(res[3].error, 0);
  EXPECT_EQ(io_->injected(), 3u);
  // The read timeout fires on the first read.
  const IoRequest r{IoOp::read, 0, buf_.p, 4096, 9};
  IoResult rr;
  io_->run(std::span(&r, 1), std::span(&rr, 1), 5000ms);
  EXPECT_EQ(rr.error, ETIMEDOUT);
  EXPECT_FALSE(rr.orphaned);
  EXPECT_EQ(io_->injected(), 4u);
  // Nothing planned is left: everything passes.
  for (const IoResult& x : write_four())
    EXPECT_EQ(x.error, 0);
}

TEST_F(FaultInjectingFileIoTest, SyncAndAllocateFailAndClearDropsThePlan) {
  io_->plan(IoFault{IoStep::sync, std::nullopt, EIO, 0, 2});
  io_->plan(IoFault{IoStep::allocate, std::nullopt, ENOSPC, 0, 1});
  EXPECT_EQ(io_->sync(), EIO);
  EXPECT_EQ(io_->allocate(8 * 4096), ENOSPC);
  EXPECT_EQ(io_->sync(), EIO);
  EXPECT_EQ(io_->sync(), 0);
  EXPECT_EQ(io_->injected(), 3u);
  io_->plan(IoFault{IoStep::sync, std::nullopt, EIO, 0, 1});
  io_->clear();
  EXPECT_EQ(io_->sync(), 0);
  EXPECT_THROW(io_->plan(IoFault{IoStep::sync, std::nullopt, EIO, 0, 0}), InvalidArgument);
  EXPECT_THROW(FaultInjectingFileIo(nullptr), InvalidArgument);
  EXPECT_NE(io_->describe().find("faults injected"), std::string::npos);
}

}  // namespace
}  // namespace kvport::disk
