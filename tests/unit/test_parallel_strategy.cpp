// The strategy seam, in one process: ranks are threads over Communicator::in_process, so every
// strategy can be checked against the oracle (N ranks on batch b == one rank on batch N*b) without the
// launcher. Next strategies add themselves to the same tests.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <mutex>

#include "strategy_steps.hpp"
#include "thread_ranks.hpp"
#include "xlr8/error.hpp"
#include "xlr8/parallel_strategy.hpp"

using namespace xlr8;
using xlr8::testing::run_ranks;

namespace {

std::shared_ptr<torch::nn::Module> make_model() {
  // Ranks are threads sharing LibTorch's default generator: seed and draw under one lock.
  static std::mutex mutex;
  std::lock_guard<std::mutex> lock(mutex);
  torch::manual_seed(7);
  return torch::nn::Sequential(torch::nn::Linear(6, 16), torch::nn::Tanh(), torch::nn::Linear(16, 3)).ptr();
}

at::Tensor forward(torch::nn::Module& m, const at::Tensor& x) {
  return dynamic_cast<torch::nn::SequentialImpl&>(m).forward(x);
}

struct Batch {
  at::Tensor x, y;
};

Batch global_batch(int64_t rows) {
  auto gen = at::detail::createCPUGenerator(99);
  return {at::randn({rows, 6}, gen), at::randint(0, 3, {rows}, gen)};
}

// Trains `steps` SGD steps on rank `rank`'s rows of the global batch; returns the final parameters.
std::vector<at::Tensor> train(ParallelStrategy& strategy, int rank, int ranks, int steps, bool sync = true) {
  auto batch = global_batch(12);
  int64_t rows = 12 / ranks;
  auto x = batch.x.narrow(0, rank * rows, rows), y = batch.y.narrow(0, rank * rows, rows);
  torch::optim::SGD opt(strategy.optimizer_parameters(), 0.5);
  for (int i = 0; i < steps; ++i) {
    strategy.begin_step(/*suspend_sync=*/!sync);
    // As the prepared optimizer does: DDP's gradients are views of its buckets, which LibTorch's own
    // zero_grad() would try to detach_() in place.
    for (auto& p : strategy.module()->parameters()) p.mutable_grad() = at::Tensor();
    torch::nll_loss(torch::log_softmax(forward(*strategy.module(), x), 1), y).backward();
    strategy.optimizer_step(opt);
    strategy.end_step();
  }
  std::vector<at::Tensor> out;
  for (auto& p : strategy.module()->parameters()) out.push_back(p.detach().clone());
  return out;
}

}  // namespace

TEST(ParallelStrategy, FactoryPicksSingleForOneRankAndDdpForSeveral) {
  auto single = make_parallel_strategy(make_model(), Communicator::in_process("factory1", 0, 1), {});
  EXPECT_EQ(single->name(), "single");
  EXPECT_EQ(single->stats()["strategy"], "single");
  run_ranks(2, [](Communicator& comm) {
    auto s = make_parallel_strategy(make_model(), comm, {});
    EXPECT_EQ(s->name(), "ddp");
    auto stats = s->stats();
    EXPECT_EQ(stats["strategy"], "ddp");
    EXPECT_TRUE(stats.contains("exposed_comm_seconds"));
  });
  EXPECT_THROW(make_parallel_strategy(nullptr, Communicator::in_process("factory3", 0, 1), {}), Error);
}

TEST(ParallelStrategy, EveryStrategyOnNRanksMatchesOneRankOnTheGlobalBatch) {
  auto single = make_parallel_strategy(make_model(), Communicator::in_process("oracle1", 0, 1), {});
  auto expected = train(*single, 0, 1, 5);
  for (int ranks : {2, 3, 4}) {
    ParallelOptions options;
    options.ddp.first_bucket_mb = 0.0001;  // several buckets, uneven over 3 ranks
    options.ddp.bucket_cap_mb = 0.0002;
    run_ranks(ranks, [&](Communicator& comm) {
      const int r = comm.rank();
      auto strategy = make_parallel_strategy(make_model(), comm, options);
      auto got = train(*strategy, r, ranks, 5);
      ASSERT_EQ(got.size(), expected.size());
      for (size_t i = 0; i < got.size(); ++i)
        EXPECT_LE((got[i] - expected[i]).abs().max().item<double>(), 1e-6) << ranks << " ranks, rank " << r;
    });
  }
}

TEST(ParallelStrategy, OffTheBoundaryOrUnderNoSyncGradientsStayLocal) {
  // The oracle can fail: without synchronisation each rank follows its own rows and the ranks drift apart,
  // whether the GradientState says this is no boundary or no_sync() suspends the model.
  auto off_boundary = std::make_shared<GradientState>();
  off_boundary->sync_gradients = false;
  for (bool suspend : {true, false}) {
    std::vector<at::Tensor> first(2);
    run_ranks(2, [&](Communicator& comm) {
      auto strategy = make_parallel_strategy(make_model(), comm, {}, suspend ? nullptr : off_boundary);
      first[comm.rank()] = train(*strategy, comm.rank(), 2, 3, /*sync=*/!suspend).front();
    });
    EXPECT_GT((first[0] - first[1]).abs().max().item<double>(), 1e-4) << (suspend ? "no_sync" : "off the boundary");
  }
}

TEST(ParallelStrategy, StateDictRoundTripAndClearErrors) {
  auto a = make_parallel_strategy(make_model(), Communicator::in_process("sd1", 0, 1), {});
  auto state = a->state_dict(StateDictKind::FULL);
  ASSERT_EQ(state.size(), 4u);  // two Linear layers: weight and bias each
  for (auto& [name, t] : state) t = t.detach().clone().fill_(0.25);
  a->load_state_dict(state, StateDictKind::FULL);
  for (auto& p : a->module()->parameters()) EXPECT_TRUE(at::all(p == 0.25).item<bool>());
  StateDict wrong{{"0.weight", at::zeros({2, 2})}};
  try {
    a->load_state_dict(wrong, StateDictKind::FULL);
    FAIL();
  } catch (const ConfigError& e) {
    EXPECT_NE(std::string(e.what()).find("\"0.weight\" is Float[16, 6] in the model but Float[2, 2]"), std::string::npos)
        << e.what();
    EXPECT_NE(std::string(e.what()).find("missing \"2.bias\""), std::string::npos) << e.what();
  }
  EXPECT_THROW(a->load_state_dict({{"nope", at::zeros({1})}}, StateDictKind::FULL), ConfigError);
}

TEST(ParallelStrategy, ClipGradNormOfReplicasIsTorchsNorm) {
  auto s = make_parallel_strategy(make_model(), Communicator::in_process("clip", 0, 1), {});
  auto batch = global_batch(12);
  torch::nll_loss(torch::log_softmax(forward(*s->module(), batch.x), 1), batch.y).backward();
  double total = 0;
  for (auto& p : s->module()->parameters()) total += p.grad().pow(2).sum().item<double>();
  double norm = s->clip_grad_norm(s->module()->parameters(), 1e-3, 2.0);
  EXPECT_NEAR(norm, std::sqrt(total), 1e-6);
  double clipped = 0;
  for (auto& p : s->module()->parameters()) clipped += p.grad().pow(2).sum().item<double>();
  EXPECT_NEAR(std::sqrt(clipped), 1e-3, 1e-6);
}

// LibTorch's parameters() lists a tied weight under each of its names; PyTorch's lists it once. The norm
// counts it once and clipping scales it once, as the sharded strategies' clipping does.
TEST(ParallelStrategy, ClipGradNormCountsATiedWeightOnceAndScalesItOnce) {
  torch::manual_seed(3);
  torch::nn::Linear first(4, 4);
  auto second = xlr8::testing::tied_linear(first->weight);
  auto model = torch::nn::Sequential(first, torch::nn::Tanh(), second).ptr();
  ASSERT_EQ(model->parameters().size(), 4u);  // the tied weight twice
  auto s = make_parallel_strategy(model, Communicator::in_process("tied", 0, 1), {});
  forward(*s->module(), at::randn({5, 4})).pow(2).sum().backward();
  auto unique_norm = [&] {
    return std::sqrt(first->weight.grad().pow(2).sum().item<double>() + first->bias.grad().pow(2).sum().item<double>() +
                     second->bias.grad().pow(2).sum().item<double>());
  };
  const double before = unique_norm();
  EXPECT_NEAR(s->clip_grad_norm(s->module()->parameters(), 1e-3, 2.0), before, 1e-6 * before);
  EXPECT_NEAR(unique_norm(), 1e-3, 1e-9);  // scaled twice it would be about 1e-3 times the coefficient
}
