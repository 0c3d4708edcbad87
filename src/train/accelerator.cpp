// Accelerator: the process it runs in, preparing models, optimizers, schedulers and loaders, building a
// model for rank-0 loading, free_memory and seeds (the training step: accelerator_step.cpp).
#include "xlr8/accelerator.hpp"

#include "compat/torch_compat.hpp"
#include "core/log.hpp"
#include "os/memory.hpp"
#include "parallel/activation_checkpoint.hpp"
#include "parallel/tp_layer_kinds.hpp"
#include "parallel/wrap_policy.hpp"
#include "parallel/zero_strategy.hpp"
#include "train/accelerator_impl.hpp"
#include "train/tensor_parallel_prepare.hpp"
#include "xlr8/context_parallel.hpp"
#include "xlr8/error.hpp"
#include "xlr8/tensor_parallel.hpp"

namespace xlr8 {

// ------------------------------------------------------------------------------------------ impl helpers

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
  for (const auto& model : models)
    if (model->owns(parameter)) return model.get();
  return nullptr;
}

// ------------------------------------------------------------------------------------------ accelerator

Accelerator::Accelerator(AcceleratorOptions options) : Accelerator(std::move(options), ForEngine{}) {
  auto& s = *impl_;
  const auto& launch = s.state->settings().deepspeed;
  if (launch && !launch->config_file.empty()) {
    // The JSON decides precision and accumulation (Accelerate: DeepSpeed's value wins), its scaler and clipping.
    auto& plugin = s.deepspeed.emplace(*launch, s.precision, s.gradient_state->num_steps,
                                       s.state->mesh().group("dp").size(), s.state->is_main_process());
    s.precision = plugin.precision();
    if (plugin.gradient_accumulation_steps() > 0) s.gradient_state->num_steps = plugin.gradient_accumulation_steps();
    s.follow_deepspeed(plugin.config());
    s.clip_at_step = plugin.config().gradient_clipping;
  } else if (launch && launch->gradient_clipping) {
    s.clip_at_step = *launch->gradient_clipping;  // --gradient_clipping: DeepSpeed clips every step
  }
  // `xlr8 verify`'s third run: each of the N ranks' shares is a micro-batch, so N times as many make a step.
  if (s.verify) s.gradient_state->num_steps *= s.verify->micro_split();
}

Accelerator::Accelerator(AcceleratorOptions options, ForEngine) : impl_(std::make_unique<AcceleratorImpl>()) {
  auto& s = *impl_;
  s.state = &ProcessState::instance();
  s.options = std::move(options);
  s.device = s.options.cpu ? at::Device(at::kCPU) : at::Device(s.state->device());
  s.precision = s.options.mixed_precision.value_or(s.state->mixed_precision());
  s.gradient_state->num_steps = gradient_accumulation_steps_for(s.state->settings(), s.options.gradient_accumulation_steps,
                                                                s.state->is_main_process());
  s.gradient_state->sync_with_dataloader = s.options.sync_with_dataloader;
  if (s.precision == MixedPrecision::FP16) s.scaler.emplace();
  // Offload keeps the optimizer's side (and under stage 3 the parameter shards) in host memory.
  const auto& settings = s.state->settings();
  bool offload = (settings.fsdp && settings.fsdp->offload_params) ||
                 (settings.deepspeed && (settings.deepspeed->offload_optimizer_device != "none" ||
                                         settings.deepspeed->offload_param_device != "none"));
  if (offload) s.report_offload();
  // `xlr8 verify`: the same global batch on any number of processes, and the record of each step.
  if (const char* split = std::getenv("XLR8_SPLIT_BATCHES"); split && std::string(split) == "1") s.options.split_batches = true;
  s.verify = detail::VerifyRecorder::from_env();
  s.advise = detail::AdviseRecorder::from_env();
  // parallelism_config_cp_size / _sp_size: a model's xlr8::attention and cp::local_positions follow the group.
  if (auto context = s.sequence_context()) {
    cp::set_process_context(*context);
    s.installed_cp_context = true;
  }
}

std::optional<cp::Context> AcceleratorImpl::sequence_context() const {
  auto& mesh = state->mesh();
  if (mesh.size("sp") > 1) return cp::Context{mesh.group("sp"), cp::CommStrategy::Ulysses};
  if (mesh.size("cp") > 1)
    return cp::Context{mesh.group("cp"), cp::parse_comm_strategy(state->settings().parallelism->cp_comm_strategy)};
  return std::nullopt;
}

void AcceleratorImpl::check_sequence_length(int64_t length) const {
  const auto& p = state->settings().parallelism;
  if (!p || p->sp == 1 || p->sp_seq_length_is_variable || !p->sp_seq_length || *p->sp_seq_length == length) return;
  throw ConfigError(fmt::format("this batch's sequence is {} tokens, but parallelism_config_sp_seq_length is {} with "
                                "parallelism_config_sp_seq_length_is_variable false; pad every batch to {} tokens, or "
                                "set parallelism_config_sp_seq_length_is_variable true",
                                length, *p->sp_seq_length, *p->sp_seq_length));
}

void AcceleratorImpl::follow_deepspeed(const deepspeed::Config& config) {
  scaler.reset();
  if (precision == MixedPrecision::FP16) scaler.emplace(deepspeed::loss_scaler_options(config.fp16, config.zero_optimization.stage));
  if (config.zero_optimization.offloads()) report_offload();
}

void AcceleratorImpl::report_offload() {
  if (offload_reported || !state->is_main_process()) return;
  offload_reported = true;
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
const nlohmann::json* Accelerator::deepspeed_config() const {
  return impl_->deepspeed ? &impl_->deepspeed->config().document : nullptr;
}
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

// fsdp_activation_checkpointing: every unit of the wrap policy is recomputed in backward (after TP
// split its layers, before the sharding engine takes its parameters: torchtitan's order).
void mark_units_for_checkpointing(const torch::nn::Module& module, const ZeroOptions& zero, const FsdpSettings& fsdp) {
  int marked = 0;
  for (const auto& unit : detail::plan_units(module, zero))
    if (unit.module && unit.module != &module) {
      detail::mark_checkpointed_unit(*unit.module, unit.label, module);
      ++marked;
    }
  if (marked == 0)
    throw ConfigError(fmt::format(
        "fsdp_activation_checkpointing: true checkpoints the units of the wrap policy, and fsdp_auto_wrap_policy {} "
        "makes none in this model; set fsdp_auto_wrap_policy: TRANSFORMER_BASED_WRAP with "
        "fsdp_transformer_layer_cls_to_wrap naming its block class (or the model's xlr8::NoSplitModules declaring "
        "it), or fsdp_activation_checkpointing: false",
        fsdp.auto_wrap_policy));
  log::info("prepare(): fsdp_activation_checkpointing: {} unit(s) recompute their forward in backward", marked);
}

}  // namespace

bool Accelerator::rank0_loading() const {
  const auto& s = *impl_;
  const auto& settings = s.state->settings();
  if (s.state->world_size() == 1 || !settings.fsdp || !settings.fsdp->cpu_ram_efficient_loading) return false;
  const auto zero = detail::resolve_zero_options(s.options.parallel.zero, settings, s.state->local_world_size());
  const int dp = s.state->mesh().size("dp_cp");  // what the strategy shards over
  // Units chosen by size may be modules whose forward opens no guard: they must stay whole.
  const bool guarded_units =
      zero.auto_wrap_policy == AutoWrapPolicy::TRANSFORMER_BASED_WRAP || zero.auto_wrap_policy == AutoWrapPolicy::NO_WRAP;
  return zero.stage == 3 && guarded_units && (zero.hybrid_shard_size == 0 || zero.hybrid_shard_size == dp) &&
         dp == num_processes();
}

bool Accelerator::tp_loading() const {
  const auto& s = *impl_;
  const auto& fsdp = s.state->settings().fsdp;
  return s.state->world_size() > 1 && s.state->mesh().size("tp") > 1 && (!fsdp || fsdp->cpu_ram_efficient_loading);
}

struct Accelerator::ModelBuild {
  std::optional<EmptyInitScope> empty;                 // every rank but the main process
  std::optional<tp::detail::KeepWholeValues> wholes;   // the main process, under tensor parallelism
};

std::shared_ptr<Accelerator::ModelBuild> Accelerator::begin_model_build() {
  auto building = std::make_shared<ModelBuild>();
  const bool from_main = rank0_loading() || tp_loading();
  if (from_main && !is_main_process()) building->empty.emplace();
  if (from_main && is_main_process() && tp_loading()) building->wholes.emplace();
  return building;
}

void Accelerator::built_model(const std::shared_ptr<torch::nn::Module>& module, ModelBuild& building) {
  building.empty.reset();
  if (!module) throw Error("build_model(): the model is null");
  auto& s = *impl_;
  if (tp_loading()) {
    // The main process keeps every whole value (those a plan sliced inside build() included) until
    // prepare() has sent them; the others stay on the meta device until the plan has sliced them.
    AcceleratorImpl::BuiltForTp built{module, {}};
    if (building.wholes) {
      for (const auto& item : module->named_parameters()) built.wholes[item.key()] = building.wholes->whole_of(item.value());
      for (const auto& item : module->named_buffers()) built.wholes[item.key()] = building.wholes->whole_of(item.value());
    }
    building.wholes.reset();
    s.built_for_tp_loading.push_back(std::move(built));
  } else if (rank0_loading()) {
    if (!is_main_process()) to_empty(*module, s.device);  // untouched memory; prepare() fills its shards
    s.built_for_rank0_loading.push_back(module);
  } else {
    return;
  }
  // The main process's initialisers drew random numbers, the others' did not: every rank continues
  // from the main process's generator, as when every rank builds the model.
  auto generator = at::detail::getDefaultCPUGenerator();
  std::lock_guard<std::mutex> lock(generator.mutex());
  auto state = generator.get_state();
  s.world().broadcast(state, 0);
  if (!is_main_process()) generator.set_state(state);
}

void Accelerator::register_model(std::shared_ptr<torch::nn::Module> module) {
  auto& s = *impl_;
  if (!module) throw Error("prepare(): the model is null");
  if (s.strategy_for(module.get())) throw Error("prepare(): this model was already prepared; prepare each model once");
  // AcceleratorOptions::tp_head_dim, else the launch's parallelism_config_tp_head_dim (0: unchecked).
  const auto& launch = s.state->settings().parallelism;
  const int64_t head_dim = s.options.tp_head_dim.value_or(launch ? launch->tp_head_dim.value_or(0) : 0);
  detail::split_for_tensor_parallel(*module, s.state->mesh(), s.options.tp_sequence_parallel, head_dim);
  auto& tp_built = s.built_for_tp_loading;
  std::erase_if(tp_built, [](const auto& b) { return b.module.expired(); });
  auto tp_it = std::find_if(tp_built.begin(), tp_built.end(), [&](const auto& b) { return b.module.lock() == module; });
  if (tp_it != tp_built.end()) {
    auto wholes = std::move(tp_it->wholes);
    tp_built.erase(tp_it);
    tp::detail::take_whole_values_from_main(*module, s.world(), wholes, s.device);
  }
  module->to(s.device);
  auto& built = s.built_for_rank0_loading;
  std::erase_if(built, [](const auto& weak) { return weak.expired(); });
  auto it = std::find_if(built.begin(), built.end(), [&](const auto& weak) { return weak.lock() == module; });
  const bool values_from_rank0 = it != built.end();  // the other ranks hold no values until the strategy sends them
  if (values_from_rank0) built.erase(it);
  if (s.verify) s.verify->on_prepare(s, *module, /*compare_across_ranks=*/!values_from_rank0);
  if (s.advise) s.advise->on_prepare(s, *module);
  auto parallel = s.options.parallel;
  const auto& settings = s.state->settings();
  if (settings.fsdp && settings.fsdp->activation_checkpointing)
    mark_units_for_checkpointing(
        *module, detail::resolve_zero_options(parallel.zero, settings, s.state->local_world_size()), *settings.fsdp);
  if (!parallel.zero.param_dtype) parallel.zero.param_dtype = sharded_param_dtype(s.precision, s.device);
  if (s.deepspeed) s.deepspeed->configure_model(*module, parallel, s.options.model_hidden_size);
  if (values_from_rank0) parallel.zero.values_from_rank0 = true;
  s.models.push_back(make_parallel_strategy(std::move(module), *s.state, parallel, s.gradient_state));
  auto* strategy = s.models.back().get();
  for (const auto& o : s.optimizers) strategy->bind_optimizer(*o->optimizer);  // prepared before the model
}

PreparedOptimizer Accelerator::prepare_optimizer(std::shared_ptr<torch::optim::Optimizer> optimizer) {
  auto& s = *impl_;
  if (!optimizer) throw Error("prepare(): the optimizer is null");
  for (const auto& o : s.optimizers)
    if (o->optimizer == optimizer) throw Error("prepare(): this optimizer was already prepared; prepare it once");
  if (s.deepspeed) optimizer = s.deepspeed->optimizer_for(std::move(optimizer));  // a DummyOptim: the JSON's
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
    s.deepspeed->loader_prepared(s.options.split_batches ? o.batch_size / shares : o.batch_size);
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
