// SPDX-License-Identifier: Apache-2.0
#include "kvport/router/router_index.hpp"

#include <absl/container/flat_hash_map.h>

#include <algorithm>
#include <bit>
#include <cmath>
#include <limits>
#include <map>
#include <string>
#include <type_traits>

#include "kvport/platform/error.hpp"

namespace kvport::router {

Tier tier_of_medium(std::string_view medium) noexcept {
  if (medium == "GPU") return Tier::gpu;
  if (medium == "CPU") return Tier::cpu;
  return Tier::other;
}

namespace {

constexpr std::uint8_t kAllTiers = 0b111;
constexpr std::size_t kTsWindow = 64;
// How many blocks ahead an event's table slots are prefetched: the table is
// larger than the caches, so each lookup is a miss worth overlapping.
constexpr std::size_t kPrefetchAhead = 8;

std::array<double, kTsWindow> unknown_ts() noexcept {
  std::array<double, kTsWindow> a;
  a.fill(std::numeric_limits<double>::quiet_NaN());
  return a;
}

std::uint64_t bit(InstanceId id) noexcept {
  return std::uint64_t{1} << id;
}

struct Instance {
  bool added = false;
  bool active = true;
  std::optional<std::uint64_t> last;
  // The ts of the seq 0 batch applied (restart detection when last == 0).
  std::optional<double> first_ts;
  // The ts of the last kTsWindow batches applied, by seq % kTsWindow (NaN:
  // unknown): a "duplicate" with another ts is a restarted stream whose
  // seq 0 was lost.
  std::array<double, kTsWindow> recent_ts = unknown_ts();
  // The ts of the last batch applied (NaN: unknown, after a snapshot).
  double last_ts = std::numeric_limits<double>::quiet_NaN();
  Need need;
  std::map<std::uint64_t, EventBatch> held;
  std::array<std::size_t, kNumTiers> blocks{};
  std::optional<std::uint32_t> mismatched_block_size;
  // The scored group learned from this instance's stores (options without
  // scored_group).
  std::optional<std::uint32_t> learned_group;
  Clock::time_point last_heard{};
};

}  // namespace

struct RouterIndex::State {
  IndexOptions options;
  absl::flat_hash_map<std::uint64_t, BlockHolders> table;
  std::array<Instance, kMaxInstances> instances{};
  std::uint64_t mask = 0;
  IndexCounters counters;

  Instance& get(InstanceId id, const char* what) {
    if (id >= kMaxInstances || !instances[id].added) {
      throw InvalidArgument(std::string("RouterIndex::") + what + ": unknown instance " +
                            std::to_string(id));
    }
    return instances[id];
  }
  const Instance& get(InstanceId id, const char* what) const {
    return const_cast<State*>(this)->get(id, what);
  }

  void add_block(InstanceId id, Instance& inst, std::uint64_t hash, Tier tier) {
    const auto t = static_cast<std::size_t>(tier);
    std::uint64_t& set = table[hash].tiers[t];
    if ((set & bit(id)) != 0) {
      ++counters.redundant_stores;
      return;
    }
    set |= bit(id);
    ++inst.blocks[t];
    ++counters.blocks_stored;
  }

  void remove_block(InstanceId id, Instance& inst, std::uint64_t hash, Tier tier) {
    const auto t = static_cast<std::size_t>(tier);
    auto it = table.find(hash);
    if (it == table.end() || (it->second.tiers[t] & bit(id)) == 0) {
      ++counters.unknown_removals;
      return;
    }
    it->second.tiers[t] &= ~bit(id);
    --inst.blocks[t];
    ++counters.blocks_removed;
    if (it->second.any() == 0) table.erase(it);
  }

  // Drops instance `id`'s entries in the tiers of `tiers` (bit per tier).
  void clear_instance(InstanceId id, Instance& inst, std::uint8_t tiers) {
    bool any = false;
    for (std::size_t t = 0; t < kNumTiers; ++t)
      any = any || (((tiers >> t) & 1u) != 0 && inst.blocks[t] != 0);
    if (!any) return;
    const std::uint64_t keep = ~bit(id);
    for (auto it = table.begin(); it != table.end();) {
      BlockHolders& h = it->second;
      for (std::size_t t = 0; t < kNumTiers; ++t) {
        if (((tiers >> t) & 1u) != 0) h.tiers[t] &= keep;
      }
      if (h.any() == 0) {
        table.erase(it++);
      } else {
        ++it;
      }
    }
    for (std::size_t t = 0; t < kNumTiers; ++t) {
      if (((tiers >> t) & 1u) != 0) inst.blocks[t] = 0;
    }
  }

  // Forgets everything the instance's stream said: entries, held batches,
  // what was learned from its events.
  void reset_instance(InstanceId id, Instance& inst) {
    clear_instance(id, inst, kAllTiers);
    inst.held.clear();
    inst.last.reset();
    inst.first_ts.reset();
    inst.recent_ts = unknown_ts();
    inst.last_ts = std::numeric_limits<double>::quiet_NaN();
    inst.learned_group.reset();
    inst.mismatched_block_size.reset();
  }

  // Whether an event of group `group` (with the spec kind of a store, if
  // any) is indexed for `inst`. Learns the scored group from stores.
  bool scored(Instance& inst, std::uint32_t group, const std::optional<std::string>* kind) {
    if (options.scored_group) return group == *options.scored_group;
    if (inst.learned_group) return group == *inst.learned_group;
    if (kind == nullptr) return false;  // a removal or clear before any store of the group
    const bool full =
        kind->has_value() ? (**kind == "full_attention" || **kind == "mla_attention") : group == 0;
    if (!full) return false;
    inst.learned_group = group;
    return true;
  }

  void apply_event(InstanceId id, Instance& inst, const CacheEvent& event) {
    if (const auto* s = std::get_if<BlockStored>(&event)) {
      if (s->group_idx && !scored(inst, *s->group_idx, &s->kv_cache_spec_kind)) {
        ++counters.other_group_events;
        return;
      }
      if (s->block_size != options.block_size) {
        inst.mismatched_block_size = s->block_size;
        ++counters.block_size_mismatches;
        return;
      }
      const Tier tier = tier_of_medium(s->medium);
      const auto& hs = s->block_hashes;
      for (std::size_t k = 0; k < hs.size(); ++k) {
        if (k + kPrefetchAhead < hs.size()) table.prefetch(hs[k + kPrefetchAhead]);
        add_block(id, inst, hs[k], tier);
      }
    } else if (const auto* r = std::get_if<BlockRemoved>(&event)) {
      if (r->group_idx && !scored(inst, *r->group_idx, nullptr)) {
        ++counters.other_group_events;
        return;
      }
      const Tier tier = tier_of_medium(r->medium);
      const auto& hs = r->block_hashes;
      for (std::size_t k = 0; k < hs.size(); ++k) {
        if (k + kPrefetchAhead < hs.size()) table.prefetch(hs[k + kPrefetchAhead]);
        remove_block(id, inst, hs[k], tier);
      }
    } else {
      const auto& c = std::get<AllBlocksCleared>(event);
      if (c.group_idx && !scored(inst, *c.group_idx, nullptr)) {
        ++counters.other_group_events;
        return;
      }
      ++counters.clears;
      const std::uint8_t tiers =
          c.medium
              ? static_cast<std::uint8_t>(1u << static_cast<unsigned>(tier_of_medium(*c.medium)))
              : kAllTiers;
      clear_instance(id, inst, tiers);
    }
  }

  void apply_in_sequence(InstanceId id, Instance& inst, const EventBatch& batch) {
    for (const CacheEvent& e : batch.events)
      apply_event(id, inst, e);
    if (batch.seq == 0) inst.first_ts = batch.ts;
    inst.recent_ts[batch.seq % kTsWindow] = batch.ts;
    inst.last_ts = batch.ts;
    inst.last = batch.seq;
    ++counters.batches_applied;
  }

  void hold(Instance& inst, const EventBatch& batch) {
    if (inst.held.size() >= options.max_held_batches) {
      ++counters.held_dropped;
      return;
    }
    inst.held.emplace(batch.seq, batch);
  }

  // Applies the held batches that follow `last`, then sets the need.
  void drain(InstanceId id, Instance& inst) {
    while (!inst.held.empty()) {
      auto it = inst.held.begin();
      const std::uint64_t next = inst.last ? *inst.last + 1 : 0;
      if (it->first < next) {
        inst.held.erase(it);
      } else if (it->first == next) {
        apply_in_sequence(id, inst, it->second);
        inst.held.erase(it);
      } else {
        break;
      }
    }
    if (inst.need.kind == Need::Kind::snapshot) return;
    if (inst.held.empty()) {
      inst.need = Need{};
    } else {
      inst.need = Need{Need::Kind::replay_from, inst.last ? *inst.last + 1 : 0};
    }
  }
};

RouterIndex::RouterIndex(IndexOptions options) : state_(std::make_unique<State>()) {
  if (options.block_size == 0) throw InvalidArgument("RouterIndex: block_size must be > 0");
  if (options.max_held_batches == 0 || options.max_held_batches > 1'000'000) {
    throw InvalidArgument("RouterIndex: max_held_batches must be in [1, 1000000], got " +
                          std::to_string(options.max_held_batches));
  }
  if (options.instance_timeout <= Clock::duration::zero()) {
    throw InvalidArgument("RouterIndex: instance_timeout must be > 0");
  }
  state_->options = options;
}

RouterIndex::~RouterIndex() = default;
RouterIndex::RouterIndex(RouterIndex&&) noexcept = default;
RouterIndex& RouterIndex::operator=(RouterIndex&&) noexcept = default;

const IndexOptions& RouterIndex::options() const noexcept {
  return state_->options;
}

void RouterIndex::add_instance(InstanceId id, Clock::time_point now) {
  if (id >= kMaxInstances) {
    throw InvalidArgument("RouterIndex::add_instance: instance " + std::to_string(id) +
                          " out of range (at most " + std::to_string(kMaxInstances) + ")");
  }
  Instance& inst = state_->instances[id];
  if (inst.added) {
    throw InvalidArgument("RouterIndex::add_instance: instance " + std::to_string(id) +
                          " already added");
  }
  inst = Instance{};
  inst.added = true;
  inst.last_heard = now;
  state_->mask |= bit(id);
}

void RouterIndex::remove_instance(InstanceId id) {
  Instance& inst = state_->get(id, "remove_instance");
  state_->reset_instance(id, inst);
  inst = Instance{};
  state_->mask &= ~bit(id);
}

bool RouterIndex::has_instance(InstanceId id) const noexcept {
  return id < kMaxInstances && state_->instances[id].added;
}

std::uint64_t RouterIndex::instance_mask() const noexcept {
  return state_->mask;
}

std::uint64_t RouterIndex::active_mask() const noexcept {
  std::uint64_t m = 0;
  for (std::uint64_t rest = state_->mask; rest != 0; rest &= rest - 1) {
    const auto id = static_cast<InstanceId>(std::countr_zero(rest));
    if (state_->instances[id].active) m |= bit(id);
  }
  return m;
}

ApplyResult RouterIndex::apply(InstanceId id, const EventBatch& batch, Clock::time_point now) {
  State& s = *state_;
  Instance& inst = s.get(id, "apply");
  inst.last_heard = now;
  ApplyResult result = ApplyResult::applied;
  if (batch.seq == 0) {
    const bool restart =
        inst.last.has_value() && (*inst.last > 0 || !inst.first_ts || *inst.first_ts != batch.ts);
    if (restart || !inst.active) {
      // A new stream from its beginning: everything before it is void.
      ++s.counters.restarts;
      s.reset_instance(id, inst);
      inst.active = true;
      inst.need = Need{};
      result = ApplyResult::restarted;
    }
  }
  if (inst.need.kind == Need::Kind::snapshot) {
    if (inst.held.contains(batch.seq)) {
      ++s.counters.duplicates;
      return ApplyResult::duplicate;
    }
    s.hold(inst, batch);
    return ApplyResult::held;
  }
  const std::uint64_t expected = inst.last ? *inst.last + 1 : 0;
  if (batch.seq < expected) {
    const double seen = inst.recent_ts[batch.seq % kTsWindow];
    const bool other =
        expected - 1 - batch.seq < kTsWindow && !std::isnan(seen) && seen != batch.ts;
    // A batch's ts is its publisher's clock: a copy of an applied batch is
    // never later than the last one applied.
    const bool later = !std::isnan(inst.last_ts) && batch.ts > inst.last_ts;
    if (other || later) {
      // Not the batch applied under this seq: the stream restarted and its
      // first batches were lost. Start over from its seq 0.
      ++s.counters.restarts;
      s.reset_instance(id, inst);
      s.hold(inst, batch);
      inst.need = Need{Need::Kind::replay_from, 0};
      return ApplyResult::restarted;
    }
    ++s.counters.duplicates;
    return ApplyResult::duplicate;
  }
  if (batch.seq == expected) {
    s.apply_in_sequence(id, inst, batch);
    s.drain(id, inst);
    return result;
  }
  if (inst.held.contains(batch.seq)) {
    ++s.counters.duplicates;
    return ApplyResult::duplicate;
  }
  if (inst.need.kind == Need::Kind::nothing) ++s.counters.gaps;
  s.hold(inst, batch);
  inst.need = Need{Need::Kind::replay_from, expected};
  return ApplyResult::held;
}

void RouterIndex::apply_snapshot(InstanceId id, std::uint64_t seq,
                                 std::span<const CacheEvent> events, Clock::time_point now,
                                 std::optional<double> ts) {
  State& s = *state_;
  Instance& inst = s.get(id, "apply_snapshot");
  ++s.counters.snapshots;
  // Held batches past the snapshot follow it when they are of the stream
  // the snapshot was taken from: not earlier than it by the publisher's
  // clock. Without its ts, none is known to be: all are dropped (a replay
  // brings them back).
  auto held = std::move(inst.held);
  s.reset_instance(id, inst);
  if (ts) {
    std::erase_if(held, [&](const auto& kv) { return kv.second.ts < *ts; });
    inst.held = std::move(held);
  }
  for (const CacheEvent& e : events)
    s.apply_event(id, inst, e);
  inst.last = seq;
  if (ts) {
    inst.recent_ts[seq % kTsWindow] = *ts;
    inst.last_ts = *ts;
    if (seq == 0) inst.first_ts = *ts;
  }
  inst.active = true;
  inst.last_heard = now;
  inst.need = Need{};
  s.drain(id, inst);
}

Need RouterIndex::needs(InstanceId id) const {
  return state_->get(id, "needs").need;
}

void RouterIndex::replay_failed(InstanceId id) {
  Instance& inst = state_->get(id, "replay_failed");
  if (inst.need.kind == Need::Kind::replay_from) inst.need = Need{Need::Kind::snapshot, 0};
}

std::uint64_t RouterIndex::expire(Clock::time_point now) {
  State& s = *state_;
  std::uint64_t dropped = 0;
  for (std::uint64_t rest = s.mask; rest != 0; rest &= rest - 1) {
    const auto id = static_cast<InstanceId>(std::countr_zero(rest));
    Instance& inst = s.instances[id];
    if (!inst.active || now - inst.last_heard <= s.options.instance_timeout) continue;
    s.clear_instance(id, inst, kAllTiers);
    inst.held.clear();
    inst.learned_group.reset();
    inst.active = false;
    inst.need = Need{Need::Kind::snapshot, 0};
    ++s.counters.expired;
    dropped |= bit(id);
  }
  return dropped;
}

void RouterIndex::prefetch(std::uint64_t hash) const noexcept {
  state_->table.prefetch(hash);
}

BlockHolders RouterIndex::holders(std::uint64_t hash) const noexcept {
  const auto it = state_->table.find(hash);
  return it == state_->table.end() ? BlockHolders{} : it->second;
}

std::size_t RouterIndex::match(std::span<const std::uint64_t> hashes, std::uint64_t candidates,
                               std::vector<BlockHolders>& holders) const {
  holders.resize(hashes.size());
  const auto& table = state_->table;
  std::uint64_t alive = candidates;
  std::size_t n = 0;
  for (; n < hashes.size(); ++n) {
    const auto it = table.find(hashes[n]);
    if (it == table.end()) break;
    alive &= it->second.any();
    if (alive == 0) break;
    holders[n] = it->second;
  }
  return n;
}

InstanceStatus RouterIndex::status(InstanceId id) const {
  const Instance& inst = state_->get(id, "status");
  InstanceStatus st;
  st.id = id;
  st.active = inst.active;
  st.last_seq = inst.last;
  st.need = inst.need;
  st.held_batches = inst.held.size();
  st.blocks = inst.blocks;
  st.mismatched_block_size = inst.mismatched_block_size;
  st.last_heard = inst.last_heard;
  return st;
}

std::vector<std::pair<std::uint64_t, Tier>> RouterIndex::blocks_of(InstanceId id) const {
  (void)state_->get(id, "blocks_of");
  std::vector<std::pair<std::uint64_t, Tier>> out;
  for (const auto& [hash, h] : state_->table) {
    for (std::size_t t = 0; t < kNumTiers; ++t) {
      if ((h.tiers[t] & bit(id)) != 0) out.emplace_back(hash, static_cast<Tier>(t));
    }
  }
  std::sort(out.begin(), out.end());
  return out;
}

std::size_t RouterIndex::num_blocks() const noexcept {
  return state_->table.size();
}

const IndexCounters& RouterIndex::counters() const noexcept {
  return state_->counters;
}

}  // namespace kvport::router
