// SPDX-License-Identifier: Apache-2.0
//! `PrefixCache` and `BlockTable` over `kvport_prefix_cache` and
//! `kvport_block_table`. They borrow their parent, so the borrow checker
//! enforces kvport's ownership rules (a cache outlives its prefix cache, a
//! prefix cache its block tables); neither is `Send` nor `Sync`.

use std::marker::PhantomData;
use std::ptr;

use crate::backend::{stream_ptr, Backend};
use crate::hybrid::{GroupsView, HybridKvCache};
use crate::cache::{invariant_report, InvariantReport, PagedKvCache};
use crate::error::{check, expect_ok, KvError};
use crate::ffi;

/// Counters of a prefix cache (kvport::PrefixCacheCounters).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct PrefixCacheCounters {
    pub lookups: u64,
    pub hits: u64,
    pub misses: u64,
    pub inserts: u64,
    pub evictions: u64,
    pub ignored_releases: u64,
}

/// Automatic prefix caching over a [`PagedKvCache`] (kvport::PrefixCache).
/// While it lives, sequences allocate and release through it (or through
/// [`BlockTable`]s), not through the cache's `alloc_block` / `dec_ref`
/// (the borrow makes those `&mut` methods unavailable).
pub struct PrefixCache<'c> {
    raw: *mut ffi::kvport_prefix_cache,
    backend: Backend,
    _cache: PhantomData<&'c PagedKvCache>,
}

impl<'c> Drop for PrefixCache<'c> {
    fn drop(&mut self) {
        unsafe { ffi::kvport_prefix_cache_destroy(self.raw) };
    }
}

impl<'c> PrefixCache<'c> {
    pub fn new(cache: &'c PagedKvCache) -> Result<PrefixCache<'c>, KvError> {
        let mut raw = ptr::null_mut();
        check(unsafe { ffi::kvport_prefix_cache_create(cache.raw(), &mut raw) })?;
        Ok(PrefixCache { raw, backend: cache.backend().clone(), _cache: PhantomData })
    }

    /// This prefix cache as the one-group [`HybridKvCache`] over it
    /// (kvport_prefix_cache_as_groups): [`HybridBlockTable`](crate::HybridBlockTable)s
    /// over it share this prefix cache's blocks and hits. Borrowed: it cannot
    /// outlive the prefix cache.
    pub fn as_groups(&self) -> Result<GroupsView<'_>, KvError> {
        let mut raw = ptr::null_mut();
        check(unsafe { ffi::kvport_prefix_cache_as_groups(self.raw, &mut raw) })?;
        Ok(GroupsView::new(HybridKvCache::lent(raw, self.backend.clone())))
    }

    pub fn raw(&self) -> *mut ffi::kvport_prefix_cache {
        self.raw
    }

    /// The blocks of the longest cached prefix of full blocks of `tokens`
    /// under `extra_key`; the caller owns one reference on each (give it
    /// back with `release`).
    pub fn lookup(&self, tokens: &[u32], extra_key: u64) -> Result<Vec<u32>, KvError> {
        // kvport_config has the block size; the output never exceeds
        // tokens.len() / block_size ids, and tokens.len() is an upper bound.
        let mut out = vec![0u32; tokens.len()];
        let mut n = 0usize;
        check(unsafe {
            ffi::kvport_prefix_cache_lookup(
                self.raw,
                tokens.as_ptr(),
                tokens.len(),
                extra_key,
                out.as_mut_ptr(),
                out.len(),
                &mut n,
                ptr::null_mut(),
            )
        })?;
        out.truncate(n);
        Ok(out)
    }

    /// A free block, or the least recently used cached one evicted.
    /// `CacheExhausted` when neither.
    pub fn alloc(&self) -> Result<u32, KvError> {
        let mut b = 0u32;
        check(unsafe { ffi::kvport_prefix_cache_alloc(self.raw, &mut b) })?;
        Ok(b)
    }

    pub fn try_alloc(&self) -> Option<u32> {
        let mut b = 0u32;
        let mut ok = false;
        expect_ok(unsafe { ffi::kvport_prefix_cache_try_alloc(self.raw, &mut b, &mut ok) }, "kvport_prefix_cache_try_alloc");
        if ok {
            Some(b)
        } else {
            None
        }
    }

    pub fn release(&self, block: u32) -> Result<(), KvError> {
        check(unsafe { ffi::kvport_prefix_cache_release(self.raw, block) })
    }

    pub fn release_blocks(&self, blocks: &[u32]) -> Result<(), KvError> {
        check(unsafe { ffi::kvport_prefix_cache_release_blocks(self.raw, blocks.as_ptr(), blocks.len()) })
    }

    /// Evicts up to `max_blocks` evictable blocks; returns how many.
    pub fn evict(&self, max_blocks: usize) -> Result<usize, KvError> {
        let mut n = 0usize;
        check(unsafe { ffi::kvport_prefix_cache_evict(self.raw, max_blocks, &mut n) })?;
        Ok(n)
    }

    fn count(&self, f: unsafe extern "C" fn(*const ffi::kvport_prefix_cache, *mut usize) -> ffi::kvport_status) -> usize {
        let mut n = 0usize;
        expect_ok(unsafe { f(self.raw, &mut n) }, "kvport_prefix_cache_num_*");
        n
    }
    pub fn num_cached_blocks(&self) -> usize {
        self.count(ffi::kvport_prefix_cache_num_cached_blocks)
    }
    pub fn num_evictable_blocks(&self) -> usize {
        self.count(ffi::kvport_prefix_cache_num_evictable_blocks)
    }
    /// Free plus evictable blocks.
    pub fn num_available_blocks(&self) -> usize {
        self.count(ffi::kvport_prefix_cache_num_available_blocks)
    }

    pub fn counters(&self) -> PrefixCacheCounters {
        let mut c = ffi::kvport_prefix_cache_counters::default();
        expect_ok(unsafe { ffi::kvport_prefix_cache_counters_get(self.raw, &mut c) }, "kvport_prefix_cache_counters_get");
        PrefixCacheCounters {
            lookups: c.lookups,
            hits: c.hits,
            misses: c.misses,
            inserts: c.inserts,
            evictions: c.evictions,
            ignored_releases: c.ignored_releases,
        }
    }

    pub fn check_invariants(&self) -> Result<InvariantReport, KvError> {
        let raw = self.raw;
        invariant_report(|r, t, n, needed| unsafe { ffi::kvport_prefix_cache_check_invariants(raw, r, t, n, needed) })
    }
}

/// How much of a fully cached prompt `reuse_cached_prefix` may hit.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PrefixHitMode {
    /// Leave at least the last token to compute (the default).
    ComputeLastToken,
    /// Every cached full block, up to the whole prompt.
    Full,
}

/// One sequence's blocks (kvport::BlockTable), over a plain cache or a
/// prefix cache. Dropping it releases its blocks.
pub struct BlockTable<'a> {
    raw: *mut ffi::kvport_block_table,
    _parent: PhantomData<&'a ()>,
}

impl<'a> Drop for BlockTable<'a> {
    fn drop(&mut self) {
        unsafe { ffi::kvport_block_table_destroy(self.raw) };
    }
}

impl<'a> BlockTable<'a> {
    /// An empty table over a plain cache.
    pub fn new(cache: &'a PagedKvCache) -> Result<BlockTable<'a>, KvError> {
        let mut raw = ptr::null_mut();
        check(unsafe { ffi::kvport_block_table_create(cache.raw(), &mut raw) })?;
        Ok(BlockTable { raw, _parent: PhantomData })
    }

    /// An empty table over a prefix cache; `extra_key` (e.g. a LoRA id) goes
    /// into every block hash.
    pub fn with_prefix_cache(prefix: &'a PrefixCache<'_>, extra_key: u64) -> Result<BlockTable<'a>, KvError> {
        let mut raw = ptr::null_mut();
        check(unsafe { ffi::kvport_block_table_create_prefixed(prefix.raw(), extra_key, &mut raw) })?;
        Ok(BlockTable { raw, _parent: PhantomData })
    }

    /// Starts the (empty) table with the longest cached prefix of `prompt`;
    /// returns the tokens it covers.
    pub fn reuse_cached_prefix(&mut self, prompt: &[u32], stream: u64) -> Result<usize, KvError> {
        let mut hit = 0usize;
        check(unsafe {
            ffi::kvport_block_table_reuse_cached_prefix(self.raw, prompt.as_ptr(), prompt.len(), stream_ptr(stream), &mut hit)
        })?;
        Ok(hit)
    }

    pub fn set_prefix_hit_mode(&mut self, mode: PrefixHitMode) -> Result<(), KvError> {
        let raw = match mode {
            PrefixHitMode::ComputeLastToken => ffi::KVPORT_PREFIX_HIT_COMPUTE_LAST_TOKEN,
            PrefixHitMode::Full => ffi::KVPORT_PREFIX_HIT_FULL,
        };
        check(unsafe { ffi::kvport_block_table_set_prefix_hit_mode(self.raw, raw) })
    }

    pub fn prefix_hit_mode(&self) -> PrefixHitMode {
        let mut raw = 0i32;
        expect_ok(unsafe { ffi::kvport_block_table_prefix_hit_mode(self.raw, &mut raw) }, "kvport_block_table_prefix_hit_mode");
        if raw == ffi::KVPORT_PREFIX_HIT_FULL {
            PrefixHitMode::Full
        } else {
            PrefixHitMode::ComputeLastToken
        }
    }

    /// Appends tokens, allocating blocks. All or nothing: `CacheExhausted`
    /// before any change when the blocks are not available.
    pub fn append_tokens(&mut self, tokens: &[u32], stream: u64) -> Result<(), KvError> {
        check(unsafe { ffi::kvport_block_table_append_tokens(self.raw, tokens.as_ptr(), tokens.len(), stream_ptr(stream)) })
    }

    /// New blocks appending `num_tokens` would take.
    pub fn blocks_needed(&self, num_tokens: usize) -> Result<usize, KvError> {
        let mut n = 0usize;
        check(unsafe { ffi::kvport_block_table_blocks_needed(self.raw, num_tokens, &mut n) })?;
        Ok(n)
    }

    /// A new table sharing every block (one reference each).
    pub fn fork(&self) -> Result<BlockTable<'a>, KvError> {
        let mut raw = ptr::null_mut();
        check(unsafe { ffi::kvport_block_table_fork(self.raw, &mut raw) })?;
        Ok(BlockTable { raw, _parent: PhantomData })
    }

    /// Releases every block and empties the table.
    pub fn release(&mut self) -> Result<(), KvError> {
        check(unsafe { ffi::kvport_block_table_release(self.raw) })
    }

    /// The block ids, in sequence order (a copy).
    pub fn block_ids(&self) -> Vec<u32> {
        let mut p = ptr::null();
        let mut n = 0usize;
        expect_ok(unsafe { ffi::kvport_block_table_blocks(self.raw, &mut p, &mut n) }, "kvport_block_table_blocks");
        if n == 0 || p.is_null() {
            return Vec::new();
        }
        // SAFETY: n ids, valid until the table next changes; copied now.
        unsafe { std::slice::from_raw_parts(p, n) }.to_vec()
    }

    pub fn num_tokens(&self) -> usize {
        let mut n = 0usize;
        expect_ok(unsafe { ffi::kvport_block_table_num_tokens(self.raw, &mut n) }, "kvport_block_table_num_tokens");
        n
    }

    /// Copy-on-write copies this table made.
    pub fn copy_on_writes(&self) -> u64 {
        let mut n = 0u64;
        expect_ok(unsafe { ffi::kvport_block_table_copy_on_writes(self.raw, &mut n) }, "kvport_block_table_copy_on_writes");
        n
    }
}
