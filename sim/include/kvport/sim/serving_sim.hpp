// SPDX-License-Identifier: Apache-2.0
// A simulated LLM serving workload over a bare PagedKvCache (refcounts,
// inc_ref sharing, batched zeroing; no prefix cache): the workload behind
// `kvport demo`.
//
// It runs under the one scheduler loop of scheduler.hpp, with these choices
// (RetirePoint::after_admission, the head retried every step):
//   - arrival: 0-3 new requests per step (1 when nothing runs or waits), from
//     a seeded generator; lengths are capped so that one request always fits
//     in the cache alone (beside the pinned system prompts). The same seed
//     gives the same run.
//   - system prompts: up to `shared_prompts` prompts of 1-4 blocks (at most a
//     quarter of the cache) are allocated once and held for the whole run, as
//     a prefix cache would; a request that continues one inc_ref's its blocks
//     and allocates only its own.
//   - decode: a running request reserves the block for its next token by
//     allocating it (try_alloc_block); when the cache is exhausted the newest
//     running request is preempted (its blocks freed; it recomputes its
//     prompt plus the tokens it had generated when admitted again).
//   - admission: FIFO while its blocks are free, keeping 1% of the cache free
//     for running requests to grow unless nothing runs.
//   - zeroing: every block allocated in a step is zeroed by ONE zero_blocks
//     call after admission.
//   - completion: at the end of the step, finished requests free their table
//     (shared blocks drop back to the pinned reference).
// After every step the cache's refcounts are checked against the workload's
// own bookkeeping.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "kvport/core/paged_kv_cache.hpp"
#include "kvport/platform/stream.hpp"

namespace kvport::sim {

struct ServingSimOptions {
  std::size_t requests = 100;      ///< requests to serve (> 0)
  std::size_t max_running = 32;    ///< batch size limit (> 0)
  std::size_t shared_prompts = 4;  ///< system prompts shared through inc_ref
  std::uint64_t seed = 1;
  std::size_t max_prompt_tokens = 512;  ///< per request, excluding the shared prompt
  std::size_t max_output_tokens = 256;
};

struct ServingSimResult {
  std::size_t requests = 0;
  std::size_t completed = 0;
  std::size_t preemptions = 0;
  std::size_t steps = 0;
  std::size_t shared_prompts = 0;        ///< system prompts that fit (<= options)
  std::size_t shared_prompt_blocks = 0;  ///< blocks pinned by them
  std::uint64_t prompt_tokens = 0;       ///< admitted, including recomputation
  std::uint64_t generated_tokens = 0;

  std::uint64_t allocs = 0;          ///< successful try_alloc_block calls
  std::uint64_t alloc_failures = 0;  ///< try_alloc_block calls that found no block
  std::uint64_t inc_refs = 0;
  std::uint64_t dec_refs = 0;       ///< references dropped (free_blocks entries + dec_ref)
  std::uint64_t zero_batches = 0;   ///< zero_blocks calls
  std::uint64_t zeroed_blocks = 0;  ///< ids passed to them
  std::size_t peak_blocks_in_use = 0;
  /// Host time of the scheduling loop: refcount operations, queuing the zero
  /// batches, and the simulation's own bookkeeping and refcount checks.
  double loop_s = 0.0;
  /// loop_s plus waiting for the device to finish the queued zeroing.
  double elapsed_s = 0.0;

  /// Refcounts that differed from the simulation's own bookkeeping, counters
  /// that disagree with the calls made, blocks still in use at the end: each a
  /// one-line description. Empty in a correct run.
  std::vector<std::string> discrepancies;

  /// Refcount operations: allocs + inc_refs + dec_refs.
  std::uint64_t block_ops() const noexcept { return allocs + inc_refs + dec_refs; }
  /// Block operations per second of scheduling-loop time (loop_s).
  double ops_per_s() const noexcept {
    return loop_s > 0.0 ? static_cast<double>(block_ops()) / loop_s : 0.0;
  }
};

/// Runs the workload on a fresh `cache` (no block in use), queuing zeroing on
/// `stream`. Leaves every block free. Throws InvalidArgument for zero
/// requests or max_running, and std::logic_error if the scheduler stalls (a bug).
ServingSimResult run_serving_simulation(PagedKvCache& cache, StreamView stream,
                                        const ServingSimOptions& options);

}  // namespace kvport::sim
