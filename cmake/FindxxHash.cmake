# SPDX-License-Identifier: Apache-2.0
# Finds xxHash (Debian: libxxhash-dev) and defines the imported target
# xxHash::xxhash. XXH3's 128-bit hash is stable from 0.8.0 on.
find_path(xxHash_INCLUDE_DIR xxhash.h)
find_library(xxHash_LIBRARY NAMES xxhash)
if(xxHash_INCLUDE_DIR AND EXISTS "${xxHash_INCLUDE_DIR}/xxhash.h")
  file(STRINGS "${xxHash_INCLUDE_DIR}/xxhash.h" _xxh_version_lines
       REGEX "^#define XXH_VERSION_(MAJOR|MINOR|RELEASE) +[0-9]+")
  foreach(_part MAJOR MINOR RELEASE)
    string(REGEX REPLACE ".*#define XXH_VERSION_${_part} +([0-9]+).*" "\\1" _xxh_${_part}
                         "${_xxh_version_lines}")
  endforeach()
  set(xxHash_VERSION "${_xxh_MAJOR}.${_xxh_MINOR}.${_xxh_RELEASE}")
endif()

include(FindPackageHandleStandardArgs)
find_package_handle_standard_args(xxHash
  REQUIRED_VARS xxHash_LIBRARY xxHash_INCLUDE_DIR
  VERSION_VAR xxHash_VERSION)

if(xxHash_FOUND AND NOT TARGET xxHash::xxhash)
  add_library(xxHash::xxhash UNKNOWN IMPORTED)
  set_target_properties(xxHash::xxhash PROPERTIES
    IMPORTED_LOCATION "${xxHash_LIBRARY}"
    INTERFACE_INCLUDE_DIRECTORIES "${xxHash_INCLUDE_DIR}")
endif()
mark_as_advanced(xxHash_INCLUDE_DIR xxHash_LIBRARY)
