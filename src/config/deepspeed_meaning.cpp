// What a resolved DeepSpeed JSON means for a training, read in one place: its precision and loss scaler,
// its tensor-parallel rules, and the mesh and launch it requires. resolve_plan, the DeepSpeed plugin and
// deepspeed::Engine all ask here (the ZeRO keys: parallel/shard/zero_options.hpp).
#include <fmt/format.h>

#include "xlr8/deepspeed_config.hpp"
#include "xlr8/error.hpp"

namespace xlr8::deepspeed {

MixedPrecision mixed_precision(const Config& config) {
  return config.fp16.enabled ? MixedPrecision::FP16 : config.bf16 ? MixedPrecision::BF16 : MixedPrecision::NO;
}

LossScalerOptions loss_scaler(const Config& config) {
  return loss_scaler_options(config.fp16, config.zero_optimization.stage);
}

nlohmann::json tensor_rules(const Config& config) {
  const auto section = config.document.value("tensor_parallel", nlohmann::json::object());
  const auto given = [&](const char* key) { return section.contains(key) && !section[key].is_null(); };
  return given("partition_config") || given("preset_model") ? section : nlohmann::json();
}

void check_mesh(const Config& config, const MeshSizes& mesh) {
  if (config.sequence_parallel_size && *config.sequence_parallel_size != mesh.sp)
    throw ConfigError(fmt::format("deepspeed::initialize: {} sets sequence_parallel_size {} but this job's mesh has sp "
                                  "{}; launch it with --parallelism_config_sp_size {} (xlr8 launch sets it itself from "
                                  "a JSON given as --use_deepspeed --deepspeed_config_file)",
                                  config.origin, *config.sequence_parallel_size, mesh.sp,
                                  *config.sequence_parallel_size));
  if (config.data_parallel_size && *config.data_parallel_size != mesh.dp)
    throw ConfigError(fmt::format("deepspeed::initialize: {} sets data_parallel_size {} but this job's mesh has {} "
                                  "data-parallel ranks; make them agree",
                                  config.origin, *config.data_parallel_size, mesh.dp));
  const int autotp = static_cast<int>(config.autotp_size);
  if (autotp > 1 && autotp != mesh.tp)
    throw ConfigError(fmt::format("deepspeed::initialize: {} sets tensor_parallel.autotp_size {} but this job's mesh "
                                  "has tp {}; launch it with --parallelism_config_tp_size {} (xlr8 launch sets it "
                                  "itself from a JSON given as --use_deepspeed --deepspeed_config_file)",
                                  config.origin, autotp, mesh.tp, autotp));
  if (config.pipeline.stages && *config.pipeline.stages != mesh.pp)
    throw ConfigError(fmt::format("deepspeed::initialize: {} sets pipeline.stages {} but this job's mesh has pp {}; "
                                  "launch it with --parallelism_config_pp_size {} (xlr8 launch sets it itself from a "
                                  "JSON given as --use_deepspeed --deepspeed_config_file)",
                                  config.origin, *config.pipeline.stages, mesh.pp, *config.pipeline.stages));
}

void check_launch(const Settings& settings, const BatchSizes& sizes) {
  if (settings.fsdp)
    throw ConfigError("deepspeed::initialize: the launch selects FSDP (--use_fsdp / ACCELERATE_USE_FSDP), but the "
                      "DeepSpeed engine takes its strategy from its JSON config; launch without --use_fsdp");
  if (settings.gradient_accumulation_steps && *settings.gradient_accumulation_steps != sizes.gradient_accumulation_steps)
    throw ConfigError(fmt::format("deepspeed::initialize: the launch says gradient_accumulation_steps {} but the "
                                  "DeepSpeed config resolves to {}; drop the launch's value or change the config",
                                  *settings.gradient_accumulation_steps, sizes.gradient_accumulation_steps));
}

}  // namespace xlr8::deepspeed
