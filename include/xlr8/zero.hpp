#pragma once
// Sharded data parallelism: ZeRO stages 1-3, which are also FSDP's sharding strategies
// (SHARD_GRAD_OP = stage 2, FULL_SHARD = stage 3, NO_SHARD = stage 0 = DDP). What each rank keeps
// between steps, for Ψ fp32 parameters trained with Adam (reference/003):
//   stage 1: parameters and gradients whole, optimizer state sharded        8Ψ + 8Ψ/N bytes
//   stage 2: parameters whole, gradients and optimizer state sharded        4Ψ + 12Ψ/N
//   stage 3: everything sharded; each unit gathered around its forward
//            and its backward, then freed                                    16Ψ/N (+ the gathered units)
// With a lower-precision param_dtype the whole parameters (and gradients) take 2 bytes each and the
// optimizer keeps fp32 master shards.
#include <c10/core/ScalarType.h>

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

namespace xlr8 {

// FSDP's auto wrap policies (fsdp_auto_wrap_policy), parsed once where options are read, and
// GUARDED_MODULES, the default under DeepSpeed ZeRO-3 settings (see ZeroOptions::auto_wrap_policy).
enum class AutoWrapPolicy { NO_WRAP, TRANSFORMER_BASED_WRAP, SIZE_BASED_WRAP, GUARDED_MODULES };
// FSDP's backward prefetch (fsdp_backward_prefetch); NO_PREFETCH and "" are NONE.
enum class BackwardPrefetch { NONE, BACKWARD_PRE, BACKWARD_POST };
// The config's spelling; ConfigError naming `key`, the value and the allowed ones otherwise.
AutoWrapPolicy parse_auto_wrap_policy(const std::string& value, const std::string& key = "fsdp_auto_wrap_policy");
BackwardPrefetch parse_backward_prefetch(const std::string& value, const std::string& key = "fsdp_backward_prefetch");
const char* to_string(AutoWrapPolicy policy);
const char* to_string(BackwardPrefetch prefetch);

struct ZeroOptions {
  // -1: from the process's settings (FSDP / DeepSpeed keys of the config file or environment);
  // 0: replicas (DDP); 1, 2, 3: the ZeRO stage.
  int stage = -1;
  // Stage 3's units, as FSDP's auto wrap policy: TRANSFORMER_BASED_WRAP (modules whose class is in
  // `layer_classes`: "Block", "BlockImpl" or a namespace-qualified name all match TORCH_MODULE(Block); empty:
  // the classes the model declares, xlr8::NoSplitModules),
  // SIZE_BASED_WRAP (the smallest modules of the model's own classes, not LibTorch's, holding at least
  // `min_num_params` parameters not already in a unit) or NO_WRAP (the whole model is one unit). The
  // parameters no unit takes form the root unit. GUARDED_MODULES (DeepSpeed ZeRO-3's granularity, the
  // default under DeepSpeed settings): every module whose forward opens a guard is a unit; a module of
  // the model's own classes that never opens one is gathered and freed with its nearest ancestor that
  // does (or with the root), decided after the first backward (until then every unit is whole). LibTorch's
  // and xlr8's layers (xlr8::nn) are no units: their parameters are the unit's around them.
  AutoWrapPolicy auto_wrap_policy = AutoWrapPolicy::NO_WRAP;
  std::vector<std::string> layer_classes;
  int64_t min_num_params = 100'000'000;
  // Stages 1 and 2 reduce gradients in buckets of consecutive parameters (reverse order, as DDP), the
  // first `first_bucket_mb`, the others `bucket_cap_mb`; stage 3 reduces per unit.
  double bucket_cap_mb = 25.0;
  double first_bucket_mb = 1.0;
  // Hybrid sharding (FSDP's HYBRID_SHARD / HYBRID_SHARD_ZERO2, stages 3 / 2): shard inside groups of
  // this many consecutive data-parallel ranks (a node by default), and all-reduce the sharded gradients
  // across the groups' replicas. 0: shard over all data-parallel ranks.
  int hybrid_shard_size = 0;
  // FSDP's MixedPrecision: parameters gathered and computed in `param_dtype` (the Accelerator sets bf16
  // for mixed_precision bf16, fp16 for fp16 on CUDA) while the optimizer updates fp32 master shards;
  // gradients reduced in `reduce_dtype` (default: the parameters' compute dtype; at::kFloat for fp32).
  std::optional<at::ScalarType> param_dtype;
  std::optional<at::ScalarType> reduce_dtype;
  // Stage 3, FSDP's prefetching (from fsdp_forward_prefetch / fsdp_backward_prefetch): the next unit's
  // all-gather is issued early, in the order the units ran in the previous step, so it overlaps the
  // current unit's compute. forward_prefetch: when a unit's forward begins. backward_prefetch
  // BACKWARD_PRE: when a unit's backward begins; BACKWARD_POST: when its gradients are done; NONE:
  // never. At most two units' gathered parameters are alive (FSDP's limit). Prefetching starts once
  // every rank is known to run the units in the same order (checked after the first forward and
  // backward).
  bool forward_prefetch = false;
  BackwardPrefetch backward_prefetch = BackwardPrefetch::NONE;
  // Stage 3, DeepSpeed's bounds instead of FSDP's limit, in elements (stage3_max_live_parameters,
  // stage3_prefetch_bucket_size): when max_live_elements is set, a prefetch issues the next units of the
  // recorded order until prefetch_bucket_elements are in flight (the unit that crosses it still goes, as in
  // DeepSpeed's coordinator), never beyond max_live_elements gathered (besides the root); 0 buckets: none.
  int64_t max_live_elements = 0;
  int64_t prefetch_bucket_elements = 0;
  // Stage 3, FSDP's cpu_ram_efficient_loading (set by Accelerator::build_model): the model may hold no
  // values on ranks other than 0 (built in an EmptyInitScope). Each unit takes rank 0's values one at a
  // time, every rank keeps only its shard, and every unit but the root starts freed: its forward must
  // open xlr8::unshard(*this), as nothing gathers it otherwise.
  bool values_from_rank0 = false;
  // Stage 3, DeepSpeed's stage3_param_persistence_threshold: parameters of fewer elements stay whole on
  // every rank (their gradients and optimizer state are still sharded), in one unit that is never freed,
  // saving a gather for each small bias or norm. 0: none (FSDP's behaviour and the Accelerator's default;
  // the DeepSpeed engine takes the JSON's value, DeepSpeed's default 100,000 when absent).
  int64_t param_persistence_threshold = 0;
  // Offload (DeepSpeed's offload_optimizer / offload_param with device cpu, FSDP's offload_params), for
  // parameters on an accelerator. offload_optimizer: this rank's fp32 master shards, their gradients and
  // the optimizer's state live in host memory and the optimizer steps there; each step's gradient chunks
  // go to the host and the updated shards come back. offload_params (stage 3; implies offload_optimizer,
  // as FSDP's does): the compute-dtype shards live in host memory too, and a gather copies them to the
  // device first, so between uses a unit holds no device memory. The leaves the optimizer gets are host
  // tensors. `offload_ratio` (DeepSpeed's offload_optimizer.ratio, stage 3, the optimizer offloaded without
  // the parameters): the groups offloaded, in order, until this fraction of the trainable elements is
  // (whole groups: the one that crosses it goes too). `offload_pin_memory`: host memory page-locked when
  // the parameters are on CUDA. On a CPU the same copies are made (what tests check the arithmetic
  // with); the Accelerator does not ask for them there.
  bool offload_optimizer = false;
  bool offload_params = false;
  double offload_ratio = 1.0;
  bool offload_pin_memory = true;
  // Offload's disk tier (DeepSpeed's device "nvme", ZeRO-Infinity), on any device, the CPU too.
  // optimizer_on_disk: the optimizer's state (Adam's moments, SGD's momentum...) lives in a scratch file under
  // `path` and comes into memory one parameter group at a time to step (the next group's read ahead, the
  // previous one's written behind when asked). params_on_disk (stage 3, with optimizer_on_disk): each unit's
  // parameter shard lives in a scratch file too, read for its gathers and its group's step and written back
  // after the step; in memory stay the gathered units, the gradients' shards and the optimizer's step counts.
  struct Disk {
    std::string path;                  // nvme_path; empty: nothing on disk
    int buffer_count = 4;              // aligned host buffers the state moves through
    bool read_ahead = false;           // the next group's state read while this one steps (pipeline_read)
    bool write_behind = false;         // a group's state written while the next one steps (pipeline_write)
    int64_t aio_block_size = 1 << 20;  // bytes one read or write call moves
    int aio_threads = 1;               // threads issuing them (aio.intra_op_parallelism)
    // optimizer_on_disk only (xlr8's; XLR8_GRADIENTS_ON_DISK=1): each group's reduced gradient chunk goes to the swap
    // file as soon as it is reduced and the step reads it with the group's state, instead of every chunk waiting in
    // memory for the step (stage 3: as many bytes as the fp32 parameters). Until the step the leaves' .grad is
    // undefined; unscaling, clipping and zero_grad through the Accelerator still apply (queued for the step).
    bool gradients = false;
    bool enabled() const { return !path.empty(); }
  } optimizer_on_disk, params_on_disk;
};

}  // namespace xlr8
