// The GPT example through DeepSpeed's engine API: the model and text of examples/gpt, trained by the
// loop a DeepSpeed user writes (initialize from a JSON file, forward, backward, step). The strategy,
// batch sizes, precision, optimizer and scheduler all come from the JSON:
//   xlr8 launch --num_processes 2 build/bin/gpt_deepspeed --deepspeed_config examples/gpt_deepspeed/zero2.json
// Prints progress and one JSON line last (losses, tokens/s).
#include <CLI/CLI.hpp>
#include <fmt/format.h>

#include <chrono>

#include "../gpt/gpt.hpp"
#include "xlr8/tensor_parallel.hpp"
#include "xlr8/deepspeed.hpp"
#include "xlr8/process_state.hpp"
#include "xlr8/error.hpp"

namespace F = torch::nn::functional;

namespace {

// --pipeline: the GPT as DeepSpeed's layer specs in a PipelineModule, each batch one engine->train_batch() over
// the accumulation steps' micro-batches (through the stages by 1F1B under --parallelism_config_pp_size).
nlohmann::json train_pipeline(const gpt::Config& config, const std::string& ds_config, const torch::Tensor& text,
                              int64_t max_steps, uint64_t seed) {
  auto loss_fn = [](const torch::Tensor& logits, const torch::Tensor& target) {
    return F::cross_entropy(logits.flatten(0, 1), target.flatten());
  };
  xlr8::deepspeed::PipelineModule model(gpt::pipeline_layers(config),
                                        xlr8::deepspeed::PipelineModuleOptions{.loss_fn = loss_fn, .base_seed = seed});
  auto [engine, optimizer, scheduler] = xlr8::deepspeed::initialize(model, ds_config);
  auto& acc = engine->accelerator();
  auto train = acc.prepare_data_loader(gpt::TextWindows(text.narrow(0, 0, text.numel() * 9 / 10), config.seq_len),
                                       {.batch_size = engine->train_micro_batch_size_per_gpu(), .shuffle = true,
                                        .seed = seed});
  const auto start = std::chrono::steady_clock::now();
  std::vector<double> losses;
  std::vector<xlr8::deepspeed::Engine::MicroBatch> pending;
  while (engine->global_steps() < max_steps)
    for (auto& batch : *train) {
      pending.push_back({batch.data, batch.target});
      if (static_cast<int64_t>(pending.size()) < engine->gradient_accumulation_steps()) continue;
      size_t next = 0;
      const double loss = engine->train_batch([&] { return pending[next++]; });
      pending.clear();
      losses.push_back(acc.reduce(at::full({1}, loss, at::kDouble), xlr8::ReduceOp::AVG).item<double>());
      if (engine->global_steps() >= max_steps) break;
    }
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  const auto tokens = static_cast<double>(engine->global_samples() * config.seq_len);
  int64_t held = 0;  // the parameters this rank's stage holds (a tied copy, unregistered, apart)
  for (const auto& p : model->parameters()) held += p.numel();
  nlohmann::json parameters_by_rank = nlohmann::json::array();
  for (const auto& text : acc.gather_object(std::to_string(held))) parameters_by_rank.push_back(std::stoll(text));
  return {{"losses", losses},
          {"final_train_loss", losses.empty() ? 0.0 : losses.back()},
          {"global_steps", engine->global_steps()},
          {"num_processes", acc.num_processes()},
          {"pp_size", acc.state().mesh().size(xlr8::MeshDim::pp)},
          {"stage_starts", model->stage_starts()},
          {"parameters_by_rank", parameters_by_rank},
          {"tokens_per_s", tokens / std::max(seconds, 1e-9)}};
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"GPT through xlr8::deepspeed::initialize"};
  std::string ds_config, data_dir = "/usr/share/games/fortunes", save_dir;
  int64_t max_steps = 300, seq_len = 128, n_layer = 4, d_model = 128, n_head = 4, log_every = 25;
  uint64_t seed = 1234;
  app.add_option("--deepspeed_config", ds_config, "DeepSpeed JSON config (a path or the JSON itself)")->required();
  app.add_option("--max_steps", max_steps, "optimizer steps (global_steps)");
  app.add_option("--seq_len", seq_len);
  app.add_option("--n_layer", n_layer);
  app.add_option("--d_model", d_model);
  app.add_option("--n_head", n_head);
  app.add_option("--seed", seed);
  app.add_option("--data_dir", data_dir);
  app.add_option("--log_every", log_every);
  app.add_option("--save_dir", save_dir, "save_checkpoint here at the end");
  bool pipeline = false;
  app.add_flag("--pipeline", pipeline, "Train the GPT as a PipelineModule by train_batch (pipeline parallel under pp)");
  CLI11_PARSE(app, argc, argv);
  try {
    torch::manual_seed(seed);
    gpt::Config config{.seq_len = seq_len, .n_layer = n_layer, .d_model = d_model, .n_head = n_head};
    if (pipeline) {
      const auto result = train_pipeline(config, ds_config, gpt::load_text(data_dir), max_steps, seed);
      if (xlr8::ProcessState::instance().is_main_process()) fmt::print("{}\n", result.dump());
      return 0;
    }
    auto [engine, optimizer, scheduler] = xlr8::deepspeed::initialize(gpt::Gpt(config), ds_config);
    auto& acc = engine->accelerator();
    auto text = gpt::load_text(data_dir);
    auto train = acc.prepare_data_loader(gpt::TextWindows(text.narrow(0, 0, text.numel() * 9 / 10), seq_len),
                                         {.batch_size = engine->train_micro_batch_size_per_gpu(), .shuffle = true,
                                          .seed = seed});
    acc.print("gpt_deepspeed: ZeRO stage {}, {} windows per step ({} per rank x {} accumulation x {} ranks)",
              engine->zero_optimization_stage(), engine->train_batch_size(), engine->train_micro_batch_size_per_gpu(),
              engine->gradient_accumulation_steps(), acc.state().mesh().size(xlr8::MeshDim::dp));
    const auto start = std::chrono::steady_clock::now();
    int64_t tokens = 0;
    double step_loss = 0;
    double step_ms = 0;  // forward to step(), each micro-step: what wall_clock_breakdown divides up
    std::vector<double> losses;
    while (engine->global_steps() < max_steps) {
      for (auto& batch : *train) {
        const auto began = std::chrono::steady_clock::now();
        // sequence_parallel_size (Ulysses): this rank's share of each window's tokens (the windows
        // themselves at sp 1), as DeepSpeed's UlyssesSPDataLoaderAdapter cuts them.
        auto logits = engine->forward(acc.shard_sequence(batch.data));
        auto loss = F::cross_entropy(logits.flatten(0, 1), acc.shard_sequence(batch.target).flatten());
        auto reported = engine->backward(loss);
        const bool boundary = engine->is_gradient_accumulation_boundary();
        engine->step();
        step_ms += std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - began).count();
        step_loss += reported.item<double>();
        tokens += batch.data.numel() * acc.state().mesh().size(xlr8::MeshDim::dp);  // tp and sp peers read the same batch
        if (!boundary) continue;
        losses.push_back(acc.reduce(at::full({1}, step_loss, at::kDouble), xlr8::ReduceOp::AVG).item<double>());
        step_loss = 0;
        if (engine->global_steps() % log_every == 0)
          acc.print("step {}: loss {:.4f}, lr {:.3g}", engine->global_steps(), losses.back(), engine->get_lr()[0]);
        if (engine->global_steps() >= max_steps) break;
      }
    }
    const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    if (!save_dir.empty()) engine->save_checkpoint(save_dir, "", {{"seed", seed}});
    double tail = 0;  // the mean of the last (up to) ten steps' losses
    const size_t n = std::min<size_t>(10, losses.size());
    for (size_t i = losses.size() - n; i < losses.size(); ++i) tail += losses[i] / static_cast<double>(n);
    if (acc.is_main_process())
      fmt::print("{}\n", nlohmann::json{{"final_train_loss", tail},
                                         {"losses", losses},
                                         {"global_steps", engine->global_steps()},
                                         {"skipped_steps", engine->skipped_steps()},
                                         {"num_processes", acc.num_processes()},
                                         {"stage", engine->zero_optimization_stage()},
                                         // Offload (zero_optimization.offload_optimizer): the optimizer steps in host memory.
                                         {"optimizer_device",
                                          optimizer->param_groups().front().params().front().device().str()},
                                         {"tp_size", acc.state().mesh().size(xlr8::MeshDim::tp)},
                                         {"sp_size", acc.state().mesh().size(xlr8::MeshDim::sp)},
                                         {"sliced_parameters", xlr8::tp::slice_layouts(engine->module()).size()},
                                         {"tokens_per_s", static_cast<double>(tokens) / std::max(seconds, 1e-9)},
                                         {"measured_step_ms", step_ms},
                                         {"wall_clock_ms", {{"forward", engine->wall_clock().forward_ms},
                                                            {"backward", engine->wall_clock().backward_ms},
                                                            {"backward_inner", engine->wall_clock().backward_inner_ms},
                                                            {"backward_allreduce", engine->wall_clock().backward_allreduce_ms},
                                                            {"step", engine->wall_clock().step_ms}}}}
                             .dump());
    acc.end_training();
    return 0;
  } catch (const std::exception& e) {
    fmt::print(stderr, "gpt_deepspeed: error: {}\n", e.what());
    return 1;
  }
}
