# SPDX-License-Identifier: Apache-2.0
"""The pip packaging check (ctest python.pip_install): build a wheel of
bindings/python with pip, install it into a fresh virtual environment
(--system-site-packages, so Debian's NumPy and pytest are found), run the
binding tests against the installed package from outside the build tree,
then `pip uninstall` it and check it is gone.

    check_pip_install.py --build-dir build/host --work build/host/python-pip

The wheel reuses --build-dir's module (kvport_build's build-dir setting):
no second build of the tree. Exits non-zero with the failing step's output.
"""

import argparse
import glob
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

TESTS = Path(__file__).resolve().parent
PYTHON_DIR = TESTS.parent


def run(cmd, timeout, **kw):
    print("+", " ".join(str(c) for c in cmd), flush=True)
    env = dict(os.environ)
    env.pop("PYTHONPATH", None)  # ctest's points at the build tree: not here
    env.update(kw.pop("env", {}))
    r = subprocess.run([str(c) for c in cmd], timeout=timeout, env=env, **kw)
    if r.returncode != 0:
        sys.exit(f"FAILED ({r.returncode}): {' '.join(str(c) for c in cmd)}")
    return r


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--build-dir", required=True)
    ap.add_argument("--work", required=True)
    ap.add_argument("--python", default=sys.executable)
    args = ap.parse_args()
    work = Path(args.work).resolve()
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    venv = work / "venv"
    run([args.python, "-m", "venv", "--system-site-packages", venv], 120)
    py = venv / "bin" / "python"
    pip = [py, "-m", "pip", "--disable-pip-version-check", "--no-input"]
    setting = ["--config-settings", f"build-dir={Path(args.build_dir).resolve()}"]

    # 1. A wheel: the module, __init__.py and the dist-info, versioned as the project.
    run(pip + ["wheel", "--no-deps", "--no-index", "-w", work / "dist", PYTHON_DIR] + setting, 300)
    wheels = glob.glob(str(work / "dist" / "kvport-*.whl"))
    assert len(wheels) == 1, wheels
    names = zipfile.ZipFile(wheels[0]).namelist()
    assert "kvport/__init__.py" in names and any(n.startswith("kvport/_kvport") for n in names)
    assert any(n.endswith(".dist-info/RECORD") for n in names), names

    # 2. pip install from the source directory (as a user would), then the tests
    # against the installed package from a directory outside the build tree.
    run(pip + ["install", "--no-deps", "--no-index", PYTHON_DIR] + setting, 300)
    site = run([py, "-c", "import kvport, os; print(os.path.dirname(kvport.__file__))"], 60,
               cwd=work, capture_output=True, text=True).stdout.strip()
    assert site.startswith(str(venv)), f"kvport imported from {site}, not the venv"
    run([py, "-m", "pip", "show", "kvport"], 60)
    run([py, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--ignore=test_torch.py", TESTS],
        300, cwd=TESTS, env={"KVPORT_EXPECT_PACKAGE_DIR": site, "PYTHONDONTWRITEBYTECODE": "1"})

    # 3. pip uninstall removes it.
    run(pip + ["uninstall", "-y", "kvport"], 120)
    assert not Path(site).exists(), f"{site} left after pip uninstall"
    r = subprocess.run([str(py), "-c", "import kvport"], cwd=work, capture_output=True,
                       env={k: v for k, v in os.environ.items() if k != "PYTHONPATH"}, timeout=60)
    assert r.returncode != 0, "kvport still importable after pip uninstall"
    shutil.rmtree(work, ignore_errors=True)
    print("pip install check: ok")


if __name__ == "__main__":
    main()
