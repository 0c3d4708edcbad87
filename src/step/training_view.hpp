#pragma once
// What an observer of the step may read of the training that runs it: the process, the device, the plan and
// what was prepared. The Accelerator builds one for the events that carry it, so observers (diagnostics/:
// verify's and advise's recorders, a pipeline schedule next) need none of its internals.
#include <c10/core/Device.h>

#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "xlr8/data_loader.hpp"
#include "xlr8/parallel_plan.hpp"
#include "xlr8/parallel_strategy.hpp"
#include "xlr8/process_state.hpp"

namespace xlr8::step {

struct TrainingView {
  const ProcessState& process;
  at::Device device;
  const ParallelPlan& plan;
  int accumulation_steps = 1;                            // micro-steps per optimizer step, as the gradient state has it
  int64_t pipeline_steps = 0;                            // Accelerator::pipeline_step calls so far
  std::vector<ParallelStrategy*> models;                 // prepared, in order
  std::vector<torch::optim::Optimizer*> optimizers;      // prepared, in order
  std::vector<std::shared_ptr<DataLoaderBase>> loaders;  // prepared and still alive, in order
  // The whole model (gathered from shards) as Hugging Face safetensors in `dir` (collective): save_model's files.
  std::function<void(const torch::nn::Module&, const std::string&)> write_full_model;
  // Under pp: the global gradient norm over every stage (collective over the world); empty otherwise, where the
  // strategy of each model measures its own.
  std::function<double(double norm_type)> pipeline_grad_norm;

  Communicator& world() const { return process.world(); }
};

}  // namespace xlr8::step
