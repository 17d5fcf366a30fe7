#!/usr/bin/env bash
# Builds the host preset and runs the whole test suite through ctest.
# Usage: scripts/test.sh [preset]   (host by default; asan and tsan work too)
set -euo pipefail
cd "$(dirname "$0")/.."
preset="${1:-host}"

scripts/deps.sh
cmake --preset "$preset"
cmake --build --preset "$preset"
ctest --preset "$preset"
