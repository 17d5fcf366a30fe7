// SPDX-License-Identifier: Apache-2.0
#include "store_file.hpp"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <string>

#include "kvport/platform/error.hpp"

namespace kvport::disk::detail {

std::string file_kind(mode_t mode) {
  if (S_ISREG(mode)) return "a regular file";
  if (S_ISLNK(mode)) return "a symbolic link";
  if (S_ISFIFO(mode)) return "a FIFO";
  if (S_ISDIR(mode)) return "a directory";
  if (S_ISSOCK(mode)) return "a socket";
  if (S_ISCHR(mode)) return "a character device";
  if (S_ISBLK(mode)) return "a block device";
  return "not a regular file";
}

int open_regular(const std::filesystem::path& path, int flags, mode_t mode) {
  // O_NONBLOCK: opening a FIFO for reading would wait for a writer forever.
  const int fd = ::open(path.c_str(), flags | O_NOFOLLOW | O_NONBLOCK | O_CLOEXEC, mode);
  if (fd < 0) return -1;
  struct stat st {};
  if (::fstat(fd, &st) != 0 || !S_ISREG(st.st_mode)) {
    const std::string kind = st.st_mode != 0 ? file_kind(st.st_mode) : "of an unknown kind";
    ::close(fd);
    throw InvalidArgument(path.string() + " is " + kind +
                          ", not a regular file: a disk store uses only regular files of its own "
                          "(refused)");
  }
  // A file opened for writing must have no other name: a hard link is a
  // regular file too, and would carry the store's writes to a file outside.
  if ((flags & O_ACCMODE) != O_RDONLY && st.st_nlink > 1) {
    ::close(fd);
    throw InvalidArgument(path.string() + " has " + std::to_string(st.st_nlink) +
                          " names (hard links): a disk store writes only files of its own "
                          "(refused)");
  }
  // Back to blocking I/O (io_uring would otherwise answer EAGAIN where the
  // page cache cannot serve a buffered read at once).
  const int fl = ::fcntl(fd, F_GETFL);
  if (fl < 0 || ::fcntl(fd, F_SETFL, fl & ~O_NONBLOCK) != 0) {
    const int e = errno;
    ::close(fd);
    errno = e;
    return -1;
  }
  return fd;
}

std::string open_failure(const std::filesystem::path& path, int error, std::string_view doing) {
  struct stat st {};
  if (error == ELOOP && ::lstat(path.c_str(), &st) == 0 && S_ISLNK(st.st_mode)) {
    return path.string() +
           " is a symbolic link: a disk store never follows links inside its directory "
           "(refused)";
  }
  return "cannot " + std::string(doing) + " " + path.string() + ": " + std::strerror(error);
}

}  // namespace kvport::disk::detail
