// SPDX-License-Identifier: Apache-2.0
// Opening a file of a disk store: never through a symbolic link, never
// blocking on a FIFO, regular files only. A store's directory may hold
// anything (a mistake, another user's link); no name in it may lead the store
// to read or write anything but its own regular files.
#pragma once

#include <sys/types.h>
#include <unistd.h>

#include <filesystem>
#include <string>
#include <string_view>
#include <utility>

namespace kvport::disk::detail {

/// Owns a file descriptor: closes it when it goes (-1: none). Move-only.
class UniqueFd {
 public:
  explicit UniqueFd(int fd = -1) noexcept : fd_(fd) {}
  UniqueFd(UniqueFd&& other) noexcept : fd_(std::exchange(other.fd_, -1)) {}
  UniqueFd& operator=(UniqueFd&& other) noexcept {
    if (this != &other) {
      reset();
      fd_ = std::exchange(other.fd_, -1);
    }
    return *this;
  }
  UniqueFd(const UniqueFd&) = delete;
  UniqueFd& operator=(const UniqueFd&) = delete;
  ~UniqueFd() { reset(); }

  int get() const noexcept { return fd_; }
  void reset() noexcept {
    if (fd_ >= 0) (void)::close(fd_);
    fd_ = -1;
  }

 private:
  int fd_;
};

/// "a symbolic link", "a FIFO", "a directory", "a socket", "a character
/// device", "a block device", "a regular file".
std::string file_kind(mode_t mode);

/// Opens `path` with `flags` | O_NOFOLLOW | O_NONBLOCK | O_CLOEXEC (`mode`
/// for O_CREAT), checks with fstat that it is a regular file, then clears
/// O_NONBLOCK. Returns the descriptor, or -1 with errno set when open(2)
/// failed (ELOOP: `path` is a symbolic link). Throws InvalidArgument naming
/// the path and what it is when it opened something other than a regular
/// file, or, for writing, a file with another name (a hard link). One open
/// and one fstat.
int open_regular(const std::filesystem::path& path, int flags, mode_t mode = 0644);

/// The one-line reason why open_regular(path) failed with `error`, for a
/// message "cannot <doing> <reason>": a symbolic link is named as one. One
/// lstat.
std::string open_failure(const std::filesystem::path& path, int error, std::string_view doing);

}  // namespace kvport::disk::detail
