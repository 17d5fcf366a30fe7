// SPDX-License-Identifier: Apache-2.0
//! The example of docs/bindings/rust.md (keep the two the same): an
//! engine's use of the cache, as it would be written against the reference's
//! PagedKvCache. `cargo run --offline --example engine` (KVPORT_C_LIB_DIR set).

use kvport::{Backend, KvCacheConfig, KvCacheDtype, KvError, PagedKvCache, Stream, DEFAULT_STREAM};

fn main() -> Result<(), KvError> {
    // "default": $KVPORT_BACKEND when set, else the first GPU with a device,
    // else host. "host", "cuda" and "hip" name one.
    let gpu = Backend::new("default")?;
    let config = KvCacheConfig::new(
        32,                // num_layers
        8,                 // num_kv_heads
        128,               // head_dim (K and V)
        16,                // block_size: tokens per block
        KvCacheDtype::Bf16,
    );

    // Size the cache from a memory budget (a fraction of free memory).
    let (free, _total) = gpu.mem_info()?;
    let num_blocks = PagedKvCache::compute_num_blocks(&config, free / 8)?.min(1024);
    let mut cache = PagedKvCache::new(config, num_blocks, &gpu)?;

    // A sequence of 40 tokens needs 3 blocks.
    let mut table = Vec::new();
    for _ in 0..3 {
        match cache.alloc_block() {
            Ok(block) => table.push(block),
            Err(e) if e.is_cache_exhausted() => {
                // Recoverable: preempt a sequence, free its blocks, retry.
                cache.free_blocks(&table)?;
                return Err(e);
            }
            Err(e) => return Err(e),
        }
    }

    // Fresh blocks hold stale data: zero them (or poison them in debug
    // builds to catch reads of unwritten KV), here on a stream of our own.
    let stream = Stream::new(&gpu)?;
    for &block in &table {
        cache.zero_block(block, &gpu, stream.as_raw())?;
    }
    stream.synchronize()?;

    // Device addresses for an attention kernel: block b of layer l's K.
    let k = cache.k_cache_ptr(0, table[0])?;
    assert_eq!(
        k,
        cache.k_pool_ptr(0)?.offset(table[0] as usize * cache.k_block_stride_bytes_for_layer(0)?)
    );

    // Host round trip of one block of one layer (tests, swapping).
    let (k_bytes, v_bytes) = cache.read_block(0, table[0], &gpu)?;
    cache.write_block(0, table[1], &k_bytes, &v_bytes, &gpu)?;

    // Share the first block with a forked sequence, then release both.
    cache.inc_ref(table[0])?;
    assert_eq!(cache.ref_count(table[0])?, 2);
    assert!(!cache.dec_ref(table[0])?); // still referenced
    cache.free_blocks(&table)?; // every block back on the free list
    assert_eq!(cache.num_free_blocks(), cache.num_blocks());

    // Out-of-range ids are errors, not panics.
    match cache.inc_ref(u32::MAX) {
        Err(KvError::OutOfRange(message)) => println!("as expected: {}", message),
        other => panic!("{:?}", other),
    }
    let _ = DEFAULT_STREAM; // 0: the backend's default stream
    Ok(()) // dropping the cache waits for its device work and frees the pools
}
