// SPDX-License-Identifier: Apache-2.0
#include "kvport/platform/backend.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <atomic>
#include <optional>
#include <string>
#include <vector>

#include "kvport/platform/error.hpp"
#include "kvport/platform/log.hpp"

namespace kvport {

struct Backend::Counters {
  std::atomic<std::uint64_t> alloc{0};
  std::atomic<std::uint64_t> free{0};
  std::atomic<std::uint64_t> memset{0};
  std::atomic<std::uint64_t> fill{0};
  std::atomic<std::uint64_t> copy{0};
  std::atomic<std::uint64_t> copy_batch{0};
  std::atomic<std::uint64_t> copy_host_batch{0};
  std::atomic<std::uint64_t> synchronize{0};
  std::atomic<std::uint64_t> host_alloc{0};
  std::atomic<std::uint64_t> host_free{0};
};

namespace {

void bump(std::atomic<std::uint64_t>& counter) noexcept {
  counter.fetch_add(1, std::memory_order_relaxed);
}

void require_device_ptr(const std::string& backend, const char* op, const char* what, DevicePtr p) {
  if (p.is_null()) {
    throw InvalidArgument(fmt::format("{}: {}: {} is a null pointer", backend, op, what));
  }
}

void require_host_ptr(const std::string& backend, const char* op, const char* what, const void* p) {
  if (p == nullptr) {
    throw InvalidArgument(fmt::format("{}: {}: {} is a null host pointer", backend, op, what));
  }
}

// End of [p, p + bytes); throws when the range wraps the address space.
std::uintptr_t range_end(const std::string& backend, const char* op, DevicePtr p,
                         std::size_t bytes) {
  if (bytes > UINTPTR_MAX - p.address()) {
    throw InvalidArgument(fmt::format("{}: {}: range {:#x} + {} bytes overflows the address space",
                                      backend, op, p.address(), bytes));
  }
  return p.address() + bytes;
}

bool overlaps(std::uintptr_t a, std::uintptr_t a_end, std::uintptr_t b, std::uintptr_t b_end) {
  return a < b_end && b < a_end;
}

// A batch region's [begin, end) and its index in the batch.
struct Range {
  std::uintptr_t begin, end;
  std::size_t index;
};

void sort_by_begin(std::vector<Range>& ranges) {
  std::sort(ranges.begin(), ranges.end(),
            [](const Range& a, const Range& b) { return a.begin < b.begin; });
}

// Sorts `ranges` by begin and throws InvalidArgument when two overlap:
// "<backend>: <op>: <what> of regions i and j overlap".
void check_disjoint(std::vector<Range>& ranges, const std::string& backend, const char* op,
                    const char* what) {
  sort_by_begin(ranges);
  for (std::size_t i = 1; i < ranges.size(); ++i) {
    if (ranges[i].begin < ranges[i - 1].end) {
      throw InvalidArgument(fmt::format("{}: {}: {} of regions {} and {} overlap", backend, op,
                                        what, ranges[i - 1].index, ranges[i].index));
    }
  }
}

}  // namespace

Backend::Backend(std::string name)
    : name_(std::move(name)), counters_(std::make_unique<Counters>()) {}

Backend::~Backend() = default;

DevicePtr Backend::alloc(std::size_t bytes) {
  if (bytes == 0) throw InvalidArgument(fmt::format("{}: alloc: size must be > 0", name_));
  bump(counters_->alloc);
  return do_alloc(bytes);
}

bool Backend::free(DevicePtr ptr) noexcept {
  if (ptr.is_null()) return true;
  bump(counters_->free);
  if (do_free(ptr)) return true;
  try {
    log::error(
        fmt::format("{}: free({:#x}) rejected: not a live allocation of this backend "
                    "(foreign pointer, interior pointer or double free)",
                    name_, ptr.address()));
  } catch (...) {  // free never throws
  }
  return false;
}

void* Backend::alloc_host(std::size_t bytes) {
  if (bytes == 0) throw InvalidArgument(fmt::format("{}: alloc_host: size must be > 0", name_));
  bump(counters_->host_alloc);
  return do_alloc_host(bytes);
}

bool Backend::free_host(void* ptr) noexcept {
  if (ptr == nullptr) return true;
  bump(counters_->host_free);
  if (do_free_host(ptr)) return true;
  try {
    log::error(
        fmt::format("{}: free_host({}) rejected: not a live pinned allocation of this backend "
                    "(foreign pointer, interior pointer or double free)",
                    name_, ptr));
  } catch (...) {  // free_host never throws
  }
  return false;
}

void* Backend::check_stream(StreamView stream, const char* op) const {
  if (stream.backend() != this) {
    // Both sides are often "host": say "another", or the message reads as if
    // the stream were fine.
    throw InvalidArgument(fmt::format(
        "{}: {}: the stream is not one of this backend's (it belongs to {})", name_, op,
        stream.backend() ? fmt::format("another backend, '{}'", stream.backend()->name())
                         : std::string("no backend: a moved-from stream")));
  }
  return stream.native();
}

void* Backend::check_event(const Event& event, const char* op) const {
  if (event.backend() != this || event.native() == nullptr) {
    throw InvalidArgument(
        fmt::format("{}: {}: the event is empty or belongs to another backend", name_, op));
  }
  return event.native();
}

Stream Backend::create_stream() {
  return Stream(this, do_create_stream());
}

StreamView Backend::default_stream() {
  return StreamView(this, do_default_stream());
}

WrappedStream Backend::wrap_stream(void* vendor_stream) {
  return WrappedStream(this, do_wrap_stream(vendor_stream));
}

void* Backend::vendor_stream(StreamView stream) const {
  return do_vendor_stream(check_stream(stream, "vendor_stream"));
}

void* Backend::do_wrap_stream(void*) {
  throw InvalidArgument(
      fmt::format("{}: wrap_stream: this backend cannot wrap a stream it did not create", name_));
}

void* Backend::do_vendor_stream(void*) const {
  throw InvalidArgument(
      fmt::format("{}: vendor_stream: this backend has no vendor stream handles", name_));
}

AdoptedMemory Backend::adopt_memory(DevicePtr base, std::size_t bytes) {
  require_device_ptr(name_, "adopt_memory", "base", base);
  if (bytes == 0) throw InvalidArgument(fmt::format("{}: adopt_memory: size must be > 0", name_));
  range_end(name_, "adopt_memory", base, bytes);
  do_adopt_memory(base, bytes);
  return AdoptedMemory(this, base, bytes);
}

void Backend::do_adopt_memory(DevicePtr, std::size_t) {
  throw InvalidArgument(
      fmt::format("{}: adopt_memory: this backend cannot adopt memory it did not allocate", name_));
}

void Backend::do_release_adopted(DevicePtr) noexcept {}

bool Backend::stream_alive(StreamView stream) const noexcept {
  // A moved-from view has no backend; a view of another backend names a
  // handle this one never gave out (and may share its number).
  if (stream.backend() != this) return false;
  return do_stream_alive(stream.native());
}

void Backend::synchronize(StreamView stream) {
  void* native = check_stream(stream, "synchronize");
  bump(counters_->synchronize);
  do_synchronize(native);
}

Event Backend::create_event() {
  return Event(this, do_create_event());
}

Event Backend::create_timing_event() {
  return Event(this, do_create_timing_event());
}

double Backend::elapsed_seconds(const Event& start, const Event& end) {
  return do_elapsed_seconds(check_event(start, "elapsed_seconds"),
                            check_event(end, "elapsed_seconds"));
}

void Backend::record_event(const Event& event, StreamView stream) {
  do_record_event(check_event(event, "record_event"), check_stream(stream, "record_event"));
}

void Backend::wait_event(StreamView stream, const Event& event) {
  do_wait_event(check_stream(stream, "wait_event"), check_event(event, "wait_event"));
}

void Backend::synchronize_event(const Event& event) {
  do_synchronize_event(check_event(event, "synchronize_event"));
}

bool Backend::query_event(const Event& event) {
  return do_query_event(check_event(event, "query_event"));
}

void Backend::memset_async(DevicePtr ptr, std::uint8_t value, std::size_t bytes,
                           StreamView stream) {
  void* native = check_stream(stream, "memset_async");
  require_device_ptr(name_, "memset_async", "destination", ptr);
  range_end(name_, "memset_async", ptr, bytes);
  bump(counters_->memset);
  do_memset_async(ptr, value, bytes, native);
}

void Backend::fill_async(std::span<const FillRegion> regions, std::uint8_t value,
                         StreamView stream) {
  void* native = check_stream(stream, "fill_async");
  for (std::size_t i = 0; i < regions.size(); ++i) {
    if (regions[i].ptr.is_null()) {
      throw InvalidArgument(fmt::format("{}: fill_async: region {} of {} has a null pointer", name_,
                                        i, regions.size()));
    }
    range_end(name_, "fill_async", regions[i].ptr, regions[i].bytes);
  }
  if (regions.empty()) return;
  bump(counters_->fill);
  do_fill_async(regions, value, native);
}

void Backend::copy_h2d_async(DevicePtr dst, const void* src, std::size_t bytes, StreamView stream) {
  void* native = check_stream(stream, "copy_h2d_async");
  require_device_ptr(name_, "copy_h2d_async", "destination", dst);
  require_host_ptr(name_, "copy_h2d_async", "source", src);
  range_end(name_, "copy_h2d_async", dst, bytes);
  bump(counters_->copy);
  do_copy_h2d_async(dst, src, bytes, native);
}

void Backend::copy_d2h_async(void* dst, DevicePtr src, std::size_t bytes, StreamView stream) {
  void* native = check_stream(stream, "copy_d2h_async");
  require_host_ptr(name_, "copy_d2h_async", "destination", dst);
  require_device_ptr(name_, "copy_d2h_async", "source", src);
  range_end(name_, "copy_d2h_async", src, bytes);
  bump(counters_->copy);
  do_copy_d2h_async(dst, src, bytes, native);
}

void Backend::copy_d2d_async(DevicePtr dst, DevicePtr src, std::size_t bytes, StreamView stream) {
  void* native = check_stream(stream, "copy_d2d_async");
  require_device_ptr(name_, "copy_d2d_async", "destination", dst);
  require_device_ptr(name_, "copy_d2d_async", "source", src);
  const auto dst_end = range_end(name_, "copy_d2d_async", dst, bytes);
  const auto src_end = range_end(name_, "copy_d2d_async", src, bytes);
  if (bytes != 0 && overlaps(dst.address(), dst_end, src.address(), src_end)) {
    throw InvalidArgument(
        fmt::format("{}: copy_d2d_async: source [{:#x}, +{}) and destination [{:#x}, +{}) overlap",
                    name_, src.address(), bytes, dst.address(), bytes));
  }
  bump(counters_->copy);
  do_copy_d2d_async(dst, src, bytes, native);
}

void Backend::copy_batch_async(std::span<const CopyRegion> regions, StreamView stream) {
  void* native = check_stream(stream, "copy_batch_async");
  std::vector<Range> dsts, srcs;
  dsts.reserve(regions.size());
  srcs.reserve(regions.size());
  for (std::size_t i = 0; i < regions.size(); ++i) {
    const CopyRegion& r = regions[i];
    if (r.dst.is_null() || r.src.is_null()) {
      throw InvalidArgument(fmt::format("{}: copy_batch_async: region {} of {} has a null pointer",
                                        name_, i, regions.size()));
    }
    const auto dst_end = range_end(name_, "copy_batch_async", r.dst, r.bytes);
    const auto src_end = range_end(name_, "copy_batch_async", r.src, r.bytes);
    if (r.bytes == 0) continue;
    dsts.push_back({r.dst.address(), dst_end, i});
    srcs.push_back({r.src.address(), src_end, i});
  }
  check_disjoint(dsts, name_, "copy_batch_async", "destinations");
  sort_by_begin(srcs);
  // Sources may overlap each other, so track the furthest end seen so far.
  std::uintptr_t src_reach = 0;
  std::size_t src_reach_index = 0;
  std::size_t s = 0;
  for (const Range& d : dsts) {
    while (s < srcs.size() && srcs[s].begin < d.end) {
      if (srcs[s].end > src_reach) {
        src_reach = srcs[s].end;
        src_reach_index = srcs[s].index;
      }
      ++s;
    }
    if (src_reach > d.begin) {
      throw InvalidArgument(fmt::format(
          "{}: copy_batch_async: destination of region {} overlaps the source of region {}", name_,
          d.index, src_reach_index));
    }
  }
  if (regions.empty()) return;
  bump(counters_->copy_batch);
  do_copy_batch_async(regions, native);
}

void Backend::copy_batch_h2d_async(std::span<const HostCopyRegion> regions, StreamView stream) {
  copy_host_batch_checked(regions, HostCopyDirection::host_to_device, stream,
                          "copy_batch_h2d_async");
}

void Backend::copy_batch_d2h_async(std::span<const HostCopyRegion> regions, StreamView stream) {
  copy_host_batch_checked(regions, HostCopyDirection::device_to_host, stream,
                          "copy_batch_d2h_async");
}

void Backend::copy_host_batch_checked(std::span<const HostCopyRegion> regions,
                                      HostCopyDirection direction, StreamView stream,
                                      const char* op) {
  void* native = check_stream(stream, op);
  const bool to_device = direction == HostCopyDirection::host_to_device;
  std::vector<Range> dsts;
  dsts.reserve(regions.size());
  for (std::size_t i = 0; i < regions.size(); ++i) {
    const HostCopyRegion& r = regions[i];
    if (r.device.is_null() || r.host == nullptr) {
      throw InvalidArgument(fmt::format("{}: {}: region {} of {} has a null {} pointer", name_, op,
                                        i, regions.size(), r.host == nullptr ? "host" : "device"));
    }
    const auto device_end = range_end(name_, op, r.device, r.bytes);
    const auto host_end = range_end(name_, op, DevicePtr::from(r.host), r.bytes);
    if (r.bytes == 0) continue;
    dsts.push_back(to_device ? Range{r.device.address(), device_end, i}
                             : Range{reinterpret_cast<std::uintptr_t>(r.host), host_end, i});
  }
  check_disjoint(dsts, name_, op, to_device ? "device destinations" : "host destinations");
  if (regions.empty()) return;
  bump(counters_->copy_host_batch);
  do_copy_host_batch_async(regions, direction, native);
}

// ---- block pools ----------------------------------------------------------------

BlockPoolSet::~BlockPoolSet() {
  if (backend_ != nullptr && native_ != nullptr) backend_->do_unregister_block_pools(native_);
}

BlockPoolSet Backend::register_block_pools(std::span<const PoolGeometry> pools,
                                           std::size_t num_blocks) {
  if (pools.empty())
    throw InvalidArgument(fmt::format("{}: register_block_pools: no pools", name_));
  if (num_blocks == 0) {
    throw InvalidArgument(fmt::format("{}: register_block_pools: num_blocks must be > 0", name_));
  }
  bool dense = true;
  for (std::size_t i = 0; i < pools.size(); ++i) {
    const PoolGeometry& p = pools[i];
    if (p.base.is_null() || p.bytes == 0 || p.stride < p.bytes) {
      throw InvalidArgument(fmt::format(
          "{}: register_block_pools: pool {} is invalid (base {:#x}, bytes {}, stride {}): "
          "needs a non-null base, bytes > 0 and stride >= bytes",
          name_, i, p.base.address(), p.bytes, p.stride));
    }
    const std::optional<std::size_t> extent = p.extent(num_blocks);
    if (!extent) {
      throw InvalidArgument(fmt::format(
          "{}: register_block_pools: pool {} extent of {} blocks overflows", name_, i, num_blocks));
    }
    range_end(name_, "register_block_pools", p.base, *extent);
    dense = dense && p.stride == p.bytes;
  }
  BlockPoolSet set;
  set.native_ = do_register_block_pools(pools, num_blocks);
  set.backend_ = this;
  set.num_blocks_ = num_blocks;
  set.num_pools_ = pools.size();
  set.dense_ = dense;
  return set;
}

void Backend::fill_blocks_async(const BlockPoolSet& pools, std::span<const std::uint32_t> block_ids,
                                std::uint8_t value, StreamView stream) {
  void* native = check_stream(stream, "fill_blocks_async");
  if (pools.backend_ != this || pools.native_ == nullptr) {
    throw InvalidArgument(fmt::format(
        "{}: fill_blocks_async: the pool set is empty or registered with another backend", name_));
  }
  for (std::uint32_t id : block_ids) {
    if (id >= pools.num_blocks_) {
      throw OutOfRange(fmt::format("{}: fill_blocks_async: block {} out of range ({} blocks)",
                                   name_, id, pools.num_blocks_));
    }
  }
  if (block_ids.empty()) return;
  bump(counters_->fill);
  do_fill_blocks_async(pools.native_, block_ids, value, native);
}

void Backend::copy_h2d(DevicePtr dst, const void* src, std::size_t bytes, StreamView stream) {
  copy_h2d_async(dst, src, bytes, stream);
  synchronize(stream);
}

void Backend::copy_d2h(void* dst, DevicePtr src, std::size_t bytes, StreamView stream) {
  copy_d2h_async(dst, src, bytes, stream);
  synchronize(stream);
}

void Backend::inject_async_fault(StreamView stream) {
  do_inject_async_fault(check_stream(stream, "inject_async_fault"));
}

CallCounts Backend::call_counts() const noexcept {
  auto get = [](const std::atomic<std::uint64_t>& c) { return c.load(std::memory_order_relaxed); };
  CallCounts out;
  out.alloc = get(counters_->alloc);
  out.free = get(counters_->free);
  out.memset = get(counters_->memset);
  out.fill = get(counters_->fill);
  out.copy = get(counters_->copy);
  out.copy_batch = get(counters_->copy_batch);
  out.copy_host_batch = get(counters_->copy_host_batch);
  out.synchronize = get(counters_->synchronize);
  out.host_alloc = get(counters_->host_alloc);
  out.host_free = get(counters_->host_free);
  return out;
}

void Backend::reset_call_counts() noexcept {
  for (auto* c : {&counters_->alloc, &counters_->free, &counters_->memset, &counters_->fill,
                  &counters_->copy, &counters_->copy_batch, &counters_->copy_host_batch,
                  &counters_->synchronize, &counters_->host_alloc, &counters_->host_free}) {
    c->store(0, std::memory_order_relaxed);
  }
}

// ---- Stream / Event -----------------------------------------------------------

Stream& Stream::operator=(Stream&& other) noexcept {
  if (this != &other) {
    reset();
    backend_ = std::exchange(other.backend_, nullptr);
    native_ = std::exchange(other.native_, nullptr);
  }
  return *this;
}

Stream::~Stream() {
  reset();
}

void Stream::reset() noexcept {
  if (backend_ != nullptr && native_ != nullptr) backend_->do_destroy_stream(native_);
  backend_ = nullptr;
  native_ = nullptr;
}

StreamView Stream::view() const noexcept {
  return StreamView(backend_, native_);
}

void Stream::synchronize() const {
  if (backend_ == nullptr) throw InvalidArgument("Stream::synchronize on a moved-from stream");
  backend_->synchronize(view());
}

void* StreamView::vendor_handle() const {
  if (backend_ == nullptr) {
    throw InvalidArgument(
        "StreamView::vendor_handle: a view of no backend (moved-from or released)");
  }
  return backend_->vendor_stream(*this);
}

WrappedStream& WrappedStream::operator=(WrappedStream&& other) noexcept {
  if (this != &other) {
    release();
    backend_ = std::exchange(other.backend_, nullptr);
    native_ = std::exchange(other.native_, nullptr);
  }
  return *this;
}

WrappedStream::~WrappedStream() {
  release();
}

void WrappedStream::release() noexcept {
  // The backend's do_destroy_stream knows the handle is a wrap: it forgets it
  // and leaves the vendor stream alone.
  if (backend_ != nullptr && native_ != nullptr) backend_->do_destroy_stream(native_);
  backend_ = nullptr;
  native_ = nullptr;
}

StreamView WrappedStream::view() const noexcept {
  return StreamView(backend_, native_);
}

AdoptedMemory::~AdoptedMemory() {
  if (backend_ != nullptr && !ptr_.is_null()) backend_->do_release_adopted(ptr_);
}

Event& Event::operator=(Event&& other) noexcept {
  if (this != &other) {
    reset();
    backend_ = std::exchange(other.backend_, nullptr);
    native_ = std::exchange(other.native_, nullptr);
  }
  return *this;
}

Event::~Event() {
  reset();
}

void Event::reset() noexcept {
  if (backend_ != nullptr && native_ != nullptr) backend_->do_destroy_event(native_);
  backend_ = nullptr;
  native_ = nullptr;
}

void Event::record(StreamView stream) {
  if (backend_ == nullptr) throw InvalidArgument("Event::record on a moved-from event");
  backend_->record_event(*this, stream);
}

void Event::wait(StreamView stream) const {
  if (backend_ == nullptr) throw InvalidArgument("Event::wait on a moved-from event");
  backend_->wait_event(stream, *this);
}

void Event::synchronize() const {
  if (backend_ == nullptr) throw InvalidArgument("Event::synchronize on a moved-from event");
  backend_->synchronize_event(*this);
}

bool Event::query() const {
  if (backend_ == nullptr) throw InvalidArgument("Event::query on a moved-from event");
  return backend_->query_event(*this);
}

}  // namespace kvport
