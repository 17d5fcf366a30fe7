// SPDX-License-Identifier: Apache-2.0
//! The reference engine's PagedKvCache behaviours, on kvport's host backend.
//! Written as an engine that used the reference would call it.

use kvport::{
    Backend, KvCacheConfig, KvCacheDtype, KvCacheLayout, KvError, PagedKvCache, Stream, DEFAULT_STREAM,
};

fn config() -> KvCacheConfig {
    // 2 layers, 2 KV heads, head_dim 16, 4 tokens per block, f16:
    // a K (and V) region is 4 * 2 * 16 * 2 = 256 bytes.
    KvCacheConfig::new(2, 2, 16, 4, KvCacheDtype::F16)
}

fn cache(num_blocks: usize) -> (Backend, PagedKvCache) {
    let gpu = Backend::host().expect("host backend");
    let cache = PagedKvCache::new(config(), num_blocks, &gpu).expect("cache");
    (gpu, cache)
}

#[test]
fn fresh_cache_hands_out_blocks_in_order() {
    let (_gpu, mut cache) = cache(8);
    assert_eq!(cache.num_blocks(), 8);
    assert_eq!(cache.num_free_blocks(), 8);
    for expected in 0..8u32 {
        assert_eq!(cache.alloc_block().unwrap(), expected);
    }
    assert_eq!(cache.num_free_blocks(), 0);
}

#[test]
fn free_list_is_lifo() {
    let (_gpu, mut cache) = cache(8);
    let a = cache.alloc_block().unwrap();
    let b = cache.alloc_block().unwrap();
    let c = cache.alloc_block().unwrap();
    assert_eq!((a, b, c), (0, 1, 2));
    assert!(cache.dec_ref(b).unwrap());
    assert!(cache.dec_ref(a).unwrap());
    // Last freed, first handed out.
    assert_eq!(cache.alloc_block().unwrap(), a);
    assert_eq!(cache.alloc_block().unwrap(), b);
    assert_eq!(cache.alloc_block().unwrap(), 3);
}

#[test]
fn issue_short_names_are_the_same_calls() {
    let (_gpu, mut cache) = cache(2);
    assert_eq!(cache.alloc().unwrap(), 0);
    assert_eq!(cache.try_alloc(), Some(1));
    assert_eq!(cache.try_alloc(), None);
    assert!(cache.alloc().unwrap_err().is_cache_exhausted());
}

#[test]
fn refcounts_and_dec_ref_to_zero_frees() {
    let (_gpu, mut cache) = cache(4);
    let b = cache.alloc_block().unwrap();
    assert_eq!(cache.ref_count(b).unwrap(), 1);
    cache.inc_ref(b).unwrap();
    cache.inc_ref(b).unwrap();
    assert_eq!(cache.ref_count(b).unwrap(), 3);
    assert_eq!(cache.num_free_blocks(), 3);
    assert!(!cache.dec_ref(b).unwrap());
    assert!(!cache.dec_ref(b).unwrap());
    assert_eq!(cache.ref_count(b).unwrap(), 1);
    assert_eq!(cache.num_free_blocks(), 3);
    assert!(cache.dec_ref(b).unwrap(), "the last reference frees the block");
    assert_eq!(cache.ref_count(b).unwrap(), 0);
    assert_eq!(cache.num_free_blocks(), 4);
    assert_eq!(cache.num_blocks_in_use(), 0);
}

#[test]
fn double_free_is_ignored_like_the_reference() {
    let (_gpu, mut cache) = cache(4);
    let b = cache.alloc_block().unwrap();
    assert!(cache.dec_ref(b).unwrap());
    // The reference logs and returns false; the refcount does not wrap and
    // the block is not pushed twice.
    assert_eq!(cache.dec_ref(b), Ok(false));
    cache.free_block(b).unwrap();
    assert_eq!(cache.ref_count(b).unwrap(), 0);
    assert_eq!(cache.num_free_blocks(), 4);
    assert_eq!(cache.counters().ignored_double_frees, 2);
    let mut ids: Vec<u32> = (0..4).map(|_| cache.alloc_block().unwrap()).collect();
    ids.sort_unstable();
    assert_eq!(ids, vec![0, 1, 2, 3], "no free-list duplicate");
    assert!(cache.check_invariants().unwrap().ok);
}

#[test]
fn return_evicted_block() {
    let (_gpu, mut cache) = cache(4);
    let b = cache.alloc_block().unwrap();
    cache.inc_ref(b).unwrap();
    cache.return_evicted_block(b).unwrap();
    assert_eq!(cache.ref_count(b).unwrap(), 1);
    cache.return_evicted_block(b).unwrap();
    assert_eq!(cache.ref_count(b).unwrap(), 0);
    assert_eq!(cache.num_free_blocks(), 4);
    // At refcount 0: warned about and ignored (no duplicate free entry).
    cache.return_evicted_block(b).unwrap();
    assert_eq!(cache.num_free_blocks(), 4);
    assert!(cache.check_invariants().unwrap().ok);
}

#[test]
fn free_blocks_frees_a_block_table() {
    let (_gpu, mut cache) = cache(6);
    let table: Vec<u32> = (0..4).map(|_| cache.alloc_block().unwrap()).collect();
    cache.inc_ref(table[1]).unwrap();
    cache.free_blocks(&table).unwrap();
    assert_eq!(cache.num_free_blocks(), 5);
    assert_eq!(cache.ref_count(table[1]).unwrap(), 1);
    // Every id is checked first: an out-of-range id changes nothing.
    let err = cache.free_blocks(&[table[1], 99]).unwrap_err();
    assert!(matches!(err, KvError::OutOfRange(_)), "{:?}", err);
    assert_eq!(cache.ref_count(table[1]).unwrap(), 1);
}

#[test]
fn exhaustion_is_an_error_and_try_alloc_is_none() {
    let (_gpu, mut cache) = cache(2);
    cache.alloc_block().unwrap();
    cache.alloc_block().unwrap();
    let err = cache.alloc_block().unwrap_err();
    assert!(matches!(err, KvError::CacheExhausted(_)), "{:?}", err);
    assert_eq!(err.status(), kvport::ffi::KVPORT_ERR_CACHE_EXHAUSTED);
    assert!(!err.message().is_empty());
    assert_eq!(cache.try_alloc_block(), None);
    assert_eq!(cache.num_free_blocks(), 0);
    assert!(cache.counters().exhaustion_events >= 1);
    // Recoverable: free one and allocate again.
    cache.dec_ref(1).unwrap();
    assert_eq!(cache.try_alloc_block(), Some(1));
}

#[test]
fn zero_and_poison_are_visible_through_read_block() {
    let (gpu, mut cache) = cache(4);
    let b = cache.alloc_block().unwrap();
    for layer in 0..cache.num_layers() {
        assert_eq!(cache.k_block_bytes_for_layer(layer).unwrap(), 256);
    }
    cache.poison_block(b, &gpu, DEFAULT_STREAM).unwrap();
    for layer in 0..cache.num_layers() {
        let (k, v) = cache.read_block(layer, b, &gpu).unwrap();
        assert_eq!(k.len(), 256);
        assert_eq!(v.len(), 256);
        assert!(k.iter().chain(v.iter()).all(|&x| x == 0xFF));
    }
    cache.zero_block(b, &gpu, DEFAULT_STREAM).unwrap();
    for layer in 0..cache.num_layers() {
        let (k, v) = cache.read_block(layer, b, &gpu).unwrap();
        assert!(k.iter().chain(v.iter()).all(|&x| x == 0));
    }
}

#[test]
fn zero_and_poison_on_a_stream() {
    let (gpu, mut cache) = cache(4);
    let stream = Stream::new(&gpu).unwrap();
    assert_ne!(stream.as_raw(), 0);
    let b = cache.alloc_block().unwrap();
    cache.poison_block(b, &gpu, stream.as_raw()).unwrap();
    stream.synchronize().unwrap();
    let (k, _) = cache.read_block(0, b, &gpu).unwrap();
    assert!(k.iter().all(|&x| x == 0xFF));
    cache.zero_blocks(&[b], stream.as_raw()).unwrap();
    cache.synchronize().unwrap();
    let (k, v) = cache.read_block(1, b, &gpu).unwrap();
    assert!(k.iter().chain(v.iter()).all(|&x| x == 0));
    // A u64 that is no live stream is an error value, not a crash.
    let err = cache.zero_block(b, &gpu, 0xdead_beef).unwrap_err();
    assert!(matches!(err, KvError::InvalidHandle(_)), "{:?}", err);
}

#[test]
fn write_read_round_trip() {
    let (gpu, mut cache) = cache(4);
    let a = cache.alloc_block().unwrap();
    let b = cache.alloc_block().unwrap();
    cache.zero_block(b, &gpu, DEFAULT_STREAM).unwrap();
    let k: Vec<u8> = (0..256).map(|i| i as u8).collect();
    let v: Vec<u8> = (0..256).map(|i| (255 - i) as u8).collect();
    cache.write_block(1, a, &k, &v, &gpu).unwrap();
    let (k2, v2) = cache.read_block(1, a, &gpu).unwrap();
    assert_eq!(k2, k);
    assert_eq!(v2, v);
    // Other blocks are untouched.
    let (kb, vb) = cache.read_block(1, b, &gpu).unwrap();
    assert!(kb.iter().chain(vb.iter()).all(|&x| x == 0));
    // Wrong lengths are an error (the reference would copy out of bounds).
    let err = cache.write_block(1, a, &k[..10], &v, &gpu).unwrap_err();
    assert!(matches!(err, KvError::InvalidArgument(_)), "{:?}", err);
}

#[test]
fn copy_blocks_copies_every_layer() {
    let (gpu, mut cache) = cache(4);
    let a = cache.alloc_block().unwrap();
    let b = cache.alloc_block().unwrap();
    let k = vec![7u8; 256];
    let v = vec![9u8; 256];
    for layer in 0..2 {
        cache.write_block(layer, a, &k, &v, &gpu).unwrap();
    }
    cache.copy_blocks(&[(a, b)], DEFAULT_STREAM).unwrap();
    cache.synchronize().unwrap();
    for layer in 0..2 {
        assert_eq!(cache.read_block(layer, b, &gpu).unwrap(), (k.clone(), v.clone()));
    }
    let err = cache.copy_blocks(&[(a, a)], DEFAULT_STREAM).unwrap_err();
    assert!(matches!(err, KvError::InvalidArgument(_)), "{:?}", err);
}

#[test]
fn compute_num_blocks() {
    let config = config();
    let per_block = config.bytes_per_block().unwrap();
    assert_eq!(per_block, 2 * 2 * 256, "layers x (K + V) x region");
    assert_eq!(config.block_bytes_kv_all_layers().unwrap(), per_block);
    assert_eq!(PagedKvCache::compute_num_blocks(&config, 0).unwrap(), 0);
    assert_eq!(PagedKvCache::compute_num_blocks(&config, per_block - 1).unwrap(), 0);
    let n = PagedKvCache::compute_num_blocks(&config, 1000 * per_block).unwrap();
    // kvport includes pool alignment: at most what the reference's division gives.
    assert!(n <= 1000 && n >= 990, "n = {}", n);
    // The reference bails on a zero block size; kvport rejects the config.
    let mut bad = config.clone();
    bad.head_dim_k = 0;
    let err = PagedKvCache::compute_num_blocks(&bad, 1 << 20).unwrap_err();
    assert!(matches!(err, KvError::InvalidArgument(_)), "{:?}", err);
    // A cache of that many blocks fits.
    let gpu = Backend::host().unwrap();
    let cache = PagedKvCache::new(config, n, &gpu).unwrap();
    assert!(cache.total_bytes() <= 1000 * per_block);
}

#[test]
fn pointers_and_stride_arithmetic() {
    let (gpu, mut cache) = cache(8);
    for layer in 0..cache.num_layers() {
        let k_pool = cache.k_pool_ptr(layer).unwrap();
        let v_pool = cache.v_pool_ptr(layer).unwrap();
        assert!(!k_pool.is_null() && !v_pool.is_null());
        let ks = cache.k_block_stride_bytes_for_layer(layer).unwrap();
        let vs = cache.v_block_stride_bytes_for_layer(layer).unwrap();
        assert_eq!(cache.block_stride_bytes_for_layer(layer).unwrap(), ks);
        assert!(ks >= 256 && vs >= 256);
        for block in 0..8u32 {
            assert_eq!(cache.k_cache_ptr(layer, block).unwrap(), k_pool.offset(block as usize * ks));
            assert_eq!(cache.v_cache_ptr(layer, block).unwrap(), v_pool.offset(block as usize * vs));
        }
    }
    assert_eq!(cache.block_stride_bytes(), cache.k_block_stride_bytes_for_layer(0).unwrap());
    // On the host backend a pointer is host memory: what write_block wrote
    // is there.
    let b = cache.alloc_block().unwrap();
    let k: Vec<u8> = (0..256).map(|i| (i * 3) as u8).collect();
    cache.write_block(1, b, &k, &k, &gpu).unwrap();
    let p = cache.k_cache_ptr(1, b).unwrap().as_ptr() as *const u8;
    let seen = unsafe { std::slice::from_raw_parts(p, 256) };
    assert_eq!(seen, &k[..]);
}

#[test]
fn block_major_layout_strides() {
    let gpu = Backend::host().unwrap();
    let mut config = config();
    config.layout = KvCacheLayout::BlockMajor;
    let cache = PagedKvCache::new(config.clone(), 4, &gpu).unwrap();
    let stride = cache.k_block_stride_bytes_for_layer(0).unwrap();
    assert_eq!(stride, config.bytes_per_block().unwrap(), "the whole block");
    assert_eq!(
        cache.k_cache_ptr(1, 3).unwrap(),
        cache.k_pool_ptr(1).unwrap().offset(3 * stride)
    );
}

#[test]
fn shape_accessors_and_mixed_dtypes() {
    let gpu = Backend::host().unwrap();
    let mut config = KvCacheConfig::new(3, 2, 32, 16, KvCacheDtype::Fp8E4m3);
    config.layer_dtypes = vec![KvCacheDtype::Bf16, KvCacheDtype::Fp8E4m3, KvCacheDtype::Bf16];
    let cache = PagedKvCache::new(config.clone(), 4, &gpu).unwrap();
    assert_eq!(cache.config(), &config);
    assert_eq!(cache.block_size(), 16);
    assert_eq!(cache.num_layers(), 3);
    assert_eq!(cache.dtype(), KvCacheDtype::Fp8E4m3);
    assert_eq!(cache.dtype_for_layer(0).unwrap(), KvCacheDtype::Bf16);
    assert_eq!(cache.dtype_for_layer(1).unwrap(), KvCacheDtype::Fp8E4m3);
    assert_eq!(config.dtype_for_layer(2).unwrap(), KvCacheDtype::Bf16);
    // bf16 layers have twice the bytes of fp8 ones.
    assert_eq!(
        cache.k_block_bytes_for_layer(0).unwrap(),
        2 * cache.k_block_bytes_for_layer(1).unwrap()
    );
    assert_eq!(cache.k_region_layout(1).unwrap().data_bytes, 16 * 2 * 32);
    assert!(matches!(cache.dtype_for_layer(3), Err(KvError::OutOfRange(_))));
}

#[test]
fn out_of_range_ids_are_errors() {
    let (gpu, mut cache) = cache(4);
    let oor = |r: Result<(), KvError>| match r {
        Err(KvError::OutOfRange(m)) => assert!(!m.is_empty()),
        other => panic!("expected OutOfRange, got {:?}", other),
    };
    oor(cache.inc_ref(4));
    oor(cache.dec_ref(4).map(|_| ()));
    oor(cache.return_evicted_block(u32::MAX));
    oor(cache.ref_count(4).map(|_| ()));
    oor(cache.k_cache_ptr(0, 4).map(|_| ()));
    oor(cache.v_cache_ptr(2, 0).map(|_| ()));
    oor(cache.k_pool_ptr(2).map(|_| ()));
    oor(cache.zero_block(4, &gpu, DEFAULT_STREAM));
    oor(cache.poison_block(4, &gpu, DEFAULT_STREAM));
    oor(cache.read_block(0, 4, &gpu).map(|_| ()));
    oor(cache.read_block(2, 0, &gpu).map(|_| ()));
    oor(cache.write_block(0, 4, &[0; 256], &[0; 256], &gpu));
    // inc_ref of a free block is an argument error.
    assert!(matches!(cache.inc_ref(0), Err(KvError::InvalidArgument(_))));
    assert!(cache.check_invariants().unwrap().ok);
}

#[test]
fn bad_configs_are_errors() {
    let gpu = Backend::host().unwrap();
    let mut zero_layers = config();
    zero_layers.num_layers = 0;
    let mut wrong_layer_dtypes = config();
    wrong_layer_dtypes.layer_dtypes = vec![KvCacheDtype::F16];
    let mut zero_block_size = config();
    zero_block_size.block_size = 0;
    for bad in [zero_layers, wrong_layer_dtypes, zero_block_size] {
        assert!(matches!(bad.validate(), Err(KvError::InvalidArgument(_))));
        match PagedKvCache::new(bad.clone(), 4, &gpu) {
            Err(KvError::InvalidArgument(m)) => assert!(!m.is_empty()),
            other => panic!("{:?}: expected InvalidArgument, got {:?}", bad, other.map(|_| ())),
        }
    }
    assert!(config().validate().is_ok());
    assert!(matches!(PagedKvCache::new(config(), 0, &gpu), Err(KvError::InvalidArgument(_))));
}

#[test]
fn gpu_must_be_the_cache_backend() {
    let (_gpu, mut cache) = cache(2);
    let other = Backend::host().unwrap();
    let b = cache.alloc_block().unwrap();
    let err = cache.zero_block(b, &other, DEFAULT_STREAM).unwrap_err();
    assert!(matches!(err, KvError::InvalidArgument(_)), "{:?}", err);
    assert!(cache.read_block(0, b, cache.backend()).is_ok());
}

#[test]
fn drop_frees_the_cache() {
    let (gpu, cache) = cache(4);
    let raw = cache.raw();
    let mut n = 0usize;
    assert_eq!(unsafe { kvport::ffi::kvport_cache_num_blocks(raw, &mut n) }, kvport::ffi::KVPORT_OK);
    drop(cache);
    assert_eq!(
        unsafe { kvport::ffi::kvport_cache_num_blocks(raw, &mut n) },
        kvport::ffi::KVPORT_ERR_INVALID_HANDLE
    );
    // The backend outlives it; a cache keeps its backend alive on its own.
    let cache = PagedKvCache::new(config(), 4, &gpu).unwrap();
    drop(gpu);
    assert_eq!(cache.backend().name(), "host");
}

#[test]
fn cache_is_send() {
    fn assert_send<T: Send>() {}
    assert_send::<PagedKvCache>();
    assert_send::<Stream>();
    fn assert_send_sync<T: Send + Sync>() {}
    assert_send_sync::<Backend>();
    assert_send_sync::<KvError>();

    let (gpu, mut cache) = cache(4);
    let b = cache.alloc_block().unwrap();
    let handle = std::thread::spawn(move || {
        cache.zero_block(b, &gpu, DEFAULT_STREAM).unwrap();
        assert!(cache.dec_ref(b).unwrap());
        // Errors read the message of the thread that made the call.
        let err = cache.inc_ref(99).unwrap_err();
        assert!(err.message().contains("99"), "{}", err);
        cache.num_free_blocks()
    });
    assert_eq!(handle.join().unwrap(), 4);
}
