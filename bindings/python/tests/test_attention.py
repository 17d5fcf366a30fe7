# SPDX-License-Identifier: Apache-2.0
"""End to end: paged attention in NumPy, gathering K/V through a
BlockTable's block ids from kvport's pools, equals dense attention."""

import numpy as np
import pytest

import kvport

BLOCK, KV_HEADS, Q_HEADS, HEAD_DIM, LAYERS = 4, 2, 4, 16, 2


def dense_attention(q, k, v):
    """q [Hq, D], k/v [T, Hkv, D] (float32) -> [Hq, D]; grouped-query."""
    group = q.shape[0] // k.shape[1]
    k = np.repeat(k, group, axis=1)
    v = np.repeat(v, group, axis=1)
    scores = np.einsum("hd,thd->ht", q, k) / np.sqrt(q.shape[1])
    scores -= scores.max(axis=1, keepdims=True)
    p = np.exp(scores)
    p /= p.sum(axis=1, keepdims=True)
    return np.einsum("ht,thd->hd", p, v)


def paged_attention(q, k_pool, v_pool, block_ids, num_tokens):
    """Block by block with an online softmax, reading only kvport's pools."""
    group = q.shape[0] // k_pool.shape[2]
    m = np.full(q.shape[0], -np.inf, np.float32)
    denom = np.zeros(q.shape[0], np.float32)
    acc = np.zeros_like(q)
    for i, block in enumerate(block_ids):
        n = min(BLOCK, num_tokens - i * BLOCK)
        k = np.repeat(k_pool[block, :n].astype(np.float32), group, axis=1)
        v = np.repeat(v_pool[block, :n].astype(np.float32), group, axis=1)
        s = np.einsum("hd,thd->ht", q, k) / np.sqrt(q.shape[1])
        m_new = np.maximum(m, s.max(axis=1))
        scale = np.exp(m - m_new)
        p = np.exp(s - m_new[:, None])
        denom = denom * scale + p.sum(axis=1)
        acc = acc * scale[:, None] + np.einsum("ht,thd->hd", p, v)
        m = m_new
    return acc / denom[:, None]


@pytest.mark.parametrize("layout", ["layer_major", "block_major"])
def test_paged_attention_numpy(layout):
    rng = np.random.default_rng(7)
    config = kvport.KvCacheConfig(LAYERS, KV_HEADS, HEAD_DIM, block_size=BLOCK, dtype="f16",
                                  layout=layout)
    with kvport.PagedKvCache(config, num_blocks=16) as cache:
        # Scatter the sequence's blocks: allocate and free a few first.
        scratch = [cache.alloc_block() for _ in range(5)]
        cache.free_blocks(scratch[::2])
        tokens = 13
        with kvport.BlockTable(cache) as table:
            table.append_tokens(range(tokens))
            ids = table.block_ids
            assert len(ids) == 4 and list(ids) != sorted(ids)
            for layer in range(LAYERS):
                k_pool = cache.k_pool(layer).numpy()
                v_pool = cache.v_pool(layer).numpy()
                k = rng.standard_normal((tokens, KV_HEADS, HEAD_DIM)).astype(np.float16)
                v = rng.standard_normal((tokens, KV_HEADS, HEAD_DIM)).astype(np.float16)
                for t in range(tokens):  # the "KV write" of each token
                    k_pool[ids[t // BLOCK], t % BLOCK] = k[t]
                    v_pool[ids[t // BLOCK], t % BLOCK] = v[t]
                q = rng.standard_normal((Q_HEADS, HEAD_DIM)).astype(np.float32)
                want = dense_attention(q, k.astype(np.float32), v.astype(np.float32))
                got = paged_attention(q, k_pool, v_pool, ids, tokens)
                np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
                # The same K came through read_block: the pools hold it.
                first_k = cache.read_block(layer, int(ids[0]))[0].view(np.float16)
                assert np.array_equal(first_k.reshape(BLOCK, KV_HEADS, HEAD_DIM), k[:BLOCK])
