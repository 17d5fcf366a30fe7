# SPDX-License-Identifier: Apache-2.0
# ctest driver: fails when libkvport_c exports a symbol that is not kvport_*
# (a leaked C++ symbol of kvport, fmt, spdlog, abseil, ...).
#   cmake -DNM=nm -DLIBRARY=libkvport_c.so -P check_exports.cmake
execute_process(COMMAND ${NM} -D --defined-only ${LIBRARY}
                RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err)
if(NOT rc EQUAL 0)
  message(FATAL_ERROR "${NM} -D --defined-only ${LIBRARY} failed (${rc}): ${err}")
endif()
string(REPLACE "\n" ";" lines "${out}")
set(exported 0)
set(foreign "")
foreach(line IN LISTS lines)
  if(line STREQUAL "")
    continue()
  endif()
  # "<address> <type> <name>"
  string(REGEX REPLACE "^[0-9a-fA-F]* *[A-Za-z] " "" name "${line}")
  if(name MATCHES "^kvport_")
    math(EXPR exported "${exported} + 1")
  else()
    list(APPEND foreign "${line}")
  endif()
endforeach()
if(foreign)
  list(JOIN foreign "\n  " text)
  message(FATAL_ERROR "${LIBRARY} exports symbols other than kvport_*:\n  ${text}")
endif()
if(exported EQUAL 0)
  message(FATAL_ERROR "${LIBRARY} exports no kvport_* symbol")
endif()
message(STATUS "${LIBRARY}: ${exported} symbols exported, all kvport_*")
