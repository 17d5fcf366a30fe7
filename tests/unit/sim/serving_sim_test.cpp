// SPDX-License-Identifier: Apache-2.0
// The demo workload under the scheduler loop, driven directly on a
// host-backend cache.
#include "kvport/sim/serving_sim.hpp"
#include "kvport/testing/sim_support.hpp"

#include <gtest/gtest.h>

#include "kvport/backends/host_backend.hpp"
#include "kvport/platform/error.hpp"

namespace kvport::sim {
namespace {

KvCacheConfig small_config() {
  return kvport::testing::tiny_sim_config();
}

TEST(sim_serving_sim, ServesEveryRequestAndLeavesTheCacheEmpty) {
  auto backend = make_host_backend(HostBackendOptions{std::size_t{64} << 20});
  PagedKvCache cache(small_config(), 64, *backend, PagedKvCacheOptions{.trace = true});
  const Stream stream = backend->create_stream();
  backend->reset_call_counts();
  ServingSimOptions options;
  options.requests = 100;
  options.max_running = 16;
  options.seed = 11;
  const ServingSimResult r = run_serving_simulation(cache, stream, options);
  EXPECT_EQ(r.completed, 100u);
  EXPECT_TRUE(r.discrepancies.empty()) << r.discrepancies.front();
  EXPECT_GT(r.preemptions, 0u);
  EXPECT_GT(r.alloc_failures, 0u);
  EXPECT_GT(r.inc_refs, 0u);
  EXPECT_EQ(r.peak_blocks_in_use, 64u);
  EXPECT_EQ(cache.num_blocks_in_use(), 0u);
  EXPECT_TRUE(cache.check_invariants().ok);
  EXPECT_EQ(backend->call_counts().fill, r.zero_batches);
  EXPECT_EQ(cache.counters().allocs, r.allocs);
  EXPECT_EQ(cache.counters().exhaustion_events, r.alloc_failures);
}

TEST(sim_serving_sim, RejectsAUsedCacheAndZeroRequests) {
  auto backend = make_host_backend(HostBackendOptions{std::size_t{64} << 20});
  PagedKvCache cache(small_config(), 8, *backend);
  const Stream stream = backend->create_stream();
  EXPECT_THROW(run_serving_simulation(cache, stream, ServingSimOptions{.requests = 0}),
               InvalidArgument);
  const BlockId held = cache.alloc_block();
  EXPECT_THROW(run_serving_simulation(cache, stream, ServingSimOptions{}), InvalidArgument);
  cache.free_block(held);
}

}  // namespace
}  // namespace kvport::sim
