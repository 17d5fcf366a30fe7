# SPDX-License-Identifier: Apache-2.0
"""What a new user runs into: objects made by __new__ alone, ids that are
bools, write_block given a non-buffer, a forked child, no NumPy, the log."""

import array
import os
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest

import kvport
from conftest import make_config


def _classes():
    return [getattr(kvport, n) for n in dir(kvport)
            if isinstance(getattr(kvport, n), type)
            and not issubclass(getattr(kvport, n), BaseException)]


def test_every_class_refuses_new_alone():
    classes = _classes()
    assert len(classes) >= 20  # every bound class, not a few
    for cls in classes:
        with pytest.raises(TypeError, match=r"not initialised: create one by calling kvport\."):
            cls.__new__(cls)
        # pybind11's base __new__ and object.__new__ refuse too.
        with pytest.raises(TypeError):
            object.__new__(cls)
        assert cls.__mro__[-2].__name__ == "pybind11_object"
        with pytest.raises(TypeError):
            cls.__mro__[-2].__new__(cls)


def test_bare_new_used_does_not_crash():
    """The reproducer: a subprocess so a crash (exit 139) fails the test, not pytest."""
    code = textwrap.dedent("""
        import kvport
        for cls in (kvport.BlockTable, kvport.KvCacheConfig, kvport.PagedKvCache):
            try:
                cls.__new__(cls).release() if cls is kvport.BlockTable else cls.__new__(cls)
            except TypeError:
                pass
            else:
                raise SystemExit(2)
        """)
    r = subprocess.run([sys.executable, "-c", code], timeout=60)
    assert r.returncode == 0


def test_constructed_objects_and_subclasses_work():
    class Config(kvport.KvCacheConfig):
        pass

    config = Config(num_layers=2, num_kv_heads=2, head_dim=8)
    assert isinstance(config, kvport.KvCacheConfig) and config.num_layers == 2
    with kvport.PagedKvCache(config, num_blocks=4) as cache:
        assert cache.num_blocks == 4
        table = kvport.BlockTable(cache)
        table.append_tokens([1, 2, 3])
        table.release()
        # Objects the module returns are made without __new__.
        assert isinstance(cache.counters, kvport.KvCacheCounters)
    # A class without a constructor still says so.
    with pytest.raises(TypeError):
        kvport.PrefixMatch()


def test_bools_are_not_ids(cache):
    block = cache.alloc_block()
    scalar = [lambda: cache.inc_ref(True), lambda: cache.dec_ref(False),
              lambda: cache.free_block(True), lambda: cache.ref_count(True),
              lambda: cache.k_cache_ptr(0, True), lambda: cache.k_cache_ptr(True, block),
              lambda: cache.k_pool_ptr(True), lambda: cache.k_pool(True),
              lambda: cache.read_block(0, True), lambda: cache.dtype_for_layer(False)]
    batch = [lambda: cache.free_blocks([True]), lambda: cache.zero_blocks(True),
             lambda: cache.zero_blocks(np.array([True])), lambda: cache.copy_blocks([(True, 2)]),
             lambda: cache.poison_blocks((block, False))]
    for call in scalar + batch:
        with pytest.raises(TypeError, match="must be an int|must hold integers"):
            call()
    assert cache.ref_count(block) == 1 and cache.ref_count(1) == 0  # nothing acted on block 1
    with kvport.PrefixCache(cache) as prefix:
        with pytest.raises(TypeError, match="must be an int"):
            prefix.release(True)
        with pytest.raises(TypeError, match="must be an int"):
            prefix.is_cached(True)
        with pytest.raises(TypeError, match="must be an int"):
            prefix.lookup([1, True, 3])
    # ints and NumPy integers are ids; negative layers are refused by value.
    cache.inc_ref(np.uint32(block))
    assert cache.ref_count(block) == 2
    with pytest.raises(kvport.InvalidArgument, match="negative"):
        cache.k_pool_ptr(-1)


def test_write_block_takes_only_buffers_of_the_block(cache):
    block = cache.alloc_block()
    kb, vb = cache.k_block_bytes(0), cache.v_block_bytes(0)
    for bad in ("x" * (kb // 4), list(range(kb // 8)), [0] * kb, None, 7,
                np.zeros(kb // 8, dtype=object), np.zeros(kb // 8, dtype=np.int64),
                np.zeros(kb, dtype=bool), np.zeros(kb // 4, dtype=np.float32)):
        with pytest.raises(TypeError, match="write_block: k"):
            cache.write_block(0, block, bad, bytes(vb))
    with pytest.raises(kvport.InvalidArgument, match="C-contiguous"):
        cache.write_block(0, block, np.zeros(2 * kb, np.uint8)[::2], bytes(vb))
    with pytest.raises(kvport.InvalidArgument):
        cache.write_block(0, block, bytes(kb - 1), bytes(vb))  # the size is exact
    with pytest.raises(TypeError, match="write_block: v"):
        cache.write_block(0, block, bytes(kb), "v")
    # Every buffer of the exact bytes, and arrays of the layer's element (f16).
    rng = np.random.default_rng(5)
    k = rng.integers(0, 256, kb, dtype=np.uint8)
    for good in (k.tobytes(), bytearray(k.tobytes()), memoryview(k.tobytes()), k,
                 array.array("B", k.tobytes()), k.view(np.float16), k.view(np.int8)):
        cache.write_block(0, block, good, bytes(vb))
        assert np.array_equal(cache.read_block(0, block)[0], k)


def test_forked_child_gets_an_error_not_a_hang(cache):
    block = cache.alloc_block()
    pid = os.fork()
    if pid == 0:  # the child: exit codes say what happened, never returns to pytest
        code = 1
        try:
            cache.zero_blocks([block])
        except kvport.Error as e:
            code = 3 if "before os.fork()" in str(e) else 4
        except BaseException:  # noqa: BLE001
            code = 5
        try:  # a cache made in the child works
            with kvport.PagedKvCache(make_config(), num_blocks=2) as fresh:
                fresh.zero_blocks([fresh.alloc_block()])
        except BaseException:  # noqa: BLE001
            code = 6
        os._exit(code)
    deadline = time.monotonic() + 30
    status = None
    while time.monotonic() < deadline:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            break
        time.sleep(0.02)
    else:
        os.kill(pid, 9)
        os.waitpid(pid, 0)
        pytest.fail("the forked child hung")
    assert os.waitstatus_to_exitcode(status) == 3
    cache.zero_blocks([block])  # the parent's cache is unaffected


def test_forked_child_exits_cleanly_with_live_objects(tmp_path):
    """sys.exit in a child destroys the parent's objects: they must not wait on
    the parent's threads."""
    code = textwrap.dedent("""
        import os, sys, kvport
        c = kvport.PagedKvCache(kvport.KvCacheConfig(num_layers=1, num_kv_heads=1, head_dim=8), 4)
        p = kvport.PrefixCache(c)
        t = kvport.BlockTable(p)
        t.append_tokens(list(range(40)))
        pid = os.fork()
        if pid == 0:
            sys.exit(7)
        _, status = os.waitpid(pid, 0)
        sys.exit(os.waitstatus_to_exitcode(status))
        """)
    r = subprocess.run([sys.executable, "-c", code], timeout=60)
    assert r.returncode == 7


NO_NUMPY = textwrap.dedent("""
    import sys
    sys.modules["numpy"] = None  # import numpy raises ImportError
    import kvport
    config = kvport.KvCacheConfig(num_layers=2, num_kv_heads=2, head_dim=8, block_size=4)
    with kvport.PagedKvCache(config, num_blocks=8) as cache:
        ids = [cache.alloc_block() for _ in range(4)]
        cache.zero_blocks(ids)
        cache.zero_blocks(range(2))
        cache.poison_blocks(tuple(ids))
        cache.copy_blocks([(ids[0], ids[1])])
        cache.write_block(0, ids[0], bytes(cache.k_block_bytes(0)), bytearray(cache.v_block_bytes(0)))
        with kvport.PrefixCache(cache) as prefix:
            table = kvport.BlockTable(prefix)
            table.append_tokens(list(range(9)))
            assert len(table.blocks) == 3
            table.release()
        cache.free_blocks(ids)
        try:
            cache.read_block(0, ids[0])
        except ModuleNotFoundError as e:
            assert "needs NumPy" in str(e), e
        else:
            raise SystemExit("read_block without NumPy")
        try:
            cache.k_pool(0).numpy()
        except ModuleNotFoundError as e:
            assert "needs NumPy" in str(e), e
        else:
            raise SystemExit("numpy() without NumPy")
    layers = [kvport.LayerSpec.sliding_window(16, 2, 16), kvport.LayerSpec.full_attention(2, 16)]
    with kvport.HybridKvCache(layers, [16, 16], block_size=4) as hybrid:
        with kvport.HybridBlockTable(hybrid) as t:
            t.append_tokens(list(range(30)))
            assert len(t.blocks(1)) == 8 and t.num_live_blocks(1) == 8
            try:
                t.block_ids(1)
            except ModuleNotFoundError as e:
                assert "needs NumPy" in str(e), e
            else:
                raise SystemExit("block_ids without NumPy")
    assert "numpy" not in sys.modules or sys.modules["numpy"] is None
    print("ok")
    """)


def test_without_numpy_plain_sequences_work():
    r = subprocess.run([sys.executable, "-c", NO_NUMPY], capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stderr


def test_quiet_unless_asked(capfd):
    assert kvport.log_level() == "warn"  # ctest runs without KVPORT_LOG_LEVEL
    with kvport.PagedKvCache(make_config(), num_blocks=4):
        pass
    assert capfd.readouterr().err == ""
    kvport.set_log_level("info")
    try:
        assert kvport.log_level() == "info"
        with kvport.PagedKvCache(make_config(), num_blocks=4):
            pass
        assert "KV cache on host" in capfd.readouterr().err
    finally:
        kvport.set_log_level("warn")
    with pytest.raises(kvport.InvalidArgument, match="loud"):
        kvport.set_log_level("loud")
    with kvport.PagedKvCache(make_config(), num_blocks=4):
        pass
    assert capfd.readouterr().err == ""


def test_log_level_from_the_environment():
    code = "import kvport; kvport.PagedKvCache(kvport.KvCacheConfig(num_layers=1, " \
           "num_kv_heads=1, head_dim=8), 2); print(kvport.log_level())"
    env = dict(os.environ, KVPORT_LOG_LEVEL="info")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                       timeout=60)
    assert r.returncode == 0 and r.stdout.strip() == "info"
    assert "KV cache on host" in r.stderr


def test_version_is_the_projects():
    top = os.path.join(os.path.dirname(__file__), "..", "..", "..", "CMakeLists.txt")
    import re
    with open(top) as f:
        version = re.search(r"project\(kvport VERSION ([0-9.]+)", f.read()).group(1)
    assert kvport.__version__ == version
