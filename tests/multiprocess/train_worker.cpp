// The training side of the correctness oracle: a small MLP on deterministic synthetic data, trained
// through xlr8::Accelerator. Launched on 1 or N processes by the tests; rank 0 prints one JSON line
// with the per-step losses (mean over ranks) and writes the final parameters with save_model.
//   --batch B --accum K --steps S --precision no|bf16|fp16 --out DIR
//   --checkpoint_at N (save_state after optimizer step N)   --resume DIR
//   --clip_value V (clip_grad_value instead of clip_grad_norm to 5)   --max_norm M (clip_grad_norm to M)
//   --save_every N (save_state into DIR/checkpoint every N steps)   --die_at N --die_rank R
//   --mode train|gather|mismatch|unused   --find_unused   --samples N   --optimizer adamw|fused_adamw
//   --norm (a LayerNorm fed by the first Linear; the model a sharded unit)
//   --split_batches (--batch is the global batch, the same on any number of processes)
//   --resume_latest (resume from DIR/checkpoint when it exists: a restarted elastic job)
//   --step_sleep_ms N (each step takes at least this long)   --print_steps (rank 0: "step N" after each step)
//   --dropout P (a Dropout after the first layer)   --init_by_rank (each rank seeds its model's draws differently)
//   --uneven_batches (AcceleratorOptions::even_batches off)   --batch_norm (a BatchNorm1d after the first layer)
//   --track (init_trackers("oracle") in --out; log loss and lr every step)
//   --count_host_reads (report the reads of tensor values on the host inside the steps after the first, the
//   program's own excluded: "host_reads", the largest rank's)
//   --mode nested|nested-mismatch|free-memory|free-control (train_worker_api.cpp)
//   --build_reads_values (the model built in Accelerator::build_model, which reads a value of it back)
//   --retry_failed_load (a --resume that fails on any rank is loaded again on every rank; "load_errors": what the
//   first load said on each)
#include <CLI/CLI.hpp>
#include <fmt/format.h>

#include <algorithm>
#include <csignal>
#include <torch/torch.h>

#include <chrono>
#include <filesystem>
#include <optional>
#include <fstream>
#include <thread>

#include "xlr8/accelerator.hpp"
#include "xlr8/error.hpp"
#include "xlr8/fused_adam.hpp"
#include "xlr8/nn.hpp"
#include "xlr8/tensor_parallel.hpp"
#include "xlr8/unshard.hpp"
#include "../unit/op_counter.hpp"
#include "train_worker_api.hpp"

namespace {

struct Synthetic {  // a fixed classification problem, identical on every rank
  at::Tensor x, y;
  explicit Synthetic(int64_t n) {
    auto gen = at::detail::createCPUGenerator(1234);
    x = at::randn({n, 8}, gen);
    y = (x.narrow(1, 0, 1).squeeze(1) + x.narrow(1, 1, 1).squeeze(1) * 2 > 0).to(at::kLong) +
        (x.narrow(1, 2, 1).squeeze(1) > 0.5).to(at::kLong) * 2;
  }
  size_t size() const { return static_cast<size_t>(x.size(0)); }
  torch::data::Example<> get(size_t i) const { return {x[i], y[i]}; }
};

struct MlpImpl : torch::nn::Module {
  MlpImpl(int64_t hidden, bool with_unused, bool with_norm, double dropout = 0, bool batch_norm = false) {
    fc1 = register_module("fc1", torch::nn::Linear(8, hidden));
    fc2 = register_module("fc2", torch::nn::Linear(hidden, 4));
    if (dropout > 0) drop = register_module("drop", torch::nn::Dropout(dropout));
    if (batch_norm) bn = register_module("bn", torch::nn::BatchNorm1d(hidden));
    if (with_unused) spare = register_module("spare", torch::nn::Linear(4, 4));
    if (with_norm) norm = register_module("norm", torch::nn::LayerNorm(torch::nn::LayerNormOptions({hidden})));
  }
  at::Tensor forward(const at::Tensor& x) {
    if (drop) return fc2(drop(torch::tanh(fc1(x))));
    if (bn) return fc2(torch::tanh(bn(fc1(x))));  // each rank's share normalised by its own statistics
    if (!norm) return fc2(torch::tanh(fc1(x)));
    // A Linear's output straight into a LayerNorm (bf16 into fp32 weights under autocast), as a sharded unit.
    return xlr8::sharded(*this, [&] { return fc2(torch::tanh(norm(fc1(x)))); });
  }
  torch::nn::Linear fc1{nullptr}, fc2{nullptr}, spare{nullptr};
  torch::nn::LayerNorm norm{nullptr};
  torch::nn::Dropout drop{nullptr};
  torch::nn::BatchNorm1d bn{nullptr};
};
TORCH_MODULE(Mlp);

// Mlp with xlr8's drop-in layers, for tensor parallelism (the same parameters and draws at tp 1).
struct TpMlpImpl : torch::nn::Module {
  explicit TpMlpImpl(int64_t hidden) {
    fc1 = register_module("fc1", xlr8::nn::Linear(8, hidden));
    fc2 = register_module("fc2", xlr8::nn::Linear(hidden, 4));
  }
  at::Tensor forward(const at::Tensor& x) { return fc2(torch::tanh(fc1(x))); }
  xlr8::nn::Linear fc1{nullptr}, fc2{nullptr};
};
TORCH_MODULE(TpMlp);

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"xlr8 oracle worker"};
  int64_t batch = 4, steps = 12, checkpoint_at = 0, samples = 96;
  int accum = 1;
  std::string precision = "no", out = ".", resume, mode = "train";
  bool find_unused = false, compress = false, zero_in_place = false, track = false, with_norm = false;
  app.add_option("--batch", batch);
  app.add_option("--accum", accum);
  app.add_option("--steps", steps);
  app.add_option("--precision", precision);
  app.add_option("--out", out);
  app.add_option("--checkpoint_at", checkpoint_at);
  int64_t save_every = 0, die_at = 0;
  double clip_value = 0;
  app.add_option("--clip_value", clip_value);  // clip_grad_value instead of clip_grad_norm
  double max_norm = 5.0;
  app.add_option("--max_norm", max_norm);
  int die_rank = -1;
  app.add_option("--save_every", save_every);  // save_state(out/checkpoint) after every N steps, overwriting
  app.add_option("--die_at", die_at);          // with --die_rank: that rank SIGKILLs itself as the others save
  app.add_option("--die_rank", die_rank);
  app.add_option("--resume", resume);
  app.add_option("--mode", mode);
  app.add_option("--samples", samples);
  app.add_flag("--find_unused", find_unused);
  app.add_flag("--norm", with_norm, "a LayerNorm between the two Linear layers");
  app.add_flag("--compress_bf16", compress);
  app.add_flag("--zero_in_place", zero_in_place);
  app.add_flag("--track", track);
  bool tensor_parallel = false;
  app.add_flag("--tensor_parallel", tensor_parallel, "TpMlp, fc1 column-wise and fc2 row-wise over the mesh's tp group");
  bool split_batches = false, resume_latest = false, print_steps = false;
  int step_sleep_ms = 0;
  double dropout = 0;
  bool init_by_rank = false, uneven = false, batch_norm = false;
  app.add_flag("--batch_norm", batch_norm, "a BatchNorm1d after the first Linear");
  app.add_flag("--uneven_batches", uneven, "even_batches off: a short last batch is shared unevenly, not padded");
  app.add_option("--dropout", dropout);
  app.add_flag("--init_by_rank", init_by_rank);
  app.add_flag("--split_batches", split_batches);
  app.add_flag("--resume_latest", resume_latest);
  app.add_flag("--print_steps", print_steps);
  bool count_host_reads = false;
  app.add_flag("--count_host_reads", count_host_reads);
  bool build_reads_values = false;  // Accelerator::build_model, reading a value back: no recorded build can
  app.add_flag("--build_reads_values", build_reads_values);
  bool retry_failed_load = false;  // a --resume whose load fails on some rank is loaded again, on every rank
  app.add_flag("--retry_failed_load", retry_failed_load);
  app.add_option("--step_sleep_ms", step_sleep_ms);
  std::string optimizer = "adamw";
  app.add_option("--optimizer", optimizer)->check(CLI::IsMember({"adamw", "fused_adamw"}));
  CLI11_PARSE(app, argc, argv);
  if (batch_norm && dropout > 0) {  // the model has one or the other after its first layer
    fmt::print(stderr, "train_worker: --batch_norm and --dropout cannot go together\n");
    return 2;
  }
  try {
    xlr8::AcceleratorOptions options;
    options.mixed_precision = xlr8::parse_mixed_precision(precision, "--precision");
    options.gradient_accumulation_steps = accum;
    options.split_batches = split_batches;
    options.even_batches = !uneven;
    options.parallel.ddp.find_unused_parameters = find_unused;
    options.parallel.ddp.compress_bf16 = compress;
    options.parallel.ddp.first_bucket_mb = 0.0002;  // three buckets even for this small model
    options.parallel.ddp.bucket_cap_mb = 0.0005;
    if (track) options.project_dir = out;
    xlr8::Accelerator acc(options);
    acc.set_seed(7);
    if (track) acc.init_trackers("oracle", {{"batch", batch}, {"steps", steps}});

    if (mode.rfind("nested", 0) == 0) {
      int code = run_nested_mode(acc, mode);
      acc.end_training();
      return code;
    }
    if (mode.rfind("free-", 0) == 0) {
      int code = run_free_memory_mode(acc, mode);
      acc.end_training();
      return code;
    }
    if (mode == "gather") {  // gather_for_metrics must return exactly the dataset, padding dropped
      struct Ids {
        int64_t n;
        size_t size() const { return static_cast<size_t>(n); }
        at::Tensor get(size_t i) const { return at::full({}, static_cast<int64_t>(i), at::kLong); }
      };
      auto loader = acc.prepare_data_loader(Ids{samples}, {.batch_size = batch});
      std::vector<int64_t> seen;
      for (auto& b : *loader) {
        auto all = acc.gather_for_metrics(b);
        for (int64_t i = 0; i < all.size(0); ++i) seen.push_back(all[i].item<int64_t>());
      }
      if (acc.is_main_process()) fmt::print("{}\n", nlohmann::json{{"gathered", seen}}.dump());
      acc.end_training();
      return 0;
    }

    if (mode == "helpers") {  // the small collectives of the Accelerator, on real ranks
      const int r = acc.process_index();
      auto mine = at::full({r + 1, 2}, static_cast<double>(r + 1));  // ranks hold different lengths
      auto padded = acc.pad_across_processes(mine, 0, -1.0);
      auto first = acc.pad_across_processes(mine, 0, -1.0, /*pad_first=*/true);
      auto past_last_dim = acc.pad_across_processes(mine, 2, -1.0);  // a dimension it lacks: left as it is
      auto gathered = acc.gather(padded);
      auto items = acc.split_between_processes(std::vector<int>{10, 11, 12}, /*apply_padding=*/true);
      auto maximum = acc.reduce(at::full({1}, static_cast<double>(r)), xlr8::ReduceOp::MAX).item<double>();
      std::vector<int> order;  // main_process_first: rank 0's body runs before everyone else's
      auto marker = out + "/first";
      acc.main_process_first([&] {
        if (r != 0) order.push_back(std::filesystem::exists(marker) ? 1 : 0);
        else std::ofstream(marker) << "0";
      });
      int local_first = 0, on_main = 0, on_local_main = 0;
      auto local_marker = out + "/local_first";
      acc.local_main_process_first([&] {
        if (!acc.is_local_main_process()) local_first = std::filesystem::exists(local_marker) ? 1 : 0;
        else std::ofstream(local_marker) << "0";
      });
      acc.on_main_process([&] { ++on_main; });
      acc.on_local_main_process([&] { ++on_local_main; });
      auto objects = acc.gather_object(fmt::format("rank {}", r));
      // backward twice through one graph with retain_graph: gradients add up.
      auto w = torch::ones({2}, torch::requires_grad());
      auto y = (w * 3).sum();
      acc.backward(y, /*retain_graph=*/true);
      acc.backward(y);
      auto all = acc.state().world().all_gather_object(nlohmann::json{{"rank", r},
                                                                {"local_first", local_first},
                                                                {"on_main", on_main},
                                                                {"on_local_main", on_local_main},
                                                                {"objects", objects},
                                                                {"twice_grad", w.grad()[0].item<double>()},
                                                                {"padded_rows", padded.size(0)},
                                                                {"pad_first_row0", first[0][0].item<double>()},
                                                                {"past_last_dim_rows", past_last_dim.size(0)},
                                                                {"items", items},
                                                                {"max", maximum},
                                                                {"saw_marker", order}}
                                                    .dump());
      if (acc.is_main_process()) {
        std::vector<double> column;
        for (int64_t i = 0; i < gathered.size(0); ++i) column.push_back(gathered[i][0].item<double>());
        nlohmann::json report{{"gathered", column}, {"ranks", nlohmann::json::array()}};
        for (auto& a : all) report["ranks"].push_back(nlohmann::json::parse(a));
        fmt::print("{}\n", report.dump());
      }
      acc.end_training();
      return 0;
    }

    int64_t hidden = (mode == "mismatch" && acc.process_index() == 1) ? 12 : 16;
    int64_t tp_size = 1, local_hidden = hidden;  // reported: what the tp group really split
    // The training loop, for either model.
    auto train = [&](auto model) -> int {
      const torch::optim::AdamWOptions adamw(1e-2);
      auto opt = optimizer == "fused_adamw" ? acc.prepare(xlr8::optim::FusedAdamW(model->parameters(), adamw))
                                            : acc.prepare(torch::optim::AdamW(model->parameters(), adamw));
      auto sched = acc.prepare(torch::optim::StepLR(opt.optimizer(), 5, 0.5));
      auto loader = acc.prepare_data_loader(Synthetic(samples), {.batch_size = batch, .shuffle = true, .seed = 11});
      if (resume_latest && std::filesystem::exists(out + "/checkpoint")) resume = out + "/checkpoint";
      std::vector<std::string> load_errors;  // --retry_failed_load: what the first load said on each rank
      if (!resume.empty() && retry_failed_load) {
        std::string said;
        try {
          acc.load_state(resume);
        } catch (const xlr8::Error& e) {
          said = e.what();
        }
        load_errors = acc.state().world().all_gather_object(said);
        if (std::ranges::any_of(load_errors, [](const auto& e) { return !e.empty(); })) acc.load_state(resume);
      } else if (!resume.empty()) {
        acc.load_state(resume);
      }
      if (print_steps && acc.is_main_process())
        fmt::print("start at step {} on {} processes\n", acc.step(), acc.num_processes()), std::fflush(stdout);
      const int64_t resumed_step = acc.step();

      std::vector<double> losses;
      // Host reads (counted as Accelerator.ATrainingStepReadsNothingBack... does) from the accumulate scope to zero_grad:
      // the library's part of a step, not the loader's indices or the program's own loss read below.
      std::optional<xlr8::testing::OpCounter> reads;
      if (count_host_reads) reads.emplace(xlr8::testing::OpCounter::host_reads());
      int64_t library_reads = 0;
      while (acc.step() < steps) {
        for (auto& b : *loader) {
          const int64_t reads_before = reads ? reads->count() : 0;
          auto scope = acc.accumulate(model);
          at::Tensor loss = torch::cross_entropy_loss(model->forward(b.data), b.target);
          acc.backward(loss);
          if (clip_value > 0) acc.clip_grad_value(model->parameters(), clip_value);
          else acc.clip_grad_norm(model->parameters(), max_norm);
          opt.step();
          sched.step();
          opt.zero_grad(!zero_in_place);
          if (reads && acc.step() > resumed_step + 1) library_reads += reads->count() - reads_before;
          if (!acc.sync_gradients()) continue;
          losses.push_back(acc.reduce(loss.detach().to(at::kDouble), xlr8::ReduceOp::AVG).item<double>());
          if (track)
            acc.log({{"loss", losses.back()}, {"lr", opt.optimizer().param_groups()[0].options().get_lr()}}, acc.step());
          // Only in a first attempt: a group restarted after the death must get past that step.
          const char* restarted = std::getenv("TORCHELASTIC_RESTART_COUNT");
          if (die_rank == acc.process_index() && acc.step() == die_at && (!restarted || std::string(restarted) == "0"))
            raise(SIGKILL);
          if (step_sleep_ms > 0) std::this_thread::sleep_for(std::chrono::milliseconds(step_sleep_ms));
          if ((checkpoint_at > 0 && acc.step() == checkpoint_at) || (save_every > 0 && acc.step() % save_every == 0))
            acc.save_state(out + "/checkpoint");
          if (print_steps && acc.is_main_process()) fmt::print("step {}\n", acc.step()), std::fflush(stdout);
          if (acc.step() >= steps) break;
        }
      }
      // A tensor-parallel model's ranks hold slices, which save_model does not gather yet.
      if (!tensor_parallel) acc.save_model(model, out + "/model");
      reads.reset();
      auto stats = acc.parallel_stats(model);
      auto figure = [&](const char* key) { return stats.value(key, nlohmann::json(0)); };
      const auto most_reads = acc.reduce(torch::full({1}, static_cast<double>(library_reads), torch::kFloat64),
                                         xlr8::ReduceOp::MAX).item<double>();
      if (acc.is_main_process())
        fmt::print("{}\n", nlohmann::json{{"losses", losses},
                                           {"resumed_step", resumed_step},
                                           {"num_processes", acc.num_processes()},
                                           {"step", acc.step()},
                                           {"lr", opt.optimizer().param_groups()[0].options().get_lr()},
                                           {"strategy", stats["strategy"]},
                                           {"plan", acc.plan().to_json()},
                                           {"buckets", figure("buckets")},
                                           {"launches", figure("launches")},
                                           {"overlapped", figure("overlapped_launches")},
                                           {"exposed_comm_s", figure("exposed_comm_seconds")},
                                           {"shared_memory", acc.state().world().uses_shared_memory()},
                                           {"tp_size", tp_size},
                                           {"host_reads", most_reads},
                                           {"optimizer_on_disk", stats.value("optimizer_on_disk", nlohmann::json())},
                                           {"local_hidden", local_hidden},
                                           {"load_errors", load_errors}}
                               .dump());
      acc.end_training();
      return 0;
    };
    if (init_by_rank) torch::manual_seed(1000 + acc.process_index());  // a bug verify must name
    if (build_reads_values)
      return train(acc.prepare(acc.build_model([&] {
        Mlp model(hidden, mode == "unused", with_norm, dropout, batch_norm);
        if (model->fc1->weight.abs().max().item<double>() > 1) throw std::runtime_error("fc1's init is out of range");
        return model;
      })));
    if (!tensor_parallel) return train(acc.prepare(Mlp(hidden, mode == "unused", with_norm, dropout, batch_norm)));
    // fc1 column-wise, fc2 row-wise over the mesh's tp group, before the Accelerator sees the model.
    TpMlp model(hidden);
    xlr8::tp::parallelize(*model, acc.state().mesh().group(xlr8::MeshDim::tp),
                          {{"fc1", xlr8::tp::Style::Colwise}, {"fc2", xlr8::tp::Style::Rowwise}}, /*strict=*/true);
    tp_size = acc.state().mesh().group(xlr8::MeshDim::tp).size();
    local_hidden = model->fc1->weight.size(0);
    return train(acc.prepare(model));
  } catch (const std::exception& e) {
    fmt::print(stderr, "train_worker: error: {}\n", e.what());
    return 1;
  }
}
