// Fashion-MNIST with xlr8: the same program trains on 1 process or many (`xlr8 launch`), with gradient
// accumulation, mixed precision, checkpoints and resumption. The last line is one JSON object.
#include <CLI/CLI.hpp>
#include <fmt/format.h>

#include <chrono>
#include <filesystem>
#include <optional>

#include "fashion_mnist.hpp"
#include "xlr8/accelerator.hpp"
#include "xlr8/error.hpp"
#include "xlr8/fused_adam.hpp"

namespace {

struct Args {
  int epochs = 4;
  int64_t max_steps = 0;  // 0: no limit
  int64_t batch_size = 64;
  double lr = 1e-3;
  uint64_t seed = 42;
  int gradient_accumulation_steps = 1;
  std::string mixed_precision;
  std::string output_dir = "fashion_mnist_output";
  int64_t checkpoint_every = 0;
  std::string resume_from;
  std::string data_dir = "/usr/share/datasets/fashion-mnist";
  int64_t train_limit = 0;
  int num_workers = 1;
  double clip = 0;
};

double evaluate(xlr8::Accelerator& acc, fashion::Net& model, xlr8::DataLoader<fashion::Dataset>& test) {
  torch::NoGradGuard no_grad;
  model->eval();
  int64_t correct = 0, seen = 0;
  for (auto& batch : test) {
    auto autocast = acc.autocast();
    auto predictions = model->forward(batch.data).argmax(1);
    // gather_for_metrics drops the samples even_batches repeated, so exactly the test set is counted.
    auto all_predictions = acc.gather_for_metrics(predictions);
    auto all_targets = acc.gather_for_metrics(batch.target);
    correct += all_predictions.eq(all_targets).sum().item<int64_t>();
    seen += all_targets.size(0);
  }
  model->train();
  return seen ? static_cast<double>(correct) / static_cast<double>(seen) : 0.0;
}

// Statistics that must survive a resume: register_for_checkpointing saves them with every save_state and
// load_state restores them (anything with state() and load_state() can be registered).
struct RunningStats {
  double smoothed_loss = 0;  // exponential moving average of the training loss
  double best_accuracy = 0;
  int64_t updates = 0;
  void add_loss(double loss) { smoothed_loss = updates++ == 0 ? loss : 0.9 * smoothed_loss + 0.1 * loss; }
  nlohmann::json state() const {
    return {{"smoothed_loss", smoothed_loss}, {"best_accuracy", best_accuracy}, {"updates", updates}};
  }
  void load_state(const nlohmann::json& saved) {
    smoothed_loss = saved.at("smoothed_loss");
    best_accuracy = saved.at("best_accuracy");
    updates = saved.at("updates");
  }
};

int run(const Args& args) {
  xlr8::AcceleratorOptions options;
  if (!args.mixed_precision.empty())
    options.mixed_precision = xlr8::parse_mixed_precision(args.mixed_precision, "--mixed_precision");
  options.gradient_accumulation_steps = args.gradient_accumulation_steps;
  options.project_dir = args.output_dir;
  options.automatic_checkpoint_naming = true;
  options.total_limit = 2;
  xlr8::Accelerator acc(options);
  acc.set_seed(args.seed);
  // Each run logs into its own directory: <output_dir>/fashion_mnist/<time>/ (metrics.jsonl, config.json).
  acc.init_trackers("fashion_mnist", {{"lr", args.lr},
                                      {"batch_size", args.batch_size},
                                      {"epochs", args.epochs},
                                      {"seed", args.seed},
                                      {"resume_from", args.resume_from}});
  acc.log({{"run", fmt::format("fashion_mnist: lr {}, batch {} per process on {} process(es){}", args.lr,
                               args.batch_size, acc.num_processes(),
                               args.resume_from.empty() ? "" : ", resumed from " + args.resume_from)}},
          0);

  auto model = acc.prepare(fashion::Net());
  // FusedAdamW: LibTorch's AdamW (same options and state) with a one-pass step on CPU.
  auto opt = acc.prepare(xlr8::optim::FusedAdamW(model->parameters(), torch::optim::AdamWOptions(args.lr)));
  fashion::Dataset train_set(args.data_dir, "train", args.train_limit), test_set(args.data_dir, "t10k");
  auto train = acc.prepare_data_loader(
      std::move(train_set), {.batch_size = args.batch_size, .shuffle = true, .num_workers = args.num_workers});
  auto test = acc.prepare_data_loader(std::move(test_set), {.batch_size = 256, .num_workers = args.num_workers});
  const int64_t steps_per_epoch = (train->size() + args.gradient_accumulation_steps - 1) / args.gradient_accumulation_steps;
  // Halve the learning rate every epoch (the scheduler advances once per optimizer step).
  auto scheduler = acc.prepare(torch::optim::StepLR(opt.optimizer(), static_cast<unsigned>(steps_per_epoch), 0.5));
  RunningStats stats;
  acc.register_for_checkpointing(stats);  // before load_state, which restores it
  // "latest" on a first start (no automatic checkpoint yet) starts fresh and says so, so one command line
  // serves the first run and every restart.
  const bool nothing_to_resume = args.resume_from == "latest" && !acc.latest_checkpoint();
  if (nothing_to_resume) acc.print("--resume_from latest: no checkpoint under {}/checkpoints yet; starting fresh", args.output_dir);
  if (!args.resume_from.empty() && !nothing_to_resume) {
    acc.load_state(args.resume_from == "latest" ? "" : args.resume_from);
    acc.print("resumed from {} at step {} (epoch {}, batch {}; smoothed loss {:.6f})", args.resume_from, acc.step(),
              train->epoch(), train->batches_yielded(), stats.smoothed_loss);
  }
  const int64_t total_steps = args.max_steps > 0 ? args.max_steps : steps_per_epoch * args.epochs;
  acc.print("training on {} process(es), {} samples per global batch, {} steps", acc.num_processes(),
            args.batch_size * acc.num_processes() * args.gradient_accumulation_steps, total_steps);
  const auto start = std::chrono::steady_clock::now();
  int64_t samples = 0;
  double last_loss = 0;
  std::optional<double> test_accuracy;  // none when no epoch ran (--epochs 0, or resumed at the end)
  int64_t steps_here = 0;
  bool done = acc.step() >= total_steps;
  // A bar on a terminal, a line every 50 steps otherwise (XLR8_PROGRESS=off: none).
  auto bar = acc.progress(total_steps, {.description = "train", .unit = "step", .initial = acc.step(), .line_every = 50});
  while (!done && train->epoch() < args.epochs) {
    const int64_t epoch = train->epoch() + 1;
    for (auto& batch : *train) {
      auto step = acc.accumulate(model);
      auto loss = torch::nll_loss(model->forward(batch.data), batch.target);
      acc.backward(loss);
      if (args.clip > 0) acc.clip_grad_norm(model->parameters(), args.clip);
      opt.step();
      scheduler.step();
      opt.zero_grad();
      samples += batch.data.size(0) * acc.num_processes();
      if (!acc.sync_gradients()) continue;
      last_loss = loss.item<double>();
      ++steps_here;
      stats.add_loss(last_loss);
      const int64_t global_step = acc.step();
      const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
      const double rate = samples / std::max(seconds, 1e-9);
      bar.set_postfix({{"epoch", epoch}, {"loss", last_loss}, {"samples/s", std::round(rate)}});
      bar.update();
      if (global_step % 50 == 0 || global_step == total_steps)
        acc.log({{"loss", last_loss}, {"samples_per_s", rate}, {"lr", opt.optimizer().param_groups()[0].options().get_lr()}}, global_step);
      if (args.checkpoint_every > 0 && global_step % args.checkpoint_every == 0) {
        auto where = acc.save_state();
        acc.print("saved {}", where);
      }
      if (global_step >= total_steps) {
        done = true;
        break;
      }
    }
    if (done) bar.close();
    test_accuracy = evaluate(acc, model, *test);
    stats.best_accuracy = std::max(stats.best_accuracy, *test_accuracy);
    acc.print("epoch {} test accuracy {:.4f}", epoch, *test_accuracy);
    acc.log({{"test_accuracy", *test_accuracy}, {"epoch", epoch}}, acc.step());
  }
  // Mean over ranks of the last optimizer step's batch loss.
  auto mean_loss = acc.reduce(torch::full({1}, last_loss, torch::kFloat64), xlr8::ReduceOp::AVG).item<double>();
  double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  acc.save_model(model, args.output_dir + "/model");
  acc.end_training();
  if (acc.is_main_process()) {
    // null, not 0, for what this run did not measure (no step, no evaluation).
    auto measured = [](bool was, double value) { return was ? nlohmann::json(value) : nlohmann::json(); };
    nlohmann::json result{{"final_train_loss", measured(steps_here > 0, mean_loss)},
                          {"test_accuracy", measured(test_accuracy.has_value(), test_accuracy.value_or(0))},
                          {"best_test_accuracy", stats.best_accuracy},
                          {"smoothed_loss", stats.smoothed_loss},
                          {"global_step", acc.step()},
                          {"samples_per_s", samples / std::max(seconds, 1e-9)},
                          {"num_processes", acc.num_processes()}};
    fmt::print("{}\n", result.dump());
  }
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"Train a small CNN on Fashion-MNIST with xlr8"};
  Args a;
  app.add_option("--epochs", a.epochs, "Epochs")->check(CLI::NonNegativeNumber);
  app.add_option("--max_steps", a.max_steps, "Stop after this many optimizer steps (0: no limit)");
  app.add_option("--batch_size", a.batch_size, "Batch size per process");
  app.add_option("--lr", a.lr, "Learning rate (AdamW)");
  app.add_option("--seed", a.seed, "Seed: same seed, same global data order for any number of processes");
  app.add_option("--gradient_accumulation_steps", a.gradient_accumulation_steps, "Micro-batches per optimizer step");
  app.add_option("--mixed_precision", a.mixed_precision, "no | fp16 | bf16 (default: from xlr8 launch / config)");
  app.add_option("--output_dir", a.output_dir, "Checkpoints, each run's metrics (fashion_mnist/<time>/) and the final model go here");
  app.add_option("--checkpoint_every", a.checkpoint_every, "Save a checkpoint every N optimizer steps");
  app.add_option("--resume_from", a.resume_from, "Checkpoint directory to resume from, or 'latest'");
  app.add_option("--data_dir", a.data_dir, "Directory with the Fashion-MNIST IDX .gz files");
  app.add_option("--train_limit", a.train_limit, "Use only the first N training samples (smoke tests)");
  app.add_option("--num_workers", a.num_workers, "Data-loading threads per process");
  app.add_option("--clip", a.clip, "Clip gradients to this global norm (0: off)");
  CLI11_PARSE(app, argc, argv);
  try {
    return run(a);
  } catch (const std::exception& e) {
    fmt::print(stderr, "fashion_mnist: error: {}\n", e.what());
    return 1;
  }
}
