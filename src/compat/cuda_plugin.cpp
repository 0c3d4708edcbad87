// libxlr8_cuda.so: the part of xlr8 that links LibTorch's CUDA half (compat/cuda_on_demand.hpp loads it where
// CUDA can run; an installed package's consumers link it). It uses LibTorch alone, nothing of libxlr8.a, so
// that it loads into any program built with xlr8.
#include <torch/csrc/distributed/c10d/ProcessGroupNCCL.hpp>
#include <torch/version.h>

#include "compat/abort_at_exit.hpp"
#include "compat/cuda_plugin.hpp"

namespace {

using NcclGroupsAtExit = xlr8::compat::AbortAtExit<c10d::ProcessGroupNCCL>;

c10::intrusive_ptr<c10d::Backend> make_nccl(const c10::intrusive_ptr<c10d::Store>& store, int rank, int size,
                                            std::chrono::milliseconds timeout, std::shared_ptr<void>& at_exit) {
  auto options = c10d::ProcessGroupNCCL::Options::create();
  options->timeout = timeout;
  auto group = c10::make_intrusive<c10d::ProcessGroupNCCL>(store, rank, size, options);
  at_exit = NcclGroupsAtExit::instance().add(group);
  return group;
}

void abort_nccl_groups_at_exit() { NcclGroupsAtExit::arm(); }

}  // namespace

extern "C" __attribute__((visibility("default"))) const xlr8::compat::CudaPlugin* xlr8_cuda_plugin() {
  static const xlr8::compat::CudaPlugin plugin{TORCH_VERSION, xlr8::compat::kCudaPluginLayout, &make_nccl,
                                               &abort_nccl_groups_at_exit};
  return &plugin;
}
