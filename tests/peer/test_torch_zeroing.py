# SPDX-License-Identifier: Apache-2.0
"""torch_zeroing.py: input checks (no torch needed) and verification that fails
when a strategy zeroes the wrong bytes (needs torch; skipped without it).
"""

import contextlib
import io
import json
import os
import sys
import tempfile
import unittest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks", "peer"))
import torch_zeroing as tz  # noqa: E402

try:
    import torch  # noqa: F401

    HAVE_TORCH = True
except ImportError:
    HAVE_TORCH = False


def run_main(args):
    """(exit status, stdout, stderr) of torch_zeroing.main."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = tz.main(args)
        except SystemExit as e:
            code = e.code
    return code, out.getvalue(), err.getvalue()


def kvport_case(**fields):
    """A `kvport bench --json` case of llama-3-8b, 2 scattered blocks."""
    case = {
        "backend": "host",
        "model": "llama-3-8b",
        "layout": "layer_major",
        "batch": 2,
        "ids": "scattered",
        "bytes": 2 * 2 * 2**20,
        "num_blocks": 4,
        "block_ids": [2, 0],
    }
    case.update(fields)
    return case


class ShapeTest(unittest.TestCase):
    def test_block_bytes_match_kvport(self):
        # kvport: layers x 2 (K + V) x 16 tokens x 8 heads x 128 x dtype bytes.
        shapes = tz.make_shapes(small=False)
        self.assertEqual(shapes["llama-3-8b"].bytes_per_block(), 32 * 2 * 16 * 8 * 128 * 2)
        self.assertEqual(shapes["llama-3-70b"].bytes_per_block(), 80 * 2 * 16 * 8 * 128 * 2)
        # bf16 first and last layers, fp8 (1 byte) in the 30 others.
        self.assertEqual(
            shapes["llama-3-8b-mixed"].bytes_per_block(), (2 * 2 + 30) * 2 * 16 * 8 * 128
        )

    def test_scattered_ids_are_every_other_block(self):
        ids = tz.scattered_ids(16)
        self.assertEqual(sorted(ids), list(range(0, 32, 2)))
        self.assertNotEqual(ids, sorted(ids))
        self.assertEqual(ids, tz.scattered_ids(16))  # deterministic


class InputTest(unittest.TestCase):
    def setUp(self):
        self.dir = tempfile.TemporaryDirectory()
        self.addCleanup(self.dir.cleanup)

    def write(self, data):
        path = os.path.join(self.dir.name, "k.json")
        with open(path, "w", encoding="utf-8") as f:
            f.write(data if isinstance(data, str) else json.dumps(data))
        return path

    def assert_bad_input(self, args, needle):
        code, out, err = run_main(args)
        self.assertEqual(code, tz.EXIT_BAD_INPUT, err)
        self.assertEqual(out, "")
        self.assertEqual(len(err.strip().splitlines()), 1, err)
        self.assertIn(needle, err)

    def test_bad_flags(self):
        for args, needle in [
            (["--batches", "0"], "--batches"),
            (["--batches", "1,x"], "--batches"),
            (["--models", "gpt-2"], "unknown value 'gpt-2'"),
            (["--layouts", "row_major"], "--layouts"),
            (["--repetitions", "0"], "--repetitions"),
            (["--device", "tpu"], "--device"),
            (["--bogus"], "--bogus"),
            (["--kvport-json", "k.json", "--small"], "drop --small"),
        ]:
            with self.subTest(args=args):
                self.assert_bad_input(args, needle)

    def test_layout_spelling_and_defaults(self):
        args = tz.parse_args(["--layouts", "Block-Major", "--small"])
        self.assertEqual(args.layouts, ["block_major"])
        self.assertEqual(args.models, list(tz.MODELS))
        self.assertEqual(args.batches, list(tz.SMALL_BATCHES))

    def test_kvport_json_cases_keep_kvport_ids(self):
        path = self.write([kvport_case(), kvport_case(ids="contiguous", block_ids=[0, 1])])
        cases = tz.cases_from_kvport(path, tz.make_shapes(small=False))
        self.assertEqual([c.block_ids for c in cases], [[2, 0], [0, 1]])
        self.assertEqual({c.num_blocks for c in cases}, {4})

    def test_bad_kvport_json(self):
        for data, needle in [
            ("[", "not JSON"),
            ([], "non-empty list"),
            ([kvport_case(model="gpt-2")], "unknown model"),
            ([{k: v for k, v in kvport_case().items() if k != "block_ids"}], "no 'block_ids'"),
            ([kvport_case(block_ids=[0])], "1 block ids for a batch of 2"),
            ([kvport_case(block_ids=[0, 4])], "in [0, 4)"),
            ([kvport_case(block_ids=[2, 2])], "duplicate"),
            ([kvport_case(bytes=12345)], "kvport zeroed 12345 bytes"),
            ([kvport_case(batch="2")], "'batch' is not an integer"),
        ]:
            with self.subTest(needle=needle):
                self.assert_bad_input(
                    ["--kvport-json", self.write(data), "--device", "cpu"], needle
                )
        self.assert_bad_input(
            ["--kvport-json", os.path.join(self.dir.name, "absent.json")], "cannot read"
        )


@unittest.skipUnless(HAVE_TORCH, "torch is not importable")
class VerifyTest(unittest.TestCase):
    """A strategy that zeroes the wrong bytes makes the run exit 1."""

    ARGS = [
        "--device",
        "cpu",
        "--small",
        "--models",
        "llama-3-8b-mixed",
        "--batches",
        "2,3",
        "--repetitions",
        "1",
        "--warmup",
        "1",
    ]

    def run_with(self, name, replacement, layout):
        original = getattr(tz, name)
        setattr(tz, name, replacement)
        try:
            return run_main(self.ARGS + ["--layouts", layout])
        finally:
            setattr(tz, name, original)

    def test_correct_strategies_pass(self):
        for layout in tz.LAYOUTS:
            with self.subTest(layout=layout):
                code, out, err = run_main(self.ARGS + ["--layouts", layout])
                self.assertEqual(code, 0, err)
                self.assertIn("Verify   ok", out)

    def test_a_missed_pool_fails(self):
        def skip_last_v(pools, ids):
            for k, v in pools.views[:-1]:
                k.index_fill_(0, ids, 0)
                v.index_fill_(0, ids, 0)
            pools.views[-1][0].index_fill_(0, ids, 0)
            return 2 * len(pools.views)

        for layout in tz.LAYOUTS:
            with self.subTest(layout=layout):
                code, _, err = self.run_with("zero_per_layer", skip_last_v, layout)
                self.assertEqual(code, tz.EXIT_VERIFY_FAILED)
                self.assertIn("torch_per_layer: layer 3 V: a zeroed block holds nonzero bytes", err)

    def test_a_neighbour_zeroed_too_fails(self):
        original = tz.zero_per_layer

        def one_too_many(pools, ids):
            return original(pools, torch.cat([ids, ids + 1]))

        for layout in tz.LAYOUTS:
            with self.subTest(layout=layout):
                code, _, err = self.run_with("zero_per_layer", one_too_many, layout)
                self.assertEqual(code, tz.EXIT_VERIFY_FAILED)
                self.assertIn("a block outside the batch lost its fill", err)

    def test_a_copy_zeroed_fails(self):
        # The classic mistake: advanced indexing gathers a copy.
        def zero_a_copy(pools, ids):
            for k, v in pools.views:
                k[ids].zero_()
                v[ids].zero_()
            return 2 * len(pools.views)

        code, _, err = self.run_with("zero_per_layer", zero_a_copy, "layer_major")
        self.assertEqual(code, tz.EXIT_VERIFY_FAILED)
        self.assertIn("a zeroed block holds nonzero bytes", err)

    def test_limit_off_by_one_fails(self):
        def one_byte_more(pools, nbytes):
            pools.limit[: nbytes + 1].zero_()
            return 1

        def one_byte_less(pools, nbytes):
            pools.limit[: nbytes - 1].zero_()
            return 1

        for fn, needle in [
            (one_byte_more, "lost their fill"),
            (one_byte_less, "nonzero bytes in the first"),
        ]:
            with self.subTest(fn=fn.__name__):
                code, _, err = self.run_with("zero_limit", fn, "block_major")
                self.assertEqual(code, tz.EXIT_VERIFY_FAILED)
                self.assertIn(needle, err)


@unittest.skipUnless(HAVE_TORCH, "torch is not importable")
class TritonHarnessTest(unittest.TestCase):
    """The Triton strategy's place in the run, with a stand-in for the kernel
    (no triton on a CPU-only torch): its result is verified like the others,
    and a kernel that raises fails the run but keeps the other figures."""

    def setUp(self):
        self.dir = tempfile.TemporaryDirectory()
        self.addCleanup(self.dir.cleanup)
        self.out = os.path.join(self.dir.name, "t.json")
        originals = (tz.triton_status, tz.TritonZeroer)
        self.addCleanup(
            lambda: (
                setattr(tz, "triton_status", originals[0]),
                setattr(tz, "TritonZeroer", originals[1]),
            )
        )
        tz.triton_status = lambda torch, device: (object(), "stand-in", None)

    def run_with_zeroer(self, zero):
        class StandIn:
            def __init__(self, torch, triton, pools):
                self.pools = pools

            def __call__(self, ids):
                zero(self.pools, ids)
                return 1

        tz.TritonZeroer = StandIn
        code, out, err = run_main(VerifyTest.ARGS + ["--layouts", "block_major", "--out", self.out])
        with open(self.out, encoding="utf-8") as f:
            return code, err, json.load(f)

    def test_a_correct_kernel_is_verified_and_reported(self):
        code, err, report = self.run_with_zeroer(tz.zero_per_layer)
        self.assertEqual(code, 0, err)
        self.assertEqual(report["triton"], "stand-in")
        self.assertIsNone(report["triton_reason"])
        for case in report["cases"]:
            self.assertEqual(case["triton"]["launches"], 1)
            self.assertTrue(case["triton"]["verified"])

    def test_a_wrong_kernel_fails_verification(self):
        code, err, report = self.run_with_zeroer(lambda pools, ids: None)
        self.assertEqual(code, tz.EXIT_VERIFY_FAILED)
        self.assertIn("triton: layer 0 K: a zeroed block holds nonzero bytes", err)
        self.assertFalse(report["cases"][0]["triton"]["verified"])

    def test_a_kernel_that_raises_fails_the_run_and_keeps_the_rest(self):
        def broken(pools, ids):
            raise RuntimeError("no such intrinsic")

        code, err, report = self.run_with_zeroer(broken)
        self.assertEqual(code, tz.EXIT_VERIFY_FAILED)
        self.assertIn("RuntimeError: no such intrinsic", err)
        self.assertIn("the Triton kernel failed", report["triton_reason"])
        self.assertEqual(len(report["cases"]), 4)
        for case in report["cases"]:
            self.assertIsNone(case["triton"])
            self.assertTrue(case["torch_per_layer"]["verified"] and case["limit"]["verified"])


if __name__ == "__main__":
    unittest.main()
