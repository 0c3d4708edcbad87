#include "xlr8/accelerator.hpp"

#include <torch/nn/utils/clip_grad.h>

#include <ctime>
#include <filesystem>
#include <fstream>
#include <limits>

#include "compat/torch_compat.hpp"
#include "core/log.hpp"
#include "os/memory.hpp"
#include "parallel/zero_strategy.hpp"
#include "train/accelerator_impl.hpp"
#include "xlr8/error.hpp"

namespace xlr8 {

// ------------------------------------------------------------------------------------------ impl helpers

std::vector<at::Tensor> AcceleratorImpl::optimized_parameters() const {
  std::vector<at::Tensor> params;
  for (const auto& o : optimizers)
    for (const auto& group : o->optimizer->param_groups())
      for (const auto& p : group.params()) params.push_back(p);
  return params;
}

void AcceleratorImpl::unscale_gradients() {
  if (!scaler || unscaled) return;
  const double inverse = 1.0 / scaler->scale();
  at::NoGradGuard no_grad;
  std::vector<at::Tensor> finite;  // one flag per gradient, read back once (one device sync, not one per tensor)
  for (auto& p : optimized_parameters()) {
    auto& g = p.mutable_grad();
    if (!g.defined()) continue;
    g.mul_(inverse);
    finite.push_back(at::isfinite(g).all());
  }
  bool found = !finite.empty() && !at::stack(finite).all().item<bool>();
  // Every rank must skip the same step: MAX of the overflow flag over the world.
  auto flag = at::full({1}, found ? 1 : 0, at::kInt);
  world().all_reduce(flag, ReduceOp::MAX);
  overflow = flag.item<int>() != 0;
  scaler->update(overflow);
  unscaled = true;
}

ParallelStrategy* AcceleratorImpl::strategy_for(const torch::nn::Module* module) const {
  for (const auto& m : models)
    if (m->module().get() == module) return m.get();
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
  auto it = owners.find(parameter.unsafeGetTensorImpl());
  return it == owners.end() ? nullptr : it->second;
}

// ------------------------------------------------------------------------------------------ optimizer, scheduler

namespace {
void check_not_freed(const AcceleratorImpl* impl, const char* what) {
  if (!impl)
    throw Error(fmt::format("{}.step(): Accelerator::free_memory() released it; prepare the {} again", what, what));
}
}  // namespace

void PreparedOptimizer::step() {
  auto& s = *state_;
  check_not_freed(s.impl, "optimizer");
  auto& impl = *s.impl;
  if (!impl.gradient_state->sync_gradients) return;
  impl.unscale_gradients();
  if (impl.scaler && impl.overflow) {
    s.skipped = true;
    impl.last_step_applied = false;
    if (impl.state->is_main_process())
      log::info("xlr8: fp16 gradient overflow: skipped optimizer step; loss scale is now {}", impl.scaler->scale());
    return;
  }
  // The strategy of the model it optimizes steps it (sharded strategies step their shards, then gather).
  const auto& groups = s.optimizer->param_groups();
  auto* owner = groups.empty() || groups.front().params().empty() ? nullptr : impl.owner_of(groups.front().params().front());
  if (owner) owner->optimizer_step(*s.optimizer);
  else s.optimizer->step();
  s.skipped = false;
  s.steps += 1;
  impl.last_step_applied = true;
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

// ------------------------------------------------------------------------------------------ accelerator

Accelerator::Accelerator(AcceleratorOptions options) : impl_(std::make_unique<AcceleratorImpl>()) {
  auto& s = *impl_;
  s.state = &ProcessState::instance();
  s.options = std::move(options);
  s.device = s.options.cpu ? at::Device(at::kCPU) : at::Device(s.state->device());
  s.precision = s.options.mixed_precision.value_or(s.state->mixed_precision());
  s.gradient_state->num_steps = gradient_accumulation_steps_for(s.state->settings(), s.options.gradient_accumulation_steps,
                                                                s.state->is_main_process());
  s.gradient_state->sync_with_dataloader = s.options.sync_with_dataloader;
  if (s.precision == MixedPrecision::FP16) s.scaler.emplace();
  // Offload moves shards to host memory on CUDA machines; this build keeps them on the training device.
  const auto& settings = s.state->settings();
  bool offload = (settings.fsdp && settings.fsdp->offload_params) ||
                 (settings.deepspeed && (settings.deepspeed->offload_optimizer_device != "none" ||
                                         settings.deepspeed->offload_param_device != "none"));
  if (offload && s.state->is_main_process())
    log::info("xlr8: offload requested: shards, gradients and optimizer state stay on the training device ({}); on a "
              "CPU-only machine that is host memory already, so nothing moves",
              s.device.str());
}

Accelerator::~Accelerator() = default;

const ProcessState& Accelerator::state() const { return *impl_->state; }
int Accelerator::num_processes() const { return impl_->state->world_size(); }
int Accelerator::process_index() const { return impl_->state->rank(); }
int Accelerator::local_process_index() const { return impl_->state->local_rank(); }
bool Accelerator::is_main_process() const { return impl_->state->is_main_process(); }
bool Accelerator::is_local_main_process() const { return impl_->state->is_local_main_process(); }
at::Device Accelerator::device() const { return impl_->device; }
MixedPrecision Accelerator::mixed_precision() const { return impl_->precision; }
int Accelerator::gradient_accumulation_steps() const { return impl_->gradient_state->num_steps; }
bool Accelerator::sync_gradients() const { return impl_->gradient_state->sync_gradients; }
bool Accelerator::end_of_dataloader() const { return impl_->gradient_state->end_of_dataloader(); }
const ParallelStrategy& Accelerator::strategy_of(const torch::nn::Module& module) const {
  if (auto* strategy = impl_->strategy_for(&module)) return *strategy;
  throw Error("parallel_stats(): this model was not passed to Accelerator::prepare(); prepare it first");
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

namespace {

// The dtype sharded strategies gather and compute parameters in (FSDP's MixedPrecision param_dtype).
// On CUDA, the mixed-precision dtype. On CPU, none: CPUs without native bf16 run LayerNorm, GELU and
// softmax on bf16 tensors slower than on fp32 ones, so parameters stay fp32 under autocast as with DDP
// (measured on the GPT example, 2 ranks: bf16 parameters gave 0.82-0.84x DDP's tokens/s). The
// XLR8_SHARDED_PARAM_DTYPE variable (auto | bf16 | fp16 | fp32) overrides it.
std::optional<at::ScalarType> sharded_param_dtype(MixedPrecision precision, const at::Device& device) {
  const auto asked = Env::current().get("XLR8_SHARDED_PARAM_DTYPE").value_or("auto");
  if (asked == "bf16") return at::kBFloat16;
  if (asked == "fp16") return at::kHalf;
  if (asked == "fp32") return std::nullopt;
  if (asked != "auto")
    throw ConfigError(fmt::format("XLR8_SHARDED_PARAM_DTYPE={:?}: allowed values are auto, bf16, fp16 and fp32", asked));
  if (!device.is_cuda() || precision == MixedPrecision::NO) return std::nullopt;
  return precision == MixedPrecision::FP16 ? at::kHalf : at::kBFloat16;
}

}  // namespace

bool Accelerator::rank0_loading() const {
  const auto& s = *impl_;
  const auto& settings = s.state->settings();
  if (s.state->world_size() == 1 || !settings.fsdp || !settings.fsdp->cpu_ram_efficient_loading) return false;
  const auto zero = detail::resolve_zero_options(s.options.parallel.zero, settings, s.state->local_world_size());
  const int dp = s.state->mesh().group("dp").size();
  // Units chosen by size are often LibTorch's own modules, which open no guard: they must stay whole.
  const bool guarded_units = zero.auto_wrap_policy == "TRANSFORMER_BASED_WRAP" || zero.auto_wrap_policy == "NO_WRAP";
  return zero.stage == 3 && guarded_units && (zero.hybrid_shard_size == 0 || zero.hybrid_shard_size == dp) &&
         dp == num_processes();
}

bool Accelerator::builds_empty() const { return !is_main_process() && rank0_loading(); }

void Accelerator::built_model(const std::shared_ptr<torch::nn::Module>& module) {
  if (!module) throw Error("build_model(): the model is null");
  if (!rank0_loading()) return;
  auto& s = *impl_;
  if (!is_main_process()) to_empty(*module, s.device);  // untouched memory; prepare() fills its shards
  // The main process's initialisers drew random numbers, the others' did not: every rank continues
  // from the main process's generator, as when every rank builds the model.
  auto generator = at::detail::getDefaultCPUGenerator();
  std::lock_guard<std::mutex> lock(generator.mutex());
  auto state = generator.get_state();
  s.world().broadcast(state, 0);
  if (!is_main_process()) generator.set_state(state);
  s.built_for_rank0_loading.push_back(module);
}

void Accelerator::register_model(std::shared_ptr<torch::nn::Module> module) {
  auto& s = *impl_;
  if (!module) throw Error("prepare(): the model is null");
  if (s.strategy_for(module.get())) throw Error("prepare(): this model was already prepared; prepare each model once");
  module->to(s.device);
  auto parallel = s.options.parallel;
  if (!parallel.zero.param_dtype) parallel.zero.param_dtype = sharded_param_dtype(s.precision, s.device);
  auto& built = s.built_for_rank0_loading;
  std::erase_if(built, [](const auto& weak) { return weak.expired(); });
  auto it = std::find_if(built.begin(), built.end(), [&](const auto& weak) { return weak.lock() == module; });
  if (it != built.end()) {
    parallel.zero.values_from_rank0 = true;
    built.erase(it);
  }
  s.models.push_back(make_parallel_strategy(std::move(module), *s.state, parallel, s.gradient_state));
  // What users pass to optimizers and clip_grad_norm (the module's parameters) and what a sharded
  // strategy optimizes (its shards) both lead to the strategy.
  auto* strategy = s.models.back().get();
  for (const auto& p : strategy->module()->parameters()) s.owners[p.unsafeGetTensorImpl()] = strategy;
  for (const auto& p : strategy->optimizer_parameters()) s.owners[p.unsafeGetTensorImpl()] = strategy;
  for (const auto& o : s.optimizers) strategy->bind_optimizer(*o->optimizer);  // prepared before the model
}

PreparedOptimizer Accelerator::prepare_optimizer(std::shared_ptr<torch::optim::Optimizer> optimizer) {
  auto& s = *impl_;
  if (!optimizer) throw Error("prepare(): the optimizer is null");
  for (const auto& o : s.optimizers)
    if (o->optimizer == optimizer) throw Error("prepare(): this optimizer was already prepared; prepare it once");
  // A sharded model's optimizer works on this rank's shards of the parameters it was given.
  for (const auto& model : s.models) model->bind_optimizer(*optimizer);
  auto state = std::make_shared<PreparedOptimizer::State>();
  state->optimizer = std::move(optimizer);
  state->impl = impl_.get();
  s.optimizers.push_back(state);
  return PreparedOptimizer(state);
}

PreparedScheduler Accelerator::prepare_scheduler(std::shared_ptr<torch::optim::LRScheduler> scheduler) {
  auto state = std::make_shared<PreparedScheduler::State>();
  state->scheduler = std::move(scheduler);
  state->impl = impl_.get();
  impl_->schedulers.push_back(state);
  return PreparedScheduler(state);
}

void Accelerator::register_loader(std::shared_ptr<DataLoaderBase> loader) { impl_->loaders.push_back(loader); }

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
  s.owners.clear();
  s.optimizers.clear();
  s.schedulers.clear();
  s.loaders.clear();
  s.custom.clear();  // registered by reference for the training that ends here
  s.gradient_state->sync_gradients = true;  // the same object: loaders and the accumulation setting keep it
  s.micro_step = 0;
  s.unscaled = s.overflow = s.last_step_applied = false;
  compat::empty_device_cache();
  detail::return_free_memory_to_system();
}

ShardingOptions Accelerator::sharding() const {
  ShardingOptions o;
  // Ranks of one data-parallel index (tensor or context parallel peers) read the same batches.
  auto& mesh = impl_->state->mesh();
  o.num_processes = mesh.size("dp");
  o.process_index = mesh.rank("dp");
  o.split_batches = impl_->options.split_batches;
  o.even_batches = impl_->options.even_batches;
  return o;
}

uint64_t Accelerator::seed() const { return impl_->seed; }
std::shared_ptr<GradientState> Accelerator::gradient_state() const { return impl_->gradient_state; }

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
  bool enabled = impl_->precision == MixedPrecision::BF16 ||
                 (impl_->precision == MixedPrecision::FP16 && type == c10::DeviceType::CUDA);
  auto dtype = impl_->precision == MixedPrecision::FP16 ? at::kHalf : at::kBFloat16;
  return enabled ? AutocastScope(type, dtype) : AutocastScope();
}

void Accelerator::backward(const at::Tensor& loss, bool retain_graph) {
  auto& s = *impl_;
  if (!loss.defined()) throw Error("backward(): the loss tensor is undefined");
  at::Tensor scaled = loss / s.gradient_state->num_steps;
  if (s.scaler) scaled = scaled * s.scaler->scale();
  s.unscaled = false;
  s.overflow = false;
  AutocastPause outside_autocast;
  scaled.backward({}, retain_graph);
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
}

double Accelerator::clip_grad_norm(const std::vector<at::Tensor>& parameters, double max_norm, double norm_type) {
  auto& s = *impl_;
  if (!s.gradient_state->sync_gradients) return 0.0;
  s.unscale_gradients();
  if (s.scaler && s.overflow) return std::numeric_limits<double>::infinity();
  if (parameters.empty()) return 0.0;
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
  return torch::nn::utils::clip_grad_norm_(parameters, max_norm, norm_type);
}

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

void Accelerator::init_trackers(const std::string& project_name, const nlohmann::json& config,
                                const std::string& run_name) {
  if (!is_main_process()) return;
  auto& s = *impl_;
  if (project_name.empty() || project_name.find('/') != std::string::npos)
    throw ConfigError(fmt::format("init_trackers: project_name {:?} must be a non-empty name without '/'", project_name));
  for (auto& t : s.trackers) t->finish();
  s.trackers.clear();
  auto names = s.options.log_with;
  if (names.empty()) {
    const char* env = std::getenv("XLR8_LOG_WITH");
    names = env && *env ? parse_log_with(env) : std::vector<std::string>{"jsonl"};
  }
  const auto project = std::filesystem::path(s.options.project_dir) / project_name;
  std::string run = run_name;
  if (run.empty()) {  // the local time, made unique
    const auto now = std::time(nullptr);
    std::tm local{};
    localtime_r(&now, &local);
    char stamp[32];
    std::strftime(stamp, sizeof(stamp), "%Y%m%d-%H%M%S", &local);
    run = stamp;
    for (int k = 2; std::filesystem::exists(project / run); ++k) run = fmt::format("{}-{}", stamp, k);
  } else if (std::filesystem::exists(project / run)) {
    throw ConfigError(fmt::format("init_trackers: run {:?} of project {:?} exists already ({}); give another run_name",
                                  run, project_name, (project / run).string()));
  }
  const auto dir = project / run;
  std::filesystem::create_directories(dir);
  nlohmann::json stored{{"project_name", project_name},
                        {"run_name", run},
                        {"log_with", names},
                        {"num_processes", num_processes()},
                        {"mixed_precision", to_string(s.precision)},
                        {"config", config}};
  std::ofstream((dir / "config.json").string()) << stored.dump(2) << "\n";
  for (const auto& name : names) {
    s.trackers.push_back(make_tracker(name, dir.string()));
    s.trackers.back()->store_init_configuration(config);
  }
  s.run_dir = dir.string();
}

void Accelerator::log(const nlohmann::json& values, std::optional<int64_t> step) {
  if (!is_main_process()) return;
  auto& s = *impl_;
  if (s.run_dir.empty()) init_trackers("xlr8");
  for (auto& t : s.trackers) t->log(values, step);
}

Tracker* Accelerator::get_tracker(const std::string& name) {
  if (!is_main_process()) return nullptr;
  for (auto& t : impl_->trackers)
    if (t->name() == name) return t.get();
  throw Error(fmt::format("get_tracker({:?}): no such tracker is logging{}", name,
                          impl_->run_dir.empty() ? " (call init_trackers first)" : ""));
}

std::string Accelerator::run_dir() const { return impl_->run_dir; }

void Accelerator::end_training() {
  for (auto& t : impl_->trackers) t->finish();
  impl_->trackers.clear();
  impl_->run_dir.clear();
  wait_for_everyone();
}

}  // namespace xlr8
