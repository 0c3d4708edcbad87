#pragma once
// What AcceleratorOptions passes to make_parallel_strategy: each data-parallel strategy reads its own part
// (kept out of parallel_strategy.hpp, so that the seam does not know its implementations' options).
#include "xlr8/ddp.hpp"
#include "xlr8/zero.hpp"

namespace xlr8 {

struct ParallelOptions {
  DDPOptions ddp;
  ZeroOptions zero;
};

}  // namespace xlr8
