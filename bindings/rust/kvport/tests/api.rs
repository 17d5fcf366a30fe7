// SPDX-License-Identifier: Apache-2.0
//! The rest of the crate: the error mapping, dtypes, backends, prefix
//! caches and block tables.

use kvport::ffi;
use kvport::{
    Backend, BlockTable, KvCacheConfig, KvCacheDtype, KvError, PagedKvCache, PrefixCache,
    PrefixHitMode, RegionLayout, DEFAULT_STREAM,
};

#[test]
fn every_status_maps_to_its_variant() {
    let cases: Vec<(ffi::kvport_status, fn(&KvError) -> bool)> = vec![
        (ffi::KVPORT_ERR_ERROR, |e| matches!(e, KvError::Error(_))),
        (ffi::KVPORT_ERR_INVALID_ARGUMENT, |e| matches!(e, KvError::InvalidArgument(_))),
        (ffi::KVPORT_ERR_CACHE_EXHAUSTED, |e| matches!(e, KvError::CacheExhausted(_))),
        (ffi::KVPORT_ERR_OUT_OF_MEMORY, |e| matches!(e, KvError::OutOfMemory(_))),
        (ffi::KVPORT_ERR_BACKEND, |e| matches!(e, KvError::Backend(_))),
        (ffi::KVPORT_ERR_DEVICE_LOST, |e| matches!(e, KvError::DeviceLost(_))),
        (ffi::KVPORT_ERR_OUT_OF_RANGE, |e| matches!(e, KvError::OutOfRange(_))),
        (ffi::KVPORT_ERR_INVALID_HANDLE, |e| matches!(e, KvError::InvalidHandle(_))),
        (ffi::KVPORT_ERR_HANDLE_IN_USE, |e| matches!(e, KvError::HandleInUse(_))),
        (ffi::KVPORT_ERR_UNKNOWN, |e| matches!(e, KvError::Unknown(_))),
    ];
    assert!(kvport::testing_fail_with(ffi::KVPORT_OK).is_ok());
    for (status, is_variant) in cases {
        let err = kvport::testing_fail_with(status).unwrap_err();
        assert!(is_variant(&err), "status {} gave {:?}", status, err);
        assert_eq!(err.status(), status);
        assert!(!err.message().is_empty(), "{:?}", err);
        assert!(err.status_name().starts_with("KVPORT_ERR_"));
        assert!(err.to_string().starts_with(err.status_name()));
    }
    // A value outside kvport_status: an argument error, not undefined behaviour.
    assert!(matches!(kvport::testing_fail_with(99), Err(KvError::InvalidArgument(_))));
    // A status the crate does not know.
    let e = KvError::from_status(42, "m".into()).unwrap();
    assert!(matches!(e, KvError::Unknown(ref m) if m.contains("42")));
    assert!(KvError::from_status(ffi::KVPORT_OK, String::new()).is_none());
}

#[test]
fn version_and_dtypes() {
    assert!(!kvport::version().is_empty());
    assert_eq!(kvport::version().split('.').count(), 3);
    for d in KvCacheDtype::ALL.iter().copied() {
        assert_eq!(KvCacheDtype::from_name(d.name()).unwrap(), d);
        assert_eq!(KvCacheDtype::from_raw(d.as_raw()), Some(d));
    }
    assert_eq!(KvCacheDtype::from_name("bfloat16").unwrap(), KvCacheDtype::Bf16);
    assert_eq!(KvCacheDtype::F16.to_string(), "f16");
    assert!(matches!(KvCacheDtype::from_name("int3"), Err(KvError::InvalidArgument(_))));
    let r = RegionLayout::new(KvCacheDtype::F16, 4, 2, 16).unwrap();
    assert_eq!(r.data_bytes, 256);
    assert_eq!(r.total_bytes, 256);
    assert!(RegionLayout::new(KvCacheDtype::F16, 0, 2, 16).is_err());
}

#[test]
fn backends() {
    let host = Backend::new("host").unwrap();
    assert_eq!(host.name(), "host");
    assert_eq!(host.device_count().unwrap(), 1);
    let (free, total) = host.mem_info().unwrap();
    assert!(total > 0 && free <= total);
    host.synchronize().unwrap();
    assert!(host.same_as(&host.clone()));
    assert!(!host.same_as(&Backend::host().unwrap()));
    match Backend::new("no-such-backend") {
        Err(KvError::InvalidArgument(m)) => assert!(m.contains("host"), "{}", m),
        other => panic!("{:?}", other.map(|_| ())),
    }
    // "default" is whatever this machine has; it must build a cache.
    let gpu = Backend::new("default").unwrap();
    let mut cache = PagedKvCache::new(KvCacheConfig::new(1, 1, 16, 4, KvCacheDtype::F16), 2, &gpu).unwrap();
    let b = cache.alloc_block().unwrap();
    cache.zero_block(b, &gpu, DEFAULT_STREAM).unwrap();
    assert!(cache.read_block(0, b, &gpu).unwrap().0.iter().all(|&x| x == 0));
}

#[test]
fn prefix_cache_and_block_tables() {
    let gpu = Backend::host().unwrap();
    let cache = PagedKvCache::new(KvCacheConfig::new(2, 2, 16, 4, KvCacheDtype::F16), 16, &gpu).unwrap();
    let prompt: Vec<u32> = (1000..1010).collect(); // 2 full blocks of 4 + 2 tokens
    {
        let prefix = PrefixCache::new(&cache).unwrap();
        {
            let mut seq = BlockTable::with_prefix_cache(&prefix, 0).unwrap();
            assert_eq!(seq.prefix_hit_mode(), PrefixHitMode::ComputeLastToken);
            assert_eq!(seq.reuse_cached_prefix(&prompt, DEFAULT_STREAM).unwrap(), 0);
            assert_eq!(seq.blocks_needed(prompt.len()).unwrap(), 3);
            seq.append_tokens(&prompt, DEFAULT_STREAM).unwrap();
            assert_eq!(seq.num_tokens(), 10);
            assert_eq!(seq.block_ids().len(), 3);
            let fork = seq.fork().unwrap();
            assert_eq!(fork.block_ids(), seq.block_ids());
            assert_eq!(cache.ref_count(seq.block_ids()[0]).unwrap(), 3, "seq + fork + prefix cache");
        }
        assert_eq!(prefix.num_cached_blocks(), 2);
        let mut again = BlockTable::with_prefix_cache(&prefix, 0).unwrap();
        assert_eq!(again.reuse_cached_prefix(&prompt, DEFAULT_STREAM).unwrap(), 8);
        let hit = prefix.lookup(&prompt, 0).unwrap();
        assert_eq!(hit, again.block_ids()[..2].to_vec());
        prefix.release_blocks(&hit).unwrap(); // a lookup's references are the caller's
        assert_eq!(prefix.lookup(&prompt, 7).unwrap().len(), 0, "another extra key");
        let hit = prefix.lookup(&prompt, 0).unwrap();
        prefix.release_blocks(&hit).unwrap();
        assert!(prefix.counters().hits >= 1);
        assert!(prefix.check_invariants().unwrap().ok);
        again.release().unwrap();
        assert_eq!(again.num_tokens(), 0);
        assert_eq!(prefix.num_evictable_blocks(), 2);
        assert_eq!(prefix.evict(1).unwrap(), 1);
        assert_eq!(prefix.num_cached_blocks(), 1);
        assert_eq!(prefix.num_available_blocks(), 16, "free + evictable");
        let b = prefix.alloc().unwrap();
        prefix.release(b).unwrap();
        assert!(prefix.try_alloc().is_some());
    }
    // A plain table over the cache, without prefix caching.
    let mut t = BlockTable::new(&cache).unwrap();
    t.append_tokens(&prompt, DEFAULT_STREAM).unwrap();
    assert_eq!(t.block_ids().len(), 3);
    assert_eq!(t.copy_on_writes(), 0);
    let err = t.append_tokens(&vec![1u32; 4 * 64], DEFAULT_STREAM).unwrap_err();
    assert!(err.is_cache_exhausted(), "{:?}", err);
    assert_eq!(t.num_tokens(), 10, "all or nothing");
}

#[test]
fn k_only_layers() {
    // head_dim_v 0 (MLA's latent): K pools only.
    let gpu = Backend::host().unwrap();
    let mut config = KvCacheConfig::new(2, 2, 16, 4, KvCacheDtype::F16);
    config.head_dim_v = 0;
    assert!(!config.has_v());
    assert_eq!(config.bytes_per_block().unwrap(), 2 * 4 * 2 * 16 * 2);
    let mut cache = PagedKvCache::new(config, 4, &gpu).unwrap();
    let kb = cache.k_block_bytes_for_layer(1).unwrap();
    assert_eq!(cache.v_block_bytes_for_layer(1).unwrap(), 0);
    for e in [
        cache.v_cache_ptr(0, 0).unwrap_err(),
        cache.v_pool_ptr(1).unwrap_err(),
        cache.v_block_stride_bytes_for_layer(0).unwrap_err(),
    ] {
        assert!(matches!(e, KvError::InvalidArgument(ref m) if m.contains("no V")), "{:?}", e);
    }
    let b = cache.alloc_block().unwrap();
    let k: Vec<u8> = (0..kb).map(|i| (i * 3 + 1) as u8).collect();
    cache.write_block(1, b, &k, &[], &gpu).unwrap();
    assert!(matches!(cache.write_block(1, b, &k, &[1], &gpu), Err(KvError::InvalidArgument(_))));
    let (rk, rv) = cache.read_block(1, b, &gpu).unwrap();
    assert_eq!(rk, k);
    assert!(rv.is_empty());
    cache.zero_blocks(&[b], DEFAULT_STREAM).unwrap();
    cache.synchronize().unwrap();
    assert!(cache.read_block(1, b, &gpu).unwrap().0.iter().all(|&x| x == 0));
    assert!(cache.check_invariants().unwrap().ok);
}
