// SPDX-License-Identifier: Apache-2.0
/* Uses the installed C ABI the way a C engine would: a host backend, a
 * cache, a poisoned block read back. Built twice by the install check:
 * through pkg-config (kvport.pc) and through find_package (kvport::c). */
#include <kvport/kvport.h>

#include <stdio.h>

#define TRY(call)                                                                          \
  do {                                                                                     \
    kvport_status s_ = (call);                                                             \
    if (s_ != KVPORT_OK) {                                                                 \
      fprintf(stderr, "%s: %s: %s\n", #call, kvport_status_name(s_), kvport_last_error()); \
      return 1;                                                                            \
    }                                                                                      \
  } while (0)

int main(void) {
  kvport_backend* backend = NULL;
  kvport_cache* cache = NULL;
  kvport_config config;
  uint32_t block = 0;
  unsigned char k[4096], v[4096];
  size_t kb = 0, vb = 0, i;
  int poisoned = 1;

  TRY(kvport_config_init(&config));
  config.num_layers = 2;
  config.num_kv_heads = 2;
  config.head_dim_k = config.head_dim_v = 64;
  TRY(kvport_backend_create("host", &backend));
  TRY(kvport_cache_create(&config, 8, backend, &cache));
  TRY(kvport_cache_alloc(cache, &block));
  TRY(kvport_cache_poison_block(cache, block, NULL));
  TRY(kvport_cache_k_block_bytes(cache, 1, &kb));
  TRY(kvport_cache_v_block_bytes(cache, 1, &vb));
  if (kb > sizeof k || vb > sizeof v) return 1;
  TRY(kvport_cache_read_block(cache, 1, block, k, kb, v, vb, NULL));
  for (i = 0; i < kb; ++i)
    poisoned &= k[i] == 0xFF;
  printf("c_consumer: kvport %s, block %u poisoned=%d\n", kvport_version_string(), (unsigned)block,
         poisoned);
  TRY(kvport_cache_destroy(cache));
  TRY(kvport_backend_destroy(backend));
  return poisoned ? 0 : 1;
}
