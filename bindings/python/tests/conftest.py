# SPDX-License-Identifier: Apache-2.0
"""Shared fixtures of the kvport Python tests.

The tests import the `kvport` package from PYTHONPATH: ctest points it at
the build tree's python/ directory (build/<preset>/python).
"""

import os

import numpy as np
import pytest

import kvport

# The pip check (check_pip_install.py) runs these tests against the package
# installed in a virtual environment: make sure that is the one imported.
_expected = os.environ.get("KVPORT_EXPECT_PACKAGE_DIR")
if _expected:
    assert os.path.dirname(kvport.__file__) == _expected, (kvport.__file__, _expected)


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
