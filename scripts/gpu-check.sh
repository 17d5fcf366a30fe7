#!/usr/bin/env bash
# The whole GPU check in one step, on a machine with an NVIDIA GPU and the
# CUDA toolkit: build the `cuda` preset, run the conformance suite on the cuda
# backend (and host, for comparison), run the zeroing benchmark when it is
# built, and write JSON and logs into OUT_DIR. Finishes in well under 8
# minutes on a 16-core machine.
#
# Usage: scripts/gpu-check.sh OUT_DIR
set -uo pipefail
cd "$(dirname "$0")/.."
out="${1:?usage: scripts/gpu-check.sh OUT_DIR}"
mkdir -p "$out"
out="$(cd "$out" && pwd)"
start=$SECONDS
step() { echo "=== $* ($((SECONDS - start)) s)" | tee -a "$out/summary.txt"; }
status=0

{
  echo "date: $(date -u +%Y-%m-%dT%H:%M:%SZ)"
  echo "commit: $(git rev-parse --short HEAD 2>/dev/null || echo unknown)"
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>&1 | sed 's/^/gpu: /'
  /usr/local/cuda/bin/nvcc --version 2>&1 | tail -1 | sed 's/^/nvcc: /'
} | tee "$out/summary.txt"

step "configure + build the cuda preset"
if ! { cmake --preset cuda -DKVPORT_BUILD_BENCHMARKS=ON &&
       cmake --build --preset cuda -j "$(nproc)"; } > "$out/build.log" 2>&1; then
  tail -40 "$out/build.log"
  step "BUILD FAILED (see build.log)"
  exit 1
fi

step "conformance suite (cuda and host)"
build/cuda/bin/kvport conformance --json > "$out/conformance.json" 2> "$out/conformance.err"
rc=$?
build/cuda/bin/kvport conformance | tee -a "$out/summary.txt"
[ $rc -eq 0 ] || status=1
build/cuda/bin/kvport_conformance --gtest_filter='Backends/Conformance.*/cuda' \
  --gtest_output="json:$out/conformance-gtest.json" > "$out/conformance.log" 2>&1 || status=1

if [ -x build/cuda/bin/kvport_bench ]; then
  step "zeroing benchmark"
  KVPORT_BACKEND=cuda timeout 300 build/cuda/bin/kvport_bench --benchmark_filter='Zero' \
    --benchmark_out="$out/bench.json" --benchmark_out_format=json > "$out/bench.log" 2>&1 || status=1
  build/cuda/bin/kvport bench --backend cuda --quick --batches 1,256 --json > "$out/bench-quick.json" 2>> "$out/bench.log" || status=1
  build/cuda/bin/kvport bench --backend cuda --quick --batches 1,256 >> "$out/summary.txt" 2>&1 || status=1
fi

step "done, status $status"
exit $status
