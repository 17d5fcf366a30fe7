# SPDX-License-Identifier: Apache-2.0
# The dependency direction of docs/architecture.md, checked from the sources:
#   tools -> {sim, transfer, events, router, disk} -> core -> platform <- backends;
#   benchmarks -> sim/core.
# Fails (listing every offending include or link) when
#   - a file outside tools/ (and the CLI's own tests) includes kvport/cli/;
#   - sim/ includes a backend or tools header (kvport/backends/, kvport/cli/);
#   - router/ includes sim, transfer, events or a backend (core and platform only),
#     except that its ZeroMQ subscriber (router/src/subscriber.cpp, a target of
#     its own) includes events/;
#   - disk/ includes sim, transfer, events, router or a backend (core and platform only);
#   - core/ includes sim, transfer, disk, a backend or the CLI; platform/ includes anything
#     above it; backends/ include core, sim or the CLI;
#   - benchmarks/ or sim/ link kvport_cli, or sim/ links a backend.
# Usage: cmake -DSOURCE_DIR=<repo> -P check_layering.cmake
if(NOT SOURCE_DIR)
  message(FATAL_ERROR "check_layering: pass -DSOURCE_DIR=<repository root>")
endif()

set(violations "")

# check_includes(<folder> <regex of forbidden include paths> <why> [<regex of exempt files>])
function(check_includes folder forbidden why)
  set(exempt "${ARGV3}")
  file(GLOB_RECURSE files LIST_DIRECTORIES false
       "${SOURCE_DIR}/${folder}/*.hpp" "${SOURCE_DIR}/${folder}/*.cpp"
       "${SOURCE_DIR}/${folder}/*.h" "${SOURCE_DIR}/${folder}/*.cu" "${SOURCE_DIR}/${folder}/*.cuh")
  foreach(file IN LISTS files)
    file(RELATIVE_PATH rel "${SOURCE_DIR}" "${file}")
    if(rel MATCHES "^tests/unit/cli/|^tests/layering/")
      continue()  # the CLI's own tests test the CLI; the fixtures violate on purpose
    endif()
    if(exempt AND rel MATCHES "${exempt}")
      continue()
    endif()
    file(STRINGS "${file}" lines REGEX "^[ \t]*#[ \t]*include[ \t]*[<\"]${forbidden}")
    foreach(line IN LISTS lines)
      string(STRIP "${line}" line)
      list(APPEND violations "${rel}: ${line} (${why})")
    endforeach()
  endforeach()
  set(violations "${violations}" PARENT_SCOPE)
endfunction()

# check_links(<CMakeLists.txt> <regex of forbidden targets> <why>)
function(check_links cmake_file forbidden why)
  if(NOT EXISTS "${SOURCE_DIR}/${cmake_file}")
    return()
  endif()
  file(READ "${SOURCE_DIR}/${cmake_file}" text)
  # Comments may name what is not linked.
  string(REGEX REPLACE "#[^\n]*" "" text "${text}")
  string(REGEX MATCHALL "target_link_libraries\\([^)]*\\)" calls "${text}")
  foreach(call IN LISTS calls)
    if(call MATCHES "${forbidden}")
      list(APPEND violations "${cmake_file}: links ${CMAKE_MATCH_0} (${why})")
    endif()
  endforeach()
  set(violations "${violations}" PARENT_SCOPE)
endfunction()

foreach(folder platform core sim backends benchmarks tests transfer bindings router disk)
  check_includes(${folder} "kvport/cli/" "only tools/ may include the CLI")
endforeach()
check_includes(sim "kvport/backends/" "sim depends on core and platform only")
foreach(above sim backends)
  check_includes(transfer "kvport/${above}/" "transfer depends on core and platform only")
endforeach()
foreach(above sim transfer backends disk)
  check_includes(core "kvport/${above}/" "core depends on platform only")
endforeach()
foreach(above core sim backends)
  check_includes(platform "kvport/${above}/" "platform is the bottom layer")
endforeach()
foreach(above sim transfer backends)
  check_includes(router "kvport/${above}/" "router depends on core and platform only")
endforeach()
foreach(above sim transfer backends events router)
  check_includes(disk "kvport/${above}/" "disk depends on core and platform only")
endforeach()
check_includes(router "kvport/events/" "router depends on core and platform only"
               "^router/src/subscriber\\.cpp$")
foreach(above core sim)
  check_includes(backends "kvport/${above}/" "backends never include core or above")
endforeach()
check_links(benchmarks/CMakeLists.txt "kvport_cli" "benchmarks link sim/core, not the CLI")
check_links(sim/CMakeLists.txt "kvport_cli|kvport::backends|kvport_backends|kvport::host|kvport_host"
            "sim depends on core and platform only")

if(violations)
  list(LENGTH violations count)
  list(JOIN violations "\n  " listed)
  message(FATAL_ERROR "layering: ${count} violation(s) of the dependency direction:\n  ${listed}")
endif()
message(STATUS "layering: ok")
