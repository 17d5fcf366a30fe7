#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# Installs the Debian 12 packages kvport builds with, if any are missing.
# Usage: scripts/deps.sh [--hip] [--fuzz|--clang] [--plots] [--peer|--torch]
#   --hip adds hipcc + libamdhip64-dev; --fuzz (or --clang) clang 15 and its
#   libFuzzer and sanitizer runtimes (the fuzz, asan and tsan presets);
#   --plots python3-matplotlib for scripts/bench.sh; --peer (or --torch)
#   python3-torch (CPU-only PyTorch 1.13, for /usr/bin/python3: about 180
#   packages) for the PyTorch peer of the zeroing bench (benchmarks/peer), its
#   ctests (label peer) and the Python bindings' PyTorch tests
# The bindings (bindings/): python3-dev, pybind11, NumPy and pytest for the
# Python module, rustc + cargo for the Rust crate, libdlpack-dev for the
# tensor views; all from Debian. The block transfer (transfer/, `kvport
# disagg`): UCX (libucx-dev: UCP over TCP, shared memory and CMA). The KV
# events (events/): ZeroMQ (libzmq3-dev, cppzmq-dev) and msgpack-cxx, with
# python3-zmq + python3-msgpack for the test that decodes the stream the way
# vLLM's consumers do. The disk tier (disk/): liburing-dev (io_uring), and fio
# for the disk benchmark's limit (direct sequential I/O on the same file system).
# ccache: every preset compiles through one cache under build/.ccache
# (CMakePresets.json), so the `ci` preset and reruns compile only what changed.
# Needs root (or sudo) only when something is missing.
set -euo pipefail

packages=(
  cmake ninja-build g++ pkg-config git ccache
  libgtest-dev libgmock-dev libbenchmark-dev
  libspdlog-dev libfmt-dev libabsl-dev libcli11-dev nlohmann-json3-dev libxxhash-dev libboost-dev
  python3 python3-dev pybind11-dev python3-pybind11 python3-numpy python3-pytest libdlpack-dev
  rustc cargo
  libucx-dev
  libzmq3-dev cppzmq-dev libmsgpack-cxx-dev python3-zmq python3-msgpack
  liburing-dev fio
)
for arg in "$@"; do
  case "$arg" in
    --hip) packages+=(hipcc libamdhip64-dev) ;;
    --plots) packages+=(python3 python3-matplotlib) ;;
    --peer | --torch) packages+=(python3 python3-torch) ;;
    # clang 15 (std::source_location) and its runtimes: libFuzzer (the fuzz
    # preset), ASan, UBSan and TSan (the asan and tsan presets compile with it).
    --fuzz | --clang) packages+=(clang-15 libclang-common-15-dev) ;;
    *) echo "deps.sh: unknown option '$arg'" >&2; exit 2 ;;
  esac
done

missing=()
for p in "${packages[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if [ ${#missing[@]} -eq 0 ]; then
  echo "deps: all ${#packages[@]} packages present"
  exit 0
fi

echo "deps: installing ${missing[*]}"
sudo_cmd=()
if [ "$(id -u)" -ne 0 ]; then
  command -v sudo >/dev/null || { echo "deps: need root to install: ${missing[*]}" >&2; exit 1; }
  sudo_cmd=(sudo)
fi
export DEBIAN_FRONTEND=noninteractive
"${sudo_cmd[@]}" apt-get update -qq
"${sudo_cmd[@]}" apt-get install -y -qq --no-install-recommends "${missing[@]}"
