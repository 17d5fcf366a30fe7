// SPDX-License-Identifier: Apache-2.0
// Objects made before os.fork() are unusable in the child: their backend's
// stream threads (and an events publisher's) exist only in the parent, so the
// first call that queues work would wait forever. Every owned state records
// the process generation it was made in; the accessors refuse it in a
// forked child with a clear error, and its destructor leaks what would join
// the missing threads (the child's memory goes with it at exit).
#pragma once

#include <cstdint>

namespace kvport::python {

/// 0 in the process that imported kvport, +1 in each child forked since
/// (pthread_atfork, installed by install_fork_guard()).
std::uint64_t process_generation() noexcept;

/// Registers the atfork handler (once; at import).
void install_fork_guard();

/// kvport.Error naming `what` when `generation` is not this process's:
/// the object was made before a fork.
void check_same_process(std::uint64_t generation, const char* what);

}  // namespace kvport::python
