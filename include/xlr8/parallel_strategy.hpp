#pragma once
// The seam every data-parallel strategy plugs into: one object per prepared model, picked once by
// make_parallel_strategy from the process state. The Accelerator talks only to this interface, so DDP
// today and ZeRO-1/2/3 / FSDP next live entirely in src/parallel/.
//
// Why this shape: the strategy owns the module it was
// given, so a model is prepared once and everything the Accelerator needs about it (sync switch, hook
// before forward, what the optimizer updates, the step, the norm, state dicts, statistics) is one
// virtual call away; replicas share the defaults below and only override what differs.
#include <ATen/core/Tensor.h>
#include <torch/nn/module.h>
#include <torch/optim/optimizer.h>

#include <functional>
#include <memory>
#include <nlohmann/json.hpp>
#include <mutex>
#include <string>
#include <unordered_set>
#include <vector>

#include "xlr8/grad_norm.hpp"
#include "xlr8/gradient_state.hpp"
#include "xlr8/named_tensors.hpp"
#include "xlr8/placement.hpp"
#include "xlr8/process_state.hpp"

namespace xlr8 {

struct ParallelOptions;  // xlr8/parallel_options.hpp: each strategy's own options

// FULL: every tensor whole, by name, on every rank. FULL_ON_MAIN: the same on the strategy group's rank 0
// (FSDP's rank0_only; what save_model and save_state write), and elsewhere only names, dtypes and shapes
// (meta tensors, no memory). SHARDED: what this rank holds (views of its shards; with the parameters on disk, read
// in for the purpose and valid until the next optimizer step, which puts them back).
enum class StateDictKind { FULL, SHARDED, FULL_ON_MAIN };
// Named tensors in the module's order (parameters, then buffers), as PyTorch's state_dict orders them.
using StateDict = NamedTensors;

// A part of one parameter that this rank holds, for checkpoints that any strategy and process count can
// read back: `values` is the tensor the optimizer updates for it (the parameter itself for replicas, a
// shard leaf when sharded; its optimizer state has its shape) and holds `placement`'s elements of the
// whole parameter (a tensor-parallel slice's boxes, then the strategy's flat chunk of those). `writes`
// says whether this rank is the one that saves it (hybrid sharding: the first replica's).
struct ParameterPiece {
  std::string name;
  Placement placement;
  at::Tensor values;
  bool writes = true;
};

// Offload's disk tier: one group of a strategy's tensors held in memory (ParallelStrategy::hold_in_memory).
// release() puts it back (writing what a holder for writing changed) and throws when that fails; the destructor
// releases too, and only logs a failure.
class HeldInMemory {
 public:
  virtual ~HeldInMemory() = default;
  virtual void release() = 0;
};
// reading: the values go back unwritten. writing: the holder may change them; they are written back at release.
enum class HoldFor { reading, writing };

class ParallelStrategy {
 public:
  virtual ~ParallelStrategy() = default;
  // "single" (one process, nothing to synchronise), "ddp", or "zero1" / "zero2" / "zero3".
  virtual std::string name() const = 0;
  const std::shared_ptr<torch::nn::Module>& module() const { return module_; }

  // Called at the start of every accumulate()/no_sync() scope, before the forward pass. Whether this
  // step's backward synchronises has one owner, the GradientState the strategy was made with (its
  // sync_gradients: the accumulation boundary); `suspend_sync` is no_sync()'s request for this model.
  // Here DDP broadcasts buffers; ZeRO-3 / FSDP gather their first unit.
  virtual void begin_step(bool /*suspend_sync*/) {}
  // At the end of the scope: outside scopes every backward synchronises, as DDP without no_sync.
  virtual void end_step() {}
  // Outside any backward: reduces now the gradients backwards accumulated with sync suspended, as a synchronising
  // backward would have at its end (an interleaved pipeline's chunks finish their backwards apart). Nothing to do
  // without data parallelism.
  virtual void reduce_accumulated_gradients() {}
  // The tensors the optimizer updates: the full parameters for replicas, this rank's shards when sharded.
  virtual std::vector<at::Tensor> optimizer_parameters() const { return module_->parameters(); }
  // Whether `tensor` is one of this strategy's parameters: the module's, or one optimizer_parameters()
  // returns (a sharded parameter has both identities). What the Accelerator asks to find a tensor's model.
  virtual bool owns(const at::Tensor& tensor) const;
  // Points an optimizer built over the module's parameters at what optimizer_parameters() returns (in
  // place, group by group, keeping each group's options). Before the optimizer's first step.
  virtual void bind_optimizer(torch::optim::Optimizer& /*optimizer*/) const {}
  // One optimizer step: plain for replicas; shard step plus all-gather when sharded.
  virtual void optimizer_step(torch::optim::Optimizer& optimizer) { optimizer.step(); }
  // Offload's disk tier: the optimizer state this strategy keeps on disk, all in memory (true: a checkpoint
  // reads or replaces it) or back on disk (false: what the optimizer holds then is written out).
  virtual void optimizer_state_in_memory(torch::optim::Optimizer& /*optimizer*/, bool /*in_memory*/) {}
  // Offload's disk tier, one group at a time (what checkpoints use, so that state larger than memory can be saved
  // and loaded): keeps the group holding `leaf` (a ParameterPiece's values) in memory until the handle is released:
  // without `optimizer`, its parameter values; with one, that optimizer's state for the group's leaves. A live
  // handle of the same group is shared. Null when nothing of it is on disk.
  virtual std::shared_ptr<HeldInMemory> hold_in_memory(const at::Tensor& /*leaf*/, torch::optim::Optimizer* /*optimizer*/,
                                                       HoldFor /*purpose*/) {
    return nullptr;
  }
  // Clips `parameters` (of this strategy's module) to the global gradient norm and returns it. Replicas
  // hold identical synchronised gradients, so their local norm is the global one; sharded strategies
  // reduce partial norms over the groups that hold different parts. Nothing is read back (GradNorm).
  virtual GradNorm clip_grad_norm(const std::vector<at::Tensor>& parameters, double max_norm, double norm_type);
  // The tensors whose .grad holds this rank's gradients of `parameters` (of this strategy's module): the
  // parameters themselves for replicas, their shard leaves when sharded. For elementwise gradient work.
  virtual std::vector<at::Tensor> gradient_holders(const std::vector<at::Tensor>& parameters) const { return parameters; }
  // Offload's disk tier with the gradients on disk (ZeroOptions::Disk::gradients): gradients of `parameters` (those of
  // this strategy's module; others are ignored) that wait on disk for the step have no .grad; `op` (elementwise, given each one's 1-dimensional
  // gradient) is queued for each and runs, in order, as the step reads it; an empty `op` sets them to none. Whether
  // any was on disk.
  virtual bool queue_on_disk_gradients(const std::vector<at::Tensor>& /*parameters*/,
                                       const std::function<void(at::Tensor&)>& /*op*/) {
    return false;
  }
  // Whether a gradient of `parameters` waiting on disk holds an inf or NaN now (fp16's overflow check).
  virtual bool non_finite_gradients_on_disk(const std::vector<at::Tensor>& /*parameters*/) { return false; }
  // Whether every rank holds the whole synchronised gradients (replicas), so that a gradient norm over
  // parameters of several such models is the local one.
  virtual bool replicated() const { return true; }
  // Parameters and buffers by name. Collective: every rank of the strategy's group calls it together
  // (a sharded FULL state dict gathers).
  virtual StateDict state_dict(StateDictKind kind) const;
  // Copies `state` into the module, strictly: exactly the module's names, shapes and dtypes
  // (ConfigError naming every difference otherwise). Collective, as state_dict.
  virtual void load_state_dict(const StateDict& state, StateDictKind kind);
  // Names, dtypes and shapes of state_dict(FULL), as meta tensors: nothing is gathered.
  virtual StateDict full_state_layout() const;
  // The whole parameters and buffers one at a time in that order, fn(index, tensor), at least on the
  // group's rank 0 (FSDP's rank0_only): at most one sharding unit is gathered at a time (and the root's,
  // whose parameters are spread over the module's order), so a model larger than one rank's memory can
  // be written. Collective.
  virtual void visit_full_state(const std::function<void(size_t, const at::Tensor&)>& fn) const;
  // Every parameter of the module, as the parts this rank holds (in the module's order). Replicas: each
  // parameter whole. No communication.
  virtual std::vector<ParameterPiece> parameter_pieces() const;
  // The same, leaving values kept on disk there (offload's disk tier): read or write them under hold_in_memory.
  virtual std::vector<ParameterPiece> parameter_pieces_where_they_are() const { return parameter_pieces(); }
  // Offload's disk tier: whether parameters or optimizer state live on disk. A load then reads the checkpoint as it
  // writes it, one group at a time (checked first); otherwise it reads everything before changing anything.
  virtual bool keeps_state_on_disk() const { return false; }
  // After new values were copied into parameter_pieces()' `values`: whole copies catch up. Collective,
  // unless `whole_parameters_written` (the caller also wrote every parameter that holds memory whole):
  // then only local copies (low-precision shards of fp32 masters) are refreshed.
  virtual void parameter_pieces_loaded(bool /*whole_parameters_written*/ = false) {}
  // FSDP's summon_full_params: every parameter whole and current until release_full_parameters(), which
  // with `writeback` keeps changes made to them meanwhile. Collective; replicas are always whole.
  virtual void gather_full_parameters() {}
  virtual void release_full_parameters(bool /*writeback*/) {}
  // Figures for tests, benchmarks and logs: at least {"strategy": name()}.
  virtual nlohmann::json stats() const { return {{"strategy", name()}}; }

 protected:
  explicit ParallelStrategy(std::shared_ptr<torch::nn::Module> module) : module_(std::move(module)) {}

 private:
  std::shared_ptr<torch::nn::Module> module_;
  mutable std::once_flag owned_once_;
  mutable std::unordered_set<const c10::TensorImpl*> owned_;  // owns()'s, built on its first call
};

// A module's parameters, then its buffers, by name: the order PyTorch's state_dict uses.
StateDict module_state_dict(const torch::nn::Module& module);

// Collective over `data_parallel` when it has several ranks. One rank: "single". Several: "ddp" for
// options.zero.stage 0 (or -1), else the ZeRO stage's sharded strategy. Without `gradient_state`, every
// step is a synchronisation boundary.
std::unique_ptr<ParallelStrategy> make_parallel_strategy(std::shared_ptr<torch::nn::Module> module,
                                                         Communicator data_parallel, const ParallelOptions& options,
                                                         std::shared_ptr<const GradientState> gradient_state = nullptr);
// The same over the process's data-parallel group, with options.zero.stage -1 meaning the stage (and
// units) the process's FSDP / DeepSpeed settings ask for.
std::unique_ptr<ParallelStrategy> make_parallel_strategy(std::shared_ptr<torch::nn::Module> module,
                                                         const ProcessState& state, const ParallelOptions& options,
                                                         std::shared_ptr<const GradientState> gradient_state = nullptr);

}  // namespace xlr8
