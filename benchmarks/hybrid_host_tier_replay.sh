#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# The host tier's target for hybrid models: for each model, on one
# Mooncake-format trace, in one run:
#   device-only, 4x the memory                     (the reference)
#   device 1x + host tier of 3x, write-back, exclusive
#   device-only, 1x
# where 1x is 65,536 blocks of the model's attention layers
# (sim::model_block_bytes: 65,536 + 196,608 against 262,144, as the host
# tier's measurement of a model without groups). Prints, for each, the hit tokens
# over the KV cache groups, the share that used the host, and the ratio to the
# reference (target >= 0.95), as a Markdown table (docs/performance.md).
#
# Usage: benchmarks/hybrid_host_tier_replay.sh [--bin PATH] [--trace FILE]
#        [--requests N] [--seed S] [--models "m1 m2"] [--workdir DIR]
# Exit status 0 when every run's invariants held and every model met 0.95.
set -euo pipefail

repo="$(cd "$(dirname "$0")/.." && pwd)"
bin="$repo/build/host/bin/kvport" trace="" requests=20000 seed=1
models="gpt-oss-120b nemotron-h-8b" workdir=/tmp/kvport-hybrid-host-tier
while [ $# -gt 0 ]; do
  case "$1" in
    --bin) bin="$2"; shift 2 ;;
    --trace) trace="$2"; shift 2 ;;
    --requests) requests="$2"; shift 2 ;;
    --seed) seed="$2"; shift 2 ;;
    --models) models="$2"; shift 2 ;;
    --workdir) workdir="$2"; shift 2 ;;
    *) echo "hybrid_host_tier_replay.sh: unknown option '$1'" >&2; exit 2 ;;
  esac
done
[ -x "$bin" ] || { echo "hybrid_host_tier_replay.sh: no kvport at $bin" >&2; exit 1; }
mkdir -p "$workdir"
if [ -z "$trace" ]; then
  trace="$workdir/conversation_r${requests}_s${seed}.jsonl"
  [ -s "$trace" ] || python3 "$repo/benchmarks/conversation_trace.py" "$trace" \
    --requests "$requests" --seed "$seed" >&2
fi
echo "kvport: $bin"
echo "trace: $trace ($(wc -l < "$trace") requests)"
echo "machine: $(uname -srm), $(nproc) CPUs; load $(cut -d' ' -f1-3 /proc/loadavg)"
echo
echo "| model | run | device | host | hit tokens | hit rate | hits using the host | hits decided again | ratio to 4x device-only |"
echo "|---|---|---|---|---|---|---|---|---|"
status=0
for m in $models; do
  # The model's block bytes (attention layers): bytes_per_block of its
  # block groups, from `kvport plan --json`.
  unit=$("$bin" plan --model "$m" --memory 1GiB --json | python3 -c '
import json, sys
j = json.load(sys.stdin)
print(sum(g["bytes_per_block"] for g in j["groups"] if g["bytes_per_request"] == 0))')
  x=$((65536 * unit))
  "$bin" replay --trace "$trace" --model "$m" --memory $((4 * x)) --json --no-progress \
    > "$workdir/$m-dev4.json"
  "$bin" replay --trace "$trace" --model "$m" --memory "$x" --host-tier-blocks 196608 --json \
    --no-progress > "$workdir/$m-tier.json"
  "$bin" replay --trace "$trace" --model "$m" --memory "$x" --json --no-progress \
    > "$workdir/$m-dev1.json"
  python3 - "$workdir" "$m" <<'PY' || status=1
import json, sys
d, m = sys.argv[1], sys.argv[2]
runs = [("device-only 4x", "dev4", "4x", "-"), ("device 1x + host 3x", "tier", "1x", "3x"),
        ("device-only 1x", "dev1", "1x", "-")]
res = {k: json.load(open(f"{d}/{m}-{k}.json"))["groups"] for _, k, _, _ in runs}
ok = all(r["invariants_ok"] for r in res.values())
ref = res["dev4"]["hit_tokens"]
for name, k, dev, host in runs:
    r = res[k]
    ratio = r["hit_tokens"] / ref if ref else 0.0
    via = r.get("host_hit_tokens", 0) / r["prompt_tokens"] if r["prompt_tokens"] else 0.0
    print(f"| {m} | {name} | {dev} | {host} | {r['hit_tokens']:,} | {100 * r['hit_rate']:.1f}% "
          f"| {100 * via:.1f}% | {r.get('short_hits', 0)} | {ratio:.4f} |")
tier = res["tier"]["hit_tokens"] / ref if ref else 1.0
sys.exit(0 if ok and tier >= 0.95 else 1)
PY
done
exit $status
