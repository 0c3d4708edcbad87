// The Accelerator's DeepSpeed JSON: Accelerate's "auto" filling, step by step as the objects it needs
// are prepared, and the ZeRO keys on the strategies' options.
#include "deepspeed/deepspeed_plugin.hpp"

#include <fmt/format.h>
#include <torch/nn/modules/embedding.h>

#include <algorithm>
#include <cmath>

#include "core/log.hpp"
#include "core/text.hpp"
#include "xlr8/nn.hpp"
#include "xlr8/deepspeed.hpp"
#include "xlr8/deepspeed_dummy.hpp"
#include "xlr8/error.hpp"

namespace xlr8 {

DummyOptim::DummyOptim(const std::vector<at::Tensor>& parameters, double lr, double weight_decay)
    : torch::optim::Optimizer({torch::optim::OptimizerParamGroup(parameters)},
                              std::make_unique<torch::optim::AdamWOptions>(
                                  torch::optim::AdamWOptions(lr).weight_decay(weight_decay))),
      lr_(lr),
      weight_decay_(weight_decay) {}

at::Tensor DummyOptim::step(LossClosure) {
  throw Error("DummyOptim::step(): a DummyOptim stands for the optimizer of a DeepSpeed config; prepare it with "
              "Accelerator::prepare under --use_deepspeed --deepspeed_config_file and step what prepare returns");
}

DummyScheduler::DummyScheduler(torch::optim::Optimizer& optimizer, std::optional<int64_t> total_num_steps,
                               int64_t warmup_num_steps)
    : torch::optim::LRScheduler(optimizer),
      optimizer_of_(optimizer),
      total_num_steps_(total_num_steps),
      warmup_num_steps_(warmup_num_steps) {}

std::vector<double> DummyScheduler::get_lrs() {
  throw Error("DummyScheduler::step(): a DummyScheduler stands for the scheduler of a DeepSpeed config; prepare it "
              "with Accelerator::prepare under --use_deepspeed --deepspeed_config_file and step what prepare returns");
}

namespace deepspeed {
namespace {

bool explicitly_enabled(const nlohmann::json& document, const char* section) {
  if (!document.contains(section) || !document.at(section).is_object()) return false;
  const auto& enabled = document.at(section).value("enabled", nlohmann::json(false));
  return enabled.is_boolean() && enabled.get<bool>();
}

// What a model's width is when the program does not say: its first Embedding's (a transformer's hidden size).
std::optional<int64_t> embedding_width(torch::nn::Module& model) {
  for (const auto& module : model.modules())
    if (const auto* embedding = dynamic_cast<const torch::nn::EmbeddingImpl*>(module.get()))
      return embedding->options.embedding_dim();
    else if (const auto* ours = dynamic_cast<const nn::EmbeddingImpl*>(module.get()))
      return ours->options.embedding_dim();
  return std::nullopt;
}

}  // namespace

void mark_leaf_modules(torch::nn::Module& model, const deepspeed::LeafModuleConfig& leaf) {
  if (!leaf.classes.empty()) deepspeed::set_z3_leaf_modules(model, leaf.classes);
  if (!leaf.names.empty()) deepspeed::set_z3_leaf_modules_by_name(model, leaf.names);
  if (!leaf.name_suffixes.empty()) deepspeed::set_z3_leaf_modules_by_suffix(model, leaf.name_suffixes);
}

DeepSpeedPlugin::DeepSpeedPlugin(const DeepSpeedSettings& launch, MixedPrecision asked, int accumulation,
                                 int data_parallel_size, bool main_process)
    : config_(deepspeed::load_config(launch.config_file)),
      data_parallel_size_(data_parallel_size),
      main_process_(main_process) {
  const auto& doc = config_.document;
  // fp8 runs its layers' gemms in fp8 inside DeepSpeed's bf16 (Accelerate's fp8 with DeepSpeed).
  const auto precision = asked == MixedPrecision::FP8 ? MixedPrecision::BF16 : asked;
  // Accelerate's set_mixed_precision: the launch's precision may not contradict the JSON's other dtype.
  if (precision != MixedPrecision::NO) {
    const char* other = precision == MixedPrecision::FP16 ? "bf16" : "fp16";
    if (explicitly_enabled(doc, other))
      throw ConfigError(fmt::format("mixed_precision {} was asked for, but {} enables {}; drop --mixed_precision or set "
                                    "{}.enabled to \"auto\" or false",
                                    to_string(precision), config_.origin, other, other));
  }
  // ... and a precision the JSON does not mention is added to it, as Accelerate adds the section.
  auto added = doc;
  if (precision == MixedPrecision::FP16 && !doc.contains("fp16")) added["fp16"] = {{"enabled", true}, {"auto_cast", true}};
  if (precision == MixedPrecision::BF16 && !doc.contains("bf16") && !doc.contains("bfloat16"))
    added["bf16"] = {{"enabled", true}};
  if (added != doc) config_ = deepspeed::parse_config(added, config_.origin);
  std::map<std::string, nlohmann::json> values{
      {"fp16.enabled", precision == MixedPrecision::FP16},
      {"bf16.enabled", precision == MixedPrecision::BF16},
      {"gradient_accumulation_steps", accumulation},
      {"gradient_clipping", launch.gradient_clipping.value_or(1.0)},
      {"zero_optimization.stage", launch.zero_stage},
      {"zero_optimization.offload_optimizer.device", launch.offload_optimizer_device},
      {"zero_optimization.offload_param.device", launch.offload_param_device},
      {"zero_optimization.offload_optimizer.nvme_path", launch.offload_optimizer_nvme_path},  // Accelerate's mapping
      {"zero_optimization.offload_param.nvme_path", launch.offload_param_nvme_path},
      {"zero_optimization.stage3_gather_16bit_weights_on_model_save", launch.zero3_save_16bit_model}};
  fill(values);
  if (main_process_ && this->precision() != precision)
    log::warning("xlr8: {} sets mixed precision {} while the launch asks for {}; DeepSpeed's config wins",
                 config_.origin, to_string(this->precision()), to_string(precision));
  if (main_process_ && config_.gradient_accumulation_steps && *config_.gradient_accumulation_steps != accumulation)
    log::warning("xlr8: gradient accumulation steps mismatch: the Accelerator has {}, {} has {}; using DeepSpeed's value",
                 accumulation, config_.origin, *config_.gradient_accumulation_steps);
}

// Accelerate fills an "auto" warmup_num_steps with its DummyScheduler's, 0 by default; DeepSpeed up to 0.19.2
// clamped that to its smallest warm-up (2 steps), 0.19.3 on refuses 0. A warm-up of 0 asked for through "auto"
// (Accelerate's own configs with a program's defaults) gets those 2 steps; a 0 written in the JSON is refused.
int64_t DeepSpeedPlugin::auto_warmup_steps(int64_t program_steps) const {
  const auto& params = config_.scheduler->params;
  const bool automatic = params.contains("warmup_num_steps") && params.at("warmup_num_steps") == "auto";
  if (!automatic || program_steps != 0) return program_steps;
  log::debug("xlr8: {}: scheduler.params.warmup_num_steps \"auto\" with the program's warm-up of 0 steps: using "
             "DeepSpeed's smallest warm-up, 2 steps",
             config_.origin);
  return 2;
}

void DeepSpeedPlugin::fill(const std::map<std::string, nlohmann::json>& values) {
  config_ = deepspeed::fill_auto(config_, values);
}

MixedPrecision DeepSpeedPlugin::precision() const { return deepspeed::mixed_precision(config_); }

int DeepSpeedPlugin::gradient_accumulation_steps() const {
  return static_cast<int>(config_.gradient_accumulation_steps.value_or(0));
}

void DeepSpeedPlugin::configure_model(torch::nn::Module& model, ParallelOptions& parallel, int64_t hidden_size) {
  const std::vector<std::string> hidden_keys = {"zero_optimization.reduce_bucket_size",
                                                "zero_optimization.stage3_prefetch_bucket_size",
                                                "zero_optimization.stage3_param_persistence_threshold"};
  std::vector<std::string> wanted;
  for (const auto& key : hidden_keys)
    if (std::find(config_.auto_keys.begin(), config_.auto_keys.end(), key) != config_.auto_keys.end()) wanted.push_back(key);
  if (!wanted.empty()) {
    const auto width = hidden_size > 0 ? std::optional(hidden_size) : embedding_width(model);
    if (!width)
      throw ConfigError(fmt::format("{} leaves {} as \"auto\", which Accelerate fills from the model's hidden size; this "
                                    "model has no Embedding to read it from: set AcceleratorOptions::model_hidden_size, "
                                    "or give these keys numbers",
                                    config_.origin, text::join(wanted)));
    const int64_t h = *width;
    fill({{hidden_keys[0], h * h},
          {hidden_keys[1], static_cast<int64_t>(0.9 * static_cast<double>(h * h))},
          {hidden_keys[2], 10 * h}});
  }
  mark_leaf_modules(model, config_.zero_optimization.leaf_module);
  shard::apply_zero_sizes(config_.zero_optimization, parallel);
}

void DeepSpeedPlugin::refuse_auto_in(const std::string& prefix, const std::string& filled_by) const {
  std::vector<std::string> left;
  for (const auto& key : config_.auto_keys)
    if (key.rfind(prefix, 0) == 0) left.push_back(key);
  if (!left.empty())
    throw ConfigError(fmt::format("{} leaves {} as \"auto\"; {} fills only {}: give the others values", config_.origin,
                                  text::join(left), prefix == "optimizer." ? "DummyOptim" : "DummyScheduler", filled_by));
}

std::shared_ptr<torch::optim::Optimizer> DeepSpeedPlugin::optimizer_for(std::shared_ptr<torch::optim::Optimizer> given) {
  auto dummy = std::dynamic_pointer_cast<DummyOptim>(given);
  if (!config_.optimizer) {
    if (dummy)
      throw ConfigError(fmt::format("a DummyOptim was prepared, but {} has no \"optimizer\" section for it to stand for; "
                                    "prepare a real optimizer, or add the section",
                                    config_.origin));
    return given;
  }
  if (!dummy)
    throw ConfigError(fmt::format("{} defines an optimizer ({}) and the program prepared its own: keep one of them "
                                  "(prepare an xlr8::DummyOptim to use the config's, or remove its \"optimizer\" section)",
                                  config_.origin, config_.optimizer->type));
  fill({{"optimizer.params.lr", dummy->lr()}, {"optimizer.params.weight_decay", dummy->weight_decay()}});
  refuse_auto_in("optimizer.", "lr and weight_decay");
  std::vector<at::Tensor> parameters;
  for (const auto& group : dummy->param_groups())
    parameters.insert(parameters.end(), group.params().begin(), group.params().end());
  auto built = deepspeed::make_optimizer(*config_.optimizer, parameters);
  built_.emplace_back(dummy, built);
  return built;
}

std::shared_ptr<torch::optim::LRScheduler> DeepSpeedPlugin::scheduler_for(std::shared_ptr<torch::optim::LRScheduler> given) {
  auto dummy = std::dynamic_pointer_cast<DummyScheduler>(given);
  if (!config_.scheduler) {
    if (dummy)
      throw ConfigError(fmt::format("a DummyScheduler was prepared, but {} has no \"scheduler\" section for it to stand "
                                    "for; prepare a real scheduler, or add the section",
                                    config_.origin));
    return given;
  }
  if (!dummy)
    throw ConfigError(fmt::format("{} defines a scheduler ({}) and the program prepared its own: keep one of them "
                                  "(prepare an xlr8::DummyScheduler to use the config's, or remove its \"scheduler\" "
                                  "section)",
                                  config_.origin, config_.scheduler->type));
  // The scheduler drives the optimizer built for its DummyOptim (or the one prepare() returned for it).
  torch::optim::Optimizer* optimizer = &dummy->optimizer();
  for (const auto& [placeholder, built] : built_)
    if (placeholder.get() == optimizer) optimizer = built.get();
  if (dynamic_cast<DummyOptim*>(optimizer))
    throw ConfigError("a DummyScheduler was prepared before its DummyOptim: prepare the DummyOptim first (the "
                      "scheduler drives the optimizer built for it)");
  const auto& groups = optimizer->param_groups();
  if (groups.empty()) throw ConfigError("DummyScheduler: its optimizer has no parameter groups");
  // xlr8's prepared schedulers step once per optimizer step, so totals count optimizer steps (Accelerate
  // divides them by the number of processes because its own schedulers step once per process).
  std::map<std::string, nlohmann::json> values{{"scheduler.params.warmup_min_lr", 0.0},
                                               {"scheduler.params.warmup_max_lr", groups.front().options().get_lr()},
                                               {"scheduler.params.warmup_num_steps", auto_warmup_steps(dummy->warmup_num_steps())}};
  if (dummy->total_num_steps()) values["scheduler.params.total_num_steps"] = *dummy->total_num_steps();
  fill(values);
  refuse_auto_in("scheduler.", "warmup_min_lr, warmup_max_lr, warmup_num_steps and total_num_steps (when given)");
  return deepspeed::make_scheduler(*config_.scheduler, *optimizer);
}

void DeepSpeedPlugin::loader_prepared(int64_t batch_size_per_process) {
  smallest_batch_ = std::min(smallest_batch_.value_or(batch_size_per_process), batch_size_per_process);
}

void DeepSpeedPlugin::finish(int accumulation) {
  if (finished_) return;
  const int data_parallel_size = data_parallel_size_;
  finished_ = true;
  if (smallest_batch_) {
    const int64_t micro = *smallest_batch_, steps = config_.gradient_accumulation_steps.value_or(accumulation);
    fill({{"train_micro_batch_size_per_gpu", micro}, {"train_batch_size", micro * steps * data_parallel_size}});
  }
  if (!config_.auto_keys.empty()) {
    std::vector<std::string> hints;
    for (const auto& key : config_.auto_keys) {
      std::string who = "nothing fills it here: give it a value";
      if (key.rfind("train_", 0) == 0) who = "filled from the batch size of a data loader prepared before the first backward";
      else if (key.rfind("optimizer.", 0) == 0) who = "filled when an xlr8::DummyOptim is prepared";
      else if (key.rfind("scheduler.", 0) == 0) who = "filled when an xlr8::DummyScheduler is prepared";
      hints.push_back(fmt::format("{} ({})", key, who));
    }
    throw ConfigError(fmt::format("{} still has \"auto\" at the first backward: {}", config_.origin,
                                  text::join(hints, "; ")));
  }
  if (config_.optimizer && built_.empty())
    throw ConfigError(fmt::format("{} defines an optimizer ({}) but none was built from it: prepare an "
                                  "xlr8::DummyOptim, or remove the \"optimizer\" section",
                                  config_.origin, config_.optimizer->type));
  const auto sizes = deepspeed::resolve_batch_sizes(config_, data_parallel_size);
  if (sizes.gradient_accumulation_steps != accumulation)
    throw ConfigError(fmt::format("{}: its batch sizes give gradient_accumulation_steps {} but the Accelerator "
                                  "accumulates {}; set gradient_accumulation_steps in the config",
                                  config_.origin, sizes.gradient_accumulation_steps, accumulation));
  if (smallest_batch_ && *smallest_batch_ != sizes.micro_batch_per_gpu && main_process_)
    log::warning("xlr8: {} says train_micro_batch_size_per_gpu {} but the data loaders give {} per process; DeepSpeed's "
                 "sample counts follow the config",
                 config_.origin, sizes.micro_batch_per_gpu, *smallest_batch_);
  if (main_process_) log::info("xlr8: DeepSpeed config {} resolved to {}", config_.origin, config_.document.dump());
}

}  // namespace deepspeed
}  // namespace xlr8
