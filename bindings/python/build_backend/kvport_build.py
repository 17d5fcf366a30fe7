# SPDX-License-Identifier: Apache-2.0
"""kvport's PEP 517 build backend: the Python module built with CMake, packed
into a wheel.

It has no dependencies (pyproject.toml's requires = []), so pip runs it
offline and in an isolated build environment. build_wheel:

1. configures the kvport source tree (two directories up from
   bindings/python) into a build directory, or reuses one: the config
   setting ``build-dir`` (``pip install -C build-dir=build/host ...``) or the
   environment variable KVPORT_BUILD_DIR names an existing CMake build
   directory, which is only brought up to date; otherwise
   ``<source>/build/pip-<python tag>`` is configured (Release, tests off,
   KVPORT_BUILD_PYTHON=ON, the GPU backends as CMake finds them; more
   options through ``-C cmake-args="-DKVPORT_WITH_CUDA=OFF ..."`` or
   KVPORT_CMAKE_ARGS) and kept for the next build; ``-C jobs=N`` or
   CMAKE_BUILD_PARALLEL_LEVEL sets the build's parallelism;
2. builds the one target kvport_python (the module and the static kvport
   libraries it links: the wheel needs no libkvport of its own);
3. writes the wheel: kvport/__init__.py, kvport/_kvport<EXT_SUFFIX> (its debug
   information stripped when ``strip`` is found) and the .dist-info.

The version is project(VERSION) of the top-level CMakeLists.txt, the one
version the C ABI and the CLI report too. Sdists are not made (the module
builds from the whole source tree): build_sdist says so.
"""

import base64
import csv
import hashlib
import io
import os
import re
import shutil
import subprocess
import sys
import sysconfig
import tempfile
import zipfile
from pathlib import Path

PYTHON_DIR = Path(__file__).resolve().parent.parent  # bindings/python
SOURCE_DIR = PYTHON_DIR.parent.parent                # the kvport source tree
NAME = "kvport"


def project_version():
    text = (SOURCE_DIR / "CMakeLists.txt").read_text()
    m = re.search(r"project\(\s*kvport\s+VERSION\s+([0-9]+(?:\.[0-9]+)*)", text)
    if not m:
        raise RuntimeError(f"kvport_build: no project(kvport VERSION ...) in {SOURCE_DIR}/CMakeLists.txt")
    return m.group(1)


def _tags():
    impl = "cp" if sys.implementation.name == "cpython" else sys.implementation.name[:2]
    py = f"{impl}{sys.version_info.major}{sys.version_info.minor}"
    abi = py if impl == "cp" else "none"
    plat = re.sub(r"[-.]", "_", sysconfig.get_platform())
    return py, abi, plat


def _clean_env():
    """The environment for CMake: without pip's build-isolation overlay (its
    PYTHONPATH hides the interpreter's site-packages from CMake's checks)."""
    env = dict(os.environ)
    for var in ("PYTHONPATH", "PYTHONNOUSERSITE", "PYTHONHOME"):
        env.pop(var, None)
    return env


def _run(cmd):
    print("kvport_build:", " ".join(str(c) for c in cmd), flush=True)
    subprocess.run([str(c) for c in cmd], check=True, env=_clean_env())


def _build_dir(config_settings):
    given = (config_settings or {}).get("build-dir") or os.environ.get("KVPORT_BUILD_DIR")
    if given:
        build = Path(given)
        if not build.is_absolute():
            build = (SOURCE_DIR / build).resolve()
        if not (build / "CMakeCache.txt").is_file():
            raise RuntimeError(f"kvport_build: build-dir {build} is not a configured CMake build "
                               "directory (no CMakeCache.txt)")
        return build, False
    py, _, _ = _tags()
    return SOURCE_DIR / "build" / f"pip-{py}", True


def build_module(config_settings=None):
    """Builds kvport_python; returns the module's path."""
    if shutil.which("cmake") is None:
        raise RuntimeError("kvport_build: cmake not found (apt-get install cmake)")
    build, fresh = _build_dir(config_settings)
    if fresh and not (build / "CMakeCache.txt").is_file():
        cmd = ["cmake", "-S", SOURCE_DIR, "-B", build, "-DCMAKE_BUILD_TYPE=Release",
               "-DKVPORT_BUILD_PYTHON=ON", "-DKVPORT_BUILD_TESTS=OFF",
               f"-DPython3_EXECUTABLE={sys.executable}"]
        if shutil.which("ninja"):
            cmd += ["-G", "Ninja"]
        # More options for CMake (e.g. -DKVPORT_WITH_CUDA=OFF): -C cmake-args="..."
        cmd += ((config_settings or {}).get("cmake-args") or os.environ.get("KVPORT_CMAKE_ARGS", "")).split()
        _run(cmd)
    jobs = (config_settings or {}).get("jobs") or os.environ.get("CMAKE_BUILD_PARALLEL_LEVEL")
    _run(["cmake", "--build", build, "--target", "kvport_python"] + (["-j", jobs] if jobs else []))
    suffix = sysconfig.get_config_var("EXT_SUFFIX")
    module = build / "python" / NAME / f"_kvport{suffix}"
    if not module.is_file():
        found = sorted(p.name for p in (build / "python" / NAME).glob("_kvport*"))
        raise RuntimeError(f"kvport_build: {module} was not built (found {found}): the build "
                           f"directory's module is for another Python than {sys.executable}")
    return module


def _metadata(version):
    readme = "kvport: a paged KV-cache runtime. docs/bindings/python.md is the guide.\n"
    return (f"Metadata-Version: 2.1\nName: {NAME}\nVersion: {version}\n"
            "Summary: A paged KV-cache runtime for LLM inference engines (Python bindings)\n"
            "License: Apache-2.0\nRequires-Python: >=3.9\n"
            "Provides-Extra: numpy\nRequires-Dist: numpy; extra == \"numpy\"\n"
            f"Description-Content-Type: text/plain\n\n{readme}")


def _wheel_file(tag):
    return (f"Wheel-Version: 1.0\nGenerator: kvport_build {project_version()}\n"
            f"Root-Is-Purelib: false\nTag: {tag}\n")


def _dist_info(version, tag):
    return {"METADATA": _metadata(version), "WHEEL": _wheel_file(tag), "top_level.txt": f"{NAME}\n"}


def _record_line(path, data):
    digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
    return [path, f"sha256={digest}", str(len(data))]


def _stripped(module):
    strip = shutil.which("strip")
    if strip is None:
        return module.read_bytes()
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / module.name
        subprocess.run([strip, "--strip-debug", "-o", str(out), str(module)], check=True)
        return out.read_bytes()


# ---- PEP 517 hooks ------------------------------------------------------------------

def get_requires_for_build_wheel(config_settings=None):
    return []


def prepare_metadata_for_build_wheel(metadata_directory, config_settings=None):
    version = project_version()
    py, abi, plat = _tags()
    info = Path(metadata_directory) / f"{NAME}-{version}.dist-info"
    info.mkdir(parents=True, exist_ok=True)
    for name, text in _dist_info(version, f"{py}-{abi}-{plat}").items():
        (info / name).write_text(text)
    return info.name


def build_wheel(wheel_directory, config_settings=None, metadata_directory=None):
    version = project_version()
    py, abi, plat = _tags()
    tag = f"{py}-{abi}-{plat}"
    module = build_module(config_settings)
    files = {
        f"{NAME}/__init__.py": (PYTHON_DIR / NAME / "__init__.py").read_bytes(),
        f"{NAME}/{module.name}": _stripped(module),
    }
    info = f"{NAME}-{version}.dist-info"
    for name, text in _dist_info(version, tag).items():
        files[f"{info}/{name}"] = text.encode()
    record = io.StringIO()
    writer = csv.writer(record, lineterminator="\n")
    for path, data in files.items():
        writer.writerow(_record_line(path, data))
    writer.writerow([f"{info}/RECORD", "", ""])
    files[f"{info}/RECORD"] = record.getvalue().encode()
    wheel_name = f"{NAME}-{version}-{tag}.whl"
    Path(wheel_directory).mkdir(parents=True, exist_ok=True)
    with zipfile.ZipFile(Path(wheel_directory) / wheel_name, "w", zipfile.ZIP_DEFLATED) as whl:
        for path, data in files.items():
            entry = zipfile.ZipInfo(path, date_time=(2020, 1, 1, 0, 0, 0))
            entry.external_attr = (0o755 if path.endswith(".so") else 0o644) << 16
            entry.compress_type = zipfile.ZIP_DEFLATED
            whl.writestr(entry, data)
    print(f"kvport_build: wrote {wheel_name}", flush=True)
    return wheel_name


def build_sdist(sdist_directory, config_settings=None):
    raise RuntimeError("kvport_build: no sdist: the module builds from the whole kvport source "
                       "tree; install from it (pip install ./bindings/python)")
