// DeepSpeed's pipeline API in C++ (issue 46): a model given as layer specs, with the embedding tied to the output
// head, trained by engine->train_batch() from a DeepSpeed JSON. With
//   xlr8 launch --num_processes 4 --parallelism_config_pp_size 2 --parallelism_config_dp_replicate_size 2
//     build/bin/pipeline_deepspeed --config ds_pipeline.json
// (or the JSON's "pipeline": {"stages": 2} with --use_deepspeed --deepspeed_config_file ds_pipeline.json) each pair
// of stages is a pipeline and the two pipelines are data
// parallel; each rank builds only its stage's layers. One process trains the same steps. Prints one JSON line:
// every step's loss, the last evaluation's, the stages' first layers, and rank 0's block forwards in training.
#include <CLI/CLI.hpp>
#include <fmt/format.h>
#include <nlohmann/json.hpp>
#include <torch/torch.h>
#include <xlr8/deepspeed.hpp>
#include <xlr8/deepspeed_pipeline.hpp>
#include <xlr8/nn.hpp>

namespace {

// This rank's block forwards: a recomputed region runs its blocks' forwards again in backward.
int64_t block_forwards = 0;

struct BlockImpl : torch::nn::Module {
  BlockImpl(int64_t width, int64_t hidden)
      : fc1(register_module("fc1", xlr8::nn::Linear(width, hidden))),
        fc2(register_module("fc2", xlr8::nn::Linear(hidden, width))) {}
  torch::Tensor forward(const torch::Tensor& x) {
    ++block_forwards;
    return x + fc2(torch::tanh(fc1(x)));
  }
  xlr8::nn::Linear fc1, fc2;
};
TORCH_MODULE(Block);

// The token embedding's weight read as the output head (a GPT's tied embedding).
torch::Tensor head(torch::nn::Module& embedding, const torch::Tensor& x) {
  return x.matmul(embedding.as<torch::nn::Embedding>()->weight.t());
}

}  // namespace

int run_example(int argc, char** argv) {
  CLI::App app{"pipeline_deepspeed: DeepSpeed's PipelineModule and train_batch, from a DeepSpeed JSON"};
  std::string config = "examples/pipeline_deepspeed/ds_pipeline.json", partition = "parameters", save_dir, load_dir,
              model_dir;
  int steps = 6, blocks = 5, checkpoint_interval = 0;
  int64_t vocab = 32, width = 16, seq_len = 8;
  bool untied = false;
  app.add_option("--config", config, "The DeepSpeed JSON");
  app.add_option("--steps", steps, "Batches to train (train_batch calls)");
  app.add_option("--blocks", blocks, "Residual blocks between the embedding and the head");
  app.add_option("--partition_method", partition, "parameters | uniform | type:<regex>");
  app.add_option("--activation_checkpoint_interval", checkpoint_interval, "Layers a recomputed region holds");
  app.add_flag("--untied", untied, "A head of its own instead of the embedding's weight");
  app.add_option("--save_checkpoint", save_dir, "engine->save_checkpoint there at the end");
  app.add_option("--load_checkpoint", load_dir, "engine->load_checkpoint from there first");
  app.add_option("--save_model", model_dir, "The whole trained model there (model.safetensors), from every stage");
  CLI11_PARSE(app, argc, argv);

  using namespace xlr8::deepspeed;
  const auto embedding = LayerSpec::of<torch::nn::Embedding>(vocab, width);
  std::vector<PipeLayer> layers{TiedLayerSpec("embed", embedding)};
  for (int b = 0; b < blocks; ++b) layers.push_back(LayerSpec::of<Block>(width, 2 * width + 8 * b));
  if (untied) layers.push_back(LayerSpec::of<xlr8::nn::Linear>(width, vocab));
  else layers.push_back(TiedLayerSpec("embed", embedding, head));
  auto cross_entropy = [vocab](const torch::Tensor& logits, const torch::Tensor& labels) {
    return torch::cross_entropy_loss(logits.reshape({-1, vocab}), labels.reshape({-1}));
  };
  PipelineModule model(layers, PipelineModuleOptions{.loss_fn = cross_entropy,
                                                    .partition_method = partition,
                                                    .activation_checkpoint_interval = checkpoint_interval});
  auto [engine, optimizer, scheduler] = initialize(model, config);
  if (!load_dir.empty()) engine->load_checkpoint(load_dir);

  auto& mesh = engine->accelerator().state().mesh();
  const auto dp = mesh.size(xlr8::MeshDim::dp), dp_rank = mesh.rank(xlr8::MeshDim::dp);
  // Batch k of the whole run (every layout draws it alike): tokens, and the labels a fixed map gives them.
  auto batch = [&](int64_t k) {
    auto data = at::detail::createCPUGenerator(static_cast<uint64_t>(1000 + k));
    auto x = torch::randint(vocab, {engine->train_batch_size(), seq_len}, data);
    auto y = (x * 7 + 3).remainder(vocab);
    return std::pair{x.chunk(dp)[dp_rank], y.chunk(dp)[dp_rank]};  // this data-parallel replica's share
  };
  auto micro_batches = [&](std::pair<torch::Tensor, torch::Tensor> mine) {
    const auto m = engine->gradient_accumulation_steps();
    return [parts = std::pair{mine.first.chunk(m), mine.second.chunk(m)}, k = size_t{0}]() mutable {
      const size_t i = k++;
      return Engine::MicroBatch{parts.first[i], parts.second[i]};
    };
  };
  nlohmann::json losses = nlohmann::json::array();
  for (int s = 0; s < steps; ++s) {
    const double loss = engine->train_batch(micro_batches(batch(engine->global_steps())));
    // Each replica's mean over its share; their mean is the global batch's.
    losses.push_back(engine->accelerator().reduce(torch::tensor(loss, torch::kDouble)).item<double>() /
                     engine->accelerator().num_processes());
  }
  const int64_t training_block_forwards = block_forwards;
  const double eval = engine->eval_batch(micro_batches(batch(1 << 20)));
  const double eval_loss =
      engine->accelerator().reduce(torch::tensor(eval, torch::kDouble)).item<double>() / engine->accelerator().num_processes();
  if (!save_dir.empty()) engine->save_checkpoint(save_dir);
  if (!model_dir.empty()) engine->accelerator().save_model(model, model_dir);
  int64_t parameter_bytes = 0;  // what this rank holds (under pp: its stage's layers)
  for (const auto& p : model->parameters()) parameter_bytes += p.numel() * static_cast<int64_t>(p.element_size());
  if (engine->accelerator().is_main_process())
    std::cout << nlohmann::json{{"losses", losses},
                                {"eval_loss", eval_loss},
                                {"global_steps", engine->global_steps()},
                                {"num_processes", engine->accelerator().num_processes()},
                                {"stage_starts", model->stage_starts()},
                                {"block_forwards", training_block_forwards},  // rank 0's, in training
                                {"parameter_bytes", parameter_bytes}}
              << std::endl;
  return 0;
}

// A configuration the run cannot take is one line and exit code 1, not std::terminate's abort on every rank.
int main(int argc, char** argv) {
  try {
    return run_example(argc, argv);
  } catch (const std::exception& e) {
    fmt::print(stderr, "pipeline_deepspeed: error: {}\n", e.what());
    return 1;
  }
}
