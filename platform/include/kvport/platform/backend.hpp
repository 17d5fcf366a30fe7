// SPDX-License-Identifier: Apache-2.0
// The Backend contract: what every device plugin (host, CUDA, HIP) provides.
// The RAII buffers (device_buffer.hpp, host_buffer.hpp) and the block-pool
// types (block_pool.hpp) have headers of their own; this one includes them.
//
// Public calls are non-virtual: they validate arguments that every backend
// validates the same way (null pointers, a stream of another backend,
// overlapping copies), count the call, then forward to a private `do_*`
// virtual that the plugin implements. All sizes are in bytes.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <string_view>

#include "kvport/platform/adopted_memory.hpp"
#include "kvport/platform/block_pool.hpp"
#include "kvport/platform/device_buffer.hpp"
#include "kvport/platform/device_ptr.hpp"
#include "kvport/platform/device_region.hpp"
#include "kvport/platform/host_buffer.hpp"
#include "kvport/platform/memory_kind.hpp"
#include "kvport/platform/stream.hpp"

namespace kvport {

/// Free and total device memory, for capacity planning.
struct MemInfo {
  std::size_t free_bytes = 0;
  std::size_t total_bytes = 0;
};

/// One region of a batched fill: `bytes` bytes starting at `ptr` (a
/// DeviceRegion, so block regions from core fill as they are).
using FillRegion = DeviceRegion;

/// One region of a batched device-to-device copy on one backend
/// (copy_batch_async). A copy between two processes' memory is a
/// transfer::TransferRegion (transfer/layout.hpp).
struct CopyRegion {
  DevicePtr dst;
  DevicePtr src;
  std::size_t bytes = 0;
};

/// Which way a batch of host copies moves bytes (copy_batch_h2d_async /
/// copy_batch_d2h_async).
enum class HostCopyDirection {
  host_to_device,
  device_to_host,
};

/// One region of a batched copy between device memory and host memory:
/// `bytes` bytes between `device` and `host`, in the direction of the call
/// that takes it. `host` may be any host memory; memory from alloc_host
/// (pinned) is what lets the GPU backends copy it asynchronously and at full
/// link speed (pageable memory is staged by the runtimes and may block).
struct HostCopyRegion {
  DevicePtr device;
  void* host = nullptr;
  std::size_t bytes = 0;
};

/// How many contract calls a backend has served. Each public call counts once,
/// whatever it costs inside: a `fill_async` of 40 000 regions is one fill call.
/// Used by benchmarks and tests to prove that batching happens.
struct CallCounts {
  std::uint64_t alloc = 0;
  std::uint64_t free = 0;
  std::uint64_t memset = 0;
  std::uint64_t fill = 0;  ///< fill_async and fill_blocks_async
  std::uint64_t copy = 0;  ///< single copies in any direction
  std::uint64_t copy_batch = 0;
  std::uint64_t copy_host_batch = 0;  ///< copy_batch_h2d_async and copy_batch_d2h_async
  std::uint64_t synchronize = 0;
  std::uint64_t host_alloc = 0;  ///< alloc_host
  std::uint64_t host_free = 0;   ///< free_host (non-null pointers)

  /// Calls that queue device work: memset + fill + copy + copy_batch +
  /// copy_host_batch.
  std::uint64_t device_ops() const noexcept {
    return memset + fill + copy + copy_batch + copy_host_batch;
  }
};

/// Alignment of every allocation, on every backend.
inline constexpr std::size_t kAllocAlignment = 256;

/// Alignment of every pinned host allocation (alloc_host), on every backend.
inline constexpr std::size_t kHostAllocAlignment = 4096;

class Backend {
 public:
  virtual ~Backend();
  Backend(const Backend&) = delete;
  Backend& operator=(const Backend&) = delete;

  /// "host", "cuda", "hip", or a decorator's name.
  const std::string& name() const noexcept { return name_; }

  /// Devices this backend can see (host: 1). 0 means every device call throws.
  int device_count() const { return do_device_count(); }

  /// Free and total bytes of the selected device.
  MemInfo mem_info() const { return do_mem_info(); }

  /// True once the backend has seen a sticky, context-wide device error (see
  /// DeviceLost): from then on every device call throws DeviceLost. Always
  /// false on the host backend.
  bool device_lost() const noexcept { return do_device_lost(); }

  /// Where alloc() memory lives (host: host memory a CPU may read). A
  /// decorator reports its inner backend's.
  MemoryKind memory_kind() const noexcept { return do_memory_kind(); }

  // ---- memory -------------------------------------------------------------

  /// Allocates `bytes` (> 0), aligned to kAllocAlignment. Contents are
  /// unspecified. Throws InvalidArgument for 0 bytes, OutOfMemory when the
  /// device cannot satisfy the request.
  DevicePtr alloc(std::size_t bytes);

  /// Releases an allocation made by `alloc`. Returns false, logs an error and
  /// changes nothing when `ptr` is not a live allocation of this backend (a
  /// foreign pointer, an interior pointer, a double free). Null is a no-op
  /// that returns true. Never throws.
  bool free(DevicePtr ptr) noexcept;

  /// Registers `bytes` (> 0) at `base`, memory the caller allocated (an
  /// engine's KV tensors), so that this backend's calls accept ranges inside
  /// it (AdoptedMemory). kvport never frees it. The memory must be what
  /// alloc() would return on this backend: device memory of the backend's
  /// device on CUDA/HIP (not checked: the vendor reports a wrong pointer at
  /// the first copy or kernel), host memory a CPU may read on the host
  /// backend. Adopted ranges are process-wide: the range may not overlap a
  /// live allocation (alloc; pinned alloc_host buffers are staging, checked
  /// by their own backend only) or adopted range of ANY backend object of the
  /// same memory space (host memory; one device), so two caches never share
  /// a byte whichever backend objects they use (MemorySpaceRegistry). Cost:
  /// O(log n) insertions into two maps under locks. Throws InvalidArgument for
  /// a null base, 0 bytes, a range that wraps the address space, or one that
  /// overlaps such a range (the message names both ranges); InvalidArgument
  /// too on a backend that cannot adopt memory (a test decorator). Releasing
  /// the AdoptedMemory frees the range for the next adoption.
  AdoptedMemory adopt_memory(DevicePtr base, std::size_t bytes);

  // ---- pinned host memory ---------------------------------------------------

  /// Allocates `bytes` (> 0) of page-locked host memory, aligned to
  /// kHostAllocAlignment: cudaHostAlloc / hipHostMalloc on GPUs, page-aligned
  /// memory on the host backend. The device's copy engines read and write it
  /// directly, so copy_h2d_async / copy_d2h_async with it return before the
  /// copy is done and overlap other work (with pageable memory the GPU
  /// runtimes stage through a bounce buffer and may block). Pinning is costly
  /// (milliseconds per GiB): allocate once, reuse. Contents are unspecified.
  /// Throws InvalidArgument for 0 bytes, OutOfMemory when the memory cannot be
  /// pinned.
  void* alloc_host(std::size_t bytes);

  /// Releases memory from alloc_host. Returns false, logs an error and changes
  /// nothing for a pointer that is not a live pinned allocation of this
  /// backend (foreign, interior, freed twice). Null is a no-op that returns
  /// true. Copies still queued on it must be finished first (synchronize).
  /// Never throws.
  bool free_host(void* ptr) noexcept;

  // ---- streams and events ---------------------------------------------------

  /// Creates an independent in-order work queue.
  Stream create_stream();

  /// The backend's own stream, alive as long as the backend.
  StreamView default_stream();

  /// Registers a stream kvport did not create (an engine's), so that every
  /// call that takes a StreamView accepts it: memsets, fills, copies, events,
  /// synchronize, PagedKvCache's device work, the host tier, the transfer
  /// agent. Work queued through the view is queued on that very stream,
  /// ordered with the engine's own work on it. The registration gets a handle
  /// of its own (a serial, as kvport's streams) and ends with the returned
  /// WrappedStream; it never destroys the stream.
  ///   CUDA / HIP: a cudaStream_t / hipStream_t of the backend's device
  ///     (not checked: the runtime rejects a stream of another device at its
  ///     first use). nullptr is the vendor's legacy default stream (PyTorch's
  ///     default stream reports 0).
  ///   host: the host backend has no vendor streams; it wraps the handle
  ///     vendor_stream() gave for one of its own streams (the queue of a
  ///     worker thread): an engine on the host backend shares a queue with
  ///     kvport that way. Anything else is InvalidArgument.
  /// Wrapping the same vendor stream twice gives two registrations (views
  /// that compare unequal) of one stream. Throws InvalidArgument for a handle
  /// the backend cannot wrap, with the reason.
  WrappedStream wrap_stream(void* vendor_stream);

  /// The vendor's handle of `stream` (StreamView::vendor_handle): the
  /// cudaStream_t / hipStream_t behind kvport's serial on the GPU backends
  /// (the legacy default stream is nullptr), the queue's address on the host
  /// backend. Throws InvalidArgument for a view of another backend, a
  /// destroyed stream or a released wrap.
  void* vendor_stream(StreamView stream) const;

  /// Whether `stream` names a live stream of this backend: the default stream
  /// always; a stream from create_stream until its Stream is destroyed. False
  /// for a destroyed stream (its handle is never reused, so a stale view stays
  /// dead), a moved-from view and a stream of another backend. A lookup under
  /// the backend's handle lock: no device call, no wait, never throws. It says
  /// nothing about errors pending on the stream (synchronize reports those):
  /// a caller that waits for streams it remembers skips the dead ones with it
  /// and still sees every error of a live one, including an InvalidArgument
  /// raised asynchronously (the host backend's use after free).
  bool stream_alive(StreamView stream) const noexcept;

  /// Waits for every operation queued on `stream`; rethrows the first error an
  /// asynchronous operation on it raised since the last synchronize.
  void synchronize(StreamView stream);

  Event create_event();
  /// See Event::record / Event::wait / Event::synchronize.
  void record_event(const Event& event, StreamView stream);
  void wait_event(StreamView stream, const Event& event);
  void synchronize_event(const Event& event);
  /// Whether the stream has reached the event's last record (true for an event
  /// never recorded), without waiting: cudaEventQuery / hipEventQuery. It
  /// reports completion only: an asynchronous error of the work before the
  /// record surfaces at the stream's synchronize, as ever (a GPU backend
  /// throws here for a sticky device error, as every call does then).
  bool query_event(const Event& event);

  /// An event that also records when its stream reached it, for measuring
  /// device time (CUDA/HIP events without cudaEventDisableTiming).
  Event create_timing_event();
  /// Seconds between the last records of two timing events, measured on the
  /// device's clock. Waits for both to complete. Throws a kvport::Error when
  /// either was never recorded (InvalidArgument on host; the vendor's
  /// BackendError on GPUs, as for an event made by create_event).
  double elapsed_seconds(const Event& start, const Event& end);

  // ---- fills -----------------------------------------------------------------

  /// Sets `bytes` bytes at `ptr` to `value`, in stream order. 0 bytes is a
  /// no-op (still validated).
  void memset_async(DevicePtr ptr, std::uint8_t value, std::size_t bytes, StreamView stream);

  /// Sets every region to `value` as ONE device operation (one kernel launch
  /// over a descriptor table on GPUs), whatever the number of regions. The
  /// span is consumed before the call returns. Regions may overlap (they all
  /// receive the same value). An empty span is a no-op.
  void fill_async(std::span<const FillRegion> regions, std::uint8_t value, StreamView stream);

  /// Registers block pools for fill_blocks_async. Throws InvalidArgument for
  /// an empty list, a null base, a zero region size, a stride smaller than the
  /// region, num_blocks == 0 or a pool extent that overflows. The GPU
  /// backends also require every pool to lie inside one live allocation; the
  /// host backend checks the regions at each fill, as fill_async does.
  BlockPoolSet register_block_pools(std::span<const PoolGeometry> pools, std::size_t num_blocks);

  /// Sets the regions of `block_ids` in every registered pool to `value` as
  /// ONE device operation (the cache-aware fill). Upload cost grows with the
  /// number of ids, not with pools x ids: the GPU backends keep the pool
  /// table on the device. Runs of consecutive ids in dense pools are
  /// coalesced on the host backend. Throws InvalidArgument for an id
  /// >= num_blocks or a set of another backend. An empty span is a no-op.
  void fill_blocks_async(const BlockPoolSet& pools, std::span<const std::uint32_t> block_ids,
                         std::uint8_t value, StreamView stream);

  // ---- copies ----------------------------------------------------------------

  /// Host memory passed to an async copy must stay valid until the stream is
  /// synchronized (as with cudaMemcpyAsync).
  void copy_h2d_async(DevicePtr dst, const void* src, std::size_t bytes, StreamView stream);
  void copy_d2h_async(void* dst, DevicePtr src, std::size_t bytes, StreamView stream);

  /// Device-to-device copy. Overlapping source and destination ranges are
  /// rejected with InvalidArgument (use a staging buffer to move data within
  /// one range).
  void copy_d2d_async(DevicePtr dst, DevicePtr src, std::size_t bytes, StreamView stream);

  /// Many device-to-device copies as ONE device operation. Regions run in an
  /// unspecified order, so no destination may overlap another destination or
  /// any source (InvalidArgument). The span is consumed before the call
  /// returns.
  void copy_batch_async(std::span<const CopyRegion> regions, StreamView stream);

  /// Many copies between device memory and host memory as ONE backend call,
  /// host -> device (h2d: each region's `host` bytes into its `device` range)
  /// or device -> host (d2h). CUDA 12.8+ queues the batch with one
  /// cudaMemcpyBatchAsync (older runtimes and drivers: one cudaMemcpyAsync per
  /// region inside the call); HIP queues one hipMemcpyAsync per region; the
  /// host backend queues one stream operation. Regions run in an unspecified
  /// order, so destinations must not overlap (InvalidArgument); sources may.
  /// Checked at call time, before anything is queued (InvalidArgument): a null
  /// device or host pointer in any region, a range that wraps the address
  /// space, a device range outside one live allocation of this backend. A
  /// zero-byte region is checked and then skipped. An empty span is a no-op
  /// and not counted; any other call counts once (CallCounts::copy_host_batch).
  /// The span is consumed before the call returns; the host memory must stay
  /// valid until the stream is synchronized. A copy that fails on the stream
  /// surfaces at its next synchronize (BackendError / DeviceLost).
  void copy_batch_h2d_async(std::span<const HostCopyRegion> regions, StreamView stream);
  void copy_batch_d2h_async(std::span<const HostCopyRegion> regions, StreamView stream);

  /// Blocking helpers: queue the copy on `stream`, then synchronize it.
  void copy_h2d(DevicePtr dst, const void* src, std::size_t bytes, StreamView stream);
  void copy_d2h(void* dst, DevicePtr src, std::size_t bytes, StreamView stream);

  // ---- testing ----------------------------------------------------------------

  /// Queues work on `stream` that fails asynchronously, so that the stream's
  /// next synchronize throws BackendError, as after a faulting kernel. For the
  /// conformance suite. On GPUs the fault is a trapping kernel, a sticky error
  /// that leaves the device context unusable: use it only in a process of its
  /// own.
  void inject_async_fault(StreamView stream);

  // ---- instrumentation -------------------------------------------------------

  CallCounts call_counts() const noexcept;
  void reset_call_counts() noexcept;

 protected:
  explicit Backend(std::string name);

  /// Wraps a native handle of this backend into a view / owning object.
  StreamView make_stream_view(void* native) noexcept { return StreamView(this, native); }

 private:
  friend class Stream;
  friend class WrappedStream;
  friend class AdoptedMemory;
  friend class Event;
  friend class BlockPoolSet;

  virtual int do_device_count() const = 0;
  virtual MemInfo do_mem_info() const = 0;
  virtual bool do_device_lost() const noexcept { return false; }
  virtual MemoryKind do_memory_kind() const noexcept { return MemoryKind::host; }
  virtual DevicePtr do_alloc(std::size_t bytes) = 0;
  virtual bool do_free(DevicePtr ptr) noexcept = 0;
  virtual void* do_alloc_host(std::size_t bytes) = 0;
  virtual bool do_free_host(void* ptr) noexcept = 0;
  virtual void* do_create_stream() = 0;
  virtual void do_destroy_stream(void* native) noexcept = 0;
  virtual void* do_default_stream() = 0;
  /// Registers a vendor stream; returns its handle. Default: InvalidArgument
  /// (the backend cannot wrap). Destroying the handle goes through
  /// do_destroy_stream, which must then forget it without destroying the
  /// vendor stream.
  virtual void* do_wrap_stream(void* vendor_stream);
  /// The vendor handle behind `native`; InvalidArgument for a stale handle.
  /// Default: InvalidArgument.
  virtual void* do_vendor_stream(void* native) const;
  /// Registers adopted memory (checked: non-null, > 0 bytes, no wrap).
  /// Default: InvalidArgument.
  virtual void do_adopt_memory(DevicePtr base, std::size_t bytes);
  /// Forgets an adopted range by its base; never frees it.
  virtual void do_release_adopted(DevicePtr base) noexcept;
  /// `native` is a handle this backend gave out (or a stale one); true while
  /// it is the default stream or a stream not yet destroyed.
  virtual bool do_stream_alive(void* native) const noexcept = 0;
  virtual void do_synchronize(void* stream) = 0;
  virtual void* do_create_event() = 0;
  virtual void* do_create_timing_event() = 0;
  virtual double do_elapsed_seconds(void* start, void* end) = 0;
  virtual void do_destroy_event(void* native) noexcept = 0;
  virtual void do_record_event(void* event, void* stream) = 0;
  virtual void do_wait_event(void* stream, void* event) = 0;
  virtual void do_synchronize_event(void* event) = 0;
  virtual bool do_query_event(void* event) = 0;
  virtual void do_memset_async(DevicePtr ptr, std::uint8_t value, std::size_t bytes,
                               void* stream) = 0;
  virtual void do_fill_async(std::span<const FillRegion> regions, std::uint8_t value,
                             void* stream) = 0;
  virtual void do_copy_h2d_async(DevicePtr dst, const void* src, std::size_t bytes,
                                 void* stream) = 0;
  virtual void do_copy_d2h_async(void* dst, DevicePtr src, std::size_t bytes, void* stream) = 0;
  virtual void do_copy_d2d_async(DevicePtr dst, DevicePtr src, std::size_t bytes, void* stream) = 0;
  virtual void do_copy_batch_async(std::span<const CopyRegion> regions, void* stream) = 0;
  /// Both directions of copy_batch_h2d_async / copy_batch_d2h_async; the
  /// regions are non-empty and have passed the checks Backend makes itself
  /// (the device ranges against live allocations are the plugin's).
  virtual void do_copy_host_batch_async(std::span<const HostCopyRegion> regions,
                                        HostCopyDirection direction, void* stream) = 0;

  virtual void do_inject_async_fault(void* stream) = 0;

  // Block pools: the GPU backends keep the table on the device; the host
  // backend checks each pool's extent once and walks the ids on its worker.
  virtual void* do_register_block_pools(std::span<const PoolGeometry> pools,
                                        std::size_t num_blocks) = 0;
  virtual void do_unregister_block_pools(void* native) noexcept = 0;
  virtual void do_fill_blocks_async(void* pools, std::span<const std::uint32_t> block_ids,
                                    std::uint8_t value, void* stream) = 0;

  void* check_stream(StreamView stream, const char* op) const;
  void* check_event(const Event& event, const char* op) const;
  void copy_host_batch_checked(std::span<const HostCopyRegion> regions, HostCopyDirection direction,
                               StreamView stream, const char* op);

  std::string name_;
  struct Counters;
  std::unique_ptr<Counters> counters_;
};

}  // namespace kvport
