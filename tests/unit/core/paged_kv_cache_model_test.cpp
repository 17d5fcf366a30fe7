// SPDX-License-Identifier: Apache-2.0
// Model-based test: random sequences of allocation and refcount operations
// against a minimal reference model of the reference semantics (a LIFO stack of
// free ids and a refcount per block), compared after every step.
#include <gtest/gtest.h>

#include <cstddef>
#include <cstdint>
#include <optional>
#include <random>
#include <string>
#include <vector>

#include "core_test_util.hpp"
#include "kvport/core/paged_kv_cache.hpp"
#include "kvport/platform/error.hpp"

namespace kvport {
namespace {

/// The reference semantics, written as plainly as possible.
class Model {
 public:
  explicit Model(std::size_t num_blocks) : refcounts_(num_blocks, 0) {
    for (std::size_t i = num_blocks; i-- > 0;)
      free_.push_back(static_cast<BlockId>(i));
  }

  std::optional<BlockId> alloc() {
    if (free_.empty()) {
      ++exhaustion_events;
      return std::nullopt;
    }
    const BlockId b = free_.back();
    free_.pop_back();
    refcounts_[b] = 1;
    ++allocs;
    const std::size_t in_use = refcounts_.size() - free_.size();
    if (in_use > peak) peak = in_use;
    return b;
  }

  /// False when the block is free (the cache throws InvalidArgument then).
  bool inc_ref(BlockId b) {
    if (refcounts_[b] == 0) return false;
    ++refcounts_[b];
    return true;
  }

  /// dec_ref / free_block / return_evicted_block: true when the block was freed.
  bool release(BlockId b) {
    if (refcounts_[b] == 0) {
      ++ignored;
      return false;
    }
    if (--refcounts_[b] != 0) return false;
    free_.push_back(b);
    ++frees;
    return true;
  }

  bool in_range(BlockId b) const { return b < refcounts_.size(); }
  std::uint32_t ref_count(BlockId b) const { return refcounts_[b]; }
  std::size_t num_free() const { return free_.size(); }
  std::size_t num_blocks() const { return refcounts_.size(); }

  std::uint64_t allocs = 0, frees = 0, ignored = 0, exhaustion_events = 0;
  std::size_t peak = 0;

 private:
  std::vector<BlockId> free_;  // top at the back
  std::vector<std::uint32_t> refcounts_;
};

struct ModelParam {
  std::uint32_t seed;
  std::size_t num_blocks;
  bool trace;
  int steps;
};

void PrintTo(const ModelParam& p, std::ostream* os) {
  *os << "seed " << p.seed << ", " << p.num_blocks << " blocks" << (p.trace ? ", traced" : "");
}

class PagedKvCacheModelTest : public ::testing::TestWithParam<ModelParam> {};

void expect_same_state(const PagedKvCache& cache, const Model& model) {
  ASSERT_EQ(cache.num_free_blocks(), model.num_free());
  for (BlockId b = 0; b < model.num_blocks(); ++b) {
    ASSERT_EQ(cache.ref_count(b), model.ref_count(b)) << "block " << b;
  }
  const KvCacheCounters& c = cache.counters();
  ASSERT_EQ(c.allocs, model.allocs);
  ASSERT_EQ(c.frees, model.frees);
  ASSERT_EQ(c.ignored_double_frees, model.ignored);
  ASSERT_EQ(c.exhaustion_events, model.exhaustion_events);
  ASSERT_EQ(c.peak_blocks_in_use, model.peak);
}

TEST_P(PagedKvCacheModelTest, RandomOperationsMatchTheReferenceModel) {
  const ModelParam& p = GetParam();
  auto backend = test::host_backend();
  PagedKvCacheOptions options;
  options.trace = p.trace;
  options.trace_depth = 5;
  PagedKvCache cache(test::small_config(), p.num_blocks, *backend, options);
  Model model(p.num_blocks);
  test::QuietLog quiet;  // thousands of deliberate double frees

  std::mt19937 rng(p.seed);
  const auto uniform = [&](std::size_t lo, std::size_t hi) {  // [lo, hi]
    return static_cast<std::size_t>(lo + rng() % (hi - lo + 1));
  };
  // Mostly blocks in range (free or not); now and then one just past the end.
  const auto pick_block = [&]() -> BlockId {
    if (uniform(0, 99) < 3) return static_cast<BlockId>(p.num_blocks + uniform(0, 2));
    return static_cast<BlockId>(uniform(0, p.num_blocks - 1));
  };

  for (int step = 0; step < p.steps; ++step) {
    const std::size_t op = uniform(0, 99);
    std::string what;
    if (op < 20) {  // alloc_block
      const std::optional<BlockId> expected = model.alloc();
      what = "alloc_block";
      if (expected) {
        ASSERT_EQ(cache.alloc_block(), *expected) << "step " << step;
      } else {
        ASSERT_THROW(cache.alloc_block(), CacheExhausted) << "step " << step;
      }
    } else if (op < 35) {  // try_alloc_block
      what = "try_alloc_block";
      ASSERT_EQ(cache.try_alloc_block(), model.alloc()) << "step " << step;
    } else if (op < 50) {  // inc_ref
      const BlockId b = pick_block();
      what = "inc_ref " + std::to_string(b);
      if (!model.in_range(b) || !model.inc_ref(b)) {
        ASSERT_THROW(cache.inc_ref(b), InvalidArgument) << what << " step " << step;
      } else {
        cache.inc_ref(b);
      }
    } else if (op < 68) {  // dec_ref
      const BlockId b = pick_block();
      what = "dec_ref " + std::to_string(b);
      if (!model.in_range(b)) {
        ASSERT_THROW(cache.dec_ref(b), InvalidArgument) << what;
      } else {
        ASSERT_EQ(cache.dec_ref(b), model.release(b)) << what << " step " << step;
      }
    } else if (op < 75) {  // free_block
      const BlockId b = pick_block();
      what = "free_block " + std::to_string(b);
      if (!model.in_range(b)) {
        ASSERT_THROW(cache.free_block(b), InvalidArgument) << what;
      } else {
        ASSERT_EQ(cache.free_block(b), model.release(b)) << what << " step " << step;
      }
    } else if (op < 87) {  // free_blocks
      std::vector<BlockId> table(uniform(0, 5));
      bool all_in_range = true;
      for (BlockId& b : table) {
        b = pick_block();
        all_in_range = all_in_range && model.in_range(b);
      }
      what = "free_blocks " + ::testing::PrintToString(table);
      if (!all_in_range) {
        ASSERT_THROW(cache.free_blocks(table), InvalidArgument) << what;
      } else {
        cache.free_blocks(table);
        for (BlockId b : table)
          model.release(b);
      }
    } else {  // return_evicted_block
      const BlockId b = pick_block();
      what = "return_evicted_block " + std::to_string(b);
      if (!model.in_range(b)) {
        ASSERT_THROW(cache.return_evicted_block(b), InvalidArgument) << what;
      } else {
        cache.return_evicted_block(b);
        model.release(b);
      }
    }

    SCOPED_TRACE(::testing::Message() << "after step " << step << ": " << what);
    ASSERT_EQ(cache.num_free_blocks(), model.num_free());
    ASSERT_EQ(cache.num_blocks_in_use(), p.num_blocks - model.num_free());
    const InvariantReport report = cache.check_invariants();
    ASSERT_TRUE(report.ok) << report.to_string();
    ASSERT_EQ(report.free_blocks, model.num_free());
    if (step % 64 == 0) expect_same_state(cache, model);
  }
  expect_same_state(cache, model);

  // Drain: the cache hands out exactly the model's stack, top first.
  while (const std::optional<BlockId> expected = model.alloc()) {
    ASSERT_EQ(cache.alloc_block(), *expected);
  }
  EXPECT_EQ(cache.try_alloc_block(), std::nullopt);
  EXPECT_EQ(cache.num_free_blocks(), 0u);
}

INSTANTIATE_TEST_SUITE_P(
    Seeds, PagedKvCacheModelTest,
    ::testing::Values(ModelParam{1, 1, false, 3000}, ModelParam{2, 7, false, 5000},
                      ModelParam{3, 64, false, 5000}, ModelParam{42, 16, true, 5000},
                      ModelParam{1234, 33, false, 8000}, ModelParam{99, 3, true, 4000}),
    [](const ::testing::TestParamInfo<ModelParam>& param_info) {
      return "Seed" + std::to_string(param_info.param.seed) + "Blocks" +
             std::to_string(param_info.param.num_blocks) + (param_info.param.trace ? "Traced" : "");
    });

}  // namespace
}  // namespace kvport
