# SPDX-License-Identifier: Apache-2.0
"""PagedKvCache from Python: config, the seed semantics (LIFO, refcounts,
double frees counted and ignored, exhaustion), batches, errors, lifetimes."""

import gc

import numpy as np
import pytest

import kvport
from conftest import make_config


def test_config_is_dataclass_like():
    c = kvport.KvCacheConfig(num_layers=4, num_kv_heads=8, head_dim=128, dtype="fp16")
    assert (c.num_layers, c.num_kv_heads, c.head_dim_k, c.head_dim_v) == (4, 8, 128, 128)
    assert c.block_size == 16 and c.dtype == "f16" and c.layout == "layer_major"
    assert c.layer_dtypes == []
    assert repr(c) == ("KvCacheConfig(num_layers=4, block_size=16, num_kv_heads=8, "
                       "head_dim_k=128, head_dim_v=128, dtype='f16', layout='layer_major')")
    d = c.copy()
    assert d == c and d is not c
    d.dtype = "bf16"
    assert d != c and c.dtype == "f16"
    assert c.k_block_bytes(0) == 2 * 16 * 8 * 128
    assert c.bytes_per_block() == 4 * 2 * 2 * 16 * 8 * 128
    mixed = kvport.KvCacheConfig(2, 1, 16, block_size=4, layer_dtypes=["bf16", "nvfp4"],
                                 head_dim_v=32)
    assert mixed.dtype_for_layer(1) == "nvfp4" and mixed.head_dim_v == 32
    assert "layer_dtypes=['bf16', 'nvfp4']" in repr(mixed)
    assert set(kvport.dtypes()) >= {"f16", "bf16", "fp8_e4m3", "fp8_e5m2", "nvfp4", "turbo3"}


def test_config_dtype_must_be_a_name():
    with pytest.raises(kvport.InvalidArgument, match="dtype must be a name"):
        kvport.KvCacheConfig(2, 4, 64, dtype=16)
    # A config edited after construction is checked again, never read past
    # its per-layer dtypes.
    c = kvport.KvCacheConfig(2, 4, 64, dtype="f16", layer_dtypes=["f16", "bf16"])
    c.num_layers = 64
    with pytest.raises(kvport.InvalidArgument, match="layer_dtypes has 2 entries"):
        c.dtype_for_layer(10)


def test_config_errors_name_the_field():
    with pytest.raises(kvport.InvalidArgument, match="num_kv_heads"):
        kvport.KvCacheConfig(num_layers=1, num_kv_heads=0, head_dim=8)
    with pytest.raises(kvport.InvalidArgument, match="unknown KV cache dtype 'int4'"):
        kvport.KvCacheConfig(num_layers=1, num_kv_heads=1, head_dim=8, dtype="int4")
    with pytest.raises(kvport.InvalidArgument, match="layout"):
        kvport.KvCacheConfig(num_layers=1, num_kv_heads=1, head_dim=8, layout="heads_first")
    with pytest.raises(kvport.InvalidArgument, match="head_dim_k"):
        kvport.KvCacheConfig(num_layers=1, num_kv_heads=1, head_dim=8, dtype="nvfp4")
    # InvalidArgument is also a ValueError, every kvport error a kvport.Error.
    assert issubclass(kvport.InvalidArgument, ValueError)
    assert issubclass(kvport.InvalidArgument, kvport.Error)
    assert issubclass(kvport.CacheExhausted, kvport.Error)
    assert issubclass(kvport.OutOfMemory, MemoryError)
    assert issubclass(kvport.DeviceLost, kvport.BackendError)


def test_lifo_free_list(cache):
    assert [cache.alloc_block() for _ in range(3)] == [0, 1, 2]
    assert cache.free_block(1) is True
    assert cache.free_block(0) is True
    assert cache.alloc_block() == 0  # last freed, first reused
    assert cache.alloc_block() == 1
    assert cache.alloc_block() == 3
    assert cache.num_blocks_in_use == 4 and cache.num_free_blocks == 4


def test_refcounts(cache):
    b = cache.alloc_block()
    cache.inc_ref(b)
    assert cache.ref_count(b) == 2
    assert cache.dec_ref(b) is False
    assert cache.dec_ref(b) is True
    assert cache.ref_count(b) == 0
    with pytest.raises(kvport.InvalidArgument, match="free"):
        cache.inc_ref(b)  # sharing a free block


def test_double_free_is_counted_and_ignored(cache):
    b = cache.alloc_block()
    assert cache.free_block(b) is True
    free_before = cache.num_free_blocks
    assert cache.free_block(b) is False  # logged, counted, ignored
    assert cache.counters.ignored_double_frees == 1
    assert cache.num_free_blocks == free_before
    assert cache.check_invariants().ok


def test_exhaustion(cache):
    blocks = [cache.alloc_block() for _ in range(cache.num_blocks)]
    assert sorted(blocks) == list(range(8))
    with pytest.raises(kvport.CacheExhausted, match="KV cache exhausted"):
        cache.alloc_block()
    assert cache.try_alloc_block() is None
    assert cache.counters.exhaustion_events == 2  # the raise and the None
    assert cache.counters.peak_blocks_in_use == 8
    cache.free_blocks(np.array(blocks, dtype=np.uint32))
    assert cache.num_free_blocks == 8
    c = cache.counters
    assert (c.allocs, c.frees) == (8, 8)
    assert "allocs=8" in repr(c)


def test_batches_lists_arrays_and_errors(cache):
    ids = [cache.alloc_block() for _ in range(4)]
    cache.zero_blocks(ids)                                  # list
    cache.zero_blocks(np.array(ids, dtype=np.uint32))       # used in place
    cache.zero_blocks(np.array(ids, dtype=np.int64))        # converted
    cache.zero_blocks(np.array(ids, dtype=np.uint64))
    cache.zero_blocks(range(2))                             # any iterable
    assert cache.last_fill_regions == 2 * 2  # ids 0..1 coalesce: one run x 4 pools
    cache.zero_blocks(3)                                    # one id
    cache.zero_blocks([])
    with pytest.raises(kvport.InvalidArgument, match="outside"):
        cache.zero_blocks([-1])
    with pytest.raises(kvport.InvalidArgument, match="outside"):
        cache.zero_blocks(np.array([2**32], dtype=np.int64))
    # A value of the wrong type is a TypeError (a bool is not an id).
    with pytest.raises(TypeError, match="integers"):
        cache.zero_blocks(np.array([1.0]))
    with pytest.raises(TypeError, match="must be an int"):
        cache.zero_blocks(["0"])
    with pytest.raises(kvport.InvalidArgument, match="out of range"):
        cache.zero_blocks([8])
    with pytest.raises(kvport.InvalidArgument, match="out of range"):
        cache.free_blocks([0, 99])
    assert cache.ref_count(0) == 1  # validated before any change
    # Out of range is its own kind of InvalidArgument, from core's one check.
    assert issubclass(kvport.OutOfRange, kvport.InvalidArgument)
    with pytest.raises(kvport.OutOfRange, match="out of range"):
        cache.zero_blocks([8])
    with pytest.raises(kvport.OutOfRange):
        cache.inc_ref(99)
    # Not a batch: a float, a str or bytes (iterable, but not of block ids).
    for bad in (1.5, np.float64(2), "01", b"\x01", bytearray(b"\x01")):
        with pytest.raises(TypeError, match="an int or an iterable of ints"):
            cache.zero_blocks(bad)
    # A uint32 array that is C-contiguous but not 4-byte aligned is copied.
    raw = np.zeros(4 * 3 + 1, dtype=np.uint8)
    unaligned = np.frombuffer(raw.data, dtype=np.uint32, count=3, offset=1)
    assert not unaligned.flags.aligned
    cache.zero_blocks(unaligned)


def test_read_write_copy_blocks(cache, rng):
    a, b = cache.alloc_block(), cache.alloc_block()
    kb, vb = cache.k_block_bytes(1), cache.v_block_bytes(1)
    k = rng.integers(0, 256, kb, dtype=np.uint8)
    v = rng.integers(0, 256, vb, dtype=np.uint8)
    cache.write_block(1, a, k, v.tobytes())
    rk, rv = cache.read_block(1, a)
    assert rk.dtype == np.uint8 and np.array_equal(rk, k) and np.array_equal(rv, v)
    cache.copy_blocks([(a, b)])
    assert np.array_equal(cache.read_block(1, b)[0], k)
    cache.poison_blocks([b])
    assert (cache.read_block(0, b)[1] == 0xFF).all()
    cache.copy_blocks(np.array([[a, b]]))
    assert np.array_equal(cache.read_block(1, b)[1], v)
    with pytest.raises(kvport.InvalidArgument):
        cache.write_block(1, a, k[:-1], v)
    with pytest.raises(kvport.InvalidArgument):
        cache.copy_blocks([(a, a)])


@pytest.mark.parametrize("layout", ["layer_major", "block_major"])
def test_k_only_layers(layout, rng):
    """head_dim_v=0 (MLA's latent): K pools only; V views and pointers refuse."""
    config = make_config(layout=layout, head_dim_v=0)
    assert not config.has_v and make_config().has_v
    assert config.v_block_bytes(0) == 0
    assert config.bytes_per_block() == config.k_block_bytes(0) * 2
    with kvport.PagedKvCache(config, num_blocks=4) as c:
        kb = c.k_block_bytes(1)
        assert c.v_block_bytes(1) == 0
        for call in (lambda: c.v_pool(0), lambda: c.v_pool_ptr(0), lambda: c.v_cache_ptr(0, 1),
                     lambda: c.v_block_stride(1)):
            with pytest.raises(kvport.InvalidArgument, match="no V"):
                call()
        k = rng.integers(0, 256, kb, dtype=np.uint8)
        c.write_block(1, 2, k)  # v defaults to None: no V bytes
        c.write_block(0, 2, k, b"")
        with pytest.raises(kvport.InvalidArgument, match="no V: K-only, so v must be empty"):
            c.write_block(1, 2, k, b"\x01")
        rk, rv = c.read_block(1, 2)
        assert np.array_equal(rk, k) and rv.size == 0
        c.copy_blocks([(2, 3)])
        assert np.array_equal(c.read_block(1, 3)[0], k)
        view = c.k_pool(1).numpy()
        assert view.shape == (4, 4, 2, 8)
        c.zero_blocks([3])
        assert (c.read_block(1, 3)[0] == 0).all()
        assert c.check_invariants().ok


def test_pointers_strides_and_repr(cache):
    assert cache.k_cache_ptr(0, 3) == cache.k_pool_ptr(0) + 3 * cache.k_block_stride(0)
    assert cache.backend == "host" and cache.device == 0
    assert cache.config == make_config()
    assert cache.dtype_for_layer(1) == "f16"
    r = repr(cache)
    assert "num_blocks=8" in r and "free=8" in r and "'f16'" in r and "host" in r
    with pytest.raises(kvport.InvalidArgument, match="layer"):
        cache.k_pool_ptr(2)
    assert kvport.PagedKvCache.compute_num_blocks(make_config(), 10 * 1024) > 0
    assert any(b["name"] == "host" and b["available"] for b in kvport.compiled_backends())


def test_unknown_backend():
    with pytest.raises(kvport.InvalidArgument, match="host"):
        kvport.PagedKvCache(make_config(), 4, backend="tpu")


def test_context_manager_closes():
    with kvport.PagedKvCache(make_config(), 4) as c:
        assert not c.closed
    assert c.closed and repr(c) == "PagedKvCache(closed)"
    with pytest.raises(kvport.InvalidArgument, match="closed"):
        c.alloc_block()
    c.close()  # idempotent


def test_view_keeps_pools_alive_after_close(rng):
    c = kvport.PagedKvCache(make_config(), 4)
    c.zero_blocks(range(4))
    view = c.k_pool(0)
    arr = c.v_pool(1).numpy()
    ro = np.from_dlpack(c.k_pool(1))
    c.close()
    del c
    gc.collect()
    arr[...] = 7          # still owned memory: the capsule holds the pools
    assert (arr == 7).all()
    assert ro.sum() == 0  # readable after close
    again = view.numpy()
    again[0, 0, 0, 0] = 1
    assert again[0, 0, 0, 0] == 1
