// SPDX-License-Identifier: Apache-2.0
//! KV cache events through the crate: enable on 127.0.0.1 port 0, the bound
//! endpoints, the counters after stores and a flush, disable, and the errors.
//! (The wire itself is checked by the C and Python tests, which subscribe.)

use std::time::Duration;

use kvport::{
    Backend, BlockTable, EventForm, EventsOptions, HybridBlockTable, HybridKvCache, KvCacheConfig, KvCacheDtype,
    KvError, LayerSpec, PagedKvCache, PrefixCache, DEFAULT_STREAM,
};

fn local() -> EventsOptions {
    let mut o = EventsOptions::new("tcp://127.0.0.1:0");
    o.batch_interval = Duration::from_millis(1);
    o
}

#[test]
fn prefix_cache_events() {
    let gpu = Backend::new("host").unwrap();
    let cache = PagedKvCache::new(KvCacheConfig::new(2, 2, 16, 4, KvCacheDtype::F16), 16, &gpu).unwrap();
    let prefix = PrefixCache::new(&cache).unwrap();
    assert!(matches!(prefix.events_stats(), Err(KvError::InvalidArgument(_))));
    assert!(matches!(prefix.events_endpoint(), Err(KvError::InvalidArgument(_))));
    assert!(matches!(prefix.flush_events(Duration::from_millis(1)), Err(KvError::InvalidArgument(_))));
    prefix.disable_events().unwrap();

    for bad in ["", "not-an-endpoint", "tcp://127.0.0.1:notaport", "tcp://127.0.0.1:\0"] {
        let e = prefix.enable_events(&EventsOptions::new(bad)).unwrap_err();
        assert!(matches!(e, KvError::InvalidArgument(_)), "{:?}: {:?}", bad, e);
    }
    let mut negative = local();
    negative.send_high_water_mark = -1;
    assert!(matches!(prefix.enable_events(&negative), Err(KvError::InvalidArgument(_))));

    let mut options = local();
    options.topic = "kv@pod-0@model".to_string();
    options.data_parallel_rank = Some(1);
    options.replay_endpoint = Some("tcp://127.0.0.1:0".to_string());
    options.form = EventForm::Positional;
    prefix.enable_events(&options).unwrap();
    let e = prefix.enable_events(&options).unwrap_err();
    assert!(matches!(e, KvError::InvalidArgument(ref m) if m.contains("enabled already")), "{:?}", e);
    let endpoint = prefix.events_endpoint().unwrap();
    assert!(endpoint.starts_with("tcp://127.0.0.1:") && endpoint != "tcp://127.0.0.1:0", "{}", endpoint);
    let replay = prefix.events_replay_endpoint().unwrap().unwrap();
    assert!(replay.starts_with("tcp://127.0.0.1:") && replay != endpoint);

    // The same port again: the bind fails.
    let other_cache = PagedKvCache::new(KvCacheConfig::new(2, 2, 16, 4, KvCacheDtype::F16), 4, &gpu).unwrap();
    let other = PrefixCache::new(&other_cache).unwrap();
    let e = other.enable_events(&EventsOptions::new(&endpoint)).unwrap_err();
    assert!(matches!(e, KvError::InvalidArgument(ref m) if m.contains(&endpoint)), "{:?}", e);

    // Two blocks stored in one event, published (to no subscriber).
    let mut table = BlockTable::with_prefix_cache(&prefix, 0).unwrap();
    table.append_tokens(&[1, 2, 3, 4, 5, 6, 7, 8], DEFAULT_STREAM).unwrap();
    assert!(prefix.flush_events(Duration::from_secs(2)).unwrap());
    let stats = prefix.events_stats().unwrap();
    assert_eq!(stats.events_accepted, 1);
    assert_eq!((stats.batches_sent, stats.next_seq, stats.events_dropped), (1, 1, 0));
    drop(table);

    prefix.disable_events().unwrap();
    assert!(matches!(prefix.events_stats(), Err(KvError::InvalidArgument(_))));
    // On again: the two cached blocks are announced; dropped with events on.
    prefix.enable_events(&local()).unwrap();
    assert_eq!(prefix.events_stats().unwrap().events_accepted, 2);
    assert_eq!(prefix.events_replay_endpoint().unwrap(), None);
}

#[test]
fn hybrid_cache_events() {
    let gpu = Backend::new("host").unwrap();
    let layers = [
        LayerSpec::sliding_window(8, 1, 8, 8, KvCacheDtype::Bf16),
        LayerSpec::full_attention(1, 8, 8, KvCacheDtype::Bf16),
    ];
    let cache = HybridKvCache::new(&layers, 4, 1, &[16, 16], &gpu).unwrap();
    assert!(matches!(cache.events_stats(), Err(KvError::InvalidArgument(_))));
    assert!(matches!(cache.enable_events(&EventsOptions::new("nope")), Err(KvError::InvalidArgument(_))));
    cache.enable_events(&local()).unwrap();
    assert!(cache.events_endpoint().unwrap().starts_with("tcp://127.0.0.1:"));
    assert_eq!(cache.events_replay_endpoint().unwrap(), None);
    {
        let mut t = HybridBlockTable::new(&cache, 0).unwrap();
        t.append_tokens(&[1, 2, 3, 4], DEFAULT_STREAM).unwrap();
    }
    assert!(cache.flush_events(Duration::from_secs(2)).unwrap());
    let stats = cache.events_stats().unwrap();
    assert_eq!(stats.events_accepted, 2); // one block in each group
    assert_eq!(stats.events_dropped, 0);
    cache.disable_events().unwrap();
    cache.disable_events().unwrap();
    cache.enable_events(&local()).unwrap(); // destroyed with events on
}
