// SPDX-License-Identifier: Apache-2.0
//! `PagedKvCache`: the reference's API over `kvport_cache`.

use std::ffi::c_void;
use std::os::raw::c_char;
use std::ptr;

use crate::backend::{stream_ptr, Backend, DevicePtr, GpuBackend};
use crate::config::{KvCacheConfig, KvCacheDtype, RegionLayout};
use crate::error::{check, expect_ok, KvError};
use crate::ffi;

/// Monotonic counters since creation (kvport::KvCacheCounters).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct CacheCounters {
    pub allocs: u64,
    pub frees: u64,
    /// `dec_ref` / `return_evicted_block` calls on a block at refcount 0,
    /// which were ignored.
    pub ignored_double_frees: u64,
    pub exhaustion_events: u64,
    pub peak_blocks_in_use: u64,
}

/// The result of an invariant check (kvport::InvariantReport).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct InvariantReport {
    pub ok: bool,
    pub blocks_checked: usize,
    pub free_blocks: usize,
    pub blocks_in_use: usize,
    pub evictable_blocks: usize,
    pub cached_blocks: usize,
    pub num_violations: usize,
    /// "ok: N blocks, ..." or one line per violation.
    pub text: String,
}

/// Runs a `*_check_invariants` call twice: once for the text's length.
pub(crate) fn invariant_report(
    call: impl Fn(*mut ffi::kvport_invariant_report, *mut c_char, usize, *mut usize) -> ffi::kvport_status,
) -> Result<InvariantReport, KvError> {
    let mut r = ffi::kvport_invariant_report::default();
    let mut needed = 0usize;
    check(call(&mut r, ptr::null_mut(), 0, &mut needed))?;
    let mut text = vec![0u8; needed.max(1)];
    check(call(&mut r, text.as_mut_ptr() as *mut c_char, text.len(), &mut needed))?;
    let len = text.iter().position(|&b| b == 0).unwrap_or(text.len());
    text.truncate(len);
    Ok(InvariantReport {
        ok: r.ok,
        blocks_checked: r.blocks_checked,
        free_blocks: r.free_blocks,
        blocks_in_use: r.blocks_in_use,
        evictable_blocks: r.evictable_blocks,
        cached_blocks: r.cached_blocks,
        num_violations: r.num_violations,
        text: String::from_utf8_lossy(&text).into_owned(),
    })
}

/// A paged KV cache: per layer a K pool and a V pool of `num_blocks` blocks
/// on a backend, a LIFO free list (a fresh cache hands out 0, 1, 2, ...) and
/// a refcount per block. Method names, arguments and semantics follow the
/// reference engine's `PagedKvCache`; where the reference panics or logs,
/// these return `Err(KvError)` (see docs/bindings/rust.md for the mapping).
///
/// Dropping it waits for the device work it queued and frees the pools.
///
/// `Send` (kvport's cache has no thread-affine state: a backend may be used
/// from any thread), **not** `Sync`: like the C++ cache it is not
/// thread-safe, so one thread at a time uses it. Methods that queue device
/// work take `&self`, as in the reference; `!Sync` keeps them on one thread.
pub struct PagedKvCache {
    raw: *mut ffi::kvport_cache,
    backend: Backend,
    config: KvCacheConfig,
    num_blocks: usize,
    /// A hybrid cache's group pool: the hybrid cache destroys the handle.
    lent: bool,
}

// SAFETY: see the type's documentation. The raw pointer keeps it !Sync.
unsafe impl Send for PagedKvCache {}

impl Drop for PagedKvCache {
    fn drop(&mut self) {
        // Prefix caches and block tables borrow the cache, so none is alive
        // here and destroy cannot report HANDLE_IN_USE.
        if !self.lent {
            unsafe { ffi::kvport_cache_destroy(self.raw) };
        }
    }
}

impl std::fmt::Debug for PagedKvCache {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PagedKvCache")
            .field("backend", &self.backend)
            .field("num_blocks", &self.num_blocks)
            .field("num_free_blocks", &self.num_free_blocks())
            .field("config", &self.config)
            .finish()
    }
}

impl PagedKvCache {
    /// Validates `config` and allocates `num_blocks` blocks on `gpu`.
    /// `InvalidArgument` for a bad config or `num_blocks` 0 or > 2^32-1,
    /// `OutOfMemory` when the pools do not fit. Pool contents are unspecified
    /// until zeroed.
    pub fn new(
        config: KvCacheConfig,
        num_blocks: usize,
        gpu: &dyn GpuBackend,
    ) -> Result<Self, KvError> {
        let backend = gpu.kvport_backend().clone();
        let mut raw = ptr::null_mut();
        config.with_c(|c| {
            check(unsafe { ffi::kvport_cache_create(c, num_blocks, backend.raw(), &mut raw) })
        })?;
        Ok(PagedKvCache { raw, backend, config, num_blocks, lent: false })
    }

    /// Bytes each pool of [`PagedKvCache::adopt`] must hold, in its order
    /// (layer 0 K, layer 0 V, layer 1 K, ...; one pool in block-major layout).
    pub fn adopted_pool_bytes(config: &KvCacheConfig, num_blocks: usize) -> Result<Vec<usize>, KvError> {
        config.with_c(|c| {
            let mut count = 0usize;
            check(unsafe {
                ffi::kvport_cache_adopted_pool_bytes(c, num_blocks, ptr::null_mut(), 0, &mut count)
            })?;
            let mut bytes = vec![0usize; count];
            check(unsafe {
                ffi::kvport_cache_adopted_pool_bytes(
                    c,
                    num_blocks,
                    bytes.as_mut_ptr(),
                    bytes.len(),
                    &mut count,
                )
            })?;
            Ok(bytes)
        })
    }

    /// A cache over the engine's memory: `pools` as (base, bytes) in the
    /// order of [`PagedKvCache::adopted_pool_bytes`], each at least that many
    /// bytes and 16-byte aligned, device memory of `gpu`'s device (host
    /// memory on the host backend). kvport manages the blocks in them and
    /// never frees them.
    ///
    /// # Safety
    /// The memory must stay valid, and not be used as another cache's pools,
    /// until the cache is dropped (kvport reads and writes it meanwhile).
    /// `InvalidArgument`, naming the pool, for a wrong count, 0 blocks, a null
    /// or misaligned base, too few bytes, pools that overlap, or memory any
    /// cache of the process already holds: adopted ranges are process-wide,
    /// so memory adopted or allocated through any [`Backend`] of the same
    /// memory (host memory; one device) is refused, naming both ranges, until
    /// that cache is dropped.
    pub unsafe fn adopt(
        config: KvCacheConfig,
        num_blocks: usize,
        gpu: &dyn GpuBackend,
        pools: &[(*mut c_void, usize)],
    ) -> Result<Self, KvError> {
        let backend = gpu.kvport_backend().clone();
        let c_pools: Vec<ffi::kvport_pool> =
            pools.iter().map(|&(base, bytes)| ffi::kvport_pool { base, bytes }).collect();
        let mut raw = ptr::null_mut();
        config.with_c(|c| {
            check(ffi::kvport_cache_create_adopted(
                c,
                num_blocks,
                backend.raw(),
                c_pools.as_ptr(),
                c_pools.len(),
                &mut raw,
            ))
        })?;
        Ok(PagedKvCache { raw, backend, config, num_blocks, lent: false })
    }

    /// Whether the pools are the engine's ([`PagedKvCache::adopt`]).
    pub fn is_adopted(&self) -> bool {
        let mut out = false;
        expect_ok(unsafe { ffi::kvport_cache_is_adopted(self.raw, &mut out) }, "kvport_cache_is_adopted");
        out
    }

    /// A cache over a handle lent by a hybrid cache (its group pool): the
    /// config and block count read back; dropping it leaves the handle to the
    /// hybrid cache. The caller keeps it from outliving the hybrid cache.
    pub(crate) fn from_lent(raw: *mut ffi::kvport_cache, backend: Backend) -> Result<Self, KvError> {
        let mut c = ffi::kvport_config {
            num_layers: 0,
            block_size: 0,
            num_kv_heads: 0,
            head_dim_k: 0,
            head_dim_v: 0,
            dtype: 0,
            layout: 0,
            layer_dtypes: ptr::null(),
            num_layer_dtypes: 0,
        };
        check(unsafe { ffi::kvport_cache_config(raw, &mut c) })?;
        let config = KvCacheConfig::from_c(&c)?;
        let mut num_blocks = 0usize;
        check(unsafe { ffi::kvport_cache_num_blocks(raw, &mut num_blocks) })?;
        Ok(PagedKvCache { raw, backend, config, num_blocks, lent: true })
    }

    /// How many blocks of `config` fit in `available_bytes` (kvport includes
    /// pool alignment and caps at the 32-bit id range). `InvalidArgument` for
    /// an invalid config (the reference: "block size is zero").
    pub fn compute_num_blocks(config: &KvCacheConfig, available_bytes: usize) -> Result<usize, KvError> {
        let mut out = 0usize;
        config.with_c(|c| check(unsafe { ffi::kvport_compute_num_blocks(c, available_bytes, &mut out) }))?;
        Ok(out)
    }

    /// The C handle (valid while the cache lives).
    pub fn raw(&self) -> *mut ffi::kvport_cache {
        self.raw
    }

    /// The backend the cache was created on.
    pub fn backend(&self) -> &Backend {
        &self.backend
    }

    /// This cache as the one-group [`HybridKvCache`](crate::HybridKvCache)
    /// over it, without a prefix cache (kvport_cache_as_groups):
    /// [`HybridBlockTable`](crate::HybridBlockTable)s over it allocate and
    /// free its blocks and cache nothing. `InvalidArgument` for a hybrid
    /// cache's group pool.
    pub fn as_groups(&self) -> Result<crate::hybrid::GroupsView<'_>, KvError> {
        let mut raw = ptr::null_mut();
        check(unsafe { ffi::kvport_cache_as_groups(self.raw, &mut raw) })?;
        Ok(crate::hybrid::GroupsView::new(crate::hybrid::HybridKvCache::lent(raw, self.backend.clone())))
    }

    fn check_gpu(&self, gpu: &dyn GpuBackend) -> Result<(), KvError> {
        if gpu.kvport_backend().same_as(&self.backend) {
            Ok(())
        } else {
            Err(KvError::InvalidArgument(format!(
                "gpu is backend '{}', not the backend this cache was created on ('{}')",
                gpu.kvport_backend().name(),
                self.backend.name()
            )))
        }
    }

    // ---- allocation and reference counts ---------------------------------

    /// Pops the free list and sets the block's refcount to 1.
    /// `CacheExhausted` when no block is free.
    pub fn alloc_block(&mut self) -> Result<u32, KvError> {
        let mut block = 0u32;
        check(unsafe { ffi::kvport_cache_alloc(self.raw, &mut block) })?;
        Ok(block)
    }

    /// The name for [`alloc_block`](Self::alloc_block).
    #[inline]
    pub fn alloc(&mut self) -> Result<u32, KvError> {
        self.alloc_block()
    }

    /// As `alloc_block`, `None` when no block is free.
    pub fn try_alloc_block(&mut self) -> Option<u32> {
        let mut block = 0u32;
        let mut allocated = false;
        expect_ok(
            unsafe { ffi::kvport_cache_try_alloc(self.raw, &mut block, &mut allocated) },
            "kvport_cache_try_alloc",
        );
        if allocated {
            Some(block)
        } else {
            None
        }
    }

    /// The name for [`try_alloc_block`](Self::try_alloc_block).
    #[inline]
    pub fn try_alloc(&mut self) -> Option<u32> {
        self.try_alloc_block()
    }

    /// Adds a reference. `InvalidArgument` for a free block, `OutOfRange`
    /// for an id >= num_blocks (the reference: debug assertions).
    pub fn inc_ref(&mut self, block_idx: u32) -> Result<(), KvError> {
        check(unsafe { ffi::kvport_cache_inc_ref(self.raw, block_idx) })
    }

    /// Drops a reference; `Ok(true)` when the block went back to the free
    /// list. At refcount 0 the call is logged, counted
    /// (`counters().ignored_double_frees`) and ignored: `Ok(false)`, as the
    /// reference. `OutOfRange` for an id >= num_blocks.
    pub fn dec_ref(&mut self, block_idx: u32) -> Result<bool, KvError> {
        let mut freed = false;
        check(unsafe { ffi::kvport_cache_dec_ref(self.raw, block_idx, &mut freed) })?;
        Ok(freed)
    }

    /// `dec_ref`, ignoring whether the block was freed.
    pub fn free_block(&mut self, block_idx: u32) -> Result<(), KvError> {
        self.dec_ref(block_idx).map(|_| ())
    }

    /// `free_block` on each id in order; every id is checked first (an
    /// out-of-range id changes nothing).
    pub fn free_blocks(&mut self, block_table: &[u32]) -> Result<(), KvError> {
        check(unsafe { ffi::kvport_cache_free_blocks(self.raw, block_table.as_ptr(), block_table.len()) })
    }

    /// Gives back a block a prefix cache evicted (like `dec_ref`; at
    /// refcount 0 logged, counted and ignored, as the reference).
    pub fn return_evicted_block(&mut self, block_idx: u32) -> Result<(), KvError> {
        check(unsafe { ffi::kvport_cache_return_evicted_block(self.raw, block_idx) })
    }

    /// The block's refcount (0: free). `OutOfRange` for an id >= num_blocks.
    pub fn ref_count(&self, block_idx: u32) -> Result<u32, KvError> {
        let mut out = 0u32;
        check(unsafe { ffi::kvport_cache_ref_count(self.raw, block_idx, &mut out) })?;
        Ok(out)
    }

    pub fn num_free_blocks(&self) -> usize {
        let mut out = 0usize;
        expect_ok(unsafe { ffi::kvport_cache_num_free_blocks(self.raw, &mut out) }, "kvport_cache_num_free_blocks");
        out
    }

    pub fn num_blocks_in_use(&self) -> usize {
        let mut out = 0usize;
        expect_ok(unsafe { ffi::kvport_cache_num_blocks_in_use(self.raw, &mut out) }, "kvport_cache_num_blocks_in_use");
        out
    }

    // ---- shape --------------------------------------------------------------

    pub fn config(&self) -> &KvCacheConfig {
        &self.config
    }
    pub fn block_size(&self) -> usize {
        self.config.block_size
    }
    pub fn num_blocks(&self) -> usize {
        self.num_blocks
    }
    pub fn dtype(&self) -> KvCacheDtype {
        self.config.dtype
    }
    pub fn num_layers(&self) -> usize {
        self.config.num_layers
    }

    /// The layer's dtype. `OutOfRange` for layer >= num_layers.
    pub fn dtype_for_layer(&self, layer_idx: usize) -> Result<KvCacheDtype, KvError> {
        let mut raw = 0i32;
        check(unsafe { ffi::kvport_cache_layer_dtype(self.raw, layer_idx, &mut raw) })?;
        KvCacheDtype::from_raw(raw).ok_or_else(|| KvError::Unknown(format!("kvport returned dtype {}", raw)))
    }

    /// Bytes of all pools together.
    pub fn total_bytes(&self) -> usize {
        let mut out = 0usize;
        expect_ok(unsafe { ffi::kvport_cache_total_bytes(self.raw, &mut out) }, "kvport_cache_total_bytes");
        out
    }

    // ---- pointers and strides ----------------------------------------------

    fn layer_ptr(
        &self,
        f: unsafe extern "C" fn(*const ffi::kvport_cache, usize, *mut *mut c_void) -> ffi::kvport_status,
        layer_idx: usize,
    ) -> Result<DevicePtr, KvError> {
        let mut out = ptr::null_mut();
        check(unsafe { f(self.raw, layer_idx, &mut out) })?;
        Ok(out.into())
    }

    fn block_ptr(
        &self,
        f: unsafe extern "C" fn(*const ffi::kvport_cache, usize, u32, *mut *mut c_void) -> ffi::kvport_status,
        layer_idx: usize,
        block_idx: u32,
    ) -> Result<DevicePtr, KvError> {
        let mut out = ptr::null_mut();
        check(unsafe { f(self.raw, layer_idx, block_idx, &mut out) })?;
        Ok(out.into())
    }

    fn layer_size(
        &self,
        f: unsafe extern "C" fn(*const ffi::kvport_cache, usize, *mut usize) -> ffi::kvport_status,
        layer_idx: usize,
    ) -> Result<usize, KvError> {
        let mut out = 0usize;
        check(unsafe { f(self.raw, layer_idx, &mut out) })?;
        Ok(out)
    }

    /// Address of `layer_idx`'s K of `block_idx`:
    /// `k_pool_ptr(layer) + block * k_block_stride_bytes_for_layer(layer)`.
    /// `OutOfRange` for a layer or block out of range (the reference panics).
    pub fn k_cache_ptr(&self, layer_idx: usize, block_idx: u32) -> Result<DevicePtr, KvError> {
        self.block_ptr(ffi::kvport_cache_k_ptr, layer_idx, block_idx)
    }
    pub fn v_cache_ptr(&self, layer_idx: usize, block_idx: u32) -> Result<DevicePtr, KvError> {
        self.block_ptr(ffi::kvport_cache_v_ptr, layer_idx, block_idx)
    }
    /// Start of `layer_idx`'s K pool (block 0).
    pub fn k_pool_ptr(&self, layer_idx: usize) -> Result<DevicePtr, KvError> {
        self.layer_ptr(ffi::kvport_cache_k_pool_ptr, layer_idx)
    }
    pub fn v_pool_ptr(&self, layer_idx: usize) -> Result<DevicePtr, KvError> {
        self.layer_ptr(ffi::kvport_cache_v_pool_ptr, layer_idx)
    }

    /// Layer 0's K block stride: what the reference's `block_stride_bytes`
    /// is for a uniform layer-major cache.
    pub fn block_stride_bytes(&self) -> usize {
        let mut out = 0usize;
        expect_ok(unsafe { ffi::kvport_cache_k_block_stride(self.raw, 0, &mut out) }, "kvport_cache_k_block_stride");
        out
    }
    /// The layer's K block stride (as the reference).
    pub fn block_stride_bytes_for_layer(&self, layer_idx: usize) -> Result<usize, KvError> {
        self.k_block_stride_bytes_for_layer(layer_idx)
    }
    /// Bytes from one block's K to the next in the layer's K pool (the
    /// region size in layer-major layout, the whole block in block-major).
    pub fn k_block_stride_bytes_for_layer(&self, layer_idx: usize) -> Result<usize, KvError> {
        self.layer_size(ffi::kvport_cache_k_block_stride, layer_idx)
    }
    pub fn v_block_stride_bytes_for_layer(&self, layer_idx: usize) -> Result<usize, KvError> {
        self.layer_size(ffi::kvport_cache_v_block_stride, layer_idx)
    }
    /// Bytes of the layer's K region of one block (what `read_block` returns).
    pub fn k_block_bytes_for_layer(&self, layer_idx: usize) -> Result<usize, KvError> {
        self.layer_size(ffi::kvport_cache_k_block_bytes, layer_idx)
    }
    pub fn v_block_bytes_for_layer(&self, layer_idx: usize) -> Result<usize, KvError> {
        self.layer_size(ffi::kvport_cache_v_block_bytes, layer_idx)
    }
    /// Data / scale bytes of the layer's K region (replaces the reference's
    /// `nvfp4_data_bytes`, `turbo*_data_bytes`, `turbo4_scale_bytes`).
    pub fn k_region_layout(&self, layer_idx: usize) -> Result<RegionLayout, KvError> {
        let mut out = ffi::kvport_region_layout::default();
        check(unsafe { ffi::kvport_cache_k_region_layout(self.raw, layer_idx, &mut out) })?;
        Ok(out.into())
    }
    pub fn v_region_layout(&self, layer_idx: usize) -> Result<RegionLayout, KvError> {
        let mut out = ffi::kvport_region_layout::default();
        check(unsafe { ffi::kvport_cache_v_region_layout(self.raw, layer_idx, &mut out) })?;
        Ok(out.into())
    }

    // ---- device work ------------------------------------------------------------

    /// Sets every layer's K and V bytes of the block to 0, queued on
    /// `stream` (0: the backend's default stream; else [`Stream::as_raw`](crate::Stream::as_raw)).
    /// `OutOfRange` for an id >= num_blocks, before any work is queued.
    pub fn zero_block(&self, block_idx: u32, gpu: &dyn GpuBackend, stream: u64) -> Result<(), KvError> {
        self.check_gpu(gpu)?;
        check(unsafe { ffi::kvport_cache_zero_block(self.raw, block_idx, stream_ptr(stream)) })
    }

    /// As `zero_block`, with 0xFF bytes (to catch reads of unwritten KV).
    pub fn poison_block(&self, block_idx: u32, gpu: &dyn GpuBackend, stream: u64) -> Result<(), KvError> {
        self.check_gpu(gpu)?;
        check(unsafe { ffi::kvport_cache_poison_block(self.raw, block_idx, stream_ptr(stream)) })
    }

    /// Zeroes many blocks in ONE backend call (kvport addition).
    pub fn zero_blocks(&self, blocks: &[u32], stream: u64) -> Result<(), KvError> {
        check(unsafe { ffi::kvport_cache_zero_blocks(self.raw, blocks.as_ptr(), blocks.len(), stream_ptr(stream)) })
    }

    /// Poisons many blocks in ONE backend call (kvport addition).
    pub fn poison_blocks(&self, blocks: &[u32], stream: u64) -> Result<(), KvError> {
        check(unsafe { ffi::kvport_cache_poison_blocks(self.raw, blocks.as_ptr(), blocks.len(), stream_ptr(stream)) })
    }

    /// Copies every layer's K and V of each `(src, dst)` in ONE batched
    /// backend call (kvport addition). `InvalidArgument` for src == dst or
    /// overlapping destinations.
    pub fn copy_blocks(&self, copies: &[(u32, u32)], stream: u64) -> Result<(), KvError> {
        let c: Vec<ffi::kvport_block_copy> =
            copies.iter().map(|&(src, dst)| ffi::kvport_block_copy { src, dst }).collect();
        check(unsafe { ffi::kvport_cache_copy_blocks(self.raw, c.as_ptr(), c.len(), stream_ptr(stream)) })
    }

    /// `layer_idx`'s K and V bytes of `block_idx`, copied to the host after
    /// the default stream's queued work.
    pub fn read_block(
        &self,
        layer_idx: usize,
        block_idx: u32,
        gpu: &dyn GpuBackend,
    ) -> Result<(Vec<u8>, Vec<u8>), KvError> {
        self.check_gpu(gpu)?;
        let mut k = vec![0u8; self.k_block_bytes_for_layer(layer_idx)?];
        let mut v = vec![0u8; self.v_block_bytes_for_layer(layer_idx)?];
        check(unsafe {
            ffi::kvport_cache_read_block(
                self.raw,
                layer_idx,
                block_idx,
                k.as_mut_ptr() as *mut c_void,
                k.len(),
                v.as_mut_ptr() as *mut c_void,
                v.len(),
                ptr::null_mut(),
            )
        })?;
        Ok((k, v))
    }

    /// Copies host bytes into `layer_idx`'s K and V of `block_idx` (on the
    /// default stream, synchronized). The slices must be exactly
    /// `k_block_bytes_for_layer` / `v_block_bytes_for_layer` long
    /// (`InvalidArgument` otherwise; the reference does not check).
    pub fn write_block(
        &self,
        layer_idx: usize,
        block_idx: u32,
        k_data: &[u8],
        v_data: &[u8],
        gpu: &dyn GpuBackend,
    ) -> Result<(), KvError> {
        self.check_gpu(gpu)?;
        check(unsafe {
            ffi::kvport_cache_write_block(
                self.raw,
                layer_idx,
                block_idx,
                k_data.as_ptr() as *const c_void,
                k_data.len(),
                v_data.as_ptr() as *const c_void,
                v_data.len(),
                ptr::null_mut(),
            )
        })
    }

    /// Waits for every stream the cache queued work on; `KvError::Backend`
    /// for an asynchronous error.
    pub fn synchronize(&self) -> Result<(), KvError> {
        check(unsafe { ffi::kvport_cache_synchronize(self.raw) })
    }

    // ---- diagnostics ---------------------------------------------------------------

    pub fn counters(&self) -> CacheCounters {
        let mut c = ffi::kvport_cache_counters::default();
        expect_ok(unsafe { ffi::kvport_cache_counters_get(self.raw, &mut c) }, "kvport_cache_counters_get");
        CacheCounters {
            allocs: c.allocs,
            frees: c.frees,
            ignored_double_frees: c.ignored_double_frees,
            exhaustion_events: c.exhaustion_events,
            peak_blocks_in_use: c.peak_blocks_in_use,
        }
    }

    /// Checks the free list and refcounts (O(num_blocks)). A violation is
    /// `Ok` with `ok == false`.
    pub fn check_invariants(&self) -> Result<InvariantReport, KvError> {
        let raw = self.raw;
        invariant_report(|r, t, n, needed| unsafe { ffi::kvport_cache_check_invariants(raw, r, t, n, needed) })
    }
}
