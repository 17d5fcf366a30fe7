#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# Makes the GPU proof kit: builds the `cuda` preset here (benchmarks on) and
# copies into DIR everything the GPU machine needs to run the proof without
# the Debian packages kvport builds with:
#
#   run.sh        the proof: `DIR/run.sh OUT_DIR` (exit 0 PASS, 1 FAIL)
#   bin/          kvport, kvport_conformance, kvport_bench, stripped
#   lib/          the shared libraries they load that are not glibc, libstdc++,
#                 libgcc or the dynamic loader (spdlog, fmt, gtest, benchmark...)
#   gpu/          checks.sh and verdict.py, the steps and verdict that
#                 scripts/gpu-check.sh runs too
#   peer/         benchmarks/peer/torch_zeroing.py and compare.py, when present
#   BUILD_INFO    commit, date, CUDA runtime version, nvcc, host compiler
#
# DIR must stay under 48 MiB (the device tool carries 64 MiB of ignored paths).
# Carry it to the GPU machine and run `DIR/run.sh OUT_DIR` there, from any
# directory: run.sh finds its own.
#
# Usage: scripts/gpu-bundle.sh [DIR]   (default build/gpu-bundle)
# Environment: KVPORT_BUILD_JOBS (default nproc)
set -euo pipefail
cd "$(dirname "$0")/.."
root="$(pwd)"
dir="${1:-build/gpu-bundle}"
max_bytes=$((48 * 1024 * 1024))
binaries=(kvport kvport_conformance kvport_bench)
build=build/cuda

for tool in cmake ninja strip ldd; do
  command -v "$tool" > /dev/null || { echo "gpu-bundle: $tool not found" >&2; exit 1; }
done

echo "gpu-bundle: configure + build the cuda preset (${binaries[*]})"
cmake --preset cuda -DKVPORT_BUILD_BENCHMARKS=ON > /dev/null
cmake --build --preset cuda -j "${KVPORT_BUILD_JOBS:-$(nproc)}" --target "${binaries[@]}"
if ! grep -q '^KVPORT_WITH_CUDA:[A-Z]*=ON$' "$build/CMakeCache.txt"; then
  echo "gpu-bundle: $build is not configured with KVPORT_WITH_CUDA=ON" >&2
  exit 1
fi

# Only a bundle (or nothing) is replaced: a typo must not delete a folder.
mkdir -p "$dir"
dir="$(cd "$dir" && pwd)"
marker=.kvport-gpu-bundle
if [ "$dir" = "$root" ] || [ "$dir" = / ] ||
   { [ -n "$(ls -A "$dir")" ] && [ ! -f "$dir/$marker" ]; }; then
  echo "gpu-bundle: $dir is not empty and not a bundle (no $marker): not replacing it" >&2
  exit 1
fi
rm -rf "${dir:?}"/{bin,lib,gpu,peer,run.sh,BUILD_INFO}
: > "$dir/$marker"
mkdir -p "$dir"/{bin,lib,gpu,peer}

for b in "${binaries[@]}"; do
  strip --strip-all -o "$dir/bin/$b" "$build/bin/$b"
done

# The libraries the loader finds for them, less the C/C++ runtime every Linux
# machine has. A library ldd cannot find stops the bundle here.
is_system_lib() {
  case "$1" in
    linux-vdso.so* | ld-linux*.so* | libc.so* | libm.so* | libmvec.so* | libpthread.so* | \
      libdl.so* | librt.so* | libutil.so* | libresolv.so* | libstdc++.so* | libgcc_s.so*) return 0 ;;
  esac
  return 1
}
missing=$(ldd "$dir"/bin/* | grep 'not found' || true)
if [ -n "$missing" ]; then
  echo "gpu-bundle: libraries not found:" >&2
  echo "$missing" >&2
  exit 1
fi
libs=()
while read -r name path; do
  is_system_lib "$name" && continue
  cp -L "$path" "$dir/lib/$name"
  strip --strip-unneeded "$dir/lib/$name"
  libs+=("$name")
done < <(ldd "$dir"/bin/* | awk '$2 == "=>" && $3 ~ /^\// { print $1, $3 }' | sort -u)

cp scripts/gpu/checks.sh scripts/gpu/verdict.py "$dir/gpu/"
cp scripts/gpu/bundle-run.sh "$dir/run.sh"
chmod +x "$dir/run.sh" "$dir/gpu/checks.sh"
peer=()
for f in torch_zeroing.py compare.py; do
  if [ -f "benchmarks/peer/$f" ]; then
    cp "benchmarks/peer/$f" "$dir/peer/"
    peer+=("$f")
  fi
done

# Symbol versions the binaries need from the libraries left to the machine.
needs="$(objdump -T "$dir"/bin/* "$dir"/lib/* 2> /dev/null |
  grep -o '\(GLIBC\|GLIBCXX\|CXXABI\|GCC\)_[0-9.]*' | sort -t_ -k1,1 -k2,2V | uniq |
  awk -F_ '{ last[$1] = $0 } END { for (k in last) print last[k] }' | sort | paste -sd ' ' -)"
{
  scripts/gpu/build_info.sh "$build"
  echo "needs from the machine: ${needs:-unknown} (glibc, libstdc++ and libgcc are not bundled)"
  echo "bundled libraries: ${libs[*]:-none}"
  echo "peer scripts: ${peer[*]:-absent (benchmarks/peer/ had none; run.sh skips the peer step)}"
} > "$dir/BUILD_INFO"

# The bundle must load its libraries from its own lib/, not from this machine.
stray=$(LD_LIBRARY_PATH="$dir/lib" ldd "$dir"/bin/* |
  awk '$2 == "=>" { print $1, $3 }' | while read -r name path; do
    is_system_lib "$name" || [ "$path" = "$dir/lib/$name" ] || echo "  $name => $path"
  done)
if [ -n "$stray" ]; then
  echo "gpu-bundle: with LD_LIBRARY_PATH=$dir/lib these still load from outside the bundle:" >&2
  echo "$stray" >&2
  exit 1
fi
if ! LD_LIBRARY_PATH="$dir/lib" "$dir/bin/kvport" --version > /dev/null; then
  echo "gpu-bundle: $dir/bin/kvport does not start with LD_LIBRARY_PATH=$dir/lib" >&2
  exit 1
fi

bytes=$(du -sb "$dir" | cut -f1)
mib=$(awk -v b="$bytes" 'BEGIN { printf "%.1f", b / 1048576 }')
cat "$dir/BUILD_INFO"
echo "gpu-bundle: $dir: $mib MiB ($bytes bytes; limit 48 MiB)"
du -ab "$dir" | sort -rn | sed -n '2,8p' | awk '{ printf "  %8.1f MiB  %s\n", $1 / 1048576, $2 }'
if [ "$bytes" -gt "$max_bytes" ]; then
  echo "gpu-bundle: FAILED: $dir is $mib MiB, over the 48 MiB limit" >&2
  exit 1
fi
echo "gpu-bundle: run it with: $dir/run.sh OUT_DIR"
