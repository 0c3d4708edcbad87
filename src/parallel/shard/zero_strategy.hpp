#pragma once
// The ZeRO / FSDP strategy object behind the seam, and how the process's settings choose its stage.
#include <memory>

#include "xlr8/parallel_strategy.hpp"
#include "xlr8/settings.hpp"

namespace xlr8::detail {

std::unique_ptr<ParallelStrategy> make_zero_strategy(std::shared_ptr<torch::nn::Module> module, Communicator comm,
                                                     const ParallelOptions& options,
                                                     std::shared_ptr<const GradientState> gradient_state);

// `options` with stage -1 resolved from the settings: DeepSpeed's zero_stage; FSDP's sharding strategy
// (FULL_SHARD 3, SHARD_GRAD_OP 2, NO_SHARD 0; FSDP2's reshard_after_forward true 3, false 2; HYBRID_SHARD
// 3 and HYBRID_SHARD_ZERO2 2 sharded over parallelism_config's dp_shard_size when it is above 1, else
// over `node_size` ranks; FSDP2 on a mesh with dp_replicate and dp_shard x cp x sp above 1 is hybrid too, as
// in Accelerate) and its wrap policy; 0 otherwise.
ZeroOptions resolve_zero_options(ZeroOptions options, const Settings& settings, int node_size);

}  // namespace xlr8::detail
