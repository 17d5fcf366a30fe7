#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# One command on a fresh Debian 12 machine: install what is missing, build the
# host preset, and run the main job (`kvport demo`) on the host backend.
set -euo pipefail
cd "$(dirname "$0")/.."

scripts/deps.sh
cmake --preset host
cmake --build --preset host
KVPORT_BACKEND="${KVPORT_BACKEND:-host}" build/host/bin/kvport demo "$@"
