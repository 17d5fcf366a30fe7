#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""scripts/ctest_report.py on a canned ctest run: the passing tests and the
padding dots stay out of what it prints, the summary counts each label, a
failure is printed in full, skip reasons are listed, and it exits 0 (the run's
status stays ctest's).

Usage: test_ctest_report.py <scripts/ctest_report.py>
"""

import json
import os
import subprocess
import sys
import tempfile

DOTS = "." * 300
CTEST_OUTPUT = f"""Test project /build
    Start 1: core.alloc
1/5 Test #1: core.alloc {DOTS}   Passed    0.01 sec
    Start 2: cli.bad_flag
2/5 Test #2: cli.bad_flag {DOTS}***Failed    1.50 sec
the failure's own output, which ctest repeats with --output-on-failure
    Start 3: peer.torch
3/5 Test #3: peer.torch {DOTS}***Skipped   0.20 sec
    Start 4: cli.help
4/5 Test #4: cli.help {DOTS}   Passed    0.30 sec
    Start 5: Inputs/Parse.Rejects/16-byte object <20-8D 97-70>
5/5 Test #5: Inputs/Parse.Rejects/16-byte object <20-8D 97-70> {DOTS}   Passed    0.02 sec

80% tests passed, 1 tests failed out of 5

Total Test time (real) =   2.01 sec

The following tests did not run:
\t  3 - peer.torch (Skipped)

The following tests FAILED:
\t  2 - cli.bad_flag (Failed)
Errors while running CTest
"""

JUNIT = """<?xml version="1.0" encoding="UTF-8"?>
<testsuite name="(empty)" tests="5" failures="1" disabled="0" skipped="1" time="0">
  <testcase name="core.alloc" classname="core.alloc" time="0.01" status="run">
    <system-out>ok</system-out>
  </testcase>
  <testcase name="cli.bad_flag" classname="cli.bad_flag" time="1.5" status="fail">
    <failure message="Failed"/>
    <system-out>line one of the failure
expected 2, got 0</system-out>
  </testcase>
  <testcase name="peer.torch" classname="peer.torch" time="0.2" status="notrun">
    <skipped message="SKIP_RETURN_CODE=77"/>
    <system-out>SKIP: python3-torch is not installed</system-out>
  </testcase>
  <testcase name="cli.help" classname="cli.help" time="0.3" status="run">
    <system-out>usage</system-out>
  </testcase>
  <testcase name="Inputs/Parse.Rejects/16-byte object &lt;20-8D 97-70&gt;" classname="x" time="0.02" status="run">
    <system-out>ok</system-out>
  </testcase>
</testsuite>
"""

TESTS = {"tests": [
    {"name": "core.alloc", "properties": [{"name": "LABELS", "value": ["core"]}]},
    {"name": "cli.bad_flag", "properties": [{"name": "LABELS", "value": ["cli"]}]},
    {"name": "peer.torch", "properties": [{"name": "LABELS", "value": ["peer"]}]},
    {"name": "cli.help", "properties": [{"name": "LABELS", "value": ["cli"]}]},
    {"name": "Inputs/Parse.Rejects/16-byte object <20-8D 97-70>",
     "properties": [{"name": "LABELS", "value": ["unit"]}]},
]}


def expect(condition, what, out):
    if not condition:
        print(f"FAIL: {what}\n--- output ---\n{out}")
        sys.exit(1)


def main():
    script = sys.argv[1]
    with tempfile.TemporaryDirectory() as d:
        junit = os.path.join(d, "junit.xml")
        tests = os.path.join(d, "tests.json")
        raw = os.path.join(d, "raw.log")
        with open(junit, "w") as f:
            f.write(JUNIT)
        with open(tests, "w") as f:
            json.dump(TESTS, f)
        r = subprocess.run([sys.executable, script, "--junit", junit, "--tests", tests, "--log", raw],
                           input=CTEST_OUTPUT, capture_output=True, text=True, timeout=60)
        out = r.stdout
        expect(r.returncode == 0, f"exit status {r.returncode} (stderr: {r.stderr})", out)
        expect("...." not in out, "the padding dots are printed", out)
        expect("core.alloc" not in out, "a passing test is listed", out)
        expect("object <" not in out, "a passing test whose name has spaces is listed", out)
        expect("Failed" in out and "cli.bad_flag" in out, "the failure is not listed live", out)
        rows = {line.split()[0]: line.split()[1:] for line in out.splitlines()
                if line.startswith("  ") and len(line.split()) >= 5}
        expect(rows.get("cli", [])[:4] == ["2", "1", "1", "0"], "cli row: 2 tests, 1 passed, 1 failed", out)
        expect(rows.get("core", [])[:4] == ["1", "1", "0", "0"], "core row: 1 test, 1 passed", out)
        expect(rows.get("peer", [])[:4] == ["1", "0", "0", "1"], "peer row: 1 test, 1 skipped", out)
        expect(rows.get("unit", [])[:4] == ["1", "1", "0", "0"], "unit row: 1 test, 1 passed", out)
        expect(rows.get("all", [])[:4] == ["5", "3", "1", "1"], "all row: 5 tests, 3/1/1", out)
        expect("==== FAILED: cli.bad_flag" in out and "expected 2, got 0" in out,
               "the failure's output is not printed in full", out)
        expect("SKIP: python3-torch is not installed" in out, "the skip reason is missing", out)
        with open(raw) as f:
            expect(f.read() == CTEST_OUTPUT, "the raw log is not ctest's output", out)
    print("ok")


if __name__ == "__main__":
    main()
