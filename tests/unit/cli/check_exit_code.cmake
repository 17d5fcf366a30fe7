# SPDX-License-Identifier: Apache-2.0
# cmake -DKVPORT=<binary> -DARGS=<a,b,c> -DEXPECTED_CODE=<n> -P check_exit_code.cmake
# Runs the binary and checks its exit code; for a non-zero code also that
# stderr is exactly one line starting with "kvport: error: ".
string(REPLACE "," ";" arg_list "${ARGS}")
execute_process(COMMAND ${KVPORT} ${arg_list}
                RESULT_VARIABLE code OUTPUT_VARIABLE out ERROR_VARIABLE err)
if(NOT code STREQUAL EXPECTED_CODE)
  message(FATAL_ERROR "kvport ${ARGS}: exit code ${code}, expected ${EXPECTED_CODE}\n"
                      "stdout: ${out}\nstderr: ${err}")
endif()
if(NOT EXPECTED_CODE STREQUAL "0")
  if(NOT err MATCHES "^kvport: error: [^\n]+\n$")
    message(FATAL_ERROR "kvport ${ARGS}: stderr is not one 'kvport: error: ' line:\n${err}")
  endif()
  if(NOT out STREQUAL "")
    message(FATAL_ERROR "kvport ${ARGS}: unexpected stdout:\n${out}")
  endif()
endif()
message(STATUS "kvport ${ARGS}: exit code ${code}: ${err}")
