// The ParallelPlan: resolved once from every source of settings, and told back as text and JSON.
#include "accelerate/parallel_plan.hpp"

#include <fmt/format.h>

#include "parallel/parallelize.hpp"
#include "parallel/shard/zero_strategy.hpp"
#include "deepspeed/deepspeed_plugin.hpp"
#include "xlr8/context_parallel.hpp"
#include "xlr8/error.hpp"
#include "xlr8/float8.hpp"
#include "xlr8/pipeline.hpp"

namespace xlr8 {
namespace accelerate {
namespace {

// The dtype sharded strategies gather and compute parameters in (FSDP's MixedPrecision param_dtype).
// On CUDA, the mixed-precision dtype. On CPU, none: CPUs without native bf16 run LayerNorm, GELU and
// softmax on bf16 tensors slower than on fp32 ones, so parameters stay fp32 under autocast as with DDP
// (measured on the GPT example, 2 ranks: bf16 parameters gave 0.82-0.84x DDP's tokens/s). The
// XLR8_SHARDED_PARAM_DTYPE variable (auto | bf16 | fp16 | fp32) overrides it.
std::optional<at::ScalarType> sharded_param_dtype(MixedPrecision precision, const at::Device& device, const Env& env) {
  const auto asked = env.get("XLR8_SHARDED_PARAM_DTYPE").value_or("auto");
  if (asked == "bf16") return at::kBFloat16;
  if (asked == "fp16") return at::kHalf;
  if (asked == "fp32") return std::nullopt;
  if (asked != "auto")
    throw ConfigError(fmt::format("XLR8_SHARDED_PARAM_DTYPE={:?}: allowed values are auto, bf16, fp16 and fp32", asked));
  if (!device.is_cuda() || precision == MixedPrecision::NO) return std::nullopt;
  return precision == MixedPrecision::FP16 ? at::kHalf : at::kBFloat16;
}

ParallelPlan::Mesh mesh_of(const DeviceMesh& mesh) {
  return {.pp = mesh.size(MeshDim::pp),
          .dp_replicate = mesh.size(MeshDim::dp_replicate),
          .dp_shard = mesh.size(MeshDim::dp_shard),
          .cp = mesh.size(MeshDim::cp),
          .sp = mesh.size(MeshDim::sp),
          .tp = mesh.size(MeshDim::tp)};
}

ParallelPlan::TensorParallel tensor_of(const AcceleratorOptions& options, const Settings& settings, const Env& env) {
  ParallelPlan::TensorParallel t;
  t.sequence_parallel = options.tp_sequence_parallel.value_or(env.get_bool("XLR8_TP_SEQUENCE_PARALLEL").value_or(false));
  const auto& launch = settings.parallelism;
  t.head_dim = options.tp_head_dim.value_or(launch ? launch->tp_head_dim.value_or(0) : 0);
  t.plan_file = env.get("XLR8_TP_PLAN_FILE").value_or("");
  return t;
}

ParallelPlan::Sequence sequence_of(const ParallelPlan::Mesh& mesh, const Settings& settings) {
  ParallelPlan::Sequence s;
  const auto& p = settings.parallelism;
  if (mesh.sp > 1) s.comm_strategy = "ulysses";
  if (mesh.cp > 1) {
    s.comm_strategy = p->cp_comm_strategy;
    cp::parse_comm_strategy(s.comm_strategy);  // refused here, before any model is built
  }
  if (p && p->sp > 1 && !p->sp_seq_length_is_variable) s.fixed_length = p->sp_seq_length;
  return s;
}

// XLR8_GRADIENTS_ON_DISK=1: the reduced gradients wait for the step in the optimizer's swap file.
void gradients_on_disk(ZeroOptions& zero, const ParallelPlan::Mesh& mesh) {
  if (!zero.optimizer_on_disk.enabled())
    throw ConfigError("XLR8_GRADIENTS_ON_DISK=1: the gradients go to the optimizer's swap file, and the optimizer's "
                      "state is not on disk; set offload_optimizer_device nvme with offload_optimizer_nvme_path (or the "
                      "JSON's offload_optimizer device \"nvme\"), or unset XLR8_GRADIENTS_ON_DISK");
  if (mesh.pp > 1)
    throw ConfigError(fmt::format("XLR8_GRADIENTS_ON_DISK=1 with parallelism_config_pp_size {}: a pipeline's stages "
                                  "clip their gradients in memory; unset XLR8_GRADIENTS_ON_DISK for pipelines",
                                  mesh.pp));
  zero.optimizer_on_disk.gradients = true;
}

// make_parallel_strategy's choice for these options over `ranks` data-parallel ranks.
std::string strategy_of(const ZeroOptions& zero, int ranks) {
  const bool offloads = zero.offload_optimizer || zero.offload_params || zero.optimizer_on_disk.enabled();
  if (ranks == 1 && !offloads) return "single";
  return zero.stage > 0 ? fmt::format("zero{}", zero.stage) : "ddp";
}

}  // namespace

ParallelPlan resolve_plan(const PlanInputs& in, const Env& env) {
  const auto& settings = in.state->settings();
  const auto& mesh = in.state->mesh();
  ParallelPlan plan;
  plan.mesh = mesh_of(mesh);
  plan.tensor = tensor_of(*in.options, settings, env);
  plan.sequence = sequence_of(plan.mesh, settings);
  if (plan.mesh.pp > 1) {
    const auto& p = *settings.parallelism;
    const int virtual_stages = p.pp_virtual_stages > 0 ? p.pp_virtual_stages : p.pp_schedule == "Interleaved1F1B" ? 2 : 1;
    plan.pipeline = {.schedule = p.pp_schedule,
                     .micro_batches = p.pp_microbatches > 0 ? p.pp_microbatches : plan.mesh.pp,
                     .virtual_stages = virtual_stages};
    if (in.options->pp_schedule) {
      plan.pipeline.schedule = *in.options->pp_schedule;
      if (const auto given = pp::parse_schedule(plan.pipeline.schedule);
          given != pp::Schedule::Interleaved1F1B && given != pp::Schedule::InterleavedZeroBubble)
        plan.pipeline.virtual_stages = 1;
    }
    if (in.options->pp_microbatches) plan.pipeline.micro_batches = *in.options->pp_microbatches;
  } else if (in.options->pp_microbatches) {  // pipeline_step() without stages accumulates as many micro-batches
    plan.pipeline.micro_batches = *in.options->pp_microbatches;
  } else if (settings.parallelism && settings.parallelism->pp_microbatches > 0) {
    plan.pipeline.micro_batches = settings.parallelism->pp_microbatches;
  }
  plan.recompute_units = settings.fsdp && settings.fsdp->activation_checkpointing;
  plan.mixed_precision = in.precision;
  plan.allow_tf32 = in.options->allow_tf32 ? in.options->allow_tf32 : env.get_bool("XLR8_ALLOW_TF32");
  plan.gradient_accumulation_steps = plan.mesh.pp > 1 && in.options->pp_microbatches ? 1 : in.accumulation;
  plan.split_batches = in.options->split_batches || env.get("XLR8_SPLIT_BATCHES") == "1";
  auto parallel = in.options->parallel;
  if (in.deepspeed) {
    const auto& json = *in.deepspeed;
    if (!in.from_engine) {  // the engine's options carry its JSON's precision and accumulation; it clips itself
      plan.mixed_precision = deepspeed::mixed_precision(json);
      // fp8's layers run inside the JSON's bf16, which the plugin enabled for it.
      if (in.precision == MixedPrecision::FP8 && plan.mixed_precision == MixedPrecision::BF16)
        plan.mixed_precision = MixedPrecision::FP8;
      if (json.gradient_accumulation_steps.value_or(0) > 0)
        plan.gradient_accumulation_steps = static_cast<int>(*json.gradient_accumulation_steps);
      plan.clip_at_step = json.gradient_clipping;
    }
    if (in.from_engine) plan.tensor.deepspeed_rules = deepspeed::tensor_rules(json);
  } else if (settings.deepspeed) {
    // DeepSpeed clips every step: at --gradient_clipping, else 1.0 (Accelerate's config without a JSON says "auto",
    // which its Accelerator fills with 1.0); 0 turns it off.
    plan.clip_at_step = settings.deepspeed->gradient_clipping.value_or(1.0);
  }
  if (!in.from_engine) plan.gradient_accumulation_steps *= in.micro_batches_per_rank;
  if (plan.mixed_precision == MixedPrecision::FP8) plan.fp8 = in.options->fp8.value_or(settings.fp8);
  if (plan.mixed_precision == MixedPrecision::FP16)
    plan.loss_scaler = in.deepspeed ? deepspeed::loss_scaler(*in.deepspeed) : LossScalerOptions{};
  parallel = shard::resolve_parallel_options(std::move(parallel), in.deepspeed ? &in.deepspeed->zero_optimization : nullptr,
                                      settings, in.state->local_world_size(), in.device.is_cpu());
  if (!parallel.zero.param_dtype) parallel.zero.param_dtype = sharded_param_dtype(plan.mixed_precision, in.device, env);
  if (env.get_bool("XLR8_GRADIENTS_ON_DISK").value_or(false)) gradients_on_disk(parallel.zero, plan.mesh);
  plan.data_parallel_dim = parallel::data_parallel_dim(mesh);
  plan.strategy = strategy_of(parallel.zero, mesh.size(plan.data_parallel_dim));
  plan.data_parallel = std::move(parallel);
  return plan;
}

}  // namespace accelerate

namespace {

// " (tensorwise scaling, backend AO; ...)": the recipe the model's Linear layers compute with.
std::string fp8_text(const Fp8Settings& f) {
  const auto recipe = fp8::recipe_from(f);
  return fmt::format(" ({} scaling, backend {}; bf16 autocast around the fp8 layers)", fp8::to_string(recipe.scaling),
                     f.backend.empty() ? "AO" : f.backend);
}

const char* dtype_name(const std::optional<at::ScalarType>& dtype) {
  if (!dtype) return "fp32";
  return *dtype == at::kBFloat16 ? "bf16" : *dtype == at::kHalf ? "fp16" : *dtype == at::kFloat ? "fp32" : "other";
}

std::string tensor_text(const ParallelPlan& p) {
  if (p.mesh.tp == 1) return "none";
  const auto& t = p.tensor;
  const std::string source = !t.deepspeed_rules.is_null() ? "the DeepSpeed JSON's tensor_parallel rules"
                             : !t.plan_file.empty()       ? fmt::format("the plan file {}", t.plan_file)
                                                          : std::string("AutoTP");
  return fmt::format("tp {}: a model the program split is kept, else {} splits it; sequence parallel {}; head size {}",
                     p.mesh.tp, source, t.sequence_parallel ? "on" : "off",
                     t.head_dim > 0 ? std::to_string(t.head_dim) : std::string("unchecked"));
}

std::string data_parallel_text(const ParallelPlan& p) {
  const auto& z = p.data_parallel.zero;
  std::string text = fmt::format("{} over {}", p.strategy, to_string(p.data_parallel_dim));
  if (z.stage == 3) {
    text += fmt::format(", units {}", to_string(z.auto_wrap_policy));
    if (!z.layer_classes.empty()) text += fmt::format(" [{}]", fmt::join(z.layer_classes, ", "));
    text += fmt::format(", prefetch forward {} backward {}", z.forward_prefetch ? "on" : "off", to_string(z.backward_prefetch));
  }
  if (z.stage > 0) text += fmt::format(", parameters computed in {}", dtype_name(z.param_dtype));
  if (z.hybrid_shard_size > 0) text += fmt::format(", hybrid: shard groups of {}", z.hybrid_shard_size);
  if (z.offload_optimizer || z.offload_params)
    text += fmt::format(", offload {}", z.offload_params ? "optimizer and parameters" : "optimizer");
  if (z.optimizer_on_disk.gradients) text += ", gradients on disk";
  return text;
}

}  // namespace

std::string ParallelPlan::describe() const {
  std::vector<std::string> lines;
  lines.push_back(fmt::format("mesh: pp {} x dp_replicate {} x dp_shard {} x cp {} x sp {} x tp {}", mesh.pp,
                              mesh.dp_replicate, mesh.dp_shard, mesh.cp, mesh.sp, mesh.tp));
  lines.push_back(mesh.pp > 1 ? fmt::format("pipeline: {} stages", mesh.pp) : "pipeline: none");
  lines.push_back("tensor parallel: " + tensor_text(*this));
  lines.push_back(sequence.comm_strategy.empty()
                      ? "sequence split: none"
                      : fmt::format("sequence split: {} {} ({}){}", mesh.sp > 1 ? "sp" : "cp", std::max(mesh.cp, mesh.sp),
                                    sequence.comm_strategy,
                                    sequence.fixed_length ? fmt::format(", every batch {} tokens", *sequence.fixed_length) : ""));
  lines.push_back(mesh.pp > 1 ? fmt::format("pipeline: {} stages ({} a rank), {} over {} micro-batches a step",
                                             mesh.pp * pipeline.virtual_stages, pipeline.virtual_stages,
                                             pipeline.schedule, pipeline.micro_batches)
                              : std::string("pipeline: none"));
  lines.push_back(fmt::format("activation checkpointing: {}", recompute_units ? "every unit of the wrap policy" : "off"));
  lines.push_back(fmt::format("precision: {}{}{}{}", to_string(mixed_precision), fp8 ? fp8_text(*fp8) : "",
                              loss_scaler ? (loss_scaler->static_scale > 0
                                                 ? fmt::format(", static loss scale {}", loss_scaler->static_scale)
                                                 : fmt::format(", dynamic loss scale from 2^{}", loss_scaler->initial_scale_power))
                                          : "",
                              allow_tf32 ? fmt::format(", TF32 float32 matmuls {}", *allow_tf32 ? "on" : "off") : ""));
  lines.push_back("data parallel: " + data_parallel_text(*this));
  lines.push_back(fmt::format("steps: {} micro-batch(es) per optimizer step, gradient clipping {}, split batches {}",
                              gradient_accumulation_steps, clip_at_step > 0 ? fmt::format("{}", clip_at_step) : "none",
                              split_batches ? "yes" : "no"));
  std::string text;
  for (const auto& line : lines) text += "xlr8 plan: " + line + "\n";
  return text;
}

nlohmann::json ParallelPlan::to_json() const {
  const auto& z = data_parallel.zero;
  return {{"mesh",
           {{"pp", mesh.pp}, {"dp_replicate", mesh.dp_replicate}, {"dp_shard", mesh.dp_shard}, {"cp", mesh.cp},
            {"sp", mesh.sp}, {"tp", mesh.tp}}},
          {"tensor_parallel",
           {{"sequence_parallel", tensor.sequence_parallel}, {"head_dim", tensor.head_dim}, {"plan_file", tensor.plan_file},
            {"deepspeed_rules", !tensor.deepspeed_rules.is_null()}}},
          {"sequence", {{"comm_strategy", sequence.comm_strategy}, {"fixed_length", sequence.fixed_length.value_or(0)}}},
          {"pipeline",
           {{"schedule", pipeline.schedule},
            {"micro_batches", pipeline.micro_batches},
            {"virtual_stages", pipeline.virtual_stages}}},
          {"recompute_units", recompute_units},
          {"mixed_precision", to_string(mixed_precision)},
          {"fp8", fp8 ? nlohmann::json(fp8_text(*fp8)) : nlohmann::json()},
          {"loss_scaler", loss_scaler.has_value()},
          {"allow_tf32", allow_tf32 ? nlohmann::json(*allow_tf32) : nlohmann::json()},
          {"strategy", strategy},
          {"data_parallel_dim", to_string(data_parallel_dim)},
          {"zero",
           {{"stage", z.stage}, {"auto_wrap_policy", to_string(z.auto_wrap_policy)}, {"layer_classes", z.layer_classes},
            {"hybrid_shard_size", z.hybrid_shard_size}, {"param_dtype", dtype_name(z.param_dtype)},
            {"offload_optimizer", z.offload_optimizer}, {"offload_params", z.offload_params}}},
          {"gradient_accumulation_steps", gradient_accumulation_steps},
          {"clip_at_step", clip_at_step},
          {"split_batches", split_batches}};
}

}  // namespace xlr8
