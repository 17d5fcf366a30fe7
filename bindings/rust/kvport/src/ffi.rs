// SPDX-License-Identifier: Apache-2.0
//! Hand-written declarations of the C ABI in `kvport/kvport.h`
//! (bindings/c/include/kvport/kvport.h), one for one, in the header's order.
//!
//! `tests/header_check.rs` parses the header and this file and fails when a
//! function, a parameter type, a struct field or an enum constant differs.
//! C enums are `c_int` here (the header's structs store them as `int32_t`);
//! the header's integer `#define`s are `pub const`s of the same value.
#![allow(non_camel_case_types)]

use std::os::raw::{c_char, c_int, c_void};

// ---- status codes ----------------------------------------------------------

pub type kvport_status = c_int;
pub const KVPORT_OK: kvport_status = 0;
pub const KVPORT_ERR_ERROR: kvport_status = 1;
pub const KVPORT_ERR_INVALID_ARGUMENT: kvport_status = 2;
pub const KVPORT_ERR_CACHE_EXHAUSTED: kvport_status = 3;
pub const KVPORT_ERR_OUT_OF_MEMORY: kvport_status = 4;
pub const KVPORT_ERR_BACKEND: kvport_status = 5;
pub const KVPORT_ERR_DEVICE_LOST: kvport_status = 6;
pub const KVPORT_ERR_OUT_OF_RANGE: kvport_status = 7;
pub const KVPORT_ERR_INVALID_HANDLE: kvport_status = 8;
pub const KVPORT_ERR_HANDLE_IN_USE: kvport_status = 9;
pub const KVPORT_ERR_UNKNOWN: kvport_status = 10;

// ---- handles (opaque) --------------------------------------------------------

#[repr(C)]
pub struct kvport_backend {
    _opaque: [u8; 0],
}
#[repr(C)]
pub struct kvport_stream {
    _opaque: [u8; 0],
}
#[repr(C)]
pub struct kvport_cache {
    _opaque: [u8; 0],
}
#[repr(C)]
pub struct kvport_prefix_cache {
    _opaque: [u8; 0],
}
#[repr(C)]
pub struct kvport_block_table {
    _opaque: [u8; 0],
}
#[repr(C)]
pub struct kvport_hybrid_cache {
    _opaque: [u8; 0],
}
#[repr(C)]
pub struct kvport_hybrid_block_table {
    _opaque: [u8; 0],
}

// ---- configuration -------------------------------------------------------------

pub type kvport_dtype = c_int;
pub const KVPORT_DTYPE_F16: kvport_dtype = 0;
pub const KVPORT_DTYPE_BF16: kvport_dtype = 1;
pub const KVPORT_DTYPE_FP8_E4M3: kvport_dtype = 2;
pub const KVPORT_DTYPE_FP8_E5M2: kvport_dtype = 3;
pub const KVPORT_DTYPE_NVFP4: kvport_dtype = 4;
pub const KVPORT_DTYPE_TURBO2: kvport_dtype = 5;
pub const KVPORT_DTYPE_TURBO3: kvport_dtype = 6;
pub const KVPORT_DTYPE_TURBO4: kvport_dtype = 7;
pub const KVPORT_DTYPE_TURBO8: kvport_dtype = 8;

pub type kvport_layout = c_int;
pub const KVPORT_LAYOUT_LAYER_MAJOR: kvport_layout = 0;
pub const KVPORT_LAYOUT_BLOCK_MAJOR: kvport_layout = 1;

#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct kvport_config {
    pub num_layers: usize,
    pub block_size: usize,
    pub num_kv_heads: usize,
    pub head_dim_k: usize,
    pub head_dim_v: usize,
    pub dtype: i32,
    pub layout: i32,
    pub layer_dtypes: *const i32,
    pub num_layer_dtypes: usize,
}

/// One pool of the engine's memory (kvport_cache_create_adopted).
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct kvport_pool {
    pub base: *mut c_void,
    pub bytes: usize,
}

#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct kvport_region_layout {
    pub data_bytes: usize,
    pub data_padding: usize,
    pub scale_offset: usize,
    pub scale_bytes: usize,
    pub scale_padding: usize,
    pub total_bytes: usize,
}

#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct kvport_block_copy {
    pub src: u32,
    pub dst: u32,
}

#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub struct kvport_cache_counters {
    pub allocs: u64,
    pub frees: u64,
    pub ignored_double_frees: u64,
    pub exhaustion_events: u64,
    pub peak_blocks_in_use: u64,
}

#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub struct kvport_invariant_report {
    pub ok: bool,
    pub blocks_checked: usize,
    pub free_blocks: usize,
    pub blocks_in_use: usize,
    pub evictable_blocks: usize,
    pub cached_blocks: usize,
    pub num_violations: usize,
}

#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub struct kvport_prefix_cache_counters {
    pub lookups: u64,
    pub hits: u64,
    pub misses: u64,
    pub inserts: u64,
    pub evictions: u64,
    pub ignored_releases: u64,
}

pub type kvport_prefix_hit_mode = c_int;
pub const KVPORT_PREFIX_HIT_COMPUTE_LAST_TOKEN: kvport_prefix_hit_mode = 0;
pub const KVPORT_PREFIX_HIT_FULL: kvport_prefix_hit_mode = 1;

// ---- layer specs, the planner, hybrid caches ---------------------------------

pub type kvport_layer_kind = c_int;
pub const KVPORT_LAYER_FULL_ATTENTION: kvport_layer_kind = 0;
pub const KVPORT_LAYER_MLA: kvport_layer_kind = 1;
pub const KVPORT_LAYER_SLIDING_WINDOW: kvport_layer_kind = 2;
pub const KVPORT_LAYER_CHUNKED_LOCAL: kvport_layer_kind = 3;
pub const KVPORT_LAYER_STATE: kvport_layer_kind = 4;
pub const KVPORT_LAYER_NONE: kvport_layer_kind = 5;

pub type kvport_mla_format = c_int;
pub const KVPORT_MLA_PLAIN: kvport_mla_format = 0;
pub const KVPORT_MLA_FP8_DS_MLA: kvport_mla_format = 1;

pub type kvport_state_dtype = c_int;
pub const KVPORT_STATE_F32: kvport_state_dtype = 0;
pub const KVPORT_STATE_F16: kvport_state_dtype = 1;
pub const KVPORT_STATE_BF16: kvport_state_dtype = 2;

// #define constants of the header.
pub const KVPORT_STATE_MAX_DIMS: usize = 8;
pub const KVPORT_NULL_BLOCK: u32 = 0xFFFFFFFF;

#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct kvport_state_tensor {
    pub name: *const c_char,
    pub ndim: usize,
    pub shape: [usize; KVPORT_STATE_MAX_DIMS],
    pub dtype: i32,
}

#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct kvport_layer_spec {
    pub kind: i32,
    pub num_kv_heads: usize,
    pub head_dim_k: usize,
    pub head_dim_v: usize,
    pub dtype: i32,
    pub window: usize,
    pub chunk: usize,
    pub kv_lora_rank: usize,
    pub rope_dim: usize,
    pub mla_format: i32,
    pub state: *const kvport_state_tensor,
    pub num_state: usize,
}

#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub struct kvport_plan_request {
    pub budget_bytes: usize,
    pub max_context_tokens: usize,
    pub max_requests: usize,
    pub step_tokens: usize,
    pub state_checkpoints: usize,
    pub shared_pool: i32,
}

#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct kvport_group_plan {
    pub kind: i32,
    pub num_layers: usize,
    pub bytes_per_block: usize,
    pub bytes_per_token: usize,
    pub bytes_per_request: usize,
    pub peak_blocks_per_request: usize,
    pub num_blocks: usize,
    pub bytes: usize,
    pub shared: i32,
}

#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub struct kvport_plan {
    pub block_size: usize,
    pub num_groups: usize,
    pub total_bytes: usize,
    pub max_concurrent_requests: usize,
    pub peak_bytes_per_request: usize,
    pub all_full_peak_bytes_per_request: usize,
    pub shared_pool_peak_bytes_per_request: usize,
    pub ratio_to_all_full: f64,
    pub shared_blocks: usize,
    pub shared_bytes: usize,
    pub max_group_layers: usize,
    pub max_context_tokens: usize,
}

#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct kvport_hybrid_hit_counters {
    pub lookups: u64,
    pub lookup_tokens: u64,
    pub hit_tokens: u64,
    pub state_checkpoints: u64,
}

#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct kvport_batch {
    pub tables: *const *const kvport_hybrid_block_table,
    pub num_new_tokens: *const usize,
    pub num_sequences: usize,
    pub group: usize,
    pub kernel_block_size: usize,
    pub null_block: i32,
}

#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct kvport_group_need {
    pub fresh: usize,
    pub released: usize,
}

// ---- KV cache events ----------------------------------------------------------

pub type kvport_event_form = c_int;
pub const KVPORT_EVENT_FORM_MAP: kvport_event_form = 0;
pub const KVPORT_EVENT_FORM_POSITIONAL: kvport_event_form = 1;

pub type kvport_events_socket = c_int;
pub const KVPORT_EVENTS_SOCKET_PUB: kvport_events_socket = 0;
pub const KVPORT_EVENTS_SOCKET_REPLAY: kvport_events_socket = 1;

#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct kvport_events_options {
    pub endpoint: *const c_char,
    pub topic: *const c_char,
    pub replay_endpoint: *const c_char,
    pub has_data_parallel_rank: bool,
    pub data_parallel_rank: i64,
    pub form: i32,
    pub max_batch_events: usize,
    pub batch_interval_us: u64,
    pub buffer_events: usize,
    pub buffer_bytes: usize,
    pub send_high_water_mark: i32,
    pub replay_ring_batches: usize,
    pub linger_ms: u32,
}

#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct kvport_events_stats {
    pub events_accepted: u64,
    pub events_dropped: u64,
    pub batches_sent: u64,
    pub send_failures: u64,
    pub replay_requests: u64,
    pub snapshots: u64,
    pub bad_requests: u64,
    pub next_seq: u64,
}

extern "C" {
    // errors and version
    pub fn kvport_status_name(status: i32) -> *const c_char;
    pub fn kvport_last_error() -> *const c_char;
    pub fn kvport_clear_last_error();
    pub fn kvport_version_string() -> *const c_char;
    pub fn kvport_version(major: *mut u32, minor: *mut u32, patch: *mut u32) -> kvport_status;

    // backends
    pub fn kvport_backend_create(name: *const c_char, out: *mut *mut kvport_backend)
        -> kvport_status;
    pub fn kvport_backend_create_on(
        name: *const c_char,
        device: c_int,
        out: *mut *mut kvport_backend,
    ) -> kvport_status;
    pub fn kvport_backend_destroy(backend: *mut kvport_backend) -> kvport_status;
    pub fn kvport_backend_name(backend: *const kvport_backend, out: *mut *const c_char)
        -> kvport_status;
    pub fn kvport_backend_device_count(backend: *const kvport_backend, out: *mut c_int)
        -> kvport_status;
    pub fn kvport_backend_mem_info(
        backend: *const kvport_backend,
        free_bytes: *mut usize,
        total_bytes: *mut usize,
    ) -> kvport_status;
    pub fn kvport_backend_synchronize(backend: *mut kvport_backend) -> kvport_status;

    // streams
    pub fn kvport_stream_create(backend: *mut kvport_backend, out: *mut *mut kvport_stream)
        -> kvport_status;
    pub fn kvport_stream_destroy(stream: *mut kvport_stream) -> kvport_status;
    pub fn kvport_stream_synchronize(stream: *mut kvport_stream) -> kvport_status;

    // configuration
    pub fn kvport_config_init(config: *mut kvport_config) -> kvport_status;
    pub fn kvport_config_validate(config: *const kvport_config) -> kvport_status;
    pub fn kvport_config_bytes_per_block(config: *const kvport_config, out: *mut usize)
        -> kvport_status;
    pub fn kvport_compute_num_blocks(
        config: *const kvport_config,
        available_bytes: usize,
        out: *mut usize,
    ) -> kvport_status;
    pub fn kvport_dtype_name(dtype: i32) -> *const c_char;
    pub fn kvport_dtype_from_name(name: *const c_char, out: *mut i32) -> kvport_status;
    pub fn kvport_block_region_layout(
        dtype: i32,
        block_size: usize,
        num_kv_heads: usize,
        head_dim: usize,
        out: *mut kvport_region_layout,
    ) -> kvport_status;

    // caches
    pub fn kvport_cache_create(
        config: *const kvport_config,
        num_blocks: usize,
        backend: *mut kvport_backend,
        out: *mut *mut kvport_cache,
    ) -> kvport_status;
    pub fn kvport_cache_destroy(cache: *mut kvport_cache) -> kvport_status;
    pub fn kvport_cache_config(cache: *const kvport_cache, out: *mut kvport_config)
        -> kvport_status;
    pub fn kvport_cache_num_blocks(cache: *const kvport_cache, out: *mut usize) -> kvport_status;
    pub fn kvport_cache_num_free_blocks(cache: *const kvport_cache, out: *mut usize)
        -> kvport_status;
    pub fn kvport_cache_num_blocks_in_use(cache: *const kvport_cache, out: *mut usize)
        -> kvport_status;
    pub fn kvport_cache_num_layers(cache: *const kvport_cache, out: *mut usize) -> kvport_status;
    pub fn kvport_cache_total_bytes(cache: *const kvport_cache, out: *mut usize) -> kvport_status;

    // allocation and reference counts
    pub fn kvport_cache_alloc(cache: *mut kvport_cache, out_block: *mut u32) -> kvport_status;
    pub fn kvport_cache_try_alloc(
        cache: *mut kvport_cache,
        out_block: *mut u32,
        out_allocated: *mut bool,
    ) -> kvport_status;
    pub fn kvport_cache_inc_ref(cache: *mut kvport_cache, block: u32) -> kvport_status;
    pub fn kvport_cache_dec_ref(cache: *mut kvport_cache, block: u32, out_freed: *mut bool)
        -> kvport_status;
    pub fn kvport_cache_free(cache: *mut kvport_cache, block: u32, out_freed: *mut bool)
        -> kvport_status;
    pub fn kvport_cache_free_blocks(cache: *mut kvport_cache, blocks: *const u32, count: usize)
        -> kvport_status;
    pub fn kvport_cache_return_evicted_block(cache: *mut kvport_cache, block: u32)
        -> kvport_status;
    pub fn kvport_cache_ref_count(cache: *const kvport_cache, block: u32, out: *mut u32)
        -> kvport_status;

    // pointers and strides
    pub fn kvport_cache_k_ptr(
        cache: *const kvport_cache,
        layer: usize,
        block: u32,
        out: *mut *mut c_void,
    ) -> kvport_status;
    pub fn kvport_cache_v_ptr(
        cache: *const kvport_cache,
        layer: usize,
        block: u32,
        out: *mut *mut c_void,
    ) -> kvport_status;
    pub fn kvport_cache_k_pool_ptr(cache: *const kvport_cache, layer: usize, out: *mut *mut c_void)
        -> kvport_status;
    pub fn kvport_cache_v_pool_ptr(cache: *const kvport_cache, layer: usize, out: *mut *mut c_void)
        -> kvport_status;
    pub fn kvport_cache_k_block_stride(cache: *const kvport_cache, layer: usize, out: *mut usize)
        -> kvport_status;
    pub fn kvport_cache_v_block_stride(cache: *const kvport_cache, layer: usize, out: *mut usize)
        -> kvport_status;
    pub fn kvport_cache_k_block_bytes(cache: *const kvport_cache, layer: usize, out: *mut usize)
        -> kvport_status;
    pub fn kvport_cache_v_block_bytes(cache: *const kvport_cache, layer: usize, out: *mut usize)
        -> kvport_status;
    pub fn kvport_cache_k_region_layout(
        cache: *const kvport_cache,
        layer: usize,
        out: *mut kvport_region_layout,
    ) -> kvport_status;
    pub fn kvport_cache_v_region_layout(
        cache: *const kvport_cache,
        layer: usize,
        out: *mut kvport_region_layout,
    ) -> kvport_status;
    pub fn kvport_cache_layer_dtype(cache: *const kvport_cache, layer: usize, out: *mut i32)
        -> kvport_status;

    // device work
    pub fn kvport_cache_zero_blocks(
        cache: *mut kvport_cache,
        blocks: *const u32,
        count: usize,
        stream: *mut kvport_stream,
    ) -> kvport_status;
    pub fn kvport_cache_poison_blocks(
        cache: *mut kvport_cache,
        blocks: *const u32,
        count: usize,
        stream: *mut kvport_stream,
    ) -> kvport_status;
    pub fn kvport_cache_zero_block(
        cache: *mut kvport_cache,
        block: u32,
        stream: *mut kvport_stream,
    ) -> kvport_status;
    pub fn kvport_cache_poison_block(
        cache: *mut kvport_cache,
        block: u32,
        stream: *mut kvport_stream,
    ) -> kvport_status;
    pub fn kvport_cache_copy_blocks(
        cache: *mut kvport_cache,
        copies: *const kvport_block_copy,
        count: usize,
        stream: *mut kvport_stream,
    ) -> kvport_status;
    pub fn kvport_cache_read_block(
        cache: *const kvport_cache,
        layer: usize,
        block: u32,
        k_out: *mut c_void,
        k_bytes: usize,
        v_out: *mut c_void,
        v_bytes: usize,
        stream: *mut kvport_stream,
    ) -> kvport_status;
    pub fn kvport_cache_write_block(
        cache: *mut kvport_cache,
        layer: usize,
        block: u32,
        k: *const c_void,
        k_bytes: usize,
        v: *const c_void,
        v_bytes: usize,
        stream: *mut kvport_stream,
    ) -> kvport_status;
    pub fn kvport_cache_synchronize(cache: *mut kvport_cache) -> kvport_status;

    // diagnostics
    pub fn kvport_cache_counters_get(cache: *const kvport_cache, out: *mut kvport_cache_counters)
        -> kvport_status;
    pub fn kvport_cache_check_invariants(
        cache: *const kvport_cache,
        report: *mut kvport_invariant_report,
        text: *mut c_char,
        text_size: usize,
        text_needed: *mut usize,
    ) -> kvport_status;

    // prefix caches
    pub fn kvport_prefix_cache_create(
        cache: *mut kvport_cache,
        out: *mut *mut kvport_prefix_cache,
    ) -> kvport_status;
    pub fn kvport_prefix_cache_destroy(prefix_cache: *mut kvport_prefix_cache) -> kvport_status;
    pub fn kvport_prefix_cache_lookup(
        prefix_cache: *mut kvport_prefix_cache,
        tokens: *const u32,
        num_tokens: usize,
        extra_key: u64,
        out_blocks: *mut u32,
        out_capacity: usize,
        out_num_blocks: *mut usize,
        out_num_tokens: *mut usize,
    ) -> kvport_status;
    pub fn kvport_prefix_cache_alloc(
        prefix_cache: *mut kvport_prefix_cache,
        out_block: *mut u32,
    ) -> kvport_status;
    pub fn kvport_prefix_cache_try_alloc(
        prefix_cache: *mut kvport_prefix_cache,
        out_block: *mut u32,
        out_allocated: *mut bool,
    ) -> kvport_status;
    pub fn kvport_prefix_cache_release(prefix_cache: *mut kvport_prefix_cache, block: u32)
        -> kvport_status;
    pub fn kvport_prefix_cache_release_blocks(
        prefix_cache: *mut kvport_prefix_cache,
        blocks: *const u32,
        count: usize,
    ) -> kvport_status;
    pub fn kvport_prefix_cache_evict(
        prefix_cache: *mut kvport_prefix_cache,
        max_blocks: usize,
        out_evicted: *mut usize,
    ) -> kvport_status;
    pub fn kvport_prefix_cache_num_cached_blocks(
        prefix_cache: *const kvport_prefix_cache,
        out: *mut usize,
    ) -> kvport_status;
    pub fn kvport_prefix_cache_num_evictable_blocks(
        prefix_cache: *const kvport_prefix_cache,
        out: *mut usize,
    ) -> kvport_status;
    pub fn kvport_prefix_cache_num_available_blocks(
        prefix_cache: *const kvport_prefix_cache,
        out: *mut usize,
    ) -> kvport_status;
    pub fn kvport_prefix_cache_counters_get(
        prefix_cache: *const kvport_prefix_cache,
        out: *mut kvport_prefix_cache_counters,
    ) -> kvport_status;
    pub fn kvport_prefix_cache_check_invariants(
        prefix_cache: *const kvport_prefix_cache,
        report: *mut kvport_invariant_report,
        text: *mut c_char,
        text_size: usize,
        text_needed: *mut usize,
    ) -> kvport_status;

    // block tables
    pub fn kvport_block_table_create(
        cache: *mut kvport_cache,
        out: *mut *mut kvport_block_table,
    ) -> kvport_status;
    pub fn kvport_block_table_create_prefixed(
        prefix_cache: *mut kvport_prefix_cache,
        extra_key: u64,
        out: *mut *mut kvport_block_table,
    ) -> kvport_status;
    pub fn kvport_block_table_destroy(table: *mut kvport_block_table) -> kvport_status;
    pub fn kvport_block_table_reuse_cached_prefix(
        table: *mut kvport_block_table,
        prompt: *const u32,
        num_tokens: usize,
        stream: *mut kvport_stream,
        out_hit_tokens: *mut usize,
    ) -> kvport_status;
    pub fn kvport_block_table_set_prefix_hit_mode(table: *mut kvport_block_table, mode: i32)
        -> kvport_status;
    pub fn kvport_block_table_prefix_hit_mode(table: *const kvport_block_table, out: *mut i32)
        -> kvport_status;
    pub fn kvport_block_table_append_tokens(
        table: *mut kvport_block_table,
        tokens: *const u32,
        num_tokens: usize,
        stream: *mut kvport_stream,
    ) -> kvport_status;
    pub fn kvport_block_table_blocks_needed(
        table: *const kvport_block_table,
        num_tokens: usize,
        out: *mut usize,
    ) -> kvport_status;
    pub fn kvport_block_table_fork(
        table: *const kvport_block_table,
        out: *mut *mut kvport_block_table,
    ) -> kvport_status;
    pub fn kvport_block_table_release(table: *mut kvport_block_table) -> kvport_status;
    pub fn kvport_block_table_blocks(
        table: *const kvport_block_table,
        out_blocks: *mut *const u32,
        out_count: *mut usize,
    ) -> kvport_status;
    pub fn kvport_block_table_num_tokens(table: *const kvport_block_table, out: *mut usize)
        -> kvport_status;
    pub fn kvport_block_table_copy_on_writes(table: *const kvport_block_table, out: *mut u64)
        -> kvport_status;

    // layer specs
    pub fn kvport_layer_spec_init(spec: *mut kvport_layer_spec) -> kvport_status;
    pub fn kvport_layer_spec_validate(spec: *const kvport_layer_spec, block_size: usize)
        -> kvport_status;
    pub fn kvport_layer_spec_describe(
        spec: *const kvport_layer_spec,
        text: *mut c_char,
        text_size: usize,
        text_needed: *mut usize,
    ) -> kvport_status;
    pub fn kvport_layer_spec_block_bytes(
        spec: *const kvport_layer_spec,
        block_size: usize,
        out: *mut usize,
    ) -> kvport_status;
    pub fn kvport_layer_spec_state_bytes(spec: *const kvport_layer_spec, out: *mut usize)
        -> kvport_status;
    pub fn kvport_layer_spec_state_offset(
        spec: *const kvport_layer_spec,
        index: usize,
        out: *mut usize,
    ) -> kvport_status;

    // the hybrid planner
    pub fn kvport_plan_request_init(request: *mut kvport_plan_request) -> kvport_status;
    pub fn kvport_plan_kv_cache(
        specs: *const kvport_layer_spec,
        num_layers: usize,
        block_size: usize,
        request: *const kvport_plan_request,
        out_plan: *mut kvport_plan,
        out_groups: *mut kvport_group_plan,
        groups_capacity: usize,
    ) -> kvport_status;

    // hybrid caches
    pub fn kvport_hybrid_cache_create(
        backend: *mut kvport_backend,
        specs: *const kvport_layer_spec,
        num_layers: usize,
        block_size: usize,
        state_checkpoint_interval: usize,
        blocks_per_group: *const usize,
        num_groups: usize,
        out: *mut *mut kvport_hybrid_cache,
    ) -> kvport_status;
    pub fn kvport_hybrid_cache_create_shared(
        backend: *mut kvport_backend,
        specs: *const kvport_layer_spec,
        num_layers: usize,
        block_size: usize,
        state_checkpoint_interval: usize,
        max_group_layers: usize,
        shared_blocks: usize,
        blocks_per_group: *const usize,
        num_groups: usize,
        out: *mut *mut kvport_hybrid_cache,
    ) -> kvport_status;
    pub fn kvport_prefix_cache_as_groups(prefix: *mut kvport_prefix_cache, out: *mut *mut kvport_hybrid_cache) -> kvport_status;
    pub fn kvport_cache_as_groups(cache: *mut kvport_cache, out: *mut *mut kvport_hybrid_cache) -> kvport_status;
    pub fn kvport_hybrid_cache_shared_pool_blocks(cache: *const kvport_hybrid_cache, out: *mut usize) -> kvport_status;
    pub fn kvport_hybrid_cache_group_in_shared_pool(
        cache: *const kvport_hybrid_cache,
        group: usize,
        out: *mut i32,
    ) -> kvport_status;
    pub fn kvport_hybrid_cache_destroy(cache: *mut kvport_hybrid_cache) -> kvport_status;
    pub fn kvport_hybrid_cache_num_layers(cache: *const kvport_hybrid_cache, out: *mut usize)
        -> kvport_status;
    pub fn kvport_hybrid_cache_num_groups(cache: *const kvport_hybrid_cache, out: *mut usize)
        -> kvport_status;
    pub fn kvport_hybrid_cache_block_size(cache: *const kvport_hybrid_cache, out: *mut usize)
        -> kvport_status;
    pub fn kvport_hybrid_cache_total_bytes(cache: *const kvport_hybrid_cache, out: *mut usize)
        -> kvport_status;
    pub fn kvport_hybrid_cache_group_kind(
        cache: *const kvport_hybrid_cache,
        group: usize,
        out: *mut i32,
    ) -> kvport_status;
    pub fn kvport_hybrid_cache_group_spec(
        cache: *const kvport_hybrid_cache,
        group: usize,
        out: *mut kvport_layer_spec,
    ) -> kvport_status;
    pub fn kvport_hybrid_cache_group_num_layers(
        cache: *const kvport_hybrid_cache,
        group: usize,
        out: *mut usize,
    ) -> kvport_status;
    pub fn kvport_hybrid_cache_group_layers(
        cache: *const kvport_hybrid_cache,
        group: usize,
        out: *mut usize,
        capacity: usize,
        out_count: *mut usize,
    ) -> kvport_status;
    pub fn kvport_hybrid_cache_group_blocks_in_use(
        cache: *const kvport_hybrid_cache,
        group: usize,
        out: *mut usize,
    ) -> kvport_status;
    pub fn kvport_hybrid_cache_group_cache(
        cache: *mut kvport_hybrid_cache,
        group: usize,
        out: *mut *mut kvport_cache,
    ) -> kvport_status;
    pub fn kvport_hybrid_cache_locate(
        cache: *const kvport_hybrid_cache,
        layer: usize,
        out_has_kv: *mut bool,
        out_group: *mut usize,
        out_index: *mut usize,
    ) -> kvport_status;
    pub fn kvport_hybrid_cache_hit_counters(
        cache: *const kvport_hybrid_cache,
        out: *mut kvport_hybrid_hit_counters,
    ) -> kvport_status;
    pub fn kvport_hybrid_cache_check_invariants(
        cache: *const kvport_hybrid_cache,
        report: *mut kvport_invariant_report,
        text: *mut c_char,
        text_size: usize,
        text_needed: *mut usize,
    ) -> kvport_status;
    pub fn kvport_hybrid_cache_synchronize(cache: *mut kvport_hybrid_cache) -> kvport_status;

    // hybrid block tables
    pub fn kvport_hybrid_block_table_create(
        cache: *mut kvport_hybrid_cache,
        extra_key: u64,
        out: *mut *mut kvport_hybrid_block_table,
    ) -> kvport_status;
    pub fn kvport_hybrid_block_table_destroy(table: *mut kvport_hybrid_block_table)
        -> kvport_status;
    pub fn kvport_hybrid_block_table_reuse_cached_prefix(
        table: *mut kvport_hybrid_block_table,
        prompt: *const u32,
        num_tokens: usize,
        stream: *mut kvport_stream,
        out_hit_tokens: *mut usize,
    ) -> kvport_status;
    pub fn kvport_hybrid_block_table_set_prefix_hit_mode(
        table: *mut kvport_hybrid_block_table,
        mode: i32,
    ) -> kvport_status;
    pub fn kvport_hybrid_block_table_prefix_hit_mode(
        table: *const kvport_hybrid_block_table,
        out: *mut i32,
    ) -> kvport_status;
    pub fn kvport_hybrid_block_table_set_keep_shared_windows(
        table: *mut kvport_hybrid_block_table,
        keep: i32,
    ) -> kvport_status;
    pub fn kvport_hybrid_block_table_keeps_shared_windows(
        table: *const kvport_hybrid_block_table,
        out: *mut i32,
    ) -> kvport_status;
    pub fn kvport_hybrid_block_table_set_copy_last_block(
        table: *mut kvport_hybrid_block_table,
        copy: i32,
    ) -> kvport_status;
    pub fn kvport_hybrid_block_table_copies_last_block(
        table: *const kvport_hybrid_block_table,
        out: *mut i32,
    ) -> kvport_status;
    pub fn kvport_hybrid_block_table_keep_hit_point(table: *mut kvport_hybrid_block_table) -> kvport_status;
    pub fn kvport_hybrid_block_table_num_kept_blocks(
        table: *const kvport_hybrid_block_table,
        group: usize,
        out: *mut usize,
    ) -> kvport_status;
    pub fn kvport_hybrid_block_table_append_tokens(
        table: *mut kvport_hybrid_block_table,
        tokens: *const u32,
        num_tokens: usize,
        stream: *mut kvport_stream,
    ) -> kvport_status;
    pub fn kvport_hybrid_block_table_append_draft(
        table: *mut kvport_hybrid_block_table,
        tokens: *const u32,
        num_tokens: usize,
        stream: *mut kvport_stream,
    ) -> kvport_status;
    pub fn kvport_vllm_row_width(max_model_len: usize, kernel_block_size: usize, out: *mut usize) -> kvport_status;
    pub fn kvport_build_block_table_rows(
        batch: *const kvport_batch,
        row_width: usize,
        rows: *mut i32,
        num_rows: usize,
    ) -> kvport_status;
    pub fn kvport_build_token_locations(
        batch: *const kvport_batch,
        row_width: usize,
        locations: *mut i32,
        num_rows: usize,
    ) -> kvport_status;
    pub fn kvport_build_slot_mapping(
        batch: *const kvport_batch,
        slots: *mut i64,
        num_slots: usize,
        out_count: *mut usize,
    ) -> kvport_status;
    pub fn kvport_build_flashinfer_pages(
        batch: *const kvport_batch,
        indptr: *mut i32,
        indices: *mut i32,
        indices_capacity: usize,
        last_page_len: *mut i32,
        kv_len: *mut i32,
        out_num_indices: *mut usize,
    ) -> kvport_status;
    pub fn kvport_hybrid_block_table_num_draft_tokens(
        table: *const kvport_hybrid_block_table,
        out: *mut usize,
    ) -> kvport_status;
    pub fn kvport_hybrid_block_table_can_append_draft(
        table: *const kvport_hybrid_block_table,
        num_tokens: usize,
        out: *mut bool,
    ) -> kvport_status;
    pub fn kvport_hybrid_block_table_draft_state_slots(
        table: *const kvport_hybrid_block_table,
        group: usize,
        out: *mut u32,
        capacity: usize,
        out_count: *mut usize,
    ) -> kvport_status;
    pub fn kvport_hybrid_block_table_commit(table: *mut kvport_hybrid_block_table, num_tokens: usize) -> kvport_status;
    pub fn kvport_hybrid_block_table_truncate(table: *mut kvport_hybrid_block_table, num_tokens: usize) -> kvport_status;
    pub fn kvport_hybrid_block_table_num_committed(
        table: *const kvport_hybrid_block_table,
        out: *mut usize,
    ) -> kvport_status;
    pub fn kvport_hybrid_block_table_check_invariants(
        table: *const kvport_hybrid_block_table,
        report: *mut kvport_invariant_report,
        text: *mut c_char,
        text_size: usize,
        text_needed: *mut usize,
    ) -> kvport_status;
    pub fn kvport_hybrid_block_table_can_append(
        table: *const kvport_hybrid_block_table,
        num_tokens: usize,
        out: *mut bool,
    ) -> kvport_status;
    pub fn kvport_hybrid_block_table_blocks_needed(
        table: *const kvport_hybrid_block_table,
        num_tokens: usize,
        out: *mut kvport_group_need,
        capacity: usize,
        out_count: *mut usize,
    ) -> kvport_status;
    pub fn kvport_hybrid_block_table_fork(
        table: *const kvport_hybrid_block_table,
        stream: *mut kvport_stream,
        out: *mut *mut kvport_hybrid_block_table,
    ) -> kvport_status;
    pub fn kvport_hybrid_block_table_release(table: *mut kvport_hybrid_block_table)
        -> kvport_status;
    pub fn kvport_hybrid_block_table_num_tokens(
        table: *const kvport_hybrid_block_table,
        out: *mut usize,
    ) -> kvport_status;
    pub fn kvport_hybrid_block_table_num_blocks(
        table: *const kvport_hybrid_block_table,
        group: usize,
        out: *mut usize,
    ) -> kvport_status;
    pub fn kvport_hybrid_block_table_num_live_blocks(
        table: *const kvport_hybrid_block_table,
        group: usize,
        out: *mut usize,
    ) -> kvport_status;
    pub fn kvport_hybrid_block_table_blocks(
        table: *const kvport_hybrid_block_table,
        group: usize,
        out: *mut u32,
        capacity: usize,
        out_count: *mut usize,
    ) -> kvport_status;
    pub fn kvport_hybrid_block_table_state_slot(
        table: *const kvport_hybrid_block_table,
        group: usize,
        out_has_slot: *mut bool,
        out_slot: *mut u32,
    ) -> kvport_status;
    pub fn kvport_hybrid_block_table_copy_on_writes(
        table: *const kvport_hybrid_block_table,
        out: *mut u64,
    ) -> kvport_status;

    // KV cache events
    pub fn kvport_events_options_init(options: *mut kvport_events_options) -> kvport_status;
    pub fn kvport_prefix_cache_enable_events(
        prefix_cache: *mut kvport_prefix_cache,
        options: *const kvport_events_options,
    ) -> kvport_status;
    pub fn kvport_prefix_cache_disable_events(prefix_cache: *mut kvport_prefix_cache) -> kvport_status;
    pub fn kvport_prefix_cache_events_stats(
        prefix_cache: *const kvport_prefix_cache,
        out: *mut kvport_events_stats,
    ) -> kvport_status;
    pub fn kvport_prefix_cache_events_endpoint(
        prefix_cache: *const kvport_prefix_cache,
        socket: i32,
        text: *mut c_char,
        text_size: usize,
        text_needed: *mut usize,
    ) -> kvport_status;
    pub fn kvport_prefix_cache_flush_events(
        prefix_cache: *mut kvport_prefix_cache,
        timeout_ms: u32,
        out_flushed: *mut bool,
    ) -> kvport_status;
    pub fn kvport_hybrid_cache_enable_events(
        cache: *mut kvport_hybrid_cache,
        options: *const kvport_events_options,
    ) -> kvport_status;
    pub fn kvport_hybrid_cache_disable_events(cache: *mut kvport_hybrid_cache) -> kvport_status;
    pub fn kvport_hybrid_cache_events_stats(
        cache: *const kvport_hybrid_cache,
        out: *mut kvport_events_stats,
    ) -> kvport_status;
    pub fn kvport_hybrid_cache_events_endpoint(
        cache: *const kvport_hybrid_cache,
        socket: i32,
        text: *mut c_char,
        text_size: usize,
        text_needed: *mut usize,
    ) -> kvport_status;
    pub fn kvport_hybrid_cache_flush_events(
        cache: *mut kvport_hybrid_cache,
        timeout_ms: u32,
        out_flushed: *mut bool,
    ) -> kvport_status;

    // an engine's streams and memory
    pub fn kvport_stream_wrap(
        backend: *mut kvport_backend,
        vendor_stream: *mut c_void,
        out: *mut *mut kvport_stream,
    ) -> kvport_status;
    pub fn kvport_stream_release(stream: *mut kvport_stream) -> kvport_status;
    pub fn kvport_stream_vendor_handle(
        backend: *mut kvport_backend,
        stream: *mut kvport_stream,
        out: *mut *mut c_void,
    ) -> kvport_status;
    pub fn kvport_cache_adopted_pool_bytes(
        config: *const kvport_config,
        num_blocks: usize,
        out_bytes: *mut usize,
        capacity: usize,
        out_count: *mut usize,
    ) -> kvport_status;
    pub fn kvport_cache_create_adopted(
        config: *const kvport_config,
        num_blocks: usize,
        backend: *mut kvport_backend,
        pools: *const kvport_pool,
        num_pools: usize,
        out: *mut *mut kvport_cache,
    ) -> kvport_status;
    pub fn kvport_cache_is_adopted(cache: *const kvport_cache, out: *mut bool) -> kvport_status;

    // testing
    pub fn kvport_testing_inject_async_fault(
        backend: *mut kvport_backend,
        stream: *mut kvport_stream,
    ) -> kvport_status;
    pub fn kvport_testing_fail_with(status: i32) -> kvport_status;
}
