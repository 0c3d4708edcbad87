// The Accelerator under pipeline parallelism (parallelism_config_pp_size > 1): the stage's schedule as one call a
// step, its gradients reduced over the stage's data-parallel peers once a step, and clipping across stages.
#include <fmt/format.h>

#include <algorithm>
#include <cmath>

#include "accelerate/accelerator_impl.hpp"
#include "parallel/grad_norm.hpp"
#include "xlr8/accelerator.hpp"
#include "xlr8/error.hpp"
#include "xlr8/pipeline.hpp"

namespace xlr8 {

void AcceleratorImpl::start_pipeline(std::shared_ptr<torch::nn::Module> whole) {
  auto* strategy = models.front().get();
  auto stage = std::dynamic_pointer_cast<torch::nn::SequentialImpl>(strategy->module());
  if (!stage) throw Error("prepare(): under pp the prepared stage is not a torch::nn::Sequential");
  pipeline = std::make_unique<pp::Pipeline>(torch::nn::Sequential(stage), state->mesh().group(MeshDim::pp),
                                            pp::parse_schedule(plan.pipeline.schedule), plan.pipeline.micro_batches);
  pipelined_model = std::move(whole);
  // The micro-batches are the stage's accumulation steps: only the last backward synchronises.
  pipeline->set_before_backward([this, strategy](bool last_of_step) {
    if (!last_of_step) return;
    gradient_state->sync_gradients = true;
    strategy->begin_step(/*suspend_sync=*/false);
  });
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
  for (const auto& holder : stage.gradient_holders(parameters))
    if (holder.grad().defined()) grads.push_back(holder.grad());
  return GradNorm(parallel::scale_to_norm(part, {&grads}, max_norm, norm_type));
}

double Accelerator::pipeline_step(const at::Tensor& input, const at::Tensor& target, const pp::LossFn& loss) {
  auto& s = *impl_;
  if (!s.pipeline)
    throw ConfigError("pipeline_step(): no pipeline: set parallelism_config_pp_size above 1 and prepare the model first");
  if (s.plan.gradient_accumulation_steps > 1)
    throw ConfigError(fmt::format("pipeline_step(): gradient_accumulation_steps {} under pp: the pipeline's micro-batches "
                                  "are its accumulation; set parallelism_config_pp_microbatches instead and "
                                  "gradient_accumulation_steps 1",
                                  s.plan.gradient_accumulation_steps));
  if (s.scaler)
    throw ConfigError("pipeline_step(): mixed_precision fp16 under pp is not built (its loss scale would have to reach "
                      "every micro-batch's loss); use mixed_precision bf16");
  const int m = s.plan.pipeline.micro_batches;
  auto split = [&](const at::Tensor& t, const char* what) {
    if (!t.defined()) return std::vector<at::Tensor>{};
    if (t.dim() == 0 || t.size(0) % m != 0)
      throw ConfigError(fmt::format("pipeline_step(): the {}'s first dimension ({}) does not split into {} equal "
                                    "micro-batches (parallelism_config_pp_microbatches); give a batch it divides",
                                    what, t.dim() == 0 ? 0 : t.size(0), m));
    auto parts = t.to(s.device).chunk(m);
    return std::vector<at::Tensor>(parts.begin(), parts.end());
  };
  auto inputs = split(input, "input");
  auto targets = split(target, "target");
  s.enter(xlr8::step::StepPhase::gradients, "pipeline_step()");
  auto& stage = *s.models.front();
  s.gradient_state->sync_gradients = false;  // until the stage's last backward (set_before_backward above)
  stage.begin_step(/*suspend_sync=*/true);
  struct EndStep {  // the strategy's scope ends however the step does, at the boundary optimizer.step() steps at
    ParallelStrategy& strategy;
    GradientState& gradients;
    ~EndStep() {
      strategy.end_step();
      gradients.sync_gradients = true;
    }
  } end_step{stage, *s.gradient_state};
  auto scope = autocast();
  return s.pipeline->step(inputs, targets, loss);
}

}  // namespace xlr8
