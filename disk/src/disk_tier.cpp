// SPDX-License-Identifier: Apache-2.0
#include "kvport/disk/disk_tier.hpp"

#include <exception>
#include <string>
#include <utility>

#include "kvport/platform/error.hpp"
#include "kvport/platform/log.hpp"

namespace kvport::disk {

namespace {

// Logs what a store call threw; the tier above goes on with "nothing".
void log_failure(const char* call, const std::exception& e) noexcept {
  try {
    log::error(std::string("disk tier: ") + call + " failed: " + e.what());
  } catch (...) {
  }
}

}  // namespace

DiskTier::DiskTier(std::unique_ptr<DiskStore> store) : store_(std::move(store)) {
  if (!store_) throw InvalidArgument("DiskTier: no store");
}

std::unique_ptr<DiskTier> DiskTier::open(const DiskStoreOptions& options) {
  return std::make_unique<DiskTier>(DiskStore::open(options));
}

DiskTier::~DiskTier() {
  store_->set_listener(nullptr);
}

std::size_t DiskTier::block_bytes() const noexcept {
  return store_->block_bytes();
}

std::size_t DiskTier::put(std::span<const BlockHash> hashes,
                          std::span<const std::span<const std::byte>> images) noexcept {
  try {
    return store_->put(hashes, images);
  } catch (const std::exception& e) {
    log_failure("put", e);
    return 0;
  }
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

void DiskTier::set_listener(Listener* listener) noexcept {
  store_->set_listener(listener);
}

}  // namespace kvport::disk
