# SPDX-License-Identifier: Apache-2.0
"""Hybrid models through the module: layer specs, the planner, and three
caches built as engines would build them (gpt-oss-like window + full,
DeepSeek-like MLA, a Mamba hybrid). Checks window freeing (null entries after
a long decode), prefix hits (a window group needs only its last blocks), state
checkpoints (a state written with NumPy comes back in a new request's slot)
and the views (shapes, strides and data pointers against locate + the group
pools' pointers), and that views keep the cache alive."""

import gc

import numpy as np
import pytest

import kvport

NULL = kvport.NULL_BLOCK


def tokens(n, first=1):
    return list(range(first, first + n))


def gpt_oss_layers(num_layers=4, window=128):
    """Alternating sliding-window and full attention, like gpt-oss (small heads)."""
    return [kvport.LayerSpec.sliding_window(window, 2, 16) if i % 2 == 0
            else kvport.LayerSpec.full_attention(2, 16) for i in range(num_layers)]


def mamba_layers():
    """A Mamba hybrid: state layers around one full-attention layer, an MLP layer."""
    state = kvport.LayerSpec.state([kvport.StateTensor("conv", [24, 3], "bf16"),
                                    ("ssm", [2, 8, 16], "f32")])
    return [state, state, kvport.LayerSpec.full_attention(2, 16), state, kvport.LayerSpec.none()]


def check_ok(cache):
    report = cache.check_invariants()
    assert report.ok, str(report)


# ---- specs and the planner -------------------------------------------------------

def test_layer_specs():
    w = kvport.LayerSpec.sliding_window(128, 8, 64)
    assert (w.kind, w.window, w.num_kv_heads, w.head_dim_k, w.head_dim_v, w.dtype) == \
        ("sliding_window", 128, 8, 64, 64, "bf16")
    assert w.describe() == "sliding_window(128) 8x64 bf16"
    assert w.block_bytes(16) == 2 * 16 * 8 * 64 * 2 and w.has_blocks and not w.has_state
    assert repr(w) == "LayerSpec(sliding_window(128) 8x64 bf16)"
    c = kvport.LayerSpec.chunked_local(8192, 8, 128, dtype="fp8_e4m3")
    assert (c.kind, c.chunk, c.dtype) == ("chunked_local", 8192, "fp8_e4m3")
    m = kvport.LayerSpec.mla(512, 64)
    assert (m.kind, m.kv_lora_rank, m.rope_dim, m.mla_format) == ("mla_attention", 512, 64, "plain")
    assert m.block_bytes(16) == 16 * 576 * 2
    ds = kvport.LayerSpec.mla(512, 64, format="fp8_ds_mla")
    assert ds.block_bytes(16) == 16 * 656 and ds.describe() == "mla(512+64) fp8_ds_mla"
    s = mamba_layers()[0]
    assert s.kind == "mamba" and s.has_state and not s.has_blocks
    assert [t.name for t in s.state_tensors] == ["conv", "ssm"]
    assert s.state_tensors[1] == kvport.StateTensor("ssm", [2, 8, 16], "f32")
    assert s.state_tensors[0].bytes == 24 * 3 * 2 and s.state_tensors[1].num_elements == 256
    assert s.state_offset(0) == 0 and s.state_offset(1) == 144  # 144 is 16-aligned
    assert s.state_bytes() == 144 + 1024
    assert s.describe() == "state(conv 24x3 bf16, ssm 2x8x16 f32)"
    assert kvport.LayerSpec.none().kind == "none"
    assert w == kvport.LayerSpec.sliding_window(128, 8, 64) and w != m
    assert w.same_group_as(kvport.LayerSpec.sliding_window(128, 8, 64, dtype="f16"))
    assert w.pool_config(3, 16).num_layers == 3
    assert m.pool_config(1, 16).head_dim_v == 0

    with pytest.raises(kvport.InvalidArgument, match="window"):
        kvport.LayerSpec.sliding_window(0, 8, 64).validate(16)
    with pytest.raises(kvport.InvalidArgument):
        kvport.LayerSpec.chunked_local(6, 1, 8).validate(4)
    with pytest.raises(kvport.InvalidArgument, match="state dtype"):
        kvport.StateTensor("x", [1], "f64")
    with pytest.raises(kvport.InvalidArgument, match="MLA format"):
        kvport.LayerSpec.mla(512, 64, format="fp4")
    with pytest.raises(kvport.InvalidArgument, match="state tensor"):
        kvport.LayerSpec.state([42])
    with pytest.raises(kvport.InvalidArgument):
        s.state_offset(2)


def test_state_tensor_errors_name_the_tensor_and_the_dimension():
    with pytest.raises(kvport.InvalidArgument,
                       match=r"StateTensor 'a': dimension 0 is -1; every dimension must be > 0"):
        kvport.LayerSpec.state([("a", [-1, 3])])
    with pytest.raises(kvport.InvalidArgument, match=r"StateTensor 'conv': dimension 1 is 0"):
        kvport.LayerSpec.state([("ssm", [2, 4]), ("conv", [24, 0], "bf16")])
    with pytest.raises(kvport.InvalidArgument, match=r"StateTensor 'x': dimension 2 is -5"):
        kvport.StateTensor("x", [1, 2, -5])
    with pytest.raises(kvport.InvalidArgument, match=r"StateTensor 'x': dimension 0 is 2.5"):
        kvport.StateTensor("x", [2.5])
    with pytest.raises(kvport.InvalidArgument, match=r"StateTensor 'x': the shape is empty"):
        kvport.LayerSpec.state([("x", [])])
    with pytest.raises(kvport.InvalidArgument,
                       match=r"state tensors 0 and 2 are both named 'conv'"):
        kvport.LayerSpec.state([("conv", [4]), ("ssm", [2]), ("conv", [8], "bf16")])
    with pytest.raises(kvport.InvalidArgument, match="at least one state tensor"):
        kvport.LayerSpec.state([])
    ok = kvport.LayerSpec.state([("conv", [4]), ("ssm", [2])])
    assert [t.name for t in ok.state_tensors] == ["conv", "ssm"]


def test_plan_and_groups():
    layers = [kvport.LayerSpec.sliding_window(128, 8, 64) if i % 2 == 0
              else kvport.LayerSpec.full_attention(8, 64) for i in range(4)]
    groups = kvport.group_layers(layers, 16)
    assert [g.layers for g in groups] == [[0, 2], [1, 3]]
    assert groups[0].spec.kind == "sliding_window" and groups[1].layer_dtypes == ["bf16", "bf16"]
    plan = kvport.plan_kv_cache(layers, 16, 64 << 20, 4096)
    assert plan.block_size == 16 and len(plan.groups) == 2
    assert [g.peak_blocks_per_request for g in plan.groups] == [9, 256]
    assert plan.groups[0].spec.window == 128 and plan.groups[0].num_layers == 2
    assert plan.ratio_to_all_full == pytest.approx(265 / 512, abs=1e-12)
    assert plan.total_bytes == sum(g.bytes for g in plan.groups) <= 64 << 20
    assert plan.blocks_per_group == [g.num_blocks for g in plan.groups]
    with kvport.HybridKvCache(layers, plan) as cache:
        assert cache.block_size == 16 and cache.total_bytes == plan.total_bytes
        assert [cache.group_pool(g).num_blocks for g in range(2)] == plan.blocks_per_group
    with pytest.raises(kvport.InvalidArgument, match="differs from the plan"):
        kvport.HybridKvCache(layers, plan, block_size=32)
    with pytest.raises(kvport.InvalidArgument, match="blocks_per_group"):
        kvport.HybridKvCache(layers, "many")
    with pytest.raises(kvport.InvalidArgument, match="1 block counts for 2"):
        kvport.HybridKvCache(layers, [4])
    with pytest.raises(kvport.InvalidArgument, match="holds"):
        kvport.plan_kv_cache(layers, 16, 64 << 20, 4096, max_requests=10 ** 6)
    with pytest.raises(kvport.InvalidArgument):
        kvport.plan_kv_cache([kvport.LayerSpec.none()], 16, 1 << 20, 128)


def test_shared_pool_plan_and_kept_windows():
    # Gemma-like: 5 window layers, 1 full, 5 window, 1 full, 2 window: a plan
    # with a shared pool splits them into 7 groups of 2 layers that share it.
    pattern = ([kvport.LayerSpec.sliding_window(32, 2, 16)] * 5 +
               [kvport.LayerSpec.full_attention(2, 16)])
    layers = pattern * 2 + [kvport.LayerSpec.sliding_window(32, 2, 16)] * 2
    separate = kvport.plan_kv_cache(layers, 16, 8 << 20, 1024)
    assert len(separate.groups) == 2 and separate.shared_blocks == 0
    assert separate.max_context_tokens == 1024
    plan = kvport.plan_kv_cache(layers, 16, 8 << 20, 1024, shared_pool=True)
    assert len(plan.groups) == 7 and all(g.shared and g.num_layers == 2 for g in plan.groups)
    assert plan.shared_blocks > 0 and plan.total_bytes <= 8 << 20
    with kvport.HybridKvCache(layers, plan) as cache:
        assert cache.num_groups == 7 and cache.shared_pool_blocks == plan.shared_blocks
        assert all(cache.in_shared_pool(g) for g in range(7))
        with pytest.raises(kvport.OutOfRange):
            cache.in_shared_pool(7)
        # Memory moves between groups: one long sequence fills the pool, the
        # window groups hold a few blocks each, the full group the rest.
        with kvport.HybridBlockTable(cache) as t:
            n = 0
            while t.can_append(16):
                t.append_tokens(tokens(16, 1 + n))
                n += 16
            full = t.num_live_blocks(3)
            assert full > plan.shared_blocks // 2
            assert all(t.num_live_blocks(g) <= 4 for g in range(7) if g != 3)
            with pytest.raises(kvport.CacheExhausted, match="shared pool"):
                t.append_tokens(tokens(16, 1 + n))
        # Kept windows: a table that hits keeps the window before its hit.
        prompt = tokens(64)
        with kvport.HybridBlockTable(cache) as a:
            a.append_tokens(prompt)
        with kvport.HybridBlockTable(cache) as b:
            assert not b.keep_shared_windows
            b.keep_shared_windows = True
            assert b.reuse_cached_prefix(prompt + tokens(64, 1000)) == 64
            b.append_tokens(tokens(64, 1000))
            assert b.num_kept_blocks(0) == 2  # window 32: blocks 2 and 3, before the hit
            assert b.num_kept_blocks(3) == 0  # full attention: held anyway
            b.keep_hit_point()
            assert b.num_kept_blocks(0) == 4
            with pytest.raises(kvport.OutOfRange, match="group 7 out of range"):
                b.num_kept_blocks(7)
    with kvport.HybridKvCache(layers, separate) as cache:
        assert cache.shared_pool_blocks == 0 and not cache.in_shared_pool(0)


def test_copy_last_block_hits_all_but_the_last_token():
    layers = gpt_oss_layers()
    with kvport.HybridKvCache(layers, [32, 64], block_size=16) as cache:
        prompt = tokens(64)
        with kvport.HybridBlockTable(cache) as a:
            a.append_tokens(prompt)
        with kvport.HybridBlockTable(cache) as b:
            assert b.reuse_cached_prefix(prompt) == 48  # the default: n - block_size
        with kvport.HybridBlockTable(cache) as c:
            assert not c.copy_last_block
            c.copy_last_block = True
            assert c.reuse_cached_prefix(prompt) == 63
            assert c.copy_on_writes == 2  # the last block of each group, copied
            assert c.num_tokens == 63
            c.append_tokens(prompt[63:])
            assert c.num_tokens == 64
            with c.fork() as child:
                assert child.copy_last_block
        assert cache.check_invariants().ok


# ---- gpt-oss-like: window 128 + full ---------------------------------------------

def test_window_freeing_after_a_long_decode():
    layers = gpt_oss_layers()
    with kvport.HybridKvCache(layers, [32, 64], block_size=16) as cache:
        assert cache.num_groups == 2 and cache.locate(2) == (0, 1) and cache.locate(3) == (1, 1)
        with kvport.HybridBlockTable(cache) as t:
            t.append_tokens(tokens(100))
            peak = 0
            for tok in range(100, 400):
                t.append_tokens([tok])
                peak = max(peak, t.num_live_blocks(0))
            window = t.blocks(0)
            # The last append started at 399 tokens: blocks wholly before
            # token 399 - 128 + 1 = 272 are released.
            assert len(window) == 25 and window[:17] == [NULL] * 17
            assert NULL not in window[17:] and t.num_live_blocks(0) == 8
            assert NULL not in t.blocks(1) and t.num_live_blocks(1) == 25
            assert peak <= 9  # the planner's peak for window 128, step 1
            ids = t.block_ids(0)
            assert ids.dtype == np.uint32 and list(ids) == window
            assert cache.blocks_in_use(0) == 8
            check_ok(cache)
        assert cache.blocks_in_use(0) == 0 and cache.blocks_in_use(1) == 0
        check_ok(cache)


def test_window_hit_needs_only_the_last_blocks():
    layers = gpt_oss_layers()
    prompt = tokens(300)
    with kvport.HybridKvCache(layers, [64, 64], block_size=16) as cache:
        with kvport.HybridBlockTable(cache) as a:
            a.append_tokens(prompt)
            a.append_tokens([7, 8, 9])  # decode: the window releases its early blocks
            assert a.blocks(0)[0] == NULL
        with kvport.HybridBlockTable(cache) as b:
            assert b.prefix_hit_mode == "compute_last_token"
            hit = b.reuse_cached_prefix(prompt)
            assert hit == 288  # 18 whole blocks of at most 299 tokens
            # The next token is 288: the window needs tokens 161..287, blocks 10..17.
            window = b.blocks(0)
            assert len(window) == 18 and window[:10] == [NULL] * 10 and NULL not in window[10:]
            assert NULL not in b.blocks(1) and len(b.blocks(1)) == 18
            counters = cache.hit_counters
            assert (counters.lookups, counters.lookup_tokens, counters.hit_tokens) == (1, 300, 288)
            with pytest.raises(kvport.InvalidArgument):
                b.reuse_cached_prefix(prompt)  # not empty
            b.append_tokens(prompt[288:])
            assert b.num_tokens == 300
            check_ok(cache)
        with kvport.HybridBlockTable(cache, extra_key=5) as other:
            assert other.reuse_cached_prefix(prompt) == 0


def test_speculative_steps_never_make_a_rejected_token_hittable():
    layers = gpt_oss_layers(window=32)
    prompt = tokens(40)
    with kvport.HybridKvCache(layers, [64, 64], block_size=16) as cache:
        with kvport.HybridBlockTable(cache) as t:
            t.append_tokens(prompt)
            drafts = [900, 901, 902, 903, 904, 905, 906, 907, 908, 909]
            t.append_draft(drafts)  # 50 tokens: block 3 holds drafts only
            assert (t.num_tokens, t.num_committed, t.num_draft_tokens) == (50, 40, 10)
            assert t.tokens == prompt and t.draft_tokens == drafts
            assert len(t.blocks(1)) == 4 and t.check_invariants().ok
            with kvport.HybridBlockTable(cache) as probe:  # drafts are not hit
                assert probe.reuse_cached_prefix(prompt + drafts + [1]) == 32
            t.commit(8)  # the verifier accepts 8: block 2 (tokens 32..47) is committed
            assert (t.num_committed, t.num_draft_tokens) == (48, 2)
            with kvport.HybridBlockTable(cache) as probe:
                assert probe.reuse_cached_prefix(prompt + drafts + [1]) == 48
            in_use = cache.blocks_in_use(1)
            t.truncate(t.num_committed)  # 2 rejected: block 3 held only them
            assert t.num_tokens == 48 and cache.blocks_in_use(1) == in_use - 1
            with pytest.raises(kvport.InvalidArgument, match="never taken back"):
                t.truncate(47)
            with pytest.raises(kvport.InvalidArgument, match="draft tokens"):
                t.commit(1)
            t.append_tokens([77])  # the verifier's own next token
            t.append_draft([5, 6])
            with pytest.raises(kvport.InvalidArgument, match="commit or truncate"):
                t.append_tokens([1])
            with pytest.raises(kvport.InvalidArgument, match="commit or truncate"):
                t.fork()
            t.truncate(49)
            assert t.check_invariants().ok
            check_ok(cache)
    # A state group: one slot per draft; the accepted one's becomes the working state.
    with kvport.HybridKvCache(mamba_layers(), [8, 32], block_size=16) as cache:
        with kvport.HybridBlockTable(cache) as t:
            t.append_tokens(tokens(10))
            working = t.state_slot(0)
            assert t.can_append_draft(3) and not t.can_append_draft(8)
            t.append_draft([1, 2, 3])
            slots = t.draft_state_slots(0)
            assert len(slots) == 3 and working not in slots and t.draft_state_slots(1) == []
            t.commit(2)
            assert t.state_slot(0) == slots[1] and t.draft_state_slots(0) == [slots[2]]
            t.truncate(12)
            assert t.draft_state_slots(0) == [] and t.check_invariants().ok
            assert cache.blocks_in_use(0) == 1
            check_ok(cache)


def test_attention_views_match_the_group_pools():
    layers = gpt_oss_layers()
    with kvport.HybridKvCache(layers, [8, 16], block_size=16) as cache:
        for layer in range(4):
            group, index = cache.locate(layer)
            pool = cache.group_pool(group)
            for k in (True, False):
                view = cache.k_pool(layer) if k else cache.v_pool(layer)
                stride = pool.k_block_stride(index) if k else pool.v_block_stride(index)
                assert view.shape == (pool.num_blocks, 16, 2, 16)
                assert view.strides == (stride // 2, 32, 16, 1) and view.dtype == "bfloat16"
                assert view.data_ptr == (pool.k_pool_ptr(index) if k else pool.v_pool_ptr(index))
                assert view.kv_dtype == "bf16" and f"pool({layer})" in repr(view)
            assert set(cache.views(layer)) == {"k", "v"}
        # A write through the view is what the pool's read_block returns.
        with kvport.HybridBlockTable(cache) as t:
            t.append_tokens(tokens(20))
            block = t.blocks(0)[1]
            k = cache.k_pool(2, raw=True).numpy()
            k[block] = np.arange(16 * 2 * 16, dtype=np.uint16).reshape(16, 2, 16)
            kb, _ = cache.group_pool(0).read_block(1, block)
            assert np.array_equal(kb.view(np.uint16).reshape(16, 2, 16), k[block])
        with pytest.raises(kvport.InvalidArgument, match="not an MLA layer"):
            cache.latent_pool(0)
        with pytest.raises(kvport.InvalidArgument, match="not a state layer"):
            cache.state_pool(1, 0)
        with pytest.raises(kvport.InvalidArgument):
            cache.k_pool(4)


def test_all_or_nothing_and_fork():
    layers = gpt_oss_layers(num_layers=2, window=8)
    with kvport.HybridKvCache(layers, [3, 16], block_size=4) as cache:
        t = kvport.HybridBlockTable(cache)
        t.append_tokens(tokens(12))
        assert not t.can_append(9)
        need = t.blocks_needed(9)
        assert [(n.fresh, n.released) for n in need] == [(3, 1), (3, 0)]
        before = (t.blocks(0), t.blocks(1))
        with pytest.raises(kvport.CacheExhausted, match="group 0"):
            t.append_tokens(tokens(9, 100))
        assert (t.blocks(0), t.blocks(1)) == before and t.num_tokens == 12
        t.append_tokens([100])
        assert t.blocks(0)[0] == NULL
        with pytest.raises(kvport.CacheExhausted):
            t.fork().append_tokens([5])  # the copy-on-write needs a fourth window block
        t.release()
        assert t.empty
        check_ok(cache)
        with pytest.raises(kvport.InvalidArgument):
            t.blocks(2)
        t.close()
        with pytest.raises(kvport.InvalidArgument, match="closed"):
            t.num_tokens
    with kvport.HybridKvCache(layers, [16, 16], block_size=4) as cache:
        with kvport.HybridBlockTable(cache) as t:
            t.append_tokens(tokens(13))
            child = t.fork()  # shares every live block
            assert child.blocks(0) == t.blocks(0) and child.blocks(1) == t.blocks(1)
            child.append_tokens([5])  # copies the shared, partly filled last block
            assert child.copy_on_writes == 2 and t.copy_on_writes == 0  # one per group
            assert child.blocks(1)[-1] != t.blocks(1)[-1]
            child.close()
            check_ok(cache)


# ---- DeepSeek-like MLA -------------------------------------------------------------

@pytest.mark.parametrize("fmt", ["plain", "fp8_ds_mla"])
def test_mla_latent_views(fmt):
    layers = [kvport.LayerSpec.mla(512, 64, format=fmt) for _ in range(3)]
    with kvport.HybridKvCache(layers, [8], block_size=16) as cache:
        assert cache.num_groups == 1 and cache.group(0).layers == [0, 1, 2]
        pool = cache.group_pool(0)
        assert pool.config.head_dim_v == 0
        for layer in range(3):
            view = cache.latent_pool(layer)
            group, index = cache.locate(layer)
            stride = pool.k_block_stride(index)
            assert view.data_ptr == pool.k_pool_ptr(index)
            if fmt == "plain":
                assert view.shape == (8, 16, 576) and view.dtype == "bfloat16"
                assert view.strides == (stride // 2, 576, 1) and view.kv_dtype == "bf16"
            else:
                assert view.shape == (8, 16, 656) and view.dtype == "uint8"
                assert view.strides == (stride, 656, 1) and view.kv_dtype == "fp8_ds_mla"
            assert list(cache.views(layer)) == ["latent"]
            with pytest.raises(kvport.InvalidArgument, match="not an attention layer"):
                cache.k_pool(layer)
        with pytest.raises(kvport.InvalidArgument):
            pool.v_pool_ptr(0)
        with kvport.HybridBlockTable(cache) as t:
            t.append_tokens(tokens(40))
            block = t.blocks(0)[2]
            lat = cache.latent_pool(1).as_words().numpy()
            lat[block] = 7
            kb, vb = pool.read_block(1, block)
            assert len(vb) == 0 and np.all(kb.view(lat.dtype) == 7)
        with kvport.HybridBlockTable(cache) as again:
            assert again.reuse_cached_prefix(tokens(40)) == 32


# ---- a Mamba hybrid: state checkpoints ----------------------------------------------

def test_state_views_match_the_slots():
    layers = mamba_layers()
    with kvport.HybridKvCache(layers, [6, 16], block_size=16) as cache:
        assert cache.groups[0].layers == [0, 1, 3] and cache.locate(4) is None
        spec = layers[0]
        for layer in (0, 1, 3):
            group, index = cache.locate(layer)
            pool = cache.group_pool(group)
            assert pool.config.block_size == 1 and pool.config.head_dim_k == spec.state_bytes()
            views = cache.views(layer)
            assert list(views) == ["conv", "ssm"]
            for i, t in enumerate(spec.state_tensors):
                v = views[t.name]
                itemsize = 4 if t.dtype == "f32" else 2
                assert v.shape == (6, *t.shape)
                assert v.data_ptr == pool.k_pool_ptr(index) + spec.state_offset(i)
                assert v.strides[0] * itemsize == pool.k_block_stride(index)
                assert v.strides[-1] == 1
                assert v.dtype == ("float32" if t.dtype == "f32" else "bfloat16")
                arr = v.numpy()
                assert arr.ctypes.data == v.data_ptr and arr.shape == v.shape
            assert cache.state_pool(layer, 1).data_ptr == views["ssm"].data_ptr
        assert cache.views(4) == {}
        with pytest.raises(kvport.InvalidArgument, match="no state tensor 'x'"):
            cache.state_pool(0, "x")
        with pytest.raises(kvport.InvalidArgument, match="out of range"):
            cache.state_pool(0, 2)


def test_state_checkpoint_hits_with_the_same_bytes(rng):
    layers = mamba_layers()
    prompt = tokens(17)
    state_layers = (0, 1, 3)
    with kvport.HybridKvCache(layers, [8, 16], block_size=16, state_checkpoint_interval=1) as cache:
        a = kvport.HybridBlockTable(cache)
        assert a.state_slot(0) is None and a.blocks(0) == []
        a.append_tokens(prompt[:16])
        slot = a.state_slot(0)
        written = {}
        for layer in state_layers:
            ssm = cache.state_pool(layer, "ssm").numpy()
            conv = cache.state_pool(layer, "conv").numpy()  # bf16 as uint16 words
            assert not ssm[slot].any() and not conv[slot].any()  # zeroed
            ssm[slot] = rng.standard_normal(ssm.shape[1:], dtype=np.float32)
            conv[slot] = rng.integers(0, 1 << 16, conv.shape[1:], dtype=np.uint16)
            written[layer] = (ssm[slot].copy(), conv[slot].copy())
        a.append_tokens(tokens(16, 1000))  # a block: the state at 16 tokens is checkpointed
        assert cache.hit_counters.state_checkpoints == 1

        b = kvport.HybridBlockTable(cache)
        assert b.reuse_cached_prefix(prompt) == 16
        b_slot = b.state_slot(0)
        assert b_slot is not None and b_slot != slot
        assert b.blocks(1) == a.blocks(1)[:1]  # the full group shares block 0
        for layer in state_layers:
            ssm_w, conv_w = written[layer]
            assert np.array_equal(cache.state_pool(layer, "ssm").numpy()[b_slot], ssm_w)
            assert np.array_equal(cache.state_pool(layer, "conv").numpy()[b_slot], conv_w)
            # The same bytes through the pool's read_block.
            group, index = cache.locate(layer)
            kb, _ = cache.group_pool(group).read_block(index, b_slot)
            off = layers[layer].state_offset(1)
            assert kb[off:off + ssm_w.nbytes].tobytes() == ssm_w.tobytes()

        c = b.fork()  # the state is per sequence: a copy in a new slot
        assert c.state_slot(0) not in (slot, b_slot)
        assert np.array_equal(cache.state_pool(0, "ssm").numpy()[c.state_slot(0)], written[0][0])
        for t in (a, b, c):
            t.close()
        check_ok(cache)
        assert cache.blocks_in_use(0) == 0


def test_state_slots_run_out():
    with kvport.HybridKvCache(mamba_layers(), [1, 16], block_size=16,
                              state_checkpoint_interval=0) as cache:
        a = kvport.HybridBlockTable(cache)
        a.append_tokens(tokens(5))
        with pytest.raises(kvport.CacheExhausted):
            a.fork()
        other = kvport.HybridBlockTable(cache)
        assert not other.can_append(1)
        with pytest.raises(kvport.CacheExhausted):
            other.append_tokens([1])
        check_ok(cache)


# ---- lifetimes and borrowed pools ---------------------------------------------------

def test_views_and_pools_keep_the_cache_alive():
    cache = kvport.HybridKvCache(mamba_layers(), [4, 8], block_size=16)
    view = cache.state_pool(3, "ssm")
    pool = cache.group_pool(1)
    table = kvport.HybridBlockTable(cache)
    cache.close()
    assert cache.closed and "closed" in repr(cache)
    with pytest.raises(kvport.InvalidArgument, match="closed"):
        cache.num_groups
    del cache
    gc.collect()
    table.append_tokens(tokens(20))  # the table still holds the cache
    arr = view.numpy()
    arr[:] = 1.5
    assert arr.shape == (4, 2, 8, 16)
    assert pool.num_blocks == 8 and pool.check_invariants().ok
    assert "borrowed" in repr(pool)


def test_group_pools_refuse_allocation():
    with kvport.HybridKvCache(gpt_oss_layers(), [4, 4], block_size=16) as cache:
        pool = cache.group_pool(0)
        for call in (pool.alloc_block, pool.try_alloc_block, lambda: pool.inc_ref(0),
                     lambda: pool.dec_ref(0), lambda: pool.free_block(0),
                     lambda: pool.free_blocks([0])):
            with pytest.raises(kvport.InvalidArgument, match="borrowed"):
                call()
        with pytest.raises(kvport.InvalidArgument, match="borrowed"):
            kvport.PrefixCache(pool)
        with pytest.raises(kvport.InvalidArgument, match="borrowed"):
            kvport.BlockTable(pool)
        with pytest.raises(kvport.InvalidArgument):
            cache.group_pool(2)
        with pytest.raises(kvport.InvalidArgument):
            cache.locate(4)
        # What the pool does allow: zeroing, reads, checks.
        pool.zero_blocks([0, 1])
        assert pool.read_block(0, 1)[0].sum() == 0
        assert "groups=[2 x sliding_window(128) 2x16 bf16: 4 blocks" in repr(cache)
