"""Shared fixtures of the kvport Python tests.

The tests import the `kvport` package from PYTHONPATH: ctest points it at
the build tree's python/ directory (build/<preset>/python).
"""

import numpy as np
import pytest

import kvport


def make_config(dtype="f16", layout="layer_major", **kw):
    args = dict(num_layers=2, num_kv_heads=2, head_dim=8, block_size=4, dtype=dtype, layout=layout)
    args.update(kw)
    return kvport.KvCacheConfig(**args)


@pytest.fixture
def cache():
    with kvport.PagedKvCache(make_config(), num_blocks=8) as c:
        yield c


@pytest.fixture(params=["layer_major", "block_major"])
def layout(request):
    return request.param


@pytest.fixture
def rng():
    return np.random.default_rng(1234)
