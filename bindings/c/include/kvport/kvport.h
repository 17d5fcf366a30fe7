/* kvport.h: the C ABI of kvport (libkvport_c). C99; usable from C++.
 *
 * Every call returns a kvport_status; results come back through
 * out-parameters. No C++ exception crosses this boundary: each kvport
 * exception type has its own status code, and kvport_last_error() gives the
 * message of the last failing call of the calling thread.
 *
 * Handles (kvport_backend, kvport_cache, kvport_stream, kvport_prefix_cache,
 * kvport_block_table) are opaque tokens, not addresses: they are never
 * dereferenced, and a token is never reused within a process, so a null,
 * destroyed or forged handle, or one of another kind, is reported as
 * KVPORT_ERR_INVALID_HANDLE instead of crashing. Each call looks its handles
 * up in a process-wide, mutex-protected table (about the cost of one
 * uncontended lock).
 *
 * Ownership: a backend outlives its caches and streams, a cache its prefix
 * cache and block tables, a prefix cache its block tables. Destroying a
 * handle that still has live children fails with KVPORT_ERR_HANDLE_IN_USE and
 * changes nothing.
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
  /** A block id >= the cache's block count, or a layer >= its layer count. */
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
  /** 0: K-only layers (MLA's latent, state slots): no V pools; the V
   *  pointer and stride calls then fail with KVPORT_ERR_INVALID_ARGUMENT,
   *  v_block_bytes is 0 and read/write_block take a null v of 0 bytes. */
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
 * (all layers, K and V) in block-major. */

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
 *  KVPORT_ERR_INVALID_ARGUMENT), synchronizing `stream` first. v_out may be
 *  null when v_bytes is 0 (K-only layers). */
KVPORT_API kvport_status kvport_cache_read_block(const kvport_cache* cache, size_t layer,
                                                 uint32_t block, void* k_out, size_t k_bytes,
                                                 void* v_out, size_t v_bytes,
                                                 kvport_stream* stream);

/** Copies host bytes (exactly k_block_bytes / v_block_bytes long) into
 *  `layer`'s K and V of `block` and synchronizes `stream`. v may be null
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
