// SPDX-License-Identifier: Apache-2.0
// Router: picks the engine instance for a request from the blocks each
// instance holds (RouterIndex) and the load each reports, under a pluggable
// Policy: prefix-aware (llm-d's longest-prefix score with Dynamo's cost),
// round-robin, least-loaded.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <optional>
#include <span>
#include <string_view>
#include <vector>

#include "kvport/core/block_hash.hpp"
#include "kvport/router/router_index.hpp"

namespace kvport::router {

/// How a prefix is scored and weighed against load. Checked by Router's
/// constructor (InvalidArgument).
struct ScoringOptions {
  /// Per block of the longest prefix an instance holds, the weight of the
  /// best tier it holds the block in (llm-d: GPU 1.0, CPU 0.8: a CPU hit
  /// still costs the copy back). Each in [0, 1], gpu >= cpu >= other.
  double gpu_weight = 1.0;
  double cpu_weight = 0.8;
  double other_weight = 0.5;
  /// Dynamo's overlap_score_weight: cost = overlap_weight * blocks to prefill
  /// + blocks in use. >= 0 (0: load alone).
  double overlap_weight = 1.0;
};

/// What an instance reports about its load (Router::set_load).
struct InstanceLoad {
  std::uint32_t running_requests = 0;
  /// KV blocks its running requests hold (Dynamo's decode blocks).
  std::uint64_t blocks_in_use = 0;
};

/// One instance's score for one request.
struct InstanceScore {
  InstanceId id = 0;
  /// Active in the index (not dropped by expire): the policy may pick it.
  bool candidate = false;
  /// Its events carry another block size than the router's: its prefix is
  /// unknown (0 here), and Decision::block_size_mismatch is set.
  bool block_size_mismatch = false;
  /// The longest prefix of the request's full blocks it holds (any tier),
  /// and how many of those blocks are held on the GPU (others: CPU, other).
  std::uint32_t matched_blocks = 0;
  std::uint32_t gpu_blocks = 0;
  std::uint32_t cpu_blocks = 0;
  std::uint32_t other_blocks = 0;
  /// sum over the matched blocks of the weight of their best tier.
  double prefix_score = 0;
  /// The request's blocks (ceil(tokens / block_size)) minus prefix_score.
  double prefill_blocks = 0;
  /// overlap_weight * prefill_blocks + load.blocks_in_use (lower is better).
  double cost = 0;
  InstanceLoad load;
};

/// The outcome of Router::decide.
struct Decision {
  /// The instance chosen; nullopt when no instance is a candidate.
  std::optional<InstanceId> instance;
  /// One per followed instance, by increasing id.
  std::vector<InstanceScore> scores;
  /// Full blocks of the request (hashed and looked up).
  std::uint32_t request_blocks = 0;
  /// Some followed instance publishes another block size than the router
  /// hashes with: its prefix hits are not seen (RouterIndex flags it).
  bool block_size_mismatch = false;
};

/// A routing policy: picks one of the candidates among scores.
class Policy {
 public:
  virtual ~Policy() = default;
  /// "prefix_aware", "round_robin", "least_loaded", or the policy's own.
  virtual std::string_view name() const noexcept = 0;
  /// The index into `scores` of the instance to route to; called with at
  /// least one candidate, must return a candidate's index.
  virtual std::size_t choose(std::span<const InstanceScore> scores) = 0;
};

/// The lowest cost; ties go to fewer running requests, then fewer blocks in
/// use, then the lower id.
std::unique_ptr<Policy> make_prefix_aware_policy();
/// The candidates in turn, by id.
std::unique_ptr<Policy> make_round_robin_policy();
/// Fewest running requests; ties to fewer blocks in use, then the lower id.
std::unique_ptr<Policy> make_least_loaded_policy();
/// One of the three by name(). Throws InvalidArgument for another name.
std::unique_ptr<Policy> make_policy(std::string_view name);

/// A request to route: its tokens and the extra key its blocks are hashed
/// under (a LoRA adapter's; 0 for none), as the instances hash them.
struct Request {
  std::span<const TokenId> tokens;
  std::uint64_t extra_key = 0;
  /// The chained hashes of the tokens' full blocks (hash_full_blocks with
  /// the index's block_size and extra_key), when the caller has them: the
  /// router then hashes nothing, and the engine can take the same hashes
  /// (PrefixCache::lookup_hashes), so a prompt is hashed once. Empty: the
  /// router hashes the tokens. Must have tokens.size() / block_size entries.
  std::span<const BlockHash> block_hashes{};
};

/// The index, the instances' loads and a policy. Not thread-safe.
class Router {
 public:
  /// Throws InvalidArgument for bad options (RouterIndex's, or weights out of
  /// range) or a null policy.
  Router(IndexOptions index_options, ScoringOptions scoring, std::unique_ptr<Policy> policy);

  RouterIndex& index() noexcept { return index_; }
  const RouterIndex& index() const noexcept { return index_; }
  const ScoringOptions& scoring() const noexcept { return scoring_; }
  Policy& policy() noexcept { return *policy_; }
  /// Replaces the policy. Throws InvalidArgument for null.
  void set_policy(std::unique_ptr<Policy> policy);

  /// Records instance `id`'s load (the caller learns it from the instance or
  /// counts its own routing). Throws InvalidArgument for an unknown instance.
  void set_load(InstanceId id, std::uint32_t running_requests, std::uint64_t blocks_in_use);
  /// Throws InvalidArgument for an unknown instance.
  InstanceLoad load(InstanceId id) const;

  /// Scores every followed instance for `request` and lets the policy pick.
  /// Hashes the request's full blocks as kvport's caches do (hash_block
  /// chained, block_size of the index, low 64 bits), 16 blocks at a time,
  /// looking each up, and stops after the first block that ends every
  /// candidate's prefix: O(longest prefix held + 16) hashes and lookups,
  /// plus O(instances); with Request::block_hashes given, the lookups only.
  /// `out`'s capacity is reused: no allocation once it has grown. Throws
  /// InvalidArgument for block_hashes of the wrong length.
  void decide(const Request& request, Decision& out);
  Decision decide(const Request& request);

 private:
  RouterIndex index_;
  ScoringOptions scoring_;
  std::unique_ptr<Policy> policy_;
  std::array<InstanceLoad, kMaxInstances> loads_{};
};

}  // namespace kvport::router
