# SPDX-License-Identifier: Apache-2.0
"""Every source file of the tree carries an SPDX license line near its top.

Usage: check_spdx.py SOURCE_DIR. Walks the tree (build/ and install/ left out,
and the fuzz corpus, which is data), picks the files that are code or build
scripts by name, and fails naming each one whose first three lines have no
"SPDX-License-Identifier: Apache-2.0". Exits 0 when none is missing.
"""
import os
import re
import sys

LICENSE = "SPDX-License-Identifier: Apache-2.0"
SOURCE = re.compile(r".*\.(cpp|hpp|h|c|cu|hip|rs|inc|py|sh|cmake|toml|supp)$")
NAMED = {"CMakeLists.txt", "registry.cpp.in", "kvportConfig.cmake.in", "kvport.pc.in",
         "kvport_c.map"}
SKIP_DIRS = {".git", "corpus", "target", "__pycache__", ".cache"}
SKIP_TOP = {"build", "install"}  # build trees at the top of the checkout


def sources(root):
    for top, dirs, files in os.walk(root):
        dirs[:] = [d for d in dirs
                   if d not in SKIP_DIRS and not (top == root and d in SKIP_TOP)]
        for name in files:
            if name in NAMED or SOURCE.match(name):
                yield os.path.join(top, name)
    ci = os.path.join(root, ".ci", "run")
    if os.path.exists(ci):
        yield ci


def main():
    if len(sys.argv) != 2:
        print(__doc__)
        return 2
    root = sys.argv[1]
    missing, seen = [], 0
    for path in sources(root):
        seen += 1
        with open(path, encoding="utf-8", errors="replace") as f:
            head = "".join(f.readline() for _ in range(3))
        if LICENSE not in head:
            missing.append(os.path.relpath(path, root))
    for path in sorted(missing):
        print(f"no '{LICENSE}' line in the first three lines: {path}")
    print(f"{seen} source files, {len(missing)} without the SPDX line")
    return 1 if missing or seen == 0 else 0


if __name__ == "__main__":
    sys.exit(main())
