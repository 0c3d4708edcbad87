#pragma once
// ParallelPlan: what this process will do, resolved once when the Accelerator is built from every source of
// settings (the launch's config file and variables, its FSDP / DeepSpeed / parallelism_config keys, a DeepSpeed
// JSON, AcceleratorOptions) and read by everything after. `Accelerator::plan().describe()` answers "what did it
// configure?". The sections follow the order prepare() applies them in (parallelize.hpp): pipeline stages,
// tensor parallelism, context parallelism, activation checkpointing, precision, data parallelism.
#include <c10/core/ScalarType.h>

#include <cstdint>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>

#include "xlr8/device_mesh.hpp"
#include "xlr8/loss_scaler.hpp"
#include "xlr8/parallel_options.hpp"
#include "xlr8/settings.hpp"

namespace xlr8 {

struct ParallelPlan {
  // The mesh's sizes, pp (pipeline stages) outermost; every rank has the same.
  struct Mesh {
    int pp = 1, dp_replicate = 1, dp_shard = 1, cp = 1, sp = 1, tp = 1;
  } mesh;

  // A model prepare() splits over tp: by the DeepSpeed JSON's tensor_parallel rules (the engine's), a plan
  // file, else AutoTP; a model the program split already is only checked.
  struct TensorParallel {
    bool sequence_parallel = false;  // AcceleratorOptions::tp_sequence_parallel, else XLR8_TP_SEQUENCE_PARALLEL
    int64_t head_dim = 0;            // AcceleratorOptions::tp_head_dim, else parallelism_config_tp_head_dim; 0: unchecked
    std::string plan_file;           // XLR8_TP_PLAN_FILE
    nlohmann::json deepspeed_rules;  // the engine's JSON tensor_parallel section with partition_config / preset_model
  } tensor;

  // pp: the model (a torch::nn::Sequential) is cut into mesh.pp stages that a schedule runs over micro-batches.
  struct Pipeline {
    std::string schedule = "1F1B";  // GPipe | 1F1B | Interleaved1F1B | InterleavedZeroBubble
    int micro_batches = 1;          // per optimizer step
    int virtual_stages = 1;         // chunks a rank (Interleaved1F1B: 2 or more)
  } pipeline;

  // cp (ring or all-gather attention) or sp (Ulysses) splits every sequence; the model's xlr8::attention follows.
  struct Sequence {
    std::string comm_strategy;            // "allgather" | "alltoall" (cp), "ulysses" (sp); empty: no split
    std::optional<long> fixed_length;      // parallelism_config_sp_seq_length with _is_variable false
  } sequence;

  // fsdp_activation_checkpointing: every unit of the wrap policy recomputes its forward in backward.
  bool recompute_units = false;

  // Autocast's precision (the DeepSpeed JSON's wins over the launch's, the launch's over the program's), and
  // fp16's loss scaler (the JSON's fp16 section when there is one).
  MixedPrecision mixed_precision = MixedPrecision::NO;
  // mixed_precision fp8: its settings (the program's AcceleratorOptions::fp8, else the launch's); autocast is bf16.
  std::optional<Fp8Settings> fp8;
  std::optional<LossScalerOptions> loss_scaler;
  // float32 matmuls on TF32 tensor cores (the program's allow_tf32, else XLR8_ALLOW_TF32); unset leaves
  // LibTorch's setting alone (off, as PyTorch's torch.backends.cuda.matmul.allow_tf32).
  std::optional<bool> allow_tf32;

  // The strategy each prepared model gets and the options it is made with: data_parallel.zero has its stage
  // (0: DDP), units, hybrid size, compute dtype (param_dtype) and offload decided; a DeepSpeed JSON's "auto"
  // bucket sizes are filled per model (from its hidden size).
  std::string strategy;  // "single", "ddp", "zero1", "zero2" or "zero3"
  MeshDim data_parallel_dim = MeshDim::dp;  // dp, or dp_cp when context-parallel peers share the gradients
  ParallelOptions data_parallel;

  int gradient_accumulation_steps = 1;
  double clip_at_step = 0;  // DeepSpeed's gradient_clipping, applied at every optimizer step (0: none)
  bool split_batches = false;

  // One line per section, as "xlr8 plan: ..." lines: what a user reads to learn what the launch configured.
  std::string describe() const;
  nlohmann::json to_json() const;
};

}  // namespace xlr8
