#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# scripts/gpu/checks.sh against this build's own binaries, conformance step
# only, on a machine without an NVIDIA GPU: it must exit 1 and summary.txt's
# first line must be "VERDICT: FAIL: ..." naming EXPECTED ("no device" when
# the build has the cuda backend, "not compiled" when it does not). On a
# machine whose nvidia-smi lists a GPU, a build with the cuda backend must
# PASS instead. Nothing the check starts may outlive it.
#
# Usage: gpu_checks_no_gpu.sh CHECKS_SH BIN_DIR EXPECTED
set -euo pipefail
checks="${1:?usage: gpu_checks_no_gpu.sh CHECKS_SH BIN_DIR EXPECTED}"
bin="${2:?}"
expected="${3:?}"

tmp="$(mktemp -d "${TMPDIR:-/tmp}/kvport-gpu-checks-test.XXXXXX")"
trap 'rm -rf "$tmp"' EXIT

want_rc=1
want_first="VERDICT: FAIL: "
if [ "$expected" = "no device" ] && nvidia-smi -L 2> /dev/null | grep -q '^GPU '; then
  echo "nvidia-smi lists a GPU: the cuda backend must pass here"
  want_rc=0
  want_first="VERDICT: PASS"
  expected=""
fi

# A session of its own, so that whatever it started can be found afterwards.
rc=0
KVPORT_GPU_CHECK_STEPS=conformance setsid -w "$checks" "$bin" "$tmp/out" > "$tmp/stdout" 2>&1 &
pid=$!
wait "$pid" || rc=$?

problems=()
left="$(ps -eo pid=,sid=,args= | awk -v sid="$pid" '$2 == sid')"
[ -z "$left" ] || problems+=("processes left running: $left")
[ "$rc" -eq "$want_rc" ] || problems+=("exit status $rc, expected $want_rc")
first="$(head -1 "$tmp/out/summary.txt" 2> /dev/null || true)"
case "$first" in
  "$want_first"*) ;;
  *) problems+=("summary.txt's first line is '$first', expected '$want_first...'") ;;
esac
if [ -n "$expected" ] && [[ "$first" != *"$expected"* ]]; then
  problems+=("summary.txt's first line does not name the reason '$expected'")
fi
for f in conformance.json conformance-cuda.gtest.json steps.tsv header.txt; do
  [ -s "$tmp/out/$f" ] || problems+=("$f missing or empty")
done
# The bench and the peer were left out, and the summary says so.
grep -q '^not run:' "$tmp/out/summary.txt" 2> /dev/null ||
  problems+=("summary.txt does not list the steps left out")

if [ ${#problems[@]} -gt 0 ]; then
  printf 'FAILED: %s\n' "${problems[@]}"
  echo "--- output"
  cat "$tmp/stdout"
  exit 1
fi
echo "ok: exit $rc: $first"
