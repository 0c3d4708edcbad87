// The DeepSpeed-engine side of the correctness oracle: a small model with a guarded block (a stage-3
// unit whose unguarded child rides with it) trained through xlr8::deepspeed::initialize from a JSON
// config, on deterministic data split across ranks. Rank 0 prints one JSON line with the per-step losses
// (mean over ranks and micro-steps) and writes the final parameters with save_model.
//   engine_worker --config ds.json --steps S --out DIR [--save_at N] [--resume CHECKPOINT_DIR]
//   engine_worker --accelerate --steps S --out DIR  (under xlr8 launch --use_deepspeed --deepspeed_config_file)
// --save_at: save_checkpoint(DIR/ckpt) after step N; --resume: load_checkpoint and go on from its step;
// --save_every N --resume_latest: an elastic job's checkpoints, and each start resuming from the latest.
// --zero_init: the model built inside xlr8::DeferredInitScope (DeepSpeed's `with deepspeed.zero.Init():`).
// --accelerate: the same model, rows and optimizer through Accelerator, as Accelerate drives DeepSpeed: the
// launch's JSON may leave batch sizes, accumulation, clipping, optimizer and scheduler values "auto".
#include <CLI/CLI.hpp>
#include <fmt/format.h>
#include <torch/torch.h>

#include <chrono>
#include <filesystem>
#include <optional>
#include <thread>

#include "xlr8/deepspeed.hpp"
#include "xlr8/deepspeed_dummy.hpp"
#include "xlr8/deferred_init.hpp"
#include "xlr8/error.hpp"
#include "xlr8/unshard.hpp"

namespace {

struct InnerImpl : torch::nn::Module {  // the model's own class without a guard: rides with its block
  InnerImpl() { fc = register_module("fc", torch::nn::Linear(16, 16)); }
  at::Tensor forward(const at::Tensor& x) { return fc(x); }
  torch::nn::Linear fc{nullptr};
};
TORCH_MODULE(Inner);

struct BlockImpl : torch::nn::Module {
  BlockImpl() {
    inner = register_module("inner", Inner());
    norm = register_module("norm", torch::nn::LayerNorm(torch::nn::LayerNormOptions({16})));
  }
  at::Tensor forward(const at::Tensor& x) {
    return xlr8::sharded(*this, [&] { return x + torch::tanh(inner(norm(x))); });
  }
  Inner inner{nullptr};
  torch::nn::LayerNorm norm{nullptr};
};
TORCH_MODULE(Block);

struct NetImpl : torch::nn::Module {
  NetImpl() {
    in = register_module("in", torch::nn::Linear(8, 16));
    b0 = register_module("b0", Block());
    b1 = register_module("b1", Block());
    out = register_module("out", torch::nn::Linear(16, 4));
  }
  at::Tensor forward(const at::Tensor& x) {
    return xlr8::sharded(*this, [&] { return out(b1(b0(in(x)))); });
  }
  torch::nn::Linear in{nullptr}, out{nullptr};
  Block b0{nullptr}, b1{nullptr};
};
TORCH_MODULE(Net);

struct Rows {
  at::Tensor x, y;
  size_t size() const { return static_cast<size_t>(x.size(0)); }
  torch::data::Example<> get(size_t i) const { return {x[i], y[i]}; }
};

// Accelerate's loop over a DeepSpeed JSON: DummyOptim / DummyScheduler stand for the JSON's sections, the
// data loader's batch size fills train_micro_batch_size_per_gpu. The loader hands rank r the global
// batches r, r + world, ...: the rows the engine's loop takes.
int accelerate_path(int64_t steps, const std::string& out) {
  xlr8::AcceleratorOptions options;
  options.model_hidden_size = 16;  // the width "auto" bucket sizes derive from (the model has no Embedding)
  xlr8::Accelerator acc(options);
  torch::manual_seed(5);
  auto model = acc.prepare(Net());
  const auto* ds = acc.deepspeed_config();
  if (!ds) throw xlr8::Error("engine_worker --accelerate: launch with --use_deepspeed --deepspeed_config_file");
  auto optimizer = ds->contains("optimizer")
                       ? acc.prepare(xlr8::DummyOptim(model->parameters(), 1e-2, 0.01))
                       : acc.prepare(torch::optim::AdamW(model->parameters(), torch::optim::AdamWOptions(1e-2)));
  std::optional<xlr8::PreparedScheduler> scheduler;
  if (ds->contains("scheduler"))
    scheduler = acc.prepare(xlr8::DummyScheduler(optimizer.optimizer(), steps, /*warmup_num_steps=*/3));
  const int64_t world = acc.num_processes(), gas = acc.gradient_accumulation_steps();
  const int64_t micro = 24 / world / gas;  // the engine's train_batch_size 24
  auto gen = at::detail::createCPUGenerator(99);
  auto x = at::randn({16 * 24, 8}, gen);
  auto y = at::randint(0, 4, {16 * 24}, gen);
  auto loader = acc.prepare_data_loader(Rows{x.narrow(0, 0, steps * 24), y.narrow(0, 0, steps * 24)},
                                        {.batch_size = micro});
  std::vector<double> losses;
  double total = 0;
  for (auto& batch : *loader) {
    auto scope = acc.accumulate(model);
    auto loss = torch::cross_entropy_loss(model->forward(batch.data), batch.target);
    acc.backward(loss);
    optimizer.step();
    if (scheduler) scheduler->step();
    optimizer.zero_grad();
    total += loss.item<double>() / static_cast<double>(gas);
    if (!acc.sync_gradients()) continue;
    losses.push_back(acc.reduce(at::full({1}, total, at::kDouble), xlr8::ReduceOp::AVG).item<double>());
    total = 0;
  }
  acc.save_model(model, out + "/model");
  if (acc.is_main_process())
    fmt::print("{}\n", nlohmann::json{{"losses", losses},
                                      {"micro_batch", acc.deepspeed_config()->value("train_micro_batch_size_per_gpu", nlohmann::json())},
                                      {"resolved", *acc.deepspeed_config()},
                                      {"strategy", acc.parallel_stats(model)["strategy"]},
                                      {"plan", acc.plan().to_json()}}
                           .dump());
  acc.end_training();
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"xlr8 DeepSpeed engine oracle worker"};
  std::string config, out = ".";
  int64_t steps = 4;
  app.add_option("--config", config);
  app.add_option("--steps", steps);
  app.add_option("--out", out);
  int64_t save_at = 0, save_every = 0, step_sleep_ms = 0;
  std::string resume;
  bool accelerate = false, resume_latest = false, zero_init = false;
  app.add_flag("--accelerate", accelerate);
  app.add_flag("--zero_init", zero_init);
  app.add_option("--save_at", save_at);
  app.add_option("--resume", resume);
  // An elastic job's restarts: a checkpoint every N steps in DIR/ckpt, resumed from its latest at each start.
  app.add_option("--save_every", save_every);
  app.add_flag("--resume_latest", resume_latest);
  app.add_option("--step_sleep_ms", step_sleep_ms);
  CLI11_PARSE(app, argc, argv);
  try {
    if (accelerate) return accelerate_path(steps, out);
    if (config.empty()) throw xlr8::Error("engine_worker: --config is required");
    torch::manual_seed(5);
    Net net{nullptr};
    {
      std::optional<xlr8::DeferredInitScope> zero_init_scope;  // no values until sharding makes each group
      if (zero_init) zero_init_scope.emplace();
      net = Net();
      if (zero_init_scope) zero_init_scope->finish(*net);
    }
    auto [engine, optimizer, scheduler] = xlr8::deepspeed::initialize(net, config);
    auto& acc = engine->accelerator();
    const int64_t world = acc.num_processes(), rank = acc.process_index();
    const int64_t micro = engine->train_micro_batch_size_per_gpu(), gas = engine->gradient_accumulation_steps();
    auto gen = at::detail::createCPUGenerator(99);
    // The same data whatever --steps says (a run resumed later reads the rows the uninterrupted one did).
    if (steps > 16) throw xlr8::Error("engine_worker: at most 16 steps");
    auto x = at::randn({16 * engine->train_batch_size(), 8}, gen);
    auto y = at::randint(0, 4, {16 * engine->train_batch_size()}, gen);
    int64_t first = 0;
    if (resume_latest && std::filesystem::exists(out + "/ckpt/latest")) resume = out + "/ckpt";
    if (!resume.empty()) {
      auto loaded = engine->load_checkpoint(resume);
      if (!loaded) throw xlr8::Error("engine_worker: nothing to resume in " + resume);
      first = loaded->second.at("step").get<int64_t>();
      if (first != engine->global_steps()) throw xlr8::Error("engine_worker: the client state disagrees with global_steps");
    }
    if (acc.is_main_process())
      fmt::print("start at step {} on {} processes: {} per rank x {} accumulation\n", first, world, micro, gas);
    std::vector<double> losses;
    for (int64_t s = first; s < steps; ++s) {
      double total = 0;
      for (int64_t k = 0; k < gas; ++k) {
        // Micro-batch k of step s, this rank's rows of it.
        const int64_t start = (s * gas + k) * micro * world + rank * micro;
        auto loss = torch::cross_entropy_loss(engine->forward(x.narrow(0, start, micro)), y.narrow(0, start, micro));
        total += engine->backward(loss).item<double>();
        engine->step();
      }
      losses.push_back(acc.reduce(at::full({1}, total, at::kDouble), xlr8::ReduceOp::AVG).item<double>());
      if (s + 1 == save_at || (save_every > 0 && (s + 1) % save_every == 0))
        engine->save_checkpoint(out + "/ckpt", "", {{"step", s + 1}});
      if (acc.is_main_process() && resume_latest) fmt::print("step {}\n", s + 1), std::fflush(stdout);
      std::this_thread::sleep_for(std::chrono::milliseconds(step_sleep_ms));
    }
    acc.save_model(engine->model(), out + "/model");
    if (acc.is_main_process())
      fmt::print("{}\n", nlohmann::json{{"losses", losses},
                                         {"global_steps", engine->global_steps()},
                                         {"global_samples", engine->global_samples()},
                                         {"micro_batch", micro},
                                         {"stage", engine->zero_optimization_stage()},
                                         {"strategy", acc.parallel_stats(engine->model())["strategy"]},
                                         {"groups_computed_when_made",
                                          acc.parallel_stats(engine->model()).value("groups_computed_when_made", 0)},
                                         {"plan", acc.plan().to_json()}}
                             .dump());
    acc.end_training();
    return 0;
  } catch (const std::exception& e) {
    fmt::print(stderr, "engine_worker: error: {}\n", e.what());
    return 1;
  }
}
