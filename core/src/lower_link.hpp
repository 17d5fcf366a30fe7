// SPDX-License-Identifier: Apache-2.0
// The lower-tier link, the third room of a HostTier (core/src/host_tier.cpp):
// the store below the host (LowerTierStore, lower_tier.hpp) and the two ways
// blocks cross to it, each one batch: a spill offers the host's least
// recently used ready slots (with the origins the store announces them
// with), and a lookup's run reads the store's blocks into host slots. It
// takes and frees no slot itself (the tier does, announcing what its slots
// do) and announces nothing (the store announces its own blocks).
#pragma once

#include <cstddef>
#include <span>
#include <vector>

#include "host_slots.hpp"
#include "kvport/core/host_tier.hpp"
#include "kvport/core/lower_tier.hpp"

namespace kvport::detail {

class LowerLink {
 public:
  /// Scratch for a run as long as `max_run` (a spill, a lookup's run below
  /// the host: at most one entry per host slot) is reserved here, so that no
  /// call allocates.
  explicit LowerLink(std::size_t max_run) {
    offered_.reserve(max_run);
    offered_hashes_.reserve(max_run);
    offered_images_.reserve(max_run);
    offered_origins_.reserve(max_run);
  }

  LowerTierStore* store() const noexcept { return store_; }
  void set_store(LowerTierStore* store) noexcept { store_ = store; }
  /// Whether the store holds `hash` (no store: false).
  bool contains(const BlockHash& hash) const noexcept {
    return store_ != nullptr && store_->contains(hash);
  }

  // ---- spill -------------------------------------------------------------------------

  /// Offers the store up to `n` ready host slots no onload pins, least
  /// recently used first, as one batch (LowerTierStore::put, with each
  /// slot's origin), and returns them: the caller frees them, whether the
  /// store kept them or not. Counts the offers and the blocks kept. Nothing
  /// without a store.
  std::span<const SlotId> offer(const HostSlots& host, std::size_t n,
                                HostTierCounters& counters) noexcept {
    offered_.clear();
    offered_hashes_.clear();
    offered_images_.clear();
    offered_origins_.clear();
    if (store_ == nullptr) return {};
    for (const Slot& c : host.lru) {  // reserved: nothing below allocates
      if (offered_.size() == n || offered_.size() == offered_.capacity()) break;
      if (c.pins != 0) continue;
      const SlotId id = host.id_of(c);
      offered_.push_back(id);
      offered_hashes_.push_back(host.hashes[id]);
      offered_images_.emplace_back(host.slot_ptr(id), host.slot_bytes);
      offered_origins_.push_back(host.origin_of(id));
    }
    if (offered_.empty()) return {};
    counters.lower_tier_offers += offered_.size();
    counters.lower_tier_writes += store_->put(offered_hashes_, offered_images_, offered_origins_);
    return offered_;
  }

  // ---- a lookup's run below the host ---------------------------------------------------

  /// Starts a run: nothing found below yet.
  void begin_run() noexcept {
    run_positions_.clear();
    run_hashes_.clear();
    reads_.clear();
  }
  /// Adds `hash`, at `position` of the lookup's run, when the store holds
  /// it; false otherwise (the run ends there). May throw std::bad_alloc.
  bool find(const BlockHash& hash, std::size_t position) {
    if (!contains(hash)) return false;
    run_positions_.push_back(position);
    run_hashes_.push_back(hash);
    return true;
  }
  /// The run's blocks found below: their hashes and positions in the run.
  std::span<const BlockHash> run_hashes() const noexcept { return run_hashes_; }
  std::span<const std::size_t> run_positions() const noexcept { return run_positions_; }

  /// Sizes the reads of the run found (may throw std::bad_alloc; nothing
  /// changed then), and makes its blocks the store's most recently used: a
  /// spill that makes room on the host may evict the store's least recently
  /// used blocks, and these are about to be read.
  void prepare_reads() {
    reads_.reserve(run_hashes_.size());
    store_->touch(run_hashes_);
  }
  /// The next found block is read into `slot` (prepare_reads reserved room).
  void read_into(std::span<std::byte> slot) noexcept { reads_.push_back(slot); }
  /// Reads the blocks given slots, as one batch: how many (a prefix) were
  /// read whole and verified. The rest of the run found is a shortfall.
  std::size_t read(HostTierCounters& counters) noexcept {
    const std::size_t got =
        reads_.empty() ? 0
                       : store_->get_prefix(
                             std::span<const BlockHash>(run_hashes_).first(reads_.size()), reads_);
    counters.lower_tier_shortfalls += run_hashes_.size() - got;
    return got;
  }
  /// Removes the first `n` blocks read from the store (an exclusive tier:
  /// they moved up).
  void erase_read(std::size_t n) noexcept {
    if (n > 0) store_->erase(std::span<const BlockHash>(run_hashes_).first(n));
  }

  /// Counts a lookup's hits for the store's admission filter.
  void note_hits(std::span<const BlockHash> hit) const noexcept {
    if (store_ != nullptr && !hit.empty()) store_->note_hits(hit);
  }

 private:
  LowerTierStore* store_ = nullptr;
  // A spill's batch.
  std::vector<SlotId> offered_;
  std::vector<BlockHash> offered_hashes_;
  std::vector<std::span<const std::byte>> offered_images_;
  std::vector<BlockOrigin> offered_origins_;
  // A lookup's run below the host: where its blocks are in the run, their
  // hashes, the host slots they are read into.
  std::vector<std::size_t> run_positions_;
  std::vector<BlockHash> run_hashes_;
  std::vector<std::span<std::byte>> reads_;
};

}  // namespace kvport::detail
