// SPDX-License-Identifier: Apache-2.0
#include "kvport/core/host_tier.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <chrono>
#include <exception>
#include <thread>
#include <utility>

#include "copy_engine.hpp"
#include "host_slots.hpp"
#include "kvport/core/block_regions.hpp"
#include "kvport/platform/byte_size.hpp"
#include "kvport/platform/error.hpp"
#include "kvport/platform/host_memory.hpp"
#include "kvport/platform/log.hpp"
#include "log_nothrow.hpp"
#include "lower_link.hpp"

namespace kvport {

const char* to_string(TierPolicy policy) noexcept {
  switch (policy) {
    case TierPolicy::write_back:
      return "write-back";
    case TierPolicy::write_through:
      return "write-through";
  }
  return "unknown";
}

std::optional<TierPolicy> parse_tier_policy(std::string_view text) noexcept {
  if (text == "write-back") return TierPolicy::write_back;
  if (text == "write-through") return TierPolicy::write_through;
  return std::nullopt;
}

const char* to_string(TierInclusion inclusion) noexcept {
  switch (inclusion) {
    case TierInclusion::exclusive:
      return "exclusive";
    case TierInclusion::inclusive:
      return "inclusive";
  }
  return "unknown";
}

HostTierCounters& HostTierCounters::operator+=(const HostTierCounters& o) noexcept {
  offloads += o.offloads;
  offload_bytes += o.offload_bytes;
  onloads += o.onloads;
  onload_bytes += o.onload_bytes;
  host_hits += o.host_hits;
  host_evictions += o.host_evictions;
  aborted_transfers += o.aborted_transfers;
  aborted_blocks += o.aborted_blocks;
  already_on_host += o.already_on_host;
  dropped_offloads += o.dropped_offloads;
  offload_waits += o.offload_waits;
  onload_shortfalls += o.onload_shortfalls;
  stalled_transfers += o.stalled_transfers;
  stalled_blocks += o.stalled_blocks;
  lower_tier_offers += o.lower_tier_offers;
  lower_tier_writes += o.lower_tier_writes;
  lower_tier_hits += o.lower_tier_hits;
  lower_tier_shortfalls += o.lower_tier_shortfalls;
  lookup_spills += o.lookup_spills;
  poll_spills += o.poll_spills;
  return *this;
}

namespace {

using detail::CopyEngine;
using detail::HostSlots;
using detail::kNoSlot;
using detail::LowerLink;
using detail::Slot;
using detail::SlotId;
using detail::SlotOrigin;
using detail::SlotState;

// One device block in a write-back or write-through copy.
struct Transfer {
  BlockId block;
  SlotId slot;
};

// What copies abandoned at their deadline hold (CopyEngine's payload): their
// device blocks stay held and their host slots out of use until their event
// completes (poll) or the tier is destroyed.
struct HeldCopies {
  std::vector<Transfer> writes;  // device -> host: slot quarantined, block held
  std::vector<Transfer> reads;   // host -> device (onloads): slot pinned, block held
};

enum class WaitResult : std::uint8_t { done, failed, stalled };

using detail::log_error_nothrow;

}  // namespace

struct HostTier::State {
  State(PrefixCache& p, const HostTierOptions& o, StreamView compute)
      : prefix(&p),
        kv(&p.kv_cache()),
        backend(&kv->backend()),
        options(o),
        compute_stream(compute),
        host(*backend, o.num_host_blocks, slot_bytes_for(*kv), p.tokens_per_block()),
        copies(*backend, compute, o.copy_timeout, "HostTier") {
    // Everything a call may append to is sized here (the slot store sizes
    // its own), so that no call allocates (and throws halfway) once blocks
    // are detached or slots taken: at most one transfer per host slot, at
    // most one write-through entry per device block (it holds the block).
    const std::size_t n = host.size();
    in_flight.reserve(n);
    staged.reserve(n);
    write_queue.reserve(kv->num_blocks());
  }

  // ---- events --------------------------------------------------------------------------
  // Keeps what `block` (being copied into slot s) was registered with on the
  // device, when the prefix cache keeps it.
  void remember_origin(SlotId s, BlockId block) noexcept {
    SlotOrigin& o = host.origins[s];
    o = SlotOrigin{};
    std::optional<BlockOrigin> from;
    try {
      from = prefix->block_origin(block);
    } catch (...) {  // out of range: cannot happen for a block the tier holds
    }
    if (!from) return;
    o.has_parent = from->parent.has_value();
    o.parent = from->parent.value_or(BlockHash{});
    o.extra_key = from->extra_key;
    o.has_tokens = from->tokens.size() == host.block_size;
    if (o.has_tokens)
      std::copy(from->tokens.begin(), from->tokens.end(), host.tokens_of(s).begin());
  }

  // Tokens per block, as the tier's (and its lower tier's) events say.
  std::uint32_t event_block_size() const noexcept {
    return static_cast<std::uint32_t>(host.block_size);
  }

  void announce(CacheEventSink& to, SlotId s) const noexcept {
    const BlockOrigin origin = host.origin_of(s);
    to.stored(source, stored_view({&host.hashes[s], 1}, event_block_size(), &origin));
  }

  // Frees a filling, ready or quarantined slot (HostSlots::free). A ready
  // slot was announced: its removal is.
  void free_slot(SlotId s) noexcept {
    if (host.free(s) && sink != nullptr) sink->removed(source, {&host.hashes[s], 1});
  }

  // A slot for a new block under `hash`, marked filling (HostSlots::acquire):
  // an evicted ready block's removal is announced and counted. nullopt when
  // every slot is filling or pinned.
  std::optional<SlotId> acquire_slot(const BlockHash& hash) {
    const HostSlots::Acquired got = host.acquire(hash);
    if (got.evicted) {
      if (sink != nullptr) sink->removed(source, {&*got.evicted, 1});
      ++counters.host_evictions;
    }
    if (got.slot == kNoSlot) return std::nullopt;
    return got.slot;
  }

  // ---- lower tier --------------------------------------------------------------------

  // Frees host slots until `n` are free (or no ready slot is left unpinned),
  // offering the least recently used ready blocks to the lower tier first, as
  // one batch; returns how many it freed. Without a lower tier nothing:
  // acquire_slot drops them then.
  std::size_t spill(std::size_t n) noexcept {
    if (lower_link.store() == nullptr || host.free_slots.size() >= n) return 0;
    const std::span<const SlotId> offered =
        lower_link.offer(host, n - host.free_slots.size(), counters);
    for (SlotId id : offered) {
      free_slot(id);
      ++counters.host_evictions;
    }
    return offered.size();
  }

  // A lookup's run ends with `landed` blocks past the device's match: its
  // hits (the device's and those) count for the lower tier's admission,
  // whatever the outcome. Unpins what is left of the run.
  void end_run(std::size_t landed) noexcept {
    for (SlotId h : run_hits)
      if (h != kNoSlot && host.slots[h].pins > 0) --host.slots[h].pins;
    run_hits.clear();
    lower_link.note_hits(run_hashes.first(std::min(run_hashes.size(), run_start + landed)));
    run_hashes = {};
  }

  // A lookup's run past the device's prefix, into `hits` (host slots, each
  // pinned): host blocks as they are found and, with a lower tier, its
  // blocks, read into host slots as one batch (they become host blocks). The
  // run ends at the first hash neither holds, at a hash named twice, and at
  // the first lower-tier block that could not be read (fail closed).
  // Returns how many of the hits came from the lower tier. May throw
  // (bad_alloc) before the read; the caller unpins `hits` then.
  std::size_t find_hits(std::span<const BlockHash> run, const BlockHash* before,
                        std::vector<SlotId>& hits) {
    lower_link.begin_run();
    for (const BlockHash& h : run) {
      if (auto it = host.index.find(h); it != host.index.end()) {
        Slot& slot = host.slots[it->second];
        if (slot.state != SlotState::ready || slot.pins != 0) break;
        ++slot.pins;
        hits.push_back(it->second);
        continue;
      }
      if (!lower_link.find(h, hits.size())) break;
      hits.push_back(kNoSlot);
    }
    const std::span<const BlockHash> below = lower_link.run_hashes();
    const std::span<const std::size_t> at = lower_link.run_positions();
    if (below.empty()) return 0;
    lower_link.prepare_reads();  // may throw: nothing changed yet
    // Nothing below throws. Room on the host first (the blocks about to be
    // read are the store's most recent: the spill evicts others there).
    counters.lookup_spills += spill(below.size());
    for (std::size_t n = 0; n < below.size(); ++n) {
      // A hash named twice (a caller's span, not a chain) is in the index
      // since its first slot was taken: the run ends there.
      if (host.index.contains(below[n])) break;
      const std::optional<SlotId> id = acquire_slot(below[n]);
      if (!id) break;  // every other slot is pinned by this lookup
      hits[at[n]] = *id;
      lower_link.read_into({host.slot_ptr(*id), host.slot_bytes});
    }
    const std::size_t got = lower_link.read(counters);  // one batch, straight into the slots
    for (std::size_t k = 0; k < below.size(); ++k) {
      const SlotId id = hits[at[k]];
      if (k >= got) {
        if (id != kNoSlot) free_slot(id);  // filling: never announced
        hits[at[k]] = kNoSlot;
        continue;
      }
      // On the host from now on: its parent is the block before it in the
      // chain; its tokens and extra key were not kept below.
      SlotOrigin& o = host.origins[id];
      o = SlotOrigin{};
      const BlockHash* parent = at[k] > 0 ? &run[at[k] - 1] : before;
      o.has_parent = parent != nullptr;
      if (parent != nullptr) o.parent = *parent;
      host.mark_ready(id);
      host.slots[id].pins = 1;
      if (sink != nullptr) announce(*sink, id);
    }
    if (options.inclusion == TierInclusion::exclusive) lower_link.erase_read(got);
    if (got < below.size()) {  // the run ends at the first block not read
      const std::size_t end = at[got];
      for (std::size_t i = end; i < hits.size(); ++i)
        if (hits[i] != kNoSlot) --host.slots[hits[i]].pins;
      hits.resize(end);
    }
    return got;
  }

  // ---- copies ------------------------------------------------------------------------
  // Queues one batch (device -> host for write-backs), ordered after the
  // compute stream's work so far, and records the batch's end (CopyEngine::queue). When it
  // throws, no copy of the batch is still running: the caller may roll the
  // batch back (free its slots and blocks).
  void queue_copies(std::span<const Transfer> batch, HostCopyDirection direction) {
    regions.clear();
    for (const Transfer& t : batch)
      append_block_regions(*kv, t.block, host.slot_ptr(t.slot), regions);
    copies.queue(regions, direction, [&](const Error& e) {
      log_error_nothrow("HostTier: a copy failed; rolling back {} block(s) in flight: {}",
                        in_flight.size(), e.what());
      finish_in_flight(false);
    });
  }

  // Completes (ok) or rolls back (!ok) every write-back and write-through in
  // flight: slots published or freed, device blocks given back.
  void finish_in_flight(bool ok) {
    if (!ok) {
      abort_offloads(in_flight);
      in_flight.clear();
      return;
    }
    for (const Transfer& t : in_flight) {
      host.mark_ready(t.slot);
      if (sink != nullptr) announce(*sink, t.slot);  // visible from now on
      ++counters.offloads;
      counters.offload_bytes += host.slot_bytes;
      release_block(t.block);
    }
    in_flight.clear();
  }

  // Rolls back write-backs / write-throughs that failed, counted as one
  // aborted transfer: their filling slots are freed and their device blocks
  // given back (evicted, not on the host; a write-through stays cached).
  void abort_offloads(std::span<const Transfer> batch) {
    if (batch.empty()) return;
    ++counters.aborted_transfers;
    counters.aborted_blocks += batch.size();
    for (const Transfer& t : batch) {
      free_slot(t.slot);
      release_block(t.block);
    }
  }

  // Gives back the tier's reference on a device block (an uncached
  // write-back is freed; a cached write-through may become evictable).
  void release_block(BlockId block) noexcept {
    try {
      prefix->release(block);
    } catch (const std::exception& e) {  // out of range cannot happen; logging failed
      log_error_nothrow("HostTier: giving back block {} failed: {}", block, e.what());
    }
  }

  // Synchronizes the tier's stream and completes everything in flight:
  // failed (everything in flight rolled back) when the stream reported an
  // error; stalled when the copies did not complete by the deadline (they
  // and `reads`, an onload's copies, are abandoned into quarantine).
  WaitResult wait_all(std::span<const Transfer> reads = {}) {
    if (in_flight.empty() && reads.empty()) return WaitResult::done;
    if (!copies.wait_until_done()) {
      abandon(reads);
      return WaitResult::stalled;
    }
    bool ok = true;
    try {
      copies.synchronize();
    } catch (const Error& e) {
      ok = false;
      log_error_nothrow("HostTier: a copy failed; rolling back {} block(s) in flight: {}",
                        in_flight.size() + reads.size(), e.what());
    }
    finish_in_flight(ok);
    return ok ? WaitResult::done : WaitResult::failed;
  }

  // The copies in flight (and `reads`) missed their deadline: they move into
  // quarantine with the stream and event they were queued with, and the tier
  // goes on with a new stream. When no new stream can be made, it waits for
  // the old one instead (nothing is abandoned).
  void abandon(std::span<const Transfer> reads) {
    const std::size_t blocks = in_flight.size() + reads.size();
    try {
      HeldCopies held;
      held.writes.assign(in_flight.begin(), in_flight.end());
      held.reads.assign(reads.begin(), reads.end());
      copies.quarantine(std::move(held));
    } catch (const std::exception& e) {
      log_error_nothrow(
          "HostTier: copies missed their deadline and no new stream could be made ({}); waiting",
          e.what());
      bool ok = true;
      try {
        copies.synchronize();
      } catch (const Error&) {
        ok = false;
      }
      finish_in_flight(ok);
      return;
    }
    ++counters.stalled_transfers;
    counters.stalled_blocks += blocks;
    log_error_nothrow(
        "HostTier: {} block copies missed the {} ms deadline; quarantined until they end", blocks,
        options.copy_timeout.count());
    for (const Transfer& t : in_flight)
      host.quarantine(t.slot);
    quarantined_blocks += blocks;
    in_flight.clear();
  }

  // Gives back what quarantined copies held once their event completed (or
  // every quarantine, waiting, when `wait`).
  void release_quarantine(bool wait) noexcept {
    copies.release_quarantine(wait, [&](const HeldCopies& q) noexcept {
      for (const Transfer& t : q.writes) {  // the contents are not trusted
        free_slot(t.slot);
        release_block(t.block);
      }
      for (const Transfer& t : q.reads) {
        if (host.slots[t.slot].pins > 0) --host.slots[t.slot].pins;
        release_block(t.block);  // uncached: freed
      }
      quarantined_blocks -= q.writes.size() + q.reads.size();
    });
  }

  // Completes what finished, without waiting.
  void reap() {
    if (!copies.quarantined().empty()) release_quarantine(false);
    if (in_flight.empty()) return;
    if (copies.ended()) wait_all();
  }

  // Queues the copies of `batch` (device -> host) and moves them in flight;
  // on a throw rolls the batch back and counts it.
  void start_offload(std::vector<Transfer>& batch) {
    if (batch.empty()) return;
    try {
      queue_copies(batch, HostCopyDirection::device_to_host);
    } catch (const std::exception& e) {
      log_error_nothrow("HostTier: queueing the write-back of {} block(s) failed: {}", batch.size(),
                        e.what());
      abort_offloads(batch);
      batch.clear();
      return;
    }
    in_flight.insert(in_flight.end(), batch.begin(), batch.end());
    batch.clear();
  }

  // Takes a host slot for `block` (held by the tier) under `hash`, or gives
  // the block back when the host has it already or has no slot.
  void stage(BlockId block, const BlockHash& hash, std::vector<Transfer>& batch) {
    if (auto it = host.index.find(hash); it != host.index.end()) {
      if (host.slots[it->second].state == SlotState::ready) host.touch(it->second);
      ++counters.already_on_host;
      release_block(block);
      return;
    }
    const std::optional<SlotId> slot = acquire_slot(hash);
    if (!slot) {
      ++counters.dropped_offloads;
      release_block(block);
      return;
    }
    remember_origin(*slot, block);
    batch.push_back({block, *slot});
  }

  // Evicts up to `n` LRU device blocks and queues their write-back.
  std::size_t write_back(std::size_t n) {
    victims.clear();
    // More victims than host slots would only be dropped uncopied.
    const std::size_t detached = prefix->detach_lru(std::min(n, host.slots.size()), victims);
    if (lower_link.store() != nullptr) {
      std::size_t need = 0;
      for (const auto& [block, hash] : victims)
        need += host.index.contains(hash) ? 0 : 1;
      spill(need);
    }
    staged.clear();
    for (const auto& [block, hash] : victims)
      stage(block, hash, staged);
    start_offload(staged);
    return detached;
  }

  // Gives the tier's reference on each queued write-through block that no
  // sequence holds (refcount 2: the cache's and the tier's) back: the block
  // becomes evictable, uncopied. The others stay queued.
  void release_unheld_writes() {
    std::size_t kept = 0;
    for (std::size_t i = 0; i < write_queue.size(); ++i) {
      const BlockId block = write_queue[i].first;
      if (kv->ref_count(block) == 2) {
        release_block(block);
      } else {
        write_queue[kept++] = write_queue[i];
      }
    }
    write_queue.resize(kept);
  }

  // Queues the write-through copies of the blocks registered since the last
  // call.
  void flush_writes() {
    if (write_queue.empty()) return;
    spill(write_queue.size());
    staged.clear();
    for (const auto& [block, hash] : write_queue)
      stage(block, hash, staged);
    write_queue.clear();
    start_offload(staged);
  }

  PrefixCache* prefix;
  PagedKvCache* kv;
  Backend* backend;
  HostTierOptions options;
  StreamView compute_stream;
  HostSlots host;  // the slot store (host_slots.hpp)
  CacheEventSink* sink = nullptr;
  EventSource source{Medium::cpu, std::nullopt, std::nullopt, std::nullopt};
  std::size_t quarantined_blocks = 0;  // device blocks quarantined copies hold
  CopyEngine<HeldCopies> copies;       // the tier's stream, deadline and quarantine
  std::vector<Transfer> in_flight;     // write-backs and write-throughs queued, not completed
  std::vector<std::pair<BlockId, BlockHash>> write_queue;  // write-through, not queued yet
  // A lookup's run (find_run .. finish_run): its host slots, pinned; how
  // many came from the lower tier; the copies into the prefix cache's
  // blocks; the lookup's hashes and where the device's match ended.
  std::vector<SlotId> run_hits;
  std::size_t run_from_lower = 0;
  std::vector<Transfer> run_onload;
  std::span<const BlockHash> run_hashes;
  std::size_t run_start = 0;
  HostTierCounters counters;
  // The lower-tier link (lower_link.hpp) and the source its store announces
  // its own blocks as (the tier's source with medium DISK).
  LowerLink lower_link{host.size()};
  EventSource lower_source{Medium::disk, std::nullopt, std::nullopt, std::nullopt};
  // Scratch, kept to avoid allocating per call.
  std::vector<std::pair<BlockId, BlockHash>> victims;
  std::vector<Transfer> staged;
  std::vector<HostCopyRegion> regions;
};

// ---- construction ---------------------------------------------------------------------------

namespace {

void validate(const PrefixCache& prefix, const HostTierOptions& o) {
  if (o.num_host_blocks == 0 || o.num_host_blocks > HostTierOptions::kMaxHostBlocks) {
    throw InvalidArgument(fmt::format("HostTier: num_host_blocks must be in [1, {}], got {}",
                                      HostTierOptions::kMaxHostBlocks, o.num_host_blocks));
  }
  if (o.copy_timeout.count() < 0 || o.copy_timeout > HostTierOptions::kMaxCopyTimeout) {
    throw InvalidArgument(fmt::format("HostTier: copy_timeout must be in [0, {}] ms, got {} ms",
                                      HostTierOptions::kMaxCopyTimeout.count(),
                                      o.copy_timeout.count()));
  }
  if (o.offload_batch == 0 || o.offload_batch > HostTierOptions::kMaxOffloadBatch) {
    throw InvalidArgument(fmt::format("HostTier: offload_batch must be in [1, {}], got {}",
                                      HostTierOptions::kMaxOffloadBatch, o.offload_batch));
  }
  if (o.host_free_watermark > o.num_host_blocks / 2) {
    throw InvalidArgument(fmt::format(
        "HostTier: host_free_watermark must be at most num_host_blocks / 2 ({}), got {}",
        o.num_host_blocks / 2, o.host_free_watermark));
  }
  if (to_string(o.policy) == std::string_view("unknown") ||
      to_string(o.inclusion) == std::string_view("unknown")) {
    throw InvalidArgument("HostTier: unknown policy or inclusion");
  }
  if (prefix.tier() != nullptr) {
    throw InvalidArgument("HostTier: the prefix cache already has a tier");
  }
  const std::size_t slot = std::max<std::size_t>(HostTier::slot_bytes_for(prefix.kv_cache()), 1);
  const std::size_t memory = host_physical_memory();  // 0: unknown, not checked
  if (memory != 0 && o.num_host_blocks > memory / slot) {
    throw InvalidArgument(
        fmt::format("HostTier: {} host blocks of {} need more memory than this machine has ({})",
                    o.num_host_blocks, format_bytes(slot), format_bytes(memory)));
  }
}

}  // namespace

HostTier::HostTier(PrefixCache& prefix_cache, const HostTierOptions& options,
                   StreamView compute_stream) {
  validate(prefix_cache, options);
  state_ = std::make_unique<State>(prefix_cache, options, compute_stream);
  prefix_cache.set_tier(this);
}

HostTier::HostTier(PrefixCache& prefix_cache, const HostTierOptions& options)
    : HostTier(prefix_cache, options, prefix_cache.kv_cache().backend().default_stream()) {}

HostTier::~HostTier() {
  State& s = *state_;
  s.prefix->set_tier(nullptr);
  // No deadline here: the memory cannot be freed while a copy may write it.
  s.options.copy_timeout = std::chrono::milliseconds(0);
  s.wait_all();
  s.release_quarantine(true);
  for (const auto& [block, hash] : s.write_queue)
    s.release_block(block);
  s.write_queue.clear();
  LowerTierStore* const lower = s.lower_link.store();
  if (lower != nullptr) lower->set_event_sink(nullptr, {}, 0);
  if (s.sink != nullptr) {
    s.sink->cleared(s.source);
    if (lower != nullptr) s.sink->cleared(s.lower_source);
  }
}

// ---- the tier's hooks -----------------------------------------------------------------------

void HostTier::on_free_list_empty(PrefixCache& /*cache*/, const std::source_location& /*where*/) {
  State& s = *state_;
  // Write-through blocks still queued are not copied here: this allocation
  // may be part of the step that will write their KV (a block is registered
  // when its tokens are appended, before the forward pass), so their copy
  // waits for poll(). Those no sequence holds any more are given back to the
  // LRU instead (their KV was queued before their release), and the
  // write-back below copies them if they are chosen.
  s.release_unheld_writes();
  bool waited = false;
  if (!s.in_flight.empty()) {
    waited = true;
    s.wait_all();
  }
  if (s.kv->num_free_blocks() == 0 && s.write_back(s.options.offload_batch) != 0 &&
      !s.in_flight.empty()) {
    waited = true;
    s.wait_all();
  }
  if (waited) ++s.counters.offload_waits;
}

std::size_t HostTier::reclaimable_blocks() const noexcept {
  // A held block becomes free (a write-back: uncached) or evictable (a
  // write-through no sequence holds any more: the cache's reference and the
  // tier's) once its copy completed.
  const State& s = *state_;
  std::size_t n = 0;
  auto count = [&](BlockId block) {
    if (!s.prefix->is_cached(block) || s.kv->ref_count(block) == 2) ++n;
  };
  for (const Transfer& t : s.in_flight)
    count(t.block);
  for (const auto& [block, hash] : s.write_queue)
    count(block);
  return n;
}

void HostTier::on_insert(PrefixCache& /*cache*/, BlockId block, const BlockHash& hash) {
  State& s = *state_;
  if (s.options.policy != TierPolicy::write_through) return;
  if (s.host.index.contains(hash)) return;
  // The queue has room for every device block (reserved at construction): a
  // queued block is held, so it is never evicted and registered again.
  if (s.write_queue.size() == s.write_queue.capacity()) return;
  try {
    s.kv->inc_ref(block);              // held until its copy completed
  } catch (const std::exception& e) {  // a refcount at its limit: not written through
    log_error_nothrow("HostTier: write-through of block {} skipped: {}", block, e.what());
    return;
  }
  s.write_queue.emplace_back(block, hash);
}

// A lookup's continuation below the device, in three steps the prefix cache
// drives (PrefixCacheTier): find and pin the run, load it into the blocks
// the prefix cache allocated, let the slots go once it registered them. The
// tier calls nothing of the prefix cache on this path.
std::size_t HostTier::find_run(std::span<const BlockHash> hashes, std::size_t start) noexcept {
  State& s = *state_;
  s.run_hits.clear();
  s.run_onload.clear();
  s.run_from_lower = 0;
  s.run_hashes = hashes;
  s.run_start = start;
  try {
    // Pinned as they are found: not reused by the write-backs the prefix
    // cache's allocations may start, and a hash named twice in `hashes` (a
    // caller's span, not a chain) ends the hit instead of onloading one slot
    // twice.
    s.run_hits.reserve(hashes.size() - start);
    s.run_onload.reserve(hashes.size() - start);
    s.run_from_lower =
        s.find_hits(hashes.subspan(start), start > 0 ? &hashes[start - 1] : nullptr, s.run_hits);
  } catch (const std::exception& e) {
    log_error_nothrow("HostTier: a lookup's run past block {} failed: {}", start, e.what());
    s.end_run(0);
    return 0;
  }
  if (s.run_hits.empty()) s.end_run(0);
  return s.run_hits.size();
}

TierLoad HostTier::load_run(std::span<const BlockId> blocks) noexcept {
  State& s = *state_;
  const std::size_t found = s.run_hits.size();
  if (blocks.size() < found) s.counters.onload_shortfalls += found - blocks.size();
  // The run's slots past those being read are not read: unpinned.
  auto unpin_unread = [&] {
    for (std::size_t i = s.run_onload.size(); i < found; ++i)
      --s.host.slots[s.run_hits[i]].pins;
    s.run_hits.resize(s.run_onload.size());
  };
  // Nothing landed: the caller releases the blocks (uncached: freed, their
  // contents never seen).
  auto roll_back = [&] {
    if (!s.run_onload.empty()) {
      ++s.counters.aborted_transfers;
      s.counters.aborted_blocks += s.run_onload.size();
    }
    s.run_onload.clear();
    s.end_run(0);
    return TierLoad{};
  };
  // Reserved by find_run: the pushes do not throw.
  for (std::size_t i = 0; i < blocks.size() && i < found; ++i)
    s.run_onload.push_back({blocks[i], s.run_hits[i]});
  if (s.run_onload.empty()) return roll_back();
  try {
    s.queue_copies(s.run_onload, HostCopyDirection::host_to_device);
  } catch (const std::exception& e) {
    log_error_nothrow("HostTier: onload of {} block(s) failed: {}", s.run_onload.size(), e.what());
    return roll_back();
  }
  // The caller computes on these blocks next: wait for the copy. A failure
  // rolls back this onload and everything else in flight; a copy that misses
  // its deadline leaves its blocks and slots in quarantine (the device may
  // still write them), and the lookup keeps its device hit.
  const WaitResult waited = s.wait_all(s.run_onload);
  if (waited == WaitResult::stalled) {
    // The quarantine holds the blocks (their references are the tier's now)
    // and the slots they read.
    const TierLoad kept{0, s.run_onload.size()};
    unpin_unread();
    s.run_hits.clear();  // the quarantined reads keep their pins
    s.run_onload.clear();
    s.end_run(0);
    return kept;
  }
  if (waited == WaitResult::failed) return roll_back();
  // Landed: the references go back to the caller. The slots not loaded are
  // let go; the loaded ones stay pinned until finish_run (run_origin reads them).
  unpin_unread();
  return TierLoad{s.run_onload.size(), 0};
}

BlockOrigin HostTier::run_origin(std::size_t i) const noexcept {
  const State& s = *state_;
  return s.host.origin_of(s.run_onload[i].slot);
}

void HostTier::finish_run() noexcept {
  State& s = *state_;
  const std::size_t landed = s.run_onload.size();
  for (const Transfer& t : s.run_onload) {
    --s.host.slots[t.slot].pins;
    if (s.options.inclusion == TierInclusion::exclusive) {
      s.free_slot(t.slot);
    } else {
      s.host.touch(t.slot);
    }
  }
  // The hits from the lower tier among those onloaded (the first ones of
  // the run: the rest stay on the host).
  std::size_t lower_onloaded = 0;
  for (std::size_t k = 0; k < s.run_from_lower && s.lower_link.run_positions()[k] < landed; ++k)
    ++lower_onloaded;
  s.counters.onloads += landed;
  s.counters.host_hits += landed - lower_onloaded;
  s.counters.lower_tier_hits += lower_onloaded;
  s.counters.onload_bytes += landed * s.host.slot_bytes;
  s.run_hits.clear();
  s.run_onload.clear();
  s.end_run(landed);
}

// ---- public calls ---------------------------------------------------------------------------

void HostTier::poll() {
  State& s = *state_;
  s.reap();
  s.flush_writes();
  const std::size_t watermark = s.options.free_watermark;
  if (watermark != 0) {
    // Write-backs in flight become free; write-throughs stay cached.
    std::size_t have = s.kv->num_free_blocks();
    for (const Transfer& t : s.in_flight)
      if (!s.prefix->is_cached(t.block)) ++have;
    if (have < watermark) s.write_back(std::min(watermark - have, s.options.offload_batch));
  }
  const std::size_t host_watermark = s.options.host_free_watermark;
  // spill() does nothing without a lower tier or with enough slots free.
  if (host_watermark != 0 && s.host.free_slots.size() < host_watermark)
    s.counters.poll_spills += s.spill(2 * host_watermark);
}

void HostTier::synchronize() {
  state_->wait_all();
  state_->release_quarantine(false);
}

std::size_t HostTier::offload(std::size_t max_blocks) {
  return state_->write_back(max_blocks);
}

bool HostTier::is_on_host(const BlockHash& hash) const {
  const State& s = *state_;
  auto it = s.host.index.find(hash);
  return it != s.host.index.end() && s.host.slots[it->second].state == SlotState::ready;
}

bool HostTier::holds(const BlockHash& hash) const noexcept {
  // What find_run would pin: ready and no onload reading it.
  const State& s = *state_;
  auto it = s.host.index.find(hash);
  if (it != s.host.index.end()) {
    return s.host.slots[it->second].state == SlotState::ready && s.host.slots[it->second].pins == 0;
  }
  return s.lower_link.contains(hash);
}

std::size_t HostTier::num_host_blocks() const noexcept {
  return state_->host.slots.size();
}
std::size_t HostTier::num_ready_blocks() const noexcept {
  return state_->host.ready;
}
std::size_t HostTier::num_filling_blocks() const noexcept {
  return state_->host.filling;
}
std::size_t HostTier::num_free_host_blocks() const noexcept {
  return state_->host.free_slots.size();
}
std::size_t HostTier::num_held_device_blocks() const noexcept {
  return state_->in_flight.size() + state_->write_queue.size() + state_->quarantined_blocks;
}
std::size_t HostTier::num_quarantined_blocks() const noexcept {
  return state_->quarantined_blocks;
}
std::size_t HostTier::num_quarantined_slots() const noexcept {
  return state_->host.quarantined_slots;
}
std::size_t HostTier::slot_bytes() const noexcept {
  return state_->host.slot_bytes;
}
std::span<std::byte> HostTier::slot_memory() const noexcept {
  return {state_->host.memory, state_->host.slots.size() * state_->host.slot_bytes};
}
const HostTierOptions& HostTier::options() const noexcept {
  return state_->options;
}
const HostTierCounters& HostTier::counters() const noexcept {
  return state_->counters;
}
PrefixCache& HostTier::prefix_cache() const noexcept {
  return *state_->prefix;
}

// ---- lower tier -----------------------------------------------------------------------------

void HostTier::set_lower_tier(LowerTierStore* store) {
  State& s = *state_;
  if (store != nullptr && store->block_bytes() != s.host.slot_bytes) {
    throw InvalidArgument(
        fmt::format("HostTier::set_lower_tier: the store's blocks have {} bytes, host slots {}",
                    store->block_bytes(), s.host.slot_bytes));
  }
  // The store announces its own blocks to the tier's sink, as the tier's
  // source with medium DISK: what it holds already first.
  if (store != nullptr) {
    EventSource source = s.lower_source;  // the copies may throw: nothing changed
    EventSource before = store->event_source();
    CacheEventSink* const before_sink = store->event_sink();
    const std::uint32_t before_block_size = store->event_block_size();
    store->set_event_sink(s.sink, std::move(source), s.event_block_size());
    if (s.sink != nullptr) {
      try {
        store->snapshot(*s.sink);  // throws before announcing anything
      } catch (...) {
        store->set_event_sink(before_sink, std::move(before), before_block_size);
        throw;
      }
    }
  }
  LowerTierStore* const before_store = s.lower_link.store();
  if (before_store != nullptr && before_store != store)
    before_store->set_event_sink(nullptr, {}, 0);
  s.lower_link.set_store(store);
}

LowerTierStore* HostTier::lower_tier() const noexcept {
  return state_->lower_link.store();
}

// ---- events ---------------------------------------------------------------------------------

void HostTier::set_event_sink(CacheEventSink* sink, EventSource source) {
  State& s = *state_;
  if (sink != nullptr) s.prefix->keep_block_origins();
  EventSource lower_source = source;  // may throw: nothing changed
  lower_source.medium = Medium::disk;
  EventSource for_store = lower_source;
  s.sink = sink;
  s.source = std::move(source);
  s.lower_source = std::move(lower_source);
  // The store announces its own blocks, to the same sink.
  if (LowerTierStore* const lower = s.lower_link.store(); lower != nullptr)
    lower->set_event_sink(sink, std::move(for_store), s.event_block_size());
}

CacheEventSink* HostTier::event_sink() const noexcept {
  return state_->sink;
}

const EventSource& HostTier::event_source() const noexcept {
  return state_->source;
}

void HostTier::snapshot(CacheEventSink& sink) const {
  const State& s = *state_;
  std::vector<bool> seen(s.host.slots.size(), false);
  std::vector<SlotId> chain;
  for (const Slot& slot : s.host.lru) {
    const SlotId c = s.host.id_of(slot);
    if (seen[c]) continue;
    // Parents that are ready on the host first, as PrefixCache::snapshot.
    chain.clear();
    for (SlotId x = c;;) {
      seen[x] = true;
      chain.push_back(x);
      if (!s.host.origins[x].has_parent) break;
      auto it = s.host.index.find(s.host.origins[x].parent);
      if (it == s.host.index.end() || s.host.slots[it->second].state != SlotState::ready ||
          seen[it->second]) {
        break;
      }
      x = it->second;
    }
    for (auto it = chain.rbegin(); it != chain.rend(); ++it)
      s.announce(sink, *it);
  }
  // The store's own blocks, as it announces them.
  if (LowerTierStore* const lower = s.lower_link.store(); lower != nullptr) lower->snapshot(sink);
}

std::size_t HostTier::origin_bytes_per_slot() const noexcept {
  return sizeof(SlotOrigin) + state_->host.block_size * sizeof(TokenId);
}

std::vector<BlockHash> HostTier::host_lru_order() const {
  const State& s = *state_;
  std::vector<BlockHash> order;
  order.reserve(s.host.ready);
  for (const Slot& slot : s.host.lru)
    order.push_back(s.host.hashes[s.host.id_of(slot)]);
  return order;
}

// ---- regions --------------------------------------------------------------------------------

std::size_t HostTier::slot_bytes_for(const PagedKvCache& cache) {
  return cache.config().bytes_per_block();  // every layer's K and V: one slot
}

void HostTier::append_block_regions(const PagedKvCache& cache, BlockId block, std::byte* slot,
                                    std::vector<HostCopyRegion>& out) {
  // A slot is the block's image over the memory pools (block_regions.hpp).
  append_host_copy_regions(cache.memory_pools(), {&block, 1}, slot, 0, out);
}

// ---- diagnostics ----------------------------------------------------------------------------

InvariantReport HostTier::check_invariants() const {
  const State& s = *state_;
  InvariantReport report = s.prefix->check_invariants();
  std::size_t free = 0;
  std::size_t filling = 0;
  std::size_t ready = 0;
  std::size_t quarantined = 0;
  // Between calls only quarantined onloads pin slots (one pin each).
  std::vector<std::uint32_t> read_pins(s.host.slots.size(), 0);
  std::size_t quarantined_blocks = 0;
  std::size_t quarantined_writes = 0;
  for (const auto& entry : s.copies.quarantined()) {
    const HeldCopies& q = entry.payload;
    quarantined_blocks += q.writes.size() + q.reads.size();
    quarantined_writes += q.writes.size();
    for (const Transfer& t : q.reads)
      if (t.slot < read_pins.size()) ++read_pins[t.slot];
  }
  if (quarantined_blocks != s.quarantined_blocks) {
    report.add_violation(fmt::format("{} quarantined blocks counted, {} in the quarantine",
                                     s.quarantined_blocks, quarantined_blocks));
  }
  for (SlotId i = 0; i < s.host.slots.size(); ++i) {
    const Slot& slot = s.host.slots[i];
    if (slot.pins != read_pins[i]) {
      report.add_violation(
          fmt::format("host slot {} has {} pins between calls, {} from quarantined onloads", i,
                      slot.pins, read_pins[i]));
    }
    switch (slot.state) {
      case SlotState::free:
        ++free;
        break;
      case SlotState::filling:
        ++filling;
        break;
      case SlotState::ready:
        ++ready;
        break;
      case SlotState::quarantined:
        ++quarantined;
        break;
    }
    if (slot.state == SlotState::filling || slot.state == SlotState::ready) {
      auto it = s.host.index.find(s.host.hashes[i]);
      if (it == s.host.index.end() || it->second != i) {
        report.add_violation(
            fmt::format("host slot {} (hash {}) is not what the host index holds for its hash", i,
                        s.host.hashes[i].to_string()));
      }
    }
  }
  if (free + filling + ready + quarantined != s.host.slots.size() ||
      free != s.host.free_slots.size() || filling != s.host.filling || ready != s.host.ready ||
      quarantined != s.host.quarantined_slots) {
    report.add_violation(fmt::format(
        "host slots: {} free ({} listed) + {} filling ({} counted) + {} ready ({} counted) + {} "
        "quarantined ({} counted) != {}",
        free, s.host.free_slots.size(), filling, s.host.filling, ready, s.host.ready, quarantined,
        s.host.quarantined_slots, s.host.slots.size()));
  }
  std::vector<bool> listed(s.host.slots.size(), false);
  for (SlotId f : s.host.free_slots) {
    if (f >= s.host.slots.size() || s.host.slots[f].state != SlotState::free) {
      report.add_violation(fmt::format("the free slot list holds slot {}, which is not free", f));
    } else if (listed[f]) {
      report.add_violation(fmt::format("the free slot list holds slot {} twice", f));
    } else {
      listed[f] = true;
    }
  }
  if (s.prefix->tier() != this) {
    report.add_violation("the prefix cache's tier is not this HostTier");
  }
  if (s.host.index.size() != filling + ready) {
    report.add_violation(fmt::format("the host index has {} entries for {} filling + {} ready",
                                     s.host.index.size(), filling, ready));
  }
  // Walked both ways (bounded, should the links be corrupt): the same slots,
  // each ready and inside the slot array.
  std::size_t linked = 0;
  std::vector<bool> in_lru(s.host.slots.size(), false);
  for (auto it = s.host.lru.begin(); it != s.host.lru.end() && linked <= s.host.slots.size();
       ++it, ++linked) {
    const Slot* p = &*it;
    if (p < s.host.slots.data() || p >= s.host.slots.data() + s.host.slots.size()) {
      report.add_violation("the host LRU order links a slot outside the slot array");
      break;
    }
    const SlotId c = s.host.id_of(*p);
    if (p->state != SlotState::ready)
      report.add_violation(fmt::format("host slot {} is in the LRU order but not ready", c));
    if (in_lru[c]) report.add_violation(fmt::format("host slot {} is in the LRU order twice", c));
    in_lru[c] = true;
  }
  std::size_t back_linked = 0;
  for (auto it = s.host.lru.rbegin(); it != s.host.lru.rend() && back_linked <= s.host.slots.size();
       ++it) {
    const Slot* p = &*it;
    if (p < s.host.slots.data() || p >= s.host.slots.data() + s.host.slots.size() ||
        !in_lru[s.host.id_of(*p)]) {
      report.add_violation("host LRU links are inconsistent (backward walk differs)");
      break;
    }
    ++back_linked;
  }
  if (linked != ready || back_linked != linked) {
    report.add_violation(
        fmt::format("the host LRU order holds {} slots ({} walked back) for {} ready", linked,
                    back_linked, ready));
  }
  // Every filling slot is the destination of exactly one transfer in flight
  // (a filling slot with none would stay invisible forever), and every held
  // block is held once: a write-back is uncached with only the tier's
  // reference, a write-through is cached and held by the cache and the tier.
  if (s.in_flight.size() != filling) {
    report.add_violation(fmt::format("{} transfers in flight for {} filling host slots",
                                     s.in_flight.size(), filling));
  }
  std::vector<bool> slot_seen(s.host.slots.size(), false);
  std::vector<bool> block_seen(s.kv->num_blocks(), false);
  auto hold_once = [&](BlockId block) {
    if (block >= block_seen.size() || block_seen[block]) {
      report.add_violation(
          fmt::format("block {} is held by the tier twice (or out of range)", block));
      return false;
    }
    block_seen[block] = true;
    return true;
  };
  for (const Transfer& t : s.in_flight) {
    if (t.slot >= s.host.slots.size() || s.host.slots[t.slot].state != SlotState::filling ||
        slot_seen[t.slot]) {
      report.add_violation(
          fmt::format("host slot {} is in flight but not filling, or twice", t.slot));
    } else {
      slot_seen[t.slot] = true;
    }
    if (!hold_once(t.block)) continue;
    const std::uint32_t rc = s.kv->ref_count(t.block);
    if (s.prefix->is_cached(t.block) ? rc < 2 : rc != 1) {
      report.add_violation(
          fmt::format("block {} is in flight to the host with refcount {} ({}): expected {}",
                      t.block, rc, s.prefix->is_cached(t.block) ? "cached" : "uncached",
                      s.prefix->is_cached(t.block) ? ">= 2" : "1 (the tier's)"));
    }
  }
  for (const auto& [block, hash] : s.write_queue) {
    if (!hold_once(block)) continue;
    if (s.kv->ref_count(block) < 2 || s.prefix->hash_of(block) != std::optional<BlockHash>(hash)) {
      report.add_violation(fmt::format(
          "block {} waits for its write-through but is not cached under its hash and held", block));
    }
  }
  // Quarantine: every write's slot quarantined (once), every block held once
  // (a write-back's and an onload's uncached with the tier's reference only).
  for (const auto& entry : s.copies.quarantined()) {
    const HeldCopies& q = entry.payload;
    for (const Transfer& t : q.writes) {
      if (t.slot >= s.host.slots.size() || s.host.slots[t.slot].state != SlotState::quarantined ||
          slot_seen[t.slot]) {
        report.add_violation(fmt::format(
            "host slot {} is a quarantined write's but not quarantined, or twice", t.slot));
      } else {
        slot_seen[t.slot] = true;
      }
    }
    for (const auto* list : {&q.writes, &q.reads}) {
      for (const Transfer& t : *list) {
        if (!hold_once(t.block)) continue;
        const std::uint32_t rc = s.kv->ref_count(t.block);
        if (s.prefix->is_cached(t.block) ? rc < 2 : rc != 1) {
          report.add_violation(fmt::format("quarantined block {} has refcount {} ({})", t.block, rc,
                                           s.prefix->is_cached(t.block) ? "cached" : "uncached"));
        }
      }
    }
  }
  if (quarantined != quarantined_writes) {
    report.add_violation("a quarantined host slot is no quarantined write's destination");
  }
  return report;
}

}  // namespace kvport
