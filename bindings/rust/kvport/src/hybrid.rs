// SPDX-License-Identifier: Apache-2.0
//! Hybrid models: the planner (`plan_kv_cache`), `HybridKvCache` (one block
//! pool and prefix cache per KV cache group) and `HybridBlockTable` (one
//! sequence over every group), over `kvport_plan_kv_cache`,
//! `kvport_hybrid_cache` and `kvport_hybrid_block_table`.
//! docs/hybrid-models.md has the design, docs/bindings/rust.md an example.

use std::marker::PhantomData;
use std::ops::Deref;
use std::ptr;

use crate::backend::{stream_ptr, Backend, GpuBackend};
use crate::cache::{invariant_report, InvariantReport, PagedKvCache};
use crate::error::{check, expect_ok, KvError};
use crate::ffi;
use crate::layer_spec::{with_c_specs, LayerKind, LayerSpec};
use crate::prefix::PrefixHitMode;

/// The entry of a released block in a hybrid block list (never a valid id).
pub const NULL_BLOCK: u32 = ffi::KVPORT_NULL_BLOCK;

// ---- the planner ---------------------------------------------------------------

/// What [`plan_kv_cache`] is asked to fit (kvport::KvCachePlanRequest).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PlanRequest {
    /// Memory for every group's pools together.
    pub budget_bytes: usize,
    /// The longest sequence (prompt + output).
    pub max_context_tokens: usize,
    /// Requests of `max_context_tokens` that must fit at once; 0: no minimum.
    pub max_requests: usize,
    /// Tokens a running request appends per step (1 for decode).
    pub step_tokens: usize,
    /// Cached state checkpoints kept per request beside its working state.
    pub state_checkpoints: usize,
    /// The attention groups whose pages match share one pool (split into
    /// groups of equal layer count first), and memory moves between them at
    /// run time; false (the default): a pool per group.
    pub shared_pool: bool,
}

impl Default for PlanRequest {
    /// kvport's defaults: everything 0 but `step_tokens` and
    /// `state_checkpoints`, 1; no shared pool.
    fn default() -> Self {
        let mut r = ffi::kvport_plan_request::default();
        expect_ok(unsafe { ffi::kvport_plan_request_init(&mut r) }, "kvport_plan_request_init");
        PlanRequest {
            budget_bytes: r.budget_bytes,
            max_context_tokens: r.max_context_tokens,
            max_requests: r.max_requests,
            step_tokens: r.step_tokens,
            state_checkpoints: r.state_checkpoints,
            shared_pool: r.shared_pool != 0,
        }
    }
}

impl PlanRequest {
    pub fn new(budget_bytes: usize, max_context_tokens: usize) -> PlanRequest {
        PlanRequest { budget_bytes, max_context_tokens, ..PlanRequest::default() }
    }
}

/// One group's share (kvport::GroupPlan).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct GroupPlan {
    pub kind: LayerKind,
    pub num_layers: usize,
    /// One block id (one state slot), all layers.
    pub bytes_per_block: usize,
    /// Per-token kinds, all layers; 0 for state.
    pub bytes_per_token: usize,
    /// State: one state, all layers; else 0.
    pub bytes_per_request: usize,
    /// Blocks (slots) one request of the maximum context holds at its peak.
    pub peak_blocks_per_request: usize,
    /// Blocks (slots) of the group's pool.
    pub num_blocks: usize,
    /// The pool's bytes, allocation rounding included (0 in the shared pool).
    pub bytes: usize,
    /// The group draws from the plan's shared pool (`num_blocks` is then the
    /// shared pool's).
    pub shared: bool,
}

/// The planner's answer (kvport::KvCachePlan).
#[derive(Clone, Debug, PartialEq)]
pub struct KvCachePlan {
    pub block_size: usize,
    /// In group order (the order of each group's first layer).
    pub groups: Vec<GroupPlan>,
    pub total_bytes: usize,
    /// Requests of the maximum context that fit at once.
    pub max_concurrent_requests: usize,
    pub peak_bytes_per_request: usize,
    /// The same with window and chunked layers treated as full attention.
    pub all_full_peak_bytes_per_request: usize,
    /// The same in one shared pool of pages padded to the largest page.
    pub shared_pool_peak_bytes_per_request: usize,
    /// `peak_bytes_per_request / all_full_peak_bytes_per_request`.
    pub ratio_to_all_full: f64,
    /// The shared pool's blocks and bytes (0 when no group shares).
    pub shared_blocks: usize,
    pub shared_bytes: usize,
    /// The cap on layers per group the plan's grouping used (0: none).
    pub max_group_layers: usize,
    /// The context the plan was made for.
    pub max_context_tokens: usize,
}

impl KvCachePlan {
    /// Each group's block count: what [`HybridKvCache::new`] takes.
    pub fn blocks_per_group(&self) -> Vec<usize> {
        self.groups.iter().map(|g| g.num_blocks).collect()
    }
}

/// Groups `layers` and splits `request.budget_bytes` between the groups in
/// the ratio of their peak need per request (kvport::plan_kv_cache).
/// `InvalidArgument` for a bad spec, only `none` layers, a zero block size,
/// budget, context or step, a budget too small for one block of a group, or
/// one that holds fewer than `request.max_requests` requests.
pub fn plan_kv_cache(layers: &[LayerSpec], block_size: usize, request: &PlanRequest) -> Result<KvCachePlan, KvError> {
    let r = ffi::kvport_plan_request {
        budget_bytes: request.budget_bytes,
        max_context_tokens: request.max_context_tokens,
        max_requests: request.max_requests,
        step_tokens: request.step_tokens,
        state_checkpoints: request.state_checkpoints,
        shared_pool: i32::from(request.shared_pool),
    };
    let mut plan = ffi::kvport_plan::default();
    // There are never more groups than layers.
    let mut groups = vec![ffi::kvport_group_plan::default(); layers.len()];
    with_c_specs(layers, |specs, n| {
        check(unsafe { ffi::kvport_plan_kv_cache(specs, n, block_size, &r, &mut plan, groups.as_mut_ptr(), groups.len()) })
    })?;
    groups.truncate(plan.num_groups);
    let groups = groups
        .iter()
        .map(|g| {
            Ok(GroupPlan {
                kind: LayerKind::from_raw(g.kind).ok_or_else(|| KvError::Unknown(format!("kvport returned kind {}", g.kind)))?,
                num_layers: g.num_layers,
                bytes_per_block: g.bytes_per_block,
                bytes_per_token: g.bytes_per_token,
                bytes_per_request: g.bytes_per_request,
                peak_blocks_per_request: g.peak_blocks_per_request,
                num_blocks: g.num_blocks,
                bytes: g.bytes,
                shared: g.shared != 0,
            })
        })
        .collect::<Result<Vec<_>, KvError>>()?;
    Ok(KvCachePlan {
        block_size: plan.block_size,
        groups,
        total_bytes: plan.total_bytes,
        max_concurrent_requests: plan.max_concurrent_requests,
        peak_bytes_per_request: plan.peak_bytes_per_request,
        all_full_peak_bytes_per_request: plan.all_full_peak_bytes_per_request,
        shared_pool_peak_bytes_per_request: plan.shared_pool_peak_bytes_per_request,
        ratio_to_all_full: plan.ratio_to_all_full,
        shared_blocks: plan.shared_blocks,
        shared_bytes: plan.shared_bytes,
        max_group_layers: plan.max_group_layers,
        max_context_tokens: plan.max_context_tokens,
    })
}

// ---- hybrid caches -----------------------------------------------------------------

/// A single-group cache seen as a cache of groups: the one-group
/// [`HybridKvCache`] over a [`PrefixCache`](crate::PrefixCache) or a
/// [`PagedKvCache`](crate::PagedKvCache) (`as_groups`), borrowed from it. A
/// model of one full-attention group is the one-group case of groups:
/// [`HybridBlockTable`]s over it share the prefix cache's blocks and hits
/// with its [`BlockTable`](crate::BlockTable)s. Derefs to the cache.
pub struct GroupsView<'p> {
    cache: HybridKvCache,
    _lender: std::marker::PhantomData<&'p ()>,
}

impl<'p> GroupsView<'p> {
    pub(crate) fn new(cache: HybridKvCache) -> GroupsView<'p> {
        GroupsView { cache, _lender: std::marker::PhantomData }
    }
}

impl<'p> std::ops::Deref for GroupsView<'p> {
    type Target = HybridKvCache;
    fn deref(&self) -> &HybridKvCache {
        &self.cache
    }
}

/// Where a model layer lives.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LayerLocation {
    pub group: usize,
    /// The layer's index inside the group's pool.
    pub index: usize,
}

/// Counters of `reuse_cached_prefix` over a hybrid cache.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct HybridHitCounters {
    pub lookups: u64,
    pub lookup_tokens: u64,
    /// Tokens the hits covered (valid for every group).
    pub hit_tokens: u64,
    /// State copies cached (every state group).
    pub state_checkpoints: u64,
}

/// A model's KV cache as KV cache groups (kvport::HybridKvCache): one block
/// pool and one prefix cache per group. Sequences use it through
/// [`HybridBlockTable`]s, which borrow it; a group's pool (pointers, strides,
/// read/write) is [`group_pool`](Self::group_pool).
///
/// Dropping it waits for the device work its pools queued and frees them.
/// `Send`, not `Sync` (one thread at a time, as the C++ cache).
pub struct HybridKvCache {
    raw: *mut ffi::kvport_hybrid_cache,
    backend: Backend,
    num_groups: usize,
    /// The one-group view of a prefix cache (or cache), destroyed with it.
    lent: bool,
}

// SAFETY: as PagedKvCache: no thread-affine state; the raw pointer keeps it !Sync.
unsafe impl Send for HybridKvCache {}

impl Drop for HybridKvCache {
    fn drop(&mut self) {
        // Tables and group pools borrow the cache: none is alive here.
        if !self.lent {
            unsafe { ffi::kvport_hybrid_cache_destroy(self.raw) };
        }
    }
}

impl std::fmt::Debug for HybridKvCache {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HybridKvCache")
            .field("backend", &self.backend)
            .field("num_layers", &self.num_layers())
            .field("num_groups", &self.num_groups)
            .field("total_bytes", &self.total_bytes())
            .finish()
    }
}

impl HybridKvCache {
    /// Groups `layers` and allocates group g's pool with
    /// `blocks_per_group[g]` blocks (state groups: slots) on `gpu`, layer-major.
    /// State groups cache a copy of a sequence's state every
    /// `state_checkpoint_interval` full blocks (0: never). `InvalidArgument`
    /// for a bad spec, a count per group other than one, a zero count;
    /// `OutOfMemory` when the pools do not fit.
    pub fn new(
        layers: &[LayerSpec],
        block_size: usize,
        state_checkpoint_interval: usize,
        blocks_per_group: &[usize],
        gpu: &dyn GpuBackend,
    ) -> Result<HybridKvCache, KvError> {
        HybridKvCache::new_shared(layers, block_size, state_checkpoint_interval, 0, 0, blocks_per_group, gpu)
    }

    /// With a shared pool: `layers` grouped with at most `max_group_layers`
    /// layers a group (0: every layer of a spec together), the attention
    /// groups whose pages match drawing from one pool of `shared_blocks`
    /// blocks (an allocation in any of them evicts the least recently
    /// released cached block of any), every other group from a pool of
    /// `blocks_per_group[g]` (entries of shared groups are ignored).
    /// `shared_blocks` 0 is [`new`](Self::new). `InvalidArgument` as `new`,
    /// and when `shared_blocks > 0` but no two groups can share.
    pub fn new_shared(
        layers: &[LayerSpec],
        block_size: usize,
        state_checkpoint_interval: usize,
        max_group_layers: usize,
        shared_blocks: usize,
        blocks_per_group: &[usize],
        gpu: &dyn GpuBackend,
    ) -> Result<HybridKvCache, KvError> {
        let backend = gpu.kvport_backend().clone();
        let mut raw = ptr::null_mut();
        with_c_specs(layers, |specs, n| {
            check(unsafe {
                ffi::kvport_hybrid_cache_create_shared(
                    backend.raw(),
                    specs,
                    n,
                    block_size,
                    state_checkpoint_interval,
                    max_group_layers,
                    shared_blocks,
                    blocks_per_group.as_ptr(),
                    blocks_per_group.len(),
                    &mut raw,
                )
            })
        })?;
        let mut num_groups = 0usize;
        expect_ok(unsafe { ffi::kvport_hybrid_cache_num_groups(raw, &mut num_groups) }, "kvport_hybrid_cache_num_groups");
        Ok(HybridKvCache { raw, backend, num_groups, lent: false })
    }

    /// The lent handle `raw` (the one-group view of a prefix cache or cache).
    pub(crate) fn lent(raw: *mut ffi::kvport_hybrid_cache, backend: Backend) -> HybridKvCache {
        let mut num_groups = 0usize;
        expect_ok(unsafe { ffi::kvport_hybrid_cache_num_groups(raw, &mut num_groups) }, "kvport_hybrid_cache_num_groups");
        HybridKvCache { raw, backend, num_groups, lent: true }
    }

    /// Sized by a plan of the same layers and block size, sharing a pool
    /// where the plan does (a plan made with `shared_pool`).
    pub fn from_plan(
        layers: &[LayerSpec],
        plan: &KvCachePlan,
        state_checkpoint_interval: usize,
        gpu: &dyn GpuBackend,
    ) -> Result<HybridKvCache, KvError> {
        HybridKvCache::new_shared(
            layers,
            plan.block_size,
            state_checkpoint_interval,
            plan.max_group_layers,
            plan.shared_blocks,
            &plan.blocks_per_group(),
            gpu,
        )
    }

    /// Blocks of the shared pool; 0 when no group draws from one.
    pub fn shared_pool_blocks(&self) -> usize {
        self.size(ffi::kvport_hybrid_cache_shared_pool_blocks)
    }

    /// Whether the group draws from the shared pool. `OutOfRange` for group
    /// >= num_groups.
    pub fn in_shared_pool(&self, group: usize) -> Result<bool, KvError> {
        let mut raw = 0i32;
        check(unsafe { ffi::kvport_hybrid_cache_group_in_shared_pool(self.raw, group, &mut raw) })?;
        Ok(raw != 0)
    }

    /// The C handle (valid while the cache lives).
    pub fn raw(&self) -> *mut ffi::kvport_hybrid_cache {
        self.raw
    }

    pub fn backend(&self) -> &Backend {
        &self.backend
    }

    fn size(&self, f: unsafe extern "C" fn(*const ffi::kvport_hybrid_cache, *mut usize) -> ffi::kvport_status) -> usize {
        let mut n = 0usize;
        expect_ok(unsafe { f(self.raw, &mut n) }, "kvport_hybrid_cache_*");
        n
    }

    /// Model layers.
    pub fn num_layers(&self) -> usize {
        self.size(ffi::kvport_hybrid_cache_num_layers)
    }
    pub fn num_groups(&self) -> usize {
        self.num_groups
    }
    pub fn block_size(&self) -> usize {
        self.size(ffi::kvport_hybrid_cache_block_size)
    }
    /// Bytes of every pool.
    pub fn total_bytes(&self) -> usize {
        self.size(ffi::kvport_hybrid_cache_total_bytes)
    }

    fn group_size(
        &self,
        f: unsafe extern "C" fn(*const ffi::kvport_hybrid_cache, usize, *mut usize) -> ffi::kvport_status,
        group: usize,
    ) -> Result<usize, KvError> {
        let mut n = 0usize;
        check(unsafe { f(self.raw, group, &mut n) })?;
        Ok(n)
    }

    /// The group's kind. `OutOfRange` for group >= num_groups (every group
    /// query).
    pub fn group_kind(&self, group: usize) -> Result<LayerKind, KvError> {
        let mut raw = 0i32;
        check(unsafe { ffi::kvport_hybrid_cache_group_kind(self.raw, group, &mut raw) })?;
        LayerKind::from_raw(raw).ok_or_else(|| KvError::Unknown(format!("kvport returned kind {}", raw)))
    }

    /// The spec of the group's first layer.
    pub fn group_spec(&self, group: usize) -> Result<LayerSpec, KvError> {
        let mut c = ffi::kvport_layer_spec {
            kind: 0,
            num_kv_heads: 0,
            head_dim_k: 0,
            head_dim_v: 0,
            dtype: 0,
            window: 0,
            chunk: 0,
            kv_lora_rank: 0,
            rope_dim: 0,
            mla_format: 0,
            state: ptr::null(),
            num_state: 0,
        };
        check(unsafe { ffi::kvport_hybrid_cache_group_spec(self.raw, group, &mut c) })?;
        LayerSpec::from_c(&c)
    }

    /// The group's model layers, ascending (group layer i is model layer
    /// `layers[i]`).
    pub fn group_layers(&self, group: usize) -> Result<Vec<usize>, KvError> {
        let n = self.group_size(ffi::kvport_hybrid_cache_group_num_layers, group)?;
        let mut out = vec![0usize; n];
        let mut count = 0usize;
        check(unsafe { ffi::kvport_hybrid_cache_group_layers(self.raw, group, out.as_mut_ptr(), out.len(), &mut count) })?;
        out.truncate(count);
        Ok(out)
    }

    /// Blocks (slots) the group holds for sequences (in use, not evictable).
    pub fn group_blocks_in_use(&self, group: usize) -> Result<usize, KvError> {
        self.group_size(ffi::kvport_hybrid_cache_group_blocks_in_use, group)
    }

    /// Where model layer `layer` is; `None` for a layer without KV.
    /// `OutOfRange` for layer >= num_layers.
    pub fn locate(&self, layer: usize) -> Result<Option<LayerLocation>, KvError> {
        let (mut has, mut group, mut index) = (false, 0usize, 0usize);
        check(unsafe { ffi::kvport_hybrid_cache_locate(self.raw, layer, &mut has, &mut group, &mut index) })?;
        Ok(if has { Some(LayerLocation { group, index }) } else { None })
    }

    /// The group's pool as a [`PagedKvCache`] (read-only: `&PagedKvCache`):
    /// config, pointers, strides, region layouts, `read_block` /
    /// `write_block`, `zero_blocks`, `check_invariants`. K-only for MLA and
    /// state groups (no V: the V pointer calls are `InvalidArgument`); a state
    /// group's block is one slot of `config().head_dim_k` bytes. Its blocks
    /// belong to the hybrid tables, so the allocation calls (which need
    /// `&mut`) are not reachable.
    pub fn group_pool(&self, group: usize) -> Result<GroupPool<'_>, KvError> {
        let mut raw = ptr::null_mut();
        check(unsafe { ffi::kvport_hybrid_cache_group_cache(self.raw, group, &mut raw) })?;
        let cache = PagedKvCache::from_lent(raw, self.backend.clone())?;
        Ok(GroupPool { cache, _hybrid: PhantomData })
    }

    pub fn hit_counters(&self) -> HybridHitCounters {
        let mut c = ffi::kvport_hybrid_hit_counters::default();
        expect_ok(unsafe { ffi::kvport_hybrid_cache_hit_counters(self.raw, &mut c) }, "kvport_hybrid_cache_hit_counters");
        HybridHitCounters {
            lookups: c.lookups,
            lookup_tokens: c.lookup_tokens,
            hit_tokens: c.hit_tokens,
            state_checkpoints: c.state_checkpoints,
        }
    }

    /// Every group's checks (violations prefixed "group g: ").
    pub fn check_invariants(&self) -> Result<InvariantReport, KvError> {
        let raw = self.raw;
        invariant_report(|r, t, n, needed| unsafe { ffi::kvport_hybrid_cache_check_invariants(raw, r, t, n, needed) })
    }

    /// Waits for the device work of every pool.
    pub fn synchronize(&self) -> Result<(), KvError> {
        check(unsafe { ffi::kvport_hybrid_cache_synchronize(self.raw) })
    }
}

/// A hybrid cache's group pool, borrowed from it: derefs to a
/// `&PagedKvCache`. It is never destroyed on its own (the hybrid cache frees
/// its pools).
pub struct GroupPool<'c> {
    cache: PagedKvCache, // lent: its Drop leaves the handle alone
    _hybrid: PhantomData<&'c HybridKvCache>,
}

impl<'c> std::fmt::Debug for GroupPool<'c> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_tuple("GroupPool").field(&self.cache).finish()
    }
}

impl<'c> Deref for GroupPool<'c> {
    type Target = PagedKvCache;
    fn deref(&self) -> &PagedKvCache {
        &self.cache
    }
}


// ---- hybrid block tables ---------------------------------------------------------------

/// One group's need for an append.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct GroupNeed {
    /// Blocks (slots) to allocate.
    pub fresh: usize,
    /// Blocks the freeing rules give back to the group first.
    pub released: usize,
}

/// One sequence over every group of a [`HybridKvCache`]
/// (kvport::HybridBlockTable): one block list per block group, with
/// [`NULL_BLOCK`] where a window or chunked group released a block, and a
/// working state slot per state group. Dropping it releases everything.
pub struct HybridBlockTable<'c> {
    raw: *mut ffi::kvport_hybrid_block_table,
    cache: &'c HybridKvCache,
}

impl<'c> Drop for HybridBlockTable<'c> {
    fn drop(&mut self) {
        unsafe { ffi::kvport_hybrid_block_table_destroy(self.raw) };
    }
}

impl<'c> std::fmt::Debug for HybridBlockTable<'c> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HybridBlockTable").field("num_tokens", &self.num_tokens()).finish()
    }
}

impl<'c> HybridBlockTable<'c> {
    /// An empty table; `extra_key` (e.g. a LoRA id) goes into every hash.
    pub fn new(cache: &'c HybridKvCache, extra_key: u64) -> Result<HybridBlockTable<'c>, KvError> {
        let mut raw = ptr::null_mut();
        check(unsafe { ffi::kvport_hybrid_block_table_create(cache.raw, extra_key, &mut raw) })?;
        Ok(HybridBlockTable { raw, cache })
    }

    pub fn raw(&self) -> *mut ffi::kvport_hybrid_block_table {
        self.raw
    }

    pub fn cache(&self) -> &'c HybridKvCache {
        self.cache
    }

    /// Starts the (empty) table from the longest cached prefix of `prompt`
    /// valid for every group; returns the tokens it covers (a multiple of the
    /// block size). A state hit copies the checkpoint on `stream`.
    /// `InvalidArgument` when the table is not empty.
    pub fn reuse_cached_prefix(&mut self, prompt: &[u32], stream: u64) -> Result<usize, KvError> {
        let mut hit = 0usize;
        check(unsafe {
            ffi::kvport_hybrid_block_table_reuse_cached_prefix(self.raw, prompt.as_ptr(), prompt.len(), stream_ptr(stream), &mut hit)
        })?;
        Ok(hit)
    }

    pub fn set_prefix_hit_mode(&mut self, mode: PrefixHitMode) -> Result<(), KvError> {
        let raw = match mode {
            PrefixHitMode::ComputeLastToken => ffi::KVPORT_PREFIX_HIT_COMPUTE_LAST_TOKEN,
            PrefixHitMode::Full => ffi::KVPORT_PREFIX_HIT_FULL,
        };
        check(unsafe { ffi::kvport_hybrid_block_table_set_prefix_hit_mode(self.raw, raw) })
    }

    /// Keep the sliding-window blocks before the end of the cached prefix
    /// the lookup found, once the table reaches it, so that requests sharing
    /// the prefix still hit there under memory pressure (off by default).
    pub fn set_keep_shared_windows(&mut self, keep: bool) {
        expect_ok(
            unsafe { ffi::kvport_hybrid_block_table_set_keep_shared_windows(self.raw, i32::from(keep)) },
            "kvport_hybrid_block_table_set_keep_shared_windows",
        );
    }

    pub fn keeps_shared_windows(&self) -> bool {
        let mut raw = 0i32;
        expect_ok(
            unsafe { ffi::kvport_hybrid_block_table_keeps_shared_windows(self.raw, &mut raw) },
            "kvport_hybrid_block_table_keeps_shared_windows",
        );
        raw != 0
    }

    /// BlockTable's compute-last-token rule as an option (off by default): a
    /// block-aligned prompt whose blocks are all cached hits n - 1 tokens,
    /// each group's last block a private copy; not with a state group, a
    /// lower tier under a cache of several groups, nor without a block for a
    /// copy (the default rule then).
    pub fn set_copy_last_block(&mut self, copy: bool) {
        expect_ok(
            unsafe { ffi::kvport_hybrid_block_table_set_copy_last_block(self.raw, i32::from(copy)) },
            "kvport_hybrid_block_table_set_copy_last_block",
        );
    }

    pub fn copies_last_block(&self) -> bool {
        let mut raw = 0i32;
        expect_ok(
            unsafe { ffi::kvport_hybrid_block_table_copies_last_block(self.raw, &mut raw) },
            "kvport_hybrid_block_table_copies_last_block",
        );
        raw != 0
    }

    /// Keeps the window blocks just before the table's current end (a point
    /// other requests hit); best-effort, nothing kept out of memory; again
    /// moves the kept point.
    pub fn keep_hit_point(&mut self) {
        expect_ok(unsafe { ffi::kvport_hybrid_block_table_keep_hit_point(self.raw) }, "kvport_hybrid_block_table_keep_hit_point");
    }

    /// The extra references the kept windows hold in the group.
    /// `OutOfRange` for group >= num_groups.
    pub fn num_kept_blocks(&self, group: usize) -> Result<usize, KvError> {
        let mut n = 0usize;
        check(unsafe { ffi::kvport_hybrid_block_table_num_kept_blocks(self.raw, group, &mut n) })?;
        Ok(n)
    }

    pub fn prefix_hit_mode(&self) -> PrefixHitMode {
        let mut raw = 0i32;
        expect_ok(
            unsafe { ffi::kvport_hybrid_block_table_prefix_hit_mode(self.raw, &mut raw) },
            "kvport_hybrid_block_table_prefix_hit_mode",
        );
        if raw == ffi::KVPORT_PREFIX_HIT_FULL {
            PrefixHitMode::Full
        } else {
            PrefixHitMode::ComputeLastToken
        }
    }

    /// Appends tokens in every group (freeing rules, state checkpoints,
    /// copy-on-write, allocation). All or nothing: `CacheExhausted` naming
    /// the group before any change.
    pub fn append_tokens(&mut self, tokens: &[u32], stream: u64) -> Result<(), KvError> {
        check(unsafe {
            ffi::kvport_hybrid_block_table_append_tokens(self.raw, tokens.as_ptr(), tokens.len(), stream_ptr(stream))
        })
    }

    /// Speculative decoding: appends draft tokens, which get KV slots (and a
    /// state slot each in a state group) but are never hashed, registered or
    /// announced until committed (the freeing rules see the committed length
    /// only). All or nothing: `CacheExhausted` naming the group.
    pub fn append_draft(&mut self, tokens: &[u32], stream: u64) -> Result<(), KvError> {
        check(unsafe {
            ffi::kvport_hybrid_block_table_append_draft(self.raw, tokens.as_ptr(), tokens.len(), stream_ptr(stream))
        })
    }

    /// Whether appending `num_tokens` draft tokens would find every block and
    /// state slot it needs.
    pub fn can_append_draft(&self, num_tokens: usize) -> bool {
        let mut ok = false;
        expect_ok(
            unsafe { ffi::kvport_hybrid_block_table_can_append_draft(self.raw, num_tokens, &mut ok) },
            "kvport_hybrid_block_table_can_append_draft",
        );
        ok
    }

    /// State group g's slots for the state after each draft token (the
    /// verifier writes them); empty for other groups. `OutOfRange` for group
    /// >= num_groups.
    pub fn draft_state_slots(&self, group: usize) -> Result<Vec<u32>, KvError> {
        let mut out = vec![0u32; self.num_draft_tokens()];
        let mut n = 0usize;
        check(unsafe {
            ffi::kvport_hybrid_block_table_draft_state_slots(self.raw, group, out.as_mut_ptr(), out.len(), &mut n)
        })?;
        out.truncate(n);
        Ok(out)
    }

    /// Draft tokens held (appended, not committed or truncated).
    pub fn num_draft_tokens(&self) -> usize {
        let mut n = 0usize;
        expect_ok(
            unsafe { ffi::kvport_hybrid_block_table_num_draft_tokens(self.raw, &mut n) },
            "kvport_hybrid_block_table_num_draft_tokens",
        );
        n
    }

    /// Commits the first `num_tokens` draft tokens (accepted): their full
    /// blocks are registered and announced. `InvalidArgument` past the drafts
    /// held.
    pub fn commit(&mut self, num_tokens: usize) -> Result<(), KvError> {
        check(unsafe { ffi::kvport_hybrid_block_table_commit(self.raw, num_tokens) })
    }

    /// Keeps the first `num_tokens` tokens: drops the draft tokens past it
    /// and frees the blocks only they used. `InvalidArgument` below the
    /// committed tokens (never taken back) or past every token held.
    pub fn truncate(&mut self, num_tokens: usize) -> Result<(), KvError> {
        check(unsafe { ffi::kvport_hybrid_block_table_truncate(self.raw, num_tokens) })
    }

    /// Committed tokens ([`num_tokens`](Self::num_tokens) counts the drafts too).
    pub fn num_committed(&self) -> usize {
        let mut n = 0usize;
        expect_ok(
            unsafe { ffi::kvport_hybrid_block_table_num_committed(self.raw, &mut n) },
            "kvport_hybrid_block_table_num_committed",
        );
        n
    }

    /// The table's own checks: no block holding a draft token (or not yet
    /// full of committed tokens) is cached.
    pub fn check_invariants(&self) -> Result<InvariantReport, KvError> {
        let raw = self.raw;
        invariant_report(|r, t, n, needed| unsafe { ffi::kvport_hybrid_block_table_check_invariants(raw, r, t, n, needed) })
    }

    /// Whether appending `num_tokens` would find every block it needs.
    pub fn can_append(&self, num_tokens: usize) -> bool {
        let mut ok = false;
        expect_ok(
            unsafe { ffi::kvport_hybrid_block_table_can_append(self.raw, num_tokens, &mut ok) },
            "kvport_hybrid_block_table_can_append",
        );
        ok
    }

    /// Each group's need for appending `num_tokens`.
    pub fn blocks_needed(&self, num_tokens: usize) -> Vec<GroupNeed> {
        let mut out = vec![ffi::kvport_group_need::default(); self.cache.num_groups()];
        let mut n = 0usize;
        expect_ok(
            unsafe { ffi::kvport_hybrid_block_table_blocks_needed(self.raw, num_tokens, out.as_mut_ptr(), out.len(), &mut n) },
            "kvport_hybrid_block_table_blocks_needed",
        );
        out.truncate(n);
        out.iter().map(|g| GroupNeed { fresh: g.fresh, released: g.released }).collect()
    }

    /// A table sharing every live block; each working state is copied into
    /// a new slot on `stream`. `CacheExhausted` (nothing changed) when a
    /// state group has no slot.
    pub fn fork(&self, stream: u64) -> Result<HybridBlockTable<'c>, KvError> {
        let mut raw = ptr::null_mut();
        check(unsafe { ffi::kvport_hybrid_block_table_fork(self.raw, stream_ptr(stream), &mut raw) })?;
        Ok(HybridBlockTable { raw, cache: self.cache })
    }

    /// Releases every block and slot; the table stays usable.
    pub fn release(&mut self) -> Result<(), KvError> {
        check(unsafe { ffi::kvport_hybrid_block_table_release(self.raw) })
    }

    /// Every token the table holds KV slots for: committed and draft.
    pub fn num_tokens(&self) -> usize {
        let mut n = 0usize;
        expect_ok(unsafe { ffi::kvport_hybrid_block_table_num_tokens(self.raw, &mut n) }, "kvport_hybrid_block_table_num_tokens");
        n
    }

    /// Group g's block list, [`NULL_BLOCK`] where released (empty for a
    /// state group). `OutOfRange` for group >= num_groups.
    pub fn blocks(&self, group: usize) -> Result<Vec<u32>, KvError> {
        let mut n = 0usize;
        check(unsafe { ffi::kvport_hybrid_block_table_num_blocks(self.raw, group, &mut n) })?;
        let mut out = vec![0u32; n];
        check(unsafe { ffi::kvport_hybrid_block_table_blocks(self.raw, group, out.as_mut_ptr(), out.len(), &mut n) })?;
        out.truncate(n);
        Ok(out)
    }

    /// Entries of group g's list that are not [`NULL_BLOCK`].
    pub fn num_live_blocks(&self, group: usize) -> Result<usize, KvError> {
        let mut n = 0usize;
        check(unsafe { ffi::kvport_hybrid_block_table_num_live_blocks(self.raw, group, &mut n) })?;
        Ok(n)
    }

    /// Group g's working state slot (a block of `group_pool(g)`), or `None`
    /// (no state yet, or not a state group).
    pub fn state_slot(&self, group: usize) -> Result<Option<u32>, KvError> {
        let (mut has, mut slot) = (false, 0u32);
        check(unsafe { ffi::kvport_hybrid_block_table_state_slot(self.raw, group, &mut has, &mut slot) })?;
        Ok(if has { Some(slot) } else { None })
    }

    /// Copy-on-write copies (every group) this table made.
    pub fn copy_on_writes(&self) -> u64 {
        let mut n = 0u64;
        expect_ok(
            unsafe { ffi::kvport_hybrid_block_table_copy_on_writes(self.raw, &mut n) },
            "kvport_hybrid_block_table_copy_on_writes",
        );
        n
    }
}

// ---- batch metadata for attention kernels (docs/batch-metadata.md) ----

/// One step's batch over group `group`: `tables[i]` computes its last
/// `num_new_tokens[i]` tokens; kernel blocks of `kernel_block_size` tokens (0:
/// the cache's; it must divide it); `null_block` for released entries and
/// padding (vLLM's 0).
pub struct Batch<'a, 'c> {
    pub tables: &'a [&'a HybridBlockTable<'c>],
    pub num_new_tokens: &'a [usize],
    pub group: usize,
    pub kernel_block_size: usize,
    pub null_block: i32,
}

/// FlashInfer's paged-KV description of a batch (all int32).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct FlashInferPages {
    /// [B + 1], from 0, non-decreasing.
    pub indptr: Vec<i32>,
    /// Every sequence's pages in position order.
    pub indices: Vec<i32>,
    /// [B], each in [1, page size].
    pub last_page_len: Vec<i32>,
    /// [B]: tokens each sequence holds (MLA's kv_len).
    pub kv_len: Vec<i32>,
}

impl<'a, 'c> Batch<'a, 'c> {
    fn with_raw<T>(&self, f: impl FnOnce(&ffi::kvport_batch) -> T) -> T {
        let raws: Vec<*const ffi::kvport_hybrid_block_table> = self.tables.iter().map(|t| t.raw as *const _).collect();
        let raw = ffi::kvport_batch {
            tables: raws.as_ptr(),
            num_new_tokens: self.num_new_tokens.as_ptr(),
            num_sequences: self.tables.len().min(self.num_new_tokens.len()),
            group: self.group,
            kernel_block_size: self.kernel_block_size,
            null_block: self.null_block,
        };
        f(&raw)
    }

    fn check_lengths(&self) -> Result<(), KvError> {
        if self.tables.len() != self.num_new_tokens.len() {
            return Err(KvError::InvalidArgument(format!(
                "batch metadata: {} tables but {} new-token counts",
                self.tables.len(),
                self.num_new_tokens.len()
            )));
        }
        Ok(())
    }

    /// vLLM v1's block-table rows (int32, row-major `num_rows` x
    /// `row_width`): kernel block ids left-aligned, `null_block` elsewhere.
    pub fn block_table_rows(&self, row_width: usize, num_rows: usize) -> Result<Vec<i32>, KvError> {
        self.check_lengths()?;
        let mut rows = vec![0i32; row_width * num_rows];
        self.with_raw(|b| check(unsafe { ffi::kvport_build_block_table_rows(b, row_width, rows.as_mut_ptr(), num_rows) }))?;
        Ok(rows)
    }

    /// SGLang's req_to_token (int32, row-major `num_rows` x `row_width`):
    /// every position's KV slot, `null_block` for released positions, past
    /// each sequence and in rows past the batch.
    pub fn token_locations(&self, row_width: usize, num_rows: usize) -> Result<Vec<i32>, KvError> {
        self.check_lengths()?;
        let mut out = vec![0i32; row_width * num_rows];
        self.with_raw(|b| check(unsafe { ffi::kvport_build_token_locations(b, row_width, out.as_mut_ptr(), num_rows) }))?;
        Ok(out)
    }

    /// Each new token's slot (kernel block * kernel_block_size + offset),
    /// -1 padding up to `num_slots`.
    pub fn slot_mapping(&self, num_slots: usize) -> Result<Vec<i64>, KvError> {
        self.check_lengths()?;
        let mut slots = vec![0i64; num_slots];
        let mut n = 0usize;
        self.with_raw(|b| check(unsafe { ffi::kvport_build_slot_mapping(b, slots.as_mut_ptr(), slots.len(), &mut n) }))?;
        Ok(slots)
    }

    /// FlashInfer's pages.
    pub fn flashinfer_pages(&self) -> Result<FlashInferPages, KvError> {
        self.check_lengths()?;
        let mut n = 0usize;
        self.with_raw(|b| {
            check(unsafe {
                ffi::kvport_build_flashinfer_pages(b, ptr::null_mut(), ptr::null_mut(), 0, ptr::null_mut(), ptr::null_mut(), &mut n)
            })
        })?;
        let seqs = self.tables.len();
        let mut out = FlashInferPages {
            indptr: vec![0; seqs + 1],
            indices: vec![0; n],
            last_page_len: vec![0; seqs],
            kv_len: vec![0; seqs],
        };
        self.with_raw(|b| {
            check(unsafe {
                ffi::kvport_build_flashinfer_pages(
                    b,
                    out.indptr.as_mut_ptr(),
                    out.indices.as_mut_ptr(),
                    out.indices.len(),
                    out.last_page_len.as_mut_ptr(),
                    out.kv_len.as_mut_ptr(),
                    &mut n,
                )
            })
        })?;
        Ok(out)
    }
}

/// vLLM v1's row width: cdiv(max_model_len, kernel_block_size) rounded up to
/// a multiple of 128 / kernel_block_size. `InvalidArgument` for 0 sizes.
pub fn vllm_row_width(max_model_len: usize, kernel_block_size: usize) -> Result<usize, KvError> {
    let mut n = 0usize;
    check(unsafe { ffi::kvport_vllm_row_width(max_model_len, kernel_block_size, &mut n) })?;
    Ok(n)
}

