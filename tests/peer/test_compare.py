# SPDX-License-Identifier: Apache-2.0
"""compare.py: the join of kvport and torch cases, the table, and the error paths.

Stdlib only (no torch): runs everywhere the test suite runs.
"""

import contextlib
import io
import json
import os
import sys
import tempfile
import unittest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks", "peer"))
import compare  # noqa: E402

MIB = 2**20


def kvport_case(
    model="llama-3-8b",
    layout="layer_major",
    batch=4,
    ids="scattered",
    block_ids=None,
    nbytes=None,
    batched=20e9,
    limit=25e9,
):
    """A case as `kvport bench --json` writes it."""
    return {
        "backend": "host",
        "model": model,
        "layout": layout,
        "batch": batch,
        "ids": ids,
        "bytes": nbytes if nbytes is not None else batch * 2 * MIB,
        "num_blocks": 8,
        "repetitions": 1,
        "reference": {"seconds": 1.0, "bytes_per_s": 10e9, "calls": 256},
        "batched": {"seconds": 1.0, "bytes_per_s": batched, "calls": 1},
        "limit": {"seconds": 1.0, "bytes_per_s": limit, "calls": 1},
        "batched_over_limit": batched / limit,
        "batched_over_reference": batched / 10e9,
        "block_ids": block_ids if block_ids is not None else [6, 0, 4, 2][:batch],
    }


def torch_case(
    model="llama-3-8b",
    layout="layer_major",
    batch=4,
    ids="scattered",
    block_ids=None,
    nbytes=None,
    per_layer=5e9,
    triton=None,
    limit=40e9,
):
    """A case as torch_zeroing.py --out writes it."""

    def strategy(bps, launches):
        return {"seconds": 1.0, "bytes_per_s": bps, "launches": launches, "verified": True}

    return {
        "model": model,
        "layout": layout,
        "batch": batch,
        "ids": ids,
        "bytes": nbytes if nbytes is not None else batch * 2 * MIB,
        "num_blocks": 8,
        "torch_per_layer": strategy(per_layer, 64),
        "triton": strategy(triton, 1) if triton is not None else None,
        "limit": strategy(limit, 1),
        "block_ids": block_ids if block_ids is not None else [0, 2, 4, 6][:batch],
    }


def torch_report(cases, device_type="cpu"):
    """A torch_zeroing.py report around `cases`."""
    return {
        "tool": "torch_zeroing.py",
        "device": device_type,
        "device_type": device_type,
        "torch": "1.13",
        "triton": None,
        "triton_reason": "no triton",
        "cases": cases,
    }


class CompareTest(unittest.TestCase):
    def setUp(self):
        self.dir = tempfile.TemporaryDirectory()
        self.addCleanup(self.dir.cleanup)

    def write(self, name, data):
        path = os.path.join(self.dir.name, name)
        with open(path, "w", encoding="utf-8") as f:
            f.write(data if isinstance(data, str) else json.dumps(data))
        return path

    def run_compare(self, kvport, torch, *extra):
        """(exit status, stdout, stderr) of compare.main on the two inputs."""
        args = [
            "--kvport",
            self.write("k.json", kvport),
            "--torch",
            self.write("t.json", torch),
            *extra,
        ]
        out, err = io.StringIO(), io.StringIO()
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                code = compare.main(args)
            except SystemExit as e:
                code = e.code
        return code, out.getvalue(), err.getvalue()

    def test_joins_on_model_layout_batch_and_ids_with_ratios(self):
        kv = [kvport_case(ids="contiguous", block_ids=[0, 1, 2, 3]), kvport_case(batched=30e9)]
        th = torch_report(
            [torch_case(), torch_case(ids="contiguous", block_ids=[0, 1, 2, 3], per_layer=10e9)]
        )
        code, out, err = self.run_compare(kv, th)
        self.assertEqual(code, 0, err)
        self.assertEqual(err, "")
        rows = [line.split() for line in out.splitlines() if line.startswith("llama-3-8b")]
        self.assertEqual(len(rows), 2)
        contiguous, scattered = rows  # kvport's order
        self.assertEqual(contiguous[2], "contiguous")
        # kvport 20 GB/s over its limit 25: 0.80x; over torch per-layer 10: 2.00x; no triton.
        self.assertEqual(contiguous[-3:], ["0.80x", "2.00x", "-"])
        # The scattered row joins the torch case whose ids are in another order.
        self.assertEqual(scattered[-3:], ["1.20x", "6.00x", "-"])

    def test_triton_over_torch_limit(self):
        code, out, err = self.run_compare([kvport_case()], torch_report([torch_case(triton=30e9)]))
        self.assertEqual(code, 0, err)
        row = next(line.split() for line in out.splitlines() if line.startswith("llama-3-8b"))
        self.assertEqual(row[-1], "0.75x")
        self.assertIn("30.00", row)

    def test_markdown_table(self):
        code, out, _ = self.run_compare([kvport_case()], torch_report([torch_case()]), "--markdown")
        self.assertEqual(code, 0)
        table = [line for line in out.splitlines() if line.startswith("|")]
        self.assertEqual(len(table), 3)  # header, rule, one case
        self.assertTrue(table[1].startswith("|---|"))
        self.assertEqual(table[0].count("|"), table[2].count("|"))

    def test_different_bytes_is_an_error_naming_the_case(self):
        code, _, err = self.run_compare([kvport_case()], torch_report([torch_case(nbytes=4 * MIB)]))
        self.assertEqual(code, compare.EXIT_MISMATCH)
        self.assertIn("llama-3-8b layer_major scattered batch 4", err)
        self.assertIn("8388608 bytes, torch 4194304", err)

    def test_different_block_ids_is_an_error(self):
        code, _, err = self.run_compare(
            [kvport_case()], torch_report([torch_case(block_ids=[0, 2, 4, 8])])
        )
        self.assertEqual(code, compare.EXIT_MISMATCH)
        self.assertIn("different block ids", err)

    def test_no_common_case_is_an_error(self):
        code, _, err = self.run_compare(
            [kvport_case(model="llama-3-70b", nbytes=20 * MIB)], torch_report([torch_case()])
        )
        self.assertEqual(code, compare.EXIT_MISMATCH)
        self.assertIn("only in --kvport: llama-3-70b", err)
        self.assertIn("only in --torch: llama-3-8b", err)
        self.assertIn("no case is in both files", err)

    def test_cases_on_one_side_are_listed_not_fatal(self):
        kv = [kvport_case(), kvport_case(layout="block_major")]
        code, out, err = self.run_compare(kv, torch_report([torch_case()]))
        self.assertEqual(code, 0)
        self.assertIn("only in --kvport: llama-3-8b block_major scattered batch 4", err)
        self.assertEqual(sum(line.startswith("llama-3-8b") for line in out.splitlines()), 1)

    def test_different_devices_warn(self):
        code, _, err = self.run_compare(
            [kvport_case()], torch_report([torch_case()], device_type="cuda")
        )
        self.assertEqual(code, 0)
        self.assertIn("warning: the runs are on different devices", err)

    def test_bad_input_is_one_line_and_exit_2(self):
        bad = [
            ("not json", torch_report([torch_case()])),
            ([kvport_case()], "{"),
            ({"cases": []}, torch_report([torch_case()])),  # kvport's output is a list
            ([kvport_case()], [torch_case()]),  # the torch report is an object
            ([kvport_case(), kvport_case()], torch_report([torch_case()])),  # a case twice
            ([{"model": "llama-3-8b"}], torch_report([torch_case()])),  # fields missing
        ]
        for kvport, torch in bad:
            with self.subTest(kvport=str(kvport)[:40], torch=str(torch)[:40]):
                code, out, err = self.run_compare(kvport, torch)
                self.assertEqual(code, compare.EXIT_BAD_INPUT)
                self.assertEqual(out, "")
                self.assertEqual(len(err.strip().splitlines()), 1, err)

    def test_missing_file_and_missing_flag(self):
        code, _, err = self.run_compare([kvport_case()], torch_report([torch_case()]))
        self.assertEqual(code, 0, err)
        out, err = io.StringIO(), io.StringIO()
        for args in (
            [
                "--kvport",
                os.path.join(self.dir.name, "absent.json"),
                "--torch",
                os.path.join(self.dir.name, "t.json"),
            ],
            ["--kvport", "k.json"],
        ):
            with self.subTest(args=args), contextlib.redirect_stdout(
                out
            ), contextlib.redirect_stderr(err):
                try:
                    code = compare.main(args)
                except SystemExit as e:
                    code = e.code
                self.assertEqual(code, compare.EXIT_BAD_INPUT)


if __name__ == "__main__":
    unittest.main()
