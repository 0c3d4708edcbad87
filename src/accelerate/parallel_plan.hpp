#pragma once
// Resolving the ParallelPlan: the one place the Accelerator's sources of settings become what it does.
#include <nlohmann/json.hpp>

#include "xlr8/accelerator.hpp"
#include "xlr8/deepspeed_config.hpp"
#include "xlr8/env.hpp"
#include "xlr8/parallel_plan.hpp"

namespace xlr8::accelerate {

struct PlanInputs {
  const ProcessState* state = nullptr;
  const AcceleratorOptions* options = nullptr;
  at::Device device{at::kCPU};
  MixedPrecision precision = MixedPrecision::NO;  // the program's, else the launch's
  int accumulation = 1;                           // the launch's, else the program's (gradient_accumulation_steps_for)
  // The DeepSpeed JSON that configures the run: the launch's (--deepspeed_config_file, already filled from the
  // launch by the Accelerator's DeepSpeedPlugin) or deepspeed::initialize's. Its precision, accumulation, ZeRO
  // keys, loss scaler and clipping win.
  const deepspeed::Config* deepspeed = nullptr;
  bool from_engine = false;            // deepspeed::initialize's Accelerator: its JSON is resolved already
  int micro_batches_per_rank = 1;      // xlr8 verify's third run: each rank stands for several
};

// Every environment variable the plan reads (XLR8_TP_PLAN_FILE, XLR8_TP_SEQUENCE_PARALLEL,
// XLR8_SHARDED_PARAM_DTYPE, XLR8_SPLIT_BATCHES) comes from `env`. ConfigError naming the key or variable, its value
// and the fix for what cannot be resolved.
ParallelPlan resolve_plan(const PlanInputs& in, const Env& env);

}  // namespace xlr8::accelerate
