#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# `kvport replay` of a large generated conversation trace, an old and a new
# binary side by side: they run alternately (old, new, old, new, ...) on the
# same trace, so both see the same machine load; the medians and their ratio
# are printed. The two runs must report the same simulation (hits, evictions,
# steps, ...): only the timing fields may differ.
#
# Usage: benchmarks/replay_large.sh [options]
#   --old-bin PATH     the old kvport (default: build --old-commit in a git worktree)
#   --old-commit REV   commit to build when --old-bin is not given (default 311abaf)
#   --new-bin PATH     the new kvport (default: build/host/bin/kvport of this checkout)
#   --runs N           runs of each binary (default 5)
#   --requests N       requests in the trace (default 20000: ~11.7 M prompt blocks)
#   --seed S           trace seed (default 1)
#   --capacity N       --capacity-blocks (default 262144)
#   --workdir DIR      trace, old worktree and build (default /tmp/kvport-replay-large)
# Writes nothing into the repository; the trace (~4 MB) stays in --workdir.
set -euo pipefail

repo="$(cd "$(dirname "$0")/.." && pwd)"
old_bin="" old_commit=311abaf new_bin="$repo/build/host/bin/kvport"
runs=5 requests=20000 seed=1 capacity=262144 workdir=/tmp/kvport-replay-large
while [ $# -gt 0 ]; do
  case "$1" in
    --old-bin) old_bin="$2"; shift 2 ;;
    --old-commit) old_commit="$2"; shift 2 ;;
    --new-bin) new_bin="$2"; shift 2 ;;
    --runs) runs="$2"; shift 2 ;;
    --requests) requests="$2"; shift 2 ;;
    --seed) seed="$2"; shift 2 ;;
    --capacity) capacity="$2"; shift 2 ;;
    --workdir) workdir="$2"; shift 2 ;;
    *) echo "replay_large.sh: unknown option '$1'" >&2; exit 2 ;;
  esac
done
mkdir -p "$workdir"

if [ -z "$old_bin" ]; then
  old_src="$workdir/old-$old_commit"
  if [ ! -d "$old_src" ]; then
    git -C "$repo" worktree add --detach "$old_src" "$old_commit"
  fi
  if [ ! -x "$old_src/build/host/bin/kvport" ]; then
    (cd "$old_src" &&
      cmake --preset host -DKVPORT_BUILD_TESTS=OFF -DKVPORT_BUILD_BENCHMARKS=OFF > /dev/null &&
      cmake --build build/host --target kvport)
  fi
  old_bin="$old_src/build/host/bin/kvport"
fi
[ -x "$old_bin" ] || { echo "replay_large.sh: no old binary at $old_bin" >&2; exit 1; }
[ -x "$new_bin" ] || { echo "replay_large.sh: no new binary at $new_bin (build target kvport)" >&2; exit 1; }

trace="$workdir/conversation_r${requests}_s${seed}.jsonl"
if [ ! -s "$trace" ]; then
  python3 "$repo/benchmarks/conversation_trace.py" "$trace" --requests "$requests" --seed "$seed"
fi

echo "old: $old_bin"
echo "new: $new_bin"
echo "trace: $trace ($(wc -l < "$trace") requests), --capacity-blocks $capacity"
echo "load before: $(uptime)"

# One run: prints "<wall s> <CPU s (user + sys)> <the replay's own wall_s> <fingerprint> ...".
# CPU time is the steadier figure on a shared machine: wall time also counts
# the time the process waited for a core.
# A binary that has --full-prefix-hits (the engine-safe default hits a
# fully cached prompt's last token again) runs with it, so that both simulate
# the old semantics and their results can be compared.
run_one() {
  python3 - "$1" "$trace" "$capacity" <<'PY'
import hashlib, json, os, subprocess, sys, time
binary, trace, capacity = sys.argv[1:4]
extra = []
if b"--full-prefix-hits" in subprocess.run([binary, "replay", "--help"], capture_output=True).stdout:
    extra = ["--full-prefix-hits"]
start = time.perf_counter()
p = subprocess.Popen([binary, "replay", "--trace", trace, "--capacity-blocks", capacity, "--json"] + extra,
                     stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
out = p.stdout.read()
_, status, usage = os.wait4(p.pid, 0)
wall = time.perf_counter() - start
if status != 0: sys.exit(f"{binary} replay failed (status {status})")
r = json.loads(out)
if not r.get("ok"): sys.exit("replay failed: " + json.dumps(r))
timing = {"wall_s", "requests_per_s", "operations_per_s", "trace",
          "prefix_hit_mode", "last_block_copies"}  # the last two: new fields only
core = {k: v for k, v in r.items() if k not in timing}
print("%.3f %.3f %.3f %s hit_rate=%.4f evictions=%d" % (
    wall, usage.ru_utime + usage.ru_stime, r["wall_s"],
    hashlib.sha1(json.dumps(core, sort_keys=True).encode()).hexdigest()[:12],
    r["hit_rate"], r["evictions"]))
PY
}

old_walls=() new_walls=() old_cpu=() new_cpu=() prints=()
for i in $(seq 1 "$runs"); do
  read -r w c s fp rest < <(run_one "$old_bin")
  old_walls+=("$w"); old_cpu+=("$c"); prints+=("$fp")
  echo "run $i old: ${w} s wall, ${c} s CPU (replay loop ${s} s) result $fp $rest"
  read -r w c s fp rest < <(run_one "$new_bin")
  new_walls+=("$w"); new_cpu+=("$c"); prints+=("$fp")
  echo "run $i new: ${w} s wall, ${c} s CPU (replay loop ${s} s) result $fp $rest"
done
echo "load after: $(uptime)"

if [ "$(printf '%s\n' "${prints[@]}" | sort -u | wc -l)" -ne 1 ]; then
  echo "replay_large.sh: the old and new binaries simulated different results" >&2
  exit 1
fi
median() { printf '%s\n' "$@" | sort -g | awk '{ v[NR] = $1 } END { print (NR % 2) ? v[(NR + 1) / 2] : (v[NR / 2] + v[NR / 2 + 1]) / 2 }'; }
mo=$(median "${old_walls[@]}") mn=$(median "${new_walls[@]}")
co=$(median "${old_cpu[@]}") cn=$(median "${new_cpu[@]}")
echo "median wall: old ${mo} s, new ${mn} s, old/new = $(awk -v a="$mo" -v b="$mn" 'BEGIN { printf "%.2f", a / b }')x"
echo "median CPU:  old ${co} s, new ${cn} s, old/new = $(awk -v a="$co" -v b="$cn" 'BEGIN { printf "%.2f", a / b }')x"
