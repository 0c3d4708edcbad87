#pragma once
// What the DeepSpeed engine does with a PipelineModule before preparing it (src/deepspeed/deepspeed_pipeline.cpp).
#include <torch/nn/module.h>

#include "xlr8/deepspeed_config.hpp"

namespace xlr8::deepspeed {

// Under pp: the JSON's "pipeline" section against the module (partition must agree; its
// activation_checkpoint_interval applies when the module sets none). Other models pass unchanged.
void prepare_pipeline_module(torch::nn::Module& module, const Config& config);
// Under pp: what the engine's pipeline cannot take, in one line before anything is prepared (fp16; a launch's
// schedule or micro-batches other than DeepSpeed's 1F1B over gradient_accumulation_steps).
void check_pipeline_launch(const Config& config, const Settings& settings, const BatchSizes& sizes);

}  // namespace xlr8::deepspeed
