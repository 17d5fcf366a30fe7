// SPDX-License-Identifier: Apache-2.0
// kvport's exception hierarchy. A vendor status code becomes one of these in
// one place, GpuBackend<Api>'s classifier (backends/common/gpu_backend.hpp:
// OutOfMemory only for the runtime's out-of-memory code on an allocation,
// DeviceLost for a sticky error, BackendError otherwise).
#pragma once

#include <cstddef>
#include <stdexcept>
#include <string>
#include <string_view>

namespace kvport {

/// Base of every exception kvport throws. Catch this to handle any kvport
/// failure; the message always names the operation and the offending values.
class Error : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

/// A caller passed a value outside the contract: a null or foreign pointer, a
/// size past an allocation, a bad config field, an index out of range (the
/// OutOfRange subclass). Thrown in every build type; never undefined
/// behaviour.
class InvalidArgument : public Error {
 public:
  using Error::Error;
};

/// An index past the end of what it indexes: a block id >= the pool's block
/// count, a layer >= the layer count, a group >= a hybrid cache's group
/// count. A kind of InvalidArgument (a handler of InvalidArgument catches
/// it); thrown by core's block and layer checks before anything changes, and
/// mapped once by each binding (C: KVPORT_ERR_OUT_OF_RANGE, Python:
/// kvport.OutOfRange, Rust: Error::OutOfRange).
class OutOfRange : public InvalidArgument {
 public:
  using InvalidArgument::InvalidArgument;
};

/// The KV cache has no free block left. Recoverable: the scheduler should
/// preempt or evict and retry. `PagedKvCache::try_alloc_block` reports the
/// same condition as an empty optional instead.
class CacheExhausted : public Error {
 public:
  CacheExhausted() : Error("KV cache exhausted: no free blocks") {}
  /// With a message that says what was asked for; it should start with
  /// "KV cache exhausted".
  explicit CacheExhausted(const std::string& message) : Error(message) {}
};

/// A backend could not satisfy an allocation.
class OutOfMemory : public Error {
 public:
  /// @param backend   backend name, e.g. "host"
  /// @param requested bytes asked for
  /// @param free      bytes the backend reported free (0 when unknown)
  OutOfMemory(std::string_view backend, std::size_t requested, std::size_t free);

  std::size_t requested_bytes() const noexcept { return requested_; }
  std::size_t free_bytes() const noexcept { return free_; }

 private:
  std::size_t requested_;
  std::size_t free_;
};

/// A vendor runtime call failed. Carries the backend, the API call text, the
/// native error code and the vendor's own error string.
class BackendError : public Error {
 public:
  BackendError(std::string_view backend, std::string_view call, long native_code,
               std::string_view native_string);

  const std::string& backend() const noexcept { return backend_; }
  const std::string& call() const noexcept { return call_; }
  long native_code() const noexcept { return native_code_; }
  const std::string& native_string() const noexcept { return native_string_; }

 protected:
  /// For subclasses that word the message themselves.
  BackendError(std::string message, std::string_view backend, std::string_view call,
               long native_code, std::string_view native_string);

 private:
  std::string backend_;
  std::string call_;
  long native_code_;
  std::string native_string_;
};

/// The device context is gone: a sticky, context-wide error (a kernel fault,
/// an illegal address, an ECC error) was seen. It is not a per-stream error
/// and nothing recovers it in this process: every later call on the backend
/// throws DeviceLost again (no out-of-memory, no retry), and
/// Backend::device_lost() turns true. A scheduler must not evict and retry on
/// it; the engine has to restart the process (or the worker owning the
/// device). Carries the call and native code of the error that lost it.
class DeviceLost : public BackendError {
 public:
  DeviceLost(std::string_view backend, std::string_view call, long native_code,
             std::string_view native_string);
};

namespace detail {

/// Logs a vendor failure that cannot be thrown (destructors, free paths);
/// the GPU backend's classifier calls it for its noexcept checks.
void log_vendor_failure(std::string_view backend, std::string_view call, long code,
                        std::string_view what, const char* file, int line) noexcept;

}  // namespace detail
}  // namespace kvport
