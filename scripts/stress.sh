#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# Runs chosen ctest entries many times on a crowded machine: LOAD busy loops
# (default 4, on this project's 2 cores) run beside the tests, as on a loaded
# CI runner, and are stopped when the script ends, however it ends. Each test
# repeats until it fails or has passed N times (ctest --repeat until-fail:N);
# the script prints ctest's summary and exits with ctest's status.
# Usage: scripts/stress.sh [-n N] [-l LOAD] [-p PRESET] [-j JOBS] -- <ctest selection...>
#   e.g. scripts/stress.sh -n 100 -- -R 'kvport_cli\.disagg\.hybrid_kill'
#        scripts/stress.sh -n 20 -- -L 'disagg|cluster'
# The build must exist (scripts/test.sh PRESET builds it).
set -euo pipefail
cd "$(dirname "$0")/.."
n=100
load=4
preset=host
jobs=2
while [ $# -gt 0 ]; do
  case "$1" in
    -n) n="$2"; shift 2 ;;
    -l) load="$2"; shift 2 ;;
    -p) preset="$2"; shift 2 ;;
    -j) jobs="$2"; shift 2 ;;
    --) shift; break ;;
    *) echo "stress.sh: unknown option '$1' (usage: see the header)" >&2; exit 2 ;;
  esac
done
if [ $# -eq 0 ]; then
  echo "stress.sh: name the tests after --, e.g. -- -R 'kvport_cli\\.disagg'" >&2
  exit 2
fi
for v in "$n" "$load" "$jobs"; do
  [[ "$v" =~ ^[0-9]+$ ]] || { echo "stress.sh: '$v' is not a count" >&2; exit 2; }
done
[ -d "build/$preset" ] || { echo "stress.sh: build/$preset does not exist: run scripts/test.sh $preset first" >&2; exit 2; }

pids=()
stop_load() {
  for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done
  for p in "${pids[@]}"; do wait "$p" 2>/dev/null || true; done
}
trap stop_load EXIT INT TERM
for _ in $(seq 1 "$load"); do
  sh -c 'while :; do :; done' &
  pids+=($!)
done
echo "stress: $load busy loops beside the tests; each test until it fails or has passed $n times"
# The test preset, for its environment (the sanitizers' options, UCX's hooks
# off under tsan, KVPORT_TEST_TIME_SCALE): without it a tsan run crashes in UCX.
ctest --preset "$preset" --repeat "until-fail:$n" -j "$jobs" "$@"
