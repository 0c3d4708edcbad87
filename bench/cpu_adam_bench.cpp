// Issue 47 item 1's measurement: an optimizer step of AdamW over `millions` M fp32 parameters on this CPU (what CPU
// offload steps every iteration), three ways in one invocation, alternating over rounds, medians: LibTorch's AdamW
// (the C++ API's one mode: a loop of ops per tensor; the C++ API has no foreach mode), xlr8::optim::FusedAdamW (one
// pass over each tensor, vectorised), and LibTorch 2.x's own fused CPU kernel (_fused_adamw_, through FusedAdamW).
//   build/bin/xlr8-cpu-adam-bench --millions 100 --threads 1,2 --rounds 3 --steps 3
#include <CLI/CLI.hpp>
#include <fmt/format.h>
#include <fmt/ranges.h>
#include <torch/torch.h>

#include <algorithm>
#include <chrono>
#include <map>

#include "optim/fused_adam_testing.hpp"
#include "xlr8/fused_adam.hpp"

namespace {

using Clock = std::chrono::steady_clock;

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v.empty() ? 0 : v[v.size() / 2];
}

// Seconds per step of `kind` over fresh parameters (1 M elements a tensor) with fixed gradients.
double seconds_per_step(const std::string& kind, int64_t millions, int steps) {
  torch::manual_seed(0);
  std::vector<at::Tensor> params;
  for (int64_t i = 0; i < millions; ++i) {
    auto p = torch::randn({1000, 1000}).requires_grad_(true);
    p.mutable_grad() = torch::randn({1000, 1000}) * 1e-3;
    params.push_back(p);
  }
  const auto options = torch::optim::AdamWOptions(1e-4).weight_decay(0.01);
  xlr8::optim::detail::use_torch_kernel_on_cpu(kind == "LibTorch fused kernel");
  std::unique_ptr<torch::optim::Optimizer> opt;
  if (kind == "LibTorch AdamW") opt = std::make_unique<torch::optim::AdamW>(params, options);
  else opt = std::make_unique<xlr8::optim::FusedAdamW>(params, options);
  opt->step();  // the first step allocates the moments: not timed
  const auto start = Clock::now();
  for (int s = 0; s < steps; ++s) opt->step();
  xlr8::optim::detail::use_torch_kernel_on_cpu(false);
  return std::chrono::duration<double>(Clock::now() - start).count() / steps;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"AdamW's step on the CPU: LibTorch's, xlr8's fused, LibTorch's fused kernel"};
  int64_t millions = 100;
  std::vector<int> threads{1, 2};
  int rounds = 3, steps = 3;
  app.add_option("--millions", millions, "Parameters, millions (fp32)");
  app.add_option("--threads", threads, "Intra-op thread counts")->delimiter(',');
  app.add_option("--rounds", rounds);
  app.add_option("--steps", steps, "Timed steps a run");
  CLI11_PARSE(app, argc, argv);
  const std::vector<std::string> kinds{"LibTorch AdamW", "xlr8 FusedAdamW", "LibTorch fused kernel"};
  std::map<std::pair<int, std::string>, std::vector<double>> runs;
  for (int r = 0; r < rounds; ++r)
    for (int t : threads) {
      at::set_num_threads(t);
      for (const auto& k : kinds) runs[{t, k}].push_back(seconds_per_step(k, millions, steps));
    }
  for (int t : threads) {
    const double base = median(runs[{t, kinds[0]}]);
    for (const auto& k : kinds) {
      const double m = median(runs[{t, k}]);
      fmt::print("{} thread(s)  {:<22} {:8.1f} ms/step  {:5.2f}x LibTorch AdamW  {:6.2f} G params/s  (runs {:.3f})\n",
                 t, k, m * 1e3, base / m, static_cast<double>(millions) * 1e6 / m / 1e9, fmt::join(runs[{t, k}], ", "));
    }
  }
}
