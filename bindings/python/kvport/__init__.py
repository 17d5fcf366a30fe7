# SPDX-License-Identifier: Apache-2.0
"""kvport: a paged KV-cache runtime (Python bindings).

    import kvport
    config = kvport.KvCacheConfig(num_layers=2, num_kv_heads=4, head_dim=64, dtype="f16")
    with kvport.PagedKvCache(config, num_blocks=64) as cache:
        block = cache.alloc_block()
        k = numpy.from_dlpack(cache.k_pool(0))   # [num_blocks, block_size, heads, head_dim]

docs/bindings/python.md is the guide: the API, the tensor views of every
dtype, NumPy and PyTorch, the errors, hybrid models (LayerSpec, plan_kv_cache,
HybridKvCache, HybridBlockTable).
"""

from ._kvport import (  # noqa: F401
    NULL_BLOCK,
    BackendError,
    BlockRegionLayout,
    BlockTable,
    CacheExhausted,
    DeviceLost,
    Error,
    EventPublisherStats,
    GroupNeed,
    GroupPlan,
    HybridBlockTable,
    HybridHitCounters,
    HybridKvCache,
    InvalidArgument,
    InvariantReport,
    KvCacheConfig,
    KvCacheCounters,
    KvCacheGroup,
    KvCachePlan,
    LayerSpec,
    OutOfMemory,
    OutOfRange,
    PagedKvCache,
    PoolView,
    PrefixCache,
    PrefixCacheCounters,
    PrefixMatch,
    StateTensor,
    block_region_layout,
    compiled_backends,
    dtypes,
    __version__,
    group_layers,
    log_level,
    plan_kv_cache,
    set_log_level,
    stream_handle,
)

__all__ = [
    "NULL_BLOCK",
    "BackendError",
    "BlockRegionLayout",
    "BlockTable",
    "CacheExhausted",
    "DeviceLost",
    "Error",
    "EventPublisherStats",
    "GroupNeed",
    "GroupPlan",
    "HybridBlockTable",
    "HybridHitCounters",
    "HybridKvCache",
    "InvalidArgument",
    "InvariantReport",
    "KvCacheConfig",
    "KvCacheCounters",
    "KvCacheGroup",
    "KvCachePlan",
    "LayerSpec",
    "OutOfMemory",
    "OutOfRange",
    "PagedKvCache",
    "PoolView",
    "PrefixCache",
    "PrefixCacheCounters",
    "PrefixMatch",
    "StateTensor",
    "block_region_layout",
    "compiled_backends",
    "dtypes",
    "group_layers",
    "log_level",
    "plan_kv_cache",
    "set_log_level",
    "stream_handle",
]
