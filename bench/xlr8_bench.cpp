// xlr8-bench: training-step throughput of the bench specs, and collective bandwidth.
//   --model mlp|transformer --batch B --steps S --warmup W --threads T --impl xlr8|handwritten
//   [--optimizer adamw|fused_adamw|fused_adamw_torch_kernel]
//   --collectives [--max_mb M]   (launch on 2 ranks with `xlr8 launch`)
// Each training run prints one JSON line: {"impl", "model", "nproc", "batch_per_rank", "step_ms_median",
// "samples_per_s", "peak_rss_mb", "forward_ms_median", "backward_ms_median", "optimizer_ms_median"}, plus
// "comm_wait_ms_median" under DDP (the part of backward spent waiting for unfinished all-reduces);
// samples/s counts all ranks. Benchmarks, never assertions.
#include <CLI/CLI.hpp>
#include <fmt/format.h>
#include <sys/resource.h>
#include <torch/torch.h>

#include <chrono>
#include <cstring>
#include <set>

#include "compat/torch_compat.hpp"
#include "core/flight_recorder.hpp"
#include "optim/fused_adam_testing.hpp"
#include "xlr8/accelerator.hpp"
#include "xlr8/fused_adam.hpp"

namespace {

using Clock = std::chrono::steady_clock;

struct Spec {
  std::string model = "mlp";
  int64_t batch = 64;
  int steps = 50;
  int warmup = 5;
  int threads = 1;
  std::string impl = "xlr8";
  double bucket_cap_mb = 25;
  bool compress_bf16 = false;
  bool zero_in_place = false;  // zero_grad(false): keep .grad allocated (and a bucket view under DDP)
  bool lockstep_only = false;  // diagnostic: a barrier per step instead of DDP's gradient all-reduce
  std::string optimizer = "adamw";  // xlr8 only: adamw (LibTorch's) | fused_adamw (xlr8::optim::FusedAdamW)
};

// MLP 784-2048-2048-10 (ReLU), or a small transformer encoder (d_model 256, 4 heads, 2 layers, seq 128).
torch::nn::Sequential make_model(const std::string& name) {
  if (name == "mlp")
    return torch::nn::Sequential(torch::nn::Linear(784, 2048), torch::nn::ReLU(), torch::nn::Linear(2048, 2048),
                                 torch::nn::ReLU(), torch::nn::Linear(2048, 10));
  if (name == "transformer") {
    auto layer = torch::nn::TransformerEncoderLayerOptions(256, 4).dim_feedforward(1024).dropout(0.0);
    return torch::nn::Sequential(torch::nn::TransformerEncoder(torch::nn::TransformerEncoderOptions(layer, 2)),
                                 torch::nn::Linear(256, 10));
  }
  throw std::invalid_argument("unknown --model " + name + " (mlp or transformer)");
}

// Synthetic inputs, fixed for the run: [B, 784] or [seq 128, B, 256].
std::pair<at::Tensor, at::Tensor> make_batch(const std::string& model, int64_t batch) {
  if (model == "mlp") return {torch::randn({batch, 784}), torch::randint(10, {batch})};
  return {torch::randn({128, batch, 256}), torch::randint(10, {128 * batch})};
}

at::Tensor loss_of(const std::string& model, torch::nn::Sequential& net, const std::pair<at::Tensor, at::Tensor>& b) {
  auto out = net->forward(b.first);
  if (model == "transformer") out = out.reshape({-1, 10});
  return torch::cross_entropy_loss(out, b.second);
}

double peak_rss_mb() {
  rusage usage{};
  getrusage(RUSAGE_SELF, &usage);
  return usage.ru_maxrss / 1024.0;
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v.empty() ? 0 : v[v.size() / 2];
}

// Per timed step: the whole step, and its forward, backward (with DDP's wait for the all-reduce) and
// optimizer (zero_grad + step) parts, so a slower step can be traced to its phase.
struct StepTimes {
  std::vector<double> step, forward, backward, optimizer;
  template <class ZeroGrad, class Forward, class Backward, class Step>
  void time(ZeroGrad&& zero_grad, Forward&& run_forward, Backward&& run_backward, Step&& optimizer_step) {
    auto ms = [](Clock::time_point a, Clock::time_point b) { return std::chrono::duration<double, std::milli>(b - a).count(); };
    auto t0 = Clock::now();
    zero_grad();
    auto t1 = Clock::now();
    auto loss = run_forward();
    auto t2 = Clock::now();
    run_backward(loss);
    auto t3 = Clock::now();
    optimizer_step();
    auto t4 = Clock::now();
    step.push_back(ms(t0, t4));
    forward.push_back(ms(t1, t2));
    backward.push_back(ms(t2, t3));
    optimizer.push_back(ms(t0, t1) + ms(t3, t4));
  }
};

// `medians` holds the step, forward, backward and optimizer medians (the slowest rank's, under DDP),
// then under DDP the median time backward's end waited for all-reduces still running.
// Bytes of parameters, gradients and optimizer state held, each storage once (as examples/gpt counts).
int64_t state_bytes(const torch::nn::Module& model, const torch::optim::Optimizer& opt) {
  std::set<const void*> seen;
  int64_t total = 0;
  auto add = [&](const at::Tensor& t) {
    if (t.defined() && seen.insert(t.storage().data()).second) total += static_cast<int64_t>(t.storage().nbytes());
  };
  for (const auto& p : model.parameters()) add(p), add(p.grad());
  for (const auto& group : opt.param_groups())
    for (const auto& p : group.params()) add(p), add(p.grad());
  for (const auto& [key, state] : opt.state())
    if (const auto* a = dynamic_cast<const torch::optim::AdamWParamState*>(state.get()))
      add(a->exp_avg()), add(a->exp_avg_sq()), add(a->max_exp_avg_sq());
  return total;
}

void report(const Spec& s, int nproc, const std::vector<double>& medians, double rss_mb, int64_t state = -1) {
  const double med = medians[0];
  const std::string impl = s.impl + (s.compress_bf16 ? "_bf16_wire" : "") + (s.optimizer == "adamw" ? "" : "_" + s.optimizer);
  nlohmann::json line{{"impl", impl},
                      {"model", s.model},
                      {"nproc", nproc},
                      {"batch_per_rank", s.batch},
                      {"step_ms_median", med},
                      {"samples_per_s", s.batch * nproc * 1000.0 / med},
                      {"peak_rss_mb", rss_mb},
                      {"forward_ms_median", medians[1]},
                      {"backward_ms_median", medians[2]},
                      {"optimizer_ms_median", medians[3]}};
  if (medians.size() > 4) line["comm_wait_ms_median"] = medians[4];
  if (state >= 0) line["state_bytes_per_rank"] = state;
  fmt::print("{}\n", line.dump());
  std::fflush(stdout);
}

std::vector<double> medians_of(const StepTimes& t) {
  return {median(t.step), median(t.forward), median(t.backward), median(t.optimizer)};
}

// (a) The loop a user writes without xlr8.
int handwritten(const Spec& s) {
  at::set_num_threads(s.threads);
  torch::manual_seed(0);
  auto net = make_model(s.model);
  torch::optim::AdamW opt(net->parameters(), torch::optim::AdamWOptions(1e-3));
  auto batch = make_batch(s.model, s.batch);
  StepTimes times, warmup;
  for (int i = 0; i < s.warmup + s.steps; ++i)
    (i < s.warmup ? warmup : times)
        .time([&] { opt.zero_grad(); }, [&] { return loss_of(s.model, net, batch); },
              [&](const at::Tensor& loss) { loss.backward(); }, [&] { opt.step(); });
  report(s, 1, medians_of(times), peak_rss_mb());
  return 0;
}

// (b)/(c) The same loop through xlr8 (DDP when launched on several processes).
int with_xlr8(const Spec& s) {
  xlr8::AcceleratorOptions options;
  options.parallel.ddp.bucket_cap_mb = s.bucket_cap_mb;
  options.parallel.ddp.compress_bf16 = s.compress_bf16;
  xlr8::Accelerator acc(options);
  at::set_num_threads(s.threads);
  torch::manual_seed(0);
  auto net = acc.prepare(make_model(s.model));
  const torch::optim::AdamWOptions adamw(1e-3);
  // fused_adamw_torch_kernel: FusedAdamW stepping CPU parameters with LibTorch's fused kernel (CUDA's path).
  xlr8::optim::detail::use_torch_kernel_on_cpu(s.optimizer == "fused_adamw_torch_kernel");
  auto opt = s.optimizer != "adamw" ? acc.prepare(xlr8::optim::FusedAdamW(net->parameters(), adamw))
                                    : acc.prepare(torch::optim::AdamW(net->parameters(), adamw));
  auto batch = make_batch(s.model, s.batch);
  // DDP's figure for the communication that overlap did not hide; absent on one process.
  const bool ddp = acc.parallel_stats(net)["strategy"] == "ddp";
  auto exposed_comm = [&] { return acc.parallel_stats(net)["exposed_comm_seconds"].get<double>(); };
  std::vector<double> comm_wait_ms;  // per timed step: backward's end waiting for unfinished all-reduces
  acc.wait_for_everyone();
  StepTimes times, warmup;
  for (int i = 0; i < s.warmup + s.steps; ++i)
    (i < s.warmup ? warmup : times)
        .time(
            [&] {
              opt.zero_grad(!s.zero_in_place);
              if (s.lockstep_only) acc.wait_for_everyone();
            },
            [&] { return loss_of(s.model, net, batch); },
            [&](const at::Tensor& loss) {
              const double waited_before = ddp ? exposed_comm() : 0;
              if (s.lockstep_only) {
                auto local = acc.no_sync(net);
                acc.backward(loss);
              } else {
                acc.backward(loss);
              }
              if (i >= s.warmup && ddp) comm_wait_ms.push_back((exposed_comm() - waited_before) * 1e3);
            },
            [&] { opt.step(); });
  // The slowest rank sets the pace: report the max over ranks of each figure.
  auto mine = medians_of(times);
  mine.push_back(median(comm_wait_ms));
  mine.push_back(peak_rss_mb());
  mine.push_back(static_cast<double>(state_bytes(*net.ptr(), opt.optimizer())));
  auto slowest = acc.reduce(at::tensor(mine, at::kDouble), xlr8::ReduceOp::MAX);
  std::vector<double> medians(slowest.data_ptr<double>(), slowest.data_ptr<double>() + 4);
  if (ddp) medians.push_back(slowest[4].item<double>());
  if (acc.is_main_process())
    report(s, acc.num_processes(), medians, slowest[5].item<double>(), static_cast<int64_t>(slowest[6].item<double>()));
  acc.end_training();
  return 0;
}

// Collective bandwidth on the world group: ours vs raw c10d Gloo, against a memcpy ceiling.
int collectives(double max_mb) {
  const auto& state = xlr8::ProcessState::instance();
  auto& comm = state.world();
  const int P = comm.size();
  {  // the machine's single-thread copy bandwidth
    auto a = at::ones({16 << 20}), b = at::empty_like(a);
    auto start = Clock::now();
    for (int i = 0; i < 10; ++i) std::memcpy(b.data_ptr(), a.data_ptr(), a.nbytes());
    double s = std::chrono::duration<double>(Clock::now() - start).count();
    if (state.is_main_process()) fmt::print("{}\n", nlohmann::json{{"memcpy_gb_per_s", 10 * a.nbytes() / s / 1e9}}.dump());
  }
  // The baseline: a raw c10d Gloo group built the way a hand-rolled C++ loop does (its own TCPStore on
  // MASTER_PORT + 1, ProcessGroupGloo on loopback), called directly.
  const auto& t = state.topology();
  auto store = xlr8::compat::make_tcp_store(t.master_addr, t.master_port + 1, t.rank == 0, P, std::chrono::seconds(60));
  auto backend = xlr8::compat::make_gloo(store, t.rank, P, std::chrono::seconds(60), t.master_addr);
  auto slowest = [&](double seconds) {
    auto v = at::full({1}, seconds, at::kDouble);
    comm.all_reduce(v, xlr8::ReduceOp::MAX);
    return v.item<double>();
  };
  for (double kb = 1; kb <= max_mb * 1024; kb *= 4) {
    int64_t n = static_cast<int64_t>(kb * 1024 / 4);
    n = std::max<int64_t>(P, n / P * P);
    auto x = at::ones({n});
    auto out = at::empty({n / P});
    auto gathered = at::empty({n});
    // The same operands in shared memory (symmetric_empty), which all_reduce and reduce_scatter read in place.
    auto xs = comm.symmetric_empty({n}, at::kFloat).fill_(1);
    int reps = kb <= 1024 ? 50 : 5;
    auto time = [&](auto&& fn) {
      fn();
      comm.barrier();
      std::vector<double> t;
      for (int i = 0; i < reps; ++i) {
        auto start = Clock::now();
        fn();
        t.push_back(std::chrono::duration<double>(Clock::now() - start).count());
      }
      return slowest(median(t));
    };
    double ar = time([&] { comm.all_reduce(x); });
    double rs = time([&] { comm.reduce_scatter(out, x); });
    double ag = time([&] { comm.all_gather(gathered, out); });
    double ar_sym = time([&] { comm.all_reduce(xs); });
    double rs_sym = time([&] { comm.reduce_scatter(out, xs); });
    // Raw c10d Gloo baselines: allreduce directly on the backend; reduce-scatter as Gloo 2.x does it
    // (allreduce + take the chunk); all-gather through Gloo's list allgather.
    double raw_ar = time([&] {
      std::vector<at::Tensor> v{x};
      backend->allreduce(v)->wait();
    });
    double raw_rs = time([&] {
      std::vector<at::Tensor> v{x};
      backend->allreduce(v)->wait();
      out.copy_(x.narrow(0, state.rank() * (n / P), n / P));
    });
    double raw_ag = time([&] {
      std::vector<std::vector<at::Tensor>> o(1);
      for (int i = 0; i < P; ++i) o[0].push_back(at::empty({n / P}));
      std::vector<at::Tensor> in{out};
      backend->allgather(o, in)->wait();
    });
    double bytes = n * 4.0;
    if (state.is_main_process())
      fmt::print("{}\n", nlohmann::json{{"bytes", static_cast<int64_t>(bytes)},
                                        {"shared_memory", comm.uses_shared_memory()},
                                        {"all_reduce_gb_per_s", bytes / ar / 1e9},
                                        {"all_reduce_symmetric_gb_per_s", bytes / ar_sym / 1e9},
                                        {"reduce_scatter_symmetric_gb_per_s", bytes / rs_sym / 1e9},
                                        {"raw_gloo_all_reduce_gb_per_s", bytes / raw_ar / 1e9},
                                        {"reduce_scatter_gb_per_s", bytes / rs / 1e9},
                                        {"raw_gloo_reduce_scatter_gb_per_s", bytes / raw_rs / 1e9},
                                        {"all_gather_gb_per_s", bytes / ag / 1e9},
                                        {"raw_gloo_all_gather_gb_per_s", bytes / raw_ag / 1e9}}
                             .dump());
  }
  comm.barrier();
  return 0;
}

// What the flight recorder adds to one collective: an entry recorded and marked completed, as the
// communicator does, timed over many (no process group needed). XLR8_TRACE_BUFFER_SIZE=0 gives the floor.
int flight_recorder_cost(int64_t operations) {
  auto& recorder = xlr8::core::FlightRecorder::instance();
  const std::string description = "all_reduce(float32[1048576], SUM) on group 'world' (rank 0 of 2)";
  const auto began = std::chrono::steady_clock::now();
  for (int64_t i = 0; i < operations; ++i) recorder.completed(recorder.enqueued("world", static_cast<uint64_t>(i + 1), description), true);
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - began).count();
  fmt::print("{}\n", nlohmann::json{{"flight_recorder_ns_per_collective", seconds * 1e9 / static_cast<double>(operations)},
                                     {"capacity", recorder.capacity()}}.dump());
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"xlr8-bench"};
  Spec s;
  bool coll = false;
  double max_mb = 64;
  app.add_option("--model", s.model, "mlp | transformer");
  app.add_option("--batch", s.batch, "Batch per rank");
  app.add_option("--steps", s.steps, "Timed steps");
  app.add_option("--warmup", s.warmup, "Untimed steps first");
  app.add_option("--threads", s.threads, "Intra-op threads per rank");
  app.add_option("--impl", s.impl, "xlr8 | handwritten");
  app.add_option("--bucket_cap_mb", s.bucket_cap_mb, "DDP bucket size");
  app.add_flag("--compress_bf16", s.compress_bf16, "DDP: bf16 gradients on the wire");
  app.add_flag("--zero_in_place", s.zero_in_place, "xlr8: zero gradients in place instead of setting them to none");
  app.add_option("--optimizer", s.optimizer, "xlr8: adamw | fused_adamw | fused_adamw_torch_kernel")
      ->check(CLI::IsMember({"adamw", "fused_adamw", "fused_adamw_torch_kernel"}));
  app.add_flag("--lockstep_only", s.lockstep_only,
               "Diagnostic: no gradient all-reduce, only a barrier per step (what running in lockstep costs)");
  app.add_flag("--collectives", coll, "Collective bandwidth instead of training");
  app.add_option("--max_mb", max_mb, "Largest collective size in MB");
  int64_t recorder_ops = 0;
  app.add_option("--flight_recorder_ops", recorder_ops, "Time this many flight-recorder entries instead of training");
  CLI11_PARSE(app, argc, argv);
  try {
    if (recorder_ops > 0) return flight_recorder_cost(recorder_ops);
    if (coll) return collectives(max_mb);
    return s.impl == "handwritten" ? handwritten(s) : with_xlr8(s);
  } catch (const std::exception& e) {
    fmt::print(stderr, "xlr8-bench: error: {}\n", e.what());
    return 1;
  }
}
