#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# The GPU proof: the steps and the verdict, shared by the bundle's run.sh
# (scripts/gpu-bundle.sh) and the from-source scripts/gpu-check.sh.
#
#   conformance  kvport conformance --json (every backend, cuda included) and
#                kvport_conformance --gtest_filter='*/cuda'
#   bench        kvport bench --backend cuda --json (llama-3-8b and llama-3-70b,
#                both layouts, batches 1,16,256, contiguous and scattered ids),
#                and kvport_bench's Zeroing/cuda/ cases only; then kvport_bench's
#                HostTier/cuda/ cases (offload and onload of 1/16/256 scattered
#                blocks, llama-3-8b and llama-3-70b, both layouts, against one
#                contiguous copy; one backend call per batch)
#   peer         torch_zeroing.py (PyTorch per-layer zeroing and a Triton
#                kernel, beside the kvport bench JSON) and compare.py's ratio
#                table; skipped with a note when the scripts are not there
#
# Every step runs under `timeout` (the limits add up to 345 s) and writes JSON
# and logs into OUT_DIR; then verdict.py writes OUT_DIR/summary.txt, whose
# first line is "VERDICT: PASS" or "VERDICT: FAIL: <why>", and this script
# prints it and exits 0 (PASS) or 1 (FAIL). The run passes only when the cuda
# backend ran the whole conformance suite with passed > 0, skipped == 0 and
# failed == 0, and every step asked for succeeded: no device is a FAIL.
#
# Usage: checks.sh [--peer-dir DIR] [--build-info FILE] BIN_DIR OUT_DIR
#   BIN_DIR       holds kvport, kvport_conformance and kvport_bench
#   --peer-dir    holds torch_zeroing.py and compare.py
#   --build-info  the BUILD_INFO file (commit, CUDA runtime, host compiler)
# Environment:
#   KVPORT_GPU_CHECK_STEPS  comma-separated steps to run (default
#                           conformance,bench,peer); steps left out are
#                           reported as "not run", never as passed
#   KVPORT_PYTHON           the Python with PyTorch and Triton (default python3)
#   KVPORT_GPU_CHECK_TIME_SCALE  multiplies every step's time limit (default 1;
#                           the tests set it for sanitizer builds)
set -euo pipefail

usage() { sed -n '/^# Usage:/,/^set -euo/{/^set/d;s/^# \{0,1\}//p}' "${BASH_SOURCE[0]}"; }

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
peer_dir=""
build_info=""
while [ $# -gt 0 ]; do
  case "$1" in
    --peer-dir) peer_dir="${2:?--peer-dir needs a value}"; shift 2 ;;
    --build-info) build_info="${2:?--build-info needs a value}"; shift 2 ;;
    -h | --help) usage; exit 0 ;;
    -*) echo "checks.sh: unknown option '$1'" >&2; usage >&2; exit 2 ;;
    *) break ;;
  esac
done
if [ $# -ne 2 ]; then
  usage >&2
  exit 2
fi
if [ ! -d "$1" ]; then
  echo "checks.sh: BIN_DIR '$1' is not a directory" >&2
  exit 2
fi
bin="$(cd "$1" && pwd)"
mkdir -p "$2"
out="$(cd "$2" && pwd)"
python="${KVPORT_PYTHON:-python3}"
# The binaries in BIN_DIR and the flags below settle these, not the caller.
unset KVPORT_CONFORMANCE KVPORT_BACKEND

steps="${KVPORT_GPU_CHECK_STEPS:-conformance,bench,peer}"
want_conformance=0 want_bench=0 want_peer=0
IFS=',' read -r -a step_list <<< "$steps"
for s in "${step_list[@]}"; do
  case "$s" in
    conformance) want_conformance=1 ;;
    bench) want_bench=1 ;;
    peer) want_peer=1 ;;
    *) echo "checks.sh: KVPORT_GPU_CHECK_STEPS: unknown step '$s' (conformance, bench, peer)" >&2; exit 2 ;;
  esac
done

scale="${KVPORT_GPU_CHECK_TIME_SCALE:-1}"
case "$scale" in
  '' | *[!0-9]* | 0*) echo "checks.sh: KVPORT_GPU_CHECK_TIME_SCALE: '$scale' is not a positive integer" >&2; exit 2 ;;
esac

# A reused OUT_DIR must not lend this run an old result.
(cd "$out" && rm -f summary.txt header.txt steps.tsv conformance.json conformance.err \
  conformance-cuda.gtest.json conformance-cuda.log bench-kvport.json bench-kvport.err \
  bench-gbench.json bench-gbench.log bench-hosttier.json bench-hosttier.log torch.json \
  peer-torch.log peer-compare.txt peer-compare.err)

start=$SECONDS

# run_step NAME LIMIT_S STDOUT STDERR COMMAND...: runs COMMAND under timeout
# with its output in OUT_DIR and appends its line to steps.tsv. timeout puts
# the command in its own process group and signals the whole group, so a
# step's children (kvport conformance runs kvport_conformance) go with it.
run_step() {
  local name=$1 limit=$(($2 * scale)) stdout=$3 stderr=$4
  shift 4
  local t0=$SECONDS rc=0 status=ok
  echo "checks: $name (limit $limit s)" >&2
  if [ "$stdout" = "$stderr" ]; then
    timeout --kill-after=10 "$limit" "$@" > "$out/$stdout" 2>&1 || rc=$?
  else
    timeout --kill-after=10 "$limit" "$@" > "$out/$stdout" 2> "$out/$stderr" || rc=$?
  fi
  if [ "$rc" -eq 124 ] || [ "$rc" -eq 137 ]; then
    status=timeout
  elif [ "$rc" -ne 0 ]; then
    status=failed
  fi
  printf '%s\t%s\t%s\t%s\t%s\n' "$name" "$status" "$rc" "$((SECONDS - t0))" "" >> "$out/steps.tsv"
}

# skip_step NAME WHY
skip_step() {
  echo "checks: $1 not run: $2" >&2
  printf '%s\tskipped\t-\t0\t%s\n' "$1" "$2" >> "$out/steps.tsv"
}

# ---- what ran where --------------------------------------------------------
: > "$out/steps.tsv"
runtime_version=""
{
  echo "date: $(date -u +%Y-%m-%dT%H:%M:%SZ)"
  echo "machine: $(uname -n), $(nproc) CPUs"
  echo "bin: $bin"
  if command -v nvidia-smi > /dev/null; then
    gpu="$(timeout 30 nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>&1 |
      head -4 | paste -sd ';' -)" || true
    echo "gpu: ${gpu:-nvidia-smi printed nothing}"
    driver_cuda="$(timeout 30 nvidia-smi 2>/dev/null | grep -o 'CUDA Version: *[0-9.]*' | grep -o '[0-9.]*$' | head -1)" || true
    echo "driver cuda version: ${driver_cuda:-unknown (nvidia-smi shows none)}"
  else
    echo "gpu: nvidia-smi not found (no NVIDIA driver on this machine)"
    driver_cuda=""
  fi
  if [ -n "$build_info" ] && [ -r "$build_info" ]; then
    runtime_version="$(sed -n 's/^cuda runtime: *\([0-9.]*\).*/\1/p' "$build_info" | head -1)"
    echo "cuda runtime: ${runtime_version:-unknown} (from BUILD_INFO; cudart is linked statically)"
    if [ -n "$driver_cuda" ] && [ -n "$runtime_version" ] &&
       [ "$(printf '%s\n%s\n' "$driver_cuda" "$runtime_version" | sort -V | head -1)" != "$runtime_version" ]; then
      echo "WARNING: the driver supports CUDA $driver_cuda, older than the runtime $runtime_version this was built with: expect 'driver insufficient' (error 35)"
    fi
    echo "build (BUILD_INFO):"
    sed 's/^/  /' "$build_info"
  else
    echo "build: no BUILD_INFO given"
  fi
  echo "steps: $steps"
} > "$out/header.txt"
cat "$out/header.txt" >&2

# ---- conformance -----------------------------------------------------------
if [ "$want_conformance" -eq 1 ]; then
  run_step conformance 60 conformance.json conformance.err \
    "$bin/kvport" conformance --suite "$bin/kvport_conformance" --json
  run_step conformance-cuda-gtest 45 conformance-cuda.log conformance-cuda.log \
    "$bin/kvport_conformance" --gtest_filter='*/cuda' \
    --gtest_output="json:$out/conformance-cuda.gtest.json"
else
  skip_step conformance "KVPORT_GPU_CHECK_STEPS=$steps"
  skip_step conformance-cuda-gtest "KVPORT_GPU_CHECK_STEPS=$steps"
fi

# ---- zeroing bench ---------------------------------------------------------
if [ "$want_bench" -eq 1 ]; then
  # --quick selects llama-3-8b and llama-3-70b; both layouts and both id
  # patterns (contiguous, scattered) are the default.
  run_step bench-kvport 45 bench-kvport.json bench-kvport.err \
    "$bin/kvport" bench --backend cuda --quick --batches 1,16,256 --repetitions 5 --json
  # The cuda cases only; each costs at most ~2.5 x min_time of device time
  # (benchmarks/zeroing_bench.cpp times all three strategies).
  run_step bench-gbench 60 bench-gbench.log bench-gbench.log \
    env KVPORT_LOG_LEVEL=warn "$bin/kvport_bench" --benchmark_filter='^Zeroing/cuda/' --benchmark_min_time=0.1 \
    --benchmark_out="$out/bench-gbench.json" --benchmark_out_format=json
  # The host tier's copies (benchmarks/host_tier_bench.cpp): 24 cases, each
  # at most ~2.5 x min_time of device time (the batch and the contiguous limit
  # are both timed), plus setting up four caches and their pinned host slots
  # (up to 2.5 GiB of pools and 1.25 GiB pinned at a time).
  run_step bench-hosttier 45 bench-hosttier.log bench-hosttier.log \
    env KVPORT_LOG_LEVEL=warn "$bin/kvport_bench" --benchmark_filter='^HostTier/cuda/' --benchmark_min_time=0.1 \
    --benchmark_out="$out/bench-hosttier.json" --benchmark_out_format=json
else
  skip_step bench-kvport "KVPORT_GPU_CHECK_STEPS=$steps"
  skip_step bench-gbench "KVPORT_GPU_CHECK_STEPS=$steps"
  skip_step bench-hosttier "KVPORT_GPU_CHECK_STEPS=$steps"
fi

# ---- the peer: PyTorch and Triton ------------------------------------------
peer_missing=""
for f in torch_zeroing.py compare.py; do
  if [ -z "$peer_dir" ] || [ ! -f "$peer_dir/$f" ]; then
    peer_missing="$peer_missing $f"
  fi
done
if [ "$want_peer" -eq 0 ]; then
  skip_step peer-torch "KVPORT_GPU_CHECK_STEPS=$steps"
  skip_step peer-compare "KVPORT_GPU_CHECK_STEPS=$steps"
elif [ -n "$peer_missing" ]; then
  why="peer scripts absent:$peer_missing not in ${peer_dir:-(no --peer-dir)}"
  skip_step peer-torch "$why"
  skip_step peer-compare "$why"
elif [ "$want_bench" -eq 0 ]; then
  skip_step peer-torch "needs the bench step's bench-kvport.json"
  skip_step peer-compare "needs the bench step's bench-kvport.json"
else
  run_step peer-torch 75 peer-torch.log peer-torch.log \
    "$python" "$peer_dir/torch_zeroing.py" --device cuda \
    --kvport-json "$out/bench-kvport.json" --out "$out/torch.json"
  run_step peer-compare 15 peer-compare.txt peer-compare.err \
    "$python" "$peer_dir/compare.py" --kvport "$out/bench-kvport.json" --torch "$out/torch.json"
fi

# ---- verdict ---------------------------------------------------------------
echo "checks: steps took $((SECONDS - start)) s" >&2
rc=0
verdict_python=python3
command -v python3 > /dev/null || verdict_python="$python"
if command -v "$verdict_python" > /dev/null; then
  "$verdict_python" "$here/verdict.py" "$out" || rc=$?
else
  { echo "VERDICT: FAIL: no python3 to run the verdict ($here/verdict.py)"; echo; cat "$out/header.txt"; } \
    > "$out/summary.txt"
  rc=1
fi
cat "$out/summary.txt"
if [ "$rc" -eq 0 ]; then
  exit 0
fi
exit 1
