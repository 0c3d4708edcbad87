#pragma once
// Pipeline parallelism (issue 46, first part): a model that is a sequence of layers is cut into stages, one per
// rank of the pp group; a step's global batch is split into micro-batches that flow through the stages by a
// schedule (torch.distributed.pipelining's names: GPipe, 1F1B), activations forward and their gradients backward
// going point to point between neighbouring stages. The gradients each stage accumulates are one process's on the
// same global batch: the loss of each micro-batch is divided by their number, as one process's mean is.
//
//   auto stage = xlr8::pp::stage_of(model, pp.size(), pp.rank());        // this rank's layers only
//   xlr8::pp::Pipeline pipe(stage, pp, xlr8::pp::Schedule::OneFOneB, 8);  // 8 micro-batches a step
//   double loss = pipe.step(inputs, targets, loss_fn);                     // forward and backward of the step
//   optimizer.step();
//
// Under the Accelerator (parallelism_config_pp_size, Accelerator::pipeline_step) a stage is also data- and
// tensor-parallel over the ranks that hold the same stage; deepspeed_pipeline.hpp has DeepSpeed's PipelineModule and
// engine API over it. InterleavedZeroBubble splits each backward into its inputs' part and its parameters' part,
// the latter deferred to fill the bubble.
#include <ATen/core/Tensor.h>
#include <torch/nn/modules/container/sequential.h>

#include <functional>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "xlr8/communicator.hpp"

namespace xlr8::pp {

enum class Schedule { GPipe, OneFOneB, Interleaved1F1B, InterleavedZeroBubble };
std::string to_string(Schedule schedule);  // "GPipe", "1F1B", "Interleaved1F1B", "InterleavedZeroBubble"
// torch's names (case-insensitive); another is an error naming the valid ones.
Schedule parse_schedule(const std::string& name);

// One thing a stage does: the forward or the backward of a micro-batch, through one of its chunks (its virtual
// stages under the interleaved schedules: chunk c of rank r is stage c * stages + r of stages * chunks; 0 otherwise).
// Under InterleavedZeroBubble a Backward computes the gradients of the chunk's input only (what the previous stage
// waits for) and a later Weight those of its parameters.
struct Action {
  enum Kind { Forward, Backward, Weight } kind;
  int micro_batch;
  int chunk = 0;
  bool operator==(const Action&) const = default;
};
// What `stage` of `stages` does in one step of `micro_batches`, in order. GPipe: every forward, then every
// backward. 1F1B: stages - 1 - stage forwards to fill the pipe, then one forward and one backward in turn, then the
// remaining backwards: a stage holds at most stages - stage micro-batches' activations instead of all of them.
// Interleaved1F1B (Megatron's; `chunks` of 2 or more, micro_batches a multiple of stages): the same through each
// rank's chunks in turn, `stages` micro-batches at a time, which divides the ramp's idle time by `chunks`.
// InterleavedZeroBubble (`chunks` 1 or more): the order of 1F1B (or Interleaved1F1B), each Backward the inputs' part
// alone, and each Weight `stage` backwards after its Backward (the zero-bubble paper's ZB-H1 placement: a later
// stage defers more, so the gradients travel back sooner and the deferred weights fill the ramp): a stage holds at
// most `stages` micro-batches' activations, as 1F1B's first stage does.
std::vector<Action> actions(Schedule schedule, int stages, int micro_batches, int stage, int chunks = 1);
// The idle fraction the schedule's shape gives with equal stages: (p - 1) / (v m + p - 1), v = chunks (1 but for
// the interleaved schedules); for InterleavedZeroBubble, with a forward, an inputs' part and a weights' part of
// equal time, (p - 1) / (3 v m + p - 1) of the whole.
double bubble_fraction(Schedule schedule, int stages, int micro_batches, int chunks = 1);

// How a sequence of layers is cut: equal numbers of layers, or equal numbers of parameters (DeepSpeed's
// partition_method "uniform" and "parameters").
enum class Partition { Uniform, Parameters };
// The first layer of each stage and one past the last, for layers of the given parameter counts; every stage gets
// at least one layer (more stages than layers is an error naming both).
std::vector<std::pair<size_t, size_t>> partition(const std::vector<int64_t>& layer_parameters, int stages,
                                                 Partition how);
// A Sequential cut where it says rather than by parameters: `part_starts` holds the first layer of each of the
// stages x chunks parts (0 first, ascending); empty: by parameters. DeepSpeed's PipelineModule is one (its
// partition_method decides the starts); a program may build one to cut at its own boundaries.
class PartitionedSequentialImpl : public torch::nn::SequentialImpl {
 public:
  using SequentialImpl::SequentialImpl;
  std::vector<size_t> part_starts;
  // Layers a recomputed region holds when a pipeline runs its stages (activation checkpointing); 0: none.
  int activation_checkpoint_interval = 0;
};
TORCH_MODULE(PartitionedSequential);

// `layers` in order on `x`; with gradients on and `checkpoint_interval` > 0, each run of that many layers is one
// checkpointed region (xlr8::checkpoint: its activations recomputed in backward, as DeepSpeed's pipeline does).
at::Tensor forward_layers(const torch::nn::Sequential& layers, at::Tensor x, int checkpoint_interval);

// The parts `whole` is cut into for `stages` x `chunks` virtual stages: its own starts (PartitionedSequential,
// checked), else by `how`. Part p is rank p % stages's chunk p / stages.
std::vector<std::pair<size_t, size_t>> parts_of(const torch::nn::Sequential& whole, int stages, int chunks,
                                                Partition how = Partition::Parameters);
// Stage `stage` of `stages` of `whole`: a Sequential of its layers (the same modules, not copies).
torch::nn::Sequential stage_of(const torch::nn::Sequential& whole, int stages, int stage,
                               Partition how = Partition::Parameters);
// The same with `chunks` virtual stages a rank (the model cut into stages * chunks parts): the rank's layers of
// every chunk in chunk order, and how many of them each chunk has.
struct StageLayers {
  torch::nn::Sequential layers;
  std::vector<size_t> chunk_sizes;
  std::vector<std::pair<size_t, size_t>> parts;  // the whole model's parts (parts_of), as cut
};
StageLayers stage_layers(const torch::nn::Sequential& whole, int stages, int stage, int chunks,
                         Partition how = Partition::Parameters);

using LossFn = std::function<at::Tensor(const at::Tensor& output, const at::Tensor& target)>;

// A layer that runs a module another layer of the model also runs (DeepSpeed's TiedLayerSpec: the embedding whose
// weight is the output head's too). `forward` says how this layer uses it (empty: the module's own forward). The
// first layer of a key in the whole model owns the module: its parameters are named there ("<layer>.<key>.weight"),
// trained and saved once. In one process the layers share the module and autograd sums its gradients. Under pp a
// later stage holding the key runs its own copy, which takes the owner's values at the start of each
// pipeline_step and hands its gradient to the owner at the end: the copies stay equal and the gradients summed.
using TiedForward = std::function<at::Tensor(torch::nn::Module& module, const at::Tensor& input)>;
class TiedLayerImpl : public torch::nn::Module {
 public:
  // `key`: a name without dots, the same for every layer of one module.
  TiedLayerImpl(std::string key, torch::nn::AnyModule module, TiedForward forward, bool owner);
  at::Tensor forward(const at::Tensor& input);
  // A layer that does not own its module (not registered under it) still switches it between train and eval.
  void train(bool on = true) override;
  const std::string& key() const { return key_; }
  bool owner() const { return owner_; }
  torch::nn::Module& tied() const { return *module_.ptr(); }
  // A later stage's layer gets its own copy of the module (the owner's may be released with its stage).
  void take_copy() { module_ = module_.clone(); }
  void share_module_of(const TiedLayerImpl& other) { module_ = other.module_; }

 private:
  std::string key_;
  torch::nn::AnyModule module_;
  TiedForward forward_;
  bool owner_;
};
TORCH_MODULE(TiedLayer);

class Pipeline {
 public:
  // `group`: the pp group, rank r holding stage r. Activations cross it point to point. Under Interleaved1F1B
  // `stage` is the rank's layers of every chunk and `chunk_sizes` (StageLayers') how many each chunk has; empty:
  // one chunk of them all.
  Pipeline(torch::nn::Sequential stage, Communicator group, Schedule schedule, int micro_batches,
           std::vector<size_t> chunk_sizes = {});

  // One step: the first stage reads `inputs` (one tensor per micro-batch), the last `targets` and `loss`
  // (a mean over its micro-batch); other stages may pass empty vectors. Every stage's parameters accumulate the
  // gradients of the mean loss over the micro-batches. Returns that mean loss on every stage.
  double step(const std::vector<at::Tensor>& inputs, const std::vector<at::Tensor>& targets, const LossFn& loss);
  // The same forwards without gradients (DeepSpeed's eval_batch): the mean loss, on every stage.
  double evaluate(const std::vector<at::Tensor>& inputs, const std::vector<at::Tensor>& targets, const LossFn& loss);

  // Called before each backward of a step with whether it is this stage's last: the micro-batches are gradient
  // accumulation steps, so data parallelism reduces the stage's gradients in that one (as torchtitan's FSDP under
  // pp), not in every micro-batch's.
  void set_before_backward(std::function<void(bool last_of_step)> hook) { before_backward_ = std::move(hook); }
  // Each chunk's forward in checkpointed regions of this many layers (forward_layers); 0: none.
  void set_activation_checkpoint_interval(int layers) { checkpoint_interval_ = layers; }

  // The last step as this stage saw it: its seconds in step(), those spent waiting for a neighbour (the idle
  // time the schedule's bubble makes, plus transfers), the bytes it sent, and the most micro-batches whose
  // activations it held at once (over its chunks).
  double last_step_seconds() const { return step_seconds_; }
  double last_wait_seconds() const { return wait_seconds_; }
  int64_t last_bytes_sent() const { return bytes_sent_; }
  int last_peak_held() const { return peak_held_; }
  // Under InterleavedZeroBubble: the last step's backwards (a micro-batch's, or a checkpointed region's inside it)
  // that could not be split (a custom autograd Function not declared pure or a hook where the weights' graph leaves
  // the input's path; with a weight used at two depths, any such node or checkpointed region on that path) and ran
  // whole. The first stage's backward, which no input's gradient waits for, is one backward by design and
  // not counted.
  int last_whole_backwards() const { return whole_backwards_; }
  // Under InterleavedZeroBubble: the last step's checkpointed regions (activation checkpointing) whose backward
  // was split as the stage's is, their weights' gradients left to the weights' part.
  int last_split_regions() const { return split_regions_; }

 private:
  // A tensor from stage `from`: its shape and dtype first, checked against the step's first micro-batch's
  // (`agreed`, set by the first), then its values.
  at::Tensor receive(int from, int tag, std::vector<int64_t>& agreed, const char* what);
  // Hands `tensor` to stage `to` without waiting for it to arrive (`in_flight` keeps it alive until the step ends).
  void send(const at::Tensor& tensor, int to, int tag);
  double run(const std::vector<at::Tensor>& inputs, const std::vector<at::Tensor>& targets, const LossFn& loss,
             bool train);
  void check_micro_batches(const std::vector<at::Tensor>& inputs, const std::vector<at::Tensor>& targets) const;

  std::vector<Work> pending_;
  std::vector<at::Tensor> in_flight_;

  torch::nn::Sequential stage_;
  std::vector<torch::nn::Sequential> chunks_;  // views of stage_'s layers, one per virtual stage
  Communicator group_;
  Schedule schedule_;
  int micro_batches_;
  int checkpoint_interval_ = 0;
  std::function<void(bool)> before_backward_;
  double wait_seconds_ = 0, step_seconds_ = 0;
  int peak_held_ = 0, whole_backwards_ = 0, split_regions_ = 0;
  int64_t bytes_sent_ = 0;
};

}  // namespace xlr8::pp
