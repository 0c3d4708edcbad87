#pragma once
// DeepSpeed's pipeline API (deepspeed.pipe, reference/002): a model given as a list of layer specs, cut into stages
// by partition_method, each rank building only its own stage's layers; the engine's train_batch / eval_batch run a
// batch's micro-batches (gradient_accumulation_steps of them) through the stages by 1F1B, as DeepSpeed's
// TrainSchedule does, composed with the stage's data parallelism (DDP, ZeRO 1-3, FSDP) and tp.
//
//   using namespace xlr8::deepspeed;
//   auto embed = LayerSpec::of<torch::nn::Embedding>(vocab, width);
//   PipelineModule model({TiedLayerSpec("embed", embed), LayerSpec::of<Block>(width), LayerSpec::of<Block>(width),
//                         TiedLayerSpec("embed", embed, [](torch::nn::Module& m, const at::Tensor& x) {
//                           return at::matmul(x, m.as<torch::nn::Embedding>()->weight.t());  // the output head
//                         })},
//                        PipelineModuleOptions{.loss_fn = cross_entropy, .partition_method = "type:Block"});
//   auto [engine, optimizer, scheduler] = xlr8::deepspeed::initialize(model, "ds_config.json");
//   double loss = engine->train_batch([&] { return next_micro_batch(); });  // {inputs, labels}
//
// Launch with --parallelism_config_pp_size N (or the JSON's "pipeline": {"stages": N}); num_stages 0 takes it.
#include <ATen/core/Tensor.h>
#include <torch/nn/modules/container/any.h>

#include <cstdint>
#include <functional>
#include <string>
#include <variant>
#include <vector>

#include "xlr8/pipeline.hpp"

namespace xlr8::deepspeed {

// How to build one layer: called only on the stage that runs it (and, allocating nothing, under EmptyInitScope on
// every rank to count its parameters and read its type for the partition).
class LayerSpec {
 public:
  using Build = std::function<torch::nn::AnyModule()>;
  explicit LayerSpec(Build build);
  // A module holder (torch::nn::Linear, TORCH_MODULE(Block)'s Block) built from `args` (copied).
  template <class Holder, class... Args>
  static LayerSpec of(Args... args) {
    return LayerSpec([=] { return torch::nn::AnyModule(Holder(args...)); });
  }
  torch::nn::AnyModule build() const;

 private:
  Build build_;
};

// A layer sharing its module with every other layer of the same key (the whole module is shared: DeepSpeed's
// tied_weight_attr names one attribute, here it is all of them). `forward` says how this layer runs the module
// (empty: its own forward); the spec of the key's first layer builds it.
struct TiedLayerSpec {
  TiedLayerSpec(std::string key, LayerSpec spec, pp::TiedForward forward = {})
      : key(std::move(key)), spec(std::move(spec)), forward(std::move(forward)) {}
  std::string key;
  LayerSpec spec;
  pp::TiedForward forward;
};

using PipeLayer = std::variant<LayerSpec, TiedLayerSpec>;

struct PipelineModuleOptions {
  int num_stages = 0;  // 0: the launch's parallelism_config_pp_size; another value must equal it
  pp::LossFn loss_fn;  // on the last stage: the micro-batch's mean loss from its output and labels
  // "parameters" (balanced parameter counts), "uniform" (layer counts), or "type:<regex>": the layers whose class
  // name (Module::name(), e.g. "BlockImpl") the regex finds, case-insensitive, spread evenly, each stage starting
  // at one of them (the layers before the first go to stage 0).
  std::string partition_method = "parameters";
  // Every layer is built after torch::manual_seed(base_seed + its index) (DeepSpeed's seed_layers), so each
  // layout builds the values one process does.
  uint64_t base_seed = 1234;
  // Layers a checkpointed region holds on each stage (recomputed in backward); 0: none.
  int activation_checkpoint_interval = 0;
};

// The model as this rank holds it: a Sequential of every layer under the whole model's names, this stage's built
// for real and the others' with empty tensors (built on the meta device: no memory, no initialiser run). The
// Accelerator cuts it where partition_method said.
class PipelineModuleImpl : public pp::PartitionedSequentialImpl {
 public:
  PipelineModuleImpl(const std::vector<PipeLayer>& layers, PipelineModuleOptions options);
  // The whole model in one process (or this stage's part of it under pp, which the engine runs instead).
  at::Tensor forward(at::Tensor x);
  const PipelineModuleOptions& options() const { return options_; }
  int num_stages() const { return options_.num_stages; }
  int stage_id() const { return stage_; }
  // The first layer of each stage.
  const std::vector<size_t>& stage_starts() const { return part_starts; }

 private:
  PipelineModuleOptions options_;
  int stage_ = 0;
};
TORCH_MODULE(PipelineModule);

// partition_method's cut of layers with these parameter counts and class names into `stages`: the first layer of
// each stage. A method DeepSpeed does not have, a regex no layer matches, or fewer matches than stages is a
// ConfigError naming it.
std::vector<size_t> partition_layers(const std::vector<int64_t>& parameters, const std::vector<std::string>& types,
                                     int stages, const std::string& method);

}  // namespace xlr8::deepspeed
