# `cmake --install` produces a CMake package: find_package(kvport) gives
# kvport::core, kvport::host, kvport::backends, kvport::platform,
# kvport::transfer (block transfer over UCX), kvport::events (cache events
# in vLLM's wire format over ZeroMQ), kvport::router (the cache-aware router
# index and policies) and kvport::router_subscriber (its ZeroMQ subscriber).
include(GNUInstallDirs)
include(CMakePackageConfigHelpers)

set(KVPORT_INSTALL_CMAKEDIR ${CMAKE_INSTALL_LIBDIR}/cmake/kvport)

install(TARGETS kvport_platform kvport_core kvport_transfer kvport_events kvport_router
                kvport_router_subscriber kvport_backends ${KVPORT_BACKEND_TARGETS}
        EXPORT kvportTargets
        ARCHIVE DESTINATION ${CMAKE_INSTALL_LIBDIR}
        LIBRARY DESTINATION ${CMAKE_INSTALL_LIBDIR}
        RUNTIME DESTINATION ${CMAKE_INSTALL_BINDIR})
install(DIRECTORY platform/include/ core/include/ transfer/include/ events/include/
                  router/include/ backends/host/include/
        DESTINATION ${CMAKE_INSTALL_INCLUDEDIR})
if(KVPORT_HAVE_CUDA)
  install(DIRECTORY backends/cuda/include/ DESTINATION ${CMAKE_INSTALL_INCLUDEDIR})
endif()
if(KVPORT_HAVE_HIP)
  install(DIRECTORY backends/hip/include/ DESTINATION ${CMAKE_INSTALL_INCLUDEDIR})
endif()
install(EXPORT kvportTargets NAMESPACE kvport:: DESTINATION ${KVPORT_INSTALL_CMAKEDIR})

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
