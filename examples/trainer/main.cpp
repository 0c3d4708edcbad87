// Fashion-MNIST through xlr8::train::Trainer (Ray Train's shape): this program is the driver and, started
// again by it, each worker. Workers checkpoint through report(); when one dies the Trainer restarts the group,
// which resumes from get_checkpoint(). The driver's last line is one JSON object (metrics, checkpoints, error).
//
//   trainer --num_workers 2 --max_failures 3 --storage_path runs --name demo
//   trainer ... --crash 1:30:kill     rank 1 SIGKILLs itself at step 30, in the first group only
//   trainer ... --model tiny --checkpoint_every 1     what a small checkpoint costs (bench/trainer_report.sh)
#include <CLI/CLI.hpp>
#include <fmt/format.h>
#include <signal.h>

#include <chrono>
#include <filesystem>

#include "../fashion_mnist/fashion_mnist.hpp"
#include "xlr8/accelerator.hpp"
#include "xlr8/error.hpp"
#include "xlr8/fused_adam.hpp"
#include "xlr8/train.hpp"

namespace fs = std::filesystem;

namespace {

double unix_time() {
  return std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch()).count();
}

// "--crash R:S:how": in the first group, rank R fails at optimizer step S (kill: SIGKILL; throw: an
// exception; exit: exit code 3).
void maybe_crash(const nlohmann::json& config, int64_t step) {
  const auto crash = config.value("crash", std::string());
  if (crash.empty()) return;
  int rank = 0;
  long long at = 0;
  char how[16] = {};
  if (std::sscanf(crash.c_str(), "%d:%lld:%15s", &rank, &at, how) != 3)
    throw xlr8::Error(fmt::format("--crash {:?}: expected RANK:STEP:kill|throw|exit", crash));
  const auto context = xlr8::train::get_context();
  if (context.restart_count != 0 || context.world_rank != rank || step != at) return;
  const std::string kind = how;
  fmt::print(stderr, "trainer: injecting {} at step {} (unix time {:.3f})\n", kind, step, unix_time());
  std::fflush(stderr);
  if (kind == "kill") raise(SIGKILL);
  if (kind == "throw") throw xlr8::Error(fmt::format("injected failure at step {} on rank {}", step, rank));
  if (kind == "exit") std::_Exit(3);
}

// "--model tiny": 7 x 7 average-pooled pixels through one Linear(49, 10), 500 parameters (a 6 KB checkpoint
// with AdamW's state): what a checkpoint costs beyond its bytes.
struct TinyNetImpl : torch::nn::Module {
  TinyNetImpl() : fc(register_module("fc", torch::nn::Linear(49, 10))) {}
  torch::Tensor forward(torch::Tensor x) { return torch::log_softmax(fc(torch::avg_pool2d(x, 4).flatten(1)), 1); }
  torch::nn::Linear fc;
};
TORCH_MODULE(TinyNet);

// "--extra_state_kb N": N KB more in every checkpoint (a registered module's buffer), to time checkpoints by size.
struct PaddingImpl : torch::nn::Module {
  explicit PaddingImpl(int64_t kb) : values(register_buffer("values", torch::zeros({kb * 256}))) {}
  torch::Tensor values;
};
TORCH_MODULE(Padding);

double seconds_since(std::chrono::steady_clock::time_point start) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
}

int64_t bytes_under(const fs::path& dir) {
  int64_t total = 0;
  for (const auto& entry : fs::recursive_directory_iterator(dir))
    if (entry.is_regular_file()) total += static_cast<int64_t>(entry.file_size());
  return total;
}

template <class Model>
void run_training(xlr8::Accelerator& acc, Model net, const nlohmann::json& config) {
  auto model = acc.prepare(std::move(net));
  auto opt = acc.prepare(xlr8::optim::FusedAdamW(model->parameters(), torch::optim::AdamWOptions(config.at("lr"))));
  Padding padding(config.at("extra_state_kb").get<int64_t>());
  if (config.at("extra_state_kb").get<int64_t>() > 0) acc.register_for_checkpointing(padding);
  fashion::Dataset train_set(config.at("data_dir"), "train", config.at("train_limit").get<int64_t>());
  auto train = acc.prepare_data_loader(std::move(train_set),
                                       {.batch_size = config.at("batch_size").get<int64_t>(), .shuffle = true});
  if (auto checkpoint = xlr8::train::get_checkpoint()) {
    acc.load_state(checkpoint->path);
    acc.print("resumed from {} at step {} (unix time {:.3f})", checkpoint->path, acc.step(), unix_time());
  } else {
    acc.print("no checkpoint registered yet: starting fresh");
  }
  const auto context = xlr8::train::get_context();
  const int64_t total = config.at("steps"), every = config.at("checkpoint_every");  // every 0: no reports
  const fs::path scratch = fs::path(context.storage_path) / context.experiment_name / "worker_scratch";
  double last_loss = 0, save_s = 0, report_s = 0;
  int64_t reports = 0, checkpoint_bytes = 0;
  while (acc.step() < total) {
    for (auto& batch : *train) {
      auto step = acc.accumulate(model);
      auto loss = torch::nll_loss(model->forward(batch.data), batch.target);
      acc.backward(loss);
      opt.step();
      opt.zero_grad();
      if (!acc.sync_gradients()) continue;
      last_loss = acc.reduce(loss.detach().to(torch::kFloat64).reshape({1}), xlr8::ReduceOp::AVG).item().toDouble();
      const int64_t global_step = acc.step();
      maybe_crash(config, global_step);
      if (every > 0 && (global_step % every == 0 || global_step == total)) {
        // Every rank writes its part of the state into one folder, report() registers a copy of it.
        const auto dir = scratch / fmt::format("step_{}", global_step);
        auto start = std::chrono::steady_clock::now();
        acc.save_state(dir.string());
        save_s += seconds_since(start);
        if (acc.is_main_process() && reports == 0) checkpoint_bytes = bytes_under(dir);
        double norm = 0;
        for (const auto& p : model->parameters()) norm += p.detach().to(torch::kFloat64).pow(2).sum().item().toDouble();
        start = std::chrono::steady_clock::now();
        xlr8::train::report({{"step", global_step}, {"loss", last_loss}, {"param_sq_norm", norm}, {"world_size", acc.num_processes()}},
                            dir.string());
        report_s += seconds_since(start);
        ++reports;
        if (acc.is_main_process()) fs::remove_all(dir);  // after report(), which is a barrier
      }
      if (global_step >= total) break;
    }
  }
  if (reports > 0)
    acc.print("checkpoint costs: save_state {:.2f} ms, report {:.2f} ms (means of {}; {} bytes each)",
              1e3 * save_s / static_cast<double>(reports), 1e3 * report_s / static_cast<double>(reports), reports,
              checkpoint_bytes);
}

void train_loop(const nlohmann::json& config) {
  xlr8::Accelerator acc;
  acc.set_seed(config.at("seed").get<uint64_t>());
  if (config.at("model") == "tiny") run_training(acc, TinyNet(), config);
  else run_training(acc, fashion::Net(), config);
  // Optional since the Trainer ends the worker group itself (it closes trackers, and waits for every rank).
  if (config.at("end_training").get<bool>()) acc.end_training();
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"Fashion-MNIST through xlr8::train::Trainer"};
  xlr8::train::ScalingConfig scaling;
  xlr8::train::RunConfig run{.name = "fashion_mnist_trainer", .storage_path = "xlr8_results"};
  nlohmann::json config{{"seed", 42},       {"lr", 1e-3}, {"batch_size", 32}, {"steps", 40}, {"checkpoint_every", 10},
                        {"train_limit", 4096}, {"crash", ""}, {"data_dir", "/usr/share/datasets/fashion-mnist"}};
  int64_t steps = 40, every = 10, batch = 32, limit = 4096, extra_kb = 0;
  std::string crash, data_dir = config["data_dir"], score, model = "net";
  int keep = 0;
  bool no_end_training = false;
  std::string workers = "1";
  app.add_option("--num_workers", workers, "Worker processes, N or MIN:MAX (elastic)");
  app.add_option("--rdzv_endpoint", scaling.rendezvous_endpoint,
                 "Several machines: host:port of the rendezvous, or etcd://host:port[,...] of an etcd cluster (each "
                 "machine runs this program)");
  app.add_option("--workers_per_machine", scaling.workers_per_machine, "Several machines: workers on each");
  app.add_option("--cpus_per_worker", scaling.resources_per_worker.cpus, "Cores per worker (a range of workers: "
                 "as many as the cores allow)");
  app.add_option("--rdzv_conf", scaling.rendezvous_conf, "Several machines: torchrun's --rdzv_conf");
  app.add_option("--max_failures", run.failure_config.max_failures, "Group restarts after a failure (-1: no limit)");
  app.add_option("--storage_path", run.storage_path, "Runs are kept under this folder");
  app.add_option("--name", run.name, "The run's name (its folder under --storage_path); an existing run resumes");
  app.add_option("--config_file", run.launch_config_file, "Accelerate config the workers run with (strategy, precision)");
  app.add_option("--num_to_keep", keep, "Keep only this many checkpoints (0: all)");
  app.add_option("--score", score, "Keep the checkpoints with the lowest value of this metric (empty: the latest)");
  app.add_option("--steps", steps, "Optimizer steps");
  app.add_option("--checkpoint_every", every, "Report a checkpoint every N steps (0: never)");
  app.add_option("--model", model, "net (a small CNN) or tiny (one Linear(49, 10): a 6 KB checkpoint)")
      ->check(CLI::IsMember({"net", "tiny"}));
  app.add_option("--extra_state_kb", extra_kb, "Add this many KB to every checkpoint (to time them by size)");
  app.add_flag("--no_end_training", no_end_training, "Return from the loop without Accelerator::end_training()");
  app.add_option("--batch_size", batch, "Batch size per worker");
  app.add_option("--train_limit", limit, "Use the first N training samples");
  app.add_option("--data_dir", data_dir, "Directory with the Fashion-MNIST IDX .gz files");
  app.add_option("--crash", crash, "RANK:STEP:kill|throw|exit: fail once, in the first group");
  CLI11_PARSE(app, argc, argv);
  // Whole numbers only ("2x", "1.5" and "1:2:3" are refused, not read as 2, 1 and 1:2).
  auto count = [](const std::string& text) {
    size_t used = 0;
    const int n = std::stoi(text, &used);
    if (used != text.size()) throw std::invalid_argument(text);
    return n;
  };
  try {
    const size_t colon = workers.find(':');
    scaling.num_workers = colon == std::string::npos
                              ? xlr8::train::NumWorkers(count(workers))
                              : xlr8::train::NumWorkers(count(workers.substr(0, colon)), count(workers.substr(colon + 1)));
  } catch (const std::logic_error&) {
    fmt::print(stderr, "trainer: --num_workers {:?}: give N or MIN:MAX\n", workers);
    return 2;
  }
  // A crash that cannot happen is refused here, not in every worker (or never): its form, kind and rank.
  if (!crash.empty()) {
    int rank = 0;
    long long at = 0;
    char how[16] = {};
    const bool parsed = std::sscanf(crash.c_str(), "%d:%lld:%15s", &rank, &at, how) == 3;
    const std::string kind = how;
    if (!parsed || (kind != "kill" && kind != "throw" && kind != "exit") || rank < 0 ||
        rank >= scaling.num_workers.max || at < 1) {
      fmt::print(stderr, "trainer: --crash {:?}: give RANK:STEP:kill|throw|exit with a rank below the workers ({}) and "
                         "a step from 1\n",
                 crash, scaling.num_workers.max);
      return 2;
    }
  }
  config["steps"] = steps;
  config["checkpoint_every"] = every;
  config["batch_size"] = batch;
  config["train_limit"] = limit;
  config["crash"] = crash;
  config["data_dir"] = data_dir;
  config["model"] = model;
  config["extra_state_kb"] = extra_kb;
  config["end_training"] = !no_end_training;
  if (keep != 0) run.checkpoint_config.num_to_keep = keep;
  if (!score.empty()) {
    run.checkpoint_config.checkpoint_score_attribute = score;
    run.checkpoint_config.checkpoint_score_order = "min";
  }
  try {
    auto result = xlr8::train::Trainer(train_loop, config, scaling, run).fit();
    if (result.worker) return 0;
    nlohmann::json summary{{"metrics", result.metrics}, {"path", result.path}};
    summary["checkpoint"] = result.checkpoint ? nlohmann::json(result.checkpoint->path) : nlohmann::json();
    summary["best_checkpoints"] = nlohmann::json::array();
    for (const auto& [checkpoint, metrics] : result.best_checkpoints)
      summary["best_checkpoints"].push_back({{"path", checkpoint.path}, {"metrics", metrics}});
    if (result.error) {
      summary["error"] = result.error->message();
      fmt::print(stderr, "trainer: {}\n", result.error->message());
    }
    fmt::print("{}\n", summary.dump());
    return result.error ? 1 : 0;
  } catch (const std::exception& e) {
    fmt::print(stderr, "trainer: error: {}\n", e.what());
    return 1;
  }
}
