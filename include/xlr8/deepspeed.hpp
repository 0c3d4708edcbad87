#pragma once
// DeepSpeed's engine API in C++ (reference/002, research/peers.md §1.1): for a training loop written
// against DeepSpeed rather than Accelerate.
//
//   auto [engine, optimizer, scheduler] = xlr8::deepspeed::initialize(model, "ds_config.json");
//   for (auto& batch : loader) {
//     auto loss = loss_fn(engine->forward(batch.data), batch.target);
//     engine->backward(loss);
//     engine->step();
//   }
//
// The engine is an Accelerator configured from the JSON (deepspeed_config.hpp): ZeRO stage 0 is DDP,
// stages 1-3 the sharding engine (stage 3 by GUARDED_MODULES units, as DeepSpeed gathers submodule by
// submodule), fp16 with the JSON's loss scaler, bf16, gradient accumulation and clipping. Micro-steps
// count as DeepSpeed's do: step() after every backward; only the accumulation boundary updates.
// Several engines in one process share the process state and count their steps independently.
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "xlr8/accelerator.hpp"
#include "xlr8/deepspeed_config.hpp"
#include "xlr8/deepspeed_schedulers.hpp"

namespace xlr8::deepspeed {

class Engine {
 public:
  // Collective: prepares `module` (replicated or sharded by the config's stage), then the optimizer:
  // `optimizer` when given (built over the module's parameters), else the config's "optimizer" section
  // (Adam, AdamW, SGD). A config that still has "auto" values, batch sizes that disagree, or an
  // optimizer given both ways is a ConfigError.
  Engine(std::shared_ptr<torch::nn::Module> module, Config config,
         std::shared_ptr<torch::optim::Optimizer> optimizer = nullptr,
         std::shared_ptr<torch::optim::LRScheduler> scheduler = nullptr);
  ~Engine();
  Engine(const Engine&) = delete;
  Engine& operator=(const Engine&) = delete;

  // Opens the micro-step (its sync decision) and returns the autocast the forward runs under: the
  // typed engine's forward() calls it. A loop that calls the module itself may call it too (and
  // end_forward() after it, else the forward's time runs until backward()).
  [[nodiscard]] AutocastScope begin_forward();
  void end_forward();
  // The loss divided by the accumulation steps and multiplied by the fp16 scale, backpropagated (outside
  // autocast). Returns loss / gradient_accumulation_steps, detached, for logging.
  at::Tensor backward(const at::Tensor& loss, bool retain_graph = false);
  // What backward() backpropagates, for a program that calls loss.backward() itself: the gradients are
  // identical.
  at::Tensor scale(const at::Tensor& loss);
  // Counts a micro-step. On the accumulation boundary: unscale and check fp16 overflow on every rank,
  // clip to gradient_clipping, step the optimizer (skipped on overflow), step the scheduler only when
  // the optimizer stepped, zero the gradients, count the global step and samples.
  void step();

  // DeepSpeed's pipeline API, for a PipelineModule (deepspeed_pipeline.hpp): gradient_accumulation_steps
  // micro-batches, each `next()` = {inputs, labels} (a middle stage's are not read: it may pass an empty function),
  // through the stages (1F1B under pp; forward, backward and step() each in one process), then the optimizer step
  // as step() takes it on the boundary. Returns the batch's mean loss over every data-parallel replica (as
  // DeepSpeed's aggregated loss), on every rank.
  using MicroBatch = std::pair<at::Tensor, at::Tensor>;
  double train_batch(const std::function<MicroBatch()>& next);
  // The same micro-batches' mean loss in eval mode, without gradients; the model returns to train mode.
  double eval_batch(const std::function<MicroBatch()>& next);

  bool is_gradient_accumulation_boundary() const;
  // Overrides the boundary (DeepSpeed's set_gradient_accumulation_boundary) until set again.
  void set_gradient_accumulation_boundary(bool is_boundary);
  // Gradients accumulate locally while the guard lives (no reduction); step() inside it is an Error.
  class NoSync {
   public:
    explicit NoSync(Engine& engine);
    NoSync(NoSync&& other) noexcept;
    NoSync(const NoSync&) = delete;
    ~NoSync();

   private:
    Engine* engine_;
  };
  [[nodiscard]] NoSync no_sync() { return NoSync(*this); }

  bool was_step_applied() const { return step_applied_; }
  // The gradients' global norm (before clipping) at the last boundary; inf after an fp16 overflow.
  double get_global_grad_norm() const { return grad_norm_.value(); }  // waits for the device
  std::vector<double> get_lr() const;
  int64_t train_batch_size() const { return sizes_.train_batch_size; }
  int64_t train_micro_batch_size_per_gpu() const { return sizes_.micro_batch_per_gpu; }
  int64_t gradient_accumulation_steps() const { return sizes_.gradient_accumulation_steps; }
  int64_t global_steps() const { return global_steps_; }
  int64_t global_samples() const { return global_samples_; }
  int64_t skipped_steps() const { return skipped_steps_; }
  int64_t micro_steps() const { return micro_steps_; }
  int zero_optimization_stage() const { return config_.zero_optimization.stage; }
  double loss_scale() const;  // 1 without fp16

  // wall_clock_breakdown: milliseconds spent in each phase since the engine was built (zeros unless the
  // config turns it on). backward = backward_inner + backward_allreduce, the time blocked waiting for
  // gradient reductions (in backward and when the micro-step ends); step = clipping, the optimizer (with
  // ZeRO's gathers), the scheduler and zeroing. With steps_per_print, each interval's sums are printed.
  struct WallClock {
    double forward_ms = 0, backward_ms = 0, backward_inner_ms = 0, backward_allreduce_ms = 0, step_ms = 0;
  };
  const WallClock& wall_clock() const { return wall_clock_total_; }

  // DeepSpeed's checkpoints, over Accelerator::save_state (sharded, checksummed, resharded on load, read
  // by `xlr8 merge-weights`): `dir/tag` (default "global_step<N>") holds the model, optimizer, scheduler,
  // scaler, the engine's counters and `client_state`; `dir/latest` names the tag. Every rank must pass
  // the same tag: checkpoint.tag_validation says what a difference does (Warn, Ignore, Fail). Collective.
  std::string save_checkpoint(const std::string& dir, const std::string& tag = "",
                              const nlohmann::json& client_state = nlohmann::json::object(), bool save_latest = true);
  // Loads `dir/tag` (without a tag: the one `dir/latest` names) and returns {its path, client_state}; no
  // `latest` file: a warning and nothing, as DeepSpeed does. Collective.
  std::optional<std::pair<std::string, nlohmann::json>> load_checkpoint(const std::string& dir, const std::string& tag = "");
  // The whole model in one safetensors file `dir/file`, in the training's 16-bit dtype (fp16 / bf16; the
  // parameters' own dtype without mixed precision), written by rank 0. Under stage 3 only when
  // zero_optimization.stage3_gather_16bit_weights_on_model_save is true; else a warning and false, as
  // DeepSpeed does. Collective.
  bool save_16bit_model(const std::string& dir, const std::string& file = "model.safetensors");

  // DeepSpeed's deepspeed_io: a loader over `dataset` giving each data-parallel rank its share in
  // micro-batches of train_micro_batch_size_per_gpu (or `batch_size`), shuffled as DeepSpeed's training
  // sampler does (reseeded per epoch), the last partial batch dropped when dataloader_drop_last.
  template <class Dataset>
  std::shared_ptr<DataLoader<Dataset>> deepspeed_io(Dataset dataset, std::optional<int64_t> batch_size = std::nullopt) {
    DataLoaderOptions options;
    options.batch_size = batch_size.value_or(sizes_.micro_batch_per_gpu);
    options.shuffle = true;
    options.drop_last = config_.dataloader_drop_last;
    return accelerator_->prepare_data_loader(std::move(dataset), options);
  }

  const Config& config() const { return config_; }
  Accelerator& accelerator() { return *accelerator_; }
  torch::nn::Module& module() { return *module_; }
  PreparedOptimizer& optimizer() { return optimizer_; }
  std::optional<PreparedScheduler>& lr_scheduler() { return scheduler_; }

 private:
  void open_micro_step();
  // On the accumulation boundary: clipping, the optimizer, the scheduler, zeroing and the counters.
  void boundary_step();
  // train_batch / eval_batch: the batch's micro-batches, concatenated, as {inputs, labels}.
  MicroBatch gather_micro_batches(const std::function<MicroBatch()>& next, const char* call) const;
  double replicas_mean(double loss) const;
  void check_tag(const std::string& tag) const;
  // wall_clock_breakdown: a phase's clock (synchronising the device first, as DeepSpeed's timers do).
  double now_ms() const;
  void add_time(double WallClock::*phase, double ms);
  void add_backward_time(double began_ms, int64_t waited_before_ns);
  void print_wall_clock();

  // What save_checkpoint keeps besides the Accelerator's own state (registered for checkpointing).
  struct Counters {
    Engine* engine = nullptr;
    nlohmann::json client_state = nlohmann::json::object();
    nlohmann::json state() const;
    void load_state(const nlohmann::json& state);
  };

  Config config_;
  Counters counters_{this};
  BatchSizes sizes_;
  std::unique_ptr<Accelerator> accelerator_;
  std::shared_ptr<torch::nn::Module> module_;
  PreparedOptimizer optimizer_;
  std::optional<PreparedScheduler> scheduler_;
  std::optional<StepScope> micro_step_;
  std::optional<bool> boundary_override_;
  int no_sync_depth_ = 0;
  int64_t micro_steps_ = 0, global_steps_ = 0, global_samples_ = 0, skipped_steps_ = 0;
  // The micro-step the accumulation windows count from: 0, or where a loaded checkpoint's window ended when it was
  // saved with another gradient_accumulation_steps (an elastic restart's).
  int64_t window_origin_ = 0;
  int64_t micro_steps_into_window() const;
  bool step_applied_ = false;
  GradNorm grad_norm_;  // on the device until read
  WallClock wall_clock_total_, wall_clock_interval_;
  std::optional<double> forward_began_ms_;
};

// The engine of a model of type Model (a module holder such as TORCH_MODULE(Net)'s Net, or a
// shared_ptr): forward() runs the model's own forward inside begin_forward().
template <class Model>
class ModelEngine : public Engine {
 public:
  ModelEngine(Model model, Config config, std::shared_ptr<torch::optim::Optimizer> optimizer = nullptr,
              std::shared_ptr<torch::optim::LRScheduler> scheduler = nullptr)
      : Engine(pointer_of(model), std::move(config), std::move(optimizer), std::move(scheduler)), model_(model) {}

  template <class... Args>
  auto forward(Args&&... args) {
    auto autocast = begin_forward();
    auto output = model_->forward(std::forward<Args>(args)...);
    end_forward();
    return output;
  }
  template <class... Args>
  auto operator()(Args&&... args) {
    return forward(std::forward<Args>(args)...);
  }
  Model& model() { return model_; }

 private:
  static std::shared_ptr<torch::nn::Module> pointer_of(const Model& model) {
    if constexpr (requires { model.ptr(); }) return model.ptr();
    else return model;
  }
  Model model_;
};

// deepspeed.initialize's tuple: the engine and handles to its optimizer and scheduler (the scheduler is
// empty when neither the call nor the config gave one).
template <class Model>
struct Initialized {
  std::shared_ptr<ModelEngine<Model>> engine;
  PreparedOptimizer optimizer;
  std::optional<PreparedScheduler> lr_scheduler;
};

// `config`: a path to a JSON file, JSON text, or a parsed Config. An optimizer or scheduler passed here
// is used instead of the config's section (an optimizer given both ways is an Error, as DeepSpeed's is
// ambiguous about it; a scheduler given both ways: the one passed here, with a warning). The config's
// scheduler section builds WarmupLR, WarmupDecayLR or WarmupCosineLR (deepspeed_schedulers.hpp).
template <class Model>
Initialized<Model> initialize(Model model, const Config& config,
                              std::shared_ptr<torch::optim::Optimizer> optimizer = nullptr,
                              std::shared_ptr<torch::optim::LRScheduler> scheduler = nullptr) {
  auto engine = std::make_shared<ModelEngine<Model>>(model, config, std::move(optimizer), std::move(scheduler));
  return {engine, engine->optimizer(), engine->lr_scheduler()};
}
template <class Model>
Initialized<Model> initialize(Model model, const std::string& config_path_or_json,
                              std::shared_ptr<torch::optim::Optimizer> optimizer = nullptr,
                              std::shared_ptr<torch::optim::LRScheduler> scheduler = nullptr) {
  return initialize(std::move(model), load_config(config_path_or_json), std::move(optimizer), std::move(scheduler));
}
template <class Model>
Initialized<Model> initialize(Model model, const char* config_path_or_json,
                              std::shared_ptr<torch::optim::Optimizer> optimizer = nullptr,
                              std::shared_ptr<torch::optim::LRScheduler> scheduler = nullptr) {
  return initialize(std::move(model), load_config(config_path_or_json), std::move(optimizer), std::move(scheduler));
}
template <class Model>
Initialized<Model> initialize(Model model, const nlohmann::json& config,
                              std::shared_ptr<torch::optim::Optimizer> optimizer = nullptr,
                              std::shared_ptr<torch::optim::LRScheduler> scheduler = nullptr) {
  return initialize(std::move(model), parse_config(config), std::move(optimizer), std::move(scheduler));
}

// deepspeed.initialize with training_data: the tuple gains the engine's loader over it (deepspeed_io), in
// DeepSpeed's order:
//   auto [engine, optimizer, loader, scheduler] = xlr8::deepspeed::initialize(model, "ds.json", dataset);
template <class Model, class Dataset>
struct InitializedWithData {
  std::shared_ptr<ModelEngine<Model>> engine;
  PreparedOptimizer optimizer;
  std::shared_ptr<DataLoader<Dataset>> training_dataloader;
  std::optional<PreparedScheduler> lr_scheduler;
};

inline Config config_of(const Config& config) { return config; }
inline Config config_of(const std::string& path_or_json) { return load_config(path_or_json); }
inline Config config_of(const char* path_or_json) { return load_config(path_or_json); }
inline Config config_of(const nlohmann::json& config) { return parse_config(config); }

template <class Model, class ConfigSource, class Dataset>
  requires requires(const Dataset& d) {
    d.size();
    d.get(size_t{0});
  }
InitializedWithData<Model, Dataset> initialize(Model model, const ConfigSource& config, Dataset training_data,
                                               std::shared_ptr<torch::optim::Optimizer> optimizer = nullptr,
                                               std::shared_ptr<torch::optim::LRScheduler> scheduler = nullptr) {
  auto made = initialize(std::move(model), config_of(config), std::move(optimizer), std::move(scheduler));
  auto loader = made.engine->deepspeed_io(std::move(training_data));
  return {made.engine, made.optimizer, loader, made.lr_scheduler};
}

// DeepSpeed's set_z3_leaf_modules: under ZeRO-3 each module of `model` that matches becomes one unit
// gathered whole, with no unit below it (for modules whose submodules run differently on different ranks,
// as MoE experts: every rank then gathers the same thing). Classes match as fsdp_transformer_layer_cls_to_wrap's
// names do ("Experts", "ExpertsImpl", "ns::ExpertsImpl"); names exactly as named_modules() gives them;
// suffixes the end of those names after a dot. Returns how many modules were marked; a ConfigError when
// none matched. Call before initialize() or Accelerator::prepare(). The config's
// zero_optimization.leaf_module does the same.
int set_z3_leaf_modules(torch::nn::Module& model, const std::vector<std::string>& classes);
int set_z3_leaf_modules_by_name(torch::nn::Module& model, const std::vector<std::string>& names);
int set_z3_leaf_modules_by_suffix(torch::nn::Module& model, const std::vector<std::string>& suffixes);

// The optimizer a config's "optimizer" section describes, over `parameters` (Adam with adam_w_mode,
// the default, and AdamW are decoupled-weight-decay AdamW; float32 CPU parameters take the fused step).
std::shared_ptr<torch::optim::Optimizer> make_optimizer(const TypedSection& section,
                                                        const std::vector<at::Tensor>& parameters);

}  // namespace xlr8::deepspeed
