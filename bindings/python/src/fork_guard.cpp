// SPDX-License-Identifier: Apache-2.0
#include "fork_guard.hpp"

#include <pthread.h>

#include <atomic>
#include <string>

#include "kvport/platform/error.hpp"

namespace kvport::python {

namespace {

std::atomic<std::uint64_t> generation{0};

void after_fork_in_child() noexcept {
  generation.fetch_add(1, std::memory_order_relaxed);
}

}  // namespace

std::uint64_t process_generation() noexcept {
  return generation.load(std::memory_order_relaxed);
}

void install_fork_guard() {
  static const int rc = pthread_atfork(nullptr, nullptr, after_fork_in_child);
  if (rc != 0) throw kvport::Error("kvport: pthread_atfork failed (" + std::to_string(rc) + ")");
}

void check_same_process(std::uint64_t made_in, const char* what) {
  if (made_in == process_generation()) return;
  throw kvport::Error(std::string(what) +
                      " was created before os.fork(): its backend's stream threads do not "
                      "exist in this child process. Create kvport objects after the fork "
                      "(or use multiprocessing's 'spawn' or 'forkserver' start method).");
}

}  // namespace kvport::python
