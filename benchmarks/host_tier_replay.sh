#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# The host tier's target on one Mooncake-format trace, in one run:
#   device-only 262,144 blocks (the reference)
#   device 65,536 + host 196,608, write-back, exclusive
#   device 65,536 + host 196,608, write-back, inclusive
#   device 65,536 + host 196,608, write-through, exclusive
#   device-only 65,536 blocks
# and prints, for each, the hit blocks, the device / host split, the hit rate,
# the ratio to the reference's hit blocks (target >= 0.95 with write-back),
# the offloaded / onloaded blocks and the modeled GB and seconds, as a
# Markdown table (docs/performance.md, "Host tier: replay").
#
# Usage: benchmarks/host_tier_replay.sh [options]
#   --bin PATH         kvport (default: build/host/bin/kvport of this checkout)
#   --trace FILE       a Mooncake trace (default: generate one with
#                      benchmarks/conversation_trace.py, --requests/--seed)
#   --requests N       requests of the generated trace (default 20000)
#   --seed S           its seed (default 1)
#   --device N         device blocks of the tier runs (default 65536)
#   --host N           host blocks (default 196608)
#   --jobs J           replays at once (default 1)
#   --workdir DIR      generated trace and JSON reports (default /tmp/kvport-host-tier)
#   -- ARGS...         more `kvport replay` flags for every run (e.g. --host-link-gbps 64)
# Exit status 0 when every run's invariants held and write-back exclusive met
# the 0.95 target, 1 otherwise. Writes nothing into the repository.
set -euo pipefail

repo="$(cd "$(dirname "$0")/.." && pwd)"
bin="$repo/build/host/bin/kvport" trace="" requests=20000 seed=1
device=65536 host=196608 jobs=1 workdir=/tmp/kvport-host-tier
extra=()
while [ $# -gt 0 ]; do
  case "$1" in
    --bin) bin="$2"; shift 2 ;;
    --trace) trace="$2"; shift 2 ;;
    --requests) requests="$2"; shift 2 ;;
    --seed) seed="$2"; shift 2 ;;
    --device) device="$2"; shift 2 ;;
    --host) host="$2"; shift 2 ;;
    --jobs) jobs="$2"; shift 2 ;;
    --workdir) workdir="$2"; shift 2 ;;
    --) shift; extra=("$@"); break ;;
    *) echo "host_tier_replay.sh: unknown option '$1'" >&2; exit 2 ;;
  esac
done
[ -x "$bin" ] || { echo "host_tier_replay.sh: no kvport at $bin (build target kvport)" >&2; exit 1; }
mkdir -p "$workdir"
if [ -z "$trace" ]; then
  trace="$workdir/conversation_r${requests}_s${seed}.jsonl"
  if [ ! -s "$trace" ]; then
    python3 "$repo/benchmarks/conversation_trace.py" "$trace" --requests "$requests" --seed "$seed"
  fi
fi
total=$((device + host))

# name|flags
runs=(
  "device-only-$total|--capacity-blocks $total"
  "write-back-exclusive|--capacity-blocks $device --host-tier-blocks $host --tier-policy write-back --tier-inclusion exclusive"
  "write-back-inclusive|--capacity-blocks $device --host-tier-blocks $host --tier-policy write-back --tier-inclusion inclusive"
  "write-through-exclusive|--capacity-blocks $device --host-tier-blocks $host --tier-policy write-through --tier-inclusion exclusive"
  "device-only-$device|--capacity-blocks $device"
)

echo "kvport: $bin"
echo "trace: $trace ($(wc -l < "$trace") requests)"
echo "machine: $(uname -srm), $(nproc) CPUs; load $(cut -d' ' -f1-3 /proc/loadavg)"
run_one() {
  local name="${1%%|*}" flags="${1#*|}"
  # shellcheck disable=SC2086
  "$bin" replay --trace "$trace" $flags --json --no-progress "${extra[@]}" > "$workdir/$name.json"
}
pids=()
for r in "${runs[@]}"; do
  run_one "$r" &
  pids+=("$!")
  if [ "${#pids[@]}" -ge "$jobs" ]; then wait "${pids[0]}"; pids=("${pids[@]:1}"); fi
done
for p in "${pids[@]}"; do wait "$p"; done

names=()
for r in "${runs[@]}"; do names+=("${r%%|*}"); done
python3 - "$workdir" "${names[@]}" <<'PY'
import json, sys
workdir, names = sys.argv[1], sys.argv[2:]
runs = {n: json.load(open(f"{workdir}/{n}.json")) for n in names}
ref = runs[names[0]]["hit_blocks"]
print(f"prompt blocks {runs[names[0]]['prompt_blocks']}; reference: {names[0]}, "
      f"{ref} hit blocks")
print()
print("| run | hit blocks | device hits | host hits | hit rate | ratio | offloaded | onloaded "
      "| offload GB | onload GB | transfer s | invariants |")
print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|")
ok = True
for n in names:
    j = runs[n]
    tier = "host_tier_blocks" in j
    dev = j.get("device_hit_blocks", j["hit_blocks"])
    cells = [n, j["hit_blocks"], dev, j.get("host_hit_blocks", 0),
             f"{100 * j['hit_rate']:.1f}%", f"{j['hit_blocks'] / ref:.4f}" if ref else "-"]
    if tier:
        cells += [j["offloaded_blocks"], j["onloaded_blocks"],
                  f"{j['modeled_offload_bytes'] / 1e9:.0f}", f"{j['modeled_onload_bytes'] / 1e9:.0f}",
                  f"{j['modeled_transfer_s']:.1f}"]
    else:
        cells += ["-"] * 5
    cells.append("ok" if j["ok"] else "FAILED")
    ok = ok and j["ok"]
    print("| " + " | ".join(str(c) for c in cells) + " |")
print()
for n in names:
    j = runs[n]
    if "tier_counters" in j:
        c = j["tier_counters"]
        sim_s = j["simulated_ms"] / 1000
        print(f"{n}: {j['model']} {j['model_block_bytes']} B/block at {j['host_link_gbps']:g} GB/s; "
              f"link busy {100 * j['modeled_offload_s'] / sim_s:.1f}% (to host) and "
              f"{100 * j['modeled_onload_s'] / sim_s:.1f}% (to device) of {sim_s:.0f} simulated s; "
              f"replay wall {j['wall_s']:.1f} s; "
              + ", ".join(f"{k} {v}" for k, v in c.items() if not k.endswith("bytes")))
wb = runs["write-back-exclusive"]["hit_blocks"] / ref if ref else 0.0
print(f"\nwrite-back exclusive / device-only: {wb:.4f} (target >= 0.95: "
      f"{'met' if wb >= 0.95 else 'MISSED'})")
sys.exit(0 if ok and wb >= 0.95 else 1)
PY
