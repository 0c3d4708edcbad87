#pragma once
// Training a small classifier under a ParallelStrategy, as the strategy tests do on ranks as threads: SGD
// steps on this rank's rows of a global batch, and the whole parameters compared afterwards.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <string>

#include "xlr8/parallel_strategy.hpp"

namespace xlr8::testing {

// A Linear whose weight is `tied` (another layer's): LibTorch has no unregister_parameter, and a subclass reaches the
// parameter table.
struct TiedLinearImpl : torch::nn::LinearImpl {
  explicit TiedLinearImpl(const at::Tensor& tied) : LinearImpl(tied.size(1), tied.size(0)) {
    weight = parameters_["weight"] = tied;
  }
};
inline torch::nn::Linear tied_linear(const at::Tensor& weight) {
  return torch::nn::Linear(std::shared_ptr<torch::nn::LinearImpl>(std::make_shared<TiedLinearImpl>(weight)));
}

// SGD steps of a `Net` (4 inputs, 3 classes; its forward takes the batch) on this rank's rows of a global
// batch of 12 drawn from generators seeded `seed + step`; the whole parameters afterwards.
template <class Net>
StateDict train_steps(ParallelStrategy& strategy, int rank, int ranks, int steps, uint64_t seed) {
  // Plain SGD: Adam turns the rounding noise of near-zero gradients into whole steps.
  torch::optim::SGD opt(strategy.module()->parameters(), torch::optim::SGDOptions(0.1).momentum(0.9));
  strategy.bind_optimizer(opt);
  auto& net = dynamic_cast<Net&>(*strategy.module());
  for (int s = 0; s < steps; ++s) {
    auto gen = at::detail::createCPUGenerator(seed + static_cast<uint64_t>(s));
    auto x = at::randn({12, 4}, gen), y = at::randint(0, 3, {12}, gen);
    const int64_t rows = 12 / ranks;
    strategy.begin_step(false);
    torch::nll_loss(torch::log_softmax(net.forward(x.narrow(0, rank * rows, rows)), 1), y.narrow(0, rank * rows, rows))
        .backward();
    strategy.end_step();
    strategy.optimizer_step(opt);
    for (auto& group : opt.param_groups())
      for (auto& p : group.params()) p.mutable_grad() = at::Tensor();
  }
  StateDict out;
  for (auto& [name, t] : strategy.state_dict(StateDictKind::FULL)) out.emplace_back(name, t.detach().clone());
  return out;
}

inline void expect_same(const StateDict& got, const StateDict& expected, const std::string& what) {
  ASSERT_EQ(got.size(), expected.size()) << what;
  for (size_t i = 0; i < got.size(); ++i)
    EXPECT_LE((got[i].second - expected[i].second).abs().max().item<double>(), 2e-6) << what << " " << got[i].first;
}

}  // namespace xlr8::testing
