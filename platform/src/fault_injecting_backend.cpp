// SPDX-License-Identifier: Apache-2.0
#include "kvport/platform/fault_injecting_backend.hpp"

#include <fmt/format.h>
#include <atomic>

#include <deque>
#include <exception>
#include <string>
#include <utility>

#include "kvport/platform/error.hpp"
#include "kvport/platform/log.hpp"

namespace kvport {
namespace {
std::atomic<std::uint64_t> g_faults_injected{0};
}  // namespace

std::uint64_t FaultInjectingBackend::faults_injected_in_process() noexcept {
  return g_faults_injected.load(std::memory_order_relaxed);
}

namespace {

constexpr std::uintptr_t kDefaultStreamId = 1;

void* stream_handle(std::uintptr_t id) noexcept {
  return reinterpret_cast<void*>(id);
}

std::string decorated_name(const Backend* inner) {
  if (inner == nullptr) throw InvalidArgument("FaultInjectingBackend: the inner backend is null");
  return "fault(" + inner->name() + ")";
}

std::size_t index_of(FaultKind kind, const char* op) {
  const auto i = static_cast<std::size_t>(kind);
  if (i >= kFaultKindCount) {
    throw InvalidArgument(
        fmt::format("FaultInjectingBackend: {}: fault kind {} is not a FaultKind", op, i));
  }
  return i;
}

bool is_async(FaultKind kind) noexcept {
  return kind == FaultKind::fill || kind == FaultKind::copy;
}

std::string what_of(const std::exception_ptr& error) noexcept {
  try {
    std::rethrow_exception(error);
  } catch (const std::exception& e) {
    return e.what();
  } catch (...) {
    return "an exception that is not a std::exception";
  }
}

}  // namespace

std::string_view to_string(FaultKind kind) noexcept {
  switch (kind) {
    case FaultKind::alloc:
      return "alloc";
    case FaultKind::fill:
      return "fill";
    case FaultKind::copy:
      return "copy";
    case FaultKind::synchronize:
      return "synchronize";
    case FaultKind::stream_create:
      return "stream_create";
    case FaultKind::event_create:
      return "event_create";
    case FaultKind::register_pools:
      return "register_pools";
  }
  return "unknown";
}

// One of the decorator's streams: the inner stream it forwards to, and the
// errors waiting for its next synchronize (guarded by the decorator's mutex).
struct FaultInjectingBackend::FaultStream {
  explicit FaultStream(Stream stream) : owned(std::move(stream)), inner(owned->view()) {}
  explicit FaultStream(WrappedStream stream) : wrapped(std::move(stream)), inner(wrapped.view()) {}
  explicit FaultStream(StreamView view) : inner(view) {}

  std::optional<Stream> owned;  // empty for the default stream and a wrap
  WrappedStream wrapped;        // the inner backend's wrap of an engine's stream
  StreamView inner;
  std::deque<std::exception_ptr> pending;
};

struct FaultInjectingBackend::FaultEvent {
  Event inner;
};

struct FaultInjectingBackend::FaultPoolSet {
  BlockPoolSet inner;
};

FaultInjectingBackend::FaultInjectingBackend(Backend& inner)
    : FaultInjectingBackend(std::unique_ptr<Backend>(), &inner) {}

FaultInjectingBackend::FaultInjectingBackend(std::unique_ptr<Backend> inner)
    : FaultInjectingBackend(std::move(inner), inner.get()) {}

FaultInjectingBackend::FaultInjectingBackend(std::unique_ptr<Backend>&& owned, Backend* inner)
    : Backend(decorated_name(inner)), owned_(std::move(owned)), inner_(inner) {
  streams_.emplace(stream_handle(kDefaultStreamId),
                   std::make_shared<FaultStream>(inner_->default_stream()));
  last_stream_id_ = kDefaultStreamId;
}

FaultInjectingBackend::~FaultInjectingBackend() {
  std::unordered_map<void*, std::shared_ptr<FaultStream>> streams;
  {
    std::lock_guard lock(mutex_);
    streams.swap(streams_);
  }
  for (auto& [handle, stream] : streams) {
    drain(*stream);
    log_pending(*stream, handle == stream_handle(kDefaultStreamId)
                             ? "default stream, at the backend's destruction"
                             : "stream still alive at the backend's destruction");
  }
  // `streams` releases the inner streams here, before an owned inner backend.
}

// ---- plans and counters ---------------------------------------------------------------

void FaultInjectingBackend::set_plan(FaultKind kind, const FaultPlan& plan) {
  const std::size_t i = index_of(kind, "set_plan");
  const std::string_view k = to_string(kind);
  if (!plan.nth && !plan.from_nth && !plan.probability) {
    throw InvalidArgument(fmt::format(
        "{}: set_plan({}): the plan has no condition (set nth, from_nth or probability; "
        "clear_plan removes a plan)",
        name(), k));
  }
  if (plan.nth && *plan.nth == 0) {
    throw InvalidArgument(
        fmt::format("{}: set_plan({}): nth must be > 0 (calls are numbered from 1)", name(), k));
  }
  if (plan.from_nth && *plan.from_nth == 0) {
    throw InvalidArgument(fmt::format(
        "{}: set_plan({}): from_nth must be > 0 (calls are numbered from 1)", name(), k));
  }
  if (plan.probability && !(*plan.probability >= 0.0 && *plan.probability <= 1.0)) {
    throw InvalidArgument(fmt::format("{}: set_plan({}): probability {} is outside [0, 1]", name(),
                                      k, *plan.probability));
  }
  if (plan.mode != FaultMode::synchronous && plan.mode != FaultMode::deferred) {
    throw InvalidArgument(fmt::format("{}: set_plan({}): mode {} is not a FaultMode", name(), k,
                                      static_cast<int>(plan.mode)));
  }
  if (plan.mode == FaultMode::deferred && !is_async(kind)) {
    throw InvalidArgument(fmt::format(
        "{}: set_plan({}): the deferred mode is for asynchronous kinds only (fill, copy)", name(),
        k));
  }
  std::lock_guard lock(mutex_);
  KindState& state = kinds_[i];
  state.plan = plan;
  state.calls_since_plan = 0;
  state.rng.seed(plan.seed);
}

void FaultInjectingBackend::clear_plan(FaultKind kind) {
  const std::size_t i = index_of(kind, "clear_plan");
  std::lock_guard lock(mutex_);
  kinds_[i].plan.reset();
  kinds_[i].calls_since_plan = 0;
}

void FaultInjectingBackend::clear_plans() noexcept {
  std::lock_guard lock(mutex_);
  for (KindState& state : kinds_) {
    state.plan.reset();
    state.calls_since_plan = 0;
  }
}

std::optional<FaultPlan> FaultInjectingBackend::plan(FaultKind kind) const {
  const std::size_t i = index_of(kind, "plan");
  std::lock_guard lock(mutex_);
  return kinds_[i].plan;
}

FaultCounts FaultInjectingBackend::counts(FaultKind kind) const {
  const std::size_t i = index_of(kind, "counts");
  std::lock_guard lock(mutex_);
  return kinds_[i].counts;
}

void FaultInjectingBackend::reset_fault_counts() noexcept {
  std::lock_guard lock(mutex_);
  for (KindState& state : kinds_)
    state.counts = FaultCounts{};
}

std::size_t FaultInjectingBackend::live_allocations() const noexcept {
  std::lock_guard lock(mutex_);
  return live_.size();
}

std::size_t FaultInjectingBackend::live_bytes() const noexcept {
  std::lock_guard lock(mutex_);
  return live_bytes_;
}

std::optional<FaultInjectingBackend::Injection> FaultInjectingBackend::decide(FaultKind kind) {
  std::lock_guard lock(mutex_);
  KindState& state = kinds_[static_cast<std::size_t>(kind)];
  ++state.counts.calls;
  if (!state.plan) return std::nullopt;
  const FaultPlan& plan = *state.plan;
  const std::uint64_t call = ++state.calls_since_plan;
  bool fail = false;
  if (plan.probability) {
    // One draw per call, whatever the other conditions say, so that the
    // sequence depends only on the seed and the number of calls. 53 random
    // bits make a double in [0, 1) the same way on every standard library.
    const double draw = static_cast<double>(state.rng() >> 11) * 0x1.0p-53;
    fail = draw < *plan.probability;
  }
  if (plan.nth && call == *plan.nth) fail = true;
  if (plan.from_nth && call >= *plan.from_nth) fail = true;
  if (!fail) return std::nullopt;
  ++state.counts.faults;
  g_faults_injected.fetch_add(1, std::memory_order_relaxed);
  return Injection{kind, plan.mode, call};
}

void FaultInjectingBackend::throw_injected(const Injection& injection, const char* op,
                                           std::size_t bytes) const {
  if (injection.kind == FaultKind::alloc) {
    // OutOfMemory's message starts with the backend: say there that it was
    // injected. 0 free bytes: "unknown", per OutOfMemory.
    throw OutOfMemory(
        fmt::format("{} (injected fault: alloc call #{} of the plan)", name(), injection.call),
        bytes, 0);
  }
  throw BackendError(name(), op, kInjectedFaultCode,
                     fmt::format("injected fault: {} call #{} of the plan",
                                 to_string(injection.kind), injection.call));
}

bool FaultInjectingBackend::inject_async(const std::optional<Injection>& injection, const char* op,
                                         FaultStream& stream) {
  if (!injection) return false;
  if (injection->mode == FaultMode::synchronous) throw_injected(*injection, op);
  std::exception_ptr error = std::make_exception_ptr(
      BackendError(name(), op, kInjectedFaultCode,
                   fmt::format("injected deferred fault: {} call #{} of the plan",
                               to_string(injection->kind), injection->call)));
  std::lock_guard lock(mutex_);
  stream.pending.push_back(std::move(error));
  return true;
}

std::shared_ptr<FaultInjectingBackend::FaultStream> FaultInjectingBackend::stream_of(
    void* native, const char* op) const {
  std::lock_guard lock(mutex_);
  auto it = streams_.find(native);
  if (it == streams_.end()) {
    throw InvalidArgument(
        fmt::format("{}: {}: stream {} is not a live stream (destroyed?)", name(), op, native));
  }
  return it->second;
}

void FaultInjectingBackend::drain(FaultStream& stream) noexcept {
  try {
    inner_->synchronize(stream.inner);
  } catch (...) {
    try {
      std::lock_guard lock(mutex_);
      stream.pending.push_back(std::current_exception());
    } catch (...) {  // out of memory: the error cannot be kept
      log::error(fmt::format("{}: an asynchronous error was lost (out of memory)", name()));
    }
  }
}

void FaultInjectingBackend::log_pending(FaultStream& stream, const char* where) noexcept {
  std::deque<std::exception_ptr> pending;
  {
    std::lock_guard lock(mutex_);
    pending.swap(stream.pending);
  }
  for (const std::exception_ptr& error : pending) {
    try {
      log::warn(
          fmt::format("{}: error never synchronized ({}): {}", name(), where, what_of(error)));
    } catch (...) {  // formatting failed (out of memory): nothing more to do
    }
  }
}

// ---- identity and memory --------------------------------------------------------------

int FaultInjectingBackend::do_device_count() const {
  return inner_->device_count();
}

MemInfo FaultInjectingBackend::do_mem_info() const {
  return inner_->mem_info();
}

DevicePtr FaultInjectingBackend::do_alloc(std::size_t bytes) {
  if (const auto injection = decide(FaultKind::alloc)) throw_injected(*injection, "alloc", bytes);
  const DevicePtr ptr = inner_->alloc(bytes);
  try {
    std::lock_guard lock(mutex_);
    live_.emplace(ptr.address(), bytes);
    live_bytes_ += bytes;
  } catch (...) {
    inner_->free(ptr);
    throw;
  }
  return ptr;
}

bool FaultInjectingBackend::do_free(DevicePtr ptr) noexcept {
  // Forget the allocation before the inner backend can hand its address out
  // again to a concurrent alloc.
  {
    std::lock_guard lock(mutex_);
    if (auto it = live_.find(ptr.address()); it != live_.end()) {
      live_bytes_ -= it->second;
      live_.erase(it);
    }
  }
  return inner_->free(ptr);
}

void* FaultInjectingBackend::do_alloc_host(std::size_t bytes) {
  if (const auto injection = decide(FaultKind::alloc)) {
    throw_injected(*injection, "alloc_host", bytes);
  }
  return inner_->alloc_host(bytes);
}

bool FaultInjectingBackend::do_free_host(void* ptr) noexcept {
  return inner_->free_host(ptr);
}

// ---- streams and events -----------------------------------------------------------------

void* FaultInjectingBackend::do_create_stream() {
  if (const auto injection = decide(FaultKind::stream_create)) {
    throw_injected(*injection, "create_stream");
  }
  auto stream = std::make_shared<FaultStream>(inner_->create_stream());
  std::lock_guard lock(mutex_);
  void* handle = stream_handle(++last_stream_id_);
  streams_.emplace(handle, std::move(stream));
  return handle;
}

bool FaultInjectingBackend::do_stream_alive(void* native) const noexcept {
  // The decorator's own handle, never faulted: a query, not a device call.
  // The inner stream lives exactly as long as the handle that owns it.
  std::lock_guard lock(mutex_);
  return streams_.contains(native);
}

void FaultInjectingBackend::do_destroy_stream(void* native) noexcept {
  if (native == stream_handle(kDefaultStreamId)) return;
  std::shared_ptr<FaultStream> doomed;
  {
    std::lock_guard lock(mutex_);
    auto it = streams_.find(native);
    if (it == streams_.end()) return;
    doomed = std::move(it->second);
    streams_.erase(it);
  }
  // A wrap is the engine's stream: forgetting it must not wait for its work.
  if (doomed->wrapped) {
    log_pending(*doomed, "wrapped stream released");
    return;
  }
  // Destroying the inner stream would wait for its work and drop its error:
  // synchronize first, so that the error joins the pending ones and is logged.
  drain(*doomed);
  log_pending(*doomed, "stream destroyed");
}

void* FaultInjectingBackend::do_default_stream() {
  return stream_handle(kDefaultStreamId);
}

// Wraps and vendor handles are the inner backend's; never faulted (no device work).
void* FaultInjectingBackend::do_wrap_stream(void* vendor) {
  auto stream = std::make_shared<FaultStream>(inner_->wrap_stream(vendor));
  std::lock_guard lock(mutex_);
  void* handle = stream_handle(++last_stream_id_);
  streams_.emplace(handle, std::move(stream));
  return handle;
}

void* FaultInjectingBackend::do_vendor_stream(void* native) const {
  return inner_->vendor_stream(stream_of(native, "vendor_stream")->inner);
}

void FaultInjectingBackend::do_adopt_memory(DevicePtr base, std::size_t bytes) {
  AdoptedMemory adopted = inner_->adopt_memory(base, bytes);
  std::lock_guard lock(mutex_);
  adopted_.emplace(base.address(), std::move(adopted));
}

void FaultInjectingBackend::do_release_adopted(DevicePtr base) noexcept {
  AdoptedMemory doomed;
  {
    std::lock_guard lock(mutex_);
    auto it = adopted_.find(base.address());
    if (it == adopted_.end()) return;
    doomed = std::move(it->second);
    adopted_.erase(it);
  }
  // `doomed` forgets the inner registration here, outside the lock.
}

void FaultInjectingBackend::do_synchronize(void* native) {
  const std::shared_ptr<FaultStream> stream = stream_of(native, "synchronize");
  const auto injection = decide(FaultKind::synchronize);
  // Always wait for the inner stream, even when this call is to fail: no
  // work may still be running on memory the caller frees after the error.
  std::exception_ptr inner_error;
  try {
    inner_->synchronize(stream->inner);
  } catch (...) {
    inner_error = std::current_exception();
  }
  std::exception_ptr first;
  {
    std::lock_guard lock(mutex_);
    if (inner_error) stream->pending.push_back(std::move(inner_error));
    if (!injection && !stream->pending.empty()) {
      first = std::move(stream->pending.front());
      stream->pending.pop_front();
    }
  }
  if (injection) throw_injected(*injection, "synchronize");
  if (first) std::rethrow_exception(first);
}

void* FaultInjectingBackend::do_create_event() {
  if (const auto injection = decide(FaultKind::event_create)) {
    throw_injected(*injection, "create_event");
  }
  return new FaultEvent{inner_->create_event()};
}

void* FaultInjectingBackend::do_create_timing_event() {
  if (const auto injection = decide(FaultKind::event_create)) {
    throw_injected(*injection, "create_timing_event");
  }
  return new FaultEvent{inner_->create_timing_event()};
}

void FaultInjectingBackend::do_destroy_event(void* native) noexcept {
  delete static_cast<FaultEvent*>(native);
}

double FaultInjectingBackend::do_elapsed_seconds(void* start, void* end) {
  return inner_->elapsed_seconds(static_cast<FaultEvent*>(start)->inner,
                                 static_cast<FaultEvent*>(end)->inner);
}

void FaultInjectingBackend::do_record_event(void* event, void* stream) {
  inner_->record_event(static_cast<FaultEvent*>(event)->inner,
                       stream_of(stream, "record_event")->inner);
}

void FaultInjectingBackend::do_wait_event(void* stream, void* event) {
  inner_->wait_event(stream_of(stream, "wait_event")->inner,
                     static_cast<FaultEvent*>(event)->inner);
}

void FaultInjectingBackend::do_synchronize_event(void* event) {
  const auto injection = decide(FaultKind::synchronize);
  // As for streams, wait first. An error of the inner backend has no stream
  // to wait on here, so it wins over the injected one.
  inner_->synchronize_event(static_cast<FaultEvent*>(event)->inner);
  if (injection) throw_injected(*injection, "synchronize_event");
}

bool FaultInjectingBackend::do_query_event(void* event) {
  return inner_->query_event(static_cast<FaultEvent*>(event)->inner);
}

// ---- fills --------------------------------------------------------------------------------

void FaultInjectingBackend::do_memset_async(DevicePtr ptr, std::uint8_t value, std::size_t bytes,
                                            void* native) {
  const auto stream = stream_of(native, "memset_async");
  if (inject_async(decide(FaultKind::fill), "memset_async", *stream)) return;
  inner_->memset_async(ptr, value, bytes, stream->inner);
}

void FaultInjectingBackend::do_fill_async(std::span<const FillRegion> regions, std::uint8_t value,
                                          void* native) {
  const auto stream = stream_of(native, "fill_async");
  if (inject_async(decide(FaultKind::fill), "fill_async", *stream)) return;
  inner_->fill_async(regions, value, stream->inner);
}

void* FaultInjectingBackend::do_register_block_pools(std::span<const PoolGeometry> pools,
                                                     std::size_t num_blocks) {
  if (const auto injection = decide(FaultKind::register_pools)) {
    throw_injected(*injection, "register_block_pools");
  }
  return new FaultPoolSet{inner_->register_block_pools(pools, num_blocks)};
}

void FaultInjectingBackend::do_unregister_block_pools(void* native) noexcept {
  delete static_cast<FaultPoolSet*>(native);
}

void FaultInjectingBackend::do_fill_blocks_async(void* pools,
                                                 std::span<const std::uint32_t> block_ids,
                                                 std::uint8_t value, void* native) {
  const auto stream = stream_of(native, "fill_blocks_async");
  if (inject_async(decide(FaultKind::fill), "fill_blocks_async", *stream)) return;
  inner_->fill_blocks_async(static_cast<FaultPoolSet*>(pools)->inner, block_ids, value,
                            stream->inner);
}

// ---- copies -------------------------------------------------------------------------------

void FaultInjectingBackend::do_copy_h2d_async(DevicePtr dst, const void* src, std::size_t bytes,
                                              void* native) {
  const auto stream = stream_of(native, "copy_h2d_async");
  if (inject_async(decide(FaultKind::copy), "copy_h2d_async", *stream)) return;
  inner_->copy_h2d_async(dst, src, bytes, stream->inner);
}

void FaultInjectingBackend::do_copy_d2h_async(void* dst, DevicePtr src, std::size_t bytes,
                                              void* native) {
  const auto stream = stream_of(native, "copy_d2h_async");
  if (inject_async(decide(FaultKind::copy), "copy_d2h_async", *stream)) return;
  inner_->copy_d2h_async(dst, src, bytes, stream->inner);
}

void FaultInjectingBackend::do_copy_d2d_async(DevicePtr dst, DevicePtr src, std::size_t bytes,
                                              void* native) {
  const auto stream = stream_of(native, "copy_d2d_async");
  if (inject_async(decide(FaultKind::copy), "copy_d2d_async", *stream)) return;
  inner_->copy_d2d_async(dst, src, bytes, stream->inner);
}

void FaultInjectingBackend::do_copy_batch_async(std::span<const CopyRegion> regions, void* native) {
  const auto stream = stream_of(native, "copy_batch_async");
  if (inject_async(decide(FaultKind::copy), "copy_batch_async", *stream)) return;
  inner_->copy_batch_async(regions, stream->inner);
}

void FaultInjectingBackend::do_copy_host_batch_async(std::span<const HostCopyRegion> regions,
                                                     HostCopyDirection direction, void* native) {
  const bool to_device = direction == HostCopyDirection::host_to_device;
  const char* op = to_device ? "copy_batch_h2d_async" : "copy_batch_d2h_async";
  const auto stream = stream_of(native, op);
  if (inject_async(decide(FaultKind::copy), op, *stream)) return;
  if (to_device) {
    inner_->copy_batch_h2d_async(regions, stream->inner);
  } else {
    inner_->copy_batch_d2h_async(regions, stream->inner);
  }
}

void FaultInjectingBackend::do_inject_async_fault(void* native) {
  inner_->inject_async_fault(stream_of(native, "inject_async_fault")->inner);
}

}  // namespace kvport
