// SPDX-License-Identifier: Apache-2.0
#include "kvport/router/router.hpp"

#include <algorithm>
#include <bit>
#include <string>
#include <tuple>

#include "kvport/core/cache_events.hpp"
#include "kvport/platform/div_ceil.hpp"
#include "kvport/platform/error.hpp"

namespace kvport::router {

namespace {

class PrefixAwarePolicy final : public Policy {
 public:
  std::string_view name() const noexcept override { return "prefix_aware"; }
  std::size_t choose(std::span<const InstanceScore> scores) override {
    std::size_t best = scores.size();
    for (std::size_t i = 0; i < scores.size(); ++i) {
      const InstanceScore& s = scores[i];
      if (!s.candidate) continue;
      if (best == scores.size()) {
        best = i;
        continue;
      }
      const InstanceScore& b = scores[best];
      if (std::tie(s.cost, s.load.running_requests, s.load.blocks_in_use) <
          std::tie(b.cost, b.load.running_requests, b.load.blocks_in_use)) {
        best = i;
      }
    }
    return best;
  }
};

class RoundRobinPolicy final : public Policy {
 public:
  std::string_view name() const noexcept override { return "round_robin"; }
  std::size_t choose(std::span<const InstanceScore> scores) override {
    // The first candidate with an id at or after the cursor, else the first.
    std::size_t first = scores.size();
    for (std::size_t i = 0; i < scores.size(); ++i) {
      if (!scores[i].candidate) continue;
      if (first == scores.size()) first = i;
      if (scores[i].id >= next_) {
        next_ = scores[i].id + 1;
        return i;
      }
    }
    if (first != scores.size()) next_ = scores[first].id + 1;
    return first;
  }

 private:
  InstanceId next_ = 0;
};

class LeastLoadedPolicy final : public Policy {
 public:
  std::string_view name() const noexcept override { return "least_loaded"; }
  std::size_t choose(std::span<const InstanceScore> scores) override {
    std::size_t best = scores.size();
    for (std::size_t i = 0; i < scores.size(); ++i) {
      const InstanceScore& s = scores[i];
      if (!s.candidate) continue;
      if (best == scores.size() ||
          std::tie(s.load.running_requests, s.load.blocks_in_use) <
              std::tie(scores[best].load.running_requests, scores[best].load.blocks_in_use)) {
        best = i;
      }
    }
    return best;
  }
};

void check_weight(double w, const char* name) {
  if (!(w >= 0.0 && w <= 1.0)) {
    throw InvalidArgument(std::string("Router: ") + name + " must be in [0, 1], got " +
                          std::to_string(w));
  }
}

}  // namespace

std::unique_ptr<Policy> make_prefix_aware_policy() {
  return std::make_unique<PrefixAwarePolicy>();
}
std::unique_ptr<Policy> make_round_robin_policy() {
  return std::make_unique<RoundRobinPolicy>();
}
std::unique_ptr<Policy> make_least_loaded_policy() {
  return std::make_unique<LeastLoadedPolicy>();
}

std::unique_ptr<Policy> make_policy(std::string_view name) {
  if (name == "prefix_aware") return make_prefix_aware_policy();
  if (name == "round_robin") return make_round_robin_policy();
  if (name == "least_loaded") return make_least_loaded_policy();
  throw InvalidArgument("unknown routing policy '" + std::string(name) +
                        "' (prefix_aware, round_robin, least_loaded)");
}

Router::Router(IndexOptions index_options, ScoringOptions scoring, std::unique_ptr<Policy> policy)
    : index_(index_options), scoring_(scoring), policy_(std::move(policy)) {
  check_weight(scoring.gpu_weight, "gpu_weight");
  check_weight(scoring.cpu_weight, "cpu_weight");
  check_weight(scoring.other_weight, "other_weight");
  if (!(scoring.gpu_weight >= scoring.cpu_weight && scoring.cpu_weight >= scoring.other_weight)) {
    throw InvalidArgument("Router: weights must satisfy gpu_weight >= cpu_weight >= other_weight");
  }
  if (!(scoring.overlap_weight >= 0.0) || scoring.overlap_weight > 1e9) {
    throw InvalidArgument("Router: overlap_weight must be in [0, 1e9], got " +
                          std::to_string(scoring.overlap_weight));
  }
  if (!policy_) throw InvalidArgument("Router: null policy");
}

void Router::set_policy(std::unique_ptr<Policy> policy) {
  if (!policy) throw InvalidArgument("Router::set_policy: null policy");
  policy_ = std::move(policy);
}

void Router::set_load(InstanceId id, std::uint32_t running_requests, std::uint64_t blocks_in_use) {
  if (!index_.has_instance(id)) {
    throw InvalidArgument("Router::set_load: unknown instance " + std::to_string(id));
  }
  loads_[id] = InstanceLoad{running_requests, blocks_in_use};
}

InstanceLoad Router::load(InstanceId id) const {
  if (!index_.has_instance(id)) {
    throw InvalidArgument("Router::load: unknown instance " + std::to_string(id));
  }
  return loads_[id];
}

void Router::decide(const Request& request, Decision& out) {
  const std::size_t bs = index_.options().block_size;
  const std::size_t full = request.tokens.size() / bs;
  const bool prehashed = !request.block_hashes.empty();
  if (prehashed && request.block_hashes.size() != full) {
    throw InvalidArgument("Router::decide: " + std::to_string(request.block_hashes.size()) +
                          " block hashes for " + std::to_string(full) + " full blocks of " +
                          std::to_string(bs) + " tokens");
  }
  const std::uint64_t followed = index_.instance_mask();
  const std::uint64_t candidates = index_.active_mask();

  // Stop at the first block no candidate holds after the blocks before it:
  // the rest cannot extend any prefix, so it is never hashed (the cost is
  // the longest prefix, not the request).
  std::array<std::uint32_t, kMaxInstances> matched{};
  std::array<std::array<std::uint32_t, kNumTiers>, kMaxInstances> per_tier{};
  // In chunks: hash a chunk (each hash chains on the one before), prefetch
  // its table slots, then look them up, so that the lookups' cache misses
  // overlap. At most one chunk is hashed past the end of the prefixes.
  constexpr std::size_t kChunk = 16;
  std::array<std::uint64_t, kChunk> chunk;
  std::uint64_t alive = candidates;
  std::optional<BlockHash> parent;
  for (std::size_t start = 0; start < full && alive != 0; start += kChunk) {
    const std::size_t n = std::min(kChunk, full - start);
    for (std::size_t k = 0; k < n; ++k) {
      const std::size_t b = start + k;
      if (prehashed) {
        chunk[k] = event_hash(request.block_hashes[b]);
      } else {
        const BlockHash h =
            hash_block(parent, request.tokens.subspan(b * bs, bs), request.extra_key);
        parent = h;
        chunk[k] = event_hash(h);
      }
      index_.prefetch(chunk[k]);
    }
    for (std::size_t k = 0; k < n && alive != 0; ++k) {
      const BlockHolders holders = index_.holders(chunk[k]);
      alive &= holders.any();
      for (std::uint64_t rest = alive; rest != 0; rest &= rest - 1) {
        const int i = std::countr_zero(rest);
        const std::uint64_t bit = std::uint64_t{1} << i;
        const std::size_t tier = (holders.tiers[0] & bit) != 0   ? 0
                                 : (holders.tiers[1] & bit) != 0 ? 1
                                                                 : 2;
        ++matched[static_cast<std::size_t>(i)];
        ++per_tier[static_cast<std::size_t>(i)][tier];
      }
    }
  }

  const double request_blocks = static_cast<double>(div_ceil(request.tokens.size(), bs));
  out.instance.reset();
  out.scores.clear();
  out.request_blocks = static_cast<std::uint32_t>(full);
  out.block_size_mismatch = false;
  for (std::uint64_t rest = followed; rest != 0; rest &= rest - 1) {
    const auto id = static_cast<InstanceId>(std::countr_zero(rest));
    InstanceScore s;
    s.id = id;
    s.candidate = (candidates >> id & 1u) != 0;
    const InstanceStatus st = index_.status(id);
    s.block_size_mismatch = st.mismatched_block_size.has_value();
    out.block_size_mismatch = out.block_size_mismatch || s.block_size_mismatch;
    s.matched_blocks = matched[id];
    s.gpu_blocks = per_tier[id][0];
    s.cpu_blocks = per_tier[id][1];
    s.other_blocks = per_tier[id][2];
    s.prefix_score = scoring_.gpu_weight * s.gpu_blocks + scoring_.cpu_weight * s.cpu_blocks +
                     scoring_.other_weight * s.other_blocks;
    s.prefill_blocks = request_blocks - s.prefix_score;
    s.load = loads_[id];
    s.cost = scoring_.overlap_weight * s.prefill_blocks + static_cast<double>(s.load.blocks_in_use);
    out.scores.push_back(s);
  }
  if (candidates == 0) return;
  const std::size_t chosen = policy_->choose(out.scores);
  if (chosen >= out.scores.size() || !out.scores[chosen].candidate) {
    throw Error("Router::decide: policy '" + std::string(policy_->name()) + "' chose no candidate");
  }
  out.instance = out.scores[chosen].id;
}

Decision Router::decide(const Request& request) {
  Decision d;
  decide(request, d);
  return d;
}

}  // namespace kvport::router
