// SPDX-License-Identifier: Apache-2.0
// The host slot store, the first room of a HostTier (core/src/host_tier.cpp):
// pinned slot memory, each slot's state, pins, block hash and origin, the
// index of hashes to slots, the LRU of ready slots and the free list. It
// copies nothing and announces nothing: the tier's other rooms (its copy
// engine with deadlines and quarantine, the lower-tier link, the write-back
// and write-through policies, the events) work over it.
#pragma once

#include <absl/container/flat_hash_map.h>

#include <boost/intrusive/list.hpp>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <optional>
#include <span>
#include <vector>

#include "kvport/core/block_hash.hpp"
#include "kvport/core/prefix_cache.hpp"
#include "kvport/platform/backend.hpp"

namespace kvport::detail {

using SlotId = std::uint32_t;
inline constexpr SlotId kNoSlot = std::numeric_limits<SlotId>::max();

// quarantined: the destination of a write-back abandoned at its deadline,
// out of the index, reused only once the copy can no longer write into it.
enum class SlotState : std::uint8_t { free, filling, ready, quarantined };

// The host LRU's hook: plain links (no safe-mode or auto-unlink resets), as
// the hand-written prev/next ids were. HostSlots::slots never reallocates, so
// the links stay valid for the store's lifetime.
using LruHook =
    boost::intrusive::list_member_hook<boost::intrusive::link_mode<boost::intrusive::normal_link>>;

// What the LRU and the state checks read, 24 bytes; the slot's block hash
// (read when the slot is freed or reused) is in HostSlots::hashes.
struct Slot {
  LruHook lru;  // linked while ready
  // Onloads reading it: inside a lookup, or abandoned at their deadline
  // (quarantined reads) until their copy can no longer run.
  std::uint32_t pins = 0;
  SlotState state = SlotState::free;
};

static_assert(sizeof(Slot) == 24, "docs/prefix-caching.md says 24 bytes a slot");

// Ready slots, least recently used first. Its size is HostSlots::ready.
using SlotLru =
    boost::intrusive::list<Slot, boost::intrusive::member_hook<Slot, LruHook, &Slot::lru>,
                           boost::intrusive::constant_time_size<false>>;

// What a slot's block was registered with on the device (its parent, tokens
// and extra key): what the tier's BlockStored announces, and what an onload
// registers the block with again. Its tokens live in HostSlots::origin_tokens.
struct SlotOrigin {
  BlockHash parent;
  std::uint64_t extra_key = 0;
  bool has_parent = false;
  bool has_tokens = false;
};

static_assert(sizeof(SlotOrigin) == 32, "host_tier.hpp and docs/events.md say 32 bytes");

struct HostSlots {
  /// A slot for a new block (acquire): the slot, and the hash of the ready
  /// block it evicted for it (announced by the tier), if any.
  struct Acquired {
    SlotId slot = kNoSlot;
    std::optional<BlockHash> evicted;
  };

  /// `num_slots` slots of `slot_bytes` pinned bytes each (Backend::alloc_host:
  /// OutOfMemory), for blocks of `block_size` tokens. Everything a call
  /// appends to is sized here, so that no call allocates (and throws halfway)
  /// once slots are taken: at most one index entry per slot, reserved 1/8
  /// above (and at least 32), as PrefixCache's: below the load at which absl
  /// grows instead of reusing tombstones.
  HostSlots(Backend& b, std::size_t num_slots, std::size_t slot_bytes_, std::size_t block_size_)
      : backend(&b),
        slot_bytes(slot_bytes_),
        block_size(block_size_),
        slots(num_slots),
        hashes(num_slots),
        origins(num_slots),
        origin_tokens(num_slots * block_size_) {
    free_slots.reserve(num_slots);
    for (std::size_t i = num_slots; i-- > 0;)
      free_slots.push_back(static_cast<SlotId>(i));
    index.reserve(std::max<std::size_t>(num_slots + num_slots / 8 + 1, 32));
    memory = static_cast<std::byte*>(backend->alloc_host(num_slots * slot_bytes));
  }
  ~HostSlots() { backend->free_host(memory); }
  HostSlots(const HostSlots&) = delete;
  HostSlots& operator=(const HostSlots&) = delete;

  std::size_t size() const noexcept { return slots.size(); }
  std::byte* slot_ptr(SlotId s) const { return memory + std::size_t{s} * slot_bytes; }

  // ---- LRU (ready slots; front = least recently used) -----------------------
  SlotId id_of(const Slot& slot) const noexcept {
    return static_cast<SlotId>(&slot - slots.data());
  }
  void lru_push_back(SlotId s) noexcept { lru.push_back(slots[s]); }
  void lru_remove(SlotId s) noexcept { lru.erase(lru.iterator_to(slots[s])); }
  void touch(SlotId s) noexcept {
    lru.splice(lru.end(), lru, lru.iterator_to(slots[s]));  // to the most recently used end
  }

  // ---- origins --------------------------------------------------------------
  std::span<TokenId> tokens_of(SlotId s) noexcept {
    return {origin_tokens.data() + std::size_t{s} * block_size, block_size};
  }
  std::span<const TokenId> tokens_of(SlotId s) const noexcept {
    return {origin_tokens.data() + std::size_t{s} * block_size, block_size};
  }
  BlockOrigin origin_of(SlotId s) const noexcept {
    const SlotOrigin& o = origins[s];
    BlockOrigin origin;
    if (o.has_parent) origin.parent = o.parent;
    if (o.has_tokens) origin.tokens = tokens_of(s);
    origin.extra_key = o.extra_key;
    return origin;
  }

  // ---- states -----------------------------------------------------------------
  /// Frees a filling, ready or quarantined slot (a quarantined one left the
  /// index at its quarantine). True when it was ready: announced, so its
  /// removal is the caller's to announce (hashes[s] still holds its hash).
  bool free(SlotId s) noexcept {
    Slot& slot = slots[s];
    const SlotState was = slot.state;
    if (was == SlotState::ready) {
      lru_remove(s);
      --ready;
    } else if (was == SlotState::filling) {
      --filling;
    } else if (was == SlotState::quarantined) {
      --quarantined_slots;
    }
    if (was == SlotState::ready || was == SlotState::filling) index.erase(hashes[s]);
    slot.state = SlotState::free;
    slot.pins = 0;
    free_slots.push_back(s);
    return was == SlotState::ready;
  }

  /// A slot for a new block under `hash`, marked filling: a free one, or the
  /// least recently used ready one no onload is reading (evicted). No slot
  /// (every one filling, quarantined or pinned): Acquired::slot is kNoSlot.
  Acquired acquire(const BlockHash& hash) {
    Acquired out;
    if (!free_slots.empty()) {
      out.slot = free_slots.back();
      free_slots.pop_back();
    } else {
      for (const Slot& c : lru) {
        if (c.pins == 0) {
          out.slot = id_of(c);
          break;
        }
      }
      if (out.slot == kNoSlot) return out;
      out.evicted = hashes[out.slot];
      free(out.slot);
      free_slots.pop_back();
    }
    index.emplace(hash, out.slot);  // never allocates (reserved), so nothing to undo
    hashes[out.slot] = hash;
    slots[out.slot].state = SlotState::filling;
    ++filling;
    return out;
  }

  /// A filling slot whose block landed: ready, most recently used.
  void mark_ready(SlotId s) noexcept {
    slots[s].state = SlotState::ready;
    --filling;
    ++ready;
    lru_push_back(s);
  }

  /// A filling slot whose copy missed its deadline: out of the index, unused
  /// until the copy can no longer write into it (free() then).
  void quarantine(SlotId s) noexcept {
    index.erase(hashes[s]);
    slots[s].state = SlotState::quarantined;
    --filling;
    ++quarantined_slots;
  }

  Backend* backend;
  std::size_t slot_bytes;
  std::size_t block_size;
  std::vector<Slot> slots;
  std::vector<BlockHash> hashes;       // per slot: its block's, while filling or ready
  std::vector<SlotOrigin> origins;     // per slot
  std::vector<TokenId> origin_tokens;  // block_size per slot
  std::vector<SlotId> free_slots;
  absl::flat_hash_map<BlockHash, SlotId, BlockHashHasher> index;  // filling and ready slots
  SlotLru lru;  // over slots, which outlive it (declared before)
  std::size_t filling = 0;
  std::size_t ready = 0;
  std::size_t quarantined_slots = 0;  // slots in SlotState::quarantined
  std::byte* memory = nullptr;
};

}  // namespace kvport::detail
