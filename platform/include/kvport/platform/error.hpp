// kvport's exception hierarchy and the TRY macro that turns a vendor status
// code into a typed exception naming the call.
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

/// A caller passed a value outside the contract: an out-of-range block id or
/// layer, a null or foreign pointer, a size past an allocation, a bad config
/// field. Thrown in every build type; never undefined behaviour.
class InvalidArgument : public Error {
 public:
  using Error::Error;
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

/// Logs a vendor failure that cannot be thrown (destructors, free paths).
void log_vendor_failure(std::string_view backend, std::string_view call, long code,
                        std::string_view what, const char* file, int line) noexcept;

/// Checks a vendor status code through an API mapping struct `Api` with:
///   using Status = ...;  static constexpr Status success;
///   static constexpr const char* name;         // "cuda", "hip", ...
///   static const char* error_string(Status);
///   static void clear_error() noexcept;        // drops a non-sticky error
template <class Api>
inline void check_vendor(typename Api::Status status, const char* call) {
  if (status != Api::success) {
    Api::clear_error();
    throw BackendError(Api::name, call, static_cast<long>(status), Api::error_string(status));
  }
}

template <class Api>
inline bool check_vendor_nothrow(typename Api::Status status, const char* call, const char* file,
                                 int line) noexcept {
  if (status == Api::success) return true;
  Api::clear_error();
  log_vendor_failure(Api::name, call, static_cast<long>(status), Api::error_string(status), file,
                     line);
  return false;
}

}  // namespace detail
}  // namespace kvport

/// Evaluates a vendor runtime call and throws `kvport::BackendError` naming the
/// call, the native code and string when it does not return `Api::success`.
#define KVPORT_TRY(Api, call) ::kvport::detail::check_vendor<Api>((call), #call)

/// Like KVPORT_TRY, for destructors and noexcept paths: logs the failure and
/// yields false instead of throwing.
#define KVPORT_TRY_NOTHROW(Api, call) \
  ::kvport::detail::check_vendor_nothrow<Api>((call), #call, __FILE__, __LINE__)
