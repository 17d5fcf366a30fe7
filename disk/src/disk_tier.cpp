// SPDX-License-Identifier: Apache-2.0
#include "kvport/disk/disk_tier.hpp"

#include <exception>
#include <string>
#include <utility>

#include "kvport/platform/error.hpp"
#include "kvport/platform/log.hpp"

namespace kvport::disk {

namespace {

// Logs why a store call failed; the tier above goes on with "nothing".
void log_failure(const char* call, const char* why) noexcept {
  try {
    log::error(std::string("disk tier: ") + call + " failed: " + why);
  } catch (...) {
  }
}

void log_failure(const char* call, const std::exception& e) noexcept {
  log_failure(call, e.what());
}

}  // namespace

DiskTier::DiskTier(std::unique_ptr<DiskStore> store) : store_(std::move(store)) {
  if (!store_) throw InvalidArgument("DiskTier: no store");
  store_->set_listener(&announcer_);
}

std::unique_ptr<DiskTier> DiskTier::open(const DiskStoreOptions& options) {
  return std::make_unique<DiskTier>(DiskStore::open(options));
}

DiskTier::~DiskTier() {
  store_->set_listener(nullptr);  // the store may outlive nothing, but says nothing more
}

std::size_t DiskTier::block_bytes() const noexcept {
  return store_->block_bytes();
}

std::size_t DiskTier::put(std::span<const BlockHash> hashes,
                          std::span<const std::span<const std::byte>> images,
                          std::span<const BlockOrigin> origins) noexcept {
  if (!origins.empty() && origins.size() != hashes.size()) {
    log_failure("put", "origins and hashes differ in size");
    return 0;
  }
  put_hashes_ = hashes;
  put_origins_ = origins;
  std::size_t kept = 0;
  try {
    kept = store_->put(hashes, images);
  } catch (const std::exception& e) {
    log_failure("put", e);
  }
  put_hashes_ = {};
  put_origins_ = {};
  return kept;
}

bool DiskTier::contains(const BlockHash& hash) const noexcept {
  return store_->contains(hash);
}

std::size_t DiskTier::get_prefix(std::span<const BlockHash> hashes,
                                 std::span<const std::span<std::byte>> out) noexcept {
  try {
    return store_->get_prefix(hashes, out);
  } catch (const std::exception& e) {
    log_failure("get_prefix", e);
    return 0;
  }
}

void DiskTier::touch(std::span<const BlockHash> hashes) noexcept {
  store_->touch(hashes);  // no allocation, no I/O
}

void DiskTier::erase(std::span<const BlockHash> hashes) noexcept {
  if (store_->options().read_only) return;
  try {
    for (const BlockHash& h : hashes)
      store_->erase(h);
  } catch (const std::exception& e) {  // bad_alloc queueing the erase record
    log_failure("erase", e);
  }
}

void DiskTier::note_hits(std::span<const BlockHash> hashes) noexcept {
  try {
    store_->note_hits(hashes);
  } catch (const std::exception& e) {  // bad_alloc: the counts stay as they were
    log_failure("note_hits", e);
  }
}

std::vector<BlockHash> DiskTier::stored_hashes() const {
  return store_->lru_order();
}

void DiskTier::Announcer::stored(std::span<const BlockHash> hashes) noexcept {
  tier->announce_stored(tier->put_hashes_, tier->put_origins_, hashes);
}

void DiskTier::Announcer::removed(std::span<const BlockHash> hashes) noexcept {
  tier->announce_removed(hashes);
}

}  // namespace kvport::disk
