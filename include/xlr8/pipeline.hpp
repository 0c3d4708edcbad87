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
// tensor-parallel over the ranks that hold the same stage. Not yet: the DeepSpeed engine's API and zero-bubble
// schedules.
#include <ATen/core/Tensor.h>
#include <torch/nn/modules/container/sequential.h>

#include <functional>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "xlr8/communicator.hpp"

namespace xlr8::pp {

enum class Schedule { GPipe, OneFOneB, Interleaved1F1B };
std::string to_string(Schedule schedule);  // "GPipe", "1F1B", "Interleaved1F1B"
// torch's names (case-insensitive); another is an error naming the valid ones.
Schedule parse_schedule(const std::string& name);

// One thing a stage does: the forward or the backward of a micro-batch, through one of its chunks (its virtual
// stages under Interleaved1F1B: chunk c of rank r is stage c * stages + r of stages * chunks; 0 otherwise).
struct Action {
  enum Kind { Forward, Backward } kind;
  int micro_batch;
  int chunk = 0;
  bool operator==(const Action&) const = default;
};
// What `stage` of `stages` does in one step of `micro_batches`, in order. GPipe: every forward, then every
// backward. 1F1B: stages - 1 - stage forwards to fill the pipe, then one forward and one backward in turn, then the
// remaining backwards: a stage holds at most stages - stage micro-batches' activations instead of all of them.
// Interleaved1F1B (Megatron's; `chunks` of 2 or more, micro_batches a multiple of stages): the same through each
// rank's chunks in turn, `stages` micro-batches at a time, which divides the ramp's idle time by `chunks`.
std::vector<Action> actions(Schedule schedule, int stages, int micro_batches, int stage, int chunks = 1);
// The idle fraction the schedule's shape gives with equal stages: (p - 1) / (v m + p - 1), v = chunks (1 but for
// Interleaved1F1B).
double bubble_fraction(Schedule schedule, int stages, int micro_batches, int chunks = 1);

// How a sequence of layers is cut: equal numbers of layers, or equal numbers of parameters (DeepSpeed's
// partition_method "uniform" and "parameters").
enum class Partition { Uniform, Parameters };
// The first layer of each stage and one past the last, for layers of the given parameter counts; every stage gets
// at least one layer (more stages than layers is an error naming both).
std::vector<std::pair<size_t, size_t>> partition(const std::vector<int64_t>& layer_parameters, int stages,
                                                 Partition how);
// Stage `stage` of `stages` of `whole`: a Sequential of its layers (the same modules, not copies).
torch::nn::Sequential stage_of(const torch::nn::Sequential& whole, int stages, int stage,
                               Partition how = Partition::Parameters);
// The same with `chunks` virtual stages a rank (the model cut into stages * chunks parts): the rank's layers of
// every chunk in chunk order, and how many of them each chunk has.
struct StageLayers {
  torch::nn::Sequential layers;
  std::vector<size_t> chunk_sizes;
};
StageLayers stage_layers(const torch::nn::Sequential& whole, int stages, int stage, int chunks,
                         Partition how = Partition::Parameters);

using LossFn = std::function<at::Tensor(const at::Tensor& output, const at::Tensor& target)>;

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

  // Called before each backward of a step with whether it is this stage's last: the micro-batches are gradient
  // accumulation steps, so data parallelism reduces the stage's gradients in that one (as torchtitan's FSDP under
  // pp), not in every micro-batch's.
  void set_before_backward(std::function<void(bool last_of_step)> hook) { before_backward_ = std::move(hook); }

  // The last step as this stage saw it: its seconds in step(), those spent waiting for a neighbour (the idle
  // time the schedule's bubble makes, plus transfers), the bytes it sent, and the most micro-batches whose
  // activations it held at once (over its chunks).
  double last_step_seconds() const { return step_seconds_; }
  double last_wait_seconds() const { return wait_seconds_; }
  int64_t last_bytes_sent() const { return bytes_sent_; }
  int last_peak_held() const { return peak_held_; }

 private:
  // A tensor from stage `from`: its shape and dtype first, checked against the step's first micro-batch's
  // (`agreed`, set by the first), then its values.
  at::Tensor receive(int from, int tag, std::vector<int64_t>& agreed, const char* what);
  // Hands `tensor` to stage `to` without waiting for it to arrive (`in_flight` keeps it alive until the step ends).
  void send(const at::Tensor& tensor, int to, int tag);

  std::vector<Work> pending_;
  std::vector<at::Tensor> in_flight_;

  torch::nn::Sequential stage_;
  std::vector<torch::nn::Sequential> chunks_;  // views of stage_'s layers, one per virtual stage
  Communicator group_;
  Schedule schedule_;
  int micro_batches_;
  std::function<void(bool)> before_backward_;
  double wait_seconds_ = 0, step_seconds_ = 0;
  int peak_held_ = 0;
  int64_t bytes_sent_ = 0;
};

}  // namespace xlr8::pp
