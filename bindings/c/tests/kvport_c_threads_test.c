// SPDX-License-Identifier: Apache-2.0
/* The thread-safe parts of the C ABI from several threads at once: the handle
 * table (create, use, destroy of handles on every thread) and the
 * thread-local last error. Each thread owns its backend and cache, as the
 * C++ contract asks (a cache is used by one thread at a time). */
#include <kvport/kvport.h>

#include <pthread.h>
#include <stdio.h>
#include <string.h>

#define NUM_THREADS 4
#define ROUNDS 50

typedef struct worker {
  int index;
  int failures;
} worker;

#define WCHECK(w, cond)                                                                    \
  do {                                                                                     \
    if (!(cond)) {                                                                         \
      fprintf(stderr, "thread %d: %s:%d: CHECK failed: %s (last error: %s)\n", (w)->index, \
              __FILE__, __LINE__, #cond, kvport_last_error());                             \
      ++(w)->failures;                                                                     \
    }                                                                                      \
  } while (0)

static void* run(void* arg) {
  worker* w = (worker*)arg;
  kvport_backend* backend = NULL;
  kvport_config config;
  int round;
  char expected[64];

  WCHECK(w, kvport_backend_create("host", &backend) == KVPORT_OK);
  kvport_config_init(&config);
  config.num_layers = 1;
  config.block_size = 4;
  config.num_kv_heads = 1;
  config.head_dim_k = config.head_dim_v = 16;
  for (round = 0; round < ROUNDS; ++round) {
    kvport_cache* cache = NULL;
    kvport_block_table* table = NULL;
    uint32_t block = 0;
    uint32_t tokens[6] = {1, 2, 3, 4, 5, 6};
    WCHECK(w, kvport_cache_create(&config, 2, backend, &cache) == KVPORT_OK);
    WCHECK(w, kvport_block_table_create(cache, &table) == KVPORT_OK);
    WCHECK(w, kvport_block_table_append_tokens(table, tokens, 6, NULL) == KVPORT_OK);
    WCHECK(w, kvport_cache_alloc(cache, &block) == KVPORT_ERR_CACHE_EXHAUSTED);
    /* This thread's own message, whatever the others fail with meanwhile. */
    snprintf(expected, sizeof expected, "block %d out of range", 100 + w->index);
    WCHECK(w, kvport_cache_inc_ref(cache, (uint32_t)(100 + w->index)) == KVPORT_ERR_OUT_OF_RANGE);
    WCHECK(w, strstr(kvport_last_error(), expected) != NULL);
    WCHECK(w, kvport_cache_destroy(cache) == KVPORT_ERR_HANDLE_IN_USE);
    WCHECK(w, kvport_block_table_destroy(table) == KVPORT_OK);
    WCHECK(w, kvport_cache_destroy(cache) == KVPORT_OK);
    WCHECK(w, kvport_cache_destroy(cache) == KVPORT_ERR_INVALID_HANDLE);
  }
  WCHECK(w, kvport_backend_destroy(backend) == KVPORT_OK);
  return NULL;
}

int main(void) {
  pthread_t threads[NUM_THREADS];
  worker workers[NUM_THREADS];
  int i, failures = 0;

  for (i = 0; i < NUM_THREADS; ++i) {
    workers[i].index = i;
    workers[i].failures = 0;
    if (pthread_create(&threads[i], NULL, run, &workers[i]) != 0) {
      fprintf(stderr, "pthread_create failed\n");
      return 1;
    }
  }
  for (i = 0; i < NUM_THREADS; ++i) {
    pthread_join(threads[i], NULL);
    failures += workers[i].failures;
  }
  if (failures != 0) {
    fprintf(stderr, "kvport_c_threads_test: %d checks FAILED\n", failures);
    return 1;
  }
  printf("kvport_c_threads_test: %d threads x %d rounds passed\n", NUM_THREADS, ROUNDS);
  return 0;
}
