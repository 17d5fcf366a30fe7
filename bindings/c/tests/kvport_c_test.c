// SPDX-License-Identifier: Apache-2.0
/* The C ABI from C: every function of kvport.h and every status code.
 * CHECK macros, a failure count, exit status 1 on failure; libzmq's C API
 * subscribes to the KV events. */
#include <kvport/kvport.h>
#include <zmq.h>

#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define NUM_STATUSES 11

static int g_failures = 0;
static int g_checks = 0;
static int g_seen[NUM_STATUSES]; /* status codes a call returned as expected */

#define CHECK(cond)                                                            \
  do {                                                                         \
    ++g_checks;                                                                \
    if (!(cond)) {                                                             \
      fprintf(stderr, "%s:%d: CHECK failed: %s\n", __FILE__, __LINE__, #cond); \
      ++g_failures;                                                            \
    }                                                                          \
  } while (0)

#define EXPECT(expected, call) expect_status((expected), (call), #call, __FILE__, __LINE__)
#define OK(call) EXPECT(KVPORT_OK, call)

static void expect_status(kvport_status expected, kvport_status got, const char* call,
                          const char* file, int line) {
  ++g_checks;
  if (got != expected) {
    fprintf(stderr, "%s:%d: %s returned %s, expected %s (last error: %s)\n", file, line, call,
            kvport_status_name(got), kvport_status_name(expected), kvport_last_error());
    ++g_failures;
    return;
  }
  if ((int)got >= 0 && (int)got < NUM_STATUSES) g_seen[got] = 1;
  if (got != KVPORT_OK && kvport_last_error()[0] == '\0') {
    fprintf(stderr, "%s:%d: %s failed with an empty kvport_last_error()\n", file, line, call);
    ++g_failures;
  }
}

static int contains(const char* text, const char* part) {
  return strstr(text, part) != NULL;
}

static kvport_config small_config(void) {
  kvport_config c;
  kvport_config_init(&c);
  c.num_layers = 2;
  c.block_size = 4;
  c.num_kv_heads = 2;
  c.head_dim_k = 16;
  c.head_dim_v = 16;
  return c;
}

/* ---- status codes, last error, version ------------------------------------- */

static void test_status_and_version(void) {
  int s;
  uint32_t major = 99, minor = 99, patch = 99;
  char expected[64];

  for (s = 0; s < NUM_STATUSES; ++s) {
    const char* name = kvport_status_name((kvport_status)s);
    CHECK(name != NULL && strncmp(name, "KVPORT_", 7) == 0);
  }
  CHECK(strcmp(kvport_status_name(KVPORT_OK), "KVPORT_OK") == 0);
  CHECK(strcmp(kvport_status_name(KVPORT_ERR_CACHE_EXHAUSTED), "KVPORT_ERR_CACHE_EXHAUSTED") == 0);
  CHECK(strcmp(kvport_status_name((kvport_status)1234), "KVPORT_ERR_<unknown status>") == 0);

  /* Every status code through the library's own exception mapping. */
  for (s = 0; s < NUM_STATUSES; ++s) {
    kvport_clear_last_error();
    EXPECT((kvport_status)s, kvport_testing_fail_with((kvport_status)s));
    if (s != KVPORT_OK)
      CHECK(contains(kvport_last_error(), kvport_status_name((kvport_status)s)) ||
            s == KVPORT_ERR_OUT_OF_MEMORY);
  }
  EXPECT(KVPORT_ERR_INVALID_ARGUMENT, kvport_testing_fail_with((kvport_status)77));
  CHECK(contains(kvport_last_error(), "not a kvport_status"));
  kvport_clear_last_error();
  CHECK(strcmp(kvport_last_error(), "") == 0);
  OK(kvport_testing_fail_with(KVPORT_OK));
  CHECK(strcmp(kvport_last_error(), "") == 0); /* success leaves it alone */

  OK(kvport_version(&major, &minor, &patch));
  OK(kvport_version(NULL, NULL, NULL));
  snprintf(expected, sizeof expected, "%u.%u.%u", (unsigned)major, (unsigned)minor,
           (unsigned)patch);
  CHECK(strcmp(kvport_version_string(), expected) == 0);
}

/* ---- backends and streams -------------------------------------------------- */

static void test_backends(void) {
  kvport_backend* backend = NULL;
  kvport_backend* other = NULL;
  kvport_stream* stream = NULL;
  const char* name = NULL;
  int devices = 0;
  size_t free_bytes = 0, total_bytes = 0;

  EXPECT(KVPORT_ERR_INVALID_ARGUMENT, kvport_backend_create(NULL, &backend));
  EXPECT(KVPORT_ERR_INVALID_ARGUMENT, kvport_backend_create("host", NULL));
  EXPECT(KVPORT_ERR_INVALID_ARGUMENT, kvport_backend_create("no-such-backend", &backend));
  CHECK(contains(kvport_last_error(), "no-such-backend") && contains(kvport_last_error(), "host"));
  EXPECT(KVPORT_ERR_INVALID_ARGUMENT, kvport_backend_create_on("host", 1, &backend));
  EXPECT(KVPORT_ERR_INVALID_ARGUMENT, kvport_backend_create_on("default", 0, &backend));
  EXPECT(KVPORT_ERR_INVALID_ARGUMENT, kvport_backend_create_on(NULL, 0, &backend));

  OK(kvport_backend_create_on("host", 0, &other));
  OK(kvport_backend_create("default", &backend)); /* KVPORT_BACKEND=host under ctest */
  CHECK(backend != NULL && other != NULL && backend != other);

  OK(kvport_backend_name(other, &name));
  CHECK(name != NULL && strcmp(name, "host") == 0);
  EXPECT(KVPORT_ERR_INVALID_ARGUMENT, kvport_backend_name(other, NULL));
  OK(kvport_backend_device_count(other, &devices));
  CHECK(devices == 1);
  EXPECT(KVPORT_ERR_INVALID_ARGUMENT, kvport_backend_device_count(other, NULL));
  OK(kvport_backend_mem_info(other, &free_bytes, &total_bytes));
  CHECK(total_bytes > 0 && free_bytes <= total_bytes);
  OK(kvport_backend_mem_info(other, NULL, NULL));
  OK(kvport_backend_synchronize(other));

  /* Streams: create, synchronize, an asynchronous fault, destroy order. */
  EXPECT(KVPORT_ERR_INVALID_ARGUMENT, kvport_stream_create(other, NULL));
  OK(kvport_stream_create(other, &stream));
  OK(kvport_stream_synchronize(stream));
  OK(kvport_testing_inject_async_fault(other, stream));
  EXPECT(KVPORT_ERR_BACKEND, kvport_stream_synchronize(stream));
  OK(kvport_stream_synchronize(stream)); /* reported once */
  OK(kvport_testing_inject_async_fault(other, NULL));
  EXPECT(KVPORT_ERR_BACKEND, kvport_backend_synchronize(other));
  /* A stream of another backend. */
  EXPECT(KVPORT_ERR_INVALID_ARGUMENT, kvport_testing_inject_async_fault(backend, stream));

  EXPECT(KVPORT_ERR_HANDLE_IN_USE, kvport_backend_destroy(other));
  CHECK(contains(kvport_last_error(), "live child"));
  OK(kvport_stream_destroy(stream));
  EXPECT(KVPORT_ERR_INVALID_HANDLE, kvport_stream_synchronize(stream));
  EXPECT(KVPORT_ERR_INVALID_HANDLE, kvport_stream_destroy(stream));
  OK(kvport_backend_destroy(other));

  /* Null, destroyed, forged and wrong-kind handles. */
  EXPECT(KVPORT_ERR_INVALID_HANDLE, kvport_backend_name(other, &name));
  EXPECT(KVPORT_ERR_INVALID_HANDLE, kvport_backend_destroy(other));
  EXPECT(KVPORT_ERR_INVALID_HANDLE, kvport_backend_destroy(NULL));
  EXPECT(KVPORT_ERR_INVALID_HANDLE, kvport_backend_synchronize(NULL));
  EXPECT(KVPORT_ERR_INVALID_HANDLE, kvport_backend_device_count((kvport_backend*)0x1234, &devices));
  EXPECT(KVPORT_ERR_INVALID_HANDLE, kvport_stream_synchronize((kvport_stream*)backend));
  CHECK(contains(kvport_last_error(), "is a kvport_backend"));
  EXPECT(KVPORT_ERR_INVALID_HANDLE, kvport_stream_create(NULL, &stream));
  EXPECT(KVPORT_ERR_INVALID_HANDLE, kvport_backend_mem_info(NULL, NULL, NULL));
  EXPECT(KVPORT_ERR_INVALID_HANDLE, kvport_testing_inject_async_fault(NULL, NULL));
  OK(kvport_backend_destroy(backend));
}

/* ---- configuration ------------------------------------------------------------ */

static void test_config(void) {
  kvport_config c;
  size_t bytes = 0, blocks = 0;
  int32_t dtype = -1;
  int32_t layers[2];
  int32_t d;
  kvport_region_layout region;

  EXPECT(KVPORT_ERR_INVALID_ARGUMENT, kvport_config_init(NULL));
  OK(kvport_config_init(&c));
  CHECK(c.num_layers == 0 && c.block_size == 16 && c.dtype == KVPORT_DTYPE_BF16);
  CHECK(c.layout == KVPORT_LAYOUT_LAYER_MAJOR && c.layer_dtypes == NULL && c.num_layer_dtypes == 0);
  EXPECT(KVPORT_ERR_INVALID_ARGUMENT, kvport_config_validate(&c)); /* num_layers 0 */
  CHECK(contains(kvport_last_error(), "num_layers"));
  EXPECT(KVPORT_ERR_INVALID_ARGUMENT, kvport_config_validate(NULL));

  c = small_config();
  OK(kvport_config_validate(&c));
  OK(kvport_config_bytes_per_block(&c, &bytes));
  /* bf16: 4 tokens x 2 heads x 16 dims x 2 bytes, K and V, 2 layers */
  CHECK(bytes == 4 * 2 * 16 * 2 * 2 * 2);
  EXPECT(KVPORT_ERR_INVALID_ARGUMENT, kvport_config_bytes_per_block(&c, NULL));
  OK(kvport_compute_num_blocks(&c, 1u << 20, &blocks));
  CHECK(blocks > 0 && blocks <= (1u << 20) / bytes);
  EXPECT(KVPORT_ERR_INVALID_ARGUMENT, kvport_compute_num_blocks(NULL, 1u << 20, &blocks));

  c.dtype = 42;
  EXPECT(KVPORT_ERR_INVALID_ARGUMENT, kvport_config_validate(&c));
  CHECK(contains(kvport_last_error(), "config.dtype"));
  c = small_config();
  c.layout = 7;
  EXPECT(KVPORT_ERR_INVALID_ARGUMENT, kvport_config_validate(&c));
  c = small_config();
  c.num_layer_dtypes = 2; /* with a null pointer */
  EXPECT(KVPORT_ERR_INVALID_ARGUMENT, kvport_config_validate(&c));
  layers[0] = KVPORT_DTYPE_BF16;
  layers[1] = KVPORT_DTYPE_FP8_E4M3;
  c.layer_dtypes = layers;
  c.num_layer_dtypes = 1; /* not num_layers */
  EXPECT(KVPORT_ERR_INVALID_ARGUMENT, kvport_config_validate(&c));
  c.num_layer_dtypes = (size_t)-1; /* checked before the array is read */
  EXPECT(KVPORT_ERR_INVALID_ARGUMENT, kvport_config_validate(&c));
  CHECK(strstr(kvport_last_error(), "num_layer_dtypes") != NULL);
  c.num_layer_dtypes = 2;
  OK(kvport_config_validate(&c));
  layers[1] = -3;
  EXPECT(KVPORT_ERR_INVALID_ARGUMENT, kvport_config_validate(&c));
  c = small_config();
  c.dtype = KVPORT_DTYPE_NVFP4;
  c.head_dim_k = 8; /* not a multiple of nvfp4's group of 16 */
  EXPECT(KVPORT_ERR_INVALID_ARGUMENT, kvport_compute_num_blocks(&c, 1u << 20, &blocks));

  /* nvfp4: 4 x 2 x 16 = 128 elements: 64 data bytes, 8 scale bytes (+8 pad). */
  OK(kvport_block_region_layout(KVPORT_DTYPE_NVFP4, 4, 2, 16, &region));
  CHECK(region.data_bytes == 64 && region.data_padding == 0 && region.scale_offset == 64);
  CHECK(region.scale_bytes == 8 && region.scale_padding == 8 && region.total_bytes == 80);
  EXPECT(KVPORT_ERR_INVALID_ARGUMENT,
         kvport_block_region_layout(KVPORT_DTYPE_NVFP4, 4, 2, 8, &region));
  EXPECT(KVPORT_ERR_INVALID_ARGUMENT, kvport_block_region_layout(99, 4, 2, 16, &region));
  EXPECT(KVPORT_ERR_INVALID_ARGUMENT, kvport_block_region_layout(KVPORT_DTYPE_F16, 4, 2, 16, NULL));

  for (d = KVPORT_DTYPE_F16; d <= KVPORT_DTYPE_TURBO8; ++d) {
    const char* name = kvport_dtype_name(d);
    CHECK(name != NULL);
    if (name != NULL) {
      OK(kvport_dtype_from_name(name, &dtype));
      CHECK(dtype == d);
    }
  }
  CHECK(strcmp(kvport_dtype_name(KVPORT_DTYPE_FP8_E4M3), "fp8_e4m3") == 0);
  CHECK(kvport_dtype_name(-1) == NULL && kvport_dtype_name(9) == NULL);
  OK(kvport_dtype_from_name("bfloat16", &dtype));
  CHECK(dtype == KVPORT_DTYPE_BF16);
  EXPECT(KVPORT_ERR_INVALID_ARGUMENT, kvport_dtype_from_name("fp7", &dtype));
  EXPECT(KVPORT_ERR_INVALID_ARGUMENT, kvport_dtype_from_name(NULL, &dtype));
  EXPECT(KVPORT_ERR_INVALID_ARGUMENT, kvport_dtype_from_name("f16", NULL));
}

/* ---- caches -------------------------------------------------------------------- */

static void check_invariants_ok(kvport_cache* cache, size_t in_use) {
  kvport_invariant_report r;
  char text[256];
  size_t needed = 0;
  OK(kvport_cache_check_invariants(cache, &r, text, sizeof text, &needed));
  CHECK(r.ok && r.num_violations == 0 && r.blocks_in_use == in_use);
  CHECK(r.free_blocks + r.blocks_in_use == r.blocks_checked);
  CHECK(strncmp(text, "ok", 2) == 0 && needed == strlen(text) + 1);
}

static void test_cache_refcounts(kvport_backend* backend) {
  kvport_config c = small_config();
  kvport_config got;
  kvport_cache* cache = NULL;
  kvport_cache_counters counters;
  kvport_invariant_report report;
  int32_t layers[2];
  int32_t dtype = -1;
  uint32_t b = 99, rc = 99;
  uint32_t ids[4];
  bool allocated = true, freed = false;
  size_t n = 0, i;
  char small_text[4];
  size_t needed = 0;

  layers[0] = KVPORT_DTYPE_BF16;
  layers[1] = KVPORT_DTYPE_FP8_E5M2;
  c.layer_dtypes = layers;
  c.num_layer_dtypes = 2;

  EXPECT(KVPORT_ERR_INVALID_ARGUMENT, kvport_cache_create(&c, 0, backend, &cache));
  EXPECT(KVPORT_ERR_INVALID_ARGUMENT, kvport_cache_create(NULL, 4, backend, &cache));
  EXPECT(KVPORT_ERR_INVALID_ARGUMENT, kvport_cache_create(&c, 4, backend, NULL));
  EXPECT(KVPORT_ERR_INVALID_HANDLE, kvport_cache_create(&c, 4, NULL, &cache));
  {
    /* 2^37-byte regions x 16 blocks: more than the host backend has. */
    kvport_config huge = small_config();
    huge.num_layers = 1;
    huge.block_size = 1024;
    huge.num_kv_heads = 1024;
    huge.head_dim_k = huge.head_dim_v = 65536;
    EXPECT(KVPORT_ERR_OUT_OF_MEMORY, kvport_cache_create(&huge, 16, backend, &cache));
  }
  OK(kvport_cache_create(&c, 4, backend, &cache));
  layers[1] = KVPORT_DTYPE_F16; /* the cache copied the config */

  OK(kvport_cache_config(cache, &got));
  CHECK(got.num_layers == 2 && got.block_size == 4 && got.num_kv_heads == 2);
  CHECK(got.head_dim_k == 16 && got.head_dim_v == 16 && got.dtype == KVPORT_DTYPE_BF16);
  CHECK(got.layout == KVPORT_LAYOUT_LAYER_MAJOR && got.num_layer_dtypes == 2);
  CHECK(got.layer_dtypes != NULL && got.layer_dtypes[1] == KVPORT_DTYPE_FP8_E5M2);
  OK(kvport_cache_layer_dtype(cache, 1, &dtype));
  CHECK(dtype == KVPORT_DTYPE_FP8_E5M2);
  EXPECT(KVPORT_ERR_OUT_OF_RANGE, kvport_cache_layer_dtype(cache, 2, &dtype));
  {
    kvport_region_layout k_region, v_region;
    size_t bytes = 0;
    OK(kvport_cache_k_region_layout(cache, 1, &k_region)); /* fp8: 1 byte per element */
    OK(kvport_cache_v_region_layout(cache, 1, &v_region));
    OK(kvport_cache_k_block_bytes(cache, 1, &bytes));
    CHECK(k_region.data_bytes == 4 * 2 * 16 && k_region.scale_bytes == 0);
    CHECK(k_region.total_bytes == bytes && v_region.total_bytes == bytes);
    EXPECT(KVPORT_ERR_OUT_OF_RANGE, kvport_cache_k_region_layout(cache, 2, &k_region));
    EXPECT(KVPORT_ERR_OUT_OF_RANGE, kvport_cache_v_region_layout(cache, 2, &v_region));
    EXPECT(KVPORT_ERR_INVALID_ARGUMENT, kvport_cache_k_region_layout(cache, 0, NULL));
  }

  OK(kvport_cache_num_blocks(cache, &n));
  CHECK(n == 4);
  OK(kvport_cache_num_layers(cache, &n));
  CHECK(n == 2);
  OK(kvport_cache_total_bytes(cache, &n));
  CHECK(n >= 4 * (4 * 2 * 16 * 2 * 2 + 4 * 2 * 16 * 1 * 2));
  EXPECT(KVPORT_ERR_INVALID_ARGUMENT, kvport_cache_num_blocks(cache, NULL));

  /* LIFO allocation, then exhaustion. */
  for (i = 0; i < 4; ++i) {
    OK(kvport_cache_alloc(cache, &ids[i]));
    CHECK(ids[i] == i);
  }
  EXPECT(KVPORT_ERR_CACHE_EXHAUSTED, kvport_cache_alloc(cache, &b));
  CHECK(contains(kvport_last_error(), "exhausted"));
  OK(kvport_cache_try_alloc(cache, &b, &allocated));
  CHECK(!allocated && b == 99);
  EXPECT(KVPORT_ERR_INVALID_ARGUMENT, kvport_cache_alloc(cache, NULL));
  EXPECT(KVPORT_ERR_INVALID_ARGUMENT, kvport_cache_try_alloc(cache, &b, NULL));
  OK(kvport_cache_num_free_blocks(cache, &n));
  CHECK(n == 0);
  OK(kvport_cache_num_blocks_in_use(cache, &n));
  CHECK(n == 4);
  check_invariants_ok(cache, 4);

  /* References. */
  OK(kvport_cache_inc_ref(cache, 2));
  OK(kvport_cache_ref_count(cache, 2, &rc));
  CHECK(rc == 2);
  OK(kvport_cache_dec_ref(cache, 2, &freed));
  CHECK(!freed);
  OK(kvport_cache_free(cache, 2, &freed));
  CHECK(freed);
  OK(kvport_cache_ref_count(cache, 2, &rc));
  CHECK(rc == 0);
  EXPECT(KVPORT_ERR_INVALID_ARGUMENT, kvport_cache_inc_ref(cache, 2)); /* a free block */
  OK(kvport_cache_dec_ref(cache, 2, NULL));                            /* ignored, counted */
  OK(kvport_cache_try_alloc(cache, &b, &allocated));
  CHECK(allocated && b == 2);
  OK(kvport_cache_return_evicted_block(cache, 3));
  OK(kvport_cache_free(cache, 1, NULL));
  ids[0] = 0;
  ids[1] = 2;
  OK(kvport_cache_free_blocks(cache, ids, 2));
  OK(kvport_cache_free_blocks(cache, NULL, 0));
  EXPECT(KVPORT_ERR_INVALID_ARGUMENT, kvport_cache_free_blocks(cache, NULL, 1));
  OK(kvport_cache_num_free_blocks(cache, &n));
  CHECK(n == 4);
  check_invariants_ok(cache, 0);

  /* Out of range: every per-block call. The check is core's (kvport::OutOfRange,
   * mapped by the guard), so the message names the C++ operation. */
  EXPECT(KVPORT_ERR_OUT_OF_RANGE, kvport_cache_inc_ref(cache, 4));
  CHECK(contains(kvport_last_error(),
                 "PagedKvCache::inc_ref: block 4 out of range (num_blocks = 4)"));
  EXPECT(KVPORT_ERR_OUT_OF_RANGE, kvport_cache_dec_ref(cache, 4, NULL));
  EXPECT(KVPORT_ERR_OUT_OF_RANGE, kvport_cache_free(cache, 100, NULL));
  ids[0] = 1;
  ids[1] = 4;
  OK(kvport_cache_alloc(cache, &b));
  EXPECT(KVPORT_ERR_OUT_OF_RANGE, kvport_cache_free_blocks(cache, ids, 2));
  OK(kvport_cache_ref_count(cache, b, &rc)); /* nothing was freed */
  CHECK(rc == 1);
  OK(kvport_cache_free(cache, b, NULL));
  EXPECT(KVPORT_ERR_OUT_OF_RANGE, kvport_cache_return_evicted_block(cache, 0xFFFFFFFFu));
  EXPECT(KVPORT_ERR_OUT_OF_RANGE, kvport_cache_ref_count(cache, 4, &rc));

  OK(kvport_cache_counters_get(cache, &counters));
  CHECK(counters.allocs == 6 && counters.frees == 6);
  CHECK(counters.ignored_double_frees == 1 && counters.exhaustion_events == 2);
  CHECK(counters.peak_blocks_in_use == 4);
  EXPECT(KVPORT_ERR_INVALID_ARGUMENT, kvport_cache_counters_get(cache, NULL));

  /* Invariant report text: truncated, with the length it needs. */
  OK(kvport_cache_check_invariants(cache, &report, small_text, sizeof small_text, &needed));
  CHECK(report.ok && strlen(small_text) == 3 && needed > sizeof small_text);
  OK(kvport_cache_check_invariants(cache, &report, NULL, 0, NULL));
  EXPECT(KVPORT_ERR_INVALID_ARGUMENT, kvport_cache_check_invariants(cache, NULL, NULL, 0, NULL));
  EXPECT(KVPORT_ERR_INVALID_ARGUMENT, kvport_cache_check_invariants(cache, &report, NULL, 8, NULL));

  /* The backend cannot go while the cache lives; the cache handle dies with it. */
  EXPECT(KVPORT_ERR_HANDLE_IN_USE, kvport_backend_destroy(backend));
  OK(kvport_cache_destroy(cache));
  EXPECT(KVPORT_ERR_INVALID_HANDLE, kvport_cache_alloc(cache, &b));
  EXPECT(KVPORT_ERR_INVALID_HANDLE, kvport_cache_num_free_blocks(cache, &n));
  EXPECT(KVPORT_ERR_INVALID_HANDLE, kvport_cache_destroy(cache));
  EXPECT(KVPORT_ERR_INVALID_HANDLE, kvport_cache_destroy(NULL));
  EXPECT(KVPORT_ERR_INVALID_HANDLE, kvport_cache_alloc((kvport_cache*)backend, &b));
  EXPECT(KVPORT_ERR_INVALID_HANDLE, kvport_cache_config(NULL, &got));
}

static int all_bytes(const unsigned char* p, size_t n, unsigned char value) {
  size_t i;
  for (i = 0; i < n; ++i)
    if (p[i] != value) return 0;
  return 1;
}

static void test_cache_device_work(kvport_backend* backend, int32_t layout) {
  kvport_config c = small_config();
  kvport_cache* cache = NULL;
  kvport_stream* stream = NULL;
  kvport_backend* other = NULL;
  kvport_stream* foreign = NULL;
  unsigned char k[512], v[512], k2[512], v2[512];
  size_t kb = 0, vb = 0, ks = 0, vs = 0, layer;
  void *kp = NULL, *vp = NULL, *kpool = NULL, *vpool = NULL;
  uint32_t blocks[3] = {0, 1, 2};
  kvport_block_copy copy;
  size_t i;

  c.layout = layout;
  c.head_dim_v = 8; /* K and V of different sizes */
  OK(kvport_cache_create(&c, 3, backend, &cache));
  OK(kvport_stream_create(backend, &stream));
  OK(kvport_backend_create("host", &other));
  OK(kvport_stream_create(other, &foreign));

  for (layer = 0; layer < 2; ++layer) {
    OK(kvport_cache_k_block_bytes(cache, layer, &kb));
    OK(kvport_cache_v_block_bytes(cache, layer, &vb));
    OK(kvport_cache_k_block_stride(cache, layer, &ks));
    OK(kvport_cache_v_block_stride(cache, layer, &vs));
    CHECK(kb == 4 * 2 * 16 * 2 && vb == 4 * 2 * 8 * 2);
    if (layout == KVPORT_LAYOUT_LAYER_MAJOR) {
      CHECK(ks == kb && vs == vb);
    } else {
      CHECK(ks == 2 * (kb + vb) && vs == ks); /* the whole block, all layers */
    }
    OK(kvport_cache_k_pool_ptr(cache, layer, &kpool));
    OK(kvport_cache_v_pool_ptr(cache, layer, &vpool));
    OK(kvport_cache_k_ptr(cache, layer, 2, &kp));
    OK(kvport_cache_v_ptr(cache, layer, 2, &vp));
    CHECK((char*)kp == (char*)kpool + 2 * ks && (char*)vp == (char*)vpool + 2 * vs);
  }
  EXPECT(KVPORT_ERR_OUT_OF_RANGE, kvport_cache_k_ptr(cache, 2, 0, &kp));
  EXPECT(KVPORT_ERR_OUT_OF_RANGE, kvport_cache_v_ptr(cache, 0, 3, &vp));
  EXPECT(KVPORT_ERR_OUT_OF_RANGE, kvport_cache_k_pool_ptr(cache, 2, &kpool));
  EXPECT(KVPORT_ERR_OUT_OF_RANGE, kvport_cache_v_pool_ptr(cache, 2, &vpool));
  EXPECT(KVPORT_ERR_OUT_OF_RANGE, kvport_cache_k_block_stride(cache, 2, &ks));
  EXPECT(KVPORT_ERR_OUT_OF_RANGE, kvport_cache_v_block_stride(cache, 2, &vs));
  EXPECT(KVPORT_ERR_OUT_OF_RANGE, kvport_cache_k_block_bytes(cache, 2, &kb));
  EXPECT(KVPORT_ERR_OUT_OF_RANGE, kvport_cache_v_block_bytes(cache, 2, &vb));
  EXPECT(KVPORT_ERR_INVALID_ARGUMENT, kvport_cache_k_ptr(cache, 0, 0, NULL));
  OK(kvport_cache_k_block_bytes(cache, 1, &kb));
  OK(kvport_cache_v_block_bytes(cache, 1, &vb));

  /* zero / poison, batched and single, on a stream and on the default one. */
  OK(kvport_cache_zero_blocks(cache, blocks, 3, stream));
  OK(kvport_stream_synchronize(stream)); /* two streams: no order between them */
  OK(kvport_cache_poison_block(cache, 1, NULL));
  OK(kvport_cache_synchronize(cache));
  OK(kvport_cache_read_block(cache, 1, 0, k, kb, v, vb, stream));
  CHECK(all_bytes(k, kb, 0) && all_bytes(v, vb, 0));
  OK(kvport_cache_read_block(cache, 1, 1, k, kb, v, vb, NULL));
  CHECK(all_bytes(k, kb, 0xFF) && all_bytes(v, vb, 0xFF));
  OK(kvport_cache_k_ptr(cache, 1, 1, &kp)); /* host memory on the host backend */
  CHECK(all_bytes((const unsigned char*)kp, kb, 0xFF));
  OK(kvport_cache_poison_blocks(cache, blocks, 2, stream));
  OK(kvport_cache_zero_block(cache, 0, stream));
  OK(kvport_cache_zero_blocks(cache, NULL, 0, stream));
  OK(kvport_stream_synchronize(stream));
  EXPECT(KVPORT_ERR_INVALID_ARGUMENT,
         kvport_cache_read_block(cache, 0, 0, k, sizeof k, v, sizeof v, stream));
  OK(kvport_cache_k_block_bytes(cache, 0, &kb));
  OK(kvport_cache_v_block_bytes(cache, 0, &vb));
  OK(kvport_cache_read_block(cache, 0, 0, k, kb, v, vb, stream));
  CHECK(all_bytes(k, kb, 0) && all_bytes(v, vb, 0));

  /* write, copy, read back. */
  for (i = 0; i < kb; ++i)
    k[i] = (unsigned char)(i * 7 + 1);
  for (i = 0; i < vb; ++i)
    v[i] = (unsigned char)(i * 3 + 2);
  OK(kvport_cache_write_block(cache, 0, 2, k, kb, v, vb, stream));
  copy.src = 2;
  copy.dst = 0;
  OK(kvport_cache_copy_blocks(cache, &copy, 1, stream));
  OK(kvport_cache_copy_blocks(cache, NULL, 0, stream));
  OK(kvport_cache_read_block(cache, 0, 0, k2, kb, v2, vb, stream));
  CHECK(memcmp(k, k2, kb) == 0 && memcmp(v, v2, vb) == 0);

  /* Errors of device work. */
  EXPECT(KVPORT_ERR_INVALID_ARGUMENT, kvport_cache_read_block(cache, 0, 0, k, kb + 1, v, vb, NULL));
  CHECK(contains(kvport_last_error(), "bytes"));
  EXPECT(KVPORT_ERR_INVALID_ARGUMENT, kvport_cache_read_block(cache, 0, 0, NULL, kb, v, vb, NULL));
  EXPECT(KVPORT_ERR_INVALID_ARGUMENT,
         kvport_cache_write_block(cache, 0, 0, k, kb - 1, v, vb, NULL));
  EXPECT(KVPORT_ERR_INVALID_ARGUMENT, kvport_cache_write_block(cache, 0, 0, k, kb, NULL, vb, NULL));
  EXPECT(KVPORT_ERR_OUT_OF_RANGE, kvport_cache_read_block(cache, 0, 3, k, kb, v, vb, NULL));
  EXPECT(KVPORT_ERR_OUT_OF_RANGE, kvport_cache_read_block(cache, 2, 0, k, kb, v, vb, NULL));
  EXPECT(KVPORT_ERR_OUT_OF_RANGE, kvport_cache_write_block(cache, 0, 3, k, kb, v, vb, NULL));
  blocks[1] = 3;
  EXPECT(KVPORT_ERR_OUT_OF_RANGE, kvport_cache_zero_blocks(cache, blocks, 2, NULL));
  EXPECT(KVPORT_ERR_OUT_OF_RANGE, kvport_cache_poison_blocks(cache, blocks, 2, NULL));
  EXPECT(KVPORT_ERR_OUT_OF_RANGE, kvport_cache_zero_block(cache, 3, NULL));
  EXPECT(KVPORT_ERR_OUT_OF_RANGE, kvport_cache_poison_block(cache, 7, NULL));
  EXPECT(KVPORT_ERR_INVALID_ARGUMENT, kvport_cache_zero_blocks(cache, NULL, 2, NULL));
  copy.dst = 3;
  EXPECT(KVPORT_ERR_OUT_OF_RANGE, kvport_cache_copy_blocks(cache, &copy, 1, NULL));
  copy.dst = 2;
  EXPECT(KVPORT_ERR_INVALID_ARGUMENT,
         kvport_cache_copy_blocks(cache, &copy, 1, NULL)); /* src == dst */
  EXPECT(KVPORT_ERR_INVALID_ARGUMENT, kvport_cache_copy_blocks(cache, NULL, 1, NULL));
  /* A stream of another backend; a destroyed stream. */
  EXPECT(KVPORT_ERR_INVALID_ARGUMENT, kvport_cache_zero_block(cache, 0, foreign));
  /* ... also when the call would queue nothing. */
  EXPECT(KVPORT_ERR_INVALID_ARGUMENT, kvport_cache_zero_blocks(cache, NULL, 0, foreign));
  EXPECT(KVPORT_ERR_INVALID_ARGUMENT, kvport_cache_copy_blocks(cache, NULL, 0, foreign));
  EXPECT(KVPORT_ERR_INVALID_HANDLE, kvport_cache_zero_block(cache, 0, (kvport_stream*)cache));

  /* An asynchronous error surfaces at the cache's synchronize. */
  OK(kvport_cache_zero_block(cache, 0, stream));
  OK(kvport_testing_inject_async_fault(backend, stream));
  EXPECT(KVPORT_ERR_BACKEND, kvport_cache_synchronize(cache));
  OK(kvport_cache_synchronize(cache));

  OK(kvport_stream_destroy(foreign));
  OK(kvport_backend_destroy(other));
  OK(kvport_cache_zero_block(cache, 1, stream));
  OK(kvport_stream_destroy(stream)); /* the cache skips destroyed streams */
  OK(kvport_cache_synchronize(cache));
  EXPECT(KVPORT_ERR_INVALID_HANDLE, kvport_cache_synchronize(NULL));
  EXPECT(KVPORT_ERR_INVALID_HANDLE, kvport_cache_zero_block(cache, 0, stream));
  OK(kvport_cache_destroy(cache));
}

/* K-only layers (head_dim_v 0, as MLA): no V pools; the V pointer calls fail,
 * V sizes are 0, and blocks move with a null v. */
static void test_k_only_cache(kvport_backend* backend, int32_t layout) {
  kvport_config c = small_config();
  kvport_cache* cache = NULL;
  unsigned char k[256], k2[256], junk = 7;
  size_t kb = 0, vb = 1, stride = 0, bytes = 0, i;
  void* p = NULL;
  kvport_region_layout region;
  kvport_block_copy copy;

  c.layout = layout;
  c.head_dim_v = 0;
  OK(kvport_config_validate(&c));
  OK(kvport_config_bytes_per_block(&c, &bytes));
  CHECK(bytes == 2 * 4 * 2 * 16 * 2); /* two layers of K */
  OK(kvport_cache_create(&c, 4, backend, &cache));
  OK(kvport_cache_k_block_bytes(cache, 1, &kb));
  OK(kvport_cache_v_block_bytes(cache, 1, &vb));
  CHECK(kb == 4 * 2 * 16 * 2 && vb == 0);
  OK(kvport_cache_k_block_stride(cache, 1, &stride));
  CHECK(stride == (layout == KVPORT_LAYOUT_BLOCK_MAJOR ? 2 * kb : kb));
  OK(kvport_cache_v_region_layout(cache, 1, &region));
  CHECK(region.total_bytes == 0);
  EXPECT(KVPORT_ERR_INVALID_ARGUMENT, kvport_cache_v_ptr(cache, 0, 0, &p));
  CHECK(contains(kvport_last_error(), "no V"));
  EXPECT(KVPORT_ERR_INVALID_ARGUMENT, kvport_cache_v_pool_ptr(cache, 0, &p));
  EXPECT(KVPORT_ERR_INVALID_ARGUMENT, kvport_cache_v_block_stride(cache, 0, &stride));
  EXPECT(KVPORT_ERR_OUT_OF_RANGE, kvport_cache_v_pool_ptr(cache, 2, &p));

  for (i = 0; i < kb; ++i)
    k[i] = (unsigned char)(i * 5 + 3);
  OK(kvport_cache_write_block(cache, 1, 2, k, kb, NULL, 0, NULL));
  EXPECT(KVPORT_ERR_INVALID_ARGUMENT, kvport_cache_write_block(cache, 1, 2, k, kb, &junk, 1, NULL));
  CHECK(contains(kvport_last_error(), "no V"));
  copy.src = 2;
  copy.dst = 3;
  OK(kvport_cache_copy_blocks(cache, &copy, 1, NULL));
  OK(kvport_cache_read_block(cache, 1, 3, k2, kb, NULL, 0, NULL));
  CHECK(memcmp(k, k2, kb) == 0);
  OK(kvport_cache_zero_block(cache, 3, NULL));
  OK(kvport_cache_read_block(cache, 1, 3, k2, kb, NULL, 0, NULL));
  CHECK(k2[0] == 0 && k2[kb - 1] == 0);
  EXPECT(KVPORT_ERR_INVALID_ARGUMENT, kvport_cache_read_block(cache, 1, 3, k2, kb, k, 1, NULL));
  OK(kvport_cache_destroy(cache));
}

/* ---- prefix caches and block tables ------------------------------------------- */

static void test_prefix_and_tables(kvport_backend* backend) {
  kvport_config c = small_config();
  kvport_cache* cache = NULL;
  kvport_prefix_cache* prefix = NULL;
  kvport_block_table *table = NULL, *again = NULL, *child = NULL, *plain = NULL;
  kvport_prefix_cache_counters pc;
  kvport_invariant_report report;
  char text[256];
  uint32_t tokens[10];
  uint32_t matched[4];
  const uint32_t* ids = NULL;
  size_t n = 0, hit = 0, num_blocks = 0, num_tokens = 0;
  uint64_t cows = 0;
  int32_t mode = -1;
  uint32_t b = 0;
  bool allocated = false;
  size_t i;

  for (i = 0; i < 10; ++i)
    tokens[i] = (uint32_t)(100 + i);
  OK(kvport_cache_create(&c, 6, backend, &cache));
  OK(kvport_prefix_cache_create(cache, &prefix));
  EXPECT(KVPORT_ERR_INVALID_ARGUMENT, kvport_prefix_cache_create(cache, NULL));
  EXPECT(KVPORT_ERR_INVALID_HANDLE, kvport_prefix_cache_create(NULL, &prefix));
  OK(kvport_block_table_create_prefixed(prefix, 0, &table));

  /* A sequence of 10 tokens: 2 full blocks are cached, then released. */
  OK(kvport_block_table_blocks_needed(table, 10, &n));
  CHECK(n == 3);
  OK(kvport_block_table_append_tokens(table, tokens, 10, NULL));
  OK(kvport_block_table_num_tokens(table, &n));
  CHECK(n == 10);
  OK(kvport_block_table_blocks(table, &ids, &n));
  CHECK(n == 3 && ids != NULL);
  OK(kvport_prefix_cache_num_cached_blocks(prefix, &n));
  CHECK(n == 2);
  OK(kvport_block_table_release(table));
  OK(kvport_block_table_blocks(table, &ids, &n));
  CHECK(n == 0);
  OK(kvport_prefix_cache_num_evictable_blocks(prefix, &n));
  CHECK(n == 2);
  OK(kvport_prefix_cache_num_available_blocks(prefix, &n));
  CHECK(n == 6);

  /* A second sequence with the same prompt hits both blocks. */
  OK(kvport_block_table_create_prefixed(prefix, 0, &again));
  OK(kvport_block_table_prefix_hit_mode(again, &mode));
  CHECK(mode == KVPORT_PREFIX_HIT_COMPUTE_LAST_TOKEN);
  OK(kvport_block_table_set_prefix_hit_mode(again, KVPORT_PREFIX_HIT_FULL));
  OK(kvport_block_table_prefix_hit_mode(again, &mode));
  CHECK(mode == KVPORT_PREFIX_HIT_FULL);
  EXPECT(KVPORT_ERR_INVALID_ARGUMENT, kvport_block_table_set_prefix_hit_mode(again, 5));
  OK(kvport_block_table_reuse_cached_prefix(again, tokens, 10, NULL, &hit));
  CHECK(hit == 8);
  EXPECT(KVPORT_ERR_INVALID_ARGUMENT,
         kvport_block_table_reuse_cached_prefix(again, tokens, 10, NULL, &hit)); /* not empty */
  OK(kvport_block_table_append_tokens(again, tokens + 8, 2, NULL));

  /* fork, then copy-on-write of the shared, partly filled last block. */
  OK(kvport_block_table_fork(again, &child));
  OK(kvport_block_table_append_tokens(child, tokens, 1, NULL));
  OK(kvport_block_table_copy_on_writes(child, &cows));
  CHECK(cows == 1);
  OK(kvport_block_table_copy_on_writes(again, &cows));
  CHECK(cows == 0);

  /* Direct lookups through the prefix cache. */
  EXPECT(KVPORT_ERR_INVALID_ARGUMENT,
         kvport_prefix_cache_lookup(prefix, tokens, 10, 0, matched, 1, &num_blocks, NULL));
  OK(kvport_prefix_cache_lookup(prefix, tokens, 10, 0, matched, 4, &num_blocks, &num_tokens));
  CHECK(num_blocks == 2 && num_tokens == 8);
  OK(kvport_prefix_cache_release_blocks(prefix, matched, num_blocks));
  OK(kvport_prefix_cache_lookup(prefix, tokens, 10, 7, matched, 4, &num_blocks, NULL));
  CHECK(num_blocks == 0); /* another extra key */
  OK(kvport_prefix_cache_lookup(prefix, NULL, 0, 0, NULL, 0, &num_blocks, NULL));
  EXPECT(KVPORT_ERR_INVALID_ARGUMENT,
         kvport_prefix_cache_lookup(prefix, NULL, 4, 0, matched, 4, &num_blocks, NULL));
  matched[0] = 6;
  EXPECT(KVPORT_ERR_OUT_OF_RANGE, kvport_prefix_cache_release_blocks(prefix, matched, 1));
  EXPECT(KVPORT_ERR_OUT_OF_RANGE, kvport_prefix_cache_release(prefix, 6));

  /* Allocation through the prefix cache until exhaustion. Blocks held:
   * 2 cached (shared by `again` and `child`), again's last, child's copy. */
  OK(kvport_prefix_cache_alloc(prefix, &b));
  OK(kvport_prefix_cache_try_alloc(prefix, &matched[0], &allocated));
  CHECK(allocated);
  EXPECT(KVPORT_ERR_CACHE_EXHAUSTED, kvport_prefix_cache_alloc(prefix, &matched[1]));
  OK(kvport_prefix_cache_try_alloc(prefix, &matched[1], &allocated));
  CHECK(!allocated);
  EXPECT(KVPORT_ERR_CACHE_EXHAUSTED, kvport_block_table_append_tokens(child, tokens, 8, NULL));
  OK(kvport_prefix_cache_release(prefix, b));
  OK(kvport_prefix_cache_release(prefix, matched[0]));
  EXPECT(KVPORT_ERR_INVALID_ARGUMENT, kvport_prefix_cache_alloc(prefix, NULL));
  EXPECT(KVPORT_ERR_INVALID_ARGUMENT, kvport_prefix_cache_try_alloc(prefix, &b, NULL));

  /* A plain table over the cache (no prefix caching). */
  OK(kvport_block_table_create(cache, &plain));
  OK(kvport_block_table_reuse_cached_prefix(plain, tokens, 10, NULL, &hit));
  CHECK(hit == 0);
  OK(kvport_block_table_append_tokens(plain, tokens, 3, NULL));
  OK(kvport_block_table_blocks(plain, &ids, &n));
  CHECK(n == 1);
  EXPECT(KVPORT_ERR_INVALID_ARGUMENT, kvport_block_table_create(cache, NULL));

  /* Destroy order: children first. */
  EXPECT(KVPORT_ERR_HANDLE_IN_USE, kvport_cache_destroy(cache));
  EXPECT(KVPORT_ERR_HANDLE_IN_USE, kvport_prefix_cache_destroy(prefix));
  OK(kvport_prefix_cache_check_invariants(prefix, &report, text, sizeof text, NULL));
  CHECK(report.ok && report.cached_blocks == 2);
  OK(kvport_block_table_destroy(plain));
  OK(kvport_block_table_destroy(child));
  OK(kvport_block_table_destroy(again));
  OK(kvport_block_table_destroy(table));
  EXPECT(KVPORT_ERR_INVALID_HANDLE, kvport_block_table_destroy(table));
  EXPECT(KVPORT_ERR_INVALID_HANDLE, kvport_block_table_num_tokens(child, &n));
  EXPECT(KVPORT_ERR_INVALID_HANDLE, kvport_block_table_fork(NULL, &child));
  EXPECT(KVPORT_ERR_INVALID_HANDLE, kvport_block_table_create_prefixed(NULL, 0, &child));
  EXPECT(KVPORT_ERR_INVALID_HANDLE,
         kvport_block_table_create_prefixed((kvport_prefix_cache*)cache, 0, &child));

  OK(kvport_prefix_cache_num_evictable_blocks(prefix, &n));
  CHECK(n == 2);
  OK(kvport_prefix_cache_evict(prefix, 1, &n));
  CHECK(n == 1);
  OK(kvport_prefix_cache_evict(prefix, 5, NULL));
  OK(kvport_prefix_cache_counters_get(prefix, &pc));
  CHECK(pc.lookups >= 4 && pc.hits >= 4 && pc.inserts == 2 && pc.evictions == 2);
  CHECK(pc.ignored_releases == 0 && pc.misses > 0);
  EXPECT(KVPORT_ERR_INVALID_ARGUMENT, kvport_prefix_cache_counters_get(prefix, NULL));
  OK(kvport_prefix_cache_check_invariants(prefix, &report, NULL, 0, NULL));
  CHECK(report.ok && report.cached_blocks == 0 && report.free_blocks == 6);

  OK(kvport_prefix_cache_destroy(prefix));
  EXPECT(KVPORT_ERR_INVALID_HANDLE, kvport_prefix_cache_destroy(prefix));
  EXPECT(KVPORT_ERR_INVALID_HANDLE, kvport_prefix_cache_num_cached_blocks(prefix, &n));
  check_invariants_ok(cache, 0);
  OK(kvport_cache_destroy(cache));
}

/* ---- layer specs and the planner ----------------------------------------------- */

static kvport_layer_spec attention_spec(int32_t kind, size_t window_or_chunk) {
  kvport_layer_spec s;
  kvport_layer_spec_init(&s);
  s.kind = kind;
  s.num_kv_heads = 1;
  s.head_dim_k = 8;
  s.head_dim_v = 8;
  if (kind == KVPORT_LAYER_SLIDING_WINDOW) s.window = window_or_chunk;
  if (kind == KVPORT_LAYER_CHUNKED_LOCAL) s.chunk = window_or_chunk;
  return s;
}

static kvport_layer_spec mla_spec(size_t rank, size_t rope, int32_t format) {
  kvport_layer_spec s;
  kvport_layer_spec_init(&s);
  s.kind = KVPORT_LAYER_MLA;
  s.kv_lora_rank = rank;
  s.rope_dim = rope;
  s.mla_format = format;
  return s;
}

/* A Mamba-like state: a 2x2 f32 "ssm" (16 B) and a 3-element f16 "conv" (6 B,
 * padded to 16): 32 bytes a slot. */
static const kvport_state_tensor k_state_tensors[2] = {
    {"ssm", 2, {2, 2}, KVPORT_STATE_F32},
    {"conv", 1, {3}, KVPORT_STATE_F16},
};

static kvport_layer_spec state_spec(void) {
  kvport_layer_spec s;
  kvport_layer_spec_init(&s);
  s.kind = KVPORT_LAYER_STATE;
  s.state = k_state_tensors;
  s.num_state = 2;
  return s;
}

static void test_layer_specs(void) {
  kvport_layer_spec s, bad;
  kvport_state_tensor tensors[2];
  char text[64];
  char tiny[6];
  size_t n = 0, needed = 0;

  EXPECT(KVPORT_ERR_INVALID_ARGUMENT, kvport_layer_spec_init(NULL));
  OK(kvport_layer_spec_init(&s));
  CHECK(s.kind == KVPORT_LAYER_FULL_ATTENTION && s.dtype == KVPORT_DTYPE_BF16);
  CHECK(s.num_kv_heads == 0 && s.window == 0 && s.mla_format == KVPORT_MLA_PLAIN);
  CHECK(s.state == NULL && s.num_state == 0);
  EXPECT(KVPORT_ERR_INVALID_ARGUMENT, kvport_layer_spec_validate(&s, 16)); /* heads 0 */

  s = attention_spec(KVPORT_LAYER_SLIDING_WINDOW, 128);
  s.num_kv_heads = 8;
  s.head_dim_k = s.head_dim_v = 64;
  OK(kvport_layer_spec_validate(&s, 16));
  OK(kvport_layer_spec_describe(&s, text, sizeof text, &needed));
  CHECK(strcmp(text, "sliding_window(128) 8x64 bf16") == 0 && needed == strlen(text) + 1);
  OK(kvport_layer_spec_describe(&s, tiny, sizeof tiny, &needed));
  CHECK(strcmp(tiny, "slidi") == 0 && needed > sizeof tiny);
  OK(kvport_layer_spec_describe(&s, NULL, 0, NULL));
  EXPECT(KVPORT_ERR_INVALID_ARGUMENT, kvport_layer_spec_describe(&s, NULL, 8, NULL));
  OK(kvport_layer_spec_block_bytes(&s, 16, &n));
  CHECK(n == 2 * 16 * 8 * 64 * 2); /* K and V, bf16 */
  s.window = 0;
  EXPECT(KVPORT_ERR_INVALID_ARGUMENT, kvport_layer_spec_validate(&s, 16));
  CHECK(contains(kvport_last_error(), "window"));
  EXPECT(KVPORT_ERR_INVALID_ARGUMENT, kvport_layer_spec_block_bytes(&s, 16, &n));

  s = attention_spec(KVPORT_LAYER_CHUNKED_LOCAL, 6); /* not a multiple of 4 */
  EXPECT(KVPORT_ERR_INVALID_ARGUMENT, kvport_layer_spec_validate(&s, 4));
  s.chunk = 8;
  OK(kvport_layer_spec_validate(&s, 4));

  /* MLA: DeepSeek's 512 + 64, plain bf16 and fp8_ds_mla (656 B a token). */
  s = mla_spec(512, 64, KVPORT_MLA_PLAIN);
  OK(kvport_layer_spec_block_bytes(&s, 16, &n));
  CHECK(n == 16 * 576 * 2);
  OK(kvport_layer_spec_describe(&s, text, sizeof text, NULL));
  CHECK(strcmp(text, "mla(512+64) bf16") == 0);
  s.mla_format = KVPORT_MLA_FP8_DS_MLA;
  OK(kvport_layer_spec_block_bytes(&s, 16, &n));
  CHECK(n == 16 * 656);
  s.kv_lora_rank = 100; /* not a multiple of 128 */
  EXPECT(KVPORT_ERR_INVALID_ARGUMENT, kvport_layer_spec_validate(&s, 16));
  s.mla_format = 7;
  EXPECT(KVPORT_ERR_INVALID_ARGUMENT, kvport_layer_spec_validate(&s, 16));
  CHECK(contains(kvport_last_error(), "mla_format"));

  /* State: padded sizes, offsets. */
  s = state_spec();
  OK(kvport_layer_spec_state_bytes(&s, &n));
  CHECK(n == 32);
  OK(kvport_layer_spec_state_offset(&s, 0, &n));
  CHECK(n == 0);
  OK(kvport_layer_spec_state_offset(&s, 1, &n));
  CHECK(n == 16);
  EXPECT(KVPORT_ERR_OUT_OF_RANGE, kvport_layer_spec_state_offset(&s, 2, &n));
  OK(kvport_layer_spec_block_bytes(&s, 16, &n));
  CHECK(n == 0);
  OK(kvport_layer_spec_describe(&s, text, sizeof text, NULL));
  CHECK(strcmp(text, "state(ssm 2x2 f32, conv 3 f16)") == 0);
  s = attention_spec(KVPORT_LAYER_FULL_ATTENTION, 0);
  OK(kvport_layer_spec_state_bytes(&s, &n));
  CHECK(n == 0);
  EXPECT(KVPORT_ERR_OUT_OF_RANGE, kvport_layer_spec_state_offset(&s, 0, &n));

  /* Bad specs: each names its field. */
  memcpy(tensors, k_state_tensors, sizeof tensors);
  bad = state_spec();
  bad.state = tensors;
  tensors[1].name = NULL;
  EXPECT(KVPORT_ERR_INVALID_ARGUMENT, kvport_layer_spec_validate(&bad, 16));
  CHECK(contains(kvport_last_error(), "state[1].name"));
  tensors[1].name = "conv";
  tensors[1].ndim = 0;
  EXPECT(KVPORT_ERR_INVALID_ARGUMENT, kvport_layer_spec_validate(&bad, 16));
  tensors[1].ndim = KVPORT_STATE_MAX_DIMS + 1;
  EXPECT(KVPORT_ERR_INVALID_ARGUMENT, kvport_layer_spec_validate(&bad, 16));
  CHECK(contains(kvport_last_error(), "ndim"));
  tensors[1].ndim = 2; /* {3, 0}: shape[1] is still 0 */
  tensors[1].shape[1] = 0;
  EXPECT(KVPORT_ERR_INVALID_ARGUMENT, kvport_layer_spec_validate(&bad, 16));
  CHECK(contains(kvport_last_error(), "StateTensor 'conv': dimension 1 is 0"));
  tensors[1].ndim = 1;
  tensors[1].name = "ssm"; /* two tensors of one name */
  EXPECT(KVPORT_ERR_INVALID_ARGUMENT, kvport_layer_spec_validate(&bad, 16));
  CHECK(contains(kvport_last_error(), "state tensors 0 and 1 are both named 'ssm'"));
  EXPECT(KVPORT_ERR_INVALID_ARGUMENT, kvport_layer_spec_state_bytes(&bad, &n));
  tensors[1].name = "conv";
  OK(kvport_layer_spec_validate(&bad, 16));
  tensors[1].ndim = 1;
  tensors[1].dtype = 3;
  EXPECT(KVPORT_ERR_INVALID_ARGUMENT, kvport_layer_spec_state_bytes(&bad, &n));
  tensors[1].dtype = KVPORT_STATE_BF16;
  OK(kvport_layer_spec_validate(&bad, 16));
  bad.num_state = 0; /* a state without tensors */
  EXPECT(KVPORT_ERR_INVALID_ARGUMENT, kvport_layer_spec_validate(&bad, 16));
  bad.state = NULL;
  bad.num_state = 2;
  EXPECT(KVPORT_ERR_INVALID_ARGUMENT, kvport_layer_spec_validate(&bad, 16));
  bad = attention_spec(KVPORT_LAYER_FULL_ATTENTION, 0);
  bad.kind = 6;
  EXPECT(KVPORT_ERR_INVALID_ARGUMENT, kvport_layer_spec_validate(&bad, 16));
  CHECK(contains(kvport_last_error(), "kind"));
  bad.kind = KVPORT_LAYER_FULL_ATTENTION;
  bad.dtype = 42;
  EXPECT(KVPORT_ERR_INVALID_ARGUMENT, kvport_layer_spec_validate(&bad, 16));
  CHECK(contains(kvport_last_error(), "dtype"));
  EXPECT(KVPORT_ERR_INVALID_ARGUMENT, kvport_layer_spec_validate(NULL, 16));
  EXPECT(KVPORT_ERR_INVALID_ARGUMENT, kvport_layer_spec_state_bytes(&s, NULL));
  /* A none layer is valid; fields of other kinds are not read. */
  bad.kind = KVPORT_LAYER_NONE;
  OK(kvport_layer_spec_validate(&bad, 16));
}

/* gpt-oss-like: window 128 and full attention, alternating, 8 x 64 bf16. */
static void test_plan(void) {
  kvport_layer_spec layers[4];
  kvport_plan_request request;
  kvport_plan plan;
  kvport_group_plan groups[4];
  size_t i;

  for (i = 0; i < 4; ++i) {
    layers[i] =
        attention_spec(i % 2 == 0 ? KVPORT_LAYER_SLIDING_WINDOW : KVPORT_LAYER_FULL_ATTENTION, 128);
    layers[i].num_kv_heads = 8;
    layers[i].head_dim_k = layers[i].head_dim_v = 64;
  }
  EXPECT(KVPORT_ERR_INVALID_ARGUMENT, kvport_plan_request_init(NULL));
  OK(kvport_plan_request_init(&request));
  CHECK(request.budget_bytes == 0 && request.step_tokens == 1 && request.state_checkpoints == 1);
  request.budget_bytes = (size_t)64 << 20;
  request.max_context_tokens = 4096;

  OK(kvport_plan_kv_cache(layers, 4, 16, &request, &plan, groups, 4));
  CHECK(plan.block_size == 16 && plan.num_groups == 2);
  CHECK(groups[0].kind == KVPORT_LAYER_SLIDING_WINDOW && groups[0].num_layers == 2);
  CHECK(groups[1].kind == KVPORT_LAYER_FULL_ATTENTION && groups[1].num_layers == 2);
  /* Window 128, decode: ceil((128 - 2 + 1) / 16) + 1 = 9 blocks; full: 256. */
  CHECK(groups[0].peak_blocks_per_request == 9 && groups[1].peak_blocks_per_request == 256);
  CHECK(groups[0].bytes_per_block == 2 * 2 * 16 * 8 * 64 * 2);
  CHECK(groups[0].bytes_per_token == 2 * 2 * 8 * 64 * 2 && groups[0].bytes_per_request == 0);
  CHECK(groups[0].num_blocks > 0 && groups[1].num_blocks > groups[0].num_blocks);
  CHECK(plan.total_bytes == groups[0].bytes + groups[1].bytes);
  CHECK(plan.total_bytes <= request.budget_bytes && plan.max_concurrent_requests > 0);
  CHECK(plan.peak_bytes_per_request == (9 + 256) * groups[0].bytes_per_block);
  CHECK(plan.all_full_peak_bytes_per_request == 2 * 256 * groups[0].bytes_per_block);
  CHECK(plan.shared_pool_peak_bytes_per_request >= plan.peak_bytes_per_request);
  CHECK(plan.ratio_to_all_full > 265.0 / 512 - 1e-9 && plan.ratio_to_all_full < 265.0 / 512 + 1e-9);

  /* Totals only; a buffer too small; bad requests. */
  OK(kvport_plan_kv_cache(layers, 4, 16, &request, &plan, NULL, 0));
  CHECK(plan.num_groups == 2);
  EXPECT(KVPORT_ERR_INVALID_ARGUMENT,
         kvport_plan_kv_cache(layers, 4, 16, &request, &plan, groups, 1));
  CHECK(contains(kvport_last_error(), "capacity"));
  EXPECT(KVPORT_ERR_INVALID_ARGUMENT,
         kvport_plan_kv_cache(layers, 4, 16, &request, &plan, NULL, 4));
  EXPECT(KVPORT_ERR_INVALID_ARGUMENT, kvport_plan_kv_cache(layers, 4, 16, NULL, &plan, NULL, 0));
  EXPECT(KVPORT_ERR_INVALID_ARGUMENT, kvport_plan_kv_cache(layers, 4, 16, &request, NULL, NULL, 0));
  EXPECT(KVPORT_ERR_INVALID_ARGUMENT, kvport_plan_kv_cache(NULL, 4, 16, &request, &plan, NULL, 0));
  EXPECT(KVPORT_ERR_INVALID_ARGUMENT,
         kvport_plan_kv_cache(layers, 0, 16, &request, &plan, NULL, 0));
  EXPECT(KVPORT_ERR_INVALID_ARGUMENT, kvport_plan_kv_cache(layers, 4, 0, &request, &plan, NULL, 0));
  request.max_requests = 1000000; /* more than fit */
  EXPECT(KVPORT_ERR_INVALID_ARGUMENT,
         kvport_plan_kv_cache(layers, 4, 16, &request, &plan, NULL, 0));
  CHECK(contains(kvport_last_error(), "holds"));
  request.max_requests = 0;
  request.budget_bytes = 0;
  EXPECT(KVPORT_ERR_INVALID_ARGUMENT,
         kvport_plan_kv_cache(layers, 4, 16, &request, &plan, NULL, 0));
  request.budget_bytes = (size_t)64 << 20;
  for (i = 0; i < 4; ++i)
    layers[i].kind = KVPORT_LAYER_NONE;
  EXPECT(KVPORT_ERR_INVALID_ARGUMENT,
         kvport_plan_kv_cache(layers, 4, 16, &request, &plan, NULL, 0));
}

/* ---- hybrid caches and tables ------------------------------------------------- */

/* A Mamba-hybrid of 5 layers, 4-token blocks: group 0 full attention (layer
 * 0), group 1 state (layers 1 and 2), group 2 MLA (layer 3, 8 + 4 bf16 = 24 B
 * a token, no V); layer 4 has no KV. */
static void mamba_layers(kvport_layer_spec layers[5]) {
  layers[0] = attention_spec(KVPORT_LAYER_FULL_ATTENTION, 0);
  layers[1] = state_spec();
  layers[2] = state_spec();
  layers[3] = mla_spec(8, 4, KVPORT_MLA_PLAIN);
  kvport_layer_spec_init(&layers[4]);
  layers[4].kind = KVPORT_LAYER_NONE;
}

static void fill_tokens(uint32_t* tokens, size_t n, uint32_t first) {
  size_t i;
  for (i = 0; i < n; ++i)
    tokens[i] = first + (uint32_t)i;
}

static void check_hybrid_ok(kvport_hybrid_cache* cache) {
  kvport_invariant_report r;
  char text[256];
  OK(kvport_hybrid_cache_check_invariants(cache, &r, text, sizeof text, NULL));
  CHECK(r.ok && r.num_violations == 0 && strncmp(text, "ok", 2) == 0);
}

static void test_hybrid_cache(kvport_backend* backend) {
  kvport_layer_spec layers[5];
  kvport_layer_spec spec;
  size_t counts[3] = {16, 8, 16};
  size_t zero_counts[3] = {16, 0, 16};
  kvport_hybrid_cache* cache = NULL;
  kvport_hybrid_block_table* table = NULL;
  kvport_cache *pool = NULL, *again = NULL, *mla = NULL, *full = NULL;
  kvport_prefix_cache* prefix = NULL;
  kvport_block_table* plain = NULL;
  kvport_config config;
  kvport_invariant_report report;
  size_t n = 0, group = 99, index = 99, total = 0, i;
  size_t ids[4];
  int32_t kind = -1;
  bool has = true;
  uint32_t b = 0;
  void* p = NULL;

  mamba_layers(layers);
  EXPECT(KVPORT_ERR_INVALID_ARGUMENT,
         kvport_hybrid_cache_create(backend, layers, 5, 4, 1, counts, 2, &cache));
  CHECK(contains(kvport_last_error(), "2 block counts for 3"));
  EXPECT(KVPORT_ERR_INVALID_ARGUMENT,
         kvport_hybrid_cache_create(backend, layers, 5, 4, 1, zero_counts, 3, &cache));
  EXPECT(KVPORT_ERR_INVALID_ARGUMENT,
         kvport_hybrid_cache_create(backend, layers, 5, 4, 1, NULL, 3, &cache));
  EXPECT(KVPORT_ERR_INVALID_ARGUMENT,
         kvport_hybrid_cache_create(backend, layers, 5, 4, 1, counts, 3, NULL));
  EXPECT(KVPORT_ERR_INVALID_ARGUMENT,
         kvport_hybrid_cache_create(backend, NULL, 5, 4, 1, counts, 3, &cache));
  EXPECT(KVPORT_ERR_INVALID_HANDLE,
         kvport_hybrid_cache_create(NULL, layers, 5, 4, 1, counts, 3, &cache));
  layers[3].kv_lora_rank = 0;
  EXPECT(KVPORT_ERR_INVALID_ARGUMENT,
         kvport_hybrid_cache_create(backend, layers, 5, 4, 1, counts, 3, &cache));
  layers[3].kv_lora_rank = 8;
  OK(kvport_hybrid_cache_create(backend, layers, 5, 4, 1, counts, 3, &cache));

  OK(kvport_hybrid_cache_num_layers(cache, &n));
  CHECK(n == 5);
  OK(kvport_hybrid_cache_num_groups(cache, &n));
  CHECK(n == 3);
  OK(kvport_hybrid_cache_block_size(cache, &n));
  CHECK(n == 4);
  OK(kvport_hybrid_cache_group_kind(cache, 0, &kind));
  CHECK(kind == KVPORT_LAYER_FULL_ATTENTION);
  OK(kvport_hybrid_cache_group_kind(cache, 1, &kind));
  CHECK(kind == KVPORT_LAYER_STATE);
  OK(kvport_hybrid_cache_group_kind(cache, 2, &kind));
  CHECK(kind == KVPORT_LAYER_MLA);
  EXPECT(KVPORT_ERR_OUT_OF_RANGE, kvport_hybrid_cache_group_kind(cache, 3, &kind));
  CHECK(contains(kvport_last_error(), "group 3 out of range (3 groups)"));
  EXPECT(KVPORT_ERR_INVALID_ARGUMENT, kvport_hybrid_cache_group_kind(cache, 0, NULL));

  /* Specs back: the state tensors point into the cache. */
  OK(kvport_hybrid_cache_group_spec(cache, 1, &spec));
  CHECK(spec.kind == KVPORT_LAYER_STATE && spec.num_state == 2 && spec.state != NULL);
  CHECK(strcmp(spec.state[0].name, "ssm") == 0 && spec.state[0].ndim == 2);
  CHECK(spec.state[0].shape[1] == 2 && spec.state[1].dtype == KVPORT_STATE_F16);
  OK(kvport_layer_spec_state_offset(&spec, 1, &n));
  CHECK(n == 16);
  OK(kvport_hybrid_cache_group_spec(cache, 2, &spec));
  CHECK(spec.kind == KVPORT_LAYER_MLA && spec.kv_lora_rank == 8 && spec.rope_dim == 4);
  CHECK(spec.state == NULL && spec.num_state == 0);
  EXPECT(KVPORT_ERR_OUT_OF_RANGE, kvport_hybrid_cache_group_spec(cache, 3, &spec));

  /* Layers of a group; locate. */
  OK(kvport_hybrid_cache_group_num_layers(cache, 1, &n));
  CHECK(n == 2);
  OK(kvport_hybrid_cache_group_layers(cache, 1, ids, 4, &n));
  CHECK(n == 2 && ids[0] == 1 && ids[1] == 2);
  ids[0] = 77;
  EXPECT(KVPORT_ERR_INVALID_ARGUMENT, kvport_hybrid_cache_group_layers(cache, 1, ids, 1, &n));
  CHECK(ids[0] == 77); /* nothing written */
  EXPECT(KVPORT_ERR_INVALID_ARGUMENT, kvport_hybrid_cache_group_layers(cache, 1, NULL, 4, &n));
  EXPECT(KVPORT_ERR_INVALID_ARGUMENT, kvport_hybrid_cache_group_layers(cache, 1, ids, 4, NULL));
  EXPECT(KVPORT_ERR_OUT_OF_RANGE, kvport_hybrid_cache_group_layers(cache, 3, ids, 4, &n));
  EXPECT(KVPORT_ERR_OUT_OF_RANGE, kvport_hybrid_cache_group_num_layers(cache, 9, &n));
  OK(kvport_hybrid_cache_locate(cache, 2, &has, &group, &index));
  CHECK(has && group == 1 && index == 1);
  OK(kvport_hybrid_cache_locate(cache, 3, &has, NULL, NULL));
  CHECK(has);
  group = index = 99;
  OK(kvport_hybrid_cache_locate(cache, 4, &has, &group, &index));
  CHECK(!has && group == 99 && index == 99);
  EXPECT(KVPORT_ERR_OUT_OF_RANGE, kvport_hybrid_cache_locate(cache, 5, &has, &group, &index));
  EXPECT(KVPORT_ERR_INVALID_ARGUMENT, kvport_hybrid_cache_locate(cache, 0, NULL, &group, &index));

  /* Group pools as borrowed kvport_cache handles: the existing accessors. */
  OK(kvport_hybrid_cache_group_cache(cache, 1, &pool));
  OK(kvport_hybrid_cache_group_cache(cache, 1, &again));
  CHECK(pool != NULL && pool == again);
  OK(kvport_cache_config(pool, &config));
  CHECK(config.num_layers == 2 && config.block_size == 1 && config.head_dim_v == 0);
  CHECK(config.head_dim_k == 32 && config.dtype == KVPORT_DTYPE_FP8_E4M3);
  OK(kvport_cache_num_blocks(pool, &n));
  CHECK(n == 8);
  OK(kvport_cache_k_block_bytes(pool, 1, &n));
  CHECK(n == 32);
  OK(kvport_cache_v_block_bytes(pool, 1, &n));
  CHECK(n == 0);
  OK(kvport_cache_k_pool_ptr(pool, 1, &p));
  CHECK(p != NULL);
  EXPECT(KVPORT_ERR_INVALID_ARGUMENT, kvport_cache_v_pool_ptr(pool, 1, &p));
  CHECK(contains(kvport_last_error(), "no V"));
  EXPECT(KVPORT_ERR_INVALID_ARGUMENT, kvport_cache_v_ptr(pool, 0, 0, &p));
  EXPECT(KVPORT_ERR_OUT_OF_RANGE, kvport_cache_k_pool_ptr(pool, 2, &p));
  OK(kvport_hybrid_cache_group_cache(cache, 2, &mla));
  OK(kvport_cache_k_block_bytes(mla, 0, &n));
  CHECK(n == 4 * 12 * 2);
  OK(kvport_hybrid_cache_group_cache(cache, 0, &full));
  OK(kvport_cache_v_block_bytes(full, 0, &n));
  CHECK(n == 4 * 8 * 2);
  OK(kvport_hybrid_cache_total_bytes(cache, &total));
  for (i = 0; i < 3; ++i) {
    kvport_cache* g = NULL;
    OK(kvport_hybrid_cache_group_cache(cache, i, &g));
    OK(kvport_cache_total_bytes(g, &n));
    total -= n;
  }
  CHECK(total == 0);
  EXPECT(KVPORT_ERR_OUT_OF_RANGE, kvport_hybrid_cache_group_cache(cache, 3, &pool));
  EXPECT(KVPORT_ERR_INVALID_ARGUMENT, kvport_hybrid_cache_group_cache(cache, 0, NULL));

  /* Its blocks belong to the hybrid tables: no allocation, no destroy. */
  EXPECT(KVPORT_ERR_INVALID_ARGUMENT, kvport_cache_alloc(pool, &b));
  CHECK(contains(kvport_last_error(), "borrowed"));
  EXPECT(KVPORT_ERR_INVALID_ARGUMENT, kvport_cache_try_alloc(pool, &b, &has));
  EXPECT(KVPORT_ERR_INVALID_ARGUMENT, kvport_cache_inc_ref(pool, 0));
  EXPECT(KVPORT_ERR_INVALID_ARGUMENT, kvport_cache_dec_ref(pool, 0, NULL));
  EXPECT(KVPORT_ERR_INVALID_ARGUMENT, kvport_cache_free(pool, 0, NULL));
  EXPECT(KVPORT_ERR_INVALID_ARGUMENT, kvport_cache_free_blocks(pool, &b, 1));
  EXPECT(KVPORT_ERR_INVALID_ARGUMENT, kvport_cache_return_evicted_block(pool, 0));
  EXPECT(KVPORT_ERR_INVALID_ARGUMENT, kvport_prefix_cache_create(pool, &prefix));
  EXPECT(KVPORT_ERR_INVALID_ARGUMENT, kvport_block_table_create(pool, &plain));
  EXPECT(KVPORT_ERR_INVALID_ARGUMENT, kvport_cache_destroy(pool));
  CHECK(contains(kvport_last_error(), "borrowed"));
  OK(kvport_cache_check_invariants(pool, &report, NULL, 0, NULL));
  CHECK(report.ok && report.free_blocks == 8);

  /* Ownership: the backend outlives the hybrid cache, the cache its tables. */
  OK(kvport_hybrid_block_table_create(cache, 0, &table));
  EXPECT(KVPORT_ERR_INVALID_ARGUMENT, kvport_hybrid_block_table_create(cache, 0, NULL));
  EXPECT(KVPORT_ERR_HANDLE_IN_USE, kvport_hybrid_cache_destroy(cache));
  EXPECT(KVPORT_ERR_HANDLE_IN_USE, kvport_backend_destroy(backend));
  OK(kvport_hybrid_block_table_destroy(table));
  EXPECT(KVPORT_ERR_INVALID_HANDLE, kvport_hybrid_block_table_destroy(table));
  OK(kvport_hybrid_cache_synchronize(cache));
  check_hybrid_ok(cache);
  OK(kvport_hybrid_cache_destroy(cache));
  /* The borrowed handles went with it. */
  EXPECT(KVPORT_ERR_INVALID_HANDLE, kvport_cache_num_blocks(pool, &n));
  EXPECT(KVPORT_ERR_INVALID_HANDLE, kvport_cache_destroy(mla));
  EXPECT(KVPORT_ERR_INVALID_HANDLE, kvport_hybrid_cache_destroy(cache));
  EXPECT(KVPORT_ERR_INVALID_HANDLE,
         kvport_hybrid_cache_num_groups((kvport_hybrid_cache*)backend, &n));
  CHECK(contains(kvport_last_error(), "is a kvport_backend"));
}

static size_t count_null(const uint32_t* ids, size_t n) {
  size_t i, nulls = 0;
  for (i = 0; i < n; ++i)
    if (ids[i] == KVPORT_NULL_BLOCK) ++nulls;
  return nulls;
}

/* gpt-oss-like: window 8 and full attention, 4-token blocks. */
/* Speculative decoding: drafts get blocks but no hits until committed;
 * truncate frees the blocks only they used; the errors name the limit. */
static void test_hybrid_speculative(kvport_backend* backend) {
  kvport_layer_spec layers[2];
  kvport_layer_spec mamba[5];
  size_t counts[2] = {16, 16};
  size_t mamba_counts[3] = {8, 4, 8};
  kvport_hybrid_cache *cache = NULL, *with_state = NULL;
  kvport_hybrid_block_table *t = NULL, *probe = NULL, *s = NULL;
  kvport_stream* stream = NULL;
  kvport_invariant_report r;
  char text[256];
  uint32_t tokens[32], slots[4], working = 0;
  size_t n = 0, hit = 0, in_use = 0;
  bool can = false, has = false;

  layers[0] = attention_spec(KVPORT_LAYER_SLIDING_WINDOW, 8);
  layers[1] = attention_spec(KVPORT_LAYER_FULL_ATTENTION, 0);
  fill_tokens(tokens, 32, 1);
  OK(kvport_hybrid_cache_create(backend, layers, 2, 4, 1, counts, 2, &cache));
  OK(kvport_stream_create(backend, &stream));
  OK(kvport_hybrid_block_table_create(cache, 0, &t));
  OK(kvport_hybrid_block_table_append_tokens(t, tokens, 8, stream));
  OK(kvport_hybrid_block_table_append_draft(t, tokens + 8, 8, stream)); /* 2 blocks of drafts */
  OK(kvport_hybrid_block_table_num_tokens(t, &n));
  CHECK(n == 16);
  OK(kvport_hybrid_block_table_num_committed(t, &n));
  CHECK(n == 8);
  /* Another request with the same 17 tokens hits the committed blocks only. */
  OK(kvport_hybrid_block_table_create(cache, 0, &probe));
  OK(kvport_hybrid_block_table_reuse_cached_prefix(probe, tokens, 17, stream, &hit));
  CHECK(hit == 8);
  OK(kvport_hybrid_block_table_destroy(probe));
  EXPECT(KVPORT_ERR_INVALID_ARGUMENT, kvport_hybrid_block_table_commit(t, 9));
  CHECK(contains(kvport_last_error(), "holds 8 draft tokens"));
  OK(kvport_hybrid_block_table_commit(t, 4)); /* block 2 is committed */
  OK(kvport_hybrid_block_table_create(cache, 0, &probe));
  OK(kvport_hybrid_block_table_reuse_cached_prefix(probe, tokens, 17, stream, &hit));
  CHECK(hit == 12);
  OK(kvport_hybrid_block_table_destroy(probe));
  OK(kvport_hybrid_cache_group_blocks_in_use(cache, 1, &in_use));
  EXPECT(KVPORT_ERR_INVALID_ARGUMENT, kvport_hybrid_block_table_truncate(t, 11));
  CHECK(contains(kvport_last_error(), "never taken back"));
  EXPECT(KVPORT_ERR_INVALID_ARGUMENT,
         kvport_hybrid_block_table_append_tokens(t, tokens, 1, stream));
  CHECK(contains(kvport_last_error(), "commit or truncate"));
  OK(kvport_hybrid_block_table_truncate(t, 12)); /* the 4 rejected held block 3 alone */
  OK(kvport_hybrid_cache_group_blocks_in_use(cache, 1, &n));
  CHECK(n == in_use - 1);
  OK(kvport_hybrid_block_table_check_invariants(t, &r, text, sizeof text, NULL));
  CHECK(r.ok);
  EXPECT(KVPORT_ERR_INVALID_HANDLE,
         kvport_hybrid_block_table_check_invariants(NULL, &r, text, sizeof text, NULL));
  OK(kvport_hybrid_block_table_destroy(t));
  check_hybrid_ok(cache);

  /* A state group (group 1) gets a slot per draft; the accepted one's works on. */
  mamba_layers(mamba);
  OK(kvport_hybrid_cache_create(backend, mamba, 5, 4, 1, mamba_counts, 3, &with_state));
  OK(kvport_hybrid_block_table_create(with_state, 0, &s));
  OK(kvport_hybrid_block_table_append_tokens(s, tokens, 2, stream));
  OK(kvport_hybrid_block_table_can_append_draft(s, 3, &can));
  CHECK(can);
  OK(kvport_hybrid_block_table_can_append_draft(s, 4, &can));
  CHECK(!can); /* 4 state slots, 1 working */
  OK(kvport_hybrid_block_table_append_draft(s, tokens + 2, 2, stream));
  OK(kvport_hybrid_block_table_num_draft_tokens(s, &n));
  CHECK(n == 2);
  OK(kvport_hybrid_block_table_draft_state_slots(s, 1, slots, 4, &n));
  CHECK(n == 2);
  EXPECT(KVPORT_ERR_INVALID_ARGUMENT,
         kvport_hybrid_block_table_draft_state_slots(s, 1, slots, 1, &n));
  EXPECT(KVPORT_ERR_OUT_OF_RANGE, kvport_hybrid_block_table_draft_state_slots(s, 9, slots, 4, &n));
  OK(kvport_hybrid_block_table_commit(s, 1));
  OK(kvport_hybrid_block_table_state_slot(s, 1, &has, &working));
  CHECK(has && working == slots[0]);
  OK(kvport_hybrid_block_table_truncate(s, 3));
  OK(kvport_hybrid_block_table_draft_state_slots(s, 1, slots, 4, &n));
  CHECK(n == 0);
  OK(kvport_hybrid_block_table_destroy(s));
  OK(kvport_hybrid_cache_destroy(with_state));
  OK(kvport_stream_destroy(stream));
  OK(kvport_hybrid_cache_destroy(cache));
}

/* Batch metadata: vLLM rows and slot mapping, FlashInfer pages, against the
 * tables' blocks. */
static void test_batch_metadata(kvport_backend* backend) {
  kvport_layer_spec layers[2];
  size_t counts[2] = {16, 16};
  kvport_hybrid_cache* cache = NULL;
  kvport_hybrid_block_table *a = NULL, *b = NULL;
  const kvport_hybrid_block_table* tables[2];
  size_t new_tokens[2] = {1, 3};
  kvport_batch batch;
  kvport_stream* stream = NULL;
  uint32_t tokens[16], ids[8];
  int32_t rows[3 * 8], indptr[3], indices[16], last[2], kv_len[2], locations[2 * 12];
  int64_t slots[6];
  size_t n = 0, width = 0, i;

  layers[0] = attention_spec(KVPORT_LAYER_SLIDING_WINDOW, 4);
  layers[1] = attention_spec(KVPORT_LAYER_FULL_ATTENTION, 0);
  fill_tokens(tokens, 16, 1);
  OK(kvport_hybrid_cache_create(backend, layers, 2, 4, 1, counts, 2, &cache));
  OK(kvport_stream_create(backend, &stream));
  OK(kvport_hybrid_block_table_create(cache, 0, &a));
  OK(kvport_hybrid_block_table_create(cache, 0, &b));
  OK(kvport_hybrid_block_table_append_tokens(a, tokens, 9, stream));
  OK(kvport_hybrid_block_table_append_tokens(a, tokens + 9, 1, stream)); /* 10 tokens */
  OK(kvport_hybrid_block_table_append_tokens(b, tokens, 3, stream));
  tables[0] = a;
  tables[1] = b;
  batch.tables = tables;
  batch.num_new_tokens = new_tokens;
  batch.num_sequences = 2;
  batch.group = 1;
  batch.kernel_block_size = 0;
  batch.null_block = 0;

  OK(kvport_vllm_row_width(32, 4, &width));
  CHECK(width == 32); /* 8 blocks, a multiple of 128 / 4 = 32 */
  OK(kvport_build_block_table_rows(&batch, 8, rows, 3));
  OK(kvport_hybrid_block_table_blocks(a, 1, ids, 8, &n));
  CHECK(n == 3);
  for (i = 0; i < 8; ++i)
    CHECK(rows[i] == (i < 3 ? (int32_t)ids[i] : 0));
  for (i = 0; i < 8; ++i)
    CHECK(rows[16 + i] == 0); /* a padding row */
  OK(kvport_build_token_locations(&batch, 12, locations, 2));
  for (i = 0; i < 10; ++i)
    CHECK(locations[i] == (int32_t)(ids[i / 4] * 4 + i % 4));
  CHECK(locations[10] == 0 && locations[11] == 0);
  EXPECT(KVPORT_ERR_INVALID_ARGUMENT, kvport_build_token_locations(&batch, 8, locations, 2));
  OK(kvport_build_slot_mapping(&batch, slots, 6, &n));
  CHECK(n == 4);
  CHECK(slots[0] == (int64_t)ids[2] * 4 + 1); /* a's token 9 */
  OK(kvport_hybrid_block_table_blocks(b, 1, ids, 8, &n));
  CHECK(slots[1] == (int64_t)ids[0] * 4 && slots[3] == (int64_t)ids[0] * 4 + 2);
  CHECK(slots[4] == -1 && slots[5] == -1);
  OK(kvport_build_flashinfer_pages(&batch, NULL, NULL, 0, NULL, NULL, &n));
  CHECK(n == 4);
  OK(kvport_build_flashinfer_pages(&batch, indptr, indices, 16, last, kv_len, &n));
  CHECK(indptr[0] == 0 && indptr[1] == 3 && indptr[2] == 4);
  CHECK(last[0] == 2 && last[1] == 3 && kv_len[0] == 10 && kv_len[1] == 3);
  EXPECT(KVPORT_ERR_INVALID_ARGUMENT,
         kvport_build_flashinfer_pages(&batch, indptr, indices, 3, last, kv_len, &n));
  /* Kernel blocks of 2 tokens: a's first block is kernel blocks 2b, 2b + 1. */
  batch.kernel_block_size = 2;
  OK(kvport_build_block_table_rows(&batch, 8, rows, 2));
  OK(kvport_hybrid_block_table_blocks(a, 1, ids, 8, &n));
  CHECK(rows[0] == (int32_t)ids[0] * 2 && rows[1] == (int32_t)ids[0] * 2 + 1);
  /* Errors: a kernel block that does not divide, too few rows, a state-less
   * group out of range, a null batch. */
  batch.kernel_block_size = 3;
  EXPECT(KVPORT_ERR_INVALID_ARGUMENT, kvport_build_block_table_rows(&batch, 8, rows, 2));
  CHECK(contains(kvport_last_error(), "does not divide"));
  batch.kernel_block_size = 0;
  EXPECT(KVPORT_ERR_INVALID_ARGUMENT, kvport_build_block_table_rows(&batch, 8, rows, 1));
  batch.group = 5;
  EXPECT(KVPORT_ERR_OUT_OF_RANGE, kvport_build_slot_mapping(&batch, slots, 6, &n));
  EXPECT(KVPORT_ERR_INVALID_ARGUMENT, kvport_build_slot_mapping(NULL, slots, 6, &n));
  EXPECT(KVPORT_ERR_INVALID_ARGUMENT, kvport_vllm_row_width(0, 4, &width));

  OK(kvport_hybrid_block_table_destroy(a));
  OK(kvport_hybrid_block_table_destroy(b));
  OK(kvport_stream_destroy(stream));
  OK(kvport_hybrid_cache_destroy(cache));
}

static void test_hybrid_window_tables(kvport_backend* backend) {
  kvport_layer_spec layers[3];
  size_t counts[2] = {16, 16};
  size_t small_counts[2] = {3, 16};
  kvport_hybrid_cache *cache = NULL, *small = NULL;
  kvport_hybrid_block_table *a = NULL, *b = NULL, *child = NULL, *t = NULL;
  kvport_hybrid_hit_counters hits;
  kvport_group_need need[2];
  kvport_stream* stream = NULL;
  kvport_backend* other = NULL;
  kvport_stream* foreign = NULL;
  uint32_t tokens[40], ids[16], big[1];
  size_t n = 0, hit = 0, i;
  int32_t mode = -1;
  uint64_t cows = 0;
  bool ok = false, has = true;
  uint32_t slot = 12345;

  layers[0] = attention_spec(KVPORT_LAYER_SLIDING_WINDOW, 8);
  layers[1] = attention_spec(KVPORT_LAYER_FULL_ATTENTION, 0);
  layers[2] = attention_spec(KVPORT_LAYER_SLIDING_WINDOW, 8);
  fill_tokens(tokens, 40, 1);
  OK(kvport_hybrid_cache_create(backend, layers, 3, 4, 1, counts, 2, &cache));
  OK(kvport_stream_create(backend, &stream));
  OK(kvport_hybrid_block_table_create(cache, 0, &a));

  /* Decode 40 tokens one at a time: the window group releases what falls
   * out of the window (blocks wholly before token 39 - 8 + 1 = 32). */
  for (i = 0; i < 40; ++i)
    OK(kvport_hybrid_block_table_append_tokens(a, tokens + i, 1, stream));
  OK(kvport_hybrid_block_table_num_tokens(a, &n));
  CHECK(n == 40);
  OK(kvport_hybrid_block_table_num_blocks(a, 0, &n));
  CHECK(n == 10);
  OK(kvport_hybrid_block_table_blocks(a, 0, ids, 16, &n));
  CHECK(n == 10 && count_null(ids, n) == 8 && ids[7] == KVPORT_NULL_BLOCK);
  CHECK(ids[8] != KVPORT_NULL_BLOCK && ids[9] != KVPORT_NULL_BLOCK);
  OK(kvport_hybrid_block_table_num_live_blocks(a, 0, &n));
  CHECK(n == 2);
  OK(kvport_hybrid_block_table_blocks(a, 1, ids, 16, &n));
  CHECK(n == 10 && count_null(ids, n) == 0);
  OK(kvport_hybrid_block_table_num_live_blocks(a, 1, &n));
  CHECK(n == 10);
  /* Buffer too small (nothing written), null buffer, out-of-range group. */
  big[0] = 7;
  EXPECT(KVPORT_ERR_INVALID_ARGUMENT, kvport_hybrid_block_table_blocks(a, 0, big, 1, &n));
  CHECK(big[0] == 7 && contains(kvport_last_error(), "capacity 1"));
  EXPECT(KVPORT_ERR_INVALID_ARGUMENT, kvport_hybrid_block_table_blocks(a, 0, NULL, 0, &n));
  EXPECT(KVPORT_ERR_INVALID_ARGUMENT, kvport_hybrid_block_table_blocks(a, 0, ids, 16, NULL));
  EXPECT(KVPORT_ERR_OUT_OF_RANGE, kvport_hybrid_block_table_blocks(a, 2, ids, 16, &n));
  EXPECT(KVPORT_ERR_OUT_OF_RANGE, kvport_hybrid_block_table_num_blocks(a, 2, &n));
  EXPECT(KVPORT_ERR_OUT_OF_RANGE, kvport_hybrid_block_table_num_live_blocks(a, 2, &n));
  EXPECT(KVPORT_ERR_OUT_OF_RANGE, kvport_hybrid_block_table_state_slot(a, 2, &has, &slot));
  OK(kvport_hybrid_block_table_state_slot(a, 0, &has, &slot));
  CHECK(!has && slot == 12345); /* not a state group */
  OK(kvport_hybrid_cache_group_blocks_in_use(cache, 0, &n));
  CHECK(n == 2);
  EXPECT(KVPORT_ERR_OUT_OF_RANGE, kvport_hybrid_cache_group_blocks_in_use(cache, 2, &n));
  check_hybrid_ok(cache);
  OK(kvport_hybrid_block_table_release(a));
  OK(kvport_hybrid_block_table_num_tokens(a, &n));
  CHECK(n == 0);
  OK(kvport_hybrid_cache_group_blocks_in_use(cache, 1, &n));
  CHECK(n == 0);

  /* A prefix hit: 33 tokens, then the same prompt again. compute-last-token
   * hits 32; the window group needs only tokens 25..31 (blocks 6 and 7). */
  OK(kvport_hybrid_block_table_append_tokens(a, tokens, 33, NULL));
  OK(kvport_hybrid_block_table_destroy(a));
  OK(kvport_hybrid_block_table_create(cache, 0, &b));
  OK(kvport_hybrid_block_table_prefix_hit_mode(b, &mode));
  CHECK(mode == KVPORT_PREFIX_HIT_COMPUTE_LAST_TOKEN);
  OK(kvport_hybrid_block_table_reuse_cached_prefix(b, tokens, 33, stream, &hit));
  CHECK(hit == 32);
  OK(kvport_hybrid_block_table_blocks(b, 0, ids, 16, &n));
  CHECK(n == 8 && count_null(ids, n) == 6);
  OK(kvport_hybrid_block_table_blocks(b, 1, ids, 16, &n));
  CHECK(n == 8 && count_null(ids, n) == 0);
  OK(kvport_hybrid_cache_hit_counters(cache, &hits));
  CHECK(hits.lookups == 1 && hits.lookup_tokens == 33 && hits.hit_tokens == 32);
  CHECK(hits.state_checkpoints == 0);
  EXPECT(KVPORT_ERR_INVALID_ARGUMENT, kvport_hybrid_cache_hit_counters(cache, NULL));
  EXPECT(KVPORT_ERR_INVALID_ARGUMENT,
         kvport_hybrid_block_table_reuse_cached_prefix(b, tokens, 33, NULL, &hit)); /* not empty */
  OK(kvport_hybrid_block_table_append_tokens(b, tokens + 32, 1, stream));

  /* Full mode on a fresh table hits all 8 cached blocks of the 32-token prefix. */
  OK(kvport_hybrid_block_table_create(cache, 0, &t));
  OK(kvport_hybrid_block_table_set_prefix_hit_mode(t, KVPORT_PREFIX_HIT_FULL));
  OK(kvport_hybrid_block_table_prefix_hit_mode(t, &mode));
  CHECK(mode == KVPORT_PREFIX_HIT_FULL);
  EXPECT(KVPORT_ERR_INVALID_ARGUMENT, kvport_hybrid_block_table_set_prefix_hit_mode(t, 9));
  OK(kvport_hybrid_block_table_reuse_cached_prefix(t, tokens, 32, NULL, &hit));
  CHECK(hit == 32);
  OK(kvport_hybrid_block_table_destroy(t));
  /* Another extra key: no hit. */
  OK(kvport_hybrid_block_table_create(cache, 7, &t));
  OK(kvport_hybrid_block_table_reuse_cached_prefix(t, tokens, 33, NULL, &hit));
  CHECK(hit == 0);
  EXPECT(KVPORT_ERR_INVALID_ARGUMENT,
         kvport_hybrid_block_table_reuse_cached_prefix(t, NULL, 3, NULL, &hit));
  EXPECT(KVPORT_ERR_INVALID_ARGUMENT,
         kvport_hybrid_block_table_reuse_cached_prefix(t, tokens, 3, NULL, NULL));
  OK(kvport_hybrid_block_table_destroy(t));

  /* fork shares the blocks; appending to the child copies the shared, partly
   * filled last block (copy-on-write). */
  OK(kvport_hybrid_block_table_fork(b, stream, &child));
  OK(kvport_hybrid_block_table_append_tokens(child, tokens, 1, stream));
  OK(kvport_hybrid_block_table_copy_on_writes(child, &cows));
  CHECK(cows >= 1);
  OK(kvport_hybrid_block_table_copy_on_writes(b, &cows));
  CHECK(cows == 0);
  EXPECT(KVPORT_ERR_INVALID_ARGUMENT, kvport_hybrid_block_table_fork(b, stream, NULL));
  check_hybrid_ok(cache);

  /* Streams of another backend. */
  OK(kvport_backend_create("host", &other));
  OK(kvport_stream_create(other, &foreign));
  EXPECT(KVPORT_ERR_INVALID_ARGUMENT,
         kvport_hybrid_block_table_append_tokens(b, tokens, 1, foreign));
  EXPECT(KVPORT_ERR_INVALID_ARGUMENT, kvport_hybrid_block_table_fork(b, foreign, &t));
  OK(kvport_stream_destroy(foreign));
  OK(kvport_backend_destroy(other));

  /* All or nothing: a window group of 3 blocks. After 12 tokens it holds
   * them all; 9 more need 3 fresh blocks and the freeing rules give 1 back. */
  OK(kvport_hybrid_cache_create(backend, layers, 3, 4, 1, small_counts, 2, &small));
  OK(kvport_hybrid_block_table_create(small, 0, &t));
  OK(kvport_hybrid_block_table_append_tokens(t, tokens, 12, NULL));
  OK(kvport_hybrid_block_table_can_append(t, 9, &ok));
  CHECK(!ok);
  OK(kvport_hybrid_block_table_blocks_needed(t, 9, need, 2, &n));
  CHECK(n == 2 && need[0].fresh == 3 && need[0].released == 1);
  CHECK(need[1].fresh == 3 && need[1].released == 0);
  EXPECT(KVPORT_ERR_INVALID_ARGUMENT, kvport_hybrid_block_table_blocks_needed(t, 9, need, 1, &n));
  EXPECT(KVPORT_ERR_INVALID_ARGUMENT, kvport_hybrid_block_table_blocks_needed(t, 9, need, 2, NULL));
  EXPECT(KVPORT_ERR_INVALID_ARGUMENT, kvport_hybrid_block_table_can_append(t, 9, NULL));
  EXPECT(KVPORT_ERR_CACHE_EXHAUSTED, kvport_hybrid_block_table_append_tokens(t, tokens, 9, NULL));
  CHECK(contains(kvport_last_error(), "group 0"));
  OK(kvport_hybrid_block_table_num_tokens(t, &n));
  CHECK(n == 12); /* nothing changed */
  OK(kvport_hybrid_block_table_can_append(t, 1, &ok));
  CHECK(ok);
  OK(kvport_hybrid_block_table_append_tokens(t, tokens, 1, NULL));
  OK(kvport_hybrid_block_table_blocks(t, 0, ids, 16, &n));
  CHECK(n == 4 && ids[0] == KVPORT_NULL_BLOCK);
  check_hybrid_ok(small);
  EXPECT(KVPORT_ERR_INVALID_ARGUMENT, kvport_hybrid_block_table_append_tokens(t, NULL, 1, NULL));
  OK(kvport_hybrid_block_table_destroy(t));
  OK(kvport_hybrid_cache_destroy(small));

  OK(kvport_hybrid_block_table_destroy(child));
  OK(kvport_hybrid_block_table_destroy(b));
  check_hybrid_ok(cache);
  OK(kvport_hybrid_cache_destroy(cache));
  OK(kvport_stream_destroy(stream));
}

/* State checkpoints through the group pool: the engine writes a state, the
 * next block boundary caches it, a new request with the same prompt hits
 * and its slot holds the same bytes. */
static void test_hybrid_state_tables(kvport_backend* backend) {
  kvport_layer_spec layers[5];
  size_t counts[3] = {16, 8, 16};
  size_t one_slot[3] = {16, 1, 16};
  kvport_hybrid_cache *cache = NULL, *tight = NULL;
  kvport_hybrid_block_table *a = NULL, *b = NULL, *child = NULL, *t = NULL;
  kvport_hybrid_hit_counters hits;
  kvport_cache* pool = NULL;
  uint32_t tokens[9];
  unsigned char state[32], back[32];
  uint32_t slot = 0, child_slot = 0, ids[4];
  size_t n = 0, hit = 0, layer;
  bool has = false;

  mamba_layers(layers);
  fill_tokens(tokens, 9, 1);
  OK(kvport_hybrid_cache_create(backend, layers, 5, 4, 1, counts, 3, &cache));
  OK(kvport_hybrid_cache_group_cache(cache, 1, &pool));
  OK(kvport_hybrid_block_table_create(cache, 0, &a));
  OK(kvport_hybrid_block_table_state_slot(a, 1, &has, &slot));
  CHECK(!has); /* before the first append */
  OK(kvport_hybrid_block_table_num_blocks(a, 1, &n));
  CHECK(n == 0);

  /* A new sequence's slot is zeroed. */
  OK(kvport_hybrid_block_table_append_tokens(a, tokens, 4, NULL));
  OK(kvport_hybrid_block_table_state_slot(a, 1, &has, &slot));
  CHECK(has);
  OK(kvport_cache_read_block(pool, 0, slot, back, sizeof back, NULL, 0, NULL));
  CHECK(all_bytes(back, sizeof back, 0));
  memset(state, 0x11, sizeof state);
  for (layer = 0; layer < 2; ++layer)
    OK(kvport_cache_write_block(pool, layer, slot, state, sizeof state, NULL, 0, NULL));
  OK(kvport_hybrid_block_table_append_tokens(a, tokens + 4, 4, NULL)); /* checkpoint at 4 */
  memset(state, 0x22, sizeof state);
  for (layer = 0; layer < 2; ++layer)
    OK(kvport_cache_write_block(pool, layer, slot, state, sizeof state, NULL, 0, NULL));
  OK(kvport_hybrid_block_table_append_tokens(a, tokens + 8, 1, NULL)); /* checkpoint at 8 */
  OK(kvport_hybrid_block_table_destroy(a));
  OK(kvport_hybrid_cache_hit_counters(cache, &hits));
  CHECK(hits.state_checkpoints == 2);

  OK(kvport_hybrid_block_table_create(cache, 0, &b));
  OK(kvport_hybrid_block_table_reuse_cached_prefix(b, tokens, 9, NULL, &hit));
  CHECK(hit == 8);
  OK(kvport_hybrid_block_table_state_slot(b, 1, &has, &slot));
  CHECK(has);
  OK(kvport_hybrid_cache_synchronize(cache));
  for (layer = 0; layer < 2; ++layer) {
    OK(kvport_cache_read_block(pool, layer, slot, back, sizeof back, NULL, 0, NULL));
    CHECK(memcmp(back, state, sizeof state) == 0);
  }
  OK(kvport_hybrid_block_table_blocks(b, 2, ids, 4, &n)); /* MLA: the whole chain */
  CHECK(n == 2 && count_null(ids, n) == 0);

  /* fork copies the state into a new slot. */
  OK(kvport_hybrid_block_table_fork(b, NULL, &child));
  OK(kvport_hybrid_block_table_state_slot(child, 1, &has, &child_slot));
  CHECK(has && child_slot != slot);
  OK(kvport_cache_read_block(pool, 1, child_slot, back, sizeof back, NULL, 0, NULL));
  CHECK(memcmp(back, state, sizeof state) == 0);
  check_hybrid_ok(cache);
  OK(kvport_hybrid_block_table_destroy(child));
  OK(kvport_hybrid_block_table_destroy(b));
  OK(kvport_hybrid_cache_destroy(cache));

  /* One state slot: fork has no slot for the copy (nothing changes), and a
   * second sequence cannot start. */
  OK(kvport_hybrid_cache_create(backend, layers, 5, 4, 0, one_slot, 3, &tight));
  OK(kvport_hybrid_block_table_create(tight, 0, &a));
  OK(kvport_hybrid_block_table_append_tokens(a, tokens, 6, NULL));
  EXPECT(KVPORT_ERR_CACHE_EXHAUSTED, kvport_hybrid_block_table_fork(a, NULL, &child));
  OK(kvport_hybrid_block_table_create(tight, 0, &t));
  EXPECT(KVPORT_ERR_CACHE_EXHAUSTED, kvport_hybrid_block_table_append_tokens(t, tokens, 1, NULL));
  check_hybrid_ok(tight);
  OK(kvport_hybrid_block_table_destroy(t));
  OK(kvport_hybrid_block_table_destroy(a));
  OK(kvport_hybrid_cache_destroy(tight));
}

/* Calls that reject null and destroyed handles, one per remaining function. */
/* ---- KV cache events ---------------------------------------------------------------------- */

/* A SUB socket on `endpoint` that receives everything, each receive bounded
 * by `timeout_ms`. */
static void* events_subscriber(void* zmq_context, const char* endpoint, int timeout_ms) {
  void* sub = zmq_socket(zmq_context, ZMQ_SUB);
  int linger = 0;
  CHECK(sub != NULL);
  CHECK(zmq_setsockopt(sub, ZMQ_SUBSCRIBE, "", 0) == 0);
  CHECK(zmq_setsockopt(sub, ZMQ_RCVTIMEO, &timeout_ms, sizeof timeout_ms) == 0);
  CHECK(zmq_setsockopt(sub, ZMQ_LINGER, &linger, sizeof linger) == 0);
  CHECK(zmq_connect(sub, endpoint) == 0);
  return sub;
}

/* One published message: topic, 8-byte big-endian sequence, msgpack payload. */
typedef struct events_message {
  char topic[64];
  size_t topic_size;
  uint64_t seq;
  unsigned char payload[4096];
  size_t payload_size;
} events_message;

/* Receives one 3-frame message; 0 on a timeout (nothing received). */
static int events_receive(void* sub, events_message* m) {
  unsigned char seq[16];
  int more = 0, n, i;
  size_t more_size = sizeof more;
  n = zmq_recv(sub, m->topic, sizeof m->topic, 0);
  if (n < 0) return 0;
  m->topic_size = (size_t)n;
  CHECK(zmq_getsockopt(sub, ZMQ_RCVMORE, &more, &more_size) == 0 && more == 1);
  n = zmq_recv(sub, seq, sizeof seq, 0);
  CHECK(n == 8);
  CHECK(zmq_getsockopt(sub, ZMQ_RCVMORE, &more, &more_size) == 0 && more == 1);
  m->seq = 0;
  for (i = 0; i < 8 && i < n; ++i)
    m->seq = (m->seq << 8) | seq[i];
  n = zmq_recv(sub, m->payload, sizeof m->payload, 0);
  CHECK(n > 0 && (size_t)n <= sizeof m->payload);
  m->payload_size = n > 0 ? (size_t)n : 0;
  CHECK(zmq_getsockopt(sub, ZMQ_RCVMORE, &more, &more_size) == 0 && more == 0);
  return 1;
}

/* Whether `part` (`size` bytes, NULs allowed) occurs in the payload. */
static int payload_has(const events_message* m, const char* part, size_t size) {
  size_t i;
  for (i = 0; i + size <= m->payload_size; ++i)
    if (memcmp(m->payload + i, part, size) == 0) return 1;
  return 0;
}
#define PAYLOAD_HAS(m, literal) payload_has((m), (literal), sizeof(literal) - 1)

/* events_receive, retried `tries` times (each bounded by the socket's
 * timeout). */
static int events_receive_within(void* sub, events_message* m, int tries) {
  int i;
  for (i = 0; i < tries; ++i)
    if (events_receive(sub, m)) return 1;
  return 0;
}

/* After joining: each receive may wait `timeout_ms` (a message flushed is on
 * its way, but ZeroMQ's I/O threads may take their time on a loaded machine
 * or under a sanitizer). */
static void events_set_timeout(void* sub, int timeout_ms) {
  CHECK(zmq_setsockopt(sub, ZMQ_RCVTIMEO, &timeout_ms, sizeof timeout_ms) == 0);
}

/* A PUB socket drops what it sends before a subscription arrives (ZeroMQ's
 * slow joiner): stores one new block per round (a one-block table over
 * `prefix`, tokens from `first`), flushes, and waits briefly for a message,
 * until one arrives (at most 100 rounds). The rounds it took (blocks
 * stored), 0 when no message came. */
static int events_join(kvport_prefix_cache* prefix, void* sub, uint32_t first, events_message* m) {
  kvport_block_table* table = NULL;
  uint32_t tokens[4];
  bool flushed = false;
  int round;
  for (round = 0; round < 100; ++round) {
    fill_tokens(tokens, 4, first + 4u * (uint32_t)round);
    OK(kvport_block_table_create_prefixed(prefix, 0, &table));
    OK(kvport_block_table_append_tokens(table, tokens, 4, NULL));
    OK(kvport_block_table_destroy(table));
    OK(kvport_prefix_cache_flush_events(prefix, 2000, &flushed));
    CHECK(flushed);
    if (events_receive(sub, m)) return round + 1;
  }
  return 0;
}

static void test_events(kvport_backend* backend) {
  kvport_config config = small_config(); /* block_size 4 */
  kvport_cache *cache = NULL, *other_cache = NULL;
  kvport_prefix_cache *prefix = NULL, *other = NULL;
  kvport_block_table* table = NULL;
  kvport_events_options options;
  kvport_events_stats stats;
  events_message m;
  char endpoint[256], text[256];
  size_t needed = 0, cached = 0;
  uint32_t tokens[8];
  uint64_t joined_seq;
  int rounds;
  bool flushed = false;
  void* zmq_context = zmq_ctx_new();
  void* sub;
  /* The BlockStored of tokens 100..107, block size 4, in map form. */
  static const char k_tokens[] = "\xa9token_ids\x98\x64\x65\x66\x67\x68\x69\x6a\x6b";

  CHECK(zmq_context != NULL);
  OK(kvport_cache_create(&config, 128, backend, &cache));
  OK(kvport_prefix_cache_create(cache, &prefix));

  /* Options. */
  EXPECT(KVPORT_ERR_INVALID_ARGUMENT, kvport_events_options_init(NULL));
  OK(kvport_events_options_init(&options));
  CHECK(strcmp(options.endpoint, "tcp://127.0.0.1:5557") == 0);
  CHECK(options.topic == NULL && options.replay_endpoint == NULL);
  CHECK(!options.has_data_parallel_rank && options.form == KVPORT_EVENT_FORM_MAP);
  CHECK(options.max_batch_events == 0 && options.buffer_bytes == 0 && options.linger_ms == 0);

  /* Not enabled yet. */
  EXPECT(KVPORT_ERR_INVALID_ARGUMENT, kvport_prefix_cache_events_stats(prefix, &stats));
  CHECK(contains(kvport_last_error(), "not enabled"));
  EXPECT(KVPORT_ERR_INVALID_ARGUMENT,
         kvport_prefix_cache_events_endpoint(prefix, KVPORT_EVENTS_SOCKET_PUB, text, sizeof text,
                                             NULL));
  EXPECT(KVPORT_ERR_INVALID_ARGUMENT, kvport_prefix_cache_flush_events(prefix, 10, &flushed));
  OK(kvport_prefix_cache_disable_events(prefix)); /* nothing to disable */

  /* Bad options change nothing. */
  EXPECT(KVPORT_ERR_INVALID_ARGUMENT, kvport_prefix_cache_enable_events(prefix, NULL));
  options.endpoint = NULL;
  EXPECT(KVPORT_ERR_INVALID_ARGUMENT, kvport_prefix_cache_enable_events(prefix, &options));
  CHECK(contains(kvport_last_error(), "options.endpoint"));
  options.endpoint = "";
  EXPECT(KVPORT_ERR_INVALID_ARGUMENT, kvport_prefix_cache_enable_events(prefix, &options));
  options.endpoint = "not-an-endpoint";
  EXPECT(KVPORT_ERR_INVALID_ARGUMENT, kvport_prefix_cache_enable_events(prefix, &options));
  CHECK(contains(kvport_last_error(), "not-an-endpoint"));
  options.endpoint = "tcp://127.0.0.1:0";
  options.form = 7;
  EXPECT(KVPORT_ERR_INVALID_ARGUMENT, kvport_prefix_cache_enable_events(prefix, &options));
  CHECK(contains(kvport_last_error(), "kvport_event_form"));
  options.form = KVPORT_EVENT_FORM_MAP;
  options.send_high_water_mark = -1;
  EXPECT(KVPORT_ERR_INVALID_ARGUMENT, kvport_prefix_cache_enable_events(prefix, &options));
  options.send_high_water_mark = 0;
  options.replay_endpoint = "tcp://nowhere:";
  EXPECT(KVPORT_ERR_INVALID_ARGUMENT, kvport_prefix_cache_enable_events(prefix, &options));
  options.replay_endpoint = "";
  EXPECT(KVPORT_ERR_INVALID_HANDLE, kvport_prefix_cache_enable_events(NULL, &options));
  EXPECT(KVPORT_ERR_INVALID_HANDLE,
         kvport_prefix_cache_enable_events((kvport_prefix_cache*)cache, &options));
  EXPECT(KVPORT_ERR_INVALID_ARGUMENT, kvport_prefix_cache_events_stats(prefix, &stats));

  /* A block cached before events are enabled is announced when they are. */
  fill_tokens(tokens, 4, 9000);
  OK(kvport_block_table_create_prefixed(prefix, 0, &table));
  OK(kvport_block_table_append_tokens(table, tokens, 4, NULL));
  OK(kvport_block_table_destroy(table));

  options.topic = "kv@pod-0@model";
  options.has_data_parallel_rank = true;
  options.data_parallel_rank = 3;
  options.batch_interval_us = 1000;
  OK(kvport_prefix_cache_enable_events(prefix, &options));
  EXPECT(KVPORT_ERR_INVALID_ARGUMENT, kvport_prefix_cache_enable_events(prefix, &options));
  CHECK(contains(kvport_last_error(), "enabled already"));
  OK(kvport_prefix_cache_events_stats(prefix, &stats));
  CHECK(stats.events_accepted == 1); /* the block cached before */

  /* The bound endpoint: the real port, not 0. */
  OK(kvport_prefix_cache_events_endpoint(prefix, KVPORT_EVENTS_SOCKET_PUB, endpoint,
                                         sizeof endpoint, &needed));
  CHECK(strncmp(endpoint, "tcp://127.0.0.1:", 16) == 0 && strlen(endpoint) > 16);
  CHECK(strcmp(endpoint, "tcp://127.0.0.1:0") != 0 && needed == strlen(endpoint) + 1);
  OK(kvport_prefix_cache_events_endpoint(prefix, KVPORT_EVENTS_SOCKET_PUB, NULL, 0, &needed));
  CHECK(needed == strlen(endpoint) + 1);
  OK(kvport_prefix_cache_events_endpoint(prefix, KVPORT_EVENTS_SOCKET_PUB, text, 8, NULL));
  CHECK(strcmp(text, "tcp://1") == 0);
  OK(kvport_prefix_cache_events_endpoint(prefix, KVPORT_EVENTS_SOCKET_REPLAY, text, sizeof text,
                                         &needed));
  CHECK(text[0] == '\0' && needed == 1);
  EXPECT(KVPORT_ERR_INVALID_ARGUMENT,
         kvport_prefix_cache_events_endpoint(prefix, 2, text, sizeof text, NULL));
  EXPECT(KVPORT_ERR_INVALID_ARGUMENT,
         kvport_prefix_cache_events_endpoint(prefix, KVPORT_EVENTS_SOCKET_PUB, NULL, 4, NULL));
  EXPECT(KVPORT_ERR_INVALID_ARGUMENT, kvport_prefix_cache_events_stats(prefix, NULL));

  /* Another publisher on the same port: the bind fails, naming it. */
  OK(kvport_cache_create(&config, 8, backend, &other_cache));
  OK(kvport_prefix_cache_create(other_cache, &other));
  options.endpoint = endpoint;
  EXPECT(KVPORT_ERR_INVALID_ARGUMENT, kvport_prefix_cache_enable_events(other, &options));
  CHECK(contains(kvport_last_error(), endpoint));
  EXPECT(KVPORT_ERR_INVALID_ARGUMENT, kvport_prefix_cache_events_stats(other, &stats));
  options.endpoint = "tcp://127.0.0.1:0";

  /* Subscribe, join, then one table of two blocks: one BlockStored. */
  sub = events_subscriber(zmq_context, endpoint, 100);
  rounds = events_join(prefix, sub, 1000, &m);
  CHECK(rounds > 0);
  events_set_timeout(sub, 5000);
  joined_seq = m.seq;
  CHECK(m.topic_size == 14 && memcmp(m.topic, "kv@pod-0@model", 14) == 0);
  fill_tokens(tokens, 8, 100);
  OK(kvport_block_table_create_prefixed(prefix, 0, &table));
  OK(kvport_block_table_append_tokens(table, tokens, 8, NULL));
  OK(kvport_prefix_cache_flush_events(prefix, 2000, &flushed));
  CHECK(flushed);
  CHECK(events_receive(sub, &m));
  CHECK(m.seq == joined_seq + 1);
  CHECK(m.topic_size == 14 && memcmp(m.topic, "kv@pod-0@model", 14) == 0);
  /* [ts (float64), [event], 3] with the event a map tagged "BlockStored". */
  CHECK(m.payload_size > 10 && m.payload[0] == 0x93 && m.payload[1] == 0xcb);
  CHECK(m.payload[10] == 0x91 && (m.payload[11] & 0xf0) == 0x80);
  CHECK(m.payload[m.payload_size - 1] == 0x03);
  CHECK(PAYLOAD_HAS(&m,
                    "\xa4type\xab"
                    "BlockStored"));
  CHECK(PAYLOAD_HAS(&m,
                    "\xac"
                    "block_hashes\x92"));
  CHECK(payload_has(&m, k_tokens, sizeof k_tokens - 1));
  CHECK(PAYLOAD_HAS(&m,
                    "\xaa"
                    "block_size\x04"));
  CHECK(PAYLOAD_HAS(&m, "\xa6medium\xa3GPU"));
  CHECK(PAYLOAD_HAS(&m, "\xb1parent_block_hash\xc0"));
  OK(kvport_prefix_cache_events_stats(prefix, &stats));
  CHECK(stats.events_dropped == 0 && stats.send_failures == 0);
  CHECK(stats.next_seq == m.seq + 1 && stats.batches_sent == stats.next_seq);
  /* The block cached before, one a round, the table's two in one event. */
  CHECK(stats.events_accepted == 1 + (uint64_t)rounds + 1);
  CHECK(stats.replay_requests == 0 && stats.snapshots == 0 && stats.bad_requests == 0);
  OK(kvport_prefix_cache_flush_events(prefix, 0, NULL));

  /* Disable: a clear goes out, then the publisher is gone. */
  OK(kvport_block_table_destroy(table));
  OK(kvport_prefix_cache_disable_events(prefix));
  CHECK(events_receive_within(sub, &m, 20));
  CHECK(PAYLOAD_HAS(&m,
                    "\xa4type\xb0"
                    "AllBlocksCleared"));
  CHECK(PAYLOAD_HAS(&m, "\xa6medium\xa3GPU"));
  EXPECT(KVPORT_ERR_INVALID_ARGUMENT, kvport_prefix_cache_events_stats(prefix, &stats));
  OK(kvport_prefix_cache_disable_events(prefix));
  CHECK(zmq_close(sub) == 0);

  /* Enabled again (positional form, a replay socket): the cached blocks are
   * announced; destroying the prefix cache with events on is safe. */
  OK(kvport_prefix_cache_num_cached_blocks(prefix, &cached));
  options.form = KVPORT_EVENT_FORM_POSITIONAL;
  options.replay_endpoint = "tcp://127.0.0.1:0";
  options.has_data_parallel_rank = false;
  OK(kvport_prefix_cache_enable_events(prefix, &options));
  OK(kvport_prefix_cache_events_endpoint(prefix, KVPORT_EVENTS_SOCKET_REPLAY, text, sizeof text,
                                         NULL));
  CHECK(strncmp(text, "tcp://127.0.0.1:", 16) == 0 && strcmp(text, "tcp://127.0.0.1:0") != 0);
  OK(kvport_prefix_cache_events_endpoint(prefix, KVPORT_EVENTS_SOCKET_PUB, endpoint,
                                         sizeof endpoint, NULL));
  OK(kvport_prefix_cache_events_stats(prefix, &stats));
  CHECK(cached > 2 && stats.events_accepted == cached);
  sub = events_subscriber(zmq_context, endpoint, 100);
  CHECK(events_join(prefix, sub, 5000, &m));
  /* [ts, [["BlockStored", hashes, parent, tokens, 4, nil, "GPU", ...]], nil] */
  CHECK(m.payload[0] == 0x93 && m.payload[m.payload_size - 1] == 0xc0);
  CHECK(PAYLOAD_HAS(&m,
                    "\x9c\xab"
                    "BlockStored\x91"));
  CHECK(PAYLOAD_HAS(&m, "\x04\xc0\xa3GPU"));
  CHECK(!PAYLOAD_HAS(&m, "block_hashes"));
  CHECK(zmq_close(sub) == 0);
  OK(kvport_prefix_cache_destroy(prefix));
  EXPECT(KVPORT_ERR_INVALID_HANDLE, kvport_prefix_cache_events_stats(prefix, &stats));
  EXPECT(KVPORT_ERR_INVALID_HANDLE, kvport_prefix_cache_disable_events(prefix));
  EXPECT(KVPORT_ERR_INVALID_HANDLE, kvport_prefix_cache_events_endpoint(
                                        prefix, KVPORT_EVENTS_SOCKET_PUB, text, sizeof text, NULL));
  EXPECT(KVPORT_ERR_INVALID_HANDLE, kvport_prefix_cache_flush_events(prefix, 10, NULL));
  OK(kvport_prefix_cache_destroy(other));
  OK(kvport_cache_destroy(other_cache));
  OK(kvport_cache_destroy(cache));
  CHECK(zmq_ctx_term(zmq_context) == 0);
}

/* One pool over gpt-oss-like groups (window 8 and full attention,
 * alternating, 4-token blocks): the plan with shared_pool, the cache made
 * from it, memory moving to the group that needs it, kept windows. */
static void test_hybrid_shared_pool(kvport_backend* backend) {
  kvport_layer_spec layers[4], fulls[2];
  kvport_plan_request request;
  kvport_plan plan;
  kvport_group_plan groups[4];
  size_t ignored[2] = {0, 0};
  size_t one[1] = {12};
  kvport_hybrid_cache *cache = NULL, *bad = NULL;
  kvport_hybrid_block_table* t = NULL;
  uint32_t tokens[32];
  size_t n = 0, i;
  int32_t flag = -1;

  for (i = 0; i < 4; ++i)
    layers[i] =
        attention_spec(i % 2 == 0 ? KVPORT_LAYER_SLIDING_WINDOW : KVPORT_LAYER_FULL_ATTENTION, 8);
  fill_tokens(tokens, 32, 7);

  OK(kvport_plan_request_init(&request));
  CHECK(request.shared_pool == 0);
  request.budget_bytes = (size_t)1 << 20;
  request.max_context_tokens = 4096;
  request.shared_pool = 1;
  OK(kvport_plan_kv_cache(layers, 4, 4, &request, &plan, groups, 4));
  CHECK(plan.num_groups == 2 && groups[0].shared == 1 && groups[1].shared == 1);
  CHECK(plan.shared_blocks > 0 && groups[0].num_blocks == plan.shared_blocks);
  CHECK(plan.shared_bytes > 0 && plan.shared_bytes <= request.budget_bytes);
  CHECK(plan.max_context_tokens == 4096 && plan.max_group_layers == 2);
  request.shared_pool = 0; /* a pool per group: nothing shared */
  OK(kvport_plan_kv_cache(layers, 4, 4, &request, &plan, groups, 4));
  CHECK(plan.shared_blocks == 0 && plan.shared_bytes == 0 && plan.max_group_layers == 0);
  CHECK(groups[0].shared == 0 && groups[1].shared == 0);

  /* 12 blocks for both groups: 32 tokens decoded one at a time hold 8 full
   * blocks and at most 3 window blocks; pools of 6 each could not. */
  OK(kvport_hybrid_cache_create_shared(backend, layers, 4, 4, 1, 2, 12, ignored, 2, &cache));
  OK(kvport_hybrid_cache_shared_pool_blocks(cache, &n));
  CHECK(n == 12);
  OK(kvport_hybrid_cache_group_in_shared_pool(cache, 0, &flag));
  CHECK(flag == 1);
  OK(kvport_hybrid_cache_group_in_shared_pool(cache, 1, &flag));
  CHECK(flag == 1);
  EXPECT(KVPORT_ERR_OUT_OF_RANGE, kvport_hybrid_cache_group_in_shared_pool(cache, 2, &flag));
  EXPECT(KVPORT_ERR_INVALID_ARGUMENT, kvport_hybrid_cache_group_in_shared_pool(cache, 0, NULL));
  EXPECT(KVPORT_ERR_INVALID_ARGUMENT, kvport_hybrid_cache_shared_pool_blocks(cache, NULL));
  OK(kvport_hybrid_block_table_create(cache, 0, &t));
  OK(kvport_hybrid_block_table_keeps_shared_windows(t, &flag));
  CHECK(flag == 0);
  OK(kvport_hybrid_block_table_set_keep_shared_windows(t, 1));
  OK(kvport_hybrid_block_table_keeps_shared_windows(t, &flag));
  CHECK(flag == 1);
  EXPECT(KVPORT_ERR_INVALID_ARGUMENT, kvport_hybrid_block_table_keeps_shared_windows(t, NULL));
  for (i = 0; i < 32; ++i)
    OK(kvport_hybrid_block_table_append_tokens(t, tokens + i, 1, NULL));
  OK(kvport_hybrid_cache_group_blocks_in_use(cache, 1, &n));
  CHECK(n == 8);
  OK(kvport_hybrid_block_table_num_kept_blocks(t, 0, &n));
  CHECK(n == 0);
  OK(kvport_hybrid_block_table_keep_hit_point(t));
  OK(kvport_hybrid_block_table_num_kept_blocks(t, 0, &n));
  CHECK(n >= 1 && n <= 3); /* at most a window's blocks */
  OK(kvport_hybrid_block_table_num_kept_blocks(t, 1, &n));
  CHECK(n == 0); /* full attention holds its blocks anyway */
  EXPECT(KVPORT_ERR_OUT_OF_RANGE, kvport_hybrid_block_table_num_kept_blocks(t, 2, &n));
  EXPECT(KVPORT_ERR_INVALID_ARGUMENT, kvport_hybrid_block_table_num_kept_blocks(t, 0, NULL));
  check_hybrid_ok(cache);
  OK(kvport_hybrid_block_table_destroy(t));
  OK(kvport_hybrid_cache_group_blocks_in_use(cache, 0, &n));
  CHECK(n == 0);
  /* The copy-last-block rule: the 32 cached tokens hit 31, not 28. */
  OK(kvport_hybrid_block_table_create(cache, 0, &t));
  OK(kvport_hybrid_block_table_copies_last_block(t, &flag));
  CHECK(flag == 0);
  OK(kvport_hybrid_block_table_set_copy_last_block(t, 1));
  OK(kvport_hybrid_block_table_copies_last_block(t, &flag));
  CHECK(flag == 1);
  EXPECT(KVPORT_ERR_INVALID_ARGUMENT, kvport_hybrid_block_table_copies_last_block(t, NULL));
  OK(kvport_hybrid_block_table_reuse_cached_prefix(t, tokens, 32, NULL, &n));
  CHECK(n == 31);
  OK(kvport_hybrid_block_table_destroy(t));
  check_hybrid_ok(cache);
  OK(kvport_hybrid_cache_destroy(cache));

  /* shared_blocks 0 is a pool per group; one group cannot share; bad args. */
  EXPECT(KVPORT_ERR_INVALID_ARGUMENT, /* two groups, one count */
         kvport_hybrid_cache_create_shared(backend, layers, 4, 4, 1, 0, 0, one, 1, &bad));
  fulls[0] = fulls[1] = attention_spec(KVPORT_LAYER_FULL_ATTENTION, 0);
  EXPECT(KVPORT_ERR_INVALID_ARGUMENT,
         kvport_hybrid_cache_create_shared(backend, fulls, 2, 4, 1, 0, 12, one, 1, &bad));
  CHECK(bad == NULL);
  EXPECT(KVPORT_ERR_INVALID_ARGUMENT,
         kvport_hybrid_cache_create_shared(backend, layers, 4, 4, 1, 2, 12, ignored, 2, NULL));
  EXPECT(KVPORT_ERR_INVALID_HANDLE,
         kvport_hybrid_cache_create_shared(NULL, layers, 4, 4, 1, 2, 12, ignored, 2, &bad));
  OK(kvport_hybrid_cache_create_shared(backend, fulls, 2, 4, 1, 0, 0, one, 1, &bad));
  OK(kvport_hybrid_cache_shared_pool_blocks(bad, &n));
  CHECK(n == 0);
  OK(kvport_hybrid_cache_group_in_shared_pool(bad, 0, &flag));
  CHECK(flag == 0);
  OK(kvport_hybrid_cache_destroy(bad));
}

static void test_hybrid_events(kvport_backend* backend) {
  kvport_layer_spec layers[5];
  size_t counts[3] = {16, 8, 16};
  kvport_hybrid_cache* cache = NULL;
  kvport_hybrid_block_table* table = NULL;
  kvport_events_options options;
  kvport_events_stats stats;
  events_message m;
  char endpoint[256];
  uint32_t tokens[4];
  size_t needed = 0;
  bool flushed = false;
  int round, received = 0;
  void* zmq_context = zmq_ctx_new();
  void* sub;

  mamba_layers(layers); /* groups: full attention, state (mamba), MLA */
  OK(kvport_hybrid_cache_create(backend, layers, 5, 4, 1, counts, 3, &cache));
  EXPECT(KVPORT_ERR_INVALID_ARGUMENT, kvport_hybrid_cache_events_stats(cache, &stats));
  EXPECT(KVPORT_ERR_INVALID_ARGUMENT,
         kvport_hybrid_cache_events_endpoint(cache, KVPORT_EVENTS_SOCKET_PUB, endpoint,
                                             sizeof endpoint, NULL));
  EXPECT(KVPORT_ERR_INVALID_ARGUMENT, kvport_hybrid_cache_flush_events(cache, 10, NULL));
  OK(kvport_hybrid_cache_disable_events(cache));
  OK(kvport_events_options_init(&options));
  EXPECT(KVPORT_ERR_INVALID_ARGUMENT, kvport_hybrid_cache_enable_events(cache, NULL));
  options.endpoint = "tcp://127.0.0.1:notaport";
  EXPECT(KVPORT_ERR_INVALID_ARGUMENT, kvport_hybrid_cache_enable_events(cache, &options));
  EXPECT(KVPORT_ERR_INVALID_HANDLE, kvport_hybrid_cache_enable_events(NULL, &options));
  options.endpoint = "tcp://127.0.0.1:0";
  options.batch_interval_us = 1000;
  OK(kvport_hybrid_cache_enable_events(cache, &options));
  EXPECT(KVPORT_ERR_INVALID_ARGUMENT, kvport_hybrid_cache_enable_events(cache, &options));
  OK(kvport_hybrid_cache_events_endpoint(cache, KVPORT_EVENTS_SOCKET_PUB, endpoint, sizeof endpoint,
                                         &needed));
  CHECK(strncmp(endpoint, "tcp://127.0.0.1:", 16) == 0 && needed == strlen(endpoint) + 1);
  EXPECT(KVPORT_ERR_INVALID_ARGUMENT,
         kvport_hybrid_cache_events_endpoint(cache, -1, endpoint, sizeof endpoint, NULL));

  /* Each round stores one block in every group; wait for group 0's. */
  sub = events_subscriber(zmq_context, endpoint, 100);
  for (round = 0; round < 100 && !received; ++round) {
    fill_tokens(tokens, 4, 4u * (uint32_t)round);
    OK(kvport_hybrid_block_table_create(cache, 0, &table));
    OK(kvport_hybrid_block_table_append_tokens(table, tokens, 4, NULL));
    OK(kvport_hybrid_block_table_destroy(table));
    OK(kvport_hybrid_cache_flush_events(cache, 2000, &flushed));
    CHECK(flushed);
    while (events_receive(sub, &m)) {
      if (PAYLOAD_HAS(&m,
                      "\xa9group_idx\x00\xb2kv_cache_spec_kind\xae"
                      "full_attention")) {
        received = 1;
        break;
      }
    }
  }
  CHECK(received);
  CHECK(PAYLOAD_HAS(&m,
                    "\xa4type\xab"
                    "BlockStored"));
  OK(kvport_hybrid_cache_events_stats(cache, &stats));
  CHECK(stats.events_accepted >= (uint64_t)round && stats.events_dropped == 0);
  EXPECT(KVPORT_ERR_INVALID_ARGUMENT, kvport_hybrid_cache_events_stats(cache, NULL));

  /* Disable: every group's clear goes out. */
  OK(kvport_hybrid_cache_disable_events(cache));
  received = 0;
  while (events_receive_within(sub, &m, 20)) {
    if (PAYLOAD_HAS(&m,
                    "\xb0"
                    "AllBlocksCleared")) {
      received = 1;
      break;
    }
  }
  CHECK(received);
  CHECK(PAYLOAD_HAS(&m, "\xa9group_idx\x02"));
  EXPECT(KVPORT_ERR_INVALID_ARGUMENT, kvport_hybrid_cache_events_stats(cache, &stats));
  CHECK(zmq_close(sub) == 0);

  /* Destroyed with events on. */
  OK(kvport_hybrid_cache_enable_events(cache, &options));
  OK(kvport_hybrid_cache_destroy(cache));
  EXPECT(KVPORT_ERR_INVALID_HANDLE, kvport_hybrid_cache_events_stats(cache, &stats));
  EXPECT(KVPORT_ERR_INVALID_HANDLE, kvport_hybrid_cache_disable_events(cache));
  EXPECT(KVPORT_ERR_INVALID_HANDLE, kvport_hybrid_cache_flush_events(cache, 10, NULL));
  EXPECT(KVPORT_ERR_INVALID_HANDLE,
         kvport_hybrid_cache_events_endpoint(cache, KVPORT_EVENTS_SOCKET_PUB, endpoint,
                                             sizeof endpoint, NULL));
  CHECK(zmq_ctx_term(zmq_context) == 0);
}

static void test_invalid_handles(void) {
  size_t n = 0;
  uint32_t b = 0;
  bool flag = false;
  void* p = NULL;
  int32_t i32 = 0;
  uint64_t u64 = 0;
  const uint32_t* ids = NULL;
  kvport_cache_counters cc;
  kvport_prefix_cache_counters pc;
  kvport_invariant_report r;
  kvport_block_table* t = NULL;
  kvport_block_copy copy = {0, 1};
  kvport_region_layout region;
  unsigned char buf[4];
  kvport_layer_spec spec;
  kvport_cache* cache = NULL;
  kvport_hybrid_hit_counters hc;
  kvport_hybrid_block_table* ht = NULL;
  kvport_group_need need;

  EXPECT(KVPORT_ERR_INVALID_HANDLE, kvport_cache_num_blocks(NULL, &n));
  EXPECT(KVPORT_ERR_INVALID_HANDLE, kvport_cache_num_blocks_in_use(NULL, &n));
  EXPECT(KVPORT_ERR_INVALID_HANDLE, kvport_cache_num_layers(NULL, &n));
  EXPECT(KVPORT_ERR_INVALID_HANDLE, kvport_cache_total_bytes(NULL, &n));
  EXPECT(KVPORT_ERR_INVALID_HANDLE, kvport_cache_try_alloc(NULL, &b, &flag));
  EXPECT(KVPORT_ERR_INVALID_HANDLE, kvport_cache_inc_ref(NULL, 0));
  EXPECT(KVPORT_ERR_INVALID_HANDLE, kvport_cache_dec_ref(NULL, 0, NULL));
  EXPECT(KVPORT_ERR_INVALID_HANDLE, kvport_cache_free(NULL, 0, NULL));
  EXPECT(KVPORT_ERR_INVALID_HANDLE, kvport_cache_free_blocks(NULL, &b, 1));
  EXPECT(KVPORT_ERR_INVALID_HANDLE, kvport_cache_return_evicted_block(NULL, 0));
  EXPECT(KVPORT_ERR_INVALID_HANDLE, kvport_cache_ref_count(NULL, 0, &b));
  EXPECT(KVPORT_ERR_INVALID_HANDLE, kvport_cache_k_ptr(NULL, 0, 0, &p));
  EXPECT(KVPORT_ERR_INVALID_HANDLE, kvport_cache_v_ptr(NULL, 0, 0, &p));
  EXPECT(KVPORT_ERR_INVALID_HANDLE, kvport_cache_k_pool_ptr(NULL, 0, &p));
  EXPECT(KVPORT_ERR_INVALID_HANDLE, kvport_cache_v_pool_ptr(NULL, 0, &p));
  EXPECT(KVPORT_ERR_INVALID_HANDLE, kvport_cache_k_block_stride(NULL, 0, &n));
  EXPECT(KVPORT_ERR_INVALID_HANDLE, kvport_cache_v_block_stride(NULL, 0, &n));
  EXPECT(KVPORT_ERR_INVALID_HANDLE, kvport_cache_k_block_bytes(NULL, 0, &n));
  EXPECT(KVPORT_ERR_INVALID_HANDLE, kvport_cache_v_block_bytes(NULL, 0, &n));
  EXPECT(KVPORT_ERR_INVALID_HANDLE, kvport_cache_layer_dtype(NULL, 0, &i32));
  EXPECT(KVPORT_ERR_INVALID_HANDLE, kvport_cache_k_region_layout(NULL, 0, &region));
  EXPECT(KVPORT_ERR_INVALID_HANDLE, kvport_cache_v_region_layout(NULL, 0, &region));
  EXPECT(KVPORT_ERR_INVALID_HANDLE, kvport_cache_zero_blocks(NULL, &b, 1, NULL));
  EXPECT(KVPORT_ERR_INVALID_HANDLE, kvport_cache_poison_blocks(NULL, &b, 1, NULL));
  EXPECT(KVPORT_ERR_INVALID_HANDLE, kvport_cache_poison_block(NULL, 0, NULL));
  EXPECT(KVPORT_ERR_INVALID_HANDLE, kvport_cache_copy_blocks(NULL, &copy, 1, NULL));
  EXPECT(KVPORT_ERR_INVALID_HANDLE, kvport_cache_read_block(NULL, 0, 0, buf, 4, buf, 4, NULL));
  EXPECT(KVPORT_ERR_INVALID_HANDLE, kvport_cache_write_block(NULL, 0, 0, buf, 4, buf, 4, NULL));
  EXPECT(KVPORT_ERR_INVALID_HANDLE, kvport_cache_counters_get(NULL, &cc));
  EXPECT(KVPORT_ERR_INVALID_HANDLE, kvport_cache_check_invariants(NULL, &r, NULL, 0, NULL));
  EXPECT(KVPORT_ERR_INVALID_HANDLE, kvport_prefix_cache_lookup(NULL, &b, 1, 0, &b, 1, &n, NULL));
  EXPECT(KVPORT_ERR_INVALID_HANDLE, kvport_prefix_cache_alloc(NULL, &b));
  EXPECT(KVPORT_ERR_INVALID_HANDLE, kvport_prefix_cache_try_alloc(NULL, &b, &flag));
  EXPECT(KVPORT_ERR_INVALID_HANDLE, kvport_prefix_cache_release(NULL, 0));
  EXPECT(KVPORT_ERR_INVALID_HANDLE, kvport_prefix_cache_release_blocks(NULL, &b, 1));
  EXPECT(KVPORT_ERR_INVALID_HANDLE, kvport_prefix_cache_evict(NULL, 1, NULL));
  EXPECT(KVPORT_ERR_INVALID_HANDLE, kvport_prefix_cache_num_evictable_blocks(NULL, &n));
  EXPECT(KVPORT_ERR_INVALID_HANDLE, kvport_prefix_cache_num_available_blocks(NULL, &n));
  EXPECT(KVPORT_ERR_INVALID_HANDLE, kvport_prefix_cache_counters_get(NULL, &pc));
  EXPECT(KVPORT_ERR_INVALID_HANDLE, kvport_prefix_cache_check_invariants(NULL, &r, NULL, 0, NULL));
  EXPECT(KVPORT_ERR_INVALID_HANDLE, kvport_block_table_create(NULL, &t));
  EXPECT(KVPORT_ERR_INVALID_HANDLE, kvport_block_table_reuse_cached_prefix(NULL, &b, 1, NULL, &n));
  EXPECT(KVPORT_ERR_INVALID_HANDLE, kvport_block_table_set_prefix_hit_mode(NULL, 0));
  EXPECT(KVPORT_ERR_INVALID_HANDLE, kvport_block_table_prefix_hit_mode(NULL, &i32));
  EXPECT(KVPORT_ERR_INVALID_HANDLE, kvport_block_table_append_tokens(NULL, &b, 1, NULL));
  EXPECT(KVPORT_ERR_INVALID_HANDLE, kvport_block_table_blocks_needed(NULL, 1, &n));
  EXPECT(KVPORT_ERR_INVALID_HANDLE, kvport_block_table_release(NULL));
  EXPECT(KVPORT_ERR_INVALID_HANDLE, kvport_block_table_blocks(NULL, &ids, &n));
  EXPECT(KVPORT_ERR_INVALID_HANDLE, kvport_block_table_copy_on_writes(NULL, &u64));
  EXPECT(KVPORT_ERR_INVALID_HANDLE, kvport_block_table_destroy(NULL));
  EXPECT(KVPORT_ERR_INVALID_HANDLE, kvport_stream_destroy(NULL));

  /* Hybrid caches and tables. */
  EXPECT(KVPORT_ERR_INVALID_HANDLE, kvport_hybrid_cache_destroy(NULL));
  EXPECT(KVPORT_ERR_INVALID_HANDLE, kvport_hybrid_cache_num_layers(NULL, &n));
  EXPECT(KVPORT_ERR_INVALID_HANDLE, kvport_hybrid_cache_num_groups(NULL, &n));
  EXPECT(KVPORT_ERR_INVALID_HANDLE, kvport_hybrid_cache_block_size(NULL, &n));
  EXPECT(KVPORT_ERR_INVALID_HANDLE, kvport_hybrid_cache_total_bytes(NULL, &n));
  EXPECT(KVPORT_ERR_INVALID_HANDLE, kvport_hybrid_cache_group_kind(NULL, 0, &i32));
  EXPECT(KVPORT_ERR_INVALID_HANDLE, kvport_hybrid_cache_group_spec(NULL, 0, &spec));
  EXPECT(KVPORT_ERR_INVALID_HANDLE, kvport_hybrid_cache_group_num_layers(NULL, 0, &n));
  EXPECT(KVPORT_ERR_INVALID_HANDLE, kvport_hybrid_cache_group_layers(NULL, 0, &n, 1, &n));
  EXPECT(KVPORT_ERR_INVALID_HANDLE, kvport_hybrid_cache_group_blocks_in_use(NULL, 0, &n));
  EXPECT(KVPORT_ERR_INVALID_HANDLE, kvport_hybrid_cache_group_cache(NULL, 0, &cache));
  EXPECT(KVPORT_ERR_INVALID_HANDLE, kvport_hybrid_cache_locate(NULL, 0, &flag, &n, &n));
  EXPECT(KVPORT_ERR_INVALID_HANDLE, kvport_hybrid_cache_hit_counters(NULL, &hc));
  EXPECT(KVPORT_ERR_INVALID_HANDLE, kvport_hybrid_cache_check_invariants(NULL, &r, NULL, 0, NULL));
  EXPECT(KVPORT_ERR_INVALID_HANDLE, kvport_hybrid_cache_synchronize(NULL));
  EXPECT(KVPORT_ERR_INVALID_HANDLE, kvport_hybrid_block_table_create(NULL, 0, &ht));
  EXPECT(KVPORT_ERR_INVALID_HANDLE, kvport_hybrid_block_table_destroy(NULL));
  EXPECT(KVPORT_ERR_INVALID_HANDLE,
         kvport_hybrid_block_table_reuse_cached_prefix(NULL, &b, 1, NULL, &n));
  EXPECT(KVPORT_ERR_INVALID_HANDLE, kvport_hybrid_block_table_set_prefix_hit_mode(NULL, 0));
  EXPECT(KVPORT_ERR_INVALID_HANDLE, kvport_hybrid_block_table_prefix_hit_mode(NULL, &i32));
  EXPECT(KVPORT_ERR_INVALID_HANDLE, kvport_hybrid_block_table_append_tokens(NULL, &b, 1, NULL));
  EXPECT(KVPORT_ERR_INVALID_HANDLE, kvport_hybrid_block_table_can_append(NULL, 1, &flag));
  EXPECT(KVPORT_ERR_INVALID_HANDLE, kvport_hybrid_block_table_blocks_needed(NULL, 1, &need, 1, &n));
  EXPECT(KVPORT_ERR_INVALID_HANDLE, kvport_hybrid_block_table_fork(NULL, NULL, &ht));
  EXPECT(KVPORT_ERR_INVALID_HANDLE, kvport_hybrid_block_table_release(NULL));
  EXPECT(KVPORT_ERR_INVALID_HANDLE, kvport_hybrid_block_table_num_tokens(NULL, &n));
  EXPECT(KVPORT_ERR_INVALID_HANDLE, kvport_hybrid_block_table_num_blocks(NULL, 0, &n));
  EXPECT(KVPORT_ERR_INVALID_HANDLE, kvport_hybrid_block_table_num_live_blocks(NULL, 0, &n));
  EXPECT(KVPORT_ERR_INVALID_HANDLE, kvport_hybrid_block_table_blocks(NULL, 0, &b, 1, &n));
  EXPECT(KVPORT_ERR_INVALID_HANDLE, kvport_hybrid_block_table_state_slot(NULL, 0, &flag, &b));
  EXPECT(KVPORT_ERR_INVALID_HANDLE, kvport_hybrid_block_table_copy_on_writes(NULL, &u64));
}

/* A model of one full-attention group is the one-group case of groups: the
 * groups of a prefix cache (or a plain cache) are a borrowed hybrid cache
 * handle, and hybrid tables over it share the prefix cache's blocks. */
static void test_one_group_views(kvport_backend* backend) {
  kvport_config c = small_config();
  kvport_cache *cache = NULL, *pool = NULL;
  kvport_prefix_cache* prefix = NULL;
  kvport_hybrid_cache *groups = NULL, *again = NULL, *plain = NULL;
  kvport_hybrid_block_table *h = NULL, *p = NULL;
  kvport_block_table* t = NULL;
  uint32_t tokens[8];
  size_t n = 0, hit = 0, i;

  for (i = 0; i < 8; ++i)
    tokens[i] = (uint32_t)(300 + i);
  OK(kvport_cache_create(&c, 6, backend, &cache));
  OK(kvport_prefix_cache_create(cache, &prefix));
  OK(kvport_prefix_cache_as_groups(prefix, &groups));
  OK(kvport_prefix_cache_as_groups(prefix, &again));
  CHECK(groups == again);
  EXPECT(KVPORT_ERR_INVALID_ARGUMENT, kvport_prefix_cache_as_groups(prefix, NULL));
  EXPECT(KVPORT_ERR_INVALID_HANDLE, kvport_prefix_cache_as_groups(NULL, &again));
  OK(kvport_hybrid_cache_num_groups(groups, &n));
  CHECK(n == 1);

  /* A block table caches 2 blocks; a hybrid table over the groups hits them
   * (n - 1 tokens in whole blocks: 1 block). */
  OK(kvport_block_table_create_prefixed(prefix, 0, &t));
  OK(kvport_block_table_append_tokens(t, tokens, 8, NULL));
  OK(kvport_block_table_destroy(t));
  OK(kvport_hybrid_block_table_create(groups, 0, &h));
  OK(kvport_hybrid_block_table_reuse_cached_prefix(h, tokens, 8, NULL, &hit));
  CHECK(hit == 4);
  EXPECT(KVPORT_ERR_HANDLE_IN_USE, kvport_prefix_cache_destroy(prefix));
  CHECK(contains(kvport_last_error(), "live child"));
  EXPECT(KVPORT_ERR_INVALID_ARGUMENT, kvport_hybrid_cache_destroy(groups));
  CHECK(contains(kvport_last_error(), "borrowed"));
  EXPECT(KVPORT_ERR_INVALID_ARGUMENT, kvport_hybrid_cache_enable_events(groups, NULL));
  CHECK(contains(kvport_last_error(), "kvport_prefix_cache_enable_events"));
  OK(kvport_hybrid_cache_group_cache(groups, 0, &pool));
  EXPECT(KVPORT_ERR_INVALID_ARGUMENT, kvport_cache_as_groups(pool, &plain));
  OK(kvport_hybrid_block_table_destroy(h));

  /* The plain cache's groups: blocks from the free list, nothing cached. */
  OK(kvport_cache_as_groups(cache, &plain));
  EXPECT(KVPORT_ERR_INVALID_ARGUMENT, kvport_cache_as_groups(cache, NULL));
  OK(kvport_hybrid_block_table_create(plain, 0, &p));
  OK(kvport_hybrid_block_table_reuse_cached_prefix(p, tokens, 8, NULL, &hit));
  CHECK(hit == 0);
  OK(kvport_hybrid_block_table_append_tokens(p, tokens, 8, NULL));
  OK(kvport_cache_num_free_blocks(cache, &n));
  CHECK(n == 2); /* 2 cached by the prefix cache, 2 held by p */
  EXPECT(KVPORT_ERR_HANDLE_IN_USE, kvport_cache_destroy(cache));
  OK(kvport_hybrid_block_table_destroy(p));
  OK(kvport_cache_num_free_blocks(cache, &n));
  CHECK(n == 4);

  OK(kvport_prefix_cache_destroy(prefix));
  EXPECT(KVPORT_ERR_INVALID_HANDLE, kvport_hybrid_cache_num_groups(groups, &n));
  OK(kvport_cache_destroy(cache));
  EXPECT(KVPORT_ERR_INVALID_HANDLE, kvport_hybrid_cache_num_groups(plain, &n));
}

int main(void) {
  kvport_backend* backend = NULL;
  int s;

  test_status_and_version();
  test_backends();
  test_config();
  test_layer_specs();
  test_plan();
  if (kvport_backend_create("host", &backend) != KVPORT_OK) {
    fprintf(stderr, "cannot create the host backend: %s\n", kvport_last_error());
    return 1;
  }
  test_cache_refcounts(backend);
  test_cache_device_work(backend, KVPORT_LAYOUT_LAYER_MAJOR);
  test_cache_device_work(backend, KVPORT_LAYOUT_BLOCK_MAJOR);
  test_k_only_cache(backend, KVPORT_LAYOUT_LAYER_MAJOR);
  test_k_only_cache(backend, KVPORT_LAYOUT_BLOCK_MAJOR);
  test_prefix_and_tables(backend);
  test_hybrid_cache(backend);
  test_hybrid_window_tables(backend);
  test_hybrid_speculative(backend);
  test_batch_metadata(backend);
  test_hybrid_state_tables(backend);
  test_events(backend);
  test_hybrid_shared_pool(backend);
  test_hybrid_events(backend);
  test_one_group_views(backend);
  test_invalid_handles();
  OK(kvport_backend_destroy(backend));

  for (s = 0; s < NUM_STATUSES; ++s) {
    if (!g_seen[s]) {
      fprintf(stderr, "status %s was never returned\n", kvport_status_name((kvport_status)s));
      ++g_failures;
    }
  }
  if (g_failures != 0) {
    fprintf(stderr, "kvport_c_test: %d of %d checks FAILED\n", g_failures, g_checks);
    return 1;
  }
  printf("kvport_c_test: all %d checks passed\n", g_checks);
  return 0;
}
