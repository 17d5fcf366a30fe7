// SPDX-License-Identifier: Apache-2.0
// The host tier's LRU: boost::intrusive::list (a member hook, normal_link)
// against the hand-written intrusive doubly linked list it replaced (prev/next
// slot ids in the slot, kept here as a bench-only copy), on the same
// operations in the same run. Three lists:
//
//   hand   the hand-written list, as host_tier.cpp had it: a 32-byte slot
//          (16-byte block hash, prev/next ids, pin count, state)
//   boost  boost::intrusive::list in the same slot: 40 bytes (the hook is two
//          pointers)
//   split  boost::intrusive::list in a 24-byte slot (hook, pins, state) with
//          the block hashes in an array of their own: what host_tier.cpp uses
//
// All slots are ready and linked in a shuffled order at the start, so that
// neighbours are scattered over the array as after a long run. The workload
// is a fixed (seeded) sequence of operations drawn before the timing, at the
// host tier's mix: 50% touch (a write-back of a block already on the host, an
// inclusive onload: to the most recently used end), 20% evict-oldest (a
// write-back into a full tier: the front slot, if unpinned, gets a new hash
// and goes to the back), 15% remove-middle (an exclusive onload frees a ready
// slot anywhere in the order) and 15% insert (a write-back completes into a
// free slot: linked at the back; a touch when no slot is free). The lists run
// the same sequence and must end in the same order (checked once per run; the
// benchmark fails otherwise).
//
// One benchmark per size: 65,536 slots (128 GiB of llama-3-8b blocks) and
// 1,048,576 (the largest realistic count, for small blocks). Each iteration
// runs 65,536 operations on each list (hand and boost alternating which goes
// first, split after them); the benchmark's time is boost's (manual time).
// Counters: *_ns_per_op; ratio (boost over hand, from the summed times of the
// same iterations); ratio_median and split_ratio_median (the median of the
// iterations' own ratios over hand: robust to an iteration preempted on a
// loaded machine); slot_bytes_*. The host tier keeps a Boost list unless it
// costs more than 1.1x the hand-written one (docs/performance.md).
#include <benchmark/benchmark.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <limits>
#include <random>
#include <vector>

#include <boost/intrusive/list.hpp>

#include "kvport/core/block_hash.hpp"

namespace {

using SlotId = std::uint32_t;
constexpr SlotId kNoSlot = std::numeric_limits<SlotId>::max();

constexpr std::size_t kOpsPerIteration = 65536;
constexpr std::size_t kIterations = 48;

enum class Op : std::uint32_t { touch, evict_oldest, remove, insert };

// An operation packed in 32 bits: the kind in the top 2, the slot below.
constexpr std::uint32_t pack(Op op, SlotId slot) {
  return (static_cast<std::uint32_t>(op) << 30) | slot;
}
constexpr Op kind_of(std::uint32_t op) {
  return static_cast<Op>(op >> 30);
}
constexpr SlotId slot_of(std::uint32_t op) {
  return op & ((1u << 30) - 1);
}

// ---- (a) the hand-written list, as host_tier.cpp had it ---------------------------------
struct HandSlot {
  kvport::BlockHash hash;
  SlotId prev = kNoSlot;
  SlotId next = kNoSlot;
  std::uint32_t pins = 0;
  std::uint8_t state = 0;
};

struct HandLru {
  explicit HandLru(std::size_t n) : slots(n) {}
  void push_back(SlotId s) {
    HandSlot& slot = slots[s];
    slot.prev = tail;
    slot.next = kNoSlot;
    if (tail != kNoSlot)
      slots[tail].next = s;
    else
      head = s;
    tail = s;
  }
  void remove(SlotId s) {
    HandSlot& slot = slots[s];
    if (slot.prev != kNoSlot)
      slots[slot.prev].next = slot.next;
    else
      head = slot.next;
    if (slot.next != kNoSlot)
      slots[slot.next].prev = slot.prev;
    else
      tail = slot.prev;
    slot.prev = slot.next = kNoSlot;
  }
  void touch(SlotId s) {
    remove(s);
    push_back(s);
  }
  // The least recently used unpinned slot, moved to the back (reused).
  void evict_oldest() {
    for (SlotId c = head; c != kNoSlot; c = slots[c].next) {
      if (slots[c].pins == 0) {
        remove(c);
        slots[c].hash.low += 1;  // its new block
        push_back(c);
        return;
      }
    }
  }
  std::vector<SlotId> order() const {
    std::vector<SlotId> out;
    for (SlotId c = head; c != kNoSlot; c = slots[c].next)
      out.push_back(c);
    return out;
  }
  std::vector<HandSlot> slots;
  SlotId head = kNoSlot;
  SlotId tail = kNoSlot;
};

// ---- (b) boost::intrusive::list, as host_tier.cpp has it --------------------------------
using LruHook =
    boost::intrusive::list_member_hook<boost::intrusive::link_mode<boost::intrusive::normal_link>>;

struct BoostSlot {
  kvport::BlockHash hash;
  LruHook lru;
  std::uint32_t pins = 0;
  std::uint8_t state = 0;
};

using BoostList =
    boost::intrusive::list<BoostSlot,
                           boost::intrusive::member_hook<BoostSlot, LruHook, &BoostSlot::lru>,
                           boost::intrusive::constant_time_size<false>>;

struct BoostLru {
  explicit BoostLru(std::size_t n) : slots(n) {}
  void push_back(SlotId s) { list.push_back(slots[s]); }
  void remove(SlotId s) { list.erase(list.iterator_to(slots[s])); }
  void touch(SlotId s) { list.splice(list.end(), list, list.iterator_to(slots[s])); }
  void evict_oldest() {
    for (auto it = list.begin(); it != list.end(); ++it) {
      if (it->pins == 0) {
        it->hash.low += 1;
        list.splice(list.end(), list, it);
        return;
      }
    }
  }
  std::vector<SlotId> order() const {
    std::vector<SlotId> out;
    for (const BoostSlot& s : list)
      out.push_back(static_cast<SlotId>(&s - slots.data()));
    return out;
  }
  std::vector<BoostSlot> slots;  // before the list: outlives it
  BoostList list;
};

// ---- (c) boost::intrusive::list, the block hash out of the slot -------------------------
// The slot keeps what the LRU and the tier's state checks read (the hook, the
// pin count, the state: 24 bytes); the hash, read when a slot is freed or
// reused, lives in an array of its own, as host_tier.cpp has it.
struct SplitSlot {
  LruHook lru;
  std::uint32_t pins = 0;
  std::uint8_t state = 0;
};

using SplitList =
    boost::intrusive::list<SplitSlot,
                           boost::intrusive::member_hook<SplitSlot, LruHook, &SplitSlot::lru>,
                           boost::intrusive::constant_time_size<false>>;

struct SplitLru {
  explicit SplitLru(std::size_t n) : slots(n), hashes(n) {}
  void push_back(SlotId s) { list.push_back(slots[s]); }
  void remove(SlotId s) { list.erase(list.iterator_to(slots[s])); }
  void touch(SlotId s) { list.splice(list.end(), list, list.iterator_to(slots[s])); }
  void evict_oldest() {
    for (auto it = list.begin(); it != list.end(); ++it) {
      if (it->pins == 0) {
        hashes[static_cast<std::size_t>(&*it - slots.data())].low += 1;
        list.splice(list.end(), list, it);
        return;
      }
    }
  }
  std::vector<SlotId> order() const {
    std::vector<SlotId> out;
    for (const SplitSlot& s : list)
      out.push_back(static_cast<SlotId>(&s - slots.data()));
    return out;
  }
  std::vector<SplitSlot> slots;  // before the list: outlives it
  std::vector<kvport::BlockHash> hashes;
  SplitList list;
};

// ---- the workload -------------------------------------------------------------------------
struct Workload {
  std::vector<SlotId> initial;     // the starting order (every slot ready)
  std::vector<std::uint32_t> ops;  // kIterations * kOpsPerIteration
};

Workload make_workload(std::size_t n) {
  Workload w;
  std::mt19937_64 rng(20261202);
  w.initial.resize(n);
  for (std::size_t i = 0; i < n; ++i)
    w.initial[i] = static_cast<SlotId>(i);
  std::shuffle(w.initial.begin(), w.initial.end(), rng);
  // Which slots are ready (linked), so that touch and remove pick a linked
  // one and insert a free one.
  std::vector<bool> ready(n, true);
  std::vector<SlotId> free;
  const std::size_t total = kIterations * kOpsPerIteration;
  w.ops.reserve(total);
  auto random_ready = [&] {
    for (;;) {
      const auto s = static_cast<SlotId>(rng() % n);
      if (ready[s]) return s;
    }
  };
  while (w.ops.size() < total) {
    const unsigned r = static_cast<unsigned>(rng() % 100);
    if (r < 50 || (r >= 85 && free.empty())) {
      w.ops.push_back(pack(Op::touch, random_ready()));
    } else if (r < 70) {
      w.ops.push_back(pack(Op::evict_oldest, 0));
    } else if (r < 85) {
      const SlotId s = random_ready();
      ready[s] = false;
      free.push_back(s);
      w.ops.push_back(pack(Op::remove, s));
    } else {
      const SlotId s = free.back();
      free.pop_back();
      ready[s] = true;
      w.ops.push_back(pack(Op::insert, s));
    }
  }
  return w;
}

template <class Lru>
void run_ops(Lru& lru, const std::uint32_t* ops, std::size_t count) {
  for (std::size_t i = 0; i < count; ++i) {
    const std::uint32_t op = ops[i];
    switch (kind_of(op)) {
      case Op::touch:
        lru.touch(slot_of(op));
        break;
      case Op::evict_oldest:
        lru.evict_oldest();
        break;
      case Op::remove:
        lru.remove(slot_of(op));
        break;
      case Op::insert:
        lru.push_back(slot_of(op));
        break;
    }
  }
}

template <class Lru>
double timed_chunk(Lru& lru, const std::uint32_t* ops) {
  const auto t0 = std::chrono::steady_clock::now();
  run_ops(lru, ops, kOpsPerIteration);
  const auto t1 = std::chrono::steady_clock::now();
  return std::chrono::duration<double>(t1 - t0).count();
}

void BM_HostLru(benchmark::State& state) {
  const auto n = static_cast<std::size_t>(state.range(0));
  const Workload w = make_workload(n);
  HandLru hand(n);
  BoostLru boost(n);
  SplitLru split(n);
  for (SlotId s : w.initial) {
    hand.push_back(s);
    boost.push_back(s);
    split.push_back(s);
  }
  double split_s = 0;
  std::vector<double> split_ratios;
  split_ratios.reserve(kIterations);
  double hand_s = 0;
  double boost_s = 0;
  std::vector<double> chunk_ratios;  // Boost over hand-written, per iteration
  chunk_ratios.reserve(kIterations);
  std::size_t chunk = 0;
  for (auto _ : state) {
    const std::uint32_t* ops = w.ops.data() + chunk * kOpsPerIteration;
    double b = 0;
    double h = 0;
    if (chunk % 2 == 0) {
      h = timed_chunk(hand, ops);
      b = timed_chunk(boost, ops);
    } else {
      b = timed_chunk(boost, ops);
      h = timed_chunk(hand, ops);
    }
    const double c = timed_chunk(split, ops);
    hand_s += h;
    boost_s += b;
    split_s += c;
    chunk_ratios.push_back(h > 0 ? b / h : 0);
    split_ratios.push_back(h > 0 ? c / h : 0);
    state.SetIterationTime(b);
    ++chunk;
  }
  if (hand.order() != boost.order() || hand.order() != split.order()) {
    state.SkipWithError("the Boost list and the hand-written list ended in different orders");
    return;
  }
  const double ops = static_cast<double>(chunk * kOpsPerIteration);
  state.counters["boost_ns_per_op"] = boost_s / ops * 1e9;
  state.counters["hand_ns_per_op"] = hand_s / ops * 1e9;
  state.counters["ratio"] = hand_s > 0 ? boost_s / hand_s : 0;
  // The median of the per-iteration ratios: robust to an iteration of one
  // list preempted on a loaded machine (the summed ratio is not).
  std::nth_element(chunk_ratios.begin(), chunk_ratios.begin() + chunk_ratios.size() / 2,
                   chunk_ratios.end());
  state.counters["ratio_median"] = chunk_ratios[chunk_ratios.size() / 2];
  std::nth_element(split_ratios.begin(), split_ratios.begin() + split_ratios.size() / 2,
                   split_ratios.end());
  state.counters["split_ns_per_op"] = split_s / ops * 1e9;
  state.counters["split_ratio_median"] = split_ratios[split_ratios.size() / 2];
  state.counters["slot_bytes_split"] = sizeof(SplitSlot);
  state.counters["slot_bytes_boost"] = sizeof(BoostSlot);
  state.counters["slot_bytes_hand"] = sizeof(HandSlot);
  state.SetItemsProcessed(static_cast<std::int64_t>(chunk * kOpsPerIteration));
}

// A fixed iteration count: the operations are drawn for exactly these.
BENCHMARK(BM_HostLru)
    ->ArgName("slots")
    ->Arg(65536)
    ->Arg(1 << 20)
    ->Iterations(kIterations)
    ->UseManualTime()
    ->Unit(benchmark::kMicrosecond);

}  // namespace
