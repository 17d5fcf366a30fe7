// SPDX-License-Identifier: Apache-2.0
/* kvport.h: the C ABI of kvport (libkvport_c). C99; usable from C++.
 *
 * Every call returns a kvport_status; results come back through
 * out-parameters. No C++ exception crosses this boundary: each kvport
 * exception type has its own status code, and kvport_last_error() gives the
 * message of the last failing call of the calling thread.
 *
 * Handles (kvport_backend, kvport_cache, kvport_stream, kvport_prefix_cache,
 * kvport_block_table, kvport_hybrid_cache, kvport_hybrid_block_table) are
 * opaque tokens, not addresses: they are never
 * dereferenced, and a token is never reused within a process, so a null,
 * destroyed or forged handle, or one of another kind, is reported as
 * KVPORT_ERR_INVALID_HANDLE instead of crashing. Each call looks its handles
 * up in a process-wide, mutex-protected table (about the cost of one
 * uncontended lock).
 *
 * Ownership: a backend outlives its caches, hybrid caches and streams, a
 * cache its prefix cache and block tables, a prefix cache its block tables, a
 * hybrid cache its hybrid block tables. Destroying a handle that still has
 * live children fails with KVPORT_ERR_HANDLE_IN_USE and changes nothing. A
 * borrowed handle (a hybrid cache's group pool as a kvport_cache) belongs to
 * the handle it came from: it is never destroyed by itself and becomes
 * invalid when its owner is destroyed.
 *
 * Thread safety: the handle table is thread-safe. A cache (with its prefix
 * cache and block tables) is not, as in C++: one thread at a time. A handle
 * must not be destroyed while another thread is inside a call that uses it.
 *
 * docs/bindings/c.md has an example program and the build lines.
 */
#ifndef KVPORT_KVPORT_H
#define KVPORT_KVPORT_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#if defined(_WIN32)
#if defined(KVPORT_C_BUILDING)
#define KVPORT_API __declspec(dllexport)
#else
#define KVPORT_API __declspec(dllimport)
#endif
#elif defined(KVPORT_C_BUILDING)
#define KVPORT_API __attribute__((visibility("default")))
#else
#define KVPORT_API
#endif

#ifdef __cplusplus
extern "C" {
#endif

/* ---- status codes ---------------------------------------------------------- */

typedef enum kvport_status {
  KVPORT_OK = 0,
  /** A kvport::Error not covered by a more specific code. */
  KVPORT_ERR_ERROR = 1,
  /** kvport::InvalidArgument: a value outside the contract (bad config field,
   *  null pointer argument, wrong buffer length, unknown backend name, a
   *  stream of another backend, inc_ref of a free block, ...). */
  KVPORT_ERR_INVALID_ARGUMENT = 2,
  /** kvport::CacheExhausted: no free (or evictable) block. Recoverable. */
  KVPORT_ERR_CACHE_EXHAUSTED = 3,
  /** kvport::OutOfMemory (or std::bad_alloc): an allocation failed. */
  KVPORT_ERR_OUT_OF_MEMORY = 4,
  /** kvport::BackendError: a vendor runtime call failed. */
  KVPORT_ERR_BACKEND = 5,
  /** kvport::DeviceLost: the device context is gone; restart the process. */
  KVPORT_ERR_DEVICE_LOST = 6,
  /** kvport::OutOfRange: a block id >= the cache's block count, a layer >=
   *  its layer count, a group >= a hybrid cache's group count, a state
   *  tensor index >= the spec's count. In C++ it is a kind of
   *  InvalidArgument; here it has its own code (never
   *  KVPORT_ERR_INVALID_ARGUMENT). Nothing changed. */
  KVPORT_ERR_OUT_OF_RANGE = 7,
  /** A null, destroyed or foreign handle, or a handle of another kind. */
  KVPORT_ERR_INVALID_HANDLE = 8,
  /** Destroying a handle that still has live children (see the ownership
   *  rules above). Nothing was destroyed. */
  KVPORT_ERR_HANDLE_IN_USE = 9,
  /** Anything unexpected (a non-kvport C++ exception). */
  KVPORT_ERR_UNKNOWN = 10
} kvport_status;

/** "KVPORT_OK", "KVPORT_ERR_INVALID_ARGUMENT", ...; "KVPORT_ERR_<unknown
 *  status>" for a value outside the enum. Never null; static storage. Takes
 *  an int32_t (a kvport_status converts implicitly) so that any value a
 *  foreign caller passes is defined behaviour. */
KVPORT_API const char* kvport_status_name(int32_t status);

/** The message of the last call of this thread that returned a status other
 *  than KVPORT_OK ("" when none did). Successful calls leave it unchanged.
 *  Valid until the next failing call of this thread. Never null. */
KVPORT_API const char* kvport_last_error(void);

/** Empties this thread's last error message. */
KVPORT_API void kvport_clear_last_error(void);

/* ---- version --------------------------------------------------------------- */

/** "0.1.0": the kvport version this library was built from. */
KVPORT_API const char* kvport_version_string(void);

/** The version numbers; any pointer may be null. */
KVPORT_API kvport_status kvport_version(uint32_t* major, uint32_t* minor, uint32_t* patch);

/* ---- handles ---------------------------------------------------------------- */

typedef struct kvport_backend kvport_backend;
typedef struct kvport_stream kvport_stream;
typedef struct kvport_cache kvport_cache;
typedef struct kvport_prefix_cache kvport_prefix_cache;
typedef struct kvport_block_table kvport_block_table;
typedef struct kvport_hybrid_cache kvport_hybrid_cache;
typedef struct kvport_hybrid_block_table kvport_hybrid_block_table;

/* ---- backends --------------------------------------------------------------- */

/** Builds the backend called `name` from the compiled registry ("host",
 *  "cuda", "hip"), or "default": $KVPORT_BACKEND when set, else the first GPU
 *  backend with a device, else host. KVPORT_ERR_INVALID_ARGUMENT for an
 *  unknown name (the message lists the compiled ones), KVPORT_ERR_BACKEND
 *  when it has no device. */
KVPORT_API kvport_status kvport_backend_create(const char* name, kvport_backend** out);

/** As kvport_backend_create, on device ordinal `device` (not for "default").
 *  KVPORT_ERR_INVALID_ARGUMENT when `device` is not below the device count. */
KVPORT_API kvport_status kvport_backend_create_on(const char* name, int device,
                                                  kvport_backend** out);

/** Destroys a backend. KVPORT_ERR_HANDLE_IN_USE while a cache or stream
 *  created on it lives. */
KVPORT_API kvport_status kvport_backend_destroy(kvport_backend* backend);

/** The backend's name ("host", ...); valid as long as the backend. */
KVPORT_API kvport_status kvport_backend_name(const kvport_backend* backend, const char** out);

/** Devices the backend sees (host: 1). */
KVPORT_API kvport_status kvport_backend_device_count(const kvport_backend* backend, int* out);

/** Free and total bytes of the backend's device; either pointer may be null. */
KVPORT_API kvport_status kvport_backend_mem_info(const kvport_backend* backend, size_t* free_bytes,
                                                 size_t* total_bytes);

/** Waits for the backend's default stream (the stream a null kvport_stream*
 *  selects). */
KVPORT_API kvport_status kvport_backend_synchronize(kvport_backend* backend);

/* ---- streams ------------------------------------------------------------------ */

/* Every call that takes a `kvport_stream*` accepts NULL for the default
 * stream of the backend involved. A stream of another backend is
 * KVPORT_ERR_INVALID_ARGUMENT. */

/** An independent in-order work queue on `backend`. */
KVPORT_API kvport_status kvport_stream_create(kvport_backend* backend, kvport_stream** out);

/** Waits for queued work, then destroys the stream. */
KVPORT_API kvport_status kvport_stream_destroy(kvport_stream* stream);

/** Waits for every operation queued on `stream`; reports the first
 *  asynchronous error since the last synchronize (KVPORT_ERR_BACKEND). */
KVPORT_API kvport_status kvport_stream_synchronize(kvport_stream* stream);

/* ---- configuration ------------------------------------------------------------- */

/** Element formats (mirror kvport::KvCacheDtype, same values). */
typedef enum kvport_dtype {
  KVPORT_DTYPE_F16 = 0,
  KVPORT_DTYPE_BF16 = 1,
  KVPORT_DTYPE_FP8_E4M3 = 2,
  KVPORT_DTYPE_FP8_E5M2 = 3,
  KVPORT_DTYPE_NVFP4 = 4,
  KVPORT_DTYPE_TURBO2 = 5,
  KVPORT_DTYPE_TURBO3 = 6,
  KVPORT_DTYPE_TURBO4 = 7,
  KVPORT_DTYPE_TURBO8 = 8
} kvport_dtype;

/** Pool layouts (mirror kvport::KvCacheLayout). */
typedef enum kvport_layout {
  /** One K pool and one V pool per layer. */
  KVPORT_LAYOUT_LAYER_MAJOR = 0,
  /** One pool; block b holds every layer's K and V contiguously. */
  KVPORT_LAYOUT_BLOCK_MAJOR = 1
} kvport_layout;

/** A cache's shape (kvport::KvCacheConfig). The enum fields are int32_t so
 *  that the struct layout does not depend on the size of an enum. */
typedef struct kvport_config {
  size_t num_layers;
  size_t block_size; /**< tokens per block */
  size_t num_kv_heads;
  size_t head_dim_k;
  size_t head_dim_v;
  int32_t dtype;  /**< a kvport_dtype */
  int32_t layout; /**< a kvport_layout */
  /** Per-layer dtype override (kvport_dtype values): null and 0 for none,
   *  else exactly num_layers entries. Read during the call only. */
  const int32_t* layer_dtypes;
  size_t num_layer_dtypes;
} kvport_config;

/** Fills `config` with the defaults: every size 0 except block_size 16,
 *  dtype bf16, layer-major, no per-layer dtypes. */
KVPORT_API kvport_status kvport_config_init(kvport_config* config);

/** KVPORT_OK for a valid config; else KVPORT_ERR_INVALID_ARGUMENT with the
 *  field named in the message. */
KVPORT_API kvport_status kvport_config_validate(const kvport_config* config);

/** Bytes one block costs across all layers, K + V. */
KVPORT_API kvport_status kvport_config_bytes_per_block(const kvport_config* config, size_t* out);

/** How many blocks of `config` fit in `available_bytes` (pool alignment
 *  included, capped at the 32-bit block id range). */
KVPORT_API kvport_status kvport_compute_num_blocks(const kvport_config* config,
                                                   size_t available_bytes, size_t* out);

/** "f16", "bf16", "fp8_e4m3", ...; null for a value outside kvport_dtype. */
KVPORT_API const char* kvport_dtype_name(int32_t dtype);

/** Parses a dtype name (the names above, plus "fp16", "float16", "bfloat16",
 *  "fp8"). KVPORT_ERR_INVALID_ARGUMENT for an unknown name. */
KVPORT_API kvport_status kvport_dtype_from_name(const char* name, int32_t* out);

/** Byte layout of the K (or V) part of one block of one layer
 *  (kvport::BlockRegionLayout): [ data | pad to 16 B | scales | pad to 16 B ].
 *  docs/formats.md has the formulas. */
typedef struct kvport_region_layout {
  size_t data_bytes;    /**< packed element bytes */
  size_t data_padding;  /**< zero bytes after the data */
  size_t scale_offset;  /**< data_bytes + data_padding */
  size_t scale_bytes;   /**< 0 for dtypes without scales */
  size_t scale_padding; /**< zero bytes after the scales */
  size_t total_bytes;   /**< the region's size in the pool */
} kvport_region_layout;

/** The layout of one K or V region of `block_size` tokens x `num_kv_heads`
 *  x `head_dim` elements of `dtype`. KVPORT_ERR_INVALID_ARGUMENT for a zero
 *  size, a head_dim that is not a multiple of the dtype's group, or an
 *  overflow. */
KVPORT_API kvport_status kvport_block_region_layout(int32_t dtype, size_t block_size,
                                                    size_t num_kv_heads, size_t head_dim,
                                                    kvport_region_layout* out);

/* ---- caches ------------------------------------------------------------------------ */

/** Validates `config` and allocates `num_blocks` blocks on `backend`.
 *  KVPORT_ERR_INVALID_ARGUMENT for a bad config or num_blocks 0 or > 2^32-1,
 *  KVPORT_ERR_OUT_OF_MEMORY when the pools do not fit. Pool contents are
 *  unspecified until zeroed. */
KVPORT_API kvport_status kvport_cache_create(const kvport_config* config, size_t num_blocks,
                                             kvport_backend* backend, kvport_cache** out);

/** Waits for device work the cache queued, then frees the pools.
 *  KVPORT_ERR_HANDLE_IN_USE while a prefix cache or block table over it
 *  lives. */
KVPORT_API kvport_status kvport_cache_destroy(kvport_cache* cache);

/** The cache's config; `out->layer_dtypes` points into the cache (valid as
 *  long as the cache; null when the config had none). */
KVPORT_API kvport_status kvport_cache_config(const kvport_cache* cache, kvport_config* out);

KVPORT_API kvport_status kvport_cache_num_blocks(const kvport_cache* cache, size_t* out);
KVPORT_API kvport_status kvport_cache_num_free_blocks(const kvport_cache* cache, size_t* out);
KVPORT_API kvport_status kvport_cache_num_blocks_in_use(const kvport_cache* cache, size_t* out);
KVPORT_API kvport_status kvport_cache_num_layers(const kvport_cache* cache, size_t* out);
/** Bytes of all pools together. */
KVPORT_API kvport_status kvport_cache_total_bytes(const kvport_cache* cache, size_t* out);

/* Allocation and reference counts: O(1), no device work. Sequences that use
 * a prefix cache allocate and release through it (or a block table), not
 * here. */

/** Pops the free list (LIFO: a fresh cache yields 0, 1, 2, ...) and sets the
 *  block's refcount to 1. KVPORT_ERR_CACHE_EXHAUSTED when no block is free. */
KVPORT_API kvport_status kvport_cache_alloc(kvport_cache* cache, uint32_t* out_block);

/** As kvport_cache_alloc, but an empty free list is KVPORT_OK with
 *  *out_allocated = false (and *out_block unchanged). */
KVPORT_API kvport_status kvport_cache_try_alloc(kvport_cache* cache, uint32_t* out_block,
                                                bool* out_allocated);

/** Adds a reference. KVPORT_ERR_INVALID_ARGUMENT for a free block. */
KVPORT_API kvport_status kvport_cache_inc_ref(kvport_cache* cache, uint32_t block);

/** Drops a reference; *out_freed (may be null) tells whether the block went
 *  back to the free list. At refcount 0 the call is logged, counted in
 *  ignored_double_frees and ignored (KVPORT_OK, not freed). */
KVPORT_API kvport_status kvport_cache_dec_ref(kvport_cache* cache, uint32_t block, bool* out_freed);

/** Same as kvport_cache_dec_ref. */
KVPORT_API kvport_status kvport_cache_free(kvport_cache* cache, uint32_t block, bool* out_freed);

/** dec_ref on each of `count` ids, in order; every id is checked first. */
KVPORT_API kvport_status kvport_cache_free_blocks(kvport_cache* cache, const uint32_t* blocks,
                                                  size_t count);

/** Gives back a block a prefix cache evicted (like dec_ref; refcount 0 is
 *  logged, counted and ignored). */
KVPORT_API kvport_status kvport_cache_return_evicted_block(kvport_cache* cache, uint32_t block);

KVPORT_API kvport_status kvport_cache_ref_count(const kvport_cache* cache, uint32_t block,
                                                uint32_t* out);

/* Pointers and strides. Pointers are device addresses of the cache's
 * backend (host memory on the host backend). Block b of a layer's K lives at
 * k_pool_ptr(layer) + b * k_block_stride(layer), k_block_bytes(layer) long;
 * the stride is the region size in layer-major layout and the whole block
 * (all layers, K and V) in block-major. A cache of K-only layers (head_dim_v
 * 0: a hybrid cache's MLA and state groups) has no V: the v_ptr, v_pool_ptr
 * and v_block_stride calls fail with KVPORT_ERR_INVALID_ARGUMENT and
 * v_block_bytes is 0. */

KVPORT_API kvport_status kvport_cache_k_ptr(const kvport_cache* cache, size_t layer, uint32_t block,
                                            void** out);
KVPORT_API kvport_status kvport_cache_v_ptr(const kvport_cache* cache, size_t layer, uint32_t block,
                                            void** out);
KVPORT_API kvport_status kvport_cache_k_pool_ptr(const kvport_cache* cache, size_t layer,
                                                 void** out);
KVPORT_API kvport_status kvport_cache_v_pool_ptr(const kvport_cache* cache, size_t layer,
                                                 void** out);
KVPORT_API kvport_status kvport_cache_k_block_stride(const kvport_cache* cache, size_t layer,
                                                     size_t* out);
KVPORT_API kvport_status kvport_cache_v_block_stride(const kvport_cache* cache, size_t layer,
                                                     size_t* out);
KVPORT_API kvport_status kvport_cache_k_block_bytes(const kvport_cache* cache, size_t layer,
                                                    size_t* out);
KVPORT_API kvport_status kvport_cache_v_block_bytes(const kvport_cache* cache, size_t layer,
                                                    size_t* out);
/** The layout of `layer`'s K (V) region of a block. */
KVPORT_API kvport_status kvport_cache_k_region_layout(const kvport_cache* cache, size_t layer,
                                                      kvport_region_layout* out);
KVPORT_API kvport_status kvport_cache_v_region_layout(const kvport_cache* cache, size_t layer,
                                                      kvport_region_layout* out);
/** The layer's kvport_dtype. */
KVPORT_API kvport_status kvport_cache_layer_dtype(const kvport_cache* cache, size_t layer,
                                                  int32_t* out);

/* Device work. Every id is checked (KVPORT_ERR_OUT_OF_RANGE) before any
 * work is queued; an empty batch queues nothing. */

/** Sets every layer's K and V bytes of the blocks to 0, as ONE backend call
 *  per batch, queued on `stream` (null: the backend's default stream). */
KVPORT_API kvport_status kvport_cache_zero_blocks(kvport_cache* cache, const uint32_t* blocks,
                                                  size_t count, kvport_stream* stream);
/** As zero_blocks, with 0xFF bytes (to catch reads of unwritten KV). */
KVPORT_API kvport_status kvport_cache_poison_blocks(kvport_cache* cache, const uint32_t* blocks,
                                                    size_t count, kvport_stream* stream);
KVPORT_API kvport_status kvport_cache_zero_block(kvport_cache* cache, uint32_t block,
                                                 kvport_stream* stream);
KVPORT_API kvport_status kvport_cache_poison_block(kvport_cache* cache, uint32_t block,
                                                   kvport_stream* stream);

/** One block-to-block copy. */
typedef struct kvport_block_copy {
  uint32_t src;
  uint32_t dst;
} kvport_block_copy;

/** Copies every layer's K and V of each src block to its dst block, in ONE
 *  batched backend call on `stream`. KVPORT_ERR_INVALID_ARGUMENT for src ==
 *  dst or a block that is the destination of one copy and the source or
 *  destination of another. */
KVPORT_API kvport_status kvport_cache_copy_blocks(kvport_cache* cache,
                                                  const kvport_block_copy* copies, size_t count,
                                                  kvport_stream* stream);

/** Copies `layer`'s K and V bytes of `block` into host buffers of exactly
 *  k_block_bytes(layer) / v_block_bytes(layer) bytes (else
 *  KVPORT_ERR_INVALID_ARGUMENT), synchronizing `stream` first. `v_out` may
 *  be null when v_block_bytes is 0 (K-only layers: a hybrid cache's MLA and
 *  state groups). */
KVPORT_API kvport_status kvport_cache_read_block(const kvport_cache* cache, size_t layer,
                                                 uint32_t block, void* k_out, size_t k_bytes,
                                                 void* v_out, size_t v_bytes,
                                                 kvport_stream* stream);

/** Copies host bytes (exactly k_block_bytes / v_block_bytes long) into
 *  `layer`'s K and V of `block` and synchronizes `stream`. `v` may be null
 *  when v_bytes is 0 (K-only layers). */
KVPORT_API kvport_status kvport_cache_write_block(kvport_cache* cache, size_t layer, uint32_t block,
                                                  const void* k, size_t k_bytes, const void* v,
                                                  size_t v_bytes, kvport_stream* stream);

/** Waits for every stream the cache queued work on since the last call;
 *  KVPORT_ERR_BACKEND for an asynchronous error. */
KVPORT_API kvport_status kvport_cache_synchronize(kvport_cache* cache);

/** Monotonic counters since creation (kvport::KvCacheCounters). */
typedef struct kvport_cache_counters {
  uint64_t allocs;
  uint64_t frees;
  uint64_t ignored_double_frees;
  uint64_t exhaustion_events;
  uint64_t peak_blocks_in_use;
} kvport_cache_counters;

KVPORT_API kvport_status kvport_cache_counters_get(const kvport_cache* cache,
                                                   kvport_cache_counters* out);

/** The result of an invariant check (kvport::InvariantReport). */
typedef struct kvport_invariant_report {
  bool ok;
  size_t blocks_checked;
  size_t free_blocks;
  size_t blocks_in_use;
  size_t evictable_blocks; /**< prefix cache only */
  size_t cached_blocks;    /**< prefix cache only */
  size_t num_violations;   /**< violation lines kept in the text */
} kvport_invariant_report;

/** Checks the free list and refcounts (O(num_blocks)). `text` (may be null
 *  with text_size 0) receives the report's text, "ok: N blocks, ..." or one
 *  line per violation, truncated to text_size - 1 bytes and NUL-terminated;
 *  *text_needed (may be null) is the full length + 1. A violated invariant is
 *  KVPORT_OK with report->ok false. */
KVPORT_API kvport_status kvport_cache_check_invariants(const kvport_cache* cache,
                                                       kvport_invariant_report* report, char* text,
                                                       size_t text_size, size_t* text_needed);

/* ---- prefix caches --------------------------------------------------------------- */

/** Automatic prefix caching over `cache` (kvport::PrefixCache). */
KVPORT_API kvport_status kvport_prefix_cache_create(kvport_cache* cache, kvport_prefix_cache** out);

/** Drops the prefix cache's reference on every cached block.
 *  KVPORT_ERR_HANDLE_IN_USE while a block table over it lives. */
KVPORT_API kvport_status kvport_prefix_cache_destroy(kvport_prefix_cache* prefix_cache);

/** The longest cached prefix of full blocks of `tokens` under `extra_key`.
 *  Writes the matched blocks (the caller owns one reference on each; give
 *  it back with kvport_prefix_cache_release) to `out_blocks`, which must
 *  have room for num_tokens / block_size ids (KVPORT_ERR_INVALID_ARGUMENT
 *  otherwise, checked before the lookup). *out_num_blocks gets the count,
 *  *out_num_tokens (may be null) count * block_size. */
KVPORT_API kvport_status kvport_prefix_cache_lookup(kvport_prefix_cache* prefix_cache,
                                                    const uint32_t* tokens, size_t num_tokens,
                                                    uint64_t extra_key, uint32_t* out_blocks,
                                                    size_t out_capacity, size_t* out_num_blocks,
                                                    size_t* out_num_tokens);

/** A block for a sequence, refcount 1: free, or by evicting the least
 *  recently used cached block. KVPORT_ERR_CACHE_EXHAUSTED when neither. */
KVPORT_API kvport_status kvport_prefix_cache_alloc(kvport_prefix_cache* prefix_cache,
                                                   uint32_t* out_block);
KVPORT_API kvport_status kvport_prefix_cache_try_alloc(kvport_prefix_cache* prefix_cache,
                                                       uint32_t* out_block, bool* out_allocated);

/** Gives back a sequence's reference (a cached block joins the LRU list). */
KVPORT_API kvport_status kvport_prefix_cache_release(kvport_prefix_cache* prefix_cache,
                                                     uint32_t block);
/** Releases `count` blocks, last first; every id is checked first. */
KVPORT_API kvport_status kvport_prefix_cache_release_blocks(kvport_prefix_cache* prefix_cache,
                                                            const uint32_t* blocks, size_t count);

/** Evicts up to `max_blocks` evictable blocks; *out_evicted (may be null)
 *  gets how many. */
KVPORT_API kvport_status kvport_prefix_cache_evict(kvport_prefix_cache* prefix_cache,
                                                   size_t max_blocks, size_t* out_evicted);

KVPORT_API kvport_status
kvport_prefix_cache_num_cached_blocks(const kvport_prefix_cache* prefix_cache, size_t* out);
KVPORT_API kvport_status
kvport_prefix_cache_num_evictable_blocks(const kvport_prefix_cache* prefix_cache, size_t* out);
/** Free plus evictable blocks. */
KVPORT_API kvport_status
kvport_prefix_cache_num_available_blocks(const kvport_prefix_cache* prefix_cache, size_t* out);

/** kvport::PrefixCacheCounters. */
typedef struct kvport_prefix_cache_counters {
  uint64_t lookups;
  uint64_t hits;
  uint64_t misses;
  uint64_t inserts;
  uint64_t evictions;
  uint64_t ignored_releases;
} kvport_prefix_cache_counters;

KVPORT_API kvport_status kvport_prefix_cache_counters_get(const kvport_prefix_cache* prefix_cache,
                                                          kvport_prefix_cache_counters* out);

/** The cache's checks plus the prefix cache's (as kvport_cache_check_invariants). */
KVPORT_API kvport_status kvport_prefix_cache_check_invariants(
    const kvport_prefix_cache* prefix_cache, kvport_invariant_report* report, char* text,
    size_t text_size, size_t* text_needed);

/* ---- block tables ---------------------------------------------------------------------- */

/** How much of a fully cached prompt reuse_cached_prefix may hit
 *  (kvport::PrefixHitMode). */
typedef enum kvport_prefix_hit_mode {
  /** Leave at least the last token to compute (the default). */
  KVPORT_PREFIX_HIT_COMPUTE_LAST_TOKEN = 0,
  /** Every cached full block, up to the whole prompt. */
  KVPORT_PREFIX_HIT_FULL = 1
} kvport_prefix_hit_mode;

/** An empty table (one sequence's blocks) over a plain cache. */
KVPORT_API kvport_status kvport_block_table_create(kvport_cache* cache, kvport_block_table** out);

/** An empty table over a prefix cache; `extra_key` (e.g. a LoRA id) goes into
 *  every block hash. */
KVPORT_API kvport_status kvport_block_table_create_prefixed(kvport_prefix_cache* prefix_cache,
                                                            uint64_t extra_key,
                                                            kvport_block_table** out);

/** Releases every block of the table and destroys it. */
KVPORT_API kvport_status kvport_block_table_destroy(kvport_block_table* table);

/** Starts an empty table with the longest cached prefix of `prompt`;
 *  *out_hit_tokens gets the tokens it covers (0 over a plain cache). A copy
 *  of a fully cached last block goes on `stream`; with a null stream it goes
 *  on the default stream, which the call then synchronizes.
 *  KVPORT_ERR_INVALID_ARGUMENT when the table is not empty. */
KVPORT_API kvport_status kvport_block_table_reuse_cached_prefix(kvport_block_table* table,
                                                                const uint32_t* prompt,
                                                                size_t num_tokens,
                                                                kvport_stream* stream,
                                                                size_t* out_hit_tokens);

KVPORT_API kvport_status kvport_block_table_set_prefix_hit_mode(kvport_block_table* table,
                                                                int32_t mode);
KVPORT_API kvport_status kvport_block_table_prefix_hit_mode(const kvport_block_table* table,
                                                            int32_t* out);

/** Appends tokens, allocating blocks (copy-on-write of a shared last block
 *  on `stream`). All or nothing: KVPORT_ERR_CACHE_EXHAUSTED before any
 *  change when the blocks are not available. */
KVPORT_API kvport_status kvport_block_table_append_tokens(kvport_block_table* table,
                                                          const uint32_t* tokens, size_t num_tokens,
                                                          kvport_stream* stream);

/** New blocks appending `num_tokens` would take, copy-on-write included. */
KVPORT_API kvport_status kvport_block_table_blocks_needed(const kvport_block_table* table,
                                                          size_t num_tokens, size_t* out);

/** A new table sharing every block of `table` (one reference each). */
KVPORT_API kvport_status kvport_block_table_fork(const kvport_block_table* table,
                                                 kvport_block_table** out);

/** Releases every block and empties the table (it stays usable). */
KVPORT_API kvport_status kvport_block_table_release(kvport_block_table* table);

/** The table's block ids, in sequence order: *out_blocks points into the
 *  table (valid until the table next changes or is destroyed; may be null
 *  when *out_count is 0). */
KVPORT_API kvport_status kvport_block_table_blocks(const kvport_block_table* table,
                                                   const uint32_t** out_blocks, size_t* out_count);

KVPORT_API kvport_status kvport_block_table_num_tokens(const kvport_block_table* table,
                                                       size_t* out);
/** Copy-on-write copies this table made. */
KVPORT_API kvport_status kvport_block_table_copy_on_writes(const kvport_block_table* table,
                                                           uint64_t* out);

/* ---- layer specs ------------------------------------------------------------------------- */

/* Hybrid models keep different KV in different layers (docs/hybrid-models.md):
 * each layer is described by a kvport_layer_spec, and the layers of one spec
 * form a KV cache group with its own block pool. */

/** What a layer keeps (mirror kvport::LayerKind, same values). */
typedef enum kvport_layer_kind {
  /** K and V of every token. */
  KVPORT_LAYER_FULL_ATTENTION = 0,
  /** One latent vector per token, no V (DeepSeek's multi-head latent attention). */
  KVPORT_LAYER_MLA = 1,
  /** K and V of the last `window` tokens. */
  KVPORT_LAYER_SLIDING_WINDOW = 2,
  /** K and V of the current chunk of `chunk` tokens. */
  KVPORT_LAYER_CHUNKED_LOCAL = 3,
  /** A fixed per-request state (linear attention, Mamba). */
  KVPORT_LAYER_STATE = 4,
  /** No KV (an MLP-only layer). */
  KVPORT_LAYER_NONE = 5
} kvport_layer_kind;

/** The in-cache format of an MLA latent (mirror kvport::MlaFormat). */
typedef enum kvport_mla_format {
  /** kv_lora_rank + rope_dim values of the spec's dtype per token. */
  KVPORT_MLA_PLAIN = 0,
  /** vLLM's fp8_ds_mla: kv_lora_rank fp8 e4m3 values, one fp32 scale per 128
   *  of them, rope_dim bf16 values (656 bytes a token for 512 + 64). */
  KVPORT_MLA_FP8_DS_MLA = 1
} kvport_mla_format;

/** Element types of recurrent state (mirror kvport::StateDtype). */
typedef enum kvport_state_dtype {
  KVPORT_STATE_F32 = 0,
  KVPORT_STATE_F16 = 1,
  KVPORT_STATE_BF16 = 2
} kvport_state_dtype;

/** The most dimensions a state tensor has. */
#define KVPORT_STATE_MAX_DIMS 8

/** One tensor of a layer's per-request state, e.g. Mamba2's SSM state
 *  {"ssm", 3, {heads, head_dim, state_size}, KVPORT_STATE_F32}. */
typedef struct kvport_state_tensor {
  const char* name;                    /**< NUL-terminated, not null */
  size_t ndim;                         /**< 1 .. KVPORT_STATE_MAX_DIMS */
  size_t shape[KVPORT_STATE_MAX_DIMS]; /**< the first ndim entries are read */
  int32_t dtype;                       /**< a kvport_state_dtype */
} kvport_state_tensor;

/** The KV geometry of one layer (kvport::LayerSpec). Only the fields of
 *  `kind` are read:
 *    full_attention    num_kv_heads, head_dim_k, head_dim_v, dtype
 *    sliding_window    the same + window (tokens attended, the token itself included)
 *    chunked_local     the same + chunk (a multiple of the block size)
 *    mla               kv_lora_rank, rope_dim, mla_format, dtype (plain only)
 *    state             state, num_state
 *    none              nothing
 *  The enum fields are int32_t, as in kvport_config. */
typedef struct kvport_layer_spec {
  int32_t kind; /**< a kvport_layer_kind */
  size_t num_kv_heads;
  size_t head_dim_k;
  size_t head_dim_v;
  int32_t dtype; /**< a kvport_dtype: attention K/V and a plain MLA latent */
  size_t window;
  size_t chunk;
  size_t kv_lora_rank;
  size_t rope_dim;
  int32_t mla_format; /**< a kvport_mla_format */
  /** The state tensors: `num_state` entries (null and 0 for other kinds). Read
   *  during the call only, names included. */
  const kvport_state_tensor* state;
  size_t num_state;
} kvport_layer_spec;

/** Fills `spec` with the defaults: full_attention, every size 0, dtype bf16,
 *  plain MLA format, no state tensors. */
KVPORT_API kvport_status kvport_layer_spec_init(kvport_layer_spec* spec);

/** KVPORT_OK for a spec valid with `block_size`; else
 *  KVPORT_ERR_INVALID_ARGUMENT naming the field (a zero size the kind needs,
 *  a packed dtype whose group does not divide a head dim, a chunk that is not
 *  a multiple of block_size, an fp8_ds_mla rank that is not a multiple of 128,
 *  a state without tensors, a null name, two state tensors of one name, ndim
 *  0 or > KVPORT_STATE_MAX_DIMS, a 0 dimension (naming the tensor and the
 *  dimension), an enum value outside its enum, an overflow). */
KVPORT_API kvport_status kvport_layer_spec_validate(const kvport_layer_spec* spec,
                                                    size_t block_size);

/** One line, as kvport::LayerSpec::describe: "sliding_window(128) 8x64 bf16",
 *  "mla(512+64) bf16", "state(ssm 128x64x128 f32, conv 9216x3 f32)", "none".
 *  `text` (may be null with text_size 0) receives it truncated to
 *  text_size - 1 bytes and NUL-terminated; *text_needed (may be null) is its
 *  full length + 1. The spec is not validated. */
KVPORT_API kvport_status kvport_layer_spec_describe(const kvport_layer_spec* spec, char* text,
                                                    size_t text_size, size_t* text_needed);

/** Bytes of one block of one layer of `spec` (K + V regions, scales and
 *  padding included; 0 for state and none). Validates the spec. */
KVPORT_API kvport_status kvport_layer_spec_block_bytes(const kvport_layer_spec* spec,
                                                       size_t block_size, size_t* out);

/** Bytes of one request's state in one layer: every tensor padded to 16
 *  bytes, one after the other (0 for the other kinds). Validates the spec
 *  (with a block size of 1). */
KVPORT_API kvport_status kvport_layer_spec_state_bytes(const kvport_layer_spec* spec, size_t* out);

/** Offset of state tensor `index` inside a state slot (the padded sizes of
 *  the tensors before it). KVPORT_ERR_OUT_OF_RANGE for index >= num_state. */
KVPORT_API kvport_status kvport_layer_spec_state_offset(const kvport_layer_spec* spec, size_t index,
                                                        size_t* out);

/* ---- the hybrid planner ------------------------------------------------------------------ */

/** What kvport_plan_kv_cache is asked to fit (kvport::KvCachePlanRequest). */
typedef struct kvport_plan_request {
  size_t budget_bytes;       /**< memory for every group's pools together */
  size_t max_context_tokens; /**< the longest sequence (prompt + output) */
  /** Requests of max_context_tokens that must fit at once; 0: no minimum. */
  size_t max_requests;
  /** Tokens a running request appends per step (1 for decode). */
  size_t step_tokens;
  /** Cached state checkpoints kept per request beside its working state. */
  size_t state_checkpoints;
  /** Nonzero: the attention groups whose pages match (gpt-oss, Gemma 3,
   *  Llama 4, MLA models) draw from one shared pool of
   *  kvport_plan.shared_blocks blocks, split into groups of at most
   *  kvport_plan.max_group_layers layers first, and memory moves between
   *  them at run time (kvport::KvCachePlanRequest::shared_pool). 0 (the
   *  default): a pool per group. */
  int32_t shared_pool;
} kvport_plan_request;

/** Fills `request` with the defaults: budget, context and requests 0,
 *  step_tokens 1, state_checkpoints 1, shared_pool 0. */
KVPORT_API kvport_status kvport_plan_request_init(kvport_plan_request* request);

/** One group's share (kvport::GroupPlan). */
typedef struct kvport_group_plan {
  int32_t kind;                   /**< the group's kvport_layer_kind */
  size_t num_layers;              /**< layers in the group */
  size_t bytes_per_block;         /**< one block id (one state slot), all layers */
  size_t bytes_per_token;         /**< per-token kinds, all layers; 0 for state */
  size_t bytes_per_request;       /**< state: one state, all layers; else 0 */
  size_t peak_blocks_per_request; /**< blocks (slots) a request holds at its peak */
  size_t num_blocks;              /**< blocks (slots) of the group's pool */
  size_t bytes;                   /**< the pool's bytes, allocation rounding included */
  /** Nonzero: the group draws from the plan's shared pool (num_blocks is
   *  then the shared pool's, bytes 0: kvport_plan.shared_bytes has them). */
  int32_t shared;
} kvport_group_plan;

/** The planner's totals (kvport::KvCachePlan). */
typedef struct kvport_plan {
  size_t block_size;
  size_t num_groups;
  size_t total_bytes; /**< every pool */
  /** Requests of max_context_tokens that fit at once (the smallest over groups). */
  size_t max_concurrent_requests;
  /** Bytes one request of max_context_tokens holds at its peak, over groups. */
  size_t peak_bytes_per_request;
  /** The same with every window and chunked layer treated as full attention. */
  size_t all_full_peak_bytes_per_request;
  /** The same in one shared pool of pages padded to the largest group's page. */
  size_t shared_pool_peak_bytes_per_request;
  /** peak_bytes_per_request / all_full_peak_bytes_per_request. */
  double ratio_to_all_full;
  /** The shared pool's blocks and bytes (0 when no group shares). */
  size_t shared_blocks;
  size_t shared_bytes;
  /** The cap on layers per group the plan's grouping used (0: none, a group
   *  per spec): kvport_hybrid_cache_create_shared takes it. */
  size_t max_group_layers;
  /** The context the plan was made for (request->max_context_tokens). */
  size_t max_context_tokens;
} kvport_plan;

/** Groups the `num_layers` specs (in order of each group's first layer;
 *  `none` layers belong to no group) and splits request->budget_bytes between
 *  the groups in the ratio of their peak need per request
 *  (kvport::plan_kv_cache, layer-major pools). *out_plan gets the totals;
 *  `out_groups` (may be null with groups_capacity 0: totals only) gets one
 *  entry per group and must have room for out_plan->num_groups of them
 *  (num_layers entries always suffice; KVPORT_ERR_INVALID_ARGUMENT otherwise,
 *  checked before anything is written). group_plan.num_blocks is what
 *  kvport_hybrid_cache_create takes as blocks_per_group.
 *  KVPORT_ERR_INVALID_ARGUMENT for a bad spec, no layer or only `none`
 *  layers, a zero block size, budget, context or step, a budget too small for
 *  one block of some group, or one that holds fewer than
 *  request->max_requests requests (the message says how many fit). */
KVPORT_API kvport_status kvport_plan_kv_cache(const kvport_layer_spec* specs, size_t num_layers,
                                              size_t block_size, const kvport_plan_request* request,
                                              kvport_plan* out_plan, kvport_group_plan* out_groups,
                                              size_t groups_capacity);

/* ---- hybrid caches ------------------------------------------------------------------------ */

/** A model's KV cache as KV cache groups (kvport::HybridKvCache): one block
 *  pool and one prefix cache per group. Groups the `num_layers` specs (in
 *  order of each group's first layer) and allocates group g's pool with
 *  blocks_per_group[g] blocks (state groups: state slots); `num_groups` must
 *  be the number of groups (kvport_plan_kv_cache says it, and its
 *  group_plan.num_blocks are counts that fit a budget). Pools are layer-major.
 *  State groups cache a copy of a sequence's state every
 *  state_checkpoint_interval full blocks (0: never, so no prefix hit in a
 *  model with state). KVPORT_ERR_INVALID_ARGUMENT for a bad spec, a
 *  num_groups other than the group count, a zero block count,
 *  KVPORT_ERR_OUT_OF_MEMORY when the pools do not fit (everything allocated
 *  is freed). */
KVPORT_API kvport_status kvport_hybrid_cache_create(kvport_backend* backend,
                                                    const kvport_layer_spec* specs,
                                                    size_t num_layers, size_t block_size,
                                                    size_t state_checkpoint_interval,
                                                    const size_t* blocks_per_group,
                                                    size_t num_groups, kvport_hybrid_cache** out);

/** kvport_hybrid_cache_create with a shared pool: the specs are grouped
 *  with at most `max_group_layers` layers a group (0: every layer of a spec
 *  together; kvport_plan.max_group_layers of a plan made with shared_pool),
 *  the attention groups whose pages match share one pool of `shared_blocks`
 *  blocks (an allocation in any of them evicts the least recently released
 *  cached block of any), and every other group gets blocks_per_group[g]
 *  (entries of groups in the shared pool are ignored; kvport_group_plan's
 *  num_blocks fits). shared_blocks 0 is kvport_hybrid_cache_create.
 *  KVPORT_ERR_INVALID_ARGUMENT as kvport_hybrid_cache_create, and when
 *  shared_blocks > 0 but no two groups can share a pool (the message says
 *  why). */
KVPORT_API kvport_status kvport_hybrid_cache_create_shared(
    kvport_backend* backend, const kvport_layer_spec* specs, size_t num_layers, size_t block_size,
    size_t state_checkpoint_interval, size_t max_group_layers, size_t shared_blocks,
    const size_t* blocks_per_group, size_t num_groups, kvport_hybrid_cache** out);

/** The groups of a prefix cache: the one-group hybrid cache over it and its
 *  pool (a model of one full-attention group is the one-group case of KV
 *  cache groups; kvport_block_table is a hybrid block table over this view).
 *  A borrowed handle, the same on every call: every kvport_hybrid_cache_* and
 *  kvport_hybrid_block_table_* call works on it (group 0, full attention,
 *  every layer of the cache), and tables made over it share the prefix
 *  cache's blocks, hits and events with kvport_block_table's. The prefix
 *  cache cannot be destroyed while such tables live (KVPORT_ERR_HANDLE_IN_USE);
 *  the handle becomes invalid with it. kvport_hybrid_cache_destroy and
 *  kvport_hybrid_cache_enable_events fail on it with
 *  KVPORT_ERR_INVALID_ARGUMENT (its events are the prefix cache's). */
KVPORT_API kvport_status kvport_prefix_cache_as_groups(kvport_prefix_cache* prefix,
                                                       kvport_hybrid_cache** out);

/** The same over a plain cache (no prefix cache): tables over it allocate
 *  and free the cache's blocks, cache nothing and hit nothing (as a
 *  kvport_block_table over the cache). KVPORT_ERR_INVALID_ARGUMENT for a
 *  hybrid cache's group pool. */
KVPORT_API kvport_status kvport_cache_as_groups(kvport_cache* cache, kvport_hybrid_cache** out);

/** Blocks of the shared pool; 0 when no group draws from one. */
KVPORT_API kvport_status kvport_hybrid_cache_shared_pool_blocks(const kvport_hybrid_cache* cache,
                                                                size_t* out);

/** 1 when group `group` draws from the shared pool, else 0.
 *  KVPORT_ERR_OUT_OF_RANGE for group >= num_groups. */
KVPORT_API kvport_status kvport_hybrid_cache_group_in_shared_pool(const kvport_hybrid_cache* cache,
                                                                  size_t group, int32_t* out);

/** Waits for device work the pools queued, then frees them; the group pool
 *  handles of kvport_hybrid_cache_group_cache become invalid.
 *  KVPORT_ERR_HANDLE_IN_USE while a hybrid block table over it lives. */
KVPORT_API kvport_status kvport_hybrid_cache_destroy(kvport_hybrid_cache* cache);

/** Model layers (the num_layers it was created with). */
KVPORT_API kvport_status kvport_hybrid_cache_num_layers(const kvport_hybrid_cache* cache,
                                                        size_t* out);
KVPORT_API kvport_status kvport_hybrid_cache_num_groups(const kvport_hybrid_cache* cache,
                                                        size_t* out);
/** Tokens per block, every group. */
KVPORT_API kvport_status kvport_hybrid_cache_block_size(const kvport_hybrid_cache* cache,
                                                        size_t* out);
/** Bytes of every pool. */
KVPORT_API kvport_status kvport_hybrid_cache_total_bytes(const kvport_hybrid_cache* cache,
                                                         size_t* out);

/* Group queries: KVPORT_ERR_OUT_OF_RANGE for group >= num_groups. */

/** The group's kvport_layer_kind. */
KVPORT_API kvport_status kvport_hybrid_cache_group_kind(const kvport_hybrid_cache* cache,
                                                        size_t group, int32_t* out);

/** The spec of the group's first layer; out->state points into the cache
 *  (valid as long as the cache; null for kinds without state). */
KVPORT_API kvport_status kvport_hybrid_cache_group_spec(const kvport_hybrid_cache* cache,
                                                        size_t group, kvport_layer_spec* out);

/** Layers in the group. */
KVPORT_API kvport_status kvport_hybrid_cache_group_num_layers(const kvport_hybrid_cache* cache,
                                                              size_t group, size_t* out);

/** The group's model layer indices, ascending (group layer i is model layer
 *  out[i]): copied into `out`, which must have room for group_num_layers
 *  entries (KVPORT_ERR_INVALID_ARGUMENT otherwise, nothing written);
 *  *out_count gets the count. */
KVPORT_API kvport_status kvport_hybrid_cache_group_layers(const kvport_hybrid_cache* cache,
                                                          size_t group, size_t* out,
                                                          size_t capacity, size_t* out_count);

/** Blocks (slots) the group holds for sequences: in use and not evictable. */
KVPORT_API kvport_status kvport_hybrid_cache_group_blocks_in_use(const kvport_hybrid_cache* cache,
                                                                 size_t group, size_t* out);

/** The group's pool as a borrowed kvport_cache (the same handle on every
 *  call): its config (K-only for MLA and state groups: head_dim_v 0; a state
 *  group's block is one state slot: block_size 1, dtype fp8_e4m3 as opaque
 *  bytes, head_dim_k the slot's bytes), counts, pointers, strides, region
 *  layouts, read/write/zero/copy, synchronize and check_invariants work on
 *  it. Blocks belong to the hybrid block tables, so kvport_cache_alloc,
 *  try_alloc, inc_ref, dec_ref, free, free_blocks, return_evicted_block,
 *  kvport_prefix_cache_create, kvport_block_table_create and
 *  kvport_cache_destroy fail on it with KVPORT_ERR_INVALID_ARGUMENT. It
 *  becomes invalid when the hybrid cache is destroyed. Pointers of model layer
 *  L: locate(L) gives (group, index); then kvport_cache_k_pool_ptr(pool,
 *  index). */
KVPORT_API kvport_status kvport_hybrid_cache_group_cache(kvport_hybrid_cache* cache, size_t group,
                                                         kvport_cache** out);

/** Where model layer `layer` is: *out_has_kv false for a `none` layer (then
 *  *out_group and *out_index are unchanged), else its group and its layer
 *  index inside the group's pool. KVPORT_ERR_OUT_OF_RANGE for layer >=
 *  num_layers. `out_group` and `out_index` may be null. */
KVPORT_API kvport_status kvport_hybrid_cache_locate(const kvport_hybrid_cache* cache, size_t layer,
                                                    bool* out_has_kv, size_t* out_group,
                                                    size_t* out_index);

/** Counters of kvport_hybrid_block_table_reuse_cached_prefix over the cache
 *  (kvport::HybridHitCounters). */
typedef struct kvport_hybrid_hit_counters {
  uint64_t lookups;
  uint64_t lookup_tokens;     /**< prompt tokens looked up */
  uint64_t hit_tokens;        /**< tokens the hits covered (valid for every group) */
  uint64_t state_checkpoints; /**< state copies cached (every state group) */
} kvport_hybrid_hit_counters;

KVPORT_API kvport_status kvport_hybrid_cache_hit_counters(const kvport_hybrid_cache* cache,
                                                          kvport_hybrid_hit_counters* out);

/** Every group's prefix-cache and pool checks (as
 *  kvport_cache_check_invariants; violations prefixed "group g: ", counts
 *  summed). O(total blocks). */
KVPORT_API kvport_status kvport_hybrid_cache_check_invariants(const kvport_hybrid_cache* cache,
                                                              kvport_invariant_report* report,
                                                              char* text, size_t text_size,
                                                              size_t* text_needed);

/** kvport_cache_synchronize of every group (all are waited for; the first
 *  error is returned). */
KVPORT_API kvport_status kvport_hybrid_cache_synchronize(kvport_hybrid_cache* cache);

/* ---- hybrid block tables ------------------------------------------------------------------ */

/** The entry of a released block in a hybrid block list (never a valid id). */
#define KVPORT_NULL_BLOCK 0xFFFFFFFFu

/** An empty table (one sequence over every group, kvport::HybridBlockTable);
 *  `extra_key` (e.g. a LoRA id) goes into every block hash. Freeing rules:
 *  at each append, a window group releases the blocks wholly before its
 *  window and a chunked group those before the current chunk; their entries
 *  become KVPORT_NULL_BLOCK (full ones stay cached, evictable). A state group
 *  holds one working slot (zeroed when first allocated; the engine updates it
 *  in place) and caches a checkpoint copy at the blocks the cache's interval
 *  says. */
KVPORT_API kvport_status kvport_hybrid_block_table_create(kvport_hybrid_cache* cache,
                                                          uint64_t extra_key,
                                                          kvport_hybrid_block_table** out);

/** Releases every block and slot of the table and destroys it. */
KVPORT_API kvport_status kvport_hybrid_block_table_destroy(kvport_hybrid_block_table* table);

/** Starts an empty table from the longest cached prefix of `prompt` valid for
 *  every group (full attention and MLA: the chain from block 0; a window
 *  group: the blocks of the W - 1 tokens before the hit point; a chunked
 *  group: the hit point's chunk; a state group: a checkpoint at exactly the
 *  hit point, copied into a new working slot on `stream`). Entries before what
 *  a group needs are KVPORT_NULL_BLOCK. *out_hit_tokens gets the tokens it
 *  covers, a multiple of the block size (compute-last-token mode: at most
 *  num_tokens - 1). KVPORT_ERR_INVALID_ARGUMENT when the table is not
 *  empty. */
KVPORT_API kvport_status kvport_hybrid_block_table_reuse_cached_prefix(
    kvport_hybrid_block_table* table, const uint32_t* prompt, size_t num_tokens,
    kvport_stream* stream, size_t* out_hit_tokens);

/** A kvport_prefix_hit_mode (KVPORT_ERR_INVALID_ARGUMENT for another value). */
KVPORT_API kvport_status
kvport_hybrid_block_table_set_prefix_hit_mode(kvport_hybrid_block_table* table, int32_t mode);
KVPORT_API kvport_status
kvport_hybrid_block_table_prefix_hit_mode(const kvport_hybrid_block_table* table, int32_t* out);

/** Nonzero: the table keeps the sliding-window blocks before the end of the
 *  cached prefix its lookup found, once it reaches that point, so that other
 *  requests sharing the prefix still hit there under memory pressure
 *  (kvport::HybridBlockTable::set_keep_shared_windows; off by default). Kept
 *  blocks are held until the table is released or destroyed. */
KVPORT_API kvport_status
kvport_hybrid_block_table_set_keep_shared_windows(kvport_hybrid_block_table* table, int32_t keep);
KVPORT_API kvport_status kvport_hybrid_block_table_keeps_shared_windows(
    const kvport_hybrid_block_table* table, int32_t* out);

/** Nonzero: with KVPORT_PREFIX_HIT_COMPUTE_LAST_TOKEN, a block-aligned prompt
 *  whose blocks every group needs are cached hits n - 1 tokens, each group's
 *  last block a private copy (kvport_block_table's rule;
 *  kvport::HybridBlockTable::set_copy_last_block). Not with a state group, a
 *  lower tier under a cache of several groups, nor without a block for some
 *  group's copy: the hit is then the default rule's. Off by default. */
KVPORT_API kvport_status
kvport_hybrid_block_table_set_copy_last_block(kvport_hybrid_block_table* table, int32_t copy);
KVPORT_API kvport_status
kvport_hybrid_block_table_copies_last_block(const kvport_hybrid_block_table* table, int32_t* out);

/** Keeps the window blocks just before the table's current end (a point
 *  other requests hit): best-effort, nothing kept out of memory; calling it
 *  again moves the kept point (kvport::HybridBlockTable::keep_hit_point). */
KVPORT_API kvport_status kvport_hybrid_block_table_keep_hit_point(kvport_hybrid_block_table* table);

/** The extra references the kept windows hold in group `group`.
 *  KVPORT_ERR_OUT_OF_RANGE for group >= num_groups. */
KVPORT_API kvport_status kvport_hybrid_block_table_num_kept_blocks(
    const kvport_hybrid_block_table* table, size_t group, size_t* out);

/** Appends tokens in every group: applies the freeing rules, takes a state
 *  checkpoint when due, copies a shared last block first (copy-on-write),
 *  allocates what is needed, all on `stream`. All or nothing across groups:
 *  KVPORT_ERR_CACHE_EXHAUSTED (the message names the group) before any
 *  change when some group lacks blocks. */
KVPORT_API kvport_status kvport_hybrid_block_table_append_tokens(kvport_hybrid_block_table* table,
                                                                 const uint32_t* tokens,
                                                                 size_t num_tokens,
                                                                 kvport_stream* stream);

/* Speculative decoding (docs/hybrid-models.md, "Speculative decoding"):
 * draft tokens get KV slots but are never hashed, registered or announced
 * until committed, and the freeing rules see the committed length only. */

/** Appends draft tokens after every token the table holds, allocating as
 *  kvport_hybrid_block_table_append_tokens (all or nothing:
 *  KVPORT_ERR_CACHE_EXHAUSTED names the group); a state group gets one slot
 *  per draft token for the state after it (..._draft_state_slots). */
KVPORT_API kvport_status kvport_hybrid_block_table_append_draft(kvport_hybrid_block_table* table,
                                                                const uint32_t* tokens,
                                                                size_t num_tokens,
                                                                kvport_stream* stream);
/** Whether appending `num_tokens` draft tokens would find every block and
 *  state slot it needs. */
KVPORT_API kvport_status kvport_hybrid_block_table_can_append_draft(
    const kvport_hybrid_block_table* table, size_t num_tokens, bool* out);
/** State group g's slots for the state after each draft token (the verifier
 *  writes them), copied into `out` (room for `capacity`; *out_count gets the
 *  count, 0 for other groups); KVPORT_ERR_OUT_OF_RANGE for a group out of
 *  range, KVPORT_ERR_INVALID_ARGUMENT when `out` is too small. */
KVPORT_API kvport_status
kvport_hybrid_block_table_draft_state_slots(const kvport_hybrid_block_table* table, size_t group,
                                            uint32_t* out, size_t capacity, size_t* out_count);
/** Commits the first `num_tokens` draft tokens (accepted): their full blocks
 *  are registered in every group's prefix cache and announced; a state
 *  group's state after the last of them becomes the working state.
 *  KVPORT_ERR_INVALID_ARGUMENT when it exceeds the draft tokens held. */
KVPORT_API kvport_status kvport_hybrid_block_table_commit(kvport_hybrid_block_table* table,
                                                          size_t num_tokens);
/** Keeps the first `num_tokens` tokens: drops the draft tokens past it and
 *  frees the blocks only they used. KVPORT_ERR_INVALID_ARGUMENT below the
 *  committed tokens (never taken back) or above every token held. */
KVPORT_API kvport_status kvport_hybrid_block_table_truncate(kvport_hybrid_block_table* table,
                                                            size_t num_tokens);
/** Draft tokens held (appended, not committed or truncated). */
KVPORT_API kvport_status
kvport_hybrid_block_table_num_draft_tokens(const kvport_hybrid_block_table* table, size_t* out);
/** Committed tokens; kvport_hybrid_block_table_num_tokens counts the draft
 *  tokens too. */
KVPORT_API kvport_status
kvport_hybrid_block_table_num_committed(const kvport_hybrid_block_table* table, size_t* out);
/** The table's own checks (no block holding a draft token, or not yet full of
 *  committed tokens, is cached; one entry per block of its tokens in each
 *  attention group), written as kvport_hybrid_cache_check_invariants writes
 *  its report. */
KVPORT_API kvport_status kvport_hybrid_block_table_check_invariants(
    const kvport_hybrid_block_table* table, kvport_invariant_report* report, char* text,
    size_t text_size, size_t* text_needed);

/* ---- batch metadata for attention kernels (docs/batch-metadata.md) ---- */

/** One step's batch: `tables[i]` computes its last `num_new_tokens[i]` tokens;
 *  group `group`; kernel blocks of `kernel_block_size` tokens (0: the
 *  cache's block size; it must divide it); `null_block` for released entries
 *  and padding (vLLM's null block is 0). Every function below checks these
 *  as kvport::build_block_table_rows does (KVPORT_ERR_INVALID_ARGUMENT,
 *  KVPORT_ERR_OUT_OF_RANGE for the group) and writes nothing on an error. */
typedef struct kvport_batch {
  const kvport_hybrid_block_table* const* tables;
  const size_t* num_new_tokens;
  size_t num_sequences;
  size_t group;
  size_t kernel_block_size;
  int32_t null_block;
} kvport_batch;

/** vLLM v1's row width: cdiv(max_model_len, kernel_block_size) rounded up to
 *  a multiple of 128 / kernel_block_size. */
KVPORT_API kvport_status kvport_vllm_row_width(size_t max_model_len, size_t kernel_block_size,
                                               size_t* out);
/** vLLM v1's block-table rows into `rows` (int32, row-major, `num_rows` rows
 *  of `row_width`, num_rows >= num_sequences): kernel block ids left-aligned,
 *  null_block elsewhere. */
KVPORT_API kvport_status kvport_build_block_table_rows(const kvport_batch* batch, size_t row_width,
                                                       int32_t* rows, size_t num_rows);
/** SGLang's req_to_token into `locations` (int32, row-major, `num_rows` rows
 *  of `row_width`): every position's KV slot, null_block for released
 *  positions, past each sequence and in rows past the batch. */
KVPORT_API kvport_status kvport_build_token_locations(const kvport_batch* batch, size_t row_width,
                                                      int32_t* locations, size_t num_rows);
/** Each new token's slot (int64, kernel block * kernel_block_size + offset)
 *  into `slots`, -1 past them; *out_count gets the new tokens. */
KVPORT_API kvport_status kvport_build_slot_mapping(const kvport_batch* batch, int64_t* slots,
                                                   size_t num_slots, size_t* out_count);
/** FlashInfer's pages (all int32): `indptr` [num_sequences + 1], `indices`
 *  (room for `indices_capacity`; *out_num_indices gets the count, which a
 *  call with indices_capacity 0 and indices NULL only reports),
 *  `last_page_len` and `kv_len` [num_sequences] (either may be NULL: not
 *  written). */
KVPORT_API kvport_status kvport_build_flashinfer_pages(const kvport_batch* batch, int32_t* indptr,
                                                       int32_t* indices, size_t indices_capacity,
                                                       int32_t* last_page_len, int32_t* kv_len,
                                                       size_t* out_num_indices);

/** Whether appending `num_tokens` would find every block it needs in every
 *  group (free or evictable, counting what the freeing rules release). */
KVPORT_API kvport_status kvport_hybrid_block_table_can_append(
    const kvport_hybrid_block_table* table, size_t num_tokens, bool* out);

/** One group's need for an append (kvport::HybridBlockTable::GroupNeed). */
typedef struct kvport_group_need {
  size_t fresh;    /**< blocks (slots) to allocate */
  size_t released; /**< blocks the freeing rules give back to the group first */
} kvport_group_need;

/** Each group's need for appending `num_tokens`, into `out`, which must have
 *  room for num_groups entries (KVPORT_ERR_INVALID_ARGUMENT otherwise);
 *  *out_count gets num_groups. */
KVPORT_API kvport_status
kvport_hybrid_block_table_blocks_needed(const kvport_hybrid_block_table* table, size_t num_tokens,
                                        kvport_group_need* out, size_t capacity, size_t* out_count);

/** A new table sharing every live block of `table` (one reference each);
 *  each state group's working state is copied into a new slot on `stream`.
 *  KVPORT_ERR_CACHE_EXHAUSTED (nothing changed) when a state group has no
 *  slot for the copy. */
KVPORT_API kvport_status kvport_hybrid_block_table_fork(const kvport_hybrid_block_table* table,
                                                        kvport_stream* stream,
                                                        kvport_hybrid_block_table** out);

/** Releases every block and slot and empties the table (it stays usable). */
KVPORT_API kvport_status kvport_hybrid_block_table_release(kvport_hybrid_block_table* table);

/** Every token the table holds KV slots for: committed and draft. */
KVPORT_API kvport_status
kvport_hybrid_block_table_num_tokens(const kvport_hybrid_block_table* table, size_t* out);

/* Per group: KVPORT_ERR_OUT_OF_RANGE for group >= the cache's num_groups. */

/** Entries of group g's block list, KVPORT_NULL_BLOCK entries included (0
 *  for a state group). */
KVPORT_API kvport_status kvport_hybrid_block_table_num_blocks(
    const kvport_hybrid_block_table* table, size_t group, size_t* out);

/** Entries of group g's block list that are not KVPORT_NULL_BLOCK. */
KVPORT_API kvport_status kvport_hybrid_block_table_num_live_blocks(
    const kvport_hybrid_block_table* table, size_t group, size_t* out);

/** Group g's block list in sequence order, KVPORT_NULL_BLOCK where a block
 *  was released, copied into `out`, which must have room for num_blocks
 *  entries (KVPORT_ERR_INVALID_ARGUMENT otherwise, nothing written; `out`
 *  may be null when there are none); *out_count gets the count. */
KVPORT_API kvport_status kvport_hybrid_block_table_blocks(const kvport_hybrid_block_table* table,
                                                          size_t group, uint32_t* out,
                                                          size_t capacity, size_t* out_count);

/** Group g's working state slot: *out_has_slot false (and *out_slot
 *  unchanged) before the first append or for a group that is not a state
 *  group. The slot is a block of the group's pool
 *  (kvport_hybrid_cache_group_cache). */
KVPORT_API kvport_status kvport_hybrid_block_table_state_slot(
    const kvport_hybrid_block_table* table, size_t group, bool* out_has_slot, uint32_t* out_slot);

/** Copy-on-write copies (every group) this table made. */
KVPORT_API kvport_status
kvport_hybrid_block_table_copy_on_writes(const kvport_hybrid_block_table* table, uint64_t* out);

/* ---- KV cache events ---------------------------------------------------------------------- */

/* A prefix cache or a hybrid cache can publish every change of the set of
 * blocks it holds as vLLM's KV events (BlockStored, BlockRemoved,
 * AllBlocksCleared) on a ZeroMQ PUB socket, in vLLM's wire format
 * (kvport::events::Publisher; docs/events.md has the format and what each
 * operation announces), so that llm-d's and Dynamo's cache-aware routers can
 * follow it. The publisher belongs to the cache's handle: it is created by
 * *_enable_events, destroyed by *_disable_events or with the handle, always
 * after the cache has stopped calling it. Its sockets are served by a thread
 * of its own; the cache's calls only copy each event into a bounded buffer
 * (an event that does not fit is dropped and counted, never waited for). The
 * calls below follow the cache's thread rule: one thread at a time. */

/** The events' encoding (mirror kvport::events::EventForm). */
typedef enum kvport_event_form {
  /** Map-tagged events (vLLM since mid-2026; the default). */
  KVPORT_EVENT_FORM_MAP = 0,
  /** Positional arrays with the tag first (vLLM before mid-2026). */
  KVPORT_EVENT_FORM_POSITIONAL = 1
} kvport_event_form;

/** Which socket of a publisher *_events_endpoint reports. */
typedef enum kvport_events_socket {
  /** The PUB socket the events go out on. */
  KVPORT_EVENTS_SOCKET_PUB = 0,
  /** The ROUTER socket for replay and snapshot requests ("" without one). */
  KVPORT_EVENTS_SOCKET_REPLAY = 1
} kvport_events_socket;

/** How a publisher binds and batches (kvport::events::PublisherOptions).
 *  Strings are read during the call only. Every numeric field left 0 takes
 *  the publisher's default (in parentheses). */
typedef struct kvport_events_options {
  /** The PUB socket's endpoint; port 0 binds an ephemeral port
   *  (*_events_endpoint reports it). Not null, not empty. */
  const char* endpoint;
  /** The first frame of every message; null or "" for none (vLLM's default). */
  const char* topic;
  /** The ROUTER socket for replay and snapshot requests; null or "" for none. */
  const char* replay_endpoint;
  /** Whether the batches carry data_parallel_rank (else nil). */
  bool has_data_parallel_rank;
  int64_t data_parallel_rank;
  /** A kvport_event_form. */
  int32_t form;
  /** A batch is sent at this many events (256) ... */
  size_t max_batch_events;
  /** ... or this many microseconds after its first event (10,000). */
  uint64_t batch_interval_us;
  /** Events buffered before the publisher thread takes them (65,536) ... */
  size_t buffer_events;
  /** ... and their bytes, 8 per hash and 4 per token (64 MiB). */
  size_t buffer_bytes;
  /** ZMQ_SNDHWM in messages (100,000); negative is invalid. */
  int32_t send_high_water_mark;
  /** Batches the replay socket keeps (10,000). */
  size_t replay_ring_batches;
  /** How long destroying the publisher waits for queued sends, ms (1,000). */
  uint32_t linger_ms;
} kvport_events_options;

/** Fills `options` with the defaults: endpoint "tcp://127.0.0.1:5557", no
 *  topic, no replay socket, no data_parallel_rank, map form, every numeric
 *  field 0 (the publisher's default). */
KVPORT_API kvport_status kvport_events_options_init(kvport_events_options* options);

/** A publisher's counters (kvport::events::PublisherStats). */
typedef struct kvport_events_stats {
  uint64_t events_accepted;
  uint64_t events_dropped; /**< the buffer was full (or out of memory) */
  uint64_t batches_sent;
  uint64_t send_failures; /**< batches ZeroMQ refused (high water mark) */
  uint64_t replay_requests;
  uint64_t snapshots;
  uint64_t bad_requests; /**< replay socket requests of neither form */
  uint64_t next_seq;     /**< the sequence number of the next batch */
} kvport_events_stats;

/** Starts publishing the prefix cache's events (medium "GPU", no group):
 *  binds the sockets, starts the publisher's thread, installs it as the
 *  prefix cache's sink, then announces the blocks cached already as
 *  BlockStored events (those registered before events were first enabled
 *  on this prefix cache carry neither parent nor tokens). From the first
 *  call on, the prefix cache keeps every registered block's parent and
 *  tokens (32 bytes + block_size token ids per block, allocated once).
 *  KVPORT_ERR_INVALID_ARGUMENT (nothing changed) for a null `options` or
 *  endpoint, a form outside kvport_event_form, a negative high water mark,
 *  an endpoint ZeroMQ cannot parse or bind (a port in use; the message names
 *  it), or when events are enabled already (disable them first). */
KVPORT_API kvport_status kvport_prefix_cache_enable_events(kvport_prefix_cache* prefix_cache,
                                                           const kvport_events_options* options);

/** Stops publishing: announces AllBlocksCleared (the stream stops following
 *  the cache), uninstalls the sink, then destroys the publisher, which sends
 *  what it buffered and waits up to linger_ms for ZeroMQ. KVPORT_OK, doing
 *  nothing, when events are not enabled. kvport_prefix_cache_destroy with
 *  events enabled does the same (the prefix cache's own destruction announces
 *  the clear). */
KVPORT_API kvport_status kvport_prefix_cache_disable_events(kvport_prefix_cache* prefix_cache);

/** The publisher's counters. KVPORT_ERR_INVALID_ARGUMENT when events are
 *  not enabled or `out` is null. */
KVPORT_API kvport_status kvport_prefix_cache_events_stats(const kvport_prefix_cache* prefix_cache,
                                                          kvport_events_stats* out);

/** The bound endpoint of a publisher socket (a kvport_events_socket), as
 *  ZeroMQ reports it (the real port for port 0): written to `text` (may be
 *  null with text_size 0) truncated to text_size - 1 bytes and
 *  NUL-terminated; *text_needed (may be null) gets its full length + 1.
 *  KVPORT_ERR_INVALID_ARGUMENT when events are not enabled or for another
 *  socket value. */
KVPORT_API kvport_status
kvport_prefix_cache_events_endpoint(const kvport_prefix_cache* prefix_cache, int32_t socket,
                                    char* text, size_t text_size, size_t* text_needed);

/** Waits until every event announced before the call has been published
 *  (sent, or refused and counted), at most `timeout_ms`; *out_flushed (may
 *  be null) tells whether it was. KVPORT_ERR_INVALID_ARGUMENT when events
 *  are not enabled. */
KVPORT_API kvport_status kvport_prefix_cache_flush_events(kvport_prefix_cache* prefix_cache,
                                                          uint32_t timeout_ms, bool* out_flushed);

/** As kvport_prefix_cache_enable_events, for every group of a hybrid cache:
 *  one publisher, each group's events with its group_idx, kv_cache_spec_kind
 *  ("full_attention", "mla_attention", "sliding_window", "chunked_local",
 *  "mamba") and sliding window, medium "GPU". Same errors. */
KVPORT_API kvport_status kvport_hybrid_cache_enable_events(kvport_hybrid_cache* cache,
                                                           const kvport_events_options* options);

/** As kvport_prefix_cache_disable_events (one AllBlocksCleared per group). */
KVPORT_API kvport_status kvport_hybrid_cache_disable_events(kvport_hybrid_cache* cache);

/** As kvport_prefix_cache_events_stats. */
KVPORT_API kvport_status kvport_hybrid_cache_events_stats(const kvport_hybrid_cache* cache,
                                                          kvport_events_stats* out);

/** As kvport_prefix_cache_events_endpoint. */
KVPORT_API kvport_status kvport_hybrid_cache_events_endpoint(const kvport_hybrid_cache* cache,
                                                             int32_t socket, char* text,
                                                             size_t text_size, size_t* text_needed);

/** As kvport_prefix_cache_flush_events. */
KVPORT_API kvport_status kvport_hybrid_cache_flush_events(kvport_hybrid_cache* cache,
                                                          uint32_t timeout_ms, bool* out_flushed);

/* ---- an engine's streams and memory --------------------------------------------------- */

/* An engine keeps its own streams and KV tensors; kvport runs on them and
 * manages the blocks in them (docs/backends.md, "The engine's streams and
 * memory"). */

/** Registers a stream the engine created as a kvport_stream of `backend`,
 *  accepted by every call that takes a kvport_stream*: work queued through it
 *  is queued on that very stream, ordered with the engine's own work on it.
 *  `vendor_stream` is a cudaStream_t / hipStream_t of the backend's device
 *  (NULL: the runtime's legacy default stream, PyTorch's default stream); on
 *  the host backend, which has no vendor streams, the handle
 *  kvport_stream_vendor_handle gave for one of its own streams.
 *  KVPORT_ERR_INVALID_ARGUMENT for a handle the backend cannot wrap (the
 *  message says why). The stream must outlive the registration; end it with
 *  kvport_stream_release (kvport_stream_destroy on a wrap does the same). */
KVPORT_API kvport_status kvport_stream_wrap(kvport_backend* backend, void* vendor_stream,
                                            kvport_stream** out);

/** Ends a registration made by kvport_stream_wrap: never destroys the
 *  engine's stream and never waits for it (synchronize first when kvport's
 *  work on it must be finished). KVPORT_ERR_INVALID_ARGUMENT for a stream
 *  kvport created (kvport_stream_destroy destroys those). */
KVPORT_API kvport_status kvport_stream_release(kvport_stream* stream);

/** The vendor handle of `stream` (null: `backend`'s default stream): the
 *  cudaStream_t / hipStream_t to launch the engine's kernels on, or the host
 *  backend's queue handle. KVPORT_ERR_INVALID_ARGUMENT for a stream of
 *  another backend. */
KVPORT_API kvport_status kvport_stream_vendor_handle(kvport_backend* backend, kvport_stream* stream,
                                                     void** out);

/** One pool of the engine's memory: `bytes` bytes at `base` (a tensor's data
 *  pointer and size in bytes). */
typedef struct kvport_pool {
  void* base;
  size_t bytes;
} kvport_pool;

/** How many pools a cache of `config` with `num_blocks` blocks adopts
 *  (`*out_count`: 2 per layer in layer-major layout, 1 per layer for K-only
 *  layers, 1 in block-major) and the bytes each needs, in the order
 *  kvport_cache_create_adopted takes them (layer 0 K, layer 0 V, layer 1 K,
 *  ...). `out_bytes` may be null when `capacity` is 0, to ask the count;
 *  KVPORT_ERR_INVALID_ARGUMENT when `capacity` is smaller than the count,
 *  the config is bad or num_blocks is 0 (or > 2^32 - 1). */
KVPORT_API kvport_status kvport_cache_adopted_pool_bytes(const kvport_config* config,
                                                         size_t num_blocks, size_t* out_bytes,
                                                         size_t capacity, size_t* out_count);

/** A cache over the engine's memory: `num_pools` pools in the order of
 *  kvport_cache_adopted_pool_bytes, each at least that many bytes and
 *  16-byte aligned. kvport manages the blocks in them as in its own pools and
 *  never frees them; they must stay valid until kvport_cache_destroy
 *  returns. KVPORT_ERR_INVALID_ARGUMENT, naming the pool, for a wrong count,
 *  a null base, a misaligned base, too few bytes, pools that overlap each
 *  other or memory a backend already manages: adopted ranges are
 *  process-wide, so memory adopted or allocated through ANY kvport_backend
 *  handle of the same memory (host memory; one device) is refused, the
 *  message naming both ranges, until that cache is destroyed; as
 *  kvport_cache_create for a bad config or num_blocks (0 included). */
KVPORT_API kvport_status kvport_cache_create_adopted(const kvport_config* config, size_t num_blocks,
                                                     kvport_backend* backend,
                                                     const kvport_pool* pools, size_t num_pools,
                                                     kvport_cache** out);

/** Whether the cache's pools are the engine's (kvport_cache_create_adopted). */
KVPORT_API kvport_status kvport_cache_is_adopted(const kvport_cache* cache, bool* out);

/* ---- testing ------------------------------------------------------------------------------ */

/** Queues work on `stream` (null: the backend's default stream) that fails
 *  asynchronously: its next synchronize reports KVPORT_ERR_BACKEND. On GPUs
 *  this is a sticky fault that loses the device: use it only in a process of
 *  its own. For tests of error handling. */
KVPORT_API kvport_status kvport_testing_inject_async_fault(kvport_backend* backend,
                                                           kvport_stream* stream);

/** Throws, inside the library, the C++ exception that maps to `status` and
 *  returns what the boundary made of it (KVPORT_OK for KVPORT_OK;
 *  KVPORT_ERR_INVALID_ARGUMENT for a value outside kvport_status). For bindings
 *  that test their error mapping. */
KVPORT_API kvport_status kvport_testing_fail_with(int32_t status);

#ifdef __cplusplus
}  // extern "C"
#endif

#endif /* KVPORT_KVPORT_H */
