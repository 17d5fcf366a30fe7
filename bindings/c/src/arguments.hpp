// SPDX-License-Identifier: Apache-2.0
// Conversions and checks of C arguments that more than one source of the C
// ABI uses (kvport_c.cpp: caches, prefix caches, block tables; hybrid.cpp:
// layer specs, hybrid caches and tables). Each throws what guard() maps to
// the header's status codes.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <span>
#include <string>
#include <string_view>

#include "handles.hpp"
#include "kvport/core/dtype.hpp"
#include "kvport/kvport.h"
#include "status.hpp"

namespace kvport::capi {

inline KvCacheDtype to_dtype(std::int32_t value, const char* what) {
  if (value < 0 || value > KVPORT_DTYPE_TURBO8)
    throw InvalidArgument(std::string(what) + ": " + std::to_string(value) +
                          " is not a kvport_dtype");
  return static_cast<KvCacheDtype>(value);
}

/// `count` elements at `data`, which may be null only when count is 0.
template <class T>
std::span<const T> span_of(const T* data, std::size_t count, const char* what) {
  if (count > 0) require(data, what);
  return {data, count};
}

template <class T>
void put(T* out, T value, const char* what) {
  *require(out, what) = value;
}

/// Writes `s` into the caller's buffer: truncated to text_size - 1 bytes and
/// NUL-terminated; *text_needed (may be null) gets s.size() + 1. `text` may
/// be null only with text_size 0.
inline void write_text(std::string_view s, char* text, std::size_t text_size,
                       std::size_t* text_needed) {
  if (text_size > 0) {
    require(text, "text (with text_size > 0)");
    const std::size_t n = std::min(s.size(), text_size - 1);
    std::memcpy(text, s.data(), n);
    text[n] = '\0';
  }
  if (text_needed != nullptr) *text_needed = s.size() + 1;
}

inline void write_report(const InvariantReport& r, kvport_invariant_report* report, char* text,
                         std::size_t text_size, std::size_t* text_needed) {
  require(report, "report");
  if (text_size > 0) require(text, "text (with text_size > 0)");
  const std::string s = r.to_string();
  report->ok = r.ok;
  report->blocks_checked = r.blocks_checked;
  report->free_blocks = r.free_blocks;
  report->blocks_in_use = r.blocks_in_use;
  report->evictable_blocks = r.evictable_blocks;
  report->cached_blocks = r.cached_blocks;
  report->num_violations = r.violations.size();
  write_text(s, text, text_size, text_needed);
}

/// The stream a `kvport_stream*` argument names: the backend's default
/// stream for null; KVPORT_ERR_INVALID_ARGUMENT for a stream of another
/// backend.
inline StreamView stream_for(Backend& backend, kvport_stream* stream) {
  if (stream == nullptr) return backend.default_stream();
  const StreamObject& object = get<StreamObject>(stream);
  // Checked here, not only when work is queued: a call that ends up queuing
  // nothing must fail the same way (the header's contract).
  if (object.backend != &backend) {
    throw InvalidArgument("the stream belongs to another backend than the cache's");
  }
  return object.view();
}

/// The C++ config of a kvport_config (kvport_c.cpp's one conversion):
/// InvalidArgument for a null config or a bad field.
KvCacheConfig config_from_c(const kvport_config* config);

inline std::int32_t prefix_hit_mode_value(PrefixHitMode mode) {
  return mode == PrefixHitMode::full ? std::int32_t{KVPORT_PREFIX_HIT_FULL}
                                     : std::int32_t{KVPORT_PREFIX_HIT_COMPUTE_LAST_TOKEN};
}

inline PrefixHitMode to_prefix_hit_mode(std::int32_t mode, const char* op) {
  if (mode != KVPORT_PREFIX_HIT_COMPUTE_LAST_TOKEN && mode != KVPORT_PREFIX_HIT_FULL)
    throw InvalidArgument(std::string(op) + ": " + std::to_string(mode) +
                          " is not a kvport_prefix_hit_mode");
  return mode == KVPORT_PREFIX_HIT_FULL ? PrefixHitMode::full : PrefixHitMode::compute_last_token;
}

}  // namespace kvport::capi
