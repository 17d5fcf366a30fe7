# SPDX-License-Identifier: Apache-2.0
# ctest driver: install the build tree into a scratch prefix, then configure,
# build and run the consumer projects against it: core_consumer (the core
# only, without UCX and ZeroMQ) and consumer (events, and transfer when
# HAVE_TRANSFER is true). When the C ABI is installed,
# also build and run its C consumer through find_package (kvport::c) and
# through pkg-config (kvport.pc).
#   cmake -DBUILD_DIR=... -DSOURCE_DIR=... -DWORK_DIR=... [-DC_COMPILER=cc]
#         [-DHAVE_TRANSFER=ON|OFF]
#         -P check_install.cmake
foreach(var BUILD_DIR SOURCE_DIR WORK_DIR)
  if(NOT DEFINED ${var})
    message(FATAL_ERROR "check_install.cmake: ${var} is not set")
  endif()
endforeach()
file(REMOVE_RECURSE ${WORK_DIR})
set(prefix ${WORK_DIR}/prefix)

function(run)
  execute_process(COMMAND ${ARGN} RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err)
  if(NOT rc EQUAL 0)
    message(FATAL_ERROR "command failed (${rc}): ${ARGN}\n${out}\n${err}")
  endif()
  message(STATUS "${out}")
endfunction()

run(${CMAKE_COMMAND} --install ${BUILD_DIR} --prefix ${prefix})

# The core alone, on a machine without UCX and ZeroMQ: a pkg-config that
# finds neither (its search path an empty folder). Asked for as
# COMPONENTS core and as a plain find_package(kvport); asking for transfer
# there fails the configure and says why.
set(no_pkgs ${WORK_DIR}/no-pkgconfig)
file(MAKE_DIRECTORY ${no_pkgs})
set(no_pkgs_env ${CMAKE_COMMAND} -E env PKG_CONFIG_LIBDIR=${no_pkgs} PKG_CONFIG_PATH=)
foreach(components "core" "")
  set(dir ${WORK_DIR}/core-build-${components})
  run(${no_pkgs_env} ${CMAKE_COMMAND} -S ${SOURCE_DIR}/tests/install/core_consumer -B ${dir}
      -G Ninja -DCMAKE_PREFIX_PATH=${prefix} -DCMAKE_BUILD_TYPE=Release
      "-DKVPORT_COMPONENTS=${components}")
  run(${CMAKE_COMMAND} --build ${dir})
  run(${dir}/core_consumer)
endforeach()
execute_process(COMMAND ${no_pkgs_env} ${CMAKE_COMMAND} -S ${SOURCE_DIR}/tests/install/core_consumer
                        -B ${WORK_DIR}/core-build-transfer -G Ninja -DCMAKE_PREFIX_PATH=${prefix}
                        "-DKVPORT_COMPONENTS=core;transfer"
                RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err)
if(rc EQUAL 0 OR NOT err MATCHES "transfer: ")
  message(FATAL_ERROR "find_package(kvport COMPONENTS transfer) without UCX: expected a failure "
                      "naming the component, got ${rc}:\n${out}\n${err}")
endif()
string(REGEX MATCH "kvport: required components not available:[^\n]*" why "${err}")
message(STATUS "without UCX, COMPONENTS transfer fails: ${why}")

# Every component built, with UCX and ZeroMQ found.
if(NOT DEFINED HAVE_TRANSFER)
  set(HAVE_TRANSFER ON)
endif()
run(${CMAKE_COMMAND} -S ${SOURCE_DIR}/tests/install/consumer -B ${WORK_DIR}/build -G Ninja
    -DCMAKE_PREFIX_PATH=${prefix} -DCMAKE_BUILD_TYPE=Release -DWITH_TRANSFER=${HAVE_TRANSFER})
run(${CMAKE_COMMAND} --build ${WORK_DIR}/build)
run(${WORK_DIR}/build/consumer)

if(EXISTS ${prefix}/include/kvport/kvport.h)
  run(${WORK_DIR}/build/c_consumer)
  # pkg-config: the .pc file is relocatable (its prefix is its own place).
  find_program(PKG_CONFIG pkg-config REQUIRED)
  file(GLOB pc_files ${prefix}/*/pkgconfig/kvport.pc ${prefix}/*/*/pkgconfig/kvport.pc)
  if(NOT pc_files)
    message(FATAL_ERROR "kvport.pc is not installed under ${prefix}")
  endif()
  list(GET pc_files 0 pc_file)
  get_filename_component(pc_dir ${pc_file} DIRECTORY)
  execute_process(COMMAND ${CMAKE_COMMAND} -E env PKG_CONFIG_PATH=${pc_dir}
                          ${PKG_CONFIG} --cflags --libs kvport
                  RESULT_VARIABLE rc OUTPUT_VARIABLE flags ERROR_VARIABLE err
                  OUTPUT_STRIP_TRAILING_WHITESPACE)
  if(NOT rc EQUAL 0)
    message(FATAL_ERROR "pkg-config --cflags --libs kvport failed (${rc}): ${err}")
  endif()
  message(STATUS "pkg-config --cflags --libs kvport: ${flags}")
  separate_arguments(flag_list UNIX_COMMAND "${flags}")
  if(NOT C_COMPILER)
    set(C_COMPILER cc)
  endif()
  run(${C_COMPILER} -std=c99 -Wall -Wextra -Werror -pedantic
      ${SOURCE_DIR}/tests/install/consumer/c_consumer.c ${flag_list}
      -Wl,-rpath,${pc_dir}/.. -o ${WORK_DIR}/c_consumer_pkgconfig)
  run(${WORK_DIR}/c_consumer_pkgconfig)
endif()
