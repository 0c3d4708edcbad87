#pragma once
// Tensor memory of this process, for `xlr8 advise`: bytes live now and the most live since a reset. On the CPU
// a counting allocator wraps LibTorch's (installed once, under advise only: one small record per
// allocation); on CUDA the caching allocator's own statistics for the current device.
#include <cstdint>

namespace xlr8::detail::memory_meter {

// Starts counting (idempotent). Tensors allocated before are not counted: read differences.
void install();
struct Reading {
  int64_t live = 0, peak = 0;  // bytes
};
Reading read();
void reset_peak();  // peak := live

}  // namespace xlr8::detail::memory_meter
