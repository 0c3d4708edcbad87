// Accelerator, the training step: prepared optimizers and schedulers, the scopes around a step
// (accumulation, no_sync), autocast, backward, and unscaling and clipping the gradients.
#include <torch/nn/utils/clip_grad.h>

#include <algorithm>
#include <limits>
#include <unordered_set>
#include <utility>

#include <fmt/ranges.h>

#include "core/log.hpp"
#include "core/text.hpp"
#include "parallel/recompute/recompute.hpp"
#include "parallel/sequence/cp_ring.hpp"
#include "accelerate/accelerator_impl.hpp"
#include "parallel/grad_norm.hpp"
#include "xlr8/accelerator.hpp"
#include "xlr8/error.hpp"
#include "xlr8/tensor_parallel.hpp"

namespace xlr8 {

std::vector<at::Tensor> AcceleratorImpl::optimized_parameters() const {
  std::vector<at::Tensor> params;
  for (const auto& o : optimizers)
    for (const auto& group : o->optimizer->param_groups())
      for (const auto& p : group.params()) params.push_back(p);
  return params;
}

void AcceleratorImpl::check_attention_went_through_cp() {
  // Once, at the first backward (its forward has run): a later backward may reuse a graph (retain_graph, a
  // second loss) without a new forward.
  if (attention_checked) return;
  attention_checked = true;
  if (cp::detail::attention_calls() > 0) return;
  std::vector<std::string> suspects;
  for (const auto& model : models)
    for (const auto& item : model->module()->named_modules()) {
      const auto type = item.value()->name();
      if (text::lower(type).find("attention") != std::string::npos)
        suspects.push_back(fmt::format("{} ({})", item.key(), type));
    }
  throw ConfigError(fmt::format(
      "{} is {}, but the forward before this backward never called xlr8::attention(): attention "
      "written by hand sees only this rank's share of the sequence. Compute it with xlr8::attention(q, k, v, ...) "
      "(xlr8/context_parallel.hpp) in {}",
      state->mesh().size(MeshDim::sp) > 1 ? "parallelism_config_sp_size" : "parallelism_config_cp_size",
      state->mesh().size(MeshDim::cp) * state->mesh().size(MeshDim::sp),
      suspects.empty() ? std::string("the model's attention module") : text::capped(suspects)));
}

xlr8::step::TrainingView AcceleratorImpl::view() {
  xlr8::step::TrainingView v{*state, device, plan, gradient_state->num_steps, pipeline_steps, {}, {}, {}, {}};
  for (const auto& m : models) v.models.push_back(m.get());
  for (const auto& o : optimizers) v.optimizers.push_back(o->optimizer.get());
  for (const auto& weak : loaders)
    if (auto loader = weak.lock()) v.loaders.push_back(std::move(loader));
  v.write_full_model = [this](const torch::nn::Module& module, const std::string& dir) {
    // Under pp a stage stands for the whole model, which every stage writes its part of.
    const bool stage = pipeline && &module == models.front()->module().get();
    write_full_model(*this, stage ? *pipelined_model : module, dir);
  };
  if (pipeline)
    v.pipeline_grad_norm = [this](double norm_type) {
      return clip_pipeline_grad_norm(std::numeric_limits<double>::infinity(), norm_type).value();
    };
  return v;
}

void AcceleratorImpl::enter(xlr8::step::StepPhase next, const char* caller) {
  const auto from = step_state.enter(next, caller);
  if (next == xlr8::step::StepPhase::gradients) program_clip.reset();  // new gradients, not clipped yet
  notify([&](xlr8::step::StepObserver& o) { o.on_phase(from, next); });
}

void AcceleratorImpl::unscale_gradients() {
  if (step_state.ready()) return;
  if (!scaler) return enter(xlr8::step::StepPhase::unscaled, "unscale");  // nothing to divide or check
  at::NoGradGuard no_grad;
  // One fused unscale-and-check per device (under partial offload some gradients are in host memory, others
  // on the GPU), as torch's GradScaler does; the flags meet on the first gradient's device.
  std::vector<std::pair<at::Device, std::vector<at::Tensor>>> by_device;
  const auto optimized = optimized_parameters();
  for (const auto& p : optimized) {
    const auto& g = p.grad();
    if (!g.defined()) continue;
    auto same = std::find_if(by_device.begin(), by_device.end(), [&](const auto& d) { return d.first == g.device(); });
    if (same == by_device.end()) same = by_device.insert(by_device.end(), {g.device(), {}});
    same->second.push_back(g);
  }
  const auto flag_options = at::TensorOptions().dtype(at::kFloat);
  at::Tensor found = at::zeros({1}, flag_options.device(by_device.empty() ? at::Device(at::kCPU) : by_device[0].first));
  for (auto& [device, grads] : by_device) {
    auto found_here = at::zeros({1}, flag_options.device(device));
    const auto inverse = at::full({1}, 1.0 / scaler->scale(), flag_options.device(device));
    at::_amp_foreach_non_finite_check_and_unscale_(grads, found_here, inverse);
    found = at::maximum(found, found_here.to(found.device()));
  }
  // Gradients waiting on disk (ZeroOptions::Disk::gradients): checked as they are, divided as the step reads them.
  bool on_disk_overflow = false;
  for (const auto& model : models) on_disk_overflow = model->non_finite_gradients_on_disk(optimized) || on_disk_overflow;
  if (on_disk_overflow) found.fill_(1);
  const auto inverse_on_host = at::full({1}, 1.0 / scaler->scale(), flag_options);
  queue_on_disk_gradients(optimized, [inverse_on_host](at::Tensor& g) { g.mul_(inverse_on_host); });
  // Every rank must skip the same step: MAX of the overflow flag over the world (on the host, which every
  // backend reduces: the one wait for the device is this copy), read once.
  found = found.to(at::kCPU);
  world().all_reduce(found, ReduceOp::MAX);
  const bool overflow = found.item<float>() != 0;
  scaler->update(overflow);
  enter(overflow ? xlr8::step::StepPhase::overflowed : xlr8::step::StepPhase::unscaled, "unscale");
}

void AcceleratorImpl::queue_on_disk_gradients(const std::vector<at::Tensor>& parameters,
                                              const std::function<void(at::Tensor&)>& op) {
  for (const auto& model : models) model->queue_on_disk_gradients(parameters, op);  // each skips what is not its
}

// ------------------------------------------------------------------------------------------ optimizer, scheduler

namespace {
void check_not_freed(const AcceleratorImpl* impl, const char* what) {
  if (!impl)
    throw Error(fmt::format("{}.step(): Accelerator::free_memory() released it; prepare the {} again", what, what));
}

// overflowed → skipped: every rank leaves the parameters as they are (the scale already went down).
void skip_step(PreparedOptimizer::State& s, AcceleratorImpl& impl) {
  impl.enter(xlr8::step::StepPhase::skipped, "optimizer.step()");
  s.skipped = true;
  impl.last_step_applied = false;
  if (impl.state->is_main_process())
    log::info("xlr8: fp16 gradient overflow: skipped optimizer step; loss scale is now {}", impl.scaler->scale());
}

// unscaled → updated: DeepSpeed's clipping, then the strategy of the model the optimizer updates steps it
// (sharded strategies step their shards, then gather). True when this was the step's first optimizer.
bool apply_step(PreparedOptimizer::State& s, AcceleratorImpl& impl) {
  // The owner of the first parameter of any group (under pp a stage may keep none of a group's parameters).
  ParallelStrategy* owner = nullptr;
  for (const auto& group : s.optimizer->param_groups())
    if (!owner && !group.params().empty()) owner = impl.owner_of(group.params().front());
  const bool first = !impl.optimizers.empty() && impl.optimizers.front().get() == &s;
  if (first && !impl.observers.empty()) {
    const auto parameters = owner ? owner->module()->parameters() : impl.optimized_parameters();
    const auto training = impl.view();
    impl.notify([&](xlr8::step::StepObserver& o) { o.before_update(training, parameters, owner); });
  }
  // DeepSpeed's gradient_clipping, over the whole model's gradients; not again after the program clipped all of them
  // at most as far (the norm is within the limit already; under the disk tier it would read the gradients back).
  if (impl.plan.clip_at_step > 0) {
    const auto parameters = owner ? owner->module()->parameters() : impl.optimized_parameters();
    const auto& program = impl.program_clip;
    const bool clipped = program && program->max_norm <= impl.plan.clip_at_step &&
                         std::all_of(parameters.begin(), parameters.end(), [&](const at::Tensor& p) {
                           return program->parameters.count(p.unsafeGetTensorImpl()) > 0;
                         });
    if (!clipped) impl.clip_grad_norm(parameters, impl.plan.clip_at_step, 2.0);
  }
  if (owner) owner->optimizer_step(*s.optimizer);
  else s.optimizer->step();
  impl.enter(xlr8::step::StepPhase::updated, "optimizer.step()");
  s.skipped = false;
  s.steps += 1;
  impl.last_step_applied = true;
  return first;
}

}  // namespace

void PreparedOptimizer::step() {
  auto& s = *state_;
  check_not_freed(s.impl, "optimizer");
  auto& impl = *s.impl;
  if (!impl.gradient_state->sync_gradients) return;  // accumulating: the step waits for the boundary
  impl.notify([](xlr8::step::StepObserver& o) { o.optimizer_step_begins(); });
  impl.unscale_gradients();
  if (impl.step_state.overflow()) {
    skip_step(s, impl);
    impl.notify([](xlr8::step::StepObserver& o) { o.optimizer_step_ends(); });
    return;
  }
  const bool first = apply_step(s, impl);
  impl.notify([](xlr8::step::StepObserver& o) { o.optimizer_step_ends(); });
  if (!first || impl.observers.empty()) return;
  const auto training = impl.view();
  impl.notify([&](xlr8::step::StepObserver& o) { o.after_update(training, s.steps); });
}

void PreparedOptimizer::zero_grad(bool set_to_none) {
  check_not_freed(state_->impl, "optimizer");
  if (!state_->impl->gradient_state->sync_gradients) return;
  // Setting to none (PyTorch 2.x's default) lets the next backward's AccumulateGrad keep the fresh gradient
  // instead of adding it to zeros: two fewer passes over every gradient. Under DDP the bucket then copies
  // it in once. Zeroing in place keeps .grad a view into its bucket; LibTorch's own zero_grad() would
  // detach_() it from the bucket.
  at::NoGradGuard no_grad;
  for (auto& group : state_->optimizer->param_groups())
    for (auto& p : group.params()) {
      auto& grad = p.mutable_grad();
      if (!grad.defined()) continue;
      if (set_to_none) grad = at::Tensor();
      else grad.zero_();
    }
  // Gradients on disk (a step has not read them yet): the same, when the step reads them.
  std::vector<at::Tensor> parameters;
  for (auto& group : state_->optimizer->param_groups())
    parameters.insert(parameters.end(), group.params().begin(), group.params().end());
  state_->impl->queue_on_disk_gradients(parameters, set_to_none ? std::function<void(at::Tensor&)>()
                                                                : [](at::Tensor& g) { g.zero_(); });
}

torch::optim::Optimizer& PreparedOptimizer::optimizer() { return *state_->optimizer; }
bool PreparedOptimizer::step_was_skipped() const { return state_->skipped; }
int64_t PreparedOptimizer::steps_taken() const { return state_->steps; }

void PreparedScheduler::step() {
  check_not_freed(state_->impl, "scheduler");
  auto& impl = *state_->impl;
  if (!impl.gradient_state->sync_gradients || !impl.last_step_applied) return;
  state_->scheduler->step();
  state_->steps += 1;
}

torch::optim::LRScheduler& PreparedScheduler::scheduler() { return *state_->scheduler; }
int64_t PreparedScheduler::steps_taken() const { return state_->steps; }

// ------------------------------------------------------------------------------------------ step scope

StepScope::StepScope(AcceleratorImpl* impl, std::vector<ParallelStrategy*> models, bool suspend_sync,
                     AutocastScope autocast)
    : impl_(impl), models_(std::move(models)), suspend_sync_(suspend_sync), autocast_(std::move(autocast)) {
  for (auto* m : models_) m->begin_step(suspend_sync_);
  ++impl_->open_scopes;
}

StepScope::StepScope(StepScope&& other) noexcept
    : impl_(other.impl_),
      models_(std::move(other.models_)),
      suspend_sync_(other.suspend_sync_),
      autocast_(std::move(other.autocast_)) {
  other.active_ = false;
}

StepScope::~StepScope() {
  if (!active_) return;
  for (auto* m : models_) m->end_step();
  --impl_->open_scopes;
}

bool StepScope::sync_gradients() const { return !suspend_sync_ && impl_->gradient_state->sync_gradients; }

// ------------------------------------------------------------------------------------------ backward and gradients

StepScope Accelerator::open_micro_step(std::vector<torch::nn::Module*> modules, bool sync) {
  auto& s = *impl_;
  s.gradient_state->sync_gradients = sync;  // the caller's decision is the one every reader follows
  return StepScope(impl_.get(), s.strategies_of(modules), /*suspend_sync=*/!sync, AutocastScope());
}

StepScope Accelerator::make_step_scope(std::vector<torch::nn::Module*> modules, bool decide_sync) {
  auto& s = *impl_;
  auto strategies = s.strategies_of(modules);
  // The one decision of whether this step synchronises (the GradientState owns it; strategies read it).
  if (decide_sync) {
    auto& gs = *s.gradient_state;
    if (gs.sync_with_dataloader && gs.end_of_dataloader()) {
      s.micro_step = 0;
      gs.sync_gradients = true;
    } else {
      s.micro_step += 1;
      gs.sync_gradients = s.micro_step % gs.num_steps == 0;
    }
  }
  return StepScope(impl_.get(), std::move(strategies), /*suspend_sync=*/!decide_sync,
                   decide_sync ? autocast() : AutocastScope());
}

AutocastScope Accelerator::autocast() const {
  auto type = impl_->device.type();
  // fp8: bf16 autocast around the fp8 layers (Accelerate's native_amp for fp8).
  bool enabled = impl_->plan.mixed_precision == MixedPrecision::BF16 || impl_->plan.mixed_precision == MixedPrecision::FP8 ||
                 (impl_->plan.mixed_precision == MixedPrecision::FP16 && type == c10::DeviceType::CUDA);
  auto dtype = impl_->plan.mixed_precision == MixedPrecision::FP16 ? at::kHalf : at::kBFloat16;
  return enabled ? AutocastScope(type, dtype) : AutocastScope();
}

at::Tensor AcceleratorImpl::loss_for_backward(const at::Tensor& loss) {
  if (!loss.defined()) throw Error("backward(): the loss tensor is undefined");
  at::Tensor scaled = loss / gradient_state->num_steps;
  if (scaler) scaled = scaled * scaler->scale();
  enter(xlr8::step::StepPhase::gradients, "backward()");
  return scaled;
}

at::Tensor Accelerator::scaled_loss(const at::Tensor& loss) { return impl_->loss_for_backward(loss); }

void Accelerator::backward(const at::Tensor& loss, bool retain_graph) {
  if (impl_->plan.mesh.pp > 1)
    throw ConfigError(fmt::format("backward(): under parallelism_config_pp_size {} a step is accelerator.pipeline_step("
                                  "input, target, loss), which runs the schedule's forwards and backwards; one backward "
                                  "cannot express it",
                                  impl_->plan.mesh.pp));
  if (impl_->deepspeed)  // everything the JSON needs is prepared by now: no "auto" may be left
    impl_->deepspeed->finish(impl_->gradient_state->num_steps);
  // A forward under cp/sp that never went through xlr8::attention is refused before its backward computes
  // anything: nothing has trained yet.
  if (impl_->state->mesh().size(MeshDim::cp) * impl_->state->mesh().size(MeshDim::sp) > 1) impl_->check_attention_went_through_cp();
  auto scaled = impl_->loss_for_backward(loss);
  impl_->notify([&](xlr8::step::StepObserver& o) { o.on_backward(loss); });
  AutocastPause outside_autocast;
  scaled.backward({}, retain_graph);
  impl_->check_units_recomputed();
}

void AcceleratorImpl::check_units_recomputed() const {
  for (const auto& model : models)
    if (auto never = recompute::recomputed_units_never_run(*model->module()); !never.empty())
      throw ConfigError(fmt::format("fsdp_activation_checkpointing: unit(s) {} ran no forward through "
                                    "xlr8::sharded(*this, body, inputs...), so they were not checkpointed; write "
                                    "their forward in that form (xlr8/unshard.hpp)",
                                    fmt::join(never, ", ")));
}

void Accelerator::clip_grad_value(const std::vector<at::Tensor>& parameters, double clip_value) {
  auto& s = *impl_;
  if (!(clip_value >= 0)) throw ConfigError(fmt::format("clip_grad_value(): clip_value {} must be 0 or more", clip_value));
  if (!s.gradient_state->sync_gradients) return;
  s.unscale_gradients();
  at::NoGradGuard no_grad;
  for (const auto& p : parameters) {
    auto* owner = s.owner_of(p);
    for (const auto& holder : owner ? owner->gradient_holders({p}) : std::vector<at::Tensor>{p})
      if (holder.grad().defined()) holder.grad().clamp_(-clip_value, clip_value);
  }
  s.queue_on_disk_gradients(parameters, [clip_value](at::Tensor& g) { g.clamp_(-clip_value, clip_value); });
}

GradNorm Accelerator::clip_grad_norm(const std::vector<at::Tensor>& parameters, double max_norm, double norm_type) {
  auto norm = impl_->clip_grad_norm(parameters, max_norm, norm_type);
  // Under pp the clip spans the stage whatever is passed, so no rank may decide from `parameters` alone.
  if (impl_->gradient_state->sync_gradients && norm_type == 2.0 && max_norm > 0 && impl_->plan.clip_at_step > 0 &&
      !impl_->pipeline && !impl_->program_clip) {
    impl_->program_clip.emplace(AcceleratorImpl::ProgramClip{max_norm, {}});
    for (const auto& p : parameters) impl_->program_clip->parameters.insert(p.unsafeGetTensorImpl());
  }
  // `xlr8 verify` compares the norm the program clipped from: after clipping every clipped step reads max_norm.
  if (impl_->gradient_state->sync_gradients) impl_->notify([&](xlr8::step::StepObserver& o) { o.on_clip_grad_norm(norm); });
  return norm;
}

GradNorm AcceleratorImpl::clip_grad_norm(const std::vector<at::Tensor>& parameters, double max_norm, double norm_type) {
  if (pipeline) return clip_pipeline_grad_norm(max_norm, norm_type);
  auto& s = *this;
  if (!s.gradient_state->sync_gradients) return GradNorm();
  s.unscale_gradients();
  if (s.step_state.overflow())
    return GradNorm(at::scalar_tensor(std::numeric_limits<double>::infinity(), at::TensorOptions().dtype(at::kDouble).device(s.device)));
  if (parameters.empty()) return GradNorm();
  // The strategy of the model these parameters belong to knows which ranks hold which gradients.
  std::vector<ParallelStrategy*> owners;
  bool unowned = false;
  for (const auto& p : parameters) {
    auto* owner = s.owner_of(p);
    if (!owner) unowned = true;
    else if (std::find(owners.begin(), owners.end(), owner) == owners.end()) owners.push_back(owner);
  }
  if (owners.size() == 1 && !unowned) return owners.front()->clip_grad_norm(parameters, max_norm, norm_type);
  // Several models (or tensors of none): the local norm is the global one only when all are replicas.
  for (auto* owner : owners)
    if (!owner->replicated())
      throw Error(fmt::format("clip_grad_norm(): the parameters span several prepared models and the {} one is sharded; "
                              "clip each model's parameters in its own call",
                              owner->name()));
  return tp::clip_grad_norm(parameters, tp::SlicedParameters{}, max_norm, norm_type);
}

}  // namespace xlr8
