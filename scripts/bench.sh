#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# Builds a preset's Google Benchmark suite (kvport_bench), runs it and writes
# into docs/benchmarks/:
#   <preset>.json          Google Benchmark's JSON (every repetition)
#   <preset>.md            markdown tables: zeroing strategies and ratios, core ops in ns/op
#   <preset>-zeroing.png   zeroing throughput against batch size, (a) (b) (c)
# Takes a few minutes on the host preset of a 2-core machine. Run it on a quiet
# machine: numbers taken under load are meaningless (the load average is
# printed first and recorded in the JSON).
#
# Usage: scripts/bench.sh [preset]   (default host; cuda on an NVIDIA machine)
# Environment: KVPORT_BENCH_REPETITIONS (default 3), KVPORT_BENCH_MIN_TIME in
# seconds per repetition (default 0.1), KVPORT_BENCH_FILTER (a
# --benchmark_filter regex, default all).
set -euo pipefail
cd "$(dirname "$0")/.."
preset="${1:-host}"
repetitions="${KVPORT_BENCH_REPETITIONS:-3}"
min_time="${KVPORT_BENCH_MIN_TIME:-0.1}"
filter="${KVPORT_BENCH_FILTER:-.}"

case "$preset" in
  asan | tsan)
    echo "bench.sh: '$preset' builds with sanitizers; its timings mean nothing (use host or cuda)" >&2
    exit 2
    ;;
esac

scripts/deps.sh --plots
# The ci preset turns the benchmarks off; every other preset builds them.
cmake --preset "$preset" -DKVPORT_BUILD_BENCHMARKS=ON
cmake --build --preset "$preset" --target kvport_bench

out=docs/benchmarks
mkdir -p "$out"
bench_cmd=(build/"$preset"/bin/kvport_bench
  --benchmark_filter="$filter"
  --benchmark_repetitions="$repetitions"
  --benchmark_min_time="$min_time"
  --benchmark_display_aggregates_only=true
  --benchmark_out="$out/$preset.json" --benchmark_out_format=json)
echo "bench.sh: $(nproc) CPUs, load average $(cut -d' ' -f1-3 /proc/loadavg)"
echo "bench.sh: KVPORT_LOG_LEVEL=warn ${bench_cmd[*]}"
start=$SECONDS
KVPORT_LOG_LEVEL=warn "${bench_cmd[@]}"
echo "bench.sh: the suite took $((SECONDS - start)) s"

# Debian's python3, where deps.sh --plots installs matplotlib (a python3 of
# pyenv or a virtualenv earlier in PATH may lack it).
python=python3
if ! python3 -c 'import matplotlib' 2>/dev/null && [ -x /usr/bin/python3 ]; then
  python=/usr/bin/python3
fi
"$python" scripts/bench_report.py "$out/$preset.json" --preset "$preset" \
  --markdown "$out/$preset.md" --plot "$out/$preset-zeroing.png" \
  --command "scripts/bench.sh $preset  # KVPORT_LOG_LEVEL=warn ${bench_cmd[*]}"
