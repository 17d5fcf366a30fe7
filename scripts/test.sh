#!/usr/bin/env bash
# Builds the host preset and runs the whole test suite through ctest.
# Usage: scripts/test.sh [preset]   (host by default; asan, tsan, and with
# the CUDA toolkit installed, cuda and ci work too)
set -euo pipefail
cd "$(dirname "$0")/.."
preset="${1:-host}"

case "$preset" in
  hip | ci) scripts/deps.sh --hip ;;  # Debian's hipcc + libamdhip64-dev
  *) scripts/deps.sh ;;
esac
cmake --preset "$preset"
cmake --build --preset "$preset"
ctest --preset "$preset"
