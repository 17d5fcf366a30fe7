#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""ctest driver for the PyTorch peer (benchmarks/peer) on a CPU-only torch.

Runs one check with the first of --python's interpreters that can import
torch (Debian's python3-torch is /usr/bin/python3's; another python3 may
come first on PATH), and exits 77, which ctest reports as skipped, with the
reason, when none can:

  verify   test_torch_zeroing.py's VerifyTest and TritonHarnessTest: a
           strategy that zeroes the wrong bytes, or raises, makes
           torch_zeroing.py fail
  small    torch_zeroing.py --device cpu --small: every case measured and
           verified, with the shapes' byte counts and launch counts
  kvport   `kvport bench --backend host --json` on small batches, then
           torch_zeroing.py --kvport-json on the same block ids, then
           compare.py over the two: every case joins
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from typing import List, Optional

SKIP = 77
HERE = os.path.dirname(os.path.abspath(__file__))
PEER = os.path.join(HERE, "..", "..", "benchmarks", "peer")


class CheckFailed(Exception):
    """The check ran and found something wrong (exit 1)."""


def torch_python(candidates: List[str]) -> Optional[str]:
    """The first interpreter that imports torch, or None."""
    seen = set()
    for python in candidates:
        if not python or python in seen or not os.path.exists(python):
            continue
        seen.add(python)
        probe = subprocess.run([python, "-c", "import torch"], capture_output=True, timeout=300)
        if probe.returncode == 0:
            return python
    return None


def run(cmd: List[str], **kwargs) -> subprocess.CompletedProcess:
    """Runs a command, echoing it and its output; fails on a nonzero exit."""
    print("$ " + " ".join(cmd), flush=True)
    result = subprocess.run(cmd, capture_output=True, text=True, **kwargs)
    sys.stdout.write(result.stdout)
    sys.stdout.write(result.stderr)
    if result.returncode != 0:
        raise CheckFailed(
            f"{os.path.basename(cmd[1] if len(cmd) > 1 else cmd[0])} exited {result.returncode}"
        )
    return result


def load(path: str):
    """A JSON file written by a step."""
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def expect(condition: bool, message: str) -> None:
    """Fails the check with `message` unless `condition`."""
    if not condition:
        raise CheckFailed(message)


def check_verify(python: str, _args) -> None:
    """The sabotaged-strategy tests, under the interpreter with torch."""
    run(
        [
            python,
            "-m",
            "unittest",
            "-v",
            "test_torch_zeroing.VerifyTest",
            "test_torch_zeroing.TritonHarnessTest",
        ],
        cwd=HERE,
    )


def check_small(python: str, args) -> None:
    """torch_zeroing.py --small on the cpu, and its report."""
    out = os.path.join(args.work_dir, "torch_small.json")
    run(
        [
            python,
            os.path.join(PEER, "torch_zeroing.py"),
            "--device",
            "cpu",
            "--small",
            "--repetitions",
            "2",
            "--out",
            out,
        ]
    )
    report = load(out)
    cases = report["cases"]
    # 3 models x 2 layouts x batches 1, 4, 16 x 2 id patterns.
    expect(len(cases) == 36, f"{len(cases)} cases, expected 36")
    expect(report["device_type"] == "cpu" and report["small"] is True, "not a --small cpu report")
    expect(
        report["triton"] is None or report["triton_reason"], "triton on a cpu run without a reason"
    )
    # Small shapes: 16 tokens x 2 heads x head dim 16 per K or V region.
    layers = {"llama-3-8b": 4, "llama-3-70b": 10, "llama-3-8b-mixed": 4}
    for c in cases:
        region = 16 * 2 * 16
        per_block = sum(
            2
            * region
            * (1 if c["model"].endswith("mixed") and 0 < l < layers[c["model"]] - 1 else 2)
            for l in range(layers[c["model"]])
        )
        name = f"{c['model']} {c['layout']} {c['ids']} batch {c['batch']}"
        expect(
            c["bytes"] == c["batch"] * per_block,
            f"{name}: {c['bytes']} bytes, expected {c['batch'] * per_block}",
        )
        expect(
            c["torch_per_layer"]["launches"] == 2 * layers[c["model"]],
            f"{name}: per-layer launches",
        )
        expect(c["limit"]["launches"] == 1, f"{name}: limit launches")
        expect(c["triton"] is None, f"{name}: a triton result on the cpu")
        for strategy in ("torch_per_layer", "limit"):
            expect(c[strategy]["verified"] is True, f"{name}: {strategy} not verified")
            expect(c[strategy]["bytes_per_s"] > 0, f"{name}: {strategy} has no throughput")
        expect(
            sorted(c["block_ids"])
            == (
                list(range(c["batch"]))
                if c["ids"] == "contiguous"
                else list(range(0, 2 * c["batch"], 2))
            ),
            f"{name}: block ids",
        )


def check_kvport(python: str, args) -> None:
    """kvport bench and the peer on the same blocks, joined by compare.py."""
    kvport_json = os.path.join(args.work_dir, "kvport_host.json")
    torch_json = os.path.join(args.work_dir, "torch_cpu.json")
    bench = run(
        [
            args.kvport,
            "bench",
            "--backend",
            "host",
            "--json",
            "--model",
            "llama-3-8b",
            "--batches",
            "1,4",
            "--repetitions",
            "1",
        ]
    )
    with open(kvport_json, "w", encoding="utf-8") as f:
        f.write(bench.stdout)
    run(
        [
            python,
            os.path.join(PEER, "torch_zeroing.py"),
            "--device",
            "cpu",
            "--kvport-json",
            kvport_json,
            "--repetitions",
            "2",
            "--out",
            torch_json,
        ]
    )
    kv, th = load(kvport_json), load(torch_json)["cases"]
    expect(
        len(kv) == 8 and len(th) == 8,
        f"{len(kv)} kvport and {len(th)} torch cases, expected 8 each",
    )
    for k, t in zip(kv, th):
        expect(
            t["block_ids"] == k["block_ids"],
            f"{k['layout']} {k['ids']} batch {k['batch']}: other block ids",
        )
        expect(t["num_blocks"] == k["num_blocks"] == 8, "the cache is not 2 x the largest batch")
    for extra in ([], ["--markdown"]):
        result = run(
            [
                sys.executable,
                os.path.join(PEER, "compare.py"),
                "--kvport",
                kvport_json,
                "--torch",
                torch_json,
                *extra,
            ]
        )
        rows = [line for line in result.stdout.splitlines() if "llama-3-8b" in line]
        expect(len(rows) == 8, f"compare.py {' '.join(extra)}: {len(rows)} rows, expected 8")
        expect(result.stderr == "", f"compare.py {' '.join(extra)}: unexpected stderr")


CHECKS = {"verify": check_verify, "small": check_small, "kvport": check_kvport}


def main() -> int:
    """Entry point."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("check", choices=sorted(CHECKS))
    p.add_argument(
        "--python",
        action="append",
        default=[],
        help="an interpreter to try for torch (repeatable; first that imports torch wins)",
    )
    p.add_argument("--kvport", help="the kvport binary (check kvport)")
    p.add_argument("--work-dir", default=os.getcwd(), help="where the JSON files go")
    args = p.parse_args()
    if args.check == "kvport" and not args.kvport:
        p.error("check kvport needs --kvport")
    python = torch_python(args.python or [sys.executable])
    if python is None:
        print(
            f"SKIP: torch is not importable by {', '.join(args.python or [sys.executable])}; "
            "install it with scripts/deps.sh --peer (Debian's python3-torch)"
        )
        return SKIP
    print(f"peer check {args.check}: torch from {python}", flush=True)
    os.makedirs(args.work_dir, exist_ok=True)
    try:
        CHECKS[args.check](python, args)
    except CheckFailed as e:
        print(f"FAILED: {e}")
        return 1
    print(f"peer check {args.check}: ok")
    return 0


if __name__ == "__main__":
    sys.exit(main())
