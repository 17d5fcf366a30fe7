// SPDX-License-Identifier: Apache-2.0
// One armed backend fault at a time, for the drivers of random operation
// streams (TierDriver, HybridDriver): an operation arms the failure of the
// Nth call of one kind (a copy at the call, a copy deferred to its stream, or
// a synchronize), counted over the driver's own cache calls only, which run
// through call(). A call that let the armed one through counts its calls off;
// the one in which it fired disarms it.
#pragma once

#include <cstdint>
#include <optional>

#include "kvport/platform/fault_injecting_backend.hpp"

namespace kvport::testing {

class ArmedFault {
 public:
  /// `faults`: the backend the cache lives on (null: arming does nothing).
  explicit ArmedFault(FaultInjectingBackend* faults) noexcept : faults_(faults) {}

  /// Arms a fault unless one is armed: of kind a % 3 (copy at the call, copy
  /// deferred to the stream, synchronize), the (1 + b % 16)th call of that
  /// kind that call() runs from now.
  void arm(std::uint32_t a, std::uint32_t b) {
    if (faults_ == nullptr || armed_) return;
    switch (a % 3) {
      case 0:
        armed_ = Armed{FaultKind::copy, FaultMode::synchronous, 0};
        break;
      case 1:
        armed_ = Armed{FaultKind::copy, FaultMode::deferred, 0};
        break;
      default:
        armed_ = Armed{FaultKind::synchronize, FaultMode::synchronous, 0};
        break;
    }
    armed_->remaining = 1 + b % 16;
  }

  /// Runs `fn` with the armed fault's plan set (or plainly when none is
  /// armed) and returns what it returns; when the fault fired in it (also
  /// when `fn` threw) calls `on_fault()` and disarms.
  template <class F, class OnFault>
  decltype(auto) call(F&& fn, OnFault&& on_fault) {
    if (!armed_) return fn();
    faults_->reset_fault_counts();
    faults_->set_plan(armed_->kind, {.nth = armed_->remaining, .mode = armed_->mode});
    struct Disarm {
      ArmedFault& f;
      OnFault& on_fault;
      ~Disarm() {
        const FaultCounts c = f.faults_->counts(f.armed_->kind);
        f.faults_->clear_plan(f.armed_->kind);
        if (c.faults == 0) {
          f.armed_->remaining -= c.calls;
          return;
        }
        f.armed_.reset();
        ++f.injected_;
        on_fault();
      }
    } disarm{*this, on_fault};
    return fn();
  }

  /// Disarms and clears every plan of the backend.
  void disarm() {
    armed_.reset();
    if (faults_ != nullptr) faults_->clear_plans();
  }

  /// Faults that fired so far.
  std::uint64_t injected() const noexcept { return injected_; }

 private:
  struct Armed {
    FaultKind kind;
    FaultMode mode;
    std::uint64_t remaining;  // calls of `kind` to let through, plus one
  };

  FaultInjectingBackend* faults_;
  std::optional<Armed> armed_;
  std::uint64_t injected_ = 0;
};

}  // namespace kvport::testing
