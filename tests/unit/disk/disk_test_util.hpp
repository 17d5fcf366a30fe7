// SPDX-License-Identifier: Apache-2.0
// Helpers of the disk tier's tests: a temporary directory removed at the end,
// block images derived from their hashes (so any block read back can be
// checked without remembering what was written), hashes of test sequences.
#pragma once

#include <gtest/gtest.h>
#include <signal.h>
#include <stdlib.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <functional>
#include <span>
#include <string>
#include <thread>
#include <vector>

#include "kvport/core/block_hash.hpp"
#include "kvport/disk/disk_store.hpp"

namespace kvport::disk::test {

/// A fresh directory under the system's temporary directory, removed (with
/// everything in it) when the object goes.
class TempDir {
 public:
  TempDir() {
    std::string tmpl = (std::filesystem::temp_directory_path() / "kvport-disk-XXXXXX").string();
    if (::mkdtemp(tmpl.data()) == nullptr) ADD_FAILURE() << "mkdtemp failed";
    path_ = tmpl;
  }
  ~TempDir() {
    std::error_code ec;
    std::filesystem::remove_all(path_, ec);
  }
  TempDir(const TempDir&) = delete;
  TempDir& operator=(const TempDir&) = delete;
  const std::filesystem::path& path() const { return path_; }

 private:
  std::filesystem::path path_;
};

/// The bytes of the block whose hash is `h`: a pattern of its hash and the
/// byte's position.
inline std::vector<std::byte> image_of(const BlockHash& h, std::size_t bytes) {
  std::vector<std::byte> out(bytes);
  for (std::size_t i = 0; i < bytes; ++i) {
    const std::uint64_t word = (i / 8) % 2 == 0 ? h.low : h.high;
    out[i] = static_cast<std::byte>(((word >> (8 * (i % 8))) ^ (i * 31)) & 0xFF);
  }
  return out;
}

/// Puts the blocks of `hashes` with their images (image_of) of `bytes` each;
/// returns what DiskStore::put returns.
inline std::size_t put_images(DiskStore& s, const std::vector<BlockHash>& hashes,
                              std::size_t bytes) {
  std::vector<std::vector<std::byte>> images;
  std::vector<std::span<const std::byte>> views;
  for (const BlockHash& h : hashes)
    images.push_back(image_of(h, bytes));
  for (const auto& im : images)
    views.emplace_back(im);
  return s.put(hashes, views);
}

/// get_prefix of `hashes` into fresh buffers of `bytes` each; every block
/// returned must hold its image (a failed expectation names the block).
/// Returns how many were returned.
inline std::size_t get_checked(DiskStore& s, const std::vector<BlockHash>& hashes,
                               std::size_t bytes) {
  std::vector<std::vector<std::byte>> bufs(hashes.size(), std::vector<std::byte>(bytes));
  std::vector<std::span<std::byte>> views;
  for (auto& b : bufs)
    views.emplace_back(b);
  const std::size_t n = s.get_prefix(hashes, views);
  for (std::size_t i = 0; i < n; ++i)
    EXPECT_EQ(bufs[i], image_of(hashes[i], bytes)) << "block " << i << " has wrong bytes";
  return n;
}

/// `n` chained block hashes of a sequence identified by `seed`.
inline std::vector<BlockHash> chain(std::uint32_t seed, std::size_t n) {
  std::vector<TokenId> tokens(4 * n);
  for (std::size_t i = 0; i < tokens.size(); ++i) {
    tokens[i] = static_cast<TokenId>(seed * 100003u + i);
  }
  return hash_full_blocks(tokens, 4);
}

/// Runs `work` (which should not return) in a forked child and SIGKILLs it
/// after `delay`; fails when the fork fails or the child ended by itself
/// (an exception or a return from `work` is exit code 3).
inline ::testing::AssertionResult sigkill_after(const std::function<void()>& work,
                                                std::chrono::milliseconds delay) {
  const pid_t child = ::fork();
  if (child < 0) return ::testing::AssertionFailure() << "fork failed";
  if (child == 0) {
    try {
      work();
    } catch (...) {
    }
    ::_exit(3);
  }
  std::this_thread::sleep_for(delay);
  ::kill(child, SIGKILL);
  int status = 0;
  if (::waitpid(child, &status, 0) != child) {
    return ::testing::AssertionFailure() << "waitpid failed";
  }
  if (!WIFSIGNALED(status)) {
    return ::testing::AssertionFailure() << "the child stopped by itself: " << status;
  }
  return ::testing::AssertionSuccess();
}

}  // namespace kvport::disk::test
