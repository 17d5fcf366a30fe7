#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# Builds the libFuzzer targets (the `fuzz` preset: clang with
# -fsanitize=fuzzer,address,undefined) and fuzzes the core for a bounded time,
# then the KV event decoder for a quarter of it (at most 30 s).
# Usage: scripts/fuzz.sh [seconds] [extra libFuzzer flags...]   (default 60 s)
#
# The run starts from the committed seed corpus (tests/fuzz/corpus), replays
# it first, and keeps what it finds in build/fuzz/corpus. A crash input lands
# in build/fuzz/artifacts/ and the script exits non-zero. To add new finds to
# the committed corpus, minimized:
#   build/fuzz/bin/kvport_fuzz_kv -merge=1 tests/fuzz/corpus build/fuzz/corpus
# The run passes -entropic=0 (libFuzzer's plain schedule instead of the
# entropic one): the entropic schedule's per-execution feature bookkeeping
# took a third of the CPU time (docs/reliability.md, "Speed"), and without it
# the same 60 s make about 1.4x the operations at the same coverage. Pass
# -entropic=1 to get the entropic schedule back (a later flag wins).
# KVPORT_FUZZ_WORK=DIR keeps the corpus, artifacts and log of the run in DIR
# instead of build/fuzz (so that a long run and a short one can go side by
# side).
set -euo pipefail
cd "$(dirname "$0")/.."
seconds="${1:-60}"
shift || true
work="${KVPORT_FUZZ_WORK:-build/fuzz}"

scripts/deps.sh --fuzz
cmake --preset fuzz
cmake --build --preset fuzz

mkdir -p "$work/corpus" "$work/artifacts"
log="$work/last-run.log"
echo "fuzz: ${seconds} s from tests/fuzz/corpus ($(ls tests/fuzz/corpus | wc -l) seeds)"
status=0
build/fuzz/bin/kvport_fuzz_kv "$work/corpus" tests/fuzz/corpus \
  -max_total_time="$seconds" -max_len=2562 -timeout=10 -rss_limit_mb=4096 \
  -artifact_prefix="$work/artifacts/" -print_final_stats=1 -entropic=0 "$@" 2>"$log" || status=$?
grep -E "^(stat::|Done|INFO: seed corpus|kvport fuzz: [0-9])" "$log" || true
if [ "$status" -ne 0 ]; then
  tail -n 40 "$log"
  echo "fuzz: FAILED (exit $status); the input is in $work/artifacts/" >&2
  exit "$status"
fi

# Then the KV event decoder (kvport_fuzz_events: decode, re-encode in both
# forms, decode equal) for a quarter of the time, at most 30 s, from its own
# committed corpus (tests/fuzz/corpus_events).
events_seconds=$(( seconds / 4 < 30 ? seconds / 4 : 30 ))
if [ "$events_seconds" -gt 0 ]; then
  mkdir -p "$work/corpus_events"
  elog="$work/last-run-events.log"
  echo "fuzz: the event decoder, ${events_seconds} s"
  build/fuzz/bin/kvport_fuzz_events "$work/corpus_events" tests/fuzz/corpus_events \
    -max_total_time="$events_seconds" -timeout=10 -rss_limit_mb=2048 \
    -artifact_prefix="$work/artifacts/" -print_final_stats=1 2>"$elog" || status=$?
  grep -E "^(stat::number_of_executed_units|Done)" "$elog" || true
  if [ "$status" -ne 0 ]; then
    tail -n 40 "$elog"
    echo "fuzz: the event decoder FAILED (exit $status); the input is in $work/artifacts/" >&2
    exit "$status"
  fi
fi
echo "fuzz: OK"
