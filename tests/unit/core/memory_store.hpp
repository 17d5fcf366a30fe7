// SPDX-License-Identifier: Apache-2.0
// MemoryStore: a LowerTierStore in memory for the host tier's tests.
#pragma once

#include <algorithm>
#include <list>
#include <map>
#include <optional>
#include <span>
#include <tuple>
#include <vector>

#include "kvport/core/block_hash.hpp"
#include "kvport/core/lower_tier.hpp"

namespace kvport::test {

// A LowerTierStore in memory: `capacity` blocks, least recently used (put or
// read) evicted first; `min_hits` as the disk tier's admission filter;
// `reads_left` (when set) lets that many more block reads succeed, then
// fails the rest (a failed block is dropped, as the disk tier does).
class MemoryStore final : public LowerTierStore {
 public:
  MemoryStore(std::size_t block_bytes, std::size_t capacity)
      : block_bytes_(block_bytes), capacity_(capacity) {}

  std::size_t block_bytes() const noexcept override { return block_bytes_; }

  std::size_t put(std::span<const BlockHash> hashes,
                  std::span<const std::span<const std::byte>> images,
                  std::span<const BlockOrigin> origins) noexcept override {
    ++put_calls;
    if (hashes.size() != images.size()) return 0;
    if (!origins.empty() && origins.size() != hashes.size()) return 0;
    std::vector<BlockHash> stored;
    for (std::size_t i = 0; i < hashes.size(); ++i) {
      if (images[i].size() != block_bytes_ || blocks_.contains(hashes[i])) continue;
      if (min_hits > 0 && hits_[hashes[i]] < min_hits) {
        ++not_admitted;
        continue;
      }
      if (blocks_.size() == capacity_) {
        const BlockHash victim = lru_.front();
        remove(victim);
        announce_removed({&victim, 1});
      }
      blocks_[hashes[i]].assign(images[i].begin(), images[i].end());
      lru_.push_back(hashes[i]);
      stored.push_back(hashes[i]);
    }
    announce_stored(hashes, origins, stored);
    return stored.size();
  }

  bool contains(const BlockHash& hash) const noexcept override { return blocks_.contains(hash); }

  std::size_t get_prefix(std::span<const BlockHash> hashes,
                         std::span<const std::span<std::byte>> out) noexcept override {
    ++get_calls;
    std::size_t got = 0;
    for (; got < hashes.size() && got < out.size(); ++got) {
      const auto it = blocks_.find(hashes[got]);
      if (it == blocks_.end() || out[got].size() != block_bytes_) break;
      if (reads_left && *reads_left == 0) {  // a failed read: dropped, never served
        const BlockHash h = hashes[got];
        remove(h);
        announce_removed({&h, 1});
        break;
      }
      if (reads_left) --*reads_left;
      std::copy(it->second.begin(), it->second.end(), out[got].begin());
      lru_.remove(hashes[got]);
      lru_.push_back(hashes[got]);
    }
    return got;
  }

  void touch(std::span<const BlockHash> hashes) noexcept override {
    for (const BlockHash& h : hashes) {
      if (!blocks_.contains(h)) continue;
      lru_.remove(h);
      lru_.push_back(h);
    }
  }

  void erase(std::span<const BlockHash> hashes) noexcept override {
    for (const BlockHash& h : hashes) {
      if (!blocks_.contains(h)) continue;
      remove(h);
      announce_removed({&h, 1});
    }
  }

  void note_hits(std::span<const BlockHash> hashes) noexcept override {
    for (const BlockHash& h : hashes)
      ++hits_[h];
  }

  std::vector<BlockHash> stored_hashes() const override { return {lru_.begin(), lru_.end()}; }

  std::size_t size() const { return blocks_.size(); }

  std::size_t min_hits = 0;
  std::optional<std::size_t> reads_left;
  std::size_t put_calls = 0;
  std::size_t get_calls = 0;
  std::size_t not_admitted = 0;

 private:
  void remove(const BlockHash& h) {
    blocks_.erase(h);
    lru_.remove(h);
  }
  struct Less {
    bool operator()(const BlockHash& a, const BlockHash& b) const {
      return std::tie(a.high, a.low) < std::tie(b.high, b.low);
    }
  };
  std::size_t block_bytes_;
  std::size_t capacity_;
  std::map<BlockHash, std::vector<std::byte>, Less> blocks_;
  std::map<BlockHash, std::size_t, Less> hits_;
  std::list<BlockHash> lru_;
};

}  // namespace kvport::test
