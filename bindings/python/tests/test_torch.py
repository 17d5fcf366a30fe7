# SPDX-License-Identifier: Apache-2.0
"""PyTorch interop: torch.from_dlpack of kvport's pool views, and the paged
attention check in PyTorch. Skipped, with the reason, when torch is absent
(scripts/deps.sh --torch installs Debian's python3-torch)."""

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="PyTorch is not installed (scripts/deps.sh --torch)")

import kvport  # noqa: E402

BLOCK, KV_HEADS, Q_HEADS, HEAD_DIM = 4, 2, 4, 16

TORCH_DTYPES = {"f16": torch.float16, "bf16": torch.bfloat16,
                "fp8_e4m3": torch.uint8, "fp8_e5m2": torch.uint8}


def config(dtype, layout):
    return kvport.KvCacheConfig(2, KV_HEADS, HEAD_DIM, block_size=BLOCK, dtype=dtype,
                                layout=layout)


@pytest.mark.parametrize("layout", ["layer_major", "block_major"])
@pytest.mark.parametrize("dtype", kvport.dtypes())
def test_from_dlpack_shape_dtype_and_writes(dtype, layout):
    with kvport.PagedKvCache(config(dtype, layout), num_blocks=5) as cache:
        cache.zero_blocks(range(5))
        for layer in range(2):
            view = cache.k_pool(layer)
            t = torch.from_dlpack(view)
            assert t.device.type == "cpu"
            assert t.data_ptr() == cache.k_pool_ptr(layer)
            assert tuple(t.shape) == view.shape and tuple(t.stride()) == view.strides
            if dtype in TORCH_DTYPES:
                assert t.shape == (5, BLOCK, KV_HEADS, HEAD_DIM)
                assert t.dtype == TORCH_DTYPES[dtype]
            else:
                assert t.dtype == torch.uint8 and t.dim() == 2
            # Writes through the tensor reach read_block; zero_blocks reaches the tensor.
            t[3] = 1
            k, _ = cache.read_block(layer, 3)
            nbytes = t[3].numel() * t.element_size()
            expect = torch.ones_like(t[3]).contiguous().view(torch.uint8).numpy().ravel()
            assert np.array_equal(k[:nbytes], expect)
            cache.zero_blocks([3])
            assert not t[3].any()


def test_tensor_keeps_pools_alive():
    cache = kvport.PagedKvCache(config("bf16", "layer_major"), num_blocks=3)
    t = torch.from_dlpack(cache.v_pool(1))
    cache.close()
    del cache
    t.fill_(2.0)
    assert bool((t == 2.0).all())


@pytest.mark.parametrize("dtype", ["f16", "bf16"])
@pytest.mark.parametrize("layout", ["layer_major", "block_major"])
def test_paged_attention_torch(dtype, layout):
    gen = torch.Generator().manual_seed(3)
    tokens = 11
    with kvport.PagedKvCache(config(dtype, layout), num_blocks=12) as cache:
        held = [cache.alloc_block() for _ in range(4)]
        cache.free_blocks(held[1::2])  # scatter the table's blocks
        with kvport.BlockTable(cache) as table:
            table.append_tokens(list(range(tokens)))
            ids = torch.from_numpy(table.block_ids.astype(np.int64))
            k_pool = torch.from_dlpack(cache.k_pool(1))
            v_pool = torch.from_dlpack(cache.v_pool(1))
            k = torch.randn(tokens, KV_HEADS, HEAD_DIM, generator=gen).to(k_pool.dtype)
            v = torch.randn(tokens, KV_HEADS, HEAD_DIM, generator=gen).to(v_pool.dtype)
            pos = torch.arange(tokens)
            k_pool[ids[pos // BLOCK], pos % BLOCK] = k  # scatter, as a KV write kernel
            v_pool[ids[pos // BLOCK], pos % BLOCK] = v
            q = torch.randn(Q_HEADS, HEAD_DIM, generator=gen)

            def attention(q, k, v):
                k = k.float().repeat_interleave(Q_HEADS // KV_HEADS, dim=1)
                v = v.float().repeat_interleave(Q_HEADS // KV_HEADS, dim=1)
                p = torch.softmax(torch.einsum("hd,thd->ht", q, k) / HEAD_DIM ** 0.5, dim=1)
                return torch.einsum("ht,thd->hd", p, v)

            # Paged: gather through the block ids, then trim to the tokens.
            gathered_k = k_pool[ids].reshape(-1, KV_HEADS, HEAD_DIM)[:tokens]
            gathered_v = v_pool[ids].reshape(-1, KV_HEADS, HEAD_DIM)[:tokens]
            got = attention(q, gathered_k, gathered_v)
            want = attention(q, k, v)
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
