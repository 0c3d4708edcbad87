# Two fixes to what a wheel's TorchConfig links, shared by the build (CMakeLists.txt) and the installed package
# (xlr8Config.cmake), which runs this file after its own find_dependency(Torch).
#
# 1. TorchConfig finds c10 by find_library(c10 PATHS <its prefix>/lib), which tries the system's directories
#    first: with Debian's libtorch-dev installed beside a wheel, a program linked Debian's libc10.so.1.13 next
#    to the wheel's libtorch (two c10 in one process; or "DSO missing from command line"). The c10 of the
#    LibTorch that was found, when it has one, wins.
if(TORCH_INSTALL_PREFIX AND EXISTS "${TORCH_INSTALL_PREFIX}/lib/libc10.so"
   AND NOT c10_LIBRARY STREQUAL "${TORCH_INSTALL_PREFIX}/lib/libc10.so")
  list(REMOVE_ITEM TORCH_LIBRARIES "${c10_LIBRARY}")
  set(c10_LIBRARY "${TORCH_INSTALL_PREFIX}/lib/libc10.so" CACHE FILEPATH "LibTorch's c10" FORCE)
  list(APPEND TORCH_LIBRARIES "${c10_LIBRARY}")
endif()
# 2. A program linking a CUDA wheel's libtorch_cuda.so resolves its NCCL symbols against the first libnccl.so.2
#    the linker meets, and the CUDA toolkit's lib/ (on the rpath through LibTorch's CUDA libraries) may hold an
#    older one: CUDA 13.0's NCCL 2.28 lacks ncclCommGrow & co., which torch 2.15 needs. The nvidia-nccl wheel's
#    copy beside torch (what libtorch_cuda.so loads at run time) is searched first (-rpath-link). Not linked:
#    our code calls no NCCL function.
set(XLR8_TORCH_LINK_OPTIONS "")
if(TORCH_INSTALL_PREFIX AND EXISTS "${TORCH_INSTALL_PREFIX}/../nvidia/nccl/lib/libnccl.so.2")
  get_filename_component(_xlr8_nccl_libdir "${TORCH_INSTALL_PREFIX}/../nvidia/nccl/lib" ABSOLUTE)
  set(XLR8_TORCH_LINK_OPTIONS "LINKER:-rpath-link,${_xlr8_nccl_libdir}")
endif()
