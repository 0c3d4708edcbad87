#pragma once
// Tensor memory of this process, for `xlr8 advise`: bytes live now and the most live since a reset. On the CPU
// a counting allocator wraps LibTorch's (installed once, under advise only: one small record per
// allocation); on CUDA the caching allocator's own statistics for the current device.
#include <c10/core/Device.h>

#include <cstdint>

namespace xlr8::diagnostics::memory_meter {

// Starts counting the memory of `device`'s kind (idempotent). Tensors allocated before are not counted: read
// differences.
void install(const c10::Device& device);
struct Reading {
  int64_t live = 0, peak = 0;  // bytes
};
Reading read(const c10::Device& device);
void reset_peak(const c10::Device& device);  // peak := live

}  // namespace xlr8::diagnostics::memory_meter
