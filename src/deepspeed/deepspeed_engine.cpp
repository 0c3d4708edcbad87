// xlr8::deepspeed::Engine: DeepSpeed's training-loop API as an Accelerator configured from the JSON, with
// DeepSpeed's micro-step counting, boundary, clipping, loss scaling and step counters.
#include <fmt/format.h>
#include <torch/optim/sgd.h>

#include <torch/cuda.h>

#include <chrono>
#include <cmath>
#include <functional>
#include <filesystem>
#include <fstream>
#include <limits>

#include "core/log.hpp"
#include "core/text.hpp"
#include "distributed/collective_timing.hpp"
#include "parallel/shard/unit_registry.hpp"
#include "parallel/shard/wrap_policy.hpp"
#include "deepspeed/deepspeed_plugin.hpp"
#include "deepspeed/pipeline_engine.hpp"
#include "xlr8/deepspeed.hpp"
#include "xlr8/deepspeed_schedulers.hpp"
#include "xlr8/error.hpp"
#include "xlr8/tensor_parallel.hpp"
#include "xlr8/fused_adam.hpp"
#include "xlr8/safetensors.hpp"

namespace xlr8::deepspeed {
namespace {

AcceleratorOptions accelerator_options(const Config& config, const BatchSizes& sizes, bool pipelined) {
  AcceleratorOptions o;
  o.mixed_precision = mixed_precision(config);
  o.gradient_accumulation_steps = static_cast<int>(sizes.gradient_accumulation_steps);
  if (pipelined) {  // DeepSpeed's TrainSchedule: 1F1B over the accumulation steps, which are the micro-batches
    o.pp_schedule = "1F1B";
    o.pp_microbatches = static_cast<int>(sizes.gradient_accumulation_steps);
    o.gradient_accumulation_steps = 1;
  }
  o.sync_with_dataloader = false;  // DeepSpeed's boundary is its micro-step count alone
  return o;  // the JSON's ZeRO keys: the Accelerator's plan reads them from the config it is given
}

template <class T>
T param_or(const nlohmann::json& params, const char* key, T fallback, const std::string& type) {
  if (!params.contains(key) || params.at(key).is_null()) return fallback;
  try {
    return params.at(key).get<T>();
  } catch (const nlohmann::json::exception&) {
    throw ConfigError(fmt::format("DeepSpeed config: optimizer.params.{} = {} is not valid for {}", key,
                                  params.at(key).dump(), type));
  }
}

}  // namespace

std::shared_ptr<torch::optim::Optimizer> make_optimizer(const TypedSection& section,
                                                        const std::vector<at::Tensor>& parameters) {
  const auto type = text::lower(section.type);
  const auto& p = section.params;
  if (type == "adam" || type == "adamw") {
    check_section_params(section, "optimizer",
                         {"lr", "betas", "eps", "weight_decay", "amsgrad", "adam_w_mode", "torch_adam", "bias_correction"});
    if (!param_or(p, "bias_correction", true, section.type))
      throw ConfigError("DeepSpeed config: optimizer.params.bias_correction = false is not implemented; remove it");
    const auto betas = param_or(p, "betas", std::vector<double>{0.9, 0.999}, section.type);
    if (betas.size() != 2) throw ConfigError("DeepSpeed config: optimizer.params.betas must be a list of two numbers");
    const double lr = param_or(p, "lr", 1e-3, section.type), eps = param_or(p, "eps", 1e-8, section.type),
                 decay = param_or(p, "weight_decay", 0.0, section.type);
    const bool amsgrad = param_or(p, "amsgrad", false, section.type);
    // DeepSpeed's "Adam" is AdamW unless adam_w_mode is false; "AdamW" always is.
    if (type == "adamw" || param_or(p, "adam_w_mode", true, section.type))
      return std::make_shared<optim::FusedAdamW>(
          parameters, torch::optim::AdamWOptions(lr).betas({betas[0], betas[1]}).eps(eps).weight_decay(decay).amsgrad(amsgrad));
    return std::make_shared<optim::FusedAdam>(
        parameters, torch::optim::AdamOptions(lr).betas({betas[0], betas[1]}).eps(eps).weight_decay(decay).amsgrad(amsgrad));
  }
  if (type == "sgd") {
    check_section_params(section, "optimizer", {"lr", "momentum", "dampening", "weight_decay", "nesterov"});
    if (!p.contains("lr")) throw ConfigError("DeepSpeed config: optimizer SGD needs params.lr");
    return std::make_shared<torch::optim::SGD>(parameters, torch::optim::SGDOptions(param_or(p, "lr", 0.0, section.type))
                                                               .momentum(param_or(p, "momentum", 0.0, section.type))
                                                               .dampening(param_or(p, "dampening", 0.0, section.type))
                                                               .weight_decay(param_or(p, "weight_decay", 0.0, section.type))
                                                               .nesterov(param_or(p, "nesterov", false, section.type)));
  }
  const std::vector<std::string> deepspeed_only = {"onebitadam", "zerooneadam", "onebitlamb", "lamb", "lion",
                                                   "muadam", "muadamw", "musgd", "adagrad", "muon", "adam8bit"};
  if (std::find(deepspeed_only.begin(), deepspeed_only.end(), type) != deepspeed_only.end())
    throw ConfigError(fmt::format("DeepSpeed config: optimizer.type {:?} is not implemented in xlr8; use Adam, AdamW or "
                                  "SGD, or pass your own optimizer to initialize()",
                                  section.type));
  throw ConfigError(fmt::format("DeepSpeed config: optimizer.type {:?} is not an optimizer DeepSpeed knows{}; use Adam, "
                                "AdamW or SGD",
                                section.type, text::suggestion(section.type, {"Adam", "AdamW", "SGD"})));
}

Engine::Engine(std::shared_ptr<torch::nn::Module> module, Config config, std::shared_ptr<torch::optim::Optimizer> optimizer,
               std::shared_ptr<torch::optim::LRScheduler> scheduler)
    : config_(std::move(config)) {
  if (!module) throw Error("deepspeed::initialize: the model is null");
  require_resolved(config_);
  const auto& state = ProcessState::instance();
  // The mesh before the batch sizes, which a missing sp dimension would upset.
  check_mesh(config_, {state.mesh().size(MeshDim::dp), state.mesh().size(MeshDim::sp), state.mesh().size(MeshDim::tp),
                       state.mesh().size(MeshDim::pp)});
  sizes_ = resolve_batch_sizes(config_, state.mesh().group(MeshDim::dp).size());
  check_launch(state.settings(), sizes_);
  if (optimizer && config_.optimizer)
    throw ConfigError(fmt::format("deepspeed::initialize: an optimizer was passed and {} has an \"optimizer\" section "
                                  "({}); keep one of them",
                                  config_.origin, config_.optimizer->type));
  if (!optimizer && !config_.optimizer)
    throw ConfigError(fmt::format("deepspeed::initialize: no optimizer: pass one, or give {} an \"optimizer\" section "
                                  "(Adam, AdamW or SGD)",
                                  config_.origin));
  deepspeed::mark_leaf_modules(*module, config_.zero_optimization.leaf_module);
  const bool pipelined = state.mesh().size(MeshDim::pp) > 1;
  if (pipelined) check_pipeline_launch(config_, state.settings(), sizes_);
  prepare_pipeline_module(*module, config_);
  accelerator_ = std::make_unique<Accelerator>(config_, accelerator_options(config_, sizes_, pipelined));
  module_ = accelerator_->prepare(module);
  if (!optimizer) optimizer = make_optimizer(*config_.optimizer, module_->parameters());
  optimizer_ = accelerator_->prepare_optimizer(std::move(optimizer));
  if (scheduler && config_.scheduler && state.is_main_process())
    log::warning("xlr8: deepspeed::initialize: a scheduler was passed, so {}'s \"scheduler\" section ({}) is not used",
                 config_.origin, config_.scheduler->type);
  if (!scheduler && config_.scheduler) scheduler = make_scheduler(*config_.scheduler, optimizer_.optimizer());
  if (scheduler) scheduler_ = accelerator_->prepare_scheduler(std::move(scheduler));
  accelerator_->register_for_checkpointing(counters_);
  if (state.is_main_process())
    log::info("xlr8: DeepSpeed engine: ZeRO stage {}, train_batch_size {} = {} per rank x {} accumulation x {} ranks{}, "
              "{}, gradient_clipping {}",
              config_.zero_optimization.stage, sizes_.train_batch_size, sizes_.micro_batch_per_gpu,
              sizes_.gradient_accumulation_steps, state.mesh().group(MeshDim::dp).size(),
              config_.elasticity.enabled ? " (elasticity's choice for this world size)" : "",
              config_.fp16.enabled ? "fp16" : config_.bf16 ? "bf16" : "fp32", config_.gradient_clipping);
}

Engine::~Engine() = default;

bool Engine::is_gradient_accumulation_boundary() const {
  if (boundary_override_) return *boundary_override_;
  return micro_steps_into_window() + 1 == sizes_.gradient_accumulation_steps;
}

int64_t Engine::micro_steps_into_window() const {
  return (micro_steps_ - window_origin_) % sizes_.gradient_accumulation_steps;
}

void Engine::set_gradient_accumulation_boundary(bool is_boundary) { boundary_override_ = is_boundary; }

// The micro-step's sync decision is made once, when its first forward (or backward) begins.
void Engine::open_micro_step() {
  if (micro_step_) return;
  const bool sync = is_gradient_accumulation_boundary() && no_sync_depth_ == 0;
  micro_step_.emplace(accelerator_->micro_step(sync, module_));
}

// ------------------------------------------------------------------------------------------ wall clock

double Engine::now_ms() const {
  if (accelerator_->device().is_cuda()) torch::cuda::synchronize();
  return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

void Engine::add_time(double WallClock::*phase, double ms) {
  wall_clock_total_.*phase += ms;
  wall_clock_interval_.*phase += ms;
}

// Backward time since `began_ms`: the part spent blocked in collectives (since `waited_before`) is the
// wait for gradient reductions, the rest the backward's own.
void Engine::add_backward_time(double began_ms, int64_t waited_before) {
  const double total = now_ms() - began_ms;
  const double reducing = static_cast<double>(distributed::collective_wait_ns() - waited_before) / 1e6;
  add_time(&WallClock::backward_ms, total);
  add_time(&WallClock::backward_allreduce_ms, reducing);
  add_time(&WallClock::backward_inner_ms, total - reducing);
}

void Engine::print_wall_clock() {
  const auto& w = wall_clock_interval_;
  if (ProcessState::instance().is_main_process())
    log::info("xlr8: [deepspeed] time (ms) over steps {}-{} | fwd: {:.2f} | bwd: {:.2f} | bwd_inner: {:.2f} | "
              "bwd_allreduce: {:.2f} | step: {:.2f}",
              global_steps_ - config_.steps_per_print + 1, global_steps_, w.forward_ms, w.backward_ms, w.backward_inner_ms,
              w.backward_allreduce_ms, w.step_ms);
  wall_clock_interval_ = {};
}

// ------------------------------------------------------------------------------------------ micro-steps

AutocastScope Engine::begin_forward() {
  open_micro_step();
  if (config_.wall_clock_breakdown) forward_began_ms_ = now_ms();
  return accelerator_->autocast();
}

void Engine::end_forward() {
  if (!forward_began_ms_) return;
  add_time(&WallClock::forward_ms, now_ms() - *forward_began_ms_);
  forward_began_ms_.reset();
}

at::Tensor Engine::backward(const at::Tensor& loss, bool retain_graph) {
  if (accelerator_->pipeline_stats().is_object())
    throw ConfigError("backward(): under pp the engine's step is train_batch(next), which runs the schedule's forwards "
                      "and backwards over the micro-batches; one backward cannot express it");
  open_micro_step();
  if (!config_.wall_clock_breakdown) {
    accelerator_->backward(loss, retain_graph);
  } else {
    end_forward();  // a loop that called begin_forward() itself
    const double began = now_ms();
    const int64_t waited = distributed::collective_wait_ns();
    accelerator_->backward(loss, retain_graph);
    add_backward_time(began, waited);
  }
  return loss.detach() / static_cast<double>(sizes_.gradient_accumulation_steps);
}

at::Tensor Engine::scale(const at::Tensor& loss) {
  open_micro_step();
  return accelerator_->scaled_loss(loss);  // exactly what backward() propagates
}

void Engine::step() {
  if (accelerator_->pipeline_stats().is_object())
    throw ConfigError("step(): under pp the engine's step is train_batch(next), which steps the optimizer itself");
  if (no_sync_depth_ > 0)
    throw Error("step() inside no_sync(): gradients are not reduced there, so no step may be taken (DeepSpeed's rule)");
  open_micro_step();
  const bool timed = config_.wall_clock_breakdown;
  const double began = timed ? now_ms() : 0;
  const bool boundary = is_gradient_accumulation_boundary();
  if (boundary) boundary_step();
  const double stepped = timed ? now_ms() : 0;
  const int64_t waited = timed ? distributed::collective_wait_ns() : 0;
  micro_step_.reset();  // the strategies end their step: a sharded model's reductions are done
  ++micro_steps_;
  if (!timed) return;
  add_time(&WallClock::step_ms, stepped - began);
  add_backward_time(stepped, waited);  // what ending the micro-step waited for is the backward's reductions
  if (boundary && config_.steps_per_print > 0 && global_steps_ % config_.steps_per_print == 0) print_wall_clock();
}

void Engine::boundary_step() {
  const auto params = module_->parameters();
  const double clip = config_.gradient_clipping > 0 ? config_.gradient_clipping : std::numeric_limits<double>::infinity();
  grad_norm_ = accelerator_->clip_grad_norm(params, clip);
  optimizer_.step();
  step_applied_ = !optimizer_.step_was_skipped();  // a boundary is a sync step: skipped only for fp16 overflow
  if (scheduler_) scheduler_->step();  // only after an applied step (PreparedScheduler)
  optimizer_.zero_grad();
  if (!step_applied_) ++skipped_steps_;
  ++global_steps_;
  global_samples_ += sizes_.train_batch_size;
  if (config_.steps_per_print > 0 && global_steps_ % config_.steps_per_print == 0 && ProcessState::instance().is_main_process())
    log::info("xlr8: [deepspeed] step={}, skipped={}, lr={}, grad_norm={:.4g}, loss_scale={}", global_steps_,
              skipped_steps_, text::join([&] {
                std::vector<std::string> lrs;
                for (double lr : get_lr()) lrs.push_back(fmt::format("{:.6g}", lr));
                return lrs;
              }()),
              grad_norm_.value(), loss_scale());
}

std::vector<double> Engine::get_lr() const {
  std::vector<double> lrs;
  auto handle = optimizer_;  // a handle: the same optimizer, reachable without casting const away
  for (auto& group : handle.optimizer().param_groups())
    lrs.push_back(group.options().get_lr());
  return lrs;
}

double Engine::loss_scale() const { return accelerator_->loss_scale(); }

// ------------------------------------------------------------------------------------------ checkpoints

nlohmann::json Engine::Counters::state() const {
  return {{"global_steps", engine->global_steps_},
          {"global_samples", engine->global_samples_},
          {"skipped_steps", engine->skipped_steps_},
          {"micro_steps", engine->micro_steps_},
          {"gradient_accumulation_steps", engine->sizes_.gradient_accumulation_steps},
          {"micro_steps_into_window", engine->micro_steps_into_window()},
          {"client_state", client_state}};
}

void Engine::Counters::load_state(const nlohmann::json& state) {
  // The windows go on where the saved run's stood, also under another accumulation (same global batch, other
  // micro-batches); one saved partway through a window of another size starts again (no partial gradients are saved).
  const int64_t gas = engine->sizes_.gradient_accumulation_steps;
  const int64_t micro_steps = state.at("micro_steps").get<int64_t>();
  const int64_t saved_gas = state.value("gradient_accumulation_steps", gas);
  int64_t into = state.value("micro_steps_into_window", micro_steps % gas);
  if (micro_steps < 0 || saved_gas < 1 || into < 0 || into >= saved_gas)
    throw Error(fmt::format("load_checkpoint: micro_steps {}, micro_steps_into_window {} and gradient_accumulation_steps "
                            "{} cannot be what the engine saved (0 or more, the window's place below its size): the "
                            "checkpoint was edited or damaged",
                            micro_steps, into, saved_gas));
  if (into != 0 && saved_gas != gas) {
    if (engine->accelerator_->is_main_process())
      log::warning("xlr8: the checkpoint was saved {} micro-step(s) into a window of {} and gradient_accumulation_steps "
                   "is now {}: the window starts again",
                   into, saved_gas, gas);
    into = 0;
  }
  engine->global_steps_ = state.at("global_steps").get<int64_t>();
  engine->global_samples_ = state.at("global_samples").get<int64_t>();
  engine->skipped_steps_ = state.at("skipped_steps").get<int64_t>();
  engine->micro_steps_ = micro_steps;
  engine->window_origin_ = micro_steps - into;
  client_state = state.at("client_state");
}

// DeepSpeed's tag check: one hash per rank, compared by MIN and MAX.
void Engine::check_tag(const std::string& tag) const {
  auto& world = accelerator_->state().world();
  if (config_.tag_validation == "Ignore" || world.size() == 1) return;
  const auto hash = static_cast<int64_t>(std::hash<std::string>{}(tag) >> 1);
  auto bounds = at::tensor({hash, -hash}, at::kLong);
  world.all_reduce(bounds, ReduceOp::MAX);
  if (bounds[0].item<int64_t>() == hash && -bounds[1].item<int64_t>() == hash) return;
  const auto message = fmt::format("checkpoint tag {:?} is not the same on every rank (rank {}'s); every rank must "
                                   "save under one tag (checkpoint.tag_validation is {})",
                                   tag, world.rank(), config_.tag_validation);
  if (config_.tag_validation == "Fail") throw Error(message);
  log::warning("xlr8: {}", message);
}

std::string Engine::save_checkpoint(const std::string& dir, const std::string& tag, const nlohmann::json& client_state,
                                    bool save_latest) {
  if (micro_step_)
    throw Error("save_checkpoint(): a micro-step is under way (a forward or backward since the last step()); save "
                "after step()");
  const std::string name = tag.empty() ? fmt::format("global_step{}", global_steps_) : tag;
  check_tag(name);
  counters_.client_state = client_state;
  const auto path = (std::filesystem::path(dir) / name).string();
  accelerator_->save_state(path);
  if (save_latest && accelerator_->is_main_process()) {
    const auto latest = std::filesystem::path(dir) / "latest", partial = std::filesystem::path(dir) / "latest.partial";
    std::ofstream(partial) << name;
    std::filesystem::rename(partial, latest);  // readers see the old tag or the new one, never half of it
  }
  accelerator_->wait_for_everyone();
  return path;
}

std::optional<std::pair<std::string, nlohmann::json>> Engine::load_checkpoint(const std::string& dir,
                                                                               const std::string& tag) {
  std::string name = tag;
  if (name.empty() && !std::filesystem::is_directory(dir)) {
    // DeepSpeed warns and starts fresh here too; the warning names what is missing.
    if (accelerator_->is_main_process())
      log::warning("xlr8: load_checkpoint: the directory {} does not exist; nothing was loaded (training starts "
                   "fresh)",
                   dir);
    return std::nullopt;
  }
  if (name.empty()) {
    std::ifstream latest(std::filesystem::path(dir) / "latest");
    if (!latest || !std::getline(latest, name) || name.empty()) {
      if (accelerator_->is_main_process())
        log::warning("xlr8: load_checkpoint: {} has no 'latest' file naming a tag; nothing was loaded (pass the tag "
                     "to load one)",
                     dir);
      return std::nullopt;
    }
  }
  const auto path = (std::filesystem::path(dir) / name).string();
  micro_step_.reset();
  accelerator_->load_state(path);
  return std::make_pair(path, counters_.client_state);
}

bool Engine::save_16bit_model(const std::string& dir, const std::string& file) {
  const bool main = accelerator_->is_main_process();
  if (config_.zero_optimization.stage == 3 && !config_.zero_optimization.stage3_gather_16bit_weights_on_model_save) {
    if (main)
      log::warning("xlr8: save_16bit_model: under ZeRO-3 the weights are gathered for it only with "
                   "zero_optimization.stage3_gather_16bit_weights_on_model_save: true; nothing was saved");
    return false;
  }
  auto state = accelerator_->get_state_dict(module_);  // collective: whole on rank 0 only
  if (main) {
    const auto dtype = config_.fp16.enabled ? std::optional(at::kHalf) : config_.bf16 ? std::optional(at::kBFloat16) : std::nullopt;
    NamedTensors tensors;
    for (auto& [name, tensor] : state)
      tensors.emplace_back(name, dtype && tensor.is_floating_point() ? tensor.to(*dtype) : tensor);
    std::filesystem::create_directories(dir);
    save_safetensors((std::filesystem::path(dir) / file).string(), tensors, {{"format", "pt"}});
  }
  accelerator_->wait_for_everyone();
  return true;
}

Engine::NoSync::NoSync(Engine& engine) : engine_(&engine) {
  if (engine.micro_step_)
    throw Error("no_sync(): a micro-step is already under way (a forward or backward ran since the last step()); "
                "enter no_sync() before the micro-step's forward");
  ++engine.no_sync_depth_;
}

Engine::NoSync::NoSync(NoSync&& other) noexcept : engine_(std::exchange(other.engine_, nullptr)) {}

Engine::NoSync::~NoSync() {
  if (!engine_) return;
  --engine_->no_sync_depth_;
  // The micro-steps it covered accumulated locally; the next one opens with the usual decision.
  engine_->micro_step_.reset();
}

}  // namespace xlr8::deepspeed
