# SPDX-License-Identifier: Apache-2.0
"""Zero-copy pool views (DLPack) through NumPy, for every dtype, in both
layouts: shapes, dtypes, strides, writes visible to read_block, zero_blocks
and write_block visible through the view."""

import numpy as np
import pytest

import kvport
from conftest import make_config

ELEMENTWISE = {"f16": (2, "float16"), "bf16": (2, "bfloat16"),
               "fp8_e4m3": (1, "uint8"), "fp8_e5m2": (1, "uint8")}
RAW_WORDS = {2: np.uint16, 1: np.uint8}


def config_for(dtype, layout, head_dim=16, block_size=4):
    return make_config(dtype=dtype, layout=layout, head_dim=head_dim, block_size=block_size,
                       num_kv_heads=2, num_layers=2)


@pytest.mark.parametrize("dtype", kvport.dtypes())
def test_view_shape_dtype_strides(dtype, layout):
    config = config_for(dtype, layout)
    with kvport.PagedKvCache(config, num_blocks=5) as cache:
        for layer in range(2):
            for k, view in ((True, cache.k_pool(layer)), (False, cache.v_pool(layer))):
                stride = cache.k_block_stride(layer) if k else cache.v_block_stride(layer)
                assert view.device == (1, 0) and view.__dlpack_device__() == (1, 0)
                assert view.kv_dtype == dtype
                assert view.data_ptr == (cache.k_pool_ptr(layer) if k else cache.v_pool_ptr(layer))
                if dtype in ELEMENTWISE:
                    size, name = ELEMENTWISE[dtype]
                    assert view.shape == (5, 4, 2, 16)
                    assert view.strides == (stride // size, 32, 16, 1)
                    assert view.dtype == name
                    assert view.scale_bytes == 0
                    raw = cache.k_pool(layer, raw=True) if k else cache.v_pool(layer, raw=True)
                    assert raw.dtype == ("uint16" if size == 2 else "uint8")
                    arr = raw.numpy()
                    assert arr.dtype == RAW_WORDS[size]
                    # numpy.from_dlpack: the same memory (read-only under NumPy 1.x).
                    assert np.from_dlpack(raw).ctypes.data == arr.ctypes.data
                else:
                    region = config.k_layout(layer) if k else config.v_layout(layer)
                    assert view.shape == (5, region.total_bytes)
                    assert view.strides == (stride, 1)
                    assert view.dtype == "uint8"
                    assert (view.scale_offset, view.scale_bytes) == (region.scale_offset,
                                                                     region.scale_bytes)
                    assert view.scale_bytes > 0
                    arr = np.from_dlpack(view)
                    assert np.shares_memory(arr, view.numpy())
                    arr = view.numpy()
                assert arr.shape == view.shape
                assert arr.strides == tuple(s * arr.itemsize for s in view.strides)
                assert arr.ctypes.data == view.data_ptr
                assert dtype in repr(view) and "device='cpu'" in repr(view)
        if layout == "block_major":
            assert cache.k_block_stride(0) == config.bytes_per_block()


@pytest.mark.parametrize("dtype", kvport.dtypes())
@pytest.mark.parametrize("block_size,head_dim", [(4, 16), (1, 16)])
def test_writes_visible_both_ways(dtype, layout, block_size, head_dim, rng):
    # (1, 16) pads fp8's 32 data bytes... and gives nvfp4/turbo small regions.
    config = config_for(dtype, layout, head_dim=head_dim, block_size=block_size)
    with kvport.PagedKvCache(config, num_blocks=6) as cache:
        blocks = [cache.alloc_block() for _ in range(3)]
        cache.zero_blocks(range(6))
        for layer in range(2):
            for k in (True, False):
                view = (cache.k_pool if k else cache.v_pool)(layer, raw=True)
                arr = view.numpy()
                assert arr.flags.writeable
                region = config.k_layout(layer) if k else config.v_layout(layer)
                nbytes = arr[0].nbytes
                assert nbytes == (region.data_bytes if dtype in ELEMENTWISE else region.total_bytes)
                b, other = blocks[1], blocks[2]
                # Through the view -> read_block.
                data = rng.integers(0, 256, nbytes, dtype=np.uint8)
                arr[b] = data.view(arr.dtype).reshape(arr[b].shape)
                arr[other] = 0x5A
                got = cache.read_block(layer, b)[0 if k else 1]
                assert np.array_equal(got[:nbytes], data)
                assert not got[nbytes:].any()  # padding untouched
                # write_block -> the view.
                kb, vb = cache.k_block_bytes(layer), cache.v_block_bytes(layer)
                fresh_k = rng.integers(0, 256, kb, dtype=np.uint8)
                fresh_v = rng.integers(0, 256, vb, dtype=np.uint8)
                cache.write_block(layer, b, fresh_k, fresh_v)
                expect = fresh_k if k else fresh_v
                assert np.array_equal(np.ascontiguousarray(arr[b]).view(np.uint8).ravel(),
                                      expect[:nbytes])
                # zero_blocks -> the view; other blocks keep their bytes.
                cache.zero_blocks([b])
                assert not arr[b].any()
                assert (arr[other] == 0x5A).all()


def test_numpy_dtypes_and_bf16(rng):
    with kvport.PagedKvCache(config_for("f16", "layer_major"), 3) as cache:
        arr = np.asarray(cache.k_pool(0))  # __array__: writable, no copy
        assert arr.dtype == np.float16
        assert np.from_dlpack(cache.k_pool(0)).dtype == np.float16
        arr[1] = 1.5
        k, _ = cache.read_block(0, 1)
        assert np.array_equal(k.view(np.float16), np.full(4 * 2 * 16, 1.5, np.float16))
        assert cache.k_pool(0).numpy().dtype == np.float16
    with kvport.PagedKvCache(config_for("bf16", "layer_major"), 3) as cache:
        with pytest.raises(Exception):  # NumPy has no bfloat16 (kDLBfloat)
            np.from_dlpack(cache.k_pool(0))
        words = cache.k_pool(0).numpy()          # uint16 words
        assert words.dtype == np.uint16
        assert np.from_dlpack(cache.k_pool(0).as_words()).dtype == np.uint16
        # bf16 1.0 is 0x3F80: the upper half of float32 1.0.
        words[2] = np.array([1.0], np.float32).view(np.uint32)[0] >> 16
        assert (cache.read_block(0, 2)[0].view(np.uint16) == 0x3F80).all()


def test_dlpack_capsule_protocol():
    with kvport.PagedKvCache(config_for("f16", "layer_major"), 2) as cache:
        view = cache.v_pool(1)
        capsule = view.__dlpack__()
        assert type(capsule).__name__ == "PyCapsule"
        del capsule  # unconsumed: its destructor frees the managed tensor
        assert view.__dlpack__(stream=None) is not None
        with pytest.raises(kvport.InvalidArgument):
            cache.k_pool(2)


def test_block_pool_view(rng):
    config = config_for("bf16", "block_major")
    with kvport.PagedKvCache(config, 4) as cache:
        view = cache.block_pool()
        assert view.shape == (4, config.bytes_per_block()) and view.dtype == "uint8"
        assert "block_pool" in repr(view)
        arr = view.numpy()
        data = rng.integers(0, 256, arr.shape[1], dtype=np.uint8)
        arr[2] = data
        offset = 0
        for layer in range(2):
            k, v = cache.read_block(layer, 2)
            assert np.array_equal(k, data[offset:offset + k.size])
            offset += k.size
            assert np.array_equal(v, data[offset:offset + v.size])
            offset += v.size
        cache.zero_blocks([2])
        assert not arr[2].any()
    with kvport.PagedKvCache(config_for("bf16", "layer_major"), 4) as cache:
        with pytest.raises(kvport.InvalidArgument, match="layer_major"):
            cache.block_pool()
