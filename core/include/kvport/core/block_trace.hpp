// SPDX-License-Identifier: Apache-2.0
// BlockTrace: a bounded per-block history of refcount operations, for finding
// the caller behind a refcount bug.
#pragma once

#include <cstddef>
#include <cstdint>
#include <source_location>
#include <string>
#include <vector>

namespace kvport {

/// What happened to a block.
enum class BlockOp : std::uint8_t { alloc, try_alloc, inc, dec, evict_return, ignored_dec };

const char* to_string(BlockOp op) noexcept;

struct BlockTraceEntry {
  BlockOp op;
  std::uint32_t refcount_after;
  std::source_location where;
};

/// Keeps the last `depth` entries of every block in a ring. Off, it costs one
/// branch per operation and no memory.
class BlockTrace {
 public:
  static constexpr std::size_t kDefaultDepth = 16;

  /// `enabled` false: every call is a no-op. Throws InvalidArgument when
  /// enabled and num_blocks * depth overflows size_t.
  BlockTrace(std::size_t num_blocks, bool enabled, std::size_t depth = kDefaultDepth);

  /// True when `KVPORT_KV_TRACE` is set to 1/true/on/yes.
  static bool enabled_by_env() noexcept;

  bool is_on() const noexcept { return enabled_; }
  std::size_t depth() const noexcept { return depth_; }

  void record(std::uint32_t block, BlockOp op, std::uint32_t refcount_after,
              const std::source_location& where);

  /// The block's entries, oldest first (at most depth()).
  std::vector<BlockTraceEntry> history(std::uint32_t block) const;

  /// One line per entry: "alloc -> 1 at file.cpp:42 (function)".
  std::string dump(std::uint32_t block) const;

 private:
  bool enabled_;
  std::size_t depth_;
  std::vector<BlockTraceEntry> entries_;  // num_blocks * depth_
  std::vector<std::uint64_t> written_;    // entries ever written per block (never wraps)
};

}  // namespace kvport
