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
    for (const auto& [device, key] : {std::pair{&d.offload_optimizer_device, "offload_optimizer_device"},
                                      std::pair{&d.offload_param_device, "offload_param_device"}})
      if (*device == "nvme")
        throw ConfigError(fmt::format("deepspeed_config.{} is nvme (ZeRO-Infinity), which xlr8 does not implement; use "
                                      "cpu (host memory) or none",
                                      key));
    options.offload_optimizer = options.offload_optimizer || d.offload_optimizer_device == "cpu";
    options.offload_params = options.offload_params || d.offload_param_device == "cpu";
    if (options.stage < 0) options.stage = d.zero_stage;
    // DeepSpeed gathers submodule by submodule, never the whole model at once.
    if (options.auto_wrap_policy == AutoWrapPolicy::NO_WRAP) options.auto_wrap_policy = AutoWrapPolicy::GUARDED_MODULES;
  }
  if (options.stage < 0) options.stage = 0;
  if (parameters_in_host_memory) options.offload_optimizer = options.offload_params = false;
  return options;
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
  // Offload to the CPU (ZeRO-Offload); NVMe (ZeRO-Infinity) is not built.
  for (const auto& [o, key] : {std::pair{&z.offload_optimizer, "offload_optimizer"}, std::pair{&z.offload_param, "offload_param"}})
    if (o->device == "nvme")
      throw ConfigError(fmt::format("zero_optimization.{}.device is \"nvme\" (ZeRO-Infinity), which xlr8 does not "
                                    "implement; use \"cpu\" (host memory) or \"none\"",
                                    key));
  parallel.zero.offload_optimizer = parallel.zero.offload_optimizer || z.offload_optimizer.device == "cpu";
  parallel.zero.offload_params = parallel.zero.offload_params || z.offload_param.device == "cpu";
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
  options.zero = resolve_zero_options(options.zero, settings, node_size, parameters_in_host_memory);
  return options;
}

}  // namespace xlr8::shard
