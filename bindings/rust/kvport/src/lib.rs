// SPDX-License-Identifier: Apache-2.0
//! kvport: a paged KV cache for LLM inference engines, over kvport's C ABI
//! (`libkvport_c`, `kvport/kvport.h`). No dependencies.
//!
//! [`PagedKvCache`] has the API of the reference engine's `PagedKvCache`
//! (same method names, arguments and semantics), returning
//! `Result<_, KvError>` where the reference panics or logs, so an engine
//! written against the reference switches by changing its imports:
//!
//! ```no_run
//! use kvport::{Backend, KvCacheConfig, KvCacheDtype, PagedKvCache, DEFAULT_STREAM};
//!
//! # fn main() -> Result<(), kvport::KvError> {
//! let gpu = Backend::new("default")?; // $KVPORT_BACKEND, a GPU, or host
//! let config = KvCacheConfig::new(32, 8, 128, 16, KvCacheDtype::Bf16);
//! let num_blocks = PagedKvCache::compute_num_blocks(&config, 1 << 30)?;
//! let mut cache = PagedKvCache::new(config, num_blocks, &gpu)?;
//! let block = cache.alloc_block()?;
//! cache.zero_block(block, &gpu, DEFAULT_STREAM)?;
//! let k = cache.k_cache_ptr(0, block)?; // a device address for a kernel
//! # let _ = k;
//! cache.dec_ref(block)?;
//! # Ok(())
//! # }
//! ```
//!
//! Thread safety: [`Backend`] is `Send + Sync`; [`PagedKvCache`] and
//! [`Stream`] are `Send` but not `Sync` (one thread at a time, as the C++
//! cache); [`PrefixCache`] and [`BlockTable`] borrow their parent and are
//! neither. Hybrid models ([`LayerSpec`] per layer, [`plan_kv_cache`],
//! [`HybridKvCache`]: one pool per KV cache group) follow the same rules: the
//! cache is `Send`, not `Sync`; [`HybridBlockTable`] and [`GroupPool`] borrow
//! it. docs/bindings/rust.md has the details. These do not compile:
//!
//! ```compile_fail
//! fn assert_sync<T: Sync>() {}
//! assert_sync::<kvport::PagedKvCache>(); // one thread at a time
//! ```
//!
//! ```compile_fail
//! fn assert_send<T: Send>() {}
//! assert_send::<kvport::PrefixCache<'static>>(); // it borrows a !Sync cache
//! ```

pub mod ffi;

mod backend;
mod cache;
mod config;
mod error;
mod events;
mod hybrid;
mod layer_spec;
mod prefix;

pub use backend::{Backend, DevicePtr, GpuBackend, Stream, DEFAULT_STREAM};
pub use cache::{CacheCounters, InvariantReport, PagedKvCache};
pub use config::{KvCacheConfig, KvCacheDtype, KvCacheLayout, RegionLayout};
pub use error::KvError;
pub use events::{EventForm, EventsOptions, EventsStats};
pub use hybrid::{
    plan_kv_cache, vllm_row_width, Batch, FlashInferPages, GroupNeed, GroupPlan, GroupPool, GroupsView, HybridBlockTable, HybridHitCounters, HybridKvCache, KvCachePlan,
    LayerLocation, PlanRequest, NULL_BLOCK,
};
pub use layer_spec::{LayerKind, LayerSpec, MlaFormat, StateDtype, StateTensor};
pub use prefix::{BlockTable, PrefixCache, PrefixCacheCounters, PrefixHitMode};

/// The version of the libkvport_c this process loaded ("0.1.0").
pub fn version() -> String {
    // SAFETY: never null; static storage.
    unsafe { std::ffi::CStr::from_ptr(ffi::kvport_version_string()) }
        .to_string_lossy()
        .into_owned()
}

/// Throws, inside the library, the C++ exception that maps to `status` and
/// returns what the boundary made of it (`kvport_testing_fail_with`): for
/// tests of the error mapping.
pub fn testing_fail_with(status: i32) -> Result<(), KvError> {
    error::check(unsafe { ffi::kvport_testing_fail_with(status) })
}
