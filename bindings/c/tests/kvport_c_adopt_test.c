// SPDX-License-Identifier: Apache-2.0
/* The C ABI's seams for an engine, from C99: a wrapped stream
 * (kvport_stream_wrap / kvport_stream_release / kvport_stream_vendor_handle)
 * and a cache over the engine's memory (kvport_cache_adopted_pool_bytes,
 * kvport_cache_create_adopted, kvport_cache_is_adopted), on the host backend.
 * Exit status 1 on failure. */
#include <kvport/kvport.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static int g_failures = 0;

#define CHECK(cond)                                                            \
  do {                                                                         \
    if (!(cond)) {                                                             \
      fprintf(stderr, "%s:%d: CHECK failed: %s\n", __FILE__, __LINE__, #cond); \
      ++g_failures;                                                            \
    }                                                                          \
  } while (0)

#define EXPECT(expected, call)                                                                \
  do {                                                                                        \
    kvport_status got_ = (call);                                                              \
    if (got_ != (expected)) {                                                                 \
      fprintf(stderr, "%s:%d: %s returned %s, expected %s (%s)\n", __FILE__, __LINE__, #call, \
              kvport_status_name(got_), kvport_status_name(expected), kvport_last_error());   \
      ++g_failures;                                                                           \
    }                                                                                         \
  } while (0)

#define OK(call) EXPECT(KVPORT_OK, call)

static int last_error_has(const char* part) {
  return strstr(kvport_last_error(), part) != NULL;
}

static kvport_config small_config(void) {
  kvport_config c;
  kvport_config_init(&c);
  c.num_layers = 2;
  c.block_size = 4;
  c.num_kv_heads = 2;
  c.head_dim_k = 16;
  c.head_dim_v = 16; /* K (and V) of one block of one layer: 4 * 2 * 16 * 2 = 256 bytes */
  return c;
}

enum { kBlocks = 4, kRegion = 256, kPoolBytes = kBlocks * kRegion };

static void test_wrapped_stream(kvport_backend* backend) {
  kvport_stream* own = NULL;
  kvport_stream* wrapped = NULL;
  void* vendor = NULL;
  void* again = NULL;
  void* def = NULL;
  unsigned char k[kRegion], v[kRegion], k_out[kRegion], v_out[kRegion];
  kvport_config c = small_config();
  kvport_cache* cache = NULL;
  uint32_t block = 0;

  OK(kvport_stream_create(backend, &own));
  OK(kvport_stream_vendor_handle(backend, own, &vendor));
  CHECK(vendor != NULL);
  OK(kvport_stream_vendor_handle(backend, NULL, &def));
  CHECK(def != NULL && def != vendor);
  OK(kvport_stream_wrap(backend, vendor, &wrapped));
  CHECK(wrapped != NULL && wrapped != own);
  OK(kvport_stream_vendor_handle(backend, wrapped, &again));
  CHECK(again == vendor);

  /* Work through the wrap runs on the engine's stream. */
  OK(kvport_cache_create(&c, kBlocks, backend, &cache));
  OK(kvport_cache_alloc(cache, &block));
  memset(k, 0x21, sizeof k);
  memset(v, 0x43, sizeof v);
  OK(kvport_cache_poison_block(cache, block, own));
  OK(kvport_cache_write_block(cache, 1, block, k, sizeof k, v, sizeof v, wrapped));
  OK(kvport_cache_read_block(cache, 1, block, k_out, sizeof k_out, v_out, sizeof v_out, own));
  CHECK(memcmp(k, k_out, sizeof k) == 0 && memcmp(v, v_out, sizeof v) == 0);
  OK(kvport_stream_synchronize(wrapped));
  OK(kvport_cache_synchronize(cache));

  /* Releasing a wrap: the engine's stream lives on. */
  EXPECT(KVPORT_ERR_INVALID_ARGUMENT, kvport_stream_release(own));
  CHECK(last_error_has("kvport_stream_destroy"));
  OK(kvport_stream_release(wrapped));
  EXPECT(KVPORT_ERR_INVALID_HANDLE, kvport_stream_synchronize(wrapped));
  OK(kvport_cache_zero_block(cache, block, own));
  OK(kvport_stream_synchronize(own));

  /* kvport_stream_destroy on a wrap releases it too. */
  OK(kvport_stream_wrap(backend, vendor, &wrapped));
  OK(kvport_stream_destroy(wrapped));
  OK(kvport_stream_synchronize(own));

  /* What the host backend cannot wrap. */
  EXPECT(KVPORT_ERR_INVALID_ARGUMENT, kvport_stream_wrap(backend, NULL, &wrapped));
  CHECK(last_error_has("null handle"));
  EXPECT(KVPORT_ERR_INVALID_ARGUMENT, kvport_stream_wrap(backend, k, &wrapped));
  CHECK(last_error_has("not the queue of a live stream"));
  EXPECT(KVPORT_ERR_INVALID_ARGUMENT, kvport_stream_wrap(backend, vendor, NULL));
  EXPECT(KVPORT_ERR_INVALID_HANDLE, kvport_stream_wrap(NULL, vendor, &wrapped));
  EXPECT(KVPORT_ERR_INVALID_ARGUMENT, kvport_stream_vendor_handle(backend, own, NULL));

  OK(kvport_cache_free(cache, block, NULL));
  OK(kvport_cache_destroy(cache));
  OK(kvport_stream_destroy(own));
}

static void test_adopted_cache(kvport_backend* backend) {
  kvport_config c = small_config();
  size_t bytes[8];
  size_t count = 0;
  size_t i;
  unsigned char* raw = NULL;
  unsigned char* memory = NULL;
  kvport_pool pools[4];
  kvport_cache* cache = NULL;
  kvport_cache* owned = NULL;
  bool adopted = false;
  uint32_t block = 0;
  void* k_ptr = NULL;
  unsigned char k[kRegion], v[kRegion];

  OK(kvport_cache_adopted_pool_bytes(&c, kBlocks, NULL, 0, &count));
  CHECK(count == 4);
  EXPECT(KVPORT_ERR_INVALID_ARGUMENT,
         kvport_cache_adopted_pool_bytes(&c, kBlocks, bytes, 3, &count));
  OK(kvport_cache_adopted_pool_bytes(&c, kBlocks, bytes, 8, &count));
  for (i = 0; i < 4; ++i)
    CHECK(bytes[i] == kPoolBytes);

  /* The engine's memory: one buffer, four pools back to back. */
  raw = (unsigned char*)malloc(4 * kPoolBytes + 256); /* C99: aligned by hand */
  CHECK(raw != NULL);
  if (raw == NULL) return;
  memory = raw + (256 - (size_t)((uintptr_t)raw % 256)) % 256;
  memset(memory, 0, 4 * kPoolBytes);
  for (i = 0; i < 4; ++i) {
    pools[i].base = memory + i * kPoolBytes;
    pools[i].bytes = kPoolBytes;
  }
  OK(kvport_cache_create_adopted(&c, kBlocks, backend, pools, 4, &cache));
  OK(kvport_cache_is_adopted(cache, &adopted));
  CHECK(adopted);
  OK(kvport_cache_alloc(cache, &block));
  OK(kvport_cache_k_ptr(cache, 1, block, &k_ptr));
  CHECK(k_ptr == memory + 2 * kPoolBytes + block * kRegion);
  memset(k, 0x5A, sizeof k);
  memset(v, 0xA5, sizeof v);
  OK(kvport_cache_write_block(cache, 1, block, k, sizeof k, v, sizeof v, NULL));
  CHECK(memory[2 * kPoolBytes + block * kRegion] == 0x5A); /* in the engine's bytes */
  CHECK(memory[3 * kPoolBytes + block * kRegion] == 0xA5);
  OK(kvport_cache_poison_block(cache, block, NULL));
  OK(kvport_cache_synchronize(cache));
  CHECK(memory[0 * kPoolBytes + block * kRegion] == 0xFF);

  /* The same memory cannot back two caches; an owned cache reports false. */
  EXPECT(KVPORT_ERR_INVALID_ARGUMENT,
         kvport_cache_create_adopted(&c, kBlocks, backend, pools, 4, &owned));
  CHECK(last_error_has("pool 0 (layer 0 K)") && last_error_has("overlaps an adopted range"));
  OK(kvport_cache_create(&c, kBlocks, backend, &owned));
  OK(kvport_cache_is_adopted(owned, &adopted));
  CHECK(!adopted);
  OK(kvport_cache_destroy(owned));

  OK(kvport_cache_free(cache, block, NULL));
  OK(kvport_cache_destroy(cache));
  /* Never freed: the engine's memory is still its own, and adoptable again. */
  memory[0] = 0x01;
  CHECK(memory[3 * kPoolBytes + block * kRegion] == 0xFF);

  /* The geometry is checked, naming the pool. */
  EXPECT(KVPORT_ERR_INVALID_ARGUMENT,
         kvport_cache_create_adopted(&c, kBlocks, backend, pools, 3, &cache));
  CHECK(last_error_has("3 pools given, the config needs 4"));
  pools[1].bytes = kPoolBytes - 1;
  EXPECT(KVPORT_ERR_INVALID_ARGUMENT,
         kvport_cache_create_adopted(&c, kBlocks, backend, pools, 4, &cache));
  CHECK(last_error_has("pool 1 (layer 0 V)") && last_error_has("too small"));
  pools[1].bytes = kPoolBytes;
  pools[2].base = memory + 2 * kPoolBytes + 4;
  EXPECT(KVPORT_ERR_INVALID_ARGUMENT,
         kvport_cache_create_adopted(&c, kBlocks, backend, pools, 4, &cache));
  CHECK(last_error_has("pool 2 (layer 1 K)") && last_error_has("misaligned"));
  pools[2].base = memory + kPoolBytes;
  EXPECT(KVPORT_ERR_INVALID_ARGUMENT,
         kvport_cache_create_adopted(&c, kBlocks, backend, pools, 4, &cache));
  CHECK(last_error_has("overlap"));
  pools[2].base = NULL;
  EXPECT(KVPORT_ERR_INVALID_ARGUMENT,
         kvport_cache_create_adopted(&c, kBlocks, backend, pools, 4, &cache));
  CHECK(last_error_has("null base"));
  EXPECT(KVPORT_ERR_INVALID_ARGUMENT,
         kvport_cache_create_adopted(&c, kBlocks, backend, NULL, 4, &cache));
  EXPECT(KVPORT_ERR_INVALID_ARGUMENT,
         kvport_cache_create_adopted(&c, kBlocks, backend, pools, 0, &cache));
  pools[2].base = memory + 2 * kPoolBytes;
  OK(kvport_cache_create_adopted(&c, kBlocks, backend, pools, 4, &cache));
  OK(kvport_cache_destroy(cache));
  free(raw);
}

/* Adopted ranges are process-wide: two kvport_backend_create handles (two
 * engines in one process) cannot adopt the same memory, nor one adopt the
 * pools of a cache the other allocated; destroying the first cache frees the
 * range. Zero blocks is refused before any pool is looked at. */
static void test_two_backends(kvport_backend* first) {
  kvport_config c = small_config();
  kvport_backend* second = NULL;
  unsigned char* raw = NULL;
  unsigned char* memory = NULL;
  kvport_pool pools[4];
  kvport_cache* cache = NULL;
  kvport_cache* other = NULL;
  size_t count = 0;
  size_t i;
  void* base = NULL;

  OK(kvport_backend_create("host", &second));
  raw = (unsigned char*)malloc(4 * kPoolBytes + 256);
  CHECK(raw != NULL);
  if (raw == NULL) return;
  memory = raw + (256 - (size_t)((uintptr_t)raw % 256)) % 256;
  for (i = 0; i < 4; ++i) {
    pools[i].base = memory + i * kPoolBytes;
    pools[i].bytes = kPoolBytes;
  }
  OK(kvport_cache_create_adopted(&c, kBlocks, first, pools, 4, &cache));
  EXPECT(KVPORT_ERR_INVALID_ARGUMENT,
         kvport_cache_create_adopted(&c, kBlocks, second, pools, 4, &other));
  CHECK(last_error_has("pool 0 (layer 0 K)") && last_error_has("overlaps an adopted range") &&
        last_error_has("of another host backend object (host memory)"));
  CHECK(other == NULL);
  OK(kvport_cache_destroy(cache));
  cache = NULL;
  OK(kvport_cache_create_adopted(&c, kBlocks, second, pools, 4, &other)); /* free again */
  OK(kvport_cache_destroy(other));
  other = NULL;

  /* A cache the first backend allocated: its pools are not the second's to adopt. */
  OK(kvport_cache_create(&c, kBlocks, first, &cache));
  for (i = 0; i < 4; ++i) {
    OK(kvport_cache_k_ptr(cache, i / 2, 0, &base));
    if (i % 2 == 1) OK(kvport_cache_v_ptr(cache, i / 2, 0, &base));
    pools[i].base = base;
    pools[i].bytes = kPoolBytes;
  }
  EXPECT(KVPORT_ERR_INVALID_ARGUMENT,
         kvport_cache_create_adopted(&c, kBlocks, second, pools, 4, &other));
  CHECK(last_error_has("overlaps a live allocation") && last_error_has("another host backend"));
  OK(kvport_cache_destroy(cache));

  /* Zero blocks: refused, naming the count, by both calls. */
  EXPECT(KVPORT_ERR_INVALID_ARGUMENT, kvport_cache_adopted_pool_bytes(&c, 0, NULL, 0, &count));
  CHECK(last_error_has("num_blocks must be > 0"));
  for (i = 0; i < 4; ++i)
    pools[i].base = memory + i * kPoolBytes;
  EXPECT(KVPORT_ERR_INVALID_ARGUMENT, kvport_cache_create_adopted(&c, 0, first, pools, 4, &other));
  CHECK(last_error_has("num_blocks must be > 0"));

  OK(kvport_backend_destroy(second));
  free(raw);
}

int main(void) {
  kvport_backend* backend = NULL;
  if (kvport_backend_create("host", &backend) != KVPORT_OK) {
    fprintf(stderr, "kvport_backend_create: %s\n", kvport_last_error());
    return 1;
  }
  test_wrapped_stream(backend);
  test_adopted_cache(backend);
  test_two_backends(backend);
  OK(kvport_backend_destroy(backend));
  if (g_failures != 0) {
    fprintf(stderr, "%d check(s) failed\n", g_failures);
    return 1;
  }
  printf("kvport_c_adopt_test: all checks passed\n");
  return 0;
}
