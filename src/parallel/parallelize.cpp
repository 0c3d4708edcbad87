// parallelize(): the model's steps to parallel training in their one order (parallelize.hpp).
#include "parallel/parallelize.hpp"

#include <fmt/format.h>

#include <set>

#include "core/log.hpp"
#include "parallel/pipeline/tied_weights.hpp"
#include "parallel/recompute/deferred_recording.hpp"
#include "parallel/recompute/recompute.hpp"
#include "parallel/shard/wrap_policy.hpp"
#include "xlr8/deferred_init.hpp"
#include "xlr8/error.hpp"
#include "xlr8/float8.hpp"
#include "xlr8/pipeline.hpp"
#include "xlr8/tensor_parallel.hpp"

namespace xlr8::parallel {
namespace {

// A split the program or the JSON's rules made: the tp group must be the mesh's, and no head may be cut.
void check_split(torch::nn::Module& module, const tp::SlicedParameters& sliced, int tp, int64_t head_dim) {
  if (sliced.group->size() != tp)
    throw ConfigError(fmt::format("prepare(): the model was split over a tp group of {} ranks but "
                                  "parallelism_config_tp_size is {}; make them equal",
                                  sliced.group->size(), tp));
  try {
    tp::check_whole_heads(module, head_dim);
  } catch (const ConfigError& e) {
    throw ConfigError(fmt::format("prepare(): {}", e.what()));
  }
}

// fsdp_activation_checkpointing: every unit of the wrap policy is recomputed in backward (after TP split its
// layers, before the sharded model takes its parameters: torchtitan's order).
void recompute_units(const torch::nn::Module& module, const ZeroOptions& zero) {
  int marked = 0;
  for (const auto& unit : shard::plan_units(module, zero))
    if (unit.module && unit.module != &module) {
      recompute::mark_recomputed_unit(*unit.module, unit.label, module);
      ++marked;
    }
  if (marked == 0)
    throw ConfigError(fmt::format(
        "fsdp_activation_checkpointing: true checkpoints the units of the wrap policy, and fsdp_auto_wrap_policy {} "
        "makes none in this model; set fsdp_auto_wrap_policy: TRANSFORMER_BASED_WRAP with "
        "fsdp_transformer_layer_cls_to_wrap naming its block class (or the model's xlr8::NoSplitModules declaring "
        "it), or fsdp_activation_checkpointing: false",
        to_string(zero.auto_wrap_policy)));
  log::info("prepare(): fsdp_activation_checkpointing: {} unit(s) recompute their forward in backward", marked);
}

// mixed_precision fp8: the filter's Linear layers compute in fp8, their amaxes reduced over the ranks holding other
// rows of the batch (dp x cp) and, for a split layer, over its tp group. Refused on a GPU without fp8 gemms.
void convert_to_float8(torch::nn::Module& module, const Fp8Settings& settings, DeviceMesh& mesh,
                       std::optional<at::Device> device) {
  const auto recipe = fp8::recipe_from(settings);
  const auto parameters = module.parameters();  // on the device by now (step 2 placed them), unless recorded
  if (!device && !parameters.empty()) device = parameters.front().device();
  if (device && device->is_cuda() && !fp8::has_fp8_gemm(*device, recipe.scaling == fp8::Scaling::Rowwise))
    throw ConfigError(fmt::format(
        "mixed_precision fp8: this GPU ({}) has no fp8 gemm (LibTorch's _scaled_mm needs compute capability 8.9, "
        "Ada or Hopper, and later); use mixed_precision bf16 on it",
        device->str()));
  auto report = fp8::convert_to_float8_training(module, recipe, fp8::filter_from(settings), mesh.group(MeshDim::dp_cp));
  if (report.converted.empty())
    throw ConfigError(fmt::format("mixed_precision fp8: no Linear layer of the model can compute in fp8, so it would "
                                  "train in bf16 only; use mixed_precision bf16, or see why:\n{}",
                                  report.describe()));
  if (mesh.group(MeshDim::dp_cp).rank() == 0 && mesh.group(MeshDim::tp).rank() == 0)
    log::info("prepare(): {}", report.describe());
}

// The layers of other stages give their memory back: this rank never runs them, and what it saves and loads is its
// stage's (their names stay, for checkpoints of the whole model).
void release_other_stages(torch::nn::Module& whole, const torch::nn::Module& stage) {
  std::set<const torch::nn::Module*> mine;
  for (const auto& layer : stage.children()) mine.insert(layer.get());
  at::NoGradGuard no_grad;
  // A recorded layer's tensors never get values here: their recordings go, and they become empty CPU tensors, as
  // materialize() gives a meta tensor its values (set_data refuses a meta tensor; one could not move to the device).
  auto release = [](at::Tensor& tensor) {
    if (deferred::forget({tensor}) > 0) {
      tensor.unsafeGetTensorImpl()->shallow_copy_from(at::empty({0}, tensor.options().device(at::kCPU)).getIntrusivePtr());
      return;
    }
    tensor.set_data(at::empty({0}, tensor.options()));
  };
  for (const auto& layer : whole.children()) {
    if (mine.count(layer.get())) continue;
    for (auto& tensor : layer->parameters()) release(tensor);
    for (auto& tensor : layer->buffers()) release(tensor);
  }
}

// A build that build_model recorded (DeferredInitScope): the modules this stage's tied layers run and another stage
// owns compute their values now (a copy needs them), bitwise the whole build's, and so do its other layers unless `sharded_later` (the
// stage's sharded model computes them group by group as it makes them); the other stages' never do.
void materialize_stage(const torch::nn::Sequential& stage, bool sharded_later) {
  std::vector<at::Tensor> tensors;
  auto add = [&](const torch::nn::Module& module) {
    for (const auto& p : module.parameters()) tensors.push_back(p);
    for (const auto& b : module.buffers()) tensors.push_back(b);
  };
  for (const auto& layer : stage->children()) {
    if (!sharded_later) add(*layer);
    if (const auto* tied = layer->as<pp::TiedLayerImpl>(); tied && !tied->owner()) add(tied->tied());
  }
  materialize(tensors);
}

// A recorded parameter written between build_model and prepare is refused on every rank alike, though a program may
// write on some ranks only (rank 0 loading a file): the ranks agree over each axis of the mesh in turn (a sum over
// pp, then dp, then tp is one over every rank; cp and sp are refused under pp), so that none waits for a
// neighbour that stopped. Collective under pp, recorded or not.
void refuse_writes_on_every_rank(const torch::nn::Module& whole, DeviceMesh& mesh) {
  auto every = whole.parameters();
  for (const auto& b : whole.buffers()) every.push_back(b);
  std::string written;
  try {
    check_deferred_unchanged(every);
  } catch (const Error& e) {
    written = e.what();
  }
  auto refused = at::full({1}, written.empty() ? 0 : 1, at::kInt);
  for (const auto dim : {MeshDim::pp, MeshDim::dp, MeshDim::tp})
    if (mesh.size(dim) > 1) mesh.group(dim).all_reduce(refused);
  if (refused.item<int>() > 0)
    throw ConfigError(written.empty() ? std::string("another rank refused its recorded model (DeferredInitScope, "
                                                    "build_model): see its error")
                                      : written);
}

// pp > 1: the model's layers in order, cut by parameters into one stage a pp rank; the later steps make that stage
// parallel over the rank's other axes (its tp group, its dp peers: the ranks holding the same stage).
std::shared_ptr<torch::nn::Module> cut_into_stages(torch::nn::Module& module, DeviceMesh& mesh, const ParallelPlan& plan,
                                                   const ParallelizeHooks& hooks) {
  const int virtual_stages = plan.pipeline.virtual_stages;
  const int pp = mesh.size(MeshDim::pp);
  if (const int sequence = mesh.size(MeshDim::cp) * mesh.size(MeshDim::sp); sequence > 1)
    throw ConfigError(fmt::format("parallelism_config_pp_size {} with parallelism_config_cp_size or _sp_size {}: "
                                  "pipelines do not compose with context parallelism yet; give those ranks to dp or tp",
                                  pp, sequence));
  auto* sequential = module.as<torch::nn::SequentialImpl>();
  if (!sequential)
    throw ConfigError(fmt::format("parallelism_config_pp_size {}: a pipeline cuts a torch::nn::Sequential into stages, "
                                  "and this model is not one; build it as a Sequential of its layers in order",
                                  pp));
  auto whole = torch::nn::Sequential(std::static_pointer_cast<torch::nn::SequentialImpl>(sequential->shared_from_this()));
  auto stage = pp::stage_layers(whole, pp, mesh.rank(MeshDim::pp), virtual_stages);
  if (hooks.stage_cut) hooks.stage_cut(stage);
  refuse_writes_on_every_rank(*whole, mesh);
  // ZeRO-3 / FULL_SHARD computes a recorded stage's groups as it makes them (tensor parallelism slices whole values).
  materialize_stage(stage.layers, /*sharded_later=*/plan.strategy == "zero3" && mesh.size(MeshDim::tp) == 1);
  pp::copy_tied_modules(whole, stage.layers);  // before the owner's layer, on another stage, gives its memory back
  release_other_stages(*whole, *stage.layers);
  return stage.layers.ptr();
}

}  // namespace

void split_for_tensor_parallel(torch::nn::Module& module, DeviceMesh& mesh, const ParallelPlan::TensorParallel& tensor) {
  const int tp = mesh.size(MeshDim::tp);
  if (tp > 1 && !tensor.deepspeed_rules.is_null() && !tp::sliced_parameters(module).group)
    tp::parallelize(module, mesh.group(MeshDim::tp), tp::plan_from_deepspeed(tensor.deepspeed_rules, module, tp),
                    /*strict=*/false);
  const auto sliced = tp::sliced_parameters(module);
  if (sliced.group) check_split(module, sliced, tp, tensor.head_dim);
  if (tp == 1 || sliced.group) return;
  if (tensor.head_dim == 0)  // AutoTP and a plan file check divisibility only; a head cut in two fails in the forward
    log::info("prepare(): parallelism_config_tp_size {} without a head size: a split that cuts an attention head is "
              "not refused before training (give AcceleratorOptions::tp_head_dim or --parallelism_config_tp_head_dim)",
              tp);
  // The plan made here is Megatron's sequence parallelism too when the plan says so.
  const char* sp_note = tensor.sequence_parallel ? ", with sequence parallelism" : "";
  if (!tensor.plan_file.empty()) {
    auto plan = tp::plan_from_file(tensor.plan_file, module, tp, tensor.head_dim);
    if (tensor.sequence_parallel) plan = tp::with_sequence_parallel(std::move(plan), module);
    tp::parallelize(module, mesh.group(MeshDim::tp), plan, /*strict=*/false);
    log::info("prepare(): parallelism_config_tp_size {}: the model split by the plan file {}{}", tp, tensor.plan_file,
              sp_note);
    return;
  }
  try {
    tp::parallelize(module, mesh.group(MeshDim::tp), tp::auto_plan(module, tp, tensor.head_dim, tensor.sequence_parallel),
                    /*strict=*/true);
  } catch (const ConfigError& e) {
    throw ConfigError(fmt::format("prepare(): parallelism_config_tp_size is {} and the program applied no plan "
                                  "(xlr8::tp::parallelize), so AutoTP tried: {}",
                                  tp, e.what()));
  }
  log::info("prepare(): parallelism_config_tp_size {}: AutoTP split the model's layers (no plan was applied){}", tp,
            sp_note);
}

MeshDim data_parallel_dim(const DeviceMesh& mesh) {
  return mesh.size(MeshDim::dp_cp) > mesh.size(MeshDim::dp) ? MeshDim::dp_cp : MeshDim::dp;
}

std::unique_ptr<ParallelStrategy> parallelize(std::shared_ptr<torch::nn::Module> module, const ParallelPlan& plan,
                                              DeviceMesh& mesh, const ParallelizeHooks& hooks) {
  if (!module) throw Error("prepare(): the model is null");
  // 1. Pipeline stages: from here on `module` is this rank's stage (the same layer objects as the whole's).
  if (plan.mesh.pp > 1) module = cut_into_stages(*module, mesh, plan, hooks);
  // 2. Tensor parallelism.
  split_for_tensor_parallel(*module, mesh, plan.tensor);
  if (hooks.after_tensor_parallel) hooks.after_tensor_parallel(*module);
  // 3. Context parallelism: the model's xlr8::attention follows the process's context (the Accelerator set it
  //    from plan.sequence); nothing in the model changes.
  auto options = plan.data_parallel;
  // 4. Activation checkpointing.
  if (plan.recompute_units) recompute_units(*module, options.zero);
  // 5. Precision: sharded parameters are gathered and computed in options.zero.param_dtype (the plan's); under
  //    fp8 the model's Linear layers take their recipe (cast after the gather, from the compute dtype).
  if (plan.fp8) convert_to_float8(*module, *plan.fp8, mesh, hooks.device);
  // 6. Data parallelism.
  if (hooks.data_parallel_options) hooks.data_parallel_options(*module, options);
  return make_parallel_strategy(std::move(module), mesh.group(plan.data_parallel_dim), options, hooks.gradient_state);
}

}  // namespace xlr8::parallel
