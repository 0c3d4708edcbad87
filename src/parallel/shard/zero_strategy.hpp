#pragma once
// The ZeRO / FSDP strategy object behind the seam (its options: zero_options.hpp).
#include <memory>

#include "xlr8/parallel_strategy.hpp"
#include "parallel/shard/zero_options.hpp"

namespace xlr8::shard {

std::unique_ptr<ParallelStrategy> make_zero_strategy(std::shared_ptr<torch::nn::Module> module, Communicator comm,
                                                     const ParallelOptions& options,
                                                     std::shared_ptr<const GradientState> gradient_state);

}  // namespace xlr8::shard
