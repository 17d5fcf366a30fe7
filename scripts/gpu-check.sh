#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# The GPU proof from source, on an NVIDIA machine that has the CUDA toolkit AND
# the Debian packages kvport builds with (scripts/deps.sh). A machine without
# them (the lent H200) runs the bundle instead: scripts/gpu-bundle.sh here,
# then build/gpu-bundle/run.sh OUT_DIR there (docs/backends.md).
#
# First a preflight that names every missing tool and package at once, then
# the `cuda` preset is built (benchmarks on) and scripts/gpu/checks.sh runs
# the same steps and verdict as the bundle: OUT_DIR/summary.txt's first line
# is "VERDICT: PASS" or "VERDICT: FAIL: <why>".
#
# Usage: scripts/gpu-check.sh OUT_DIR
# Exit status: 0 PASS, 1 FAIL (or a failed preflight or build), 2 bad usage.
# Environment: KVPORT_GPU_CHECK_STEPS, KVPORT_PYTHON (see scripts/gpu/checks.sh),
# KVPORT_BUILD_JOBS (default nproc).
set -euo pipefail
cd "$(dirname "$0")/.."
if [ $# -ne 1 ] || [ "${1:0:1}" = "-" ]; then
  echo "usage: scripts/gpu-check.sh OUT_DIR" >&2
  exit 2
fi
mkdir -p "$1"
out="$(cd "$1" && pwd)"

# ---- preflight: everything missing, in one message --------------------------
missing=()
for tool in cmake ninja g++ python3 timeout strip; do
  command -v "$tool" > /dev/null || missing+=("tool $tool")
done
nvcc="${CUDACXX:-}"
[ -n "$nvcc" ] || nvcc="$(command -v nvcc || true)"
[ -n "$nvcc" ] || nvcc=/usr/local/cuda/bin/nvcc
[ -x "$nvcc" ] || missing+=("tool nvcc (the CUDA toolkit; looked in \$CUDACXX, PATH and /usr/local/cuda/bin)")
if command -v cmake > /dev/null; then
  v="$(cmake --version | sed -n 's/^cmake version \([0-9.]*\).*/\1/p')"
  if [ "$(printf '%s\n3.25\n' "$v" | sort -V | head -1)" != 3.25 ]; then
    missing+=("tool cmake >= 3.25 (found $v)")
  fi
fi
# Debian package, and a file it installs: a package counts as present when
# dpkg says it is installed or the file is in a standard include directory
# (a machine without dpkg, or with the library built from source).
packages=(
  "libspdlog-dev spdlog/spdlog.h"
  "libfmt-dev fmt/format.h"
  "libxxhash-dev xxhash.h"
  "libabsl-dev absl/container/flat_hash_set.h"
  "libcli11-dev CLI/CLI.hpp"
  "nlohmann-json3-dev nlohmann/json.hpp"
  "libgtest-dev gtest/gtest.h"
  "libgmock-dev gmock/gmock.h"
  "libbenchmark-dev benchmark/benchmark.h"
)
for entry in "${packages[@]}"; do
  read -r package header <<< "$entry"
  if command -v dpkg-query > /dev/null &&
     dpkg-query -W -f='${Status}' "$package" 2> /dev/null | grep -q 'install ok installed'; then
    continue
  fi
  found=0
  for inc in /usr/include /usr/local/include ${CPATH:+${CPATH//:/ }}; do
    [ -f "$inc/$header" ] && found=1 && break
  done
  [ "$found" -eq 1 ] || missing+=("package $package (no $header)")
done
if [ ${#missing[@]} -gt 0 ]; then
  {
    echo "VERDICT: FAIL: preflight: ${#missing[@]} missing: $(printf '%s\n' "${missing[@]}" |
      awk '{ print $2 }' | paste -sd ' ' -)"
    echo "This machine cannot build kvport from source. Install what is missing"
    echo "(Debian: scripts/deps.sh), or build the bundle elsewhere with"
    echo "scripts/gpu-bundle.sh and run build/gpu-bundle/run.sh OUT_DIR here."
    printf '  - %s\n' "${missing[@]}"
  } | tee "$out/summary.txt" >&2
  exit 1
fi
command -v nvidia-smi > /dev/null ||
  echo "gpu-check: warning: nvidia-smi not found: no NVIDIA driver, the verdict will be FAIL" >&2

# ---- build ------------------------------------------------------------------
echo "gpu-check: configure + build the cuda preset (log: $out/build.log)"
if ! { cmake --preset cuda -DKVPORT_BUILD_BENCHMARKS=ON &&
       cmake --build --preset cuda -j "${KVPORT_BUILD_JOBS:-$(nproc)}" \
         --target kvport kvport_conformance kvport_bench; } > "$out/build.log" 2>&1; then
  tail -40 "$out/build.log" >&2
  echo "VERDICT: FAIL: the cuda preset did not build (see build.log)" | tee "$out/summary.txt" >&2
  exit 1
fi
scripts/gpu/build_info.sh build/cuda > "$out/BUILD_INFO"

# ---- the same steps and verdict as the bundle's run.sh ----------------------
exec scripts/gpu/checks.sh --peer-dir benchmarks/peer --build-info "$out/BUILD_INFO" \
  build/cuda/bin "$out"
