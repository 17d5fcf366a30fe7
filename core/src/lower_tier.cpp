// SPDX-License-Identifier: Apache-2.0
#include "kvport/core/lower_tier.hpp"

#include <utility>

namespace kvport {

void LowerTierStore::set_event_sink(CacheEventSink* sink, EventSource source,
                                    std::uint32_t block_size) noexcept {
  sink_ = sink;
  source_ = std::move(source);
  block_size_ = block_size;
}

void LowerTierStore::snapshot(CacheEventSink& sink) const {
  const std::vector<BlockHash> hashes = stored_hashes();  // may throw: nothing announced
  for (const BlockHash& h : hashes)
    sink.stored(source_, stored_view({&h, 1}, block_size_));
}

void LowerTierStore::announce_stored(std::span<const BlockHash> hashes,
                                     std::span<const BlockOrigin> origins,
                                     std::span<const BlockHash> visible) const noexcept {
  if (sink_ == nullptr) return;
  const bool with_origins = origins.size() == hashes.size();
  std::size_t i = 0;  // `visible` is a subsequence of `hashes`: one forward walk
  for (const BlockHash& h : visible) {
    while (i < hashes.size() && hashes[i] != h)
      ++i;
    const BlockOrigin* origin = with_origins && i < hashes.size() ? &origins[i] : nullptr;
    sink_->stored(source_, stored_view({&h, 1}, block_size_, origin));
    if (i < hashes.size()) ++i;
  }
}

void LowerTierStore::announce_removed(std::span<const BlockHash> hashes) const noexcept {
  if (sink_ != nullptr && !hashes.empty()) sink_->removed(source_, hashes);
}

}  // namespace kvport
