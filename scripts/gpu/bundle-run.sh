#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# The GPU proof from a bundle made by scripts/gpu-bundle.sh (this file is the
# bundle's run.sh). Needs only what the GPU machine has: the NVIDIA driver,
# bash, coreutils and python3 (with PyTorch and Triton for the peer step).
# Runs from wherever the bundle was copied to.
#
# Writes JSON, logs and summary.txt into OUT_DIR; summary.txt's first line is
# "VERDICT: PASS" or "VERDICT: FAIL: <why>". Exit status 0 on PASS, 1 on
# FAIL, 2 on bad usage. The steps' limits add up to 345 s.
#
# Usage: run.sh OUT_DIR
# Environment: KVPORT_GPU_CHECK_STEPS (default conformance,bench,peer),
# KVPORT_PYTHON (default python3); see gpu/checks.sh.
set -euo pipefail

if [ $# -ne 1 ] || [ "${1:0:1}" = "-" ]; then
  sed -n 's/^# \{0,1\}\(Usage:.*\)/\1/p' "${BASH_SOURCE[0]}" >&2
  exit 2
fi
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
export LD_LIBRARY_PATH="$here/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
exec "$here/gpu/checks.sh" --peer-dir "$here/peer" --build-info "$here/BUILD_INFO" "$here/bin" "$1"
