#pragma once
// LibTorch's CUDA half is loaded only where CUDA can run.
//
// A CUDA LibTorch's programs link libtorch_cuda.so, which brings cuBLAS, cuDNN, NCCL & co. and registers every
// CUDA kernel while the program starts: about 0.2 s of CPU and a second of teardown work per process, on a
// machine with no GPU too (our test suite starts thousands of processes). xlr8's library and the programs built
// in this project link LibTorch's CPU part, and load the rest through xlr8's CUDA plugin (libxlr8_cuda.so,
// compat/cuda_plugin.hpp) when the NVIDIA driver's library, libcuda.so.1, loads: without it CUDA cannot run, so
// a program sees the same devices either way. The check runs while the program starts (a static initializer),
// so that torch::cuda::is_available() in main() already sees the GPUs. An installed package's consumers link
// the plugin and LibTorch whole, as any LibTorch program does.
namespace xlr8::compat {

struct CudaPlugin;

// Whether the NVIDIA driver's library loads (then CUDA's half of LibTorch is loaded while the program starts).
bool cuda_driver_loads();

// Loads the plugin, and with it libtorch_cuda.so, where the driver loads (done while the program starts; cheap
// after): a driver whose plugin does not load is an xlr8::Error naming the plugin and the reason.
void require_cuda_where_it_can_run();

// The plugin, loading it (and libtorch_cuda.so) if it is not yet: on a machine without a driver too (tests);
// throws xlr8::Error naming the path and the reason when it cannot.
const CudaPlugin& cuda_plugin();

}  // namespace xlr8::compat
