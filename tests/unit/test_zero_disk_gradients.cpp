// Offload's disk tier with the gradients on disk too (ZeroOptions::Disk::gradients; gradients_on_disk.hpp): each
// reduced chunk goes to the optimizer's real swap file when it is reduced and comes back for the step. The same
// arithmetic as with the gradients in memory, so every run is compared bitwise with that one.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <algorithm>
#include <cmath>
#include <limits>

#include "parallel/grad_norm.hpp"
#include "zero_disk_fixture.hpp"
#include "zero_fixture.hpp"

using namespace xlr8;
using namespace xlr8::testing::zero;
using xlr8::testing::run_ranks;
namespace fs = std::filesystem;

namespace {

struct DiskLayout {
  int stage;
  bool params_on_disk, bf16;
  std::string name() const {
    return fmt::format("stage {}{}{}", stage, params_on_disk ? ", parameters on disk" : "", bf16 ? ", bf16" : "");
  }
};

ParallelOptions disk_gradient_options(const DiskLayout& layout, const fs::path& dir, bool pipelined, bool gradients) {
  auto o = on_disk(layout.stage, dir, pipelined, layout.params_on_disk);
  if (layout.bf16) o.zero.param_dtype = at::kBFloat16;
  o.zero.optimizer_on_disk.gradients = gradients;
  return o;
}

// This rank's leaves that hold elements: with the gradients on disk, none has a .grad between backward and step.
int64_t leaves_holding_gradients(ParallelStrategy& strategy) {
  int64_t n = 0;
  for (const auto& leaf : strategy.optimizer_parameters()) n += leaf.numel() > 0 && leaf.grad().defined();
  return n;
}

// In memory, what queue_on_disk_gradients does on disk: `op` on the .grad of each of `parameters` that has one.
void work_on_gradients_in_memory(ParallelStrategy& strategy, const std::vector<at::Tensor>& parameters,
                            const std::function<void(at::Tensor&)>& op) {
  at::NoGradGuard no_grad;
  for (const auto& holder : strategy.gradient_holders(parameters)) {
    auto& grad = holder.mutable_grad();
    if (!grad.defined()) continue;
    if (op) op(grad);
    else grad = at::Tensor();
  }
}

}  // namespace

// Stages 1-3 on 1, 2 and 3 ranks, and stage 3 with the parameters on disk (fp32, and bf16 over fp32 masters), with
// accumulation and clipping: bitwise the run with the gradients in memory, norms included, which are the ones taken
// as the chunks were written (nothing is read back for them). Between backward and step no leaf holds a gradient.
TEST(ZeroDiskGradients, EveryStageOnOneTwoAndThreeRanksEqualsTheGradientsInMemoryBitwise) {
  const auto dir = swap_dir("gradients");
  if (!direct_io_works(dir)) GTEST_SKIP() << dir << " has no O_DIRECT";
  for (const auto& layout : {DiskLayout{1, false, false}, DiskLayout{2, false, false}, DiskLayout{3, false, false},
                             DiskLayout{3, true, false}, DiskLayout{3, true, true}})
    for (int ranks : {1, 2, 3}) {
      std::vector<TrainRun> in_memory(ranks);
      run_ranks(ranks, [&](Communicator& comm) {
        auto strategy = make_parallel_strategy(make_model(), comm, disk_gradient_options(layout, dir, true, false));
        in_memory[comm.rank()] = train(*strategy, comm.rank(), ranks, 3, 2, 0.05, layout.bf16);
      });
      run_ranks(ranks, [&](Communicator& comm) {
        const auto what = fmt::format("{} on {} ranks, rank {}", layout.name(), ranks, comm.rank());
        auto strategy = make_parallel_strategy(make_model(), comm, disk_gradient_options(layout, dir, comm.rank() % 2 == 0, true));
        std::vector<int64_t> holding;
        auto got = train(*strategy, comm.rank(), ranks, 3, 2, 0.05, layout.bf16, [&](bool after) {
          if (!after) holding.push_back(leaves_holding_gradients(*strategy));
        });
        expect_same_run(got, in_memory[comm.rank()], 0.0, what);
        EXPECT_EQ(got.norms, in_memory[comm.rank()].norms) << what;  // bitwise
        EXPECT_EQ(holding, std::vector<int64_t>(3, 0)) << what;
        const auto disk = strategy->stats()["optimizer_on_disk"];
        ASSERT_TRUE(disk.is_object()) << what;
        EXPECT_TRUE(disk.value("gradients_on_disk", false)) << what;
        const int64_t groups = disk["swapped_groups"].get<int64_t>();
        EXPECT_GT(groups, 0) << what;
        EXPECT_EQ(disk["gradient_writes"].get<int64_t>(), 3 * groups) << what;
        EXPECT_EQ(disk["gradient_reads"].get<int64_t>(), 3 * groups) << what;
        EXPECT_EQ(disk["gradient_reads_for_norms"].get<int64_t>(), 0) << what;
      });
    }
  fs::remove_all(dir);
}

// Work on the gradients between backward and step, queued while they are on disk: halving every one (fp16's
// unscaling), clamping some (clip_grad_value), zeroing one in place and setting others to none (zero_grad), then a
// 3-norm clip (which reads them back: its norms are no longer the ones written). Bitwise the same work done in memory;
// a leaf set to none is not stepped. A NaN queued for one is found by the overflow check.
TEST(ZeroDiskGradients, WorkQueuedBeforeTheStepIsTheWorkDoneInMemory) {
  const auto dir = swap_dir("gradient_work");
  if (!direct_io_works(dir)) GTEST_SKIP() << dir << " has no O_DIRECT";
  const int ranks = 2;
  std::vector<TrainRun> in_memory(ranks);
  std::vector<std::vector<double>> memory_norms(ranks);
  // The work, given how to do it: on the .grad in memory, or queued for the gradients on disk.
  const auto work = [](ParallelStrategy& strategy, auto&& apply) {
    auto& net = dynamic_cast<TinyNetImpl&>(*strategy.module());
    apply(strategy.module()->parameters(), [](at::Tensor& g) { g.mul_(at::full({1}, 0.5f)); });
    apply(net.blocks[0]->parameters(), [](at::Tensor& g) { g.clamp_(-0.01, 0.01); });
    apply(std::vector<at::Tensor>{net.in->weight}, [](at::Tensor& g) { g.zero_(); });
    apply(net.head->parameters(), std::function<void(at::Tensor&)>());
    return strategy.clip_grad_norm(strategy.module()->parameters(), 0.02, 3.0).value();
  };
  const DiskLayout layout{3, true, false};
  run_ranks(ranks, [&](Communicator& comm) {
    auto strategy = make_parallel_strategy(make_model(), comm, disk_gradient_options(layout, dir, true, false));
    in_memory[comm.rank()] = train(*strategy, comm.rank(), ranks, 3, 2, 0.05, false, [&](bool after) {
      if (!after)
        memory_norms[comm.rank()].push_back(work(*strategy, [&](const auto& params, const auto& op) {
          work_on_gradients_in_memory(*strategy, params, op);
        }));
    });
  });
  run_ranks(ranks, [&](Communicator& comm) {
    const auto what = fmt::format("rank {}", comm.rank());
    auto strategy = make_parallel_strategy(make_model(), comm, disk_gradient_options(layout, dir, true, true));
    std::vector<double> norms;
    auto got = train(*strategy, comm.rank(), ranks, 3, 2, 0.05, false, [&](bool after) {
      if (after) return;
      EXPECT_FALSE(strategy->non_finite_gradients_on_disk(strategy->module()->parameters())) << what;
      norms.push_back(work(*strategy, [&](const auto& params, const auto& op) {
        EXPECT_TRUE(strategy->queue_on_disk_gradients(params, op)) << what;
      }));
    });
    expect_same_run(got, in_memory[comm.rank()], 0.0, what);
    EXPECT_EQ(norms, memory_norms[comm.rank()]) << what;
    const auto disk = strategy->stats()["optimizer_on_disk"];
    EXPECT_GT(disk["gradient_reads_for_norms"].get<int64_t>(), 0) << what;
    EXPECT_GT(disk["gradient_work_queued"].get<int64_t>(), 0) << what;
    // No gradient waits on disk after a step: nothing to queue work for.
    EXPECT_FALSE(strategy->queue_on_disk_gradients(strategy->module()->parameters(), [](at::Tensor& g) { g.zero_(); }));
  });
  // The overflow check sees an inf or NaN queued on disk (and only then).
  run_ranks(1, [&](Communicator& comm) {
    auto strategy = make_parallel_strategy(make_model(), comm, disk_gradient_options(layout, dir, true, true));
    train(*strategy, 0, 1, 1, 1, 0.0, false, [&](bool after) {
      if (after) return;
      const auto all = strategy->module()->parameters();
      EXPECT_FALSE(strategy->non_finite_gradients_on_disk(all));
      auto& net = dynamic_cast<TinyNetImpl&>(*strategy->module());
      strategy->queue_on_disk_gradients({net.head->bias}, [](at::Tensor& g) { g[0] = std::nanf(""); });
      EXPECT_TRUE(strategy->non_finite_gradients_on_disk(all));
      // Only the parameters asked about: the head's bias is not among the first block's.
      EXPECT_FALSE(strategy->non_finite_gradients_on_disk(net.blocks[0]->parameters()));
      EXPECT_TRUE(strategy->non_finite_gradients_on_disk({net.head->bias}));
    });
  });
  fs::remove_all(dir);
}

// A group's gradient on disk goes to one optimizer: a second live optimizer of the same parameters is refused (it would
// step with no gradients), naming the group and the ways out.
TEST(ZeroDiskGradients, ASecondLiveOptimizerOfTheSameParametersIsRefused) {
  const auto dir = swap_dir("gradient_optimizers");
  if (!direct_io_works(dir)) GTEST_SKIP() << dir << " has no O_DIRECT";
  run_ranks(1, [&](Communicator& comm) {
    auto strategy = make_parallel_strategy(make_model(), comm, disk_gradient_options({3, false, false}, dir, true, true));
    torch::optim::AdamW first(strategy->module()->parameters(), torch::optim::AdamWOptions(1e-2));
    strategy->bind_optimizer(first);
    torch::optim::AdamW second(strategy->module()->parameters(), torch::optim::AdamWOptions(1e-2));
    try {
      strategy->bind_optimizer(second);
      ADD_FAILURE() << "expected an error";
    } catch (const ConfigError& e) {
      EXPECT_NE(std::string(e.what()).find("XLR8_GRADIENTS_ON_DISK=1: parameters of sharding group "), std::string::npos)
          << e.what();
      EXPECT_NE(std::string(e.what()).find("put these parameters in one optimizer"), std::string::npos) << e.what();
    }
  });
  fs::remove_all(dir);
}

// On 3 ranks some leaves hold no elements of their parameter; they still get their empty gradient, as in memory, so the
// optimizer keeps the same state (its step count) for every leaf either way.
TEST(ZeroDiskGradients, LeavesWithNoElementsHereKeepTheirOptimizerStateAsInMemory) {
  const auto dir = swap_dir("gradient_empty_leaves");
  if (!direct_io_works(dir)) GTEST_SKIP() << dir << " has no O_DIRECT";
  const int ranks = 3;
  std::vector<std::vector<size_t>> states(2, std::vector<size_t>(ranks));
  std::vector<int64_t> empty_leaves(ranks);
  for (bool gradients : {false, true})
    run_ranks(ranks, [&](Communicator& comm) {
      auto strategy = make_parallel_strategy(make_model(), comm, disk_gradient_options({3, false, false}, dir, true, gradients));
      torch::optim::AdamW opt(strategy->module()->parameters(), torch::optim::AdamWOptions(1e-2));
      strategy->bind_optimizer(opt);
      auto& net = dynamic_cast<TinyNetImpl&>(*strategy->module());
      const auto batch = global_batch(0);
      const int64_t rows = 12 / ranks;
      strategy->begin_step(false);
      torch::nll_loss(torch::log_softmax(net.forward(batch.x.narrow(0, comm.rank() * rows, rows)), 1),
                      batch.y.narrow(0, comm.rank() * rows, rows))
          .backward();
      strategy->end_step();
      strategy->optimizer_step(opt);
      states[gradients][comm.rank()] = opt.state().size();
      empty_leaves[comm.rank()] = 0;
      for (const auto& leaf : strategy->optimizer_parameters()) empty_leaves[comm.rank()] += leaf.numel() == 0;
    });
  EXPECT_EQ(states[1], states[0]);
  EXPECT_GT(*std::max_element(empty_leaves.begin(), empty_leaves.end()), 0);  // the case is there
  fs::remove_all(dir);
}

// An optimizer over the blocks alone: their gradients go to its swap, the other trainable groups' stay in memory. A
// clip over the whole model sums both kinds in the parameters' order, as in memory: norms (2 and 3) and parameters
// bitwise those of the run with every gradient in memory.
TEST(ZeroDiskGradients, AClipOverGradientsPartlyOnDiskSumsThemInTheParametersOrder) {
  const auto dir = swap_dir("gradient_mixed");
  if (!direct_io_works(dir)) GTEST_SKIP() << dir << " has no O_DIRECT";
  const int ranks = 2;
  std::vector<std::vector<std::vector<double>>> norms(2, std::vector<std::vector<double>>(ranks));
  std::vector<std::vector<StateDict>> params(2, std::vector<StateDict>(ranks));
  for (bool gradients : {false, true})
    run_ranks(ranks, [&](Communicator& comm) {
      auto strategy = make_parallel_strategy(make_model(), comm, disk_gradient_options({3, false, false}, dir, true, gradients));
      auto& net = dynamic_cast<TinyNetImpl&>(*strategy->module());
      torch::optim::AdamW opt(net.blocks->parameters(), torch::optim::AdamWOptions(1e-2));
      strategy->bind_optimizer(opt);
      const int64_t rows = 12 / ranks;
      for (int s = 0; s < 3; ++s) {
        const auto batch = global_batch(s);
        strategy->begin_step(false);
        torch::nll_loss(torch::log_softmax(net.forward(batch.x.narrow(0, comm.rank() * rows, rows)), 1),
                        batch.y.narrow(0, comm.rank() * rows, rows))
            .backward();
        strategy->end_step();
        for (double p : {3.0, 2.0})
          norms[gradients][comm.rank()].push_back(strategy->clip_grad_norm(strategy->module()->parameters(), 0.05, p));
        strategy->optimizer_step(opt);
        for (auto& leaf : strategy->optimizer_parameters()) leaf.mutable_grad() = at::Tensor();
      }
      for (auto& [name, t] : strategy->state_dict(StateDictKind::FULL))
        params[gradients][comm.rank()].emplace_back(name, t.detach().clone());
      if (gradients) {
        EXPECT_GT(strategy->stats()["optimizer_on_disk"]["gradient_writes"].get<int64_t>(), 0);
      }
    });
  for (int r = 0; r < ranks; ++r) {
    EXPECT_EQ(norms[1][r], norms[0][r]) << "rank " << r;
    ASSERT_EQ(params[1][r].size(), params[0][r].size());
    for (size_t i = 0; i < params[0][r].size(); ++i)
      EXPECT_TRUE(at::equal(params[1][r][i].second, params[0][r][i].second)) << params[0][r][i].first;
  }
  fs::remove_all(dir);
}

// The interleaved sum against partial_norm over the same gradients all in memory, with norms whose grouping changes
// the double sum: 1e16 + 1 + 1 is 1e16 in that order, 1e16 + 2 when the two 1s are summed apart first.
TEST(ZeroDiskGradients, NormsTakenOnDiskSumInTheParametersOrderAsInMemory) {
  const auto big = at::full({1}, 1e8f), one = at::ones({1}), other_one = at::ones({1});
  const auto in_memory = parallel::partial_norm({big, one, other_one}, 2.0, at::kCPU);
  const auto big_norm = at::_foreach_norm({big}, 2.0);
  const auto interleaved =
      parallel::partial_norm_interleaved({one, other_one}, big_norm, {true, false, false}, 2.0, at::kCPU);
  EXPECT_EQ(interleaved.item<double>(), in_memory.item<double>());
  EXPECT_EQ(in_memory.item<double>(), 1e16);
  // The two sums apart (what the clip did before) round otherwise here.
  const auto apart = parallel::partial_norm({one, other_one}, 2.0, at::kCPU) +
                     parallel::partial_norm_of_norms(big_norm, 2.0, at::kCPU);
  EXPECT_NE(apart.item<double>(), in_memory.item<double>());
}
