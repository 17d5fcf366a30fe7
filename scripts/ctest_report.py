#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""Makes ctest's output readable (scripts/test.sh pipes ctest through it).

While ctest runs: one line per test that did not pass (its status, name and
time), a progress line every --every tests, and ctest's own lines before the
first test (configuration errors); every passing test and the padding dots
stay in the raw log (--log). At the end: a summary per label (tests, passed,
failed, skipped, seconds), each failed test's output in full (from ctest's
JUnit file), and the reasons the skipped tests printed.

Failed means what ctest means (its "The following tests FAILED" list: a
failure, a timeout, a crash, or "Not Run" for a missing executable); a test
that exited with its SKIP_RETURN_CODE is skipped. This script never changes
the exit status of the run: test.sh returns ctest's.

Usage: ctest ... --output-junit J 2>&1 |
       ctest_report.py --junit J --tests TESTS_JSON --log RAW_LOG [--every N]
where TESTS_JSON is `ctest --show-only=json-v1` (the tests' labels).
"""

import argparse
import json
import re
import sys
import time
import xml.etree.ElementTree as ET
from collections import OrderedDict

# A name may hold spaces (a test's own choice): it ends where ctest's padding
# of dots begins.
RESULT = re.compile(
    r"^\s*(\d+)/(\d+)\s+Test\s+#\d+:\s+(.+?)\s\.+\s*(\*{3})?(.*?)\s+([\d.]+)\s+sec\s*$")
RESULT_NO_DOTS = re.compile(
    r"^\s*(\d+)/(\d+)\s+Test\s+#\d+:\s+(\S+)\s+(\*{3})?(.*?)\s+([\d.]+)\s+sec\s*$")
FAILED_ITEM = re.compile(r"^\s*\d+\s+-\s+(\S+)\s+\((.+)\)\s*$")
SKIP_REASON = re.compile(r"^SKIP(PED)?: ")
NO_LABEL = "(no label)"


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--junit", required=True, help="ctest --output-junit file")
    p.add_argument("--tests", required=True, help="ctest --show-only=json-v1 output")
    p.add_argument("--log", required=True, help="where ctest's raw output is kept")
    p.add_argument("--every", type=int, default=50, help="progress line every N tests")
    return p.parse_args()


def labels_by_test(path):
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except (OSError, ValueError):
        return {}
    out = {}
    for t in data.get("tests", []):
        labels = []
        for prop in t.get("properties", []):
            if prop.get("name") == "LABELS":
                labels = list(prop.get("value", []))
        out[t.get("name", "")] = labels or [NO_LABEL]
    return out


def junit_cases(path):
    """name -> (status, seconds, output, skip message) from ctest's JUnit file."""
    try:
        root = ET.parse(path).getroot()
    except (OSError, ET.ParseError):
        return {}
    cases = {}
    for case in root.iter("testcase"):
        skipped = case.find("skipped")
        out = case.find("system-out")
        cases[case.get("name", "")] = (
            case.get("status", ""),
            float(case.get("time", "0") or 0),
            out.text if out is not None and out.text else "",
            skipped.get("message", "") if skipped is not None else "",
        )
    return cases


def stream(raw, every):
    """Copies stdin to the raw log; prints the lines worth reading now.
    Returns (failed name -> reason from ctest's list, counts seen live)."""
    started = False
    in_failed_list = False
    failed = OrderedDict()
    done = passed = not_passed = 0
    total = 0
    last_progress = time.monotonic()
    for line in sys.stdin:
        raw.write(line)
        raw.flush()
        text = line.rstrip("\n")
        if not started:
            if text.startswith("Test project"):
                started = True
            else:
                print(text, flush=True)  # ctest's own errors come before the tests
            continue
        if in_failed_list:
            m = FAILED_ITEM.match(text)
            if m:
                failed[m.group(1)] = m.group(2)
                continue
            in_failed_list = False
        if text.startswith("The following tests FAILED"):
            in_failed_list = True
            continue
        m = RESULT.match(text) or RESULT_NO_DOTS.match(text)
        if m:
            done, total = int(m.group(1)), int(m.group(2))
            status = m.group(5).strip() or "Passed"
            if status == "Passed":
                passed += 1
            else:
                not_passed += 1
                print(f"  {status:<18} {m.group(3)}  ({float(m.group(6)):.2f} s)", flush=True)
            now = time.monotonic()
            if done % every == 0 or now - last_progress > 60:
                print(f"  [{done}/{total}] {passed} passed, {not_passed} not passed", flush=True)
                last_progress = now
            continue
        if text.startswith(("Total Test time", "Errors while running CTest", "No tests were found")):
            print(text, flush=True)
    return failed, (done, total)


def summarize(failed, labels, cases):
    rows = OrderedDict()
    names = list(cases) or list(labels)
    for name in names:
        status, seconds, _, _ = cases.get(name, ("", 0.0, "", ""))
        if name in failed:
            kind = "failed"
        elif status == "run":
            kind = "passed"
        else:
            kind = "skipped"
        for label in labels.get(name, [NO_LABEL]):
            r = rows.setdefault(label, {"tests": 0, "passed": 0, "failed": 0, "skipped": 0,
                                        "seconds": 0.0})
            r["tests"] += 1
            r[kind] += 1
            r["seconds"] += seconds
    if not rows:
        return
    width = max(len("label"), max(len(k) for k in rows))
    print()
    print("Summary per label (a test with two labels counts under both):")
    print(f"  {'label':<{width}}  {'tests':>6} {'passed':>6} {'failed':>6} {'skipped':>7} "
          f"{'seconds':>8}")
    for label in sorted(rows):
        r = rows[label]
        print(f"  {label:<{width}}  {r['tests']:>6} {r['passed']:>6} {r['failed']:>6} "
              f"{r['skipped']:>7} {r['seconds']:>8.1f}")
    total = len(names)
    n_failed = sum(1 for n in names if n in failed)
    n_passed = sum(1 for n in names if n not in failed and cases.get(n, ("",))[0] == "run")
    print(f"  {'all':<{width}}  {total:>6} {n_passed:>6} {n_failed:>6} "
          f"{total - n_passed - n_failed:>7}")


def main():
    args = parse_args()
    with open(args.log, "w", encoding="utf-8", errors="replace") as raw:
        failed, _ = stream(raw, max(1, args.every))
    cases = junit_cases(args.junit)
    labels = labels_by_test(args.tests)
    summarize(failed, labels, cases)

    for name, reason in failed.items():
        _, seconds, output, message = cases.get(name, ("", 0.0, "", ""))
        print()
        print(f"==== FAILED: {name} ({reason}, {seconds:.2f} s) ====")
        text = output.rstrip() or message or "(no output)"
        print(text)
        print(f"==== end of {name} ====")

    reasons = sorted({line for _, _, out, _ in cases.values() for line in out.splitlines()
                      if SKIP_REASON.match(line)})
    if reasons:
        print()
        print("Skipped tests, with their reasons:")
        for line in reasons:
            print(f"  {line}")
    print()
    print(f"ctest's full output: {args.log}")
    if failed:
        print(f"{len(failed)} test(s) failed: " + ", ".join(failed))
    return 0


if __name__ == "__main__":
    sys.exit(main())
