#pragma once
// Internal state of xlr8::Accelerator, shared by accelerator.cpp and the checkpoint code.
#include <fmt/format.h>

#include <fstream>
#include <map>
#include <optional>
#include <unordered_map>
#include <unordered_set>

#include "deepspeed/deepspeed_plugin.hpp"
#include "diagnostics/advise_recorder.hpp"
#include "diagnostics/verify_recorder.hpp"
#include "parallel/pipeline/tied_weights.hpp"
#include "step/step_observer.hpp"
#include "step/step_state.hpp"
#include "step/training_view.hpp"
#include "xlr8/accelerator.hpp"
#include "xlr8/context_parallel.hpp"
#include "xlr8/error.hpp"
#include "xlr8/loss_scaler.hpp"
#include "xlr8/parallel_plan.hpp"
#include "xlr8/safetensors.hpp"

namespace xlr8 {

struct PreparedOptimizer::State {
  std::shared_ptr<torch::optim::Optimizer> optimizer;
  AcceleratorImpl* impl = nullptr;
  bool skipped = false;
  int64_t steps = 0;
};

struct PreparedScheduler::State {
  std::shared_ptr<torch::optim::LRScheduler> scheduler;
  AcceleratorImpl* impl = nullptr;
  int64_t steps = 0;
};

struct AcceleratorImpl {
  const ProcessState* state = nullptr;
  AcceleratorOptions options;
  at::Device device{at::kCPU};
  ParallelPlan plan;  // resolved once, when the Accelerator is built
  std::shared_ptr<GradientState> gradient_state = std::make_shared<GradientState>();
  int64_t micro_step = 0;  // Accelerate's accelerator.step: micro-steps in the current window
  int open_scopes = 0;      // StepScopes alive (accumulate / no_sync): free_memory must not run inside one
  std::vector<std::unique_ptr<ParallelStrategy>> models;  // one per prepared model, in prepare() order
  std::unique_ptr<pp::Pipeline> pipeline;                  // pp > 1: this rank's stage of the prepared model
  std::shared_ptr<torch::nn::Module> pipelined_model;      // and the whole model the program holds
  std::unique_ptr<pp::TiedWeights> tied;                   // its TiedLayers' modules across stages, when it has any
  // The pipeline over models.front() (the stage's strategy): its backwards accumulate, the step's last reduces.
  void start_pipeline(std::shared_ptr<torch::nn::Module> whole, const pp::StageLayers& cut);
  // Refuses, before a model is prepared, a pipeline start_pipeline could not make.
  void check_pipeline() const;
  // Whether the stage's gradients reduce once after the schedule rather than in its last backward: the backwards
  // of an interleaved rank's chunks end apart, and a zero-bubble schedule accumulates weights after its backwards.
  bool reduces_after_schedule() const {
    return plan.pipeline.virtual_stages > 1 ||
           pp::parse_schedule(plan.pipeline.schedule) == pp::Schedule::InterleavedZeroBubble;
  }
  // Whether the stage's sharded units stay gathered through the whole schedule (a zero-bubble schedule over
  // parameters sharded between forwards: FULL_SHARD, HYBRID_SHARD, ZeRO-3; accelerator_pipeline.cpp says why).
  bool keeps_stage_gathered() const {
    return plan.strategy == "zero3" &&
           pp::parse_schedule(plan.pipeline.schedule) == pp::Schedule::InterleavedZeroBubble;
  }
  // TiedLayers of the whole model: the exchanges that keep the stages' copies one parameter (when it has any).
  void start_tied_weights(const ParallelStrategy& strategy, const std::vector<std::pair<size_t, size_t>>& parts);
  // A step's tensor cut into the pipeline's micro-batches (none when undefined: a stage that does not read it).
  std::vector<at::Tensor> split_micro_batches(const at::Tensor& t, const char* what, const char* call,
                                              int count) const;
  // pipeline_step() with no stages (pp 1: one process, or data parallelism alone): the same micro-batches
  // accumulated through the prepared Sequential, so that a program written for pp runs on any layout.
  double accumulate_micro_batches(const at::Tensor& input, const at::Tensor& target, const pp::LossFn& loss,
                                  const std::function<AutocastScope()>& autocast);
  // After a backward: every unit fsdp_activation_checkpointing recomputes ran its forward through xlr8::sharded.
  void check_units_recomputed() const;
  int64_t pipeline_steps = 0;  // pipeline_step() calls (xlr8 advise tries pp for a program that makes them)
  // Under pp an optimizer over the whole model's parameters keeps this stage's only (no state for the others).
  void keep_stage_parameters(torch::optim::Optimizer& optimizer) const;
  // Clipping under pp: every stage's gradients, each stage's norm (over its dp and tp peers) joined over the pp group.
  GradNorm clip_pipeline_grad_norm(double max_norm, double norm_type);
  // What a pipeline cannot do yet (load_model: the file's whole model into one stage) is refused, never done wrong.
  void refuse_under_pipeline(const char* what) const {
    if (plan.mesh.pp > 1)
      throw ConfigError(fmt::format("{} under parallelism_config_pp_size {} is not built yet (each stage holds part of "
                                    "the model; issue 46)",
                                    what, plan.mesh.pp));
  }
  std::vector<std::shared_ptr<PreparedOptimizer::State>> optimizers;
  std::vector<std::shared_ptr<PreparedScheduler::State>> schedulers;
  std::vector<std::weak_ptr<DataLoaderBase>> loaders;
  std::vector<detail::Checkpointable> custom;  // register_for_checkpointing, in order
  std::optional<DynamicLossScaler> scaler;  // fp16 only
  xlr8::step::StepState step_state;             // where this training step is (step/step_state.hpp)
  bool last_step_applied = false;           // the last sync step really updated the parameters
  // What the program's clip_grad_norm first clipped since the last backward (max_norm, the parameters): the
  // step's DeepSpeed clip at gradient_clipping (no smaller), over those parameters, would find the norm within it.
  struct ProgramClip {
    double max_norm;
    std::unordered_set<const c10::TensorImpl*> parameters;
  };
  std::optional<ProgramClip> program_clip;
  uint64_t seed = 0;
  int64_t save_iteration = 0;               // next automatic checkpoint number
  std::vector<std::unique_ptr<Tracker>> trackers;  // main process, once a run started
  std::string run_dir;
  std::optional<deepspeed::DeepSpeedPlugin> deepspeed;  // the launch's DeepSpeed JSON, when it names one
  std::unique_ptr<diagnostics::VerifyRecorder> verify;  // under `xlr8 verify` (XLR8_VERIFY_DIR)
  std::unique_ptr<diagnostics::AdviseRecorder> advise;  // under `xlr8 advise` (XLR8_ADVISE_DIR)
  std::vector<xlr8::step::StepObserver*> observers;    // told of each step's events, in this order (step_observer.hpp)
  template <class Event>
  void notify(const Event& event) {
    for (auto* observer : observers) event(*observer);
  }
  // What observers read of this training (step/training_view.hpp): built for the events that carry it.
  xlr8::step::TrainingView view();
  // The step moves to `next` (StepState::enter's check, then every observer's on_phase).
  void enter(xlr8::step::StepPhase next, const char* caller);

  // The constructors' work: the process, the device, the recorders, the plan resolved from every source of
  // settings (`engine_config`: deepspeed::initialize's JSON; null: the launch's files), and what follows from it.
  void start(AcceleratorOptions given, const deepspeed::Config* engine_config);
  Communicator& world() const { return state->world(); }
  std::vector<at::Tensor> optimized_parameters() const;
  // A sync step's gradients made ready, once (gradients → unscaled | overflowed): under fp16 divided by the
  // scale, with the world agreeing whether any overflowed.
  void unscale_gradients();
  // Elementwise work for the gradients of `parameters` that wait on disk for the step (ParallelStrategy's
  // queue_on_disk_gradients; nothing without the disk tier's gradients).
  void queue_on_disk_gradients(const std::vector<at::Tensor>& parameters, const std::function<void(at::Tensor&)>& op);
  // What a backward propagates: loss / accumulation steps, times the fp16 scale (the step enters gradients:
  // what unscale_gradients found for the last one no longer holds).
  at::Tensor loss_for_backward(const at::Tensor& loss);
  // Accelerator::clip_grad_norm: the global norm of `parameters`' gradients, clipped to max_norm (collective).
  GradNorm clip_grad_norm(const std::vector<at::Tensor>& parameters, double max_norm, double norm_type);
  // Offload (FSDP's offload_params, DeepSpeed's offload_*) was asked for: says, once, what this build does.
  void report_offload();
  // The group and strategy that split the sequence (parallelism_config_cp_size or _sp_size above 1), or
  // nullopt.
  std::optional<cp::Context> sequence_context() const;
  // parallelism_config_sp_seq_length with _is_variable false: `length` must be it (ConfigError otherwise).
  void check_sequence_length(int64_t length) const;
  // A sequence split: the first forward called xlr8::attention (else its attention saw only this rank's
  // share of the sequence): a ConfigError naming the likely modules. Checked at the first backward.
  void check_attention_went_through_cp();
  bool attention_checked = false;
  bool offload_reported = false;
  // Whole values from the main process where build_model left the model without them, and the device: prepare()'s
  // step after the tensor-parallel split. True when the strategy must send rank 0's values (rank-0 loading).
  bool complete_values(const std::shared_ptr<torch::nn::Module>& module);
  // The strategy of a prepared module, or null.
  ParallelStrategy* strategy_for(const torch::nn::Module* module) const;
  // The strategies of `modules` (all prepared models when empty); an unprepared module is an Error.
  std::vector<ParallelStrategy*> strategies_of(const std::vector<torch::nn::Module*>& modules) const;
  // The strategy that owns `parameter` (ParallelStrategy::owns), or null.
  ParallelStrategy* owner_of(const at::Tensor& parameter) const;
  std::vector<std::weak_ptr<torch::nn::Module>> built_for_rank0_loading;  // by build_model, until prepared
  struct BuiltForTp {
    std::weak_ptr<torch::nn::Module> module;
    std::map<std::string, at::Tensor> wholes;  // the main process's whole values by name (empty elsewhere)
  };
  std::vector<BuiltForTp> built_for_tp_loading;  // by build_model under tensor parallelism, until prepared
  bool installed_cp_context = false;  // this Accelerator set cp's process context (and clears it when it goes)
};

// A module's whole tensors in state-dict order (tp slices gathered), as save_model and save_state write them.
struct WholeState {
  using Visitor = std::function<void(size_t index, const at::Tensor& whole)>;
  StateDict layout;  // names, dtypes and whole shapes (meta tensors)
  // Collective over the module's strategy group (and tp group): each tensor whole, at least on its rank 0.
  std::function<void(const Visitor&)> visit;
  std::vector<SafetensorsSpec> specs() const;
};
WholeState whole_state_of(const AcceleratorImpl& s, const torch::nn::Module& module);
// Under pp: every stage's whole state in stage order, opened and written on world rank 0 through `on_main` (which
// runs what it is given there only, keeping the first failure), each stage's tensors sent there point to point.
void stream_pipeline_state(const AcceleratorImpl& s, const std::function<void(const std::function<void()>&)>& on_main,
                           const std::function<void(std::vector<SafetensorsSpec>)>& open,
                           const std::function<void(const at::Tensor&)>& write);

// Streams a module's whole state (a prepared model's through its strategy: collective, one unit gathered at a time)
// into a writer that exists on the main process only: `open` receives the names, dtypes and shapes, `write` each
// tensor in that order, `close` ends it. A failure of the writer does not stop the collective; every rank then throws
// it (`what` begins the message). Under pp the whole model's stages come in turn.
void stream_full_state(const AcceleratorImpl& s, const torch::nn::Module& module, const std::string& what,
                       const std::function<void(std::vector<SafetensorsSpec>)>& open,
                       const std::function<void(const at::Tensor&)>& write, const std::function<void()>& close);

// The whole model (gathered from shards, on rank 0) as Hugging Face safetensors in `dir` (collective): what
// save_model writes.
void write_full_model(const AcceleratorImpl& impl, const torch::nn::Module& module, const std::string& dir,
                      int64_t shard_limit = 0);

}  // namespace xlr8
