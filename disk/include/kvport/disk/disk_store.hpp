// SPDX-License-Identifier: Apache-2.0
// DiskStore: KV-cache blocks on local disk, keyed by their chained block
// hashes, persistent across restarts and crash-safe. The storage level under
// the host tier: blocks are fixed-size images (HostTier::slot_bytes()) in
// slots of one preallocated data file, named by an append-only index.
#pragma once

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <functional>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "kvport/core/block_hash.hpp"
#include "kvport/core/paged_kv_cache.hpp"
#include "kvport/disk/file_io.hpp"

namespace kvport::disk {

/// One field of a directory's compatibility key: what must be equal for the
/// blocks of one process to be valid in another (the model's geometry,
/// dtypes, block size, the hash scheme). Compared by name and value.
struct LayoutField {
  std::string name;
  std::string value;
  friend bool operator==(const LayoutField&, const LayoutField&) = default;
};

/// The compatibility key of `config`'s blocks: block size, layer count and
/// layout, each layer's dtype and K/V bytes, the bytes of one block's image,
/// and the block hash scheme ("xxh3-128 chained, unseeded": kvport's hashes
/// do not depend on the process, so another process of the same model finds
/// the same hashes).
std::vector<LayoutField> layout_fields(const KvCacheConfig& config);

/// Configuration of a DiskStore.
struct DiskStoreOptions {
  /// The directory of the store: created when missing (not with read_only);
  /// holds kvport-disk.json (format, geometry, layout key), blocks.dat (the
  /// slots), index.log (the records) and kvport-disk.lock. An existing
  /// directory must be a store (its kvport-disk.json) or empty.
  std::filesystem::path dir;
  /// Blocks the store holds. In [1, kMaxSlots]. An existing directory must
  /// have been made with the same count.
  std::size_t num_slots = 0;
  /// Bytes of one block's image (each slot is this, rounded up to 4096).
  /// In [1, kMaxBlockBytes].
  std::size_t block_bytes = 0;
  /// The compatibility key (layout_fields()): an existing directory whose key
  /// differs is refused, naming the first differing field.
  std::vector<LayoutField> layout;
  /// Open an existing directory to read only (several processes may, at
  /// once): nothing is written, and a process holding it for writing
  /// excludes readers (and the other way round).
  bool read_only = false;
  IoEngine engine = IoEngine::automatic;
  /// O_DIRECT for the data file where the file system takes it.
  bool direct_io = true;
  /// Block I/Os in flight at once. The store keeps twice as many staging
  /// buffers (one slot each, 4096-aligned, allocated and touched at open):
  /// every read passes through one (the kernel never writes the caller's
  /// memory, so a read abandoned at its deadline cannot land in a buffer the
  /// caller reused), and so does every write whose image is not 4096-aligned
  /// or not a whole slot long. In [1, 1024].
  std::size_t queue_depth = 16;
  /// The deadline of every read and write batch, and of each sync. A read
  /// not done by then ends the hit there (its staging buffer is held until
  /// the kernel is done with it); a write not done is not published. In
  /// [1 ms, 1 hour].
  std::chrono::milliseconds io_timeout{5000};
  /// Admission (SSD wear): put() writes a block only once note_hits() has
  /// counted at least this many hits of it. 0: every block offered.
  std::uint32_t min_hits = 0;
  /// Tests: wraps each file's FileIo ("data" or "index") as it is opened,
  /// e.g. in a FaultInjectingFileIo. nullptr: none.
  std::function<std::unique_ptr<FileIo>(std::string_view file, std::unique_ptr<FileIo>)> wrap_io;

  static constexpr std::size_t kMaxSlots = (std::size_t{1} << 32) - 2;
  static constexpr std::size_t kMaxBlockBytes = std::size_t{1} << 30;
};

/// Monotonic counters since open (the `recovered` and `dropped_at_open`
/// ones describe the open itself).
struct DiskStoreCounters {
  std::uint64_t writes = 0;       ///< blocks written and published
  std::uint64_t write_bytes = 0;  ///< bytes of those (block_bytes each)
  std::uint64_t reads = 0;        ///< blocks read, verified and returned
  std::uint64_t read_bytes = 0;
  /// Blocks not published because their write, a sync or the index failed
  /// (a put refused for want of room for its records counts its blocks here).
  std::uint64_t write_failures = 0;
  std::uint64_t read_failures = 0;      ///< blocks whose read failed or came short: dropped
  std::uint64_t checksum_failures = 0;  ///< blocks read whose bytes did not match: dropped
  std::uint64_t timeouts = 0;           ///< block I/Os past io_timeout
  std::uint64_t evictions = 0;          ///< blocks dropped for newer ones (LRU)
  std::uint64_t not_admitted = 0;       ///< puts below min_hits
  std::uint64_t already_stored = 0;     ///< puts of a block the store had
  std::uint64_t dropped_puts = 0;       ///< puts refused: read-only, detached, or no slot to take
  std::uint64_t erased = 0;             ///< blocks erase() removed
  std::uint64_t recovered = 0;          ///< blocks found valid in the directory at open
  /// Records dropped at open: torn or corrupted, pointing past the end of a
  /// truncated data file, or superseded.
  std::uint64_t dropped_at_open = 0;
  /// Blocks dropped when a file of the store was found deleted under the
  /// process (the store then serves and takes nothing).
  std::uint64_t dropped_detached = 0;
  std::uint64_t journal_compactions = 0;
  /// Times the index could not be written: no room to reserve for a put's
  /// records (the put is refused before it evicts or writes anything), or an
  /// append or its sync failed. See DiskStore::index_failing().
  std::uint64_t index_failures = 0;
  std::uint64_t write_ns = 0;  ///< time in data writes and their syncs
  std::uint64_t read_ns = 0;   ///< time in data reads
  std::uint64_t index_ns = 0;  ///< time reserving, appending and syncing index records
};

/// KV-cache blocks on disk.
///
/// Durability. put() writes the blocks' images into free slots, syncs the
/// data file, then appends one record per block (hash, slot, length,
/// checksum of the image; itself checksummed) to index.log and syncs it; a
/// block is visible (contains(), get_prefix()) only after both. A crash
/// anywhere leaves each block either absent or whole: at open, records that
/// are torn or corrupted, point past the end of the data file, or were
/// superseded by a later record of the same slot are dropped and counted; and
/// every read is checked against the record's checksum, so a slot whose
/// bytes changed (a crash while a slot was reused, a corrupted page) is
/// dropped and counted, never served.
///
/// Failing closed. get_prefix() returns the longest prefix of hashes whose
/// blocks were read whole and verified: a failed, short, corrupted or
/// timed-out read ends the prefix there (a shorter hit), and a block that
/// failed to verify is dropped. A write or sync that fails publishes nothing
/// of its batch that was not durable. Every batch has io_timeout.
///
/// Eviction: the least recently used block (put or returned by get_prefix)
/// gives its slot to a newer one.
///
/// Not thread-safe (like the tiers above it).
class DiskStore {
 public:
  /// Told of the blocks that become visible in the store and of those that
  /// leave it (DiskTier announces them as the disk tier's events). Called
  /// inside the store's calls; must not throw.
  class Listener {
   public:
    virtual ~Listener() = default;
    /// `hashes` became visible (put): their data and records are durable.
    virtual void stored(std::span<const BlockHash> hashes) noexcept = 0;
    /// `hashes` left the store: evicted for newer blocks, dropped after a
    /// failed or corrupted read, erased, or lost with a deleted file.
    virtual void removed(std::span<const BlockHash> hashes) noexcept = 0;
  };

  /// Opens (or creates) the store. Cost: the data file's preallocation
  /// (fallocate, at every writer's open) and one pass over the index,
  /// streamed through a 256 KiB buffer (memory O(num_slots) whatever the
  /// index's size; an index mostly of superseded records is rewritten).
  /// Every file of the store is opened without following symbolic links and
  /// must be a regular file. A refused open leaves the directory as it was:
  /// what this open made (directories, description, lock, data and index
  /// files) is removed again. Throws InvalidArgument with one line that
  /// names the reason: options out of range, a directory that cannot be
  /// created or written, a non-empty directory that is not a store (no
  /// kvport-disk.json: nothing in it is deleted or overwritten), a file of
  /// the store that is a symbolic link, FIFO, directory or device (naming
  /// it), a description that is not one (naming the field), one made for
  /// another layout (naming the first differing field) or slot count, one
  /// held by another process, not enough space for the data file (ENOSPC at
  /// preallocation).
  static std::unique_ptr<DiskStore> open(const DiskStoreOptions& options);
  ~DiskStore();
  DiskStore(const DiskStore&) = delete;
  DiskStore& operator=(const DiskStore&) = delete;

  /// Writes `images[i]` (block_bytes each) under `hashes[i]` for every block
  /// admitted (note_hits, min_hits) and not stored already, evicting least
  /// recently used blocks for slots. Returns how many were published (durable
  /// and visible). Failures are counted, never thrown; throws InvalidArgument
  /// for spans of different sizes or an image of the wrong size.
  std::size_t put(std::span<const BlockHash> hashes,
                  std::span<const std::span<const std::byte>> images);

  /// How many of hashes[0..] are stored, in order, stopping at the first one
  /// that is not (no I/O).
  std::size_t match_prefix(std::span<const BlockHash> hashes) const;

  /// Reads the longest stored, verified prefix of `hashes` into `out[i]`
  /// (block_bytes each) and returns its length; `out` holds at least as
  /// many buffers as hashes, and those past the returned length may have
  /// been written too. A block that fails (read error, short read, checksum
  /// mismatch) is dropped and ends the prefix; one past the deadline ends it
  /// too. Throws InvalidArgument for too few or mis-sized buffers.
  std::size_t get_prefix(std::span<const BlockHash> hashes,
                         std::span<const std::span<std::byte>> out);

  /// Whether `hash` is stored and visible.
  bool contains(const BlockHash& hash) const;
  /// Makes each stored one of `hashes` the most recently used (no I/O).
  void touch(std::span<const BlockHash> hashes);
  /// Removes `hash` (an exclusive tier's onload); false when absent.
  bool erase(const BlockHash& hash);
  /// Counts one hit of each hash (for the admission filter; a no-op while
  /// min_hits is 0).
  void note_hits(std::span<const BlockHash> hashes);
  /// Appends the records still pending (erasures) and syncs the index.
  void flush();

  std::size_t size() const noexcept;       ///< blocks stored and visible
  std::size_t num_slots() const noexcept;  ///< capacity
  std::size_t block_bytes() const noexcept;
  /// Slots held back: their last write is still in the kernel's hands after
  /// its deadline.
  std::size_t quarantined_slots() const noexcept;
  /// Whether a file of the store was found deleted under the process.
  bool detached() const noexcept;
  /// Whether the index could not be written at the last try (no room for a
  /// put's records, or an append or sync failed). Meanwhile put() evicts no
  /// stored block (it takes free slots only, and a put whose records find
  /// no room is refused before it writes anything), and get_prefix() serves
  /// what is durable. Each cause has its own end: no room ends at the first
  /// reservation that succeeds; a failed append or sync ends at the first
  /// append (written and synced) that succeeds (a reservation says nothing
  /// of whether writes work). O(1).
  bool index_failing() const noexcept;
  /// "io_uring (queue depth 16), O_DIRECT; preallocated": the data file's I/O
  /// path and any fallback in use, with its reason ("; sparse (no
  /// fallocate)" where the file system has none, "; sparse (preallocation
  /// failed: No space left on device)" where an existing store's full-size
  /// data file could not get its blocks at this open; "; index cannot be
  /// written" while index_failing()).
  std::string io_description() const;
  const DiskStoreOptions& options() const noexcept;
  const DiskStoreCounters& counters() const noexcept;
  /// Tells `listener` (nullptr: none) of every block that becomes visible
  /// (put, once durable) and every one that leaves (evicted, dropped after a
  /// failed read or at detach, erased). It must stay valid until replaced.
  void set_listener(Listener* listener) noexcept;
  /// Stored hashes, least recently used first. O(n): for tests and
  /// snapshots (DiskTier::stored_hashes).
  std::vector<BlockHash> lru_order() const;
  /// Empty when consistent: every slot free, stored, or quarantined, exactly
  /// once; the index, the LRU order and the slots agree. O(num_slots).
  std::vector<std::string> check_invariants() const;

 private:
  struct State;
  explicit DiskStore(std::unique_ptr<State> state);
  std::unique_ptr<State> state_;
};

}  // namespace kvport::disk
