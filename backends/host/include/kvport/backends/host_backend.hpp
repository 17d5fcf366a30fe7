// SPDX-License-Identifier: Apache-2.0
// The host (CPU) backend: kvport's embedded default, and a memory checker.
#pragma once

#include <cstddef>
#include <functional>
#include <memory>
#include <optional>
#include <string>

#include "kvport/platform/backend.hpp"
#include "kvport/platform/host_memory.hpp"  // host_physical_memory (the host backend's capacity)

namespace kvport {

struct HostBackendOptions {
  /// Capacity reported by mem_info and enforced by alloc. Unset: the
  /// `KVPORT_HOST_MEMORY` environment variable (a byte size such as "8GiB"),
  /// else the machine's physical RAM.
  std::optional<std::size_t> capacity_bytes;
};

/// Creates a host backend.
///
/// - Streams are real: each one is a worker thread running a FIFO queue, so
///   `*_async` calls return before the work is done, exactly as on a GPU.
/// - Every operation is checked against the live allocations: the range must
///   lie inside ONE allocation. A bad pointer, an out-of-bounds range or a use
///   after free throws InvalidArgument when the call is made; if the memory is
///   freed between the call and its execution, the error is deferred to the
///   stream's next `synchronize`.
/// - Allocations are 256-byte aligned; `free` waits for operations that are
///   executing (not merely queued) on that memory, as cudaFree synchronizes.
///
/// Throws InvalidArgument when KVPORT_HOST_MEMORY is set but unparsable.
std::unique_ptr<Backend> make_host_backend(HostBackendOptions options = {});

/// Registry hooks: a host backend with default options, and its device probe
/// (always available: returns an empty reason).
std::unique_ptr<Backend> make_default_host_backend();
/// A host backend with default options on device `device`: only 0 exists
/// (InvalidArgument otherwise).
std::unique_ptr<Backend> make_host_backend_on(int device);
std::string probe_host_backend();

/// Test hook: queues `fn` on `stream` as if it were device work, unchecked.
/// Lets a test hold a stream at a known point (say, until a std::promise is
/// set) to build orderings that are deterministic without timing, such as
/// "free the buffer while the memset that uses it is still queued". `fn`
/// runs on the stream's worker and must eventually return (a stream that
/// never drains blocks its destruction); an exception it throws becomes the
/// stream's error at its next synchronize. Throws InvalidArgument when
/// `backend` is not a host backend or `stream` is not one of its live
/// streams. Not for production code: other backends have no equivalent.
void host_enqueue_for_testing(Backend& backend, StreamView stream, std::function<void()> fn);

}  // namespace kvport
