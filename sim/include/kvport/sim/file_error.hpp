// SPDX-License-Identifier: Apache-2.0
// How a failure to open or read an input file is described in messages, for
// every reader of untrusted files (traces, model configs).
#pragma once

#include <string>

namespace kvport::sim {

/// A short description of an errno value from opening or reading a file:
/// "no such file", "permission denied", "is a directory", ...; otherwise the
/// system's message.
std::string errno_text(int error);

}  // namespace kvport::sim
