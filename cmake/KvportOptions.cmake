# SPDX-License-Identifier: Apache-2.0
# Compiler flags shared by every kvport target, kept on an interface target so
# that they never leak into an installed consumer's build.
add_library(kvport_warnings INTERFACE)
target_compile_options(kvport_warnings INTERFACE
  $<$<COMPILE_LANGUAGE:CXX>:-Wall -Wextra -Wpedantic -Wshadow -Wnon-virtual-dtor
    -Wconversion -Wno-sign-conversion>)
if(KVPORT_WARNINGS_AS_ERRORS)
  target_compile_options(kvport_warnings INTERFACE $<$<COMPILE_LANGUAGE:CXX>:-Werror>)
endif()

if(KVPORT_SANITIZE)
  message(STATUS "kvport: building with -fsanitize=${KVPORT_SANITIZE}")
  add_compile_options(-fsanitize=${KVPORT_SANITIZE} -fno-omit-frame-pointer)
  add_link_options(-fsanitize=${KVPORT_SANITIZE})
  if(KVPORT_SANITIZE MATCHES "undefined")
    add_compile_options(-fno-sanitize-recover=undefined)
  endif()
endif()

if(KVPORT_FUZZ)
  if(NOT CMAKE_CXX_COMPILER_ID STREQUAL "Clang")
    message(FATAL_ERROR "KVPORT_FUZZ=ON needs clang (libFuzzer), not ${CMAKE_CXX_COMPILER_ID}. "
                        "Use the `fuzz` preset; on Debian 12: apt-get install clang-15 libclang-common-15-dev")
  endif()
  # Coverage instrumentation for libFuzzer in every target; only the fuzz
  # executables link the fuzzer's main (-fsanitize=fuzzer).
  add_compile_options(-fsanitize=fuzzer-no-link)
endif()

# kvport_target_defaults(<target>): the project's warning flags (privately,
# build tree only) and C++20 on a target each folder's CMakeLists.txt declares.
function(kvport_target_defaults target)
  target_link_libraries(${target} PRIVATE $<BUILD_INTERFACE:kvport_warnings>)
  target_compile_features(${target} PUBLIC cxx_std_20)
endfunction()

# Block transfer between processes and nodes (transfer/: kvport::transfer, and
# `kvport disagg` over it) needs UCX: KVPORT_WITH_TRANSFER = AUTO | ON | OFF,
# as the GPU backends' options (KvportGpu.cmake). AUTO builds it when
# pkg-config finds ucx >= 1.12; ON stops the configure with what to install
# when it does not; OFF skips it. Without it the core, the backends, sim, the
# events, the router and the bindings build as before; `kvport disagg` says it
# was not built (exit 2) and the package has no `transfer` component.
set(KVPORT_WITH_TRANSFER AUTO CACHE STRING "Build block transfer over UCX: AUTO, ON or OFF")
set_property(CACHE KVPORT_WITH_TRANSFER PROPERTY STRINGS AUTO ON OFF)
string(TOUPPER "${KVPORT_WITH_TRANSFER}" _kvport_transfer)
if(NOT _kvport_transfer MATCHES "^(AUTO|ON|OFF)$")
  message(FATAL_ERROR "KVPORT_WITH_TRANSFER='${KVPORT_WITH_TRANSFER}': expected AUTO, ON or OFF")
endif()
set(KVPORT_WITH_TRANSFER ${_kvport_transfer})
set(KVPORT_HAVE_TRANSFER OFF)
if(NOT KVPORT_WITH_TRANSFER STREQUAL "OFF")
  find_package(PkgConfig REQUIRED)
  pkg_check_modules(UCX IMPORTED_TARGET ucx>=1.12)
  if(UCX_FOUND)
    set(KVPORT_HAVE_TRANSFER ON)
  elseif(KVPORT_WITH_TRANSFER STREQUAL "ON")
    message(FATAL_ERROR
      "KVPORT_WITH_TRANSFER=ON but UCX (pkg-config ucx >= 1.12) was not found: the block "
      "transfer (transfer/, `kvport disagg`) needs it. Install it with: apt-get install "
      "libucx-dev (or run scripts/deps.sh), or configure with -DKVPORT_WITH_TRANSFER=OFF.")
  endif()
endif()
message(STATUS "kvport transfer (UCX): ${KVPORT_HAVE_TRANSFER}")
