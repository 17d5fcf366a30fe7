// SPDX-License-Identifier: Apache-2.0
//! The hybrid example of docs/bindings/rust.md (tests/hybrid.rs checks that
//! the two are the same): a gpt-oss-like model, window 128 and full
//! attention alternating. `cargo run --offline --example hybrid`.

use kvport::{plan_kv_cache, Backend, HybridBlockTable, HybridKvCache, KvCacheDtype, KvError};
use kvport::{LayerSpec, PlanRequest, DEFAULT_STREAM, NULL_BLOCK};

fn main() -> Result<(), KvError> {
    let gpu = Backend::new("default")?;
    let layers: Vec<LayerSpec> = (0..4)
        .map(|i| match i % 2 {
            0 => LayerSpec::sliding_window(128, 8, 64, 64, KvCacheDtype::Bf16),
            _ => LayerSpec::full_attention(8, 64, 64, KvCacheDtype::Bf16),
        })
        .collect();
    // Split 1 GiB between the groups by what a 32k-token request needs in each
    // at its peak, prefilling up to 512 tokens a step.
    let request = PlanRequest { step_tokens: 512, ..PlanRequest::new(1 << 30, 32768) };
    let plan = plan_kv_cache(&layers, 16, &request)?;
    println!("{} groups, {:.3} of all-full attention", plan.groups.len(), plan.ratio_to_all_full);
    let cache = HybridKvCache::from_plan(&layers, &plan, 1, &gpu)?;

    let prompt: Vec<u32> = (0..300).collect();
    let mut seq = HybridBlockTable::new(&cache, 0)?;
    let hit = seq.reuse_cached_prefix(&prompt, DEFAULT_STREAM)?; // 0: nothing cached yet
    seq.append_tokens(&prompt[hit..], DEFAULT_STREAM)?; // all or nothing across groups
    seq.append_tokens(&[7], DEFAULT_STREAM)?; // decode: the window group frees
    let window = seq.blocks(0)?; // NULL_BLOCK where released
    let released = window.iter().filter(|&&b| b == NULL_BLOCK).count();
    println!("window group: {} of {} blocks released", released, window.len());

    // Layer 2's K of the last window block: locate, then the group's pool.
    let at = cache.locate(2)?.expect("an attention layer");
    let pool = cache.group_pool(at.group)?;
    let k = pool.k_cache_ptr(at.index, window[window.len() - 1])?;
    println!("layer 2, last block: K at {:#x}", k.as_raw());
    Ok(())
}
