#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""kvport's block zeroing next to the PyTorch peer's, case by case.

Joins the cases of a `kvport bench --json` output and a
`torch_zeroing.py --out` report on (model, layout, batch, ids pattern) and
prints, per case, the throughput of kvport's batched zeroing, of PyTorch's
per-layer index_fill_, of the one-kernel Triton zeroer, and of the two
runs' limits (one contiguous memset / zero_() of the same bytes), with the
ratios:

  kv/lim   kvport batched over kvport's limit (same run)
  kv/torch kvport batched over torch per-layer
  tri/lim  Triton over torch's limit (same run)

Each ratio is taken against the limit of its own run, so that two runs on
different devices still give comparable ratios.

Joined cases must describe the same work: the same bytes and, when both
sides list them, the same set of block ids; otherwise the case is named and
the exit status is 1 (as it is when no case joins at all). Cases found on
one side only are listed on stderr. Bad input (unreadable or malformed
files, bad flags): one line and exit 2.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Dict, List, Optional, Sequence, Tuple

EXIT_OK = 0
EXIT_MISMATCH = 1
EXIT_BAD_INPUT = 2

PROG = "compare.py"
Key = Tuple[str, str, int, str]


class BadInput(Exception):
    """A file or flag the comparison cannot use (exit 2)."""


def load_json(path: str, flag: str):
    """The parsed contents of `path`, or BadInput naming the flag."""
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except OSError as e:
        raise BadInput(f"{flag}: cannot read {path}: {e.strerror}") from e
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise BadInput(f"{flag}: {path} is not JSON: {e}") from e


def case_key(case: dict, where: str) -> Key:
    """(model, layout, batch, ids pattern) of a case of either file."""
    try:
        key = (case["model"], case["layout"], case["batch"], case["ids"])
    except (KeyError, TypeError) as e:
        raise BadInput(f"{where}: a case without {e}") from e
    if not all(isinstance(v, str) for v in (key[0], key[1], key[3])) or not isinstance(key[2], int):
        raise BadInput(f"{where}: a case with a malformed model, layout, batch or ids field")
    return key


def throughput(case: dict, strategy: str, where: str, optional: bool = False) -> Optional[float]:
    """bytes_per_s of one strategy of a case; None for an optional null one."""
    value = case.get(strategy)
    if value is None and optional:
        return None
    if not isinstance(value, dict) or not isinstance(value.get("bytes_per_s"), (int, float)):
        raise BadInput(
            f"{where}: case {describe(case_key(case, where))} has no {strategy}.bytes_per_s"
        )
    return float(value["bytes_per_s"])


def index_cases(cases, where: str) -> Dict[Key, dict]:
    """Cases by key; a key seen twice is bad input."""
    if not isinstance(cases, list):
        raise BadInput(f"{where}: expected a list of cases")
    out: Dict[Key, dict] = {}
    for case in cases:
        if not isinstance(case, dict):
            raise BadInput(f"{where}: a case is not an object")
        key = case_key(case, where)
        if key in out:
            raise BadInput(f"{where}: case {describe(key)} appears twice")
        out[key] = case
    return out


def describe(key: Key) -> str:
    """A case key as text: 'llama-3-8b layer_major scattered batch 16'."""
    model, layout, batch, ids = key
    return f"{model} {layout} {ids} batch {batch}"


def join(kvport_cases: list, torch_report: dict) -> Tuple[List[dict], List[str], List[str]]:
    """(rows, mismatches, unmatched): one row per joined case, in kvport's order.

    A mismatch is a joined case whose bytes (or block id sets) differ;
    unmatched lists cases present on one side only.
    """
    if not isinstance(torch_report, dict) or "cases" not in torch_report:
        raise BadInput("--torch: expected a torch_zeroing.py report (an object with 'cases')")
    kv = index_cases(kvport_cases, "--kvport")
    th = index_cases(torch_report["cases"], "--torch")
    rows, mismatches, unmatched = [], [], []
    for key, k in kv.items():
        t = th.get(key)
        if t is None:
            unmatched.append(f"only in --kvport: {describe(key)}")
            continue
        if k.get("bytes") != t.get("bytes"):
            mismatches.append(
                f"{describe(key)}: kvport zeroed {k.get('bytes')} bytes, torch {t.get('bytes')}"
            )
            continue
        if (
            "block_ids" in k
            and "block_ids" in t
            and sorted(k["block_ids"]) != sorted(t["block_ids"])
        ):
            mismatches.append(f"{describe(key)}: the two runs zeroed different block ids")
            continue
        rows.append(
            {
                "key": key,
                "bytes": k["bytes"],
                "kvport_batched": throughput(k, "batched", "--kvport"),
                "kvport_limit": throughput(k, "limit", "--kvport"),
                "torch_per_layer": throughput(t, "torch_per_layer", "--torch"),
                "triton": throughput(t, "triton", "--torch", optional=True),
                "torch_limit": throughput(t, "limit", "--torch"),
            }
        )
    unmatched += [f"only in --torch: {describe(key)}" for key in th if key not in kv]
    return rows, mismatches, unmatched


def ratio(a: Optional[float], b: Optional[float]) -> str:
    """a / b as '1.23x', or '-' when either is missing or b is 0."""
    if a is None or not b:
        return "-"
    return f"{a / b:.2f}x"


def gbps(value: Optional[float]) -> str:
    """bytes/s as GB/s text (1e9 bytes), '-' when missing."""
    return "-" if value is None else f"{value / 1e9:.2f}"


def format_bytes(n: int) -> str:
    """A byte count in MiB or KiB."""
    return f"{n / 2**20:.2f} MiB" if n >= 2**20 else f"{n / 2**10:.2f} KiB"


HEADER = [
    "Model",
    "Layout",
    "Ids",
    "Batch",
    "Bytes",
    "kvport GB/s",
    "torch GB/s",
    "triton GB/s",
    "kv lim GB/s",
    "torch lim GB/s",
    "kv/lim",
    "kv/torch",
    "tri/lim",
]


def table_rows(rows: List[dict]) -> List[List[str]]:
    """The printed cells of every joined case."""
    out = []
    for r in rows:
        model, layout, batch, ids = r["key"]
        out.append(
            [
                model,
                layout,
                ids,
                str(batch),
                format_bytes(r["bytes"]),
                gbps(r["kvport_batched"]),
                gbps(r["torch_per_layer"]),
                gbps(r["triton"]),
                gbps(r["kvport_limit"]),
                gbps(r["torch_limit"]),
                ratio(r["kvport_batched"], r["kvport_limit"]),
                ratio(r["kvport_batched"], r["torch_per_layer"]),
                ratio(r["triton"], r["torch_limit"]),
            ]
        )
    return out


def render(rows: List[dict], markdown: bool) -> str:
    """The table as aligned text or as a Markdown table."""
    cells = table_rows(rows)
    if markdown:
        lines = [
            "| " + " | ".join(HEADER) + " |",
            "|" + "|".join("---" if i < 3 else "---:" for i in range(len(HEADER))) + "|",
        ]
        lines += ["| " + " | ".join(row) + " |" for row in cells]
        return "\n".join(lines) + "\n"
    widths = [max(len(h), *(len(row[i]) for row in cells)) for i, h in enumerate(HEADER)]

    def line(row: Sequence[str]) -> str:
        return "  ".join(
            c.ljust(w) if i < 3 else c.rjust(w) for i, (c, w) in enumerate(zip(row, widths))
        )

    lines = [line(HEADER), line(["-" * w for w in widths])] + [line(row) for row in cells]
    return "\n".join(lines) + "\n"


def describe_runs(kvport_cases: list, torch_report: dict) -> str:
    """One line naming the two runs' devices and versions."""
    backends = sorted({c.get("backend", "?") for c in kvport_cases if isinstance(c, dict)})
    triton = (
        torch_report.get("triton")
        or f"none ({torch_report.get('triton_reason') or 'not reported'})"
    )
    return (
        f"kvport backend {', '.join(backends)}; torch {torch_report.get('torch', '?')} on "
        f"{torch_report.get('device', '?')}; triton {triton}"
    )


def device_warning(kvport_cases: list, torch_report: dict) -> Optional[str]:
    """A warning when the runs are not on the same kind of device."""
    gpu = {"cuda", "hip"}
    backends = {c.get("backend") for c in kvport_cases if isinstance(c, dict)}
    torch_gpu = torch_report.get("device_type") == "cuda"
    if any((b in gpu) != torch_gpu for b in backends):
        return (
            f"the runs are on different devices (kvport {', '.join(sorted(map(str, backends)))}, "
            f"torch {torch_report.get('device_type')}): compare the ratios to each run's limit"
        )
    return None


class OneLineParser(argparse.ArgumentParser):
    """argparse, with a bad flag reported on one line (exit 2)."""

    def error(self, message: str):
        print(f"{PROG}: error: {message}", file=sys.stderr)
        sys.exit(EXIT_BAD_INPUT)


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Entry point: load, join, print; returns the exit status."""
    p = OneLineParser(
        prog=PROG,
        description=__doc__.split("\n\n")[0],
        epilog="Exit status: 0, 1 cases that do not match (or none joined), 2 bad input.",
    )
    p.add_argument("--kvport", required=True, metavar="K.json", help="`kvport bench --json` output")
    p.add_argument(
        "--torch", required=True, metavar="T.json", help="`torch_zeroing.py --out` report"
    )
    p.add_argument("--markdown", action="store_true", help="print a Markdown table")
    args = p.parse_args(argv)
    try:
        kvport_cases = load_json(args.kvport, "--kvport")
        torch_report = load_json(args.torch, "--torch")
        rows, mismatches, unmatched = join(kvport_cases, torch_report)
    except BadInput as e:
        print(f"{PROG}: error: {e}", file=sys.stderr)
        return EXIT_BAD_INPUT

    for note in unmatched:
        print(f"{PROG}: {note}", file=sys.stderr)
    for mismatch in mismatches:
        print(f"{PROG}: mismatch: {mismatch}", file=sys.stderr)
    if mismatches:
        print(
            f"{PROG}: {len(mismatches)} case(s) do not match: the runs did not zero the same blocks",
            file=sys.stderr,
        )
        return EXIT_MISMATCH
    if not rows:
        print(f"{PROG}: no case is in both files", file=sys.stderr)
        return EXIT_MISMATCH

    warning = device_warning(kvport_cases, torch_report)
    if warning:
        print(f"{PROG}: warning: {warning}", file=sys.stderr)
    print(describe_runs(kvport_cases, torch_report))
    print()
    sys.stdout.write(render(rows, args.markdown))
    print()
    print(
        "kv/lim: kvport batched over kvport's limit; kv/torch: kvport batched over torch per-layer; "
        "tri/lim: Triton over torch's limit; GB = 1e9 bytes"
    )
    return EXIT_OK


if __name__ == "__main__":
    sys.exit(main())
