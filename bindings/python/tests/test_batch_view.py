# SPDX-License-Identifier: Apache-2.0
"""Batch metadata for attention kernels through the module, checked against
each consumer's rules as written in the engines: vLLM v1's block-table rows
(int32, left-aligned, null block 0 for released entries and padding, row
width a multiple of 128 // kernel block) and slot mapping (int64, block *
block_size + offset per new token, -1 padding); FlashInfer's CSR pages
(int32; indptr from 0, non-decreasing; last_page_len in [1, page_size];
seq_len = page_size * (pages - 1) + last_page_len); SGLang's token locations
(one slot per position); a kernel block smaller
than the cache's (block b is kernel blocks b*k .. b*k+k-1). Random batches
with window release, forks, speculative truncation."""

import random

import numpy as np
import pytest

import kvport

NULL = kvport.NULL_BLOCK


def layers():
    return [kvport.LayerSpec.sliding_window(32, 2, 16), kvport.LayerSpec.full_attention(2, 16)]


def expected_kernel_ids(table, group, kbs, bs, null=0):
    ids = []
    blocks = table.blocks(group)
    for j in range(-(-table.num_tokens // kbs)):
        b = blocks[j * kbs // bs]
        ids.append(null if b == NULL else b * (bs // kbs) + j % (bs // kbs))
    return ids


def check_batch(tables, new, bs, kbs, max_model_len):
    for group in (0, 1):
        width = kvport.vllm_row_width(max_model_len, kbs)
        assert width % max(1, 128 // kbs) == 0 and width * kbs >= max_model_len
        rows = kvport.build_block_table_rows(tables, new, group, row_width=width,
                                             num_rows=len(tables) + 2, kernel_block_size=kbs)
        assert rows.dtype == np.int32 and rows.shape == (len(tables) + 2, width)
        assert (rows[len(tables):] == 0).all()  # padding rows: the null block
        for i, t in enumerate(tables):
            want = expected_kernel_ids(t, group, kbs, bs)
            assert list(rows[i, :len(want)]) == want
            assert (rows[i, len(want):] == 0).all()
        slots = kvport.build_slot_mapping(tables, new, group, num_slots=sum(new) + 3,
                                          kernel_block_size=kbs)
        assert slots.dtype == np.int64 and (slots[sum(new):] == -1).all()
        at = 0
        for t, n in zip(tables, new):
            blocks = t.blocks(group)
            for pos in range(t.num_tokens - n, t.num_tokens):
                assert blocks[pos // bs] != NULL
                assert slots[at] == blocks[pos // bs] * bs + pos % bs  # the same token slot
                at += 1
        locations = kvport.build_token_locations(tables, new, group, row_width=max_model_len,
                                                 num_rows=len(tables) + 1, kernel_block_size=kbs)
        assert locations.dtype == np.int32 and (locations[len(tables)] == 0).all()
        for i, t in enumerate(tables):
            blocks = t.blocks(group)
            want = [0 if blocks[p // bs] == NULL else blocks[p // bs] * bs + p % bs
                    for p in range(t.num_tokens)]
            assert list(locations[i, :t.num_tokens]) == want
            assert (locations[i, t.num_tokens:] == 0).all()
        pages = kvport.build_flashinfer_pages(tables, new, group, kernel_block_size=kbs)
        indptr, indices = pages["indptr"], pages["indices"]
        last, kv_len = pages["last_page_len"], pages["kv_len"]
        for a in (indptr, indices, last, kv_len):
            assert a.dtype == np.int32
        assert pages["page_size"] == kbs
        assert indptr[0] == 0 and (np.diff(indptr) >= 1).all() and indptr[-1] == len(indices)
        assert ((last >= 1) & (last <= kbs)).all()
        for i, t in enumerate(tables):
            n_pages = indptr[i + 1] - indptr[i]
            assert kbs * (n_pages - 1) + last[i] == t.num_tokens == kv_len[i]
            assert list(indices[indptr[i]:indptr[i + 1]]) == expected_kernel_ids(t, group, kbs, bs)


def test_random_batches_follow_the_consumers_rules():
    rng = random.Random(32)
    bs = 16
    with kvport.HybridKvCache(layers(), [256, 256], block_size=bs) as cache:
        tables = []
        for step in range(60):
            op = rng.random()
            if not tables or (op < 0.2 and len(tables) < 8):
                t = kvport.HybridBlockTable(cache)
                prompt = [rng.randrange(4) for _ in range(rng.randrange(1, 80))]
                hit = t.reuse_cached_prefix(prompt)
                t.append_tokens(prompt[hit:] or [1])
                tables.append(t)
                new = [len(prompt) - hit or 1]
            elif op < 0.3 and len(tables) < 8:
                tables.append(tables[rng.randrange(len(tables))].fork())
            elif op < 0.5:  # a speculative step: drafts, some accepted, the rest truncated
                t = rng.choice(tables)
                k = rng.randrange(1, 5)
                if t.can_append_draft(k):
                    t.append_draft([rng.randrange(4) for _ in range(k)])
                    t.commit(rng.randrange(k + 1))
                    t.truncate(t.num_committed)
            else:  # decode a token in every sequence that has room
                for t in tables:
                    if t.num_tokens < 200 and t.can_append(1):
                        t.append_tokens([rng.randrange(4)])
            batch = [t for t in tables if t.num_tokens > 0]
            new = [1 for _ in batch]
            for kbs in (16, 8, 4):
                check_batch(batch, new, bs, kbs, 256)
            # A verify step: the last drafts are new tokens too.
            t = batch[0]
            if t.can_append_draft(3):
                t.append_draft([1, 2, 3])
                check_batch([t], [4], bs, 8, 256)
                t.truncate(t.num_committed)
        # The window's released blocks are the null block in its rows.
        long = max(tables, key=lambda t: t.num_tokens)
        rows = kvport.build_block_table_rows([long], [1], 0, row_width=16)
        released = [j for j, b in enumerate(long.blocks(0)) if b == NULL]
        assert released and all(rows[0, j] == 0 for j in released)
        for t in tables:
            t.close()


def test_errors_name_the_problem():
    with kvport.HybridKvCache(layers(), [16, 16], block_size=16) as cache:
        with kvport.HybridBlockTable(cache) as t:
            t.append_tokens(list(range(40)))
            with pytest.raises(kvport.InvalidArgument, match="1 tables but 2"):
                kvport.build_slot_mapping([t], [1, 1], 1)
            with pytest.raises(kvport.InvalidArgument, match="0 new tokens"):
                kvport.build_slot_mapping([t], [0], 1)
            with pytest.raises(kvport.InvalidArgument, match="more than a row of 2"):
                kvport.build_block_table_rows([t], [1], 1, row_width=2)
            with pytest.raises(kvport.InvalidArgument, match="does not divide"):
                kvport.build_flashinfer_pages([t], [1], 1, kernel_block_size=5)
            with pytest.raises(kvport.OutOfRange):
                kvport.build_flashinfer_pages([t], [1], 2)
            with pytest.raises(kvport.InvalidArgument, match="empty"):
                kvport.build_flashinfer_pages([], [], 1)
            with pytest.raises(kvport.InvalidArgument, match="must be positive"):
                kvport.vllm_row_width(0, 16)
