// SPDX-License-Identifier: Apache-2.0
#include "kvport/disk/disk_store.hpp"

#include <fcntl.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <sys/statvfs.h>
#include <unistd.h>

#include <absl/container/flat_hash_map.h>
#include <absl/container/flat_hash_set.h>
#include <fmt/format.h>

#include <algorithm>
#include <array>
#include <boost/intrusive/list.hpp>
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <nlohmann/json.hpp>
#include <optional>
#include <system_error>
#include <utility>

#define XXH_INLINE_ALL
#include <xxhash.h>

#include "kvport/core/dtype.hpp"
#include "kvport/platform/div_ceil.hpp"
#include "kvport/platform/error.hpp"
#include "kvport/platform/log.hpp"
#include "store_file.hpp"

namespace kvport::disk {

namespace {

using Clock = std::chrono::steady_clock;
namespace fs = std::filesystem;
namespace bi = boost::intrusive;

constexpr const char* kMetaName = "kvport-disk.json";
constexpr const char* kLockName = "kvport-disk.lock";
constexpr const char* kDataName = "blocks.dat";
constexpr const char* kIndexName = "index.log";
constexpr const char* kFormat = "kvport-disk-tier";
constexpr int kFormatVersion = 1;
constexpr const char* kHashScheme = "xxh3-128 chained, unseeded";

// ---- index records ----------------------------------------------------------------------
// 64 bytes, little-endian: magic, kind, 3 pad, slot, bytes | seq, hash low,
// hash high, checksum of the block's bytes, reserved, checksum of the 56
// bytes before it.
constexpr std::size_t kRecordBytes = 64;
// Records read at once when the index is replayed at open (256 KiB).
constexpr std::uint64_t kIndexChunkRecords = 4096;
constexpr std::uint32_t kRecordMagic = 0x5244564Bu;  // "KVDR"
enum class RecordKind : std::uint8_t { put = 1, erase = 2 };

struct Record {
  RecordKind kind = RecordKind::put;
  std::uint32_t slot = 0;
  std::uint32_t bytes = 0;
  std::uint64_t seq = 0;
  BlockHash hash;
  std::uint64_t checksum = 0;
};

void put_le(std::byte* p, std::uint64_t v, std::size_t n) {
  for (std::size_t i = 0; i < n; ++i)
    p[i] = static_cast<std::byte>((v >> (8 * i)) & 0xFF);
}
std::uint64_t get_le(const std::byte* p, std::size_t n) {
  std::uint64_t v = 0;
  for (std::size_t i = 0; i < n; ++i)
    v |= std::uint64_t{std::to_integer<std::uint8_t>(p[i])} << (8 * i);
  return v;
}

void encode(const Record& r, std::byte* out) {
  std::memset(out, 0, kRecordBytes);
  put_le(out, kRecordMagic, 4);
  out[4] = static_cast<std::byte>(r.kind);
  put_le(out + 8, r.slot, 4);
  put_le(out + 12, r.bytes, 4);
  put_le(out + 16, r.seq, 8);
  put_le(out + 24, r.hash.low, 8);
  put_le(out + 32, r.hash.high, 8);
  put_le(out + 40, r.checksum, 8);
  put_le(out + 56, XXH3_64bits(out, 56), 8);
}

std::optional<Record> decode(const std::byte* in) {
  if (get_le(in, 4) != kRecordMagic) return std::nullopt;
  if (get_le(in + 56, 8) != XXH3_64bits(in, 56)) return std::nullopt;
  const auto kind = std::to_integer<std::uint8_t>(in[4]);
  if (kind != 1 && kind != 2) return std::nullopt;
  Record r;
  r.kind = static_cast<RecordKind>(kind);
  r.slot = static_cast<std::uint32_t>(get_le(in + 8, 4));
  r.bytes = static_cast<std::uint32_t>(get_le(in + 12, 4));
  r.seq = get_le(in + 16, 8);
  r.hash.low = get_le(in + 24, 8);
  r.hash.high = get_le(in + 32, 8);
  r.checksum = get_le(in + 40, 8);
  return r;
}

std::uint64_t checksum_of(const std::byte* p, std::size_t n) {
  return XXH3_64bits(p, n);
}

// Adds the time since `start` to a counter of nanoseconds.
void add_elapsed(std::uint64_t& ns, Clock::time_point start) {
  ns += static_cast<std::uint64_t>(
      std::chrono::duration_cast<std::chrono::nanoseconds>(Clock::now() - start).count());
}

std::string errno_text(int e) {
  return std::strerror(e);
}

// ---- slots ------------------------------------------------------------------------------

enum class SlotState : std::uint8_t { free, writing, stored, quarantined };

struct Slot {
  bi::list_member_hook<bi::link_mode<bi::normal_link>> lru_hook;
  BlockHash hash;
  std::uint64_t checksum = 0;
  SlotState state = SlotState::free;
};

using Lru = bi::list<
    Slot,
    bi::member_hook<Slot, bi::list_member_hook<bi::link_mode<bi::normal_link>>, &Slot::lru_hook>,
    bi::constant_time_size<true>>;

struct AlignedFree {
  void operator()(std::byte* p) const noexcept { std::free(p); }
};

// Writes a whole small file durably: a temporary beside it, fsync, rename,
// fsync of the directory. The temporary is the store's own name: whatever is
// there (a leftover of a crash, a link planted there) is unlinked first and
// the file made anew (O_EXCL, never through a link).
void write_file_durably(const fs::path& path, const std::string& text) {
  const fs::path tmp = path.string() + ".tmp";
  if (::unlink(tmp.c_str()) != 0 && errno != ENOENT) {
    throw InvalidArgument("cannot remove " + tmp.string() + ": " + errno_text(errno));
  }
  const int fd = detail::open_regular(tmp, O_WRONLY | O_CREAT | O_EXCL);
  if (fd < 0) throw InvalidArgument(detail::open_failure(tmp, errno, "write"));
  std::size_t done = 0;
  while (done < text.size()) {
    const ssize_t n = ::write(fd, text.data() + done, text.size() - done);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) {
      const int e = n < 0 ? errno : EIO;
      ::close(fd);
      (void)::unlink(tmp.c_str());
      throw InvalidArgument("cannot write " + tmp.string() + ": " + errno_text(e));
    }
    done += static_cast<std::size_t>(n);
  }
  const bool synced = ::fsync(fd) == 0;
  const int sync_error = errno;
  ::close(fd);
  if (!synced) {
    (void)::unlink(tmp.c_str());
    throw InvalidArgument("cannot sync " + tmp.string() + ": " + errno_text(sync_error));
  }
  std::error_code ec;
  fs::rename(tmp, path, ec);
  if (ec) {
    (void)::unlink(tmp.c_str());
    throw InvalidArgument("cannot rename " + tmp.string() + ": " + ec.message());
  }
  const int dfd = ::open(path.parent_path().c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (dfd >= 0) {
    (void)::fsync(dfd);
    ::close(dfd);
  }
}

// The description file's text: a regular file (never through a link, never
// a FIFO) of at most kMaxMetaBytes.
constexpr std::size_t kMaxMetaBytes = 1 << 20;
std::string read_description(const fs::path& path) {
  const detail::UniqueFd fd(detail::open_regular(path, O_RDONLY));
  if (fd.get() < 0) throw InvalidArgument(detail::open_failure(path, errno, "read"));
  std::string text;
  std::array<char, 4096> chunk{};
  for (;;) {
    const ssize_t n = ::read(fd.get(), chunk.data(), chunk.size());
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) {
      const int e = errno;
      throw InvalidArgument("cannot read " + path.string() + ": " + errno_text(e));
    }
    if (n == 0) break;
    text.append(chunk.data(), static_cast<std::size_t>(n));  // may throw: fd closes
    if (text.size() > kMaxMetaBytes) {
      throw InvalidArgument(fmt::format("{} is larger than {} bytes: not a disk store description",
                                        path.string(), kMaxMetaBytes));
    }
  }
  return text;
}

// Whether something (of any kind, a dangling link included) has this name.
bool name_taken(const fs::path& path) {
  struct stat st {};
  return ::lstat(path.c_str(), &st) == 0;
}

nlohmann::json meta_json(const DiskStoreOptions& o, std::size_t stride) {
  nlohmann::json layout = nlohmann::json::array();
  for (const LayoutField& f : o.layout)
    layout.push_back({{"name", f.name}, {"value", f.value}});
  return {{"format", kFormat},        {"version", kFormatVersion},    {"hash", kHashScheme},
          {"num_slots", o.num_slots}, {"block_bytes", o.block_bytes}, {"slot_stride", stride},
          {"layout", layout}};
}

// The first difference between the directory's description and this
// process's, as "field 'x' is A in the directory, B here"; empty when none.
std::string first_difference(const nlohmann::json& disk, const nlohmann::json& here) {
  for (const char* key : {"format", "version", "hash", "block_bytes", "slot_stride", "num_slots"}) {
    if (!disk.contains(key)) return fmt::format("field '{}' is missing in the directory", key);
    if (disk.at(key) != here.at(key)) {
      return fmt::format("field '{}' is {} in the directory, {} here", key, disk.at(key).dump(),
                         here.at(key).dump());
    }
  }
  const nlohmann::json& a = disk.contains("layout") ? disk.at("layout") : nlohmann::json::array();
  const nlohmann::json& b = here.at("layout");
  if (!a.is_array()) return "field 'layout' is not a list in the directory";
  for (std::size_t i = 0; i < a.size(); ++i) {
    const nlohmann::json& e = a[i];
    if (!e.is_object() || !e.contains("name") || !e.at("name").is_string() ||
        !e.contains("value") || !e.at("value").is_string()) {
      std::string text = e.dump();
      if (text.size() > 60) text = text.substr(0, 57) + "...";
      return fmt::format(
          "field 'layout' entry {} is {} in the directory, not an object with a string 'name' "
          "and 'value'",
          i, text);
    }
  }
  const std::size_t n = std::max(a.size(), b.size());
  for (std::size_t i = 0; i < n; ++i) {
    if (i >= a.size()) {
      return fmt::format("layout field '{}' is missing in the directory",
                         b[i].value("name", std::string()));
    }
    if (i >= b.size()) {
      return fmt::format("layout field '{}' of the directory is missing here",
                         a[i].value("name", std::string()));
    }
    if (a[i] != b[i]) {
      const std::string name = b[i].value("name", std::string());
      const std::string other = a[i].value("name", std::string());
      if (name != other) {
        return fmt::format("layout field {} is '{}' in the directory, '{}' here", i, other, name);
      }
      return fmt::format("layout field '{}' is '{}' in the directory, '{}' here", name,
                         a[i].value("value", std::string()), b[i].value("value", std::string()));
    }
  }
  return {};
}

}  // namespace

std::vector<LayoutField> layout_fields(const KvCacheConfig& config) {
  config.validate();
  std::vector<LayoutField> f;
  f.push_back({"image", "each layer's K block then its V block, in layer order"});
  f.push_back({"block_size", std::to_string(config.block_size)});
  f.push_back({"num_layers", std::to_string(config.num_layers)});
  f.push_back({"num_kv_heads", std::to_string(config.num_kv_heads)});
  f.push_back({"head_dim_k", std::to_string(config.head_dim_k)});
  f.push_back({"head_dim_v", std::to_string(config.head_dim_v)});
  // Each layer's dtype and bytes, as runs: "bf16 x 32 (K 4096 + V 4096)".
  std::string dtypes;
  for (std::size_t l = 0; l < config.num_layers;) {
    const KvCacheDtype d = config.dtype_for_layer(l);
    const std::size_t k = config.k_block_bytes(l);
    const std::size_t v = config.has_v() ? config.v_block_bytes(l) : 0;
    std::size_t run = 1;
    while (l + run < config.num_layers && config.dtype_for_layer(l + run) == d)
      ++run;
    if (!dtypes.empty()) dtypes += ", ";
    dtypes += fmt::format("{} x {} (K {} + V {})", to_string(d), run, k, v);
    l += run;
  }
  f.push_back({"layer_dtypes", dtypes});
  f.push_back({"bytes_per_block", std::to_string(config.bytes_per_block())});
  f.push_back({"hash", kHashScheme});
  return f;
}

// ---- the store's state ------------------------------------------------------------------

struct DiskStore::State {
  DiskStoreOptions options;
  std::size_t stride = 0;  // bytes of a slot in the data file
  fs::path dir;
  int lock_fd = -1;
  std::unique_ptr<FileIo> data;
  // Why a writer's data file is sparse although the file system has
  // fallocate (empty: it has none, or the file is preallocated).
  std::string sparse_why;
  std::unique_ptr<FileIo> index;
  std::uint64_t index_end = 0;  // where the next record goes
  std::uint64_t next_seq = 1;

  std::vector<Slot> slots;
  std::vector<std::uint32_t> free_slots;  // LIFO
  absl::flat_hash_map<BlockHash, std::uint32_t, BlockHashHasher> by_hash;
  Lru lru;
  absl::flat_hash_map<BlockHash, std::uint32_t, BlockHashHasher> hits;  // admission counts

  std::unique_ptr<std::byte, AlignedFree> staging;
  std::vector<std::uint32_t> free_staging;
  // I/Os orphaned at their deadline, by their tags: a read holds its staging
  // buffer (tag: the buffer), a write its slot and maybe a buffer (tag: the
  // slot, with kWriteTag set).
  static constexpr std::uint64_t kWriteTag = std::uint64_t{1} << 63;
  absl::flat_hash_map<std::uint64_t, std::optional<std::uint32_t>> orphaned_writes;  // slot -> buf
  absl::flat_hash_map<std::uint64_t, std::uint32_t> orphaned_reads;                  // tag -> buf
  std::uint64_t next_read_tag = 1;  // below kWriteTag
  std::size_t quarantined = 0;

  std::vector<Record> pending;  // erase records not yet appended
  FileIoOptions index_io;       // how the index is (re)opened
  bool detached = false;
  // Why the index could not be written at the last try, if it could not:
  // no room to reserve for a put's records (cleared by a reservation that
  // succeeds), or a failed append or sync (cleared by one that succeeds).
  // Meanwhile puts evict nothing: a good block is never given up for one
  // that may not be recorded.
  enum class IndexTrouble : std::uint8_t { none, no_room, failed };
  IndexTrouble index_trouble = IndexTrouble::none;
  DiskStore::Listener* listener = nullptr;
  DiskStoreCounters counters;

  ~State() {
    // The files first: their destructors wait for orphaned I/O, which may
    // still use the staging buffers.
    data.reset();
    index.reset();
    staging.reset();
    if (lock_fd >= 0) ::close(lock_fd);
  }

  std::byte* buffer(std::uint32_t k) const { return staging.get() + std::size_t{k} * stride; }

  void reap(bool wait) {
    if (!data) return;
    for (std::uint64_t tag : data->reap_orphans(wait)) {
      if ((tag & kWriteTag) != 0) {
        const auto slot = static_cast<std::uint32_t>(tag & ~kWriteTag);
        const auto it = orphaned_writes.find(slot);
        if (it == orphaned_writes.end()) continue;
        if (it->second) free_staging.push_back(*it->second);
        --quarantined;
        release_slot(slot);
        orphaned_writes.erase(it);
      } else if (const auto r = orphaned_reads.find(tag); r != orphaned_reads.end()) {
        free_staging.push_back(r->second);
        orphaned_reads.erase(r);
      }
    }
  }

  // A file of the store was deleted under the process: what it holds can
  // no longer persist, so it serves and takes nothing from now on.
  bool check_detached() {
    if (detached) return true;
    if (data->linked() && index->linked()) return false;
    detached = true;
    counters.dropped_detached += by_hash.size();
    log::warn(
        fmt::format("disk tier {}: a file of the store was deleted under the process; "
                    "its {} blocks are dropped and it takes no more",
                    dir.string(), by_hash.size()));
    std::vector<BlockHash> lost;
    for (const auto& [hash, slot] : by_hash) {
      lru.erase(lru.iterator_to(slots[slot]));
      release_slot(slot);
      if (listener != nullptr) lost.push_back(hash);
    }
    by_hash.clear();
    if (listener != nullptr && !lost.empty()) listener->removed(lost);
    return true;
  }

  void release_slot(std::uint32_t slot) {
    Slot& s = slots[slot];
    s.state = SlotState::free;
    free_slots.push_back(slot);
  }

  // Makes a stored slot the most recently used.
  void touch(Slot& sl) noexcept { lru.splice(lru.end(), lru, lru.iterator_to(sl)); }

  // Drops a stored block (failed read, bad checksum, erase): invisible at
  // once; an erase record follows with the next append.
  void drop(std::uint32_t slot) {
    Slot& s = slots[slot];
    by_hash.erase(s.hash);
    lru.erase(lru.iterator_to(s));
    if (listener != nullptr) listener->removed({&s.hash, 1});
    if (!options.read_only) {
      pending.push_back(Record{RecordKind::erase, slot,
                               static_cast<std::uint32_t>(options.block_bytes), next_seq++, s.hash,
                               s.checksum});
    }
    release_slot(slot);
  }

  // A slot for a new block: a free one, else the least recently used
  // block's (dropped from the index before its slot is overwritten).
  // While the index cannot be written, no block is evicted: free slots only.
  std::optional<std::uint32_t> take_slot() {
    if (!free_slots.empty()) {
      const std::uint32_t slot = free_slots.back();
      free_slots.pop_back();
      return slot;
    }
    if (lru.empty() || index_trouble != IndexTrouble::none) return std::nullopt;
    Slot& victim = lru.front();
    const auto slot = static_cast<std::uint32_t>(&victim - slots.data());
    by_hash.erase(victim.hash);
    lru.pop_front();
    if (listener != nullptr) listener->removed({&victim.hash, 1});
    victim.state = SlotState::free;
    ++counters.evictions;
    return slot;
  }

  // Rewrites the index with one put record per stored block, least
  // recently used first (renumbered, so a restart finds the same LRU order),
  // through a temporary file synced and renamed over it. An index of mostly
  // superseded records shrinks to the live ones; the pending erasures are in
  // it. False, the old index kept, when the new one cannot be written.
  bool compact() {
    std::string text(by_hash.size() * kRecordBytes, '\0');
    std::uint64_t seq = next_seq;
    std::size_t i = 0;
    for (const Slot& sl : lru) {
      const auto slot = static_cast<std::uint32_t>(&sl - slots.data());
      encode(Record{RecordKind::put, slot, static_cast<std::uint32_t>(options.block_bytes), seq++,
                    sl.hash, sl.checksum},
             reinterpret_cast<std::byte*>(text.data()) + i++ * kRecordBytes);
    }
    const auto t0 = Clock::now();
    try {
      write_file_durably(dir / kIndexName, text);
      std::unique_ptr<FileIo> fresh = open_file_io(dir / kIndexName, index_io);
      index = options.wrap_io ? options.wrap_io("index", std::move(fresh)) : std::move(fresh);
    } catch (const std::exception& e) {
      // The old index still names every block (its name may be gone: a
      // failed reopen after the rename detaches the store, failing closed).
      log::warn(
          fmt::format("disk tier {}: compacting the index failed: {}", dir.string(), e.what()));
      add_elapsed(counters.index_ns, t0);
      return false;
    }
    add_elapsed(counters.index_ns, t0);
    next_seq = seq;
    index_end = text.size();
    pending.clear();
    ++counters.journal_compactions;
    return true;
  }

  // Appends `records` (after the pending erasures) and syncs the index.
  // True when durable.
  bool append(std::vector<Record> records) {
    if (!pending.empty()) {
      records.insert(records.begin(), pending.begin(), pending.end());
    }
    if (records.empty()) return true;
    std::vector<std::byte> bytes(records.size() * kRecordBytes);
    for (std::size_t i = 0; i < records.size(); ++i)
      encode(records[i], bytes.data() + i * kRecordBytes);
    const auto t0 = Clock::now();
    const IoRequest req{IoOp::write, index_end, bytes.data(), bytes.size(), 0};
    IoResult res;
    index->run(std::span(&req, 1), std::span(&res, 1), options.io_timeout);
    int error = res.error;
    if (error == 0) error = index->sync();
    add_elapsed(counters.index_ns, t0);
    if (error != 0) {
      index_failed(IndexTrouble::failed, error);
      return false;
    }
    index_end += bytes.size();
    pending.clear();
    index_recovered(IndexTrouble::failed);
    return true;
  }

  // The index could not be written (counted; said once until it can be).
  void index_failed(IndexTrouble why, int error) {
    ++counters.index_failures;
    if (index_trouble == IndexTrouble::none) {
      log::warn(fmt::format(
          "disk tier {}: the index cannot be written ({}: {}); puts evict nothing and take only "
          "free slots until it can, and what is stored is still served",
          dir.string(),
          why == IndexTrouble::no_room ? "no room for its records" : "append or sync failed",
          errno_text(error)));
    }
    index_trouble = why;
  }

  void index_recovered(IndexTrouble cleared) {
    if (index_trouble != cleared) return;
    index_trouble = IndexTrouble::none;
    log::info(fmt::format("disk tier {}: the index can be written again", dir.string()));
  }

  // Room for `records` more records after the pending ones, reserved before
  // any slot is taken for them: a full file system refuses the put here, with
  // no block evicted and no data written. False (counted) when refused.
  bool reserve_index(std::size_t records) {
    const std::uint64_t bytes = (pending.size() + records) * std::uint64_t{kRecordBytes};
    const auto t0 = Clock::now();
    const int e = index->reserve(index_end, bytes);
    add_elapsed(counters.index_ns, t0);
    if (e != 0) {
      index_failed(IndexTrouble::no_room, e);
      return false;
    }
    index_recovered(IndexTrouble::no_room);
    return true;
  }

  void note_timeout_or_failure(int error, std::uint64_t& failures) {
    if (error == ETIMEDOUT) {
      ++counters.timeouts;
    } else {
      ++failures;
    }
  }

  // One block of a put: its slot, hash and image, the staging buffer it
  // went through (none when written straight from an aligned image) and its
  // checksum.
  struct Item {
    std::uint32_t slot;
    BlockHash hash;
    const std::byte* image;
    std::optional<std::uint32_t> buf;
    std::uint64_t checksum = 0;
  };

  // An image the kernel can write from as it is: 4096-aligned and a whole
  // slot long. A write orphaned at its deadline is never published, so the
  // caller reusing it cannot corrupt a visible block.
  bool direct_from(const std::byte* image) const {
    return options.block_bytes == stride &&
           reinterpret_cast<std::uintptr_t>(image) % kDirectAlignment == 0;
  }

  // Writes one wave (at most queue_depth blocks, staging buffers taken for
  // those that need one); appends the written ones to `written`.
  void write_wave(std::vector<Item>& wave, std::vector<Item>& written) {
    std::vector<IoRequest> reqs(wave.size());
    std::vector<IoResult> results(wave.size());
    for (std::size_t k = 0; k < wave.size(); ++k) {
      Item& it = wave[k];
      const std::byte* from = it.image;
      if (it.buf) {
        std::byte* b = buffer(*it.buf);
        std::memcpy(b, it.image, options.block_bytes);
        from = b;
      }
      slots[it.slot].state = SlotState::writing;
      // The kernel only reads a write's buffer.
      reqs[k] = IoRequest{IoOp::write, std::uint64_t{it.slot} * stride,
                          const_cast<std::byte*>(from), stride, kWriteTag | it.slot};
    }
    // Each written block's checksum is taken as its write completes, while
    // the others are in flight (the buffer is unchanged: the caller's image
    // is stable during put, a staging buffer is ours).
    const auto t0 = Clock::now();
    data->run(reqs, results, options.io_timeout, [&](std::size_t k) {
      if (results[k].error == 0)
        wave[k].checksum = checksum_of(reqs[k].buffer, options.block_bytes);
    });
    add_elapsed(counters.write_ns, t0);
    for (std::size_t k = 0; k < wave.size(); ++k) {
      Item& it = wave[k];
      if (results[k].orphaned) {
        // The kernel may still write this slot (from this buffer): both are
        // held until it is done (reap).
        slots[it.slot].state = SlotState::quarantined;
        ++quarantined;
        orphaned_writes.emplace(it.slot, it.buf);
        ++counters.timeouts;
        continue;
      }
      if (it.buf) free_staging.push_back(*it.buf);
      if (results[k].error != 0) {
        note_timeout_or_failure(results[k].error, counters.write_failures);
        release_slot(it.slot);
        continue;
      }
      written.push_back(it);
    }
    wave.clear();
  }

  // Syncs the data written, appends its records, syncs the index, and only
  // then publishes the blocks. Returns how many were published.
  std::size_t publish(std::vector<Item>& written) {
    if (written.empty()) return 0;
    const auto fail = [&] {
      counters.write_failures += written.size();
      for (const Item& it : written)
        release_slot(it.slot);
      return std::size_t{0};
    };
    const auto t0 = Clock::now();
    const bool synced = data->sync() == 0;
    add_elapsed(counters.write_ns, t0);
    if (!synced) return fail();
    std::vector<Record> records;
    records.reserve(written.size());
    for (const Item& it : written) {
      records.push_back(Record{RecordKind::put, it.slot,
                               static_cast<std::uint32_t>(options.block_bytes), next_seq++, it.hash,
                               it.checksum});
    }
    if (!append(records)) return fail();
    for (std::size_t i = 0; i < written.size(); ++i) {
      Slot& s = slots[written[i].slot];
      s.hash = records[i].hash;
      s.checksum = records[i].checksum;
      s.state = SlotState::stored;
      lru.push_back(s);
      by_hash.emplace(s.hash, written[i].slot);
      ++counters.writes;
      counters.write_bytes += options.block_bytes;
    }
    if (listener != nullptr) {
      std::vector<BlockHash> stored;
      stored.reserve(records.size());
      for (const Record& r : records)
        stored.push_back(r.hash);
      listener->stored(stored);
    }
    return written.size();
  }
};

// ---- open -------------------------------------------------------------------------------

namespace {

void check_options(const DiskStoreOptions& o) {
  if (o.dir.empty()) throw InvalidArgument("disk tier: no directory given");
  if (o.num_slots == 0 || o.num_slots > DiskStoreOptions::kMaxSlots) {
    throw InvalidArgument(fmt::format("disk tier: num_slots must be in [1, {}], got {}",
                                      DiskStoreOptions::kMaxSlots, o.num_slots));
  }
  if (o.block_bytes == 0 || o.block_bytes > DiskStoreOptions::kMaxBlockBytes) {
    throw InvalidArgument(fmt::format("disk tier: block_bytes must be in [1, {}], got {}",
                                      DiskStoreOptions::kMaxBlockBytes, o.block_bytes));
  }
  if (o.queue_depth == 0 || o.queue_depth > 1024) {
    throw InvalidArgument(
        fmt::format("disk tier: queue_depth must be in [1, 1024], got {}", o.queue_depth));
  }
  if (o.io_timeout < std::chrono::milliseconds(1) || o.io_timeout > std::chrono::hours(1)) {
    throw InvalidArgument(fmt::format("disk tier: io_timeout must be in [1 ms, 1 hour], got {} ms",
                                      o.io_timeout.count()));
  }
}

}  // namespace

namespace {

// What one open made (directories, files), removed again when the open is
// refused: a refused open leaves the directory as it found it, but for the
// lock file (never removed, see open()). Only what this open created is
// ever removed.
class Undo {
 public:
  Undo() = default;
  Undo(const Undo&) = delete;
  Undo& operator=(const Undo&) = delete;
  ~Undo() {
    if (done_) return;
    std::error_code ec;
    for (auto it = made_.rbegin(); it != made_.rend(); ++it)
      fs::remove(*it, ec);  // a directory only when empty again
  }
  void made(const fs::path& path) { made_.push_back(path); }
  void keep() noexcept { done_ = true; }

 private:
  std::vector<fs::path> made_;
  bool done_ = false;
};

// Names a store may hold before its description exists: the lock (made by
// a store being made, or left by a refused open) and the description's
// temporary (a crash while the store was being made).
bool part_of_a_new_store(const fs::path& name) {
  return name == kLockName || name == std::string(kMetaName) + ".tmp";
}

// The entries of `dir` that no new store would have made, at most 3 names
// (for the message) and whether there are more.
std::vector<std::string> foreign_entries(const fs::path& dir, bool& more) {
  std::vector<std::string> names;
  more = false;
  std::error_code ec;
  for (fs::directory_iterator it(dir, ec), end; !ec && it != end; it.increment(ec)) {
    const fs::path name = it->path().filename();
    if (part_of_a_new_store(name)) continue;
    if (names.size() == 3) {
      more = true;
      break;
    }
    names.push_back(name.string());
  }
  if (ec) names.push_back("(cannot list it: " + ec.message() + ")");
  return names;
}

}  // namespace

std::unique_ptr<DiskStore> DiskStore::open(const DiskStoreOptions& options) {
  check_options(options);
  Undo undo;  // declared first: runs after the state (its files) is closed
  auto st = std::make_unique<State>();
  State& s = *st;
  s.options = options;
  s.stride = round_up(options.block_bytes, kDirectAlignment);
  s.dir = options.dir;
  const std::string where = "disk tier " + s.dir.string();
  const std::uint64_t data_bytes = std::uint64_t{options.num_slots} * s.stride;

  std::error_code ec;
  if (!fs::exists(s.dir, ec)) {
    if (options.read_only) throw InvalidArgument(where + ": no such directory");
    // The directories this open makes, outermost first.
    std::vector<fs::path> missing;
    for (fs::path p = s.dir; !p.empty() && !name_taken(p); p = p.parent_path()) {
      missing.push_back(p);
      if (p == p.parent_path()) break;
    }
    fs::create_directories(s.dir, ec);
    if (ec) throw InvalidArgument(where + ": cannot create the directory: " + ec.message());
    for (auto it = missing.rbegin(); it != missing.rend(); ++it)
      undo.made(*it);
  }
  if (!fs::is_directory(s.dir, ec)) throw InvalidArgument(where + ": not a directory");
  if (!options.read_only && ::access(s.dir.c_str(), W_OK) != 0) {
    throw InvalidArgument(where + ": the directory is not writable: " + errno_text(errno));
  }

  // A directory without a description is a store only when it is empty (or
  // holds what a store being made had made): kvport never deletes or
  // overwrites a file it did not make.
  const fs::path meta_path = s.dir / kMetaName;
  const auto refuse_foreign = [&] {
    bool more = false;
    const std::vector<std::string> names = foreign_entries(s.dir, more);
    // Another open may have made the store meanwhile (the first check runs
    // before the lock): then it is a store, and the lock decides.
    if (names.empty() || name_taken(meta_path)) return;
    std::string list;
    for (const std::string& n : names)
      list += (list.empty() ? "'" : ", '") + n + "'";
    throw InvalidArgument(fmt::format(
        "{}: not a kvport disk store (no {}) and not empty: it holds {}{}; refused (kvport never "
        "deletes or overwrites files it did not make: give an empty or new directory)",
        where, kMetaName, list, more ? " and more" : ""));
  };
  if (!options.read_only && !name_taken(meta_path)) refuse_foreign();

  // One writer, or any number of readers.
  // The lock file is never removed, not even by a refused open that made
  // it: another open may have opened the same file meanwhile (O_CREAT
  // without O_EXCL) and hold its lock; unlinking it would let a third open
  // make a new lock file and lock that one too (two writers). An empty lock
  // file left behind is harmless: a new store may hold one.
  const fs::path lock_path = s.dir / kLockName;
  s.lock_fd = detail::open_regular(lock_path, options.read_only ? O_RDONLY : O_RDWR | O_CREAT);
  if (s.lock_fd < 0) {
    const int e = errno;
    if (options.read_only && e == ENOENT) {
      throw InvalidArgument(where + ": not a disk tier (no lock file): " + errno_text(e));
    }
    throw InvalidArgument(where + ": " + detail::open_failure(lock_path, e, "open its lock file"));
  }
  if (::flock(s.lock_fd, (options.read_only ? LOCK_SH : LOCK_EX) | LOCK_NB) != 0) {
    throw InvalidArgument(where + ": in use by another process (" +
                          (options.read_only ? "writing" : "reading or writing") + ")");
  }

  // The description: compared when present, written when new.
  const nlohmann::json here = meta_json(options, s.stride);
  if (name_taken(meta_path)) {
    std::string text;
    try {
      text = read_description(meta_path);
    } catch (const InvalidArgument& e) {
      throw InvalidArgument(where + ": " + e.what());
    }
    nlohmann::json disk;
    try {
      disk = nlohmann::json::parse(text);
    } catch (const std::exception& e) {
      throw InvalidArgument(where + ": " + kMetaName + " is not valid JSON: " + e.what());
    }
    const std::string diff = first_difference(disk, here);
    if (!diff.empty()) throw InvalidArgument(where + ": made for another layout: " + diff);
  } else {
    if (options.read_only)
      throw InvalidArgument(where + ": not a disk tier (no " + kMetaName + ")");
    refuse_foreign();  // again, under the lock
    write_file_durably(meta_path, here.dump(2) + "\n");
    undo.made(meta_path);
  }

  auto wrap = [&](std::string_view name, std::unique_ptr<FileIo> io) {
    return options.wrap_io ? options.wrap_io(name, std::move(io)) : std::move(io);
  };
  FileIoOptions data_io;
  data_io.engine = options.engine;
  data_io.direct = options.direct_io;
  data_io.read_only = options.read_only;
  data_io.create = !options.read_only;
  data_io.queue_depth = options.queue_depth;
  const bool data_existed = name_taken(s.dir / kDataName);
  s.data = wrap("data", open_file_io(s.dir / kDataName, data_io));
  if (!data_existed) undo.made(s.dir / kDataName);
  FileIoOptions index_io = data_io;
  index_io.direct = false;  // 64-byte records
  index_io.engine = IoEngine::sync;
  index_io.queue_depth = 1;
  const bool index_existed = name_taken(s.dir / kIndexName);
  s.index = wrap("index", open_file_io(s.dir / kIndexName, index_io));
  if (!index_existed) undo.made(s.dir / kIndexName);

  if (!options.read_only) {
    // Allocated at every writer's open, not only at creation: a file made
    // sparse (truncated, holes punched) gets its blocks again, and
    // preallocated() says what is true of this file now.
    const fs::path data_path = s.dir / kDataName;
    const std::uint64_t had = s.data->size().value_or(0);
    // What allocating still takes from the file system: the bytes of the
    // file that have no disk blocks yet (holes, or past its end).
    struct stat data_st {};
    const std::uint64_t allocated =
        ::lstat(data_path.c_str(), &data_st) == 0 && data_st.st_blocks > 0
            ? static_cast<std::uint64_t>(data_st.st_blocks) * 512
            : 0;
    const std::uint64_t missing = data_bytes > allocated ? data_bytes - allocated : 0;
    struct statvfs vfs {};
    const bool known = ::statvfs(s.dir.c_str(), &vfs) == 0;
    const std::uint64_t free_bytes = known ? std::uint64_t{vfs.f_bavail} * vfs.f_frsize : 0;
    const auto refuse = [&](int e) {
      throw InvalidArgument(fmt::format("{}: cannot allocate {} slots of {} bytes ({} bytes{}): {}",
                                        where, options.num_slots, s.stride, data_bytes,
                                        known ? fmt::format(", {} bytes free", free_bytes) : "",
                                        errno_text(e)));
    };
    // A store whose data file has its full size works without its blocks
    // allocated (as on a file system without fallocate): its open goes on,
    // sparse, said by io_description() and a warning; a write that finds
    // the file system full fails and is counted. A new or shorter file is
    // refused.
    const bool full_size = data_existed && had >= data_bytes;
    const auto go_on_sparse = [&](int e) {
      s.sparse_why = "preallocation failed: " + errno_text(e);
      log::warn(fmt::format(
          "disk tier {}: cannot preallocate {} ({} of {} bytes without disk blocks{}): {}; the "
          "store goes on with a sparse data file, whose writes may find the file system full",
          s.dir.string(), kDataName, missing, data_bytes,
          known ? fmt::format(", {} bytes free", free_bytes) : "", errno_text(e)));
    };
    // Refused (or skipped) before allocating: a file system that cannot
    // hold the file is never filled up to the last block on the way to
    // ENOSPC.
    if (known && missing > free_bytes) {
      if (!full_size) refuse(ENOSPC);
      go_on_sparse(ENOSPC);
    } else if (const int e = s.data->allocate(data_bytes); e != 0) {
      if (!full_size) {
        // A failed fallocate may keep what it allocated: give it back (a
        // file this open made is removed by `undo`).
        if (data_existed && had < data_bytes) {
          (void)::truncate(data_path.c_str(), static_cast<off_t>(had));
        }
        refuse(e);
      }
      // What it allocated of a full-size file cannot be told from the
      // blocks written before: kept (the check above makes this rare).
      go_on_sparse(e);
    }
  }
  const std::uint64_t data_size = s.data->size().value_or(0);

  // Replay the index, streamed through a bounded buffer (an index of any
  // size costs kIndexChunkRecords records of memory): each slot belongs to
  // its last valid put record (unless an erase of the same block follows it).
  s.slots = std::vector<Slot>(options.num_slots);
  const std::uint64_t index_size = s.index->size().value_or(0);
  const std::uint64_t whole = index_size / kRecordBytes * kRecordBytes;
  if (index_size != whole) ++s.counters.dropped_at_open;  // a torn last record
  s.index_end = whole;
  const std::uint64_t n_records = whole / kRecordBytes;
  std::vector<Record> owner(options.num_slots);
  std::vector<bool> owned(options.num_slots, false);
  std::vector<std::byte> chunk(
      static_cast<std::size_t>(std::min<std::uint64_t>(n_records, kIndexChunkRecords)) *
      kRecordBytes);
  for (std::uint64_t at = 0; at < whole;) {
    const auto len = static_cast<std::size_t>(std::min<std::uint64_t>(chunk.size(), whole - at));
    const IoRequest req{IoOp::read, at, chunk.data(), len, 0};
    IoResult res;
    s.index->run(std::span(&req, 1), std::span(&res, 1), options.io_timeout);
    if (res.error != 0) {
      throw InvalidArgument(where + ": cannot read " + kIndexName + ": " + errno_text(res.error));
    }
    for (std::size_t off = 0; off < len; off += kRecordBytes) {
      const std::optional<Record> r = decode(chunk.data() + off);
      if (!r || r->slot >= options.num_slots || r->bytes != options.block_bytes) {
        ++s.counters.dropped_at_open;
        continue;
      }
      s.next_seq = std::max(s.next_seq, r->seq + 1);
      if (owned[r->slot] && owner[r->slot].seq > r->seq) continue;  // older than what we have
      if (r->kind == RecordKind::put) {
        owner[r->slot] = *r;
        owned[r->slot] = true;
      } else if (owned[r->slot] && owner[r->slot].hash == r->hash) {
        owned[r->slot] = false;
      }
    }
    at += len;
  }
  // Records past the end of a truncated data file, and the older copy of a
  // block stored twice, are dropped.
  std::vector<std::uint32_t> live;
  for (std::uint32_t slot = 0; slot < options.num_slots; ++slot) {
    if (!owned[slot]) continue;
    if ((std::uint64_t{slot} + 1) * s.stride > data_size) {
      ++s.counters.dropped_at_open;
      owned[slot] = false;
      continue;
    }
    const auto [it, inserted] = s.by_hash.emplace(owner[slot].hash, slot);
    if (!inserted) {
      if (owner[it->second].seq < owner[slot].seq) {
        owned[it->second] = false;
        it->second = slot;
      } else {
        owned[slot] = false;
      }
    }
  }
  for (std::uint32_t slot = 0; slot < options.num_slots; ++slot) {
    if (owned[slot]) live.push_back(slot);
  }
  // Oldest record first: the LRU order the store had, as far as the index
  // says (reads do not write records).
  std::sort(live.begin(), live.end(),
            [&](std::uint32_t a, std::uint32_t b) { return owner[a].seq < owner[b].seq; });
  for (std::uint32_t slot : live) {
    Slot& sl = s.slots[slot];
    sl.hash = owner[slot].hash;
    sl.checksum = owner[slot].checksum;
    sl.state = SlotState::stored;
    s.lru.push_back(sl);
  }
  s.counters.recovered = live.size();
  s.free_slots.reserve(options.num_slots);
  for (std::size_t slot = options.num_slots; slot-- > 0;) {
    if (!owned[slot]) s.free_slots.push_back(static_cast<std::uint32_t>(slot));
  }

  // Compaction: an index mostly of superseded records is rewritten with the
  // live ones alone (a temporary file, synced, renamed over).
  s.index_io = index_io;
  if (!options.read_only && n_records > 2 * live.size() + 1024) (void)s.compact();

  // Twice the queue depth: a read wave keeps the queue full while completed
  // blocks are verified and copied out. Touched now, so that no read pays
  // the page faults.
  const std::size_t n_staging = 2 * options.queue_depth;
  void* staging = std::aligned_alloc(kDirectAlignment, n_staging * s.stride);
  if (staging == nullptr) throw OutOfMemory("disk tier staging", n_staging * s.stride, 0);
  std::memset(staging, 0, n_staging * s.stride);
  s.staging.reset(static_cast<std::byte*>(staging));
  for (std::size_t k = n_staging; k-- > 0;) {
    s.free_staging.push_back(static_cast<std::uint32_t>(k));
  }
  if (s.counters.dropped_at_open > 0) {
    log::warn(
        fmt::format("{}: {} records dropped at open (torn, corrupted or past the end of "
                    "the data file); {} blocks recovered",
                    where, s.counters.dropped_at_open, s.counters.recovered));
  }
  undo.keep();
  return std::unique_ptr<DiskStore>(new DiskStore(std::move(st)));
}

DiskStore::DiskStore(std::unique_ptr<State> state) : state_(std::move(state)) {}

DiskStore::~DiskStore() {
  if (!state_->options.read_only && !state_->detached) (void)state_->append({});
}

// ---- operations -------------------------------------------------------------------------

std::size_t DiskStore::put(std::span<const BlockHash> hashes,
                           std::span<const std::span<const std::byte>> images) {
  State& s = *state_;
  if (hashes.size() != images.size()) {
    throw InvalidArgument(
        fmt::format("DiskStore::put: {} hashes but {} images", hashes.size(), images.size()));
  }
  for (std::size_t i = 0; i < images.size(); ++i) {
    if (images[i].size() != s.options.block_bytes) {
      throw InvalidArgument(fmt::format("DiskStore::put: image {} has {} bytes, blocks have {}", i,
                                        images[i].size(), s.options.block_bytes));
    }
  }
  if (hashes.empty()) return 0;
  if (s.options.read_only || s.check_detached()) {
    s.counters.dropped_puts += hashes.size();
    return 0;
  }
  s.reap(false);
  // While the store runs, the index is bounded too: every put and erase adds
  // a record, and past 4 records a slot it is rewritten with the live ones.
  if (s.index_end / kRecordBytes > 4 * std::uint64_t{s.options.num_slots} + 1024) (void)s.compact();
  // The blocks to write: not stored already, admitted.
  std::vector<std::size_t> todo;
  absl::flat_hash_set<BlockHash, BlockHashHasher> in_batch;
  for (std::size_t i = 0; i < hashes.size(); ++i) {
    const BlockHash& h = hashes[i];
    if (s.by_hash.contains(h) || in_batch.contains(h)) {
      ++s.counters.already_stored;
      continue;
    }
    if (s.options.min_hits > 0) {
      const auto it = s.hits.find(h);
      if (it == s.hits.end() || it->second < s.options.min_hits) {
        ++s.counters.not_admitted;
        continue;
      }
    }
    in_batch.insert(h);
    todo.push_back(i);
  }
  if (todo.empty()) return 0;
  if (!s.reserve_index(std::min(todo.size(), s.options.num_slots))) {
    s.counters.write_failures += todo.size();
    return 0;
  }
  std::vector<State::Item> wave;
  std::vector<State::Item> written;
  for (std::size_t i : todo) {
    // Images written straight from the caller's memory need no buffer, and
    // FileIo keeps queue_depth of them in flight: one wave takes them all.
    const bool direct = s.direct_from(images[i].data());
    if (!direct && s.free_staging.empty()) s.write_wave(wave, written);
    if (!direct && s.free_staging.empty()) {  // every buffer held by orphaned I/O
      ++s.counters.dropped_puts;
      continue;
    }
    const std::optional<std::uint32_t> slot = s.take_slot();
    if (!slot) {
      ++s.counters.dropped_puts;
      continue;
    }
    std::optional<std::uint32_t> buf;
    if (!direct) {
      buf = s.free_staging.back();
      s.free_staging.pop_back();
    }
    wave.push_back(State::Item{*slot, hashes[i], images[i].data(), buf, 0});
  }
  if (!wave.empty()) s.write_wave(wave, written);
  return s.publish(written);
}

std::size_t DiskStore::match_prefix(std::span<const BlockHash> hashes) const {
  const State& s = *state_;
  std::size_t n = 0;
  while (n < hashes.size() && s.by_hash.contains(hashes[n]))
    ++n;
  return n;
}

std::size_t DiskStore::get_prefix(std::span<const BlockHash> hashes,
                                  std::span<const std::span<std::byte>> out) {
  State& s = *state_;
  if (out.size() < hashes.size()) {
    throw InvalidArgument(
        fmt::format("DiskStore::get_prefix: {} buffers for {} hashes", out.size(), hashes.size()));
  }
  for (std::size_t i = 0; i < hashes.size(); ++i) {
    if (out[i].size() != s.options.block_bytes) {
      throw InvalidArgument(
          fmt::format("DiskStore::get_prefix: buffer {} has {} bytes, blocks have {}", i,
                      out[i].size(), s.options.block_bytes));
    }
  }
  if (hashes.empty() || s.check_detached()) return 0;
  s.reap(false);
  const std::size_t n = match_prefix(hashes);
  if (n == 0) return 0;
  // One batch: each read takes a staging buffer as it is issued (prepare)
  // and gives it back once its block is verified and copied out
  // (on_complete), so the queue stays full over any number of blocks.
  std::vector<IoRequest> reqs(n);
  std::vector<IoResult> results(n);
  std::vector<std::uint32_t> slots(n);
  std::vector<std::optional<std::uint32_t>> bufs(n);
  std::vector<char> verified(n, 0);
  for (std::size_t k = 0; k < n; ++k) {
    slots[k] = s.by_hash.at(hashes[k]);
    reqs[k] = IoRequest{IoOp::read, std::uint64_t{slots[k]} * s.stride, nullptr, s.stride,
                        s.next_read_tag++};
  }
  const auto prepare = [&](std::size_t k) -> std::byte* {
    if (s.free_staging.empty()) return nullptr;  // every buffer in use or orphaned
    bufs[k] = s.free_staging.back();
    s.free_staging.pop_back();
    return s.buffer(*bufs[k]);
  };
  const auto complete = [&](std::size_t k) {
    if (!bufs[k] || results[k].orphaned) return;  // an orphan's buffer stays held
    const std::byte* b = s.buffer(*bufs[k]);
    if (results[k].error == 0 &&
        checksum_of(b, s.options.block_bytes) == s.slots[slots[k]].checksum) {
      std::memcpy(out[k].data(), b, s.options.block_bytes);
      verified[k] = 1;
    }
    s.free_staging.push_back(*bufs[k]);
  };
  const auto t0 = Clock::now();
  s.data->run(reqs, results, s.options.io_timeout, complete, prepare);
  add_elapsed(s.counters.read_ns, t0);
  // The prefix ends at the first block not verified. Every block that
  // failed is dropped; one past the deadline (or without a buffer) only
  // ends the prefix: the block itself is fine.
  std::size_t got = 0;
  while (got < n && verified[got])
    ++got;
  for (std::size_t k = 0; k < n; ++k) {
    if (results[k].orphaned && bufs[k]) s.orphaned_reads.emplace(reqs[k].tag, *bufs[k]);
    if (verified[k]) {
      if (k < got) {
        s.touch(s.slots[slots[k]]);
        ++s.counters.reads;
        s.counters.read_bytes += s.options.block_bytes;
      }
      continue;
    }
    const int e = results[k].error;
    if (e == ETIMEDOUT || e == ENOBUFS) {
      ++s.counters.timeouts;
    } else if (e != 0) {
      ++s.counters.read_failures;
      s.drop(slots[k]);
    } else {
      ++s.counters.checksum_failures;
      s.drop(slots[k]);
    }
  }
  if (!s.pending.empty() && !s.options.read_only) (void)s.append({});
  return got;
}

bool DiskStore::contains(const BlockHash& hash) const {
  return state_->by_hash.contains(hash);
}

void DiskStore::touch(std::span<const BlockHash> hashes) {
  State& s = *state_;
  for (const BlockHash& h : hashes) {
    if (const auto it = s.by_hash.find(h); it != s.by_hash.end()) s.touch(s.slots[it->second]);
  }
}

bool DiskStore::erase(const BlockHash& hash) {
  State& s = *state_;
  const auto it = s.by_hash.find(hash);
  if (it == s.by_hash.end()) return false;
  if (s.options.read_only) {
    throw InvalidArgument("DiskStore::erase: the store is opened read-only");
  }
  s.drop(it->second);
  ++s.counters.erased;
  return true;
}

void DiskStore::note_hits(std::span<const BlockHash> hashes) {
  State& s = *state_;
  if (s.options.min_hits == 0) return;
  // Bounded: past 4 counts per slot, every count is halved (old hits age).
  const std::size_t cap = std::max<std::size_t>(4096, 4 * s.options.num_slots);
  for (const BlockHash& h : hashes) {
    std::uint32_t& c = s.hits[h];
    if (c < UINT32_MAX) ++c;
  }
  if (s.hits.size() > cap) {
    absl::erase_if(s.hits, [](auto& kv) {
      kv.second /= 2;
      return kv.second == 0;
    });
  }
}

void DiskStore::flush() {
  State& s = *state_;
  if (s.options.read_only || s.detached) return;
  if (!s.append({})) log::warn("disk tier " + s.dir.string() + ": flush: the index append failed");
}

std::size_t DiskStore::size() const noexcept {
  return state_->by_hash.size();
}
std::size_t DiskStore::num_slots() const noexcept {
  return state_->options.num_slots;
}
std::size_t DiskStore::block_bytes() const noexcept {
  return state_->options.block_bytes;
}
std::size_t DiskStore::quarantined_slots() const noexcept {
  return state_->quarantined;
}
bool DiskStore::detached() const noexcept {
  return state_->detached;
}
bool DiskStore::index_failing() const noexcept {
  return state_->index_trouble != State::IndexTrouble::none;
}
const DiskStoreOptions& DiskStore::options() const noexcept {
  return state_->options;
}
const DiskStoreCounters& DiskStore::counters() const noexcept {
  return state_->counters;
}

std::string DiskStore::io_description() const {
  const State& s = *state_;
  std::string d = s.data->describe();
  if (!s.options.read_only)
    d += s.data->preallocated()
             ? "; preallocated"
             : "; sparse (" + (s.sparse_why.empty() ? "no fallocate" : s.sparse_why) + ")";
  if (s.index_trouble != State::IndexTrouble::none) d += "; index cannot be written";
  return d;
}

void DiskStore::set_listener(Listener* listener) noexcept {
  state_->listener = listener;
}

std::vector<BlockHash> DiskStore::lru_order() const {
  std::vector<BlockHash> out;
  for (const Slot& s : state_->lru)
    out.push_back(s.hash);
  return out;
}

std::vector<std::string> DiskStore::check_invariants() const {
  const State& s = *state_;
  std::vector<std::string> bad;
  std::vector<int> seen(s.slots.size(), 0);
  for (std::uint32_t f : s.free_slots) {
    if (f >= s.slots.size()) {
      bad.push_back(fmt::format("free slot {} out of range", f));
      continue;
    }
    if (s.slots[f].state != SlotState::free) bad.push_back(fmt::format("free slot {} not free", f));
    ++seen[f];
  }
  for (const auto& [hash, slot] : s.by_hash) {
    if (s.slots[slot].state != SlotState::stored) {
      bad.push_back(fmt::format("indexed slot {} not stored", slot));
    }
    if (!(s.slots[slot].hash == hash))
      bad.push_back(fmt::format("slot {} holds another hash", slot));
    ++seen[slot];
  }
  std::size_t quarantined = 0;
  for (std::size_t i = 0; i < s.slots.size(); ++i) {
    if (s.slots[i].state == SlotState::quarantined) {
      ++quarantined;
      ++seen[i];
    }
    if (s.slots[i].state == SlotState::writing)
      bad.push_back(fmt::format("slot {} left writing", i));
    if (seen[i] != 1) bad.push_back(fmt::format("slot {} accounted {} times", i, seen[i]));
  }
  if (quarantined != s.quarantined) bad.push_back("quarantine count differs from the slots");
  if (s.lru.size() != s.by_hash.size()) bad.push_back("LRU and index sizes differ");
  for (const Slot& sl : s.lru) {
    const auto it = s.by_hash.find(sl.hash);
    if (it == s.by_hash.end() || &s.slots[it->second] != &sl) {
      bad.push_back("an LRU entry is not indexed");
    }
  }
  std::size_t held = s.orphaned_reads.size();
  for (const auto& [slot, buf] : s.orphaned_writes)
    held += buf ? 1 : 0;
  if (s.free_staging.size() + held != 2 * s.options.queue_depth) {
    bad.push_back("staging buffers lost");
  }
  return bad;
}

}  // namespace kvport::disk
