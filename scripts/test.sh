#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# Builds the host preset and runs the whole test suite through ctest; exits
# with ctest's status.
# Usage: scripts/test.sh [preset]   (host by default; asan, tsan, and with
# the CUDA toolkit installed, cuda and ci work too)
set -euo pipefail
cd "$(dirname "$0")/.."
preset="${1:-host}"

case "$preset" in
  hip | ci) scripts/deps.sh --hip ;;      # Debian's hipcc + libamdhip64-dev
  asan | tsan) scripts/deps.sh --clang ;;  # the sanitizer presets compile with clang 15
  *) scripts/deps.sh ;;
esac
cmake --preset "$preset"
cmake --build --preset "$preset"
# ctest's own listing pads every name with dots to the longest one: it goes
# to build/<preset>/ctest-output.log, and ctest_report.py prints what is worth
# reading (tests that did not pass as they finish, progress, a summary per
# label, each failure's output in full, the reasons for skips). The exit
# status is ctest's.
dir="$PWD/build/$preset"
tests_json="$dir/ctest-tests.json"
ctest --preset "$preset" --show-only=json-v1 >"$tests_json" 2>/dev/null || echo '{}' >"$tests_json"
set +e
ctest --preset "$preset" --output-junit "$dir/ctest-junit.xml" 2>&1 |
  python3 scripts/ctest_report.py --junit "$dir/ctest-junit.xml" --tests "$tests_json" \
    --log "$dir/ctest-output.log"
statuses=("${PIPESTATUS[@]}")
set -e
status=${statuses[0]}
if [ "${statuses[1]}" != 0 ]; then
  echo "scripts/ctest_report.py failed (${statuses[1]}); ctest's output: $dir/ctest-output.log"
fi
exit "$status"
