# SPDX-License-Identifier: Apache-2.0
# ctest driver (rust.cargo_test_installed): the installed crate, as a user
# gets it, against an installed kvport: install the C ABI (bindings/c of the
# build tree) and the crate (install component `rust`:
# <prefix>/share/kvport/rust/kvport) into a scratch prefix, and run the
# installed crate's own `cargo test --offline` with only PKG_CONFIG_PATH
# pointing at the prefix: build.rs finds libkvport_c and the header (for
# tests/header_check.rs) through pkg-config.
#   cmake -DBUILD_DIR=... -DWORK_DIR=... -DCARGO=... [-DRUSTC=...]
#         [-DRUSTDOC=...]
#         -P check_installed_crate.cmake
foreach(var BUILD_DIR WORK_DIR CARGO)
  if(NOT DEFINED ${var})
    message(FATAL_ERROR "check_installed_crate.cmake: ${var} is not set")
  endif()
endforeach()
file(REMOVE_RECURSE ${WORK_DIR})
set(prefix ${WORK_DIR}/prefix)

function(run)
  execute_process(COMMAND ${ARGN} RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err)
  if(NOT rc EQUAL 0)
    message(FATAL_ERROR "command failed (${rc}): ${ARGN}\n${out}\n${err}")
  endif()
  message(STATUS "${out}\n${err}")
endfunction()

run(${CMAKE_COMMAND} --install ${BUILD_DIR}/bindings/c --prefix ${prefix})
file(GLOB pc_files ${prefix}/*/pkgconfig/kvport.pc ${prefix}/*/*/pkgconfig/kvport.pc)
if(NOT pc_files)
  message(FATAL_ERROR "kvport.pc is not installed under ${prefix}")
endif()
list(GET pc_files 0 pc_file)
get_filename_component(pc_dir ${pc_file} DIRECTORY)
get_filename_component(lib_dir ${pc_dir} DIRECTORY)

run(${CMAKE_COMMAND} --install ${BUILD_DIR} --component rust --prefix ${prefix})
set(crate ${prefix}/share/kvport/rust/kvport)
if(NOT EXISTS ${crate}/Cargo.toml)
  message(FATAL_ERROR "the crate is not installed in ${crate}")
endif()
if(EXISTS ${crate}/../../c/include/kvport/kvport.h)
  message(FATAL_ERROR "the installed crate still sees a source tree's header")
endif()

set(rustc_env "")
if(RUSTC)
  list(APPEND rustc_env RUSTC=${RUSTC})
endif()
if(RUSTDOC)  # the doc tests need the rustdoc of the same toolchain as rustc
  list(APPEND rustc_env RUSTDOC=${RUSTDOC})
endif()
# LD_LIBRARY_PATH: the doc tests (rustdoc drops build.rs's rpath); the test
# binaries have the rpath.
run(${CMAKE_COMMAND} -E env --unset=KVPORT_C_LIB_DIR --unset=KVPORT_C_INCLUDE_DIR
    PKG_CONFIG_PATH=${pc_dir} LD_LIBRARY_PATH=${lib_dir}
    CARGO_HOME=${WORK_DIR}/cargo-home CARGO_TARGET_DIR=${WORK_DIR}/target ${rustc_env}
    ${CARGO} test --offline --manifest-path ${crate}/Cargo.toml)
file(REMOVE_RECURSE ${WORK_DIR})
