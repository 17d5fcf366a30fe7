// SPDX-License-Identifier: Apache-2.0
#include "kvport/core/block_pool.hpp"

#include <fmt/format.h>

#include <optional>

#include "kvport/platform/error.hpp"

namespace kvport {

std::string_view to_string(KvPart part) noexcept {
  return part == KvPart::k ? "K" : "V";
}

DeviceRegion BlockPool::region(BlockId block) const {
  if (block >= num_blocks) {
    throw OutOfRange(fmt::format("BlockPool::region: block {} out of range (num_blocks = {})",
                                 block, num_blocks));
  }
  std::size_t offset = 0;
  if (__builtin_mul_overflow(std::size_t{block}, stride, &offset)) {
    throw InvalidArgument(fmt::format(
        "BlockPool::region: block {} x stride {} overflows the address space", block, stride));
  }
  return DeviceRegion{base.offset(offset), region_bytes};
}

std::size_t BlockPool::extent() const {
  const std::optional<std::size_t> e = pool_extent(num_blocks, stride, region_bytes);
  if (!e) {
    throw InvalidArgument(
        fmt::format("BlockPool::extent: {} blocks of stride {} and {} bytes overflow size_t",
                    num_blocks, stride, region_bytes));
  }
  return *e;
}

}  // namespace kvport
