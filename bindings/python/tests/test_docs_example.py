# SPDX-License-Identifier: Apache-2.0
"""The examples of docs/bindings/python.md run as written."""

import pathlib
import re

import pytest

DOC = pathlib.Path(__file__).resolve().parents[3] / "docs" / "bindings" / "python.md"


def run_section(title):
    """Runs the first Python block after the heading `title`."""
    if not DOC.exists():
        pytest.skip(f"{DOC} not found")
    section = DOC.read_text().split(title, 1)[1]
    code = re.search(r"```python\n(.*?)```", section, re.S).group(1)
    exec(compile(code, str(DOC), "exec"), {})


def test_docs_example_runs(capsys):
    run_section("## A complete example")
    out = capsys.readouterr().out
    assert "PagedKvCache(backend='host'" in out and "PagedKvCache is closed" in out


def test_docs_hybrid_example_runs(capsys):
    run_section("## Hybrid models")
    assert "KvCacheGroup(state(" in capsys.readouterr().out


def test_docs_engine_step_runs(capsys):
    run_section("## An engine's step")
    assert "hit 80 tokens; attention exact for 93 and 84 tokens" in capsys.readouterr().out

