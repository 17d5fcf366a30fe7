// SPDX-License-Identifier: Apache-2.0
#include "kvport/sim/file_error.hpp"

#include <cerrno>
#include <system_error>

namespace kvport::sim {

std::string errno_text(int error) {
  switch (error) {
    case ENOENT:
      return "no such file";
    case EACCES:
    case EPERM:
      return "permission denied";
    case ENOTDIR:
      return "a component of the path is not a directory";
    case EISDIR:
      return "is a directory";
    default:
      return std::system_category().message(error);
  }
}

}  // namespace kvport::sim
