#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""SIGINTs `kvport disagg` at random moments and checks each teardown.

Usage: disagg_sigint_loop.py --kvport BIN [--iterations N] [--seed S]
                             [--max-delay S] [--timeout S] -- ARGS...

Each iteration starts `kvport disagg ARGS... --json`, sends SIGINT to the
coordinator after a random delay in [0, --max-delay] (seeded: the seed is
printed, and --seed repeats a run), and checks that
- the coordinator ends within --timeout (it has started nothing else when
  the signal comes before its handler is installed, and then dies of it;
  likewise a signal that lands after its whole report was written, once
  the handlers are restored, ends it by SIGINT with that report);
- its report, when it printed one, says that no worker died by a signal the
  run did not send (SIGKILL only for a worker still running after the
  shutdown's grace period): a crash in a worker's teardown (SIGSEGV,
  SIGABRT) fails the iteration;
- nothing on stderr says a worker crashed or a sanitizer objected;
- no process of the run is left (the KVPORT_DISAGG_TEST_TAG it carries).
Bounded: --iterations runs (default 12) of at most --timeout s each.
"""
import argparse
import json
import os
import random
import signal
import subprocess
import sys
import time
import uuid

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from disagg_check import reap_tagged  # noqa: E402

CRASH_MARKS = ("double free", "Segmentation fault", "AddressSanitizer", "ThreadSanitizer",
               "UndefinedBehaviorSanitizer", "runtime error:", "terminate called", "Aborted")


def check_report(report):
    problems = []
    for w in report.get("workers", []):
        name = f"{w['role']}{w['instance']}.{w['rank']}"
        ex = w.get("exit")
        if ex is None:
            problems.append(f"{name}: no exit recorded")
            continue
        sig = ex["signal"]
        expected = sig == 0 or (sig == signal.SIGKILL and (ex["force_killed_at_shutdown"]
                                                          or w["end"] in ("killed", "lost")))
        if not expected:
            problems.append(f"{name} died by signal {sig} ({w['end']})")
    return problems


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--kvport", required=True)
    parser.add_argument("--iterations", type=int, default=12)
    parser.add_argument("--seed", type=int, default=None)
    parser.add_argument("--max-delay", type=float, default=3.0)
    parser.add_argument("--timeout", type=float, default=60)
    parser.add_argument("args", nargs=argparse.REMAINDER)
    opts = parser.parse_args()
    args = [a for a in opts.args if a != "--"]
    seed = opts.seed if opts.seed is not None else random.SystemRandom().randrange(1 << 31)
    rng = random.Random(seed)
    print(f"seed {seed} (repeat with --seed {seed})")
    failures = []
    for i in range(opts.iterations):
        delay = rng.uniform(0, opts.max_delay)
        tag = uuid.uuid4().hex
        env = dict(os.environ, KVPORT_DISAGG_TEST_TAG=tag)
        cmd = [opts.kvport, "disagg", *args, "--json"]
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env,
                                start_new_session=True)
        problems = []
        signalled = False
        try:
            proc.wait(timeout=delay)
        except subprocess.TimeoutExpired:
            proc.send_signal(signal.SIGINT)
            signalled = True
        try:
            out, err = proc.communicate(timeout=opts.timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            out, err = proc.communicate()
            problems.append(f"not done within {opts.timeout} s of the SIGINT")
        leftovers = reap_tagged(tag)
        if leftovers:
            problems.append(f"processes left behind: {leftovers}")
        text = err.decode(errors="replace")
        for mark in CRASH_MARKS:
            if mark in text:
                problems.append(f"stderr says '{mark}'")
        code = proc.returncode
        report = None
        if out.strip():
            try:
                report = json.loads(out.decode())
            except ValueError:
                problems.append("stdout is not one JSON report")
        if report is not None:
            problems.extend(check_report(report))
            failure = report.get("failure", "")
            if failure and signalled and not failure.startswith("interrupted by signal 2 while"):
                problems.append(f"the report's failure does not name the interrupt: {failure}")
            if failure.startswith("interrupted") and not signalled:
                problems.append(f"interrupted without a SIGINT: {failure}")
            # A SIGINT that lands after the report is written (the handlers are
            # restored as the command returns) ends the process by the signal:
            # that is the default disposition doing its job, not a lost report.
            late_signal = signalled and code == -signal.SIGINT and not failure
            if code not in (0, 1) and not late_signal:
                problems.append(f"exit {code} with a report")
        elif code not in (-signal.SIGINT, 0, 1):
            # No report: only a SIGINT before the handler (nothing started yet).
            problems.append(f"exit {code} without a report")
        state = report.get("failure", "completed") if report else "no report"
        when = f"SIGINT after {delay:.2f} s" if signalled else f"done before {delay:.2f} s"
        print(f"[{i}] {when}: exit {code}, {state}"
              + (f"; PROBLEMS: {problems}" if problems else ""))
        if problems:
            sys.stdout.write(text[-3000:])
            failures.append(i)
    if failures:
        print(f"FAILED iterations {failures} (seed {seed})")
        return 1
    print("PASSED")
    return 0


if __name__ == "__main__":
    sys.exit(main())
