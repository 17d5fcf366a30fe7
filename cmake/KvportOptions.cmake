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

# kvport_add_library(<name> <alias> SOURCES ...) - a static library with the
# project's warning flags and an include/ folder as its public interface.
function(kvport_target_defaults target)
  target_link_libraries(${target} PRIVATE $<BUILD_INTERFACE:kvport_warnings>)
  target_compile_features(${target} PUBLIC cxx_std_20)
endfunction()
