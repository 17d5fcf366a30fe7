// SPDX-License-Identifier: Apache-2.0
//! Layer specs, the planner, hybrid caches and hybrid block tables: window
//! freeing, hybrid prefix hits, state checkpoints read back through a group
//! pool, all-or-nothing appends, fork, and the errors.

use kvport::{
    plan_kv_cache, vllm_row_width, Backend, Batch, BlockTable, HybridBlockTable, HybridKvCache, KvCacheConfig, KvCacheDtype, KvError,
    LayerKind, LayerLocation, LayerSpec, MlaFormat, PagedKvCache, PlanRequest, PrefixCache, PrefixHitMode,
    StateDtype, StateTensor, DEFAULT_STREAM, NULL_BLOCK,
};

const BS: usize = 4;

fn tokens(n: usize, first: u32) -> Vec<u32> {
    (0..n as u32).map(|i| first + i).collect()
}

fn nulls(blocks: &[u32]) -> usize {
    blocks.iter().filter(|&&b| b == NULL_BLOCK).count()
}

fn window(w: usize) -> LayerSpec {
    LayerSpec::sliding_window(w, 1, 8, 8, KvCacheDtype::Bf16)
}

fn full() -> LayerSpec {
    LayerSpec::full_attention(1, 8, 8, KvCacheDtype::Bf16)
}

/// A 2x2 f32 "ssm" (16 B) and a 3-element f16 "conv" (6 B, padded to 16).
fn state() -> LayerSpec {
    LayerSpec::state(vec![
        StateTensor::new("ssm", &[2, 2], StateDtype::F32),
        StateTensor::new("conv", &[3], StateDtype::F16),
    ])
}

/// Group 0 full (layer 0), group 1 state (layers 1, 2), group 2 MLA (layer 3);
/// layer 4 has no KV.
fn mamba_layers() -> Vec<LayerSpec> {
    vec![full(), state(), state(), LayerSpec::mla(8, 4, KvCacheDtype::Bf16, MlaFormat::Plain), LayerSpec::none()]
}

#[test]
fn layer_specs() {
    let w = LayerSpec::sliding_window(128, 8, 64, 64, KvCacheDtype::Bf16);
    w.validate(16).unwrap();
    assert_eq!(w.describe().unwrap(), "sliding_window(128) 8x64 bf16");
    assert_eq!(w.block_bytes(16).unwrap(), 2 * 16 * 8 * 64 * 2);
    let ds = LayerSpec::mla(512, 64, KvCacheDtype::Bf16, MlaFormat::Plain);
    assert_eq!(ds.block_bytes(16).unwrap(), 16 * 576 * 2);
    assert_eq!(LayerSpec::mla(512, 64, KvCacheDtype::Bf16, MlaFormat::Fp8DsMla).block_bytes(16).unwrap(), 16 * 656);
    let s = state();
    assert_eq!(s.state_bytes().unwrap(), 32);
    assert_eq!(s.state_offset(1).unwrap(), 16);
    assert_eq!(s.describe().unwrap(), "state(ssm 2x2 f32, conv 3 f16)");
    assert!(matches!(s.state_offset(2), Err(KvError::OutOfRange(_))));
    assert_eq!(LayerSpec::none().describe().unwrap(), "none");

    match window(0).validate(16) {
        Err(KvError::InvalidArgument(m)) => assert!(m.contains("window"), "{}", m),
        other => panic!("{:?}", other),
    }
    assert!(LayerSpec::chunked_local(6, 1, 8, 8, KvCacheDtype::Bf16).validate(4).is_err());
    assert!(LayerSpec::mla(100, 64, KvCacheDtype::Bf16, MlaFormat::Fp8DsMla).validate(16).is_err());
    assert!(LayerSpec::state(vec![]).validate(16).is_err());
    let nine = LayerSpec::state(vec![StateTensor::new("x", &[1; 9], StateDtype::F32)]);
    assert!(matches!(nine.validate(16), Err(KvError::InvalidArgument(m)) if m.contains("at most 8")));
    let nul = LayerSpec::state(vec![StateTensor::new("a\0b", &[1], StateDtype::F32)]);
    assert!(matches!(nul.validate(16), Err(KvError::InvalidArgument(m)) if m.contains("NUL")));
    // State tensor names are unique; a 0 dimension is named with its tensor.
    let twice = LayerSpec::state(vec![
        StateTensor::new("ssm", &[2, 2], StateDtype::F32),
        StateTensor::new("ssm", &[3], StateDtype::F16),
    ]);
    match twice.validate(16) {
        Err(KvError::InvalidArgument(m)) => {
            assert!(m.contains("state tensors 0 and 1 are both named 'ssm'"), "{}", m)
        }
        other => panic!("{:?}", other),
    }
    assert!(twice.state_bytes().is_err());
    let zero = LayerSpec::state(vec![StateTensor::new("conv", &[3, 0], StateDtype::F16)]);
    match zero.validate(16) {
        Err(KvError::InvalidArgument(m)) => {
            assert!(m.contains("StateTensor 'conv': dimension 1 is 0"), "{}", m)
        }
        other => panic!("{:?}", other),
    }
    assert_eq!(StateDtype::from_raw(StateDtype::Bf16.as_raw()), Some(StateDtype::Bf16));
    assert_eq!(LayerKind::from_raw(LayerKind::State.as_raw()), Some(LayerKind::State));
    assert_eq!(LayerKind::from_raw(42), None);
}

/// gpt-oss-like: window 128 and full attention alternating, 8 x 64 bf16.
#[test]
fn plan_splits_by_peak_need() {
    let layers: Vec<LayerSpec> = (0..4)
        .map(|i| {
            if i % 2 == 0 {
                LayerSpec::sliding_window(128, 8, 64, 64, KvCacheDtype::Bf16)
            } else {
                LayerSpec::full_attention(8, 64, 64, KvCacheDtype::Bf16)
            }
        })
        .collect();
    let request = PlanRequest::new(64 << 20, 4096);
    assert_eq!(request.step_tokens, 1);
    assert_eq!(request.state_checkpoints, 1);
    let plan = plan_kv_cache(&layers, 16, &request).unwrap();
    assert_eq!(plan.groups.len(), 2);
    assert_eq!(plan.groups[0].kind, LayerKind::SlidingWindow);
    assert_eq!(plan.groups[0].num_layers, 2);
    assert_eq!(plan.groups[0].peak_blocks_per_request, 9); // ceil(127 / 16) + 1
    assert_eq!(plan.groups[1].peak_blocks_per_request, 256);
    assert_eq!(plan.total_bytes, plan.groups.iter().map(|g| g.bytes).sum::<usize>());
    assert!(plan.total_bytes <= request.budget_bytes);
    assert!((plan.ratio_to_all_full - 265.0 / 512.0).abs() < 1e-9, "{}", plan.ratio_to_all_full);
    assert_eq!(plan.blocks_per_group(), vec![plan.groups[0].num_blocks, plan.groups[1].num_blocks]);

    // A cache from the plan fits the budget.
    let gpu = Backend::host().unwrap();
    let cache = HybridKvCache::from_plan(&layers, &plan, 1, &gpu).unwrap();
    assert_eq!(cache.total_bytes(), plan.total_bytes);

    let too_many = PlanRequest { max_requests: 1_000_000, ..request };
    assert!(matches!(plan_kv_cache(&layers, 16, &too_many), Err(KvError::InvalidArgument(m)) if m.contains("holds")));
    assert!(plan_kv_cache(&[LayerSpec::none()], 16, &request).is_err());
    assert!(plan_kv_cache(&layers, 16, &PlanRequest::default()).is_err(), "no budget");
}

#[test]
fn groups_locations_and_pools() {
    let gpu = Backend::host().unwrap();
    let cache = HybridKvCache::new(&mamba_layers(), BS, 1, &[16, 8, 16], &gpu).unwrap();
    assert_eq!(cache.num_layers(), 5);
    assert_eq!(cache.num_groups(), 3);
    assert_eq!(cache.block_size(), BS);
    assert_eq!(cache.group_kind(1).unwrap(), LayerKind::State);
    assert_eq!(cache.group_spec(1).unwrap(), state());
    assert_eq!(cache.group_spec(2).unwrap().kv_lora_rank, 8);
    assert_eq!(cache.group_layers(1).unwrap(), vec![1, 2]);
    assert_eq!(cache.locate(2).unwrap(), Some(LayerLocation { group: 1, index: 1 }));
    assert_eq!(cache.locate(4).unwrap(), None);
    assert!(matches!(cache.locate(5), Err(KvError::OutOfRange(_))));
    assert!(matches!(cache.group_kind(3), Err(KvError::OutOfRange(_))));
    assert!(matches!(cache.group_layers(3), Err(KvError::OutOfRange(_))));
    assert!(matches!(cache.group_pool(3), Err(KvError::OutOfRange(_))));

    // The state pool: one slot a block, K only.
    let pool = cache.group_pool(1).unwrap();
    assert_eq!(pool.config().block_size, 1);
    assert_eq!(pool.config().head_dim_v, 0);
    assert_eq!(pool.config().dtype, KvCacheDtype::Fp8E4m3);
    assert_eq!(pool.num_blocks(), 8);
    assert_eq!(pool.k_block_bytes_for_layer(1).unwrap(), 32);
    assert_eq!(pool.v_block_bytes_for_layer(1).unwrap(), 0);
    assert!(matches!(pool.v_pool_ptr(0), Err(KvError::InvalidArgument(_))));
    let base = pool.k_pool_ptr(0).unwrap();
    let stride = pool.k_block_stride_bytes_for_layer(0).unwrap();
    assert_eq!(pool.k_cache_ptr(0, 3).unwrap(), base.offset(3 * stride));
    assert!(pool.check_invariants().unwrap().ok);
    // MLA: 8 + 4 bf16 a token, no V.
    assert_eq!(cache.group_pool(2).unwrap().k_block_bytes_for_layer(0).unwrap(), BS * 12 * 2);
    let total: usize = (0..3).map(|g| cache.group_pool(g).unwrap().total_bytes()).sum();
    assert_eq!(cache.total_bytes(), total);
    drop(pool); // a group pool is not destroyed on its own
    assert!(cache.group_pool(1).unwrap().check_invariants().unwrap().ok);

    // Errors of creation.
    assert!(matches!(
        HybridKvCache::new(&mamba_layers(), BS, 1, &[16, 8], &gpu),
        Err(KvError::InvalidArgument(m)) if m.contains("2 block counts for 3")
    ));
    assert!(HybridKvCache::new(&mamba_layers(), BS, 1, &[16, 0, 16], &gpu).is_err());
    assert!(HybridKvCache::new(&[window(0)], BS, 1, &[16], &gpu).is_err());
}

#[test]
fn window_freeing_hits_and_all_or_nothing() {
    let gpu = Backend::host().unwrap();
    let layers = vec![window(8), full(), window(8)];
    let cache = HybridKvCache::new(&layers, BS, 1, &[16, 16], &gpu).unwrap();
    {
        let mut a = HybridBlockTable::new(&cache, 0).unwrap();
        for t in tokens(40, 1) {
            a.append_tokens(&[t], DEFAULT_STREAM).unwrap();
        }
        // Blocks wholly before token 39 - 8 + 1 = 32 are released.
        let w = a.blocks(0).unwrap();
        assert_eq!(w.len(), 10);
        assert_eq!(nulls(&w), 8);
        assert_eq!(a.num_live_blocks(0).unwrap(), 2);
        assert_eq!(nulls(&a.blocks(1).unwrap()), 0);
        assert_eq!(a.state_slot(0).unwrap(), None);
        assert!(matches!(a.blocks(2), Err(KvError::OutOfRange(_))));
        assert!(cache.check_invariants().unwrap().ok);
    }
    // The same prompt again hits 32 of 33 tokens; the window needs only
    // blocks 6 and 7 of it.
    let prompt = tokens(33, 1);
    {
        let mut a = HybridBlockTable::new(&cache, 0).unwrap();
        a.append_tokens(&prompt, DEFAULT_STREAM).unwrap();
    }
    let mut b = HybridBlockTable::new(&cache, 0).unwrap();
    assert_eq!(b.prefix_hit_mode(), PrefixHitMode::ComputeLastToken);
    assert_eq!(b.reuse_cached_prefix(&prompt, DEFAULT_STREAM).unwrap(), 32);
    assert_eq!(nulls(&b.blocks(0).unwrap()), 6);
    assert_eq!(nulls(&b.blocks(1).unwrap()), 0);
    assert!(matches!(b.reuse_cached_prefix(&prompt, DEFAULT_STREAM), Err(KvError::InvalidArgument(_))));
    assert_eq!(cache.hit_counters().hit_tokens, 32);
    b.append_tokens(&prompt[32..], DEFAULT_STREAM).unwrap();
    let mut full_mode = HybridBlockTable::new(&cache, 0).unwrap();
    full_mode.set_prefix_hit_mode(PrefixHitMode::Full).unwrap();
    assert_eq!(full_mode.reuse_cached_prefix(&prompt[..32], DEFAULT_STREAM).unwrap(), 32);
    let mut other_key = HybridBlockTable::new(&cache, 9).unwrap();
    assert_eq!(other_key.reuse_cached_prefix(&prompt, DEFAULT_STREAM).unwrap(), 0);

    // fork shares; the child's append copies the shared last block.
    let mut child = b.fork(DEFAULT_STREAM).unwrap();
    child.append_tokens(&[7], DEFAULT_STREAM).unwrap();
    assert!(child.copy_on_writes() >= 1);
    assert_eq!(b.copy_on_writes(), 0);
    drop(child);
    b.release().unwrap();
    assert_eq!(b.num_tokens(), 0);

    // A window group of 3 blocks: 9 tokens after 12 need 3 fresh blocks and
    // get 1 back first; nothing changes when they do not fit.
    let small = HybridKvCache::new(&layers, BS, 1, &[3, 16], &gpu).unwrap();
    let mut t = HybridBlockTable::new(&small, 0).unwrap();
    t.append_tokens(&tokens(12, 1), DEFAULT_STREAM).unwrap();
    assert!(!t.can_append(9));
    let need = t.blocks_needed(9);
    assert_eq!((need[0].fresh, need[0].released), (3, 1));
    assert_eq!((need[1].fresh, need[1].released), (3, 0));
    match t.append_tokens(&tokens(9, 100), DEFAULT_STREAM) {
        Err(e) => assert!(e.is_cache_exhausted() && e.message().contains("group 0"), "{}", e),
        Ok(()) => panic!("appended past the window pool"),
    }
    assert_eq!(t.num_tokens(), 12);
    assert!(t.can_append(1));
    t.append_tokens(&[100], DEFAULT_STREAM).unwrap();
    assert_eq!(t.blocks(0).unwrap()[0], NULL_BLOCK);
    assert!(small.check_invariants().unwrap().ok);
}

#[test]
fn speculative_drafts_are_hit_only_once_committed() {
    let gpu = Backend::host().unwrap();
    let layers = vec![window(8), full()];
    let cache = HybridKvCache::new(&layers, BS, 1, &[16, 16], &gpu).unwrap();
    let all = tokens(17, 1);
    let hit_of = |n: usize| {
        let mut probe = HybridBlockTable::new(&cache, 0).unwrap();
        probe.reuse_cached_prefix(&all[..n], DEFAULT_STREAM).unwrap()
    };
    let mut t = HybridBlockTable::new(&cache, 0).unwrap();
    t.append_tokens(&all[..8], DEFAULT_STREAM).unwrap();
    t.append_draft(&all[8..16], DEFAULT_STREAM).unwrap();
    assert_eq!((t.num_tokens(), t.num_committed()), (16, 8));
    assert_eq!(hit_of(17), 8); // the drafts are not cached
    assert!(matches!(t.commit(9), Err(KvError::InvalidArgument(_))));
    t.commit(4).unwrap();
    assert_eq!(hit_of(17), 12);
    assert!(matches!(t.truncate(11), Err(KvError::InvalidArgument(_))));
    assert!(matches!(t.append_tokens(&[1], DEFAULT_STREAM), Err(KvError::InvalidArgument(_))));
    t.truncate(12).unwrap();
    assert_eq!(t.blocks(1).unwrap().len(), 3);
    assert!(t.check_invariants().unwrap().ok);
    t.append_tokens(&[99], DEFAULT_STREAM).unwrap();
    assert!(cache.check_invariants().unwrap().ok);

    // A state group (group 1): a slot per draft; the accepted one's works on.
    let with_state = HybridKvCache::new(&mamba_layers(), BS, 1, &[8, 4, 8], &gpu).unwrap();
    let mut s = HybridBlockTable::new(&with_state, 0).unwrap();
    s.append_tokens(&tokens(2, 1), DEFAULT_STREAM).unwrap();
    assert!(s.can_append_draft(3) && !s.can_append_draft(4));
    s.append_draft(&[5, 6], DEFAULT_STREAM).unwrap();
    assert_eq!(s.num_draft_tokens(), 2);
    let slots = s.draft_state_slots(1).unwrap();
    assert_eq!(slots.len(), 2);
    assert!(s.draft_state_slots(0).unwrap().is_empty());
    assert!(matches!(s.draft_state_slots(9), Err(KvError::OutOfRange(_))));
    s.commit(1).unwrap();
    assert_eq!(s.state_slot(1).unwrap(), Some(slots[0]));
    s.truncate(3).unwrap();
    assert!(s.draft_state_slots(1).unwrap().is_empty());
    assert!(s.check_invariants().unwrap().ok);
}

#[test]
fn batch_metadata_follows_the_kernels_rules() {
    let gpu = Backend::host().unwrap();
    let layers = vec![window(4), full()];
    let cache = HybridKvCache::new(&layers, BS, 1, &[16, 16], &gpu).unwrap();
    let mut a = HybridBlockTable::new(&cache, 0).unwrap();
    a.append_tokens(&tokens(10, 1), DEFAULT_STREAM).unwrap();
    let mut b = HybridBlockTable::new(&cache, 0).unwrap();
    b.append_tokens(&tokens(3, 50), DEFAULT_STREAM).unwrap();
    let (fa, fb) = (a.blocks(1).unwrap(), b.blocks(1).unwrap());
    let tables = [&a, &b];
    let batch = Batch { tables: &tables, num_new_tokens: &[1, 3], group: 1, kernel_block_size: 0, null_block: 0 };
    assert_eq!(vllm_row_width(32, 4).unwrap(), 32);
    assert!(matches!(vllm_row_width(0, 4), Err(KvError::InvalidArgument(_))));
    let rows = batch.block_table_rows(8, 3).unwrap();
    assert_eq!(&rows[..4], &[fa[0] as i32, fa[1] as i32, fa[2] as i32, 0]);
    assert_eq!(&rows[8..10], &[fb[0] as i32, 0]);
    assert!(rows[16..].iter().all(|&x| x == 0));
    let loc = batch.token_locations(12, 2).unwrap();
    assert_eq!(loc[9], fa[2] as i32 * 4 + 1);
    assert_eq!(loc[12], fb[0] as i32 * 4);
    assert_eq!(loc[15], 0);
    let slots = batch.slot_mapping(6).unwrap();
    assert_eq!(slots[0], fa[2] as i64 * 4 + 1);
    assert_eq!(&slots[1..4], &[fb[0] as i64 * 4, fb[0] as i64 * 4 + 1, fb[0] as i64 * 4 + 2]);
    assert_eq!(&slots[4..], &[-1, -1]);
    let p = batch.flashinfer_pages().unwrap();
    assert_eq!(p.indptr, vec![0, 3, 4]);
    assert_eq!(p.last_page_len, vec![2, 3]);
    assert_eq!(p.kv_len, vec![10, 3]);
    let halves = Batch { kernel_block_size: 2, ..Batch { tables: &tables, num_new_tokens: &[1, 3], group: 1, kernel_block_size: 0, null_block: 0 } };
    assert_eq!(&halves.block_table_rows(8, 2).unwrap()[..2], &[fa[0] as i32 * 2, fa[0] as i32 * 2 + 1]);
    let bad = Batch { tables: &tables, num_new_tokens: &[1], group: 1, kernel_block_size: 0, null_block: 0 };
    assert!(matches!(bad.slot_mapping(4), Err(KvError::InvalidArgument(_))));
    let odd = Batch { tables: &tables, num_new_tokens: &[1, 3], group: 1, kernel_block_size: 3, null_block: 0 };
    assert!(matches!(odd.flashinfer_pages(), Err(KvError::InvalidArgument(_))));
}

#[test]
fn state_checkpoints_hit_with_the_same_bytes() {
    let gpu = Backend::host().unwrap();
    let cache = HybridKvCache::new(&mamba_layers(), BS, 1, &[16, 8, 16], &gpu).unwrap();
    let pool = cache.group_pool(1).unwrap();
    let prompt = tokens(9, 1);
    let write_state = |slot: u32, byte: u8| {
        for layer in 0..2 {
            pool.write_block(layer, slot, &[byte; 32], &[], &gpu).unwrap();
        }
    };
    {
        let mut a = HybridBlockTable::new(&cache, 0).unwrap();
        assert_eq!(a.state_slot(1).unwrap(), None);
        a.append_tokens(&prompt[..4], DEFAULT_STREAM).unwrap();
        let slot = a.state_slot(1).unwrap().expect("a working slot");
        assert_eq!(pool.read_block(0, slot, &gpu).unwrap(), (vec![0u8; 32], vec![]), "zeroed");
        write_state(slot, 0x11);
        a.append_tokens(&prompt[4..8], DEFAULT_STREAM).unwrap(); // checkpoint at 4
        write_state(slot, 0x22);
        a.append_tokens(&prompt[8..], DEFAULT_STREAM).unwrap(); // checkpoint at 8
    }
    assert_eq!(cache.hit_counters().state_checkpoints, 2);
    let mut b = HybridBlockTable::new(&cache, 0).unwrap();
    assert_eq!(b.reuse_cached_prefix(&prompt, DEFAULT_STREAM).unwrap(), 8);
    let slot = b.state_slot(1).unwrap().expect("the checkpoint's copy");
    cache.synchronize().unwrap();
    for layer in 0..2 {
        assert_eq!(pool.read_block(layer, slot, &gpu).unwrap().0, vec![0x22u8; 32]);
    }
    assert_eq!(b.blocks(1).unwrap(), Vec::<u32>::new(), "a state group has no block list");
    let child = b.fork(DEFAULT_STREAM).unwrap();
    let child_slot = child.state_slot(1).unwrap().unwrap();
    assert_ne!(child_slot, slot);
    assert_eq!(pool.read_block(1, child_slot, &gpu).unwrap().0, vec![0x22u8; 32]);
    assert!(cache.check_invariants().unwrap().ok);

    // One state slot: no room for a fork's copy, nor for a second sequence.
    let tight = HybridKvCache::new(&mamba_layers(), BS, 0, &[16, 1, 16], &gpu).unwrap();
    let mut a = HybridBlockTable::new(&tight, 0).unwrap();
    a.append_tokens(&prompt[..6], DEFAULT_STREAM).unwrap();
    assert!(a.fork(DEFAULT_STREAM).unwrap_err().is_cache_exhausted());
    let mut other = HybridBlockTable::new(&tight, 0).unwrap();
    assert!(!other.can_append(1));
    assert!(other.append_tokens(&[1], DEFAULT_STREAM).unwrap_err().is_cache_exhausted());
    assert!(tight.check_invariants().unwrap().ok);
}

#[test]
fn the_docs_example_is_examples_hybrid() {
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR"));
    let doc = match std::fs::read_to_string(dir.join("../../../docs/bindings/rust.md")) {
        Ok(d) => d,
        Err(_) => return, // an installed crate has no docs
    };
    let section = doc.split("## Hybrid models").nth(1).expect("a Hybrid models section");
    let code = section.split("```rust\n").nth(1).and_then(|c| c.split("```").next()).expect("a rust block");
    let example = std::fs::read_to_string(dir.join("examples/hybrid.rs")).unwrap();
    // The example's license line and its //! header are not in the docs.
    let body: Vec<&str> = example
        .lines()
        .skip_while(|l| l.starts_with("// SPDX-License-Identifier:") || l.starts_with("//!") || l.is_empty())
        .collect();
    assert_eq!(code.trim_end(), body.join("\n").trim_end(), "docs/bindings/rust.md and examples/hybrid.rs differ");
}

/// One pool over gpt-oss-like groups (window 8 and full attention,
/// alternating): the plan with `shared_pool`, a cache made from it, memory
/// moving to the group that needs it, kept windows, and the errors.
#[test]
fn shared_pool_moves_memory_between_groups() {
    let layers: Vec<LayerSpec> = (0..4).map(|i| if i % 2 == 0 { window(8) } else { full() }).collect();
    assert!(!PlanRequest::default().shared_pool);
    let request = PlanRequest { shared_pool: true, ..PlanRequest::new(1 << 20, 4096) };
    let plan = plan_kv_cache(&layers, BS, &request).unwrap();
    assert_eq!(plan.groups.len(), 2);
    assert!(plan.groups.iter().all(|g| g.shared && g.num_blocks == plan.shared_blocks));
    assert!(plan.shared_blocks > 0 && plan.shared_bytes > 0 && plan.shared_bytes <= request.budget_bytes);
    assert_eq!((plan.max_group_layers, plan.max_context_tokens), (2, 4096));
    let gpu = Backend::host().unwrap();
    let planned = HybridKvCache::from_plan(&layers, &plan, 1, &gpu).unwrap();
    assert_eq!(planned.shared_pool_blocks(), plan.shared_blocks);
    drop(planned);
    let separate = plan_kv_cache(&layers, BS, &PlanRequest::new(1 << 20, 4096)).unwrap();
    assert!(separate.shared_blocks == 0 && separate.max_group_layers == 0);
    assert!(separate.groups.iter().all(|g| !g.shared));

    // 12 blocks for both groups: 32 tokens decoded one at a time hold 8 full
    // blocks and at most 3 window blocks; pools of 6 each could not.
    let cache = HybridKvCache::new_shared(&layers, BS, 1, 2, 12, &[0, 0], &gpu).unwrap();
    assert_eq!(cache.shared_pool_blocks(), 12);
    assert!(cache.in_shared_pool(0).unwrap() && cache.in_shared_pool(1).unwrap());
    assert!(matches!(cache.in_shared_pool(2), Err(KvError::OutOfRange(_))));
    {
        let mut t = HybridBlockTable::new(&cache, 0).unwrap();
        assert!(!t.keeps_shared_windows());
        t.set_keep_shared_windows(true);
        assert!(t.keeps_shared_windows());
        for token in tokens(32, 7) {
            t.append_tokens(&[token], DEFAULT_STREAM).unwrap();
        }
        assert_eq!(cache.group_blocks_in_use(1).unwrap(), 8);
        assert_eq!(t.num_kept_blocks(0).unwrap(), 0);
        t.keep_hit_point();
        let kept = t.num_kept_blocks(0).unwrap();
        assert!((1..=3).contains(&kept), "{kept}");
        assert_eq!(t.num_kept_blocks(1).unwrap(), 0);
        assert!(matches!(t.num_kept_blocks(2), Err(KvError::OutOfRange(_))));
        assert!(cache.check_invariants().unwrap().ok);
    }
    assert_eq!(cache.group_blocks_in_use(0).unwrap(), 0);
    {
        // The copy-last-block rule: the 32 cached tokens hit 31, not 28.
        let mut t = HybridBlockTable::new(&cache, 0).unwrap();
        assert!(!t.copies_last_block());
        t.set_copy_last_block(true);
        assert!(t.copies_last_block());
        assert_eq!(t.reuse_cached_prefix(&tokens(32, 7), DEFAULT_STREAM).unwrap(), 31);
    }

    // No two groups to share; a count per group other than one.
    let fulls = [full(), full()];
    assert!(matches!(HybridKvCache::new_shared(&fulls, BS, 1, 0, 12, &[12], &gpu), Err(KvError::InvalidArgument(_))));
    assert!(HybridKvCache::new_shared(&layers, BS, 1, 0, 0, &[12], &gpu).is_err());
    let own = HybridKvCache::new_shared(&fulls, BS, 1, 0, 0, &[12], &gpu).unwrap();
    assert_eq!(own.shared_pool_blocks(), 0);
    assert!(!own.in_shared_pool(0).unwrap());
}

/// A model of one full-attention group is the one-group case of groups: the
/// groups of a prefix cache are a HybridKvCache over it, and tables of either
/// kind share its blocks and hits.
#[test]
fn groups_of_a_prefix_cache_are_the_one_group_case() {
    let gpu = Backend::new("host").unwrap();
    let cache = PagedKvCache::new(KvCacheConfig::new(2, 2, 16, BS, KvCacheDtype::F16), 6, &gpu).unwrap();
    let prefix = PrefixCache::new(&cache).unwrap();
    let groups = prefix.as_groups().unwrap();
    assert_eq!(groups.num_groups(), 1);
    let prompt = tokens(8, 500);
    {
        let mut t = BlockTable::with_prefix_cache(&prefix, 0).unwrap();
        t.append_tokens(&prompt, DEFAULT_STREAM).unwrap();
    }
    let mut h = HybridBlockTable::new(&groups, 0).unwrap();
    h.set_copy_last_block(true); // BlockTable's rule: a whole-prompt hit is n - 1 tokens
    assert_eq!(h.reuse_cached_prefix(&prompt, DEFAULT_STREAM).unwrap(), 7);
    assert_eq!(h.copy_on_writes(), 1);
    assert_eq!(h.blocks(0).unwrap().len(), 2);
    drop(h);
    assert!(groups.check_invariants().unwrap().ok);

    // A plain cache's groups cache nothing.
    let plain_cache = PagedKvCache::new(KvCacheConfig::new(2, 2, 16, BS, KvCacheDtype::F16), 4, &gpu).unwrap();
    let plain = plain_cache.as_groups().unwrap();
    let mut p = HybridBlockTable::new(&plain, 0).unwrap();
    assert_eq!(p.reuse_cached_prefix(&prompt, DEFAULT_STREAM).unwrap(), 0);
    p.append_tokens(&prompt, DEFAULT_STREAM).unwrap();
    assert_eq!(plain_cache.num_free_blocks(), 2);
    drop(p);
    assert_eq!(plain_cache.num_free_blocks(), 4);
    // A group pool is a hybrid cache's: it has no groups of its own.
    let pool = groups.group_pool(0).unwrap();
    assert!(matches!(pool.as_groups(), Err(KvError::InvalidArgument(_))));
}
