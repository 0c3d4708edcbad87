#pragma once
// What xlr8's CUDA plugin (libxlr8_cuda.so, compat/cuda_plugin.cpp) offers the library: the code that needs
// LibTorch's CUDA half (libtorch_cuda.so) to link, which the library and the programs built with it do not
// link (compat/cuda_on_demand.hpp says why). One entry point, kCudaPluginEntry, returns this table.
#include <chrono>
#include <memory>

#include <c10/util/intrusive_ptr.h>

namespace c10d {
class Backend;
class Store;
}  // namespace c10d

namespace xlr8::compat {

inline constexpr const char* kCudaPluginEntry = "xlr8_cuda_plugin";

struct CudaPlugin {
  // TORCH_VERSION and this table's layout version, as the plugin was built: one from another build is refused.
  const char* torch_version;
  int layout;
  // A ProcessGroupNCCL; `at_exit` is its registration for exit (compat/abort_at_exit.hpp: keep it beside the
  // group, drop it first).
  c10::intrusive_ptr<c10d::Backend> (*make_nccl)(const c10::intrusive_ptr<c10d::Store>& store, int rank, int size,
                                                 std::chrono::milliseconds timeout, std::shared_ptr<void>& at_exit);
  // Arms the exit handler that aborts the NCCL groups before CUDA's teardown (cheap after the first call).
  void (*abort_nccl_groups_at_exit)();
};

inline constexpr int kCudaPluginLayout = 1;

}  // namespace xlr8::compat
