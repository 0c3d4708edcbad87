#pragma once
// parallelize: the one place a model becomes parallel, in torchtitan's fixed order (models/*/infra/parallelize.py):
//   1. pipeline stages     (pp: this rank's layers of a Sequential; the steps below make that stage parallel)
//   2. tensor parallelism  (tp, with Megatron's sequence parallelism)
//   3. context parallelism (cp / sp: xlr8::attention follows the process's context; nothing to change in the model)
//   4. activation checkpointing (recompute)
//   5. precision           (the compute dtype of sharded parameters; where fp8's conversion goes)
//   6. data parallelism    (replicate or shard: the ParallelStrategy the model is trained through)
// The Accelerator (and through it deepspeed::Engine) calls it once per prepared model.
#include <functional>
#include <memory>
#include <optional>

#include "xlr8/device_mesh.hpp"
#include "xlr8/gradient_state.hpp"
#include "xlr8/parallel_plan.hpp"
#include "xlr8/parallel_strategy.hpp"
#include "xlr8/pipeline.hpp"

namespace xlr8::parallel {

// What the caller does between the fixed steps, for this model.
struct ParallelizeHooks {
  // After the model's tensor-parallel split: its values in place (whole values from the main process, the
  // device), and observers told (xlr8 verify / advise).
  std::function<void(torch::nn::Module&)> after_tensor_parallel;
  // Before its strategy is made: this model's own additions to the plan's data-parallel options (a DeepSpeed
  // JSON's sizes filled from its hidden size, values held by rank 0 only).
  std::function<void(torch::nn::Module&, ParallelOptions&)> data_parallel_options;
  std::shared_ptr<const GradientState> gradient_state;
  // Where the model's values live or will (a recorded build's parameters stay on the meta device until sharding
  // computes them); unset: where its first parameter is.
  std::optional<at::Device> device;
  // pp > 1: the cut, as made from the whole model before tensor parallelism and sharding change its parameter
  // counts (and before the other stages' layers give their memory back): how many of the stage's layers each of
  // its chunks (virtual stages) has, and the whole model's parts.
  std::function<void(const pp::StageLayers& cut)> stage_cut;
};

// The dimension whose group averages gradients (and FSDP shards over): dp x cp when the sequence is split,
// since context-parallel (and Ulysses) peers share the weights and see different tokens (torchtitan's rule;
// DeepSpeed's sequence-data-parallel group); else dp.
MeshDim data_parallel_dim(const DeviceMesh& mesh);

// Collective over the mesh's groups the steps use. Returns the strategy that owns the model from now on (under pp,
// its module() is this rank's stage, a torch::nn::Sequential).
std::unique_ptr<ParallelStrategy> parallelize(std::shared_ptr<torch::nn::Module> module, const ParallelPlan& plan,
                                              DeviceMesh& mesh, const ParallelizeHooks& hooks);

// Step 2: a model the program split already (tp::parallelize) keeps its plan (checked against the head size);
// any other is split by the DeepSpeed JSON's rules, the plan file, or AutoTP, or refused by name. Never trains
// whole while the mesh says tp, nor with a rank holding part of an attention head.
void split_for_tensor_parallel(torch::nn::Module& module, DeviceMesh& mesh, const ParallelPlan::TensorParallel& tensor);

}  // namespace xlr8::parallel
