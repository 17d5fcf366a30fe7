// SPDX-License-Identifier: Apache-2.0
// The `kvport` command-line program as a library call, so that tests run it
// in-process.
#pragma once

#include <iosfwd>

namespace kvport::cli {

/// Exit codes of `kvport`.
inline constexpr int kExitOk = 0;
/// The command ran but a check it makes failed (demo: the invariant check).
inline constexpr int kExitCheckFailed = 1;
/// Bad input (unknown flag, bad size, unknown dtype/model/backend, unreadable
/// or malformed config, ...) or an error the command could not recover from.
inline constexpr int kExitError = 2;

/// Parses `argv` (argv[0] is the program name) and runs the subcommand.
/// Reports go to `out`, help to `out`; an error is ONE line on `err` starting
/// with "kvport: error: ". Never throws. Log messages from the library go to
/// the kvport logger (stderr), at level warn unless --log-level or
/// KVPORT_LOG_LEVEL says otherwise.
int run(int argc, const char* const* argv, std::ostream& out, std::ostream& err);

}  // namespace kvport::cli
