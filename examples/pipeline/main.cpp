// A model that is a sequence of layers, trained as a pipeline (issue 46, first part): with
//   xlr8 launch --num_processes 4 --parallelism_config_pp_size 4 build/bin/pipeline
// each of the 4 ranks runs a stage of the layers, and one step's batch flows through them in micro-batches
// (--parallelism_config_pp_schedule GPipe | 1F1B, --parallelism_config_pp_microbatches M). On one process it is
// the same training, step for step, and so it is with each stage data- or tensor-parallel over the other ranks
// (--parallelism_config_dp_replicate_size, --use_fsdp --parallelism_config_dp_shard_size, _tp_size). Prints one
// JSON line: every step's loss (and gradient norm with clipping).
#include <CLI/CLI.hpp>
#include <fmt/format.h>
#include <nlohmann/json.hpp>
#include <torch/torch.h>
#include <xlr8/nn.hpp>
#include <xlr8/xlr8.hpp>

#include <chrono>
#include <fstream>
#include <thread>

namespace {

// A residual block whose layers AutoTP recognises by name (fc1 column-wise, fc2 row-wise), so that a stage can
// also be tensor-parallel (xlr8::nn::Linear: the layer whose forward takes tp's collectives). Cloneable: a stage
// that runs a block another stage owns (--share_block) gets its own copy.
// With `gain`, the branch is scaled by softplus of a parameter of its own, whose gradient reads that parameter
// (as a learned temperature's does), where most layers' weight gradients read only their inputs.
struct BlockImpl : torch::nn::Cloneable<BlockImpl> {
  BlockImpl(int64_t width, int64_t hidden, bool gain) : width(width), hidden(hidden), with_gain(gain) { reset(); }
  void reset() override {
    fc1 = register_module("fc1", xlr8::nn::Linear(width, hidden));
    fc2 = register_module("fc2", xlr8::nn::Linear(hidden, width));
    if (with_gain) gain = register_parameter("gain", torch::zeros({1}));
  }
  torch::Tensor forward(const torch::Tensor& x) {
    auto unit = xlr8::unshard(*this);  // a sharded unit when FSDP wraps Block (a no-op otherwise)
    auto branch = fc2(torch::tanh(fc1(x)));
    auto out = x + (with_gain ? branch * torch::softplus(gain) : branch);
    if (simulated_ms > 0) simulate_work(out);
    return unit.done(out);
  }
  // --simulated_ms: the forward takes that much longer and the backward twice that, asleep rather than computing, so
  // that stages sharing this machine's few cores still take equal, known times (bench/pipeline_bubble.py).
  void simulate_work(const torch::Tensor& out) const {
    std::this_thread::sleep_for(std::chrono::duration<double, std::milli>(simulated_ms));
    if (out.requires_grad())
      out.register_hook([ms = 2 * simulated_ms](const torch::Tensor&) {
        std::this_thread::sleep_for(std::chrono::duration<double, std::milli>(ms));
      });
  }
  int64_t width, hidden;
  bool with_gain;
  double simulated_ms = 0;
  xlr8::nn::Linear fc1{nullptr}, fc2{nullptr};
  torch::Tensor gain;
};
TORCH_MODULE(Block);

// What the model is made of (the flags of the same names).
struct Shape {
  int64_t width = 16;
  int equal_blocks = 0;  // > 0: that many blocks of one width, else five of uneven widths
  double simulated_ms = 0;
  bool share_block = false, freeze_shared = false, gain = false;
  int checkpoint_interval = 0;  // > 0: under pp, each run of that many layers is recomputed in backward
};

// Blocks of uneven widths and a head: cut by parameters, the stages hold different numbers of layers. With
// `share_block`, the fourth block runs the second's module again (a xlr8::pp::TiedLayer, weights shared as
// ALBERT's layers are), which under pp lies on another stage.
torch::nn::Sequential mlp(const Shape& shape) {
  const auto [width, equal_blocks, simulated_ms, share_block, freeze_shared, gain, checkpoint_interval] = shape;
  // Cut by parameters either way; a PartitionedSequential also carries the pipeline's checkpointing.
  xlr8::pp::PartitionedSequential model;
  model->activation_checkpoint_interval = checkpoint_interval;
  int index = 0;
  torch::nn::AnyModule shared;
  const auto hiddens = equal_blocks > 0 ? std::vector<int64_t>(equal_blocks, 32) : std::vector<int64_t>{64, 32, 48, 24, 40};
  for (int64_t hidden : hiddens) {
    const auto name = "block" + std::to_string(index++);
    if (!share_block || (index != 2 && index != 4)) {
      Block block(width, hidden * width / 16, gain);
      block->simulated_ms = simulated_ms;
      model->push_back(std::string(name), block);
      continue;
    }
    if (shared.is_empty()) {
      Block block(width, hidden * width / 16, gain);
      block->simulated_ms = simulated_ms;
      shared = torch::nn::AnyModule(block);
      if (freeze_shared)  // fine-tuning around it: no stage may change it
        for (auto& p : shared.ptr()->parameters()) p.set_requires_grad(false);
    }
    model->push_back(std::string(name), xlr8::pp::TiedLayer("shared", shared, xlr8::pp::TiedForward{}, /*owner=*/index == 2));
  }
  model->push_back("head", xlr8::nn::Linear(width, 4));
  return torch::nn::Sequential(std::shared_ptr<torch::nn::SequentialImpl>(model.ptr()));
}

// This process's peak resident memory so far (VmHWM), in MB.
double peak_rss_mb() {
  std::ifstream status("/proc/self/status");
  for (std::string line; std::getline(status, line);)
    if (line.rfind("VmHWM:", 0) == 0) return std::stod(line.substr(6)) / 1024.0;
  return 0;
}

}  // namespace

int run_example(int argc, char** argv) {
  CLI::App app{"pipeline: a Sequential trained by xlr8's pipeline schedules (or on one process)"};
  int steps = 8, batch = 24;
  Shape shape;
  double lr = 0.05;
  app.add_option("--steps", steps);
  app.add_option("--batch_size", batch, "Samples a step (the micro-batches split it)");
  app.add_option("--width", shape.width, "The blocks' width (bench/pipeline_bubble.py makes them wide)");
  app.add_option("--equal_blocks", shape.equal_blocks, "That many blocks of one width instead of five uneven ones");
  app.add_option("--simulated_ms", shape.simulated_ms,
                 "Each block's forward sleeps this long and its backward twice that (stages of known, equal times)");
  app.add_option("--lr", lr, "SGD's learning rate");
  double max_grad_norm = 0;
  app.add_option("--max_grad_norm", max_grad_norm, "Clip the gradients' global norm to this (0: no clipping)");
  std::string save_dir;
  app.add_option("--save_state", save_dir, "Save the training state there at the end");
  bool two_groups = false;
  app.add_flag("--two_groups", two_groups, "Give SGD two parameter groups: the first block's and the rest");
  app.add_flag("--share_block", shape.share_block, "The fourth block runs the second's module (a TiedLayer)");
  app.add_flag("--freeze_shared", shape.freeze_shared, "With --share_block: the shared block's parameters do not train");
  app.add_flag("--gain", shape.gain, "Each block scales its branch by softplus of a parameter of its own");
  app.add_option("--checkpoint_interval", shape.checkpoint_interval,
                 "Under pp: each run of that many layers of a stage is recomputed in backward (0: none)");
  std::string model_dir;
  app.add_option("--save_model", model_dir, "Save the whole trained model there (model.safetensors)");
  bool always_pipeline_step = false;
  app.add_flag("--always_pipeline_step", always_pipeline_step,
               "Step through pipeline_step() on any layout, one process included (xlr8 verify compares such runs)");
  std::string load_dir;
  app.add_option("--load_state", load_dir, "Resume from the training state saved there (any pp x dp x tp layout)");
  bool build_model = false;
  app.add_flag("--build_model", build_model,
               "Build through Accelerator::build_model: under pp each rank records the build and computes only its "
               "stage's layers");
  bool write_after_build = false;
  app.add_flag("--write_after_build", write_after_build,
               "The main process scales the first block's weights between build_model and prepare (a recorded build "
               "refuses that on every rank)");
  CLI11_PARSE(app, argc, argv);
  xlr8::Accelerator acc;
  acc.set_seed(0);  // the same model on every rank; each keeps its stage's layers
  auto built = build_model ? acc.build_model([&] { return mlp(shape); }) : mlp(shape);
  int64_t built_bytes = 0;  // the values this rank held once the model was built (none when the build was recorded)
  for (const auto& p : built->parameters())
    if (!p.is_meta()) built_bytes += p.numel() * static_cast<int64_t>(p.element_size());
  if (write_after_build && acc.is_main_process()) {
    torch::NoGradGuard no_grad;
    built->ptr(0)->parameters().front().mul_(2);
  }
  auto model = acc.prepare(built);
  const double setup_peak_rss_mb = peak_rss_mb();  // building and preparing the model
  // --two_groups: the first block's parameters in a group of their own (under pp a later stage keeps none of them).
  std::vector<torch::optim::OptimizerParamGroup> groups;
  if (two_groups) {
    auto rest = model->parameters();
    auto first = model->ptr(0)->parameters();
    rest.erase(rest.begin(), rest.begin() + static_cast<long>(first.size()));
    groups.emplace_back(first);
    groups.emplace_back(rest);
  } else {
    groups.emplace_back(model->parameters());
  }
  auto optimizer = acc.prepare(torch::optim::SGD(groups, lr));
  const auto teacher = torch::randn({shape.width, 4});  // the function to learn: tanh(x @ teacher)
  if (!load_dir.empty()) acc.load_state(load_dir);  // the parameters and the optimizer's step count
  const bool pipelined = acc.plan().mesh.pp > 1 || always_pipeline_step;
  auto mse = [](const torch::Tensor& y, const torch::Tensor& target) { return torch::mse_loss(y, target); };
  nlohmann::json losses = nlohmann::json::array(), norms = nlohmann::json::array();
  double step_seconds = 0, wait_seconds = 0;  // this rank's, over the steps after the first (warm-up)
  nlohmann::json pipeline_stats;
  for (int step = 0; step < steps; ++step) {
    // Step k's batch comes from a generator of its own (seeded by k, restored from the optimizer's step count on
    // resume), so every rank draws it alike whatever layout saved or resumed the run.
    auto data = at::detail::createCPUGenerator(static_cast<uint64_t>(1000 + optimizer.steps_taken()));
    auto x = torch::randn({batch, shape.width}, data);
    auto target = torch::tanh(x.matmul(teacher));
    double loss = 0;
    if (pipelined) {
      // Each data-parallel replica of the pipeline takes its share of the batch; the mean over the replicas is
      // the whole batch's loss (every rank of a replica holds its loss: the mean over all ranks is that mean).
      const auto& mesh = acc.state().mesh();
      const auto dp = mesh.size(xlr8::MeshDim::dp), dp_rank = mesh.rank(xlr8::MeshDim::dp);
      const double mine = acc.pipeline_step(x.chunk(dp)[dp_rank], target.chunk(dp)[dp_rank], mse);
      pipeline_stats = acc.pipeline_stats();
      if (step > 0 && !pipeline_stats.is_null()) {
        step_seconds += pipeline_stats["step_seconds"].get<double>();
        wait_seconds += pipeline_stats["wait_seconds"].get<double>();
      }
      loss = acc.reduce(torch::tensor(mine, torch::kDouble)).item<double>() / acc.num_processes();
    } else {
      auto scope = acc.autocast();  // --mixed_precision bf16 here too, as pipeline_step runs its forwards
      auto value = mse(model->forward(x.to(acc.device())), target.to(acc.device()));
      acc.backward(value);
      loss = value.item<double>();
    }
    if (max_grad_norm > 0) norms.push_back(acc.clip_grad_norm(model->parameters(), max_grad_norm).value());
    optimizer.step();
    optimizer.zero_grad();
    losses.push_back(loss);
  }
  if (!save_dir.empty()) acc.save_state(save_dir);
  if (!model_dir.empty()) acc.save_model(model, model_dir);
  int64_t parameter_bytes = 0;  // what this rank holds of the model (under pp: its stage's layers only)
  for (const auto& p : model->parameters()) parameter_bytes += p.numel() * static_cast<int64_t>(p.element_size());
  // Every rank's view of its stage: the idle fraction it measured against the schedule's formula (bench/).
  nlohmann::json stages = nlohmann::json::array(), built_bytes_by_rank = nlohmann::json::array();
  for (const auto& text : acc.gather_object(std::to_string(built_bytes))) built_bytes_by_rank.push_back(std::stoll(text));
  nlohmann::json setup_peak_rss_mb_by_rank = nlohmann::json::array();
  for (const auto& text : acc.gather_object(std::to_string(setup_peak_rss_mb)))
    setup_peak_rss_mb_by_rank.push_back(std::stod(text));
  if (!pipeline_stats.is_null()) {
    pipeline_stats["idle_fraction"] = step_seconds > 0 ? wait_seconds / step_seconds : 0.0;
    pipeline_stats["mean_step_seconds"] = steps > 1 ? step_seconds / (steps - 1) : 0.0;  // steps after the first
    for (const auto& text : acc.gather_object(pipeline_stats.dump())) stages.push_back(nlohmann::json::parse(text));
  }
  if (acc.is_main_process())
    std::cout << nlohmann::json{{"losses", losses},
                                {"grad_norms", norms},
                                {"num_processes", acc.num_processes()},
                                {"pp", acc.plan().mesh.pp},
                                {"parallel", acc.parallel_stats(model)},
                                {"pipeline", stages},
                                {"parameter_bytes", parameter_bytes},
                                {"built_bytes_by_rank", built_bytes_by_rank},
                                {"setup_peak_rss_mb_by_rank", setup_peak_rss_mb_by_rank}}
              << std::endl;
  return 0;
}

// A configuration the run cannot take is one line and exit code 1, not std::terminate's abort on every rank.
int main(int argc, char** argv) {
  try {
    return run_example(argc, argv);
  } catch (const std::exception& e) {
    fmt::print(stderr, "pipeline: error: {}\n", e.what());
    return 1;
  }
}
