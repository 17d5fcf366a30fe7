# SPDX-License-Identifier: Apache-2.0
# `cmake --install` produces a CMake package with components:
#   core (always): kvport::core, kvport::platform, kvport::host,
#     kvport::backends (and kvport::cuda / kvport::hip when built),
#     kvport::router (the cache-aware router index and policies) and
#     kvport::c (the C ABI, when built); no UCX, no ZeroMQ.
#   transfer: kvport::transfer (block transfer over UCX), when built
#     (KVPORT_WITH_TRANSFER); its consumers need UCX (pkg-config ucx).
#   events: kvport::events (cache events in vLLM's wire format over ZeroMQ)
#     and kvport::router_subscriber (the router's ZeroMQ subscriber); their
#     consumers need libzmq (pkg-config libzmq).
# find_package(kvport) loads core and every optional component whose
# dependencies it finds; find_package(kvport COMPONENTS transfer) fails, with
# the reason, when the transfer component cannot be loaded.
# (kvportConfig.cmake.in; docs/bindings.md shows a consumer.)
include(GNUInstallDirs)
include(CMakePackageConfigHelpers)

set(KVPORT_INSTALL_CMAKEDIR ${CMAKE_INSTALL_LIBDIR}/cmake/kvport)

install(TARGETS kvport_platform kvport_core kvport_router kvport_backends ${KVPORT_BACKEND_TARGETS}
        EXPORT kvportTargets
        ARCHIVE DESTINATION ${CMAKE_INSTALL_LIBDIR}
        LIBRARY DESTINATION ${CMAKE_INSTALL_LIBDIR}
        RUNTIME DESTINATION ${CMAKE_INSTALL_BINDIR})
install(TARGETS kvport_events kvport_router_subscriber
        EXPORT kvportEventsTargets
        ARCHIVE DESTINATION ${CMAKE_INSTALL_LIBDIR})
install(DIRECTORY platform/include/ core/include/ events/include/ router/include/
                  backends/host/include/
        DESTINATION ${CMAKE_INSTALL_INCLUDEDIR})
if(KVPORT_HAVE_TRANSFER)
  install(TARGETS kvport_transfer
          EXPORT kvportTransferTargets
          ARCHIVE DESTINATION ${CMAKE_INSTALL_LIBDIR})
  install(DIRECTORY transfer/include/ DESTINATION ${CMAKE_INSTALL_INCLUDEDIR})
  install(EXPORT kvportTransferTargets NAMESPACE kvport:: DESTINATION ${KVPORT_INSTALL_CMAKEDIR})
endif()
if(KVPORT_HAVE_CUDA)
  install(DIRECTORY backends/cuda/include/ DESTINATION ${CMAKE_INSTALL_INCLUDEDIR})
endif()
if(KVPORT_HAVE_HIP)
  install(DIRECTORY backends/hip/include/ DESTINATION ${CMAKE_INSTALL_INCLUDEDIR})
endif()
install(EXPORT kvportTargets NAMESPACE kvport:: DESTINATION ${KVPORT_INSTALL_CMAKEDIR})
install(EXPORT kvportEventsTargets NAMESPACE kvport:: DESTINATION ${KVPORT_INSTALL_CMAKEDIR})

configure_package_config_file(cmake/kvportConfig.cmake.in
  ${PROJECT_BINARY_DIR}/kvportConfig.cmake
  INSTALL_DESTINATION ${KVPORT_INSTALL_CMAKEDIR})
write_basic_package_version_file(${PROJECT_BINARY_DIR}/kvportConfigVersion.cmake
  COMPATIBILITY SameMinorVersion)
install(FILES ${PROJECT_BINARY_DIR}/kvportConfig.cmake
              ${PROJECT_BINARY_DIR}/kvportConfigVersion.cmake
              ${PROJECT_SOURCE_DIR}/cmake/FindxxHash.cmake
        DESTINATION ${KVPORT_INSTALL_CMAKEDIR})
if(TARGET kvport)
  install(TARGETS kvport RUNTIME DESTINATION ${CMAKE_INSTALL_BINDIR})
endif()
