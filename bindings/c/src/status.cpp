// SPDX-License-Identifier: Apache-2.0
#include "status.hpp"

#include <exception>

namespace kvport::capi {
namespace {

thread_local std::string t_last_error;

}  // namespace

kvport_status fail(kvport_status status, const char* message) noexcept {
  try {
    t_last_error = message;
  } catch (...) {
    t_last_error.clear();  // no memory for the text: keep the status at least
  }
  return status;
}

kvport_status fail_current_exception() noexcept {
  try {
    throw;
  } catch (const StatusError& e) {
    return fail(e.status(), e.what());
  } catch (const DeviceLost& e) {  // before BackendError, its base
    return fail(KVPORT_ERR_DEVICE_LOST, e.what());
  } catch (const BackendError& e) {
    return fail(KVPORT_ERR_BACKEND, e.what());
  } catch (const CacheExhausted& e) {
    return fail(KVPORT_ERR_CACHE_EXHAUSTED, e.what());
  } catch (const OutOfMemory& e) {
    return fail(KVPORT_ERR_OUT_OF_MEMORY, e.what());
  } catch (const OutOfRange& e) {  // before InvalidArgument, its base
    return fail(KVPORT_ERR_OUT_OF_RANGE, e.what());
  } catch (const InvalidArgument& e) {
    return fail(KVPORT_ERR_INVALID_ARGUMENT, e.what());
  } catch (const Error& e) {
    return fail(KVPORT_ERR_ERROR, e.what());
  } catch (const std::bad_alloc& e) {
    return fail(KVPORT_ERR_OUT_OF_MEMORY, e.what());
  } catch (const std::exception& e) {
    return fail(KVPORT_ERR_UNKNOWN, e.what());
  } catch (...) {
    return fail(KVPORT_ERR_UNKNOWN, "unknown exception");
  }
}

}  // namespace kvport::capi

extern "C" {

const char* kvport_status_name(int32_t status) {
  switch (status) {
    case KVPORT_OK:
      return "KVPORT_OK";
    case KVPORT_ERR_ERROR:
      return "KVPORT_ERR_ERROR";
    case KVPORT_ERR_INVALID_ARGUMENT:
      return "KVPORT_ERR_INVALID_ARGUMENT";
    case KVPORT_ERR_CACHE_EXHAUSTED:
      return "KVPORT_ERR_CACHE_EXHAUSTED";
    case KVPORT_ERR_OUT_OF_MEMORY:
      return "KVPORT_ERR_OUT_OF_MEMORY";
    case KVPORT_ERR_BACKEND:
      return "KVPORT_ERR_BACKEND";
    case KVPORT_ERR_DEVICE_LOST:
      return "KVPORT_ERR_DEVICE_LOST";
    case KVPORT_ERR_OUT_OF_RANGE:
      return "KVPORT_ERR_OUT_OF_RANGE";
    case KVPORT_ERR_INVALID_HANDLE:
      return "KVPORT_ERR_INVALID_HANDLE";
    case KVPORT_ERR_HANDLE_IN_USE:
      return "KVPORT_ERR_HANDLE_IN_USE";
    case KVPORT_ERR_UNKNOWN:
      return "KVPORT_ERR_UNKNOWN";
  }
  return "KVPORT_ERR_<unknown status>";
}

const char* kvport_last_error(void) {
  return kvport::capi::t_last_error.c_str();
}

void kvport_clear_last_error(void) {
  kvport::capi::t_last_error.clear();
}

}  // extern "C"
