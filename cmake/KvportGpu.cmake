# SPDX-License-Identifier: Apache-2.0
# Backend selection: KVPORT_WITH_CUDA / KVPORT_WITH_HIP = AUTO | ON | OFF.
# AUTO builds a backend when its toolkit is found; ON stops the configure with
# what to install when it is not; OFF skips it. Host is always built.
set(KVPORT_WITH_CUDA AUTO CACHE STRING "Build the CUDA backend: AUTO, ON or OFF")
set(KVPORT_WITH_HIP AUTO CACHE STRING "Build the HIP backend: AUTO, ON or OFF")
set_property(CACHE KVPORT_WITH_CUDA PROPERTY STRINGS AUTO ON OFF)
set_property(CACHE KVPORT_WITH_HIP PROPERTY STRINGS AUTO ON OFF)
set(KVPORT_HIP_ARCHITECTURES "gfx90a;gfx1030" CACHE STRING
    "AMD GPU targets for the HIP kernels (Debian's ROCm 5.2 hipcc compiles gfx90a and gfx1030)")

foreach(var KVPORT_WITH_CUDA KVPORT_WITH_HIP)
  string(TOUPPER "${${var}}" value)
  if(NOT value MATCHES "^(AUTO|ON|OFF)$")
    message(FATAL_ERROR "${var}='${${var}}': expected AUTO, ON or OFF")
  endif()
  set(${var} ${value})
endforeach()

# ---- CUDA ---------------------------------------------------------------------
set(KVPORT_HAVE_CUDA OFF)
if(NOT KVPORT_WITH_CUDA STREQUAL "OFF")
  if(NOT CMAKE_CUDA_COMPILER AND EXISTS /usr/local/cuda/bin/nvcc)
    set(CMAKE_CUDA_COMPILER /usr/local/cuda/bin/nvcc)
  endif()
  include(CheckLanguage)
  check_language(CUDA)
  if(CMAKE_CUDA_COMPILER AND NOT EXISTS "${CMAKE_CUDA_COMPILER}")
    set(CMAKE_CUDA_COMPILER "")  # a stale or mistyped path: treat as not found
  endif()
  if(CMAKE_CUDA_COMPILER)
    if(NOT DEFINED CMAKE_CUDA_ARCHITECTURES)
      set(CMAKE_CUDA_ARCHITECTURES 80 90)
    endif()
    enable_language(CUDA)
    # The kernels need no more than C++17, which CMake 3.25 knows how to ask nvcc 13 for.
    set(CMAKE_CUDA_STANDARD 17)
    set(CMAKE_CUDA_STANDARD_REQUIRED ON)
    # One cudart only: CMake would otherwise add both the shared and the static one.
    set(CMAKE_CUDA_RUNTIME_LIBRARY Static)
    find_package(CUDAToolkit REQUIRED)
    set(KVPORT_HAVE_CUDA ON)
  elseif(KVPORT_WITH_CUDA STREQUAL "ON")
    message(FATAL_ERROR
      "KVPORT_WITH_CUDA=ON but no CUDA compiler was found. Install the CUDA toolkit "
      "(nvcc at /usr/local/cuda/bin/nvcc, or set CMAKE_CUDA_COMPILER), or configure with "
      "-DKVPORT_WITH_CUDA=OFF.")
  endif()
endif()

# ---- HIP ----------------------------------------------------------------------
set(KVPORT_HAVE_HIP OFF)
if(NOT KVPORT_WITH_HIP STREQUAL "OFF")
  find_program(KVPORT_HIPCC hipcc)
  find_package(hip CONFIG QUIET)
  if(KVPORT_HIPCC AND EXISTS "${KVPORT_HIPCC}" AND hip_FOUND)
    set(KVPORT_HAVE_HIP ON)
  elseif(KVPORT_WITH_HIP STREQUAL "ON")
    message(FATAL_ERROR
      "KVPORT_WITH_HIP=ON but hipcc or the HIP runtime package was not found "
      "(hipcc: '${KVPORT_HIPCC}', find_package(hip): '${hip_FOUND}'). On Debian 12: "
      "apt-get install hipcc libamdhip64-dev (or run scripts/deps.sh --hip), or configure with "
      "-DKVPORT_WITH_HIP=OFF.")
  endif()
endif()

message(STATUS "kvport backends: host=ON cuda=${KVPORT_HAVE_CUDA} hip=${KVPORT_HAVE_HIP}")
