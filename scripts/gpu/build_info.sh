#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# Prints what a cuda build is, as "key: value" lines (the bundle's BUILD_INFO):
# the commit, the date, the CUDA runtime version (cudart is linked statically,
# so it is the toolkit's: CUDART_VERSION of the headers the build used), nvcc,
# the host compiler, the CUDA architectures and the build type.
#
# Usage: scripts/gpu/build_info.sh BUILD_DIR   (e.g. build/cuda)
set -euo pipefail

build="${1:?usage: scripts/gpu/build_info.sh BUILD_DIR}"
source_dir="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
cache="$build/CMakeCache.txt"
if [ ! -f "$cache" ]; then
  echo "build_info.sh: $cache not found: configure the build first" >&2
  exit 1
fi

# The value of a set(NAME "value") line in CMake's compiler files.
compiler_var() {
  sed -n "s/^set($1 \"\\(.*\\)\")\$/\\1/p" "$build"/CMakeFiles/*/"$2" 2> /dev/null | head -1
}
cache_var() { sed -n "s/^$1:[A-Z]*=//p" "$cache" | head -1; }

commit="$(git -C "$source_dir" rev-parse HEAD 2> /dev/null || echo unknown)"
if [ "$commit" != unknown ] && ! git -C "$source_dir" diff --quiet HEAD 2> /dev/null; then
  commit="$commit (with uncommitted changes)"
fi
nvcc="$(compiler_var CMAKE_CUDA_COMPILER CMakeCUDACompiler.cmake)"
cxx="$(cache_var CMAKE_CXX_COMPILER)"

runtime=unknown
header="$(readlink -f "$(dirname "${nvcc:-/nonexistent}")/../include/cuda_runtime_api.h" || true)"
if [ -f "$header" ]; then
  v="$(sed -n 's/^#define CUDART_VERSION *\([0-9]*\).*/\1/p' "$header" | head -1)"
  [ -n "$v" ] && runtime="$((v / 1000)).$(((v % 1000) / 10))"
fi

echo "commit: $commit"
echo "built: $(date -u +%Y-%m-%dT%H:%M:%SZ) on $(uname -n)"
echo "cuda runtime: $runtime (cudart linked statically; CUDART_VERSION of ${header})"
echo "nvcc: ${nvcc:-none} ($("${nvcc:-false}" --version 2> /dev/null | grep -o 'release .*' || echo 'not found'))"
echo "host compiler: $cxx ($("$cxx" --version 2> /dev/null | head -1 || echo 'not found'))"
echo "cuda architectures: $(cache_var CMAKE_CUDA_ARCHITECTURES)"
echo "build type: $(cache_var CMAKE_BUILD_TYPE)"
echo "backends: cuda $(cache_var KVPORT_WITH_CUDA), hip $(cache_var KVPORT_WITH_HIP)"
