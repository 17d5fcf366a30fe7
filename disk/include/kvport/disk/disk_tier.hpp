// SPDX-License-Identifier: Apache-2.0
// DiskTier: a DiskStore as the host tier's lower tier (core's LowerTierStore),
// so that HostTier::set_lower_tier puts the disk under the host.
#pragma once

#include <memory>
#include <span>
#include <vector>

#include "kvport/core/lower_tier.hpp"
#include "kvport/disk/disk_store.hpp"

namespace kvport::disk {

/// The disk tier under a HostTier: the LowerTierStore calls on a DiskStore
/// it owns. Its calls never throw: a store error (bad sizes, a failure to
/// allocate) is logged and answered as "nothing kept / nothing read"; I/O
/// failures are the store's, counted in store().counters(). It announces
/// its own blocks' events (LowerTierStore::set_event_sink): a block once
/// durable, with the origin put() was given, and every block the store
/// drops, whatever the reason. Not thread-safe, like the tiers above it.
class DiskTier final : public LowerTierStore {
 public:
  /// Takes `store` (not null: InvalidArgument).
  explicit DiskTier(std::unique_ptr<DiskStore> store);
  /// DiskStore::open(options) under a DiskTier; throws as that does.
  static std::unique_ptr<DiskTier> open(const DiskStoreOptions& options);
  ~DiskTier() override;
  DiskTier(const DiskTier&) = delete;
  DiskTier& operator=(const DiskTier&) = delete;

  /// The store, for its counters, io_description() and invariants.
  DiskStore& store() noexcept { return *store_; }
  const DiskStore& store() const noexcept { return *store_; }

  std::size_t block_bytes() const noexcept override;
  std::size_t put(std::span<const BlockHash> hashes,
                  std::span<const std::span<const std::byte>> images,
                  std::span<const BlockOrigin> origins) noexcept override;
  bool contains(const BlockHash& hash) const noexcept override;
  std::size_t get_prefix(std::span<const BlockHash> hashes,
                         std::span<const std::span<std::byte>> out) noexcept override;
  void touch(std::span<const BlockHash> hashes) noexcept override;
  /// Erases what is stored of `hashes`; nothing on a read-only store.
  void erase(std::span<const BlockHash> hashes) noexcept override;
  void note_hits(std::span<const BlockHash> hashes) noexcept override;
  std::vector<BlockHash> stored_hashes() const override;

 private:
  // The store's listener: announces what it reports as the disk tier's
  // events, with the origins of the put in progress.
  struct Announcer final : DiskStore::Listener {
    explicit Announcer(DiskTier* t) : tier(t) {}
    void stored(std::span<const BlockHash> hashes) noexcept override;
    void removed(std::span<const BlockHash> hashes) noexcept override;
    DiskTier* tier;
  };

  std::unique_ptr<DiskStore> store_;
  Announcer announcer_{this};
  // The put in progress (its hashes and origins), for Announcer::stored.
  std::span<const BlockHash> put_hashes_;
  std::span<const BlockOrigin> put_origins_;
};

}  // namespace kvport::disk
