# SPDX-License-Identifier: Apache-2.0
"""PrefixCache and BlockTable from Python."""

import numpy as np
import pytest

import kvport
from conftest import make_config


@pytest.fixture
def prefix():
    with kvport.PagedKvCache(make_config(), num_blocks=8) as c:
        with kvport.PrefixCache(c) as p:
            yield p


def test_table_over_cache_fork_and_copy_on_write():
    with kvport.PagedKvCache(make_config(), num_blocks=8) as cache:
        with kvport.BlockTable(cache) as t:
            t.append_tokens([1, 2, 3, 4, 5, 6])  # block_size 4: 2 blocks
            assert t.blocks == [0, 1] and t.num_tokens == 6 and t.last_block_fill == 2
            assert t.block_ids.dtype == np.uint32 and list(t.block_ids) == [0, 1]
            assert t.blocks_needed(3) == 1
            with t.fork() as child:
                assert child.blocks == t.blocks
                assert cache.ref_count(1) == 2
                child.append_tokens(np.array([7], dtype=np.uint32))  # copy-on-write
                assert child.copy_on_writes == 1
                assert child.blocks[0] == 0 and child.blocks[1] != 1
                assert "num_tokens=7" in repr(child)
            assert child.closed and repr(child) == "BlockTable(closed)"
            assert cache.ref_count(1) == 1 and cache.ref_count(0) == 1
        assert cache.num_free_blocks == 8
        assert cache.check_invariants().ok


def test_table_exhaustion_is_all_or_nothing():
    with kvport.PagedKvCache(make_config(), num_blocks=2) as cache, kvport.BlockTable(cache) as t:
        t.append_tokens(range(5))
        with pytest.raises(kvport.CacheExhausted):
            t.append_tokens(range(8))
        assert t.num_tokens == 5 and t.num_blocks == 2


def test_prefix_reuse_and_lru(prefix):
    prompt = list(range(100, 110))  # 2 full blocks + 2 tokens
    with kvport.BlockTable(prefix) as first:
        assert first.reuse_cached_prefix(prompt) == 0
        first.append_tokens(prompt)
        cached = first.blocks[:2]
        assert prefix.num_cached_blocks == 2
    # Released: the cached blocks are evictable, the head last in line.
    assert prefix.num_evictable_blocks == 2
    assert prefix.lru_order() == [cached[1], cached[0]]
    with kvport.BlockTable(prefix) as second:
        assert second.reuse_cached_prefix(prompt) == 8
        assert second.blocks == cached
        second.append_tokens(prompt[8:])
        assert second.num_tokens == 10
    c = prefix.counters
    assert c.hits == 2 and c.inserts == 2 and 0 < c.hit_rate <= 1
    assert prefix.check_invariants().ok
    assert "cached=2" in repr(prefix)


def test_prefix_lookup_release_evict(prefix):
    with kvport.BlockTable(prefix, extra_key=7) as t:
        t.append_tokens(range(8))
    assert prefix.lookup(range(8)).num_tokens == 0        # other extra_key
    m = prefix.lookup(np.arange(8, dtype=np.uint32), extra_key=7)
    assert m.num_tokens == 8 and len(m.blocks) == 2 and len(m.hashes[0]) == 32
    assert all(prefix.is_cached(b) and not prefix.is_evictable(b) for b in m.blocks)
    prefix.release_blocks(m.blocks)
    assert prefix.evict(10) == 2
    assert prefix.num_cached_blocks == 0
    assert prefix.num_available_blocks == 8
    assert prefix.kv_cache.num_free_blocks == 8
    b = prefix.alloc_block()
    prefix.release(b)
    assert prefix.check_invariants().ok


def test_full_hit_mode(prefix):
    with kvport.BlockTable(prefix) as t:
        t.append_tokens(range(8))
    with kvport.BlockTable(prefix) as t:
        assert t.prefix_hit_mode == "compute_last_token"
        assert t.reuse_cached_prefix(range(8)) == 7
    with kvport.BlockTable(prefix) as t:
        t.prefix_hit_mode = "full"
        assert t.reuse_cached_prefix(range(8)) == 8
        with pytest.raises(kvport.InvalidArgument):
            t.prefix_hit_mode = "half"


def test_table_outlives_closed_cache():
    cache = kvport.PagedKvCache(make_config(), num_blocks=4)
    t = kvport.BlockTable(cache)
    t.append_tokens([1, 2, 3])
    cache.close()
    t.append_tokens([4, 5])  # the table still holds the cache
    assert t.num_blocks == 2
    t.close()


def test_table_owner_errors():
    with pytest.raises(kvport.InvalidArgument, match="PagedKvCache or a PrefixCache"):
        kvport.BlockTable(object())
    with kvport.PagedKvCache(make_config(), 4) as c:
        with pytest.raises(kvport.InvalidArgument, match="extra_key"):
            kvport.BlockTable(c, extra_key=1)


def test_groups_of_a_prefix_cache_are_the_one_group_case(prefix):
    """A model of one full-attention group is the one-group case of groups:
    prefix.as_groups() is the HybridKvCache over this prefix cache, and tables of
    either kind share its blocks and hits."""
    groups = prefix.as_groups()
    assert groups.num_groups == 1
    assert groups.num_layers == 2 and groups.block_size == 4
    prompt = list(range(200, 208))  # 2 full blocks
    with kvport.BlockTable(prefix) as t:
        t.append_tokens(prompt)
        cached = t.blocks[:2]
    with kvport.HybridBlockTable(groups) as h:
        h.copy_last_block = True  # BlockTable's rule: a whole-prompt hit is n - 1 tokens
        assert h.reuse_cached_prefix(prompt) == 7
        assert h.blocks(0)[0] == cached[0]
        assert h.blocks(0)[1] != cached[1]  # the last block is a private copy
        assert h.copy_on_writes == 1
    assert groups.check_invariants().ok and prefix.check_invariants().ok
    with pytest.raises(kvport.InvalidArgument, match="prefix cache's"):
        groups.enable_events()


def test_groups_of_a_plain_cache_cache_nothing():
    with kvport.PagedKvCache(make_config(), num_blocks=4) as cache:
        groups = cache.as_groups()
        with kvport.HybridBlockTable(groups) as h:
            assert h.reuse_cached_prefix(list(range(8))) == 0
            h.append_tokens(list(range(8)))
            assert cache.num_free_blocks == 2
        assert cache.num_free_blocks == 4
        with pytest.raises(kvport.InvalidArgument, match="group pool"):
            groups.group_pool(0).as_groups()
