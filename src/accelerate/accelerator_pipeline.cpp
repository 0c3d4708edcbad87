// The Accelerator under pipeline parallelism (parallelism_config_pp_size > 1): the stage's schedule as one call a
// step, its gradients reduced over the stage's data-parallel peers once a step, and clipping across stages.
#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <cmath>
#include <optional>
#include <set>

#include "accelerate/accelerator_impl.hpp"
#include "parallel/parallelize.hpp"
#include "parallel/grad_norm.hpp"
#include "parallel/pipeline/eval_mode.hpp"
#include "parallel/pipeline/owner_pieces.hpp"
#include "xlr8/accelerator.hpp"
#include "xlr8/error.hpp"
#include "xlr8/pipeline.hpp"

namespace xlr8 {

namespace {
// Inside a step the stage's backwards decide when gradients synchronise; after it, however it ends, the next
// optimizer.step() is at the boundary.
struct SyncAfterwards {
  GradientState& gradients;
  ~SyncAfterwards() { gradients.sync_gradients = true; }
};
}  // namespace

void AcceleratorImpl::check_pipeline() const {
  if (!models.empty())
    throw ConfigError("prepare(): under parallelism_config_pp_size > 1 one model is prepared (the pipeline's)");
  const auto& p = plan.pipeline;
  const auto schedule = pp::parse_schedule(p.schedule);
  (void)pp::actions(schedule, plan.mesh.pp, p.micro_batches, 0, p.virtual_stages);
}

void AcceleratorImpl::start_pipeline(std::shared_ptr<torch::nn::Module> whole, const pp::StageLayers& cut) {
  auto* strategy = models.front().get();
  auto stage = std::dynamic_pointer_cast<torch::nn::SequentialImpl>(strategy->module());
  if (!stage) throw Error("prepare(): under pp the prepared stage is not a torch::nn::Sequential");
  pipeline = std::make_unique<pp::Pipeline>(torch::nn::Sequential(stage), state->mesh().group(MeshDim::pp),
                                            pp::parse_schedule(plan.pipeline.schedule), plan.pipeline.micro_batches,
                                            cut.chunk_sizes);
  if (const auto* partitioned = whole->as<pp::PartitionedSequentialImpl>())
    pipeline->set_activation_checkpoint_interval(partitioned->activation_checkpoint_interval);
  pipelined_model = std::move(whole);
  start_tied_weights(*strategy, cut.parts);
  // The micro-batches are the stage's accumulation steps: only the last backward synchronises, overlapping it.
  // An interleaved rank's chunks finish their backwards apart, and a zero-bubble schedule's weight gradients come
  // after its backwards, so those reduce after the schedule instead (pipeline_step).
  if (reduces_after_schedule()) return;
  pipeline->set_before_backward([this, strategy](bool last_of_step) {
    if (!last_of_step) return;
    gradient_state->sync_gradients = true;
    strategy->begin_step(/*suspend_sync=*/false);
  });
}

void AcceleratorImpl::start_tied_weights(const ParallelStrategy& strategy,
                                         const std::vector<std::pair<size_t, size_t>>& parts) {
  auto* whole = pipelined_model->as<torch::nn::SequentialImpl>();
  if (!whole) return;
  auto& mesh = state->mesh();
  const auto sequential = torch::nn::Sequential(std::static_pointer_cast<torch::nn::SequentialImpl>(whole->shared_from_this()));
  const auto stage = torch::nn::Sequential(std::static_pointer_cast<torch::nn::SequentialImpl>(strategy.module()));
  auto weights = std::make_unique<pp::TiedWeights>(sequential, stage, parts, mesh.group(MeshDim::pp),
                                                   mesh.group(parallel::data_parallel_dim(mesh)), device);
  if (weights->empty()) return;
  // A copy's gradient joins the owner's where the optimizer reads it: on a sharded or tensor-split stage, this rank's
  // piece of the owner's parameter (whose whole values the copies take from the pieces of the stage's ranks).
  if (plan.mesh.tp > 1 && plan.tensor.sequence_parallel)
    throw ConfigError(fmt::format("prepare(): tied layers ({}) under pp with tp's sequence parallelism are not built "
                                  "yet (a copy would see a share of the sequence); turn off tp_sequence_parallel",
                                  weights->describe()));
  if (!strategy.replicated() || plan.mesh.tp > 1)
    weights->use_owner_pieces(std::make_shared<pp::OwnerPieces>(strategy, mesh.group(parallel::data_parallel_dim(mesh)),
                                                                mesh.group(MeshDim::tp), device));
  weights->check_copies_match();
  tied = std::move(weights);
}

void AcceleratorImpl::keep_stage_parameters(torch::optim::Optimizer& optimizer) const {
  if (!pipeline) return;
  const auto& stage = *models.front();
  for (auto& group : optimizer.param_groups())
    std::erase_if(group.params(), [&](const at::Tensor& p) { return !stage.owns(p); });
}

GradNorm AcceleratorImpl::clip_pipeline_grad_norm(double max_norm, double norm_type) {
  unscale_gradients();
  auto& stage = *models.front();
  const auto parameters = stage.module()->parameters();
  // The stage's norm over its dp and tp peers (as its strategy measures it), then the stages' parts joined.
  const auto measured = stage.clip_grad_norm(parameters, std::numeric_limits<double>::infinity(), norm_type);
  const bool infinity = std::isinf(norm_type);
  auto part = measured.tensor().defined() ? measured.tensor().to(at::kDouble).reshape({1})
                                          : at::zeros({1}, at::TensorOptions().dtype(at::kDouble).device(device));
  if (!infinity) part = part.pow(norm_type);
  state->mesh().group(MeshDim::pp).all_reduce(part, infinity ? ReduceOp::MAX : ReduceOp::SUM);
  std::vector<at::Tensor> grads;
  std::set<const void*> seen;  // a weight tied inside the stage is listed under each name: scaled once
  for (const auto& holder : stage.gradient_holders(parameters))
    if (holder.grad().defined() && seen.insert(holder.unsafeGetTensorImpl()).second) grads.push_back(holder.grad());
  return GradNorm(parallel::scale_to_norm(part, {&grads}, max_norm, norm_type));
}

void stream_pipeline_state(const AcceleratorImpl& s, const std::function<void(const std::function<void()>&)>& on_main,
                           const std::function<void(std::vector<SafetensorsSpec>)>& open,
                           const std::function<void(const at::Tensor&)>& write) {
  auto& mesh = s.state->mesh();
  auto& pp = mesh.group(MeshDim::pp);
  const auto own = whole_state_of(s, *s.models.front()->module());
  // World rank 0 learns every stage's names, dtypes and shapes (its pp group: the ranks at dp 0, tp 0 of each).
  nlohmann::json described = nlohmann::json::array();
  for (const auto& [name, t] : own.layout) described.push_back({name, static_cast<int>(t.scalar_type()), t.sizes().vec()});
  const auto stages = pp.all_gather_object(described.dump());
  std::vector<std::vector<SafetensorsSpec>> specs(stages.size());
  for (size_t t = 0; t < stages.size(); ++t)
    for (const auto& d : nlohmann::json::parse(stages[t]))
      specs[t].push_back({d[0].get<std::string>(), static_cast<at::ScalarType>(d[1].get<int>()), d[2].get<std::vector<int64_t>>()});
  on_main([&] {
    std::vector<SafetensorsSpec> all;
    for (const auto& stage : specs) all.insert(all.end(), stage.begin(), stage.end());
    open(std::move(all));
  });
  // The stage's own tensors (collective over its dp and tp peers); its rank at dp 0, tp 0 holds them whole and, on
  // a later stage, sends them to world rank 0, which writes the stages in order.
  const bool holder = mesh.rank(MeshDim::dp_cp) == 0 && mesh.rank(MeshDim::tp) == 0;
  own.visit([&](size_t i, const at::Tensor& whole) {
    if (pp.rank() == 0) on_main([&] { write(whole); });
    else if (holder) pp.send(whole.to(s.device).contiguous(), 0, static_cast<int>(i));  // NCCL sends device tensors
  });
  if (pp.rank() != 0 || !holder) return;
  for (size_t t = 1; t < specs.size(); ++t)
    for (size_t i = 0; i < specs[t].size(); ++i) {
      auto whole = at::empty(specs[t][i].shape, at::TensorOptions().dtype(specs[t][i].dtype).device(s.device));
      pp.recv(whole, static_cast<int>(t), static_cast<int>(i));
      on_main([&] { write(whole); });
    }
}

std::vector<at::Tensor> AcceleratorImpl::split_micro_batches(const at::Tensor& t, const char* what, const char* call,
                                                             int count) const {
  if (!t.defined()) return {};
  if (t.dim() == 0 || t.size(0) % count != 0)
    throw ConfigError(fmt::format("{}: the {}'s first dimension ({}) does not split into {} equal micro-batches "
                                  "(parallelism_config_pp_microbatches); give a batch it divides",
                                  call, what, t.dim() == 0 ? 0 : t.size(0), count));
  auto parts = t.to(device).chunk(count);
  return {parts.begin(), parts.end()};
}

double AcceleratorImpl::accumulate_micro_batches(const at::Tensor& input, const at::Tensor& target,
                                                 const pp::LossFn& loss,
                                                 const std::function<AutocastScope()>& autocast) {
  if (models.size() != 1)
    throw ConfigError(fmt::format("pipeline_step(): {} models are prepared; the step runs one (prepare the pipeline's "
                                  "model alone)",
                                  models.size()));
  auto& strategy = *models.front();
  auto layers = std::dynamic_pointer_cast<torch::nn::SequentialImpl>(strategy.module());
  if (!layers)
    throw ConfigError("pipeline_step(): the prepared model is not a torch::nn::Sequential, which a pipeline cuts into "
                      "stages; build it as a Sequential of its layers in order (or train with backward())");
  if (const int sequence = plan.mesh.cp * plan.mesh.sp; sequence > 1)
    throw ConfigError(fmt::format("pipeline_step() with parallelism_config_cp_size or _sp_size {}: pipelines do not "
                                  "compose with context parallelism yet",
                                  sequence));
  // In xlr8 verify's third run this process repeats N ranks: each rank's share is `per_share` micro-batches.
  const int shares = verify ? verify->micro_split() : 1, per_share = plan.pipeline.micro_batches;
  const int count = shares * per_share;
  const auto inputs = split_micro_batches(input, "input", "pipeline_step()", count);
  const auto targets = split_micro_batches(target, "target", "pipeline_step()", count);
  if (inputs.empty() || targets.empty())
    throw ConfigError("pipeline_step(): without pipeline stages this process is the first and the last: give both "
                      "the input and the target");
  const auto* partitioned = layers->as<pp::PartitionedSequentialImpl>();
  const int interval = partitioned ? partitioned->activation_checkpoint_interval : 0;
  if (deepspeed) deepspeed->finish(gradient_state->num_steps);  // no "auto" left in the JSON by now
  // Sums stay on the device: the micro-batches do not wait for it (the recorders, when on, read their losses).
  auto total = at::zeros({}, at::TensorOptions().dtype(at::kDouble).device(device)), share = total.clone();
  SyncAfterwards sync_afterwards{*gradient_state};
  for (int i = 0; i < count; ++i) {
    const bool last = i == count - 1;
    gradient_state->sync_gradients = last;  // as under accumulate(): only the last backward reduces
    StepScope micro(this, {&strategy}, /*suspend_sync=*/!last, AutocastScope());
    at::Tensor value;
    {
      auto scope = autocast();
      value = loss(pp::forward_layers(torch::nn::Sequential(layers), inputs[i], interval), targets[i]);
    }
    const auto scaled = loss_for_backward(value / count);
    {
      AutocastPause outside_autocast;
      scaled.backward();
    }
    const auto v = value.detach().to(at::kDouble);
    total.add_(v), share.add_(v);
    if ((i + 1) % per_share == 0) {  // the recorders see one loss a rank's share, as a pipeline gives it
      const auto mean = share / per_share;
      notify([&](xlr8::step::StepObserver& o) { o.on_backward(mean); });
      share.zero_();
    }
  }
  check_units_recomputed();
  return total.item<double>() / count;  // the step's one wait for the device
}

nlohmann::json Accelerator::pipeline_stats() const {
  const auto& s = *impl_;
  if (!s.pipeline) return nullptr;
  const auto& p = *s.pipeline;
  const auto& plan = s.plan.pipeline;
  const int stages = s.plan.mesh.pp;
  return {{"stage", s.state->mesh().rank(MeshDim::pp)},
          {"stages", stages},
          {"virtual_stages", plan.virtual_stages},
          {"schedule", plan.schedule},
          {"micro_batches", plan.micro_batches},
          {"step_seconds", p.last_step_seconds()},
          {"wait_seconds", p.last_wait_seconds()},
          {"bytes_sent", p.last_bytes_sent()},
          {"peak_held_micro_batches", p.last_peak_held()},
          {"whole_backwards", p.last_whole_backwards()},
          {"split_regions", p.last_split_regions()},
          {"bubble_formula",
           pp::bubble_fraction(pp::parse_schedule(plan.schedule), stages, plan.micro_batches, plan.virtual_stages)}};
}

double Accelerator::pipeline_step(const at::Tensor& input, const at::Tensor& target, const pp::LossFn& loss) {
  auto& s = *impl_;
  if (s.models.empty()) throw ConfigError("pipeline_step(): no model is prepared; prepare the model first");
  if (s.plan.gradient_accumulation_steps > 1)
    throw ConfigError(fmt::format("pipeline_step(): gradient_accumulation_steps {} under pp: the pipeline's micro-batches "
                                  "are its accumulation; set parallelism_config_pp_microbatches instead and "
                                  "gradient_accumulation_steps 1",
                                  s.plan.gradient_accumulation_steps));
  ++s.pipeline_steps;
  if (!s.pipeline) return s.accumulate_micro_batches(input, target, loss, [this] { return autocast(); });
  if (s.scaler)
    throw ConfigError("pipeline_step(): mixed_precision fp16 under pp is not built (its loss scale would have to reach "
                      "every micro-batch's loss); use mixed_precision bf16");
  const int m = s.plan.pipeline.micro_batches;
  auto inputs = s.split_micro_batches(input, "input", "pipeline_step()", m);
  auto targets = s.split_micro_batches(target, "target", "pipeline_step()", m);
  s.enter(xlr8::step::StepPhase::gradients, "pipeline_step()");
  auto& stage = *s.models.front();
  double mean = 0;
  {
    s.gradient_state->sync_gradients = false;  // until the stage's last backward (set_before_backward above)
    SyncAfterwards sync_afterwards{*s.gradient_state};
    StepScope scope_of_step(&s, {&stage}, /*suspend_sync=*/true, AutocastScope());
    auto scope = autocast();
    if (s.tied) s.tied->share_values();
    // A zero-bubble schedule runs a micro-batch's backward in two parts, a schedule apart, and its boundary nodes
    // twice: a sharded unit cannot tell when the last node reading its parameters has run (a weight gradient may
    // read the weight: softplus's, a norm's), which is when it may free them. So the stage's units stay gathered
    // through the schedule, as torch.distributed.pipelining keeps FSDP's units unsharded between micro-batches:
    // SHARD_GRAD_OP's memory for the step; gradients and optimizer state stay sharded.
    std::optional<FullParametersScope> gathered;
    if (s.keeps_stage_gathered()) gathered.emplace(&stage, /*writeback=*/false);
    mean = s.pipeline->step(inputs, targets, loss);
    if (s.reduces_after_schedule()) stage.reduce_accumulated_gradients();
    gathered.reset();
  }
  if (s.tied) s.tied->sum_gradients();  // into the owner's gradient its data-parallel reduction finished
  const auto recorded = at::scalar_tensor(mean, at::kDouble);  // the step's loss, as backward() would see it
  s.notify([&](xlr8::step::StepObserver& o) { o.on_backward(recorded); });
  return mean;
}

double Accelerator::pipeline_evaluate(const at::Tensor& input, const at::Tensor& target, const pp::LossFn& loss) {
  auto& s = *impl_;
  if (s.models.empty()) throw ConfigError("pipeline_evaluate(): no model is prepared; prepare the model first");
  const int m = s.plan.pipeline.micro_batches;
  const auto inputs = s.split_micro_batches(input, "input", "pipeline_evaluate()", m);
  const auto targets = s.split_micro_batches(target, "target", "pipeline_evaluate()", m);
  auto scope = autocast();
  if (s.pipeline) {
    if (s.tied) s.tied->share_values();
    return s.pipeline->evaluate(inputs, targets, loss);
  }
  auto layers = std::dynamic_pointer_cast<torch::nn::SequentialImpl>(s.models.front()->module());
  if (s.models.size() != 1 || !layers || inputs.empty() || targets.empty())
    throw ConfigError("pipeline_evaluate(): without pipeline stages one prepared model, a torch::nn::Sequential, runs "
                      "the batch: prepare that model alone and give both the input and the target");
  at::NoGradGuard no_grad;
  pp::EvalModeScope eval_mode(*layers);  // as the stages' evaluate()
  double total = 0;
  for (size_t i = 0; i < inputs.size(); ++i)
    total += loss(pp::forward_layers(torch::nn::Sequential(layers), inputs[i], 0), targets[i]).item<double>();
  return total / static_cast<double>(inputs.size());
}

}  // namespace xlr8
