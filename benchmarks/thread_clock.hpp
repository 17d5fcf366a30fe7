// SPDX-License-Identifier: Apache-2.0
// The calling thread's CPU time, for benchmarks on a shared machine: time the
// thread spent descheduled (builds, other jobs, a publisher thread beside it)
// would otherwise land on whichever variant happened to be running.
#pragma once

#include <time.h>

namespace kvport::bench {

/// This thread's CPU time, ns (CLOCK_THREAD_CPUTIME_ID).
inline double thread_cpu_ns() {
  timespec t{};
  clock_gettime(CLOCK_THREAD_CPUTIME_ID, &t);
  return static_cast<double>(t.tv_sec) * 1e9 + static_cast<double>(t.tv_nsec);
}

/// The thread's CPU time of f(), ns.
template <class F>
double timed_ns(F&& f) {
  const double start = thread_cpu_ns();
  f();
  return thread_cpu_ns() - start;
}

}  // namespace kvport::bench
