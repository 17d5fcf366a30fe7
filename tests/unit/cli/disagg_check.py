#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""Runs `kvport disagg ... --json` (or `kvport cluster`) once and checks its report.

Usage: disagg_check.py --kvport BIN [--command disagg|cluster] [--timeout S]
                       [--check EXPR]... [--expect-failure] [--exit CODE] -- ARGS...

Every run is bounded (--timeout, default 120 s) and must leave no process
behind: the run gets a unique KVPORT_DISAGG_TEST_TAG in its environment, and
afterwards every process that still carries it (a worker the command failed
to stop) is killed and the check fails. Each --check is a Python expression
over the report `r` (a dict), e.g. "r['leaked_blocks'] == 0". The default
checks: the run says ok, every request completed, nothing leaked, no
verification failure, no worker dead of a signal the run did not send;
with --expect-failure only the last of them (the run is meant to fail: the
--check expressions say how). With --command cluster the default checks are
CLUSTER_CHECKS. --exit: the expected exit code (default 0,
1 with --expect-failure).

--kill-child TEXT: SIGKILLs, as soon as it appears, the run's first child
process whose command line contains TEXT (a death from outside, which the
run did not order); a run that ended before that child was seen is tried
again, at most 5 times. --stderr-lacks TEXT: the run's stderr must not
contain TEXT.
"""
import argparse
import json
import os
import signal
import subprocess
import sys
import time
import uuid

DEFAULT_CHECKS = [
    "r['ok'] is True",
    "r['requests_completed'] == r['requests']",
    "r['leaked_blocks'] == 0",
    "r['verification_failures'] == 0",
    "all(w['killed'] or w['end'] == 'lost' or w['leaked_blocks'] == 0 for w in r['workers'])",
    # No worker died by a signal the run did not send: SIGKILL only for the
    # --kill victim, a worker reported lost, or one still running after the
    # shutdown's grace period.
    "all(w['exit']['signal'] == 0 or (w['exit']['signal'] == 9 and (w['end'] in ('killed', 'lost')"
    " or w['exit']['force_killed_at_shutdown'])) for w in r['workers'])",
]


# `kvport cluster`: every policy's run ended well, every request of the trace
# finished on some instance, the router's index of every live instance equals
# that instance's own cache at the end, no event was dropped, and the router
# caught up with every instance's events in every round.
CLUSTER_CHECKS = [
    "r['ok'] is True",
    "all(run['ok'] for run in r['runs'])",
    "all(run['completed'] + run['rejected'] == r['requests'] for run in r['runs'])",
    "all(sum(run['load_balance']['requests_routed']) >= r['requests'] for run in r['runs'])",
    "all(all(e == 1 for e in run['index_exact']) for run in r['runs'])",
    "all(run['events']['dropped'] == 0 for run in r['runs'])",
    "all(run['sync_failures'] == 0 for run in r['runs'])",
]


def tagged_processes(tag):
    """Pids of processes whose environment holds the tag."""
    found = []
    needle = f"KVPORT_DISAGG_TEST_TAG={tag}".encode()
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/environ", "rb") as f:
                if needle in f.read().split(b"\0"):
                    found.append(int(entry))
        except OSError:
            continue
    return found


def reap_tagged(tag):
    """Waits up to 5 s for the processes tagged `tag` to go, SIGKILLs the rest
    and returns their pids (empty: none was left behind)."""
    leftovers = []
    for _ in range(50):
        leftovers = tagged_processes(tag)
        if not leftovers:
            break
        time.sleep(0.1)
    for pid in leftovers:
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:
            pass
    return leftovers


def kill_child_when_seen(proc, tag, text):
    """SIGKILLs the first process tagged `tag` (not `proc` itself) whose
    command line holds `text`; False when `proc` ended before one was seen."""
    while proc.poll() is None:
        for pid in tagged_processes(tag):
            if pid == proc.pid:
                continue
            try:
                with open(f"/proc/{pid}/cmdline", "rb") as f:
                    cmdline = f.read().replace(b"\0", b" ").decode(errors="replace")
            except OSError:
                continue
            if text in cmdline:
                os.kill(pid, signal.SIGKILL)
                return True
        time.sleep(0.005)
    return False


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--kvport", required=True)
    parser.add_argument("--command", default="disagg", choices=["disagg", "cluster"])
    parser.add_argument("--timeout", type=float, default=120)
    parser.add_argument("--check", action="append", default=[])
    parser.add_argument("--expect-failure", action="store_true")
    parser.add_argument("--exit", type=int, default=None)
    parser.add_argument("--kill-child", default=None)
    parser.add_argument("--stderr-lacks", action="append", default=[])
    parser.add_argument("args", nargs=argparse.REMAINDER)
    opts = parser.parse_args()
    args = [a for a in opts.args if a != "--"]

    cmd = [opts.kvport, opts.command, *args, "--json"]
    failures = []
    for attempt in range(5 if opts.kill_child else 1):
        tag = uuid.uuid4().hex
        env = dict(os.environ, KVPORT_DISAGG_TEST_TAG=tag)
        start = time.monotonic()
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env,
                                start_new_session=True)
        killed = opts.kill_child is None or kill_child_when_seen(proc, tag, opts.kill_child)
        try:
            out, err = proc.communicate(timeout=opts.timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            out, err = proc.communicate()
            failures.append(f"not done within {opts.timeout} s")
        if killed:
            break
        reap_tagged(tag)
        print(f"attempt {attempt + 1}: the run ended before a child with "
              f"{opts.kill_child!r} was seen; again")
    else:
        failures.append(f"no child with {opts.kill_child!r} was seen in 5 runs")
    for text in opts.stderr_lacks:
        if text in err.decode(errors="replace"):
            failures.append(f"stderr has {text!r}")
    elapsed = time.monotonic() - start
    expected_exit = opts.exit if opts.exit is not None else (1 if opts.expect_failure else 0)
    if proc.returncode != expected_exit:
        failures.append(f"exit {proc.returncode}, expected {expected_exit}")

    # The workers die with the coordinator (PDEATHSIG); give the kernel a moment.
    leftovers = reap_tagged(tag)
    if leftovers:
        failures.append(f"processes left behind: {leftovers}")

    report = None
    try:
        report = json.loads(out.decode())
    except ValueError:
        failures.append("stdout is not one JSON report")
    if report is not None:
        checks = CLUSTER_CHECKS if opts.command == "cluster" else DEFAULT_CHECKS
        defaults = [] if opts.expect_failure and opts.command == "cluster" else (
            checks[-1:] if opts.expect_failure else checks)
        for expr in defaults + opts.check:
            try:
                if not eval(expr, {"r": report}):  # noqa: S307 - test-only expressions
                    failures.append(f"check failed: {expr}")
            except Exception as e:  # a missing field is a failed check
                failures.append(f"check {expr!r} raised {e!r}")

    print(f"$ {' '.join(cmd)}  ({elapsed:.1f} s, exit {proc.returncode})")
    if report is not None:
        keys = ("ok", "requests", "requests_completed", "transfers", "requests_recomputed",
                "leaked_blocks", "verification_failures", "ratio_vs_raw", "kill")
        if opts.command == "cluster":
            keys = ("ok", "requests", "baseline")
        summary = {k: report.get(k) for k in keys}
        for run in report.get("runs", []):
            print(json.dumps({k: run.get(k) for k in ("policy", "ok", "failure", "hit_blocks",
                                                       "hit_blocks_vs_baseline", "kill")}))
        print(json.dumps(summary))
    if failures:
        sys.stdout.write(err.decode()[-4000:])
        print("FAILED: " + "; ".join(failures))
        return 1
    print("PASSED")
    return 0


if __name__ == "__main__":
    sys.exit(main())
