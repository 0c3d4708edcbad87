# The LibTorch to build against: by default the one inside the pinned `torch` wheel that scripts/setup installs
# into the project's .venv (torch-requirements.txt). -DXLR8_PYTHON=<python> takes another Python's torch;
# -DXLR8_PYTHON=OFF (or a Torch_DIR / CMAKE_PREFIX_PATH of one's own) any other LibTorch 2.6 or newer.
# Nothing is imported: the paths come from the packages' locations, so this costs no `import torch`.
set(_xlr8_default_python "")
if(EXISTS "${CMAKE_CURRENT_SOURCE_DIR}/.venv/bin/python3")
  set(_xlr8_default_python "${CMAKE_CURRENT_SOURCE_DIR}/.venv/bin/python3")
endif()
set(XLR8_PYTHON "${_xlr8_default_python}" CACHE STRING
    "Python whose torch wheel provides LibTorch (default: the project's .venv; OFF: find LibTorch elsewhere)")

# Prints the directory of an installed (possibly namespace) package, or nothing.
function(_xlr8_python_package_dir package out)
  execute_process(
    COMMAND "${XLR8_PYTHON}" -c
            "import importlib.util as u, sys\ns = u.find_spec(sys.argv[1])\nprint(list(s.submodule_search_locations)[0] if s else '')"
            "${package}"
    OUTPUT_VARIABLE dir OUTPUT_STRIP_TRAILING_WHITESPACE ERROR_QUIET RESULT_VARIABLE rc)
  if(NOT rc EQUAL 0)
    set(dir "")
  endif()
  set(${out} "${dir}" PARENT_SCOPE)
endfunction()

if(XLR8_PYTHON)
  _xlr8_python_package_dir(torch XLR8_TORCH_PACKAGE_DIR)
  if(NOT XLR8_TORCH_PACKAGE_DIR)
    message(FATAL_ERROR "XLR8_PYTHON=${XLR8_PYTHON} has no torch package: run scripts/setup (it installs the pinned "
                        "torch into .venv), or pass -DXLR8_PYTHON=OFF with -DCMAKE_PREFIX_PATH=<your LibTorch>")
  endif()
  list(APPEND CMAKE_PREFIX_PATH "${XLR8_TORCH_PACKAGE_DIR}/share/cmake")
  # The wheel's CUDA build: NCCL comes as the nvidia-nccl wheel beside it (the CUDA toolkit's NCCL may be older).
  _xlr8_python_package_dir(nvidia.nccl _nccl_dir)
  if(_nccl_dir AND NOT XLR8_NCCL_INCLUDE)
    set(XLR8_NCCL_INCLUDE "${_nccl_dir}/include" CACHE PATH "nccl.h's directory")
  endif()
endif()

# A CUDA LibTorch's TorchConfig looks for the CUDA toolkit: the machine's /usr/local/cuda unless told otherwise.
if(NOT DEFINED CUDAToolkit_ROOT AND NOT DEFINED ENV{CUDAToolkit_ROOT} AND EXISTS /usr/local/cuda/bin/nvcc)
  set(CUDAToolkit_ROOT /usr/local/cuda)
endif()
# Without a GPU to ask, TorchConfig would guess the architectures to compile CUDA kernels for. We compile no
# kernels (only host code against LibTorch's CUDA headers), so any list serves; Hopper's is the machines' own.
if(NOT DEFINED TORCH_CUDA_ARCH_LIST AND NOT DEFINED ENV{TORCH_CUDA_ARCH_LIST})
  set(TORCH_CUDA_ARCH_LIST 9.0)
endif()
