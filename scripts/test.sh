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
status=0
ctest --preset "$preset" || status=$?
# ctest lists skipped tests (exit code 77) without their reason: print the
# reason lines they wrote ("SKIP: ..." / "SKIPPED: ..."), e.g. the PyTorch
# tests on a machine without python3-torch.
log="build/$preset/Testing/Temporary/LastTest.log"
if [ -f "$log" ] && grep -qE '^SKIP(PED)?: ' "$log"; then
  echo "Skipped tests, with their reasons:"
  grep -hE '^SKIP(PED)?: ' "$log" | sort -u | sed 's/^/  /'
fi
exit "$status"
