// Accelerator: the process it runs in, preparing models, optimizers, schedulers and loaders, free_memory and
// seeds (building a model: accelerator_build.cpp; the training step: accelerator_step.cpp).
#include "xlr8/accelerator.hpp"

#include <ATen/Context.h>

#include "compat/torch_compat.hpp"
#include "config/fp8_config.hpp"
#include "core/log.hpp"
#include "os/memory.hpp"
#include "parallel/parallelize.hpp"
#include "parallel/shard/zero_strategy.hpp"
#include "accelerate/accelerator_impl.hpp"
#include "accelerate/parallel_plan.hpp"
#include "xlr8/context_parallel.hpp"
#include "xlr8/deferred_init.hpp"
#include "xlr8/error.hpp"
#include "xlr8/tensor_parallel.hpp"

namespace xlr8 {

// ------------------------------------------------------------------------------------------ impl helpers

ParallelStrategy* AcceleratorImpl::strategy_for(const torch::nn::Module* module) const {
  for (const auto& m : models)
    if (m->module().get() == module) return m.get();
  // Under pp the program holds the whole model; the strategy holds this rank's stage of it.
  if (pipeline && pipelined_model.get() == module) return models.front().get();
  return nullptr;
}

std::vector<ParallelStrategy*> AcceleratorImpl::strategies_of(const std::vector<torch::nn::Module*>& modules) const {
  std::vector<ParallelStrategy*> out;
  if (modules.empty()) {
    for (const auto& m : models) out.push_back(m.get());
    return out;
  }
  for (auto* module : modules) {
    auto* strategy = strategy_for(module);
    if (!strategy) throw Error("this model was not passed to Accelerator::prepare(); prepare it first");
    out.push_back(strategy);
  }
  return out;
}

ParallelStrategy* AcceleratorImpl::owner_of(const at::Tensor& parameter) const {
  for (const auto& model : models)
    if (model->owns(parameter)) return model.get();
  return nullptr;
}

// ------------------------------------------------------------------------------------------ accelerator

Accelerator::Accelerator(AcceleratorOptions options) : impl_(std::make_unique<AcceleratorImpl>()) {
  impl_->start(std::move(options), nullptr);
}

Accelerator::Accelerator(const deepspeed::Config& config, AcceleratorOptions options)
    : impl_(std::make_unique<AcceleratorImpl>()) {
  impl_->start(std::move(options), &config);
}

void AcceleratorImpl::start(AcceleratorOptions given, const deepspeed::Config* engine_config) {
  auto& s = *this;
  s.state = &ProcessState::instance();
  s.options = std::move(given);
  s.device = s.options.cpu ? at::Device(at::kCPU) : at::Device(s.state->device());
  const auto& settings = s.state->settings();
  const auto env = Env::current();
  // `xlr8 verify`: the same global batch on any number of processes, and the record of each step.
  s.verify = diagnostics::VerifyRecorder::from_env();
  s.advise = diagnostics::AdviseRecorder::from_env();
  for (auto* observer : std::initializer_list<xlr8::step::StepObserver*>{s.verify.get(), s.advise.get()})
    if (observer) s.observers.push_back(observer);
  accelerate::PlanInputs in{.state = s.state, .options = &s.options, .device = s.device};
  in.precision = s.options.mixed_precision.value_or(s.state->mixed_precision());
  if (s.options.fp8) {
    if (in.precision != MixedPrecision::FP8)  // Accelerate's rule for a recipe handler
      throw ConfigError(fmt::format("AcceleratorOptions::fp8 needs mixed_precision fp8, not {}", to_string(in.precision)));
    config::check_fp8(*s.options.fp8, "AcceleratorOptions::fp8");
  }
  in.accumulation = gradient_accumulation_steps_for(settings, s.options.gradient_accumulation_steps, s.state->is_main_process());
  const auto& launch = settings.deepspeed;
  if (engine_config) {
    in.deepspeed = engine_config;
    in.from_engine = true;
  } else if (launch && !launch->config_file.empty()) {
    // The JSON decides precision and accumulation (Accelerate: DeepSpeed's value wins), its scaler and clipping.
    in.deepspeed = &s.deepspeed.emplace(*launch, in.precision, in.accumulation, s.state->mesh().size(MeshDim::dp),
                                        s.state->is_main_process()).config();
  }
  // `xlr8 verify`'s third run: each of the N ranks' shares is a micro-batch, so N times as many make a step.
  if (s.verify) in.micro_batches_per_rank = s.verify->micro_split();
  s.plan = accelerate::resolve_plan(in, env);
  if (s.state->is_main_process()) log::debug("xlr8: the Accelerator's plan:\n{}", s.plan.describe());
  if (s.plan.allow_tf32) {  // process-wide, as torch.backends.cuda.matmul.allow_tf32; cuDNN's is on by default
    at::globalContext().setAllowTF32CuBLAS(*s.plan.allow_tf32);
    if (*s.plan.allow_tf32) at::globalContext().setAllowTF32CuDNN(true);
  }
  s.gradient_state->num_steps = s.plan.gradient_accumulation_steps;
  s.gradient_state->sync_with_dataloader = s.options.sync_with_dataloader;
  if (s.plan.loss_scaler) s.scaler.emplace(*s.plan.loss_scaler);
  // Offload keeps the optimizer's side (and under stage 3 the parameter shards) in host memory.
  const bool offload = (settings.fsdp && settings.fsdp->offload_params) ||
                       (launch && (launch->offload_optimizer_device != "none" || launch->offload_param_device != "none")) ||
                       (in.deepspeed && in.deepspeed->zero_optimization.offloads());
  if (offload) s.report_offload();
  // parallelism_config_cp_size / _sp_size: a model's xlr8::attention and cp::local_positions follow the group.
  if (auto context = s.sequence_context()) {
    cp::set_process_context(*context);
    s.installed_cp_context = true;
  }
}

std::optional<cp::Context> AcceleratorImpl::sequence_context() const {
  auto& mesh = state->mesh();
  if (plan.sequence.comm_strategy.empty()) return std::nullopt;
  if (plan.mesh.sp > 1) return cp::Context{mesh.group(MeshDim::sp), cp::CommStrategy::Ulysses};
  return cp::Context{mesh.group(MeshDim::cp), cp::parse_comm_strategy(plan.sequence.comm_strategy)};
}

void AcceleratorImpl::check_sequence_length(int64_t length) const {
  const auto& fixed = plan.sequence.fixed_length;
  if (!fixed || *fixed == length) return;
  throw ConfigError(fmt::format("this batch's sequence is {} tokens, but parallelism_config_sp_seq_length is {} with "
                                "parallelism_config_sp_seq_length_is_variable false; pad every batch to {} tokens, or "
                                "set parallelism_config_sp_seq_length_is_variable true",
                                length, *fixed, *fixed));
}

void AcceleratorImpl::report_offload() {
  if (offload_reported || !state->is_main_process()) return;
  offload_reported = true;
  if (const auto& disk = plan.data_parallel.zero.optimizer_on_disk; disk.enabled())
    log::info("xlr8: offload: the optimizer's state lives in swap files under {} between steps and comes into memory "
              "one parameter group at a time to step (parallel_stats: optimizer_on_disk)",
              disk.path);
  if (const auto& disk = plan.data_parallel.zero.params_on_disk; disk.enabled())
    log::info("xlr8: offload: the parameter shards live in swap files under {}, read for each gather and step "
              "(parallel_stats: parameters_on_disk)",
              disk.path);
  if (device.is_cpu() && plan.data_parallel.zero.optimizer_on_disk.enabled()) return;
  if (device.is_cpu())
    log::info("xlr8: offload requested: shards, gradients and optimizer state stay on the training device, which on a "
              "CPU-only run is host memory already, so nothing moves");
  else
    log::info("xlr8: offload: the optimizer's fp32 shards, their gradients and its state live in host memory and it "
              "steps on the CPU; under ZeRO stage 3 with offload_param / fsdp_offload_params the parameter shards "
              "too, copied to {} for each gather (parallel_stats: offloaded_*_groups, offload_host_bytes)",
              device.str());
}

Accelerator::~Accelerator() {
  if (impl_ && impl_->installed_cp_context) cp::set_process_context(std::nullopt);
}

const ProcessState& Accelerator::state() const { return *impl_->state; }
const ParallelPlan& Accelerator::plan() const { return impl_->plan; }
int Accelerator::num_processes() const { return impl_->state->world_size(); }
int Accelerator::process_index() const { return impl_->state->rank(); }
int Accelerator::local_process_index() const { return impl_->state->local_rank(); }
bool Accelerator::is_main_process() const { return impl_->state->is_main_process(); }
bool Accelerator::is_local_main_process() const { return impl_->state->is_local_main_process(); }
at::Device Accelerator::device() const { return impl_->device; }
MixedPrecision Accelerator::mixed_precision() const { return impl_->plan.mixed_precision; }
int Accelerator::gradient_accumulation_steps() const { return impl_->gradient_state->num_steps; }
bool Accelerator::sync_gradients() const { return impl_->gradient_state->sync_gradients; }
bool Accelerator::end_of_dataloader() const { return impl_->gradient_state->end_of_dataloader(); }
const nlohmann::json* Accelerator::deepspeed_config() const {
  return impl_->deepspeed ? &impl_->deepspeed->config().document : nullptr;
}
const ParallelStrategy& Accelerator::strategy_of(const torch::nn::Module& module) const {
  if (auto* strategy = impl_->strategy_for(&module)) return *strategy;
  throw Error(
      "parallel_stats() / get_state_dict(): this model was not passed to Accelerator::prepare(); prepare it first");
}

ParallelStrategy& Accelerator::strategy_for_scope(const torch::nn::Module& module) {
  if (auto* strategy = impl_->strategy_for(&module)) return *strategy;
  throw Error("summon_full_params(): this model was not passed to Accelerator::prepare(); prepare it first");
}

FullParametersScope::FullParametersScope(ParallelStrategy* strategy, bool writeback)
    : strategy_(strategy), writeback_(writeback) {
  strategy_->gather_full_parameters();
}

FullParametersScope::FullParametersScope(FullParametersScope&& other) noexcept
    : strategy_(std::exchange(other.strategy_, nullptr)), writeback_(other.writeback_) {}

FullParametersScope::~FullParametersScope() {
  if (strategy_) strategy_->release_full_parameters(writeback_);
}

double Accelerator::loss_scale() const { return impl_->scaler ? impl_->scaler->scale() : 1.0; }
int64_t Accelerator::step() const { return impl_->optimizers.empty() ? 0 : impl_->optimizers.front()->steps; }

void Accelerator::register_model(std::shared_ptr<torch::nn::Module> module) {
  auto& s = *impl_;
  if (!module) throw Error("prepare(): the model is null");
  if (s.strategy_for(module.get())) throw Error("prepare(): this model was already prepared; prepare each model once");
  bool values_from_rank0 = false;
  parallel::ParallelizeHooks hooks;
  hooks.device = s.device;
  hooks.after_tensor_parallel = [&](torch::nn::Module&) {
    values_from_rank0 = s.complete_values(module);
    const auto training = s.view();
    const bool everywhere = !values_from_rank0 && !has_deferred(*module);  // one process recorded its build
    s.notify([&](xlr8::step::StepObserver& o) { o.on_prepare(training, *module, everywhere); });
  };
  hooks.data_parallel_options = [&](torch::nn::Module& model, ParallelOptions& parallel) {
    if (s.deepspeed) s.deepspeed->configure_model(model, parallel, s.options.model_hidden_size);
    if (values_from_rank0) parallel.zero.values_from_rank0 = true;
  };
  hooks.gradient_state = s.gradient_state;
  pp::StageLayers cut;
  hooks.stage_cut = [&](const pp::StageLayers& made) { cut = made; };
  if (s.plan.mesh.pp > 1) s.check_pipeline();  // before anything is prepared
  s.models.push_back(parallel::parallelize(module, s.plan, s.state->mesh(), hooks));
  auto* strategy = s.models.back().get();
  if (s.plan.mesh.pp > 1) s.start_pipeline(module, cut);
  for (const auto& o : s.optimizers) {  // prepared before the model
    s.keep_stage_parameters(*o->optimizer);
    strategy->bind_optimizer(*o->optimizer);
  }
}

PreparedOptimizer Accelerator::prepare_optimizer(std::shared_ptr<torch::optim::Optimizer> optimizer) {
  auto& s = *impl_;
  if (!optimizer) throw Error("prepare(): the optimizer is null");
  for (const auto& o : s.optimizers)
    if (o->optimizer == optimizer) throw Error("prepare(): this optimizer was already prepared; prepare it once");
  if (s.deepspeed) optimizer = s.deepspeed->optimizer_for(std::move(optimizer));  // a DummyOptim: the JSON's
  s.keep_stage_parameters(*optimizer);
  // A sharded model's optimizer works on this rank's shards of the parameters it was given.
  for (const auto& model : s.models) model->bind_optimizer(*optimizer);
  auto state = std::make_shared<PreparedOptimizer::State>();
  state->optimizer = std::move(optimizer);
  state->impl = impl_.get();
  s.optimizers.push_back(state);
  return PreparedOptimizer(state);
}

PreparedScheduler Accelerator::prepare_scheduler(std::shared_ptr<torch::optim::LRScheduler> scheduler) {
  if (!scheduler) throw Error("prepare(): the scheduler is null");
  if (impl_->deepspeed) scheduler = impl_->deepspeed->scheduler_for(std::move(scheduler));  // a DummyScheduler: the JSON's
  auto state = std::make_shared<PreparedScheduler::State>();
  state->scheduler = std::move(scheduler);
  state->impl = impl_.get();
  impl_->schedulers.push_back(state);
  return PreparedScheduler(state);
}

void Accelerator::register_loader(std::shared_ptr<DataLoaderBase> loader) {
  auto& s = *impl_;
  if (s.deepspeed) {
    const auto& o = loader->options();
    // Under split_batches a micro-batch is one rank's share (in verify's run 3, this process stands for several ranks).
    const int shares = std::max(1, loader->sharding().num_processes * loader->sharding().micro_batches);
    s.deepspeed->loader_prepared(s.plan.split_batches ? o.batch_size / shares : o.batch_size);
  }
  s.loaders.push_back(loader);
}

void Accelerator::free_memory() {
  auto& s = *impl_;
  if (s.open_scopes > 0)
    throw Error("free_memory() was called inside accumulate() or no_sync(): call it once the step's scope has ended");
  at::NoGradGuard no_grad;
  for (auto& strategy : s.models) {
    const auto named = strategy->module()->named_parameters();
    for (auto& item : named) item.value().mutable_grad() = at::Tensor();
    if (strategy->replicated()) continue;  // the parameters are the module's own, whole tensors already
    // Whole fp32 values on every rank first (collective), then the module's own tensors take copies of
    // them, so that nothing still points into the strategy's flat buffers when it goes.
    auto whole = strategy->state_dict(StateDictKind::FULL);
    std::unordered_map<std::string, at::Tensor> by_name(whole.begin(), whole.end());
    for (auto& item : named) {
      auto found = by_name.find(item.key());
      if (found == by_name.end())
        throw Error(fmt::format("free_memory(): the {} strategy gave no value for parameter {}", strategy->name(),
                                item.key()));
      item.value().set_data(found->second.detach().clone(at::MemoryFormat::Contiguous));
    }
  }
  for (auto& o : s.optimizers) o->impl = nullptr;
  for (auto& sc : s.schedulers) sc->impl = nullptr;
  s.models.clear();  // the strategies: hooks detached, buckets and shards freed
  s.optimizers.clear();
  s.schedulers.clear();
  s.loaders.clear();
  s.custom.clear();  // registered by reference for the training that ends here
  s.gradient_state->sync_gradients = true;  // the same object: loaders and the accumulation setting keep it
  s.micro_step = 0;
  s.last_step_applied = false;
  s.enter(xlr8::step::StepPhase::idle, "free_memory()");
  compat::empty_device_cache();
  os::return_free_memory_to_system();
}

ShardingOptions Accelerator::sharding() const {
  ShardingOptions o;
  // Ranks of one data-parallel index (tensor or context parallel peers) read the same batches.
  auto& mesh = impl_->state->mesh();
  o.num_processes = mesh.size(MeshDim::dp);
  o.process_index = mesh.rank(MeshDim::dp);
  o.split_batches = impl_->plan.split_batches;
  o.even_batches = impl_->options.even_batches;
  o.micro_batches = impl_->verify ? impl_->verify->micro_split() : 1;
  return o;
}

uint64_t Accelerator::seed() const { return impl_->seed; }
std::shared_ptr<GradientState> Accelerator::gradient_state() const { return impl_->gradient_state; }

void Accelerator::set_seed(uint64_t seed, bool device_specific) {
  impl_->seed = seed;
  uint64_t s = seed + (device_specific ? static_cast<uint64_t>(process_index()) : 0);
  {
    auto gen = at::detail::getDefaultCPUGenerator();
    std::lock_guard<std::mutex> lock(gen.mutex());
    gen.set_current_seed(s);
  }
  if (compat::cuda_device_count() > 0) {
    auto cuda = at::globalContext().defaultGenerator(at::kCUDA);
    cuda.set_current_seed(s);
  }
  std::srand(static_cast<unsigned>(s));
}

}  // namespace xlr8
