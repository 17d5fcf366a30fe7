# SPDX-License-Identifier: Apache-2.0
# ctest driver: configure kvport with ARGS (a ;-list, given with , separators)
# into a scratch folder and require that the configure FAILS with a message
# matching EXPECT.
# EMPTY_PKG_CONFIG=ON runs it with a pkg-config that finds nothing (a
# machine without UCX or ZeroMQ).
#   cmake -DSOURCE_DIR=... -DWORK_DIR=... -DARGS=a,b -DEXPECT=regex [-DEMPTY_PKG_CONFIG=ON]
#         -P expect_configure_failure.cmake
string(REPLACE "," ";" args "${ARGS}")
file(REMOVE_RECURSE ${WORK_DIR})
set(env "")
if(EMPTY_PKG_CONFIG)
  file(MAKE_DIRECTORY ${WORK_DIR}-no-pkgconfig)
  set(env ${CMAKE_COMMAND} -E env PKG_CONFIG_LIBDIR=${WORK_DIR}-no-pkgconfig PKG_CONFIG_PATH=)
endif()
execute_process(
  COMMAND ${env} ${CMAKE_COMMAND} -S ${SOURCE_DIR} -B ${WORK_DIR} -G Ninja -DKVPORT_BUILD_TESTS=OFF
          -DKVPORT_BUILD_TOOLS=OFF -DKVPORT_BUILD_BENCHMARKS=OFF ${args}
  RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err)
file(REMOVE_RECURSE ${WORK_DIR} ${WORK_DIR}-no-pkgconfig)
if(rc EQUAL 0)
  message(FATAL_ERROR "configure with ${args} succeeded; expected it to fail")
endif()
if(NOT "${out}${err}" MATCHES "${EXPECT}")
  message(FATAL_ERROR "configure failed, but without a message matching '${EXPECT}':\n${err}")
endif()
message(STATUS "configure failed as expected: ${EXPECT}")
