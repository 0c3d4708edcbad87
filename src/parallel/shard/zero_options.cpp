// Every source of ZeRO / FSDP settings mapped onto the strategies' options, in one place: the launch's FSDP and
// DeepSpeed keys, and a DeepSpeed JSON's zero_optimization section.
#include "parallel/shard/zero_options.hpp"

#include <fmt/format.h>

#include <algorithm>

#include "xlr8/error.hpp"

namespace xlr8::shard {
namespace {

int stage_of(const FsdpSettings& f) {
  switch (f.sharding_strategy) {
    case ShardingStrategy::NO_SHARD: return 0;
    case ShardingStrategy::SHARD_GRAD_OP:
    case ShardingStrategy::HYBRID_SHARD_ZERO2: return 2;
    case ShardingStrategy::HYBRID_SHARD: return 3;
    case ShardingStrategy::FULL_SHARD: return f.version == 2 && f.reshard_after_forward == false ? 2 : 3;
  }
  return 3;
}

bool hybrid(const FsdpSettings& f, const std::optional<ParallelismSettings>& mesh) {
  if (f.sharding_strategy == ShardingStrategy::HYBRID_SHARD || f.sharding_strategy == ShardingStrategy::HYBRID_SHARD_ZERO2)
    return true;
  // FSDP2 on a mesh of dp_replicate x (dp_shard x cp x sp): Accelerate's fully_shard takes both dimensions
  // (ParallelismConfig.fsdp_dim_names), which is HSDP without fsdp_sharding_strategy saying so.
  return f.version == 2 && f.sharding_strategy != ShardingStrategy::NO_SHARD && mesh && mesh->dp_replicate > 1 &&
         mesh->dp_shard * mesh->cp * mesh->sp > 1;
}

// DeepSpeed counts bucket sizes in elements; the strategies take megabytes (of float32 gradients).
double megabytes_of(int64_t elements) { return static_cast<double>(elements) * 4.0 / (1024.0 * 1024.0); }

// An offload section with device "nvme": its path and buffers (DeepSpeed's default count when it gives none), and
// the "aio" section's transfers.
ZeroOptions::Disk disk_of(const deepspeed::OffloadConfig& o, const deepspeed::AioConfig& aio, int default_buffers) {
  ZeroOptions::Disk disk;
  disk.path = o.nvme_path;
  disk.buffer_count = o.buffer_count > 0 ? o.buffer_count : default_buffers;
  disk.aio_block_size = aio.block_size;
  disk.aio_threads = aio.intra_op_parallelism;
  return disk;
}

// offload_optimizer.device "nvme" with the section's buffers and the "aio" section's transfers.
void apply_optimizer_on_disk(const deepspeed::ZeroConfig& z, ZeroOptions& zero) {
  const auto& o = z.offload_optimizer;
  if (o.ratio < 1.0)
    throw ConfigError(fmt::format("zero_optimization.offload_optimizer.ratio is {} with device \"nvme\": partial offload "
                                  "keeps the rest on the accelerator, which the disk tier does not; use ratio 1 or "
                                  "device \"cpu\"",
                                  o.ratio));
  zero.optimizer_on_disk = disk_of(o, z.aio, /*default_buffers=*/4);
  zero.optimizer_on_disk.read_ahead = o.pipeline_read;
  zero.optimizer_on_disk.write_behind = o.pipeline_write;
}

}  // namespace

ZeroOptions resolve_zero_options(ZeroOptions options, const Settings& settings, int node_size,
                                 bool parameters_in_host_memory) {
  if (settings.fsdp) {
    const auto& f = *settings.fsdp;
    // Validated when the settings were read: parsed once, here.
    options.auto_wrap_policy = parse_auto_wrap_policy(f.auto_wrap_policy);
    options.layer_classes = f.transformer_layer_cls_to_wrap;
    options.min_num_params = f.min_num_params;
    options.forward_prefetch = f.forward_prefetch;
    options.backward_prefetch = parse_backward_prefetch(f.backward_prefetch);
    if (options.stage < 0) {
      options.stage = stage_of(f);
      if (hybrid(f, settings.parallelism)) {
        const auto& mesh = settings.parallelism;
        // On a mesh, HSDP shards over dp_shard x cp (or sp) and replicates over dp_replicate (the machine's size
        // would cut across tp and cp peers).
        if (mesh && mesh->total() > 1 && mesh->dp_shard * mesh->cp * mesh->sp == 1)
          throw ConfigError(fmt::format(
              "fsdp_sharding_strategy {} shards over parallelism_config_dp_shard_size, which is 1 on this mesh "
              "(dp_replicate {} x dp_shard 1 x cp 1 x sp 1 x tp {}); set parallelism_config_dp_shard_size above 1, or use "
              "FULL_SHARD to shard over every data-parallel rank",
              to_string(f.sharding_strategy), mesh->dp_replicate, mesh->tp));
        options.hybrid_shard_size = mesh && mesh->total() > 1 ? mesh->dp_shard * mesh->cp * mesh->sp : node_size;
      }
    }
  }
  if (settings.fsdp && settings.fsdp->offload_params) {
    // FSDP's CPUOffload: the optimizer steps on host shards; parameters stay there too where they are
    // sharded between uses (FULL_SHARD).
    options.offload_optimizer = true;
    options.offload_params = options.offload_params || options.stage == 3;
  }
  if (settings.deepspeed) {
    const auto& d = *settings.deepspeed;
    if (d.offload_param_device == "nvme" && !options.params_on_disk.enabled()) {
      if (d.offload_param_nvme_path.empty())
        throw ConfigError("deepspeed_config.offload_param_device is nvme but offload_param_nvme_path "
                          "(ACCELERATE_DEEPSPEED_OFFLOAD_PARAM_NVME_PATH) is empty; set it to a directory on a local "
                          "disk");
      options.params_on_disk.path = d.offload_param_nvme_path;
      options.params_on_disk.buffer_count = 5;  // DeepSpeed's default for parameters
    }
    if (d.offload_optimizer_device == "nvme" && !options.optimizer_on_disk.enabled()) {
      if (d.offload_optimizer_nvme_path.empty())
        throw ConfigError("deepspeed_config.offload_optimizer_device is nvme but offload_optimizer_nvme_path "
                          "(ACCELERATE_DEEPSPEED_OFFLOAD_OPTIMIZER_NVME_PATH) is empty; set it to a directory on a local "
                          "disk");
      options.optimizer_on_disk.path = d.offload_optimizer_nvme_path;
    }
    // On disk means through host memory: the optimizer steps there, as with cpu.
    options.offload_optimizer = options.offload_optimizer || d.offload_optimizer_device != "none";
    options.offload_params = options.offload_params || d.offload_param_device != "none";
    if (options.stage < 0) options.stage = d.zero_stage;
    // DeepSpeed gathers submodule by submodule, never the whole model at once.
    if (options.auto_wrap_policy == AutoWrapPolicy::NO_WRAP) options.auto_wrap_policy = AutoWrapPolicy::GUARDED_MODULES;
  }
  if (options.stage < 0) options.stage = 0;
  if (options.optimizer_on_disk.enabled() && options.stage == 0)
    throw ConfigError("offload_optimizer device nvme at ZeRO stage 0: the optimizer's state goes to disk from a sharded "
                      "optimizer; use ZeRO stage 1, 2 or 3 (zero_stage, or zero_optimization.stage)");
  if (options.params_on_disk.enabled() && options.stage != 3)
    throw ConfigError(fmt::format("offload_param device nvme at ZeRO stage {}: parameters are sharded, and so can live "
                                  "on disk, at stage 3 only; use ZeRO stage 3 (FULL_SHARD)",
                                  options.stage));
  if (options.params_on_disk.enabled() && !options.optimizer_on_disk.enabled())
    throw ConfigError("offload_param device nvme without offload_optimizer device nvme: a group's parameters and its "
                      "optimizer state come in from disk together to step; set offload_optimizer_device nvme too "
                      "(offload_optimizer_nvme_path may be the same directory)");
  check_offload_stage(options);  // before a CPU run clears the host offload: its rehearsal refuses what a GPU's would
  if (parameters_in_host_memory) options.offload_optimizer = options.offload_params = false;
  return options;
}

void check_offload_stage(const ZeroOptions& zero) {
  if ((zero.offload_optimizer || zero.offload_params || zero.optimizer_on_disk.enabled()) && zero.stage < 1)
    throw ConfigError("offload (offload_optimizer / offload_param, fsdp_offload_params, nvme) needs ZeRO stage 1, 2 or 3 "
                      "(FSDP: FULL_SHARD or SHARD_GRAD_OP); the strategy is DDP: set a stage, or turn offload off");
  if (zero.offload_params && zero.stage != 3)
    throw ConfigError(fmt::format("offloading parameters needs ZeRO stage 3 (FULL_SHARD); stage {} keeps them whole "
                                  "on every rank: offload the optimizer instead, or use stage 3",
                                  zero.stage));
}

void apply_zero_sizes(const deepspeed::ZeroConfig& z, ParallelOptions& parallel) {
  parallel.zero.bucket_cap_mb = parallel.zero.first_bucket_mb = megabytes_of(z.reduce_bucket_size);
  parallel.ddp.bucket_cap_mb = parallel.ddp.first_bucket_mb = megabytes_of(z.reduce_bucket_size);
  // Options the plan resolved have their stage; unresolved ones (-1) take the JSON's.
  if ((parallel.zero.stage >= 0 ? parallel.zero.stage : z.stage) != 3) return;
  parallel.zero.param_persistence_threshold = z.stage3_param_persistence_threshold;
  // DeepSpeed prefetches the next submodules' parameters up to the bucket, within the live bound (a
  // bound of at least 1 marks them as set: an empty bucket or bound prefetches nothing).
  parallel.zero.max_live_elements = std::max<int64_t>(1, z.stage3_max_live_parameters);
  parallel.zero.prefetch_bucket_elements = z.stage3_max_live_parameters > 0 ? z.stage3_prefetch_bucket_size : 0;
  parallel.zero.forward_prefetch = parallel.zero.prefetch_bucket_elements > 0;
  parallel.zero.backward_prefetch = parallel.zero.forward_prefetch ? BackwardPrefetch::BACKWARD_PRE : BackwardPrefetch::NONE;
}

void apply_zero_config(const deepspeed::ZeroConfig& z, ParallelOptions& parallel) {
  if (parallel.zero.stage < 0) parallel.zero.stage = z.stage;
  if (parallel.zero.stage == 3 && parallel.zero.auto_wrap_policy == AutoWrapPolicy::NO_WRAP)
    parallel.zero.auto_wrap_policy = AutoWrapPolicy::GUARDED_MODULES;  // DeepSpeed gathers submodule by submodule
  apply_zero_sizes(z, parallel);
  // Offload to the CPU (ZeRO-Offload), and the optimizer's state on disk (ZeRO-Infinity's NVMe tier).
  if (z.offload_optimizer.device == "nvme") apply_optimizer_on_disk(z, parallel.zero);
  if (z.offload_param.device == "nvme")
    parallel.zero.params_on_disk = disk_of(z.offload_param, z.aio, /*default_buffers=*/5);
  parallel.zero.offload_optimizer = parallel.zero.offload_optimizer || z.offload_optimizer.device != "none";
  parallel.zero.offload_params = parallel.zero.offload_params || z.offload_param.device != "none";
  parallel.zero.offload_ratio = z.offload_optimizer.ratio;
  // Each section's pin_memory counts only when that section offloads.
  parallel.zero.offload_pin_memory = (z.offload_optimizer.device != "cpu" || z.offload_optimizer.pin_memory) &&
                                     (z.offload_param.device != "cpu" || z.offload_param.pin_memory);
  // DeepSpeed's ZeRO reduces every gradient, a missing one as zeros (ignore_unused_parameters).
  parallel.ddp.find_unused_parameters = parallel.zero.stage > 0 && z.ignore_unused_parameters;
}

ParallelOptions resolve_parallel_options(ParallelOptions options, const deepspeed::ZeroConfig* json,
                                         const Settings& settings, int node_size, bool parameters_in_host_memory) {
  if (json) apply_zero_config(*json, options);
  // With a JSON its own offload devices win over the launch's (README; Accelerate refuses both together): the launch's
  // reach it only through its "auto" ones, already filled (DeepSpeedPlugin). They overrode a JSON's "none" before.
  Settings launch = settings;
  if (json && launch.deepspeed) launch.deepspeed->offload_optimizer_device = launch.deepspeed->offload_param_device = "none";
  options.zero = resolve_zero_options(options.zero, launch, node_size, parameters_in_host_memory);
  return options;
}

}  // namespace xlr8::shard
