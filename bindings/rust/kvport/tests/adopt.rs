// SPDX-License-Identifier: Apache-2.0
//! The engine's streams and memory through the crate: `Stream::wrap` over a
//! stream's vendor handle (the host backend's queue), and
//! `PagedKvCache::adopt` over memory the test allocated.

use std::ffi::c_void;

use kvport::{Backend, KvCacheConfig, KvCacheDtype, KvError, PagedKvCache, Stream};

fn config() -> KvCacheConfig {
    // 2 layers, K (and V) of one block of one layer: 4 * 2 * 16 * 2 = 256 bytes.
    KvCacheConfig::new(2, 2, 16, 4, KvCacheDtype::F16)
}

#[test]
fn a_wrapped_stream_shares_the_engines_queue_and_never_destroys_it() {
    let backend = Backend::host().unwrap();
    let own = Stream::new(&backend).unwrap();
    let vendor = own.vendor_handle().unwrap();
    assert!(!vendor.is_null());
    let cache = PagedKvCache::new(config(), 4, &backend).unwrap();
    {
        let wrapped = Stream::wrap(&backend, vendor).unwrap();
        assert!(wrapped.is_wrapped() && !own.is_wrapped());
        assert_eq!(wrapped.vendor_handle().unwrap(), vendor);
        cache.poison_block(0, &backend, wrapped.as_raw()).unwrap();
        own.synchronize().unwrap(); // the engine's stream waited for the wrap's work
        wrapped.synchronize().unwrap();
    }
    // Dropping the wrap left the stream alive.
    cache.zero_block(0, &backend, own.as_raw()).unwrap();
    own.synchronize().unwrap();
    assert_ne!(backend.default_stream_vendor_handle().unwrap(), vendor);
    match Stream::wrap(&backend, std::ptr::null_mut()) {
        Err(KvError::InvalidArgument(m)) => assert!(m.contains("null handle"), "{}", m),
        other => panic!(
            "expected InvalidArgument, got {:?}",
            other.map(|s| s.as_raw())
        ),
    }
}

#[test]
fn a_cache_over_the_engines_memory() {
    let backend = Backend::host().unwrap();
    let sizes = PagedKvCache::adopted_pool_bytes(&config(), 4).unwrap();
    assert_eq!(sizes, vec![1024; 4]);
    // u128 words: 16-byte aligned, as the pools must be.
    let mut memory = vec![0u128; 4 * 1024 / 16];
    let base = memory.as_mut_ptr() as *mut u8;
    let pools: Vec<(*mut c_void, usize)> = (0..4)
        .map(|i| (unsafe { base.add(i * 1024) } as *mut c_void, 1024))
        .collect();
    {
        let mut cache = unsafe { PagedKvCache::adopt(config(), 4, &backend, &pools) }.unwrap();
        assert!(cache.is_adopted());
        let b = cache.alloc_block().unwrap();
        assert_eq!(cache.k_cache_ptr(1, b).unwrap().as_ptr(), pools[2].0);
        cache
            .write_block(1, b, &[0x5A; 256], &[0xA5; 256], &backend)
            .unwrap();
        assert_eq!(unsafe { *base.add(2 * 1024) }, 0x5A); // the engine's bytes
                                                          // The same memory cannot back a second cache.
        match unsafe { PagedKvCache::adopt(config(), 4, &backend, &pools) } {
            Err(KvError::InvalidArgument(m)) => assert!(m.contains("pool 0 (layer 0 K)"), "{}", m),
            other => panic!(
                "expected InvalidArgument, got {:?}",
                other.map(|c| c.num_blocks())
            ),
        }
    }
    // Never freed: still the engine's memory.
    assert_eq!(unsafe { *base.add(3 * 1024) }, 0xA5);
    let short = [pools[0], pools[1], pools[2]];
    match unsafe { PagedKvCache::adopt(config(), 4, &backend, &short) } {
        Err(KvError::InvalidArgument(m)) => assert!(m.contains("3 pools given"), "{}", m),
        other => panic!(
            "expected InvalidArgument, got {:?}",
            other.map(|c| c.num_blocks())
        ),
    }
    assert!(!PagedKvCache::new(config(), 4, &backend)
        .unwrap()
        .is_adopted());
    drop(memory);
}

/// Adopted ranges are process-wide: a second `Backend` (another engine in the
/// same process) can adopt neither the memory a cache of the first adopted
/// nor the pools a cache of the first allocated; dropping the first cache
/// frees the range.
#[test]
fn two_backends_cannot_adopt_the_same_memory() {
    let first = Backend::host().unwrap();
    let second = Backend::host().unwrap();
    let mut memory = vec![0u128; 4 * 1024 / 16];
    let base = memory.as_mut_ptr() as *mut u8;
    let pools: Vec<(*mut c_void, usize)> = (0..4)
        .map(|i| (unsafe { base.add(i * 1024) } as *mut c_void, 1024))
        .collect();
    let cache = unsafe { PagedKvCache::adopt(config(), 4, &first, &pools) }.unwrap();
    match unsafe { PagedKvCache::adopt(config(), 4, &second, &pools) } {
        Err(KvError::InvalidArgument(m)) => assert!(
            m.contains("pool 0 (layer 0 K)")
                && m.contains("overlaps an adopted range")
                && m.contains("of another host backend object (host memory)"),
            "{}",
            m
        ),
        other => panic!(
            "expected InvalidArgument, got {:?}",
            other.map(|c| c.num_blocks())
        ),
    }
    drop(cache);
    let again = unsafe { PagedKvCache::adopt(config(), 4, &second, &pools) }.unwrap();
    assert!(again.is_adopted());
    drop(again);

    // A cache the first backend allocated: its pools are not the second's.
    let owner = PagedKvCache::new(config(), 4, &first).unwrap();
    let views: Vec<(*mut c_void, usize)> = (0..4)
        .map(|i| {
            let p = if i % 2 == 0 {
                owner.k_cache_ptr(i / 2, 0)
            } else {
                owner.v_cache_ptr(i / 2, 0)
            };
            (p.unwrap().as_ptr(), 1024)
        })
        .collect();
    match unsafe { PagedKvCache::adopt(config(), 4, &second, &views) } {
        Err(KvError::InvalidArgument(m)) => {
            assert!(m.contains("overlaps a live allocation"), "{}", m)
        }
        other => panic!(
            "expected InvalidArgument, got {:?}",
            other.map(|c| c.num_blocks())
        ),
    }
    drop(owner);
    drop(memory);
}

#[test]
fn zero_blocks_is_refused() {
    let backend = Backend::host().unwrap();
    match PagedKvCache::adopted_pool_bytes(&config(), 0) {
        Err(KvError::InvalidArgument(m)) => assert!(m.contains("num_blocks must be > 0"), "{}", m),
        other => panic!("expected InvalidArgument, got {:?}", other),
    }
    let mut memory = vec![0u128; 4 * 1024 / 16];
    let base = memory.as_mut_ptr() as *mut u8;
    let pools: Vec<(*mut c_void, usize)> = (0..4)
        .map(|i| (unsafe { base.add(i * 1024) } as *mut c_void, 1024))
        .collect();
    match unsafe { PagedKvCache::adopt(config(), 0, &backend, &pools) } {
        Err(KvError::InvalidArgument(m)) => assert!(m.contains("num_blocks must be > 0"), "{}", m),
        other => panic!(
            "expected InvalidArgument, got {:?}",
            other.map(|c| c.num_blocks())
        ),
    }
    drop(memory);
}
