// SPDX-License-Identifier: Apache-2.0
//! Finds libkvport_c and tells rustc to link it.
//!
//! 1. `KVPORT_C_LIB_DIR`: the directory holding `libkvport_c.so` (the kvport
//!    build tree's `lib`, e.g. build/host/lib, or an install's `lib`). CMake's
//!    ctest sets it.
//! 2. Otherwise `pkg-config --libs-only-L kvport` (kvport.pc is installed to
//!    `<libdir>/pkgconfig`; set `PKG_CONFIG_PATH` for a non-system prefix).
//!
//! Neither: the build stops with a message that says what to set.
//!
//! The C header kvport/kvport.h the tests compare src/ffi.rs with
//! (tests/header_check.rs) is found the same way, and handed to them as the
//! compile-time variable `KVPORT_HEADER`:
//!
//! 1. `KVPORT_C_INCLUDE_DIR` (CMake's ctest sets it to the source tree's);
//! 2. `pkg-config --cflags-only-I kvport`: an installed kvport's include
//!    directory (an installed or copied crate, with no other variable);
//! 3. the source tree's bindings/c/include, when the crate is in it.
//!
//! None of them: `KVPORT_HEADER` is empty and the header tests fail saying so.
//!
//! The directory also goes into the rpath of this crate's own test and
//! example binaries, so `cargo test` runs without `LD_LIBRARY_PATH`.
//! (Cargo does not pass link arguments on to crates that depend on this one:
//! an engine sets its own rpath or `LD_LIBRARY_PATH`.)

use std::env;
use std::path::{Path, PathBuf};
use std::process::Command;

const LIB_NAME: &str = "kvport_c";

fn has_library(dir: &Path) -> bool {
    let so = format!("lib{}.so", LIB_NAME);
    let dylib = format!("lib{}.dylib", LIB_NAME);
    dir.join(&so).exists() || dir.join(&dylib).exists()
}

/// The directories pkg-config gives after `prefix` (`-L`, `-I`) for `option`
/// (`--libs-only-L`, `--cflags-only-I`), or the reason it gave none.
fn from_pkg_config(option: &str, prefix: &str) -> Result<Vec<PathBuf>, String> {
    let pkg_config = env::var("PKG_CONFIG").unwrap_or_else(|_| "pkg-config".to_string());
    let output = Command::new(&pkg_config)
        .args([option, "kvport"])
        .output()
        .map_err(|e| format!("could not run `{} {} kvport`: {}", pkg_config, option, e))?;
    if !output.status.success() {
        return Err(format!(
            "`{} {} kvport` failed: {}",
            pkg_config,
            option,
            String::from_utf8_lossy(&output.stderr).trim()
        ));
    }
    let text = String::from_utf8_lossy(&output.stdout);
    Ok(text
        .split_whitespace()
        .filter_map(|arg| arg.strip_prefix(prefix))
        .map(PathBuf::from)
        .collect())
}

/// kvport/kvport.h: KVPORT_C_INCLUDE_DIR, pkg-config's include directories,
/// then the source tree's (see the top of this file).
fn header() -> Option<PathBuf> {
    let in_dir = |dir: &Path| {
        let h = dir.join("kvport").join("kvport.h");
        if h.is_file() {
            Some(h)
        } else {
            None
        }
    };
    if let Some(dir) = env::var_os("KVPORT_C_INCLUDE_DIR").filter(|d| !d.is_empty()) {
        return in_dir(Path::new(&dir));
    }
    if let Ok(dirs) = from_pkg_config("--cflags-only-I", "-I") {
        if let Some(h) = dirs.iter().find_map(|d| in_dir(d)) {
            return Some(h);
        }
    }
    let manifest = PathBuf::from(env::var_os("CARGO_MANIFEST_DIR")?);
    in_dir(&manifest.join("../../c/include"))
}

fn main() {
    println!("cargo:rerun-if-changed=build.rs");
    println!("cargo:rerun-if-env-changed=KVPORT_C_LIB_DIR");
    println!("cargo:rerun-if-env-changed=KVPORT_C_INCLUDE_DIR");
    println!("cargo:rerun-if-env-changed=PKG_CONFIG_PATH");
    println!("cargo:rerun-if-env-changed=PKG_CONFIG");

    let dirs: Vec<PathBuf> = match env::var_os("KVPORT_C_LIB_DIR") {
        Some(dir) if !dir.is_empty() => {
            let dir = PathBuf::from(dir);
            if !has_library(&dir) {
                panic!(
                    "\n\nkvport: KVPORT_C_LIB_DIR={} has no lib{}.so.\n\
                     Point it at the directory of libkvport_c.so: the kvport build tree's \
                     lib (build/host/lib after `cmake --build build/host --target kvport_c`) \
                     or an install's lib directory.\n\n",
                    dir.display(),
                    LIB_NAME
                );
            }
            vec![dir]
        }
        _ => match from_pkg_config("--libs-only-L", "-L") {
            Ok(dirs) => dirs,
            Err(reason) => panic!(
                "\n\nkvport: cannot find libkvport_c.\n\
                 - KVPORT_C_LIB_DIR is not set (set it to the directory of libkvport_c.so: \
                 the kvport build tree's lib, e.g. build/host/lib, or an install's lib), and\n\
                 - pkg-config did not find kvport: {}\n  \
                 (set PKG_CONFIG_PATH=<prefix>/lib/pkgconfig after `cmake --install`).\n\n",
                reason
            ),
        },
    };

    for dir in &dirs {
        println!("cargo:rustc-link-search=native={}", dir.display());
        println!("cargo:rustc-link-arg=-Wl,-rpath,{}", dir.display());
    }
    println!("cargo:rustc-link-lib=dylib={}", LIB_NAME);

    let header = header();
    if let Some(h) = &header {
        println!("cargo:rerun-if-changed={}", h.display());
    }
    println!(
        "cargo:rustc-env=KVPORT_HEADER={}",
        header.map(|h| h.display().to_string()).unwrap_or_default()
    );
}
