/* The C ABI from C: every function of kvport.h and every status code.
 * Dependency-free: CHECK macros, a failure count, exit status 1 on failure. */
#include <kvport/kvport.h>

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

  /* Out of range: every per-block call. */
  EXPECT(KVPORT_ERR_OUT_OF_RANGE, kvport_cache_inc_ref(cache, 4));
  CHECK(contains(kvport_last_error(), "out of range"));
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

/* Calls that reject null and destroyed handles, one per remaining function. */
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
}

int main(void) {
  kvport_backend* backend = NULL;
  int s;

  test_status_and_version();
  test_backends();
  test_config();
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
