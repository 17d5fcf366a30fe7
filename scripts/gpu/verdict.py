#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""The GPU proof's verdict: reads what scripts/gpu/checks.sh left in OUT_DIR and
writes OUT_DIR/summary.txt, whose first line is "VERDICT: PASS" or
"VERDICT: FAIL: <the first reason>". Exit status 0 on PASS, 1 on FAIL.

The run passes only when the cuda backend ran the whole conformance suite with
passed > 0, skipped == 0 and failed == 0 (in `kvport conformance --json` and in
the suite's own gtest report), and every step that was asked for succeeded.
A backend without a device skips every test: that is a FAIL, never a pass.
The conformance result is reported first, then the bench and the peer.

Inputs in OUT_DIR (all optional; a missing one is a reason to fail when the
step that writes it was asked for):
  header.txt                 date, commit, GPU, driver and runtime versions
  steps.tsv                  one line per step: name, status (ok, failed,
                             timeout, skipped), exit code, seconds, note
  conformance.json           `kvport conformance --json`
  conformance-cuda.gtest.json  `kvport_conformance --gtest_filter=*/cuda`
  bench-kvport.json          `kvport bench --backend cuda --json`
  bench-gbench.json          kvport_bench's Zeroing/cuda/ cases (Google Benchmark JSON)
  bench-hosttier.json        kvport_bench's HostTier/cuda/ cases (Google Benchmark JSON)
  torch.json, peer-compare.txt  the peer (torch_zeroing.py, compare.py)

Python 3 standard library only: the GPU machine has nothing else to rely on.
Usage: verdict.py OUT_DIR
"""
import json
import os
import sys

BACKEND = "cuda"
# kvport bench --quick --batches 1,16,256: 2 models x 2 layouts x 3 batches x 2 id patterns.
BENCH_CASES = 24
# kvport_bench's HostTier/cuda/ cases: 2 directions x 2 models x 2 layouts x 3 batches.
HOSTTIER_CASES = 24
# Steps whose failure is reported, in report order, with the file holding their error.
STEP_ERRORS = {
    "conformance": "conformance.err",
    "conformance-cuda-gtest": "conformance-cuda.log",
    "bench-kvport": "bench-kvport.err",
    "bench-gbench": "bench-gbench.log",
    "bench-hosttier": "bench-hosttier.log",
    "peer-torch": "peer-torch.log",
    "peer-compare": "peer-compare.err",
}


def read_json(path):
    """(data, problem): problem is None when the file parsed."""
    try:
        with open(path) as f:
            text = f.read()
        if not text.strip():
            return None, "is empty"
        return json.loads(text), None
    except FileNotFoundError:
        return None, "is missing"
    except (OSError, ValueError) as e:
        return None, f"is unreadable ({e})"


def last_line(path):
    try:
        with open(path, errors="replace") as f:
            lines = [line.strip() for line in f if line.strip()]
    except OSError:
        return ""
    return lines[-1][:300] if lines else ""


def read_steps(out):
    steps = {}
    try:
        with open(os.path.join(out, "steps.tsv")) as f:
            for line in f:
                parts = line.rstrip("\n").split("\t")
                if len(parts) >= 4:
                    steps[parts[0]] = {"status": parts[1], "rc": parts[2], "seconds": parts[3],
                                       "note": parts[4] if len(parts) > 4 else ""}
    except FileNotFoundError:
        pass
    return steps


def step_reason(out, name, step, what):
    """A reason when the step ran and did not succeed, else None."""
    if step is None or step["status"] in ("ok", "skipped"):
        return None
    detail = last_line(os.path.join(out, STEP_ERRORS.get(name, "")))
    how = "timed out" if step["status"] == "timeout" else f"exited {step['rc']}"
    return f"{what} {how}" + (f": {detail}" if detail else "") + f" (see {STEP_ERRORS[name]})"


def check_conformance(out, steps, reasons, report):
    step = steps.get("conformance")
    if step is None:
        reasons.append("conformance: the step did not run (steps.tsv has no conformance line)")
        return
    data, problem = read_json(os.path.join(out, "conformance.json"))
    backends = data.get("backends") if isinstance(data, dict) else None
    if not isinstance(backends, list):
        why = step_reason(out, "conformance", step, "kvport conformance --json")
        reasons.append(f"conformance: conformance.json {problem or 'has no backends list'}"
                       + (f"; {why}" if why else ""))
        return
    by_name = {b.get("backend"): b for b in backends if isinstance(b, dict)}
    report.append("conformance (kvport conformance --json):")
    report.append(f"  {'backend':<10} {'passed':>7} {'skipped':>8} {'failed':>7}")
    for b in backends:
        report.append(f"  {b.get('backend', '?'):<10} {b.get('passed', 0):>7} "
                      f"{b.get('skipped', 0):>8} {b.get('failed', 0):>7}"
                      + (f"  skipped: {b['skip_reason']}" if b.get("skip_reason") else ""))
    report.append("")

    cuda = by_name.get(BACKEND)
    if cuda is None:
        names = ", ".join(sorted(str(n) for n in by_name)) or "none"
        reasons.append(f"conformance: the {BACKEND} backend is not compiled into this build "
                       f"(the suite has: {names}); build the cuda preset")
    else:
        passed, skipped, failed = (int(cuda.get(k, 0)) for k in ("passed", "skipped", "failed"))
        total = passed + skipped + failed
        reason = cuda.get("skip_reason") or "no reason given"
        if total == 0:
            reasons.append(f"conformance: {BACKEND} ran no test")
        elif skipped == total:
            reasons.append(f"conformance: {BACKEND} skipped all {total} tests: {reason}")
        else:
            if failed > 0:
                names = ", ".join(cuda.get("failed_tests", [])[:5])
                reasons.append(f"conformance: {BACKEND} failed {failed} of {total} tests: {names}")
            if skipped > 0:
                reasons.append(f"conformance: {BACKEND} skipped {skipped} of {total} tests: {reason}")
            if passed == 0:
                reasons.append(f"conformance: {BACKEND} passed no test")
        host = by_name.get("host")
        if host is not None:
            host_total = sum(int(host.get(k, 0)) for k in ("passed", "skipped", "failed"))
            if total != host_total:
                reasons.append(f"conformance: {BACKEND} has {total} tests, host {host_total}: "
                               "not the whole suite")
    for name, b in sorted(by_name.items()):
        if name != BACKEND and int(b.get("failed", 0)) > 0:
            reasons.append(f"conformance: backend {name} failed {b['failed']} tests: "
                           + ", ".join(b.get("failed_tests", [])[:5]))
    if not any(r.startswith("conformance:") for r in reasons):
        why = step_reason(out, "conformance", step, "kvport conformance --json")
        if why:
            reasons.append(f"conformance: {why}")


def check_gtest(out, steps, reasons):
    step = steps.get("conformance-cuda-gtest")
    if step is None:
        reasons.append("conformance: the kvport_conformance --gtest_filter='*/cuda' step did not run")
        return
    data, problem = read_json(os.path.join(out, "conformance-cuda.gtest.json"))
    what = "kvport_conformance --gtest_filter='*/cuda'"
    if not isinstance(data, dict) or not isinstance(data.get("testsuites"), list):
        why = step_reason(out, "conformance-cuda-gtest", step, what)
        reasons.append(f"conformance: {what}: its report {problem or 'has no testsuites'}"
                       + (f"; {why}" if why else ""))
        return
    total = skipped = failed = 0
    for suite in data["testsuites"]:
        for test in suite.get("testsuite", []):
            total += 1
            if test.get("failures"):
                failed += 1
            elif test.get("result") == "SKIPPED":
                skipped += 1
    if total == 0:
        reasons.append(f"conformance: {what} matched no test")
    elif failed or skipped:
        reasons.append(f"conformance: {what}: {failed} failed, {skipped} skipped of {total}")
    else:
        why = step_reason(out, "conformance-cuda-gtest", step, what)
        if why:
            reasons.append(f"conformance: {why}")


def check_bench(out, steps, reasons, notes, report):
    step = steps.get("bench-kvport")
    if step is None:
        reasons.append("bench: the kvport bench step did not run")
    elif step["status"] == "skipped":
        notes.append(f"bench: not run ({step['note']})")
    else:
        why = step_reason(out, "bench-kvport", step, "kvport bench --backend cuda")
        cases, problem = read_json(os.path.join(out, "bench-kvport.json"))
        if why:
            reasons.append(f"bench: {why}")
        elif not isinstance(cases, list):
            reasons.append(f"bench: bench-kvport.json {problem or 'is not a list of cases'}")
        else:
            wrong = [c for c in cases if c.get("backend") != BACKEND]
            if len(cases) != BENCH_CASES or wrong:
                reasons.append(f"bench: bench-kvport.json has {len(cases)} cases "
                               f"({len(wrong)} not on {BACKEND}), expected {BENCH_CASES} on {BACKEND}")
            report.append("zeroing (kvport bench --backend cuda; b/c batched over limit, "
                          "b/a batched over reference):")
            report.append(f"  {'model':<12} {'layout':<11} {'ids':<10} {'batch':>5} "
                          f"{'(b) GB/s':>9} {'(c) GB/s':>9} {'b/c':>6} {'b/a':>7}")
            for c in cases:
                gb = lambda s: c.get(s, {}).get("bytes_per_s", 0) / 1e9  # noqa: E731
                report.append(f"  {c.get('model', '?'):<12} {c.get('layout', '?'):<11} "
                              f"{c.get('ids', '?'):<10} {c.get('batch', 0):>5} "
                              f"{gb('batched'):>9.1f} {gb('limit'):>9.1f} "
                              f"{c.get('batched_over_limit', 0):>5.2f}x "
                              f"{c.get('batched_over_reference', 0):>6.1f}x")
            report.append("")

    step = steps.get("bench-gbench")
    if step is None:
        reasons.append("bench: the kvport_bench step did not run")
    elif step["status"] == "skipped":
        notes.append(f"kvport_bench: not run ({step['note']})")
    else:
        why = step_reason(out, "bench-gbench", step, "kvport_bench (cuda cases)")
        data, problem = read_json(os.path.join(out, "bench-gbench.json"))
        runs = data.get("benchmarks") if isinstance(data, dict) else None
        if why:
            reasons.append(f"bench: {why}")
        elif not isinstance(runs, list):
            reasons.append(f"bench: bench-gbench.json {problem or 'has no benchmarks'}: kvport_bench "
                           f"ran no Zeroing/{BACKEND}/ case (a backend without a device registers none)")
        else:
            errors = [r.get("name", "?") for r in runs if r.get("error_occurred")]
            other = [r.get("name", "?") for r in runs
                     if not str(r.get("name", "")).startswith(f"Zeroing/{BACKEND}/")]
            if not runs:
                reasons.append(f"bench: kvport_bench ran no Zeroing/{BACKEND}/ case "
                               "(a backend without a device registers none)")
            if errors:
                reasons.append(f"bench: kvport_bench: {len(errors)} cases failed: {errors[0]}")
            if other:
                reasons.append(f"bench: kvport_bench ran non-{BACKEND} cases: {other[0]}")


def check_hosttier(out, steps, reasons, notes, report):
    """kvport_bench's HostTier/cuda/ cases: every case ran without an error,
    on cuda, with exactly one backend call per batch."""
    prefix = f"HostTier/{BACKEND}/"
    step = steps.get("bench-hosttier")
    if step is None:
        reasons.append("bench: the kvport_bench HostTier step did not run")
        return
    if step["status"] == "skipped":
        notes.append(f"kvport_bench HostTier: not run ({step['note']})")
        return
    why = step_reason(out, "bench-hosttier", step, "kvport_bench (HostTier cuda cases)")
    data, problem = read_json(os.path.join(out, "bench-hosttier.json"))
    runs = data.get("benchmarks") if isinstance(data, dict) else None
    if why:
        reasons.append(f"bench: {why}")
        return
    if not isinstance(runs, list) or not runs:
        reasons.append(f"bench: bench-hosttier.json {problem or 'has no benchmarks'}: kvport_bench "
                       f"ran no {prefix} case (a backend without a device registers none)")
        return
    errors = [r for r in runs if r.get("error_occurred")]
    other = [r.get("name", "?") for r in runs if not str(r.get("name", "")).startswith(prefix)]
    ok = [r for r in runs if not r.get("error_occurred")]
    if errors:
        r = errors[0]
        reasons.append(f"bench: kvport_bench HostTier: {len(errors)} cases failed: "
                       f"{r.get('name', '?')}: {r.get('error_message', 'no message')}")
    if other:
        reasons.append(f"bench: kvport_bench HostTier ran non-{BACKEND} cases: {other[0]}")
    if len(runs) != HOSTTIER_CASES:
        reasons.append(f"bench: bench-hosttier.json has {len(runs)} cases, "
                       f"expected {HOSTTIER_CASES}")
    calls = [r.get("name", "?") for r in ok if r.get("calls_per_batch") != 1]
    if calls:
        reasons.append(f"bench: kvport_bench HostTier: {len(calls)} cases made other than one "
                       f"backend call per batch: {calls[0]}")
    report.append("host tier (kvport_bench HostTier/cuda/; ours: one batched copy of scattered "
                  "blocks, limit: one contiguous copy of the same bytes):")
    report.append(f"  {'direction':<9} {'model':<12} {'layout':<11} {'batch':>5} "
                  f"{'ours GB/s':>10} {'limit GB/s':>10} {'ratio':>6} {'calls':>5}")
    for r in ok:
        parts = str(r.get("name", "")).split("/")
        if len(parts) < 6:
            continue
        report.append(f"  {parts[2]:<9} {parts[3]:<12} {parts[4]:<11} {parts[5]:>5} "
                      f"{r.get('GBps', 0):>10.1f} {r.get('limit_GBps', 0):>10.1f} "
                      f"{r.get('ratio', 0):>5.2f}x {r.get('calls_per_batch', 0):>5.0f}")
    report.append("")


def check_peer(out, steps, reasons, notes, report):
    for name, what in (("peer-torch", "torch_zeroing.py"), ("peer-compare", "compare.py")):
        step = steps.get(name)
        if step is None:
            reasons.append(f"peer: the {what} step did not run")
        elif step["status"] == "skipped":
            notes.append(f"peer: {what} not run ({step['note']})")
        else:
            why = step_reason(out, name, step, what)
            if why:
                reasons.append(f"peer: {why}")
    compare = os.path.join(out, "peer-compare.txt")
    status = steps.get("peer-compare", {}).get("status")
    if status in ("ok", "failed", "timeout"):
        try:
            with open(compare, errors="replace") as f:
                text = f.read().rstrip()
        except FileNotFoundError:
            text = ""
        if text:
            report.append("peer (compare.py: kvport batched / torch per-layer / Triton / limit):")
            report.extend("  " + line for line in text.splitlines())
            report.append("")
        elif status == "ok":
            reasons.append("peer: compare.py printed no table (peer-compare.txt is empty)")


def main(argv):
    if len(argv) != 2:
        print("usage: verdict.py OUT_DIR", file=sys.stderr)
        return 2
    out = argv[1]
    steps = read_steps(out)
    reasons, notes, report = [], [], []
    check_conformance(out, steps, reasons, report)
    check_gtest(out, steps, reasons)
    check_bench(out, steps, reasons, notes, report)
    check_hosttier(out, steps, reasons, notes, report)
    check_peer(out, steps, reasons, notes, report)

    lines = [f"VERDICT: FAIL: {reasons[0]}" if reasons else "VERDICT: PASS"]
    if reasons:
        lines.append("reasons:")
        lines.extend(f"  - {r}" for r in reasons)
    if notes:
        lines.append("not run:")
        lines.extend(f"  - {n}" for n in notes)
    lines.append("")
    try:
        with open(os.path.join(out, "header.txt")) as f:
            lines.extend(f.read().rstrip().splitlines())
        lines.append("")
    except FileNotFoundError:
        pass
    if steps:
        lines.append("steps:")
        for name, s in steps.items():
            lines.append(f"  {name:<24} {s['status']:<8} exit {s['rc']:<4} {s['seconds']:>4} s"
                         + (f"  {s['note']}" if s["note"] else ""))
        lines.append("")
    lines.extend(report)
    with open(os.path.join(out, "summary.txt"), "w") as f:
        f.write("\n".join(lines).rstrip() + "\n")
    return 1 if reasons else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
