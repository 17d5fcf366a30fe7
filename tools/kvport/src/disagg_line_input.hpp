// SPDX-License-Identifier: Apache-2.0
// Lines from a file descriptor without blocking longer than asked: how a
// `kvport disagg` worker reads the coordinator's ops on stdin.
#pragma once

#include <poll.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <string>
#include <vector>

namespace kvport::cli::disagg {

// Lines from a file descriptor, without blocking longer than asked.
class LineInput {
 public:
  explicit LineInput(int fd) : fd_(fd) {}
  // Waits up to `timeout` for input; returns the complete lines read.
  std::vector<std::string> read(std::chrono::milliseconds timeout) {
    std::vector<std::string> lines;
    pollfd p{fd_, POLLIN, 0};
    const int ready = ::poll(&p, 1, static_cast<int>(timeout.count()));
    if (ready <= 0) return lines;
    char buf[65536];
    const ssize_t n = ::read(fd_, buf, sizeof buf);
    if (n == 0) {
      eof_ = true;
    } else if (n < 0) {
      if (errno != EINTR && errno != EAGAIN) eof_ = true;
    } else {
      partial_.append(buf, static_cast<std::size_t>(n));
    }
    std::size_t start = 0;
    for (std::size_t nl; (nl = partial_.find('\n', start)) != std::string::npos; start = nl + 1) {
      lines.push_back(partial_.substr(start, nl - start));
    }
    partial_.erase(0, start);
    return lines;
  }
  bool eof() const noexcept { return eof_; }

 private:
  int fd_;
  std::string partial_;
  bool eof_ = false;
};

}  // namespace kvport::cli::disagg
