#pragma once
// Test and benchmark hooks, not for production use. force_portable_kernel: run FusedAdam(W)'s portable
// loop even where the CPU has AVX2+FMA, so the path taken on other CPUs is tested on this one.
// use_torch_kernel_on_cpu: step CPU parameters with LibTorch's fused multi-tensor kernel (_fused_adamw_),
// the path CUDA parameters take, so that its batching is tested (and timed) here.
namespace xlr8::optim::detail {
void force_portable_kernel(bool on);
void use_torch_kernel_on_cpu(bool on);
}  // namespace xlr8::optim::detail
