// SPDX-License-Identifier: Apache-2.0
// Opening a file of a disk store: never through a symbolic link, never
// blocking on a FIFO, regular files only. A store's directory may hold
// anything (a mistake, another user's link); no name in it may lead the store
// to read or write anything but its own regular files.
#pragma once

#include <sys/types.h>

#include <filesystem>
#include <string>
#include <string_view>

namespace kvport::disk::detail {

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
