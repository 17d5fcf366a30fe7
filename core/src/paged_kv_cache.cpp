// SPDX-License-Identifier: Apache-2.0
#include "kvport/core/paged_kv_cache.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <exception>
#include <limits>
#include <utility>

#include "kvport/core/hybrid_kv_cache.hpp"
#include "kvport/core/shared_block_pool.hpp"
#include "kvport/platform/byte_size.hpp"
#include "kvport/platform/div_ceil.hpp"
#include "kvport/platform/error.hpp"
#include "kvport/platform/log.hpp"
#include "kvport/platform/size_math.hpp"

namespace kvport {
namespace {

constexpr std::uint8_t kPoisonByte = 0xFF;

std::size_t checked_pool_bytes(std::size_t num_blocks, std::size_t block_bytes, const char* what) {
  if (mul_overflows(num_blocks, block_bytes)) {
    throw InvalidArgument(
        fmt::format("PagedKvCache: {} pool of {} blocks x {} bytes overflows size_t", what,
                    num_blocks, block_bytes));
  }
  return num_blocks * block_bytes;
}

// Registers `pools` (memory_pools() order) with the backend: the pool table
// it fills from (device-resident on GPUs).
BlockPoolSet register_pools(Backend& backend, std::span<const BlockPool> pools,
                            std::size_t num_blocks) {
  std::vector<PoolGeometry> table;
  table.reserve(pools.size());
  for (const BlockPool& pool : pools)
    table.push_back(pool.geometry());
  return backend.register_block_pools(table, num_blocks);
}

// The pools' bytes of `num_blocks` blocks of a validated `config`, each
// allocation rounded to kAllocAlignment (pool_allocation_bytes).
std::size_t allocation_bytes(const KvCacheConfig& config, std::size_t num_blocks) {
  auto pool = [&](std::size_t block_bytes, const char* what) {
    const std::size_t bytes = checked_pool_bytes(num_blocks, block_bytes, what);
    if (add_overflows(bytes, kAllocAlignment - 1)) {
      throw InvalidArgument(
          fmt::format("PagedKvCache: {} pool of {} bytes overflows size_t when "
                      "rounded to the allocation alignment",
                      what, bytes));
    }
    return round_up(bytes, kAllocAlignment);
  };
  if (config.layout == KvCacheLayout::block_major) return pool(config.bytes_per_block(), "total");
  std::size_t total = 0;
  for (std::size_t layer = 0; layer < config.num_layers; ++layer) {
    std::size_t layer_bytes = pool(config.k_block_bytes(layer), "K");
    if (config.has_v()) {
      const std::size_t v = pool(config.v_block_bytes(layer), "V");
      if (add_overflows(layer_bytes, v))
        throw InvalidArgument("PagedKvCache: pool bytes overflow size_t");
      layer_bytes += v;
    }
    if (add_overflows(total, layer_bytes))
      throw InvalidArgument("PagedKvCache: pool bytes overflow size_t");
    total += layer_bytes;
  }
  return total;
}

// Waits for the work queued on `stream` while an exception propagates: its
// own error (if any) is dropped in favour of the one in flight, after being
// logged.
void wait_before_unwinding(Backend& backend, StreamView stream) noexcept {
  try {
    backend.synchronize(stream);
  } catch (const std::exception& e) {
    try {
      log::warn(
          fmt::format("PagedKvCache: while unwinding, the stream also reported: {}", e.what()));
    } catch (...) {
    }
  } catch (...) {
  }
}

}  // namespace

void InvariantReport::add_violation(std::string text) {
  ok = false;
  if (violations.size() < kMaxViolations) {
    violations.push_back(std::move(text));
  } else {
    ++suppressed_;
  }
}

std::string InvariantReport::to_string() const {
  if (ok) {
    std::string out = fmt::format("ok: {} blocks, {} free, {} in use", blocks_checked, free_blocks,
                                  blocks_in_use);
    if (evictable_blocks != 0 || cached_blocks != 0)
      out += fmt::format(", {} evictable, {} cached", evictable_blocks, cached_blocks);
    return out;
  }
  std::string out = fmt::format("FAILED: {} violation(s) in {} blocks",
                                violations.size() + suppressed_, blocks_checked);
  for (const std::string& v : violations)
    out += "\n  " + v;
  if (suppressed_ > 0) out += fmt::format("\n  ... and {} more", suppressed_);
  return out;
}

PagedKvCache::PagedKvCache(KvCacheConfig config, std::size_t num_blocks, Backend& backend,
                           PagedKvCacheOptions options)
    : config_(std::move(config)), num_blocks_(num_blocks), backend_(&backend), trace_(0, false) {
  build({}, options);
}

PagedKvCache::PagedKvCache(KvCacheConfig config, std::size_t num_blocks, Backend& backend,
                           std::span<const AdoptedPool> pools, PagedKvCacheOptions options)
    : config_(std::move(config)), num_blocks_(num_blocks), backend_(&backend), trace_(0, false) {
  if (pools.empty()) {
    throw InvalidArgument("PagedKvCache: adopting constructor given no pools");
  }
  build(pools, options);
}

namespace {

// "pool 3 (layer 1 V)" / "pool 0 (block-major)".
std::string pool_name(const KvCacheConfig& config, std::size_t index) {
  if (config.layout == KvCacheLayout::block_major)
    return fmt::format("pool {} (block-major)", index);
  const std::size_t per_layer = config.has_v() ? 2 : 1;
  return fmt::format("pool {} (layer {} {})", index, index / per_layer,
                     index % per_layer == 0 ? "K" : "V");
}

}  // namespace

std::vector<std::size_t> PagedKvCache::adopted_pool_bytes(const KvCacheConfig& config,
                                                          std::size_t num_blocks) {
  config.validate();
  // Every adopting caller divides a pool's bytes by the block count (per-block
  // sizes in messages, tensor shapes): 0 is refused here, before any does.
  if (num_blocks == 0) throw InvalidArgument("PagedKvCache: num_blocks must be > 0");
  if (num_blocks > kMaxCacheBlocks) {
    throw InvalidArgument(
        fmt::format("PagedKvCache: num_blocks = {} exceeds the 32-bit block id range", num_blocks));
  }
  std::vector<std::size_t> out;
  if (config.layout == KvCacheLayout::block_major) {
    out.push_back(checked_pool_bytes(num_blocks, config.bytes_per_block(), "total"));
    return out;
  }
  for (std::size_t layer = 0; layer < config.num_layers; ++layer) {
    out.push_back(checked_pool_bytes(num_blocks, config.k_block_bytes(layer), "K"));
    if (config.has_v())
      out.push_back(checked_pool_bytes(num_blocks, config.v_block_bytes(layer), "V"));
  }
  return out;
}

// Checks the engine's pools against the geometry and registers each with the
// backend (adopted_, in memory_pools() order). Throws before registering any
// when a check fails; a backend refusal midway leaves the registrations made
// so far in adopted_, for release_pools.
void PagedKvCache::adopt_pools(std::span<const AdoptedPool> pools) {
  const std::vector<std::size_t> need = adopted_pool_bytes(config_, num_blocks_);
  if (pools.size() != need.size()) {
    throw InvalidArgument(fmt::format(
        "PagedKvCache: {} pools given, the config needs {} ({})", pools.size(), need.size(),
        config_.layout == KvCacheLayout::block_major
            ? std::string("block-major: one pool")
            : fmt::format("layer-major: {} per layer x {} layers",
                          config_.has_v() ? "K and V" : "K", config_.num_layers)));
  }
  struct Span {
    std::uintptr_t begin, end;
    std::size_t index;
  };
  std::vector<Span> spans;
  spans.reserve(pools.size());
  for (std::size_t i = 0; i < pools.size(); ++i) {
    const AdoptedPool& p = pools[i];
    if (p.base.is_null()) {
      throw InvalidArgument(
          fmt::format("PagedKvCache: {}: null base pointer", pool_name(config_, i)));
    }
    if (p.base.address() % kAdoptedPoolAlignment != 0) {
      throw InvalidArgument(
          fmt::format("PagedKvCache: {}: base {:#x} is misaligned (needs {}-byte alignment)",
                      pool_name(config_, i), p.base.address(), kAdoptedPoolAlignment));
    }
    if (p.bytes < need[i]) {
      throw InvalidArgument(
          fmt::format("PagedKvCache: {}: {} bytes are too small: {} blocks need {} bytes",
                      pool_name(config_, i), p.bytes, num_blocks_, need[i]));
    }
    if (need[i] > UINTPTR_MAX - p.base.address()) {
      throw InvalidArgument(fmt::format("PagedKvCache: {}: [{:#x}, +{}) wraps the address space",
                                        pool_name(config_, i), p.base.address(), need[i]));
    }
    spans.push_back({p.base.address(), p.base.address() + need[i], i});
  }
  std::sort(spans.begin(), spans.end(),
            [](const Span& a, const Span& b) { return a.begin < b.begin; });
  for (std::size_t i = 1; i < spans.size(); ++i) {
    if (spans[i].begin < spans[i - 1].end) {
      const std::size_t a = std::min(spans[i - 1].index, spans[i].index);
      const std::size_t b = std::max(spans[i - 1].index, spans[i].index);
      throw InvalidArgument(fmt::format("PagedKvCache: {} and {} overlap", pool_name(config_, a),
                                        pool_name(config_, b)));
    }
  }
  adopted_.reserve(pools.size());
  for (std::size_t i = 0; i < pools.size(); ++i) {
    try {
      adopted_.push_back(backend_->adopt_memory(pools[i].base, need[i]));
    } catch (const InvalidArgument& e) {
      throw InvalidArgument(fmt::format("PagedKvCache: {}: {}", pool_name(config_, i), e.what()));
    }
  }
}

PagedKvCache::PagedKvCache(KvCacheConfig config, SharedBlockPool& pool, PagedKvCacheOptions options)
    : config_(std::move(config)),
      num_blocks_(pool.num_blocks()),
      backend_(&pool.backend()),
      trace_(0, false) {
  config_.validate();
  const SharedPoolGeometry& geo = pool.geometry();
  if (config_.layout != KvCacheLayout::layer_major) {
    throw InvalidArgument("PagedKvCache: a cache over a shared pool must be layer-major");
  }
  if (config_.num_layers > geo.num_slots) {
    throw InvalidArgument(
        fmt::format("PagedKvCache: {} layers do not fit a shared pool of {} slots",
                    config_.num_layers, geo.num_slots));
  }
  const bool has_v = config_.has_v();
  for (std::size_t layer = 0; layer < config_.num_layers; ++layer) {
    const std::size_t k = config_.k_block_bytes(layer);
    const std::size_t v = has_v ? config_.v_block_bytes(layer) : 0;
    if (k != geo.k_page_bytes || v != geo.v_page_bytes) {
      throw InvalidArgument(fmt::format(
          "PagedKvCache: layer {} has {}-byte K and {}-byte V pages, the shared pool {} and {}",
          layer, k, v, geo.k_page_bytes, geo.v_page_bytes));
    }
  }
  total_bytes_ = checked_pool_bytes(num_blocks_, config_.bytes_per_block(), "total");
  pools_.reserve(2 * config_.num_layers);
  memory_pools_.reserve(2 * config_.num_layers);
  for (std::size_t layer = 0; layer < config_.num_layers; ++layer) {
    const KvCacheDtype dtype = config_.dtype_for_layer(layer);
    pools_.push_back(
        BlockPool{pool.k_pool(layer), geo.k_page_bytes, geo.k_page_bytes, num_blocks_, dtype});
    pools_.push_back(has_v ? BlockPool{pool.v_pool(layer), geo.v_page_bytes, geo.v_page_bytes,
                                       num_blocks_, dtype}
                           : BlockPool{DevicePtr{}, 0, 0, num_blocks_, dtype});
    memory_pools_.push_back(pools_[2 * layer]);
    if (has_v) memory_pools_.push_back(pools_[2 * layer + 1]);
  }
  pool_set_ = register_pools(*backend_, memory_pools_, num_blocks_);
  // As in build(): what throws after the registration (bad_alloc, a bad
  // trace depth) must not leave it behind (the destructor will not run).
  try {
    ref_counts_.assign(num_blocks_, 0);
    trace_ = BlockTrace(num_blocks_, options.trace.value_or(BlockTrace::enabled_by_env()),
                        options.trace_depth);
    pool.attach(this);
  } catch (...) {
    release_pools();
    throw;
  }
  free_ = &pool.free_list_;
  shared_ = &pool;
}

void PagedKvCache::build(std::span<const AdoptedPool> adopt, const PagedKvCacheOptions& options) {
  Backend& backend = *backend_;
  const std::size_t num_blocks = num_blocks_;
  config_.validate();
  if (num_blocks == 0) throw InvalidArgument("PagedKvCache: num_blocks must be > 0");
  if (num_blocks > kMaxCacheBlocks) {
    throw InvalidArgument(
        fmt::format("PagedKvCache: num_blocks = {} exceeds the 32-bit block id range", num_blocks));
  }
  const std::size_t per_block = config_.bytes_per_block();
  total_bytes_ = checked_pool_bytes(num_blocks, per_block, "total");

  const bool has_v = config_.has_v();
  pools_.reserve(2 * config_.num_layers);
  memory_pools_.reserve(2 * config_.num_layers);
  try {
    if (!adopt.empty()) adopt_pools(adopt);
    // The next pool in memory_pools() order: the engine's, or a new allocation.
    std::size_t next_adopted = 0;
    auto next_pool = [&](std::size_t bytes) {
      if (!adopted_.empty()) return adopted_[next_adopted++].ptr();
      DevicePtr p = backend.alloc(bytes);
      allocations_.push_back(p);
      return p;
    };
    // pools_[2 * layer + part]. A K-only layer's V entry stays empty: pool()
    // refuses it before anyone sees it.
    auto add_layer = [&](std::size_t layer, DevicePtr k_base, DevicePtr v_base,
                         std::size_t block_major_stride) {
      const KvCacheDtype dtype = config_.dtype_for_layer(layer);
      const std::size_t k = config_.k_block_bytes(layer);
      const std::size_t v = config_.v_block_bytes(layer);
      pools_.push_back(BlockPool{k_base, k, block_major_stride != 0 ? block_major_stride : k,
                                 num_blocks, dtype});
      pools_.push_back(has_v
                           ? BlockPool{v_base, v, block_major_stride != 0 ? block_major_stride : v,
                                       num_blocks, dtype}
                           : BlockPool{DevicePtr{}, 0, 0, num_blocks, dtype});
    };
    if (config_.layout == KvCacheLayout::layer_major) {
      allocations_.reserve(2 * config_.num_layers);
      for (std::size_t layer = 0; layer < config_.num_layers; ++layer) {
        DevicePtr k_pool =
            next_pool(checked_pool_bytes(num_blocks, config_.k_block_bytes(layer), "K"));
        DevicePtr v_pool;  // K-only layers have no V pool
        if (has_v) {
          v_pool = next_pool(checked_pool_bytes(num_blocks, config_.v_block_bytes(layer), "V"));
        }
        add_layer(layer, k_pool, v_pool, 0);
        memory_pools_.push_back(pools_[2 * layer]);
        if (has_v) memory_pools_.push_back(pools_[2 * layer + 1]);
      }
    } else {
      DevicePtr base = next_pool(total_bytes_);
      std::size_t offset = 0;
      for (std::size_t layer = 0; layer < config_.num_layers; ++layer) {
        const std::size_t k = config_.k_block_bytes(layer);
        add_layer(layer, base.offset(offset), has_v ? base.offset(offset + k) : DevicePtr{},
                  per_block);
        offset += k + config_.v_block_bytes(layer);
      }
      memory_pools_.push_back(BlockPool{base, per_block, per_block, num_blocks, config_.dtype});
    }

    pool_set_ = register_pools(backend, memory_pools_, num_blocks);

    // Host-side state is built inside the try as well: a bad_alloc or a bad
    // trace depth here must not leak the pools (the destructor will not run).
    free_list_.resize(num_blocks);
    for (std::size_t i = 0; i < num_blocks; ++i) {
      free_list_[i] = static_cast<BlockId>(num_blocks - 1 - i);  // pop_back yields 0, 1, 2, ...
    }
    ref_counts_.assign(num_blocks, 0);
    trace_ = BlockTrace(num_blocks, options.trace.value_or(BlockTrace::enabled_by_env()),
                        options.trace_depth);
  } catch (...) {
    release_pools();
    throw;
  }

  const double gib = static_cast<double>(total_bytes_) / (1024.0 * 1024.0 * 1024.0);
  const char* adopted_note = adopted_.empty() ? "" : ", the engine's pools";
  if (const std::size_t hp = config_.num_override_layers(); hp > 0) {
    log::info(fmt::format(
        "KV cache on {}: {} blocks x {} layers ({} high-precision) = {:.2f} GiB total (mixed "
        "dtype, {}{})",
        backend.name(), num_blocks, config_.num_layers, hp, gib, kvport::to_string(config_.layout),
        adopted_note));
  } else {
    log::info(fmt::format(
        "KV cache on {}: {} blocks x {} layers x {} bytes/block = {:.2f} GiB total "
        "({}, {}{})",
        backend.name(), num_blocks, config_.num_layers, per_block / config_.num_layers, gib,
        kvport::to_string(config_.dtype), kvport::to_string(config_.layout), adopted_note));
  }
}

PagedKvCache::~PagedKvCache() {
  drain_streams_noexcept();
  release_pools();
  if (shared_ != nullptr) {
    // Blocks still held go back to the pool, as the memory of an own pool
    // would go with the cache.
    for (std::size_t b = 0; b < ref_counts_.size(); ++b) {
      if (ref_counts_[b] != 0) free_->push_back(static_cast<BlockId>(b));
    }
    shared_->detach(this);
  }
}

bool PagedKvCache::prepare_to_note(StreamView stream) {
  if (std::find(queued_streams_.begin(), queued_streams_.end(), stream) != queued_streams_.end()) {
    return false;
  }
  queued_streams_.reserve(queued_streams_.size() + 1);
  return true;
}

void PagedKvCache::note_stream(StreamView stream, bool is_new) noexcept {
  // Only once the backend accepted the work: a call it rejected queued
  // nothing, and its stream may be foreign or stale. Capacity was reserved.
  if (is_new) queued_streams_.push_back(stream);
}

// Synchronizes every stream in `streams` and forgets them. A stream destroyed
// since it was used is skipped (Stream's destructor already waited for its
// work): Backend::stream_alive says so, never the type of an error, since a
// live stream can report an asynchronous InvalidArgument of its own (the host
// backend's use after free). Every error of a live stream goes to
// `on_error`, and the rest of the streams are still waited for.
namespace {
template <class OnError>
void synchronize_each(Backend& backend, std::vector<StreamView>& streams, OnError on_error) {
  for (StreamView stream : streams) {
    if (!backend.stream_alive(stream)) continue;
    try {
      backend.synchronize(stream);
    } catch (...) {
      on_error(std::current_exception());
    }
  }
  streams.clear();
}
}  // namespace

void PagedKvCache::synchronize() {
  std::exception_ptr first;
  synchronize_each(*backend_, queued_streams_, [&](std::exception_ptr e) {
    if (!first) first = e;
  });
  if (first) std::rethrow_exception(first);
}

void PagedKvCache::drain_streams_noexcept() noexcept {
  synchronize_each(*backend_, queued_streams_, [](std::exception_ptr e) noexcept {
    try {
      std::rethrow_exception(e);
    } catch (const std::exception& error) {
      try {
        log::error(fmt::format(
            "~PagedKvCache: a stream this cache queued work on reported an error while the "
            "destructor waited for it before freeing the pools (logged, a destructor cannot "
            "throw; call PagedKvCache::synchronize() first to handle it): {}",
            error.what()));
      } catch (...) {
      }
    } catch (...) {
    }
  });
}

PagedKvCache::PagedKvCache(PagedKvCache&& other) noexcept
    : config_(std::move(other.config_)),
      num_blocks_(other.num_blocks_),
      backend_(other.backend_),
      allocations_(std::exchange(other.allocations_, {})),
      adopted_(std::exchange(other.adopted_, {})),
      pools_(std::move(other.pools_)),
      memory_pools_(std::move(other.memory_pools_)),
      total_bytes_(other.total_bytes_),
      free_list_(std::move(other.free_list_)),
      shared_(std::exchange(other.shared_, nullptr)),
      free_(other.free_ == &other.free_list_ ? &free_list_ : other.free_),
      held_(std::exchange(other.held_, 0)),
      ref_counts_(std::move(other.ref_counts_)),
      counters_(other.counters_),
      trace_(std::move(other.trace_)),
      pool_set_(std::move(other.pool_set_)),
      scratch_ids_(std::move(other.scratch_ids_)),
      scratch_regions_(std::move(other.scratch_regions_)),
      last_fill_regions_(other.last_fill_regions_),
      queued_streams_(std::exchange(other.queued_streams_, {})) {
  other.num_blocks_ = 0;
  other.pools_.clear();
  other.memory_pools_.clear();
  other.free_list_.clear();
  other.free_ = &other.free_list_;
  other.ref_counts_.clear();
  if (shared_ != nullptr) shared_->replace(&other, this);
}

void PagedKvCache::release_pools() noexcept {
  pool_set_ = BlockPoolSet();  // unregister before the memory it describes goes
  for (auto it = allocations_.rbegin(); it != allocations_.rend(); ++it)
    backend_->free(*it);
  allocations_.clear();
  adopted_.clear();  // forgets the engine's pools; never frees them
}

std::size_t PagedKvCache::pool_allocation_bytes(const KvCacheConfig& config,
                                                std::size_t num_blocks) {
  config.validate();
  return allocation_bytes(config, num_blocks);
}

std::size_t PagedKvCache::compute_num_blocks(const KvCacheConfig& config,
                                             std::size_t available_bytes) {
  config.validate();
  const std::size_t per_block = config.bytes_per_block();
  if (per_block == 0) throw InvalidArgument("PagedKvCache: KV cache block size is zero");
  // Each pool allocation is rounded up to kAllocAlignment: count that too, so
  // that the result always fits. At most 2 * num_layers * 255 bytes of
  // rounding, so the loop runs a few times at most for realistic blocks.
  // No device has 8 EiB; clamping keeps the rounding below from overflowing.
  available_bytes = std::min(available_bytes, std::numeric_limits<std::size_t>::max() / 2);
  std::size_t n = std::min<std::size_t>(available_bytes / per_block, kMaxCacheBlocks);
  // n * per_block <= available_bytes, so the products below cannot overflow
  // until rounding, which adds less than kAllocAlignment per pool.
  while (n > 0 && (available_bytes - n * per_block < 2 * config.num_layers * kAllocAlignment) &&
         allocation_bytes(config, n) > available_bytes) {
    --n;
  }
  return n;
}

// ---- checks -------------------------------------------------------------------------

void PagedKvCache::throw_block_out_of_range(BlockId block, const char* op) const {
  throw OutOfRange(fmt::format("PagedKvCache::{}: block {} out of range (num_blocks = {})", op,
                               block, num_blocks_));
}

void PagedKvCache::check_has_v(const char* op) const {
  if (!config_.has_v()) {
    throw InvalidArgument(fmt::format(
        "PagedKvCache::{}: the layers have no V (head_dim_v is 0: K-only layers, e.g. MLA)", op));
  }
}

void PagedKvCache::check_layer(std::size_t layer, const char* op) const {
  if (layer >= pools_.size() / 2) {
    throw OutOfRange(fmt::format("PagedKvCache::{}: layer {} out of range (num_layers = {})", op,
                                 layer, pools_.size() / 2));
  }
}

const BlockPool& PagedKvCache::layer_pool(std::size_t layer, KvPart part, const char* op) const {
  check_layer(layer, op);
  if (part == KvPart::v) check_has_v(op);
  return pools_[2 * layer + static_cast<std::size_t>(part)];
}

// ---- allocation and refcounts ----------------------------------------------------------

void PagedKvCache::throw_exhausted() {
  ++counters_.exhaustion_events;
  throw CacheExhausted();
}

void PagedKvCache::inc_ref(BlockId block, std::source_location where) {
  check_block(block, "inc_ref");
  std::uint32_t& rc = ref_counts_[block];
  if (rc == 0) {
    throw InvalidArgument(fmt::format(
        "PagedKvCache::inc_ref: block {} is free (refcount 0) at {}:{}; sharing it would alias it "
        "with its next owner\n{}",
        block, where.file_name(), where.line(), trace_.dump(block)));
  }
  if (rc == std::numeric_limits<std::uint32_t>::max()) {
    throw InvalidArgument(
        fmt::format("PagedKvCache::inc_ref: block {} refcount would overflow", block));
  }
  ++rc;
  if (trace_.is_on()) trace_.record(block, BlockOp::inc, rc, where);
}

bool PagedKvCache::ignore_release(BlockId block, BlockOp op, const std::source_location& where) {
  ++counters_.ignored_double_frees;
  if (trace_.is_on()) trace_.record(block, BlockOp::ignored_dec, 0, where);
  const bool evict = op == BlockOp::evict_return;
  const std::string message = fmt::format(
      "PagedKvCache::{} on block {} with 0 refs (from {}:{} in {}) - {}; ignored{}",
      evict ? "return_evicted_block" : "dec_ref", block, where.file_name(), where.line(),
      where.function_name(),
      evict ? "the prefix cache returned a block it holds no reference on"
            : "refcount bug (a double free); it would otherwise wrap the count and pin the block",
      trace_.is_on() ? "\n  history:\n" + trace_.dump(block)
                     : std::string(" [set KVPORT_KV_TRACE=1 for this block's history]"));
  if (evict) {
    log::warn(message);
  } else {
    log::error(message);
  }
  return false;
}

void PagedKvCache::free_blocks(std::span<const BlockId> table, std::source_location where) {
  for (BlockId block : table)
    check_block(block, "free_blocks");
  for (BlockId block : table)
    release(block, BlockOp::dec, where);
}

void PagedKvCache::return_evicted_block(BlockId block, std::source_location where) {
  check_block(block, "return_evicted_block");
  release(block, BlockOp::evict_return, where);
}

// ---- pointers ----------------------------------------------------------------------------

DevicePtr PagedKvCache::k_cache_ptr(std::size_t layer, BlockId block) const {
  const BlockPool& pool = layer_pool(layer, KvPart::k, "k_cache_ptr");
  check_block(block, "k_cache_ptr");
  return pool.region(block).ptr;
}

DevicePtr PagedKvCache::v_cache_ptr(std::size_t layer, BlockId block) const {
  const BlockPool& pool = layer_pool(layer, KvPart::v, "v_cache_ptr");
  check_block(block, "v_cache_ptr");
  return pool.region(block).ptr;
}

DevicePtr PagedKvCache::k_pool_ptr(std::size_t layer) const {
  return layer_pool(layer, KvPart::k, "k_pool_ptr").base;
}

DevicePtr PagedKvCache::v_pool_ptr(std::size_t layer) const {
  return layer_pool(layer, KvPart::v, "v_pool_ptr").base;
}

std::size_t PagedKvCache::k_block_stride(std::size_t layer) const {
  return layer_pool(layer, KvPart::k, "k_block_stride").stride;
}

std::size_t PagedKvCache::v_block_stride(std::size_t layer) const {
  return layer_pool(layer, KvPart::v, "v_block_stride").stride;
}

std::size_t PagedKvCache::k_block_bytes(std::size_t layer) const {
  return layer_pool(layer, KvPart::k, "k_block_bytes").region_bytes;
}

std::size_t PagedKvCache::v_block_bytes(std::size_t layer) const {
  check_layer(layer, "v_block_bytes");
  return pools_[2 * layer + 1].region_bytes;  // 0 for K-only layers
}

KvCacheDtype PagedKvCache::dtype_for_layer(std::size_t layer) const {
  return layer_pool(layer, KvPart::k, "dtype_for_layer").dtype;
}

// ---- device work --------------------------------------------------------------------------

void PagedKvCache::fill_blocks(std::span<const BlockId> blocks, std::uint8_t value,
                               StreamView stream, const char* op) {
  for (BlockId block : blocks)
    check_block(block, op);
  last_fill_regions_ = 0;
  if (blocks.empty()) return;
  // Sorted and unique: runs of consecutive ids coalesce into one region per
  // pool, and no byte is written twice.
  scratch_ids_.assign(blocks.begin(), blocks.end());
  if (!std::is_sorted(scratch_ids_.begin(), scratch_ids_.end())) {
    std::sort(scratch_ids_.begin(), scratch_ids_.end());
  }
  scratch_ids_.erase(std::unique(scratch_ids_.begin(), scratch_ids_.end()), scratch_ids_.end());
  std::size_t runs = 1;
  for (std::size_t i = 1; i < scratch_ids_.size(); ++i) {
    runs += scratch_ids_[i] != scratch_ids_[i - 1] + 1 ? 1 : 0;
  }
  const bool is_new = prepare_to_note(stream);
  backend_->fill_blocks_async(pool_set_, scratch_ids_, value, stream);
  note_stream(stream, is_new);
  last_fill_regions_ = runs * pool_set_.num_pools();
}

void PagedKvCache::zero_blocks(std::span<const BlockId> blocks, StreamView stream) {
  fill_blocks(blocks, 0, stream, "zero_blocks");
}

void PagedKvCache::poison_blocks(std::span<const BlockId> blocks, StreamView stream) {
  fill_blocks(blocks, kPoisonByte, stream, "poison_blocks");
}

void PagedKvCache::copy_blocks(std::span<const BlockCopy> copies, StreamView stream) {
  for (const BlockCopy& c : copies) {
    check_block(c.src, "copy_blocks");
    check_block(c.dst, "copy_blocks");
    if (c.src == c.dst) {
      throw InvalidArgument(
          fmt::format("PagedKvCache::copy_blocks: block {} is copied onto itself", c.src));
    }
  }
  if (copies.empty()) return;
  // A destination may not be written twice or read by another copy: the
  // copies of one batch run in no particular order.
  if (copies.size() > 1) {
    scratch_ids_.clear();
    for (const BlockCopy& c : copies)
      scratch_ids_.push_back(c.dst);
    std::sort(scratch_ids_.begin(), scratch_ids_.end());
    auto is_dst = [&](BlockId b) {
      return std::binary_search(scratch_ids_.begin(), scratch_ids_.end(), b);
    };
    if (auto dup = std::adjacent_find(scratch_ids_.begin(), scratch_ids_.end());
        dup != scratch_ids_.end()) {
      throw InvalidArgument(fmt::format(
          "PagedKvCache::copy_blocks: block {} is the destination of two copies", *dup));
    }
    for (const BlockCopy& c : copies) {
      if (is_dst(c.src)) {
        throw InvalidArgument(fmt::format(
            "PagedKvCache::copy_blocks: block {} is both a source and a destination", c.src));
      }
    }
  }
  scratch_regions_.clear();
  // One region per copy and memory pool: every layer's K and V (one region in
  // block-major layout).
  for (const BlockCopy& c : copies) {
    for (const BlockPool& pool : memory_pools_) {
      scratch_regions_.push_back(
          CopyRegion{pool.region(c.dst).ptr, pool.region(c.src).ptr, pool.region_bytes});
    }
  }
  const bool is_new = prepare_to_note(stream);
  backend_->copy_batch_async(scratch_regions_, stream);
  note_stream(stream, is_new);
}

PagedKvCache::HostBlock PagedKvCache::read_block(std::size_t layer, BlockId block,
                                                 StreamView stream) const {
  check_layer(layer, "read_block");
  check_block(block, "read_block");
  const DeviceRegion k = pools_[2 * layer].region(block);
  HostBlock out;
  out.k.resize(k.bytes);
  out.v.resize(pools_[2 * layer + 1].region_bytes);  // empty for K-only layers
  backend_->copy_d2h_async(out.k.data(), k.ptr, out.k.size(), stream);
  if (!config_.has_v()) {
    backend_->synchronize(stream);
    return out;
  }
  try {
    backend_->copy_d2h_async(out.v.data(), pools_[2 * layer + 1].region(block).ptr, out.v.size(),
                             stream);
  } catch (...) {
    wait_before_unwinding(*backend_, stream);  // the K copy still writes into `out`
    throw;
  }
  backend_->synchronize(stream);
  return out;
}

void PagedKvCache::write_block(std::size_t layer, BlockId block, std::span<const std::uint8_t> k,
                               std::span<const std::uint8_t> v, StreamView stream) {
  check_layer(layer, "write_block");
  check_block(block, "write_block");
  const BlockPool& k_pool = pools_[2 * layer];
  const BlockPool& v_pool = pools_[2 * layer + 1];
  if (k.size() != k_pool.region_bytes || v.size() != v_pool.region_bytes) {
    throw InvalidArgument(fmt::format(
        "PagedKvCache::write_block: layer {} expects {} K bytes and {} V bytes{}, got {} and {}",
        layer, k_pool.region_bytes, v_pool.region_bytes,
        config_.has_v() ? "" : " (the layers have no V: K-only, so v must be empty)", k.size(),
        v.size()));
  }
  backend_->copy_h2d_async(k_pool.region(block).ptr, k.data(), k.size(), stream);
  if (!config_.has_v()) {
    backend_->synchronize(stream);
    return;
  }
  try {
    backend_->copy_h2d_async(v_pool.region(block).ptr, v.data(), v.size(), stream);
  } catch (...) {
    wait_before_unwinding(*backend_, stream);  // the K copy still reads `k`
    throw;
  }
  backend_->synchronize(stream);
}

// ---- diagnostics ---------------------------------------------------------------------------

InvariantReport PagedKvCache::check_invariants() const {
  InvariantReport report;
  if (shared_ != nullptr) {
    // The free list is the pool's (SharedBlockPool::check_invariants checks
    // it across groups): here, the blocks this group holds.
    std::size_t held = 0;
    for (std::size_t b = 0; b < num_blocks_; ++b) {
      if (ref_counts_[b] != 0) ++held;
    }
    for (const BlockId b : *free_) {
      if (b < num_blocks_ && ref_counts_[b] != 0) {
        report.add_violation(
            fmt::format("block {} is on the shared free list with refcount {}", b, ref_counts_[b]));
      }
    }
    if (held != held_) {
      report.add_violation(
          fmt::format("{} blocks have a refcount but the cache counts {} held", held, held_));
    }
    report.blocks_checked = held;
    report.blocks_in_use = held;
    return report;
  }
  report.blocks_checked = num_blocks_;
  std::vector<std::uint32_t> on_free_list(num_blocks_, 0);
  for (std::size_t i = 0; i < free_list_.size(); ++i) {
    const BlockId b = free_list_[i];
    if (b >= num_blocks_) {
      report.add_violation(fmt::format("free list slot {} holds out-of-range block {}", i, b));
      continue;
    }
    ++on_free_list[b];
  }
  for (std::size_t b = 0; b < num_blocks_; ++b) {
    const std::uint32_t rc = ref_counts_[b];
    const std::uint32_t n = on_free_list[b];
    if (n > 1) report.add_violation(fmt::format("block {} is on the free list {} times", b, n));
    if (n >= 1 && rc != 0)
      report.add_violation(fmt::format("block {} is on the free list with refcount {}", b, rc));
    if (n == 0 && rc == 0) {
      report.add_violation(
          fmt::format("block {} has refcount 0 but is not on the free list (leaked)", b));
    }
    if (n == 0) {
      ++report.blocks_in_use;
    } else {
      ++report.free_blocks;
    }
  }
  return report;
}

}  // namespace kvport
