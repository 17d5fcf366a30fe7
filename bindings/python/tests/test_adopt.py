# SPDX-License-Identifier: Apache-2.0
"""The engine's memory and streams: PagedKvCache.adopt over NumPy arrays (the
engine's pools, checked for count, device, contiguity, dtype and shape, kept
alive with the cache, never freed), the same operations on an adopted cache
as on an owned one, and use_stream with an engine stream's handle."""

import ctypes
import gc
import sys

import numpy as np
import pytest

import kvport
from conftest import make_config


def engine_pools(config, num_blocks, dtype=np.uint8):
    """One zeroed array per pool, num_blocks rows first, as an engine allocates them."""
    sizes = kvport.PagedKvCache.adopted_pool_bytes(config, num_blocks)
    itemsize = np.dtype(dtype).itemsize
    return [np.zeros((num_blocks, size // num_blocks // itemsize), dtype=dtype) for size in sizes]


def test_adopted_pool_bytes_follow_the_layout():
    config = make_config()  # 2 layers, f16, 4 x 2 x 8 x 2 = 128 bytes per K or V region
    assert kvport.PagedKvCache.adopted_pool_bytes(config, 8) == [1024] * 4
    assert kvport.PagedKvCache.adopted_pool_bytes(make_config(layout="block_major"), 8) == [4096]


def test_the_pools_are_the_engines_arrays(layout):
    config = make_config(layout=layout)
    pools = engine_pools(config, 8)
    with kvport.PagedKvCache.adopt(config, 8, pools if layout == "layer_major" else pools[0]) as c:
        assert c.adopted
        assert c.k_pool_ptr(0) == pools[0].ctypes.data
        b = c.alloc_block()
        c.poison_blocks([b])
        assert (pools[0][b] == 0xFF).all() and (pools[-1][b] == 0xFF).all()
        pools[0][b, :] = 7  # the engine writes; the cache reads it
        k, _ = c.read_block(0, b)
        assert (k == 7).all()
        view = np.from_dlpack(c.k_pool(0, raw=True))
        assert view.ctypes.data == pools[0].ctypes.data


def test_same_operations_same_bytes_as_an_owned_cache(layout, rng):
    config = make_config(layout=layout)
    pools = engine_pools(config, 8)
    owned = kvport.PagedKvCache(config, 8)
    adopted = kvport.PagedKvCache.adopt(config, 8, pools if layout == "layer_major" else pools[0])
    table_o, table_a = kvport.BlockTable(owned), kvport.BlockTable(adopted)
    for c in (owned, adopted):
        c.zero_blocks(list(range(8)))
    for _ in range(3):
        bo, ba = owned.alloc_block(), adopted.alloc_block()
        assert bo == ba
        for layer in range(2):
            k = rng.integers(0, 256, owned.k_block_bytes(layer), dtype=np.uint8)
            v = rng.integers(0, 256, owned.v_block_bytes(layer), dtype=np.uint8)
            owned.write_block(layer, bo, k, v)
            adopted.write_block(layer, ba, k, v)
    for c in (owned, adopted):
        c.copy_blocks([(0, 5), (1, 6)])
        c.poison_blocks([2])
    table_o.append_tokens(list(range(9)))
    table_a.append_tokens(list(range(9)))
    assert table_o.blocks == table_a.blocks
    for b in range(8):
        for layer in range(2):
            ko, vo = owned.read_block(layer, b)
            ka, va = adopted.read_block(layer, b)
            assert (ko == ka).all() and (vo == va).all()
    assert adopted.check_invariants().ok
    prefix = kvport.PrefixCache(adopted)
    assert prefix is not None
    table_o.close(), table_a.close(), owned.close(), adopted.close()


def test_the_arrays_live_as_long_as_the_cache_and_are_never_freed():
    config = make_config()
    pools = engine_pools(config, 4)
    refs = [sys.getrefcount(p) for p in pools]
    cache = kvport.PagedKvCache.adopt(config, 4, pools)
    assert all(sys.getrefcount(p) > r for p, r in zip(pools, refs))
    view = cache.k_pool(0, raw=True)  # a view keeps the state, and so the arrays
    cache.close()
    del cache
    gc.collect()
    assert all(sys.getrefcount(p) > r for p, r in zip(pools, refs))
    del view
    gc.collect()
    assert [sys.getrefcount(p) for p in pools] == refs
    pools[0][0, 0] = 1  # still the engine's, still valid


def test_a_dropped_array_stays_alive_through_the_cache():
    config = make_config()
    cache = kvport.PagedKvCache.adopt(config, 4, engine_pools(config, 4))  # no other reference
    gc.collect()
    b = cache.alloc_block()
    cache.write_block(0, b, bytes(range(128)), bytes(128))
    assert bytes(cache.read_block(0, b)[0]) == bytes(range(128))


def test_typed_pools_of_the_views_dtype():
    config = make_config(dtype="f16")
    with kvport.PagedKvCache.adopt(config, 4, engine_pools(config, 4, np.float16)) as c:
        assert c.adopted
    with pytest.raises(kvport.InvalidArgument, match=r"pool 0 \(layer 0 K\): element type"):
        kvport.PagedKvCache.adopt(config, 4, engine_pools(config, 4, np.float32))


def test_the_geometry_is_checked_naming_the_pool():
    config = make_config()
    pools = engine_pools(config, 4)
    with pytest.raises(kvport.InvalidArgument, match="3 pools given, the config needs 4"):
        kvport.PagedKvCache.adopt(config, 4, pools[:3])
    short = list(pools)
    short[1] = np.zeros((4, 127), dtype=np.uint8)
    with pytest.raises(kvport.InvalidArgument, match=r"pool 1 \(layer 0 V\): shape \(4, 127\)"):
        kvport.PagedKvCache.adopt(config, 4, short)
    wrong_rows = list(pools)
    wrong_rows[2] = np.zeros((2, 256), dtype=np.uint8)
    with pytest.raises(kvport.InvalidArgument, match=r"pool 2 \(layer 1 K\).*needs 4 blocks first"):
        kvport.PagedKvCache.adopt(config, 4, wrong_rows)
    strided = list(pools)
    strided[3] = np.zeros((4, 256), dtype=np.uint8)[:, ::2]
    with pytest.raises(kvport.InvalidArgument, match="not C-contiguous"):
        kvport.PagedKvCache.adopt(config, 4, strided)
    misaligned = list(pools)
    misaligned[0] = np.zeros(4 * 128 + 1, dtype=np.uint8)[1:].reshape(4, 128)
    with pytest.raises(kvport.InvalidArgument, match=r"pool 0 \(layer 0 K\).*misaligned"):
        kvport.PagedKvCache.adopt(config, 4, misaligned)
    overlapping = list(pools)
    overlapping[1] = pools[0]
    with pytest.raises(kvport.InvalidArgument, match="overlap"):
        kvport.PagedKvCache.adopt(config, 4, overlapping)
    with pytest.raises(kvport.InvalidArgument, match="not a tensor or an array"):
        kvport.PagedKvCache.adopt(config, 4, [b"x" * 512] * 4)
    # Nothing was kept registered by the failures.
    with kvport.PagedKvCache.adopt(config, 4, pools) as c:
        assert c.adopted


def array_at(address, rows, cols):
    """A writable uint8 array over memory at `address` (another cache's pool, as
    an engine holding its pointer would alias it)."""
    return np.ctypeslib.as_array((ctypes.c_uint8 * (rows * cols)).from_address(address)).reshape(
        rows, cols)


def test_the_same_arrays_cannot_back_two_caches():
    # Each PagedKvCache has a backend object of its own: adopted ranges are
    # checked process-wide, not per backend object.
    config = make_config()
    pools = engine_pools(config, 4)
    first = kvport.PagedKvCache.adopt(config, 4, pools)
    with pytest.raises(kvport.InvalidArgument,
                       match=r"pool 0 \(layer 0 K\): host: adopt_memory: \[0x[0-9a-f]+, \+512\) "
                             r"overlaps an adopted range \[0x[0-9a-f]+, \+512\) of another host "
                             r"backend object \(host memory\)"):
        kvport.PagedKvCache.adopt(config, 4, pools)
    # A view of the first cache's pool is the same memory.
    views = [array_at(first.k_pool_ptr(0), 4, 128)] + pools[1:]
    with pytest.raises(kvport.InvalidArgument, match="overlaps an adopted range"):
        kvport.PagedKvCache.adopt(config, 4, views)
    first.close()
    with kvport.PagedKvCache.adopt(config, 4, pools) as second:  # the range is free again
        assert second.adopted


def test_a_view_of_another_caches_own_pool_cannot_be_adopted():
    config = make_config()
    owner = kvport.PagedKvCache(config, 4)
    views = [array_at(owner.k_pool_ptr(layer) if part == "k" else owner.v_pool_ptr(layer), 4, 128)
             for layer in range(2) for part in ("k", "v")]
    with pytest.raises(kvport.InvalidArgument,
                       match=r"overlaps a live allocation .* of another host backend object"):
        kvport.PagedKvCache.adopt(config, 4, views)
    owner.alloc_block()  # the refusal left the owner as it was
    owner.close()


def test_zero_blocks_is_refused_not_a_crash():
    config = make_config()
    with pytest.raises(kvport.InvalidArgument, match="num_blocks must be > 0"):
        kvport.PagedKvCache.adopt(config, 0, engine_pools(config, 4))
    with pytest.raises(kvport.InvalidArgument, match="num_blocks must be > 0"):
        kvport.PagedKvCache.adopted_pool_bytes(config, 0)
    with pytest.raises(kvport.InvalidArgument, match="num_blocks must be > 0"):
        kvport.PagedKvCache.adopt(config, 0, [np.zeros((0, 128), dtype=np.uint8)] * 4)


class CudaArray:
    """An object that says it is CUDA memory (__cuda_array_interface__)."""

    def __init__(self, array):
        self.array = array
        self.__cuda_array_interface__ = dict(array.__array_interface__, version=3)


def test_memory_of_another_device_is_refused():
    config = make_config()
    pools = [CudaArray(p) for p in engine_pools(config, 4)]
    with pytest.raises(kvport.InvalidArgument, match=r"pool 0 \(layer 0 K\): the tensor is on cuda"):
        kvport.PagedKvCache.adopt(config, 4, pools)


# ---- the engine's streams ------------------------------------------------------------


class FakeTorchStream:
    def __init__(self, handle):
        self.cuda_stream = handle


class FakeCupyStream:
    def __init__(self, handle):
        self.ptr = handle


def test_stream_handle_duck_types():
    assert kvport.stream_handle(1234) == 1234
    assert kvport.stream_handle(FakeTorchStream(99)) == 99
    assert kvport.stream_handle(FakeCupyStream(77)) == 77
    with pytest.raises(kvport.InvalidArgument, match="bool"):
        kvport.stream_handle(True)
    with pytest.raises(kvport.InvalidArgument, match="is not a stream"):
        kvport.stream_handle("stream")


def test_use_stream_runs_on_the_engines_stream():
    # On the host backend the engine's "stream" is one of the backend's own
    # queues: its handle, wrapped back. (A torch.cuda.Stream on CUDA.)
    with kvport.PagedKvCache(make_config(), 8) as c:
        default = c.stream_handle
        assert default != 0
        c.use_stream(default)  # an int handle
        assert c.stream_handle == default
        b = c.alloc_block()
        c.poison_blocks([b])
        c.use_stream(FakeTorchStream(default))
        c.zero_blocks([b])
        c.use_stream(FakeCupyStream(default))
        k, _ = c.read_block(0, b)
        assert (k == 0).all()
        c.use_stream(None)
        assert c.stream_handle == default
        with pytest.raises(kvport.InvalidArgument, match="not the queue of a live stream"):
            c.use_stream(12345)
        with pytest.raises(kvport.InvalidArgument, match="null handle"):
            c.use_stream(0)
        c.zero_blocks([b])  # still on the default stream after the failures


class InterfaceOnly:
    """An array-like with only __array_interface__ (no __dlpack__)."""

    def __init__(self, array):
        self.array = array
        self.__array_interface__ = array.__array_interface__


def test_array_interface_objects_are_adopted_and_kept_alive():
    config = make_config()
    arrays = engine_pools(config, 4)
    wrapped = [InterfaceOnly(a) for a in arrays]
    with kvport.PagedKvCache.adopt(config, 4, wrapped) as c:
        b = c.alloc_block()
        c.poison_blocks([b])
        assert (arrays[1][b] == 0xFF).all()
    read_only = [InterfaceOnly(a) for a in engine_pools(config, 4)]
    read_only[2].__array_interface__ = dict(read_only[2].__array_interface__,
                                            data=(read_only[2].__array_interface__["data"][0], True))
    with pytest.raises(kvport.InvalidArgument, match=r"pool 2 \(layer 1 K\): the array is read-only"):
        kvport.PagedKvCache.adopt(config, 4, read_only)
