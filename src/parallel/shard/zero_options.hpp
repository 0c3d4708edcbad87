#pragma once
// How every source of ZeRO / FSDP settings becomes the strategies' options, in one place: the launch's FSDP
// and DeepSpeed keys (Settings) and a DeepSpeed JSON's zero_optimization section, in Accelerate's order
// (the JSON's keys first, then the launch's; what the program set in AcceleratorOptions is kept).
#include "xlr8/deepspeed_config.hpp"
#include "xlr8/parallel_options.hpp"
#include "xlr8/settings.hpp"

namespace xlr8::shard {

// The one mapping resolve_plan (and make_parallel_strategy over a ProcessState) use: the JSON's section
// (when given) by apply_zero_config, then the launch's settings by resolve_zero_options.
ParallelOptions resolve_parallel_options(ParallelOptions options, const deepspeed::ZeroConfig* json,
                                         const Settings& settings, int node_size, bool parameters_in_host_memory);

// `options` with stage -1 resolved from the settings: DeepSpeed's zero_stage; FSDP's sharding strategy
// (FULL_SHARD 3, SHARD_GRAD_OP 2, NO_SHARD 0; FSDP2's reshard_after_forward true 3, false 2; HYBRID_SHARD
// 3 and HYBRID_SHARD_ZERO2 2 sharded over parallelism_config's dp_shard_size when it is above 1, else
// over `node_size` ranks; FSDP2 on a mesh with dp_replicate and dp_shard x cp x sp above 1 is hybrid too, as
// in Accelerate) and its wrap policy; 0 otherwise. Offload is cleared for `parameters_in_host_memory`: it
// moves state from an accelerator's memory to the host's, where parameters on the CPU are already.
ZeroOptions resolve_zero_options(ZeroOptions options, const Settings& settings, int node_size,
                                 bool parameters_in_host_memory = false);

// ConfigError for offload the stage cannot take: any offload without a stage (DDP), parameters below stage 3.
void check_offload_stage(const ZeroOptions& zero);

// The zero_optimization keys on the strategies' options: stage (unless the program chose one), bucket
// sizes (elements -> megabytes of float32), stage 3's units and persistence threshold, offload, unused
// parameters.
void apply_zero_config(const deepspeed::ZeroConfig& zero, ParallelOptions& parallel);
// Its sizes alone (bucket sizes; stage 3's persistence threshold, live bound and prefetch bucket), which a JSON's
// "auto" fills from each model's hidden size: options the plan resolved take them per model.
void apply_zero_sizes(const deepspeed::ZeroConfig& zero, ParallelOptions& parallel);

}  // namespace xlr8::shard
