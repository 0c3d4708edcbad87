#pragma once
// xlr8::Accelerator: turns a single-process LibTorch loop into distributed training, with the semantics
// of Accelerate's Accelerator: the loss is divided by the accumulation steps; optimizer and scheduler
// only step on sync steps; an epoch's last batch always syncs; gather_for_metrics drops the samples
// that even_batches padded.
#include <fmt/format.h>
#include <nlohmann/json.hpp>
#include <torch/nn/module.h>
#include <torch/nn/pimpl.h>
#include <torch/optim/optimizer.h>
#include <torch/optim/schedulers/lr_scheduler.h>

#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "xlr8/autocast.hpp"
#include "xlr8/data_loader.hpp"
#include "xlr8/empty_init.hpp"
#include "xlr8/format.hpp"
#include "xlr8/grad_norm.hpp"
#include "xlr8/parallel_plan.hpp"
#include "xlr8/parallel_options.hpp"
#include "xlr8/parallel_strategy.hpp"
#include "xlr8/pipeline.hpp"
#include "xlr8/prepared.hpp"
#include "xlr8/process_state.hpp"
#include "xlr8/progress.hpp"
#include "xlr8/tensor_tree.hpp"
#include "xlr8/trackers.hpp"

namespace xlr8 {

struct AcceleratorOptions {
  std::optional<MixedPrecision> mixed_precision;   // default: ACCELERATE_MIXED_PRECISION / config
  // The program's fp8 recipe (Accelerate's TERecipeKwargs / AORecipeKwargs): wins over the launch's fp8_config;
  // needs mixed_precision fp8.
  std::optional<Fp8Settings> fp8;
  std::optional<int> gradient_accumulation_steps;  // the launch's value wins when it names one (as in Accelerate)
  bool cpu = false;                                // stay on the CPU even with GPUs
  // float32 matmuls on TF32 tensor cores, Ampere and later: what Python sets with
  // torch.backends.cuda.matmul.allow_tf32 (true also turns cuDNN's on; false leaves cuDNN's as it is, on by
  // default). Default: XLR8_ALLOW_TF32 (true/false), else LibTorch's setting (off).
  std::optional<bool> allow_tf32;
  ParallelOptions parallel;                        // passed to the strategy each prepared model gets (DDP: .ddp)
  // Under parallelism_config_pp_size > 1, instead of the launch's _pp_schedule and _pp_microbatches (the DeepSpeed
  // engine's: 1F1B over its accumulation steps, which then are the micro-batches and no accumulation besides).
  std::optional<std::string> pp_schedule;
  std::optional<int> pp_microbatches;
  bool split_batches = false;
  bool even_batches = true;
  bool sync_with_dataloader = true;  // an epoch's last batch always syncs
  std::string project_dir = ".";     // trackers' runs and automatic checkpoints go here
  // Trackers log() writes to ("jsonl", "csv"); empty: XLR8_LOG_WITH (the launcher's --log_with / the config's
  // log_with), else "jsonl".
  std::vector<std::string> log_with;
  bool automatic_checkpoint_naming = false;  // save_state() -> <project_dir>/checkpoints/checkpoint_<N>
  std::optional<int> total_limit;            // keep at most this many automatic checkpoints
  std::optional<ProgressMode> progress;      // progress(): default XLR8_PROGRESS, else AUTO
  // The model's width, for a DeepSpeed config's "auto" bucket sizes (Accelerate reads model.config.hidden_size:
  // reduce_bucket_size h*h, stage3_prefetch_bucket_size 0.9*h*h, stage3_param_persistence_threshold 10*h).
  // 0: the width of the model's first Embedding.
  int64_t model_hidden_size = 0;
  // Under parallelism_config_tp_size, for a model prepare() splits (AutoTP or XLR8_TP_PLAN_FILE): Megatron's sequence
  // parallelism too, norms and dropouts on this rank's share. Default: XLR8_TP_SEQUENCE_PARALLEL, else off.
  std::optional<bool> tp_sequence_parallel;
  // One attention head's features: prepare() refuses a tp split cutting a head. Default: parallelism_config_tp_head_dim
  std::optional<int64_t> tp_head_dim;
};

namespace deepspeed {
struct Config;
}  // namespace deepspeed

namespace detail {
// An object registered for checkpointing: how it becomes the bytes of one file, and back.
struct Checkpointable {
  std::string kind;                                                  // "json", "module" or "optimizer"
  std::function<std::string()> save;
  std::function<void(const std::string&, const std::string&)> load;  // (bytes, the file's path for errors)
};
}  // namespace detail

class Accelerator {
 public:
  // Under `--use_deepspeed --deepspeed_config_file ds.json` the JSON configures the run as DeepSpeed's engine
  // would under Accelerate: its ZeRO stage and keys, fp16 (with its loss scaler) or bf16, accumulation and
  // gradient_clipping (applied at each optimizer step); "auto" values are filled from these options, the
  // launch, the prepared model, data loaders and DummyOptim / DummyScheduler (deepspeed_dummy.hpp).
  explicit Accelerator(AcceleratorOptions options = {});
  // deepspeed::initialize's: `config` (resolved: no "auto" left) configures it instead of the launch's files; the
  // options carry its precision and accumulation.
  Accelerator(const deepspeed::Config& config, AcceleratorOptions options);
  ~Accelerator();
  Accelerator(const Accelerator&) = delete;
  Accelerator& operator=(const Accelerator&) = delete;

  const ProcessState& state() const;
  const ParallelPlan& plan() const;  // what this run does, resolved once: plan().describe() tells it
  int num_processes() const;
  int process_index() const;
  int local_process_index() const;
  bool is_main_process() const;
  bool is_local_main_process() const;
  at::Device device() const;
  MixedPrecision mixed_precision() const;
  int gradient_accumulation_steps() const;
  bool sync_gradients() const;
  bool end_of_dataloader() const;
  // The DeepSpeed JSON this run follows (`--deepspeed_config_file`), with the "auto" values filled so far;
  // null without one. A program asks it whether the JSON defines an "optimizer" or "scheduler".
  const nlohmann::json* deepspeed_config() const;

  // Models: any torch::nn::ModuleHolder (Net, torch::nn::Linear ...) or std::shared_ptr<Module>. The
  // module is moved to the device and gets its parallel strategy (make_parallel_strategy): with several
  // processes its gradients are synchronised (DDP) or it is sharded (ZeRO / FSDP settings). Prepare a
  // sharded model before the optimizer's first step: the optimizer is pointed at this rank's shards.
  template <class Model, std::enable_if_t<!std::is_base_of_v<torch::optim::Optimizer, Model> &&
                                              !std::is_base_of_v<torch::optim::LRScheduler, Model>,
                                          int> = 0>
  Model prepare(Model model) {
    register_model(module_pointer(model));
    return model;
  }
  // Builds a model with `build()` (returning a module holder or shared_ptr) without every process
  // materialising it. Only the main process computes the initial values; the others build it in an
  // EmptyInitScope (no values, no memory) and prepare() gives them theirs; every rank's CPU generator
  // continues from the main process's. Two cases:
  // - tensor parallelism (parallelism_config_tp_size > 1; under FSDP unless fsdp_cpu_ram_efficient_loading
  //   is false): a plan applied inside `build()` or at prepare() slices the empty model, the other ranks
  //   get memory for their slices only, and the main process sends one whole tensor at a time;
  // - FSDP's cpu_ram_efficient_loading: when this run shards parameters (FULL_SHARD / stage 3 over all
  //   processes, not hybrid; units by TRANSFORMER_BASED_WRAP or NO_WRAP, as SIZE_BASED_WRAP may pick
  //   LibTorch's own modules, which open no guard) and fsdp_cpu_ram_efficient_loading is on (the default),
  //   prepare() hands each rank its shards, one unit at a time. Every unit but the root then starts
  //   freed, so each unit's forward must open xlr8::unshard(*this). The main process records `build()`
  //   (DeferredInitScope) and each unit's values are computed as prepare() makes its group, so no rank
  //   holds the whole model. DeepSpeed's zero3_init_flag (unset: on at ZeRO-3, as Accelerate's default) has
  //   every process record `build()` under ZeRO-3 over all processes (no pp or tp, not hybrid): rank 0
  //   computes each group's values and sends them. One process sharding with offload records when
  //   zero3_init_flag or fsdp_cpu_ram_efficient_loading asks. Under pipeline stages (parallelism_config_pp_size
  //   > 1; without tensor-parallel loading; unless either of those is set false) every process records `build()`
  //   and prepare() computes only its own stage's parameters (and the modules its tied layers run; buffers, small,
  //   come at once); a FULL_SHARD / ZeRO-3 stage computes its groups as it makes them, and its units then start
  //   freed as above, so their forward must open xlr8::unshard(*this). Write the parameters inside `build()` or after
  //   prepare(), not between (refused); a build that cannot be recorded fails naming the setting to turn off.
  // Otherwise `build()` runs as it is. Collective in both cases. Prepare the result before reading it.
  template <class Build>
  auto build_model(Build&& build) -> decltype(build()) {
    auto building = begin_model_build();
    auto model = [&] {
      try {
        return build();
      } catch (...) {
        build_failed(*building);
      }
    }();
    built_model(module_pointer(model), *building);
    return model;
  }
  // Optimizers are taken by value (or shared_ptr) and owned by the returned handle.
  template <class Optim, std::enable_if_t<std::is_base_of_v<torch::optim::Optimizer, std::decay_t<Optim>>, int> = 0>
  PreparedOptimizer prepare(Optim&& optimizer) {
    return prepare_optimizer(std::make_shared<std::decay_t<Optim>>(std::move(optimizer)));
  }
  PreparedOptimizer prepare_optimizer(std::shared_ptr<torch::optim::Optimizer> optimizer);
  template <class Sched, std::enable_if_t<std::is_base_of_v<torch::optim::LRScheduler, std::decay_t<Sched>>, int> = 0>
  PreparedScheduler prepare(Sched&& scheduler) {
    return prepare_scheduler(std::make_shared<std::decay_t<Sched>>(std::move(scheduler)));
  }
  PreparedScheduler prepare_scheduler(std::shared_ptr<torch::optim::LRScheduler> scheduler);
  template <class Dataset>
  std::shared_ptr<DataLoader<Dataset>> prepare_data_loader(Dataset dataset, DataLoaderOptions options = {}) {
    auto loader = std::make_shared<DataLoader<Dataset>>(std::move(dataset), options, sharding(), seed(),
                                                        gradient_state(), device());
    register_loader(loader);
    return loader;
  }

  // Accelerate's skip_first_batches: the loader's next iteration starts after this rank's first `n` batches
  // (resuming mid-epoch by hand). Returns the same loader.
  template <class Loader>
  std::shared_ptr<Loader> skip_first_batches(std::shared_ptr<Loader> loader, int64_t n) const {
    loader->skip_first_batches(n);
    return loader;
  }

  // Collective: every rank opens it together (stage 3 gathers every unit).
  template <class Model>
  [[nodiscard]] FullParametersScope summon_full_params(const Model& model, bool writeback = true) {
    return FullParametersScope(&strategy_for_scope(*module_pointer(model)), writeback);
  }

  // Gradient accumulation: the scope decides sync_gradients for this micro-step.
  template <class... Models>
  StepScope accumulate(const Models&... models) {
    return make_step_scope({module_pointer(models).get()...}, /*decide_sync=*/true);
  }
  // Turns gradient synchronisation off for the given (or all) prepared models.
  template <class... Models>
  StepScope no_sync(const Models&... models) {
    return make_step_scope({module_pointer(models).get()...}, /*decide_sync=*/false);
  }
  // A micro-step whose synchronisation the caller decides instead of the accumulation count (DeepSpeed's engine
  // counts its own): with `sync` false gradients stay local, as under no_sync. The forward's autocast is autocast().
  template <class... Models>
  StepScope micro_step(bool sync, const Models&... models) {
    return open_micro_step({module_pointer(models).get()...}, sync);
  }
  at::Tensor scaled_loss(const at::Tensor& loss);  // what backward() propagates for `loss` (below)
  // loss / gradient_accumulation_steps (times the fp16 loss scale), then backward outside autocast.
  // `retain_graph` keeps the graph for another backward through it (as torch's).
  void backward(const at::Tensor& loss, bool retain_graph = false);
  // Under parallelism_config_pp_size > 1 a step is this call in place of forward and backward(): `input` and
  // `target` (this step's batch) are split into the plan's micro-batches along their first dimension, run through
  // the stages by the plan's schedule, and every stage's parameters get the gradients of the mean `loss` over the
  // batch. Returns that loss on every rank; then optimizer.step() as usual. (The first stage reads `input`, the last
  // `target`; the others may pass undefined tensors.) Without stages (pp 1: one process, or dp / tp alone) the
  // prepared Sequential runs the same micro-batches accumulated, so one program trains on every layout and
  // `xlr8 verify` compares its pipelines with one process.
  double pipeline_step(const at::Tensor& input, const at::Tensor& target, const pp::LossFn& loss);
  // The same forwards without gradients: the mean loss over the micro-batches, on every rank (DeepSpeed's
  // eval_batch). Nothing changes in the model or its gradients.
  double pipeline_evaluate(const at::Tensor& input, const at::Tensor& target, const pp::LossFn& loss);
  // This rank's view of the last pipeline_step: {"stage", "stages", "virtual_stages", "schedule", "micro_batches",
  // "step_seconds", "wait_seconds", "bytes_sent", "peak_held_micro_batches", "bubble_formula"}; null without pp.
  nlohmann::json pipeline_stats() const;
  // Clamps the gradients to [-clip_value, clip_value] (after unscaling fp16 ones), on the shards when
  // sharded: elementwise, so the result is the same. Off the sync boundary it does nothing.
  void clip_grad_value(const std::vector<at::Tensor>& parameters, double clip_value);
  // Clips by the global norm across ranks; returns the norm, on the gradients' device until read (GradNorm:
  // converting it to double waits for the device). Off the sync boundary it does nothing and returns 0
  // (the gradients are still partial sums).
  GradNorm clip_grad_norm(const std::vector<at::Tensor>& parameters, double max_norm, double norm_type = 2.0);
  AutocastScope autocast() const;

  // Collectives on tensors.
  at::Tensor gather(const at::Tensor& tensor) const;              // concatenated on dim 0 in rank order
  at::Tensor gather_for_metrics(const at::Tensor& tensor) const;  // drops even_batches padding at the end
  at::Tensor reduce(const at::Tensor& tensor, ReduceOp op = ReduceOp::SUM) const;
  // Context parallelism (parallelism_config_cp_size): this rank's head-tail share of a batch tensor's
  // sequence dimension (inputs, labels), as Accelerate's maybe_context_parallel shards its buffers; under
  // Ulysses (parallelism_config_sp_size) its contiguous share, as DeepSpeed's UlyssesSPDataLoaderAdapter
  // does; the tensor itself when neither is above 1. A length 2 x cp (or sp) does not divide is a
  // ConfigError naming both, and so is one other than a fixed parallelism_config_sp_seq_length.
  at::Tensor shard_sequence(const at::Tensor& tensor, int64_t dim = 1) const;
  // The inverse: the whole sequence from the cp (or sp) group's shares (collective over it).
  at::Tensor unshard_sequence(const at::Tensor& local, int64_t dim = 1) const;
  at::Tensor pad_across_processes(const at::Tensor& tensor, int64_t dim = 0, double pad_index = 0,
                                  bool pad_first = false) const;
  // The same over nested values (tensor_tree.hpp: vectors, maps, pairs, tuples, torch::data::Example and
  // structs with map_tensors), tensor by tensor, keeping the structure. gather needs the same structure,
  // shapes and dtypes on every rank (checked: an Error names the first difference and the rank).
  template <class Tree>
    requires(!std::is_same_v<Tree, at::Tensor>)
  Tree gather(const Tree& tree) const {
    return replace_tensors(tree, gather_tensors(tensors_of(checked_tree(tree)), /*for_metrics=*/false));
  }
  template <class Tree>
    requires(!std::is_same_v<Tree, at::Tensor>)
  Tree gather_for_metrics(const Tree& tree) const {
    return replace_tensors(tree, gather_tensors(tensors_of(checked_tree(tree)), /*for_metrics=*/true));
  }
  template <class Tree>
    requires(!std::is_same_v<Tree, at::Tensor>)
  Tree reduce(const Tree& tree, ReduceOp op = ReduceOp::SUM) const {
    return map_tensors(checked_tree(tree), [&](const at::Tensor& t) { return reduce(t, op); });
  }
  template <class Tree>
    requires(!std::is_same_v<Tree, at::Tensor>)
  Tree pad_across_processes(const Tree& tree, int64_t dim = 0, double pad_index = 0, bool pad_first = false) const {
    return map_tensors(checked_tree(tree),
                       [&](const at::Tensor& t) { return pad_across_processes(t, dim, pad_index, pad_first); });
  }
  void wait_for_everyone() const;
  // Runs `fn` on the main process first, then on the others (e.g. downloading or preprocessing once).
  void main_process_first(const std::function<void()>& fn) const;
  // The same per machine: the local main process of each machine first (Accelerate's local_main_process_first).
  void local_main_process_first(const std::function<void()>& fn) const;
  // Runs `fn` only on the main process / on each machine's local main process (Accelerate's decorators).
  void on_main_process(const std::function<void()>& fn) const {
    if (is_main_process()) fn();
  }
  void on_local_main_process(const std::function<void()>& fn) const {
    if (is_local_main_process()) fn();
  }
  // Every rank's string (JSON text, for instance), in rank order: Accelerate's gather_object.
  std::vector<std::string> gather_object(const std::string& payload) const;
  template <class T>
  std::vector<T> split_between_processes(const std::vector<T>& items, bool apply_padding = false) const {
    auto [begin, end] = split_range(static_cast<int64_t>(items.size()), num_processes(), process_index());
    std::vector<T> mine(items.begin() + begin, items.begin() + end);
    int64_t longest = static_cast<int64_t>((items.size() + num_processes() - 1) / num_processes());
    while (apply_padding && !items.empty() && static_cast<int64_t>(mine.size()) < longest) mine.push_back(items.back());
    return mine;
  }
  template <class... Args>
  void print(fmt::format_string<Args...> format, Args&&... args) const {
    if (is_main_process()) fmt::print("{}\n", fmt::format(format, std::forward<Args>(args)...)), std::fflush(stdout);
  }
  // A progress bar on the main process (nothing elsewhere): a bar on a terminal, plain lines otherwise,
  // as AcceleratorOptions::progress / XLR8_PROGRESS say (progress.hpp).
  ProgressBar progress(int64_t total, ProgressOptions options = {}) const;
  // Accelerate's free_memory, between two trainings: every prepared model becomes a plain module again
  // (sharded parameters gathered whole into the module's own tensors, hooks removed, gradients dropped),
  // and the Accelerator lets go of its models, strategies with their buffers, optimizers, schedulers,
  // data loaders and objects registered for checkpointing; step() restarts at 0. Memory is returned to the
  // system once the caller drops its own handles too. Optimizer and scheduler handles prepared before
  // refuse to step afterwards. Collective; not inside accumulate() / no_sync().
  void free_memory();
  // Seeds LibTorch's generators (and the default data-loader shuffle seed); device_specific adds the rank.
  void set_seed(uint64_t seed, bool device_specific = false);
  template <class Model>
  Model unwrap_model(Model model) const {
    return model;  // xlr8 never wraps the module: hooks do the synchronisation
  }
  // Accelerate's trackers. init_trackers starts a run in <project_dir>/<project_name>/<run_name>/ (run name from the
  // time unless given; never an existing run's directory) with `config` stored as config.json, on the main process.
  // log() sends {"step": step, ...values} to every tracker (starting a run of project "xlr8" if none was started).
  void init_trackers(const std::string& project_name, const nlohmann::json& config = nlohmann::json::object(),
                     const std::string& run_name = "");
  void log(const nlohmann::json& values, std::optional<int64_t> step = std::nullopt);  // end_training() closes them
  // The tracker of that name (null on processes other than the main one); Error if it is not logging.
  Tracker* get_tracker(const std::string& name);
  std::string run_dir() const;  // the current run's directory ("" before a run starts or off the main process)
  void end_training();

  // Accelerate's register_for_checkpointing: save_state/load_state also save and restore `object`, in
  // registration order (a checkpoint with other objects registered is refused). Anything with
  // `nlohmann::json state() const` and `void load_state(const nlohmann::json&)`, a LibTorch module
  // (its parameters and buffers, strictly by name) or optimizer (its archive). Kept by reference: it
  // must outlive the Accelerator's use of it.
  template <class T>
  void register_for_checkpointing(T& object) {
    if constexpr (requires { typename T::ContainedType; object.ptr(); }) {
      register_for_checkpointing(*object.ptr());  // TORCH_MODULE's holder: its module
    } else if constexpr (std::is_base_of_v<torch::nn::Module, T>) {
      register_checkpointable({"module", [&object] { return module_bytes(object); },
                               [&object](const std::string& bytes, const std::string& origin) {
                                 load_module_bytes(object, bytes, origin);
                               }});
    } else if constexpr (std::is_base_of_v<torch::optim::Optimizer, T>) {
      register_checkpointable({"optimizer", [&object] { return optimizer_archive(object); },
                               [&object](const std::string& bytes, const std::string& origin) {
                                 load_optimizer_archive(object, bytes, origin);
                               }});
    } else {
      register_checkpointable({"json", [&object] { return object.state().dump(); },
                               [&object](const std::string& bytes, const std::string& origin) {
                                 object.load_state(nlohmann::json::parse(bytes));
                               }});
    }
  }
  template <class T>
  void register_for_checkpointing(const std::shared_ptr<T>& object) {
    register_for_checkpointing(*object);
  }

  // Checkpoints (crash-safe, checksummed). Without a directory: automatic naming under project_dir.
  std::string save_state(const std::string& dir = "");
  void load_state(const std::string& dir = "");
  // The newest automatic checkpoint under project_dir/checkpoints that save_state() completed, as this process sees
  // the filesystem (a save cut short leaves only a .partial directory, which does not count): what load_state()
  // without a directory loads. None on a first start, so that "resume from the latest" can start fresh instead.
  std::optional<std::string> latest_checkpoint() const;
  // Hugging Face layout: model.safetensors, or shards plus model.safetensors.index.json.
  template <class Model>
  void save_model(const Model& model, const std::string& dir, const std::string& max_shard_size = "10GB") const {
    save_module(*module_pointer(model), dir, max_shard_size);
  }
  // Reads what save_model writes (a directory, model.safetensors, or model.safetensors.index.json with
  // its shards) into `model` by name. `strict`: exactly the model's names (else missing ones keep their
  // values and unexpected ones are ignored); shapes must always match. Nothing changes when it throws.
  // A prepared model: collective; rank 0 reads each tensor once and every rank keeps the part it holds
  // (its shard, when sharded), so ranks other than 0 need neither the file nor the whole model in memory.
  template <class Model>
  void load_model(const Model& model, const std::string& path, bool strict = true) {
    load_module(*module_pointer(model), path, strict);
  }

  int64_t step() const;  // optimizer steps taken by the first prepared optimizer
  double loss_scale() const;  // the fp16 dynamic loss scale; 1 otherwise
  // The prepared model's strategy: {"strategy": "single" | "ddp" | "zero1" | "zero2" | "zero3", ...}; DDP adds
  // buckets, launches, overlapped_launches and exposed_comm_seconds; ZeRO its groups, gathers, launches and bytes.
  template <class Model>
  nlohmann::json parallel_stats(const Model& model) const {
    return strategy_of(*module_pointer(model)).stats();
  }
  // Accelerate's get_state_dict: the model's whole parameters and buffers by name on the main process (names,
  // dtypes and shapes as meta tensors elsewhere), gathered one unit at a time when sharded. Collective.
  template <class Model>
  StateDict get_state_dict(const Model& model) const {
    return strategy_of(*module_pointer(model)).state_dict(StateDictKind::FULL_ON_MAIN);
  }

 private:
  template <class Tree>
  static const Tree& checked_tree(const Tree& tree) {
    static_assert(is_tensor_tree_v<Tree>,
                  "every leaf must be an at::Tensor, in vectors, maps, pairs, tuples or structs with map_tensors "
                  "(tensor_tree.hpp); use gather_object for other values");
    return tree;
  }
  template <class Tree>
  static Tree replace_tensors(const Tree& tree, const std::vector<at::Tensor>& replacements) {
    size_t next = 0;
    return map_tensors(tree, [&](const at::Tensor&) { return replacements.at(next++); });
  }
  // Checks that every rank passes the same tensor shapes and dtypes, then gathers each.
  std::vector<at::Tensor> gather_tensors(const std::vector<at::Tensor>& tensors, bool for_metrics) const;
  void register_checkpointable(detail::Checkpointable object);
  static std::string module_bytes(const torch::nn::Module& module);
  static void load_module_bytes(torch::nn::Module& module, const std::string& bytes, const std::string& origin);
  static std::string optimizer_archive(const torch::optim::Optimizer& optimizer);
  static void load_optimizer_archive(torch::optim::Optimizer& optimizer, const std::string& bytes,
                                     const std::string& origin);
  template <class M>
  static std::shared_ptr<torch::nn::Module> module_pointer(const M& m) {
    if constexpr (std::is_convertible_v<M, std::shared_ptr<torch::nn::Module>>) return m;
    else return m.ptr();
  }
  void register_model(std::shared_ptr<torch::nn::Module> module);
  bool rank0_loading() const;  // build_model's conditions: FSDP's ...
  bool tp_loading() const;     // ... or tensor parallelism's
  struct ModelBuild;           // what build_model holds while `build()` runs (accelerator.cpp)
  std::shared_ptr<ModelBuild> begin_model_build();
  void built_model(const std::shared_ptr<torch::nn::Module>& module, ModelBuild& building);
  // Rethrows the exception `build()` threw; a recorded build's says how to build the model whole instead.
  [[noreturn]] void build_failed(ModelBuild& building);
  const ParallelStrategy& strategy_of(const torch::nn::Module& module) const;
  ParallelStrategy& strategy_for_scope(const torch::nn::Module& module);
  void register_loader(std::shared_ptr<DataLoaderBase> loader);
  StepScope make_step_scope(std::vector<torch::nn::Module*> modules, bool decide_sync);
  StepScope open_micro_step(std::vector<torch::nn::Module*> modules, bool sync);
  void save_module(const torch::nn::Module& module, const std::string& dir, const std::string& max_shard_size) const;
  void load_module(torch::nn::Module& module, const std::string& path, bool strict);
  std::string save_state_unguarded(const std::string& dir);
  void load_state_unguarded(const std::string& dir);
  ShardingOptions sharding() const;
  uint64_t seed() const;
  std::shared_ptr<GradientState> gradient_state() const;

  std::unique_ptr<AcceleratorImpl> impl_;
};

}  // namespace xlr8
