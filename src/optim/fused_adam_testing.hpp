#pragma once
// Test hook: run FusedAdam(W)'s portable loop even where the CPU has AVX2+FMA, so the path taken on
// other CPUs is tested on this one. Not for production use.
namespace xlr8::optim::detail {
void force_portable_kernel(bool on);
}
