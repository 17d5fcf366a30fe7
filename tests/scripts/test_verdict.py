#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""scripts/gpu/verdict.py on canned inputs: one case per run, so that each is
its own ctest entry. Proves the verdict can say PASS (cuda passed everything)
and says FAIL for every way the GPU proof can fall short.

Usage: test_verdict.py VERDICT_PY CASE     (test_verdict.py --list for the cases)
"""
import json
import os
import subprocess
import sys
import tempfile

SUITE = 26  # conformance tests per backend in the canned reports


def conformance(cuda=(SUITE, 0, 0), reason="", others=("host", "gpusim"), other_failed=0):
    backends = []
    if cuda is not None:
        passed, skipped, failed = cuda
        backends.append({"backend": "cuda", "passed": passed, "skipped": skipped,
                         "failed": failed,
                         "failed_tests": [f"Backends/Conformance.T{i}/cuda" for i in range(failed)],
                         "skip_reason": reason if skipped else ""})
    for name in others:
        failed = other_failed if name == "gpusim" else 0
        backends.append({"backend": name, "passed": SUITE - failed, "skipped": 0, "failed": failed,
                         "failed_tests": [f"Backends/Conformance.T{i}/{name}" for i in range(failed)],
                         "skip_reason": ""})
    return {"backends": backends, "suite": "/bundle/bin/kvport_conformance"}


def gtest(passed=SUITE, skipped=0, failed=0):
    tests = []
    for i in range(passed + skipped + failed):
        t = {"name": f"T{i}/cuda", "status": "RUN",
             "result": "SKIPPED" if passed <= i < passed + skipped else "COMPLETED"}
        if i >= passed + skipped:
            t["failures"] = [{"failure": "expected 0, got 255", "type": ""}]
        tests.append(t)
    return {"tests": len(tests), "testsuites": [{"name": "Backends/Conformance",
                                                 "testsuite": tests}]}


def bench_cases(backend="cuda"):
    return [{"backend": backend, "model": m, "layout": lay, "batch": b, "ids": ids,
             "bytes": 1 << 20, "repetitions": 5,
             "reference": {"seconds": 1e-3, "bytes_per_s": 1e9, "calls": 64},
             "batched": {"seconds": 1e-5, "bytes_per_s": 1e12, "calls": 1},
             "limit": {"seconds": 1e-5, "bytes_per_s": 1.2e12, "calls": 1},
             "batched_over_limit": 0.83, "batched_over_reference": 100.0}
            for m in ("llama-3-8b", "llama-3-70b") for lay in ("layer_major", "block_major")
            for b in (1, 16, 256) for ids in ("contiguous", "scattered")]


def gbench(names=("Zeroing/cuda/llama-3-8b/layer_major/scattered/256/manual_time",), error=False):
    return {"context": {}, "benchmarks": [
        {"name": n, "run_type": "iteration", "iterations": 10, "real_time": 1.0,
         **({"error_occurred": True, "error_message": "cuda: launch failed"} if error else {})}
        for n in names]}


def hosttier(backend="cuda", calls=1, error=False, count=None):
    names = [f"HostTier/{backend}/{d}/{m}/{lay}/{b}/manual_time"
             for m in ("llama-3-8b", "llama-3-70b") for lay in ("layer_major", "block_major")
             for d in ("offload", "onload") for b in (1, 16, 256)]
    return {"context": {}, "benchmarks": [
        {"name": n, "run_type": "iteration", "iterations": 10, "real_time": 1.0,
         "GBps": 40.0, "limit_GBps": 50.0, "ratio": 0.8, "calls_per_batch": calls,
         **({"error_occurred": True, "error_message": "cuda: launch failed"}
            if error and i == 0 else {})}
        for i, n in enumerate(names[:count])]}


NO_DEVICE = ("cuda: no device: CUDA driver version is insufficient for CUDA runtime version "
             "(error 35)")
ALL_OK = ["conformance", "conformance-cuda-gtest", "bench-kvport", "bench-gbench",
          "bench-hosttier", "peer-torch", "peer-compare"]
PEER = ["peer-torch", "peer-compare"]
COMPARE = "case  kvport  torch  triton  limit\n70b/256  1.00  0.10  0.80  1.20\n"


def full(**overrides):
    """Every step ran and succeeded; overrides replace files (None: removes one) or step lines."""
    files = {"conformance.json": conformance(), "conformance-cuda.gtest.json": gtest(),
             "bench-kvport.json": bench_cases(), "bench-gbench.json": gbench(),
             "bench-hosttier.json": hosttier(),
             "torch.json": {"cases": []}, "peer-compare.txt": COMPARE,
             "steps": {s: ("ok", 0, "") for s in ALL_OK}}
    for k, v in overrides.items():
        if k == "steps":
            files["steps"] = {**files["steps"], **v}
        else:
            files[k.replace("__", ".").replace("_", "-")] = v
    return files


# case: (inputs, expected exit status, text the first line must contain, text the summary must contain)
CASES = {
    "pass": (full(), 0, "VERDICT: PASS", "peer (compare.py"),
    "pass_conformance_only": (
        full(steps={s: ("skipped", "-", "KVPORT_GPU_CHECK_STEPS=conformance") for s in ALL_OK[2:]},
             bench_kvport__json=None, bench_gbench__json=None, bench_hosttier__json=None,
             torch__json=None,
             peer_compare__txt=None),
        0, "VERDICT: PASS", "not run:"),
    "pass_peer_absent": (
        full(steps={s: ("skipped", "-", "peer scripts absent: torch_zeroing.py compare.py")
                    for s in PEER}, torch__json=None, peer_compare__txt=None),
        0, "VERDICT: PASS", "peer scripts absent"),
    "no_device": (
        full(conformance__json=conformance(cuda=(0, SUITE, 0), reason=NO_DEVICE),
             conformance_cuda__gtest__json=gtest(passed=0, skipped=SUITE)),
        1, "VERDICT: FAIL: conformance: cuda skipped all 26 tests: cuda: no device", ""),
    "not_compiled": (
        full(conformance__json=conformance(cuda=None),
             conformance_cuda__gtest__json=gtest(passed=0)),
        1, "VERDICT: FAIL: conformance: the cuda backend is not compiled", "matched no test"),
    "partial_skips": (
        full(conformance__json=conformance(cuda=(SUITE - 2, 2, 0), reason="no peer access"),
             conformance_cuda__gtest__json=gtest(passed=SUITE - 2, skipped=2)),
        1, "VERDICT: FAIL: conformance: cuda skipped 2 of 26", ""),
    "failures": (
        full(conformance__json=conformance(cuda=(SUITE - 1, 0, 1)),
             conformance_cuda__gtest__json=gtest(passed=SUITE - 1, failed=1),
             steps={"conformance": ("failed", 1, ""), "conformance-cuda-gtest": ("failed", 1, "")}),
        1, "VERDICT: FAIL: conformance: cuda failed 1 of 26 tests", ""),
    "gtest_skips_only": (
        full(conformance_cuda__gtest__json=gtest(passed=SUITE - 1, skipped=1)),
        1, "VERDICT: FAIL: conformance: kvport_conformance", "1 skipped of 26"),
    "not_whole_suite": (
        full(conformance__json=conformance(cuda=(SUITE - 3, 0, 0))),
        1, "VERDICT: FAIL: conformance: cuda has 23 tests, host 26", ""),
    "other_backend_failed": (
        full(conformance__json=conformance(other_failed=1), steps={"conformance": ("failed", 1, "")}),
        1, "VERDICT: FAIL: conformance: backend gpusim failed 1", ""),
    "conformance_timeout": (
        full(conformance__json="", steps={"conformance": ("timeout", 124, "")}),
        1, "VERDICT: FAIL: conformance: conformance.json is empty", "timed out"),
    "bench_failed": (
        full(bench_kvport__json="", steps={"bench-kvport": ("failed", 2, "")}),
        1, "VERDICT: FAIL: bench: kvport bench --backend cuda exited 2", ""),
    "bench_wrong_backend": (
        full(bench_kvport__json=bench_cases("host")),
        1, "VERDICT: FAIL: bench: bench-kvport.json has 24 cases (24 not on cuda)", ""),
    "gbench_no_cases": (
        full(bench_gbench__json=""),
        1, "VERDICT: FAIL: bench: bench-gbench.json is empty", ""),
    "gbench_error": (
        full(bench_gbench__json=gbench(error=True)),
        1, "VERDICT: FAIL: bench: kvport_bench: 1 cases failed", ""),
    "hosttier_table": (full(), 0, "VERDICT: PASS", "host tier (kvport_bench HostTier/cuda/"),
    "hosttier_not_run": (
        full(bench_hosttier__json=None, steps={"bench-hosttier": ("skipped", "-", "why")}),
        0, "VERDICT: PASS", "kvport_bench HostTier: not run (why)"),
    "hosttier_missing": (
        full(bench_hosttier__json=""),
        1, "VERDICT: FAIL: bench: bench-hosttier.json is empty", ""),
    "hosttier_timeout": (
        full(bench_hosttier__json="", steps={"bench-hosttier": ("timeout", 124, "")}),
        1, "VERDICT: FAIL: bench: kvport_bench (HostTier cuda cases) timed out", ""),
    "hosttier_error": (
        full(bench_hosttier__json=hosttier(error=True)),
        1, "VERDICT: FAIL: bench: kvport_bench HostTier: 1 cases failed", "cuda: launch failed"),
    "hosttier_calls": (
        full(bench_hosttier__json=hosttier(calls=2)),
        1, "VERDICT: FAIL: bench: kvport_bench HostTier: 24 cases made other than one", ""),
    "hosttier_wrong_backend": (
        full(bench_hosttier__json=hosttier(backend="host")),
        1, "VERDICT: FAIL: bench: kvport_bench HostTier ran non-cuda cases", ""),
    "hosttier_too_few": (
        full(bench_hosttier__json=hosttier(count=3)),
        1, "VERDICT: FAIL: bench: bench-hosttier.json has 3 cases, expected 24", ""),
    "peer_failed": (
        full(peer_compare__txt="", steps={"peer-torch": ("failed", 1, ""),
                                          "peer-compare": ("failed", 2, "")}),
        1, "VERDICT: FAIL: peer: torch_zeroing.py exited 1", ""),
    "nothing_ran": ({}, 1, "VERDICT: FAIL: conformance: the step did not run", ""),
    "conformance_first": (
        full(conformance__json=conformance(cuda=(0, SUITE, 0), reason=NO_DEVICE),
             bench_kvport__json="", steps={"bench-kvport": ("failed", 2, "")}),
        1, "VERDICT: FAIL: conformance:", "bench: kvport bench --backend cuda exited 2"),
}


def write_inputs(out, files):
    steps = files.pop("steps", None)
    if steps is not None:
        with open(os.path.join(out, "steps.tsv"), "w") as f:
            for name, (status, rc, note) in steps.items():
                f.write(f"{name}\t{status}\t{rc}\t1\t{note}\n")
    for name, content in files.items():
        if content is None:
            continue
        with open(os.path.join(out, name), "w") as f:
            f.write(content if isinstance(content, str) else json.dumps(content))


def main(argv):
    if len(argv) == 2 and argv[1] == "--list":
        print("\n".join(CASES))
        return 0
    if len(argv) != 3 or argv[2] not in CASES:
        print(__doc__, file=sys.stderr)
        return 2
    verdict, case = argv[1], argv[2]
    files, want_rc, want_first, want_text = CASES[case]
    with tempfile.TemporaryDirectory(prefix="kvport-verdict-") as out:
        write_inputs(out, dict(files))
        rc = subprocess.run([sys.executable, verdict, out], timeout=60).returncode
        with open(os.path.join(out, "summary.txt")) as f:
            summary = f.read()
    first = summary.splitlines()[0] if summary else ""
    problems = []
    if rc != want_rc:
        problems.append(f"exit status {rc}, expected {want_rc}")
    if want_first not in first:
        problems.append(f"first line {first!r} lacks {want_first!r}")
    if want_text and want_text not in summary:
        problems.append(f"summary lacks {want_text!r}")
    if want_rc == 0 and first != "VERDICT: PASS":
        problems.append(f"a pass must say exactly 'VERDICT: PASS', got {first!r}")
    if problems:
        print(f"{case}: FAILED: " + "; ".join(problems))
        print("--- summary.txt\n" + summary)
        return 1
    print(f"{case}: ok (exit {rc}: {first})")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
