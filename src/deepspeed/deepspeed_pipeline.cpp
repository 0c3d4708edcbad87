// DeepSpeed's pipeline API: PipelineModule from layer specs, its partition methods, and the engine's train_batch /
// eval_batch (xlr8/deepspeed_pipeline.hpp).
#include <ATen/ATen.h>
#include <fmt/format.h>

#include <map>
#include <regex>

#include "core/log.hpp"
#include "core/text.hpp"
#include "deepspeed/pipeline_engine.hpp"
#include "xlr8/deepspeed.hpp"
#include "xlr8/deepspeed_pipeline.hpp"
#include "xlr8/empty_init.hpp"
#include "xlr8/error.hpp"
#include "xlr8/process_state.hpp"
#include "xlr8/unshard.hpp"

namespace xlr8::deepspeed {
namespace {

const char* kMethods = "\"parameters\", \"uniform\" or \"type:<regex>\"";

// type:<regex>: the matching layers spread evenly (the first stages one more), each stage starting at its first.
std::vector<size_t> partition_by_type(const std::vector<std::string>& types, int stages, const std::string& method) {
  std::regex pattern;
  try {
    pattern = std::regex(method.substr(5), std::regex::icase | std::regex::ECMAScript);
  } catch (const std::regex_error& e) {
    throw ConfigError(fmt::format("PipelineModule: partition_method {:?} is not a valid regex: {}", method, e.what()));
  }
  std::vector<size_t> matches;
  for (size_t i = 0; i < types.size(); ++i)
    if (std::regex_search(types[i], pattern)) matches.push_back(i);
  if (matches.size() < static_cast<size_t>(stages))
    throw ConfigError(fmt::format("PipelineModule: partition_method {:?} matches {} of the layers ({}), fewer than the "
                                  "{} stages; every stage starts at a matching layer",
                                  method, matches.size(), text::join(types), stages));
  std::vector<size_t> starts{0};
  size_t taken = 0;
  for (int s = 0; s + 1 < stages; ++s) {
    taken += matches.size() / stages + (static_cast<size_t>(s) < matches.size() % stages ? 1 : 0);
    starts.push_back(matches[taken]);
  }
  return starts;
}

}  // namespace

LayerSpec::LayerSpec(Build build) : build_(std::move(build)) {
  if (!build_) throw ConfigError("LayerSpec: no function builds the layer");
}

torch::nn::AnyModule LayerSpec::build() const {
  auto module = build_();
  if (module.is_empty()) throw ConfigError("LayerSpec: the build function returned an empty module");
  return module;
}

std::vector<size_t> partition_layers(const std::vector<int64_t>& parameters, const std::vector<std::string>& types,
                                     int stages, const std::string& method) {
  const auto lowered = text::lower(method);
  if (lowered == "parameters" || lowered == "uniform") {
    std::vector<size_t> starts;
    for (const auto& [begin, end] :
         pp::partition(parameters, stages, lowered == "uniform" ? pp::Partition::Uniform : pp::Partition::Parameters))
      starts.push_back(begin);
    return starts;
  }
  if (lowered.rfind("type:", 0) == 0) return partition_by_type(types, stages, method);
  if (lowered == "profile")
    throw ConfigError(fmt::format("PipelineModule: partition_method \"profile\" is not implemented (DeepSpeed's is "
                                  "not either); use {}",
                                  kMethods));
  throw ConfigError(fmt::format("PipelineModule: partition_method {:?} is not one DeepSpeed has; use {}", method, kMethods));
}

PipelineModuleImpl::PipelineModuleImpl(const std::vector<PipeLayer>& layers, PipelineModuleOptions options)
    : options_(std::move(options)) {
  const auto& mesh = ProcessState::instance().mesh();
  const int launched = mesh.size(MeshDim::pp);
  if (options_.num_stages == 0) options_.num_stages = launched;
  if (options_.num_stages != launched)
    throw ConfigError(fmt::format("PipelineModule: num_stages {} but the launch has parallelism_config_pp_size {}; "
                                  "launch with --parallelism_config_pp_size {} (or the JSON's \"pipeline\": "
                                  "{{\"stages\": {}}}), or pass num_stages 0",
                                  options_.num_stages, launched, options_.num_stages, options_.num_stages));
  if (!options_.loss_fn) throw ConfigError("PipelineModule: no loss_fn; the last stage computes the loss with it");
  if (layers.empty()) throw ConfigError("PipelineModule: no layers");
  if (options_.activation_checkpoint_interval < 0)
    throw ConfigError(fmt::format("PipelineModule: activation_checkpoint_interval {}; give 0 (none) or more",
                                  options_.activation_checkpoint_interval));
  stage_ = mesh.rank(MeshDim::pp);
  auto spec_of = [](const PipeLayer& layer) -> const LayerSpec& {
    return std::holds_alternative<LayerSpec>(layer) ? std::get<LayerSpec>(layer) : std::get<TiedLayerSpec>(layer).spec;
  };
  // Every layer on the meta device (no memory, no initialiser run): its parameter count and type for the cut, and
  // what stands for it on the stages that do not run it. A tied key's module comes from its first layer's spec.
  std::vector<torch::nn::AnyModule> meta;
  std::vector<int64_t> counts;
  std::vector<std::string> types;
  std::map<std::string, size_t> first_of_key;
  {
    EmptyInitScope empty;
    for (size_t i = 0; i < layers.size(); ++i) {
      const auto* tied = std::get_if<TiedLayerSpec>(&layers[i]);
      const size_t source = tied ? first_of_key.emplace(tied->key, i).first->second : i;
      meta.push_back(source == i ? spec_of(layers[i]).build() : meta[source]);
      int64_t n = 0;
      for (const auto& p : meta.back().ptr()->parameters()) n += p.numel();
      counts.push_back(n);
      types.push_back(meta.back().ptr()->name());
    }
  }
  // What stands for another stage's layer holds no memory and moves to any device: empty CPU tensors, as the
  // Accelerator leaves the other stages of a whole model it cuts.
  {
    at::NoGradGuard no_grad;
    for (const auto& module : meta) {
      to_empty(*module.ptr(), at::kCPU);  // untouched memory (never resident), released at once
      for (auto& t : module.ptr()->parameters()) t.set_data(at::empty({0}, t.options()));
      for (auto& t : module.ptr()->buffers()) t.set_data(at::empty({0}, t.options()));
    }
  }
  part_starts = partition_layers(counts, types, options_.num_stages, options_.partition_method);
  activation_checkpoint_interval = options_.activation_checkpoint_interval;
  const size_t begin = part_starts[static_cast<size_t>(stage_)];
  const size_t end = stage_ + 1 < options_.num_stages ? part_starts[static_cast<size_t>(stage_ + 1)] : layers.size();
  // This stage's layers for real, each after seeding with its index (a tied key's module: its first layer's).
  auto generator = at::detail::getDefaultCPUGenerator();
  const auto program_state = generator.get_state();  // the program's random stream goes on as if nothing was built
  auto build_real = [&](size_t i) {
    at::manual_seed(options_.base_seed + i);
    return spec_of(layers[i]).build();
  };
  std::map<std::string, torch::nn::AnyModule> real_tied;
  for (size_t i = 0; i < layers.size(); ++i) {
    const bool mine = i >= begin && i < end;
    const auto* tied = std::get_if<TiedLayerSpec>(&layers[i]);
    if (!tied) {
      push_back(std::to_string(i), mine ? build_real(i) : meta[i]);
      continue;
    }
    const size_t first = first_of_key.at(tied->key);
    auto module = meta[first];
    if (mine) {
      auto it = real_tied.find(tied->key);
      if (it == real_tied.end()) it = real_tied.emplace(tied->key, build_real(first)).first;
      module = it->second;
    }
    push_back(std::to_string(i), pp::TiedLayer(tied->key, module, tied->forward, /*owner=*/first == i));
  }
  generator.set_state(program_state);
}

at::Tensor PipelineModuleImpl::forward(at::Tensor x) {
  if (options_.num_stages > 1)
    throw Error("PipelineModule::forward: under pp no rank holds the whole model; the engine's train_batch and "
                "eval_batch run the stages");
  const auto all = torch::nn::Sequential(std::static_pointer_cast<torch::nn::SequentialImpl>(shared_from_this()));
  // The whole model is ZeRO-3's root unit in one process: gathered around the forward (nothing otherwise).
  return xlr8::sharded(*this, [&] { return pp::forward_layers(all, x, activation_checkpoint_interval); });
}

void check_pipeline_launch(const Config& config, const Settings& settings, const BatchSizes& sizes) {
  if (config.fp16.enabled)
    throw ConfigError(fmt::format("deepspeed::initialize: {} sets fp16.enabled under pp, which is not built (its loss "
                                  "scale would have to reach every micro-batch's loss); use bf16.enabled",
                                  config.origin));
  const auto& p = *settings.parallelism;
  if (p.pp_schedule != "1F1B" || (p.pp_microbatches > 0 && p.pp_microbatches != sizes.gradient_accumulation_steps))
    throw ConfigError(fmt::format("deepspeed::initialize: the launch says parallelism_config_pp_schedule {} with {} "
                                  "micro-batches, but the DeepSpeed engine runs 1F1B over its gradient_accumulation_steps "
                                  "({}); drop the launch's pp schedule and micro-batches",
                                  p.pp_schedule, p.pp_microbatches, sizes.gradient_accumulation_steps));
}

void prepare_pipeline_module(torch::nn::Module& module, const Config& config) {
  auto* pipe = module.as<PipelineModuleImpl>();
  if (!pipe) return;
  const auto& json = config.pipeline;
  const auto partition = text::lower(json.partition);
  const auto method = text::lower(pipe->options().partition_method);
  if (partition != "best" && partition != method && !(partition == "parameters" && method == "best"))
    throw ConfigError(fmt::format("deepspeed::initialize: {} sets pipeline.partition {:?} but the PipelineModule's "
                                  "partition_method is {:?}; the module's cut is the one made (as in DeepSpeed): make "
                                  "them agree or drop the key",
                                  config.origin, json.partition, pipe->options().partition_method));
  if (pipe->activation_checkpoint_interval == 0)
    pipe->activation_checkpoint_interval = static_cast<int>(json.activation_checkpoint_interval);
}

// ------------------------------------------------------------------------------------------ the engine's API

Engine::MicroBatch Engine::gather_micro_batches(const std::function<MicroBatch()>& next, const char* call) const {
  if (micro_step_ || no_sync_depth_ > 0 || micro_steps_into_window() != 0)
    throw Error(fmt::format("{}: the forward/backward/step() loop is mid-batch (a micro-step under way, no_sync, or "
                            "{} micro-steps since the last boundary); a batch starts at a boundary",
                            call, micro_steps_into_window()));
  if (!next) return {};
  std::vector<at::Tensor> inputs, labels;
  for (int64_t k = 0; k < sizes_.gradient_accumulation_steps; ++k) {
    auto [x, y] = next();
    for (auto [tensor, into] : {std::pair{&x, &inputs}, std::pair{&y, &labels}}) {
      if (!tensor->defined()) continue;
      if (!into->empty() && (tensor->dim() == 0 || tensor->size(0) != into->front().size(0)))
        throw ConfigError(fmt::format("{}: micro-batch {} has {} rows and the first {}; every micro-batch of a batch "
                                      "must have train_micro_batch_size_per_gpu rows",
                                      call, k, tensor->dim() == 0 ? 0 : tensor->size(0), into->front().size(0)));
      into->push_back(*tensor);
    }
  }
  auto joined = [](const std::vector<at::Tensor>& parts) { return parts.empty() ? at::Tensor() : at::cat(parts); };
  return {joined(inputs), joined(labels)};
}

// The batch's mean loss over the data-parallel replicas (DeepSpeed's aggregated loss).
double Engine::replicas_mean(double loss) const {
  auto& dp = accelerator_->state().mesh().group(MeshDim::dp);
  if (dp.size() == 1) return loss;
  auto value = at::full({1}, loss, at::TensorOptions().dtype(at::kDouble).device(accelerator_->device()));
  dp.all_reduce(value, ReduceOp::AVG);
  return value.item<double>();
}

double Engine::train_batch(const std::function<MicroBatch()>& next) {
  auto* pipe = module_->as<PipelineModuleImpl>();
  if (!pipe)
    throw ConfigError("train_batch(): the model is not a PipelineModule (its loss_fn is what the last stage "
                      "computes); build one from LayerSpecs, or train with forward, backward and step()");
  const int64_t m = sizes_.gradient_accumulation_steps;
  const auto [inputs, labels] = gather_micro_batches(next, "train_batch()");
  if (pipe->num_stages() > 1) {
    if (config_.wall_clock_breakdown && global_steps_ == 0 && ProcessState::instance().is_main_process())
      log::warning("xlr8: wall_clock_breakdown under pp: the phases interleave in the schedule; "
                   "accelerator().pipeline_stats() gives each stage's step and waiting seconds instead");
    const double loss = accelerator_->pipeline_step(inputs, labels, pipe->options().loss_fn);
    boundary_step();
    micro_steps_ += m;
    return replicas_mean(loss);
  }
  if (!inputs.defined() || !labels.defined())
    throw ConfigError("train_batch(): in one process every micro-batch needs its inputs and labels");
  const auto device = accelerator_->device();
  const auto xs = inputs.to(device).chunk(m), ys = labels.to(device).chunk(m);
  double sum = 0;
  for (int64_t k = 0; k < m; ++k) {
    at::Tensor loss;
    {
      auto autocast = begin_forward();
      loss = pipe->options().loss_fn(pipe->forward(xs[k]), ys[k]);
      end_forward();
    }
    backward(loss);
    sum += loss.item<double>();
    step();
  }
  return replicas_mean(sum / static_cast<double>(m));
}

double Engine::eval_batch(const std::function<MicroBatch()>& next) {
  auto* pipe = module_->as<PipelineModuleImpl>();
  if (!pipe)
    throw ConfigError("eval_batch(): the model is not a PipelineModule (its loss_fn is what the last stage computes)");
  const int64_t m = sizes_.gradient_accumulation_steps;
  const auto [inputs, labels] = gather_micro_batches(next, "eval_batch()");
  struct RestoreMode {  // eval mode for the batch, then the mode the model was in
    torch::nn::Module& module;
    bool training = module.is_training();
    ~RestoreMode() { module.train(training); }
  } restore{*module_};
  module_->eval();
  if (pipe->num_stages() > 1)
    return replicas_mean(accelerator_->pipeline_evaluate(inputs, labels, pipe->options().loss_fn));
  if (!inputs.defined() || !labels.defined())
    throw ConfigError("eval_batch(): in one process every micro-batch needs its inputs and labels");
  at::NoGradGuard no_grad;
  auto autocast = accelerator_->autocast();
  const auto xs = inputs.to(accelerator_->device()).chunk(m), ys = labels.to(accelerator_->device()).chunk(m);
  double sum = 0;
  for (int64_t k = 0; k < m; ++k) sum += pipe->options().loss_fn(pipe->forward(xs[k]), ys[k]).item<double>();
  return replicas_mean(sum / static_cast<double>(m));
}

}  // namespace xlr8::deepspeed
