# `cmake --install build --prefix P`: public headers, the libraries, the `xlr8` CLI and a CMake package
# (find_package(xlr8) + xlr8::xlr8), and `cpack -G DEB` for a Debian package of the same files.
include(CMakePackageConfigHelpers)

set(XLR8_CMAKE_DIR ${CMAKE_INSTALL_LIBDIR}/cmake/xlr8)

install(TARGETS xlr8 xlr8_base EXPORT xlr8Targets
        ARCHIVE DESTINATION ${CMAKE_INSTALL_LIBDIR}
        LIBRARY DESTINATION ${CMAKE_INSTALL_LIBDIR})
if(XLR8_WITH_NCCL)  # the CUDA plugin (src/compat/cuda_on_demand.hpp): consumers link it
  install(TARGETS xlr8_cuda EXPORT xlr8Targets LIBRARY DESTINATION ${CMAKE_INSTALL_LIBDIR})
endif()
install(TARGETS xlr8_cli RUNTIME DESTINATION ${CMAKE_INSTALL_BINDIR})
install(TARGETS xlr8_full RUNTIME DESTINATION ${CMAKE_INSTALL_LIBEXECDIR}/xlr8)  # found by xlr8 through ../libexec/xlr8
# Only include/xlr8 is public; src/ headers stay private.
install(DIRECTORY include/xlr8 DESTINATION ${CMAKE_INSTALL_INCLUDEDIR} FILES_MATCHING PATTERN "*.hpp")
install(FILES examples/slurm/train.sbatch DESTINATION ${CMAKE_INSTALL_DOCDIR}/examples)
install(EXPORT xlr8Targets NAMESPACE xlr8:: DESTINATION ${XLR8_CMAKE_DIR})

set(XLR8_OPENMP ${OpenMP_CXX_FOUND})
get_filename_component(XLR8_TORCH_CMAKE_DIR "${Torch_DIR}" DIRECTORY)  # <LibTorch>/share/cmake
configure_package_config_file(cmake/xlr8Config.cmake.in ${CMAKE_CURRENT_BINARY_DIR}/xlr8Config.cmake
                              INSTALL_DESTINATION ${XLR8_CMAKE_DIR})
# 0.x: a minor release may break the API, so only the same minor version is compatible.
write_basic_package_version_file(${CMAKE_CURRENT_BINARY_DIR}/xlr8ConfigVersion.cmake
                                 COMPATIBILITY SameMinorVersion)
install(FILES ${CMAKE_CURRENT_BINARY_DIR}/xlr8Config.cmake ${CMAKE_CURRENT_BINARY_DIR}/xlr8ConfigVersion.cmake
              ${CMAKE_CURRENT_SOURCE_DIR}/cmake/torch_link_fixes.cmake
        DESTINATION ${XLR8_CMAKE_DIR})

# --- Debian package: xlr8_<version>_<arch>.deb, installed under /usr.
set(CPACK_PACKAGE_NAME xlr8)
set(CPACK_PACKAGE_VENDOR xlr8)
set(CPACK_PACKAGE_CONTACT "xlr8 developers <xlr8@localhost>")
set(CPACK_PACKAGE_DESCRIPTION_SUMMARY "distributed training for LibTorch (C++): launcher, Accelerator, DDP")
set(CPACK_PACKAGING_INSTALL_PREFIX /usr)
set(CPACK_DEBIAN_FILE_NAME DEB-DEFAULT)
set(CPACK_DEBIAN_PACKAGE_SECTION devel)
# Run-time libraries of the CLI come from dpkg-shlibdeps; building against xlr8 needs the -dev packages
# its exported target finds with find_dependency (cmake/xlr8Config.cmake.in).
set(CPACK_DEBIAN_PACKAGE_SHLIBDEPS ON)
# The static libraries are built against one LibTorch release. Debian's (Debian 13's libtorch-dev) is a
# dependency, that major.minor only; a wheel's is no Debian package: the package names it in its description
# instead, and its programs find it where it was (RUNPATH), as find_package(xlr8) does (Torch_DIR).
set(XLR8_DEB_DEPENDS "libgloo-dev, libyaml-cpp-dev, nlohmann-json3-dev, libfmt-dev, zlib1g-dev, libprotobuf-dev, libgomp1")
find_program(XLR8_DPKG dpkg)
set(_torch_owner "")
if(XLR8_DPKG)
  execute_process(COMMAND ${XLR8_DPKG} -S "${TORCH_INSTALL_PREFIX}/lib/libtorch.so" OUTPUT_VARIABLE _torch_owner
                  ERROR_QUIET OUTPUT_STRIP_TRAILING_WHITESPACE)
endif()
if(_torch_owner)
  string(REGEX MATCH "^[0-9]+\\.[0-9]+" XLR8_TORCH_MINOR "${Torch_VERSION}")
  math(EXPR XLR8_TORCH_NEXT_MINOR "${Torch_VERSION_MINOR} + 1")
  string(PREPEND XLR8_DEB_DEPENDS "libtorch-dev (>= ${XLR8_TORCH_MINOR}), libtorch-dev (<< ${Torch_VERSION_MAJOR}.${XLR8_TORCH_NEXT_MINOR}), ")
  set(XLR8_DEB_TORCH "Debian's libtorch-dev ${Torch_VERSION}")
else()
  get_filename_component(_torch_dir "${TORCH_INSTALL_PREFIX}" ABSOLUTE)
  set(XLR8_DEB_TORCH "LibTorch ${Torch_VERSION} from ${_torch_dir}, which no Debian package provides (PyPI's torch==${Torch_VERSION}): keep it there")
endif()
set(CPACK_DEBIAN_PACKAGE_DEPENDS "${XLR8_DEB_DEPENDS}")
set(CPACK_PACKAGE_DESCRIPTION "Built against ${XLR8_DEB_TORCH}.")
set(CPACK_DEBIAN_PACKAGE_RECOMMENDS "cmake, g++")
set(CPACK_DEBIAN_PACKAGE_SUGGESTS "openmpi-bin, slurm-client")
include(CPack)
