#pragma once
// A DeepSpeed JSON config driven by the Accelerator (`--use_deepspeed --deepspeed_config_file ds.json`), as
// Accelerate's DeepSpeedPlugin and _prepare_deepspeed do it (research/accelerate.md): "auto" values are
// filled from the launch and the program's options when the Accelerator is built, from the model when
// it is prepared (hidden size), from DummyOptim / DummyScheduler when they are prepared, and from the
// data loaders' batch size; at the first backward nothing may be left "auto", the batch sizes must
// agree, and the resolved JSON is logged once. The ZeRO keys map onto the same options the engine
// (deepspeed::Engine) gives its Accelerator: one engine underneath both paths.
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "parallel/shard/zero_options.hpp"
#include "xlr8/accelerator.hpp"
#include "xlr8/deepspeed_config.hpp"
#include "xlr8/settings.hpp"

namespace xlr8::deepspeed {

// zero_optimization.leaf_module: marks the modules it names (ConfigError when a list matches none).
void mark_leaf_modules(torch::nn::Module& model, const deepspeed::LeafModuleConfig& leaf);


class DeepSpeedPlugin {
 public:
  // Reads launch.config_file and fills what the launch and the program's options decide:
  // gradient_accumulation_steps, gradient_clipping, fp16/bf16 "enabled", the ZeRO stage, offload devices,
  // stage3_gather_16bit_weights_on_model_save. `precision` and `accumulation` are the Accelerator's own;
  // `data_parallel_size` makes train_batch_size.
  DeepSpeedPlugin(const DeepSpeedSettings& launch, MixedPrecision precision, int accumulation, int data_parallel_size,
                  bool main_process);

  const deepspeed::Config& config() const { return config_; }
  // What the JSON makes of the launch's precision and accumulation (the JSON's value wins, as in Accelerate).
  MixedPrecision precision() const;
  int gradient_accumulation_steps() const;

  // Before a model's strategy is built: fills the hidden-size keys (from `hidden_size`, else the width
  // of the model's first Embedding), marks the JSON's leaf modules, sets the ZeRO sizes (apply_zero_sizes).
  void configure_model(torch::nn::Module& model, ParallelOptions& parallel, int64_t hidden_size);
  // The optimizer to prepare instead of `given`: the JSON's, built over a DummyOptim's parameters with its
  // lr and weight decay; `given` itself when the JSON has no "optimizer" section. A real optimizer with
  // such a section, or a DummyOptim without one, is a ConfigError (as in Accelerate).
  std::shared_ptr<torch::optim::Optimizer> optimizer_for(std::shared_ptr<torch::optim::Optimizer> given);
  // The same for schedulers and DummyScheduler.
  std::shared_ptr<torch::optim::LRScheduler> scheduler_for(std::shared_ptr<torch::optim::LRScheduler> given);
  // A prepared data loader's batch size per process (the smallest fills train_micro_batch_size_per_gpu).
  void loader_prepared(int64_t batch_size_per_process);
  // At the first backward, once: fills the batch sizes, refuses what is still "auto" (naming who fills
  // it), checks DeepSpeed's batch-size relation and logs the resolved JSON. Collective-free.
  void finish(int accumulation);

 private:
  int64_t auto_warmup_steps(int64_t program_steps) const;
  void fill(const std::map<std::string, nlohmann::json>& values);
  void refuse_auto_in(const std::string& prefix, const std::string& filled_by) const;

  deepspeed::Config config_;
  int data_parallel_size_;
  bool main_process_;
  bool finished_ = false;
  std::optional<int64_t> smallest_batch_;
  // DummyOptims prepared, each with the JSON optimizer built for it.
  std::vector<std::pair<std::shared_ptr<torch::optim::Optimizer>, std::shared_ptr<torch::optim::Optimizer>>> built_;
};

}  // namespace xlr8::deepspeed
