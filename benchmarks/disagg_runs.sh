#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# Runs `kvport disagg` (llama-3-8b blocks, 2 MiB each) in the configurations
# docs/performance.md reports ("Block transfer"), one after the other, and
# prints one line per run: transfers, GB/s of the pulls of >= 16 blocks, the
# raw UCX figure of the same run and the ratio, latency, verification
# failures, leaked blocks, and for the kills the loss detection time.
# Usage: benchmarks/disagg_runs.sh [--kvport BIN] [--trace F] [--requests N] [--out DIR]
set -euo pipefail
cd "$(dirname "$0")/.."
kvport=build/host/bin/kvport
trace=tests/data/mooncake_small.jsonl
requests=40
out=/tmp/kvport-disagg-runs
while [ $# -gt 0 ]; do
  case "$1" in
    --kvport) kvport="$2"; shift 2 ;;
    --trace) trace="$2"; shift 2 ;;
    --requests) requests="$2"; shift 2 ;;
    --out) out="$2"; shift 2 ;;
    *) echo "disagg_runs.sh: unknown option '$1'" >&2; exit 2 ;;
  esac
done
mkdir -p "$out"
runs=(
  "1x1|"
  "1x1 block-major|--layout block-major"
  "TP2 -> TP1|--tp-prefill 2 --tp-decode 1"
  "TP1 -> TP2|--tp-prefill 1 --tp-decode 2"
  "2 prefill x 2 decode|--prefill 2 --decode 2"
  "kill prefill (2 prefill)|--prefill 2 --kill prefill --after 10"
  "kill prefill (TP2 group)|--tp-prefill 2 --kill prefill --after 10"
  "kill decode (2 decode)|--decode 2 --kill decode --after 10"
  "kill the only decode|--kill decode --after 10"
)
i=0
for run in "${runs[@]}"; do
  name="${run%%|*}"
  args="${run#*|}"
  i=$((i + 1))
  # shellcheck disable=SC2086
  "$kvport" disagg --trace "$trace" --capacity-blocks 512 --requests "$requests" $args --json \
    > "$out/run$i.json" 2> "$out/run$i.err" || true
  python3 - "$name" "$out/run$i.json" <<'EOF'
import json, sys
name, path = sys.argv[1], sys.argv[2]
try:
    r = json.load(open(path))
except ValueError:
    print(f"{name:28s} no report (see {path[:-5]}.err)")
    sys.exit(0)
kill = r.get("kill") or {}
loss = f"{kill['loss_detected_ms_max']:.0f} ms" if kill.get("performed") else "-"
print(f"{name:28s} ok={r['ok']!s:5s} done={r['requests_completed']}/{r['requests']} "
      f"xfers={r['transfers']:3d} recomputed={r['requests_recomputed']:2d} "
      f"GB/s={r['bulk_transfer_gbps']:.2f} raw={r['raw_ucx']['gbps']:.2f} "
      f"ratio={r['ratio_vs_raw']:.2f} idle_raw={r['raw_ucx']['idle_gbps']:.2f} "
      f"p50={r['transfer_latency_ms']['p50']:.0f}ms p99={r['transfer_latency_ms']['p99']:.0f}ms "
      f"wrong={r['verification_failures']} leaked={r['leaked_blocks']} loss={loss} "
      f"wall={r['wall_seconds']:.1f}s")
EOF
done
