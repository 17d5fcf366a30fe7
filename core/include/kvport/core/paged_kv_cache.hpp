// SPDX-License-Identifier: Apache-2.0
// PagedKvCache: per-layer K/V block pools, refcounts and a LIFO free list over
// any kvport backend.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <optional>
#include <source_location>
#include <span>
#include <string>
#include <vector>

#include "kvport/core/block_id.hpp"
#include "kvport/core/block_pool.hpp"
#include "kvport/core/block_trace.hpp"
#include "kvport/core/kv_cache_config.hpp"
#include "kvport/platform/backend.hpp"

namespace kvport {

class SharedBlockPool;
class HybridKvCache;

/// Monotonic counters since construction.
struct KvCacheCounters {
  std::uint64_t allocs = 0;                ///< successful alloc_block / try_alloc_block
  std::uint64_t frees = 0;                 ///< blocks returned to the free list
  std::uint64_t ignored_double_frees = 0;  ///< dec_ref / return_evicted_block at refcount 0
  std::uint64_t exhaustion_events = 0;     ///< allocations that found no free block
  std::size_t peak_blocks_in_use = 0;
};

/// The result of check_invariants().
struct InvariantReport {
  bool ok = true;
  std::size_t blocks_checked = 0;
  std::size_t free_blocks = 0;
  /// Blocks some owner holds. PrefixCache::check_invariants() does not count
  /// its evictable blocks here: each block is in exactly one of the three.
  std::size_t blocks_in_use = 0;
  /// Blocks in a prefix cache's LRU list (held only by the cache); 0 for a
  /// PagedKvCache on its own.
  std::size_t evictable_blocks = 0;
  /// Blocks registered under a hash in a prefix cache (evictable or in use).
  std::size_t cached_blocks = 0;
  /// One human-readable line per violation (capped at kMaxViolations, then a
  /// count).
  std::vector<std::string> violations;

  static constexpr std::size_t kMaxViolations = 32;

  /// Records a violation: clears `ok`, keeps the text while fewer than
  /// kMaxViolations are kept, and counts the rest.
  void add_violation(std::string text);

  /// "ok: N blocks, F free, U in use[, E evictable, C cached]" or the
  /// violations, one per line.
  std::string to_string() const;

 private:
  std::size_t suppressed_ = 0;
};

/// One block-to-block copy of PagedKvCache::copy_blocks.
struct BlockCopy {
  BlockId src = 0;
  BlockId dst = 0;
};

/// One pool of memory the engine allocated, for the adopting constructor:
/// `bytes` bytes at `base` (a tensor's data pointer and nbytes).
struct AdoptedPool {
  DevicePtr base;
  std::size_t bytes = 0;
};

/// Alignment an adopted pool's base needs: the 16-byte vector accesses of
/// kvport's kernels and of attention kernels. Every PyTorch / CuPy / NumPy
/// allocation qualifies (they align to 64 bytes or more), and so does a slice
/// of one at any block boundary whose region size is a multiple of 16.
inline constexpr std::size_t kAdoptedPoolAlignment = 16;

struct PagedKvCacheOptions {
  /// Per-block refcount history. Unset: `KVPORT_KV_TRACE` decides.
  std::optional<bool> trace;
  std::size_t trace_depth = BlockTrace::kDefaultDepth;
};

/// A paged KV cache: `num_blocks` blocks, each holding block_size tokens of K
/// and V for every layer (K alone for K-only layers: config().has_v() false,
/// docs/formats.md "K-only layers").
///
/// Not thread-safe: one scheduler thread owns it (as in vLLM and the
/// reference). Device work goes to the stream passed in; host-side state
/// changes are immediate.
///
/// Work still queued at destruction: the cache remembers every stream it
/// queued device work on (zero/poison and copy_blocks; read_block and
/// write_block wait for their own copies, also when they throw) since the
/// last synchronize(), and the destructor synchronizes each of them before it
/// frees the pools, so queued fills and copies never run on freed memory.
/// An error a stream reports then is logged (error level), not thrown:
/// call synchronize() before destruction to see it. A remembered stream that
/// was destroyed meanwhile is skipped (Backend::stream_alive says so;
/// Stream's destructor already waited for its work); every error of a live
/// stream is reported, whatever its type. Work the caller queued on the pools itself (kernels
/// through k_cache_ptr, its own copies) on other streams is the caller's to finish before
/// destroying the cache.
class PagedKvCache {
 public:
  /// Validates `config` and allocates the pools on `backend`: 2 * num_layers
  /// allocations in layer-major layout (num_layers for K-only layers), 1 in
  /// block-major. If an allocation
  /// fails midway (device or host), everything allocated so far is freed
  /// before the exception (OutOfMemory, BackendError, std::bad_alloc)
  /// propagates. Throws InvalidArgument for a bad config, num_blocks == 0,
  /// num_blocks > 2^32 - 1 or a trace ring (num_blocks * options.trace_depth)
  /// that overflows size_t. `backend` must outlive the cache. Pool contents
  /// are unspecified until zeroed.
  PagedKvCache(KvCacheConfig config, std::size_t num_blocks, Backend& backend,
               PagedKvCacheOptions options = {});

  /// A cache over pools the engine allocated (its own tensors): kvport
  /// manages the blocks in them (refcounts, free list, prefix cache, block
  /// tables, zero/poison, copies, host tier, transfer, all unchanged) and
  /// never frees them. `pools` come in memory_pools() order: layer-major,
  /// layer 0's K, layer 0's V, layer 1's K, ... (K only for K-only layers);
  /// block-major, one pool holding every block's whole image.
  /// adopted_pool_bytes() says how many bytes each needs. Each pool's first
  /// adopted_pool_bytes()[i] bytes are registered with the backend
  /// (Backend::adopt_memory) for the cache's lifetime; bytes past them are
  /// not used. Throws InvalidArgument, naming the pool ("pool 3 (layer 1
  /// V)"), for a wrong number of pools, a null base, a base not aligned to
  /// kAdoptedPoolAlignment, fewer bytes than the geometry needs, two pools
  /// that overlap, or memory the backend cannot adopt (overlapping a live
  /// allocation or adopted pool of any backend object of the same memory
  /// space: another cache's pools, adopted or allocated, through this backend
  /// or another; Backend::adopt_memory); and as the allocating
  /// constructor for a bad config or num_blocks. The memory must stay valid
  /// until the cache is destroyed (and its queued work done: the destructor
  /// waits for it as for owned pools).
  PagedKvCache(KvCacheConfig config, std::size_t num_blocks, Backend& backend,
               std::span<const AdoptedPool> pools, PagedKvCacheOptions options = {});

  /// One group's cache over a SharedBlockPool (shared_block_pool.hpp): layer
  /// i uses the pool's slot i, block ids come from (and go back to) the
  /// pool's free list, and the refcounts, trace and counters are this
  /// cache's own. num_blocks() is the pool's (any id may come to this group),
  /// num_free_blocks() the pool's free list, num_blocks_in_use() the blocks
  /// this group holds, total_bytes() the bytes this group's layers address
  /// (shared with the other groups). Throws InvalidArgument unless the layout
  /// is layer-major, the layers fit the pool's slots and every layer's K (V)
  /// region is the pool's K (V) page; as the allocating constructor for a
  /// bad config. The pool must outlive the cache.
  PagedKvCache(KvCacheConfig config, SharedBlockPool& pool, PagedKvCacheOptions options = {});

  /// The shared pool this cache draws from (nullptr: its own pools).
  SharedBlockPool* shared_pool() const noexcept { return shared_; }

  /// Bytes each pool of the adopting constructor must hold for `num_blocks`
  /// blocks of `config`, in memory_pools() order (num_blocks x the region
  /// size in layer-major layout; num_blocks x bytes_per_block() in
  /// block-major). Throws InvalidArgument for an invalid config, num_blocks
  /// == 0 or > 2^32 - 1, or a size that overflows.
  static std::vector<std::size_t> adopted_pool_bytes(const KvCacheConfig& config,
                                                     std::size_t num_blocks);

  /// Whether the pools are the engine's (the adopting constructor).
  bool adopted() const noexcept { return !adopted_.empty(); }
  /// Synchronizes every stream in queued_streams() (see the class comment;
  /// blocks until the queued work is done), then frees the pools. Never
  /// throws.
  ~PagedKvCache();
  PagedKvCache(const PagedKvCache&) = delete;
  PagedKvCache& operator=(const PagedKvCache&) = delete;
  PagedKvCache(PagedKvCache&&) noexcept;
  PagedKvCache& operator=(PagedKvCache&&) = delete;

  /// How many blocks of `config` fit in `available_bytes`: bytes_per_block()
  /// per block, plus the rounding of each pool allocation to kAllocAlignment,
  /// capped at the 32-bit block id range. A cache of that many blocks fits a
  /// backend with that much free memory. Throws InvalidArgument when the config
  /// is invalid (including a zero block size).
  static std::size_t compute_num_blocks(const KvCacheConfig& config, std::size_t available_bytes);

  /// Bytes the pools of a cache of `config` with `num_blocks` blocks take on a
  /// backend: each pool allocation rounded up to kAllocAlignment, as the
  /// constructor allocates them (what compute_num_blocks fits into a budget).
  /// Throws InvalidArgument for an invalid config or a size that overflows.
  static std::size_t pool_allocation_bytes(const KvCacheConfig& config, std::size_t num_blocks);

  // ---- allocation and refcounts (O(1), no device work) ----------------------

  /// Pops the free list (LIFO: a fresh cache yields 0, 1, 2, ...; a freed block
  /// is reused first) and sets its refcount to 1. Throws CacheExhausted
  /// ("KV cache exhausted: no free blocks").
  BlockId alloc_block(std::source_location where = std::source_location::current());

  /// As alloc_block, but returns nullopt when no block is free.
  std::optional<BlockId> try_alloc_block(
      std::source_location where = std::source_location::current());

  /// Adds a reference (prefix sharing). Throws OutOfRange (an InvalidArgument)
  /// when the block is out of range, InvalidArgument when it is free
  /// (refcount 0): sharing a free block would alias it with its next owner.
  void inc_ref(BlockId block, std::source_location where = std::source_location::current());

  /// Drops a reference; returns true when the block went back to the free
  /// list. At refcount 0 the call is a caller bug: it is logged (with the
  /// block's trace history when tracing is on), counted in
  /// ignored_double_frees, and ignored. Throws OutOfRange out of range.
  bool dec_ref(BlockId block, std::source_location where = std::source_location::current());

  /// The same operation as dec_ref under the reference's second name (same
  /// checks, result, counters and trace record); kept so that call sites
  /// that mean "I am done with this block" read as such.
  bool free_block(BlockId block, std::source_location where = std::source_location::current());

  /// dec_ref on every id of a block table, in order. Validates every id first,
  /// so an out-of-range id throws OutOfRange before any refcount changes.
  void free_blocks(std::span<const BlockId> table,
                   std::source_location where = std::source_location::current());

  /// The prefix cache hands back a block it held a reference on (after
  /// evicting it). Like dec_ref; at refcount 0 it warns, counts, and ignores
  /// the call rather than push the block onto the free list twice.
  void return_evicted_block(BlockId block,
                            std::source_location where = std::source_location::current());

  std::uint32_t ref_count(BlockId block) const;
  std::size_t num_free_blocks() const noexcept { return free_->size(); }
  std::size_t num_blocks() const noexcept { return num_blocks_; }
  std::size_t num_blocks_in_use() const noexcept { return held_; }

  // ---- geometry: pools, pointers and strides ---------------------------------

  /// Layer `layer`'s K (or V) pool: block b's bytes of that part are
  /// pool.region(b); its stride is the region size in layer-major layout and
  /// the whole block (all layers) in block-major. O(1), no device work. The
  /// reference lives as long as the cache. Throws OutOfRange for
  /// layer >= num_layers(), InvalidArgument for KvPart::v when the layers have no V
  /// (config().has_v() false: K-only layers, e.g. MLA).
  const BlockPool& pool(std::size_t layer, KvPart part) const {
    return layer_pool(layer, part, "pool");
  }

  /// The pools as the memory holds them, in block-image order: in layer-major
  /// layout layer 0's K pool, layer 0's V pool, layer 1's K pool, ... (no V
  /// pools for K-only layers); in block-major layout one pool whose region is
  /// a whole block (every layer's K and V; dtype config().dtype). Block b's
  /// bytes are these pools' region(b), one after another: the image a
  /// HostTier slot or a transfer staging slot holds (block_regions.hpp). What
  /// zero/poison register with the backend. O(1).
  std::span<const BlockPool> memory_pools() const noexcept { return memory_pools_; }

  /// The calls below forward to pool() (kept for compatibility); each names
  /// itself in its errors.
  ///
  /// Address of `block`'s K (V) data for `layer`. Throws OutOfRange for an
  /// out-of-range layer or block, InvalidArgument from the V calls (pointers, strides) for a
  /// cache of K-only layers (config().has_v() false: MLA, state slots).
  DevicePtr k_cache_ptr(std::size_t layer, BlockId block) const;
  DevicePtr v_cache_ptr(std::size_t layer, BlockId block) const;

  /// Address of block 0's K (V) data for `layer`; block b lives at
  /// pool + b * stride.
  DevicePtr k_pool_ptr(std::size_t layer) const;
  DevicePtr v_pool_ptr(std::size_t layer) const;

  /// Bytes between consecutive blocks of `layer`'s K (V) data: the region size
  /// in layer-major layout, the whole block (all layers) in block-major.
  std::size_t k_block_stride(std::size_t layer) const;
  std::size_t v_block_stride(std::size_t layer) const;

  /// Bytes of `layer`'s K (V) region in one block (what read_block returns;
  /// V: 0 for K-only layers, which have no V pool, rather than an error).
  std::size_t k_block_bytes(std::size_t layer) const;
  std::size_t v_block_bytes(std::size_t layer) const;

  KvCacheDtype dtype_for_layer(std::size_t layer) const;
  const KvCacheConfig& config() const noexcept { return config_; }
  std::size_t num_layers() const noexcept { return config_.num_layers; }
  /// Bytes of all pools together.
  std::size_t total_bytes() const noexcept { return total_bytes_; }
  Backend& backend() const noexcept { return *backend_; }

  // ---- device work -------------------------------------------------------------

  /// Sets every layer's K and V bytes (K alone for K-only layers) of the
  /// given blocks to 0 (0xFF for poison), queued on `stream`. ONE backend
  /// call (fill_blocks_async over the cache's registered pools) per batch,
  /// whatever the batch size: ids are sorted and deduplicated, and contiguous
  /// runs coalesce into one region per pool (one region in block-major
  /// layout). On GPUs only the ids are uploaded.
  /// Throws OutOfRange (before any device work) for an out-of-range id.
  /// An empty batch queues nothing.
  void zero_blocks(std::span<const BlockId> blocks, StreamView stream);
  void poison_blocks(std::span<const BlockId> blocks, StreamView stream);
  void zero_block(BlockId block, StreamView stream) { zero_blocks({&block, 1}, stream); }
  void poison_block(BlockId block, StreamView stream) { poison_blocks({&block, 1}, stream); }

  /// Number of contiguous regions the last zero/poison batch covered: runs of
  /// consecutive ids x memory_pools() (2 x num_layers, num_layers for K-only
  /// layers, or 1 in block-major layout).
  /// For tests and benchmarks that check coalescing.
  std::size_t last_fill_regions() const noexcept { return last_fill_regions_; }

  /// Copies every layer's K and V bytes of each `src` block to its `dst`
  /// block on `stream`, in ONE batched backend call (copy_batch_async): one
  /// region per copy and memory pool (2 x num_layers in layer-major layout,
  /// num_layers for K-only layers; one in block-major). Copy-on-write uses
  /// it; engines use it as vLLM's copy_blocks. Throws InvalidArgument (before
  /// any device work) for an out-of-range id, a copy with src == dst, or a
  /// block that is the destination of one copy and the source or destination
  /// of another (the order between them would be undefined). An empty batch
  /// queues nothing.
  void copy_blocks(std::span<const BlockCopy> copies, StreamView stream);

  /// Copies `layer`'s K and V bytes of `block` to the host (v empty for
  /// K-only layers), synchronizing
  /// `stream` (work queued before on it is ordered first). When the second
  /// copy cannot be queued, the stream is still synchronized before the
  /// error propagates, so the first copy never writes into freed memory.
  struct HostBlock {
    std::vector<std::uint8_t> k;
    std::vector<std::uint8_t> v;
  };
  HostBlock read_block(std::size_t layer, BlockId block, StreamView stream) const;

  /// Copies host bytes into `layer`'s K and V of `block` and synchronizes
  /// (also when queueing the second copy throws, so the spans are never read
  /// after the call). The spans must be exactly k_block_bytes(layer) /
  /// v_block_bytes(layer) long (InvalidArgument otherwise; v empty for K-only
  /// layers).
  void write_block(std::size_t layer, BlockId block, std::span<const std::uint8_t> k,
                   std::span<const std::uint8_t> v, StreamView stream);

  /// Waits for the device work this cache queued: synchronizes every stream
  /// in queued_streams() and forgets them. Streams destroyed since are
  /// skipped (Backend::stream_alive is false: their destructor waited).
  /// Every live stream is synchronized even when one fails; then the first
  /// error is rethrown as Backend::synchronize threw it (BackendError, or
  /// the InvalidArgument of an asynchronous use after free on the host
  /// backend: an error of the stream, whoever queued the failing work). Costs one backend
  /// synchronize per remembered stream; a no-op when nothing was queued since the last call.
  void synchronize();

  /// The streams this cache queued device work on since construction or the
  /// last synchronize(), in first-use order, without duplicates (an engine
  /// that makes short-lived streams should call synchronize() now and then,
  /// or this list grows by one per stream).
  std::span<const StreamView> queued_streams() const noexcept { return queued_streams_; }

  // ---- diagnostics -------------------------------------------------------------

  /// Checks: every block is on the free list exactly once with refcount 0, or
  /// off it with refcount > 0. O(num_blocks).
  InvariantReport check_invariants() const;

  const KvCacheCounters& counters() const noexcept { return counters_; }
  const BlockTrace& trace() const noexcept { return trace_; }

 private:
  // The hot paths (alloc, free, refcounts) are inline below; their rare
  // branches (errors, logging) stay out of line.
  void check_block(BlockId block, const char* op) const {
    if (block >= num_blocks_) [[unlikely]]
      throw_block_out_of_range(block, op);
  }
  [[noreturn]] void throw_block_out_of_range(BlockId block, const char* op) const;
  [[noreturn]] void throw_exhausted();
  void check_layer(std::size_t layer, const char* op) const;
  void check_has_v(const char* op) const;
  // pool(), naming `op` in its errors.
  const BlockPool& layer_pool(std::size_t layer, KvPart part, const char* op) const;
  BlockId take_free(BlockOp op, const std::source_location& where);
  bool release(BlockId block, BlockOp op, const std::source_location& where);
  bool ignore_release(BlockId block, BlockOp op, const std::source_location& where);
  void fill_blocks(std::span<const BlockId> blocks, std::uint8_t value, StreamView stream,
                   const char* op);
  void build(std::span<const AdoptedPool> adopt, const PagedKvCacheOptions& options);
  void adopt_pools(std::span<const AdoptedPool> pools);
  void release_pools() noexcept;
  bool prepare_to_note(StreamView stream);
  void note_stream(StreamView stream, bool is_new) noexcept;
  void drain_streams_noexcept() noexcept;

  KvCacheConfig config_;
  std::size_t num_blocks_ = 0;
  Backend* backend_ = nullptr;
  std::vector<DevicePtr> allocations_;
  std::vector<AdoptedMemory> adopted_;   // the engine's pools, when adopted (never freed)
  std::vector<BlockPool> pools_;         // [2 * layer + part]; V left empty for K-only layers
  std::vector<BlockPool> memory_pools_;  // see memory_pools()
  std::size_t total_bytes_ = 0;

  std::vector<BlockId> free_list_;  // top of the stack at the back (own pools)
  SharedBlockPool* shared_ = nullptr;
  std::vector<BlockId>* free_ = &free_list_;  // free_list_, or the shared pool's
  std::size_t held_ = 0;                      // blocks with refcount > 0
  std::vector<std::uint32_t> ref_counts_;
  KvCacheCounters counters_;
  BlockTrace trace_;

  BlockPoolSet pool_set_;  // after allocations_: unregistered first
  std::vector<BlockId> scratch_ids_;
  std::vector<CopyRegion> scratch_regions_;
  std::size_t last_fill_regions_ = 0;
  std::vector<StreamView> queued_streams_;  // see queued_streams()
  // HybridKvCache::over(*this), made on first use (a move leaves it behind).
  friend class HybridKvCache;
  std::unique_ptr<HybridKvCache> group_view_;
};

// ---- hot paths --------------------------------------------------------------------

inline std::uint32_t PagedKvCache::ref_count(BlockId block) const {
  check_block(block, "ref_count");
  return ref_counts_[block];
}

inline BlockId PagedKvCache::take_free(BlockOp op, const std::source_location& where) {
  std::vector<BlockId>& free = *free_;
  const BlockId block = free.back();
  free.pop_back();
  ref_counts_[block] = 1;
  ++counters_.allocs;
  const std::size_t in_use = ++held_;
  if (in_use > counters_.peak_blocks_in_use) counters_.peak_blocks_in_use = in_use;
  if (trace_.is_on()) [[unlikely]]
    trace_.record(block, op, 1, where);
  return block;
}

inline BlockId PagedKvCache::alloc_block(std::source_location where) {
  if (free_->empty()) [[unlikely]]
    throw_exhausted();
  return take_free(BlockOp::alloc, where);
}

inline std::optional<BlockId> PagedKvCache::try_alloc_block(std::source_location where) {
  if (free_->empty()) [[unlikely]] {
    ++counters_.exhaustion_events;
    return std::nullopt;
  }
  return take_free(BlockOp::try_alloc, where);
}

inline bool PagedKvCache::release(BlockId block, BlockOp op, const std::source_location& where) {
  std::uint32_t& rc = ref_counts_[block];
  if (rc == 0) [[unlikely]]
    return ignore_release(block, op, where);
  --rc;
  if (trace_.is_on()) [[unlikely]]
    trace_.record(block, op, rc, where);
  if (rc != 0) return false;
  free_->push_back(block);  // never reallocates: capacity is num_blocks
  --held_;
  ++counters_.frees;
  return true;
}

inline bool PagedKvCache::dec_ref(BlockId block, std::source_location where) {
  check_block(block, "dec_ref");
  return release(block, BlockOp::dec, where);
}

inline bool PagedKvCache::free_block(BlockId block, std::source_location where) {
  check_block(block, "free_block");
  return release(block, BlockOp::dec, where);
}

}  // namespace kvport
