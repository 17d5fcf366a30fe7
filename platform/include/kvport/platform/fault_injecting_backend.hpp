// SPDX-License-Identifier: Apache-2.0
// FaultInjectingBackend: a Backend decorator that makes chosen calls of an
// inner backend fail, so that tests can check every error path of the code
// above the contract (PagedKvCache construction, zeroing, copies) without a
// real out-of-memory or device fault.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <mutex>
#include <optional>
#include <random>
#include <span>
#include <string_view>
#include <unordered_map>

#include "kvport/platform/backend.hpp"

namespace kvport {

/// The groups of Backend calls a fault plan can target.
enum class FaultKind {
  alloc,           ///< alloc, alloc_host
  fill,            ///< memset_async, fill_async, fill_blocks_async
  copy,            ///< copy_h2d_async, copy_d2h_async, copy_d2d_async, copy_batch_async,
                   ///< copy_batch_h2d_async, copy_batch_d2h_async
  synchronize,     ///< stream synchronize and event synchronize
  stream_create,   ///< create_stream
  event_create,    ///< create_event, create_timing_event
  register_pools,  ///< register_block_pools
};

/// Number of FaultKind values.
inline constexpr std::size_t kFaultKindCount = 7;

/// "alloc", "fill", "copy", "synchronize", "stream_create", "event_create",
/// "register_pools"; "unknown" for a value outside the enum.
std::string_view to_string(FaultKind kind) noexcept;

/// How an injected fault shows itself.
enum class FaultMode {
  /// The call throws at once and does nothing: OutOfMemory for alloc,
  /// BackendError for every other kind.
  synchronous,
  /// For the asynchronous kinds only (fill, copy): the call does nothing and
  /// returns normally; a BackendError is recorded on its stream and thrown by
  /// the next synchronize of that stream, once, as a device error of
  /// asynchronous work would be.
  deferred,
};

/// When calls of one kind fail. Conditions combine: a call fails when any set
/// condition holds. Calls are numbered from 1, counting the calls of that kind
/// made since the plan was set. Example:
///   backend.set_plan(FaultKind::copy, {.nth = 3, .mode = FaultMode::deferred});
struct FaultPlan {
  /// Fail the call numbered `nth` (once). Must be > 0.
  std::optional<std::uint64_t> nth = std::nullopt;
  /// Fail every call numbered `from_nth` or higher. Must be > 0.
  std::optional<std::uint64_t> from_nth = std::nullopt;
  /// Fail each call with this probability, in [0, 1]. The draws come from a
  /// std::mt19937_64 seeded with `seed` when the plan is set, one draw per
  /// call, so the same seed and the same calls give the same faults.
  std::optional<double> probability = std::nullopt;
  /// Seed of the probability draws (unused without `probability`).
  std::uint64_t seed = 0;
  /// How the selected calls fail; `deferred` only for FaultKind::fill / copy.
  FaultMode mode = FaultMode::synchronous;
};

/// Calls of one kind seen by the decorator, since construction or the last
/// reset_fault_counts().
struct FaultCounts {
  std::uint64_t calls = 0;   ///< calls that passed Backend's argument checks
  std::uint64_t faults = 0;  ///< of those, the ones that failed by injection
};

/// BackendError::native_code() of every injected BackendError.
inline constexpr long kInjectedFaultCode = -1000;

/// A Backend that forwards every call to an inner backend, failing the calls
/// that its fault plans select. With no plan set it behaves as the inner
/// backend (the conformance suite runs through it as "fault_host").
///
/// - name() is "fault(<inner name>)"; device_count and mem_info forward.
/// - Streams, events and block pool sets are the decorator's own handles, each
///   wrapping one of the inner backend's; the inner backend only ever sees its
///   own handles. A stale StreamView (destroyed stream) is an InvalidArgument.
///   wrap_stream, vendor_stream and adopt_memory forward to the inner backend
///   (never faulted); releasing a wrap never waits for the engine's stream.
/// - A call that an injected fault replaces never reaches the inner backend,
///   so the inner backend's own checks (ranges against live allocations) do
///   not run for it.
/// - Errors are never lost: a stream keeps a queue of pending errors (its
///   deferred injected faults, in call order, and the inner stream's own
///   asynchronous errors as its synchronize finds them); each synchronize
///   throws at most one, the oldest, and the rest wait for the following
///   synchronize calls. A stream destroyed with errors still pending
///   (including ones the inner stream reports when drained) logs each one
///   (warn), as does the decorator's destruction for its default stream.
/// - A synchronize (stream or event) that an injected fault fails still waits
///   for the inner work first, so nothing runs on after the error; an error
///   the inner stream reported meanwhile waits for the next synchronize (for
///   an event, the inner backend's own error is thrown instead of the
///   injected one).
/// - Cost: each call adds one lock of the decorator's mutex (and, for calls
///   on a stream, a hash lookup of the stream) to the inner call.
/// - Thread-safety: that of the inner backend (the host backend: one thread
///   per stream). The decorator's plans, counters, random generators and
///   pending errors sit behind one mutex that is never held while the inner
///   backend runs.
/// - The inner backend must outlive the decorator (a non-owning one) and must
///   not be used for the decorator's handles directly.
class FaultInjectingBackend final : public Backend {
 public:
  /// Decorates `inner` without owning it.
  explicit FaultInjectingBackend(Backend& inner);
  /// Decorates and owns `inner`. Throws InvalidArgument when it is null.
  explicit FaultInjectingBackend(std::unique_ptr<Backend> inner);
  /// Synchronizes the default stream (and any stream still alive, a caller
  /// bug), logs the errors still pending on them, then releases the
  /// decorator's handles (and the inner backend when owned). Never throws.
  ~FaultInjectingBackend() override;

  /// The decorated backend.
  Backend& inner() const noexcept { return *inner_; }

  /// Sets the plan of `kind`, replacing the previous one; the call numbering
  /// and the random generator of `kind` restart. Throws InvalidArgument for a
  /// plan with no condition, nth or from_nth == 0, a probability outside
  /// [0, 1] (or NaN), the deferred mode for a kind other than fill and copy,
  /// or a `kind` outside the enum.
  void set_plan(FaultKind kind, const FaultPlan& plan);

  /// Removes the plan of `kind` (no more faults of that kind). Throws
  /// InvalidArgument for a `kind` outside the enum.
  void clear_plan(FaultKind kind);
  /// Removes every plan.
  void clear_plans() noexcept;
  /// The plan of `kind`, if any. Throws InvalidArgument for a `kind` outside
  /// the enum.
  std::optional<FaultPlan> plan(FaultKind kind) const;

  /// Calls and injected faults of `kind`. Throws InvalidArgument for a `kind`
  /// outside the enum.
  FaultCounts counts(FaultKind kind) const;
  /// Sets every kind's counts to zero (plans and their numbering are kept).
  void reset_fault_counts() noexcept;

  /// Allocations made through the decorator and not yet freed through it, and
  /// their bytes (as requested). Back to 0 when a user released everything.
  std::size_t live_allocations() const noexcept;
  std::size_t live_bytes() const noexcept;

  /// Faults injected by every FaultInjectingBackend of this process so far
  /// (for test reports: docs/reliability.md quotes it).
  static std::uint64_t faults_injected_in_process() noexcept;

 private:
  struct FaultStream;
  struct FaultEvent;
  struct FaultPoolSet;
  struct Injection {
    FaultKind kind;
    FaultMode mode;
    std::uint64_t call;  // numbered since the plan was set
  };
  struct KindState {
    std::optional<FaultPlan> plan;
    std::uint64_t calls_since_plan = 0;
    std::mt19937_64 rng;
    FaultCounts counts;
  };

  // `owned` is a reference so that `inner` can be read from it before the move.
  FaultInjectingBackend(std::unique_ptr<Backend>&& owned, Backend* inner);

  // Counts one call of `kind` and says whether (and how) it fails.
  std::optional<Injection> decide(FaultKind kind);
  // Throws the synchronous error of `injection` for operation `op`.
  [[noreturn]] void throw_injected(const Injection& injection, const char* op,
                                   std::size_t bytes = 0) const;
  // Applies `injection` (if any) to an asynchronous call on `stream`: throws
  // when synchronous, records the error and returns true when deferred.
  bool inject_async(const std::optional<Injection>& injection, const char* op, FaultStream& stream);
  std::shared_ptr<FaultStream> stream_of(void* native, const char* op) const;
  // Waits for the inner stream; an error it reports joins the pending ones.
  void drain(FaultStream& stream) noexcept;
  // Logs (warn) and drops the errors pending on `stream`.
  void log_pending(FaultStream& stream, const char* where) noexcept;

  int do_device_count() const override;
  MemInfo do_mem_info() const override;
  bool do_device_lost() const noexcept override { return inner_->device_lost(); }
  MemoryKind do_memory_kind() const noexcept override { return inner_->memory_kind(); }
  DevicePtr do_alloc(std::size_t bytes) override;
  bool do_free(DevicePtr ptr) noexcept override;
  void* do_alloc_host(std::size_t bytes) override;
  bool do_free_host(void* ptr) noexcept override;
  void* do_create_stream() override;
  void do_destroy_stream(void* native) noexcept override;
  void* do_default_stream() override;
  bool do_stream_alive(void* native) const noexcept override;
  void* do_wrap_stream(void* vendor_stream) override;
  void* do_vendor_stream(void* native) const override;
  void do_adopt_memory(DevicePtr base, std::size_t bytes) override;
  void do_release_adopted(DevicePtr base) noexcept override;
  void do_synchronize(void* stream) override;
  void* do_create_event() override;
  void* do_create_timing_event() override;
  double do_elapsed_seconds(void* start, void* end) override;
  void do_destroy_event(void* native) noexcept override;
  void do_record_event(void* event, void* stream) override;
  void do_wait_event(void* stream, void* event) override;
  void do_synchronize_event(void* event) override;
  bool do_query_event(void* event) override;
  void do_memset_async(DevicePtr ptr, std::uint8_t value, std::size_t bytes, void* stream) override;
  void do_fill_async(std::span<const FillRegion> regions, std::uint8_t value,
                     void* stream) override;
  void do_copy_h2d_async(DevicePtr dst, const void* src, std::size_t bytes, void* stream) override;
  void do_copy_d2h_async(void* dst, DevicePtr src, std::size_t bytes, void* stream) override;
  void do_copy_d2d_async(DevicePtr dst, DevicePtr src, std::size_t bytes, void* stream) override;
  void do_copy_batch_async(std::span<const CopyRegion> regions, void* stream) override;
  void do_copy_host_batch_async(std::span<const HostCopyRegion> regions,
                                HostCopyDirection direction, void* stream) override;
  void do_inject_async_fault(void* stream) override;
  void* do_register_block_pools(std::span<const PoolGeometry> pools,
                                std::size_t num_blocks) override;
  void do_unregister_block_pools(void* native) noexcept override;
  void do_fill_blocks_async(void* pools, std::span<const std::uint32_t> block_ids,
                            std::uint8_t value, void* stream) override;

  // Declared first so that it is destroyed last, after every inner handle.
  std::unique_ptr<Backend> owned_;
  Backend* inner_;

  mutable std::mutex mutex_;
  std::array<KindState, kFaultKindCount> kinds_;
  std::unordered_map<std::uintptr_t, std::size_t> live_;  // address -> bytes
  std::size_t live_bytes_ = 0;
  // Streams by serial number, never by address, so that a stale view of a
  // destroyed stream is rejected instead of reaching a reused address.
  std::unordered_map<void*, std::shared_ptr<FaultStream>> streams_;
  std::uintptr_t last_stream_id_ = 0;
  // The inner backend's registrations of adopted memory, by base address.
  std::unordered_map<std::uintptr_t, AdoptedMemory> adopted_;
};

}  // namespace kvport
