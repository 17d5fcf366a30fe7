// SPDX-License-Identifier: Apache-2.0
#include "kvport/core/block_trace.hpp"

#include <fmt/format.h>

#include <cctype>
#include <cstdlib>
#include <limits>
#include <string>
#include <string_view>

#include "kvport/platform/error.hpp"

namespace kvport {

const char* to_string(BlockOp op) noexcept {
  switch (op) {
    case BlockOp::alloc:
      return "alloc";
    case BlockOp::try_alloc:
      return "try_alloc";
    case BlockOp::inc:
      return "inc";
    case BlockOp::dec:
      return "dec";
    case BlockOp::evict_return:
      return "evict_return";
    case BlockOp::ignored_dec:
      return "ignored_dec";
  }
  return "unknown";
}

BlockTrace::BlockTrace(std::size_t num_blocks, bool enabled, std::size_t depth)
    : enabled_(enabled && depth > 0 && num_blocks > 0), depth_(depth) {
  if (enabled_) {
    // An unchecked num_blocks * depth could wrap to a small ring that record()
    // then writes past.
    if (depth_ > std::numeric_limits<std::size_t>::max() / num_blocks) {
      throw InvalidArgument(fmt::format("BlockTrace: trace depth {} x {} blocks overflows size_t",
                                        depth_, num_blocks));
    }
    entries_.resize(num_blocks * depth_, BlockTraceEntry{BlockOp::alloc, 0, {}});
    written_.assign(num_blocks, 0);
  }
}

bool BlockTrace::enabled_by_env() noexcept {
  const char* env = std::getenv("KVPORT_KV_TRACE");
  if (env == nullptr) return false;
  std::string v(env);
  for (char& c : v)
    c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  return v == "1" || v == "true" || v == "on" || v == "yes";
}

void BlockTrace::record(std::uint32_t block, BlockOp op, std::uint32_t refcount_after,
                        const std::source_location& where) {
  if (!enabled_ || block >= written_.size()) return;
  const std::uint64_t n = written_[block]++;
  entries_[block * depth_ + n % depth_] = BlockTraceEntry{op, refcount_after, where};
}

std::vector<BlockTraceEntry> BlockTrace::history(std::uint32_t block) const {
  std::vector<BlockTraceEntry> out;
  if (!enabled_ || block >= written_.size()) return out;
  const std::size_t n = written_[block];
  const std::size_t count = n < depth_ ? n : depth_;
  out.reserve(count);
  for (std::size_t i = n - count; i < n; ++i)
    out.push_back(entries_[block * depth_ + i % depth_]);
  return out;
}

std::string BlockTrace::dump(std::uint32_t block) const {
  if (!enabled_) return "(tracing off: set KVPORT_KV_TRACE=1 for block histories)";
  std::string out;
  for (const BlockTraceEntry& e : history(block)) {
    out += fmt::format("  {} -> {} at {}:{} ({})\n", to_string(e.op), e.refcount_after,
                       e.where.file_name(), e.where.line(), e.where.function_name());
  }
  if (out.empty()) out = "  (no operations recorded)\n";
  return out;
}

}  // namespace kvport
